"""Paged MLA decode (absorbed) equals the contiguous absorbed form; the Triton kernel equals the torch path."""

import pytest
import torch

from rlk3.model.ops.mla import mla_attention, paged_mla_decode
from tests._util import rel_err


def _case(B=5, H=4, N=16, R=8, L=24, V=12, bs=16, P=30, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype).to(device)  # noqa: E731
    lens = torch.randint(1, 4 * bs + 5, (B,), generator=gen)
    blocks = (lens + bs - 1) // bs
    width = int(blocks.max())
    perm = torch.randperm(P, generator=gen)
    tables = torch.zeros(B, width, dtype=torch.long)
    used = 0
    for b in range(B):  # each sequence gets its own scattered pages; the rest of a row is padding
        tables[b, : blocks[b]] = perm[used : used + blocks[b]]
        used += int(blocks[b])
    # pages inside wider pages (the engine's pages also hold other layers): a strided page axis
    wide = rnd(P, bs, L + R + 3)
    latent_pages, rope_pages = wide[..., :L], wide[..., L : L + R]
    return dict(
        q_nope=rnd(B, H, N), q_rope=rnd(B, H, R), latent_pages=latent_pages, rope_pages=rope_pages,
        block_tables=tables.to(device), seq_lens=lens.to(device), w_uk=rnd(H, N, L) * 0.2, w_uv=rnd(H, V, L) * 0.2,
    )


def _contiguous_reference(c, scale):
    outs = []
    for b in range(c["q_nope"].shape[0]):
        n = int(c["seq_lens"][b])
        pages = c["block_tables"][b]
        latent = c["latent_pages"][pages].flatten(0, 1)[:n][None]
        rope = c["rope_pages"][pages].flatten(0, 1)[:n][None]
        o = mla_attention(
            c["q_nope"][b : b + 1, None], c["q_rope"][b : b + 1, None], latent, rope, c["w_uk"], c["w_uv"], scale,
            absorbed=True,
        )
        outs.append(o[0, 0])
    return torch.stack(outs)


def test_paged_equals_contiguous_absorbed_attention():
    c = _case()
    got = paged_mla_decode(**c, scale=0.2)
    assert got.shape == (5, 4, 12) and got.dtype == torch.float64
    assert rel_err(got, _contiguous_reference(c, 0.2)) <= 1e-6  # fp32 inside, fp64 reference


def test_paged_decode_ignores_padding_pages():
    c = _case()
    base = paged_mla_decode(**c, scale=0.2)
    # garbage (even inf) past each sequence's length and in unused pages must not leak in
    for b in range(c["q_nope"].shape[0]):
        n = int(c["seq_lens"][b])
        bs = c["latent_pages"].shape[1]
        last = c["block_tables"][b, (n - 1) // bs]
        c["latent_pages"][last, (n - 1) % bs + 1 :] = float("inf")
    assert torch.equal(paged_mla_decode(**c, scale=0.2), base)


def test_bad_arguments_are_named():
    c = _case()
    with pytest.raises(ValueError, match=r"`rope_pages` must be \[P, block_size, R\]"):
        paged_mla_decode(**{**c, "rope_pages": c["rope_pages"][:, :, :3]}, scale=0.2)
    with pytest.raises(ValueError, match=r"`block_tables` must be an int32/int64 \[B=5, max_blocks\]"):
        paged_mla_decode(**{**c, "block_tables": c["block_tables"].float()}, scale=0.2)
    with pytest.raises(ValueError, match="backend"):
        paged_mla_decode(**c, scale=0.2, backend="cuda")
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        paged_mla_decode(**c, scale=0.2, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("L,R,H,bs", [(24, 8, 4, 16), (256, 32, 8, 512), (512, 64, 16, 64)])
@pytest.mark.parametrize("B", [9, 300], ids=["split", "unsplit"])
def test_triton_paged_decode_equals_torch_reference(dtype, L, R, H, bs, B):
    """B = 9: each sequence split many ways (most shares of the short ones empty), merged by log-sum-exp;
    B = 300: enough programs without splitting."""
    c = _case(B=B, H=H, N=32, R=R, L=L, V=32, bs=bs, P=5 * B + 20, dtype=dtype, device="cuda")
    ref = paged_mla_decode(**c, scale=0.1, backend="torch")
    got = paged_mla_decode(**c, scale=0.1, backend="triton")
    assert rel_err(got.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)


def _small_pages(c, bs):
    """``c`` (16-token pages, sequences of up to 68 tokens) on pages of ``bs`` tokens: page p's token j is page
    ``p · 16 / bs + j // bs``'s token ``j % bs`` (the same memory, the page axis still strided)."""
    split = c["latent_pages"].shape[1] // bs
    tables = (c["block_tables"][:, :, None] * split + torch.arange(split, device=c["block_tables"].device)).flatten(1)
    return {**c, "latent_pages": c["latent_pages"].view(-1, bs, c["latent_pages"].shape[-1]),
            "rope_pages": c["rope_pages"].view(-1, bs, c["rope_pages"].shape[-1]), "block_tables": tables}


def test_small_pages_hold_the_same_cache():
    """(The case the GPU test below runs the kernel on: the re-paged cache is the same cache.)"""
    c = _case(B=9, bs=16, P=65)
    want = paged_mla_decode(**c, scale=0.2)
    for bs in (1, 4, 8):
        small = _small_pages(c, bs)
        assert small["latent_pages"].shape[1] == bs and small["block_tables"].shape[1] > c["block_tables"].shape[1]
        assert torch.equal(paged_mla_decode(**small, scale=0.2), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [1, 4, 8])
def test_triton_paged_decode_takes_pages_under_16_tokens(dtype, bs):
    """EngineConfig takes any power-of-two ``block_size`` (the CPU stress runs 4-token pages), and the auto one is
    8 when ``prefix_block_tokens`` is 24, say; the launcher refused pages under 16 tokens ("must be a multiple of
    16", a tile of tl.dot's 16 rows lying in one page), so such an engine raised at its first decode step on CUDA.
    A tile now spans several small pages, each row reading its own table entry; sequences of up to 68 tokens, so
    that tiles and splits cross pages."""
    c = _small_pages(_case(B=9, H=8, N=32, R=8, L=64, V=32, bs=16, P=65, dtype=dtype, device="cuda"), bs)
    ref = paged_mla_decode(**c, scale=0.1, backend="torch")
    got = paged_mla_decode(**c, scale=0.1, backend="triton")
    assert rel_err(got.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_paged_decode_reads_strided_tables_and_lengths():
    """A block table or lengths that are views with an inner stride (every other column of a wider table, a column of
    a [B, 2] tensor): the kernel read them as if dense, so it attended over the wrong pages and lengths."""
    c = _case(B=9, H=8, N=32, R=8, L=64, V=32, bs=16, P=65, dtype=torch.float32, device="cuda")
    ref = paged_mla_decode(**c, scale=0.1, backend="torch")
    # the columns and lengths between are in range (page 0, one token): read as dense, wrong but no bad address
    tables = torch.zeros(9, 2 * c["block_tables"].shape[1], dtype=torch.long, device="cuda")
    tables[:, ::2] = c["block_tables"]
    lens = torch.stack([c["seq_lens"], torch.ones_like(c["seq_lens"])], dim=1)
    got = paged_mla_decode(**{**c, "block_tables": tables[:, ::2], "seq_lens": lens[:, 0]}, scale=0.1,
                           backend="triton")
    assert rel_err(got, ref) <= 1e-5
