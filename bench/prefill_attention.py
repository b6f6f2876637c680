"""MLA prefill attention on CUDA: FlashAttention-2 against cuDNN, per call and at the first call of a new shape.

The engine's prefill attention (``rlk3.engine.runner.prefill_attention``) runs SDPA over decompressed keys and
values (k3-small's heads: 8, query/key dim 96 padded to the value dim 128). Three things are timed, in bf16:

* an extension of a cached prefix (the next turn of an episode): the lower-right causal bias (PyTorch dispatches it
  to FlashAttention-2), two cuDNN calls merged by log-sum-exp at the exact lengths, and the same at padded shapes
  (``_cudnn_causal``, what ``EngineConfig.cudnn_attention`` runs);
* a fresh causal prompt: SDPA's own choice (cuDNN on Hopper), FlashAttention-2, and padded cuDNN;
* the first call at a shape never seen in the process, against the second: cuDNN builds an execution plan per shape,
  and SDPA with a boolean mask (the packed multi-sequence prefill) goes to cuDNN too unless the engine excludes it.

Per-call times are CUDA-event medians of 15 calls after 3 warm-up calls; a call is short (0.05-1 ms), so its host
work (the padding's launches) counts where it is not hidden behind other GPU work, as it is inside an engine step.

    python3 bench/prefill_attention.py --out bench/results/prefill-attention-cuda.json   # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from rlk3.engine.runner import NO_CUDNN, _attend_lse, _cudnn_causal, _merge, attention_bucket

ROOT = Path(__file__).resolve().parents[1]
H, D, QK, SCALE = 8, 128, 96, 0.1


def median_ms(f, n: int = 15) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def wall_ms(f) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def tensors(T: int, S: int, seed: int = 0):
    """q ``[1, H, T, D]``, k, v ``[1, H, S, D]`` with the query/key columns past QK zero (the head dim's padding)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in (T, S, S))
    q[..., QK:], k[..., QK:] = 0, 0
    return q, k, v


def exact_merge(q, k, v, P: int):
    """Two cuDNN calls at the exact lengths (a plan per shape): the prefix unmasked, the new keys causally."""
    o1, lse1 = _attend_lse(q, k[:, :, :P], v[:, :, :P], False, SCALE)
    o2, lse2 = _attend_lse(q, k[:, :, P:], v[:, :, P:], True, SCALE)
    return _merge(o1, lse1, o2, lse2)


def extensions() -> list[dict]:
    rows = []
    for T, P in [(2064, 2048), (2176, 8128), (2176, 14320), (2192, 18432), (6240, 8192), (8192, 8192),
                 (512, 4096), (1024, 16384), (128, 20496)]:
        q, k, v = tensors(T, P + T)
        bias = causal_lower_right(T, P + T)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, scale=SCALE)
        calls = {
            "flash2_bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=SCALE),  # noqa: B023
            "cudnn_exact": lambda: exact_merge(q, k, v, P),  # noqa: B023
            "cudnn_padded": lambda: _cudnn_causal(q, k, v, P, SCALE, QK),  # noqa: B023
        }
        row = dict(T=T, prefix=P, padded_T=attention_bucket(T), padded_prefix=attention_bucket(P))
        flop = 4 * H * D * (T * P + T * T / 2)
        for name, f in calls.items():
            row[f"{name}_ms"] = median_ms(f)
            row[f"{name}_tflops"] = flop / row[f"{name}_ms"] / 1e9
            row[f"{name}_max_err"] = (f().float() - ref).abs().max().item()
        rows.append(row)
    return rows


def fresh() -> list[dict]:
    rows = []
    for T in (200, 700, 2100, 4100, 8100):
        q, k, v = tensors(T, T)
        row = dict(T=T, sdpa_default_ms=median_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALE)))  # noqa: B023
        with sdpa_kernel(NO_CUDNN):
            row["flash2_ms"] = median_ms(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=SCALE))  # noqa: B023
        row["cudnn_padded_ms"] = median_ms(lambda: _cudnn_causal(q, k, v, 0, SCALE, QK))  # noqa: B023
        rows.append(row)
    return rows


