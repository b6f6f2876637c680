"""The effort budget from the config to the prompt: the schedule's value at each step is what the prompt source
hands out (and what the agent loop states and enforces, tests/rlk3/rollout/test_agent_loop.py)."""

from pathlib import Path

from rlk3.cluster.workers import budget_fn
from rlk3.config import load_config
from rlk3.rollout.partial import PromptSource

ROOT = Path(__file__).resolve().parents[3]


def test_low_effort_anneals_from_the_high_budget_down():
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["effort.level=low", "effort.budget=96",
                                                         "effort.budget_start=384", "effort.anneal_steps=20"])
    at, _ = budget_fn(cfg)
    assert [at("low", s) for s in (0, 10, 20, 40)] == [384, 240, 96, 96]  # 384 - 288 * min(s / 20, 1)
    assert at("high", 10) == 384  # other levels (MOPD's mixed prompts) keep their own budgets
    src = PromptSource(["general"], ["low"], at, seed=0)
    assert [src.next(step).budget for step in (0, 5, 10, 20)] == [384, 312, 240, 96]


def test_the_step_schedule_drops_in_equal_steps():
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["effort.level=medium", "effort.budget=192",
                                                         "effort.budget_start=384", "effort.anneal_steps=8",
                                                         "effort.schedule=step"])
    at, _ = budget_fn(cfg)
    assert [at("medium", s) for s in (0, 1, 2, 4, 6, 8, 9)] == [384, 384, 336, 288, 240, 192, 192]


def test_without_budget_start_the_budget_is_constant():
    at, _ = budget_fn(load_config(ROOT / "configs/quickstart.yaml"))
    assert {at("high", s) for s in range(50)} == {384}
