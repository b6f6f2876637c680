"""K3Config: the hybrid layout and every dimension of a K3-style model, validated at construction.

The defaults are the ``k3-tiny`` preset (a few M parameters, the CPU default for everything downstream). Named
presets come from ``K3Config.preset(name, **overrides)``. Each K3-only extra is a switch, so that with all of them
off the model is Kimi Linear (``rlk3.model.convert.from_kimi_linear`` relies on this):

| K3 (default)                              | Kimi Linear                               |
| ----------------------------------------- | ----------------------------------------- |
| ``kda_gate="bounded"`` (−5·sigmoid)       | ``kda_gate="softplus"``                   |
| ``kda_output_gate_rank=None`` (full rank) | ``kda_output_gate_rank=<head_dim>``       |
| ``routed_expert_hidden_size=hidden/2``    | ``routed_expert_hidden_size=None``        |
| ``hidden_act="situ"``                     | ``hidden_act="silu"``                     |
| ``attn_res_block_size>0``                 | ``attn_res_block_size=0``                 |
| ``mla_output_gate=True``                  | ``mla_output_gate=False``                 |
| ``q_lora_rank=<int>``                     | ``q_lora_rank=None``                      |
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from numbers import Integral, Real

import torch
from transformers import PretrainedConfig

KDA_GATES = ("bounded", "softplus")
ACTIVATIONS = ("situ", "silu")
KDA_CHUNK_SIZES = (16, 32, 64)


def _mla_every_fourth(num_layers: int) -> list[int]:
    """Blocks of three KDA layers and one MLA layer, and the final layer MLA too (K3's layout)."""
    layers = list(range(4, num_layers + 1, 4))
    if not layers or layers[-1] != num_layers:
        layers.append(num_layers)
    return layers


PRESETS: dict[str, dict] = {
    # a few M parameters: the CPU default for tests, the demo and every downstream part
    "k3-tiny": {},
    # ~270M total / ~150M active: GPU benchmarks (KDA head dim 128 as in the real model, so FLA's fast paths apply)
    "k3-small": dict(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=12, full_attn_layers=[4, 8, 12],
        kda_num_heads=8, kda_head_dim=128, num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=128, intermediate_size=2816, num_experts=16,
        num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=384, routed_expert_hidden_size=512,
        attn_res_block_size=4,
    ),
    # the real K3 dimensions (the write-up and the public config); build it only on the meta device
    "k3-full": dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, full_attn_layers=_mla_every_fourth(93),
        kda_num_heads=96, kda_head_dim=128, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=33792, num_experts=896,
        num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, attn_res_block_size=12,
    ),
}


class K3ConfigError(ValueError):
    """An invalid K3Config value; the message names the key, the value and what would be valid."""


