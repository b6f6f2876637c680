"""The teachers stage's schedule (rlk3/pipeline.py:run_teachers): which runs train side by side, from which checkpoint,
and what a failure stops. The RL run itself is replaced by a recorder here: what is under test is the order and the
hand-over between runs; the real runs side by side are exercised by tests/rlk3/test_demo_pipeline.py (slow)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import rlk3.cluster.driver as driver
from rlk3.config import load_config, task_files
from rlk3.pipeline import run_teachers

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Stands in for ``run_rl``: records each run's start, end and starting checkpoint, and how many overlap."""

    def __init__(self, fail: str | None = None, seconds: dict[str, float] | None = None,
                 overlap: int | None = None) -> None:
        # medium and low longer than high: once the highs are done, the medium/low runs all overlap
        self.fail, self.seconds = fail, seconds or {"high": 0.02, "medium": 0.25, "low": 0.25}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.running = self.most = 0
        # with ``overlap``, medium/low runs also wait (up to 10 s) until that many runs overlap once, so that a loaded
        # machine's slow starts cannot hide whether the schedule lets them run side by side
        self.overlap, self.reached = overlap, overlap is None
        self.runs: dict[str, dict] = {}

    def __call__(self, cfg, log=print) -> Path:
        name = cfg.run.name
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.runs[name] = {"start": time.monotonic(), "from": cfg.model.init_from, "effort": cfg.effort.level,
                               "budget": cfg.effort.budget, "domains": list(cfg.tasks.domains),
                               "files": task_files(cfg)}
            if not self.reached and self.running >= self.overlap:
                self.reached = True
                self.changed.notify_all()
        try:
            log("it   0 | reward +0.000")
            if cfg.effort.level != "high":
                with self.changed:
                    self.changed.wait_for(lambda: self.reached, timeout=10)
            time.sleep(self.seconds[cfg.effort.level] if name != self.fail else 0.01)
            if name == self.fail:
                raise RuntimeError(f"{name} broke")
            final = Path(cfg.run.output_dir) / "final"
            final.mkdir(parents=True)
            return final
        finally:
            with self.lock:
                self.running -= 1
                self.runs[name]["end"] = time.monotonic()


def teachers_config(tmp_path, *overrides):
    base = tmp_path / "sft"
    base.mkdir(exist_ok=True)
    return load_config(ROOT / "configs/teachers.yaml", [f"model.init_from={base}",
                                                        f"run.output_dir={tmp_path / 'teachers'}", *overrides])


@pytest.mark.parametrize("parallel", [1, 2, 4])
def test_teachers_run_side_by_side_after_their_high_teacher(tmp_path, monkeypatch, parallel):
    rec = Recorder(overlap=min(parallel, 6))
    monkeypatch.setattr(driver, "run_rl", rec)
    cfg = teachers_config(tmp_path, f"teachers.parallel={parallel}")
    lines: list[str] = []
    out = run_teachers(cfg, log=lines.append)
    grid = [f"{d}/{e}" for d in ("general", "agentic", "coding") for e in ("high", "medium", "low")]
    assert list(out) == grid  # the grid's order, whatever order the runs finished in
    assert json.loads((tmp_path / "teachers" / "teachers.json").read_text()) == out
    assert rec.most == min(parallel, 6)  # at most 3 highs, then up to 6 medium/low runs are ready at once
    assert f"teachers: 9 runs, {parallel} at a time" in lines
    for d in ("general", "agentic", "coding"):
        high = rec.runs[f"teacher-{d}-high"]
        assert high["from"] == cfg.model.init_from and high["effort"] == "high"
        for e in ("medium", "low"):
            run = rec.runs[f"teacher-{d}-{e}"]
            assert run["from"] == out[f"{d}/high"]  # continues from its domain's high teacher ...
            assert run["start"] >= high["end"]  # ... once that one is done
            assert run["effort"] == e and run["domains"] == [d]
    # side by side, each run's lines carry its name
    assert ("teacher-coding-low it   0 | reward +0.000" in lines) == (parallel > 1)
    assert lines.count("it   0 | reward +0.000") == (9 if parallel == 1 else 0)


def test_each_teacher_trains_on_its_own_domains_task_file(tmp_path, monkeypatch):
    """``tasks.files`` names files for several domains; a teacher trains one domain, so its config keeps that
    domain's file (a general file in the coding teacher's config would be a domain it does not train: refused)."""
    from envs.tasks.loaders import EXAMPLES

    rec = Recorder()
    monkeypatch.setattr(driver, "run_rl", rec)
    general, coding = str(EXAMPLES / "gsm8k.jsonl"), str(EXAMPLES / "mbpp.jsonl")
    test = tmp_path / "test.jsonl"  # the dataset's own held-out file
    test.write_text((EXAMPLES / "gsm8k.jsonl").read_text())
    test = str(test)
    run_teachers(teachers_config(tmp_path, "teachers.parallel=1",
                                 f"tasks.files.general={{path: {general}, format: gsm8k, heldout: {test}}}",
                                 f"tasks.files.coding={{path: {coding}, format: mbpp}}"), log=lambda _: None)
    for e in ("high", "medium", "low"):
        assert rec.runs[f"teacher-general-{e}"]["files"] == {"general": (general, "gsm8k", test)}
        assert rec.runs[f"teacher-coding-{e}"]["files"] == {"coding": (coding, "mbpp")}
        assert rec.runs[f"teacher-agentic-{e}"]["files"] == {}


def test_a_failed_teacher_stops_the_schedule_and_keeps_the_others(tmp_path, monkeypatch):
    rec = Recorder(fail="teacher-general-high", seconds={"high": 0.25})
    monkeypatch.setattr(driver, "run_rl", rec)
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="teacher-general-high broke"):
        run_teachers(teachers_config(tmp_path, "teachers.parallel=2"), log=lines.append)
    # general-high and agentic-high started together; the failure let agentic-high finish but started nothing else
    assert set(rec.runs) == {"teacher-general-high", "teacher-agentic-high"}
    assert "end" in rec.runs["teacher-agentic-high"]
    assert (tmp_path / "teachers" / "teacher-agentic-high" / "final").is_dir()
    assert any("teacher-general-high failed" in x and "1 still training will finish, none will start" in x
               for x in lines)
    assert not (tmp_path / "teachers" / "teachers.json").exists()


def test_parallel_must_be_a_count(tmp_path):
    from rlk3.config import ConfigError

    with pytest.raises(ConfigError, match=r"teachers.parallel must be in \[0, inf\], got -1"):
        teachers_config(tmp_path, "teachers.parallel=-1")
