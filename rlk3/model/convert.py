"""Map a transformers ``KimiLinearForCausalLM`` onto ``K3ForCausalLM`` with the K3-only extras switched off.

Kimi Linear is K3's published ancestor: the same KDA + MLA hybrid without the bounded gate, the latent MoE,
SiTU, Attention Residuals, the MLA output gate, the full-rank KDA output gate and q compression. With those
switches off (see ``K3Config``'s table) our model computes the same function, which makes transformers' own
implementation an external oracle for ours. Weights are copied, never shared.
"""

from __future__ import annotations

import torch

from rlk3.model.configuration_k3 import K3Config
from rlk3.model.modeling_k3 import K3ForCausalLM


class ConversionError(ValueError):
    """A Kimi Linear feature rlk3's model does not express; the message names it."""


def k3_config_from_kimi_linear(hf_config) -> K3Config:
    """The K3Config equivalent to a ``KimiLinearConfig`` (all K3-only extras off)."""
    types = list(hf_config.layer_types)
    mlp_types = list(hf_config.mlp_layer_types)
    n_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    if any(t == "dense" for t in mlp_types[n_dense:]):
        raise ConversionError(f"dense feed-forward layers must come first (first_k_dense_replace); got {mlp_types}")
    if getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads) != hf_config.num_attention_heads:
        raise ConversionError("MLA with num_key_value_heads != num_attention_heads is not supported")
    if getattr(hf_config, "n_group", 1) not in (None, 1) or getattr(hf_config, "topk_group", 1) not in (None, 1):
        raise ConversionError("group-limited routing (n_group/topk_group > 1) is not supported")
    if getattr(hf_config, "attention_bias", False):
        raise ConversionError("MLA projections with biases (attention_bias=True) are not supported")
    if hf_config.hidden_act != "silu":
        raise ConversionError(f"only hidden_act='silu' maps onto K3's switches, got {hf_config.hidden_act!r}")
    full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
    return K3Config(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_hidden_layers=hf_config.num_hidden_layers,
        full_attn_layers=full,
        final_layer_global=types[-1] == "full_attention",
        kda_num_heads=hf_config.linear_num_heads,
        kda_head_dim=hf_config.linear_head_dim,
        kda_conv_kernel_size=hf_config.linear_conv_kernel_dim,
        kda_gate="softplus",
        kda_output_gate_rank=hf_config.linear_head_dim,
        num_attention_heads=hf_config.num_attention_heads,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        mla_output_gate=False,
        intermediate_size=hf_config.intermediate_size,
        num_experts=hf_config.num_local_experts,
        num_experts_per_token=hf_config.num_experts_per_tok,
        num_shared_experts=hf_config.n_shared_experts,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        routed_expert_hidden_size=None,
        first_k_dense_replace=n_dense,
        routed_scaling_factor=hf_config.routed_scaling_factor,
        moe_renormalize=hf_config.norm_topk_prob,
        hidden_act="silu",
        attn_res_block_size=0,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=hf_config.tie_word_embeddings,
    )


def _kimi_state_to_k3(hf_state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    dim = config.kda_dim
    for name, tensor in hf_state.items():
        t = tensor.detach().clone()
        if ".self_attn.conv1d.weight" in name:  # one depthwise conv over [q; k; v] -> three convs
            prefix = name.replace("conv1d.weight", "")
            q, k, v = t.squeeze(1).split(dim, dim=0)
            out[prefix + "q_conv.weight"], out[prefix + "k_conv.weight"], out[prefix + "v_conv.weight"] = q, k, v
            continue
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        if name.endswith(".self_attn.A_log"):
            t = t.reshape(-1)  # [1, 1, H, 1] -> [H]
        name = name.replace(".mlp.gate.weight", ".mlp.router.weight")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.router.e_score_correction_bias")
        out[name] = t
    return out


def from_kimi_linear(hf_model) -> K3ForCausalLM:
    """A ``K3ForCausalLM`` computing the same function as the given ``KimiLinearForCausalLM``."""
    config = k3_config_from_kimi_linear(hf_model.config)
    model = K3ForCausalLM(config).to(dtype=next(hf_model.parameters()).dtype)
    state = _kimi_state_to_k3(hf_model.state_dict(), config)
    ours = model.state_dict()
    missing = sorted(set(ours) - set(state))
    unexpected = sorted(set(state) - set(ours))
    if missing or unexpected:
        raise ConversionError(f"weight names do not line up: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(ours[name].shape):
            raise ConversionError(f"{name}: Kimi Linear shape {list(t.shape)} != K3 shape {list(ours[name].shape)}")
    model.load_state_dict(state, strict=True)
    return model.eval() if not hf_model.training else model
