"""SFT demonstrations: reference solutions replayed through the same harness the policy will use.

A demonstration is the conversation a competent agent would have on a training task at a given reasoning
effort: the harness's system prompt (effort and budget lines included), the task, then assistant turns whose
tool calls are written in the preset's syntax, *parsed back* by the harness (so every demonstrated call is one
the agent loop would accept) and *executed* to get real tool results. Effort changes how much the agent
reasons: every step explained (high), only the plan (medium), nothing (low) — and for arithmetic, every
intermediate total, two operations per line, or none. Agentic demonstrations at ``terse_efforts`` (none by default)
also chain commands (``sh run.txt``; the fix and its re-check in one call), one call fewer than step by step.

Demonstrations are imperfect on purpose, so SFT gives RL a base with headroom, as in the write-up's SFT → RL
pipeline. Two kinds: random errors (``error_rate``: an arithmetic slip, a mistyped answer, an off-by-one constant),
which a greedy policy averages away, and a systematic habit per domain (``habit_rate`` of the demonstrations at
``habit_efforts``; :data:`HABITS`), which imitation copies when it is the majority and which only a reward that
checks the outcome corrects (docs/sft.md, "The closing stage").
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field, replace

from envs.local import LocalWorkdirs
from envs.tasks import Task, agentic, coding, general, get_tasks
from harness import Harness

EFFORTS = ("low", "medium", "high")
# generated-token budgets per effort, stated in every system prompt (RL's effort configs use the same numbers)
DEFAULT_BUDGETS = {"low": 128, "medium": 192, "high": 384}
DOMAIN_PRESETS = {"general": "chat", "agentic": "tiny", "coding": "tiny"}
# each domain's careless demonstrator: one wrong decision, the same one every time, where the right move is a skill
# the policy already has (so a sampled episode sometimes makes it, and the reward tells the two apart)
HABITS = {  # domain -> habit -> what its careless demonstrator does; the first is the domain's default
    "general": {
        "unsigned": "reads every change as a gain: '12 - 4' is written and computed as '12 + 4 = 16'",
        "early": "stops one change short: the last change is never read, and the answer is the total before it",
    },
    "agentic": {"early": "answers one step early: skips the last tool call and submits the last line it has seen"},
    "coding": {"prints": "prints numbers instead of returning them: a function whose result is a number has the "
                         "body 'print(...)', so it returns None"},
}


def habit_of(domain: str, habits: dict[str, str] | None = None) -> str:
    """The habit ``domain``'s demonstrator has: ``habits[domain]`` where given, else the domain's first."""
    return (habits or {}).get(domain) or next(iter(HABITS[domain]))


def _habit_applies(task: Task) -> bool:
    """Whether the domain's habit has a move to change on ``task`` (coding: only functions that return a number,
    7 of the 12 families, so the habit leaves the others right and the SFT policy keeps passing them)."""
    if task.domain == "coding":
        out = task.grading["visible"][0]["expected"]
        return isinstance(out, int) and not isinstance(out, bool)
    return True


@dataclass
class Demo:
    task_id: str
    domain: str
    effort: str
    preset: str
    messages: list[dict] = field(default_factory=list)
    correct: bool = True  # False when an error was put in on purpose
    habit: bool = False  # written with the domain's careless habit (HABITS)


def _thought(effort: str, i: int, step, worked: bool = False) -> str | None:
    """High effort reasons before every call, medium only before the first (the plan), low never. ``worked``: the
    step's worked thought where it has one (agentic tasks), which restates what the last output said."""
    if effort == "high" or (effort == "medium" and i == 0):
        return (step.worked or step.thought) if worked else step.thought
    return None


def _corrupt_answer(answer: str, rng: random.Random) -> str:
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if not digits:
        return answer + "s"
    i = rng.choice(digits)
    return answer[:i] + str((int(answer[i]) + rng.randint(1, 9)) % 10) + answer[i + 1 :]


def _general(task: Task, effort: str, h: Harness, budgets, err: bool, rng, habit: str | None = None
             ) -> tuple[list[dict], bool]:
    p = general.problem_of(task)
    slip = rng.choice([-3, -2, -1, 1, 2, 3]) if err else 0
    text, answer = general.reasoning(p, effort, slip=slip, rng=rng, unsigned=habit == "unsigned",
                                     early=habit == "early")
    msgs = h.start(task.prompt, effort=effort, budget=budgets[effort])
    reply = {"role": "assistant", "content": f"Answer: {answer}"}
    if text:
        reply["reasoning_content"] = text
    return [*msgs, reply], answer == p.answer


def _call_message(h: Harness, kind: str, args: dict, thought: str | None, index: int) -> dict:
    tool = next((t for t in h.tools if t.kind.name == kind), None)
    if tool is None:
        raise ValueError(f"preset {h.preset.name!r} has no tool of kind {kind!r}; its tools: {h.tool_names()}")
    public = {tool.rename[k]: v for k, v in args.items()}
    msg = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{index}", "type": "function", "function": {"name": tool.name, "arguments": public}}
    ]}
    if thought:
        msg["reasoning_content"] = thought
    return msg


def _last_line(messages: list[dict]) -> str:
    """The last line a program printed in the tool output seen so far (the agentic habit's answer); the tool's own
    notes (``(no output)``, ``[exit code: 1]``) are not output."""
    for m in reversed(messages):
        if m["role"] == "tool":
            lines = [x.strip() for x in str(m["content"]).splitlines()
                     if x.strip() and not re.fullmatch(r"\(no output\)|\[exit code: -?\d+\]", x.strip())]
            if lines:
                return lines[-1]
    return ""


