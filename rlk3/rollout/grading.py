"""From a finished episode to its reward: the task's grader, then the effort budget.

Tasks (``envs.tasks``) carry their pristine grading assets as plain data (``Task.grading``); graders
(``rewards``) take typed task records. This module is the one place that joins them, so neither package
imports the other (DESIGN.md §1).

The reward is the outcome score composed with the effort grade (``rewards.effort.compose``): over budget is
−1 whatever the outcome (the write-up's rule, ``override``), or outcome − 1 (``add``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.tasks import Task
from rewards import get_grader
from rewards.answer import AnswerTask
from rewards.base import Grade, Grader, GraderConfigError
from rewards.effort import EffortGrader, compose
from rlk3.rollout.trajectory import Status, Trajectory


def grader_task(task: Task) -> Any:
    """The grader's typed view of ``task.grading``; raises ``GraderConfigError`` naming the field."""
    g = dict(task.grading)
    if task.grader == "answer":
        if "answer" not in g:
            raise GraderConfigError(f"task {task.task_id}: grader 'answer' needs grading['answer']")
        return AnswerTask(**g)
    if task.grader == "code":
        from rewards.code.grader import CodeCase, CodeTask

        def cases(key):
            return [CodeCase(**c) for c in g.get(key, [])]

        extra = {k: v for k, v in g.items() if k not in ("visible", "hidden")}
        return CodeTask(visible=cases("visible"), hidden=cases("hidden"), **extra)
    # other graders (command, kernel, webdev, custom) read their assets from a dict-like record
    return _Record(g)


class _Record(dict):
    """``task.grading`` with attribute access, for graders that read fields by name."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class GradedView:
    """What a grader reads: the conversation, the stream, the budget and the sandbox. The submit tool's answer
    becomes the final assistant line (``Answer: X``), the form the answer grader extracts."""

    messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[int]
    budget: int | None
    sandbox_id: str | None
    metrics: dict[str, Any] = field(default_factory=dict)


def view(traj: Trajectory) -> GradedView:
    msgs = list(traj.messages)
    submitted = traj.metrics.get("submitted")
    if submitted is not None:
        msgs.append({"role": "assistant", "content": f"Answer: {submitted}"})
    return GradedView(msgs, traj.token_ids, traj.loss_mask, traj.budget, traj.sandbox_id, traj.metrics)


class Grading:
    """Grades trajectories of many tasks; graders are built once per name (``grader_kwargs[name]`` passes e.g.
    the sandbox provider to graders that fork the episode's sandbox)."""

    def __init__(self, grader_kwargs: dict[str, dict] | None = None, compose_mode: str = "override") -> None:
        self.kwargs = grader_kwargs or {}
        self.mode = compose_mode
        self._graders: dict[str, Grader] = {}
        self.effort = EffortGrader()

    def grader(self, name: str) -> Grader:
        if name not in self._graders:
            self._graders[name] = get_grader(name, **self.kwargs.get(name, {}))
        return self._graders[name]

    def grade(self, task: Task, traj: Trajectory) -> Grade:
        """Sets ``traj.reward`` and the grade's summary in ``traj.metrics``; never raises for a bad episode."""
        v = view(traj)
        if traj.status == Status.FAILED:
            failure = traj.metrics.get("failure", {})
            outcome = Grade.fail("environment_failed: the episode's environment broke", **failure)
        else:
            try:
                outcome = self.grader(task.grader).grade(grader_task(task), v)
            except GraderConfigError:
                raise
            except Exception as e:  # a grader bug must not take the iteration down; it is recorded and scored 0
                outcome = Grade.fail(f"grader_error: {type(e).__name__}: {str(e)[:500]}")
                traj.metrics["grader_error"] = True  # counted apart: a broken grader must not pass for a weak policy
        grade = compose(outcome, self.effort.grade(None, v), self.mode)
        traj.reward = float(grade.score)
        traj.metrics["passed"] = bool(outcome.passed)
        traj.metrics["over_budget"] = any(r.startswith("over_budget") for r in grade.reasons)
        traj.metrics["grade_reasons"] = [r[:200] for r in grade.reasons[:8]]
        return grade
