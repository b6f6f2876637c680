"""The CPU kernels (rlk3/model/ops/cpu) against their torch references, one call each, at k3-tiny's sizes: a decode
step's shapes (32 sequences, one token each) and a prefill step's (32 prompts of 64 tokens).

    python bench/cpu_kernels.py [--threads 1] [--reps 200]

Each row times the kernel's Python call (checks included: the engine's runner skips them) and the torch code the
runner would run instead, the median of ``--reps`` calls after warm-up, on the same inputs in the same process.
Prints a table and writes bench/results/cpu_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlk3.model import K3Config
from rlk3.model.layers.attn_res import AttnResMixer
from rlk3.model.layers.common import GatedRMSNorm, RMSNorm
from rlk3.model.layers.moe import StableLatentMoE
from rlk3.model.ops import cpu
from rlk3.model.ops.kda import chunk_kda, fused_recurrent_kda_pool
from rlk3.model.ops.mla import paged_mla_decode, split_kv_b

ROOT = Path(__file__).resolve().parents[1]


def median_us(fn, reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def kda_case(cfg: K3Config, lens: list[int]):
    """A KDA layer's work between its projections for sequences of ``lens`` tokens continuing from pool slots."""
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel_size
    HK, T, N = H * K, sum(lens), len(lens)
    proj = torch.randn(T, 3 * HK + H + HK)
    g = torch.randn(T, HK)
    conv_w = torch.randn(3 * HK, W) * 0.5
    A_log, dt_bias = torch.randn(H) * 0.3, torch.randn(HK) * 0.3
    norm = GatedRMSNorm(K, eps=1e-5)
    P = 4 * N
    states, convs = torch.randn(P, H, K, K) * 0.1, torch.randn(P, W - 1, 3 * HK)
    slots = torch.randperm(P)[:N]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    conv_t = conv_w.t().contiguous()
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, state_v_first=True)

    def kernel():
        cpu.kda_recurrent(proj, 3 * HK, 3 * HK + H, g, conv_weight_t=conv_t, conv_pool=convs, state_pool=states,
                          slots=slots, cu_seqlens=cu, num_heads=H, head_dim=K, A_log=A_log, dt_bias=dt_bias,
                          lower_bound=-5.0, norm_weight=norm.weight, norm_eps=norm.eps)

    def reference():  # the runner's torch path: conv taps over [caches; new rows], then the recurrence or chunks
        cache = convs[slots]
        if all(n == 1 for n in lens):
            buf = torch.cat([cache, proj[:, None, : 3 * HK]], dim=1)
            y = torch.zeros(T, 3 * HK)
            for j in range(W):
                y = y + buf[:, j] * conv_w[:, j]
            convs[slots] = buf[:, 1:]
            q, k, v = (t.view(T, 1, H, K) for t in F.silu(y).chunk(3, dim=-1))
            o = fused_recurrent_kda_pool(q, k, v, g.view(T, 1, H, K), proj[:, None, 3 * HK : 3 * HK + H], states,
                                         slots, check_unique=False, backend="torch", **kw)[:, 0]
        else:
            x = proj[:, : 3 * HK]
            ys = []
            for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                ext = torch.cat([cache[s], x[a:b]])
                ys.append(sum(ext[j : j + b - a] * conv_w[:, j] for j in range(W)))
            q, k, v = (t.view(1, T, H, K) for t in F.silu(torch.cat(ys)).chunk(3, dim=-1))
            o, final = chunk_kda(q, k, v, g.view(1, T, H, K), proj[None, :, 3 * HK : 3 * HK + H],
                                 initial_state=states[slots], output_final_state=True, cu_seqlens=cu, safe_gate=True,
                                 chunk_size=16, backend="torch", **kw)
            states[slots] = final
            o = o[0]
        return norm(o, proj[:, 3 * HK + H :].view(T, H, K))

    return kernel, reference


