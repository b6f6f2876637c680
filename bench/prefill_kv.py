"""MLA prefill: decompressing a cached prefix into SDPA's padded heads in place (``rlk3.engine.runner.decompress_kv``)
against the decompression, concatenation and padding it replaced, and against one matmul each for keys and values.

An extension of a cached prefix (the next turn of an episode) decompresses every cached position's latent into
per-head keys and values before attention. Three forms of it:

* baseline, the engine's former code: ``einsum`` per head, ``cat`` with the shared rope slice, ``F.pad`` to one head
  dim (three intermediates of the prefix's size alive at the end);
* one matmul: each of keys and values from one matmul whose weight holds an identity block for the rope slice and
  zero rows for the padding (fewer passes over memory, more arithmetic);
* in place (the engine's ``decompress_kv``): per-head ``bmm`` into strided views of the padded tensors, the rope
  slice and the padding filled around it.

Per shape: milliseconds per decompression (median of 5 on CPU, 20 on CUDA, after a warm-up, in this process) and the
peak memory the decompression adds (on CPU each variant alone in a fresh subprocess: the peak resident set, reset
through ``/proc/self/clear_refs`` first, which counts the intermediates the baseline keeps alive; on CUDA
``max_memory_allocated`` around one call, in this process).

    .venv/bin/python bench/prefill_kv.py                 # CPU, fp32, one thread
    python3 bench/prefill_kv.py --device cuda            # bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlk3.engine.runner import decompress_kv

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = ("baseline", "one_matmul", "in_place")
# (name, heads, nope, rope, v, latent rank, cached positions): k3-tiny, k3-small, and K3's attention dims
SHAPES = [("k3-tiny", 4, 32, 16, 32, 32, 20480), ("k3-small", 8, 64, 32, 128, 256, 16384),
          ("K3", 96, 128, 64, 128, 512, 4096)]
SHAPE_NAMES = [s[0] for s in SHAPES]


def baseline(latent, k_rope, w_uk, w_uv):
    """The former decompression: keys and values per head, the rope slice concatenated, both padded to one dim."""
    H = w_uk.shape[0]
    k_nope = torch.einsum("bsl,hdl->bhsd", latent, w_uk)
    v = torch.einsum("bsl,hdl->bhsd", latent, w_uv)
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)
    qk, vd = k.shape[-1], v.shape[-1]
    if vd < qk:
        v = F.pad(v, (0, qk - vd))
    elif qk < vd:
        k = F.pad(k, (0, vd - qk))
    return k, v


def kv_up_weights(w_uk, w_uv, rope: int):
    """The one-matmul form's weights: ``W_k [H·D, L + rope]`` maps ``[latent ; k_rope]`` to ``[k_nope ; k_rope ; 0]``
    per head (an identity block for the rope slice), ``W_v [H·D, L]`` maps the latent to ``[v ; 0]``."""
    H, nope, L = w_uk.shape
    v_dim = w_uv.shape[1]
    D = max(nope + rope, v_dim)
    w_k = w_uk.new_zeros(H, D, L + rope)
    w_k[:, :nope, :L] = w_uk
    w_k[:, nope : nope + rope, L:] = torch.eye(rope, dtype=w_uk.dtype, device=w_uk.device)
    w_v = w_uv.new_zeros(H, D, L)
    w_v[:, :v_dim] = w_uv
    return w_k.view(H * D, L + rope), w_v.view(H * D, L)


def one_matmul(latent, k_rope, w_k, w_v, H):
    """Two matmuls into ``[B, S, H, D]``, seen as ``[B, H, S, D]``."""
    B, S = latent.shape[:2]
    k = F.linear(torch.cat([latent, k_rope], dim=-1), w_k).view(B, S, H, -1).transpose(1, 2)
    v = F.linear(latent, w_v).view(B, S, H, -1).transpose(1, 2)
    return k, v


def inputs(shape, device, dtype):
    _, H, nope, rope, v, L, S = shape
    g = torch.Generator().manual_seed(0)
    latent, k_rope = torch.randn(1, S, L, generator=g), torch.randn(1, S, rope, generator=g)
    w_uk, w_uv = torch.randn(H, nope, L, generator=g) * 0.05, torch.randn(H, v, L, generator=g) * 0.05
    return [t.to(device, dtype) for t in (latent, k_rope, w_uk, w_uv)]


def call(variant: str, shape, device, dtype):
    latent, k_rope, w_uk, w_uv = inputs(shape, device, dtype)
    if variant == "baseline":
        return lambda: baseline(latent, k_rope, w_uk, w_uv)
    if variant == "in_place":
        return lambda: decompress_kv(latent, k_rope, w_uk, w_uv)
    w_k, w_v = kv_up_weights(w_uk, w_uv, k_rope.shape[-1])
    return lambda: one_matmul(latent, k_rope, w_k, w_v, w_uk.shape[0])


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_child(variant: str, index: int, device: str, dtype: torch.dtype) -> None:
    """In a fresh process, on CPU: the bytes one decompression adds to the peak resident set (inputs and weights built
    first; Linux: the peak is reset, then read back after one call)."""
    f = call(variant, SHAPES[index], device, dtype)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    f()
    print((status_kib("VmHWM") - before) * 1024)


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def peak(variant: str, index: int, device: str, dtype_name: str) -> int:
    if device == "cuda":  # the caching allocator's own count: no fresh process needed
        f = call(variant, SHAPES[index], device, getattr(torch, dtype_name))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        f()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    out = subprocess.run([sys.executable, __file__, "--child", variant, str(index), "--device", device,
                          "--dtype", dtype_name], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def median_ms(f, device) -> float:
    n = 20 if device == "cuda" else 5
    f()
    times = []
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        f()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "SHAPE"), help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES),
                    help="comma-separated subset of " + ", ".join(SHAPE_NAMES) + " (default: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    chosen = [n for n in args.shapes.split(",") if n]
    if not chosen or any(n not in SHAPE_NAMES for n in chosen):
        ap.error(f"--shapes {args.shapes!r}: choose from {', '.join(SHAPE_NAMES)}")
    torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    if args.child:
        peak_child(args.child[0], int(args.child[1]), args.device, dtype)
        return
    rows = []
    for i, shape in enumerate(SHAPES):
        name, H, nope, rope, v, L, S = shape
        if name not in chosen:
            continue
        k0, v0 = call("baseline", shape, args.device, dtype)()
        row = dict(shape=name, heads=H, nope=nope, rope=rope, v=v, latent=L, positions=S,
                   output_bytes=k0.numel() * k0.element_size() * 2)
        for variant in VARIANTS[1:]:
            k1, v1 = call(variant, shape, args.device, dtype)()
            row[f"{variant}_max_abs_diff"] = max((k0.float() - k1.float()).abs().max().item(),
                                                 (v0.float() - v1.float()).abs().max().item())
            del k1, v1
        del k0, v0
        for variant in VARIANTS:
            row[f"{variant}_ms"] = median_ms(call(variant, shape, args.device, dtype), args.device)
            row[f"{variant}_peak_bytes"] = peak(variant, i, args.device, dtype_name)
        rows.append(row)
        # one line per shape as it finishes: a run cut off by a time limit keeps what it measured (the table and
        # the JSON come at the end; on CPU each peak is a fresh process, seconds each)
        print(name, {k: round(v, 3) for k, v in row.items() if k.endswith("_ms")}, flush=True)
    result = dict(device=args.device, dtype=dtype_name, threads=args.threads, torch=torch.__version__, rows=rows)
    print(f"\ndecompressing a cached prefix into padded heads ({args.device}, {dtype_name}, {args.threads} thread(s))")
    print("| dims | positions | keys + values MiB | " + " | ".join(f"{v} ms | {v} peak MiB" for v in VARIANTS)
          + " | max abs diff (one matmul / in place) |")
    print("|---|---:|---:|" + "---:|---:|" * len(VARIANTS) + "---|")
    mib = 2**20
    for r in rows:
        cells = " | ".join(f"{r[f'{v}_ms']:.3g} | {r[f'{v}_peak_bytes'] / mib:.0f}" for v in VARIANTS)
        diffs = " / ".join(f"{r[f'{v}_max_abs_diff']:.1e}" for v in VARIANTS[1:])
        print(f"| {r['shape']} | {r['positions']} | {r['output_bytes'] / mib:.0f} | {cells} | {diffs} |")
    out = args.out or ROOT / "bench" / "results" / f"prefill-kv-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
