"""Numerics of the engine's GPU paths, behind the GPU tests in tests/rlk3/engine/test_gpu.py (docs/BENCHMARKS.md,
"GPU tests"). Needs a CUDA GPU and fla-core. Each part runs in its own process:

    PYTHONPATH=. python3 bench/engine_gpu_numerics.py fp32 {tf32,env,true,late}  # k3-tiny: kernel vs torch path
    PYTHONPATH=. python3 bench/engine_gpu_numerics.py bf16  # k3-small: teacher-forced log-prob gaps
    PYTHONPATH=. python3 bench/engine_gpu_numerics.py determinism [--torch-deterministic]  # eager vs eager / graph
    PYTHONPATH=. python3 bench/engine_gpu_numerics.py pad  # where a decode step padded for its graph parts

fp32 variants: ``tf32`` Triton's and FLA's defaults; ``env`` only ``TRITON_F32_DEFAULT=ieee``; ``true`` the test's
``true_fp32()``; ``late`` defaults first, then ``true_fp32()`` in the same process. Give each its own
``TRITON_CACHE_DIR``. ``--torch-deterministic`` (with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) runs the old MoE
combine under ``torch.use_deterministic_algorithms(True)``.
"""

import argparse
import contextlib
import os
import statistics
import time

import torch

import rlk3.engine.runner as runner_module
import rlk3.model.layers.moe as moe_module
from tests.rlk3.engine._gpu_paths import (
    PATH_PROMPTS,
    kernel_and_torch_paths,
    make_model,
    make_prompts,
    run,
    teacher_forced,
    true_fp32,
)
from tests.rlk3.model._routing import pinned_routing

T0 = time.perf_counter()


def say(*args):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *args, flush=True)


def compare(name, a, b):
    """Two lists of GenerationResults (or [tokens, logprobs] pairs): where they part, log-prob gaps before."""
    pairs = [(x if isinstance(x, list) else [x.token_ids, x.logprobs], y if isinstance(y, list) else
              [y.token_ids, y.logprobs]) for x, y in zip(a, b)]
    identical = sum(x == y for x, y in pairs)
    rows, worst = [], 0.0
    for (ta, la), (tb, lb) in pairs:
        same = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), len(ta))
        gap = max((abs(p - q) for p, q in zip(la[:same], lb[:same])), default=0.0)
        worst = max(worst, gap)
        rows.append(f"{same}/{len(ta)}:{gap:.1e}")
    say(f"{name}: {identical}/{len(pairs)} bit-identical; same tokens/total:max|dlp| {' '.join(rows)}; "
        f"max {worst:.2e}")


def gaps(name, a, b):
    """Per-token |Δ log-prob| between two teacher-forced runs over the same streams."""
    d = sorted(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y))
    per_seq = [max(abs(p - q) for p, q in zip(x, y)) for x, y in zip(a, b)]
    def q(f):
        return d[int(f * (len(d) - 1))]

    say(f"{name}: n={len(d)} max {d[-1]:.2e} p99 {q(0.99):.2e} p90 {q(0.9):.2e} "
        f"median {statistics.median(d):.2e} mean {statistics.mean(d):.2e}; per sequence max "
        + " ".join(f"{g:.1e}" for g in per_seq))
    return d[-1]


# -- fp32


def fp32(variant):
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        def get_cache_invalidating_env_vars():
            return "unknown"

    if variant == "env":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
    elif variant == "true":
        true_fp32()
    say(f"fp32 {variant}: torch matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32} "
        f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} float32_matmul_precision="
        f"{torch.get_float32_matmul_precision()} TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')} "
        f"triton cache-invalidating env: {get_cache_invalidating_env_vars()}")
    out = kernel_and_torch_paths("k3-tiny", torch.float32)
    compare(f"fp32 {variant}: auto vs torch", out["auto"], out["torch"])
    first = max(abs(a[1][0] - b[1][0]) for a, b in zip(out["auto"], out["torch"]))
    say(f"fp32 {variant}: first-token (prefill only) max gap {first:.2e}")
    if variant == "late":
        try:
            true_fp32()
            again = kernel_and_torch_paths("k3-tiny", torch.float32)
            compare("fp32 late, after true_fp32() in the same process: auto vs torch", again["auto"], again["torch"])
            compare("fp32 late: auto after vs auto before", again["auto"], out["auto"])
        except Exception as e:  # Triton may refuse a changed global of a compiled kernel
            say(f"fp32 late: {type(e).__name__}: {str(e)[:300]}")


