"""Where graders run untrusted code: a small execution interface with two implementations.

* `BwrapWorkspace`: a host directory mounted at `/workspace` inside a bubblewrap sandbox (all namespaces
  unshared, so no network; system dirs read-only; capabilities dropped), with cgroup-v1 memory and pids
  limits in a sub-tree this module creates and removes, rlimits, a wall timeout and an output cap. Tests use
  it so they do not depend on the sandbox server.
* `E2BWorkspace`: the same interface over the `e2b` SDK, for the sandbox server (envs/sandbox). Thin on
  purpose: the server owns isolation; this only maps calls and re-applies the limits with shell builtins.

Graders judge in a *fork* of the trajectory's workspace (`fork()`), so grading never touches the original.

What the bwrap sandbox does not protect against: kernel exploits (it shares the host kernel), CPU time
beyond the wall timeout (no cpu quota), and disk use beyond `RLIMIT_FSIZE` per file. With `Limits(gpu=True)`
the sandbox shares the host's GPUs through their device nodes (the driver's isolation is all there is) and, where
no memory cgroup can be made, runs with no memory limit at all.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rewards.base import Grade

WORKDIR = "/workspace"
MiB = 1 << 20


@dataclass
class ExecResult:
    exit_code: int  # negative: killed by that signal (subprocess convention)
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False  # output went past the cap and was cut
    wall_s: float = 0.0


@dataclass
class Limits:
    timeout_s: float = 30.0
    memory_mb: int = 1024
    pids: int = 256
    max_output_bytes: int = 4 * MiB
    max_file_bytes: int = 256 * MiB  # RLIMIT_FSIZE: one file written by the command
    nofile: int = 1024
    # bind the host's NVIDIA device nodes (/dev/nvidia*) into the sandbox, for graders that time CUDA kernels;
    # the address-space fallback (no memory cgroup) is then skipped, since CUDA reserves far more virtual
    # memory than any such limit allows
    gpu: bool = False


@dataclass
class FileEntry:
    path: str  # relative to the workspace root, '/'-separated
    kind: str  # "file", "dir", "symlink" or "other"
    size: int = 0


class Workspace(Protocol):
    """A sandboxed file tree plus command execution. Paths are relative to the workspace root;
    `sandbox_root` is where that root is seen from inside the sandbox (for paths given to commands)."""

    sandbox_root: str

    def write_file(self, path: str, data: bytes | str) -> None: ...

    def read_file(self, path: str, max_bytes: int = 16 * MiB) -> bytes: ...

    def list_files(self, path: str = "") -> list[FileEntry]: ...

    def remove(self, path: str) -> None: ...

    def mount_readonly(self, host_path: str | Path, sandbox_path: str) -> None: ...

    def exec(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        cwd: str = WORKDIR,
    ) -> ExecResult: ...

    def fork(self) -> Workspace: ...

    def close(self) -> None: ...


class SandboxProvider(Protocol):
    """Resolves a trajectory's `sandbox_id` to a workspace."""

    def open(self, sandbox_id: str) -> Workspace: ...


def grade_in_fork(sandboxes: SandboxProvider, sandbox_id: str, judge: Callable[[Workspace], Grade]) -> Grade:
    """``judge`` run in a fork of the trajectory's sandbox, closed afterwards: what a grader writes (restored tests,
    its harness, build outputs) never lands in the sandbox the policy left, which stays as it was for a later look.
    An id that does not resolve is a failed grade (``no_sandbox: ...``), not an exception."""
    try:
        original = sandboxes.open(sandbox_id)
    except (KeyError, TypeError, ValueError) as e:
        return Grade.fail(f"no_sandbox: {e}")
    fork = original.fork()
    try:
        return judge(fork)
    finally:
        fork.close()


# ----------------------------------------------------------------------------------------------- cgroups

_CG_ROOT = Path("/sys/fs/cgroup")
_cg_counter = itertools.count()


