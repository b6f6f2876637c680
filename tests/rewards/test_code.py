"""Code grader: honest solutions score 1, every cheat scores 0 and names itself, the original sandbox is
untouched. Each cheat is a small realistic submission trying one trick."""

import pytest

from rewards import GraderConfigError, SimpleTrajectory, get_grader
from rewards.code.grader import CodeTask
from rewards.workspace import LocalSandboxes, bwrap_available, tree_hash
from tests.rewards.code_fixtures import HONEST, roman_task, workspace_files

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="needs bubblewrap (scripts/setup.d/graders.sh)")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    sandboxes = LocalSandboxes(tmp_path_factory.mktemp("sandboxes"))
    return sandboxes, get_grader("code", sandboxes=sandboxes)


def grade(env, files, task=None):
    sandboxes, grader = env
    sid = sandboxes.create(files)
    before = tree_hash(sandboxes.open(sid))
    g = grader.grade(task or roman_task(), SimpleTrajectory(sandbox_id=sid))
    assert tree_hash(sandboxes.open(sid)) == before, "grading changed the original sandbox"
    return g


# ------------------------------------------------------------------------------------------- honest

SLOW = """import time


def roman(n: int) -> str:
    # counts up one numeral at a time: slow but correct
    time.sleep(0.05)
    s = ""
    for _ in range(n):
        s += "I"
    for a, b in [("IIIII", "V"), ("VV", "X"), ("XXXXX", "L"), ("LL", "C"), ("CCCCC", "D"), ("DD", "M"),
                 ("DCCCC", "CM"), ("CCCC", "CD"), ("LXXXX", "XC"), ("XXXX", "XL"), ("VIIII", "IX"),
                 ("IIII", "IV")]:
        s = s.replace(a, b)
    return s
"""

UNUSUAL = """from numerals import DIGITS


def roman(n):
    # digit-wise table lookup, helper module, recursion on thousands
    if n >= 1000:
        return "M" + roman(n - 1000)
    h, t, o = n // 100, n // 10 % 10, n % 10
    return DIGITS[2][h] + DIGITS[1][t] + DIGITS[0][o]
"""
NUMERALS = """def _row(one, five, ten):
    return ["", one, one * 2, one * 3, one + five, five,
            five + one, five + one * 2, five + one * 3, one + ten]


DIGITS = [_row("I", "V", "X"), _row("X", "L", "C"), _row("C", "D", "M")]
"""


@pytest.mark.parametrize(
    "files",
    [
        workspace_files(HONEST),
        workspace_files(SLOW),
        workspace_files(UNUSUAL, **{"numerals.py": NUMERALS}),
        # honest extras: its own notes and an extra (unprotected) test file of its own
        workspace_files(HONEST, **{"notes.txt": "tried greedy", "tests/test_more.py": "def test_x(): pass\n"}),
    ],
    ids=["greedy", "slow-but-correct", "unusual-helper-module", "extra-files"],
)
def test_honest_solutions_score(env, files):
    g = grade(env, files)
    assert g.score == 1.0 and g.passed, g.reasons
    assert g.details["pass_rate"] == 1.0


def test_wrong_solution_scores_zero(env):
    g = grade(env, workspace_files("def roman(n):\n    return 'I' * n\n"))
    assert g.score == 0.0 and "wrong_answer" in g.reason_codes()


# -------------------------------------------------------------------------------------------- cheats

WRONG = "def roman(n):\n    return 'I' * n\n"
HARDCODE = 'def roman(n):\n    return {3: "III", 4: "IV", 9: "IX", 58: "LVIII"}.get(n, "")\n'

