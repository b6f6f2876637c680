"""Coding domain: small Python functions specified in words, graded on hidden tests by the ``code`` grader.

The policy writes ``solution.py`` in its sandbox (the ``write_file`` tool), may run it, then ends its turn. The
specs carry their constants in the prompt, so a model that reads carefully can always get them right; the
hidden cases (never in the sandbox) catch a solution fitted to the shown example only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from envs.tasks.agentic import Step
from envs.tasks.base import Task, draw

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "orbit", "pixel", "delta", "candy"]


@dataclass(frozen=True)
class Family:
    name: str
    signature: str  # parameter list
    spec: str  # English, with {k}/{a}/{b}/{c} filled from params
    body: str  # the reference return expression
    params: Callable[[random.Random], dict]
    inputs: Callable[[random.Random], list]
    fn: Callable  # reference implementation: fn(params, *args)


def _ints(rng):
    return [rng.randint(-50, 50)]


def _word(rng):
    return [rng.choice(WORDS) + rng.choice(["", "s", "ed", "er"])]


def _list(rng):
    return [[rng.randint(-20, 20) for _ in range(rng.randint(1, 7))]]


FAMILIES = [
    Family("add_k", "x", "returns x plus {k}", "x + {k}", lambda r: {"k": r.randint(1, 20)}, _ints,
           lambda p, x: x + p["k"]),
    Family("sub_k", "x", "returns x minus {k}", "x - {k}", lambda r: {"k": r.randint(1, 20)}, _ints,
           lambda p, x: x - p["k"]),
    Family("mul_k", "x", "returns x times {k}", "x * {k}", lambda r: {"k": r.randint(2, 9)}, _ints,
           lambda p, x: x * p["k"]),
    Family("affine", "x", "returns x times {a} plus {b}", "x * {a} + {b}",
           lambda r: {"a": r.randint(2, 9), "b": r.randint(1, 20)}, _ints, lambda p, x: x * p["a"] + p["b"]),
    Family("reverse", "s", "returns the string s reversed", "s[::-1]", lambda r: {}, _word, lambda p, s: s[::-1]),
    Family("shout", "s", "returns s in upper case", "s.upper()", lambda r: {}, _word, lambda p, s: s.upper()),
    Family("repeat", "s", "returns s repeated {k} times", "s * {k}", lambda r: {"k": r.randint(2, 4)}, _word,
           lambda p, s: s * p["k"]),
    Family("count_char", "s", "returns how many times the letter '{c}' occurs in s", "s.count('{c}')",
           lambda r: {"c": r.choice("aeiorst")}, _word, lambda p, s: s.count(p["c"])),
    Family("total", "xs", "returns the sum of the list xs", "sum(xs)", lambda r: {}, _list, lambda p, xs: sum(xs)),
    Family("biggest", "xs", "returns the largest number in the non-empty list xs", "max(xs)", lambda r: {}, _list,
           lambda p, xs: max(xs)),
    Family("evens", "xs", "returns the even numbers of xs, in order", "[x for x in xs if x % 2 == 0]",
           lambda r: {}, _list, lambda p, xs: [x for x in xs if x % 2 == 0]),
    Family("head", "xs", "returns the first {k} elements of xs", "xs[:{k}]", lambda r: {"k": r.randint(1, 3)},
           _list, lambda p, xs: xs[: p["k"]]),
]
BY_NAME = {f.name: f for f in FAMILIES}


def _case(fam: Family, params: dict, args: list, cid: str) -> dict:
    return {"id": cid, "call": fam.name, "args": args, "expected": fam.fn(params, *args)}


def task(split: str, index: int, family: str | None = None) -> Task:
    def build(rng):
        fam = BY_NAME[family] if family else rng.choice(FAMILIES)
        params = fam.params(rng)
        example = fam.inputs(rng)
        # spec and example decide the split (a parameterless family such as `reverse` appears in both splits,
        # with different examples and hidden cases)
        return fam.name + repr(sorted(params.items())) + repr(example), (fam, params, example, rng)

    fam, params, example, rng = draw("coding", split, index, build)
    visible = [_case(fam, params, example, "visible-0")]
    hidden = [_case(fam, params, fam.inputs(rng), f"hidden-{i}") for i in range(5)]
    shown = ", ".join(repr(a) for a in example)
    prompt = (f"Write a Python function {fam.name}({fam.signature}) in solution.py that {fam.spec.format(**params)}. "
              f"Example: {fam.name}({shown}) == {visible[0]['expected']!r}. When the file is written, answer 'done'.")
    return Task(
        task_id=f"coding/{split}/{index}",
        domain="coding",
        prompt=prompt,
        grader="code",
        grading={"visible": visible, "hidden": hidden, "module": "solution"},
        files={},
        max_turns=4,
        difficulty=0,
        meta={"family": fam.name, "params": params},
    )


def solution(t: Task, check: bool = False) -> list[Step]:
    fam = BY_NAME[t.meta["family"]]
    code = f"def {fam.name}({fam.signature}):\n    return {fam.body.format(**t.meta['params'])}\n"
    steps = [Step("write", {"path": "solution.py", "content": code}, "Write the function.")]
    if check:
        case = t.grading["visible"][0]
        args = ", ".join(repr(a) for a in case["args"])
        check = f'python3 -c "from solution import {fam.name}; print({fam.name}({args}))"'
        steps.append(Step("shell", {"command": check}, "Check it on the example."))
    steps.append(Step("submit", {"answer": "done"}, "The function is written."))
    return steps