class K3Config(PretrainedConfig):
    model_type = "k3"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 128,
        num_hidden_layers: int = 8,
        full_attn_layers: list[int] | None = None,
        final_layer_global: bool = True,
        # Kimi Delta Attention
        kda_num_heads: int = 4,
        kda_head_dim: int = 32,
        kda_conv_kernel_size: int = 4,
        kda_gate: str = "bounded",
        kda_gate_lower_bound: float = -5.0,
        kda_output_gate_rank: int | None = None,
        kda_chunk_size: int = 64,
        # Gated MLA
        num_attention_heads: int = 4,
        q_lora_rank: int | None = 64,
        kv_lora_rank: int = 32,
        qk_nope_head_dim: int = 32,
        qk_rope_head_dim: int = 16,
        v_head_dim: int = 32,
        mla_output_gate: bool = True,
        mla_norm_eps: float = 1e-6,
        # feed-forward: a dense first layer, then Stable LatentMoE
        intermediate_size: int = 256,
        num_experts: int = 16,
        num_experts_per_token: int = 4,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 64,
        routed_expert_hidden_size: int | None = 64,
        latent_moe_use_norm: bool = True,
        first_k_dense_replace: int = 1,
        routed_scaling_factor: float = 1.0,
        moe_renormalize: bool = True,
        hidden_act: str = "situ",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        # Attention Residuals: layers per block, 0 = a plain residual stream
        attn_res_block_size: int = 4,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        # the default layout needs an int layer count: any other is refused by validate_k3 (naming it), not by a
        # TypeError here; a layout that is not a sequence of layers is kept as given, for it to name
        if full_attn_layers is None:
            full_attn_layers = _mla_every_fourth(num_hidden_layers) if isinstance(num_hidden_layers, Integral) else []
        self.full_attn_layers = (
            list(full_attn_layers) if isinstance(full_attn_layers, Iterable) and not isinstance(full_attn_layers, str)
            else full_attn_layers
        )
        self.final_layer_global = final_layer_global
        self.kda_num_heads = kda_num_heads
        self.kda_head_dim = kda_head_dim
        self.kda_conv_kernel_size = kda_conv_kernel_size
        self.kda_gate = kda_gate
        self.kda_gate_lower_bound = kda_gate_lower_bound
        self.kda_output_gate_rank = kda_output_gate_rank
        self.kda_chunk_size = kda_chunk_size
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_output_gate = mla_output_gate
        self.mla_norm_eps = mla_norm_eps  # the q/kv latent RMSNorms (DeepSeek/Kimi use 1e-6 there)
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_renormalize = moe_renormalize
        self.hidden_act = hidden_act
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta
        self.attn_res_block_size = attn_res_block_size
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # before PretrainedConfig's init, which reads layer_types: a bad layer count or layout raised a TypeError
        # there instead of the K3ConfigError naming it
        self.validate_k3()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    # ---------------------------------------------------------------- presets and derived facts

    @classmethod
    def preset(cls, name: str, **overrides) -> K3Config:
        """A named configuration (``k3-tiny``, ``k3-small``, ``k3-full``) with optional overrides."""
        if name not in PRESETS:
            raise K3ConfigError(f"unknown K3 preset {name!r}; valid presets: {sorted(PRESETS)}")
        return cls(**{**copy.deepcopy(PRESETS[name]), **overrides})

    @property
    def layer_kinds(self) -> list[str]:
        """Per 0-indexed layer: ``"mla"`` or ``"kda"``."""
        mla = set(self.full_attn_layers)
        return ["mla" if i + 1 in mla else "kda" for i in range(self.num_hidden_layers)]

    @property
    def layer_types(self) -> list[str]:
        """The same in transformers' vocabulary (``full_attention`` / ``linear_attention``), for HF utilities."""
        return ["full_attention" if kind == "mla" else "linear_attention" for kind in self.layer_kinds]

    @property
    def mlp_types(self) -> list[str]:
        """Per 0-indexed layer: ``"dense"`` for the first ``first_k_dense_replace`` layers, else ``"moe"``."""
        return ["dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_hidden_layers)]

    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Numbers cached per token per MLA layer: the latent plus the (unrotated) rope slice."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_bytes(
        self, seq_len: int, dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype | None = None
    ) -> int:
        """Generation-cache bytes for one request of ``seq_len`` tokens.

        MLA layers grow by ``kv_lora_rank + qk_rope_head_dim`` numbers per token; each KDA layer holds a fixed
        ``H × K × V`` recurrent state (``state_dtype``, default ``dtype``; the runtime keeps it in fp32) plus three
        short-conv caches of ``kernel − 1`` columns for q, k and v.
        """
        if not isinstance(seq_len, Integral) or seq_len < 0:
            raise K3ConfigError(f"cache_bytes: seq_len must be an int >= 0, got {seq_len!r}")
        item = torch.empty((), dtype=dtype).element_size()
        state_item = torch.empty((), dtype=state_dtype or dtype).element_size()
        n_mla = len(self.full_attn_layers)
        n_kda = self.num_hidden_layers - n_mla
        mla = n_mla * self.mla_cache_width * item * seq_len
        state = self.kda_num_heads * self.kda_head_dim * self.kda_head_dim * state_item
        conv = 3 * self.kda_dim * (self.kda_conv_kernel_size - 1) * item
        return int(mla + n_kda * (state + conv))

    # ---------------------------------------------------------------- validation

    def validate_k3(self) -> None:
        """Checks every key; raises ``K3ConfigError`` naming the key, its value and the valid range."""

        def positive_int(key, allow_none=False, minimum=1):
            value = getattr(self, key)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
                none = " or None" if allow_none else ""
                raise K3ConfigError(f"K3Config.{key} must be an int >= {minimum}{none}, got {value!r}")

        def one_of(key, valid):
            if getattr(self, key) not in valid:
                raise K3ConfigError(f"K3Config.{key} must be one of {list(valid)}, got {getattr(self, key)!r}")

        def positive_float(key):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
                raise K3ConfigError(f"K3Config.{key} must be a number > 0, got {value!r}")

        for key in (
            "vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim", "kda_conv_kernel_size",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
            "num_experts", "num_experts_per_token", "moe_intermediate_size",
        ):
            positive_int(key)
        for key in ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace", "attn_res_block_size"):
            positive_int(key, minimum=0)
        for key in ("q_lora_rank", "kda_output_gate_rank", "routed_expert_hidden_size"):
            positive_int(key, allow_none=True)
        one_of("kda_gate", KDA_GATES)
        one_of("hidden_act", ACTIVATIONS)
        one_of("kda_chunk_size", KDA_CHUNK_SIZES)
        for key in (
            "situ_beta", "situ_linear_beta", "rms_norm_eps", "mla_norm_eps", "initializer_range",
            "routed_scaling_factor",
        ):
            positive_float(key)
        if self.kda_head_dim > 256:
            raise K3ConfigError(f"K3Config.kda_head_dim must be <= 256 (KDA kernels), got {self.kda_head_dim}")
        lb = self.kda_gate_lower_bound
        if isinstance(lb, bool) or not isinstance(lb, Real) or not -5.0 <= lb < 0.0:
            raise K3ConfigError(f"K3Config.kda_gate_lower_bound must be in [-5, 0) (FLA's safe gate range), got {lb!r}")
        if self.num_experts_per_token >= self.num_experts:
            raise K3ConfigError(
                f"K3Config.num_experts_per_token must be < num_experts={self.num_experts} (the router takes "
                f"top-(k+1) for Quantile Balancing), got {self.num_experts_per_token}"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise K3ConfigError(
                f"K3Config.first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}"
            )
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size > self.hidden_size:
            raise K3ConfigError(
                f"K3Config.routed_expert_hidden_size must be <= hidden_size={self.hidden_size} (a latent width) or "
                f"None (experts at the full width), got {self.routed_expert_hidden_size}"
            )

        layers = self.full_attn_layers
        n = self.num_hidden_layers
        if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, Integral) for i in layers):
            raise K3ConfigError(f"K3Config.full_attn_layers must be a list of 1-indexed layer numbers, got {layers!r}")
        for i in layers:
            if not 1 <= i <= n:
                raise K3ConfigError(
                    f"K3Config.full_attn_layers: layer {i} is out of range; layers are 1-indexed in [1, {n}] "
                    f"(num_hidden_layers={n}), got {layers}"
                )
        if len(set(layers)) != len(layers) or layers != sorted(layers):
            raise K3ConfigError(f"K3Config.full_attn_layers must be strictly increasing without repeats, got {layers}")
        if self.final_layer_global and n not in layers:
            raise K3ConfigError(
                f"K3Config.full_attn_layers must include the last layer {n} when final_layer_global=True "
                f"(K3 ends on a global MLA layer), got {layers}"
            )
