"""The engine's two samplers (rlk3/engine/sampling.py) on one step's logits: per-request generators drawing row by
row against the counter sampler's one batched draw, at the batch sizes of the engine benchmark.

    python bench/sampling.py                     # CPU, vocabulary 32,768 (k3-small's)
    python bench/sampling.py --device cuda       # the same on a GPU

Each row is a whole ``sample()`` call (temperature 1, every row drawn, log-probs and the tokens back on the host), the
median of ``--iters`` calls after warm-up; the ratio is generator time / counter time in the same run. Beside the
times, the ATen operators each call dispatches: on a GPU every one is a kernel launch, so the count is what the
sampler costs there in host time, whatever the device it was counted on. Prints a table; writes
bench/results/sampling[-cuda].json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import print_table, write_json
from rlk3.engine import SamplingParams
from rlk3.engine.sampling import sample


def seconds(fn, device, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()  # sample() ends by copying tokens and log-probs to the host, which waits for the device
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class OpCount(TorchDispatchMode):
    """Counts the ATen operators a call dispatches: on a GPU each is (at least) one kernel launch, ~5-35 us of host
    time, which is what a sampler costs at these sizes there."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops(fn) -> int:
    with OpCount() as c:
        fn()
    return c.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for batch in (1, 32, 128):
        for top_p in (1.0, 0.9):
            logits = torch.randn(batch, args.vocab, device=device) * 3
            params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(batch)]
            gens = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
            keys = torch.tensor([[i, 1000] for i in range(batch)], device=device)
            t_gen = seconds(lambda a=(logits, params, gens): sample(*a), device, args.iters)
            t_cnt = seconds(lambda a=(logits, params, gens), k=keys: sample(*a, keys=k), device, args.iters)
            rows.append(dict(batch=batch, top_p=top_p, generator_ms=1e3 * t_gen, counter_ms=1e3 * t_cnt,
                             ratio=t_gen / t_cnt, generator_ops=ops(lambda a=(logits, params, gens): sample(*a)),
                             counter_ops=ops(lambda a=(logits, params, gens), k=keys: sample(*a, keys=k))))
    print(f"\nsamplers on {device} ({args.threads} threads), vocabulary {args.vocab}, temperature 1")
    print_table(rows, ["batch", "top_p", "generator_ms", "counter_ms", "ratio", "generator_ops", "counter_ops"])
    suffix = "-cuda" if device.type == "cuda" else ""
    write_json(f"sampling{suffix}", dict(device=str(device), vocab=args.vocab, threads=args.threads, rows=rows))


if __name__ == "__main__":
    main()
