"""The graders' e2b path against this repository's sandbox server (envs/sandbox), through the real e2b SDK:
the judging fork is the server's fork, grader assets are written as the sandbox's root, the submission runs
as the sandbox user, and the original sandbox is unchanged afterwards."""

import os
import time

import pytest

from envs.tasks.loaders import EXAMPLES, load
from rewards import SimpleTrajectory, get_grader
from rewards.workspace import E2BConfig, E2BSandboxes, E2BWorkspace, Limits, tree_hash
from tests.rewards.code_fixtures import HONEST, roman_task, workspace_files
from tests.rewards.test_command import CALC_FIX, STATS_FIX


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the sandbox server needs root (namespaces, cgroups, mounts): run as root, as CI does")
    from tests.envs.conftest import kill_all, start_server

    srv = start_server(tmp_path_factory.mktemp("gsbx") / "state")
    yield E2BConfig(api_url=srv.url, sandbox_url=srv.url, api_key="rlk3-test")
    kill_all(srv)
    srv.stop()


def _sandbox(cfg, files):
    from e2b import Sandbox

    ws = E2BWorkspace(Sandbox.create("base", **cfg.sdk_opts()), cfg)
    for path, data in files.items():
        ws.write_file(path, data)
    return ws


def test_workspace_interface_over_e2b(server):
    ws = _sandbox(server, {"a/b.txt": "hello"})
    assert [(e.path, e.kind) for e in ws.list_files()] == [("a", "dir"), ("a/b.txt", "file")]
    assert ws.read_file("a/b.txt") == b"hello"
    r = ws.exec(["python3", "-c", "import os, sys; print(os.getcwd(), os.getuid(), sys.stdin.read())"], stdin=b"in")
    assert r.exit_code == 0 and r.stdout == f"{ws.sandbox_root} 1000 in\n".encode()
    r = ws.exec(["sh", "-c", "sleep 30"], limits=Limits(timeout_s=1))
    assert r.timed_out
    child = ws.fork()
    child.write_file("a/b.txt", "changed")
    assert ws.read_file("a/b.txt") == b"hello" and child.read_file("a/b.txt") == b"changed"
    child.close()


@pytest.mark.parametrize(
    ("solution", "code"),
    [
        (HONEST, None),
        ("def roman(n):\n    return {3: 'III', 4: 'IV', 9: 'IX', 58: 'LVIII'}.get(n, '')\n", "held_out_failed"),
        ("import sys\nsys.exit(0)\n", "early_exit"),
        ("import os, signal\ndef roman(n):\n    os.kill(os.getppid(), signal.SIGKILL)\n", "runner_killed"),
        (
            "class Eq(str):\n    def __eq__(self, o):\n        return True\n\ndef roman(n):\n    return Eq('')\n",
            "untrusted_type",
        ),
    ],
    ids=["honest", "hardcode-visible", "sys-exit-0", "kill-runner", "eq-override"],
)
def test_code_grader_over_the_sandbox_server(server, solution, code):
    ws = _sandbox(server, workspace_files(solution))
    before = tree_hash(ws)
    g = get_grader("code", sandboxes=E2BSandboxes(server)).grade(
        roman_task(), SimpleTrajectory(sandbox_id=ws.sbx.sandbox_id)
    )
    assert tree_hash(ws) == before, "grading changed the original sandbox"
    if code is None:
        assert g.passed and g.score == 1.0, g.reasons
    else:
        assert g.score == 0.0 and code in g.reason_codes(), g.reasons


@pytest.mark.parametrize(
    ("name", "code"),
    [("honest", None), ("first-frame-only", "e2e_failed"), ("noop-build-script", "build_script_modified")],
)
def test_webdev_grader_over_the_sandbox_server(server, name, code):
    from rewards.webdev.grader import WebdevGrader, WebdevTask
    from tests.rewards.test_webdev import CHEATS
    from tests.rewards.web_fixtures import PROTECTED, app

    if WebdevGrader().missing_assets():
        pytest.fail(f"run scripts/setup.d/graders.sh: {WebdevGrader().missing_assets()}")
    files = app() if code is None else {k: v for k, v in CHEATS[name][0].items() if v is not None}
    from e2b import Sandbox

    ws = E2BWorkspace(Sandbox.create("node", **server.sdk_opts()), server)
    for path, data in files.items():
        ws.write_file(path, data)
    before = tree_hash(ws)
    g = get_grader("webdev", sandboxes=E2BSandboxes(server)).grade(
        WebdevTask(protected=PROTECTED), SimpleTrajectory(sandbox_id=ws.sbx.sandbox_id)
    )
    assert tree_hash(ws) == before, "grading changed the original sandbox"
    if code is None:
        assert g.passed and g.score == 1.0, g.reasons
    else:
        assert g.score == 0.0 and code in g.reason_codes(), g.reasons



