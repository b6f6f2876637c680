"""Sampling one token per sequence, with the logprob the trainer recomputes.

The logprob of the chosen token is taken under ``softmax(logits / temperature)`` over the whole vocabulary (plain
``softmax(logits)`` for greedy), before top-k / top-p: that is the behaviour distribution a trainer can recompute
from the same logits, and what the per-token off-policy correction divides by. Top-k / top-p only restrict where
the draw may land. Each request draws from its own ``torch.Generator``, so a seeded request gives the same tokens
whatever else shares its batch, and a paused request continues its random stream where it stopped.
"""

from __future__ import annotations

import torch

from rlk3.engine.config import SamplingParams


def _restrict(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities of one row after top-k and top-p (unnormalised; multinomial normalises)."""
    probs = logp.exp()
    if top_k and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        total = sorted_p.sum()
        # keep the smallest prefix reaching top_p of the (possibly top-k restricted) mass; the first token always
        before = sorted_p.cumsum(0) - sorted_p
        keep = before < top_p * total
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """logits ``[n, V]`` (any float dtype) → (token per row, its logprob per row)."""
    logits = logits.float()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _restrict(logp[i], p.top_k, p.top_p)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
