"""``Trajectory``: the one typed record that flows from rollout to grading to training (DESIGN.md §3).

One agent episode: the token stream the model saw and produced, which tokens the policy generated (and under
which weights, with which behaviour log-probability), the conversation as messages, and what it earned. It
serialises to JSON and to Arrow without loss, so the carry-over buffer of paused trajectories can be saved with
a checkpoint and a crash loses nothing.

Per-token fields come in two alignments, on purpose: ``token_ids`` and ``loss_mask`` cover the whole stream;
``behaviour_logprobs`` and ``policy_versions`` hold one entry per *generated* token (where ``loss_mask`` is 1), in
order — the engine produces exactly these and nothing for prompt or tool-output tokens. ``dense()`` scatters them
onto the stream for the trainer.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import pyarrow as pa


class Status(StrEnum):
    RUNNING = "running"  # generating or waiting on a tool
    PAUSED = "paused"  # set aside by the partial-rollout scheduler; engine cache and sandbox kept
    FINISHED = "finished"  # submitted an answer or stopped on its own
    TRUNCATED = "truncated"  # hit the token budget, the length limit or the turn limit
    FAILED = "failed"  # the environment broke beyond recovery; never trained on


DOMAINS = ("general", "agentic", "coding")
EFFORTS = ("low", "medium", "high")


class TrajectoryError(ValueError):
    """A trajectory whose fields contradict each other; the message names the field."""


@dataclass
class Trajectory:
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique across the run; dedup key
    group_id: str = ""  # samples of one prompt share it: advantages are normalised per group
    task_id: str = ""  # which task (prompt, sandbox files, grading assets) this episode solves
    domain: str = "general"  # general | agentic | coding: routes the MOPD teacher with effort
    effort: str = "high"  # low | medium | high: stated in the system prompt
    budget: int | None = None  # generated-token budget; over it the effort grader gives -1
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation (OpenAI-style dicts)
    token_ids: list[int] = field(default_factory=list)  # the whole stream: prompt, generations, tool outputs
    loss_mask: list[int] = field(default_factory=list)  # 1 where the policy generated the token
    behaviour_logprobs: list[float] = field(default_factory=list)  # per generated token, at sampling time
    policy_versions: list[int] = field(default_factory=list)  # per generated token: the weights that sampled it
    status: Status = Status.RUNNING
    sandbox_id: str | None = None  # the episode's sandbox (paused with the trajectory)
    reward: float | None = None  # outcome reward (+ effort penalty) once graded
    token_rewards: list[float] | None = None  # MOPD: per generated token, teacher-vs-student log-ratio
    metrics: dict[str, Any] = field(default_factory=dict)  # turns, tool errors, timings, grader details...

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            try:
                self.status = Status(self.status)
            except ValueError:
                raise TrajectoryError(
                    f"Trajectory.status must be one of {[s.value for s in Status]}, got {self.status!r}"
                ) from None

    # ------------------------------------------------------------------ invariants

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> Trajectory:
        """Checks the alignment invariants; raises ``TrajectoryError`` naming the field. Returns self."""
        if self.domain not in DOMAINS:
            raise TrajectoryError(f"Trajectory.domain must be one of {list(DOMAINS)}, got {self.domain!r}")
        if self.effort not in EFFORTS:
            raise TrajectoryError(f"Trajectory.effort must be one of {list(EFFORTS)}, got {self.effort!r}")
        if len(self.loss_mask) != len(self.token_ids):
            raise TrajectoryError(
                f"Trajectory.loss_mask has {len(self.loss_mask)} entries but token_ids has {len(self.token_ids)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrajectoryError("Trajectory.loss_mask must hold only 0 and 1")
        n = self.num_generated
        for name in ("behaviour_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise TrajectoryError(
                    f"Trajectory.{name} must have one entry per generated token ({n}), got {len(getattr(self, name))}"
                )
        if self.token_rewards is not None and len(self.token_rewards) != n:
            raise TrajectoryError(
                f"Trajectory.token_rewards must have one entry per generated token ({n}), got {len(self.token_rewards)}"
            )
        if self.budget is not None and self.budget < 0:
            raise TrajectoryError(f"Trajectory.budget must be >= 0 or None, got {self.budget}")
        return self

    # ------------------------------------------------------------------ building a trajectory

    def append(self, token_ids: list[int], generated: bool, logprobs=None, versions=None) -> None:
        """Extend the stream: prompt/tool tokens (``generated=False``) or policy tokens with their logprobs."""
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([1 if generated else 0] * len(token_ids))
        if generated:
            if logprobs is None or versions is None or not len(logprobs) == len(versions) == len(token_ids):
                raise TrajectoryError("generated tokens need one logprob and one policy version each")
            self.behaviour_logprobs.extend(float(x) for x in logprobs)
            self.policy_versions.extend(int(v) for v in versions)

    def dense(self, values: list[float] | list[int], fill: float = 0.0) -> list:
        """Scatter a per-generated-token list onto the whole stream (``fill`` elsewhere)."""
        it = iter(values)
        return [next(it) if m else fill for m in self.loss_mask]

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.TRUNCATED, Status.FAILED)

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrajectoryError(f"unknown Trajectory fields {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        # Python's float repr round-trips exactly; NaN/inf are kept as JSON's common extensions
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.from_dict(json.loads(text))


# ---------------------------------------------------------------------- Arrow

# Nested free-form fields (messages, metrics) travel as JSON text: an Arrow struct schema would have to be
# inferred per batch and would reorder or widen keys, which is not lossless.
ARROW_SCHEMA = pa.schema(
    [
        ("uid", pa.string()),
        ("group_id", pa.string()),
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("effort", pa.string()),
        ("budget", pa.int64()),
        ("messages", pa.large_string()),
        ("token_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float64())),
        ("policy_versions", pa.list_(pa.int64())),
        ("status", pa.string()),
        ("sandbox_id", pa.string()),
        ("reward", pa.float64()),
        ("token_rewards", pa.list_(pa.float64())),
        ("metrics", pa.large_string()),
    ]
)
_JSON_COLUMNS = ("messages", "metrics")


def to_arrow(trajectories: list[Trajectory]) -> pa.Table:
    rows = []
    for t in trajectories:
        d = t.to_dict()
        for c in _JSON_COLUMNS:
            d[c] = json.dumps(d[c], ensure_ascii=False, allow_nan=True)
        rows.append(d)
    return pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)


def from_arrow(table: pa.Table) -> list[Trajectory]:
    if table.schema.names != ARROW_SCHEMA.names:
        raise TrajectoryError(
            f"Arrow table columns {table.schema.names} are not a Trajectory table {ARROW_SCHEMA.names}"
        )
    out = []
    for d in table.to_pylist():
        for c in _JSON_COLUMNS:
            d[c] = json.loads(d[c])
        out.append(Trajectory.from_dict(d))
    return out


def same(a: Trajectory, b: Trajectory) -> bool:
    """Field-by-field equality that treats NaN as equal to NaN and compares floats bit for bit."""

    def eq(x, y):
        if isinstance(x, float) and isinstance(y, float):
            return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))
        if isinstance(x, list) and isinstance(y, list):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return type(x) is type(y) and x == y

    return all(eq(getattr(a, f.name), getattr(b, f.name)) for f in fields(Trajectory))
