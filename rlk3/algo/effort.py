"""Effort budgets: the per-problem token budget and its schedule over training.

Each problem carries a budget of generated tokens; a trajectory over it gets reward −1 (the ``effort`` grader).
RL starts at the maximum (the high-effort budget) and anneals down to the level being trained; the medium and
low teachers continue from the high one while the budget falls.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("constant", "linear", "step")


@dataclass(frozen=True)
class BudgetSchedule:
    start: int  # budget at step 0 (the maximum)
    end: int  # budget once annealed
    steps: int = 0  # steps over which to anneal (0: already at `end`)
    kind: str = "linear"
    milestones: int = 4  # step schedule: number of equal drops

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"budget.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not 0 < self.end <= self.start:
            raise ValueError(f"budget must satisfy 0 < end <= start, got start={self.start} end={self.end}")
        if self.steps < 0 or self.milestones < 1:
            raise ValueError(f"budget.steps must be >= 0 and milestones >= 1, got {self.steps}, {self.milestones}")

    def at(self, step: int) -> int:
        """Budget at training step ``step``:

        * constant: ``end``;
        * linear: ``start − (start − end) · min(step / steps, 1)``, rounded;
        * step: ``milestones`` equal drops at ``steps·i/milestones``, i = 1..milestones.
        """
        if self.kind == "constant" or self.steps == 0:
            return self.end
        frac = min(max(step, 0) / self.steps, 1.0)
        if self.kind == "step":
            frac = int(frac * self.milestones) / self.milestones
        return round(self.start - (self.start - self.end) * frac)


def over_budget(generated_tokens: int, budget: int | None) -> bool:
    return budget is not None and generated_tokens > budget


def effort_reward(outcome: float, generated_tokens: int, budget: int | None) -> float:
    """The reward with the budget rule applied: exactly −1 over budget, the outcome reward otherwise."""
    return -1.0 if over_budget(generated_tokens, budget) else float(outcome)
