#!/usr/bin/env bash
# The nine effort-budget teachers as ONE Ray job with nine RL stages (python -m rlk3 teachers): per domain the
# high-effort teacher trains from the SFT checkpoint at the maximum budget, then medium and low continue from it
# while their budgets anneal down. One job, because medium/low depend on high's final weights and the stages share
# one Ray session and sandbox service; each teacher still gets its own directory, checkpoints and manifest.
# teachers.parallel of them train at once, each in its own placement group (0, the default: as many as the cluster's
# resources hold); a domain's medium and low start as soon as its high is done.
#   recipes/teachers.sh model.init_from=$PWD/runs/sft-tiny [key=value ...]
# Writes runs/teachers/teacher-<domain>-<effort>/{metrics.jsonl,checkpoints,final/manifest.json} and
# runs/teachers/teachers.json ("domain/effort" -> checkpoint). Metrics per teacher: as recipes/quickstart.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RLK3_OUTPUT_DIR="${RLK3_OUTPUT_DIR:-$ROOT/runs/teachers}" exec "$ROOT/recipes/submit.sh" teachers configs/teachers.yaml "$@"
