#!/usr/bin/env bash
# The quickstart RL run (configs/quickstart.yaml: general domain, high effort) as a Ray job.
#   recipes/quickstart.sh [key=value ...]        e.g. model.init_from=$PWD/runs/sft-tiny rollout.lam=0.7
# Writes runs/quickstart/ (or RLK3_OUTPUT_DIR): metrics.jsonl, tensorboard/, checkpoints/iter-N/, final/.
# Metrics (one JSON line per iteration; docs/rl.md explains each): reward/mean, pass_rate, tokens/mean,
# over_budget_rate, budget, samples, trained, failed, staleness/max, rollout/{launched,resumed,fresh,finished,
# finished_before_pause,paused,restarted_stale,groups_trained,buffered,restarts}, train/{loss,tokens,clip_frac,
# is_weight_mean,is_weight_max,is_masked_frac,stale_frac,entropy,grad_norm,qb_bias_absmax,dead_steps,version},
# time/{rollout_s,train_s,sync_s}, version.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RLK3_OUTPUT_DIR="${RLK3_OUTPUT_DIR:-$ROOT/runs/quickstart}" exec "$ROOT/recipes/submit.sh" rl configs/quickstart.yaml "$@"
