"""The kernel grader: score = correctness gate x speedup against the expert implementation.

1. fork the trajectory's workspace; the reference the policy was shown must be untouched
   (`tests_modified`), no interpreter hooks (`injection`), no symlinks;
2. static checks on every submitted .py file (static.py): forbidden library op, importing the reference,
   try/except fallback, timer patching, threads/processes, tensor subclasses, CUDA graphs, side streams,
   precision casts, memory introspection;
3. the pristine judge (judge.py) runs in the fork: expert and candidate each in their own worker process,
   every call on fresh inputs at a fresh address, timed by the judge, output read from the frozen worker
   and checked against float64, plus a profiled call for forbidden aten ops;
4. roofline: a candidate faster than half the time of merely copying its bytes, or more than
   `max_speedup` x the expert, is physically implausible (`impossible_speedup`).
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewards.base import Grade, GraderConfigError, TrajectoryLike
from rewards.code.grader import INJECTION_NAMES, sha256
from rewards.kernel.static import static_findings
from rewards.workspace import Limits, LocalSandboxes, SandboxProvider, Workspace, grade_in_fork

HERE = Path(__file__).parent
PRISTINE = ("judge.py", "worker.py", "tasks.py")


@dataclass
class KernelTask:
    task: str = "scaled_softmax"  # key in tasks.TASKS
    protected: dict[str, str] = field(default_factory=dict)  # e.g. reference.py -> sha256
    device: str = "cpu"  # "cuda" on a GPU machine: CUDA events + whole-device sync
    n_timed: int = 12
    call_timeout_s: float = 5.0
    max_speedup: float = 10.0  # KernelBench's excessive-speedup threshold
    roofline_slack: float = 0.5
    memory_mb: int = 3072


def reference_source(task_name: str) -> str:
    """What the policy is shown: the reference as readable code (written into its workspace)."""
    import inspect

    from rewards.kernel import tasks

    t = tasks.TASKS[task_name]
    return f'"""{t["doc"]}"""\nimport torch\n\n\n' + inspect.getsource(t["reference"])


class KernelGrader:
    """Reads `trajectory.sandbox_id`; the submission is `solution.py` defining the task's entry function."""

    name = "kernel"

    def __init__(self, sandboxes: SandboxProvider | None = None, python: str | None = None):
        self.sandboxes = sandboxes or LocalSandboxes()
        self.python = python or sys.executable  # an interpreter with torch, visible inside the sandbox

    def validate(self, task: Any) -> None:
        missing = [p for p in PRISTINE if not (HERE / p).is_file()]
        if missing:
            raise GraderConfigError(f"grader 'kernel': pristine assets missing: {missing} under {HERE}")
        if not isinstance(task, KernelTask):
            raise GraderConfigError(f"grader 'kernel': task must be a KernelTask, got {type(task).__name__}")
        from rewards.kernel.tasks import TASKS

        if task.task not in TASKS:
            raise GraderConfigError(
                f"grader 'kernel': unknown kernel task {task.task!r}; valid tasks: {', '.join(sorted(TASKS))}"
            )
        if task.device not in ("cpu", "cuda") and not task.device.startswith("cuda:"):
            raise GraderConfigError(f"grader 'kernel': device {task.device!r} is not cpu or cuda[:N]")

    def grade(self, task: KernelTask, trajectory: TrajectoryLike) -> Grade:
        return grade_in_fork(self.sandboxes, trajectory.sandbox_id, lambda ws: self._grade_in(ws, task))

    def _grade_in(self, ws: Workspace, task: KernelTask) -> Grade:
        from rewards.kernel.tasks import TASKS

        spec = TASKS[task.task]
        entries = ws.list_files()
        by_path = {e.path: e for e in entries}
        reasons: list[str] = []
        for path, digest in task.protected.items():
            e = by_path.get(path)
            if e is None or e.kind != "file":
                reasons.append(f"tests_modified: {path} was removed or replaced")
            elif sha256(ws.read_file(path)) != digest:
                reasons.append(f"tests_modified: {path} differs from the pristine copy")
        py_files = []
        for e in entries:
            name = e.path.rsplit("/", 1)[-1]
            if e.kind == "symlink":
                reasons.append(f"symlink: {e.path}")
            elif e.kind == "file" and (name in INJECTION_NAMES or name.endswith(".pth")):
                reasons.append(f"injection: {e.path}")
            elif e.kind == "file" and name.endswith(".py") and e.path not in task.protected:
                py_files.append(e.path)
        if "solution.py" not in by_path:
            reasons.append("no_solution: solution.py is missing")
        for path in py_files:
            src = ws.read_file(path, max_bytes=1 << 20).decode("utf-8", "replace")
            reasons += static_findings(src, spec["forbidden_names"], filename=path)
        details: dict[str, Any] = {"files": py_files}
        if reasons:
            return Grade(0.0, False, reasons, details)

        judge_dir = f".kjudge-{secrets.token_hex(4)}"
        for path in py_files:
            ws.write_file(f"{judge_dir}/{path}", ws.read_file(path))
        cfg = {
            "task": task.task,
            "solution_dir": f"{ws.sandbox_root}/{judge_dir}",
            "python": self.python,
            "device": task.device,
            "n_timed": task.n_timed,
            "call_timeout_s": task.call_timeout_s,
            "start_timeout_s": 120.0,
        }
        with tempfile.TemporaryDirectory(prefix="rlk3-kernel-grader-") as gdir:
            for p in PRISTINE:
                Path(gdir, p).write_bytes((HERE / p).read_bytes())
            ws.mount_readonly(gdir, "/grader")
            calls = len(spec["distributions"]) + task.n_timed + 2
            res = ws.exec(
                [self.python, "-I", "/grader/judge.py"],
                stdin=json.dumps(cfg).encode(),
                limits=Limits(
                    timeout_s=300 + calls * task.call_timeout_s * 2,
                    memory_mb=task.memory_mb,
                    pids=128,
                    gpu=task.device.startswith("cuda"),
                ),
            )
        try:
            report = json.loads(res.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            how = "timed out" if res.timed_out else f"exit {res.exit_code}"
            tail = res.stderr.decode("utf-8", "replace")[-300:]
            return Grade.fail(f"runner_died: judge produced no report ({how}): {tail}", judge_wall_s=res.wall_s)
        return self._score(task, spec, report, details)

    @staticmethod
    def _score(task: KernelTask, spec: dict, report: dict, details: dict) -> Grade:
        exp, cand = report["expert"], report["candidate"]
        details.update(
            judge_copy_s=report["copy_s"],
            expert_calls=exp["calls"],
            candidate_calls=cand["calls"],
            profiled_ops=cand.get("ops", [])[:50],
        )
        if exp["violations"] or not exp["times_s"]:
            return Grade.fail(f"grader_error: expert implementation failed: {exp['violations']}", **details)
        reasons = [f"{code}: {msg}" for code, msg in cand["violations"]]
        bad_ops = sorted(set(cand.get("ops", [])) & set(spec["forbidden_aten"]))
        if bad_ops:
            reasons.append(f"forbidden_op: profiler saw {', '.join(bad_ops)}")
        if reasons or not cand["times_s"]:
            return Grade(0.0, False, reasons or ["error: no timed calls"], details)
        t_exp = statistics.median(exp["times_s"])
        t_cand = statistics.median(cand["times_s"])
        speedup = t_exp / t_cand
        details.update(expert_s=t_exp, candidate_s=t_cand, speedup=speedup)
        if roofline_violation(t_cand, report["copy_s"], speedup, task):
            return Grade.fail(
                f"impossible_speedup: {t_cand * 1e6:.0f} µs per call, {speedup:.1f}x the expert (limit "
                f"{task.max_speedup}x); moving the same bytes once takes {report['copy_s'] * 1e6:.0f} µs",
                **details,
            )
        return Grade(speedup, True, [], details)


def roofline_violation(t_cand: float, copy_s: float, speedup: float, task: KernelTask) -> bool:
    """Physically implausible: faster than `roofline_slack` x the time to copy the task's bytes once, or
    more than `max_speedup` x the expert implementation (KernelBench's excessive-speedup flag)."""
    return t_cand < task.roofline_slack * copy_s or speedup > task.max_speedup
