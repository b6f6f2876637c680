"""SFT demonstrations: the demonstrator's habit lands where the config puts it and nowhere else."""

import pytest

from envs.tasks import agentic, general, get_tasks
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


def test_the_general_demonstrator_can_have_the_early_habit_instead():
    clean = build_demos("general", 120, seed=4, error_rate=0.0)
    early = build_demos("general", 120, seed=4, error_rate=0.0, habit_rate=1.0, habit="early")
    assert sum(d.habit for d in early) == sum(d.effort == "high" for d in early) > 20
    for c, h in zip(clean, early):
        if not h.habit:
            assert h.messages == c.messages
            continue
        p = general.problem_of(next(t for t in get_tasks("general", "train", 120) if t.task_id == h.task_id))
        assert not h.correct and h.messages[-1]["content"] == f"Answer: {sum(p.numbers[:-1])}"
    with pytest.raises(ValueError, match=r"general has no habit 'lazy'; its habits: \['unsigned', 'early'\]"):
        build_demos("general", 4, habit_rate=1.0, habit="lazy")


def test_habit_stage_config_is_validated():
    with pytest.raises(ConfigError, match=r"sft\.habit_stage\.rate"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.rate=1.5"])
    with pytest.raises(ConfigError, match=r"habit_stage\.efforts.*extreme"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.efforts=[extreme]"])
    with pytest.raises(ConfigError, match=r"domain_demos\.general=1200 needs 'general' in tasks\.domains"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["tasks.domains=[agentic]"])
    with pytest.raises(ConfigError, match=r"sft\.habit_stage\.domain_demos\.coding must be in \[0, inf\], got -1"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.domain_demos.coding=-1"])
    with pytest.raises(ConfigError, match=r"sft\.habit_stage\.habits\.general must be one of \['unsigned', 'early'\], "
                                          r"got 'lazy'"):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.habits.general=lazy"])
    with pytest.raises(ConfigError, match=r"sft\.habit_stage\.habits key must be one of \['general', 'agentic', "):
        load_config(CONFIG_DIR / "sft-tiny.yaml", ["sft.habit_stage.habits.math=early"])
    cfg = load_config(CONFIG_DIR / "sft-tiny.yaml",
                      ["tasks.domains=[agentic]", "sft.habit_stage.domain_demos.general=0"])
    assert not any(cfg.sft.habit_stage.domain_demos.values())


def _calls(demo):
    return [c["function"] for m in demo.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]


def test_agentic_habit_answers_one_step_early_with_the_last_printed_line():
    clean = build_demos("agentic", 30, seed=2, error_rate=0.0)
    habit = build_demos("agentic", 30, seed=2, error_rate=0.0, habit_rate=1.0, habit_efforts=("high",))
    assert any(d.effort == "high" for d in habit) and any(d.effort != "high" for d in habit)
    for c, h in zip(clean, habit):
        assert (c.effort, c.task_id) == (h.effort, h.task_id)
        if h.effort != "high":
            assert h.messages == c.messages and not h.habit and h.correct
            continue
        assert h.habit and not h.correct
        want, got = _calls(c), _calls(h)
        assert [f["name"] for f in got] == [f["name"] for f in want[:-2]] + ["submit"]  # the last tool call skipped
        assert got[:-1] == want[:-2]
        answer = got[-1]["arguments"]["answer"]
        # the last line a program printed: a fix episode's sed prints nothing, so it is the failed check's line
        printed = [m["content"] for m in h.messages if m["role"] == "tool" and m["content"] != "(no output)"][-2]
        assert answer and answer == printed.replace("[exit code: 1]", "").strip().splitlines()[-1]
        assert answer != want[-1]["arguments"]["answer"]
        assert "(no output)" not in answer and "exit code" not in answer


def test_coding_habit_prints_numbers_instead_of_returning_them():
    clean = build_demos("coding", 60, seed=3, error_rate=0.0)
    habit = build_demos("coding", 60, seed=3, error_rate=0.0, habit_rate=1.0, habit_efforts=("low", "medium", "high"))
    numeric = {"add_k", "sub_k", "mul_k", "affine", "count_char", "total", "biggest"}
    assert 0 < sum(d.habit for d in habit) < len(habit)
    for c, h in zip(clean, habit):
        family = _calls(c)[0]["arguments"]["content"].split("(")[0].removeprefix("def ")
        assert h.habit == (family in numeric)
        if not h.habit:  # a string or a list: nothing to print instead
            assert h.messages == c.messages and h.correct
            continue
        assert not h.correct
        code, ref = _calls(h)[0]["arguments"]["content"], _calls(c)[0]["arguments"]["content"]
        assert code == ref.replace("    return ", "    print(").rstrip("\n") + ")\n"
        if h.effort == "high":  # the check it runs prints the value and then the None the function returned
            assert [m["content"] for m in h.messages if m["role"] == "tool"][1].rstrip().endswith("None")


def _generated_tokens(harness, demo):
    _, mask = harness.assistant_mask(demo.messages)
    return sum(mask)


def test_worked_thoughts_reason_from_the_outputs_and_set_the_efforts_apart():
    from harness import Harness
    from harness.tokenizer import default_tokenizer

    plain = build_demos("agentic", 90, seed=4, error_rate=0.3)
    worked = build_demos("agentic", 90, seed=4, error_rate=0.3, worked_thoughts=True)
    for p, w in zip(plain, worked):
        assert (p.task_id, p.effort, p.correct) == (w.task_id, w.effort, w.correct)
        assert _calls(p) == _calls(w)  # the same moves and answers, wrong ones included
        assert [m for m in p.messages if m["role"] == "tool"] == [m for m in w.messages if m["role"] == "tool"]
        thoughts = [m.get("reasoning_content") for m in w.messages if m["role"] == "assistant"]
        if w.effort == "low":
            assert w.messages == p.messages
        elif w.effort == "medium":
            assert thoughts[0] and not any(thoughts[1:])
        else:
            assert all(thoughts)
            # each thought after an output restates what in it varies from task to task (a path, a number, a mode);
            # a wrong demonstration's last thought misreads it instead (below)
            seen = ""
            for m in w.messages:
                if m["role"] == "tool":
                    seen = "" if m["content"] == "(no output)" else str(m["content"])
                elif m["role"] == "assistant" and seen and (w.correct or m is not w.messages[-2]):
                    words = {t.strip("'.,") for t in seen.replace("->", " ").split() if "exit" not in t}
                    facts = {t for t in words if any(c.isdigit() for c in t) or t in agentic.MODES}
                    assert facts and any(t in m["reasoning_content"] for t in facts), (m["reasoning_content"], seen)
            # and the submitting thought names the answer it submits, a wrong one too
            assert _calls(w)[-1]["arguments"]["answer"] in thoughts[-1]
    assert any(not w.correct and w.effort == "high" for w in worked)
    harness = Harness(worked[0].preset, tokenizer=default_tokenizer())
    mean = {e: sum(_generated_tokens(harness, d) for d in worked if d.effort == e) / sum(d.effort == e for d in worked)
            for e in ("low", "medium", "high")}
    plain_high = [_generated_tokens(harness, d) for d in plain if d.effort == "high"]
    assert mean["low"] < mean["medium"] < mean["high"]
    assert mean["low"] <= 0.5 * mean["high"], mean  # plain thoughts: ~0.7 (docs/sft.md, "Worked thoughts")
    assert mean["low"] > 0.5 * sum(plain_high) / len(plain_high)


def test_worked_habit_thoughts_name_the_early_answer():
    habit = build_demos("agentic", 30, seed=2, error_rate=0.0, habit_rate=1.0, worked_thoughts=True)
    for h in habit:
        if h.habit:
            answer = _calls(h)[-1]["arguments"]["answer"]
            assert h.messages[-2]["reasoning_content"].endswith(f"so I submit {answer}.")
