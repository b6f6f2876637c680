"""The generation cache of one batch of requests: per KDA layer a fixed-size state, per MLA layer a growing latent.

* KDA layer: the recurrent state ``[B, H, V, K]`` in fp32, V-first as FLA's layer keeps it, and three short-conv
  caches (q, k, v) holding the last ``kernel − 1`` projected inputs, ``[B, kernel − 1, H·K]`` each.
* MLA layer: the normalised KV latent ``[B, S, kv_lora_rank]`` and the rope slice ``[B, S, qk_rope_head_dim]``
  (NoPE: the slice is cached unrotated), i.e. 576 numbers per token at full size.

``K3Cache`` subclasses transformers' ``Cache`` so that ``generate()`` accepts it, but keeps its own storage: the
hybrid layout is K3's, not one of transformers' layer classes. Its byte count matches ``K3Config.cache_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


@dataclass
class KDAState:
    recurrent: torch.Tensor  # [B, H, V, K] fp32
    conv: list[torch.Tensor]  # q, k, v: [B, kernel - 1, H*K]

    def tensors(self) -> list[torch.Tensor]:
        return [self.recurrent, *self.conv]

    def map(self, fn) -> KDAState:
        return KDAState(fn(self.recurrent), [fn(c) for c in self.conv])


@dataclass
class MLAState:
    latent: torch.Tensor  # [B, S, kv_lora_rank]
    rope: torch.Tensor  # [B, S, qk_rope_head_dim]

    def tensors(self) -> list[torch.Tensor]:
        return [self.latent, self.rope]

    def map(self, fn) -> MLAState:
        return MLAState(fn(self.latent), fn(self.rope))


class K3Cache(Cache):
    """Per-layer KDA/MLA states for a batch, filled lazily by the first forward pass."""

    def __init__(self, config):
        # Cache.__init__ differs across transformers releases; none of its storage is used here.
        self.layers = []
        self.layer_kinds = list(config.layer_kinds)
        self.states: dict[int, KDAState | MLAState] = {}
        self.seen_tokens = 0

    # -- what the layers use
    def get(self, layer_idx: int) -> KDAState | MLAState | None:
        return self.states.get(layer_idx)

    def set(self, layer_idx: int, state: KDAState | MLAState) -> None:
        self.states[layer_idx] = state

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.states.values() for t in s.tensors())

    # -- what transformers' generate() and beam search use
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def _map(self, fn) -> None:
        self.states = {i: s.map(fn) for i, s in self.states.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.states.clear()
        self.seen_tokens = 0

    def crop(self, max_length: int) -> None:
        if max_length < 0 or max_length < self.seen_tokens:
            raise NotImplementedError(
                "K3Cache cannot be cropped: a KDA layer's recurrent state cannot be rolled back to an earlier token"
            )

    @property
    def batch_size(self) -> int:
        first = next(iter(self.states.values()), None)
        return 0 if first is None else first.tensors()[0].shape[0]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.states)

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layer_kinds)

    @property
    def is_linear(self) -> list[bool]:
        return [kind == "kda" for kind in self.layer_kinds]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layer_kinds)

    def __len__(self) -> int:
        return len(self.layer_kinds)

    def __repr__(self) -> str:
        return f"K3Cache(layers={len(self.layer_kinds)}, seen_tokens={self.seen_tokens}, bytes={self.nbytes()})"
