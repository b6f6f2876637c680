"""The command grader: an SWE-style task's test command, run by the grader's own runner in a fork of the
trajectory's sandbox, with the pristine test files put back first.

Order of work for one grade (each step names its reason code when it fails):
1. fork the trajectory's workspace (grading never touches the original);
2. inspect the fork from outside: every `restore` file must still hold its pristine text (`tests_modified`,
   `tests_deleted`; they are put back either way, and a symlink on their way stops the grade: `symlink`);
   no test-runner or interpreter hooks the task did not ship (`injection`: conftest.py, pytest.ini, pytest
   sections in setup.cfg/tox.ini/pyproject.toml, sitecustomize.py, usercustomize.py, *.pth); no fake
   `pytest`/`python` (`shim`); no module shadowing the standard library or a pristine test module
   (`shadowing`); bytecode caches are removed (an unchecked hash-based .pyc is used whatever the source says);
3. mount the pristine test files read-only over their paths and the runner (`command_runner.py`) at /grader;
4. run it as `<python> -I -B`, with a nonce on stdin, under time/memory/pid/output limits. It runs the command
   in a child process: pytest commands in-process with a reporting plugin, Python commands under runpy,
   anything else with `/bin/sh -c` (see the runner's docstring for the channels);
5. accept only the one nonce-tagged result line (`runner_killed`, `runner_protocol`), re-read the pristine
   files (`tests_modified` when the run rewrote them), and judge the records: every test from the restored
   files that pytest collected must pass (or be skipped by the pristine tests' own markers), and every `test*`
   function they define must have run (`tests_missing`); collection errors fail (`collection_error`); skips and
   xfails in pristine tests raised from other workspace code fail (`skip_attempt`); a `SystemExit` from
   workspace code or a test process that ends before pytest/the script finished fails (`early_exit`); replaced
   pytest internals, or a trace function installed from workspace code, fail (`monkeypatch`).
Score is 1.0 only when the command succeeded through that channel and nothing above fired; otherwise 0.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import secrets
import shlex
import sys
import tempfile
import tomllib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from rewards.base import Grade, GraderConfigError, TrajectoryLike
from rewards.workspace import FileEntry, Limits, LocalSandboxes, SandboxProvider, Workspace, grade_in_fork

RUNNER = Path(__file__).with_name("command_runner.py")
GRADER_DIR = "/grader"
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"

INJECTION_NAMES = {"conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py"}
CONFIG_NAMES = {"setup.cfg", "tox.ini", "pyproject.toml"}
SHIM_NAME = re.compile(r"(pytest|py\.test|pytest-3|python|python3(\.\d+)?)")
SHIM_MODULES = {"pytest", "_pytest", "pluggy"}  # as pytest.py / pytest/ in the workspace
BUILD_FILES = {"make": ("Makefile", "makefile", "GNUmakefile"), "tox": ("tox.ini",), "nox": ("noxfile.py",)}
# pytest options that read or write the cache (the runner disables the cache plugin: a planted
# .pytest_cache must not choose which tests run)
CACHE_FLAGS = {"--lf", "--last-failed", "--ff", "--failed-first", "--nf", "--new-first", "--sw", "--stepwise",
               "--sw-skip", "--stepwise-skip", "--cache-show", "--cache-clear"}
# pytest options whose value is the next token (so it is not taken for a test path)
PYTEST_VALUE_OPTS = {"-k", "-m", "-p", "-o", "-c", "-W", "-r", "--tb", "--maxfail", "--durations", "--junitxml",
                     "--junit-xml", "--basetemp", "--rootdir", "--confcutdir", "--deselect", "--ignore",
                     "--ignore-glob", "--import-mode", "--override-ini", "--color", "--capture", "--log-level",
                     "--durations-min", "--log-file", "--log-cli-level", "--inifile", "--config-file"}
PY_PASS_FLAGS = {"-u", "-b", "-bb", "-v"}
PY_DROP_FLAGS = {"-B", "-E", "-s", "-I", "-q"}  # the runner runs `-I -B` anyway
PY_VALUE_FLAGS = {"-W", "-X"}
SHELL_SYNTAX = re.compile(r"[;&|<>()$`*?{}~!\\\n]")
PYTEST_SECTION = re.compile(r"^\s*\[\s*(pytest|tool:pytest)\s*\]", re.M)


@dataclass
class CommandTask:
    """`Task.grading` of an SWE-style task (envs.tasks.loaders, format `swe`)."""

    cmd: str  # the test command the policy was told must pass; owned by the grader, run from the workspace root
    restore: dict[str, str]  # workspace path -> pristine text: tests, their data and config, put back first
    expected_tests: int | None = None  # pytest: exact number of tests from restored files that must pass
    timeout_s: float = 300.0  # the command's wall limit
    memory_mb: int = 2048
    pids: int = 256
    max_output_bytes: int = 4 << 20  # the command's stdout+stderr kept (the rest is drained and dropped)

    @classmethod
    def from_grading(cls, grading: Any) -> CommandTask:
        """A `CommandTask` from itself or from a `Task.grading` mapping; unknown keys fail, naming the key."""
        if isinstance(grading, cls):
            return grading
        if not isinstance(grading, Mapping):
            raise GraderConfigError(
                f"grader 'command': task must be a CommandTask or a grading mapping, got {type(grading).__name__}"
            )
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(grading) - set(valid))
        if unknown:
            raise GraderConfigError(f"grader 'command': unknown task field(s) {unknown}; valid fields: {valid}")
        for key in ("cmd", "restore"):
            if key not in grading:
                raise GraderConfigError(f"grader 'command': task field {key!r} is required")
        return cls(**dict(grading))


@dataclass
class Plan:
    """How the runner will run `cmd`, decided once from the command text."""

    mode: str  # "pytest", "python" or "shell"
    env: dict[str, str] = field(default_factory=dict)  # leading VAR=value assignments
    pyflags: list[str] = field(default_factory=list)  # interpreter flags passed through
    args: list[str] = field(default_factory=list)  # pytest arguments
    kind: str = ""  # python mode: "script", "module" or "code"
    target: str = ""  # script path, module name or code string
    argv: list[str] = field(default_factory=list)  # python mode: sys.argv
    module_run: bool = False  # `python -m pytest` (cwd goes on sys.path) rather than `pytest`
    files: list[str] = field(default_factory=list)  # workspace files the command names


def plan_command(cmd: Any) -> Plan:
    """Parse the test command; raises `GraderConfigError` naming the `cmd` field when it cannot be run faithfully."""
    if not isinstance(cmd, str) or not cmd.strip():
        raise GraderConfigError(f"grader 'command': task field 'cmd' must be a non-empty string, got {cmd!r}")
    try:
        tokens = shlex.split(cmd)
    except ValueError as e:
        raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r} does not parse: {e}") from None
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        k, _, v = tokens.pop(0).partition("=")
        env[k] = v
    if not tokens:
        raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r} has no program")
    prog, rest = os.path.basename(tokens[0]), tokens[1:]
    if SHELL_SYNTAX.search(cmd) or ("/" in tokens[0] and not tokens[0].startswith("/")):
        return Plan("shell", env=env, files=_named_files(tokens))
    if prog in ("pytest", "py.test"):
        return _pytest_plan(cmd, rest, env, [], module_run=False)
    if not re.fullmatch(r"python(3(\.\d+)?)?", prog):
        return Plan("shell", env=env, files=_named_files(tokens))
    flags, i = [], 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] not in ("-m", "-c", "-"):
        f = rest[i]
        if f in ("-O", "-OO"):
            raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r}: {f} strips the tests' asserts")
        if f in PY_VALUE_FLAGS:
            if i + 1 >= len(rest):
                raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r}: {f} needs a value")
            flags += [f, rest[i + 1]]
            i += 2
            continue
        if f[:2] in PY_VALUE_FLAGS or f in PY_PASS_FLAGS:
            flags.append(f)
        elif f not in PY_DROP_FLAGS:
            raise GraderConfigError(
                f"grader 'command': task field 'cmd' {cmd!r}: interpreter flag {f!r} is not supported "
                f"(supported: {sorted(PY_PASS_FLAGS | PY_DROP_FLAGS | PY_VALUE_FLAGS)})"
            )
        i += 1
    rest = rest[i:]
    if not rest or rest[0] == "-":
        raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r} runs no script, module or -c code")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r}: -m needs a module")
        if rest[1] == "pytest":
            return _pytest_plan(cmd, rest[2:], env, flags, module_run=True)
        return Plan("python", env=env, pyflags=flags, kind="module", target=rest[1], argv=["-m", *rest[2:]],
                    files=_named_files(rest[2:]))
    if rest[0] == "-c":
        if len(rest) < 2:
            raise GraderConfigError(f"grader 'command': task field 'cmd' {cmd!r}: -c needs code")
        return Plan("python", env=env, pyflags=flags, kind="code", target=rest[1], argv=["-c", *rest[2:]])
    return Plan("python", env=env, pyflags=flags, kind="script", target=rest[0], argv=rest,
                files=_named_files(rest))


def _pytest_plan(cmd: str, args: list[str], env: dict, flags: list[str], *, module_run: bool) -> Plan:
    bad = sorted(a.split("=")[0] for a in args if a.split("=")[0] in CACHE_FLAGS)
    if bad:
        raise GraderConfigError(
            f"grader 'command': task field 'cmd' {cmd!r}: {bad} depend on pytest's cache, which the grader "
            "disables (a cache in the workspace is the policy's)"
        )
    return Plan("pytest", env=env, pyflags=flags, args=args, module_run=module_run, files=_pytest_paths(args))


def _pytest_paths(args: list[str]) -> list[str]:
    """The positional arguments of a pytest command line (test paths, `::` selectors dropped)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in PYTEST_VALUE_OPTS
        else:
            out.append(a.split("::")[0].rstrip("/") or ".")
    return out