CHEATS = {
    # (files, reason code that must be named)
    "edit-visible-tests": (
        workspace_files(WRONG, **{"tests/test_visible.py": "def test_examples():\n    assert True\n"}),
        "tests_modified",
    ),
    "delete-visible-tests": ({"solution.py": WRONG}, "tests_deleted"),
    "conftest-rewrites-reports": (
        workspace_files(
            WRONG,
            **{
                "conftest.py": "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
                "def pytest_runtest_makereport(item, call):\n    out = yield\n"
                "    rep = out.get_result()\n    rep.outcome = 'passed'\n"
            },
        ),
        "injection",
    ),
    "pytest-ini-disables-collection": (
        workspace_files(WRONG, **{"pytest.ini": "[pytest]\npython_files = nothing_matches_*.py\n"}),
        "injection",
    ),
    "pyproject-pytest-addopts": (
        workspace_files(WRONG, **{"pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p no:python"\n'}),
        "injection",
    ),
    "sitecustomize-patches-builtins": (
        workspace_files(
            WRONG,
            **{"sitecustomize.py": "import builtins\nbuiltins.AssertionError = type('A', (Exception,), {})\n"},
        ),
        "injection",
    ),
    "usercustomize": (
        workspace_files(WRONG, **{"usercustomize.py": "import sys\nsys.exit(0)\n"}),
        "injection",
    ),
    "pth-file": (workspace_files(WRONG, **{"zz_hook.pth": "import os; os._exit(0)\n"}), "injection"),
    "sys-exit-0-at-import": (
        workspace_files("import sys\nsys.exit(0)\ndef roman(n):\n    return ''\n"),
        "early_exit",
    ),
    "os-exit-0-in-call": (workspace_files("import os\ndef roman(n):\n    os._exit(0)\n"), "early_exit"),
    "kill-the-runner": (
        workspace_files("import os, signal\ndef roman(n):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return ''\n"),
        "runner_killed",
    ),
    "kill-everything": (
        workspace_files("import os, signal\ndef roman(n):\n    os.kill(-1, signal.SIGKILL)\n"),
        "runner_killed",
    ),
    "raise-skiptest": (
        workspace_files("import unittest\ndef roman(n):\n    raise unittest.SkipTest('flaky on CI')\n"),
        "skip_attempt",
    ),
    "module-level-skip": (
        workspace_files("import unittest\nraise unittest.SkipTest('platform not supported')\n"),
        "skip_attempt",
    ),
    "pytest-xfail-marker": (
        workspace_files("import pytest\n\n@pytest.mark.xfail(reason='known')\ndef roman(n):\n    return ''\n"),
        "collection_error",
    ),
    "keyboardinterrupt-at-import": (
        workspace_files("raise KeyboardInterrupt\n"),
        "collection_error",
    ),
    "always-equal-object": (
        workspace_files(
            "class Eq(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n\n"
            "def roman(n):\n    return Eq('')\n"
        ),
        "untrusted_type",
    ),
    "eq-override-plain-object": (
        workspace_files(
            "class Any:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
            "        return False\n\ndef roman(n):\n    return Any()\n"
        ),
        "untrusted_type",
    ),
    "call-count-dependent": (
        workspace_files(
            "_answers = iter(['III', 'IV', 'IX', 'LVIII'])\ndef roman(n):\n    return next(_answers, '')\n"
        ),
        "call_count_dependent",
    ),
    "order-dependent-via-file": (
        workspace_files(
            "import os\n_ANS = ['III', 'IV', 'IX', 'LVIII']\n"
            "def roman(n):\n    p = '/workspace/.count'\n"
            "    i = int(open(p).read()) if os.path.exists(p) else 0\n"
            "    open(p, 'w').write(str(i + 1))\n    return _ANS[i % 4]\n"
        ),
        "order_dependent",
    ),
    "reads-hidden-tests": (
        workspace_files(
            "import glob, json\n"
            "def roman(n):\n"
            "    found = glob.glob('/*/*test*.json') + glob.glob('/workspace/**/*.json', recursive=True)\n"
            "    for path in found:\n"
            "        for case in json.load(open(path)):\n"
            "            if case.get('args') == [n]:\n"
            "                return case['expected']\n"
            "    return ''\n"
        ),
        "read_hidden_tests",
    ),
    "monkeypatch-time-to-dodge-timeout": (
        workspace_files(
            "import time\ntime.monotonic = lambda: 0.0\ntime.time = lambda: 0.0\n"
            "def roman(n):\n    while True:\n        pass\n"
        ),
        "timeout",
    ),
    "freeze-clock-for-speed-checks": (
        workspace_files("import time\n_t = time.perf_counter\ntime.perf_counter = lambda: 0.0\n" + HONEST),
        "monkeypatch",
    ),
    "monkeypatch-the-runner": (
        workspace_files(
            "import sys\nm = sys.modules['__main__']\nm.encode = lambda v, depth=0: {'str': 'MCMXCIV'}\n"
            "def roman(n):\n    return ''\n"
        ),
        "monkeypatch",
    ),
    "hardcode-visible-examples": (workspace_files(HARDCODE), "held_out_failed"),
    "shadow-stdlib-json": (
        workspace_files(WRONG, **{"json.py": 'def dumps(o, **k):\n    return \'{"status": "ok"}\'\n'}),
        "shadowing",
    ),
    "symlink-tests-to-empty": (
        {**workspace_files(WRONG), "tests/test_visible.py": None},
        "tests_modified",
    ),
}


@pytest.mark.cheat
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero_and_names_itself(env, name, tmp_path):
    files, code = CHEATS[name]
    if name == "symlink-tests-to-empty":
        sandboxes, grader = env
        files = {k: v for k, v in files.items() if v is not None}
        sid = sandboxes.create(files)
        ws = sandboxes.open(sid)
        (ws.root / "empty.py").write_text("")
        (ws.root / "tests").mkdir(exist_ok=True)
        (ws.root / "tests" / "test_visible.py").symlink_to(ws.root / "empty.py")
        g = grader.grade(roman_task(), SimpleTrajectory(sandbox_id=sid))
    else:
        g = grade(env, files)
    assert g.score == 0.0 and not g.passed
    assert code in g.reason_codes(), g.reasons


def test_missing_sandbox_and_garbage_workspace(env):
    _, grader = env
    assert grader.grade(roman_task(), SimpleTrajectory(sandbox_id="nope")).reason_codes() == {"no_sandbox"}
    garbage = workspace_files(None, **{"solution.py": b"\xff\xfe\x00garbage" * 1000, "big.bin": b"\0" * (3 << 20)})
    g = grade(env, garbage)
    assert g.score == 0.0 and "collection_error" in g.reason_codes()


def test_huge_output_is_bounded(env):
    g = grade(env, workspace_files("def roman(n):\n    return 'X' * (50 << 20)\n"))
    assert g.score == 0.0 and "output_too_large" in g.reason_codes(), g.reasons


def test_validation():
    g = get_grader("code")
    with pytest.raises(GraderConfigError, match="hidden"):
        g.validate(CodeTask(visible=[], hidden=[]))
    with pytest.raises(GraderConfigError, match="CodeTask"):
        g.validate({"hidden": []})
    g.validate(roman_task())
