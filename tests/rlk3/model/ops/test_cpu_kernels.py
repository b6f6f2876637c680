"""The CPU kernels (rlk3/model/ops/cpu) against their torch references, on fresh random inputs."""

import pytest
import torch
import torch.nn.functional as F

from rlk3.model.layers.attn_res import AttnResMixer
from rlk3.model.layers.common import GLU, GatedRMSNorm, RMSNorm
from rlk3.model.ops import cpu
from rlk3.model.ops.kda import chunk_kda, fused_recurrent_kda_pool
from rlk3.model.ops.mla import paged_mla_decode, split_kv_b
from rlk3.model.ops.mla.paged import paged_latent_attention_torch
from tests._util import rel_err


def test_kernels_build_here():
    """make test's machines have a C compiler (Debian's gcc), so the kernels must build and load there."""
    assert cpu.available(), cpu.unavailable_reason()


@torch.no_grad()
def test_rms_norm_and_mix_norm_equal_the_modules():
    torch.manual_seed(0)
    T, D = 37, 96
    norm = RMSNorm(D, eps=1e-5)
    norm.weight.normal_()
    x = torch.randn(T, 2 * D)[:, 5 : 5 + D]  # a strided slice, as the runner passes column blocks
    assert rel_err(cpu.rms_norm(x, norm.weight, norm.eps), norm(x)) <= 1e-6
    mixer = AttnResMixer(D, eps=1e-6)
    mixer.proj.weight.normal_()
    mixer.norm_weight.normal_()
    for n in (1, 2, 5):
        sources = [torch.randn(T, D) * (i + 1) for i in range(n)]
        want = norm(mixer(sources))
        got = cpu.mix_norm(sources, mixer.norm_weight, mixer.proj.weight[0], mixer.eps, norm.weight, norm.eps)
        assert rel_err(got, want) <= 2e-6, n
        plain = cpu.mix_norm(sources, mixer.norm_weight, mixer.proj.weight[0], mixer.eps, None, 0.0)
        assert rel_err(plain, mixer(sources)) <= 2e-6, n


@torch.no_grad()
@pytest.mark.parametrize("act", ["situ", "silu"])
def test_glu_equals_the_module_over_a_wide_range(act):
    glu = GLU(act, 4.0, 25.0)
    # magnitudes from 1e-8 to 1e3: the polynomial tanh near 0, the exponential form far out, both signs
    g = torch.randn(64, 200) * torch.logspace(-8, 3, 200)
    u = torch.randn(64, 200) * torch.logspace(3, -8, 200)
    y = torch.cat([g, u], dim=1)
    got = cpu.glu(y, 0, 200, 200, act, 4.0, 25.0)
    want = glu(g, u)
    assert torch.allclose(got, want, rtol=3e-6, atol=1e-30)
    no_cap = cpu.glu(y, 0, 200, 200, act, 4.0, None)
    assert torch.allclose(no_cap, GLU(act, 4.0, None)(g, u), rtol=3e-6, atol=1e-30)
    nan = cpu.glu(torch.tensor([[float("nan"), 1.0]]), 0, 1, 1, act, 4.0, 25.0)
    assert nan.isnan().all()  # the branch-free math lets NaN through instead of clamping it away


def _kda_reference(proj, beta_col, gate_col, g, conv_w, conv_pool, state_pool, slots, lens, H, K, A_log, dt_bias,
                   norm):
    """The torch path, one sequence at a time: conv taps over [cache; new inputs], SiLU, chunk_kda over the slot's
    state, the gated norm. Updates the pools like the kernel."""
    HK, W = H * K, conv_w.shape[1]
    outs, start = [], 0
    for s, n in zip(slots.tolist(), lens):
        x = proj[start : start + n]
        ext = torch.cat([conv_pool[s], x[:, : 3 * HK]])
        y = sum(ext[j : j + n] * conv_w[:, j] for j in range(W))
        conv_pool[s] = ext[-(W - 1) :]
        q, k, v = (t.reshape(1, n, H, K) for t in F.silu(y).chunk(3, dim=-1))
        o, final = chunk_kda(
            q, k, v, g[start : start + n].reshape(1, n, H, K), x[:, beta_col : beta_col + H][None],
            A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, state_v_first=True, initial_state=state_pool[s][None].clone(),
            output_final_state=True, safe_gate=True, chunk_size=16, backend="torch",
        )
        state_pool[s] = final[0]
        gate = x[:, gate_col : gate_col + HK].reshape(n, H, K)
        outs.append(norm(o[0], gate).reshape(n, HK))
        start += n
    return torch.cat(outs)


