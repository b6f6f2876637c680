"""MLA attention ops: the decompressed reference and the weight-absorbed form used for decode.

``mla_attention(..., absorbed=False)`` decompresses K/V and runs ordinary multi-head attention (torch SDPA) — the
compute-friendly form for prefill and training. ``absorbed=True`` folds ``W_UK`` into the query and ``W_UV``
into the output, attending over the cached latent as one shared KV head (576 numbers per token at K3 size): the
memory-friendly form for decode. Both equal ``naive.mla_attention_reference``. ``paged_mla_decode`` (``paged.py``) is
the absorbed form over a serving engine's paged latent cache: a torch reference and a Triton kernel on GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlk3.model.ops.mla.naive import mla_attention_reference, split_kv_b
from rlk3.model.ops.mla.paged import paged_mla_decode

__all__ = [
    "mla_attention",
    "mla_attention_absorbed",
    "mla_attention_reference",
    "paged_mla_decode",
    "split_kv_b",
]


def _check(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask):
    if q_nope.dim() != 4:
        raise ValueError(f"mla_attention: `q_nope` must be [B, T, H, nope], got {list(q_nope.shape)}")
    B, T, H, N = q_nope.shape
    if q_rope.shape[:3] != (B, T, H):
        raise ValueError(f"mla_attention: `q_rope` must be [B, T, H, R]=[{B}, {T}, {H}, R], got {list(q_rope.shape)}")
    if latent.dim() != 3 or latent.shape[0] != B:
        raise ValueError(f"mla_attention: `latent` must be [B, S, L] with B={B}, got {list(latent.shape)}")
    S, L = latent.shape[1:]
    if tuple(k_rope.shape) != (B, S, q_rope.shape[-1]):
        raise ValueError(
            f"mla_attention: `k_rope` must be [B, S, R]={[B, S, q_rope.shape[-1]]}, got {list(k_rope.shape)}"
        )
    if tuple(w_uk.shape) != (H, N, L):
        raise ValueError(f"mla_attention: `w_uk` must be [H, nope, L]={[H, N, L]}, got {list(w_uk.shape)}")
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != L:
        raise ValueError(f"mla_attention: `w_uv` must be [H, v, L] with H={H}, L={L}, got {list(w_uv.shape)}")
    if mask is not None and (tuple(mask.shape) != (B, T, S) or mask.dtype != torch.bool):
        raise ValueError(
            f"mla_attention: `mask` must be a bool [B, T, S]={[B, T, S]}, got {mask.dtype} {list(mask.shape)}"
        )


def mla_attention_absorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, mask):
    """Weight absorption: ``q̃_h = W_UK_hᵀ q_h`` scores against the latent directly; the attended latent is
    lifted by ``W_UV_h`` afterwards. Never materialises per-head keys or values."""
    out_dtype = q_nope.dtype
    f = torch.promote_types(q_nope.dtype, torch.float32)  # fp32 at least, fp64 for fp64 inputs
    q_nope, q_rope, latent, k_rope, w_uk, w_uv = (t.to(f) for t in (q_nope, q_rope, latent, k_rope, w_uk, w_uv))
    q_lat = torch.einsum("bthd,hdl->bthl", q_nope, w_uk)  # [B, T, H, L]
    scores = torch.einsum("bthl,bsl->bhts", q_lat, latent)
    scores = scores + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    p = scores.softmax(dim=-1)
    o_lat = torch.einsum("bhts,bsl->bthl", p, latent)
    return torch.einsum("bthl,hvl->bthv", o_lat, w_uv).to(out_dtype)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    absorbed: bool = False,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of queries ``[B, T, H, ·]`` over ``S`` cached latents; ``mask [B, T, S]`` bool (True = attend;
    None = every query sees every key, or plain causal attention with ``causal=True``, which needs T == S).
    Returns ``[B, T, H, v]`` in the query dtype."""
    _check(q_nope, q_rope, latent, k_rope, w_uk, w_uv, mask)
    if causal:
        T, S = q_nope.shape[1], latent.shape[1]
        if mask is not None or T != S:
            raise ValueError(f"mla_attention: causal=True needs mask=None and as many queries as keys, got {T} vs {S}")
        if absorbed:
            mask = torch.ones(T, T, dtype=torch.bool, device=q_nope.device).tril()[None].expand(q_nope.shape[0], -1, -1)
    if absorbed:
        return mla_attention_absorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, mask)
    H = q_nope.shape[2]
    k_nope = torch.einsum("bsl,hdl->bhsd", latent, w_uk.to(latent.dtype))
    v = torch.einsum("bsl,hdl->bhsd", latent, w_uv.to(latent.dtype))
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else mask[:, None], is_causal=causal, scale=scale
    )
    return o.transpose(1, 2)
