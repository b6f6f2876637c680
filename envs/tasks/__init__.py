"""Task suites for the three domains, synthetic by default, plus loaders for public formats.

``get_tasks(domain, split, n)`` returns the first n tasks of a suite's split (deterministic; train and held-out
never overlap).
"""

from __future__ import annotations

from envs.tasks import agentic, coding, general
from envs.tasks.base import DOMAINS, SPLITS, Task, TaskError

SUITES = {"general": general, "agentic": agentic, "coding": coding}


def get_tasks(domain: str, split: str, n: int, start: int = 0) -> list[Task]:
    if domain not in SUITES:
        raise TaskError(f"unknown domain {domain!r}; valid domains: {list(DOMAINS)}")
    if n < 0 or start < 0:
        raise TaskError(f"n and start must be >= 0, got n={n} start={start}")
    return [SUITES[domain].task(split, i) for i in range(start, start + n)]


__all__ = ["DOMAINS", "SPLITS", "SUITES", "Task", "TaskError", "get_tasks"]