def moe_case(cfg: K3Config, T: int):
    torch.manual_seed(0)
    moe = StableLatentMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    x = torch.randn(T, cfg.hidden_size)
    shared = moe.shared_experts
    w_in = torch.cat([moe.router.weight, moe.routed_down_proj.weight, shared.gate_proj.weight, shared.up_proj.weight])
    y = F.linear(x, w_in).detach()
    gu_t = moe.experts.gate_up_proj.detach().transpose(1, 2).contiguous()
    d_t = moe.experts.down_proj.detach().transpose(1, 2).contiguous()
    I = cfg.moe_intermediate_size

    def kernel():
        cpu.latent_moe(y, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_token,
                       latent=cfg.routed_expert_hidden_size, intermediate=I, shared=I * cfg.num_shared_experts,
                       bias=moe.router.e_score_correction_bias, renormalize=True, scaling=1.0, gate_up_t=gu_t,
                       down_t=d_t, act=cfg.hidden_act, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta,
                       norm_weight=moe.routed_norm.weight, norm_eps=moe.routed_norm.eps)

    from rlk3.engine.runner import SMALL_MOE_MAX_TOKENS, grouped_experts, latent_moe

    def reference():  # what the torch runner does with these tokens (batched experts for few tokens, else the loop)
        with torch.no_grad():
            if T <= SMALL_MOE_MAX_TOKENS:
                return latent_moe(moe, x[None], grouped_experts)
            return moe(x[None])

    return kernel, reference


def mix_case(cfg: K3Config, T: int, n: int):
    D = cfg.hidden_size
    mixer, norm = AttnResMixer(D, 1e-6), RMSNorm(D)
    torch.nn.init.normal_(mixer.proj.weight)
    sources = [torch.randn(T, D) for _ in range(n)]
    query = mixer.proj.weight[0].detach()

    def kernel():
        cpu.mix_norm(sources, mixer.norm_weight, query, mixer.eps, norm.weight, norm.eps)

    def reference():
        with torch.no_grad():
            return norm(mixer.mix(torch.stack(sources, dim=-2)))

    return kernel, reference


def mla_case(cfg: K3Config, B: int, context: int):
    H, Nn, R, V, L = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                      cfg.kv_lora_rank)
    bs = 16
    blocks = -(-context // bs)
    P = B * blocks + 1
    flat = torch.randn(P, bs * (L + R))
    latent, rope = flat[:, : bs * L].view(P, bs, L), flat[:, bs * L :].view(P, bs, R)
    tables = torch.randperm(P)[: B * blocks].view(B, blocks)
    seq_lens = torch.full((B,), context)
    kv_b = torch.randn(H * (Nn + V), L) * 0.2
    q, gate = torch.randn(B, H * (Nn + R)), torch.randn(B, H * V)
    w_uk, w_uv = split_kv_b(kv_b, H, Nn, V)

    def kernel():
        cpu.mla_decode(q, kv_b, num_heads=H, nope_dim=Nn, rope_dim=R, v_dim=V, latent_pages=latent, rope_pages=rope,
                       block_tables=tables, seq_lens=seq_lens, scale=0.1, gate=gate)

    def reference():
        qn, qr = q.view(B, H, Nn + R).split([Nn, R], dim=-1)
        o = paged_mla_decode(qn, qr, latent, rope, tables, seq_lens, w_uk, w_uv, 0.1, backend="torch")
        return o * torch.sigmoid(gate).view(B, H, V)

    return kernel, reference


def cpu_name() -> str:
    """The CPU's model name (``platform.processor()`` is empty on most Linux systems)."""
    line = cpu.cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {cpu.unavailable_reason()}")
    torch.manual_seed(0)
    cfg = K3Config.preset("k3-tiny")
    cases = [
        ("AttnRes mix + norm, 3 sources", "decode (32 tokens)", *mix_case(cfg, 32, 3)),
        ("AttnRes mix + norm, 3 sources", "prefill (2,048 tokens)", *mix_case(cfg, 2048, 3)),
        ("KDA layer between projections", "decode (32 sequences)", *kda_case(cfg, [1] * 32)),
        ("KDA layer between projections", "prefill (32 x 64 tokens)", *kda_case(cfg, [64] * 32)),
        ("latent MoE between matmuls", "decode (32 tokens)", *moe_case(cfg, 32)),
        ("latent MoE between matmuls", "prefill (2,048 tokens)", *moe_case(cfg, 2048)),
        ("MLA decode attention", "32 sequences x 128 cached", *mla_case(cfg, 32, 128)),
    ]
    rows = []
    for name, shape, kernel, reference in cases:
        reps = args.reps if "prefill" not in shape else max(10, args.reps // 20)
        k, r = median_us(kernel, reps), median_us(reference, reps)
        rows.append(dict(kernel=name, shape=shape, kernel_us=k, torch_us=r, speedup=r / k))
    print(f"\nCPU kernels vs their torch references (k3-tiny, {args.threads} thread(s), median of calls)")
    print("| kernel | shape | C kernel µs | torch µs | speedup |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['kernel_us']:.0f} | {r['torch_us']:.0f} | {r['speedup']:.1f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(threads=args.threads, torch=torch.__version__, cpu=cpu_name(),
                                        rows=rows), indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
