"""Resuming truncates the metrics log to the iterations that will run again (rlk3/cluster/checkpoint.py)."""

from types import SimpleNamespace

from rlk3.cluster.checkpoint import Checkpoints, MetricsLog, resume_point


def _cfg():
    run = SimpleNamespace(stage="rl", name="t", log_tensorboard=False)
    return SimpleNamespace(run=run, tasks=SimpleNamespace(domains=["general"]), effort=SimpleNamespace(level="low"))


def test_a_run_killed_before_its_first_checkpoint_logs_iteration_zero_once(tmp_path):
    """Killed after writing iteration 0's row, before checkpoint 1: the restart runs iteration 0 again, so its row
    must go (this made tests/rlk3/cluster/test_driver.py's SIGKILL test fail under load: [it 0, it 0, it 1, ...])."""
    ckpts, metrics = Checkpoints(tmp_path / "checkpoints"), MetricsLog(tmp_path, _cfg())
    metrics.write({"iteration": 0, "samples": 8})
    assert resume_point(ckpts, metrics, resume=True) is None
    assert metrics.rows() == []
    metrics.write({"iteration": 0, "samples": 8})
    assert [r["iteration"] for r in metrics.rows()] == [0]


def test_resume_drops_the_rows_after_the_checkpoint_and_keeps_the_rest(tmp_path):
    ckpts, metrics = Checkpoints(tmp_path / "checkpoints"), MetricsLog(tmp_path, _cfg())
    for it in range(3):
        metrics.write({"iteration": it, "samples": 8 * (it + 1)})
    ckpts.save(2, {"step": 2}, {"buffer": []})
    saved = resume_point(ckpts, metrics, resume=True)
    assert saved.iteration == 2 and saved.trainer == {"step": 2}
    assert [r["iteration"] for r in metrics.rows()] == [0, 1]  # iteration 2 runs again
    # resume off: the run starts over, and its log with it
    assert resume_point(ckpts, metrics, resume=False) is None
    assert metrics.rows() == []
