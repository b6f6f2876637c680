"""Kernel judge: runs in the judging fork, never imports candidate code, reports one JSON object.

For each implementation (expert first, then candidate) it starts a worker process and, call by call:
writes fresh random inputs (a new distribution, new values, a new address) into shared memory; sends
`call` and times until the worker answers `done` with its OWN clock (a patched timer in the worker changes
nothing); freezes the worker (SIGSTOP, every thread stopped), so nothing can finish after the call
returned (background threads, lazy or deferred work); reads the output straight from the worker's memory
(/proc/<pid>/mem) and checks it against a float64 reference computed here; checks the inputs are
unchanged, and that the worker has no new threads or child processes; then resumes it. Every timed call
is a verified call, so there is no correctness phase to detect. This process is non-dumpable, so the
worker cannot read the reference values from it.
"""

import contextlib
import ctypes
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time

# torch and the task table are imported in main() once the workers are spawned, so that the three
# interpreters import torch (the slow part of a grade) at the same time
torch = None
tasks = None

SLOTS = 4
ALIGN = 4096


class WorkerDied(Exception):
    pass


def non_dumpable():
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)


def thread_ids(pid):
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def child_pids(pid):
    kids = []
    for tid in thread_ids(pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += f.read().split()
    return kids


def wait_stopped(pid, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in thread_ids(pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return True
        if not states:
            return False
        time.sleep(0.0002)
    return False


class Worker:
    def __init__(self, cfg, mode, shm_path):
        self.cmd_r, self.cmd_w = os.pipe()
        self.res_r, self.res_w = os.pipe()
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": "/tmp",
            "OMP_NUM_THREADS": "1",
            # poison fresh heap memory and keep big blocks on the heap, so an output that is allocated
            # but never written (torch.empty) holds garbage rather than the zero pages of a fresh mmap
            "MALLOC_PERTURB_": "165",
            "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        }
        argv = [
            cfg["python"],
            "-I",
            "/grader/worker.py",
            str(self.cmd_r),
            str(self.res_w),
            shm_path,
            mode,
            cfg["task"],
            cfg["solution_dir"],
            cfg["device"],
        ]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=(self.cmd_r, self.res_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        os.close(self.cmd_r)
        os.close(self.res_w)
        self.mode = mode
        self.buf = b""
        self.mem = None
        self.stopped = False

    def send(self, obj):
        try:
            os.write(self.cmd_w, json.dumps(obj).encode() + b"\n")
        except OSError as e:
            raise WorkerDied(f"worker gone ({e})") from e

    def recv(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout:.1f}s")
            r, _, _ = select.select([self.res_r], [], [], left)
            if r:
                chunk = os.read(self.res_r, 1 << 20)
                if not chunk:
                    raise WorkerDied(f"worker exited (code {self.proc.poll()})")
                self.buf += chunk
                if len(self.buf) > (4 << 20):
                    raise WorkerDied("worker flooded the result pipe")
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError as e:
            raise WorkerDied("unparsable message from worker") from e

    def stop(self):
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = wait_stopped(self.proc.pid)
        return self.stopped

    def cont(self):
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def read_mem(self, addr, n):
        if self.mem is None:
            self.mem = open(f"/proc/{self.proc.pid}/mem", "rb", buffering=0)  # noqa: SIM115
        self.mem.seek(addr)
        data = b""
        while len(data) < n:
            chunk = self.mem.read(n - len(data))
            if not chunk:
                break
            data += chunk
        return data

    def close(self):
        with contextlib.suppress(Exception):
            self.cont()
            self.send({"op": "exit"})
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.cmd_w, self.res_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.mem is not None:
            self.mem.close()


class Session:
    """One implementation under test: its worker, its report, its per-call checks."""

    def __init__(self, cfg, w, task, shm, rng):
        self.cfg, self.w, self.task, self.shm, self.rng = cfg, w, task, shm, rng
        self.rep = {"mode": w.mode, "times_s": [], "violations": [], "ops": [], "calls": 0}
        self.viol = self.rep["violations"]
        self.refs = []  # recent references: a wrong output equal to an earlier one is a cached result
        self.first = None  # (inputs, scalars, output) of the first call, replayed once for determinism
        self.last_slot = -1
        self.last_off = None
        self.base_threads = 0

    @property
    def alive(self):
        return not self.viol

    def guard(self, fn, *args):
        try:
            fn(*args)
        except WorkerDied as e:
            self.viol.append(["runner_died", str(e)])
        except TimeoutError as e:
            self.viol.append(["timeout", str(e)])

    def start(self):
        self.w.recv(self.cfg["start_timeout_s"])
        self.base_threads = len(thread_ids(self.w.proc.pid))
        self.w.send({"op": "load", "shm_bytes": self.shm.numel()})
        msg = self.w.recv(self.cfg["call_timeout_s"])
        if "error" in msg:
            self.viol.append(["load_error", msg["error"]])

    def place(self, ins, same_address=False):
        if same_address and self.last_off is not None:
            off = self.last_off
        else:
            slot = self.rng.choice([s for s in range(SLOTS) if s != self.last_slot])
            self.last_slot = slot
            off = self.cfg["slot_bytes"] * slot + 64 * self.rng.randrange(0, 63)
        self.last_off = off
        specs = []
        for t in ins:
            n = t.numel() * t.element_size()
            self.shm[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            specs.append(
                {
                    "offset": off,
                    "nbytes": n,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "pad": self.rng.randrange(1, 1 << 20),
                }
            )
            off += (n + 63) // 64 * 64
        return specs

    def call(self, ins, scalars, ref, timed, kind):
        w, viol = self.w, self.viol
        specs = self.place(ins, same_address=kind == "same_address")
        w.send({"op": "call", "inputs": specs, "scalars": scalars})
        msg = w.recv(self.cfg["call_timeout_s"])  # {"staged"} once the inputs sit on the device
        t0 = time.perf_counter()
        if msg.get("staged"):
            # the clock covers the call alone (plus one pipe round trip), not the worker's host-to-device copies,
            # so that on CUDA it bounds the worker's event time from above with little slack
            w.send({"op": "go"})
            msg = w.recv(self.cfg["call_timeout_s"])
        elapsed = time.perf_counter() - t0
        if not w.stop():
            raise WorkerDied("worker could not be frozen after the call")
        self.rep["calls"] += 1
        if "error" in msg:
            viol.append(["error", msg["error"]])
            return
        meta = msg.get("meta", {})
        out = check_output(w, meta, self.task, ref, viol, self.cfg)
        if out is not None:
            bad = output_errors(out, ref, self.task)
            if bad:
                for prev in self.refs:
                    if output_errors(out, prev, self.task) is None:
                        viol.append(
                            [
                                "cached_output",
                                "returned the result of an earlier call (caching across calls / graph replay)",
                            ]
                        )
                        break
                else:
                    viol.append(bad)
            if kind == "repeat" and self.first is not None and not torch.equal(out, self.first[2]):
                viol.append(["nondeterministic", "the same input gave a different output"])
            if self.first is None:
                self.first = (ins, scalars, out.clone())
        for t, spec in zip(ins, specs):
            now = self.shm[spec["offset"] : spec["offset"] + spec["nbytes"]]
            if not torch.equal(now, t.contiguous().view(-1).view(torch.uint8)):
                viol.append(["input_mutated", "an input was written in place"])
                break
        n_threads = len(thread_ids(w.proc.pid))
        if n_threads > self.base_threads:
            viol.append(["thread_injection", f"{n_threads} threads after the call, {self.base_threads} before"])
        if child_pids(w.proc.pid):
            viol.append(["process_injection", "the implementation started child processes"])
        if meta.get("torch_threads", 1) != 1:
            viol.append(["thread_injection", f"torch intra-op threads set to {meta.get('torch_threads')}"])
        if meta.get("tampered"):
            viol.append(["timer_patch", "replaced " + ", ".join(meta["tampered"])])
        if "event_ms" in meta:
            self.rep.setdefault("event_s", []).append(meta["event_ms"] * 1e-3)
            self.rep.setdefault("clock_s", []).append(elapsed)
        self.refs = [ref, *self.refs][:6]
        w.cont()
        if timed:
            # CUDA: the worker's CUDA events (whole-device sync inside them), trusted only because they are
            # cross-checked against this process's clock above; CPU: this process's clock
            self.rep["times_s"].append(meta["event_ms"] * 1e-3 if "event_ms" in meta else elapsed)

    def check_clock(self):
        """CUDA: the worker's event times against this process's clock, compared by their medians, so that one
        call the OS delayed on a busy machine cannot flag an honest implementation; a patched timer that
        under-reports shows on every call."""
        ev, clock = self.rep.get("event_s"), self.rep.get("clock_s")
        if ev and clock and statistics.median(ev) < 0.5 * statistics.median(clock) - 2e-4:
            self.viol.append(["timer_patch", "CUDA events disagree with the judge's clock"])

    def profile(self, ins, scalars):
        specs = self.place(ins)
        self.w.send({"op": "profile", "inputs": specs, "scalars": scalars})
        msg = self.w.recv(self.cfg["call_timeout_s"] * 3)
        self.rep["ops"] = msg.get("ops", [])


def run_all(cfg, workers, task, shm, seed):
    """Expert and candidate are driven call by call, in alternating order, on the same fresh inputs:
    load drift on a shared machine hits both alike."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(task["shape"])
    sessions = [Session(cfg, w, task, shm, random.Random(rng.random())) for w in workers]
    for s in sessions:
        s.guard(s.start)
    dists = list(task["distributions"])
    plan = [(d, False) for d in dists] + [(rng.choice(dists), True) for _ in range(cfg["n_timed"])]
    plan.insert(len(dists) + cfg["n_timed"] // 2, ("repeat", True))  # determinism check, mid-run
    # new values at the previous call's exact address: a cache keyed on pointers (or a replayed CUDA
    # graph) returns the old result here
    plan.insert(len(dists) + cfg["n_timed"] // 3, ("same_address", True))
    for dist, timed in plan:
        live = [s for s in sessions if s.alive]
        if not live:
            break
        rng.shuffle(live)
        for s in live:
            if dist == "repeat":
                if s.first is None:
                    continue
                ins, scalars, _ = s.first
            else:
                ins, scalars = task["inputs"](gen, rng.choice(dists) if dist == "same_address" else dist, shape, "cpu")
            ref = task["reference"](*ins, **scalars)
            s.guard(s.call, ins, scalars, ref, timed, dist)
    for s in sessions:
        if s.alive:
            s.check_clock()
    # one profiled call each: forbidden library ops show up as aten ops even when reached indirectly
    for s in sessions:
        if s.alive and s.w.mode == "candidate":
            ins, scalars = task["inputs"](gen, dists[0], shape, "cpu")
            s.guard(s.profile, ins, scalars)
        s.w.close()
    return {s.w.mode: s.rep for s in sessions}


def check_output(w, meta, task, ref, viol, cfg):
    """Strict layout checks, then the output bytes read from the frozen worker (CPU) or copied (CUDA)."""
    if not meta.get("exact_type", False):
        viol.append(["tensor_subclass", f"returned {meta.get('type')}, not exactly torch.Tensor"])
        return None
    want_dtype = str(task["out_dtype"]).removeprefix("torch.")
    if meta.get("dtype") != want_dtype:
        code = "precision_reduction" if meta.get("dtype") in ("float16", "bfloat16") else "dtype"
        viol.append([code, f"output dtype {meta.get('dtype')}, want {want_dtype}"])
        return None
    if tuple(meta.get("shape", ())) != tuple(ref.shape):
        viol.append(["shape", f"output shape {meta.get('shape')}, want {list(ref.shape)}"])
        return None
    contiguous = list(torch.empty(ref.shape).stride())
    if meta.get("strides") != contiguous:
        viol.append(["strides", f"output strides {meta.get('strides')}, want contiguous {contiguous}"])
        return None
    n = ref.numel() * 4
    if meta.get("nbytes") != n:
        viol.append(["shape", "output size mismatch"])
        return None
    if cfg["device"].startswith("cuda"):
        w.cont()
        w.send({"op": "copy_out", "offset": cfg["out_offset"], "nbytes": n})
        w.recv(cfg["call_timeout_s"])
        w.stop()
        data = bytes(cfg["shm"][cfg["out_offset"] : cfg["out_offset"] + n].numpy())
    else:
        data = w.read_mem(meta["ptr"], n)
    if len(data) != n:
        viol.append(["bad_pointer", "output memory could not be read"])
        return None
    return torch.frombuffer(bytearray(data), dtype=task["out_dtype"]).view(ref.shape)


def reduced_dtype(out):
    """The half-precision dtype every nonzero output value is exactly representable in, or None. A float32 result
    has 23 mantissa bits, so a value computed in float32 lands on the bfloat16 (or float16) grid about once in
    2^16 (2^13); a result computed in half precision and widened at the end lands on it every time, however far
    its rounding errors carried it from the reference."""
    o = out[out != 0]
    if o.dtype != torch.float32 or o.unique().numel() < 64:  # a constant (1/n, 0.5) is on every grid: no evidence
        return None
    for dt in (torch.bfloat16, torch.float16):
        if torch.equal(o.to(dt).to(torch.float32), o):
            return str(dt).removeprefix("torch.")
    return None


def output_errors(out, ref, task):
    o = out.double()
    if not torch.isfinite(o).all():
        return ["wrong_output", "non-finite values in the output"]
    err = (o - ref).abs()
    tol = task["atol"] + task["rtol"] * ref.abs()
    if bool((err <= tol).all()):
        return None
    worst = float(err.max())
    scale = float(ref.abs().max()) or 1.0
    dt = reduced_dtype(out)
    if dt is not None:  # however large the error: half-precision arithmetic widened to float32 at the end
        return ["precision_reduction", f"max error {worst:.2e}; every output value is a {dt} value"]
    if worst / scale < 2e-2:  # close, but outside float32 rounding: computed at reduced precision
        return ["precision_reduction", f"max error {worst:.2e} exceeds the float32 tolerance"]
    return ["wrong_output", f"max error {worst:.2e} against the float64 reference"]


def copy_time(n_bytes, device):
    """Speed-of-light probe: time to copy the same number of bytes once on the task's device (median of
    15). On CUDA the judge uses the device itself; it never runs candidate code, so its GPU use is trusted."""
    src = torch.empty(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    src.normal_()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)
    ts = []
    for _ in range(15):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main():
    global torch, tasks
    non_dumpable()
    cfg = json.loads(sys.stdin.buffer.read())
    shm_path = f"/tmp/kernel-shm-{os.getpid()}-{random.getrandbits(32):08x}"
    workers = [Worker(cfg, mode, shm_path) for mode in ("expert", "candidate")]
    import torch

    sys.path.insert(0, "/grader")
    import tasks

    torch.set_num_threads(1)
    task = tasks.TASKS[cfg["task"]]
    gen = torch.Generator().manual_seed(0)
    probe, _ = task["inputs"](gen, task["distributions"][0], tuple(task["shape"]), "cpu")
    in_bytes = sum(t.numel() * t.element_size() + 64 for t in probe)
    slot_bytes = (in_bytes + 64 * 64 + ALIGN - 1) // ALIGN * ALIGN
    out_bytes = probe[0].numel() * 8
    shm_bytes = slot_bytes * SLOTS + out_bytes
    with open(shm_path, "wb") as f:
        f.truncate(shm_bytes)
    shm = torch.from_file(shm_path, shared=True, size=shm_bytes, dtype=torch.uint8)
    cfg.update(slot_bytes=slot_bytes, out_offset=slot_bytes * SLOTS, shm=shm)
    seed = int.from_bytes(os.urandom(4), "little")
    result = {
        "copy_s": copy_time(in_bytes, cfg["device"]),
        "bytes_moved": tasks.bytes_moved(task, probe, probe[0].numel()),
    }
    result.update(run_all(cfg, workers, task, shm, seed))
    os.unlink(shm_path)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
