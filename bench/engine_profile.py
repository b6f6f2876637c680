"""Where the engine's GPU time goes (issue 3's misses): torch.profiler kernel tables for an eager decode step, a
cached extension turn of a long conversation and a fresh prompt of the same new length, plus the multi-turn
benchmark run twice (the first run pays Triton's compilation and autotuning, the second is the measurement).

    python bench/engine_profile.py --device cuda [--batch 128] [--context 18432] [--turn 2048]

Prints the tables; writes bench/results/engine-profile.json (per-kernel CUDA milliseconds per part).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.model import K3Config, K3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def kernel_table(prof, top: int) -> list[dict]:
    """Kernels (device-side events) by total GPU time."""
    rows = [dict(name=e.key[:110], ms=e.device_time_total / 1e3, calls=e.count) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.device_time_total]
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def show(title: str, rows: list[dict], wall_ms: float, per: int) -> None:
    total = sum(r["ms"] for r in rows)
    launches = sum(r["calls"] for r in rows)
    print(f"\n== {title}: wall {wall_ms / per:.2f} ms per unit, GPU time {total / per:.2f} ms and {launches // per} "
          "kernels per unit")
    for r in rows[:30]:
        print(f"{r['ms'] / per:9.3f} ms {r['calls'] // per:6d}x  {r['name']}")


def profiled(fn, per: int = 1, top: int = 10**6):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    return kernel_table(prof, top), wall


def decode_steps(model, batch: int, graphs: bool, steps: int = 10):
    gc.collect()
    engine = RolloutEngine(model, EngineConfig(memory_bytes=40 * 2**30, cuda_graphs=graphs))
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(1, model.config.vocab_size, (64,), generator=g).tolist(),
                           SamplingParams(max_tokens=1000, temperature=0))
    for _ in range(40):  # prefill, then some decode steps (CUDA graph capture, compilation)
        engine.step()
    return engine, (lambda: [engine.step() for _ in range(steps)])


def prefix_attention_bench(prefix: int, T: int, device: str) -> dict:
    """One MLA layer's attention of a turn's T new tokens over prefix + T keys (k3-small's heads): SDPA with a
    boolean [T, S] mask against two flash calls merged by their log-sum-exps."""
    from rlk3.engine import runner

    H, L, nope, rope_d, v_dim = 8, 256, 64, 32, 128
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    qn, qr, lat, kr = r(1, T, H, nope), r(1, T, H, rope_d), r(1, prefix + T, L), r(1, prefix + T, rope_d)
    w_uk, w_uv = r(H, nope, L) * L**-0.5, r(H, v_dim, L) * L**-0.5
    scale = (nope + rope_d) ** -0.5
    res = {}
    pos = torch.arange(prefix + T, device=device)
    mask = (pos[None, :] <= pos[prefix:, None])[None]
    calls = {"masked_sdpa": lambda: runner.prefill_attention(qn, qr, lat, kr, w_uk, w_uv, scale, mask=mask),
             "lse_merge": lambda: runner.prefill_attention(qn, qr, lat, kr, w_uk, w_uv, scale, prefix=prefix)}
    for name, fn in calls.items():
        for _ in range(3):
            o = fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            o = fn()
        torch.cuda.synchronize()
        res[name] = dict(ms=(time.perf_counter() - t) * 100, out=o.float())
    diff = (res["masked_sdpa"]["out"] - res["lse_merge"]["out"]).abs().max().item()
    rows, wall = profiled(lambda: runner.prefill_attention(qn, qr, lat, kr, w_uk, w_uv, scale, prefix=prefix))
    show(f"prefill_attention, {T} queries over {prefix} + {T} keys", rows, wall, 1)
    ms = {k: v["ms"] for k, v in res.items()}
    print(f"ms per call: {ms}; largest difference between the two: {diff:.3g}")
    return dict(ms_per_call=ms, max_abs_diff=diff)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--context", type=int, default=18432)
    ap.add_argument("--turn", type=int, default=2048)
    ap.add_argument("--skip", action="append", default=[], choices=["decode", "turn", "attention", "multi-turn"])
    args = ap.parse_args()
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-small")).to(args.device, torch.bfloat16).eval()
    vocab = model.config.vocab_size
    out: dict = {}

    if "decode" not in args.skip:
        for bs in args.batch or [1, 128]:
            for graphs in (False, True):
                _, run = decode_steps(model, bs, graphs)
                run()
                rows, wall = profiled(run, per=10)
                show(f"decode step, batch {bs}, {'CUDA graph' if graphs else 'eager'}", rows, wall, 10)
                out[f"decode_b{bs}_{'graph' if graphs else 'eager'}"] = dict(wall_ms=wall / 10, kernels=rows)

    if "turn" not in args.skip:
        g = torch.Generator().manual_seed(1)
        conv = torch.randint(1, vocab, (args.context,), generator=g).tolist()
        new = torch.randint(1, vocab, (args.turn,), generator=g).tolist()
        fresh = torch.randint(1, vocab, (args.turn,), generator=g).tolist()
        sp = SamplingParams(max_tokens=1, temperature=0)
        for _ in range(2):  # the first pass compiles
            gc.collect()
            engine = RolloutEngine(model, EngineConfig(memory_bytes=40 * 2**30, max_tokens_per_step=2048))
            engine.generate([conv], sp)
            rows, wall = profiled(lambda e=engine: e.generate([conv + new], sp))
            rows_f, wall_f = profiled(lambda e=engine: e.generate([fresh], sp))
        show(f"cached turn: +{args.turn} tokens after {args.context}", rows, wall, 1)
        show(f"fresh prompt of {args.turn} tokens", rows_f, wall_f, 1)
        out["cached_turn"] = dict(wall_ms=wall, kernels=rows)
        out["fresh_prompt"] = dict(wall_ms=wall_f, kernels=rows_f)

    if "attention" not in args.skip:
        out["prefix_attention"] = prefix_attention_bench(args.context, args.turn, args.device)

    if "multi-turn" not in args.skip:
        import sys

        sys.path.insert(0, str(ROOT / "bench"))
        from engine import multi_turn

        cfg = EngineConfig(memory_bytes=40 * 2**30, max_tokens_per_step=2048, prefill_chunk=512)
        for rep in ("warm-up", "measured"):
            mt = multi_turn(model, torch.device(args.device), 10, 2048, 16, cfg)
            print(f"\nmulti-turn ({rep}): time ratio {mt['time_ratio']:.2f}x, token ratio {mt['token_ratio']:.2f}x")
            for name in ("no_cache", "prefix_cache"):
                print(f"  {name}: {mt[name]['prefill_seconds']:.3f} s; per turn "
                      + " ".join(f"{t['prefill_seconds']:.3f}" for t in mt[name]["turns"]))
            print(f"  extend: {mt['extend']['prefill_seconds']:.3f} s")
        out["multi_turn"] = mt

    path = ROOT / "bench" / "results" / "engine-profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
