#!/usr/bin/env bash
# Evaluate every model of a manifest on every (domain, effort) held-out slice and write eval.json + report/:
#   recipes/eval.sh runs/demo/manifest.json [n=40] [device=auto|cpu|cuda]
# The job runs in a copy of the repository without runs/, so the manifest is passed as an absolute path: on a remote
# cluster it (and the checkpoints it names) must be on storage the job's node sees. RLK3_ENTRYPOINT_GPUS=1 runs the
# job on a node with a GPU (recipes/submit.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ]; then echo "usage: recipes/eval.sh <manifest.json> [n=40] [device=auto|cpu|cuda]" >&2; exit 2; fi
MANIFEST="$(realpath -m "$1")"; shift
exec "$ROOT/recipes/submit.sh" eval "$MANIFEST" "$@"
