"""Multi-teacher on-policy distillation (MOPD) rewards.

The student samples its own rollouts; each generated token t earns ``clip(log π_T(t) − log π_S(t), −c, c)``
from the teacher T matching the rollout's (domain, effort) — not the domain alone — optionally plus α times the
outcome reward. Prompt and tool-output tokens earn 0. The reward then flows through the same RL loss
(per-token importance correction included), which is why distillation needs no separate imitation pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

T = TypeVar("T")


class TeacherRoutingError(KeyError):
    """A rollout whose (domain, effort) has no teacher: never silently sent to some other teacher."""


def route(teachers: Mapping[tuple[str, str], T], domain: str, effort: str) -> T:
    """The teacher for a rollout, keyed by both domain and effort."""
    key = (domain, effort)
    if key not in teachers:
        raise TeacherRoutingError(
            f"no teacher for (domain={domain!r}, effort={effort!r}); teachers exist for {sorted(teachers)}"
        )
    return teachers[key]


def mopd_token_rewards(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 5.0,
    outcome: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: ``clip(log π_T − log π_S, −c, c)`` on masked-in (generated) tokens, 0 elsewhere,
    plus ``alpha · outcome[b]`` spread on the generated tokens of sequence b (so that with teacher = student only
    the outcome term remains)."""
    if student_logp.shape != teacher_logp.shape or student_logp.shape != mask.shape:
        raise ValueError(
            f"mopd: student {list(student_logp.shape)}, teacher {list(teacher_logp.shape)} and mask "
            f"{list(mask.shape)} must share [B, T]"
        )
    if clip <= 0:
        raise ValueError(f"mopd: clip must be > 0, got {clip}")
    m = mask.to(torch.float32)
    r = (teacher_logp.float() - student_logp.float()).clamp(-clip, clip) * m
    if alpha and outcome is not None:
        r = r + alpha * outcome.float()[:, None] * m
    return r.detach()
