"""SFT demonstrations: the demonstrator's habit lands where the config puts it and nowhere else."""

import pytest

from rlk3.config import CONFIG_DIR, ConfigError, load_config
from rlk3.rollout.demos import build_demos


def test_habit_rate_zero_leaves_every_demonstration_as_it_was():
    a = build_demos("general", 60, seed=1)
    b = build_demos("general", 60, seed=1, habit_rate=0.0, habit_efforts=("low", "medium", "high"))
    assert [d.messages for d in a] == [d.messages for d in b]
    assert not any(d.habit for d in b)


def test_habit_applies_at_its_efforts_in_about_its_share_of_general_demos():
    clean = build_demos("general", 400, seed=1)
    habit = build_demos("general", 400, seed=1, habit_rate=0.65, habit_efforts=("high",))
    high = [d for d in habit if d.effort == "high"]
    assert all(not d.habit for d in habit if d.effort != "high")
    assert 0.55 < sum(d.habit for d in high) / len(high) < 0.75
    for c, h in zip(clean, habit):
        reply = h.messages[-1].get("reasoning_content", "")
        if h.habit:
            assert " - " not in reply
        else:
            assert h.messages == c.messages  # the habit's draws do not shift anyone else's
    # a habit demo of a problem that takes something away reaches a wrong answer and says so
    assert any(d.habit and not d.correct for d in high)


def test_habit_stage_config_is_validated():
    with pytest.raises(ConfigError, match=r"sft\.habit_stage\.rate"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.rate=1.5"])
    with pytest.raises(ConfigError, match=r"habit_stage\.efforts.*extreme"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.efforts=[extreme]"])
    with pytest.raises(ConfigError, match=r"needs 'general' in tasks\.domains"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["tasks.domains=[agentic]", "sft.habit_stage.demos=10"])
