"""Rollout-engine benchmarks (issue 3): decode throughput against HF generate() of the same weights in the same
run, and multi-turn prefill with and without the prefix cache.

    python bench/engine.py                       # CPU: k3-tiny, batch 32 x 128 new tokens; 10 turns of +2K tokens
    python bench/engine.py --device cuda         # GPU: k3-small bf16, batch 1 / 32 / 128, roofline; multi-turn
    python bench/engine.py --skip decode --skip multi-turn   # only the RL-groups section

Multi-turn: an agent loop re-sends the whole conversation each turn, on one engine per variant (prefix cache on,
off, and one request continued with ``extend`` for reference); on CUDA each engine first runs one untimed
conversation of the same shapes (kernels compiled, prefill graphs captured, as in a long-lived engine), then
``--reps`` timed ones, each new to the engine.

RL groups: a rollout batch as GRPO makes it — G prompts x n samples each, sampled at temperature 1 — with shared
prefill off and the generator sampler (the engine's defaults before them), shared prefill on, and both (the defaults
now on CUDA); the ratio is against the first, in the same run.

Prints a table and writes bench/results/engine[-cuda].json. Timings include prefill, sampling and scheduling
(tokens/s = new tokens / seconds); each number is the best of ``--reps`` runs. Wall-clock and process CPU time are
both reported: on a shared machine the CPU time of a single-threaded run is the steadier of the two. ``--threads``
sets torch's intra-op threads for both sides (on a shared machine 1 is far steadier). Outputs of the engine and HF are
compared token by token as a sanity check (greedy, fp32 on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import torch

from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.model import K3Config, K3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mixed_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lengths]


@torch.no_grad()
def hf_generate(model, batch: list[list[int]], new_tokens: int, device, flush_denormal: bool = False,
                ) -> tuple[float, list[list[int]]]:
    """HF generate() on the batch, left-padded (with an attention mask) when the prompts differ in length.
    ``flush_denormal``: with denormals flushed to zero (``torch.set_flush_denormal``) for the call: a decaying KDA
    state reaches denormal range, where x86 arithmetic is ~40x slower, and the engine's CPU kernels flush them, so HF
    is measured both ways and the faster counts."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    torch.set_flush_denormal(flush_denormal)
    t, c = time.perf_counter(), time.process_time()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    sync(device)
    elapsed = (time.perf_counter() - t, time.process_time() - c)
    torch.set_flush_denormal(False)  # PyTorch's default
    return elapsed, out[:, width:].tolist()


def engine_generate(engine, batch, new_tokens, device) -> tuple[tuple[float, float], list[list[int]]]:
    sync(device)
    t, c = time.perf_counter(), time.process_time()
    res = engine.generate(batch, SamplingParams(max_tokens=new_tokens, temperature=0))
    sync(device)
    return (time.perf_counter() - t, time.process_time() - c), [r.token_ids for r in res]


