"""K3Config: presets, validation messages, and the cache arithmetic of the write-up."""

import pytest
import torch

from rlk3.model import K3Config, K3ConfigError


def test_presets_build_and_default_is_tiny():
    tiny = K3Config.preset("k3-tiny")
    assert tiny.to_dict() == K3Config().to_dict()
    assert tiny.layer_kinds == ["kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"]
    assert tiny.mlp_types[0] == "dense" and set(tiny.mlp_types[1:]) == {"moe"}
    full = K3Config.preset("k3-full")
    assert full.num_hidden_layers == 93 and len(full.full_attn_layers) == 24
    assert full.full_attn_layers[:3] == [4, 8, 12] and full.full_attn_layers[-2:] == [92, 93]
    assert full.layer_kinds.count("kda") == 69
    assert K3Config.preset("k3-tiny", vocab_size=300).vocab_size == 300


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(K3ConfigError, match=r"unknown K3 preset 'k3-huge'.*k3-full.*k3-small.*k3-tiny"):
        K3Config.preset("k3-huge")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"full_attn_layers": [4, 9]}, r"full_attn_layers: layer 9 is out of range; layers are 1-indexed in \[1, 8\]"),
        ({"full_attn_layers": [0, 8]}, r"layer 0 is out of range"),
        ({"full_attn_layers": [4]}, r"must include the last layer 8 when final_layer_global=True"),
        ({"full_attn_layers": [8, 4]}, r"strictly increasing"),
        ({"full_attn_layers": "4,8"}, r"must be a list of 1-indexed layer numbers, got '4,8'"),
        ({"hidden_size": 0}, r"K3Config.hidden_size must be an int >= 1, got 0"),
        ({"kda_num_heads": 2.5}, r"K3Config.kda_num_heads must be an int >= 1, got 2.5"),
        ({"kda_gate": "relu"}, r"K3Config.kda_gate must be one of \['bounded', 'softplus'\], got 'relu'"),
        ({"kda_gate_lower_bound": -6.0}, r"kda_gate_lower_bound must be in \[-5, 0\)"),
        ({"kda_gate_lower_bound": 0.0}, r"kda_gate_lower_bound must be in \[-5, 0\)"),
        ({"hidden_act": "gelu"}, r"hidden_act must be one of \['situ', 'silu'\]"),
        ({"num_experts_per_token": 16}, r"num_experts_per_token must be < num_experts=16"),
        ({"first_k_dense_replace": 9}, r"first_k_dense_replace must be in \[0, num_hidden_layers=8\]"),
        ({"routed_expert_hidden_size": 512}, r"routed_expert_hidden_size must be <= hidden_size=128"),
        ({"kda_chunk_size": 128}, r"kda_chunk_size must be one of \[16, 32, 64\]"),
        ({"situ_beta": 0}, r"situ_beta must be a number > 0"),
        ({"kda_head_dim": 512}, r"kda_head_dim must be <= 256"),
        ({"attn_res_block_size": -1}, r"attn_res_block_size must be an int >= 0"),
        # the default layout was computed from these before validation: a TypeError named neither key nor value
        ({"num_hidden_layers": "8"}, r"K3Config.num_hidden_layers must be an int >= 1, got '8'"),
        ({"num_hidden_layers": 2.5}, r"K3Config.num_hidden_layers must be an int >= 1, got 2.5"),
        ({"full_attn_layers": 8}, r"full_attn_layers must be a list of 1-indexed layer numbers, got 8"),
    ],
)
def test_invalid_config_names_key_and_valid_range(overrides, match):
    with pytest.raises(K3ConfigError, match=match):
        K3Config(**overrides)


def test_final_layer_global_off_allows_a_kda_last_layer():
    cfg = K3Config(full_attn_layers=[4], final_layer_global=False)
    assert cfg.layer_kinds[-1] == "kda"


def test_cache_bytes_reproduces_the_write_up():
    full = K3Config.preset("k3-full")
    per_token = full.cache_bytes(1) - full.cache_bytes(0)
    assert per_token == 24 * 1152 == 27_648  # 24 MLA layers x (512 + 64) x 2 bytes
    fixed_mib = full.cache_bytes(0) / 2**20
    assert round(fixed_mib, 2) == 221.55  # 69 x (96 x 128 x 128 x 2 + 3 x 12288 x 3 x 2) bytes
    assert full.cache_bytes(4096) == full.cache_bytes(0) + 4096 * 27_648
    # the same model with all 93 layers MLA: it stores less until ~2,923 tokens
    all_mla = K3Config.preset("k3-full", full_attn_layers=list(range(1, 94)))
    assert all_mla.cache_bytes(0) == 0 and all_mla.cache_bytes(1) == 93 * 1152
    break_even = full.cache_bytes(0) / (all_mla.cache_bytes(1) - per_token)
    assert abs(break_even - 2923) < 1
    assert full.cache_bytes(2922) > all_mla.cache_bytes(2922)
    assert full.cache_bytes(2924) < all_mla.cache_bytes(2924)
    # the runtime keeps the recurrent state in fp32: the fixed part grows, the per-token part does not
    fp32_state = full.cache_bytes(0, torch.bfloat16, state_dtype=torch.float32)
    assert fp32_state - full.cache_bytes(0) == 69 * 96 * 128 * 128 * 2
    with pytest.raises(K3ConfigError, match="seq_len must be an int >= 0"):
        full.cache_bytes(-1)


def test_config_round_trips_through_json(tmp_path):
    cfg = K3Config.preset("k3-tiny", kda_gate="softplus", q_lora_rank=None, attn_res_block_size=0)
    cfg.save_pretrained(tmp_path)
    back = K3Config.from_pretrained(tmp_path)
    assert back.to_dict() == cfg.to_dict()
    assert back.layer_kinds == cfg.layer_kinds
