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