def _own_cgroup_dir(controller: str) -> Path | None:
    """The v1 hierarchy dir this process sits in for `controller` (we nest under it, so the machine's own
    limits still apply to everything we start)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                d = _CG_ROOT / controller / path.lstrip("/")
                return d if d.is_dir() else None
    except OSError:
        return None
    return None


class _Cgroup:
    """One leaf cgroup per exec under `<own cgroup>/rlk3-graders-<pid>/`, in the v1 memory and pids
    hierarchies. We create every directory we write to and remove it afterwards; nothing else is touched."""

    def __init__(self, memory_bytes: int, pids: int):
        self.dirs: dict[str, Path] = {}
        leaf = f"x{os.getpid()}-{next(_cg_counter)}-{uuid.uuid4().hex[:6]}"
        for ctrl in ("memory", "pids"):
            base = _own_cgroup_dir(ctrl)
            if base is None:
                continue
            try:
                parent = base / f"rlk3-graders-{os.getpid()}"
                parent.mkdir(exist_ok=True)
                d = parent / leaf
                d.mkdir()
            except OSError:
                continue
            try:
                if ctrl == "memory":
                    (d / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    with contextlib.suppress(OSError):  # present only with swap accounting
                        (d / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                else:
                    (d / "pids.max").write_text(str(pids))
            except OSError:
                with contextlib.suppress(OSError):
                    d.rmdir()
                continue
            self.dirs[ctrl] = d

    @property
    def limits_memory(self) -> bool:
        return "memory" in self.dirs

    def task_files(self) -> list[str]:
        return [str(d / "tasks") for d in self.dirs.values()]

    def oom_killed(self) -> bool:
        d = self.dirs.get("memory")
        if d is None:
            return False
        try:
            for line in (d / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill ") and int(line.split()[1]) > 0:
                    return True
        except OSError:
            pass
        return False

    def kill_all(self) -> None:
        for d in self.dirs.values():
            for _ in range(50):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for p in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p, signal.SIGKILL)
                time.sleep(0.01)

    def destroy(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)  # the last killed process is still being reaped
            with contextlib.suppress(OSError):
                d.parent.rmdir()  # fails harmlessly while another exec of ours still uses it


# ------------------------------------------------------------------------------------------ local bwrap


def _safe_rel(path: str) -> str:
    p = Path(path.lstrip("/"))
    if path.startswith("/"):
        # absolute paths address the sandbox: only those under WORKDIR map to the host tree
        rel = Path(path).relative_to(WORKDIR) if path.startswith(WORKDIR) else None
        if rel is None:
            raise ValueError(f"path {path!r} is outside {WORKDIR}")
        p = rel
    if any(part == ".." for part in p.parts):
        raise ValueError(f"path {path!r} escapes the workspace")
    return p.as_posix() if p.parts else ""


def _host_path(root: Path, path: str, *, create_parents: bool = False) -> Path:
    """Map a workspace path to the host without following any symlink the policy planted (a link
    `tests -> /etc` must not turn a grader's write into a host write)."""
    rel = _safe_rel(path)
    cur = root
    parts = Path(rel).parts
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            if create_parents and i < len(parts) - 1:
                cur.mkdir()
                continue
            if i == len(parts) - 1:
                return cur
            raise
        if stat.S_ISLNK(st.st_mode):
            raise PermissionError(f"refusing to follow symlink {rel!r} in a workspace")
    return cur


def _system_binds() -> list[str]:
    """Read-only system tree: /usr (Debian 12 is merged-/usr) and /etc."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = f"/{link}"
        if os.path.islink(target):
            args += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            args += ["--ro-bind", target, target]
    args += ["--ro-bind", "/etc", "/etc"]
    return args


def _interpreter_binds() -> list[str]:
    """The interpreter prefixes, bound after the sandbox's own /tmp so that a checkout under /tmp (CI's
    fresh clone) is not hidden by it."""
    args = []
    for real in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}):
        if not real.startswith("/usr") and os.path.isdir(real):
            args += ["--ro-bind", real, real]
    return args


def _gpu_binds(dev: str = "/dev") -> list[str]:
    """The NVIDIA device nodes (nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/) bound read-write over the
    sandbox's minimal /dev: `--dev` alone leaves CUDA with no device."""
    args = []
    for p in sorted(Path(dev).glob("nvidia*")):
        args += ["--dev-bind", str(p), f"/dev/{p.name}"]
    return args


def bwrap_available() -> bool:
    return shutil.which("bwrap") is not None


