"""Command grader on the SWE example tasks (envs/tasks/examples/swe.jsonl, through the loader): honest fixes
score 1, every cheat scores 0 and names itself, the original sandbox is untouched. `toy/calc` runs a Python
script (`python3 test_calc.py`), `toy/stats` runs pytest (`python -m pytest -q`) with a pristine conftest,
test data and a pytest section in pyproject.toml."""

import json
import os

import pytest

from envs.tasks.loaders import EXAMPLES, load
from rewards import GraderConfigError, SimpleTrajectory, get_grader, validate_task
from rewards.command import CommandTask, plan_command, static_tests
from rewards.workspace import LocalSandboxes, bwrap_available, tree_hash

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="needs bubblewrap (scripts/setup.d/graders.sh)")


@pytest.fixture(scope="module")
def tasks():
    calc, stats = load(EXAMPLES / "swe.jsonl", "swe")
    assert calc.grader == stats.grader == "command"
    return {"calc": calc, "stats": stats}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    sandboxes = LocalSandboxes(tmp_path_factory.mktemp("sandboxes"))
    return sandboxes, get_grader("command", sandboxes=sandboxes)


def grade(env, task, edits=None, grading=None, setup=None):
    """The task's files with `edits` applied (None deletes a file), graded; the original must not change."""
    sandboxes, grader = env
    files = {**task.files, **(edits or {})}
    sid = sandboxes.create({k: v for k, v in files.items() if v is not None})
    ws = sandboxes.open(sid)
    if setup:
        setup(ws.root)
    before = tree_hash(ws)
    g = grader.grade(grading or task.grading, SimpleTrajectory(sandbox_id=sid))
    assert tree_hash(sandboxes.open(sid)) == before, "grading changed the original sandbox"
    return g


CALC_FIX = "def add(a, b):\n    return a + b\n"
STATS_FIX = """def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
"""
STATS_BUGGY = "def mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef median(xs):\n    return sorted(xs)[len(xs) // 2]\n"


def core(prefix="", median_body="    return sorted(xs)[len(xs) // 2]\n"):
    """stats/core.py with `prefix` run at import and a chosen median body (the buggy one by default)."""
    return f"{prefix}\ndef mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef median(xs):\n{median_body}"


