#!/usr/bin/env bash
# Submit the quickstart RL run (configs/quickstart.yaml) with `ray job submit`.
#
#   recipes/quickstart.sh [key=value ...]          e.g. model.init_from=runs/sft-tiny rollout.lam=0.7
#
# RAY_ADDRESS set: submits to that cluster's job server (e.g. http://head:8265). Unset: starts (or reuses) a local
# head with token auth off and usage stats off, and submits there. The job writes runs/quickstart/ (override with
# run.output_dir=...): metrics.jsonl (one line per iteration: reward/mean, pass_rate, tokens/mean, over_budget_rate,
# budget, samples, trained, rollout/paused, staleness/max, train/loss, train/entropy, train/clip_frac,
# train/is_weight_mean, train/grad_norm, time/rollout_s, time/train_s, time/sync_s; docs/rl.md lists them all),
# tensorboard/ when tensorboard is installed, checkpoints/iter-N/, and final/ (the HF checkpoint + manifest.json).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
RAY="$(dirname "$PY")/ray"
export RAY_AUTH_MODE=disabled
if [ -z "${RAY_ADDRESS:-}" ]; then
  PORT="${RAY_DASHBOARD_PORT:-8265}"
  if ! "$RAY" status >/dev/null 2>&1; then
    "$RAY" start --head --disable-usage-stats --include-dashboard=true --dashboard-port="$PORT" \
      --num-cpus="${RAY_NUM_CPUS:-2}" >/dev/null
  fi
  export RAY_ADDRESS="http://127.0.0.1:$PORT"
fi
OUT="${RLK3_OUTPUT_DIR:-$ROOT/runs/quickstart}"
exec "$RAY" job submit --address "$RAY_ADDRESS" \
  --runtime-env-json "{\"working_dir\": \"$ROOT\", \"excludes\": [\".venv\", \".cache\", \".git\", \"runs\", \"bench/results\", \"node_modules\"], \"env_vars\": {\"RAY_AUTH_MODE\": \"disabled\"}}" \
  -- "$PY" -m rlk3 rl configs/quickstart.yaml "run.output_dir=$OUT" "$@"