class BwrapWorkspace:
    """A workspace directory on the host, executed in through bubblewrap."""

    sandbox_root = WORKDIR

    def __init__(self, root: str | Path, *, owned: bool = False):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._owned = owned  # forks own their directory and delete it on close
        self._mounts: list[tuple[str, str]] = []

    # -- files ------------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str) -> None:
        hp = _host_path(self.root, path, create_parents=True)
        if isinstance(data, str):
            data = data.encode()
        hp.write_bytes(data)

    def read_file(self, path: str, max_bytes: int = 16 * MiB) -> bytes:
        hp = _host_path(self.root, path)
        fd = os.open(hp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(f"{path!r} is not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(min(max_bytes, st.st_size + 1))
        finally:
            os.close(fd)

    def list_files(self, path: str = "") -> list[FileEntry]:
        base = _host_path(self.root, path) if path else self.root
        out: list[FileEntry] = []
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            for name in sorted(dirnames + filenames):
                full = Path(dirpath) / name
                rel = full.relative_to(self.root).as_posix()
                st = os.lstat(full)
                if stat.S_ISLNK(st.st_mode):
                    kind = "symlink"
                elif stat.S_ISDIR(st.st_mode):
                    kind = "dir"
                elif stat.S_ISREG(st.st_mode):
                    kind = "file"
                else:
                    kind = "other"
                out.append(FileEntry(rel, kind, st.st_size if kind == "file" else 0))
        return sorted(out, key=lambda e: e.path)

    def remove(self, path: str) -> None:
        hp = _host_path(self.root, path)
        if hp.is_dir() and not hp.is_symlink():
            shutil.rmtree(hp)
        elif os.path.lexists(hp):
            hp.unlink()

    def mount_readonly(self, host_path: str | Path, sandbox_path: str) -> None:
        self._mounts.append((str(Path(host_path).resolve()), sandbox_path))

    # -- execution -------------------------------------------------------------------------------
    def exec(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        cwd: str = WORKDIR,
    ) -> ExecResult:
        lim = limits or Limits()
        cmd = [
            "bwrap",
            "--unshare-all",  # user, ipc, pid, net, uts, cgroup: no network at all
            "--die-with-parent",
            "--new-session",  # no TIOCSTI into the grader's terminal
            "--cap-drop",
            "ALL",
            *_system_binds(),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            *(_gpu_binds() if lim.gpu else []),
            "--tmpfs",
            "/tmp",
            *_interpreter_binds(),
            "--bind",
            str(self.root),
            WORKDIR,
        ]
        for host, inside in self._mounts:
            cmd += ["--ro-bind", host, inside]
        cmd += ["--chdir", cwd, "--hostname", "sandbox", "--", *argv]
        full_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        full_env.update(env or {})
        cg = _Cgroup(lim.memory_mb * MiB, lim.pids)
        task_files = cg.task_files()
        use_as_limit = not cg.limits_memory and not lim.gpu

        def preexec() -> None:  # runs in the child between fork and exec
            pid = str(os.getpid())
            for tf in task_files:
                with open(tf, "w") as f:
                    f.write(pid)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_bytes, lim.max_file_bytes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (lim.nofile, lim.nofile))
            if use_as_limit:  # no memory cgroup here: address-space limit is the fallback
                mem = lim.memory_mb * MiB * 4  # virtual >> resident for runtimes like torch
                resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
                preexec_fn=preexec,
                start_new_session=True,
            )
        except BaseException:
            cg.destroy()
            raise
        try:
            out, err, truncated, timed_out = _communicate(proc, stdin, lim)
            code = proc.wait()
            oom = cg.oom_killed()
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            cg.destroy()
        return ExecResult(code, out, err, timed_out, oom, truncated, time.monotonic() - t0)

    # -- lifecycle -------------------------------------------------------------------------------
    def fork(self) -> BwrapWorkspace:
        dst = Path(tempfile.mkdtemp(prefix="rlk3-fork-"))
        shutil.copytree(self.root, dst, symlinks=True, dirs_exist_ok=True)
        return BwrapWorkspace(dst, owned=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> BwrapWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _communicate(proc: subprocess.Popen, stdin: bytes | None, lim: Limits):
    """Read stdout/stderr up to the cap (then keep draining so the child never blocks), feed stdin from a
    thread, and kill the whole session at the wall deadline."""
    if stdin is not None:

        def feed() -> None:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.write(stdin)
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.close()

        threading.Thread(target=feed, daemon=True).start()
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    deadline = time.monotonic() + lim.timeout_s
    truncated = timed_out = False
    open_count = 2
    while open_count:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fileobj)
                open_count -= 1
                continue
            buf = bufs[key.fileobj]
            room = lim.max_output_bytes - len(buf)
            if len(chunk) > room:
                truncated = True
            if room > 0:
                buf += chunk[:room]
    sel.close()
    if timed_out:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), truncated, timed_out


class LocalSandboxes:
    """A `SandboxProvider` over host directories: `create()` makes a workspace, `open(id)` returns it."""

    def __init__(self, base: str | Path | None = None):
        self._base = Path(base) if base else None  # a temporary directory is made on first create()

    @property
    def base(self) -> Path:
        if self._base is None:
            self._base = Path(tempfile.mkdtemp(prefix="rlk3-sandboxes-"))
        self._base.mkdir(parents=True, exist_ok=True)
        return self._base

    def create(self, files: dict[str, bytes | str] | None = None) -> str:
        sid = uuid.uuid4().hex[:12]
        ws = BwrapWorkspace(self.base / sid)
        for path, data in (files or {}).items():
            ws.write_file(path, data)
        return sid

    def open(self, sandbox_id: str) -> BwrapWorkspace:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise KeyError(f"bad sandbox id {sandbox_id!r}")
        path = self.base / sandbox_id
        if not path.is_dir():
            raise KeyError(f"no sandbox {sandbox_id!r} under {self.base}")
        return BwrapWorkspace(path)


