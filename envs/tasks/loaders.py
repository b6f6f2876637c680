"""Loaders for public task formats, through ``datasets`` (local JSONL or parquet files; nothing is downloaded).

| format   | fields per record                                         | becomes                                  |
| -------- | --------------------------------------------------------- | ---------------------------------------- |
| gsm8k    | ``question``, ``answer`` ending in ``#### <number>``        | general task, ``answer`` grader          |
| mbpp     | ``text`` (or ``prompt``), ``test_list`` of ``assert f(...) == v`` | coding task, ``code`` grader         |
| humaneval| ``prompt``, ``entry_point``, ``test`` with ``assert candidate(...) == v`` | coding task, ``code`` grader |
| swe      | ``repo``, ``problem_statement``, ``files``, ``test_cmd`` | agentic task, ``command`` grader |
| verl     | ``prompt`` (one user message), ``reward_model.ground_truth`` | general task, ``answer`` grader    |

(``verl`` is the parquet verl's own ``examples/data_preprocess`` scripts write for rule-scored maths, GSM8K and
MATH among them: the user message is the task's prompt as written, instruction included (the ``answer`` grader reads
``#### x``, ``\\boxed{x}`` and ``Answer: x`` alike), and the ground truth is compared numerically or symbolically.
Records whose ground truth is not an answer (code test cases) and prompts with other roles are refused.)

(SWE ``files`` maps path → text; the ``command`` grader restores pristine copies of the test files, their data and
pytest's config and hooks first: see ``_restored``.)

Train and held-out split: a record's split is a function of its question (the gsm8k ``question``, the mbpp ``text``,
the humaneval ``prompt``, the SWE ``repo`` and ``problem_statement``, verl's user message): one question hash in five
is held out (``envs.tasks.base.content_split``, the synthetic suites' rule). So the split is the same in every run,
whatever the row order or the file's copy, and a question that appears twice never lands on both sides. A task's id
names its split (``gsm8k/train/17``: record 17 of the file).

A dataset that ships its own split (verl's ``train.parquet`` and ``test.parquet``) is read as two files instead:
``load(path, fmt, split, whole=split)`` puts every record of the file on ``split``'s side, and the task ids name
each record of its own file (``verl/heldout/17``: record 17 of the held-out file).

Tiny example files of each live in ``envs/tasks/examples/``. Test asserts that cannot be turned into
``call``/``expected`` cases (a literal on the right-hand side) are rejected with the record named, rather than
silently dropped.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

from envs.tasks.base import Task, TaskError, check_split, content_split

FORMATS = ("gsm8k", "mbpp", "humaneval", "swe", "verl")
DOMAIN_OF = {"gsm8k": "general", "mbpp": "coding", "humaneval": "coding", "swe": "agentic",  # the tasks a format makes
             "verl": "general"}
SUFFIXES = (".jsonl", ".json", ".parquet")
EXAMPLES = Path(__file__).with_name("examples")


def _records(path: str | Path) -> list[dict[str, Any]]:
    from datasets import load_dataset

    path = Path(path)
    if not path.exists():
        raise TaskError(f"task file {path} does not exist")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise TaskError(f"task file {path}: use {', '.join(SUFFIXES)}, got {path.suffix!r}")
    if kind == "json" and not path.read_bytes().strip():
        return []  # datasets raises "corresponds to no data" on a file with no records
    try:
        return list(load_dataset(kind, data_files=str(path), split="train"))
    except Exception as e:  # datasets wraps the parser's error: name the file and the cause, not datasets' builder
        cause = e.__cause__ or e
        raise TaskError(f"task file {path}: not readable as {'JSON lines or a JSON list' if kind == 'json' else kind}"
                        f" ({type(cause).__name__}: {str(cause)[:300]})") from e


def _require(rec: dict, keys: tuple[str, ...], fmt: str, i: int) -> None:
    missing = [k for k in keys if k not in rec or rec[k] in (None, "")]
    if missing:
        raise TaskError(f"{fmt} record {i}: missing field(s) {missing}; a {fmt} record needs {list(keys)}")


def _assert_cases(src: str, call_name: str | None, fmt: str, i: int) -> list[dict]:
    """``assert f(a, b) == v`` lines → code-grader cases (literal arguments and expected values only)."""
    cases = []
    for j, node in enumerate(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assert)):
        test = node.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
                and isinstance(test.left, ast.Call) and isinstance(test.left.func, ast.Name)):
            raise TaskError(f"{fmt} record {i}: test {ast.unparse(test)!r} is not of the form `f(...) == value`")
        try:
            args = [ast.literal_eval(a) for a in test.left.args]
            expected = ast.literal_eval(test.comparators[0])
        except ValueError:
            raise TaskError(f"{fmt} record {i}: test {ast.unparse(test)!r} has non-literal arguments") from None
        cases.append({"id": f"case-{j}", "call": call_name or test.left.func.id, "args": args, "expected": expected})
    if not cases:
        raise TaskError(f"{fmt} record {i}: no `assert f(...) == value` tests found")
    return cases


# files the test command reads besides the tests: pytest's hooks and config, build files of runners
_TEST_INFRA = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "noxfile.py", "Makefile", "makefile",
               "GNUmakefile"}
_PYTEST_SECTION = re.compile(r"^\s*\[\s*(pytest|tool:pytest|tool\.pytest[^\]]*)\s*\]", re.M)


def _restored(path: str, text: str, test_cmd: str) -> bool:
    """Whether an SWE file is one the ``command`` grader puts back pristine: anything under a ``test*`` path
    (test modules, their data), pytest hooks and config, runner build files, and files the command names."""
    p = Path(path)
    if any(part.startswith("test") for part in p.parts) or p.name in _TEST_INFRA:
        return True
    if p.name in ("setup.cfg", "pyproject.toml") and _PYTEST_SECTION.search(text):
        return True
    return path in test_cmd.split() or f"./{path}" in test_cmd.split()


def _verl_prompt(rec: dict, i: int) -> str:
    """A verl record's one user message (``prompt``: a list of {role, content})."""
    msgs = rec.get("prompt")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
        raise TaskError(f"verl record {i}: prompt must be a list of {{role, content}} messages, got "
                        f"{str(msgs)[:120]!r}")
    roles = [m["role"] for m in msgs]
    if roles != ["user"] or not str(msgs[0]["content"] or "").strip():
        raise TaskError(f"verl record {i}: prompt has roles {roles}; rlk3's harness writes the system prompt and the "
                        f"effort budget itself, so a record's prompt must be one non-empty user message")
    return str(msgs[0]["content"]).strip()


