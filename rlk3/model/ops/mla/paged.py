"""MLA decode over a paged latent cache, with absorbed weights.

A serving engine keeps each MLA layer's cache as pages of ``block_size`` tokens, ``latent_pages [P, bs, L]`` and
``rope_pages [P, bs, R]`` (the engine's views may be strided along the page axis: its pages also hold other
layers). Sequence ``b`` owns the pages ``block_tables[b, :ceil(seq_lens[b] / bs)]`` in order; its token ``t``
sits at ``(block_tables[b, t // bs], t % bs)``. One query token per sequence attends over its ``seq_lens[b]``
cached tokens (the new token's own entry already written).

Absorbed form (DeepSeek-V2 §2.1): ``q̃_h = W_UK_hᵀ q_h`` scores against the latent directly, the attended latent
is lifted by ``W_UV_h`` afterwards, so per-head keys and values are never formed and a step reads 576 numbers per
cached token at K3 size. ``backend=None`` takes the Triton kernel (``triton_paged.py``) for CUDA tensors when
triton imports, the torch reference otherwise; ``"torch"`` / ``"triton"`` force one.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = (None, "torch", "triton")


@functools.cache
def _triton_kernel():
    """The Triton launcher, or None when triton does not import (every CPU machine: triton is never installed)."""
    try:
        from rlk3.model.ops.mla.triton_paged import paged_latent_attention_triton
    except Exception:  # ImportError without triton; other errors from a broken triton install
        return None
    return paged_latent_attention_triton


def _check(q_nope, q_rope, latent_pages, rope_pages, block_tables, seq_lens, w_uk, w_uv):
    fn = "paged_mla_decode"
    if q_nope.dim() != 3:
        raise ValueError(
            f"{fn}: `q_nope` must be [B, H, nope] (one query token per sequence), got {list(q_nope.shape)}"
        )
    B, H, N = q_nope.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (B, H):
        raise ValueError(f"{fn}: `q_rope` must be [B, H, R] with B={B}, H={H}, got {list(q_rope.shape)}")
    R = q_rope.shape[2]
    if latent_pages.dim() != 3:
        raise ValueError(f"{fn}: `latent_pages` must be [P, block_size, L], got {list(latent_pages.shape)}")
    P, bs, L = latent_pages.shape
    if tuple(rope_pages.shape) != (P, bs, R):
        raise ValueError(f"{fn}: `rope_pages` must be [P, block_size, R]={[P, bs, R]}, got {list(rope_pages.shape)}")
    if latent_pages.stride(-1) != 1 or rope_pages.stride(-1) != 1:
        raise ValueError(f"{fn}: the last axis of `latent_pages` / `rope_pages` must be contiguous")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: `block_tables` must be an int32/int64 [B={B}, max_blocks] tensor, "
            f"got {block_tables.dtype} {list(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: `seq_lens` must be an int32/int64 [B={B}] tensor, got {seq_lens.dtype} {list(seq_lens.shape)}"
        )
    if tuple(w_uk.shape) != (H, N, L):
        raise ValueError(f"{fn}: `w_uk` must be [H, nope, L]={[H, N, L]}, got {list(w_uk.shape)}")
    if w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != L:
        raise ValueError(f"{fn}: `w_uv` must be [H, v, L] with H={H}, L={L}, got {list(w_uv.shape)}")


def paged_latent_attention_torch(q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, scale):
    """The reference: gather each sequence's pages into ``[B, max_blocks·bs, ·]``, mask past ``seq_lens``, softmax in
    fp32. q_lat ``[B, H, L]`` fp32 → attended latent ``[B, H, L]`` fp32."""
    B, _, L = q_lat.shape
    bs = latent_pages.shape[1]
    tables = block_tables.long()
    valid = torch.arange(tables.shape[1] * bs, device=q_lat.device)[None, :] < seq_lens.long()[:, None]
    # zero what lies past each sequence: a softmax weight of 0 times a stale non-finite entry would still be NaN
    latent = latent_pages[tables].reshape(B, -1, L).float().masked_fill(~valid[..., None], 0.0)  # [B, S_max, L]
    rope = rope_pages[tables].reshape(B, latent.shape[1], -1).float().masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("bhl,bsl->bhs", q_lat, latent) + torch.einsum("bhr,bsr->bhs", q_rope.float(), rope)
    scores = scores * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsl->bhl", scores.softmax(dim=-1), latent)


def paged_mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_pages: torch.Tensor,
    rope_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """q_nope ``[B, H, nope]``, q_rope ``[B, H, R]`` (one query per sequence) over the paged cache (module
    docstring). Every ``seq_lens[b] >= 1``. Returns ``[B, H, v]`` in the query dtype; the attention runs in fp32."""
    if backend not in BACKENDS:
        raise ValueError(f"paged_mla_decode: `backend` must be one of {BACKENDS}, got {backend!r}")
    _check(q_nope, q_rope, latent_pages, rope_pages, block_tables, seq_lens, w_uk, w_uv)
    out_dtype = q_nope.dtype
    # absorb W_UK into the query once per step: [B, H, nope] x [H, nope, L] -> [B, H, L]
    q_lat = torch.einsum("bhd,hdl->bhl", q_nope.float(), w_uk.float())
    use_triton = backend == "triton" or (backend is None and q_nope.is_cuda and _triton_kernel() is not None)
    if use_triton:
        kernel = _triton_kernel()
        if kernel is None or not q_nope.is_cuda:
            raise RuntimeError("paged_mla_decode: backend='triton' needs CUDA tensors and an importable triton")
        o_lat = kernel(q_lat, q_rope.float(), latent_pages, rope_pages, block_tables, seq_lens, scale)
    else:
        o_lat = paged_latent_attention_torch(q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, scale)
    # lift the attended latent by W_UV: [B, H, L] x [H, v, L] -> [B, H, v]
    return torch.einsum("bhl,hvl->bhv", o_lat, w_uv.float()).to(out_dtype)
