#!/usr/bin/env bash
# The quickstart RL run (configs/quickstart.yaml: general domain, high effort) as a Ray job.
#   recipes/quickstart.sh [key=value ...]        e.g. model.init_from=$PWD/runs/sft-tiny rollout.lam=0.7
# Writes runs/quickstart/ (or RLK3_OUTPUT_DIR): metrics.jsonl, tensorboard/, checkpoints/iter-NNNNNN/ (the last two), final/.
# Metrics (one JSON line per iteration; docs/rl.md, "Metrics", explains each): iteration, stage, run, domain, effort,
# reward/mean, pass_rate, tokens/mean, over_budget_rate, budget, samples, trained, failed, grader_errors,
# staleness/max, rollout/{launched,resumed,fresh,finished,finished_before_pause,paused,restarted_stale,
# groups_trained,buffered,restarts,overlapped}, train/{loss,tokens,kept_tokens,clip_frac,ppo_kl,entropy,grad_norm,
# updates,lr,sequences,version,is_weight_mean,is_weight_max,is_masked_frac,stale_frac,staleness_max,qb_bias_absmax,
# dead_steps} (+ kl_ref with train.kl_coef > 0), time/{rollout_s,train_s,sync_s,iteration_s,overlap_wait_s}, version,
# and every run.eval_every iterations eval/<domain>/<effort>/{pass_rate,mean_tokens,over_budget_rate}.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RLK3_OUTPUT_DIR="${RLK3_OUTPUT_DIR:-$ROOT/runs/quickstart}" exec "$ROOT/recipes/submit.sh" rl configs/quickstart.yaml "$@"