def _verl_answer(rec: dict, i: int) -> str:
    rm = rec.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    if isinstance(truth, bool) or not isinstance(truth, str | int | float) or not str(truth).strip():
        raise TaskError(f"verl record {i}: reward_model.ground_truth must be a final answer (a string or a number), "
                        f"got {str(truth)[:120]!r}; the verl format reads rule-scored maths (GSM8K, MATH), not code "
                        f"test cases (use mbpp or humaneval for those)")
    if rm.get("style", "rule") != "rule":
        raise TaskError(f"verl record {i}: reward_model.style is {rm.get('style')!r}; only 'rule' (a ground truth "
                        f"the answer grader checks) is read, not model-scored records")
    return str(truth).strip()


def _question(rec: dict, fmt: str) -> str:
    """What a record's split is decided by (the module's docstring)."""
    if fmt == "verl":
        msgs = rec.get("prompt")
        return str(msgs[0].get("content", "")) if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) else ""
    if fmt == "gsm8k":
        return str(rec.get("question", ""))
    if fmt == "mbpp":
        return str(rec.get("text") or rec.get("prompt") or "")
    if fmt == "humaneval":
        return str(rec.get("prompt", ""))
    return f"{rec.get('repo', '')}\x00{rec.get('problem_statement', '')}"


