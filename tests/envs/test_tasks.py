"""Task suites: deterministic, disjoint splits, and reference solutions that really solve their tasks."""

import json
import subprocess

import pytest

from envs.tasks import SUITES, TaskError, agentic, coding, general, get_tasks
from envs.tasks.loaders import EXAMPLES, FORMATS, load


@pytest.mark.parametrize("domain", sorted(SUITES))
def test_suites_are_deterministic_and_splits_disjoint(domain):
    a = get_tasks(domain, "train", 50)
    assert [t.fingerprint() for t in a] == [t.fingerprint() for t in get_tasks(domain, "train", 50)]
    train = {(t.prompt, json.dumps(t.files, sort_keys=True)) for t in get_tasks(domain, "train", 400)}
    held = [(t.prompt, json.dumps(t.files, sort_keys=True)) for t in get_tasks(domain, "heldout", 100)]
    assert sum(h in train for h in held) == 0  # the split is a function of the content
    assert len({t.task_id for t in a}) == 50


def test_general_reasoning_reaches_the_answer_and_slips_change_it():
    for t in get_tasks("general", "heldout", 200):
        p = general.problem_of(t)
        assert int(t.grading["answer"]) == p.answer
        for effort in ("low", "medium", "high"):
            text, ans = general.reasoning(p, effort)
            assert ans == p.answer
            assert (text == "") == (effort == "low")
        assert general.reasoning(p, "high", slip=2)[1] == p.answer + 2
    lengths = {e: sum(len(general.reasoning(general.problem_of(t), e)[0]) for t in get_tasks("general", "train", 100))
               for e in ("low", "medium", "high")}
    assert lengths["low"] < lengths["medium"] < lengths["high"]


def test_the_unsigned_habit_adds_what_is_taken_away():
    seen = 0
    for t in get_tasks("general", "heldout", 200):
        p = general.problem_of(t)
        text, ans = general.reasoning(p, "high", unsigned=True)
        if all(x >= 0 for x in p.numbers[1:]):  # nothing taken away: the habit changes nothing
            assert (text, ans) == general.reasoning(p, "high")
            continue
        seen += 1
        assert ans == p.numbers[0] + sum(abs(x) for x in p.numbers[1:]) != p.answer
        assert " - " not in text
    assert seen > 80


def test_the_early_habit_stops_one_change_short():
    for t in get_tasks("general", "heldout", 100):
        p = general.problem_of(t)
        short = general.Problem(p.numbers[:-1], p.word, p.name, p.item)
        for effort in ("low", "medium", "high"):
            text, ans = general.reasoning(p, effort, early=True)
            assert ans == sum(p.numbers[:-1]) != p.answer
            assert (text, ans) == general.reasoning(short, effort)  # the last change is never read
        if len(p.numbers) == 2:  # one change: nothing is worked, the first number is the answer
            assert general.reasoning(p, "high", early=True) == ("", p.numbers[0])


def run_solution(task, tmp_path, terse=False):
    """Execute the reference tool calls for real (bash in a scratch directory) and return the outputs."""
    for path, text in task.files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    outputs = []
    steps = agentic.solution(task, terse=terse) if task.domain == "agentic" else coding.solution(task, check=True)
    for step in steps:
        if step.tool == "shell":
            r = subprocess.run(["bash", "-c", step.args["command"]], cwd=tmp_path, capture_output=True, text=True,
                               timeout=10)
            outputs.append(r.stdout + r.stderr)
        elif step.tool == "write":
            (tmp_path / step.args["path"]).write_text(step.args["content"])
            outputs.append("")
        else:
            outputs.append(step.args["answer"])
    return outputs


def test_agentic_solutions_match_tasks_drawn_without_a_kind(tmp_path):
    for i, t in enumerate(get_tasks("agentic", "train", 40)):
        case = tmp_path / str(i)
        case.mkdir()
        assert run_solution(t, case)[-1] == t.grading["answer"]


@pytest.mark.parametrize("kind", agentic.KINDS)
def test_agentic_reference_solutions_work_in_a_real_shell(kind, tmp_path):
    for i in range(4):
        t = agentic.task("heldout", i, kind=kind)
        case = tmp_path / f"{kind}{i}"
        case.mkdir()
        outputs = run_solution(t, case)
        assert outputs[-1] == t.grading["answer"]
        assert len([s for s in agentic.solution(t) if s.tool != "submit"]) >= 2  # at least two working calls
        evidence = outputs[-2]
        assert t.grading["answer"] in evidence, (kind, outputs)  # the tools really reveal the answer
        if kind == "fix":
            assert outputs[0].startswith("error: mode must be")


