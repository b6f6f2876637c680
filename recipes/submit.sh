#!/usr/bin/env bash
# recipes/submit.sh <stage> <config.yaml> [key=value ...]: `ray job submit` one rlk3 stage.
# RAY_ADDRESS set: that cluster's job server (http://head:8265). Unset: a local head is started (or reused) with
# token auth and usage stats off. RLK3_OUTPUT_DIR (optional) sets run.output_dir to an absolute path (not for eval,
# which writes beside its manifest). RLK3_ENTRYPOINT_GPUS (optional) reserves GPUs for the entrypoint itself
# (`--entrypoint-num-gpus`): eval runs its models in the entrypoint, so on a cluster whose head has no GPU, set it to 1
# and the job runs on a node with one. The other stages need none there: their workers are Ray actors.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
RAY="$(dirname "$PY")/ray"
STAGE="$1"; CONFIG="$2"; shift 2
export RAY_AUTH_MODE=disabled
if [ -z "${RAY_ADDRESS:-}" ]; then
  PORT="${RAY_DASHBOARD_PORT:-8265}"
  if ! "$RAY" status >/dev/null 2>&1; then
    "$RAY" start --head --disable-usage-stats --include-dashboard=true --dashboard-port="$PORT" \
      --num-cpus="${RAY_NUM_CPUS:-2}" >/dev/null
  fi
  export RAY_ADDRESS="http://127.0.0.1:$PORT"
fi
EXTRA=()
if [ -n "${RLK3_OUTPUT_DIR:-}" ] && [ "$STAGE" != eval ]; then EXTRA+=("run.output_dir=$RLK3_OUTPUT_DIR"); fi
SUBMIT=()
if [ -n "${RLK3_ENTRYPOINT_GPUS:-}" ]; then SUBMIT+=(--entrypoint-num-gpus "$RLK3_ENTRYPOINT_GPUS"); fi
exec "$RAY" job submit --address "$RAY_ADDRESS" ${SUBMIT[@]+"${SUBMIT[@]}"} \
  --runtime-env-json "{\"working_dir\": \"$ROOT\", \"excludes\": [\".venv\", \".cache\", \".git\", \"runs\", \"bench/results\", \"node_modules\"], \"env_vars\": {\"RAY_AUTH_MODE\": \"disabled\"}}" \
  -- "$PY" -m rlk3 "$STAGE" "$CONFIG" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
