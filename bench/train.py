"""Training throughput of the K3 model: tokens/s and model-FLOPs utilisation (MFU).

    python bench/train.py                          # k3-small on a GPU (bf16 autocast), k3-tiny on CPU
    python bench/train.py --preset k3-small --batch 8 --seq 2048

One step = forward + backward + AdamW. The same run also measures the model with the KDA layers forced onto the
torch reference path (``RLK3_KDA_BACKEND=torch``) as the baseline of the ratio column. MFU counts 6 FLOPs per
activated parameter per token (embeddings excluded) plus the attention terms (MLA: causal QKᵀ and PV; KDA: the
state reads and writes), against the dense bf16 peak (989 TFLOP/s for an H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import print_table, time_fn, write_json
from rlk3.model import K3Config, K3ForCausalLM

PEAK_BF16 = 989e12


def flops_per_token(model: K3ForCausalLM, seq: int) -> float:
    c = model.config
    dense = 6 * model.num_activated_parameters()
    n_mla = len(c.full_attn_layers)
    n_kda = c.num_hidden_layers - n_mla
    qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    mla = n_mla * 6 * c.num_attention_heads * (qk + v) * seq / 2  # causal: half the keys on average
    kda = n_kda * 6 * c.kda_num_heads * 4 * c.kda_head_dim * c.kda_head_dim
    return dense + mla + kda


def step_fn(model, opt, x, device):
    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    gpu = torch.cuda.is_available()
    ap.add_argument("--preset", default="k3-small" if gpu else "k3-tiny")
    ap.add_argument("--batch", type=int, default=8 if gpu else 4)
    ap.add_argument("--seq", type=int, default=2048 if gpu else 128)
    ap.add_argument("--iters", type=int, default=10 if gpu else 3)
    ap.add_argument("--skip-reference", action="store_true")
    args = ap.parse_args()
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(args.preset)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    tokens = args.batch * args.seq
    fpt = flops_per_token(model, args.seq)
    rows = []
    paths = [("default dispatch (FLA on GPU)" if gpu else "torch chunkwise (CPU)", None)]
    if gpu and not args.skip_reference:
        paths.append(("KDA on the torch reference", "torch"))
    for name, backend in paths:
        if backend:
            os.environ["RLK3_KDA_BACKEND"] = backend
        sec = time_fn(step_fn(model, opt, x, device), warmup=3, iters=args.iters)
        os.environ.pop("RLK3_KDA_BACKEND", None)
        row = {"path": name, "step_ms": sec * 1e3, "tokens/s": tokens / sec}
        if gpu:
            row["MFU"] = fpt * tokens / sec / PEAK_BF16
        rows.append(row)
    for r in rows:
        r["x"] = r["tokens/s"] / rows[-1]["tokens/s"]
    total = sum(p.numel() for p in model.parameters())
    print(
        f"{args.preset}: {total / 1e6:.0f}M params ({model.num_activated_parameters() / 1e6:.0f}M active), "
        f"batch {args.batch} x {args.seq}, {fpt / 1e9:.2f} GFLOP/token, {device}"
    )
    if gpu:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print_table(rows, ["path", "step_ms", "tokens/s", "MFU", "x"])
    write_json(
        f"train_{args.preset}_{device}",
        {"preset": args.preset, "batch": args.batch, "seq": args.seq, "flops_per_token": fpt, "rows": rows},
    )


if __name__ == "__main__":
    main()
