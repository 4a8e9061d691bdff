#!/usr/bin/env bash
# The GPU checks, for one call of a lent GPU machine. Logs and CSVs go to $OUT (at most 8 files come back).
#   benchmarks/gpu/run_all.sh [env] [nccl2] [tests | tests_engine tests_deepspeed] [vs_deepspeed] [seed] [offload] [transfer] [memory_far]
# With carried wheels in .whl/ (hjson, pydantic, and DeepSpeed built with DS_BUILD_OPS=0: not on
# that machine) they are installed first; their console scripts (deepspeed) go on PATH.
# tests_engine / tests_deepspeed read TESTS_IDS and TESTS_TIMEOUT_S.
# vs_deepspeed reads VS_PRESET, VS_TUNERS, VS_CAPS_S, VS_DEADLINE_S, VS_STAGES (say 1: a space DeepSpeed's
# autotuner finishes inside one call) and VS_RESUME.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-output/gpu}
mkdir -p "$OUT" output
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
parts=${*:-env tests}
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
      timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/integration 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40 ;;
    tests_engine|tests_deepspeed)
      # The suite in two calls: our engine's tests, then DeepSpeed's engine's (the whole suite outran one 480 s cap).
      # TESTS_IDS (test names of that file, space-separated) runs only those, in that order: what a short call has room for first.
      file=tests/integration/test_gpu.py; [ "$part" = tests_deepspeed ] && file=tests/integration/test_gpu_deepspeed.py
      targets=("$file"); [ -n "${TESTS_IDS:-}" ] && { targets=(); set -f; for t in $TESTS_IDS; do targets+=("$file::$t"); done; set +f; }
      timeout ${TESTS_TIMEOUT_S:-540} python3 -m pytest -m gpu -rA -v -p no:cacheprovider -s --durations=0 "${targets[@]}" 2>&1 \
        | tee -a "$OUT/pytest_$part.log" | tail -40 ;;
    vs_deepspeed)
      # DeepSpeed's autotuner against ours, gpt2-medium on DeepSpeed's engine (docs/gpu.md).
      timeout 570 python3 benchmarks/gpu/vs_deepspeed_gpu.py --preset ${VS_PRESET:-gpt2-medium} --out_dir "$OUT" \
        --tuners ${VS_TUNERS:-predictive,deepspeed} --caps_s ${VS_CAPS_S:-150,330} --deadline_s ${VS_DEADLINE_S:-545} \
        --stages ${VS_STAGES:-0,1,2,3} ${VS_RESUME:+--resume} 2>&1 | tee "$OUT/gpu_vs_deepspeed.log" | tail -30 ;;
    seed)
      timeout 570 python3 benchmarks/gpu/seed_table.py --preset ${SEED_PRESET:-gpt2-large} --out_dir "$OUT" \
        --deadline_s ${SEED_DEADLINE_S:-545} 2>&1 | tee "$OUT/seed.log" | tail -30 ;;
    offload)
      timeout 300 python3 benchmarks/gpu/offload_demo.py --out_dir "$OUT" 2>&1 | tail -40 ;;
    transfer)
      # Transfer across sizes (issue 33's GPU run): gpt2 cold, then medium and large with the history and cold.
      timeout ${TRANSFER_TIMEOUT_S:-570} python3 benchmarks/transfer.py --models ${TRANSFER_MODELS:-gpt2,gpt2-medium,gpt2-large} \
        --nproc 1 --precision bf16 --seq_len 1024 --out_dir "$OUT" --csv gpu_transfer.csv 2>&1 | tee "$OUT/gpu_transfer.log" | tail -30 ;;
    memory_far)
      # Memory far from the profile (issue 49, 4.2): tunes with micro-batches up to 1024, then a measured sweep by phase.
      timeout ${MEMORY_TIMEOUT_S:-540} python3 benchmarks/gpu/memory_far.py --out_dir "$OUT" --deadline_s ${MEMORY_DEADLINE_S:-500} \
        --tune ${MEMORY_TUNES-gpt2-medium:256 gpt2-large:256} --sweep ${MEMORY_SWEEPS-gpt2-medium:256:0,3} 2>&1 \
        | tee "$OUT/memory_far.log" | tail -30 ;;
  esac
done
