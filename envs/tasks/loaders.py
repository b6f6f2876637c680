"""Loaders for public task formats, through ``datasets`` (local JSONL or parquet files; nothing is downloaded).

| format   | fields per record                                         | becomes                                  |
| -------- | --------------------------------------------------------- | ---------------------------------------- |
| gsm8k    | ``question``, ``answer`` ending in ``#### <number>``        | general task, ``answer`` grader          |
| mbpp     | ``text`` (or ``prompt``), ``test_list`` of ``assert f(...) == v`` | coding task, ``code`` grader         |
| humaneval| ``prompt``, ``entry_point``, ``test`` with ``assert candidate(...) == v`` | coding task, ``code`` grader |
| swe      | ``repo``, ``problem_statement``, ``files``, ``test_cmd`` | agentic task, ``command`` grader |

(SWE ``files`` maps path → text; the ``command`` grader restores pristine copies of the test files, their data and
pytest's config and hooks first: see ``_restored``.)

Tiny example files of each live in ``envs/tasks/examples/``. Test asserts that cannot be turned into
``call``/``expected`` cases (a literal on the right-hand side) are rejected with the record named, rather than
silently dropped.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from envs.tasks.base import Task, TaskError

FORMATS = ("gsm8k", "mbpp", "humaneval", "swe")
EXAMPLES = Path(__file__).with_name("examples")


def _records(path: str | Path) -> list[dict[str, Any]]:
    from datasets import load_dataset

    path = Path(path)
    if not path.exists():
        raise TaskError(f"task file {path} does not exist")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise TaskError(f"task file {path}: use .jsonl, .json or .parquet, got {path.suffix!r}")
    return list(load_dataset(kind, data_files=str(path), split="train"))


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


def load(path: str | Path, fmt: str, split: str = "heldout", visible: int = 1) -> list[Task]:
    """Tasks from a local file in one of ``FORMATS``; ``visible`` test cases per coding task are shown."""
    if fmt not in FORMATS:
        raise TaskError(f"unknown task format {fmt!r}; valid formats: {list(FORMATS)}")
    tasks = []
    for i, rec in enumerate(_records(path)):
        tid = f"{fmt}/{split}/{rec.get('task_id', rec.get('instance_id', i))}"
        if fmt == "gsm8k":
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
    return tasks
