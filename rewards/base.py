"""The grader contract (DESIGN.md §3) and the loose shapes graders accept.

A grader never imports the rollout package: it takes any object with the `TrajectoryLike` fields, so the
rollout `Trajectory`, a test's dataclass and a replayed JSON record all work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Grade:
    """What a grader returns. `score` is the reward; `reasons` names every check that failed (a cheat
    names itself here); `details` carries metrics (timings, counts) for logging, never for the reward."""

    score: float
    passed: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fail(cls, *reasons: str, **details: Any) -> Grade:
        return cls(score=0.0, passed=False, reasons=list(reasons), details=dict(details))

    def reason_codes(self) -> set[str]:
        """The `code` part of every `code: explanation` reason, for callers that branch on the cheat."""
        return {r.split(":", 1)[0].strip() for r in self.reasons}


@runtime_checkable
class TrajectoryLike(Protocol):
    """The fields of DESIGN.md's `Trajectory` that graders read. Only `sandbox_id` (outcome graders that
    judge a workspace), `messages` (answer grader) and `token_ids`/`loss_mask`/`budget` (effort grader)
    are used; each grader documents which."""

    messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[int]
    budget: int | None
    sandbox_id: str | None


@dataclass
class SimpleTrajectory:
    """A minimal concrete `TrajectoryLike` for tests, benchmarks and offline re-grading."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    budget: int | None = None
    sandbox_id: str | None = None


class Grader(Protocol):
    """`name` is the registry key. `validate(task)` raises `GraderConfigError` before any rollout runs when
    the task or the grader's pristine assets are unusable; `grade` must not raise on any model output."""

    name: str

    def validate(self, task: Any) -> None: ...

    def grade(self, task: Any, trajectory: TrajectoryLike) -> Grade: ...


class GraderConfigError(ValueError):
    """A task config that cannot be graded: unknown grader, missing pristine assets, bad task fields."""


def final_assistant_text(trajectory: TrajectoryLike, max_chars: int = 1 << 20) -> str:
    """The last assistant message's text, whatever shape the content has (str, list of parts, bytes),
    capped to `max_chars` from the end (the answer is at the end; a megabyte of preamble is not read)."""
    for msg in reversed(list(getattr(trajectory, "messages", None) or [])):
        if not isinstance(msg, dict) or msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if isinstance(content, bytes):
            text = content.decode("utf-8", errors="replace")
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, str):
                    parts.append(p)
                elif isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(p["text"])
            text = "".join(parts)
        else:
            text = "" if content is None else str(content)
        return text[-max_chars:]
    return ""