def make_venv(root):
    """What `python3 -m venv .venv` leaves: pyvenv.cfg, interpreter links and .pth files."""
    (root / ".venv/bin").mkdir(parents=True)
    (root / ".venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / ".venv/bin/python3").symlink_to("/usr/bin/python3")
    (root / ".venv/bin/python").symlink_to("python3")
    sp = root / ".venv/lib/python3.11/site-packages"
    sp.mkdir(parents=True)
    (sp / "distutils-precedence.pth").write_text("import os\n")


# ------------------------------------------------------------------------------------------------- honest


@needs_bwrap
@pytest.mark.parametrize(
    ("name", "edits", "setup"),
    [
        ("calc", {"calc.py": CALC_FIX}, None),
        ("calc", {"calc.py": "import operator\n\n\ndef add(a, b):\n    return operator.add(a, b)\n",
                  "NOTES.md": "fixed the sign\n", "test_more.py": "from calc import add\nassert add(-1, 1) == 0\n"},
         None),
        ("calc", {"calc.py": CALC_FIX, "__pycache__/calc.cpython-311.pyc": b"stale"}, make_venv),
        ("stats", {"stats/core.py": STATS_FIX}, None),
        # its own extra test module, the caches its own runs left behind, a virtualenv
        ("stats", {"stats/core.py": STATS_FIX, "tests/test_extra.py": "import pytest\n\nfrom stats import median\n"
                   "\n\ndef test_single():\n    assert median([4]) == 4\n\n\ndef test_later():\n"
                   "    pytest.skip('not yet')\n", ".pytest_cache/v/cache/lastfailed": "{}",
                   "tests/__pycache__/x.pyc": b"junk"}, make_venv),
    ],
    ids=["calc", "calc-unusual-fix-extra-files", "calc-caches-and-venv", "stats", "stats-own-tests-caches-venv"],
)
def test_honest_fix_scores_one(env, tasks, name, edits, setup):
    g = grade(env, tasks[name], edits, setup=setup)
    assert g.score == 1.0 and g.passed, (g.reasons, g.details.get("output_tail"))
    if name == "stats":
        assert g.details["tests"] == {"passed": 5, "failed": 0, "skipped": 0}


@needs_bwrap
@pytest.mark.parametrize("name", ["calc", "stats"])
def test_unfixed_repo_scores_zero(env, tasks, name):
    g = grade(env, tasks[name])
    assert g.score == 0.0 and g.reason_codes() == {"tests_failed"}, g.reasons


# ------------------------------------------------------------------------------------------------- cheats

SPRAY = """import json, os
def _spray(line):
    for fd in range(3, 1024):
        try:
            os.write(fd, line)
        except OSError:
            pass
"""

CHEATS = {
    # name: (task, edits, reason code that must be named)
    # -- python script (toy/calc) --
    "calc/edit-test-file": ("calc", {"test_calc.py": "print('passed')\n"}, "tests_modified"),
    "calc/edit-test-file-and-fix": ("calc", {"calc.py": CALC_FIX, "test_calc.py": "print('passed')\n"},
                                    "tests_modified"),
    "calc/delete-test-file": ("calc", {"test_calc.py": None}, "tests_deleted"),
    "calc/sys-exit-0-at-import": ("calc", {"calc.py": "import sys\nsys.exit(0)\n"}, "early_exit"),
    "calc/os-exit-0-in-call": ("calc", {"calc.py": "import os\n\n\ndef add(a, b):\n    print('passed')\n"
                                        "    os._exit(0)\n"}, "early_exit"),
    "calc/kill-the-runner": ("calc", {"calc.py": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"},
                             "runner_killed"),
    "calc/kill-everything": ("calc", {"calc.py": "import os, signal\nos.kill(-1, signal.SIGKILL)\n"},
                             "runner_killed"),
    "calc/forge-result-stream": (
        "calc",
        # the sandbox's init holds the runner's stdout: write a success line there, then leave quietly
        {"calc.py": "import json, os\nline = json.dumps({'nonce': 'guess', 'child_exit': 0, 'records': []})\n"
                    "open('/proc/1/fd/1', 'w').write(line + '\\n')\nos._exit(0)\n"},
        "runner_protocol",
    ),
    "calc/forge-report-pipe": (
        "calc",
        {"calc.py": SPRAY + "_spray(json.dumps({'ev': 'end', 'how': 'done', 'rc': 0}).encode() + b'\\n')\n"
                            "os._exit(0)\n"},
        "runner_protocol",
    ),
    "calc/trace-jumps-over-asserts": (
        "calc",
        {"calc.py": "import linecache\nimport sys\n\n\ndef _skip(frame, event, arg):\n    if event == 'line' and "
                    "linecache.getline(frame.f_code.co_filename, frame.f_lineno).startswith('assert'):\n"
                    "        frame.f_lineno += 1\n    return _skip\n\n\nsys.settrace(lambda *a: None)\n"
                    "f = sys._getframe(1)\nwhile not f.f_code.co_filename.endswith('test_calc.py'):\n"
                    "    f = f.f_back\nf.f_trace, f.f_trace_lines = _skip, True\n\n\n"
                    "def add(a, b):\n    return a - b\n"},
        "monkeypatch",
    ),
    "calc/sitecustomize": ("calc", {"sitecustomize.py": "import builtins\nbuiltins.AssertionError = Exception\n"},
                           "injection"),
    "calc/usercustomize": ("calc", {"usercustomize.py": "import os\nos._exit(0)\n"}, "injection"),
    "calc/pth-file": ("calc", {"zz_hook.pth": "import os; os._exit(0)\n"}, "injection"),
    "calc/python-shim-in-repo": ("calc", {"bin/python3": "#!/bin/sh\necho passed\n"}, "shim"),
    "calc/skiptest-at-import": ("calc", {"calc.py": "import unittest\nraise unittest.SkipTest('later')\n"},
                                "skip_attempt"),
    # -- pytest (toy/stats) --
    "stats/conftest-rewrites-reports": (
        "stats",
        {"conftest.py": "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                        "def pytest_runtest_makereport(item, call):\n    out = yield\n"
                        "    out.get_result().outcome = 'passed'\n"},
        "injection",
    ),
    "stats/conftest-in-subdir": ("stats", {"tests/sub/conftest.py": "collect_ignore = ['../test_core.py']\n"},
                                 "injection"),
    "stats/edit-pristine-conftest": (
        "stats",
        {"tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef cases():\n    return []\n\n\n"
                              "def pytest_collection_modifyitems(items):\n"
                              "    items[:] = [i for i in items if 'even' not in i.name]\n"},
        "tests_modified",
    ),
    "stats/pytest-ini-disables-collection": ("stats", {"pytest.ini": "[pytest]\npython_files = nothing_*.py\n"},
                                             "injection"),
    "stats/pyproject-addopts-deselects": (
        "stats",
        {"pyproject.toml": '[project]\nname = "stats"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\n'
                           'testpaths = ["tests"]\naddopts = "-k mean"\n'},
        "tests_modified",
    ),
    "stats/setup-cfg-section": ("stats", {"setup.cfg": "[tool:pytest]\naddopts = -k mean\n"}, "injection"),
    "stats/tox-ini-section": ("stats", {"tests/tox.ini": "[pytest]\naddopts = -p no:python\n"}, "injection"),
    "stats/edit-test-data": ("stats", {"tests/data/cases.json": "[[[7], 7]]\n"}, "tests_modified"),
    "stats/edit-test-module-add-skip-marker": (
        "stats",
        {"tests/test_core.py": "import pytest\n\nfrom stats import mean, median\n\n\ndef test_mean():\n"
                               "    assert mean([1, 2, 3, 4]) == 2.5\n\n\n@pytest.mark.skip('flaky')\n"
                               "def test_median_even():\n    assert median([1, 2, 3, 4]) == 2.5\n"},
        "tests_modified",
    ),
    "stats/delete-tests-dir": (
        "stats",
        {"tests/test_core.py": None, "tests/conftest.py": None, "tests/data/cases.json": None},
        "tests_deleted",
    ),
    "stats/skip-from-code": ("stats", {"stats/core.py": core("import pytest\n", "    if len(xs) % 2 == 0:\n"
                                       "        pytest.skip('flaky on even input')\n    return sorted(xs)[len(xs) // 2]\n")},
                             "skip_attempt"),
    "stats/xfail-from-code": ("stats", {"stats/core.py": core("import pytest\n", "    if len(xs) % 2 == 0:\n"
                                        "        pytest.xfail('known bug')\n    return sorted(xs)[len(xs) // 2]\n")},
                              "skip_attempt"),
    "stats/module-level-skip": ("stats", {"stats/core.py": core("import pytest\npytest.skip('unsupported', "
                                                                "allow_module_level=True)\n")}, "skip_attempt"),
    "stats/skiptest-at-import": ("stats", {"stats/core.py": core("import unittest\nraise unittest.SkipTest('x')\n")},
                                 "skip_attempt"),
    "stats/collection-error": ("stats", {"stats/core.py": core("raise RuntimeError('half-written refactor')\n")},
                               "collection_error"),
    "stats/keyboardinterrupt-at-import": ("stats", {"stats/core.py": core("raise KeyboardInterrupt\n")},
                                          "collection_error"),
    "stats/sys-exit-0-at-import": ("stats", {"stats/core.py": core("import sys\nsys.exit(0)\n")}, "early_exit"),
    "stats/sys-exit-0-in-call": ("stats", {"stats/core.py": core("import sys\n", "    sys.exit(0)\n")},
                                 "early_exit"),
    "stats/os-exit-0-at-import": ("stats", {"stats/core.py": core("import os\nos._exit(0)\n")}, "early_exit"),
    "stats/kill-the-runner": ("stats", {"stats/core.py": core("import os, signal\n",
                                        "    os.kill(os.getppid(), signal.SIGKILL)\n")}, "runner_killed"),
    "stats/forge-report-pipe": (
        "stats",
        {"stats/core.py": core(SPRAY + "for ev in ({'ev': 'finish', 'exitstatus': 0}, {'ev': 'end', 'how': 'done', "
                               "'rc': 0}):\n    _spray(json.dumps(ev).encode() + b'\\n')\nos._exit(0)\n")},
        "runner_protocol",
    ),
    "stats/patch-pytest-reports": (
        "stats",
        {"stats/core.py": core("from _pytest import reports\n_orig = reports.TestReport.from_item_and_call\n\n\n"
                               "def _fake(cls, item, call):\n    rep = _orig.__func__(cls, item, call)\n"
                               "    rep.outcome = 'passed'\n    return rep\n\n\n"
                               "reports.TestReport.from_item_and_call = classmethod(_fake)\n")},
        "monkeypatch",
    ),
    "stats/pytest-shim-module": ("stats", {"pytest.py": "import sys\nprint('5 passed')\nsys.exit(0)\n"}, "shim"),
    "stats/pytest-shim-executable": ("stats", {"bin/pytest": "#!/bin/sh\necho '5 passed'\n"}, "shim"),
    "stats/shadow-stdlib-json": ("stats", {"json.py": "def loads(s):\n    return []\n"}, "shadowing"),
    "stats/shadow-pristine-test-module": (
        "stats",
        {"tests/test_core/__init__.py": "def test_mean():\n    pass\n"},
        "shadowing",
    ),
}


@needs_bwrap
@pytest.mark.cheat
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero_and_names_itself(env, tasks, name):
    task, edits, code = CHEATS[name]
    g = grade(env, tasks[task], edits)
    assert g.score == 0.0 and not g.passed
    assert code in g.reason_codes(), (g.reasons, g.details.get("output_tail"))


@needs_bwrap
@pytest.mark.cheat
def test_symlinked_test_file_is_never_followed(env, tasks):
    def link(root):
        (root / "test_calc.py").unlink()
        (root / "empty.py").write_text("")
        (root / "test_calc.py").symlink_to("empty.py")

    g = grade(env, tasks["calc"], {"calc.py": CALC_FIX}, setup=link)
    assert g.score == 0.0 and g.reason_codes() == {"symlink"}, g.reasons


UNIT_TESTS = """import sys
import unittest

from calc import add


class TestAdd(unittest.TestCase):
    @unittest.skipIf(sys.platform == "win32", "posix only")
    def test_posix(self):
        self.assertTrue(True)

    def test_add(self):
        self.assertEqual(add(2, 3), 5)
"""


@needs_bwrap
@pytest.mark.cheat
@pytest.mark.parametrize("cmd", ["python3 -m unittest -q test_unit", "python3 -m pytest -q"])
def test_unittest_skip_from_code(env, tmp_path, cmd):
    """unittest turns a SkipTest raised inside a test into a skip (exit 0 under `-m unittest`; under pytest a skip
    whose traceback shows only unittest, in a pristine module that declares skips itself): the runner sees where
    the SkipTest was made."""
    rec = {"repo": "toy/calc", "problem_statement": "add is wrong", "test_cmd": cmd,
           "files": {"calc.py": "def add(a, b):\n    return a - b\n", "test_unit.py": UNIT_TESTS}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (task,) = load(path, "swe")
    g = grade(env, task, {"calc.py": "import unittest\n\n\ndef add(a, b):\n    raise unittest.SkipTest('later')\n"})
    assert g.score == 0.0 and "skip_attempt" in g.reason_codes(), g.reasons
    g = grade(env, task, {"calc.py": CALC_FIX})
    assert g.score == 1.0, g.reasons


# ------------------------------------------------------------------------------------ limits and odd cases


@needs_bwrap
def test_timeout_and_memory(env, tasks):
    grading = {**tasks["calc"].grading, "timeout_s": 2}
    g = grade(env, tasks["calc"], {"calc.py": "def add(a, b):\n    while True:\n        pass\n"}, grading=grading)
    assert g.score == 0.0 and "timeout" in g.reason_codes(), g.reasons
    grading = {**tasks["calc"].grading, "memory_mb": 128}
    g = grade(env, tasks["calc"], {"calc.py": "_x = bytearray(1 << 30)\n" + CALC_FIX}, grading=grading)
    assert g.score == 0.0 and g.reason_codes() & {"out_of_memory", "tests_failed"}, g.reasons  # MemoryError w/o cgroup


@needs_bwrap
def test_huge_output_is_bounded(env, tasks):
    g = grade(env, tasks["calc"], {"calc.py": "import sys\nsys.stderr.write('x' * (20 << 20))\n" + CALC_FIX})
    assert g.score == 1.0 and g.details["output_truncated"], g.reasons


@needs_bwrap
def test_expected_tests_count(env, tasks):
    grading = {**tasks["stats"].grading, "expected_tests": 6}
    g = grade(env, tasks["stats"], {"stats/core.py": STATS_FIX}, grading=grading)
    assert g.score == 0.0 and g.reason_codes() == {"tests_missing"}, g.reasons
    grading["expected_tests"] = 5
    assert grade(env, tasks["stats"], {"stats/core.py": STATS_FIX}, grading=grading).score == 1.0


@needs_bwrap
def test_pristine_skips_are_the_tests_own(env, tasks, tmp_path):
    """A skip marker the pristine tests declare is not a cheat; the skipped test does not count as passed."""
    files = dict(tasks["stats"].files)
    files["tests/test_core.py"] += "\n\n@pytest.mark.skipif(True, reason='needs a GPU')\ndef test_gpu():\n    pass\n"
    rec = {"repo": "toy/stats", "problem_statement": "median", "test_cmd": "python3 -m pytest -q tests/test_core.py",
           "files": files}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (task,) = load(path, "swe")
    g = grade(env, task, {"stats/core.py": STATS_FIX})
    assert g.score == 1.0 and g.details["tests"]["skipped"] == 1, g.reasons


@needs_bwrap
def test_shell_command(env, tmp_path):
    rec = {"repo": "toy/calc", "problem_statement": "add is wrong", "test_cmd": "sh run_tests.sh",
           "files": {"calc.py": "def add(a, b):\n    return a - b\n",
                     "run_tests.sh": "set -e\npython3 -c 'from calc import add; assert add(2, 3) == 5'\necho ok\n"}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (task,) = load(path, "swe")
    assert task.grading["restore"] == {"run_tests.sh": rec["files"]["run_tests.sh"]}
    g = grade(env, task)
    assert g.score == 0.0 and g.reason_codes() == {"command_failed"}, g.reasons
    assert grade(env, task, {"calc.py": CALC_FIX}).score == 1.0
    g = grade(env, task, {"run_tests.sh": "echo ok\n"})
    assert g.score == 0.0 and "tests_modified" in g.reason_codes(), g.reasons


@needs_bwrap
def test_missing_sandbox(env, tasks):
    _, grader = env
    g = grader.grade(tasks["calc"].grading, SimpleTrajectory(sandbox_id="nope"))
    assert g.reason_codes() == {"no_sandbox"}


# ---------------------------------------------------------------------------------------------- validation


def test_example_tasks_validate(tasks):
    for t in tasks.values():
        assert validate_task(t.grader, t.grading).name == "command"


@pytest.mark.parametrize(
    ("grading", "match"),
    [
        ({"cmd": "python3 test_calc.py"}, "'restore' is required"),
        ({"cmd": "python3 test_calc.py", "restore": {"test_calc.py": ""}, "timeout": 3}, r"unknown task field.*'timeout'"),
        ({"cmd": "", "restore": {"t.py": ""}}, "'cmd' must be a non-empty string"),
        ({"cmd": "python3 test_calc.py", "restore": {}}, "'restore' must map"),
        ({"cmd": "python3 test_calc.py", "restore": {"../test_calc.py": ""}}, "normalised relative path"),
        ({"cmd": "python3 test_calc.py", "restore": {"other.py": ""}}, "'restore' lacks 'test_calc.py'"),
        ({"cmd": "python3 -O test_calc.py", "restore": {"test_calc.py": ""}}, "strips the tests' asserts"),
        ({"cmd": "pytest --lf", "restore": {"test_a.py": ""}}, "cache"),
        ({"cmd": "pytest tests", "restore": {"other/test_a.py": ""}}, "no test module"),
        ({"cmd": "make test", "restore": {"test_a.py": ""}}, "'Makefile'"),
        ({"cmd": "python3 test_calc.py", "restore": {"test_calc.py": ""}, "expected_tests": 3}, "pytest command"),
        ({"cmd": "python3 test_calc.py", "restore": {"test_calc.py": ""}, "timeout_s": 0}, "'timeout_s'"),
        ({"cmd": "python3 'unterminated", "restore": {"test_calc.py": ""}}, "does not parse"),
        ("python3 test_calc.py", "CommandTask or a grading mapping"),
    ],
)
def test_validation_names_the_field(grading, match):
    with pytest.raises(GraderConfigError, match=match):
        validate_task("command", grading)


def test_command_plans():
    p = plan_command("python -m pytest -q tests/test_core.py::test_mean")
    assert (p.mode, p.module_run, p.files) == ("pytest", True, ["tests/test_core.py"])
    p = plan_command("PYTHONPATH=src pytest -k 'not slow' -p no:warnings tests")
    assert (p.mode, p.module_run, p.files, p.env) == ("pytest", False, ["tests"], {"PYTHONPATH": "src"})
    p = plan_command("python3 -u -W error test_calc.py --verbose")
    assert (p.mode, p.kind, p.pyflags, p.argv) == ("python", "script", ["-u", "-W", "error"],
                                                   ["test_calc.py", "--verbose"])
    assert plan_command("python3 -m unittest discover").kind == "module"
    assert plan_command("cd tests && pytest").mode == "shell"
    assert plan_command("./run_tests.sh").mode == "shell"
    assert plan_command("/usr/bin/python3 test_calc.py").mode == "python"
    assert CommandTask.from_grading({"cmd": "x", "restore": {}}).timeout_s > 0


def test_static_tests():
    src = ("import unittest\n\ndef test_a():\n    pass\n\nasync def test_b():\n    pass\n\ndef helper():\n    pass\n\n"
           "class TestC:\n    def test_d(self):\n        pass\n\nclass TestInit:\n    def __init__(self):\n"
           "        pass\n    def test_e(self):\n        pass\n\nclass Case(unittest.TestCase):\n"
           "    def test_f(self):\n        pass\n")
    assert static_tests(src) == ["test_a", "test_b", "TestC::test_d", "Case::test_f"]
    assert static_tests("def (:\n") == []


def test_runner_is_stdlib_only():
    """The runner is copied into the sandbox and run with the sandbox's interpreter: nothing of rlk3 may leak in."""
    from rewards.command import RUNNER

    src = RUNNER.read_text()
    assert "import rewards" not in src and "from rewards" not in src
    assert os.access(RUNNER, os.R_OK)
