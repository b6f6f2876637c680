"""Advantages from outcome rewards, per group of samples of one prompt.

* ``grpo``: ``(r − mean_group) / (std_group + eps)`` (``scale=False``: Dr. GRPO's unscaled variant);
* ``rloo``: ``r − mean of the *other* samples in the group`` (leave-one-out, unbiased);
* ``reinforce``: ``r − mean over the whole batch``.

A group whose rewards are all equal carries no learning signal under ``grpo``/``rloo``: its advantages are 0.

``negative_scale`` < 1 shrinks the below-baseline advantages after the estimator (0: reinforce only the samples
that beat their group, "positive sample reinforcement"). Why it exists: a wrong sample's tokens are mostly right
ones (every step before its one slip), so pushing the whole sample down is the noisiest part of the gradient; on
a small model that memorises its skills in few weights that noise can outweigh the signal. It biases the
estimator towards sharpening what the policy already does well, so it is off (1.0) by default.
"""

from __future__ import annotations

from collections import defaultdict

import torch

ESTIMATORS = ("grpo", "rloo", "reinforce")


def group_advantages(
    rewards: torch.Tensor, group_ids: list[str], estimator: str = "grpo", scale: bool = True, eps: float = 1e-6,
    negative_scale: float = 1.0,
) -> torch.Tensor:
    """rewards ``[N]``, one group id per sample → advantages ``[N]`` (float32)."""
    if not 0.0 <= negative_scale <= 1.0:
        raise ValueError(f"negative_scale must be in [0, 1], got {negative_scale}")
    adv = _advantages(rewards, group_ids, estimator, scale, eps)
    return torch.where(adv < 0, adv * negative_scale, adv) if negative_scale != 1.0 else adv


def _advantages(rewards, group_ids, estimator, scale, eps) -> torch.Tensor:
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
