#!/usr/bin/env bash
# Every GPU check of issue 11, for one call of a lent GPU machine. Logs and CSVs go to $OUT.
#   benchmarks/gpu/run_all.sh [env] [nccl2] [tests] [memory] [seed] [offload]
# With carried wheels in .whl/ (hjson, pydantic: not on that machine) they are installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-output/gpu}
mkdir -p "$OUT" output
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
parts=${*:-env nccl2 tests memory}
for part in $parts; do
  echo "=== $part $(date +%T)"
  case $part in
    env)
      { nvidia-smi; python3 -c "import torch, transformers, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt" ;;
    nccl2)
      # Can two nccl ranks share one GPU? (The launcher refuses more ranks than GPUs.)
      timeout 90 python3 benchmarks/gpu/nccl_shared_gpu.py 2>&1 | grep -E "rank|Error|NCCL|Duplicate" | tail -12 | tee -a "$OUT/env.txt"
      echo "nccl2 exit ${PIPESTATUS[0]}" | tee -a "$OUT/env.txt" ;;
    tests)
      timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/integration/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40 ;;
    memory)
      # The three presets at once: allocator peaks are per process, so sharing the GPU leaves them exact.
      rm -f "$OUT/gpu_memory_model.csv"
      for preset in gpt2 gpt2-medium gpt2-large; do
        timeout 500 python3 benchmarks/gpu/memory_error.py --preset $preset --micro 1 4 8 --csv "$OUT/gpu_memory_model_$preset.csv" > "output/mem_$preset.log" 2>&1 &
      done
      wait
      tail -n 80 output/mem_*.log > "$OUT/memory_logs.txt"
      cat "$OUT"/gpu_memory_model_*.csv ;;
    seed)
      timeout 560 python3 benchmarks/gpu/seed_table.py --preset ${SEED_PRESET:-gpt2-large} --out_dir "$OUT" 2>&1 | tee "$OUT/seed.log" | tail -30 ;;
    offload)
      timeout 300 python3 benchmarks/gpu/offload_demo.py --out_dir "$OUT" 2>&1 | tail -40 ;;
  esac
done
