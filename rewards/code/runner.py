"""The code grader's test runner. It is copied, pristine, into the judging fork at grading time and run as
`python3 -I -S runner.py` (no site, no user site, no environment: `sitecustomize`, `usercustomize` and
`.pth` files are never processed). It reads its cases on stdin and never sees expected values: it only
reports what the solution returned, as strictly typed JSON, and the grader compares outside the sandbox.

In the first pass each case runs in a freshly forked child that has not imported the solution yet (no
state carries over between cases), in random order; in the second pass one fresh child runs every case in
another random order (state carried from call to call shows as a difference between passes); each call is
made twice in its process (call-count dependence). The child's stdout/stderr point at
/dev/null and every other descriptor is closed, so the solution cannot write to the result stream; the
runner is non-dumpable, so the solution (without capabilities) cannot open it through /proc either.
The result stream ends with a count line; a killed or tampered runner leaves the stream short.
"""

import ctypes
import importlib
import json
import os
import select
import sys
import time

STRICT_TYPES = (bool, int, float, str, type(None), list, tuple, dict, set, frozenset, bytes)
MAX_RESULT = 1 << 20


class UntrustedType(Exception):
    pass


def encode(v, depth=0):
    """Exact-type tagged JSON: `True` is not `1`, a tuple is not a list, and an object of any other class
    (one overriding `__eq__`, a str subclass) is refused rather than compared."""
    if depth > 50:
        raise UntrustedType("nesting deeper than 50")
    t = type(v)
    if t not in STRICT_TYPES:
        raise UntrustedType(f"{t.__module__}.{t.__qualname__}")
    if t is float:
        return {"float": repr(v)}
    if t is bytes:
        return {"bytes": v.hex()}
    if t in (list, tuple):
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t in (set, frozenset):
        items = [encode(x, depth + 1) for x in v]
        return {t.__name__: sorted(items, key=lambda x: json.dumps(x, sort_keys=True))}
    if t is dict:
        items = [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]
        return {"dict": sorted(items, key=lambda x: json.dumps(x[0], sort_keys=True))}
    return {t.__name__: v}


def _non_dumpable():
    try:  # noqa: SIM105 - contextlib costs 3 ms of start-up per grade
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


def _watch_list():
    """Functions a solution has no business replacing; identity is checked after the calls."""
    import builtins

    main = sys.modules["__main__"]
    return {
        "time.time": (time, "time"),
        "time.monotonic": (time, "monotonic"),
        "time.perf_counter": (time, "perf_counter"),
        "time.sleep": (time, "sleep"),
        "sys.exit": (sys, "exit"),
        "os._exit": (os, "_exit"),
        "json.dumps": (json, "dumps"),
        "builtins.isinstance": (builtins, "isinstance"),
        "builtins.type": (builtins, "type"),
        "runner.encode": (main, "encode"),
        "runner.run_cases": (main, "run_cases"),
        "runner.eval_case": (main, "eval_case"),
    }


