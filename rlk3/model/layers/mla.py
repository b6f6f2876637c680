"""Gated Multi-head Latent Attention (DeepSeek-V2's MLA as K3 uses it).

* queries: low rank (``q_a_proj`` → RMSNorm → ``q_b_proj``) or one ``q_proj`` when ``q_lora_rank`` is None;
* keys/values: ``kv_a_proj_with_mqa`` gives the latent (RMSNorm'd, ``kv_lora_rank`` wide) and a
  ``qk_rope_head_dim`` slice shared by all heads; only these two are cached;
* NoPE: no rotary embedding anywhere (KDA's decay carries recency); the rope slice stays, unrotated;
* output gate: ``sigmoid(g_proj(x))`` on the *layer input*, applied per head before ``o_proj``.

Prefill and training decompress K/V (``mla_attention``); decode attends over the latent with absorbed weights.
"""

from __future__ import annotations

import torch
from torch import nn

from rlk3.model.cache import MLAState
from rlk3.model.layers.common import RMSNorm
from rlk3.model.ops.mla import mla_attention, split_kv_b

# queries up to this many tokens per step use the absorbed form (decode, short extends)
ABSORB_MAX_QUERY_LEN = 16


class GatedMLA(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        hidden, qk_dim = config.hidden_size, config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scale = qk_dim**-0.5
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.mla_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.mla_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(hidden, H * self.v_dim, bias=False) if config.mla_output_gate else None
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=False)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this layer caches for tokens ``x``: (normalised latent ``[B, T, L]``, rope slice ``[B, T, R]``)."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent), k_rope

    def forward(
        self, x: torch.Tensor, state: MLAState | None = None, mask: torch.Tensor | None = None, causal: bool = False
    ) -> tuple[torch.Tensor, MLAState]:
        """x ``[B, T, hidden]``; ``state`` holds the latents of earlier tokens; ``mask [B, T, S]`` (True = attend,
        S = cached + new tokens), or ``causal=True`` for a plain causal prefill. Returns the output and the state
        extended by these tokens."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.latents(x)
        if state is not None:
            latent = torch.cat([state.latent, latent], dim=1)
            k_rope = torch.cat([state.rope, k_rope], dim=1)
        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, H, self.nope_dim, self.v_dim)
        absorbed = state is not None and T <= ABSORB_MAX_QUERY_LEN
        o = mla_attention(
            q_nope, q_rope, latent, k_rope, w_uk, w_uv, self.scale, mask, absorbed=absorbed, causal=causal
        )
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, H, self.v_dim)
        return self.o_proj(o.reshape(B, T, H * self.v_dim)), MLAState(latent, k_rope)