def decode_throughput(model, device, batch_sizes, prompt_len, new_tokens, reps, cfg: EngineConfig,
                      mixed: tuple[int, int] | None = None) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    engine = RolloutEngine(model, cfg)
    engine_generate(engine, prompts(2, prompt_len, vocab, 1), 4, device)  # warm-up (CUDA graphs, Triton)
    # on CUDA the engine decodes asynchronously (EngineConfig.async_decode); the same engine without it is the
    # baseline of that column, in the same run
    sync_engine = torch_engine = None
    if engine.async_decode:
        sync_engine = RolloutEngine(model, dataclasses.replace(cfg, async_decode=False))
        engine_generate(sync_engine, prompts(2, prompt_len, vocab, 1), 4, device)
    if engine.kernels == "cpu":  # the same engine on the torch path (backend="torch"): what the CPU kernels gain
        torch_engine = RolloutEngine(model, dataclasses.replace(cfg, backend="torch"))
        engine_generate(torch_engine, prompts(2, prompt_len, vocab, 1), 4, device)
    for bs in batch_sizes:
        batch = mixed_prompts(bs, *mixed, vocab, 2) if mixed else prompts(bs, prompt_len, vocab, 2)
        best_e = best_h = (float("inf"), float("inf"))  # (wall, process CPU) seconds, each the best of reps
        best_s = best_t = best_f = float("inf")
        same, agree = True, 1.0
        for _ in range(reps):
            if sync_engine is not None:
                best_s = min(best_s, engine_generate(sync_engine, batch, new_tokens, device)[0][0])
            if torch_engine is not None:
                best_t = min(best_t, engine_generate(torch_engine, batch, new_tokens, device)[0][0])
                best_f = min(best_f, hf_generate(model, batch, new_tokens, device, flush_denormal=True)[0][0])
            te, out_e = engine_generate(engine, batch, new_tokens, device)
            th, out_h = hf_generate(model, batch, new_tokens, device)
            best_e = (min(best_e[0], te[0]), min(best_e[1], te[1]))
            best_h = (min(best_h[0], th[0]), min(best_h[1], th[1]))
            same &= out_e == out_h
            agree = min(agree, common_prefix(out_e, out_h))
        n = bs * new_tokens
        hf_best = min(best_h[0], best_f)  # the faster HF run: with or without denormals flushed
        row = dict(batch=bs, prompt_len=f"{mixed[0]}-{mixed[1]}" if mixed else prompt_len, new_tokens=new_tokens,
                   kernels=engine.kernels, engine_tok_s=n / best_e[0], hf_tok_s=n / best_h[0],
                   hf_flush_denormal_tok_s=n / best_f if torch_engine is not None else None,
                   speedup=hf_best / best_e[0], engine_tok_cpu_s=n / best_e[1], hf_tok_cpu_s=n / best_h[1],
                   speedup_cpu=best_h[1] / best_e[1], token_identical=same, common_prefix=agree,
                   engine_ms_per_step=1e3 * best_e[0] / new_tokens,
                   sync_tok_s=n / best_s if sync_engine is not None else None,
                   torch_path_tok_s=n / best_t if torch_engine is not None else None)
        if device.type == "cuda":
            row["graph_replay_ms"] = graph_replay_ms(engine, bs)
            context = sum(len(p) for p in batch) / bs + new_tokens / 2  # the mean cached length over the run
            row.update(roofline(model, engine, bs, context, device))
            row["fraction_of_roofline"] = row["engine_tok_s"] / row["roofline_tok_s"]
        rows.append(row)
    return rows


def rl_groups(model, device, groups: int, samples: int, prompt_len: int, new_tokens: int, reps: int,
              cfg: EngineConfig) -> list[dict]:
    """A GRPO-shaped rollout batch: ``groups`` prompts x ``samples`` seeded samples, temperature 1, each engine
    variant on the same requests; best of ``reps`` wall times."""
    vocab = model.config.vocab_size
    batch = [p for p in prompts(groups, prompt_len, vocab, 5) for _ in range(samples)]
    params = [SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i) for i in range(len(batch))]
    variants = [("unshared, generator", False, "generator"), ("shared prefill, generator", True, "generator"),
                ("shared prefill, counter", True, "counter")]
    rows = []
    for name, share, sampler in variants:
        engine = RolloutEngine(model, EngineConfig(**{**cfg.__dict__, "share_prefill": share, "sampler": sampler}))
        engine.generate(batch[:2], params[:2])  # warm-up (CUDA graphs, Triton)
        best, stats = float("inf"), None
        for _ in range(reps):
            engine.clear_prefix_cache()  # each rep computes its prompts
            before = engine.stats()
            sync(device)
            t = time.perf_counter()
            engine.generate(batch, params)
            sync(device)
            dt, after = time.perf_counter() - t, engine.stats()
            if dt < best:
                best = dt
                stats = dict(prefill_tokens=after.prefill_tokens - before.prefill_tokens,
                             shared_prefill_tokens=after.shared_prefill_tokens - before.shared_prefill_tokens)
        rows.append(dict(variant=name, seconds=best, tok_s=len(batch) * new_tokens / best, **stats))
        del engine
        gc.collect()
    for r in rows:
        r["speedup"] = rows[0]["seconds"] / r["seconds"]
    return rows