def run_cases(cases, module_name, fd):
    """Child side: import once, then per case call twice, encode, write one JSON line to `fd`."""
    write, _exit, dumps = os.write, os._exit, json.dumps
    encode_fn = encode

    def send(obj):
        data = dumps(obj).encode()
        if len(data) > MAX_RESULT:
            data = dumps({"status": "too_large", "bytes": len(data)}).encode()
        write(fd, data + b"\n")

    watch = _watch_list()
    before = {k: getattr(m, a) for k, (m, a) in watch.items()}
    try:
        mod = importlib.import_module(module_name)
    except BaseException as e:  # anything at import time is a collection error
        kind = "skipped" if _is_skip(e) else "exit" if isinstance(e, SystemExit) else "collection_error"
        for _ in cases:
            send({"status": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        _exit(0)
    for case in cases:
        send(eval_case(case, mod, watch, before, encode_fn))
    _exit(0)


def eval_case(case, mod, watch, before, encode_fn):
    values = []
    try:
        for _ in range(2):
            if case.get("script"):
                ns = {"solution": mod, "args": _fresh(case.get("args", []))}
                exec(case["script"], ns)  # grader-owned snippet, not model text
                values.append(ns.get("result"))
            else:
                fn = getattr(mod, case["call"])
                values.append(fn(*_fresh(case.get("args", []))))
    except BaseException as e:
        kind = "skipped" if _is_skip(e) else "exit" if isinstance(e, SystemExit) else "error"
        return {"status": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    tampered = sorted(k for k, (m, a) in watch.items() if getattr(m, a, None) is not before[k])
    try:
        enc = [encode_fn(v) for v in values]
    except UntrustedType as e:
        return {"status": "untrusted_type", "error": str(e), "tampered": tampered}
    except BaseException as e:  # a hostile __repr__/__iter__ ends up here
        return {
            "status": "untrusted_type",
            "error": f"{type(e).__name__}: {str(e)[:200]}",
            "tampered": tampered,
        }
    return {"status": "ok", "value": enc[0], "repeat_same": enc[0] == enc[1], "tampered": tampered}


def _fresh(args):
    """A private copy of the call's arguments (they are JSON, so a JSON round trip is a deep copy)."""
    return json.loads(json.dumps(args))


def _shuffled(items):
    """Fisher-Yates with os.urandom (no `random` import: every millisecond of start-up is per grade)."""
    out = list(items)
    for i in range(len(out) - 1, 0, -1):
        j = int.from_bytes(os.urandom(4), "little") % (i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def _is_skip(e):
    names = [c.__name__.lower() for c in type(e).__mro__]
    return any("skip" in n or "xfail" in n for n in names)


def main():
    _non_dumpable()
    cfg = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    sys.path.insert(0, cfg["judge_dir"])
    os.chdir(cfg["judge_dir"])
    cases = cfg["cases"]

    out = sys.stdout.buffer
    n = 0
    gave_up = False
    for pass_no in range(cfg.get("passes", 2)):
        order = _shuffled(cases)
        # pass 0: a fresh process per case; later passes: one process for all cases in another random
        # order, so state carried from call to call (counters, caches, files) shows as a difference
        groups = [[c] for c in order] if pass_no == 0 else [order]
        for group in groups:
            if gave_up:  # after a timeout the grade is 0 anyway: do not spend the limit on every case
                results = [{"status": "not_run"} for _ in group]
            else:
                results = run_group(group, cfg)
                gave_up = any(r["status"] == "timeout" for r in results)
            for case, res in zip(group, results):
                out.write(json.dumps({"id": case["id"], "pass": pass_no, **res}).encode() + b"\n")
                n += 1
            out.flush()
    out.write(json.dumps({"end": True, "count": n}).encode() + b"\n")
    out.flush()


def run_group(group, cfg):
    """Fork a child that has not imported the solution, let it run `group`, read one line per case; a
    case that does not answer within the per-case limit ends the group."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, w)
        os.closerange(w + 1, 1 << 16)
        try:
            run_cases(group, cfg["module"], w)
        finally:
            os._exit(3)
    os.close(w)
    results = []
    buf = b""
    eof = False
    timed_out = False
    deadline = time.monotonic() + cfg["timeout_s"]
    while len(results) < len(group) and not eof:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                eof = True
                break
            buf += chunk
            if len(buf) > 2 * MAX_RESULT:
                eof = True
                break
        if timed_out:
            break
        while b"\n" in buf and len(results) < len(group):
            line, buf = buf.split(b"\n", 1)
            try:
                results.append(json.loads(line))
            except ValueError:
                results.append({"status": "protocol", "error": "unparsable result line"})
            deadline = time.monotonic() + cfg["timeout_s"]
    os.close(r)
    if timed_out or len(results) < len(group):
        try:  # noqa: SIM105 - as above
            os.kill(pid, 9)  # SIGKILL (the signal module is not imported: start-up time is per grade)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    if len(results) < len(group):
        missing = (
            {"status": "timeout"} if timed_out else {"status": "no_result", "exit": os.waitstatus_to_exitcode(status)}
        )
        results.append(missing)
        results += [{"status": "not_run"} for _ in range(len(group) - len(results))]
    return results


if __name__ == "__main__":
    main()