@torch.no_grad()
@pytest.mark.parametrize("lens", [[1, 1, 1, 1, 1], [1, 2, 70, 1, 3]])
def test_kda_recurrent_equals_the_chunked_reference_and_updates_only_its_slots(lens):
    """Decode steps (one token each) and a mixed step (prefill chunks shorter and longer than the conv, beside
    decode rows), from non-zero states and conv caches in a strided pool, against chunk_kda per sequence."""
    torch.manual_seed(1)
    H, K, W, P = 3, 16, 4, 9
    HK, T = H * K, sum(lens)
    extra = 5
    proj = torch.randn(T, 3 * HK + H + HK + extra)[:, extra:]  # a strided row view
    beta_col, gate_col = 3 * HK, 3 * HK + H
    g = torch.randn(T, HK)
    conv_w = torch.randn(3 * HK, W) * 0.5
    A_log, dt_bias = torch.randn(H) * 0.3, torch.randn(HK) * 0.3
    norm = GatedRMSNorm(K, eps=1e-5)
    norm.weight.normal_()
    state_pages = torch.randn(P, H * K * K + 11) * 0.3
    conv_pages = torch.randn(P, (W - 1) * 3 * HK + 7)
    states = state_pages[:, : H * K * K].view(P, H, K, K)
    convs = conv_pages[:, : (W - 1) * 3 * HK].view(P, W - 1, 3 * HK)
    slots = torch.tensor([6, 0, 3, 8, 2])
    # the kernel keeps states K-first ([H, K, V]); the reference V-first
    ref_states, ref_convs = states.transpose(-1, -2).clone(), convs.clone()
    want = _kda_reference(proj, beta_col, gate_col, g, conv_w, ref_convs, ref_states, slots, lens, H, K, A_log,
                          dt_bias, norm)
    before_pages = state_pages.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    got = cpu.kda_recurrent(
        proj, beta_col, gate_col, g, conv_weight_t=conv_w.t().contiguous(), conv_pool=convs, state_pool=states,
        slots=slots, cu_seqlens=cu, num_heads=H, head_dim=K, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
        norm_weight=norm.weight, norm_eps=norm.eps,
    )
    assert rel_err(got, want) <= 1e-5
    assert rel_err(states[slots].transpose(-1, -2), ref_states[slots]) <= 1e-5
    assert torch.equal(convs[slots], ref_convs[slots])  # the cache is the last W-1 inputs, copied
    others = [p for p in range(P) if p not in slots.tolist()]
    assert torch.equal(state_pages[others], before_pages[others])
    assert torch.equal(state_pages[:, H * K * K :], before_pages[:, H * K * K :])  # the page tails untouched


@torch.no_grad()
def test_kda_decode_equals_the_pool_decode_and_survives_denormal_states():
    """One decode token per sequence against fused_recurrent_kda_pool (the engine's torch decode path), from states
    full of denormals (a long-decayed state), which the kernel flushes to zero."""
    torch.manual_seed(2)
    H, K, W, N = 2, 32, 4, 6
    HK = H * K
    proj = torch.randn(N, 3 * HK + H + HK)
    g = torch.randn(N, HK)
    conv_w = torch.randn(3 * HK, W) * 0.5
    A_log, dt_bias = torch.randn(H) * 0.3, torch.randn(HK) * 0.3
    norm = GatedRMSNorm(K, eps=1e-5)
    states = torch.randn(N, H, K, K)
    states[::2] *= 1e-40  # denormal
    convs = torch.randn(N, W - 1, 3 * HK)
    ref_states, ref_convs = states.transpose(-1, -2).contiguous(), convs.clone()  # the reference's layout: V-first
    slots = torch.arange(N)
    ext = torch.cat([ref_convs, proj[:, None, : 3 * HK]], dim=1)
    y = sum(ext[:, j] * conv_w[:, j] for j in range(W))
    q, k, v = (t.view(N, 1, H, K) for t in F.silu(y).chunk(3, dim=-1))
    o = fused_recurrent_kda_pool(
        q, k, v, g.view(N, 1, H, K), proj[:, None, 3 * HK : 3 * HK + H], ref_states, slots, A_log=A_log,
        dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, state_v_first=True, backend="torch",
    )
    want = norm(o[:, 0], proj[:, 3 * HK + H :].view(N, H, K)).reshape(N, HK)
    got = cpu.kda_recurrent(
        proj, 3 * HK, 3 * HK + H, g, conv_weight_t=conv_w.t().contiguous(), conv_pool=convs, state_pool=states,
        slots=slots, cu_seqlens=torch.arange(N + 1), num_heads=H, head_dim=K, A_log=A_log, dt_bias=dt_bias,
        lower_bound=-5.0, norm_weight=norm.weight, norm_eps=norm.eps,
    )
    assert rel_err(got, want) <= 1e-5
    assert rel_err(states.transpose(-1, -2), ref_states) <= 1e-5