def common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's tokens before the engine's and HF's outputs first differ (greedy bf16 on a
    GPU parts after near ties; fp32 on a CPU should give 1.0)."""
    fr = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fr.append(k / max(1, len(x)))
    return sum(fr) / max(1, len(fr))


def graph_replay_ms(engine, batch: int) -> float | None:
    """GPU time of one captured decode step at this batch size (median of 20 replays, CUDA events), with every row
    pointed at the graphs' scratch slot and page: what a step costs with no host work around it."""
    graphs = engine._graphs
    size = next((s for s in graphs.sizes if s >= batch), None) if graphs is not None else None
    if size is None or size not in graphs.graphs:
        return None
    graphs._reset_rows(0, max(graphs.sizes))
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[size].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[10]


def roofline(model, engine, batch: int, context: int, device) -> dict:
    """Decode tokens/s if a step only had to read what it must (weights once, every sequence's KDA state read and
    written, its MLA latents read) at the measured device-to-device copy bandwidth."""
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bandwidth = 2 * x.numel() * 10 / (time.perf_counter() - t)  # read + write bytes per second
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # dense experts read them all
    weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    lay = engine.layout
    state = len(lay.kda_layers) * (cfg.kda_num_heads * cfg.kda_head_dim**2 * 4) * 2  # read + write
    latents = context * lay.mla_token_bytes
    step_bytes = int(weights + batch * (state + latents))
    return dict(bandwidth_gb_s=bandwidth / 1e9, step_bytes=step_bytes,
                roofline_tok_s=batch / (step_bytes / bandwidth))


def prefill_between(before, after) -> dict:
    """The prefill tokens and seconds the engine counted between two ``stats()``; graph captures (once per step shape,
    like an engine's start-up) are reported apart, not counted as prefill time."""
    capture = after.prefill_capture_seconds - before.prefill_capture_seconds
    return dict(prefill_tokens=after.prefill_tokens - before.prefill_tokens,
                prefill_seconds=after.prefill_seconds - before.prefill_seconds - capture, capture_seconds=capture)


def conversation(engine, vocab: int, turns: int, turn_tokens: int, gen_tokens: int, device, seed: int,
                 width: int = 1) -> dict:
    """An agent loop that re-sends the whole conversation each turn (``generate``), per turn and in all; ``width``
    conversations side by side (one ``generate`` of all of them per turn, as an RL rollout's episodes run)."""
    g = torch.Generator().manual_seed(seed)
    convs, per_turn, first = [[] for _ in range(width)], [], engine.stats()
    for turn in range(turns):
        convs = [c + torch.randint(1, vocab, (turn_tokens,), generator=g).tolist() for c in convs]
        before, cpu = engine.stats(), time.process_time()
        res = engine.generate(convs, SamplingParams(max_tokens=gen_tokens, temperature=0))
        sync(device)
        per_turn.append(dict(turn=turn + 1, context=sum(map(len, convs)), cached=sum(r.num_cached_tokens for r in res),
                             **prefill_between(before, engine.stats()), turn_cpu_seconds=time.process_time() - cpu))
        convs = [c + r.token_ids for c, r in zip(convs, res)]
        per_turn[-1]["token_ids"] = [r.token_ids for r in res]
    return dict(split_checkpoints=engine.stats().split_checkpoints - first.split_checkpoints,
                **{k: sum(t[k] for t in per_turn) for k in ("prefill_tokens", "prefill_seconds", "capture_seconds")},
                cpu_seconds=sum(t["turn_cpu_seconds"] for t in per_turn), turns=per_turn)


