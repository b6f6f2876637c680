"""Stable LatentMoE: a sigmoid router on the full hidden, routed experts at a latent width, shared experts.

    scores = sigmoid(router(x))                      fp32, on the full hidden
    idx    = topk(scores + bias, k)                  the bias (Quantile Balancing) is for selection only
    w      = renorm(scores[idx]) · routed_scaling    weights from the unbiased scores
    y      = up(RMSNorm(Σ_k w_k · Expert_k(down(x))))   experts work at routed_expert_hidden_size (K3: hidden/2)
    out    = y + Shared(x)                           shared experts see the original hidden

The RMSNorm between aggregation and up-projection bounds the four consecutive matmuls of the routed path.
``routed_expert_hidden_size=None`` drops the latent projection (experts at full width, as in Kimi Linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlk3.model.layers.common import GLU, MLP, RMSNorm


class K3Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        # routing bias for selection only; Quantile Balancing rewrites it between optimizer steps
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # when True, forward keeps the last batch's scores for the trainer's QB update (`pop_scores`)
        self.record_scores = False
        # which of the next forward's N tokens to record (bool [N]); None: all. The trainer masks out the padding
        # of its packed micro-batches, so that the routing statistics do not depend on how the batch was packed
        self.score_mask: torch.Tensor | None = None
        self._scores: list[torch.Tensor] = []

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, hidden]`` → sigmoid scores ``[N, E]`` fp32 (selection adds ``e_score_correction_bias``)."""
        return torch.sigmoid(F.linear(x.float(), self.weight.float()))

    def weights(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The routing weights ``[N, k]`` of the chosen experts ``idx``: their scores, renormalised and scaled."""
        w = scores.gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, hidden]`` → (expert indices ``[N, k]``, routing weights ``[N, k]`` fp32)."""
        scores = self.scores(x)
        idx = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        w = self.weights(scores, idx)
        if self.record_scores:
            kept = scores.detach()
            self._scores.append(kept if self.score_mask is None else kept[self.score_mask.to(kept.device)])
        return idx, w

    def pop_scores(self) -> torch.Tensor | None:
        """The scores ``[N, E]`` recorded since the last call (what a QB update needs), or None."""
        if not self._scores:
            return None
        scores, self._scores = torch.cat(self._scores), []
        return scores


class K3Experts(nn.Module):
    """E gated MLPs stored as 3-D weights: ``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, config):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.act = GLU(config.hidden_act, config.situ_beta, config.situ_linear_beta)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x ``[N, D]``, idx/weights ``[N, k]`` → ``Σ_k w_k · Expert_{idx_k}(x)``, accumulated in fp32."""
        N, k = idx.shape
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # group (token, slot) pairs by expert
        token_of = order // k
        if self._grouped_ok(x):
            return self._grouped(x, order, token_of, flat, weights)
        if self._dense_ok(x):
            return self._dense(x, idx, weights)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        acc = torch.promote_types(x.dtype, torch.float32)  # accumulate in fp32 at least (fp64 in fp64 tests)
        out = torch.zeros(N, x.shape[-1], dtype=acc, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start : start + n]
            tokens = token_of[start : start + n]
            start += n
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate, up), self.down_proj[e])
            out.index_add_(0, tokens, y.to(acc) * weights.flatten()[rows, None].to(acc))
        return out.to(x.dtype)

    # On a CPU with few experts and few tokens (decode steps), one batched matmul over *all* experts beats a Python
    # loop of tiny ones: per-op overhead dominates there. Past a few hundred tokens the E/k times larger work loses.
    # Unselected experts get routing weight 0 (so no output and no gradient).
    DENSE_MAX_EXPERTS = 32
    DENSE_MAX_TOKENS = 256

    def _dense_ok(self, x: torch.Tensor) -> bool:
        return not x.is_cuda and self.num_experts <= self.DENSE_MAX_EXPERTS and x.shape[0] <= self.DENSE_MAX_TOKENS

    def _dense(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        dense_w = torch.zeros(N, self.num_experts, dtype=acc, device=x.device)
        dense_w.scatter_add_(1, idx, weights.to(acc))
        gate, up = torch.einsum("nd,eid->eni", x, self.gate_up_proj.to(x.dtype)).chunk(2, dim=-1)
        y = torch.einsum("eni,edi->end", self.act(gate, up), self.down_proj.to(x.dtype))  # [E, N, D]
        return torch.einsum("end,ne->nd", y.to(acc), dense_w).to(x.dtype)

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        """One grouped GEMM per projection instead of a Python loop over experts: bf16 on CUDA (Hopper's grouped
        GEMM), with widths the kernel can align. The loop above stays the reference and the CPU path."""
        I2, D = self.gate_up_proj.shape[1:]
        return (
            x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and D % 16 == 0 and I2 % 32 == 0
        )

    def _grouped(self, x, order, token_of, flat, weights):
        # counted by a scatter, not bincount, which reads the largest id back to size its output (a host
        # synchronisation, and not capturable in a CUDA graph)
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device)
        offs = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0).to(torch.int32)
        xs = x[token_of]  # rows sorted by expert
        w_gate_up = self.gate_up_proj.to(x.dtype).transpose(1, 2)  # [E, D, 2I]
        gate, up = torch._grouped_mm(xs, w_gate_up, offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(self.act(gate, up), self.down_proj.to(x.dtype).transpose(1, 2), offs=offs)
        y = y.float() * weights.flatten()[order, None]
        return sum_in_expert_order(y, order, weights.shape[1]).to(x.dtype)


def sum_in_expert_order(y: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's sum of its ``k`` weighted expert outputs, added in expert order as the loop above adds them.
    ``y`` has one row per (token, slot) pair, sorted by expert: ``order`` is the stable argsort of the flattened
    expert ids that sorted them. The additions happen in a fixed order, so the same inputs always round the same
    way: ``index_add_`` on CUDA adds a token's k rows with atomics in whatever order they land, which made eager
    bf16 decode differ from run to run (docs/BENCHMARKS.md, GPU tests)."""
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=order.device)  # each (token, slot) pair's row in y
    return add_slots(y[row.view(-1, k).sort(dim=1).values])  # a token's rows in increasing order = by expert


def add_slots(y: torch.Tensor) -> torch.Tensor:
    """``[N, k, D]`` → ``[N, D]``: the k slots added one after another (``sum`` may pair them up differently)."""
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


class StableLatentMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.latent_dim = config.routed_expert_hidden_size
        width = self.latent_dim or hidden
        self.router = K3Router(config)
        self.experts = K3Experts(config.num_experts, width, config.moe_intermediate_size, config)
        if self.latent_dim is not None:
            self.routed_down_proj = nn.Linear(hidden, width, bias=False)
            self.routed_norm = RMSNorm(width, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
            self.routed_up_proj = nn.Linear(width, hidden, bias=False)
        self.shared_experts = (
            MLP(hidden, config.moe_intermediate_size * config.num_shared_experts, config)
            if config.num_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.router(flat)
        h = self.routed_down_proj(flat) if self.latent_dim is not None else flat
        y = self.experts(h, idx, w)
        if self.latent_dim is not None:
            if self.routed_norm is not None:
                y = self.routed_norm(y)
            y = self.routed_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)