def test_kda_recurrent_refuses_what_would_write_out_of_bounds():
    H, K, W = 2, 8, 4
    HK = H * K
    kw = dict(conv_weight_t=torch.randn(W, 3 * HK), conv_pool=torch.zeros(3, W - 1, 3 * HK),
              state_pool=torch.zeros(3, H, K, K), num_heads=H, head_dim=K, A_log=torch.zeros(H),
              dt_bias=torch.zeros(HK), lower_bound=-5.0, norm_weight=torch.ones(K), norm_eps=1e-5)
    proj, g = torch.randn(2, 4 * HK + H), torch.randn(2, HK)
    with pytest.raises(cpu.CPUKernelError, match=r"slots must lie in \[0, 3\), got values in \[0, 3\]"):
        cpu.kda_recurrent(proj, 3 * HK, 3 * HK + H, g, slots=torch.tensor([0, 3]), cu_seqlens=torch.tensor([0, 1, 2]),
                          **kw)
    with pytest.raises(cpu.CPUKernelError, match="cu_seqlens must rise from 0 to T=2"):
        cpu.kda_recurrent(proj, 3 * HK, 3 * HK + H, g, slots=torch.tensor([0, 1]), cu_seqlens=torch.tensor([0, 2, 1]),
                          **kw)
    with pytest.raises(cpu.CPUKernelError, match=r"must be a float32 CPU tensor, got torch\.float64"):
        cpu.kda_recurrent(proj.double(), 3 * HK, 3 * HK + H, g, slots=torch.tensor([0, 1]),
                          cu_seqlens=torch.tensor([0, 1, 2]), **kw)
    with pytest.raises(cpu.CPUKernelError, match="gate_col"):
        cpu.kda_recurrent(proj, 3 * HK, 3 * HK + H + 1, g, slots=torch.tensor([0, 1]),
                          cu_seqlens=torch.tensor([0, 1, 2]), **kw)


@torch.no_grad()
def test_mla_paged_decode_equals_the_torch_reference():
    torch.manual_seed(3)
    B, H, L, R, bs, P = 5, 4, 32, 16, 16, 40
    # pages strided along P (a page holds other layers too), each page's rows contiguous, as the engine's pool
    flat = torch.randn(P, bs * (L + R) + 9)
    latent = flat[:, : bs * L].view(P, bs, L)
    rope = flat[:, bs * L : bs * (L + R)].view(P, bs, R)
    seq_lens = torch.tensor([1, 16, 17, 70, 33])
    tables = torch.stack([torch.randperm(P)[:5] for _ in range(B)])
    q_lat, q_rope = torch.randn(B, H, L), torch.randn(B, H, R)
    want = paged_latent_attention_torch(q_lat, q_rope, latent, rope, tables, seq_lens, 0.2)
    got = cpu.mla_paged_decode(q_lat, q_rope, latent, rope, tables, seq_lens, 0.2)
    assert rel_err(got, want) <= 2e-6
    with pytest.raises(cpu.CPUKernelError, match=r"seq_lens must lie in \[1, 80\]"):
        cpu.mla_paged_decode(q_lat, q_rope, latent, rope, tables, torch.tensor([1, 2, 3, 81, 4]), 0.2)
    bad = tables.clone()
    bad[1, 0] = P
    with pytest.raises(cpu.CPUKernelError, match=r"block_tables must name pages in \[0, 40\)"):
        cpu.mla_paged_decode(q_lat, q_rope, latent, rope, bad, seq_lens, 0.2)


