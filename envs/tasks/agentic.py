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
    # the same step reasoned through: what the last output said, what follows, what this call is for (the
    # demonstrations' worked thoughts, rlk3.rollout.demos); empty: the thought is all there is
    worked: str = ""


Made = tuple[str, dict[str, str], str, list[Step], list[Step]]  # prompt, files, answer, solution, terse solution


def _lookup(rng: random.Random) -> Made:
    svcs = rng.sample(SERVICES, rng.randint(3, 6))
    files, lines, ports = {}, [], {}
    for i, s in enumerate(svcs):
        cfg = f"configs/c{rng.randint(10, 99)}{i}.ini"
        port = rng.randint(1024, 9999)
        lines.append(f"{s} -> {cfg}")
        host = f"10.0.{rng.randint(0, 9)}.{rng.randint(1, 250)}"
        ports[s] = (cfg, port, host)
        files[cfg] = f"host = {host}\nport = {port}\nworkers = {rng.randint(1, 16)}\n"
    files["services.txt"] = "\n".join(lines) + "\n"
    target = rng.choice(svcs)
    cfg, port, host = ports[target]
    prompt = (f"Which port does the service '{target}' use? services.txt says which config file describes each "
              f"service. Give the port as your final answer.")
    steps = [
        Step("shell", {"command": "cat services.txt"}, "First see which config file belongs to the service.",
             f"I need the port of {target}. services.txt says which config file describes each service, so I read "
             f"it first, find the line for {target}, then read the file it names."),
        Step("shell", {"command": f"cat {cfg}"}, f"{target} is described in {cfg}.",
             f"services.txt has the line '{target} -> {cfg}'. So {target} is described in {cfg}, and its port is "
             f"in that file, on the line that starts with port; I read it next."),
        Step("submit", {"answer": str(port)}, f"The config says port = {port}.",
             f"{cfg} has the lines 'host = {host}' and 'port = {port}'. The port line is the one I need: {target} "
             f"uses port {port}, so I submit {port}."),
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
        Step("shell", {"command": "cat run.txt"}, "Read which command to run.",
             "run.txt holds the command to run. I read it first, then I run exactly that command, with the same "
             "script and the same argument, and report the number it prints."),
        Step("shell", {"command": f"python3 {path} {arg}"}, "Run exactly that command.",
             f"run.txt says: python3 {path} {arg}. The script is {path}, not another one in tools, and its "
             f"argument is {arg}; I run exactly that command."),
        Step("submit", {"answer": value}, f"It printed {value}.",
             f"The command python3 {path} {arg} printed {value}. That is the number it prints, so I submit {value}."),
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
        Step("shell", {"command": "python3 check.py"}, "See why the check fails.",
             "check.py reads settings.ini and fails. I run it first to see what it wants, then I fix settings.ini, "
             "run it again and report the line it prints."),
        Step("shell", {"command": f"sed -i 's/^mode = .*/mode = {right}/' settings.ini"}, f"It wants mode {right}.",
             f"The check says mode must be {right}, and settings.ini has mode = {wrong}. I set mode = {right} in "
             f"settings.ini and leave its other lines as they are."),
        Step("shell", {"command": "python3 check.py"}, "Run the check again.",
             f"settings.ini now has mode = {right}, the mode the check asked for. I run the check again to see "
             f"the line it prints."),
        Step("submit", {"answer": token}, "The check passes now.",
             f"The check printed '{token}'. It passes now with mode = {right}, so I submit that line."),
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