def _named_files(tokens: list[str]) -> list[str]:
    return [t for t in tokens if not t.startswith("-") and "=" not in t and re.search(r"\.(py|sh|bash)$", t)]


def _norm(path: str) -> str:
    p = PurePosixPath(path)
    return "." if str(p) in ("", ".") else str(p).removeprefix("./")


def _is_test_module(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def configures_pytest(name: str, text: str) -> bool:
    """Whether a setup.cfg / tox.ini / pyproject.toml holds pytest configuration (a section pytest reads)."""
    if name == "pyproject.toml":
        try:
            return "pytest" in tomllib.loads(text).get("tool", {})
        except (tomllib.TOMLDecodeError, AttributeError):
            return "tool.pytest" in text  # pytest cannot parse it either: judge by the text
    return bool(PYTEST_SECTION.search(text))


def pristine_inifile(restore: Mapping[str, str], scope: list[str]) -> str | None:
    """The configuration file pytest would pick among the pristine files: its own search (pytest.ini,
    .pytest.ini, pyproject.toml, tox.ini, setup.cfg in each directory) from the common ancestor of the test
    paths up to the workspace root, never above it."""
    parts = [PurePosixPath(p).parts for p in scope if p != "."]
    common: list[str] = []
    if parts and len(parts) == len(scope):
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
    start = PurePosixPath(*common) if common else PurePosixPath(".")
    if str(start) in restore:  # a file argument: its directory
        start = start.parent
    for d in (start, *start.parents):
        for name in ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"):
            p = _norm(str(d / name))
            if p in restore and (name.endswith("pytest.ini") or configures_pytest(name, restore[p])):
                return p
    return None


def static_tests(source: str) -> list[str]:
    """`test*` functions and `Test*` / `*TestCase` class methods a pristine test module defines, as they appear
    in pytest node ids (`test_x`, `TestY::test_z`); parametrised ids are matched without their `[...]`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            is_case = any(b.endswith("TestCase") for b in bases)
            if not (node.name.startswith("Test") or is_case):
                continue
            methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if any(m.name == "__init__" for m in methods) and not is_case:
                continue  # pytest does not collect classes with __init__
            names += [f"{node.name}::{m.name}" for m in methods if m.name.startswith("test")]
    return names


class CommandGrader:
    """Reads `trajectory.sandbox_id` only (the workspace is the submission). `python` is the interpreter inside
    the sandbox that runs the runner and the tests (it must have pytest for pytest commands)."""

    name = "command"

    def __init__(self, sandboxes: SandboxProvider | None = None, python: str = "/usr/bin/python3"):
        self.sandboxes = sandboxes or LocalSandboxes()
        self.python = python

    # ------------------------------------------------------------------------------------------- validation
    def validate(self, task: Any) -> None:
        self._checked(task)

    def _checked(self, task: Any) -> tuple[CommandTask, Plan]:
        if not RUNNER.is_file():
            raise GraderConfigError(f"grader 'command': pristine runner missing at {RUNNER}")
        task = CommandTask.from_grading(task)
        plan = plan_command(task.cmd)

        def bad(name: str, msg: str) -> GraderConfigError:
            return GraderConfigError(f"grader 'command': task field {name!r} {msg}")

        if not isinstance(task.restore, Mapping) or not task.restore:
            raise bad("restore", "must map workspace paths to the pristine text of the tests the command runs, "
                                 f"got {type(task.restore).__name__} {str(task.restore)[:80]!r}")
        for path, text in task.restore.items():
            if not isinstance(path, str) or not isinstance(text, str):
                raise bad("restore", f"must map str paths to str texts, got {path!r}: {type(text).__name__}")
            p = PurePosixPath(path)
            if not path or p.is_absolute() or ".." in p.parts or _norm(path) != path or path.endswith("/"):
                raise bad("restore", f"has {path!r}: keys must be normalised relative paths")
        for name, least in (("timeout_s", 1.0), ("memory_mb", 64), ("pids", 8), ("max_output_bytes", 1024)):
            v = getattr(task, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < least:
                raise bad(name, f"must be a number >= {least}, got {v!r}")
        n = task.expected_tests
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise bad("expected_tests", f"must be a positive int or None, got {n!r}")
        if n is not None and plan.mode != "pytest":
            raise bad("expected_tests", f"needs a pytest command, {task.cmd!r} is not one")
        restored = set(task.restore)
        for f in map(_norm, plan.files):
            if f not in restored and (plan.mode != "pytest" or f.endswith(".py")):
                raise bad("restore", f"lacks {f!r}, which the command runs (the policy could edit it)")
        if plan.mode == "pytest":
            scope = [_norm(f) for f in plan.files] or ["."]
            if not any(_is_test_module(p) and _under(p, scope) for p in restored):
                raise bad("restore", f"holds no test module (test_*.py / *_test.py) under {scope} for {task.cmd!r}")
        prog = os.path.basename(shlex.split(task.cmd)[len(plan.env)]) if plan.mode == "shell" else ""
        if prog in BUILD_FILES and not restored & set(BUILD_FILES[prog]):
            raise bad("restore", f"lacks {BUILD_FILES[prog][0]!r}, which {prog} reads (the policy could edit it)")
        return task, plan

    # ------------------------------------------------------------------------------------------------ grading
    def grade(self, task: Any, trajectory: TrajectoryLike) -> Grade:
        task, plan = self._checked(task)
        return grade_in_fork(self.sandboxes, trajectory.sandbox_id, lambda ws: self._grade_in(ws, task, plan))

    def _grade_in(self, ws: Workspace, task: CommandTask, plan: Plan) -> Grade:
        entries = ws.list_files()
        by_path = {e.path: e for e in entries}
        details: dict[str, Any] = {"mode": plan.mode}
        reasons, fatal = self._restore(ws, task, by_path)
        if fatal:
            return Grade(0.0, False, reasons, details)
        reasons += self._inspect(ws, task, entries)
        for e in entries:  # bytecode caches: an unchecked hash-based .pyc is used whatever the source says
            if e.kind == "dir" and PurePosixPath(e.path).name == "__pycache__":
                with contextlib.suppress(Exception):  # gone with a directory removed above
                    ws.remove(e.path)
        nonce = secrets.token_hex(16)
        with tempfile.TemporaryDirectory(prefix="rlk3-command-grader-") as gdir:
            Path(gdir, "runner", "runner.py").parent.mkdir()
            Path(gdir, "runner", "runner.py").write_bytes(RUNNER.read_bytes())
            Path(gdir, "runner", "pytest.ini").write_text("[pytest]\n")  # when the task ships no pytest config
            ws.mount_readonly(Path(gdir, "runner"), GRADER_DIR)
            for path, text in sorted(task.restore.items()):  # read-only over the copies just written
                host = Path(gdir, "pristine", path)
                host.parent.mkdir(parents=True, exist_ok=True)
                host.write_text(text)
                ws.mount_readonly(host, f"{ws.sandbox_root}/{path}")
            job = self._job(ws, task, plan, nonce)
            limits = Limits(
                timeout_s=task.timeout_s + 30,
                memory_mb=task.memory_mb,
                pids=task.pids,
                max_output_bytes=task.max_output_bytes,
            )
            res = ws.exec([self.python, "-I", "-B", f"{GRADER_DIR}/runner.py"], stdin=json.dumps(job).encode(),
                          limits=limits)
        details["output_tail"] = res.stderr[-2000:].decode("utf-8", "replace")
        details["output_truncated"] = res.truncated
        out, stream_reasons = _result_line(res, nonce)
        reasons += stream_reasons
        reasons += self._recheck(ws, task)
        if out is not None:
            details["wall_s"] = out.get("wall_s")
            details["exit"] = out.get("child_exit")
            reasons += _judge_run(out, task, plan, details, oom=res.oom_killed)
        if reasons:
            return Grade(0.0, False, _dedupe(reasons), details)
        return Grade(1.0, True, [], details)

    # ------------------------------------------------------------------------------------------------ steps
    @staticmethod
    def _restore(ws: Workspace, task: CommandTask, by_path: dict[str, FileEntry]) -> tuple[list[str], bool]:
        """Compare every pristine file with the fork's copy and put the pristine one back."""
        reasons = []
        for path, text in sorted(task.restore.items()):
            parts = PurePosixPath(path).parts
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                e = by_path.get(parent)
                if e is not None and e.kind != "dir":
                    what = "a symlink" if e.kind == "symlink" else f"a {e.kind}"
                    code = "symlink" if e.kind == "symlink" else "tests_modified"
                    return [f"{code}: {parent} (on the way to the pristine {path}) is now {what}"], True
            e = by_path.get(path)
            if e is None:
                reasons.append(f"tests_deleted: {path} is missing (restored)")
            elif e.kind == "symlink":  # never followed, and not removed through the host either
                return [f"symlink: {path} is now a symlink (pristine tests are never read through links)"], True
            elif e.kind != "file":
                reasons.append(f"tests_modified: {path} is now a {e.kind} (restored)")
                try:
                    ws.remove(path)
                except Exception as err:  # whatever the backend raises: the grade must not
                    return [*reasons, f"tests_modified: {path} cannot be put back ({err})"], True
            else:
                try:
                    same = ws.read_file(path, max_bytes=len(text.encode()) + 1) == text.encode()
                except (OSError, ValueError):
                    same = False
                if not same:
                    reasons.append(f"tests_modified: {path} differs from the pristine copy (restored)")
            try:
                ws.write_file(path, text)
            except Exception as err:
                return [*reasons, f"tests_modified: {path} cannot be put back ({err})"], True
        return reasons, False

    @staticmethod
    def _inspect(ws: Workspace, task: CommandTask, entries: list[FileEntry]) -> list[str]:
        reasons = []
        restored = set(task.restore)
        paths = {e.path for e in entries}
        # directories that end up on sys.path: the root (python -m, scripts there, rootdir conftest) and the
        # directories of the pristine test modules (pytest's default `prepend` import mode)
        path_dirs = {"."} | {str(PurePosixPath(p).parent) for p in restored if p.endswith(".py")}
        pristine_modules = {str(PurePosixPath(p).with_suffix("")) for p in restored if p.endswith(".py")}
        # a virtualenv the policy made (never used by the runner, full of .pth files and interpreter links) is
        # exempt from the hook and shim checks, never from the shadowing checks, and never at a sys.path dir
        venvs = {str(PurePosixPath(p).parent) for p in paths if PurePosixPath(p).name == "pyvenv.cfg"} - path_dirs
        stdlib = set(sys.stdlib_module_names)
        for e in entries:
            if e.path in restored:
                continue
            p = PurePosixPath(e.path)
            name, parent = p.name, str(p.parent)
            module = _module_name(name, e.kind)
            if e.kind == "dir" and f"{e.path}/__init__.py" not in paths:
                module = None  # a namespace portion never wins over a regular module later on sys.path
            if parent in path_dirs and module in stdlib:
                reasons.append(f"shadowing: {e.path} shadows the standard-library module {module!r}")
            if module and f"{parent}/{module}".removeprefix("./") in pristine_modules:
                reasons.append(f"shadowing: {e.path} would be imported instead of a pristine test module")
            if any(str(a) in venvs for a in p.parents):
                continue
            if name in INJECTION_NAMES or (name.endswith(".pth") and e.kind != "dir"):
                reasons.append(f"injection: {e.path} (test-runner / interpreter hook the task did not ship)")
            elif name in CONFIG_NAMES and e.kind == "file":
                text = ws.read_file(e.path, max_bytes=1 << 20).decode("utf-8", "replace")
                if configures_pytest(name, text):
                    reasons.append(f"injection: {e.path} configures pytest (the task did not ship that)")
            elif SHIM_NAME.fullmatch(name) and e.kind in ("file", "symlink"):
                reasons.append(f"shim: {e.path} stands in for an interpreter or pytest")
            elif name.removesuffix(".py") in SHIM_MODULES and (e.kind == "dir" or name.endswith(".py")):
                reasons.append(f"shim: {e.path} stands in for the {name.removesuffix('.py')} package")
        return reasons

    def _job(self, ws: Workspace, task: CommandTask, plan: Plan, nonce: str) -> dict:
        root = ws.sandbox_root
        env = {"PATH": CLEAN_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        env.update(plan.env)
        pythonpath = [p if p.startswith("/") else f"{root}/{p}" for p in plan.env.get("PYTHONPATH", "").split(":") if p]
        job = {
            "nonce": nonce,
            "mode": plan.mode,
            "cwd": root,
            "env": env,
            "timeout_s": task.timeout_s,
            "restore": sorted(task.restore),
            "pythonpath": pythonpath,
            "pyflags": plan.pyflags,
        }
        if plan.mode == "shell":
            job["cmd"] = shlex.join(shlex.split(task.cmd)[len(plan.env):])
        elif plan.mode == "pytest":
            args = list(plan.args)
            # pytest's configuration is pinned to the pristine file pytest would pick (or an empty one): a
            # pytest.ini the policy planted, or one above the workspace, is never read
            ini = pristine_inifile(task.restore, [_norm(f) for f in plan.files])
            config = f"{root}/{ini}" if ini else f"{GRADER_DIR}/pytest.ini"
            forced = [(("--rootdir",), ["--rootdir", root]), (("--confcutdir",), ["--confcutdir", root]),
                      (("-c", "--config-file", "--inifile"), ["-c", config])]
            for names, extra in forced:
                if not any(a == n or a.startswith(n + "=") for a in args for n in names):
                    args += extra
            job["args"] = ["-p", "no:cacheprovider", *args]
            job["path0"] = [root] if plan.module_run else []
        else:
            target = plan.target
            if plan.kind == "script":
                target = target if target.startswith("/") else f"{root}/{_norm(target)}"
            job.update(kind=plan.kind, target=target, argv=[target, *plan.argv[1:]] if plan.kind == "script" else
                       plan.argv, path0=[os.path.dirname(target)] if plan.kind == "script" else [root])
        return job

    @staticmethod
    def _recheck(ws: Workspace, task: CommandTask) -> list[str]:
        """The pristine files after the run: a test process that rewrote one (around the read-only mount, e.g.
        by renaming over it where the backend allows that) changed what the command ran."""
        reasons = []
        for path, text in sorted(task.restore.items()):
            try:
                same = ws.read_file(path, max_bytes=len(text.encode()) + 1) == text.encode()
            except (OSError, ValueError):
                same = False
            if not same:
                reasons.append(f"tests_modified: {path} was rewritten while the command ran")
        return reasons


# ---------------------------------------------------------------------------------------------- judging


def _under(path: str, scope: list[str]) -> bool:
    return any(s == "." or path == s or path.startswith(s + "/") for s in scope)


def _module_name(name: str, kind: str) -> str | None:
    if kind == "dir":
        return name if name.isidentifier() else None
    m = re.fullmatch(r"([A-Za-z_]\w*)(\.[\w-]+)?\.(py|pyc|so|pyd)", name)
    return m.group(1) if m else None


def _result_line(res, nonce: str) -> tuple[dict | None, list[str]]:
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    mine, others = [], 0
    for ln in lines:
        try:
            obj = json.loads(ln)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get("nonce") == nonce:
            mine.append(obj)
        else:
            others += 1
    reasons = []
    if others:
        reasons.append(f"runner_protocol: {others} line(s) on the result stream that the runner did not write")
    if len(mine) > 1:
        reasons.append("runner_protocol: more than one result line carries the nonce")
    if not mine:
        if res.oom_killed:
            reasons.append("out_of_memory: the command exceeded its memory limit and the runner was killed")
        elif res.timed_out:
            reasons.append("timeout: the runner did not finish within its wall limit")
        else:
            reasons.append(f"runner_killed: no result from the runner (exit {res.exit_code})")
        return None, reasons
    return mine[-1], reasons


def _judge_run(out: dict, task: CommandTask, plan: Plan, details: dict, *, oom: bool = False) -> list[str]:
    reasons = []
    if out.get("timed_out"):
        return [f"timeout: the command exceeded {task.timeout_s}s"]
    if out.get("forged"):
        reasons.append(f"runner_protocol: {out['forged']} record(s) on the report pipe failed authentication (forged)")
    if out.get("overflow"):
        reasons.append("runner_protocol: too many records on the report pipe")
    code = out.get("child_exit")
    if plan.mode == "shell":
        if code != 0:
            reasons.append(f"command_failed: exit status {code}")
        return reasons
    if not out.get("hello"):
        return [*reasons, f"runner_protocol: the test process never reported (exit {code})"]
    records = [r for r in out.get("records", []) if isinstance(r, dict)]
    end = [r for r in records if r.get("ev") == "end"]
    for r in records:
        if r.get("ev") == "skip" and r.get("under") and r.get("origin") not in task.restore:
            reasons.append(f"skip_attempt: {r['origin']} raised SkipTest in {r['under']} ({r.get('reason', '')[:80]})")
        if r.get("tamper"):
            reasons.append(f"monkeypatch: {', '.join(map(str, r['tamper'][:5]))} replaced while the tests ran")
        if r.get("ev") == "trace" and r.get("origin") not in task.restore:
            reasons.append(f"monkeypatch: {r.get('origin')} installed a {r.get('what')} function (it can skip asserts)")
    if plan.mode == "pytest":
        reasons += _judge_pytest(records, task, plan, details)
    else:
        reasons += _judge_python(records, task, details)
    if not end and oom and code == -9:
        reasons.append(f"out_of_memory: the test process exceeded {task.memory_mb} MiB and was killed")
    elif not end:
        if isinstance(code, int) and code < 0:
            how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        finished = "pytest" if plan.mode == "pytest" else "the script"
        reasons.append(f"early_exit: the test process ended before {finished} finished ({how})")
    elif end[-1].get("rc") != code:
        reasons.append(f"runner_protocol: the test process reported {end[-1].get('rc')} but exited {code}")
    return reasons


def _judge_python(records: list[dict], task: CommandTask, details: dict) -> list[str]:
    reasons = []
    end = [r for r in records if r.get("ev") == "end"]
    if end:
        e = end[-1]
        policy_origin = e.get("origin") and e["origin"] not in task.restore
        details["script_end"] = e.get("how")
        if e.get("how") == "exit" and policy_origin:
            reasons.append(f"early_exit: {e['origin']} called sys.exit({e.get('rc')}) before the script finished")
        elif e.get("rc") != 0:
            what = e.get("exc") or f"exit status {e.get('rc')}"
            reasons.append(f"tests_failed: the command failed ({what})")
    return reasons


def _judge_pytest(records: list[dict], task: CommandTask, plan: Plan, details: dict) -> list[str]:
    reasons = []
    restored = task.restore
    for r in records:
        ev = r.get("ev")
        if ev == "conftest" and r.get("rel") not in restored:
            reasons.append(f"injection: pytest loaded {r.get('rel') or r.get('path')}, which the task did not ship")
        elif ev == "config" and r.get("inifile") and r.get("inifile_rel") is None and r.get("ini_options"):
            reasons.append(f"injection: pytest read its configuration from {r['inifile']} outside the workspace")
        elif ev == "collect" and r.get("outcome") == "failed":
            why = r.get("exc") or "error"
            if why == "SystemExit" or (r.get("origin") and why == "KeyboardInterrupt"):
                reasons.append(f"early_exit: {r.get('origin') or r.get('id')} raised {why} during collection")
            reasons.append(f"collection_error: {r.get('id') or 'session'}: {why} (from {r.get('origin') or '?'})")
        elif ev == "collect" and r.get("outcome") == "skipped" and r.get("id", "").split("::")[0] in restored:
            if not _skip_allowed(r, r.get("id", ""), restored):
                reasons.append(f"skip_attempt: collecting {r.get('id')} was skipped from {r.get('origin')}")
        elif ev == "interrupt" and r.get("exc") == "KeyboardInterrupt":
            reasons.append(f"early_exit: {r.get('origin') or 'the test process'} raised KeyboardInterrupt")
        elif ev == "internal_error":
            reasons.append(f"tests_failed: pytest internal error ({r.get('exc')} from {r.get('origin') or '?'})")
    # per test: the worst phase decides
    phases: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("ev") == "test":
            phases[r.get("id", "")].append(r)
    status: dict[str, str] = {}
    exits: dict[str, list[str]] = defaultdict(list)  # where from -> tests
    skips: dict[str, list[str]] = defaultdict(list)
    for nodeid, reps in phases.items():
        file = nodeid.split("::")[0]
        st = "passed"
        for r in reps:
            if r.get("exc") == "SystemExit":
                exits[r.get("origin") or "?"].append(nodeid)
            if r.get("outcome") == "failed":
                st = "failed"
            elif r.get("outcome") == "skipped" and st != "failed":
                st = "skipped"
                if file in restored and not _skip_allowed(r, file, restored):
                    how = "xfailed" if r.get("xfail") else "skipped"
                    where = r.get("origin") or "a marker the pristine tests do not declare"
                    skips[f"{how} from {where}"].append(nodeid)
        status[nodeid] = st
    for origin, ids in exits.items():
        reasons.append(f"early_exit: {origin} raised SystemExit in {len(ids)} test(s): {', '.join(ids[:3])}")
    for how, ids in skips.items():
        reasons.append(f"skip_attempt: {len(ids)} test(s) {how}: {', '.join(ids[:3])}")
    pristine = {k: v for k, v in status.items() if k.split("::")[0] in restored}
    counts = {s: sum(1 for v in pristine.values() if v == s) for s in ("passed", "failed", "skipped")}
    details.update(tests=counts, other_tests=len(status) - len(pristine))
    failed = sorted(k for k, v in status.items() if v == "failed")
    if failed:
        reasons.append(f"tests_failed: {len(failed)} failed: {', '.join(failed[:5])}")
    # every test function of every pristine module pytest collected (or the command names) must have run
    scope = [_norm(f) for f in plan.files]
    collected = {r.get("id", "").split("::")[0] for r in records if r.get("ev") in ("collect", "test")}
    custom = any(re.search(r"python_(functions|classes|files)", t) for p, t in restored.items()
                 if PurePosixPath(p).name in CONFIG_NAMES | {"pytest.ini", "conftest.py"})
    missing = []
    for path, text in sorted(restored.items()):
        if custom or not _is_test_module(path) or not (path in collected or (scope and _under(path, scope))):
            continue
        ran = {re.sub(r"\[.*\]$", "", k.split("::", 1)[1]) for k in pristine if k.startswith(path + "::")}
        missing += [f"{path}::{n}" for n in static_tests(text) if n not in ran]
    if missing:
        reasons.append(f"tests_missing: {len(missing)} pristine test(s) did not run: {', '.join(missing[:5])}")
    n_ran = counts["passed"] + counts["skipped"]
    if task.expected_tests is not None and n_ran != task.expected_tests:
        reasons.append(f"tests_missing: {n_ran} pristine tests ran, the task expects {task.expected_tests}")
    if not counts["passed"]:
        reasons.append("tests_missing: no test from the pristine test files passed")
    finish = [r for r in records if r.get("ev") == "finish"]
    if finish and finish[-1].get("exitstatus") != 0 and not reasons:
        reasons.append(f"tests_failed: pytest exit status {finish[-1].get('exitstatus')}")
    return reasons


def _skip_allowed(rec: dict, file: str, restored: Mapping[str, str]) -> bool:
    """A skip/xfail is the pristine tests' own when it was raised in a pristine file, or came from a marker
    (no workspace frame) on a test in a pristine file that declares skips or xfails."""
    origin = rec.get("origin")
    if origin is not None:
        return origin in restored
    text = restored.get(file)
    return text is not None and bool(re.search(r"skip|xfail", text))


def _dedupe(reasons: list[str]) -> list[str]:
    return list(dict.fromkeys(reasons))
