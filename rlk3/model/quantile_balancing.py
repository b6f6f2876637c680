"""Quantile Balancing (QB): the router bias that balances expert load, computed from one batch's scores.

For token i the router selects the top k of ``s_i + b`` (sigmoid scores plus the routing bias, which is used for
selection only). Take top-(k+1) once: its (k+1)-th value is the token's cutoff ``α_i``. Expert j would be selected
for token i iff ``s_ij + b_j > α_i``, i.e. iff ``b_j > r_ij := α_i − s_ij``. Balanced routing gives every expert
``q = N·k/E`` tokens, so the next bias of expert j sits at the (q+1)-th smallest ``r_:j`` (the negative of the
(q+1)-th largest raw margin ``s_ij − α_i``): with the cutoffs held fixed and no ties, exactly q tokens clear it.
We place it halfway between the q-th and (q+1)-th margins rather than on the (q+1)-th: the same q tokens clear
it, and the token at the edge is not decided by the rounding of ``s + b`` against ``α``.
The biases are then mean-centred (selection only depends on their differences) and applied on the next step.

A pricing view: the bias is each expert's price in an assignment problem; DeepSeek-V3's auxiliary-loss-free
update moves every price by a fixed ±γ, QB solves for it from the batch in one pass.

At scale the exact quantile would gather every margin, so ``qb_histogram`` counts margins per expert into fixed
bins (an integer tensor a data-parallel trainer all-reduces) and ``qb_bias_from_histogram`` reads the quantile
off the pooled counts, exact up to one bin width. The bias is frozen at inference.
"""

from __future__ import annotations

import torch

DEFAULT_BINS = 1000


def _check(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[int, int]:
    if scores.dim() != 2:
        raise ValueError(f"quantile balancing: `scores` must be [N, E], got {list(scores.shape)}")
    N, E = scores.shape
    if tuple(bias.shape) != (E,):
        raise ValueError(f"quantile balancing: `bias` must be [E]=[{E}], got {list(bias.shape)}")
    if not 1 <= k < E:
        raise ValueError(f"quantile balancing: top-k must be in [1, E-1]=[1, {E - 1}], got {k}")
    if N == 0:
        raise ValueError("quantile balancing: needs at least one token, got N=0")
    return N, E


def cutoff_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """``r[i, j] = α_i − s_ij``: the bias expert j needs to be selected for token i (``[N, E]``, fp32/fp64)."""
    scores = scores.double() if scores.dtype == torch.float64 else scores.float()
    alpha = (scores + bias.to(scores.dtype)).topk(k + 1, dim=-1).values[:, k]
    return alpha[:, None] - scores


def target_load(n_tokens: int, k: int, n_experts: int) -> int:
    """Tokens per expert under perfect balance (rounded down when N·k/E is fractional)."""
    return (n_tokens * k) // n_experts


def quantile_balancing_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, center: bool = True) -> torch.Tensor:
    """The exact QB update: scores ``[N, E]`` (unbiased sigmoid scores), current ``bias [E]``, top-k → next bias.

    With ``center=False`` the raw thresholds are returned (exactly ``q = N·k/E`` tokens clear each when the
    cutoffs are held fixed); by default they are mean-centred, which changes no selection.
    """
    N, E = _check(scores, bias, k)
    r = cutoff_margins(scores, bias, k)
    q = target_load(N, k, E)
    if q >= N:  # every token must select every expert: any bias above the largest margin does
        new = r.max(dim=0).values + 1.0
    else:
        lowest = r.topk(q + 1, dim=0, largest=False).values  # sorted ascending: [q + 1, E]
        new = lowest[q] if q == 0 else 0.5 * (lowest[q - 1] + lowest[q])
    new = new.to(bias.dtype)
    return new - new.mean() if center else new


def histogram_edges(bias: torch.Tensor, bins: int = DEFAULT_BINS) -> torch.Tensor:
    """Uniform bin edges over ``[min(b) − 1, max(b) + 1]``, which hold every margin: ``α_i − s_ij`` with sigmoid
    scores in (0, 1) lies strictly inside. Identical on every rank because the bias is replicated."""
    b = bias.double()
    return torch.linspace(float(b.min()) - 1.0, float(b.max()) + 1.0, bins + 1, dtype=torch.float64)


def qb_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, edges: torch.Tensor) -> torch.Tensor:
    """Per-expert counts of margins per bin, ``[E, bins]`` int64: sum these across data-parallel ranks
    (``torch.distributed.all_reduce``) together with the token count, then call ``qb_bias_from_histogram``."""
    _check(scores, bias, k)
    r = cutoff_margins(scores, bias, k).double()
    bins = edges.numel() - 1
    lo, width = float(edges[0]), float(edges[1] - edges[0])
    idx = ((r - lo) / width).floor().long().clamp_(0, bins - 1)  # [N, E]
    E = scores.shape[1]
    counts = torch.zeros(E, bins, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(1, idx.t().contiguous(), torch.ones_like(idx.t(), dtype=torch.int64))
    return counts


def qb_bias_from_histogram(
    counts: torch.Tensor, edges: torch.Tensor, n_tokens: int, k: int, center: bool = True, dtype=torch.float32
) -> torch.Tensor:
    """The (q+1)-th smallest margin per expert, read off pooled histogram counts ``[E, bins]`` by linear
    interpolation inside the bin that holds it: within one bin width of ``quantile_balancing_bias``."""
    E, bins = counts.shape
    q = target_load(n_tokens, k, E)
    rank = min(q + 1, n_tokens)  # 1-based rank of the wanted order statistic
    cum = counts.cumsum(dim=1)
    b = torch.searchsorted(cum, torch.full((E, 1), rank, dtype=cum.dtype, device=cum.device)).squeeze(1)
    b = b.clamp_(max=bins - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(b))
    inside = counts.gather(1, b[:, None]).squeeze(1).clamp(min=1)
    frac = (rank - before).double() / inside.double()  # how far into the bin the rank falls, in (0, 1]
    edges = edges.to(counts.device)
    width = edges[1] - edges[0]
    new = (edges[b] + frac * width).to(dtype)
    return new - new.mean() if center else new


def expert_load(topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, ``[E]``."""
    return torch.bincount(topk_idx.flatten(), minlength=n_experts)


def topk_with_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """The experts a router with this bias selects, ``[N, k]``."""
    return (scores + bias.to(scores.dtype)).topk(k, dim=-1).indices


def aux_free_sign_update(load: torch.Tensor, bias: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free update, the baseline QB replaces: ``b ← b − γ·sign(load − mean)``."""
    load = load.to(bias.dtype)
    return bias - gamma * torch.sign(load - load.mean())
