"""Effort budget (DESIGN.md §5): a trajectory whose generated tokens exceed its budget gets reward −1.

The grader reads only counts (`loss_mask`, `token_ids`, `budget`), never the text: generated tokens are
those with `loss_mask == 1` (tool output and prompts carry 0). How the penalty combines with the outcome
reward is the RL config's choice (`compose`).
"""

from __future__ import annotations

from typing import Any

from rewards.base import Grade, GraderConfigError, TrajectoryLike

PENALTY = -1.0


def generated_tokens(trajectory: TrajectoryLike) -> int:
    mask = list(getattr(trajectory, "loss_mask", None) or [])
    ids = list(getattr(trajectory, "token_ids", None) or [])
    if mask and len(mask) != len(ids):
        raise ValueError(f"loss_mask has {len(mask)} entries for {len(ids)} token_ids")
    return sum(1 for m in mask if m) if mask else len(ids)


class EffortGrader:
    """score 0 within budget, −1 over it. A task may carry its own `budget`; the trajectory's wins."""

    name = "effort"

    def validate(self, task: Any) -> None:
        b = getattr(task, "budget", None)
        if b is not None and (not isinstance(b, int) or b <= 0):
            raise GraderConfigError(f"grader 'effort': budget must be a positive int or None, got {b!r}")

    def grade(self, task: Any, trajectory: TrajectoryLike) -> Grade:
        budget = getattr(trajectory, "budget", None) or getattr(task, "budget", None)
        try:
            used = generated_tokens(trajectory)
        except ValueError as e:
            return Grade(PENALTY, False, [f"malformed_trajectory: {e}"], {})
        details = {"generated_tokens": used, "budget": budget}
        if budget is None:
            return Grade(0.0, True, [], details)
        if used > budget:
            return Grade(PENALTY, False, [f"over_budget: {used} generated tokens > budget {budget}"], details)
        return Grade(0.0, True, [], details)


def compose(outcome: Grade, effort: Grade, mode: str = "override") -> Grade:
    """Combine an outcome grade with an effort grade.

    override: over budget -> −1 whatever the outcome (the K3 write-up's rule); else the outcome.
    add:      outcome score + effort score (0 or −1).
    """
    if mode not in ("override", "add"):
        raise GraderConfigError(f"effort compose mode {mode!r} is not one of override, add")
    reasons = outcome.reasons + effort.reasons
    details = {**outcome.details, "effort": effort.details}
    if effort.score < 0:
        score = effort.score if mode == "override" else outcome.score + effort.score
        return Grade(score, False, reasons, details)
    return Grade(outcome.score, outcome.passed, reasons, details)
