"""How many agent conversations the prefix cache keeps under memory pressure: superseded KDA checkpoints dropped
first (``EngineConfig.drop_superseded_checkpoints``, the default) against plain LRU over whole entries.

An agentic rollout batch: ``--convs`` conversations advance turn by turn together (one ``generate`` call per turn,
the batch of every conversation's next turn); each turn re-sends the conversation so far, with the model's reply,
plus ``--turn`` new tokens (a tool's output), and generates ``--gen`` tokens. With ``--system`` every conversation
opens with the same system prompt, and with ``--steps`` several RL steps each start fresh conversations (so the
system prompt's checkpoint is worth keeping across them). The pool is sized so that the cache cannot hold every
conversation's blocks and checkpoints (``--budget``: fractions of what an unbounded run's cache holds at its end).

A KDA checkpoint is a whole KDA state slot: in ``k3-small`` 4,608 tokens' worth of MLA latents, in ``k3-full``
17,664 (``PoolLayout``: slot bytes / MLA bytes per token). Each re-sent turn leaves a checkpoint at a block
boundary inside it (the interval's, and the turn end's last boundary) and two tails; the next turn's checkpoint
supersedes it (and each turn resumes from the latest tail), but each lookup that matches the conversation touches
its block, so plain LRU keeps it as long as the conversation. The defaults here mirror k3-small's proportions on
``k3-tiny`` (a slot is 384 tokens of its latents; blocks of 64 tokens, a checkpoint every 128: a slot costs three
intervals of latents, k3-small's at 2,048 costs 2.25).

    python bench/prefix_capacity.py [--convs 16] [--turns 8] [--turn 192] [--gen 8] [--budget 0.6,0.4,0.25]
    python bench/prefix_capacity.py --system 1024 --steps 2 --convs 8 --turns 6 --out prefix-capacity-system

Prints a table (prefill tokens, time, hits, what was evicted) and writes bench/results/prefix-capacity.json. The
prefill-token counts do not depend on the machine; the CPU seconds are one thread's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _common import print_table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine import prompts as random_prompts
from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.model import K3Config, K3ForCausalLM


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return random_prompts(1, n, vocab, seed)[0]


def rollout(model, cfg: EngineConfig, args) -> dict:
    """The conversations' turns through one engine; the prefix cache's and the engine's counters at the end."""
    engine = RolloutEngine(model, cfg)
    vocab = model.config.vocab_size
    system = tokens(args.system, seed=2**31 - 1, vocab=vocab)  # apart from every turn's seed
    sampling = SamplingParams(max_tokens=args.gen, temperature=0)
    replies = []
    start = time.perf_counter()
    for step in range(args.steps):  # an RL step: fresh conversations, the same system prompt
        convs = [list(system) for _ in range(args.convs)]
        for turn in range(args.turns):
            prompts = [c + tokens(args.turn, seed=10**6 * step + 1000 * i + turn, vocab=vocab)
                       for i, c in enumerate(convs)]
            results = engine.generate(prompts, sampling)
            convs = [p + r.token_ids for p, r in zip(prompts, results)]
            replies.append([r.token_ids for r in results])
    seconds = time.perf_counter() - start
    s = engine.stats()
    engine.check_invariants()
    c = s.prefix_cache
    held = s.pool.prefix_cache_pages
    return dict(prefill_tokens=s.prefill_tokens, seconds=seconds, hits=c.hits if c else 0,
                hit_tokens=c.hit_tokens if c else 0, evictions=c.evictions if c else 0,
                checkpoints_dropped=c.checkpoints_dropped if c else 0,
                cache_pages_at_end=held, total_pages=s.pool.total_pages, page_bytes=s.pool.page_bytes, replies=replies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn", type=int, default=192)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--system", type=int, default=0, help="a system prompt of this many tokens opens every "
                                                           "conversation")
    ap.add_argument("--steps", type=int, default=1, help="RL steps: each starts fresh conversations")
    ap.add_argument("--block", type=int, default=64, help="prefix_block_tokens")
    ap.add_argument("--interval", type=int, default=128, help="checkpoint_interval")
    ap.add_argument("--budget", default="0.6,0.4,0.25", help="pool sizes: fractions of what an unbounded run's "
                                                                  "cache holds at its end, comma-separated")
    ap.add_argument("--device", default="cpu", help="cuda: k3-small in bf16 (its own proportions; pass --block 512 "
                                                     "--interval 2048 --turn 2048 for the engine's defaults)")
    ap.add_argument("--out", default="prefix-capacity")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)
        model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    else:
        model = K3ForCausalLM(K3Config.preset("k3-small")).to(args.device, torch.bfloat16).eval()
    base = dict(prefix_block_tokens=args.block, checkpoint_interval=args.interval,
                max_tokens_per_step=2048 if args.device == "cpu" else None)

    # the footprint of an unbounded run: every block and checkpoint the conversations leave, plus what the running
    # batch holds (measured with a pool far larger than needed)
    unbounded = EngineConfig(memory_bytes=(1 << 30) if args.device == "cpu" else (40 << 30), **base)
    if args.device != "cpu":  # compilation and graph captures: a warm-up run first
        rollout(model, unbounded, args)
    big = rollout(model, unbounded, args)
    page_bytes = big["page_bytes"]
    rows = []
    fractions = [float(f) for f in args.budget.split(",")]
    for fraction in fractions:
        budget = int(fraction * big["cache_pages_at_end"] * page_bytes)
        variants = {"LRU over whole entries": dict(drop_superseded_checkpoints=False),
                    "superseded checkpoints first (default)": dict()}
        if fraction == min(fractions):  # the floor: every turn recomputes its whole conversation
            variants["no prefix cache"] = dict(enable_prefix_cache=False)
        for name, extra in variants.items():
            r = rollout(model, EngineConfig(memory_bytes=budget, **base, **extra), args)
            rows.append(dict(pool=f"{fraction:.2f} ({budget / 2**20:.1f} MiB)", variant=name, **r))
    rows.append(dict(pool=f"unbounded ({big['cache_pages_at_end']} cache pages)", variant="defaults", **big))
    ref = rows[-1]
    lru = {r["pool"]: r["seconds"] for r in rows if r["variant"].startswith("LRU")}
    for r in rows:
        r["same_replies_as_unbounded"] = r["replies"] == ref["replies"]
        r["prefill_vs_unbounded"] = r["prefill_tokens"] / ref["prefill_tokens"]
        r["seconds_vs_lru"] = r["seconds"] / lru[r["pool"]] if r["pool"] in lru else None
    print(f"\n{args.convs} conversations x {args.turns} turns of +{args.turn} tokens, {args.gen} generated; blocks of "
          f"{args.block}, a checkpoint every {args.interval}; pools as fractions of an unbounded run's cache\n")
    print_table(rows, ["pool", "variant", "prefill_tokens", "prefill_vs_unbounded", "hit_tokens", "evictions",
                       "checkpoints_dropped", "seconds", "seconds_vs_lru", "same_replies_as_unbounded"])
    for r in rows:
        del r["replies"]
    write_json(args.out, dict(args=vars(args), page_bytes=page_bytes, rows=rows))


if __name__ == "__main__":
    main()
