"""The runner's pieces against the model's own modules: batched experts, the graph-safe decode path, packed
multi-sequence prefill."""

import pytest
import torch

import rlk3.engine.engine as engine_module
from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.engine.runner import decompress_kv, dense_experts, grouped_experts, latent_moe
from tests._util import rel_err
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, mixed_workload, prompt


@pytest.mark.parametrize("n", [1, 7, 64])
def test_batched_experts_equal_the_model_moe(tiny, n):
    moe = tiny.model.layers[2].mlp
    x = torch.randn(1, n, tiny.config.hidden_size)
    with torch.no_grad():
        ref = moe(x)
        for fn in (grouped_experts, dense_experts):
            assert rel_err(latent_moe(moe, x, fn), ref) <= 1e-6, fn.__name__


def test_graph_safe_decode_path_equals_the_eager_one(tiny):
    """Under CUDA-graph capture the runner avoids host syncs (dense experts); the same step must give the same
    logits. Checked on CPU by running the capture-mode code of the torch path eagerly."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20, backend="torch"))
    for i in range(5):
        engine.add_request(prompt(20 + i, seed=i), SamplingParams(max_tokens=10))
    for _ in range(2):
        engine.step()
    plan = engine.scheduler.schedule()
    assert all(n == 1 for _, n in plan)
    batch = engine._batch(plan)
    state = engine.pool.storage.clone()
    eager = engine.runner.forward(engine.pool, batch)
    engine.pool.storage.copy_(state)
    engine.runner.sync_ok = False
    try:
        safe = engine.runner.forward(engine.pool, batch)
    finally:
        engine.runner.sync_ok = True
    assert rel_err(safe, eager) <= 1e-6


def test_packed_multi_sequence_prefill_equals_one_at_a_time(tiny, monkeypatch):
    """One masked attention for a step's prefills, several runs of them (a bound that splits the step), and one
    sequence at a time all give the same tokens and log-probs."""
    prompts = [prompt(n, seed=n) for n in (3, 9, 30, 17, 50)]
    outs, runs = [], {}
    monkeypatch.setitem(engine_module.PACKED_PREFILL_RUNS, "cpu", True)  # CUDA's policy, on the CPU model
    for limit in (1 << 30, 600, 0):
        monkeypatch.setitem(engine_module.PACKED_PREFILL_MAX, "cpu", limit)
        engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20, max_tokens_per_step=40, prefill_chunk=8))
        build = engine._packed_groups

        def counted(multi, starts, lens, build=build, limit=limit):
            groups = build(multi, starts, lens)
            runs.setdefault(limit, []).append(([g.last - g.first for g in groups], len(multi)))
            for g in groups:  # each run within the bound: new tokens x (cached + new) tokens
                assert g.mask.numel() <= limit
            return groups

        engine._packed_groups = counted
        outs.append(engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0)))
    assert all(sizes == [n] for sizes, n in runs[1 << 30])  # the whole step in one run
    assert any(len(sizes) >= 2 for sizes, _ in runs[600])  # split into runs ...
    assert any(sum(sizes) < n for sizes, n in runs[600])  # ... and sequences left to attend alone
    assert all(sizes == [] for sizes, _ in runs[0])
    for a, b, c, p in zip(*outs, prompts):
        assert a.token_ids == b.token_ids == c.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) <= 1e-5
        assert max(abs(x - y) for x, y in zip(b.logprobs, c.logprobs)) <= 1e-5
        assert_greedy_matches_full_forward(tiny, p, a.token_ids, a.logprobs)


def test_cpu_packs_a_whole_step_or_none(tiny, monkeypatch):
    """Without runs (the CPU's policy) a step over the bound attends one sequence at a time, as it always did."""
    monkeypatch.setitem(engine_module.PACKED_PREFILL_MAX, "cpu", 2000)
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20, max_tokens_per_step=40, prefill_chunk=8))
    seen = []
    build = engine._packed_groups
    engine._packed_groups = lambda *a: seen.append(build(*a)) or seen[-1]
    engine.generate([prompt(n, seed=n) for n in (3, 9, 30, 17, 50)], SamplingParams(max_tokens=2, temperature=0))
    assert seen and all(len(groups) <= 1 for groups in seen)
    assert any(groups == [] for groups in seen)  # a step over the bound: no run at all
    assert any(len(groups) == 1 for groups in seen)  # a step under it: one run of the whole step


