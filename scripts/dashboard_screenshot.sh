#!/usr/bin/env bash
# The README's dashboard screenshot, from real runs: the GPT-2 example tuned at 2 blocks, then at
# 4 (which transfers from the first), into one history; `launcher --history` lists both; then
# optuna-dashboard serves the history on localhost and headless Chromium (Debian's `chromium`
# package) takes the second study's page. Needs the venv with the history extra.
#   scripts/dashboard_screenshot.sh [OUT_DIR]   (default: a new temporary directory)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$(mktemp -d)}"
port=8089
cd "$out"
for layers in 2 4; do
  launcher --autotuning tune --nproc_per_node 2 "$root/examples/hf_gpt2/train.py" --model_size tiny \
    --n_layer "$layers" --max_steps 200 --output_dir output/gpt2 --deepspeed "$root/examples/hf_gpt2/ds_config.json" \
    > "tune_$layers.log" 2>&1
done
url="sqlite:///$out/autotuning_results/history.db"
launcher --history "$url" | tee history_table.txt
timeout 120 optuna-dashboard --host 127.0.0.1 --port "$port" "$url" > dashboard.log 2>&1 &
dashboard=$!
trap 'kill "$dashboard" 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -fs -o /dev/null "http://127.0.0.1:$port/dashboard" && break; sleep 0.2; done
timeout 60 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --user-data-dir="$out/chrome" \
  --hide-scrollbars --window-size=1400,1000 --virtual-time-budget=15000 \
  --screenshot="$out/optuna_dashboard.png" "http://127.0.0.1:$port/dashboard/studies/2" > /dev/null 2>&1
echo "screenshot: $out/optuna_dashboard.png"