@pytest.mark.parametrize("kind", agentic.KINDS)
def test_agentic_terse_solutions_take_one_call_fewer_and_still_need_the_tools(kind, tmp_path):
    for i in range(4):
        t = agentic.task("heldout", i, kind=kind)
        case = tmp_path / f"{kind}{i}"
        case.mkdir()
        outputs = run_solution(t, case, terse=True)
        assert outputs[-1] == t.grading["answer"]
        calls = [s for s in agentic.solution(t, terse=True) if s.tool != "submit"]
        assert len(calls) == len([s for s in agentic.solution(t) if s.tool != "submit"]) - 1 >= 1
        assert t.grading["answer"] in outputs[-2]  # what the chained command printed reveals the answer
        assert t.grading["answer"] not in t.prompt + "".join(s.args.get("command", "") for s in calls)


def test_coding_reference_solutions_pass_every_case(tmp_path):
    for i, t in enumerate(get_tasks("coding", "heldout", 60)):
        case = tmp_path / str(i)
        case.mkdir()
        outputs = run_solution(t, case)
        namespace = {}
        exec((case / "solution.py").read_text(), namespace)
        for c in t.grading["visible"] + t.grading["hidden"]:
            assert namespace[c["call"]](*c["args"]) == c["expected"]
        assert outputs[1].strip() == str(t.grading["visible"][0]["expected"])  # the check step prints the example


@pytest.mark.parametrize("fmt", FORMATS)
def test_public_format_examples_load(fmt):
    tasks = load(EXAMPLES / f"{fmt}.jsonl", fmt)
    assert tasks and all(t.task_id.startswith(fmt) for t in tasks)
    if fmt == "gsm8k":
        assert [t.grading["answer"] for t in tasks] == ["72", "10"]
    if fmt in ("mbpp", "humaneval"):
        assert all(t.grading["hidden"] and t.grader == "code" for t in tasks)
    if fmt == "swe":
        assert tasks[0].grading["restore"] == {"test_calc.py": tasks[0].files["test_calc.py"]}


def gsm8k_file(path, n, order=None):
    """A gsm8k-format file of ``n`` distinct questions (in ``order``, a permutation of range(n))."""
    rows = [{"question": f"Tom has {a} apples and buys {a + 3} more. How many now?", "answer": f"#### {2 * a + 3}"}
            for a in range(n)]
    path.write_text("".join(json.dumps(rows[i]) + "\n" for i in (order or range(n))))
    return path


def test_a_files_split_is_stable_disjoint_and_a_function_of_the_question(tmp_path):
    """``load``'s ``split`` was only a label in the task id: every record came back whichever split was asked for.
    Now a record's split is its question's hash, so train and held-out never share a question, whatever the row
    order, the same in every run."""
    f = gsm8k_file(tmp_path / "a.jsonl", 40)
    train, held, every = load(f, "gsm8k", "train"), load(f, "gsm8k", "heldout"), load(f, "gsm8k")
    assert train and held and len(train) + len(held) == len(every) == 40
    assert {t.prompt for t in train}.isdisjoint(t.prompt for t in held)
    assert all(t.task_id.startswith("gsm8k/train/") for t in train)
    assert all(t.task_id.startswith("gsm8k/heldout/") for t in held)
    assert sorted(t.task_id for t in every) == sorted(t.task_id for t in train + held)
    shuffled = gsm8k_file(tmp_path / "b.jsonl", 40, order=list(reversed(range(40))))
    assert {t.prompt for t in load(shuffled, "gsm8k", "heldout")} == {t.prompt for t in held}
    # a file replaces a domain's suite in get_tasks: the first n of its split, fewer when the split runs out
    files = {"general": (str(f), "gsm8k")}
    assert get_tasks("general", "heldout", 2, files=files) == held[:2]
    assert get_tasks("general", "heldout", 1000, files=files) == held
    assert get_tasks("general", "train", 3, start=1, files=files) == train[1:4]
    with pytest.raises(TaskError, match=r"format 'gsm8k' makes general tasks, not coding ones"):
        get_tasks("coding", "train", 1, files={"coding": (str(f), "gsm8k")})


def test_loader_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    with pytest.raises(TaskError, match=r"answer must end with '#### <final answer>'"):
        load(bad, "gsm8k")
    bad.write_text(json.dumps({"text": "f", "test_list": ["assert f(x) == 1"]}) + "\n")
    with pytest.raises(TaskError, match=r"non-literal arguments"):
        load(bad, "mbpp")
    with pytest.raises(TaskError, match=r"unknown task format 'csv'"):
        load(bad, "csv")
    with pytest.raises(TaskError, match=r"unknown domain 'math'"):
        get_tasks("math", "train", 1)
    with pytest.raises(TaskError, match=r"split must be one of \['train', 'heldout'\]"):
        get_tasks("general", "test", 1)
