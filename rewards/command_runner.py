"""The command grader's runner. The grader copies it, pristine, into the judging fork at grading time and runs it
as `<python> -I -B /grader/runner.py` with its job (JSON) on stdin. Standard library only.

Two processes, because the code under test can do anything inside the process that runs it:

* The **parent** (this file's `main`) reads the job, including a nonce, then unlinks the stdin file if the
  backend used one, makes itself non-dumpable (so a same-uid process without capabilities cannot read its
  memory or open its descriptors through /proc), ignores the catchable signals, and starts the child. It
  never imports workspace code. When the child is done (or the deadline passes and the child's process
  group is killed) it writes exactly one line to its stdout: the nonce, the child's exit status and the
  records the child sent. The grader accepts only that line; any other line on stdout means something else
  wrote to the result stream (inside bubblewrap, the sandbox's init holds the same pipe).
* The **child** is a fresh interpreter (`exec`, not `fork`: the nonce is never in its memory). Its
  stdout/stderr go to the parent's stderr; its report pipe sits at a random descriptor, and every record on
  it carries an HMAC under a key the child sends first, before any workspace code is imported. It runs
  pytest in-process with a reporting plugin (`pytest` mode), or a Python script/module/`-c` string
  (`python` mode); other commands run under `/bin/sh -c` with a clean PATH (`shell` mode: exit status
  only). The child ends with `os._exit`, so exit handlers registered by workspace code do not run.

What this cannot do: workspace code shares the child process with the tests (that is what a test is), so
code written against this runner could still find the report key in memory and forge records; the HMAC,
the random descriptor, the identity checks on pytest internals (`tamper` records) and an audit hook on
`sys.settrace`/`sys.setprofile` (`trace` records) make the naive paths (spraying descriptors, patching the
report functions, exiting early, a trace function that jumps over asserts) fail loudly, not impossible.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time

MAX_RECORDS = 50_000
MAX_BUFFER = 64 << 20
GRACE_S = 0.5  # after the child exits: how long to wait for the rest of its records


def _non_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


def _forget_stdin():
    """E2BWorkspace passes stdin through a file in /tmp; remove it before any workspace code runs."""
    try:
        path = os.readlink("/proc/self/fd/0")
    except OSError:
        return
    if path.startswith("/tmp/.stdin-"):
        with contextlib.suppress(OSError):
            os.unlink(path)


# ------------------------------------------------------------------------------------------------- parent


def main():
    _non_dumpable()
    job = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    _forget_stdin()
    nonce = job.pop("nonce")
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGALRM",
                 "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGXFSZ", "SIGXCPU", "SIGVTALRM", "SIGPROF"):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    out = {"nonce": nonce}
    out.update(run_child(job))
    data = json.dumps(out, separators=(",", ":")).encode() + b"\n"
    while data:
        data = data[os.write(1, data):]


def run_child(job):
    t0 = time.monotonic()
    env = job["env"]
    if job["mode"] == "shell":
        argv, r, w = ["/bin/sh", "-c", job["cmd"]], None, None
    else:
        r, w = os.pipe()
        argv = [sys.executable, *job.get("pyflags", []), "-I", "-B", os.path.abspath(__file__), "--child", str(w)]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL if r is None else subprocess.PIPE,
        stdout=2,
        stderr=2,
        pass_fds=() if w is None else (w,),
        cwd=job["cwd"],
        env=env,
        start_new_session=True,  # its own process group: killed whole at the deadline
    )
    if w is not None:
        os.close(w)
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except OSError:
            pass
    deadline = t0 + job["timeout_s"]
    key = None
    records, forged, overflow = [], 0, False
    buf = b""
    eof = r is None
    timed_out = False
    grace_end = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if proc.poll() is not None:
            if eof:
                break
            if grace_end is None:
                grace_end = now + GRACE_S
            elif now >= grace_end:
                break
        wait = min(0.2, deadline - now, (grace_end - now) if grace_end else 0.2)
        if eof:
            time.sleep(max(0.0, wait))
            continue
        ready, _, _ = select.select([r], [], [], max(0.0, wait))
        if not ready:
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:
            eof = True
            continue
        if len(buf) + len(chunk) > MAX_BUFFER:
            overflow = True
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if key is None:
                if line.startswith(b"hello "):
                    try:
                        key = bytes.fromhex(line[6:].decode())
                    except ValueError:
                        forged += 1
                else:
                    forged += 1
                continue
            rec = _verify(key, line)
            if rec is None:
                forged += 1
            elif len(records) < MAX_RECORDS:
                records.append(rec)
            else:
                overflow = True
    with contextlib.suppress(ProcessLookupError, PermissionError):  # background processes the tests left too
        os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()
    if r is not None:
        os.close(r)
    return {
        "child_exit": code,
        "timed_out": timed_out,
        "hello": key is not None or r is None,
        "records": records,
        "forged": forged,
        "overflow": overflow,
        "wall_s": round(time.monotonic() - t0, 3),
    }


def _verify(key, line):
    import hmac

    mac, _, data = line.partition(b" ")
    want = hmac.new(key, data, "sha256").hexdigest()[:32].encode()
    if not hmac.compare_digest(mac, want):
        return None
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


# -------------------------------------------------------------------------------------------------- child


def child(fd):
    import hmac

    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # tests that read stdin see EOF
    os.close(devnull)
    # the report pipe at a random descriptor, not inherited by the tests' subprocesses
    target = 200 + int.from_bytes(os.urandom(2), "little") % 800
    os.dup2(fd, target, inheritable=False)
    os.close(fd)
    key = os.urandom(32)
    write, _exit = os.write, os._exit

    def raw(data):
        while data:
            data = data[write(target, data):]

    raw(b"hello " + key.hex().encode() + b"\n")

    def send(obj):
        data = json.dumps(obj, separators=(",", ":"), default=str).encode()
        raw(hmac.new(key, data, "sha256").hexdigest()[:32].encode() + b" " + data + b"\n")

    ws = os.path.realpath(job["cwd"])
    _watch_tracing(send, ws)
    _watch_skiptest(send, ws, set(job["restore"]))
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # the runner's own directory is not the command's
    try:
        if job["mode"] == "pytest":
            rc = run_pytest(job, send, ws)
        else:
            rc = run_python(job, send, ws)
    except BaseException as e:  # a runner bug or an interrupt that escaped pytest
        send({"ev": "end", "how": "error", "exc": type(e).__name__, "origin": _origin(e.__traceback__, ws)})
        rc = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):  # a closed or replaced stream must not change the way out
            stream.flush()
    _exit(rc)


def _rel(path, ws):
    """Workspace-relative path of `path`, or None when it lies outside the workspace."""
    if not path:
        return None
    path = str(path)
    if not os.path.isabs(path):
        if path.startswith("<"):
            return None
        path = os.path.join(ws, path)
    path = os.path.normpath(path)
    if path.startswith(ws + os.sep):
        return path[len(ws) + 1:]
    return None


def _origin(tb, ws):
    """The innermost workspace file in a traceback: where, among files the policy could touch, it was raised."""
    found = None
    while tb is not None:
        rel = _rel(tb.tb_frame.f_code.co_filename, ws)
        if rel is not None:
            found = rel
        tb = tb.tb_next
    return found


def _frame_origin(frame, ws):
    """The innermost workspace file on a call stack, from `frame` outwards."""
    while frame is not None:
        rel = _rel(frame.f_code.co_filename, ws)
        if rel is not None:
            return rel
        frame = frame.f_back
    return None


def _watch_tracing(send, ws):
    """An audit hook (it cannot be removed once added) that reports trace/profile functions installed from
    workspace code: a trace function can jump a test frame past its asserts (`frame.f_lineno = ...`)."""
    seen = set()
    getframe = sys._getframe

    def hook(event, args):
        if event not in ("sys.settrace", "sys.setprofile"):
            return
        origin = _frame_origin(getframe(1), ws)
        if origin is not None and (event, origin) not in seen:
            seen.add((event, origin))
            send({"ev": "trace", "what": event, "origin": origin})

    sys.addaudithook(hook)


def _watch_skiptest(send, ws, restore):
    """Report where each `unittest.SkipTest` is made (the innermost workspace file on the stack) and the innermost
    pristine file under it: unittest (and pytest's unittest support) turns one raised inside a test into a skip
    without a traceback that would show it came from workspace code."""
    import unittest.case

    init = unittest.case.SkipTest.__init__
    getframe = sys._getframe

    def skip_init(self, *a, **k):
        origin, under, f = None, None, getframe(1)
        while f is not None and under is None:
            rel = _rel(f.f_code.co_filename, ws)
            origin = origin or rel
            under = rel if rel in restore else None
            f = f.f_back
        send({"ev": "skip", "origin": origin, "under": under, "reason": str(a[0])[:200] if a else ""})
        init(self, *a, **k)

    unittest.case.SkipTest.__init__ = skip_init


def _guards(pairs):
    """(label, namespace, name) -> the object now there, for identity checks after the workspace code ran."""
    return {label: vars(ns).get(name) for label, ns, name in pairs}


def _set_path(job):
    sys.path[0:0] = job.get("path0", []) + [p for p in job.get("pythonpath", []) if p]


def run_pytest(job, send, ws):
    # pytest and its plugins are imported before the workspace is on sys.path: a planted pytest.py, pluggy.py
    # or _pytest/ cannot stand in for them
    import pytest
    from _pytest import python as _py
    from _pytest import reports as _reports
    from _pytest import runner as _runner

    ws_files = {}  # (nodeid, phase) -> (exception type, innermost workspace file it came from)

    class Reporter:
        def pytest_configure(self, config):
            inipath = getattr(config, "inipath", None)
            send({"ev": "config", "inifile": str(inipath) if inipath else None,
                  "inifile_rel": _rel(inipath, ws), "ini_options": bool(getattr(config, "inicfg", None)),
                  "rootdir": str(getattr(config, "rootpath", ""))})

        def pytest_plugin_registered(self, plugin, manager):
            f = getattr(plugin, "__file__", None)
            if f and os.path.basename(f) == "conftest.py":
                send({"ev": "conftest", "path": str(f), "rel": _rel(f, ws)})

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            yield
            if call.excinfo is not None:
                ws_files[(item.nodeid, call.when)] = (call.excinfo.type.__name__, _origin(call.excinfo.tb, ws))

        def pytest_runtest_logreport(self, report):
            exc, origin = ws_files.pop((report.nodeid, report.when), (None, None))
            rec = {"ev": "test", "id": report.nodeid, "when": report.when, "outcome": report.outcome}
            if hasattr(report, "wasxfail"):
                rec["xfail"] = True
            if exc:
                rec["exc"], rec["origin"] = exc, origin
            send(rec)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_make_collect_report(self, collector):
            outcome = yield
            rep = outcome.get_result()  # its CallInfo is dropped before pytest_collectreport sees the report
            excinfo = getattr(getattr(rep, "call", None), "excinfo", None)
            if rep is not None and excinfo is not None:
                ws_files[(rep.nodeid, "collect")] = (excinfo.type.__name__, _origin(excinfo.tb, ws))

        def pytest_collectreport(self, report):
            exc, origin = ws_files.pop((report.nodeid, "collect"), (None, None))
            rec = {"ev": "collect", "id": report.nodeid, "outcome": report.outcome}
            if exc:
                rec["exc"], rec["origin"] = exc, origin
            send(rec)

        def pytest_collection_finish(self, session):
            send({"ev": "collected", "n": len(session.items)})

        def pytest_keyboard_interrupt(self, excinfo):
            send({"ev": "interrupt", "exc": excinfo.type.__name__, "origin": _origin(excinfo.tb, ws)})

        def pytest_internalerror(self, excrepr, excinfo):
            send({"ev": "internal_error", "exc": excinfo.type.__name__, "origin": _origin(excinfo.tb, ws)})

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus):
            send({"ev": "finish", "exitstatus": int(exitstatus), "tamper": changed()})

    watched = [
        ("os._exit", os, "_exit"), ("os.write", os, "write"), ("sys.exit", sys, "exit"),
        ("_pytest.runner.call_and_report", _runner, "call_and_report"),
        ("_pytest.runner.runtestprotocol", _runner, "runtestprotocol"),
        ("_pytest.runner.CallInfo.from_call", _runner.CallInfo, "from_call"),
        ("_pytest.reports.TestReport", _reports, "TestReport"),
        ("_pytest.reports.TestReport.from_item_and_call", _reports.TestReport, "from_item_and_call"),
        ("_pytest.python.Function.runtest", _py.Function, "runtest"),
        ("_pytest.python.pytest_pyfunc_call", _py, "pytest_pyfunc_call"),
    ] + [(f"runner.Reporter.{n}", Reporter, n) for n in vars(Reporter) if n.startswith("pytest_")]
    before = _guards(watched)

    def changed():
        now = _guards(watched)
        return sorted(k for k in before if now[k] is not before[k])

    _set_path(job)
    args = list(job["args"])
    rc = pytest.main(args, plugins=[Reporter()])
    send({"ev": "end", "how": "done", "rc": int(rc), "tamper": changed()})
    return int(rc)


def run_python(job, send, ws):
    import runpy

    sys.argv = list(job["argv"])
    _set_path(job)
    how, code, exc, origin = "done", 0, None, None
    try:
        if job["kind"] == "module":
            runpy.run_module(job["target"], run_name="__main__", alter_sys=True)
        elif job["kind"] == "code":
            import types

            main_mod = types.ModuleType("__main__")
            sys.modules["__main__"] = main_mod
            exec(compile(job["target"], "<string>", "exec"), main_mod.__dict__)
        else:
            runpy.run_path(job["target"], run_name="__main__")
    except SystemExit as e:
        how, origin = "exit", _origin(e.__traceback__, ws)
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            with contextlib.suppress(BaseException):
                print(e.code, file=sys.stderr)
    except BaseException as e:
        how, code, exc, origin = "error", 1, type(e).__name__, _origin(e.__traceback__, ws)
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exception(e)
    send({"ev": "end", "how": how, "rc": code & 0xFF, "exc": exc, "origin": origin})
    return code & 0xFF


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        main()