# -- bf16 teacher forcing


def bf16():
    model = make_model("k3-small", torch.bfloat16)
    prompts = make_prompts(model.config.vocab_size, PATH_PROMPTS)
    with pinned_routing() as routes:
        ref = run(model, "torch", False, prompts)
    say(f"bf16: torch path generated; {len(routes)} router calls recorded")
    compare("bf16 greedy: auto vs torch (the old test)", run(model, "auto", False, prompts), ref)
    streams = [r.token_ids for r in ref]
    T = [r.logprobs for r in ref]
    with pinned_routing(routes):
        K = teacher_forced(model, "auto", prompts, streams)
    Ku = teacher_forced(model, "auto", prompts, streams)
    with pinned_routing(routes):
        T2 = teacher_forced(model, "torch", prompts, streams)
    Tu = teacher_forced(model, "torch", prompts, streams)
    model.float()
    with pinned_routing(routes):
        F = teacher_forced(model, "torch", prompts, streams)
    with pinned_routing(routes):
        K32 = teacher_forced(model, "auto", prompts, streams)
    gaps("kernel bf16 (pinned) vs torch bf16", K, T)
    gaps("kernel bf16 (routing free) vs torch bf16", Ku, T)
    gaps("torch bf16 teacher-forced (pinned) vs torch bf16 generated", T2, T)
    gaps("torch bf16 teacher-forced (routing free) vs torch bf16 generated", Tu, T)
    gaps("torch bf16 vs torch fp32 (pinned): the bf16 noise floor", T, F)
    gaps("kernel bf16 vs torch fp32 (pinned)", K, F)
    gaps("kernel fp32 (FLA's TF32 defaults) vs torch fp32 (pinned)", K32, F)


# -- determinism