def extended(engine, vocab: int, turns: int, turn_tokens: int, gen_tokens: int, device, seed: int,
             width: int = 1) -> dict:
    """The same conversations, each one request continued with ``extend()``: nothing is recomputed."""
    g = torch.Generator().manual_seed(seed)
    before, cpu = engine.stats(), time.process_time()
    rids = [engine.add_request(torch.randint(1, vocab, (turn_tokens,), generator=g).tolist(),
                               SamplingParams(max_tokens=gen_tokens, temperature=0)) for _ in range(width)]
    for turn in range(turns):
        while engine.has_unfinished():
            engine.step()
        if turn + 1 < turns:
            for rid in rids:
                engine.extend(rid, torch.randint(1, vocab, (turn_tokens,), generator=g).tolist())
    engine.release(rids)
    sync(device)
    return dict(**prefill_between(before, engine.stats()), cpu_seconds=time.process_time() - cpu)


def multi_turn(model, device, turns: int, turn_tokens: int, gen_tokens: int, cfg: EngineConfig, reps: int,
               warmup: int, width: int = 1) -> dict:
    """The multi-turn benchmark: one engine per variant (prefix cache on, off, and ``extend`` for reference) runs
    ``warmup`` untimed conversations, then ``reps`` timed ones; each variant keeps its fastest run (as the decode rows
    keep their best), and the ratio of each run pair is kept beside it (``run_time_ratios``) to show the spread.

    Run r of every variant is the same conversation (seed 3 + r); each conversation is new to its engine, so the
    prefix cache only ever hits the conversation's own earlier turns. A long-lived engine (an RL run's) has its
    kernels compiled and its prefill graphs captured; the warm-up conversations, which have the timed ones' shapes,
    do that here (on CUDA; on the CPU there is nothing to warm)."""
    vocab = model.config.vocab_size
    runs: dict[str, list[dict]] = {}
    for name in ("prefix_cache", "no_cache", "extend"):
        gc.collect()  # the previous engine's pool (a reference cycle) before another is allocated
        if device.type == "cuda":
            torch.cuda.empty_cache()
        engine = RolloutEngine(model, EngineConfig(**{**cfg.__dict__, "enable_prefix_cache": name != "no_cache"}))
        run = extended if name == "extend" else conversation
        for seed in range(1000, 1000 + warmup):
            run(engine, vocab, turns, turn_tokens, gen_tokens, device, seed, width)
        runs[name] = [run(engine, vocab, turns, turn_tokens, gen_tokens, device, 3 + r, width) for r in range(reps)]
        del engine
    best = {name: min(rs, key=lambda m: m["prefill_seconds"]) for name, rs in runs.items()}
    best["run_time_ratios"] = [n["prefill_seconds"] / p["prefill_seconds"]
                               for n, p in zip(runs["no_cache"], runs["prefix_cache"])]
    best["warmup_conversations"] = warmup
    best["conversations"] = width
    best["time_ratio"] = best["no_cache"]["prefill_seconds"] / best["prefix_cache"]["prefill_seconds"]
    best["cpu_time_ratio"] = best["no_cache"]["cpu_seconds"] / best["prefix_cache"]["cpu_seconds"]
    best["token_ratio"] = best["no_cache"]["prefill_tokens"] / best["prefix_cache"]["prefill_tokens"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=2048)
    ap.add_argument("--conversations", type=int, default=1,
                    help="multi-turn: this many conversations side by side (each turn one generate() of all of them)")
    ap.add_argument("--skip", choices=["decode", "multi-turn", "rl-groups", "graphs-off", "in-step-off"],
                    action="append", default=[],
                    help="graphs-off / in-step-off: the multi-turn runs without prefill graphs (CUDA) / without "
                    "checkpoints inside a step, added for their effect")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="EngineConfig.compile: auto = on CUDA only")
    ap.add_argument("--prefill-graphs", choices=["auto", "on", "off"], default="auto",
                    help="EngineConfig.prefill_graphs: auto = on where decode steps replay CUDA graphs")
    ap.add_argument("--checkpoint-in-step", choices=["on", "off"], default="on",
                    help="EngineConfig.checkpoint_in_step (on: also a multi-turn run with it off, for its effect)")
    ap.add_argument("--cudnn-attention", choices=["on", "off"], default="off",
                    help="EngineConfig.cudnn_attention: causal prefill attention through cuDNN at padded shapes")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="EngineConfig.max_tokens_per_step (default: the engine's on CUDA (8192), 512 on CPU)")
    ap.add_argument("--pool-gib", type=float, default=None,
                    help="each engine's pool (default 40 on CUDA, 0.25 on CPU); the decode rows build two engines "
                         "on CUDA, so an 80 GB card needs 30")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset, dtype = ("k3-small", torch.bfloat16) if cuda else ("k3-tiny", torch.float32)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset)).to(device, dtype).eval()
    cfg = EngineConfig(memory_bytes=int((args.pool_gib or (40 if cuda else 0.25)) * 2**30),
                       max_tokens_per_step=args.step_tokens or (None if cuda else 512),
                       prefill_chunk=512 if cuda else 256,
                       compile={"auto": None, "on": True, "off": False}[args.compile],
                       prefill_graphs={"auto": None, "on": True, "off": False}[args.prefill_graphs],
                       checkpoint_in_step=args.checkpoint_in_step == "on",
                       cudnn_attention=args.cudnn_attention == "on")
    result = dict(device=str(device), gpu=torch.cuda.get_device_name(device) if cuda else None, preset=preset,
                  dtype=str(dtype), threads=args.threads, torch=torch.__version__,
                  load_average=os.getloadavg(), config={k: v for k, v in cfg.__dict__.items()})

    if "decode" not in args.skip:
        sizes = [1, 32, 128] if cuda else [32]
        result["decode"] = decode_throughput(model, device, sizes, args.prompt_len, args.new_tokens, args.reps, cfg)
        # RL prompts differ in length: HF pads them (left, with a mask), the engine packs them
        result["decode"] += decode_throughput(model, device, [32], args.prompt_len, args.new_tokens, args.reps, cfg,
                                              mixed=(16, 256))
        print(f"\n{preset} ({dtype}, {device}, {args.threads} threads): decode, {args.new_tokens} new tokens; "
              f"speedup = engine vs the faster HF run")
        print("| batch | prompt tokens | engine tok/s | HF generate tok/s | speedup | speedup (CPU time) "
              "| token-identical (common prefix) |"
              + (" engine ms/step | graph replay ms | roofline tok/s | of roofline | engine tok/s, async decode off "
                 "| async decode speedup |" if cuda else " HF, denormals flushed | engine, torch path |"))
        print("|---:|---:|---:|---:|---:|---:|:---:|" + ("---:|---:|---:|---:|---:|---:|" if cuda else "---:|---:|"))
        for r in result["decode"]:
            line = (f"| {r['batch']} | {r['prompt_len']} | {r['engine_tok_s']:.0f} | {r['hf_tok_s']:.0f} "
                    f"| {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x | {r['token_identical']} "
                    f"({r['common_prefix']:.2f}) |")
            if r["torch_path_tok_s"] is not None:
                line += f" {r['hf_flush_denormal_tok_s']:.0f} | {r['torch_path_tok_s']:.0f} |"
            if cuda:
                replay = f"{r['graph_replay_ms']:.2f}" if r["graph_replay_ms"] is not None else "-"
                line += (f" {r['engine_ms_per_step']:.2f} | {replay} | {r['roofline_tok_s']:.0f} "
                         f"| {r['fraction_of_roofline']:.2f} |")
                if r["sync_tok_s"] is not None:
                    line += f" {r['sync_tok_s']:.0f} | {r['engine_tok_s'] / r['sync_tok_s']:.2f}x |"
            print(line)

    if "multi-turn" not in args.skip:
        warmup = 1 if cuda else 0  # CUDA: Triton's compilation and autotuning, the prefill graphs' captures
        mt = multi_turn(model, device, args.turns, args.turn_tokens, 16, cfg, args.reps, warmup, args.conversations)
        result["multi_turn"] = mt
        # the same run without the prefill graphs, for their effect
        if cuda and cfg.prefill_graphs is not False and "graphs-off" not in args.skip:
            off = dataclasses.replace(cfg, prefill_graphs=False)
            result["multi_turn_prefill_graphs_off"] = multi_turn(model, device, args.turns, args.turn_tokens, 16, off,
                                                                 1, warmup, args.conversations)
        # the same run ending each chunk at its checkpoint boundary, for the effect
        if cfg.checkpoint_in_step and "in-step-off" not in args.skip:
            off = dataclasses.replace(cfg, checkpoint_in_step=False)
            result["multi_turn_in_step_off"] = multi_turn(model, device, args.turns, args.turn_tokens, 16, off,
                                                          args.reps, warmup, args.conversations)
        print(f"\nmulti-turn: {args.conversations} conversation(s) side by side, {args.turns} turns of "
              f"+{args.turn_tokens} tokens each (16 generated per turn), whole conversations re-sent each turn")
        print("| | prefill tokens | prefill seconds (wall) | graph capture seconds (not counted) "
              f"| process CPU seconds (all {args.turns} turns) |")
        print("|---|---:|---:|---:|---:|")
        for name in ("no_cache", "prefix_cache", "extend"):
            m = mt[name]
            print(f"| {name} | {m['prefill_tokens']} | {m['prefill_seconds']:.2f} | {m['capture_seconds']:.2f} "
                  f"| {m['cpu_seconds']:.2f} |")
        print(f"prefix cache: {mt['token_ratio']:.2f}x fewer prefill tokens, {mt['time_ratio']:.2f}x less prefill "
              f"time, {mt['cpu_time_ratio']:.2f}x less CPU time (best of {args.reps} runs of each variant after "
              f"{warmup} warm-up conversation(s) on the same engine; each run's own ratio: "
              f"{', '.join(f'{r:.2f}x' for r in mt['run_time_ratios'])})")
        print(f"checkpoints taken inside a step (prefix cache side): {mt['prefix_cache']['split_checkpoints']}")
        for name in ("no_cache", "prefix_cache"):
            print(f"{name}, prefill ms per turn (best run): "
                  + ", ".join(f"{t['prefill_seconds'] * 1e3:.1f}" for t in mt[name]["turns"]))
        off = result.get("multi_turn_in_step_off")
        if off is not None:
            print(f"checkpoint_in_step off: no cache {off['no_cache']['prefill_seconds']:.2f} s, prefix cache "
                  f"{off['prefix_cache']['prefill_seconds']:.2f} s: {off['time_ratio']:.2f}x less prefill time "
                  f"(runs: {', '.join(f'{r:.2f}x' for r in off['run_time_ratios'])})")
        off = result.get("multi_turn_prefill_graphs_off")
        if off is not None:
            print(f"prefill graphs off: no cache {off['no_cache']['prefill_seconds']:.2f} s, prefix cache "
                  f"{off['prefix_cache']['prefill_seconds']:.2f} s, extend {off['extend']['prefill_seconds']:.2f} s: "
                  f"{off['time_ratio']:.2f}x less prefill time")

    if "rl-groups" not in args.skip:
        g, n, plen, new = (32, 8, 1024, 128) if cuda else (8, 8, 256, 32)
        rows = rl_groups(model, device, g, n, plen, new, args.reps, cfg)
        result["rl_groups"] = dict(groups=g, samples=n, prompt_len=plen, new_tokens=new, rows=rows)
        print(f"\nRL groups: {g} prompts of {plen} tokens x {n} samples, {new} new tokens each, temperature 1")
        print("| variant | seconds | tok/s | prefill tokens | shared prefill tokens | speedup |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['variant']} | {r['seconds']:.3f} | {r['tok_s']:.0f} | {r['prefill_tokens']} "
                  f"| {r['shared_prefill_tokens']} | {r['speedup']:.2f}x |")

    out = args.out or ROOT / "bench" / "results" / f"engine{'-cuda' if cuda else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
