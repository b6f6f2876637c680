"""What a task is, for every domain: the prompt the policy sees, the sandbox it works in, and how it is graded.

A task carries its grading assets (reference answer, hidden tests, check scripts) in ``grading``; they are
never written into the policy's sandbox — graders put their own pristine copies in place at grading time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

DOMAINS = ("general", "agentic", "coding")
SPLITS = ("train", "heldout")


class TaskError(ValueError):
    """A malformed task or suite request; the message names the field and what is valid."""


@dataclass(frozen=True)
class Task:
    task_id: str  # stable, unique: "<suite>/<split>/<index>"
    domain: str  # general | agentic | coding
    prompt: str  # the user turn
    grader: str  # a rewards registry name
    grading: dict[str, Any]  # pristine grading assets; never shown to the policy
    template: str = "base"  # sandbox template
    files: dict[str, str] = field(default_factory=dict)  # written into the sandbox before the episode
    max_turns: int = 1  # assistant turns allowed (1 = answer directly, no tools needed)
    difficulty: int = 1  # the suite's knob, for slicing metrics
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise TaskError(f"Task.domain must be one of {list(DOMAINS)}, got {self.domain!r} ({self.task_id})")
        if not self.prompt:
            raise TaskError(f"Task.prompt is empty ({self.task_id})")
        if self.max_turns < 1:
            raise TaskError(f"Task.max_turns must be >= 1, got {self.max_turns} ({self.task_id})")

    @property
    def uses_sandbox(self) -> bool:
        return self.max_turns > 1 or bool(self.files)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        return cls(**d)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise TaskError(f"split must be one of {list(SPLITS)}, got {split!r}")


def split_seed(suite: str, split: str, index: int, attempt: int = 0) -> int:
    """Reproducible randomness per (suite, split, index, attempt)."""
    digest = hashlib.sha256(f"{suite}|{split}|{index}|{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


HELDOUT_SHARE = 5  # one content hash in five belongs to the held-out split


def content_split(*parts: str) -> str:
    """The split a task's *content* belongs to. Generators redraw until it matches the split asked for, so a
    held-out prompt can never also be drawn for training, however many training tasks are generated."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return "heldout" if digest[0] % HELDOUT_SHARE == 0 else "train"


def draw(suite: str, split: str, index: int, build):
    """Calls ``build(rng)`` with fresh seeds until the result's content belongs to ``split``.
    ``build`` returns ``(content_key, value)``; returns ``value``."""
    import random

    check_split(split)
    for attempt in range(10_000):
        key, value = build(random.Random(split_seed(suite, split, index, attempt)))
        if content_split(key) == split:
            return value
    raise TaskError(f"{suite}: could not draw a {split} task for index {index}")