def index_add_combine(y, order, k):
    """The combine before this branch: every pair added into its token's row with index_add_ (atomics on CUDA)."""
    out = torch.zeros(order.numel() // k, y.shape[-1], dtype=y.dtype, device=y.device)
    return out.index_add_(0, order // k, y)


@contextlib.contextmanager
def patched(module, name, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def old_combine():
    with patched(moe_module, "sum_in_expert_order", index_add_combine), \
            patched(runner_module, "sum_in_expert_order", index_add_combine):
        yield


def record_layer_outputs(runner) -> list:
    """Wrap the runner's per-layer mixers so every call appends (name, a copy of its output) to the returned list."""
    record: list = []
    for name in ("_kda", "_mla", "_feed_forward"):
        original = getattr(runner, name)

        def wrap(*args, original=original, name=name):
            out = original(*args)
            record.append((name, out.clone()))
            return out

        setattr(runner, name, wrap)
    return record


def bisect(model, prompts, repeats=4):
    """Runs a prefill step, then a decode step, ``repeats`` times each on the same pool state and names the first
    op (layer, kind) whose output is not bit-identical across the repeats."""
    from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams

    for step in ("prefill", "decode"):
        engine = RolloutEngine(model, EngineConfig(memory_bytes=2 * 2**30, cuda_graphs=False,
                                                   max_tokens_per_step=1024, prefill_chunk=256))
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=8, temperature=0))
        if step == "decode":
            engine.step()
        plan = engine.scheduler.schedule()
        batch = engine._batch(plan)
        record = record_layer_outputs(engine.runner)
        state = engine.pool.storage.clone()
        runs = []
        for _ in range(repeats):
            engine.pool.storage.copy_(state)
            record.clear()
            logits = engine.runner.forward(engine.pool, batch)
            runs.append([*record, ("logits", logits.clone())])
        first = None
        for i, (name, out) in enumerate(runs[0]):
            bad = sum(not torch.equal(out, r[i][1]) for r in runs[1:])
            if bad and first is None:
                first = f"op {i} ({name}, layer {i // 2}): {bad}/{repeats - 1} repeats differ"
        say(f"  bisect {step} ({batch.input_ids.numel()} tokens): first non-reproducible op: {first}")


def determinism(torch_deterministic):
    model = make_model("k3-small", torch.bfloat16)
    lengths = [3, 17, 64, 100, 250, 7, 40]
    p7 = make_prompts(model.config.vocab_size, lengths)
    p8 = make_prompts(model.config.vocab_size, [*lengths, 30])
    assert p8[:7] == p7
    if torch_deterministic:
        torch.use_deterministic_algorithms(True)
        say(f"deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}; "
            "old (index_add_) combine")
        with old_combine():
            try:
                a, b = run(model, "auto", False, p7), run(model, "auto", False, p7)
                compare("torch-deterministic, old combine: eager vs eager", a, b)
                bisect(model, p7)
            except Exception as e:
                say(f"torch-deterministic: {type(e).__name__}: {str(e)[:400]}")
        return
    with old_combine():
        a, b = run(model, "auto", False, p7), run(model, "auto", False, p7)
        compare("old combine: eager vs eager", a, b)
        bisect(model, p7)
    e1, e2, e3 = (run(model, "auto", False, p7) for _ in range(3))
    compare("new combine: eager vs eager", e1, e2)
    compare("new combine: eager vs eager (3rd)", e1, e3)
    bisect(model, p7)
    g7 = run(model, "auto", True, p7)
    compare("new combine: graphed vs eager, 7 sequences (graph of 8)", g7, e1)
    e8, g8 = run(model, "auto", False, p8), run(model, "auto", True, p8)
    compare("new combine: graphed vs eager, 8 sequences", g8, e8)
    with patched(runner_module, "grouped_experts", runner_module.dense_experts):
        d7, d8 = run(model, "auto", False, p7), run(model, "auto", False, p8)
    compare("dense experts in eager decode: graphed vs eager, 7 sequences", g7, d7)
    compare("dense experts in eager decode: graphed vs eager, 8 sequences", g8, d8)
    compare("dense vs grouped experts, both eager, 7 sequences", d7, e1)
    # op level, on this model's MoE layer and random hidden states
    moe = model.model.layers[2].mlp
    for n in (7, 8, 64):
        x = torch.randn(n, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            idx, w = moe.router(x)
            h = moe.routed_down_proj(x)
            a = runner_module.grouped_experts(moe.experts, h, idx, w)
            b = runner_module.dense_experts(moe.experts, h, idx, w)
        say(f"  op: grouped vs dense experts, {n} tokens: bit-identical {torch.equal(a, b)}, "
            f"max |diff| {(a.float() - b.float()).abs().max().item():.2e}")
    with torch.no_grad():
        from rlk3.engine import EngineConfig, RolloutEngine

        w_in = RolloutEngine(model, EngineConfig(memory_bytes=2**30)).runner._fused[0][0]
        for name, wt in (("kda in-proj", w_in), ("lm_head", model.lm_head.weight)):
            x = torch.randn(8, wt.shape[1], device="cuda", dtype=torch.bfloat16)
            y7, y8 = torch.nn.functional.linear(x[:7], wt), torch.nn.functional.linear(x, wt)[:7]
            say(f"  op: {name} rows of a 7-row vs an 8-row matmul bit-identical: {torch.equal(y7, y8)}")


def pad():
    """A decode step of 7 sequences computed as eager decode runs it (7 rows) and as the captured graph runs it
    (the same 7 rows padded to 8 with the scratch slot, run eagerly here): the first op whose 7 real rows differ,
    down to the first ``nn.Linear`` whose input rows agree and output rows do not. Then graph replay against the
    padded eager step."""
    from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
    from rlk3.engine.cuda_graphs import DecodeGraphs

    model = make_model("k3-small", torch.bfloat16)
    prompts = make_prompts(model.config.vocab_size, [3, 17, 64, 100, 250, 7, 40])
    engine = RolloutEngine(model, EngineConfig(memory_bytes=2 * 2**30, cuda_graphs=False, max_tokens_per_step=1024,
                                               prefill_chunk=256))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the prefill
    batch = engine._batch(engine.scheduler.schedule())
    n = batch.num_decode
    graphs = DecodeGraphs(engine.runner, engine.pool, engine.config)
    size = next(s for s in graphs.sizes if s >= n)
    graphs.load(batch, size)  # the static inputs, as DecodeGraphs.run fills them
    padded = graphs._batch(size)

    record = record_layer_outputs(engine.runner)
    linears: list = []
    hooks = [m.register_forward_hook(lambda mod, i, o, name=name: linears.append((name, i[0].clone(), o.clone())))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    state = engine.pool.storage.clone()

    def forward(b, sync_ok):
        engine.pool.storage.copy_(state)
        record.clear()
        linears.clear()
        engine.runner.sync_ok = sync_ok
        try:
            logits = engine.runner.forward(engine.pool, b)
        finally:
            engine.runner.sync_ok = True
        return [*record, ("logits", logits.clone())], list(linears)

    def rows(t):
        return t[:, :n] if t.dim() == 3 else t[:n]

    eager, eager_lin = forward(batch, True)
    graph_like, graph_lin = forward(padded, False)
    first = next((f"op {i} ({name}, layer {i // 2})" for i, ((name, a), (_, b)) in enumerate(zip(eager, graph_like))
                  if not torch.equal(a, rows(b))), None)
    say(f"pad: {n} rows eager vs padded to {size}: first op whose real rows differ: {first}")
    for (name, xa, ya), (_, xb, yb) in zip(eager_lin, graph_lin):
        if torch.equal(xa, rows(xb)) and not torch.equal(ya, rows(yb)):
            weight = model.get_submodule(name).weight
            say(f"pad: first nn.Linear with equal input rows and different output rows: {name} "
                f"{tuple(xa.shape)} -> {tuple(ya.shape)} (x {xa.dtype}, weight {weight.dtype})")
            break
    else:
        say("pad: every nn.Linear with equal input rows gave equal output rows")
    moe = model.model.layers[2].mlp
    x = torch.randn(size, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        (i7, w7), (i8, w8) = moe.router(x[:n]), moe.router(x)
        say(f"pad: router rows {n} vs {size}: same experts {torch.equal(i7, i8[:n])}, same weights "
            f"{torch.equal(w7, w8[:n])}")
        h = moe.routed_down_proj(x)
        dense7 = runner_module.dense_experts(moe.experts, h[:n], i8[:n], w8[:n])
        dense8 = runner_module.dense_experts(moe.experts, h, i8, w8)
        grouped7 = runner_module.grouped_experts(moe.experts, h[:n], i8[:n], w8[:n])
        say(f"pad: dense experts {n} vs {size} rows equal {torch.equal(dense7, dense8[:n])}; grouped {n} vs dense "
            f"{size} equal {torch.equal(grouped7, dense8[:n])}")
    for hook in hooks:
        hook.remove()
    engine.pool.storage.copy_(state)
    replayed = graphs.run(batch)
    say(f"pad: graph replay equals the padded step run eagerly: {torch.equal(replayed, graph_like[-1][1][:n])}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["fp32", "bf16", "determinism", "pad"])
    parser.add_argument("variant", nargs="?", default="true", choices=["tf32", "env", "true", "late"])
    parser.add_argument("--torch-deterministic", action="store_true")
    args = parser.parse_args()
    say(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    if args.part == "fp32":
        fp32(args.variant)
    elif args.part == "bf16":
        bf16()
    elif args.part == "determinism":
        determinism(args.torch_deterministic)
    else:
        pad()
    say("done")


if __name__ == "__main__":
    main()
