"""Agentic domain: multi-turn tool tasks in a sandbox, each needing at least two tool calls.

* ``lookup``: which port does a service use? ``services.txt`` names the config file that holds it — two hops.
* ``run``: ``run.txt`` names a script and its argument; run exactly that and report what it prints.
* ``fix``: ``python3 check.py`` fails until ``settings.ini`` has the mode it asks for; fix it, rerun, report.

Graded on the final answer (the ``answer`` grader): the value cannot be known without using the tools (the
port sits in a file the prompt does not name; the script output and the success token are computed by code
the policy has to run or read).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from envs.tasks.base import Task, draw

KINDS = ("lookup", "run", "fix")
SERVICES = ["auth", "billing", "cache", "search", "mailer", "gateway", "ledger", "queue", "metrics", "images",
            "profile", "notify", "export", "sched"]
MODES = ["fast", "safe", "eco", "debug", "strict", "turbo", "quiet", "lazy"]
SCRIPTS = ["calc", "mix", "fold", "hash", "spin", "step"]


@dataclass(frozen=True)
class Step:
    """One move of a reference solution: a call of a tool *kind* with canonical arguments (the harness maps both
    to each preset's tool and parameter names). ``submit`` with ``{"answer": ...}`` ends the episode."""

    tool: str  # a harness tool kind: shell, read, write, submit, ...
    args: dict
    thought: str = ""


Made = tuple[str, dict[str, str], str, list[Step], list[Step]]  # prompt, files, answer, solution, terse solution


def _lookup(rng: random.Random) -> Made:
    svcs = rng.sample(SERVICES, rng.randint(3, 6))
    files, lines, ports = {}, [], {}
    for i, s in enumerate(svcs):
        cfg = f"configs/c{rng.randint(10, 99)}{i}.ini"
        port = rng.randint(1024, 9999)
        ports[s] = (cfg, port)
        lines.append(f"{s} -> {cfg}")
        host = f"10.0.{rng.randint(0, 9)}.{rng.randint(1, 250)}"
        files[cfg] = f"host = {host}\nport = {port}\nworkers = {rng.randint(1, 16)}\n"
    files["services.txt"] = "\n".join(lines) + "\n"
    target = rng.choice(svcs)
    cfg, port = ports[target]
    prompt = (f"Which port does the service '{target}' use? services.txt says which config file describes each "
              f"service. Give the port as your final answer.")
    steps = [
        Step("shell", {"command": "cat services.txt"}, "First see which config file belongs to the service."),
        Step("shell", {"command": f"cat {cfg}"}, f"{target} is described in {cfg}."),
        Step("submit", {"answer": str(port)}, f"The config says port = {port}."),
    ]
    terse = [Step("shell", {"command": f"cat $(grep '^{target} ' services.txt | cut -d' ' -f3)"}),
             Step("submit", {"answer": str(port)})]
    return prompt, files, str(port), steps, terse


def _run(rng: random.Random) -> Made:
    name = rng.choice(SCRIPTS)
    a, b, m = rng.randint(2, 9), rng.randint(1, 50), rng.choice([97, 89, 83, 101])
    arg = rng.randint(1, 500)
    path = f"tools/{name}.py"
    files = {
        path: ("import sys\n"
               f"n = int(sys.argv[1])\n"
               f"print((n * {a} + {b}) % {m})\n"),
        "run.txt": f"python3 {path} {arg}\n",
    }
    decoy = rng.choice([s for s in SCRIPTS if s != name])
    files[f"tools/{decoy}.py"] = f"import sys\nprint(int(sys.argv[1]) * {rng.randint(2, 9)})\n"
    value = str((arg * a + b) % m)
    prompt = "Run the command written in run.txt and give the number it prints as your final answer."
    steps = [
        Step("shell", {"command": "cat run.txt"}, "Read which command to run."),
        Step("shell", {"command": f"python3 {path} {arg}"}, "Run exactly that command."),
        Step("submit", {"answer": value}, f"It printed {value}."),
    ]
    terse = [Step("shell", {"command": "sh run.txt"}), Step("submit", {"answer": value})]
    return prompt, files, value, steps, terse


def _fix(rng: random.Random) -> Made:
    right, wrong = rng.sample(MODES, 2)
    secret = rng.randint(100, 999)
    token = f"ok {sum(map(ord, right)) * secret % 10000}"
    files = {
        "settings.ini": f"mode = {wrong}\nlevel = {rng.randint(1, 5)}\n",
        "check.py": (
            "import sys\n"
            "conf = dict(l.split(' = ', 1) for l in open('settings.ini').read().splitlines() if ' = ' in l)\n"
            "mode = conf.get('mode', '').strip()\n"
            f"if mode != '{right}':\n"
            f"    print(f'error: mode must be {right}, found {{mode}}')\n"
            "    sys.exit(1)\n"
            f"print('ok', sum(map(ord, mode)) * {secret} % 10000)\n"
        ),
    }
    prompt = ("The command 'python3 check.py' fails. Fix settings.ini so that it succeeds, run it again and "
              "give the line it prints as your final answer.")
    steps = [
        Step("shell", {"command": "python3 check.py"}, "See why the check fails."),
        Step("shell", {"command": f"sed -i 's/^mode = .*/mode = {right}/' settings.ini"}, f"It wants mode {right}."),
        Step("shell", {"command": "python3 check.py"}, "Run the check again."),
        Step("submit", {"answer": token}, "The check passes now."),
    ]
    terse = [steps[0], Step("shell", {"command": f"{steps[1].args['command']} && python3 check.py"}),
             Step("submit", {"answer": token})]
    return prompt, files, token, steps, terse


MAKERS = {"lookup": _lookup, "run": _run, "fix": _fix}


def _build(split: str, index: int, kind: str | None):
    if kind is not None and kind not in MAKERS:
        raise ValueError(f"agentic: kind must be one of {list(KINDS)}, got {kind!r}")

    def build(rng):
        k = rng.choice(KINDS)  # drawn even when `kind` is given: the same index must give the same content
        k = kind or k
        made = MAKERS[k](rng)
        return made[0] + json.dumps(made[1], sort_keys=True), (k, *made)

    return draw("agentic", split, index, build)


def task(split: str, index: int, kind: str | None = None) -> Task:
    kind_arg = kind
    kind, prompt, files, answer, _, _ = _build(split, index, kind)
    return Task(
        task_id=f"agentic/{split}/{index}",
        domain="agentic",
        prompt=prompt,
        grader="answer",
        grading={"answer": answer, "kind": "text" if " " in answer else "numeric"},
        files=files,
        max_turns=6,
        difficulty=KINDS.index(kind),
        meta={"kind": kind, "kind_forced": kind_arg is not None},
    )


def solution(t: Task, terse: bool = False) -> list[Step]:
    """The reference moves for a task built by :func:`task` (for SFT demonstrations): one step at a time, or
    ``terse``: commands chained so that each kind takes one call fewer (low effort's demonstrations)."""
    _, split, index = t.task_id.split("/")
    # rebuild exactly as task() did: a forced kind changes which redraw lands in the split
    _, prompt, files, _, steps, short = _build(split, int(index), t.meta["kind"] if t.meta.get("kind_forced") else None)
    if prompt != t.prompt or files != t.files:
        raise ValueError(f"{t.task_id}: the task does not come from agentic.task(); no reference solution")
    return short if terse else steps
