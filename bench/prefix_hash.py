"""Prefix-cache admission cost on the host: the chained block keys of a re-sent multi-turn conversation.

Every turn of an agent loop that re-sends its conversation is a new request, and its admission hashes every
512-token block of the conversation so far (``Scheduler.keys``) before the prefix cache can match it: 40 blocks at
the multi-turn benchmark's last turn (20,624 tokens). This times ``prefix_cache.block_hash`` over those blocks against
the way it turned the ids into bytes before (``torch.tensor(ids).numpy().tobytes()``), in the same run, and checks
that both give the same keys (a cache built before the change matches after it).

    python bench/prefix_hash.py [--tokens 20624] [--block 512]

Prints a table and writes bench/results/prefix-hash.json.
"""

from __future__ import annotations

import argparse
import hashlib
import random

import torch
from _common import machine, print_table, time_fn, write_json

from rlk3.engine.prefix_cache import ROOT, block_hash


def tensor_block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The baseline: the same key, the ids converted through a tensor."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.digest()


def chain(hash_fn, tokens: list[int], block: int) -> list[bytes]:
    keys = []
    for b in range(len(tokens) // block):
        keys.append(hash_fn(keys[-1] if keys else ROOT, tokens[b * block : (b + 1) * block]))
    return keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20624)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=163840)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    if chain(block_hash, tokens, args.block) != chain(tensor_block_hash, tokens, args.block):
        raise SystemExit("block_hash and the tensor baseline disagree: cached keys would stop matching")
    rows = []
    base = None
    for name, fn in (("torch.tensor bytes (before)", tensor_block_hash), ("array bytes (block_hash)", block_hash)):
        seconds = time_fn(lambda fn=fn: chain(fn, tokens, args.block), warmup=3, iters=30)
        base = base or seconds
        rows.append({"variant": name, "blocks": args.tokens // args.block, "ms": round(seconds * 1e3, 3),
                     "us/block": round(seconds * 1e6 / (args.tokens // args.block), 1),
                     "speedup": f"{base / seconds:.2f}x"})
    print_table(rows, ["variant", "blocks", "ms", "us/block", "speedup"])
    write_json("prefix-hash", {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
