"""Triton kernel: one query token per sequence attends over its paged MLA latent cache (absorbed form).

Imported only when triton is importable (never on CPU machines); ``paged.py`` holds the torch reference it must
equal (``tests/rlk3/model/ops/test_mla_paged.py``, marked ``gpu``).

Grid ``(B, cdiv(H, BLOCK_H))``: a program owns one sequence and a tile of heads, walks the sequence's tokens in
tiles of ``BLOCK_T`` (a divisor of the page size, so a tile never straddles a page), and keeps a FlashAttention
online softmax over the latent. All heads of a tile share each loaded latent tile (MLA's keys and values are one
shared head), which is what makes absorbed decode bandwidth-efficient. Scores and the accumulator are fp32; the
cache may be bf16/fp16/fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_latent_attention_kernel(
    Q_LAT, Q_ROPE, LAT, ROPE, TABLES, SEQ_LENS, OUT,
    stride_qb, stride_qh,
    stride_rb, stride_rh,
    stride_lp, stride_lt,
    stride_pp, stride_pt,
    stride_tb,
    stride_ob, stride_oh,
    scale,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_l = offs_l < L
    mask_r = offs_r < R

    q_lat = tl.load(
        Q_LAT + b * stride_qb + offs_h[:, None] * stride_qh + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_ROPE:
        q_rope = tl.load(
            Q_ROPE + b * stride_rb + offs_h[:, None] * stride_rh + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :], other=0.0,
        ).to(tl.float32)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < seq_len
        # BLOCK_T divides PAGE, so the whole tile lies in one page
        page = tl.load(TABLES + b * stride_tb + start // PAGE).to(tl.int64)
        in_page = offs_t % PAGE
        lat = tl.load(
            LAT + page * stride_lp + in_page[:, None] * stride_lt + offs_l[None, :],
            mask=mask_t[:, None] & mask_l[None, :], other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_L]
        s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")  # [BLOCK_H, BLOCK_T]
        if HAS_ROPE:
            rope = tl.load(
                ROPE + page * stride_pp + in_page[:, None] * stride_pt + offs_r[None, :],
                mask=mask_t[:, None] & mask_r[None, :], other=0.0,
            ).to(tl.float32)
            s += tl.dot(q_rope, tl.trans(rope), input_precision="ieee")
        s = tl.where(mask_t[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        OUT + b * stride_ob + offs_h[:, None] * stride_oh + offs_l[None, :], out,
        mask=mask_h[:, None] & mask_l[None, :],
    )


def paged_latent_attention_triton(q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, scale):
    """q_lat ``[B, H, L]`` fp32, q_rope ``[B, H, R]`` fp32 over the pages → attended latent ``[B, H, L]`` fp32.
    Shapes are checked by the caller (``paged.paged_mla_decode``)."""
    B, H, L = q_lat.shape
    R = q_rope.shape[-1]
    page = latent_pages.shape[1]
    q_lat = q_lat.contiguous()
    q_rope = q_rope.contiguous()
    out = torch.empty_like(q_lat)
    block_l = max(16, triton.next_power_of_2(L))
    block_r = max(16, triton.next_power_of_2(max(R, 1)))
    block_h = 16  # tl.dot needs >= 16 rows; heads past H are masked
    # a latent tile is BLOCK_T x BLOCK_L fp32 in registers: keep it near 8K elements
    block_t = max(16, min(64, 8192 // block_l, page))
    while page % block_t:
        block_t //= 2
    if block_t < 16:
        raise ValueError(f"paged_latent_attention_triton: the page size {page} must be a multiple of 16")
    grid = (B, triton.cdiv(H, block_h))
    _paged_latent_attention_kernel[grid](
        q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, out,
        q_lat.stride(0), q_lat.stride(1),
        q_rope.stride(0), q_rope.stride(1),
        latent_pages.stride(0), latent_pages.stride(1),
        rope_pages.stride(0), rope_pages.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale,
        H=H, L=L, R=R, PAGE=page, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_T=block_t,
        HAS_ROPE=R > 0, num_warps=4,
    )
    return out
