"""Triton kernel: one query token per sequence attends over its paged MLA latent cache (absorbed form).

Imported only when triton is importable (never on CPU machines); ``paged.py`` holds the torch reference it must
equal (``tests/rlk3/model/ops/test_mla_paged.py``, marked ``gpu``).

Grid ``(B, cdiv(H, BLOCK_H), splits)``: a program owns one sequence, a tile of heads and a share of the sequence's
tokens (flash-decoding: at small batch one program per sequence would leave most SMs idle), walks its share in
tiles of ``BLOCK_T`` (a divisor of the page size where it can be, so a tile lies in one page and reads one table
entry; the engine allows pages of 1-8 tokens too, whose tiles span several pages and read a table entry per row),
and keeps a FlashAttention online softmax over the latent; the shares are merged by their log-sum-exps. All heads
of a tile share each loaded latent tile (MLA's keys and values are one shared head), which is what makes absorbed
decode bandwidth-efficient. Scores and the accumulator are fp32; the cache may be bf16/fp16 (tensor-core dots in
that dtype, as FlashAttention does) or fp32 (exact fp32 dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_latent_attention_kernel(
    Q_LAT, Q_ROPE, LAT, ROPE, TABLES, SEQ_LENS, OUT, LSE,
    stride_qb, stride_qh,
    stride_rb, stride_rh,
    stride_lp, stride_lt,
    stride_pp, stride_pt,
    stride_tb,
    stride_ob, stride_os, stride_oh,
    stride_eb, stride_es,
    scale,
    H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr, HAS_ROPE: tl.constexpr, PRECISION: tl.constexpr, WHOLE_PAGES: tl.constexpr,
):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_l = offs_l < L
    mask_r = offs_r < R
    # dots in the cache's dtype with fp32 accumulation: tensor cores for bf16/fp16 caches (FlashAttention's
    # numerics), exact fp32 ("ieee") for fp32 caches
    dot_dtype = LAT.dtype.element_ty

    q_lat = tl.load(
        Q_LAT + b * stride_qb + offs_h[:, None] * stride_qh + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :], other=0.0,
    ).to(dot_dtype)
    if HAS_ROPE:
        q_rope = tl.load(
            Q_ROPE + b * stride_rb + offs_h[:, None] * stride_rh + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :], other=0.0,
        ).to(dot_dtype)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    # this program's share of the sequence: whole BLOCK_T tiles (with WHOLE_PAGES a tile never straddles a page)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_T) * BLOCK_T
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < hi
        in_page = offs_t % PAGE
        if WHOLE_PAGES:  # BLOCK_T divides PAGE, so the whole tile lies in one page: one table entry
            page = tl.load(TABLES + b * stride_tb + start // PAGE).to(tl.int64)
        else:  # pages smaller than a tile (tl.dot needs 16 rows): each row reads its own page from the table
            page = tl.load(TABLES + b * stride_tb + offs_t // PAGE, mask=mask_t, other=0).to(tl.int64)
        lat_rows = page * stride_lp + in_page * stride_lt  # [BLOCK_T] (the scalar page broadcasts)
        rope_rows = page * stride_pp + in_page * stride_pt
        lat = tl.load(
            LAT + lat_rows[:, None] + offs_l[None, :], mask=mask_t[:, None] & mask_l[None, :], other=0.0,
        ).to(dot_dtype)  # [BLOCK_T, BLOCK_L]
        s = tl.dot(q_lat, tl.trans(lat), input_precision=PRECISION)  # [BLOCK_H, BLOCK_T] fp32
        if HAS_ROPE:
            rope = tl.load(
                ROPE + rope_rows[:, None] + offs_r[None, :], mask=mask_t[:, None] & mask_r[None, :], other=0.0,
            ).to(dot_dtype)
            s += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        s = tl.where(mask_t[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), lat, input_precision=PRECISION)
        m_i = m_new
    # an empty share (a short sequence split many ways) writes out 0 and a log-sum-exp of -inf: weight 0
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(
        OUT + b * stride_ob + split * stride_os + offs_h[:, None] * stride_oh + offs_l[None, :], out,
        mask=mask_h[:, None] & mask_l[None, :],
    )
    if SPLITS > 1:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_eb + split * stride_es + offs_h, lse, mask=mask_h)


# programs to aim for: a few per SM of an H100/H200 (132 SMs), so a small decode batch still fills the GPU
TARGET_PROGRAMS = 264
MAX_SPLITS = 64


def num_splits(batch: int, head_tiles: int, max_tokens: int, block_t: int) -> int:
    """How many ways each sequence's tokens are split (flash-decoding): enough programs to fill the GPU at small
    batch, never more than the table could hold tiles. Depends on shapes only, so a CUDA graph can fix it."""
    want = -(-TARGET_PROGRAMS // (batch * head_tiles))
    return max(1, min(want, MAX_SPLITS, -(-max_tokens // block_t)))


def paged_latent_attention_triton(q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, scale):
    """q_lat ``[B, H, L]`` fp32, q_rope ``[B, H, R]`` fp32 over the pages → attended latent ``[B, H, L]`` fp32.
    Shapes are checked by the caller (``paged.paged_mla_decode``). With several splits per sequence each writes
    its normalised partial output and log-sum-exp, merged here exactly (as ``runner._prefix_causal`` merges)."""
    B, H, L = q_lat.shape
    R = q_rope.shape[-1]
    page = latent_pages.shape[1]
    half = latent_pages.dtype in (torch.float16, torch.bfloat16)
    q_lat = q_lat.contiguous()
    q_rope = q_rope.contiguous()
    # the kernel reads a table row and the lengths without their inner strides (a no-op for the engine's own)
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    block_l = max(16, triton.next_power_of_2(L))
    block_r = max(16, triton.next_power_of_2(max(R, 1)))
    block_h = 16  # tl.dot needs >= 16 rows; heads past H are masked
    # a latent tile is BLOCK_T x BLOCK_L in registers: keep it near 8K fp32 / 16K half elements
    # (a power of two, as block_l is), at least 16 rows for tl.dot, and a divisor of the page where one is: pages
    # of 1-8 tokens (EngineConfig allows any power of two) take the per-row table reads instead of a refusal
    block_t = max(16, min(64, (16384 if half else 8192) // block_l))
    while block_t > 16 and page % block_t:
        block_t //= 2
    head_tiles = triton.cdiv(H, block_h)
    splits = num_splits(B, head_tiles, block_tables.shape[1] * page, block_t)
    out = torch.empty(B, splits, H, L, dtype=torch.float32, device=q_lat.device)
    # one split: the kernel writes no log-sum-exp (SPLITS is a constexpr), so any tensor fills the argument
    lse = torch.empty(B, splits, H, dtype=torch.float32, device=q_lat.device) if splits > 1 else out
    grid = (B, head_tiles, splits)
    _paged_latent_attention_kernel[grid](
        q_lat, q_rope, latent_pages, rope_pages, block_tables, seq_lens, out, lse,
        q_lat.stride(0), q_lat.stride(1),
        q_rope.stride(0), q_rope.stride(1),
        latent_pages.stride(0), latent_pages.stride(1),
        rope_pages.stride(0), rope_pages.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        scale,
        H=H, L=L, R=R, PAGE=page, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r, BLOCK_T=block_t,
        SPLITS=splits, HAS_ROPE=R > 0, PRECISION="tf32" if half else "ieee", WHOLE_PAGES=page % block_t == 0,
        num_warps=4,
    )
    if splits == 1:
        return out[:, 0]
    w = torch.softmax(lse, dim=1)  # [B, S, H]: every sequence has a token, so some split's weight is > 0
    return (out * w[..., None]).sum(dim=1)
