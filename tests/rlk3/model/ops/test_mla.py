"""MLA attention: SDPA over decompressed K/V and the weight-absorbed form both equal the reference."""

import pytest
import torch

from rlk3.model.ops.mla import mla_attention, mla_attention_reference
from tests._util import rel_err


def inputs(B=2, T=5, S=40, H=4, N=16, R=8, L=24, V=12, dtype=torch.float64):
    return (
        torch.randn(B, T, H, N, dtype=dtype), torch.randn(B, T, H, R, dtype=dtype),
        torch.randn(B, S, L, dtype=dtype), torch.randn(B, S, R, dtype=dtype),
        torch.randn(H, N, L, dtype=dtype) * 0.2, torch.randn(H, V, L, dtype=dtype) * 0.2,
    )


@pytest.mark.parametrize("absorbed", [False, True], ids=["decompressed", "absorbed"])
@pytest.mark.parametrize("masked", [False, True])
def test_forms_equal_the_reference(absorbed, masked):
    q_nope, q_rope, latent, k_rope, w_uk, w_uv = inputs()
    mask = torch.rand(2, 5, 40) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True
    ref = mla_attention_reference(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.2, mask)
    got = mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.2, mask, absorbed=absorbed)
    assert got.shape == (2, 5, 4, 12)
    assert rel_err(got, ref) <= 1e-10


@pytest.mark.parametrize("absorbed", [False, True], ids=["decompressed", "absorbed"])
def test_causal_flag_equals_explicit_mask(absorbed):
    q_nope, q_rope, latent, k_rope, w_uk, w_uv = inputs(T=33, S=33)
    tril = torch.ones(33, 33, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    ref = mla_attention_reference(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.2, tril)
    got = mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.2, absorbed=absorbed, causal=True)
    assert rel_err(got, ref) <= 1e-10


def test_bad_shapes_are_named():
    q_nope, q_rope, latent, k_rope, w_uk, w_uv = inputs()
    with pytest.raises(ValueError, match=r"`k_rope` must be \[B, S, R\]=\[2, 40, 8\]"):
        mla_attention(q_nope, q_rope, latent, k_rope[:, :3], w_uk, w_uv, 0.2)
    with pytest.raises(ValueError, match=r"`w_uk` must be \[H, nope, L\]=\[4, 16, 24\]"):
        mla_attention(q_nope, q_rope, latent, k_rope, w_uk[:, :3], w_uv, 0.2)
    with pytest.raises(ValueError, match=r"causal=True needs mask=None and as many queries as keys"):
        mla_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, 0.2, causal=True)