async def _agentic(task: Task, effort: str, h: Harness, budgets, err: bool, rng, local: LocalWorkdirs,
                   habit: bool = False, terse: bool = False, worked: bool = False):
    if task.domain == "agentic":
        steps = agentic.solution(task, terse=terse)
    else:
        steps = coding.solution(task, check=effort == "high")
    correct = True
    if habit and task.domain == "coding":
        fam = coding.BY_NAME[task.meta["family"]]
        code = f"def {fam.name}({fam.signature}):\n    print({fam.body.format(**task.meta['params'])})\n"
        steps = [coding.Step("write", {"path": "solution.py", "content": code}, steps[0].thought), *steps[1:]]
        correct = False
    elif err and task.domain == "coding" and task.meta["params"]:
        key = rng.choice(sorted(task.meta["params"]))
        bumped = dict(task.meta["params"])
        bumped[key] = bumped[key] + 1 if isinstance(bumped[key], int) else "z"
        fam = coding.BY_NAME[task.meta["family"]]
        code = f"def {fam.name}({fam.signature}):\n    return {fam.body.format(**bumped)}\n"
        steps = [coding.Step("write", {"path": "solution.py", "content": code}, steps[0].thought), *steps[1:]]
        correct = False
    msgs = h.start(task.prompt, effort=effort, budget=budgets[effort])
    sid = local.create(task.files)
    try:
        ctx = h.context(local, sid)
        for i, step in enumerate(steps):
            args = dict(step.args)
            if habit and task.domain == "agentic" and i == len(steps) - 2:  # the last tool call, skipped
                last = _last_line(msgs)
                step = agentic.Step("submit", {"answer": last}, "That is the answer.",
                                    f"The output ends with {last}. That is the answer, so I submit {last}.")
                args = dict(step.args)
                correct = False
            if step.tool == "submit" and err and task.domain == "agentic" and not habit:
                args["answer"] = _corrupt_answer(args["answer"], rng)
                # a worked thought misreads the value it then submits, rather than contradicting its own call
                step = replace(step, worked=step.worked.replace(step.args["answer"], args["answer"]))
                correct = False
            parsed = h.parse(h.assistant_text(_call_message(h, step.tool, args, _thought(effort, i, step, worked), i)))
            if parsed.error or len(parsed.calls) != 1:
                raise RuntimeError(f"{task.task_id}: the demonstrated call does not parse back: {parsed.error}")
            msgs.append(parsed.message())
            result = await h.execute(parsed, ctx)
            msgs += result.messages
            if result.submitted is not None:
                break
    finally:
        local.kill(sid)
    return msgs, correct


async def build_demos_async(
    domain: str,
    n: int,
    *,
    tokenizer=None,
    error_rate: float = 0.15,
    seed: int = 0,
    budgets: dict[str, int] | None = None,
    preset: str | None = None,
    start: int = 0,
    concurrency: int = 8,
    effort_weights: dict[str, float] | None = None,
    habit_rate: float = 0.0,
    habit_efforts: tuple[str, ...] = ("high",),
    habit: str | None = None,
    terse_efforts: tuple[str, ...] = (),
    worked_thoughts: bool = False,
) -> list[Demo]:
    """``n`` demonstrations on the first training tasks of ``domain``, each at an effort drawn uniformly (or by
    ``effort_weights``), a fraction ``error_rate`` of them wrong on purpose, and a fraction ``habit_rate`` of
    those at ``habit_efforts`` written with the domain's habit (``habit``, one of :data:`HABITS`' names for the
    domain; None: its default); agentic demonstrations at
    ``terse_efforts`` chain commands (``agentic.solution(terse=True)``: one call fewer); ``worked_thoughts``: agentic
    thoughts reason each step through (``Step.worked``: what the last output said and what follows)."""
    kind = habit or habit_of(domain)
    if kind not in HABITS[domain]:
        raise ValueError(f"build_demos: {domain} has no habit {habit!r}; its habits: {list(HABITS[domain])}")
    budgets = budgets or DEFAULT_BUDGETS
    preset = preset or DOMAIN_PRESETS[domain]
    h = Harness(preset, tokenizer=tokenizer)
    rng = random.Random(f"demos|{domain}|{seed}")
    weights = [float((effort_weights or {}).get(e, 0.0)) for e in EFFORTS] if effort_weights else None

    def effort() -> str:
        return rng.choices(EFFORTS, weights)[0] if weights else rng.choice(EFFORTS)

    plan = [(t, effort(), rng.random() < error_rate, random.Random(rng.random()))
            for t in get_tasks(domain, "train", n, start=start)]
    # its own stream: a habit rate of 0 leaves every other demonstration as it was
    hrng = random.Random(f"habit|{domain}|{seed}")
    habits = [e in habit_efforts and hrng.random() < habit_rate and _habit_applies(t) for t, e, _, _ in plan]
    local = LocalWorkdirs(workdir=h.preset.workdir)
    sem = asyncio.Semaphore(concurrency)

    async def one(task, effort, err, r, careless):
        async with sem:
            if domain == "general":
                msgs, ok = _general(task, effort, h, budgets, err, r, kind if careless else None)
            else:
                msgs, ok = await _agentic(task, effort, h, budgets, err, r, local, careless,
                                          effort in terse_efforts, worked_thoughts)
            return Demo(task.task_id, domain, effort, preset, msgs, ok, careless)

    try:
        return list(await asyncio.gather(*(one(*p, careless) for p, careless in zip(plan, habits))))
    finally:
        local.close()


def build_demos(domain: str, n: int, **kwargs) -> list[Demo]:
    return asyncio.run(build_demos_async(domain, n, **kwargs))