# ------------------------------------------------------------------------------------------------ e2b


@dataclass
class E2BConfig:
    """How to reach an E2B-compatible server. Defaults point at a local envs/sandbox server: the SDK's
    `E2B_API_URL`/`E2B_SANDBOX_URL` overrides route every sandbox through one envd port."""

    api_url: str = "http://localhost:3000"
    sandbox_url: str = "http://localhost:49983"
    api_key: str = "e2b_local"
    workdir: str = "/home/user/workspace"
    request_timeout_s: float = 60.0
    user: str = "user"  # untrusted commands run as this sandbox user; grader assets are written as root

    def sdk_opts(self) -> dict:
        return {
            "api_key": self.api_key,
            "api_url": self.api_url,
            "sandbox_url": self.sandbox_url,
            "request_timeout": self.request_timeout_s,
        }


class E2BWorkspace:
    """The `Workspace` interface over an `e2b.Sandbox`. Time, process and file limits are re-applied
    inside the sandbox with `timeout` and `ulimit`; memory is the server's own cgroup limit; output is
    capped here."""

    def __init__(self, sandbox, config: E2BConfig, *, owned: bool = False):
        self.sbx = sandbox
        self.cfg = config
        self._owned = owned
        self.sandbox_root = config.workdir

    @classmethod
    def connect(cls, sandbox_id: str, config: E2BConfig | None = None) -> E2BWorkspace:
        from e2b import Sandbox  # the SDK is only needed when this backend is used

        cfg = config or E2BConfig()
        sbx = Sandbox.connect(sandbox_id, **cfg.sdk_opts())
        return cls(sbx, cfg)

    def _abs(self, path: str) -> str:
        if path.startswith(self.cfg.workdir + "/"):
            path = path[len(self.cfg.workdir) + 1 :]
        rel = _safe_rel(path)
        return f"{self.cfg.workdir}/{rel}" if rel else self.cfg.workdir

    def write_file(self, path: str, data: bytes | str) -> None:
        self.sbx.files.write(self._abs(path), data)

    def read_file(self, path: str, max_bytes: int = 16 * MiB) -> bytes:
        data = self.sbx.files.read(self._abs(path), format="bytes")
        return bytes(data[:max_bytes])

    def list_files(self, path: str = "") -> list[FileEntry]:
        root = self.cfg.workdir.rstrip("/") + "/"
        out = []
        for e in self.sbx.files.list(self._abs(path), depth=64):
            kind = {"file": "file", "dir": "dir"}.get(str(getattr(e.type, "value", e.type)), "other")
            if getattr(e, "symlink_target", None) or getattr(e, "is_symlink", False):
                kind = "symlink"
            out.append(FileEntry(e.path.removeprefix(root), kind, int(getattr(e, "size", 0) or 0)))
        return sorted(out, key=lambda x: x.path)

    def remove(self, path: str) -> None:
        self.sbx.files.remove(self._abs(path))

    def mount_readonly(self, host_path: str | Path, sandbox_path: str) -> None:
        # no bind mounts across machines: upload the tree as the sandbox's root, then make it read-only
        # for everyone else (untrusted commands run as `cfg.user`)
        host = Path(host_path)
        files = [host] if host.is_file() else [p for p in host.rglob("*") if p.is_file()]
        executables = []
        for f in files:
            rel = "" if f == host else f.relative_to(host).as_posix()
            dest = f"{sandbox_path}/{rel}".rstrip("/")
            self.sbx.files.write(dest, f.read_bytes(), user="root")
            if os.access(f, os.X_OK):  # uploads carry no mode bits: restore the executable ones
                executables.append(dest)
        cmd = f"chown -R root:root {_shq(sandbox_path)} && chmod -R a+rX,go-w {_shq(sandbox_path)}"
        if executables:
            self.sbx.files.write("/tmp/.rlk3-exec-list", "\n".join(executables), user="root")
            cmd += " && xargs -d '\\n' chmod a+x < /tmp/.rlk3-exec-list && rm -f /tmp/.rlk3-exec-list"
        self.sbx.commands.run(cmd, user="root", timeout=120)

    def exec(self, argv, *, stdin=None, limits=None, env=None, cwd=WORKDIR) -> ExecResult:
        lim = limits or Limits()
        cwd_abs = self._abs(cwd) if cwd.startswith((WORKDIR, self.cfg.workdir)) else cwd
        redirect = ""
        if stdin is not None:
            tmp = f"/tmp/.stdin-{uuid.uuid4().hex}"
            self.sbx.files.write(tmp, stdin)
            redirect = f" < {tmp}"
            self.sbx.commands.run(f"chmod a+r {tmp}", user=self.cfg.user, timeout=30)
        # `commands.run` is `bash -l -c`: a login shell first runs ~/.profile, which the submission may have
        # written (a PATH with a fake `timeout` that reads the grader's stdin and answers for the runner). So
        # HOME points nowhere while the shell starts and is set for the command in the script, and `timeout`
        # is called by its full path.
        # memory is the server's cgroup limit: an address-space ulimit would break runtimes that reserve
        # far more virtual memory than they use (V8's WebAssembly, torch)
        envs = dict(env or {})
        home = envs.pop("HOME", f"/home/{self.cfg.user}")
        script = (
            f"export HOME={_shq(home)} && cd {_shq(cwd_abs)} && ulimit -u {lim.pids} -n {lim.nofile} -c 0 && "
            f"exec /usr/bin/timeout -s KILL {lim.timeout_s:.3f} {' '.join(_shq(a) for a in argv)}{redirect}"
        )
        t0 = time.monotonic()
        try:
            r = self.sbx.commands.run(
                script, envs={**envs, "HOME": "/nonexistent"}, user=self.cfg.user, timeout=lim.timeout_s + 10
            )
            code, out, err = r.exit_code, r.stdout, r.stderr
        except Exception as e:  # CommandExitException carries the result of a non-zero exit
            code = getattr(e, "exit_code", -1)
            out, err = getattr(e, "stdout", ""), getattr(e, "stderr", str(e))
        out_b, err_b = _as_bytes(out), _as_bytes(err)
        cap = lim.max_output_bytes
        wall = time.monotonic() - t0
        # envd reports a death by signal as -1: `timeout -s KILL` shows as that, at the deadline
        killed = code in (124, 137) or (code < 0 and wall >= lim.timeout_s * 0.95)
        return ExecResult(
            code,
            out_b[:cap],
            err_b[:cap],
            timed_out=killed,
            oom_killed=False,
            truncated=len(out_b) > cap or len(err_b) > cap,
            wall_s=wall,
        )

    def fork(self) -> E2BWorkspace:
        # the server's fork: the parent is checkpointed in place and the child boots from that snapshot. One retry:
        # a failed fork leaves the parent as it was (thawed, reattached), and under load a fork can fail for reasons
        # of the moment (96 coding episodes judged at once beside another RL run: ~5% of CRIU dumps were killed)
        for attempt in range(2):
            try:
                (child,) = self.sbx.fork(count=1, **self.cfg.sdk_opts())
                if isinstance(child, Exception):
                    raise child
                break
            except Exception:
                if attempt:
                    raise
                time.sleep(0.5)
        ws = E2BWorkspace(child, self.cfg, owned=True)
        # the snapshot holds the submission's processes too (a daemon the episode left running could rewrite
        # files the grader just restored, or read the grader's stdin file): a judging fork starts without them
        for _ in range(2):
            with contextlib.suppress(Exception):  # the killing shell is one of them
                child.commands.run("kill -KILL -1", user=self.cfg.user, timeout=30)
        return ws

    def close(self) -> None:
        if self._owned:
            with contextlib.suppress(Exception):
                self.sbx.kill()


class E2BSandboxes:
    """`SandboxProvider` over the e2b SDK."""

    def __init__(self, config: E2BConfig | None = None):
        self.cfg = config or E2BConfig()

    def open(self, sandbox_id: str) -> E2BWorkspace:
        return E2BWorkspace.connect(sandbox_id, self.cfg)


def _shq(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _as_bytes(x) -> bytes:
    if isinstance(x, bytes):
        return x
    return (x or "").encode("utf-8", errors="replace")


def tree_hash(ws: Workspace) -> dict[str, str]:
    """Content hash of every entry (files by sha256, symlinks by target kind, dirs by presence): used to
    show grading leaves the original workspace unchanged."""
    import hashlib

    out = {}
    for e in ws.list_files():
        if e.kind == "file":
            out[e.path] = hashlib.sha256(ws.read_file(e.path, max_bytes=1 << 40)).hexdigest()
        else:
            out[e.path] = e.kind
    return out
