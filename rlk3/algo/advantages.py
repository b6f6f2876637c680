"""Advantages from outcome rewards, per group of samples of one prompt.

* ``grpo``: ``(r − mean_group) / (std_group + eps)`` (``scale=False``: Dr. GRPO's unscaled variant);
* ``rloo``: ``r − mean of the *other* samples in the group`` (leave-one-out, unbiased);
* ``reinforce``: ``r − mean over the whole batch``.

A group whose rewards are all equal carries no learning signal under ``grpo``/``rloo``: its advantages are 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch

ESTIMATORS = ("grpo", "rloo", "reinforce")


def group_advantages(
    rewards: torch.Tensor, group_ids: list[str], estimator: str = "grpo", scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards ``[N]``, one group id per sample → advantages ``[N]`` (float32)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    if rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(f"rewards must be [N] with one group id each, got {list(rewards.shape)} and {len(group_ids)}")
    r = rewards.float()
    if estimator == "reinforce":
        return r - r.mean()
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = torch.zeros_like(r)
    for idx in members.values():
        ix = torch.tensor(idx)
        rg = r[ix]
        n = len(idx)
        if estimator == "grpo":
            a = rg - rg.mean()
            if scale and n > 1:
                a = a / (rg.std(unbiased=False) + eps)
        else:  # rloo
            a = rg - (rg.sum() - rg) / (n - 1) if n > 1 else torch.zeros_like(rg)
        adv[ix] = a
    return adv


def reward_spread(rewards: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """Per-group max − min of rewards, in first-seen group order (0 everywhere = a dead learning signal)."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return torch.stack([rewards[torch.tensor(ix)].max() - rewards[torch.tensor(ix)].min() for ix in members.values()])
