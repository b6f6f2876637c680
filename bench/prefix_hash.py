"""Prefix-cache admission cost on the host: the range check and the chained block keys of a re-sent conversation.

Every turn of an agent loop that re-sends its conversation is a new request: ``add_request`` checks its ids against
the vocabulary, and its admission hashes every 512-token block of the conversation so far (``Scheduler.keys``)
before the prefix cache can match it: 40 blocks at the multi-turn benchmark's last turn (20,624 tokens). Part one
times that work three ways in the same run, and checks that all give the same keys (a cache built before a change
matches after it):

- the ids of each block turned into bytes through a tensor (``torch.tensor(ids).numpy().tobytes()``), with Python's
  ``min``/``max`` for the range check;
- each block packed by ``array`` (the engine until 2026-12-06), the same range check;
- the whole prompt packed once by ``add_request``, whose range check reads it (``aminmax``) and whose views the
  block hashes read (the engine now).

Part two (``--engine``, on by default) times the engine's own host path on ``k3-tiny``: ``add_request`` of a
re-sent conversation of each length, then its step up to the model's forward (admission with the prefix lookup and
restore, the batch), against a cold prompt of one turn's tokens in the same engine.

    python bench/prefix_hash.py [--tokens 20624] [--block 512] [--no-engine]

Prints tables and writes bench/results/prefix-hash.json.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import hashlib
import random
import statistics
import time

import torch
from _common import print_table, time_fn, write_json

from rlk3.engine.prefix_cache import ROOT, block_hash


def tensor_block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The first baseline: the same key, the ids converted through a tensor."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.digest()


def chain(hash_fn, tokens, block: int) -> list[bytes]:
    keys = []
    for b in range(len(tokens) // block):
        keys.append(hash_fn(keys[-1] if keys else ROOT, tokens[b * block : (b + 1) * block]))
    return keys


def list_check(tokens: list[int]) -> tuple[int, int]:
    return min(tokens), max(tokens)


def packed_admission(tokens: list[int], block: int) -> tuple[tuple[int, int], list[bytes]]:
    """What the engine does now: pack once, the range check and the block hashes read the packed ids."""
    packed = array.array("q", tokens)
    lo, hi = (int(x) for x in torch.frombuffer(packed, dtype=torch.long).aminmax())
    return (lo, hi), chain(block_hash, memoryview(packed), block)


def hashing(tokens: list[int], block: int) -> list[dict]:
    keys = chain(block_hash, tokens, block)
    if keys != chain(tensor_block_hash, tokens, block) or packed_admission(tokens, block)[1] != keys:
        raise SystemExit("the three ways disagree on the keys: cached keys would stop matching")
    variants = (
        ("torch.tensor bytes per block, min/max",
         lambda: (list_check(tokens), chain(tensor_block_hash, tokens, block))),
        ("array per block, min/max (before)", lambda: (list_check(tokens), chain(block_hash, tokens, block))),
        ("packed once, aminmax, views (now)", lambda: packed_admission(tokens, block)),
    )
    rows, base = [], None
    for name, fn in variants:
        seconds = time_fn(fn, warmup=3, iters=50)
        base = base or seconds
        rows.append({"variant": name, "tokens": len(tokens), "blocks": len(tokens) // block,
                     "ms": round(seconds * 1e3, 3), "speedup": f"{base / seconds:.2f}x"})
    return rows


class _Stop(Exception):
    """Raised in place of the model's forward: the step's host work up to it is what is timed."""


def engine_admission(turns: int, turn_tokens: int, reps: int) -> list[dict]:
    from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
    from rlk3.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    engine = RolloutEngine(model, EngineConfig(memory_bytes=2 * 2**30))
    V, g = model.config.vocab_size, torch.Generator().manual_seed(7)
    conv, lengths = [], {}
    for turn in range(turns):  # a real conversation fills the cache (the forward runs here)
        conv += torch.randint(1, V, (turn_tokens,), generator=g).tolist()
        conv += engine.generate([conv], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
        if turn in (0, turns // 2 - 1, turns - 1):
            lengths[turn + 1] = conv + torch.randint(1, V, (turn_tokens,), generator=g).tolist()
    cold = torch.randint(1, V, (turn_tokens,), generator=g).tolist()

    def stop(*args, **kwargs):
        raise _Stop

    engine.runner.forward = stop
    greedy = SamplingParams(max_tokens=1, temperature=0)
    rows, base = [], None
    for name, ids in [("cold prompt", cold)] + [(f"re-sent after {t} turns", c) for t, c in lengths.items()]:
        add, sched, cached = [], [], 0
        for _ in range(reps):
            t0 = time.perf_counter()
            rid = engine.add_request(ids, greedy)
            t1 = time.perf_counter()
            with contextlib.suppress(_Stop):
                engine.step()
            t2 = time.perf_counter()
            cached = engine.requests[rid].num_cached_tokens
            engine.abort([rid])
            add.append(t1 - t0)
            sched.append(t2 - t1)
        total = statistics.median(a + s for a, s in zip(add, sched))
        base = base or total
        rows.append({"request": name, "tokens": len(ids), "cached": cached,
                     "add_request ms": round(statistics.median(add) * 1e3, 3),
                     "step to forward ms": round(statistics.median(sched) * 1e3, 3),
                     "total ms": round(total * 1e3, 3), "vs cold": f"{total / base:.2f}x"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20624)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--no-engine", dest="engine", action="store_false")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=101)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    tokens = [rng.randrange(1, args.vocab) for _ in range(args.tokens)]
    rows = hashing(tokens, args.block)
    print_table(rows, ["variant", "tokens", "blocks", "ms", "speedup"])
    engine_rows = []
    if args.engine:
        engine_rows = engine_admission(args.turns, args.turn_tokens, args.reps)
        print()
        print_table(engine_rows, ["request", "tokens", "cached", "add_request ms", "step to forward ms", "total ms",
                                  "vs cold"])
    write_json("prefix-hash", {"args": vars(args), "rows": rows, "engine": engine_rows})


if __name__ == "__main__":
    main()
