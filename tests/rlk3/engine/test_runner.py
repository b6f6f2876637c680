"""The runner's pieces against the model's own modules: batched experts, the graph-safe decode path, packed
multi-sequence prefill."""

import pytest
import torch

import rlk3.engine.engine as engine_module
from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.engine.runner import dense_experts, grouped_experts, latent_moe
from tests._util import rel_err
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt


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
    logits. Checked on CPU by running the capture-mode code eagerly."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20))
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
        assert_greedy_matches_full_forward(tiny, p, a.token_ids)


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


@pytest.mark.parametrize("qk,v", [(48, 32), (96, 128), (64, 64)])
def test_prefill_attention_equals_mla_attention(qk, v):
    """The padded-head SDPA call equals the model's decompressed MLA attention, masked and causal."""
    from rlk3.engine.runner import prefill_attention
    from rlk3.model.ops.mla import mla_attention

    rope = 16
    B, T, S, H, L = 1, 40, 100, 4, 24
    q_nope, q_rope = torch.randn(B, T, H, qk - rope), torch.randn(B, T, H, rope)
    latent, k_rope = torch.randn(B, S, L), torch.randn(B, S, rope)
    w_uk, w_uv = torch.randn(H, qk - rope, L) * 0.2, torch.randn(H, v, L) * 0.2
    mask = (torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None])[None]
    got = prefill_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)
    assert got.shape == (B, T, H, v)
    assert rel_err(got, mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)) <= 1e-5
    got = prefill_attention(q_nope, q_rope, latent[:, :T], k_rope[:, :T], w_uk, w_uv, 0.1, causal=True)
    ref = mla_attention(q_nope, q_rope, latent[:, :T], k_rope[:, :T], w_uk, w_uv, 0.1, causal=True)
    assert rel_err(got, ref) <= 1e-5
    # a cached prefix of S - T positions and its extension: two fused calls merged by log-sum-exp on CPU
    ref = mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, mask)
    assert rel_err(prefill_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.1, prefix=S - T), ref) <= 1e-5
    bf = [t.bfloat16() for t in (q_nope, q_rope, latent, k_rope)]  # the merge keeps the input dtype
    got = prefill_attention(*bf, w_uk, w_uv, 0.1, prefix=S - T)
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), ref) <= 2e-2


@pytest.mark.slow  # ~40 s: inductor compiles the blocks for the CPU
def test_compiled_blocks_generate_what_the_eager_blocks_generate(tiny):
    """``EngineConfig.compile`` (the CUDA default, opt-in on CPU): the per-token blocks through ``torch.compile``
    give the eager engine's greedy tokens and log-probs within 1e-5 (fp32; inductor reorders reductions, so not
    bit-equal), over prefills of several lengths in one step and decode steps of several batch sizes."""
    prompts = [prompt(n, seed=n) for n in (5, 40, 300, 1)]
    sampling = SamplingParams(max_tokens=12, temperature=0)
    eager = RolloutEngine(tiny, EngineConfig(memory_bytes=2**28)).generate(prompts, sampling)
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=2**28, compile=True))
    assert engine.runner.compiled
    compiled = engine.generate(prompts, sampling)
    for a, b in zip(compiled, eager):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    assert not RolloutEngine(tiny, EngineConfig(memory_bytes=2**28)).runner.compiled  # off on CPU by default
