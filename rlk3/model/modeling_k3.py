"""The K3 hybrid causal LM: blocks of three KDA layers and one Gated MLA layer (the layout is data: the config's
1-indexed ``full_attn_layers``), a dense first feed-forward then Stable LatentMoE, optional Attention Residuals.

HF-native: ``K3ForCausalLM`` is a ``PreTrainedModel`` + ``GenerationMixin``; ``import rlk3`` registers it with the
Auto classes; ``generate()`` uses ``K3Cache``. ``cu_seqlens`` (batch of one, sequences packed end to end) trains
on packed trajectories without cross-talk: KDA resets its state and conv window at each start, MLA masks across.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from rlk3.model.cache import K3Cache
from rlk3.model.configuration_k3 import K3Config
from rlk3.model.layers.attn_res import AttnResMixer, AttnResStream, ResidualStream
from rlk3.model.layers.common import MLP, GatedRMSNorm, RMSNorm
from rlk3.model.layers.kda import KimiDeltaAttention, ShortConv
from rlk3.model.layers.mla import GatedMLA
from rlk3.model.layers.moe import K3Experts, K3Router, StableLatentMoE

try:  # transformers >= 5: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover - older transformers
    from torch.nn import init


@dataclasses.dataclass
class _Batch:
    """What every layer needs to know about the tokens of this forward pass."""

    cache: K3Cache | None
    kda_padding: torch.Tensor | None  # [B, T] 1 = real token, for the KDA layers
    mla_mask: torch.Tensor | None  # [B, T, S] bool, None = no mask needed
    mla_causal: bool  # with mla_mask None: plain causal attention over T == S tokens
    cu_seqlens: torch.Tensor | None
    pos_in_seq: torch.Tensor | None  # [T] position of each token inside its packed sequence


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.layer_kinds[layer_idx]
        self.self_attn = GatedMLA(config, layer_idx) if self.kind == "mla" else KimiDeltaAttention(config, layer_idx)
        dense = config.mlp_types[layer_idx] == "dense"
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config) if dense else StableLatentMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_res = self.mlp_res = None
        if config.attn_res_block_size > 0:
            # layer 0's attention reads the embedding alone (nothing to mix), so it has no pre-attention mixer
            if layer_idx > 0:
                self.attn_res = AttnResMixer(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = AttnResMixer(config.hidden_size, config.rms_norm_eps)

    def attention(self, x: torch.Tensor, batch: _Batch) -> torch.Tensor:
        h = self.input_layernorm(x)
        state = batch.cache.get(self.layer_idx) if batch.cache is not None else None
        if self.kind == "mla":
            out, new_state = self.self_attn(h, state, batch.mla_mask, causal=batch.mla_causal)
        else:
            out, new_state = self.self_attn(h, state, batch.kda_padding, batch.cu_seqlens, batch.pos_in_seq)
        if batch.cache is not None:
            batch.cache.set(self.layer_idx, new_state)
        return out

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(x))


class K3PreTrainedModel(PreTrainedModel):
    config_class = K3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["K3DecoderLayer"]
    _is_stateful = True  # a KDA state cannot be rolled back: no assisted decoding / cache cropping
    _keep_in_fp32_modules = ["e_score_correction_bias", "router.weight", "A_log", "dt_bias"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, AttnResMixer):
            init.zeros_(module.proj.weight)  # a zero pseudo-query: the first mix is a uniform average
            init.ones_(module.norm_weight)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, ShortConv):
            bound = module.kernel_size**-0.5  # nn.Conv1d's default for a depthwise kernel
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, KimiDeltaAttention):
            # FLA's gate init: dt ~ logU(1e-3, 1e-1) stored as inverse softplus; A_log 0 (rate 1) for the bounded
            # gate, log U(1, 16) for the softplus one
            dt = torch.empty_like(module.dt_bias).uniform_(-6.907755, -2.302585).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
            if module.bounded:
                init.zeros_(module.A_log)
            else:
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log())
        elif isinstance(module, K3Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, K3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


class K3Model(K3PreTrainedModel):
    def __init__(self, config: K3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output_res = (
            AttnResMixer(config.hidden_size, config.rms_norm_eps) if config.attn_res_block_size > 0 else None
        )
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _batch(self, B, T, device, attention_mask, cache, cu_seqlens) -> _Batch:
        past = cache.get_seq_length() if cache is not None else 0
        S = past + T
        pos_in_seq = None
        if cu_seqlens is not None:
            if cache is not None or attention_mask is not None:
                raise ValueError(
                    "K3Model: `cu_seqlens` (packed sequences) cannot be combined with a cache or attention_mask"
                )
            if B != 1:
                raise ValueError(f"K3Model: with `cu_seqlens` pack the sequences into a batch of one, got batch {B}")
            offs = cu_seqlens.to(device)
            if offs.dim() != 1 or int(offs[0]) != 0 or int(offs[-1]) != T or bool((offs[1:] < offs[:-1]).any()):
                raise ValueError(
                    f"K3Model: `cu_seqlens` must be 1-D offsets from 0 to T={T}, got {cu_seqlens.tolist()}"
                )
            seq_id = torch.searchsorted(offs[1:], torch.arange(T, device=device), right=True)
            pos_in_seq = torch.arange(T, device=device) - offs[seq_id]
            mask = (seq_id[:, None] == seq_id[None, :]) & (pos_in_seq[:, None] >= pos_in_seq[None, :])
            return _Batch(None, None, mask[None], False, cu_seqlens, pos_in_seq)
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in (S, T):
                raise ValueError(
                    f"K3Model: `attention_mask` must be a 2-D padding mask [batch, past + new]=[{B}, {S}], "
                    f"got {list(attention_mask.shape)}"
                )
            keys = attention_mask.to(device).bool()
            if keys.shape[1] == T and past:
                keys = torch.cat([keys.new_ones(B, past), keys], dim=1)
            if bool(keys.all()):
                attention_mask = None  # nothing is padded: take the fast unmasked path
        if attention_mask is None:
            if T == 1 or past == 0:  # decode sees every key; a fresh prefill is plain causal
                return _Batch(cache, None, None, T > 1, None, None)
            keys = torch.ones(B, S, dtype=torch.bool, device=device)
        q_pos = torch.arange(past, S, device=device)
        k_pos = torch.arange(S, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None] & keys[:, None, :]
        allowed = allowed | (k_pos[None, :] == q_pos[:, None])[None]  # a pad query sees itself: no empty softmax
        return _Batch(cache, keys[:, past:].to(torch.float32), allowed, False, None, None)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("K3Model: pass exactly one of `input_ids` and `inputs_embeds`")
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"K3Model: `input_ids` must be [batch, seq], got shape {list(input_ids.shape)}")
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
                raise ValueError(
                    f"K3Model: token ids must be in [0, vocab_size={self.config.vocab_size}), "
                    f"got min {int(input_ids.min())} max {int(input_ids.max())}"
                )
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and cache is None and cu_seqlens is None:
            cache = K3Cache(self.config)
        if not use_cache:
            cache = None
        batch = self._batch(B, T, inputs_embeds.device, attention_mask, cache, cu_seqlens)

        if self.config.attn_res_block_size > 0:
            stream = AttnResStream(inputs_embeds, self.config.attn_res_block_size)
        else:
            stream = ResidualStream(inputs_embeds)
        checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            stream.begin_layer(i)
            x = stream.read(layer.attn_res)
            if checkpoint:
                stream.write(self._gradient_checkpointing_func(layer.attention, x, batch))
                x = stream.read(layer.mlp_res)
                stream.write(self._gradient_checkpointing_func(layer.feed_forward, x))
            else:
                stream.write(layer.attention(x, batch))
                stream.write(layer.feed_forward(stream.read(layer.mlp_res)))
        hidden = self.norm(stream.final(self.output_res))
        if cache is not None:
            cache.seen_tokens += T
        return BaseModelOutputWithPast(last_hidden_state=hidden, **_cache_field(BaseModelOutputWithPast, cache))


def _cache_field(output_cls, cache) -> dict:
    """transformers renamed `past_key_values` to `cache` in its 5.x line; fill whichever this release has."""
    names = {f.name for f in dataclasses.fields(output_cls)}
    return {"cache": cache} if "cache" in names else {"past_key_values": cache}


class K3ForCausalLM(K3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: K3Config):
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,  # accepted for generate(); NoPE has no positions
        cache: K3Cache | None = None,
        past_key_values: K3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Labels follow HF: ``labels = input_ids`` (−100 = ignore); the shift happens here. With ``cu_seqlens``
        the caller masks the first token of every packed sequence."""
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, K3Cache):
            raise TypeError(f"K3ForCausalLM: the cache must be a K3Cache, got {type(cache).__name__}")
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, inputs_embeds=inputs_embeds,
            use_cache=use_cache, cu_seqlens=cu_seqlens,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        new_cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return CausalLMOutputWithPast(loss=loss, logits=logits, **_cache_field(CausalLMOutputWithPast, new_cache))

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() gets a K3Cache: transformers' own cache classes do not know the hybrid KDA/MLA layout."""
        name = "cache" if "cache" in inspect.signature(self.prepare_inputs_for_generation).parameters else (
            "past_key_values"
        )
        if model_kwargs.get(name) is None and generation_config.use_cache is not False:
            model_kwargs[name] = K3Cache(self.config)

    # -- parameter accounting

    def num_activated_parameters(self, include_embeddings: bool = False) -> int:
        """Parameters a token passes through: everything except the routed experts it was not sent to (top-k of E
        per MoE layer) and, unless asked, the embedding table (a lookup, not a matmul)."""
        total = sum(p.numel() for p in self.parameters())
        for module in self.modules():
            if isinstance(module, K3Experts):
                routed = module.gate_up_proj.numel() + module.down_proj.numel()
                total -= routed - routed * self.config.num_experts_per_token // module.num_experts
        if not include_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        return total
