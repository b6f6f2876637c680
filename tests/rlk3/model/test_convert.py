"""External oracle: transformers' own Kimi Linear, mapped onto our model with the K3-only extras off."""

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from rlk3.model.convert import ConversionError, from_kimi_linear


def kimi_linear(q_lora_rank=None, layers=5, seed=0):
    torch.manual_seed(seed)
    full = [2, 5] if layers == 5 else [layers]
    cfg = KimiLinearConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={
            "full_attn_layers": full, "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
        },
    )
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # exercise the selection bias, which is zero at init
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


@torch.no_grad()
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["no_q_compression", "q_lora"])
def test_logits_match_transformers_kimi_linear(q_lora_rank):
    hf = kimi_linear(q_lora_rank)
    ours = from_kimi_linear(hf)
    assert ours.config.kda_gate == "softplus" and ours.config.attn_res_block_size == 0
    assert ours.config.full_attn_layers == [2, 5] and ours.config.hidden_act == "silu"
    x = torch.randint(0, 512, (2, 150))  # crosses the 64-token chunk border twice
    expected = hf(x).logits
    got = ours(x, use_cache=False).logits
    assert (got - expected).abs().max() <= 1e-5  # the issue asks 1e-4; the two agree to ~1e-8


@torch.no_grad()
def test_greedy_generation_follows_transformers_full_forward():
    """Our cached decoding reproduces argmax decoding of transformers' *full forward*. (transformers 5.24's own
    cached Kimi Linear decode departs from its full forward on this seed, by a logit gap of 0.02, so it is
    not used as the oracle here.)"""
    hf = kimi_linear(seed=3)
    ours = from_kimi_linear(hf)
    x = torch.randint(3, 512, (2, 40))
    seq = x
    for _ in range(20):
        seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ours.generate(x, max_new_tokens=20, do_sample=False), seq)


def test_unsupported_kimi_features_are_named():
    hf = kimi_linear()
    hf.config.hidden_act = "gelu"
    with pytest.raises(ConversionError, match="only hidden_act='silu'"):
        from_kimi_linear(hf)
