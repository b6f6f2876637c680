"""KDA prefill throughput: our dispatch (``rlk3.model.ops.kda.chunk_kda``) against a bare FLA call on a GPU,
and the chunkwise torch path against the naive recurrence on CPU.

    python bench/kda.py                       # GPU if present, else CPU
    python bench/kda.py --T 8192 --H 16 --K 128

Prints a table, writes bench/results/kda_<device>.json. The ratio columns compare against the baseline measured
in the same run (bare FLA on GPU; the naive per-token loop on CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import print_table, time_fn, write_json
from rlk3.model.ops.kda import chunk_kda, fla_available, naive_recurrent_kda, torch_chunk_kda


def k3_inputs(B, T, H, K, device, dtype):
    """What a K3 KDA layer passes: raw gate and beta logits, q/k before l2norm, the bounded in-kernel gate."""
    q, k, v = (torch.randn(B, T, H, K, device=device, dtype=dtype) for _ in range(3))
    g = torch.randn(B, T, H, K, device=device, dtype=dtype)
    beta = torch.randn(B, T, H, device=device, dtype=dtype)
    kwargs = dict(
        A_log=torch.zeros(H, device=device), dt_bias=torch.randn(H * K, device=device) * 0.5,
        use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, state_v_first=True, output_final_state=True,
        initial_state=torch.zeros(B, H, K, K, device=device),
    )
    return (q, k, v, g, beta), kwargs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=None)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    gpu = fla_available()
    device = "cuda" if gpu else "cpu"
    T = args.T or (8192 if gpu else 1024)
    H, K = (args.H, args.K) if gpu else (min(args.H, 4), min(args.K, 64))
    dtype = torch.bfloat16 if gpu else torch.float32
    tensors, kwargs = k3_inputs(args.B, T, H, K, device, dtype)
    tokens = args.B * T
    rows = []
    with torch.inference_mode():
        if gpu:
            from fla.ops.kda import chunk_kda as fla_chunk_kda

            base = time_fn(lambda: fla_chunk_kda(*tensors, **kwargs), warmup=5, iters=args.iters)
            ours = time_fn(lambda: chunk_kda(*tensors, **kwargs), warmup=5, iters=args.iters)
            ref = time_fn(lambda: chunk_kda(*tensors, backend="torch", **kwargs), warmup=1, iters=3)
            rows += [
                {"path": "bare FLA chunk_kda (baseline)", "ms": base * 1e3, "Mtok/s": tokens / base / 1e6, "x": 1.0},
                {"path": "rlk3 chunk_kda dispatch", "ms": ours * 1e3, "Mtok/s": tokens / ours / 1e6, "x": base / ours},
                {"path": "rlk3 torch reference (GPU)", "ms": ref * 1e3, "Mtok/s": tokens / ref / 1e6, "x": base / ref},
            ]
        else:
            base = time_fn(lambda: naive_recurrent_kda(*tensors, **kwargs), warmup=1, iters=3)
            ours = time_fn(lambda: torch_chunk_kda(*tensors, **kwargs), warmup=2, iters=args.iters)
            rows += [
                {"path": "naive per-token recurrence (baseline)", "ms": base * 1e3, "Mtok/s": tokens / base / 1e6,
                 "x": 1.0},
                {"path": "rlk3 torch chunkwise", "ms": ours * 1e3, "Mtok/s": tokens / ours / 1e6, "x": base / ours},
            ]
    print(f"KDA prefill, B={args.B} T={T} H={H} K=V={K} {dtype} on {device}")
    print_table(rows, ["path", "ms", "Mtok/s", "x"])
    write_json(f"kda_{device}", {"B": args.B, "T": T, "H": H, "K": K, "dtype": str(dtype), "rows": rows})


if __name__ == "__main__":
    main()