@pytest.mark.parametrize(
    ("name", "edits", "code"),
    [
        ("stats", {"stats/core.py": STATS_FIX}, None),
        ("calc", {"calc.py": CALC_FIX}, None),
        ("calc", {"test_calc.py": "print('passed')\n"}, "tests_modified"),
        ("calc", {"calc.py": "import sys\nsys.exit(0)\n"}, "early_exit"),
        ("calc", {"calc.py": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"}, "runner_killed"),
        ("stats", {"stats/core.py": STATS_FIX, "conftest.py": "def pytest_collection_modifyitems(items):\n"
                   "    items.clear()\n"}, "injection"),
        ("stats", {"stats/core.py": "import pytest\npytest.skip('later', allow_module_level=True)\n"}, "skip_attempt"),
    ],
    ids=["stats-honest", "calc-honest", "edit-test-file", "sys-exit-0", "kill-runner", "conftest", "module-skip"],
)
def test_command_grader_over_the_sandbox_server(server, name, edits, code):
    """The SWE examples (through the loader): the pristine tests are put back as the sandbox's root, read-only to
    the submission; the runner and the tests run as the sandbox user."""
    calc, stats = load(EXAMPLES / "swe.jsonl", "swe")
    task = {"calc": calc, "stats": stats}[name]
    ws = _sandbox(server, {**task.files, **edits})
    before = tree_hash(ws)
    g = get_grader("command", sandboxes=E2BSandboxes(server)).grade(
        task.grading, SimpleTrajectory(sandbox_id=ws.sbx.sandbox_id)
    )
    assert tree_hash(ws) == before, "grading changed the original sandbox"
    if code is None:
        assert g.passed and g.score == 1.0, (g.reasons, g.details.get("output_tail"))
    else:
        assert g.score == 0.0 and code in g.reason_codes(), (g.reasons, g.details.get("output_tail"))


FAKE_TIMEOUT = """#!/bin/sh
nonce=$(/usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["nonce"])')
echo '{"nonce": "'$nonce'", "child_exit": 0, "hello": true, "forged": 0, "records": [{"ev": "end", "how": "done", "rc": 0}]}'
"""


@pytest.mark.parametrize("trick", ["login-profile-fake-timeout", "daemon-swaps-tests"])
def test_command_grader_outside_the_workspace(server, trick):
    """Tricks played outside the workspace during the episode. The e2b SDK runs commands through `bash -l`, so a
    ~/.profile the policy wrote would run first (here: a PATH with a `timeout` that reads the nonce from the
    runner's stdin and answers for it); the server's fork also restores the policy's processes (here: a loop
    that renames a weakened test over the restored one). Both must leave the unfixed repo at 0."""
    calc, _ = load(EXAMPLES / "swe.jsonl", "swe")
    ws = _sandbox(server, calc.files)
    if trick == "login-profile-fake-timeout":
        ws.sbx.files.write("/home/user/bin/timeout", FAKE_TIMEOUT)
        ws.sbx.files.write("/home/user/.profile", "export PATH=/home/user/bin:$PATH\n")
        ws.sbx.commands.run("chmod +x /home/user/bin/timeout")
    else:
        ws.sbx.files.write("/home/user/fake.py", "print('passed')\n")
        ws.sbx.commands.run(
            # writes only when the file is not its own (once here, once after the grader's restore): a process
            # caught writing makes the server's checkpoint (CRIU) fail
            "nohup sh -c 'cd ~/workspace; while :; do [ -O test_calc.py ] || { cp ~/fake.py .t && mv -f .t "
            "test_calc.py; }; sleep 0.05; done' >/dev/null 2>&1 &",
            background=True,
        )
        time.sleep(0.5)
    g = get_grader("command", sandboxes=E2BSandboxes(server)).grade(
        calc.grading, SimpleTrajectory(sandbox_id=ws.sbx.sandbox_id)
    )
    assert g.score == 0.0, (g.reasons, g.details.get("output_tail"))
    # the tests ran pristine: the profile never ran, the daemon did not survive into the judging fork
    assert "tests_failed" in g.reason_codes() and not any("while the command ran" in r for r in g.reasons), g.reasons


def test_a_judging_fork_that_fails_once_is_retried_and_twice_raises():
    from types import SimpleNamespace

    ran = []
    child = SimpleNamespace(commands=SimpleNamespace(run=lambda cmd, **kw: ran.append(cmd)))

    class Source:  # the SDK sandbox's fork, failing as the server's answer does (an exception in the list)
        def __init__(self, failures):
            self.failures, self.calls = failures, 0

        def fork(self, count, **opts):
            self.calls += 1
            return [RuntimeError("criu dump failed (exit -9)") if self.calls <= self.failures else child]

    src = Source(failures=1)
    judge = E2BWorkspace(src, E2BConfig()).fork()
    assert src.calls == 2 and judge.sbx is child and ran == ["kill -KILL -1"] * 2
    with pytest.raises(RuntimeError, match="exit -9"):
        E2BWorkspace(Source(failures=2), E2BConfig()).fork()