@torch.no_grad()
@pytest.mark.parametrize("gated", [True, False])
def test_mla_decode_equals_paged_decode_with_the_output_gate(gated):
    """Absorption, the paged latent attention, the lift and the output gate in one call, against paged_mla_decode
    (the runner's torch path) on strided query and gate columns."""
    torch.manual_seed(6)
    B, H, Nn, R, V, L, bs, P = 6, 4, 32, 16, 24, 32, 16, 30
    flat = torch.randn(P, bs * (L + R) + 5)
    latent = flat[:, : bs * L].view(P, bs, L)
    rope = flat[:, bs * L : bs * (L + R)].view(P, bs, R)
    seq_lens = torch.tensor([1, 5, 16, 17, 48, 64])
    tables = torch.stack([torch.randperm(P)[:4] for _ in range(B)])
    kv_b = torch.randn(H * (Nn + V), L) * 0.2
    y = torch.randn(B, 3 + H * (Nn + R) + H * V)  # [junk | q | gate], as the runner's fused projection
    q, gate = y[:, 3 : 3 + H * (Nn + R)], y[:, 3 + H * (Nn + R) :]
    q_nope, q_rope = q.reshape(B, H, Nn + R).split([Nn, R], dim=-1)
    w_uk, w_uv = split_kv_b(kv_b, H, Nn, V)
    want = paged_mla_decode(q_nope, q_rope, latent, rope, tables, seq_lens, w_uk, w_uv, 0.15, backend="torch")
    if gated:
        want = want * torch.sigmoid(gate).view(B, H, V)
    got = cpu.mla_decode(q, kv_b, num_heads=H, nope_dim=Nn, rope_dim=R, v_dim=V, latent_pages=latent,
                         rope_pages=rope, block_tables=tables, seq_lens=seq_lens, scale=0.15,
                         gate=gate if gated else None)
    assert rel_err(got, want.reshape(B, H * V)) <= 2e-6


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 9, 300])
def test_latent_moe_equals_router_and_expert_loop(T):
    """Routing, the experts (the loop of K3Experts.forward), the routed norm and the shared activation."""
    from rlk3.model import K3Config
    from rlk3.model.layers.moe import StableLatentMoE

    torch.manual_seed(4)
    config = K3Config()
    moe = StableLatentMoE(config)
    for p in moe.parameters():
        p.normal_(0, 0.2)
    moe.router.e_score_correction_bias.normal_(0, 0.1)
    moe.routed_norm.weight.normal_()
    E, k, Dl = config.num_experts, config.num_experts_per_token, config.routed_expert_hidden_size
    I, Is = config.moe_intermediate_size, config.moe_intermediate_size * config.num_shared_experts
    x = torch.randn(T, config.hidden_size)
    shared = moe.shared_experts
    w = torch.cat([moe.router.weight, moe.routed_down_proj.weight, shared.gate_proj.weight, shared.up_proj.weight])
    y = F.linear(x, w)
    mid = cpu.latent_moe(
        y, num_experts=E, top_k=k, latent=Dl, intermediate=I, shared=Is, bias=moe.router.e_score_correction_bias,
        renormalize=True, scaling=1.0, gate_up_t=moe.experts.gate_up_proj.transpose(1, 2).contiguous(),
        down_t=moe.experts.down_proj.transpose(1, 2).contiguous(), act="situ", beta=config.situ_beta,
        linear_beta=config.situ_linear_beta, norm_weight=moe.routed_norm.weight, norm_eps=moe.routed_norm.eps,
    )
    idx, wts = moe.router(x)
    routed = moe.routed_norm(moe.experts(moe.routed_down_proj(x), idx, wts))
    assert rel_err(mid[:, :Dl], routed) <= 1e-5
    assert rel_err(mid[:, Dl:], shared.act(shared.gate_proj(x), shared.up_proj(x))) <= 1e-5
    out = F.linear(mid, torch.cat([moe.routed_up_proj.weight, shared.down_proj.weight], dim=1))
    assert rel_err(out, moe(x[None])[0]) <= 1e-5


@torch.no_grad()
def test_argmax_logprob_equals_log_softmax_and_takes_the_first_tie():
    torch.manual_seed(5)
    logits = torch.randn(7, 1000) * 5
    logits[3, 10] = logits[3, 500] = logits[3].max() + 1  # a tie: the first index wins, as torch.argmax
    tokens, lp = cpu.argmax_logprob(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(lp, want, rtol=0, atol=2e-6)


def test_a_broken_compiler_leaves_the_kernels_unavailable_with_the_reason(tmp_path, monkeypatch):
    """Where no compiler works the kernels report why instead of raising at import (callers keep the torch path)."""
    import subprocess
    import sys

    code = "from rlk3.model.ops import cpu; print(cpu.available()); print(cpu.unavailable_reason())"
    env = {"PATH": "/usr/bin:/bin", "CC": str(tmp_path / "no-such-cc"), "RLK3_KERNEL_CACHE": str(tmp_path),
           "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    available, reason = out.splitlines()[:2]
    assert available == "False"
    assert "no-such-cc" in reason
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "CC": "cc", "RLK3_CPU_KERNELS": "0"}).stdout
    assert off.splitlines()[:2] == ["False", "turned off by RLK3_CPU_KERNELS=0"]


@pytest.mark.slow  # two more builds and runs of this file, ~40 s
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "sse2"])
def test_kernels_built_for_narrower_vectors_pass_these_tests(march, tmp_path):
    """The kernels' vector width follows the target (16 lanes with AVX-512, 8 with AVX2, 4 with SSE2), and with it
    the reductions' code: built for the narrower targets, every test above passes too."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64":
        pytest.skip(f"AVX2 and SSE2 are x86-64 targets; this machine is {platform.machine()}")
    env = {**os.environ, "RLK3_KERNEL_MARCH": march, "RLK3_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", __file__],
        capture_output=True, text=True, env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "skipped" not in done.stdout and " passed" in done.stdout, done.stdout[-3000:]
    assert any(p.name.endswith(".so") for p in tmp_path.iterdir())  # built there, for that target
