"""The demo pipeline end to end at toy scale (slow): nine teachers (each from the base, then medium/low from high),
MOPD over all nine, evaluation of every model on every slice, the report. The numbers `make demo` reaches at full
scale are in docs/demo.md; this checks that every stage runs and hands the next one what it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlk3.config import load_config
from rlk3.rollout.demos import DEFAULT_BUDGETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_pipeline_at_toy_scale(general_policy, tmp_path):
    import ray

    from rlk3.pipeline import run_demo

    model, tok = general_policy
    base = tmp_path / "base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    cfg = load_config(ROOT / "configs/demo.yaml", [
        f"run.output_dir={tmp_path / 'demo'}", f"model.init_from={base}", "run.iterations=1", "run.checkpoint_every=1",
        "effort.anneal_steps=1", "rollout.groups_per_iteration=2", "rollout.group_size=2", "rollout.max_new_tokens=48",
        "rollout.max_total_tokens=768", "harness.max_turns=2", "mopd.iterations=1", "tasks.heldout_size=2",
        "tasks.heldout_sizes.general=3", "cluster.cpu_threads=1",
        # configs/demo.yaml's general teachers at toy scale too; general/low's own entry is applied over them
        "teachers.overrides.general.rollout.groups_per_iteration=2", "teachers.overrides.general.rollout.group_size=2",
        "teachers.overrides.general.rollout.max_new_tokens=48", "teachers.overrides.general.run.iterations=1",
        "teachers.overrides.general/high.run.iterations=1", "teachers.overrides.general/low.run.iterations=2",
        *(f"teachers.overrides.{d}.{k}" for d in ("agentic", "coding", "agentic/high", "coding/high")
          for k in ("rollout.groups_per_iteration=2", "rollout.group_size=2", "run.iterations=1")),
        "mopd.overrides.rollout.groups_per_iteration=2", "mopd.overrides.rollout.group_size=2"])
    lines = []
    try:
        report = run_demo(cfg, log=lines.append)
        cpus = int(ray.cluster_resources()["CPU"])
    finally:
        ray.shutdown()
    root = tmp_path / "demo"
    teachers = json.loads((root / "teachers.json").read_text())
    assert sorted(teachers) == sorted(f"{d}/{e}" for d in ("general", "agentic", "coding")
                                      for e in ("low", "medium", "high"))
    for key, path in teachers.items():
        man = json.loads((Path(path) / "manifest.json").read_text())
        assert man["domains"] == [key.split("/")[0]] and man["effort"] == key.split("/")[1]
        assert man["budget"] == DEFAULT_BUDGETS[man["effort"]]  # each teacher ends at its effort's budget
    assert any("teacher-general-medium from" in x and "teacher-general-high" in x for x in lines)
    # the base and the teachers are evaluated beside the student's training, not after it
    assert lines.index("demo: evaluating the SFT base and 9 teachers while the student trains") < next(
        i for i, x in enumerate(lines) if x.startswith("demo: student ready"))
    assert f"teachers: 9 runs, {min(cpus, 9)} at a time" in lines  # as many as the local head's CPUs hold
    iterations = {k: len((Path(p).parent / "metrics.jsonl").read_text().splitlines()) for k, p in teachers.items()}
    assert iterations == {k: 2 if k == "general/low" else 1 for k in teachers}  # teachers.overrides applied
    ev = json.loads((root / "eval.json").read_text())
    names = [m["name"] for m in ev["models"]]
    assert names[0] == "sft" and names[-1] == "student" and len(names) == 11
    assert len(ev["models"][0]["slices"]) == 9 and len(ev["models"][-1]["slices"]) == 9
    student_rows = [json.loads(x) for x in (root / "student/metrics.jsonl").read_text().splitlines()]
    assert student_rows[0]["stage"] == "mopd" and any(k.startswith("kl/") for k in student_rows[0])
    # mopd.overrides applied: 2 x 2 samples a step, lr 1e-4 a third of the way through its 3 warm-up steps
    assert student_rows[0]["samples"] == 4 and student_rows[0]["train/lr"] == pytest.approx(1e-4 / 3)
    assert report.name == "report.md" and report.exists()
    assert len(list(report.parent.glob("*.png"))) >= 3
    assert any("general" in x and "low" in x for x in lines)  # the slice table was printed
    assert "checks met" in lines[-2] and "teacher beats SFT on its domain" in lines[-2]  # then the acceptance table
    man = json.loads((root / "manifest.json").read_text())
    assert man["heldout"] == {"general": 3, "agentic": 2, "coding": 2} and man["loop"]["max_turns"] == 2
    assert [s["n"] for s in ev["models"][0]["slices"]] == [3, 3, 3, 2, 2, 2, 2, 2, 2]
    # `python -m rlk3 eval` of the manifest, one model after another in this process: the same eval.json as the
    # demo's, whose base and teachers were evaluated beside the student's training
    from rlk3.pipeline import run_eval

    run_eval(root / "manifest.json", log=lambda _: None, workers=1)
    assert json.loads((root / "eval.json").read_text()) == ev


def test_the_eval_stage_evaluates_a_domain_on_its_task_files_heldout_tasks(general_policy, tmp_path):
    """A run manifest records ``tasks.files`` (absolute paths), and ``python -m rlk3 eval`` of it evaluates those
    domains on the files' held-out tasks, not the synthetic suite's."""
    from envs.tasks.loaders import load
    from rlk3.pipeline import Evaluation, _evaluate_model, manifest_files
    from tests.envs.test_tasks import gsm8k_file

    model, tok = general_policy
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    f = gsm8k_file(tmp_path / "gsm8k.jsonl", 30)
    held = load(f, "gsm8k", "heldout")
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"tasks.files={{general: {f}}}"])
    m = {"sft": str(tmp_path / "base"), "heldout": {"general": 64, "agentic": 1, "coding": 1},
         "loop": {"max_turns": 1, "max_turn_tokens": 16, "max_context_tokens": 512}, "files": manifest_files(cfg)}
    assert m["files"] == {"general": [str(f.resolve()), "gsm8k"]}
    ev = Evaluation.of_manifest(json.loads(json.dumps(m)), workers=1)  # as run_eval reads it back
    try:
        entry, bad, _ = _evaluate_model(("sft", "sft", "general", "high", m["sft"], [("general", "high", None)],
                                         ev.n, ev.loop, ev.files, ev.device))
    finally:
        ev.close()
    assert 0 < len(held) < 64 and [s["n"] for s in entry["slices"]] == [len(held)] and bad == 0
