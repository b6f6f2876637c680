"""Attention Residuals: each sub-layer reads a softmax mix over depth instead of one summed residual stream.

The sources are the completed block outputs (block 0 is the token embedding) and the running partial sum of the
current block. A sub-layer's mix scores each source with a learned pseudo-query against the source's RMS-normed
value (the values themselves enter unnormalised) and takes the softmax-weighted sum. The pseudo-query is
zero-initialised, so training starts from a uniform average. Blocks span ``attn_res_block_size`` layers; at a
block boundary the partial sum is frozen as a completed block and restarts with that layer's attention output.
Everything is per token, so decoding needs no extra cache.
"""

from __future__ import annotations

import torch
from torch import nn


class AttnResMixer(nn.Module):
    """One pseudo-query: ``softmax_i(w · RMSNorm(v_i)) · v_i`` over the sources (fp32)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=False)  # the pseudo-query, zero-initialised
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))  # the key-side RMSNorm weight
        self.eps = eps

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        return self.mix(torch.stack(sources, dim=-2))

    def mix(self, stacked: torch.Tensor) -> torch.Tensor:
        """The mix of sources stacked as ``[..., n, D]`` (one tensor, so a compiled caller sees one input)."""
        v = stacked.float()
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        scores = (keys * (self.norm_weight.float() * self.proj.weight[0].float())).sum(-1)
        p = scores.softmax(dim=-1)
        return (p.unsqueeze(-1) * v).sum(-2).to(stacked.dtype)


class ResidualStream:
    """The plain pre-norm residual: every sub-layer reads the running sum and adds its output to it."""

    def __init__(self, embeddings: torch.Tensor):
        self.h = embeddings

    def begin_layer(self, layer_idx: int) -> None:
        pass

    def read(self, mixer: AttnResMixer | None) -> torch.Tensor:
        return self.h

    def sources(self) -> list[torch.Tensor]:
        """What ``read`` mixes: here the one running sum."""
        return [self.h]

    def write(self, out: torch.Tensor) -> None:
        self.h = self.h + out

    def final(self, mixer: AttnResMixer | None) -> torch.Tensor:
        return self.h


class AttnResStream:
    """Block Attention Residuals bookkeeping (see the module docstring)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial = embeddings
        self.at_boundary = False

    def begin_layer(self, layer_idx: int) -> None:
        if layer_idx % self.block_size == 0:
            self.blocks.append(self.partial)  # the partial sum completes a block (layer 0: the embedding)
            self.at_boundary = True

    def sources(self) -> list[torch.Tensor]:
        """What ``read`` mixes: the completed blocks, and the partial sum unless it was just frozen (at a boundary
        the partial sum *is* the block just completed, so it is not a second source)."""
        return self.blocks if self.at_boundary else [*self.blocks, self.partial]

    def read(self, mixer: AttnResMixer | None) -> torch.Tensor:
        sources = self.sources()
        if mixer is None:  # only layer 0's attention, whose single source is the embedding
            assert len(sources) == 1
            return sources[0]
        return mixer(sources)

    def write(self, out: torch.Tensor) -> None:
        if self.at_boundary:
            self.partial, self.at_boundary = out, False
        else:
            self.partial = self.partial + out

    def final(self, mixer: AttnResMixer) -> torch.Tensor:
        return mixer([*self.blocks, self.partial])
