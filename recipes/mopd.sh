#!/usr/bin/env bash
# Distil the nine teachers into one student (python -m rlk3 mopd) as a Ray job:
#   recipes/mopd.sh model.init_from=$PWD/runs/sft-tiny "mopd.teachers=$(cat runs/teachers/teachers.json)"
# Metrics: as recipes/quickstart.sh plus kl/<domain>/<effort> (student-vs-teacher KL estimate per teacher),
# mopd/trajectories/<domain>/<effort>, mopd/teacher_loads.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RLK3_OUTPUT_DIR="${RLK3_OUTPUT_DIR:-$ROOT/runs/student}" exec "$ROOT/recipes/submit.sh" mopd configs/mopd.yaml "$@"