def first_calls() -> list[dict]:
    """Each shape new to the process (lengths no other section used): the first call against the second."""
    rows = []
    for i, (T, S) in enumerate(((3001, 3001), (3017, 3017), (2071, 9011), (2085, 12007), (310, 950), (520, 1400))):
        q, k, v = tensors(T, S, seed=100 + i)
        if T == S:  # a fresh causal prompt: SDPA's choice (cuDNN), then FlashAttention-2 at another new length
            calls = {"sdpa_default": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}  # noqa: B023
            q2, k2, v2 = tensors(T + 3, T + 3, seed=200 + i)

            def flash2():
                with sdpa_kernel(NO_CUDNN):
                    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True)  # noqa: B023
            calls["flash2"] = flash2
        elif T > 1000:  # an extension: cuDNN at the exact lengths, and padded (a bucket no earlier call built)
            calls = {"cudnn_exact": lambda: exact_merge(q, k, v, S - T),  # noqa: B023
                     "cudnn_padded": lambda: _cudnn_causal(q, k, v, S - T, SCALE, QK)}  # noqa: B023
        else:  # the packed prefill's boolean mask: SDPA's choice (cuDNN), then without cuDNN at another shape
            m = torch.ones(1, 1, T, S, dtype=torch.bool, device="cuda").tril(S - T)
            calls = {"sdpa_default_masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m)}  # noqa
            q2, k2, v2 = tensors(T + 3, S + 3, seed=300 + i)
            m2 = torch.ones(1, 1, T + 3, S + 3, dtype=torch.bool, device="cuda").tril(S - T)

            def no_cudnn():
                with sdpa_kernel(NO_CUDNN):
                    F.scaled_dot_product_attention(q2, k2, v2, attn_mask=m2)  # noqa: B023
            calls["no_cudnn_masked"] = no_cudnn
        for name, f in calls.items():
            rows.append(dict(call=name, T=T, S=S, first_ms=wall_ms(f), second_ms=wall_ms(f)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefill-attention-cuda.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/prefill_attention.py needs a CUDA GPU (it compares CUDA attention kernels)")
    torch.zeros(1, device="cuda")
    # the process's first cuDNN call pays its initialisation (~0.6 s): not any shape's cost
    q, k, v = tensors(64, 64)
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                  heads=H, head_dim=D, first_calls=first_calls(), extensions=extensions(), fresh=fresh())
    print(f"\nextension of a cached prefix (bf16, {H} heads, head dim {D}): ms per call (TFLOPS)")
    print("| new T | prefix | FlashAttention-2 (bias) | cuDNN, exact lengths | cuDNN, padded | padded to |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in result["extensions"]:
        cells = " | ".join(f"{r[f'{n}_ms']:.3f} ({r[f'{n}_tflops']:.0f})"
                           for n in ("flash2_bias", "cudnn_exact", "cudnn_padded"))
        print(f"| {r['T']} | {r['prefix']} | {cells} | {r['padded_T']} / {r['padded_prefix']} |")
    print("\nfresh causal prompt: ms per call")
    print("| T | SDPA's choice (cuDNN) | FlashAttention-2 | cuDNN, padded |")
    print("|---:|---:|---:|---:|")
    for r in result["fresh"]:
        print(f"| {r['T']} | {r['sdpa_default_ms']:.3f} | {r['flash2_ms']:.3f} | {r['cudnn_padded_ms']:.3f} |")
    print("\nfirst call at a new shape (wall ms, synchronised)")
    print("| call | T | S | first | second |")
    print("|---|---:|---:|---:|---:|")
    for r in result["first_calls"]:
        print(f"| {r['call']} | {r['T']} | {r['S']} | {r['first_ms']:.1f} | {r['second_ms']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
