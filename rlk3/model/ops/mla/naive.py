"""Multi-head latent attention, the reference form: decompress keys and values from the cached latent.

Per token an MLA layer caches only ``c`` (the normalised KV latent, ``kv_lora_rank`` wide) and ``k_r`` (a
``qk_rope_head_dim`` slice shared by all heads; K3 is NoPE, so it is never rotated). Head ``h`` sees
``k_h = [W_UK_h c ; k_r]`` and ``v_h = W_UV_h c``, where ``kv_b_proj`` stacks ``[W_UK_h ; W_UV_h]`` per head.
"""

from __future__ import annotations

import torch


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int):
    """``kv_b_proj.weight [H·(nope+v), L]`` → ``W_UK [H, nope, L]``, ``W_UV [H, v, L]``."""
    w = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
    return w[:, :nope_dim], w[:, nope_dim:]


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """q_nope ``[B, T, H, nope]``, q_rope ``[B, T, H, R]``, latent ``[B, S, L]``, k_rope ``[B, S, R]``,
    mask ``[B, T, S]`` (True = may attend) → ``[B, T, H, v]``. Softmax in fp32."""
    out_dtype = q_nope.dtype
    f = torch.promote_types(q_nope.dtype, torch.float32)  # fp32 at least, fp64 for fp64 inputs
    q_nope, q_rope, latent, k_rope, w_uk, w_uv = (t.to(f) for t in (q_nope, q_rope, latent, k_rope, w_uk, w_uv))
    k_nope = torch.einsum("bsl,hdl->bshd", latent, w_uk)
    v = torch.einsum("bsl,hdl->bshd", latent, w_uv)
    scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope)
    scores = scores + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    p = scores.softmax(dim=-1)
    return torch.einsum("bhts,bshd->bthd", p, v).to(out_dtype)
