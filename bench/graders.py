"""Grades per second for every grader on this machine.

    .venv/bin/python bench/graders.py [--seconds 20] [--workers 2] [--only code,answer]

Each grader grades an honest submission over and over (a fixed set for the answer grader) from `--workers`
threads for about `--seconds` (grading is subprocess-bound, so threads overlap the sandboxes); the table
gives grades/s, mean and p90 latency. JSON goes to bench/results/graders-<time>.json with the machine's load
average, which matters on a shared 2-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rewards import SimpleTrajectory, get_grader  # noqa: E402
from rewards.answer import AnswerTask  # noqa: E402
from rewards.workspace import LocalSandboxes  # noqa: E402


def _answer_jobs():
    g = get_grader("answer")
    pairs = [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("The answer is 42.", "42"),
        ("\\boxed{(x+1)^2}", "x^2+2x+1"),
        ("Answer: 5 cm", "5"),
        ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"),
        ("#### 1,000", "1000"),
    ]
    jobs = [
        (AnswerTask(answer=ref), SimpleTrajectory(messages=[{"role": "assistant", "content": pred}]))
        for pred, ref in pairs
    ]
    return g, jobs


def _code_jobs(sb):
    from tests.rewards.code_fixtures import HONEST, roman_task, workspace_files

    return get_grader("code", sandboxes=sb), [
        (roman_task(), SimpleTrajectory(sandbox_id=sb.create(workspace_files(HONEST))))
    ]


def _kernel_jobs(sb):
    from rewards.code.grader import sha256
    from rewards.kernel.grader import KernelTask, reference_source

    ref = reference_source("scaled_softmax")
    sol = (
        "import torch\n\n\ndef kernel(x, scale):\n    y = x * scale\n    y -= y.amax(-1, keepdim=True)\n"
        "    y.exp_()\n    y /= y.sum(-1, keepdim=True)\n    return y\n"
    )
    sid = sb.create({"reference.py": ref, "solution.py": sol})
    return get_grader("kernel", sandboxes=sb), [
        (KernelTask(protected={"reference.py": sha256(ref)}), SimpleTrajectory(sandbox_id=sid))
    ]


def _webdev_jobs(sb):
    from rewards.webdev.grader import WebdevTask
    from tests.rewards.web_fixtures import PROTECTED, app

    return get_grader("webdev", sandboxes=sb), [
        (WebdevTask(protected=PROTECTED), SimpleTrajectory(sandbox_id=sb.create(app())))
    ]


def _effort_jobs():
    g = get_grader("effort")
    return g, [(None, SimpleTrajectory(token_ids=list(range(4000)), loss_mask=[1, 0] * 2000, budget=1500))]


def run(name, grader, jobs, seconds, workers, min_grades):
    lat, scores, errors = [], [], []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    counter = [0]

    def loop():
        while True:
            with lock:
                if time.monotonic() > stop and counter[0] >= min_grades:
                    return
                i = counter[0]
                counter[0] += 1
            task, traj = jobs[i % len(jobs)]
            t0 = time.perf_counter()
            g = grader.grade(task, traj)
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                scores.append(g.score)
                if not g.passed and name != "effort":
                    errors.append(g.reasons[:2])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {
        "grader": name,
        "workers": workers,
        "grades": len(lat),
        "wall_s": round(wall, 3),
        "grades_per_s": round(len(lat) / wall, 2),
        "mean_latency_s": round(statistics.fmean(lat), 4),
        "p90_latency_s": round(lat[int(0.9 * (len(lat) - 1))], 4),
        "honest_failures": len(errors),
        "first_failure": errors[0] if errors else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", default="answer,effort,code,kernel,webdev")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="rlk3-graders-bench-")
    sb = LocalSandboxes(tmp.name)
    builders = {
        "answer": _answer_jobs,
        "effort": _effort_jobs,
        "code": lambda: _code_jobs(sb),
        "kernel": lambda: _kernel_jobs(sb),
        "webdev": lambda: _webdev_jobs(sb),
    }
    rows = []
    for name in args.only.split(","):
        grader, jobs = builders[name]()
        grader.grade(*jobs[0])  # warm-up (worker processes, imports) outside the measurement
        min_grades = 3 if name in ("kernel", "webdev") else 10
        rows.append(run(name, grader, jobs, args.seconds, args.workers, min_grades))
        r = rows[-1]
        print(
            f"{name:8s} {r['grades_per_s']:8.2f}/s  mean {r['mean_latency_s'] * 1e3:8.1f} ms  "
            f"p90 {r['p90_latency_s'] * 1e3:8.1f} ms  ({r['grades']} grades, {r['workers']} workers, "
            f"honest failures {r['honest_failures']})",
            flush=True,
        )
    out = {
        "command": "python bench/graders.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg(),
        },
        "rows": rows,
    }
    res_dir = ROOT / "bench" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    path = res_dir / f"graders-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(
        "\n| grader | grades/s | mean latency | p90 latency | grades | workers |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['grader']} | {r['grades_per_s']} | {r['mean_latency_s'] * 1e3:.1f} ms | "
            f"{r['p90_latency_s'] * 1e3:.1f} ms | {r['grades']} | {r['workers']} |"
        )
    print(f"\nwritten {path.relative_to(ROOT)}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
