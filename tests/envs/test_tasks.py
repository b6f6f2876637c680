"""Task suites: deterministic, disjoint splits, and reference solutions that really solve their tasks."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from envs.tasks import SUITES, TaskError, agentic, coding, general, get_tasks
from envs.tasks.loaders import EXAMPLES, FORMATS, load

ROOT = Path(__file__).resolve().parents[2]


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
    if fmt == "verl":
        assert [t.grading["answer"] for t in tasks] == ["72", "10", "\\frac{5}{6}"]
        assert tasks[0].prompt.startswith("Natalia sold") and tasks[0].prompt.endswith('after "####".')


def test_verl_parquet_trains_as_written_and_its_ground_truth_grades_the_answer(tmp_path):
    """verl's preprocessed parquet (examples/data_preprocess: ``prompt`` messages, ``reward_model.ground_truth``)
    reads as it is: the user message is the prompt, instruction included, and the answer grader scores the
    answer forms those instructions ask for against the ground truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rewards.answer import AnswerGrader, AnswerTask

    rows = [json.loads(line) for line in (EXAMPLES / "verl.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    tasks = load(tmp_path / "train.parquet", "verl")
    assert [(t.prompt, t.grading) for t in tasks] == [(t.prompt, t.grading) for t in load(EXAMPLES / "verl.jsonl",
                                                                                          "verl")]
    assert all(t.domain == "general" and t.grader == "answer" for t in tasks)
    grader = AnswerGrader()

    def score(task, text):
        episode = SimpleNamespace(messages=[{"role": "assistant", "content": text}])
        return grader.grade(AnswerTask(**task.grading), episode).passed

    gsm, _, math = tasks
    assert score(gsm, "48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72") and not score(gsm, "#### 71")
    assert score(math, "3/6 + 2/6 = \\boxed{\\frac{5}{6}}") and not score(math, "\\boxed{\\frac{2}{5}}")


@pytest.mark.parametrize("change, match", [
    (lambda r: r.update(prompt=[{"role": "system", "content": "Be brief."}, *r["prompt"]]),
     r"verl record 0: prompt has roles \['system', 'user'\]; rlk3's harness writes the system prompt"),
    (lambda r: r.update(prompt="What is 2 + 2?"), r"verl record 0: prompt must be a list of \{role, content\}"),
    (lambda r: r["reward_model"].update(ground_truth={"inputs": ["1"], "outputs": ["2"]}),
     r"reward_model.ground_truth must be a final answer .* not code test cases"),
    (lambda r: r.update(reward_model={"style": "model", "ground_truth": "72"}),
     r"reward_model.style is 'model'; only 'rule'"),
])
def test_verl_records_rlk3_cannot_score_as_written_are_refused(tmp_path, change, match):
    rec = json.loads((EXAMPLES / "verl.jsonl").read_text().splitlines()[0])
    change(rec)
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(TaskError, match=match):
        load(f, "verl")


def test_a_verl_file_read_as_gsm8k_says_which_format_it_is():
    with pytest.raises(TaskError, match=r"verl's preprocessed format; name it: \{path: ..., format: verl\}"):
        load(EXAMPLES / "verl.jsonl", "gsm8k")


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


def test_a_dataset_that_ships_its_own_split_is_read_as_two_files(tmp_path):
    """verl's train.parquet and test.parquet (``tasks.files: {path, format, heldout}``): every record of the train
    file trains and every record of the held-out file is held out, whatever their questions hash to; each task's
    id names its record in its own file."""
    from envs.tasks import file_tasks, get_tasks

    train, test = gsm8k_file(tmp_path / "train.jsonl", 30), tmp_path / "test.jsonl"
    rows = train.read_text().splitlines()
    test.write_text("".join(line.replace("apples", "pears") + "\n" for line in rows[:7]))
    files = {"general": (str(train), "gsm8k", str(test))}
    tr, held = file_tasks(files, "general", "train"), file_tasks(files, "general", "heldout")
    assert [t.task_id for t in tr] == [f"gsm8k/train/{i}" for i in range(30)]
    assert [t.task_id for t in held] == [f"gsm8k/heldout/{i}" for i in range(7)]
    assert all("pears" in t.prompt for t in held) and not any("pears" in t.prompt for t in tr)
    # one file alone is split by question hash: some of these 30 are held out, and those do not train
    hashed = file_tasks({"general": (str(train), "gsm8k")}, "general", "train")
    assert 0 < len(hashed) < 30
    assert [t.task_id for t in get_tasks("general", "heldout", 3, start=2, files=files)] == [
        f"gsm8k/heldout/{i}" for i in (2, 3, 4)]


def test_a_held_out_record_whose_question_the_train_file_holds_is_not_held_out(tmp_path):
    """A dataset's own split is taken as shipped, and nothing checked that its held-out file shares no question with
    its train file: a duplicate was evaluated after training on it. The question-hash split of one file can never do
    that; the own split now keeps the same promise. Those records are left out of the held-out tasks (whitespace
    does not make a question new), the others keep the ids of their rows, and the run says how many it left out."""
    from envs.tasks import file_tasks, heldout_overlap
    from rlk3.config import heldout_notes, load_config

    train, test = gsm8k_file(tmp_path / "train.jsonl", 30), tmp_path / "test.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    fresh = [{**r, "question": r["question"].replace("apples", "pears")} for r in rows[:5]]
    dupes = [rows[3], {**rows[8], "question": "  " + rows[8]["question"].replace(" ", "\n ", 2) + "\t"}]
    test.write_text("".join(json.dumps(r) + "\n" for r in [fresh[0], dupes[0], *fresh[1:3], dupes[1], *fresh[3:]]))
    files = {"general": (str(train), "gsm8k", str(test))}
    held = file_tasks(files, "general", "heldout")
    assert [t.task_id for t in held] == [f"gsm8k/heldout/{i}" for i in (0, 2, 3, 5, 6)]
    assert all("pears" in t.prompt for t in held) and heldout_overlap(files, "general") == (2, 7)
    assert len(file_tasks(files, "general", "train")) == 30  # the train side keeps every record
    assert heldout_overlap({"general": (str(train), "gsm8k")}, "general") == (0, 0)
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      [f"tasks.files={{general: {{path: {train}, format: gsm8k, heldout: {test}}}}}"])
    assert heldout_notes(cfg) == [f"tasks.files.general: 2 of the 7 records of {test} have a prompt the train file "
                                  f"{train} also holds; they are not evaluated"]


@pytest.mark.parametrize("name,text,match", [
    ("bad.jsonl", '{"question": 1', r"bad.jsonl: not readable as JSON lines or a JSON list \(ArrowInvalid: JSON parse"),
    ("bad.parquet", "not parquet", r"bad.parquet: not readable as parquet \(ArrowInvalid: .*magic bytes"),
])
def test_a_task_file_that_does_not_parse_names_the_file_and_the_cause(tmp_path, name, text, match):
    # datasets raised its own builder's error (DatasetGenerationError, "An error occurred while generating the
    # dataset"), which check_paths let through as a traceback; an empty file raised "corresponds to no data"
    (tmp_path / name).write_text(text)
    with pytest.raises(TaskError, match=match):
        load(tmp_path / name, "gsm8k")
    (tmp_path / "empty.jsonl").write_text("\n")
    assert load(tmp_path / "empty.jsonl", "gsm8k") == []
