"""Registry (unknown names fail with the valid list; every default loads) and the effort-budget grader."""

import pytest

from rewards import Grade, GraderConfigError, SimpleTrajectory, get_grader, grader_names, validate_task
from rewards.answer import AnswerTask
from rewards.effort import compose, generated_tokens


def test_unknown_grader_names_the_valid_ones():
    with pytest.raises(GraderConfigError) as e:
        get_grader("anwser")
    msg = str(e.value)
    assert "'anwser'" in msg
    for name in grader_names():
        assert name in msg


@pytest.mark.parametrize("bad", ["", None, 3, "no.such.module:Grader", "rewards.answer:Nope"])
def test_bad_names_fail_at_config_time(bad):
    with pytest.raises(GraderConfigError):
        get_grader(bad)


def test_every_registered_default_loads():
    assert set(grader_names()) == {"answer", "code", "command", "kernel", "webdev", "effort"}
    for name in grader_names():
        g = get_grader(name)
        assert g.name == name and callable(g.grade) and callable(g.validate)


def test_dotted_path_loads_custom_grader():
    g = get_grader("rewards.answer:AnswerGrader")
    assert g.name == "answer"


def test_answer_task_validation():
    with pytest.raises(GraderConfigError, match="answer"):
        validate_task("answer", AnswerTask(answer="  "))
    with pytest.raises(GraderConfigError, match="kind"):
        validate_task("answer", AnswerTask(answer="1", kind="fuzzy"))
    assert validate_task("answer", AnswerTask(answer="1")).name == "answer"


def _traj(n_gen, n_tool=0, budget=None):
    ids = list(range(n_gen + n_tool))
    mask = [1] * n_gen + [0] * n_tool
    return SimpleTrajectory(token_ids=ids, loss_mask=mask, budget=budget)


def test_effort_counts_generated_tokens_not_tool_output():
    g = get_grader("effort")
    assert generated_tokens(_traj(10, 500)) == 10
    within = g.grade(None, _traj(100, 5000, budget=100))
    assert within.score == 0.0 and within.passed
    over = g.grade(None, _traj(101, 0, budget=100))
    assert over.score == -1.0 and not over.passed and over.reason_codes() == {"over_budget"}
    assert over.details == {"generated_tokens": 101, "budget": 100}
    assert g.grade(None, _traj(10**6)).score == 0.0  # no budget: no penalty


def test_effort_malformed_mask_is_penalised_not_raised():
    g = get_grader("effort")
    bad = SimpleTrajectory(token_ids=[1, 2, 3], loss_mask=[1], budget=10)
    grade = g.grade(None, bad)
    assert grade.score == -1.0 and grade.reason_codes() == {"malformed_trajectory"}


def test_effort_composes_with_outcome():
    outcome = Grade(1.0, True, [], {"x": 1})
    over = Grade(-1.0, False, ["over_budget: 2 > 1"], {})
    within = Grade(0.0, True, [], {})
    assert compose(outcome, over, "override").score == -1.0
    assert compose(outcome, over, "add").score == 0.0
    assert compose(outcome, within).score == 1.0 and compose(outcome, within).passed
    with pytest.raises(GraderConfigError):
        compose(outcome, over, "multiply")


def test_effort_budget_validation():
    with pytest.raises(GraderConfigError, match="budget"):
        validate_task("effort", SimpleTrajectory(budget=-5))


def test_missing_pristine_assets_fail_at_config_validation(monkeypatch, tmp_path):
    import rewards.code.grader as code_grader
    import rewards.kernel.grader as kernel_grader
    from rewards.code.grader import CodeCase, CodeTask
    from rewards.kernel.grader import KernelTask

    task = CodeTask(visible=[], hidden=[CodeCase(id="h", call="f", expected=1)])
    monkeypatch.setattr(code_grader, "RUNNER", tmp_path / "runner.py")
    with pytest.raises(GraderConfigError, match=r"grader 'code': pristine runner missing"):
        validate_task("code", task)
    monkeypatch.setattr(kernel_grader, "HERE", tmp_path)
    with pytest.raises(GraderConfigError, match=r"grader 'kernel': pristine assets missing: \['judge.py'"):
        validate_task("kernel", KernelTask())