def per_token_batch(engine, plan):
    """``ForwardBatch``'s index tensors by their definition, one token at a time (the engine builds them with tensor
    arithmetic over the sequences' starts and lengths)."""
    bs, W, N = engine.layout.block_size, engine.layout.conv_width, len(plan)
    out = {k: [] for k in ("input_ids", "write_pages", "write_offsets", "logit_rows", "conv_src", "conv_new",
                           "slot_pages", "block_tables", "seq_lens")}
    width = max(-(-(r.num_computed + n) // bs) for r, n in plan)
    row = 0
    for s, (req, n) in enumerate(plan):
        a = req.num_computed

        def src(p, s=s, row=row):  # buffer row of chunk input p (p < 0: the sequence's cached conv rows)
            return N * W + row + p if p >= 0 else s * W + W + p

        out["input_ids"] += req.tokens[a : a + n]
        out["write_pages"] += [req.pages[p // bs] for p in range(a, a + n)]
        out["write_offsets"] += [p % bs for p in range(a, a + n)]
        out["conv_src"] += [[src(i - W + j) for j in range(W + 1)] for i in range(n)]
        out["conv_new"].append([src(n - W + r) for r in range(W)])
        row += n
        if a + n == len(req.tokens):
            out["logit_rows"].append(row - 1)
        out["slot_pages"].append(req.slot)
        used = -(-(a + n) // bs)
        out["block_tables"].append(req.pages[:used] + [0] * (width - used))
        out["seq_lens"].append(a + n)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def test_step_batch_equals_its_per_token_definition(tiny):
    """Every mixed step of a workload with chunked prefill, prefix-cache hits (prefill resuming mid-prompt) and
    decodes beside prefills: the engine's vectorised batch equals the per-token definition, tensor for tensor."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20, max_tokens_per_step=96, prefill_chunk=40,
                                                prefix_block_tokens=64, checkpoint_interval=64))
    build, checked = engine._batch, []

    def checked_batch(plan):
        batch = build(plan)
        if plan[-1][1] > 1:
            for key, want in per_token_batch(engine, plan).items():
                got = getattr(batch, key)
                assert got.dtype == torch.long and torch.equal(got, want), key
            checked.append([n for _, n in plan])
        return batch

    engine._batch = checked_batch
    shared = prompt(300, seed=7)
    prompts = [prompt(n, seed=n) for n in (5, 130, 1, 47)] + [shared + prompt(n, seed=n) for n in (3, 60)]
    engine.generate(prompts, SamplingParams(max_tokens=6))
    engine.generate([shared + prompt(90, seed=90), prompt(2, seed=2)], SamplingParams(max_tokens=4))
    assert len(checked) >= 8
    assert any(1 in plan for plan in checked) and any(len(plan) >= 3 for plan in checked)  # decodes beside prefills
    assert engine.stats().prefix_cache.hit_tokens > 0  # a prefill that starts past the sequence's beginning


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("qk,v", [(48, 32), (96, 128), (64, 64)])
def test_prefill_attention_equals_mla_attention(qk, v, device):
    """The padded-head SDPA call equals the model's decompressed MLA attention, masked and causal. On CUDA (fp32, no
    TF32 in these SDPA kernels; marked gpu) a cached prefix's extension takes PyTorch's lower-right causal bias."""
    from rlk3.engine.runner import prefill_attention
    from rlk3.model.ops.mla import mla_attention

    rope = 16
    B, T, S, H, L = 1, 40, 100, 4, 24
    g = torch.Generator().manual_seed(qk * 1000 + v)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    q_nope, q_rope = r(B, T, H, qk - rope), r(B, T, H, rope)
    latent, k_rope = r(B, S, L), r(B, S, rope)
    w_uk, w_uv = r(H, qk - rope, L) * 0.2, r(H, v, L) * 0.2
    mask = (torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None])[None].to(device)
    got = prefill_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)
    assert got.shape == (B, T, H, v)
    assert rel_err(got, mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)) <= 1e-5
    got = prefill_attention(q_nope, q_rope, latent[:, :T], k_rope[:, :T], w_uk, w_uv, 0.1, causal=True)
    ref = mla_attention(q_nope, q_rope, latent[:, :T], k_rope[:, :T], w_uk, w_uv, 0.1, causal=True)
    assert rel_err(got, ref) <= 1e-5
    # a cached prefix of S - T positions and its extension: two fused calls merged by log-sum-exp on CPU, the
    # lower-right causal bias on CUDA
    ref = mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)
    assert rel_err(prefill_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, prefix=S - T), ref) <= 1e-5
    bf = [t.bfloat16() for t in (q_nope, q_rope, latent, k_rope)]  # the merge keeps the input dtype
    got = prefill_attention(*bf, w_uk, w_uv, 0.1, prefix=S - T)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), ref) <= 2e-2


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("qk,v", [(48, 32), (96, 128), (64, 48)])
def test_decompress_kv_writes_the_padded_heads(qk, v, B, device):
    """``decompress_kv`` gives every head ``[W_UK_h c ; k_rope ; 0]`` and ``[W_UV_h c ; 0]``, written in place into
    strided views of the padded tensors: the decompressed part as the model's einsum computes it, the shared rope
    slice bit for bit, the padding exactly zero (the buffers start uninitialised, so a missed fill would show). On
    CUDA (gpu) the strided ``bmm`` goes to cuBLAS (fp32, TF32 off: the default)."""
    rope, H, S, L = 16, 4, 70, 24
    g = torch.Generator().manual_seed(qk + v + B)
    latent, k_rope = torch.randn(B, S, L, generator=g), torch.randn(B, S, rope, generator=g)
    w_uk, w_uv = torch.randn(H, qk - rope, L, generator=g), torch.randn(H, v, L, generator=g)
    latent, k_rope, w_uk, w_uv = (t.to(device) for t in (latent, k_rope, w_uk, w_uv))
    tol = 1e-6 if device == "cpu" else 1e-5  # cuBLAS may sum in another order than the einsum's kernel
    D = max(qk, v)
    for _ in range(2):  # the second call reuses freed memory that holds the first call's values
        k, vals = decompress_kv(latent, k_rope, w_uk, w_uv)
        assert k.shape == vals.shape == (B, H, S, D) and k.is_contiguous() and vals.is_contiguous()
        assert rel_err(k[..., : qk - rope], torch.einsum("bsl,hdl->bhsd", latent, w_uk)) <= tol
        assert torch.equal(k[..., qk - rope : qk], k_rope[:, None].expand(B, H, S, rope))
        assert rel_err(vals[..., :v], torch.einsum("bsl,hdl->bhsd", latent, w_uv)) <= tol
        assert not k[..., qk:].any() and not vals[..., v:].any()
        latent, k_rope = latent * 2, k_rope - 1


def test_decompress_kv_takes_weights_that_require_grad():
    """The engine slices the model's parameters (``requires_grad``) for it, and a CUDA prefill graph's eager attention
    once ran it with grad mode on: an ``out=`` matmul refuses autograd inputs, so it must detach them."""
    g = torch.Generator().manual_seed(0)
    latent, k_rope = torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 4, generator=g)
    w_uk, w_uv = torch.randn(2, 12, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    with torch.enable_grad():
        k, v = decompress_kv(latent, k_rope, w_uk.requires_grad_(), w_uv.requires_grad_())
    assert not k.requires_grad and not v.requires_grad
    assert rel_err(v[..., :16], torch.einsum("bsl,hdl->bhsd", latent, w_uv.detach())) <= 1e-6


def test_attention_buckets_are_few_and_tight():
    """cuDNN builds a plan per shape, so its calls are padded: never shorter, multiples of the minimum quantum, under
    6.25% padding past 2K rows, and few distinct shapes (48 up to 8K rows)."""
    from rlk3.engine.runner import CUDNN_MIN_QUANTUM, attention_bucket

    sizes = range(1, 8193)
    buckets = [attention_bucket(n) for n in sizes]
    assert all(b >= n and b % CUDNN_MIN_QUANTUM == 0 for n, b in zip(sizes, buckets))
    assert all((b - n) / n < 1 / 16 for n, b in zip(sizes, buckets) if n > 2048)
    assert len(set(buckets)) == 48 and attention_bucket(2049) == 2176 and attention_bucket(4096) == 4096


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("T,P", [(40, 0), (600, 0), (40, 100), (600, 4400), (600, 4608), (1030, 3000)])
def test_padded_causal_attention_equals_the_masked_one(T, P, device):
    """``_cudnn_causal``: rows padded to ``attention_bucket`` at the end, the prefix's padded keys masked through a
    spare head-dim column, the prefix and the new keys merged by log-sum-exp. On CPU its two calls are PyTorch's
    flash kernel (fp32: the padding and masking exactly as on CUDA, 1e-5); on CUDA (gpu) cuDNN's in bf16, against the
    fp32 reference within bf16 rounding."""
    from rlk3.engine.runner import _cudnn_causal

    H, D, qk = 4, 64, 48  # the query/key columns past 48 are the head dim's zero padding
    g = torch.Generator().manual_seed(T + P)
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, P + T, D, generator=g), \
        torch.randn(1, H, P + T, D, generator=g)
    q[..., qk:], k[..., qk:] = 0, 0
    mask = torch.arange(P + T)[None, :] <= (P + torch.arange(T))[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    got = _cudnn_causal(*(x.to(device, dtype) for x in (q, k, v)), P, 0.125, qk)
    assert got.shape == (1, H, T, D) and got.dtype == dtype
    assert rel_err(got.float().cpu(), ref) <= (1e-5 if device == "cpu" else 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefill_attention_takes_cudnn_only_when_asked_for_long_causal_calls_in_bf16():
    """The routing: with ``cudnn`` (``EngineConfig.cudnn_attention``) a fresh causal prompt and a long extension in
    bf16 go through ``_cudnn_causal``, a short extension (under CUDNN_MIN_QUERIES) keeps the bias; without it none
    does. Every output equals the fp32 model attention within bf16 rounding."""
    import rlk3.engine.runner as runner
    from rlk3.model.ops.mla import mla_attention

    calls = []
    real = runner._cudnn_causal
    runner._cudnn_causal = lambda *a: calls.append(a[3]) or real(*a)
    try:
        H, rope, qk, v, L = 8, 32, 96, 128, 64
        g = torch.Generator().manual_seed(0)
        for cudnn in (True, False):
            for T, P in ((700, 0), (700, 3000), (100, 3000)):
                r = lambda *shape: torch.randn(*shape, generator=g).cuda()  # noqa: E731
                q_nope, q_rope = r(1, T, H, qk - rope), r(1, T, H, rope)
                latent, k_rope = r(1, P + T, L), r(1, P + T, rope)
                w_uk, w_uv = r(H, qk - rope, L) * 0.2, r(H, v, L) * 0.2
                mask = (torch.arange(P + T)[None, :] <= (P + torch.arange(T))[:, None])[None].cuda()
                ref = mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)
                bf = [t.bfloat16() for t in (q_nope, q_rope, latent, k_rope)]
                got = runner.prefill_attention(*bf, w_uk, w_uv, 0.1, causal=not P, prefix=P, cudnn=cudnn)
                assert got.dtype == torch.bfloat16 and rel_err(got.float(), ref) <= 2e-2, (cudnn, T, P)
    finally:
        runner._cudnn_causal = real
    assert calls == [0, 3000] and runner._CUDNN["ok"]


@pytest.mark.slow  # ~40 s: inductor compiles the blocks for the CPU
def test_compiled_blocks_generate_what_the_eager_blocks_generate(tiny):
    """``EngineConfig.compile`` (the CUDA default, opt-in on CPU): the per-token blocks through ``torch.compile``
    give the eager engine's greedy tokens and log-probs within 1e-5 (fp32; inductor reorders reductions, so not
    bit-equal), over prefills of several lengths in one step and decode steps of several batch sizes."""
    prompts = [prompt(n, seed=n) for n in (5, 40, 300, 1)]
    sampling = SamplingParams(max_tokens=12, temperature=0)
    # the torch path: its blocks are what compile compiles (the CPU kernels replace them on a CPU by default)
    eager = RolloutEngine(tiny, EngineConfig(memory_bytes=2**28, backend="torch")).generate(prompts, sampling)
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=2**28, compile=True, backend="torch"))
    assert engine.runner.compiled
    compiled = engine.generate(prompts, sampling)
    for a, b in zip(compiled, eager):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert not RolloutEngine(tiny, EngineConfig(memory_bytes=2**28)).runner.compiled  # off on CPU by default


def test_cpu_kernels_generate_what_the_torch_path_generates(tiny):
    """The CPU runner (the default for a float32 model on a CPU) against the torch runner over a mixed workload: the
    same tokens (greedy and seeded), log-probs within 1e-5, versions alike — before and after an in-place weight
    update, which the CPU runner's derived weights (transposed experts, side-by-side projections) must follow."""
    import copy

    cfg = dict(memory_bytes=32 * 2**20, max_tokens_per_step=256, prefill_chunk=64, prefix_block_tokens=64,
               checkpoint_interval=64)
    results = {}
    for backend in ("auto", "torch"):
        model = copy.deepcopy(tiny)  # the workload updates the weights
        engine = RolloutEngine(model, EngineConfig(**cfg, backend=backend))
        assert engine.stats().kernels == ("cpu" if backend == "auto" else "torch")
        torch.manual_seed(11)
        new = {name: p + 0.02 * torch.randn_like(p) for name, p in model.named_parameters() if "mlp" in name}
        results[backend] = (mixed_workload(engine, sampled=True, new_weights=new), model, engine.stats())
    (kernels, model, stats), (ref, _, _) = results["auto"], results["torch"]
    assert stats.prefix_cache.hit_tokens > 0
    for a, b in zip(kernels, ref, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
        assert a.versions == b.versions
    assert kernels[-1].versions == [1] * len(kernels[-1].token_ids)  # the turn after the update
    assert all(set(r.versions) == {0} for r in kernels[:-1])


def test_cpu_runner_refuses_a_step_that_points_outside_the_pool(tiny):
    """The kernels take the runner's indices on trust; the runner checks them once per step, so a corrupt slot
    raises instead of writing outside the pool."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20))
    engine.add_request(prompt(20, seed=1), SamplingParams(max_tokens=4))
    batch = engine._batch(engine.scheduler.schedule())
    batch.slot_pages[0, 0] = engine.pool.num_pages
    with pytest.raises(RuntimeError, match=r"slot_pages must be int64 pages in \[0, \d+\)"):
        engine.runner.forward(engine.pool, batch)


def test_engine_keeps_the_torch_path_where_the_cpu_kernels_cannot_build(tmp_path):
    """No working compiler (or RLK3_CPU_KERNELS=0): the engine warns once, naming why, and runs the torch path."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "from rlk3.engine import RolloutEngine, EngineConfig, SamplingParams\n"
        "from rlk3.model import K3Config, K3ForCausalLM\n"
        "m = K3ForCausalLM(K3Config()).eval()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    e = RolloutEngine(m, EngineConfig(memory_bytes=8 * 2**20))\n"
        "print(e.stats().kernels)\n"
        "print([str(x.message) for x in w if 'CPU kernels' in str(x.message)])\n"
        "print(len(e.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].token_ids))\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "RLK3_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    kernels, warned, generated = out.stdout.splitlines()[-3:]
    assert kernels == "torch" and generated == "3"
    assert "rlk3 CPU kernels unavailable" in warned and "no-such-cc" in warned


def test_every_engine_forward_runs_with_grad_mode_off(tiny, monkeypatch):
    """A step's forwards are inference: on CUDA the prefill graphs call the runner's attention outside its
    ``no_grad`` forward, so ``step`` itself must turn grad mode off (with it on, the model's parameters made that
    attention record an autograd graph, then crash once it wrote through ``out=``; 274ade8). Checked here where every
    path forks: the engine's own ``_forward``, with the model's parameters requiring grad as a trainer leaves them."""
    assert all(p.requires_grad for p in tiny.parameters())
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20, backend="torch"))
    seen, forward = [], engine._forward

    def recording(batch):
        seen.append(torch.is_grad_enabled())
        return forward(batch)

    monkeypatch.setattr(engine, "_forward", recording)
    engine.generate([prompt(30, seed=1), prompt(7, seed=2)], SamplingParams(max_tokens=4, temperature=0))
    assert seen and not any(seen) and torch.is_grad_enabled()
