"""SiTU-GLU, the bounded KDA gate, Attention Residuals bookkeeping and the router."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlk3.model import K3Config, K3ForCausalLM
from rlk3.model.layers.attn_res import AttnResMixer, AttnResStream
from rlk3.model.layers.common import silu_glu, situ_glu
from rlk3.model.layers.moe import K3Router
from rlk3.model.ops.kda import kda_gate
from tests._util import rel_err


def test_situ_is_bounded_by_100_for_huge_inputs():
    x = torch.cat([torch.logspace(-3, 6, 500), -torch.logspace(-3, 6, 500), torch.tensor([0.0, 1e6, -1e6])])
    g, u = torch.meshgrid(x, x, indexing="ij")
    out = situ_glu(g, u, beta=4.0, linear_beta=25.0)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 100.0
    assert out.abs().max() > 99.0  # the bound is approached, not an artefact of small inputs


def test_situ_tends_to_silu_glu_as_beta_grows():
    g, u = torch.randn(1000, dtype=torch.float64) * 3, torch.randn(1000, dtype=torch.float64) * 3
    errors = [rel_err(situ_glu(g, u, beta=b, linear_beta=b), silu_glu(g, u)) for b in (10.0, 100.0, 1e4)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-6
    # and near the origin SiTU already is SwiGLU
    small = torch.linspace(-0.1, 0.1, 101, dtype=torch.float64)
    assert rel_err(situ_glu(small, small), silu_glu(small, small)) < 1e-3


def test_situ_computes_in_fp32_for_bf16_inputs():
    g = torch.tensor([7.3, -2.1], dtype=torch.bfloat16)
    u = torch.tensor([40.0, 3.3], dtype=torch.bfloat16)
    expected = situ_glu(g.float(), u.float()).to(torch.bfloat16)
    assert torch.equal(situ_glu(g, u), expected)


def test_bounded_gate_stays_in_range():
    x = torch.cat([torch.linspace(-1e4, 1e4, 20001), torch.tensor([-1e30, 1e30, 0.0])]).view(-1, 1, 1).expand(-1, 2, 4)
    A_log = torch.tensor([-3.0, 3.0])
    dt_bias = torch.randn(8)
    g = kda_gate(x, A_log, dt_bias, lower_bound=-5.0)
    assert (g >= -5.0).all() and (g < 0.0).all()
    assert math.isclose(float(g.min()), -5.0) and float(g.max()) > -1e-30
    # the softplus gate (Kimi Linear) is unbounded below: the reason K3 replaced it
    assert float(kda_gate(x, A_log, dt_bias, lower_bound=None).min()) < -1000


def test_attn_res_mixer_starts_uniform():
    mixer = AttnResMixer(8, eps=1e-5)
    torch.nn.init.zeros_(mixer.proj.weight)
    sources = [torch.randn(2, 3, 8) for _ in range(4)]
    assert torch.allclose(mixer(sources), torch.stack(sources).mean(0), atol=1e-6)
    mixer.proj.weight.data.normal_()
    assert not torch.allclose(mixer(sources), torch.stack(sources).mean(0), atol=1e-3)


class _CountingMixer:
    def __init__(self):
        self.calls = []

    def __call__(self, sources):
        self.calls.append(len(sources))
        return sources[-1]


@pytest.mark.parametrize("block", [1, 2, 3])
def test_attn_res_block_bookkeeping(block):
    """Pre-attention: ceil(i/B) completed blocks + the partial sum; pre-MLP one more block at a boundary."""
    layers = 7
    stream, mixer = AttnResStream(torch.zeros(1), block), _CountingMixer()
    expected = []
    for i in range(layers):
        stream.begin_layer(i)
        stream.read(mixer)
        stream.write(torch.ones(1))
        stream.read(mixer)
        stream.write(torch.ones(1))
        pre_attn = -(-i // block) + 1
        expected += [pre_attn, pre_attn + (1 if i % block == 0 else 0)]
    stream.final(mixer)
    expected.append(len(stream.blocks) + 1)
    assert mixer.calls == expected
    assert len(stream.blocks) == -(-layers // block)


def test_model_with_attn_res_off_is_a_plain_residual_model():
    cfg = K3Config(attn_res_block_size=0)
    model = K3ForCausalLM(cfg)
    assert not any("res" in n and "proj" in n for n, _ in model.named_parameters())
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    assert model(x, use_cache=False).logits.shape == (1, 12, cfg.vocab_size)


def test_router_selects_with_bias_but_weights_from_scores():
    cfg = K3Config()
    router = K3Router(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(64, cfg.hidden_size)
    idx0, w0 = router(x)
    assert idx0.shape == (64, cfg.num_experts_per_token)
    assert torch.allclose(w0.sum(-1), torch.ones(64))  # renormalised, scaling 1.0
    # a large bias on expert 3 forces it into every selection, yet its weight still comes from its score
    router.e_score_correction_bias[3] = 10.0
    idx, w = router(x)
    assert (idx == 3).any(-1).all()
    scores = torch.sigmoid(F.linear(x, router.weight))
    picked = scores.gather(1, idx)
    assert torch.allclose(w, picked / picked.sum(-1, keepdim=True), atol=1e-6)
    router.record_scores = True
    router(x)
    router(x[:10])
    recorded = router.pop_scores()
    assert recorded.shape == (74, cfg.num_experts) and router.pop_scores() is None
