"""General domain: running-total arithmetic, as bare sums and as word problems, with a difficulty knob.

Built so that reasoning length matters: a high-effort solution writes every intermediate total
(``12 + 7 = 19. 19 - 4 = 15.``), medium folds two operations into one line, low states the answer alone. A small
model that must add six numbers in one shot fails often; step by step it rarely does, so effort buys accuracy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs.tasks.base import Task, draw

DIFFICULTIES = (0, 1, 2, 3, 4)  # operands: 2 + difficulty; larger operands from difficulty 2 on
NAMES = ["Ann", "Ben", "Chloe", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena", "Milo", "Nia"]
ITEMS = ["apples", "marbles", "stamps", "coins", "books", "shells", "cards", "pencils", "stickers", "beads"]


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]  # first operand, then the signed changes
    word: bool
    name: str
    item: str

    @property
    def totals(self) -> list[int]:
        out, acc = [], self.numbers[0]
        for x in self.numbers[1:]:
            acc += x
            out.append(acc)
        return out

    @property
    def answer(self) -> int:
        return sum(self.numbers)

    def prompt(self) -> str:
        first, rest = self.numbers[0], self.numbers[1:]
        if not self.word:
            expr = str(first) + "".join(f" + {x}" if x >= 0 else f" - {-x}" for x in rest)
            return f"Compute {expr}."
        parts = [f"{self.name} has {first} {self.item}."]
        for x in rest:
            parts.append(f"Then {self.name} gets {x} more." if x >= 0 else f"Then {self.name} gives away {-x}.")
        parts.append(f"How many {self.item} does {self.name} have now?")
        return " ".join(parts)


def make_problem(rng: random.Random, difficulty: int) -> Problem:
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"general: difficulty must be one of {list(DIFFICULTIES)}, got {difficulty}")
    n = 2 + difficulty
    hi = 9 if difficulty < 2 else 20
    acc = rng.randint(1, hi)
    nums = [acc]
    for _ in range(n - 1):
        x = rng.randint(1, hi)
        if acc - x >= 0 and rng.random() < 0.35:
            x = -x  # keep every running total non-negative: word problems cannot give away what is not there
        acc += x
        nums.append(x)
    return Problem(tuple(nums), word=rng.random() < 0.4, name=rng.choice(NAMES), item=rng.choice(ITEMS))


def _step(a: int, x: int, total: int) -> str:
    return f"{a} + {x} = {total}." if x >= 0 else f"{a} - {-x} = {total}."


def reasoning(problem: Problem, effort: str, slip: int = 0, rng: random.Random | None = None,
              unsigned: bool = False, early: bool = False) -> tuple[str, int]:
    """The worked solution at an effort level, and the answer it reaches. ``slip`` ≠ 0 puts an arithmetic
    error of that size into one step (demonstrations are imperfect on purpose, so RL has headroom).
    ``unsigned`` is a careless demonstrator's habit: every change is read as a gain (``12 - 4`` written and
    computed as ``12 + 4 = 16``, "gives away 4" as "+ 4"), so the solution is consistently wrong whenever something
    is taken away. ``early`` is another: the demonstrator stops one change short (the last change is never read,
    and the answer is the total before it), so the solution is wrong on every problem."""
    if early:
        problem = Problem(problem.numbers[:-1], problem.word, problem.name, problem.item)
    if unsigned:
        problem = Problem((problem.numbers[0], *map(abs, problem.numbers[1:])), problem.word, problem.name,
                          problem.item)
    nums, totals = list(problem.numbers), problem.totals
    slip_at = (rng or random.Random(0)).randrange(len(totals)) if slip else -1
    lines, acc = [], nums[0]
    if effort == "high":
        for i, x in enumerate(nums[1:]):
            new = acc + x + (slip if i == slip_at else 0)
            lines.append(_step(acc, x, new))
            acc = new
    elif effort == "medium":
        i = 0
        while i < len(nums) - 1:
            xs = nums[1 + i : 3 + i]
            new = acc + sum(xs) + (slip if i // 2 == slip_at // 2 and slip else 0)
            expr = str(acc) + "".join(f" + {x}" if x >= 0 else f" - {-x}" for x in xs)
            lines.append(f"{expr} = {new}.")
            acc, i = new, i + 2
    elif effort == "low":
        acc = problem.answer + slip
    else:
        raise ValueError(f"effort must be low, medium or high, got {effort!r}")
    return " ".join(lines), acc


def task(split: str, index: int, difficulty: int | None = None) -> Task:
    def build(rng):
        d = rng.choice(DIFFICULTIES) if difficulty is None else difficulty
        p = make_problem(rng, d)
        return p.prompt(), (p, d)

    p, difficulty = draw("general", split, index, build)
    return Task(
        task_id=f"general/{split}/{index}",
        domain="general",
        prompt=p.prompt() + " End with a line 'Answer: <number>'.",
        grader="answer",
        grading={"answer": str(p.answer), "kind": "numeric"},
        difficulty=difficulty,
        meta={"numbers": list(p.numbers), "word": p.word, "name": p.name, "item": p.item},
    )


def problem_of(t: Task) -> Problem:
    m = t.meta
    return Problem(tuple(m["numbers"]), m["word"], m["name"], m["item"])