def load(path: str | Path, fmt: str, split: str | None = None, visible: int = 1, whole: str | None = None
         ) -> list[Task]:
    """Tasks from a local file in one of ``FORMATS``, in file order: the records of ``split`` ("train" or "heldout",
    by the question's hash: the module's docstring), or every record (None). ``whole``: every record is on that
    side instead (the file is one half of a dataset's own split). ``visible`` test cases per coding task are shown.
    Every record of the file is checked, whichever split is asked for."""
    if fmt not in FORMATS:
        raise TaskError(f"unknown task format {fmt!r}; valid formats: {list(FORMATS)}")
    for s in (split, whole):
        if s is not None:
            check_split(s)
    tasks = []
    for i, rec in enumerate(_records(path)):
        own = whole or content_split(_question(rec, fmt))
        tid = f"{fmt}/{own}/{rec.get('task_id', rec.get('instance_id', i))}"
        if fmt == "verl":
            tasks.append(Task(tid, "general", _verl_prompt(rec, i), "answer",
                              {"answer": _verl_answer(rec, i), "kind": "auto"}))
        elif fmt == "gsm8k":
            if "question" not in rec and "prompt" in rec and "reward_model" in rec:
                raise TaskError(f"gsm8k record {i}: has prompt and reward_model, not question and answer: verl's "
                                f"preprocessed format; name it: {{path: ..., format: verl}}")
            _require(rec, ("question", "answer"), fmt, i)
            m = re.search(r"####\s*(.+?)\s*$", rec["answer"].strip())
            if not m:
                raise TaskError(f"gsm8k record {i}: answer must end with '#### <final answer>'")
            tasks.append(Task(tid, "general", rec["question"].strip() + " End with a line 'Answer: <number>'.",
                              "answer", {"answer": m.group(1).replace(",", ""), "kind": "auto"}))
        elif fmt in ("mbpp", "humaneval"):
            if fmt == "mbpp":
                text = rec.get("text") or rec.get("prompt")
                _require({**rec, "text": text}, ("text", "test_list"), fmt, i)
                cases = _assert_cases("\n".join(rec["test_list"]), None, fmt, i)
                prompt = f"{text}\nWrite it in solution.py. End with 'Answer: done'."
            else:
                _require(rec, ("prompt", "entry_point", "test"), fmt, i)
                src = rec["test"].replace("candidate(", f"{rec['entry_point']}(")
                cases = _assert_cases(src, rec["entry_point"], fmt, i)
                prompt = f"Complete this function in solution.py:\n{rec['prompt']}\nEnd with 'Answer: done'."
            for c in cases[:visible]:
                c["id"] = "visible-" + c["id"]
            grading = {"visible": cases[:visible], "hidden": cases[visible:] or cases[:1], "module": "solution"}
            tasks.append(Task(tid, "coding", prompt, "code", grading, max_turns=6))
        else:
            _require(rec, ("repo", "problem_statement", "files", "test_cmd"), fmt, i)
            prompt = (f"Repository {rec['repo']}. {rec['problem_statement'].strip()}\n"
                      f"Fix it so that `{rec['test_cmd']}` passes. End with 'Answer: done'.")
            files = {k: v for k, v in dict(rec["files"]).items() if v is not None}
            # the grader restores its own copies of what the command reads before running it: edits the policy
            # makes to them do not count (and are reported)
            tests = {k: v for k, v in files.items() if _restored(k, v, rec["test_cmd"])}
            tasks.append(Task(tid, "agentic", prompt, "command", {"cmd": rec["test_cmd"], "restore": tests},
                              files=files, max_turns=20))
    return [t for t in tasks if split is None or t.task_id.split("/")[1] == split]


def load_split(path: str | Path, fmt: str, split: str, whole: str | None = None) -> list[Task]:
    """``load(path, fmt, split, whole=whole)``, read once per process for each version of the file (the prompt
    source draws one task at a time; evaluation asks again every ``run.eval_every`` iterations)."""
    p = Path(path).resolve()
    if not p.exists():
        raise TaskError(f"task file {p} does not exist")
    return list(_load_cached(str(p), fmt, split, whole, p.stat().st_mtime_ns))


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, fmt: str, split: str, whole: str | None, _mtime_ns: int) -> tuple[Task, ...]:
    return tuple(load(path, fmt, split, whole=whole))
