"""The ``gvisor`` backend: the same sandboxes, run on gVisor's user-space kernel (``runsc``) instead of the host's.

A gVisor sandbox's system calls are served by the Sentry, a Go program that implements Linux in user space
and itself talks to the host through a narrow, seccomp-filtered set of calls; files reach it through a
separate Gofer process. So a kernel bug reachable from the sandbox is a Sentry bug first, not a host-kernel
bug: that is the stronger isolation this backend buys, at the price of slow process creation (every exec
crosses the Sentry; see docs/sandbox.md and docs/BENCHMARKS.md for numbers on this machine).

Everything except running the processes is shared with the bwrap backend (:class:`BwrapBackend`, called the
*host* here): the layered btrfs+overlayfs disk, templates, the server's cgroup sub-tree and the in-sandbox
agent. A sandbox's launcher (``unshare -m`` → ``sh``: join the sandbox's cgroups, mount its overlay) execs
``runsc run -detach`` instead of ``bwrap``; runsc's Gofer and Sentry inherit that private mount namespace,
so the overlay is the container's root and is never visible on the host, and they sit in the sandbox's
cgroups, so freeze, kill, CPU and memory limits work exactly as for bwrap (runsc runs with
``--ignore-cgroups``: it never creates cgroups of its own).

- Agent link: the agent connects to ``/run/rlk3/agent.sock`` as under bwrap; runsc's ``--host-uds=open`` lets
  it reach that host socket, and the host sees the *Gofer* as the peer (it makes the connection on the
  Sentry's behalf). The socket lives in a directory of its own that only root *inside* the sandbox can enter,
  so ordinary commands (uid 1000) cannot reach it; a root command could, but root inside already owns its
  sandbox and can reach nothing else this way.
- Pause, memory mode: ``runsc checkpoint`` (which stops the container) and ``runsc restore`` over the same
  disk, like CRIU for bwrap; fork and snapshot restore one checkpoint several times.
- Ids: the container's uid/gid map is the bwrap backend's (sandbox 0..65535 = host 100000..165535), so both
  backends read the same layers and the Gofer and Sentry run as an unprivileged host uid.
- Limits: memory is the sandbox cgroup's limit on Sentry + Gofer together. gVisor has no OOM killer of its
  own to pick one process: a guest that outgrows the limit gets ENOMEM when the Sentry's memory file cannot
  grow, or, when the limit is hit on a page fault, the host's OOM killer takes the Sentry: the *whole sandbox*.
  The process limit is the guest's RLIMIT_NPROC, enforced by the Sentry (a fork fails with EAGAIN); the host
  pids cgroup is set above it, because a Sentry that cannot create a host stub process panics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

from .bwrap import HOST_RO, ID_COUNT, ID_SHIFT, BwrapBackend
from .host import HostError, Limits

# The Sentry, the Gofer and the guest's host stubs share the pids cgroup: under systrap every guest process
# costs a host stub process and every guest thread a host "sysmsg" thread. The guest itself is held to
# Limits.pids by RLIMIT_NPROC; the host limit sits well above that (a Sentry refused a host task panics and
# the whole sandbox dies), so it only guards the host against a runaway Sentry.
HOST_TASKS_PER_GUEST = 4
HOST_PIDS_HEADROOM = 512
# capabilities of the agent (and of commands run as root): Docker's default set. No CAP_SYS_ADMIN or
# CAP_SYS_RESOURCE, so RLIMIT_NPROC holds for root inside as well.
CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
]


def find_runsc(explicit: str | None = None) -> str | None:
    """runsc unpacked by scripts/setup.d/sandbox.sh into .cache/runsc/, else $RLK3_RUNSC, else PATH."""
    for cand in (
        explicit,
        os.environ.get("RLK3_RUNSC"),
        str(Path(__file__).resolve().parents[2] / ".cache" / "runsc" / "usr" / "bin" / "runsc"),
        shutil.which("runsc"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


class GvisorBackend:
    name = "gvisor"
    # runsc checkpoint -leave-running exists, but the disk copy must match the image: a checkpoint that stops
    # the container, a snapshot of its upper, and a restore are what keeps the two consistent
    live_checkpoint = False

    def __init__(self, host: BwrapBackend, *, runsc: str | None = None, platform: str = "systrap") -> None:
        if platform not in ("systrap", "ptrace"):
            # runsc's kvm platform needs a KVM that can run its guest; on this machine's PVM it hangs
            raise HostError(f"gVisor platform must be systrap or ptrace, not {platform!r}")
        self.host = host
        self.reaper = host.reaper
        self.cgroups = host.cgroups
        self.runsc = find_runsc(runsc)
        self.platform = platform
        # runsc keeps one state file and one control socket per container here; a short path, because a
        # unix socket path must fit in 108 bytes
        self.root = host.view / "gv"
        self.bundles = host.state / "gvisor-bundles"
        # the agent directory gVisor sandboxes see at /run/rlk3: owned by the sandbox's root, mode 0700
        self.agent_dir = host.view / "agent-gv"
        self.cids: dict[str, str] = {}  # sandbox id -> current runsc container id

    @property
    def available(self) -> str | None:
        """None when usable, else why not."""
        if self.runsc is None:
            return "runsc was not found: run `make system` (scripts/setup.d/sandbox.sh unpacks it into .cache/runsc)"
        return None

    def agent_socket(self) -> Path:
        return self.agent_dir / "agent.sock"

    # ------------------------------------------------------------------------------------ setup
    async def start(self) -> None:
        if self.available:
            return
        for d in (self.root, self.bundles):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.agent_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.agent_dir, ID_SHIFT, ID_SHIFT)
        os.chmod(self.agent_dir, 0o700)
        shutil.copyfile(Path(__file__).with_name("agent.py"), self.agent_dir / "agent.py")
        # containers from a previous run: forget_others() drops those whose sandbox is gone (Manager._gc)
        for state in self.root.glob("*_sandbox:*.state"):
            cid = state.name.split("_sandbox:", 1)[0]
            self.cids.setdefault(cid.rsplit("-", 1)[0], cid)

    async def stop(self) -> None:
        for f in ("agent.py", "agent.sock"):
            with contextlib.suppress(OSError):
                (self.agent_dir / f).unlink()
        for d in (self.agent_dir, self.root):
            with contextlib.suppress(OSError):
                d.rmdir()

    def _flags(self) -> list[str]:
        return [
            self.runsc,
            "--root",
            str(self.root),
            "--platform",
            self.platform,
            "--network",
            "none",  # loopback only, as under bwrap
            "--overlay2",
            "none",  # writes go through the Gofer to the sandbox's upper layer (quota, snapshots, forks)
            "--host-uds",
            "open",  # the agent's socket; the sandbox's mounts hold no other host socket
            "--ignore-cgroups",  # the launcher already put everything in the sandbox's own cgroups
            # RLK3_RUNSC_DEBUG=<dir> keeps runsc's own debug logs there (one set per command)
            *(
                [f"--debug-log={os.environ['RLK3_RUNSC_DEBUG'].rstrip('/')}/"]
                if os.environ.get("RLK3_RUNSC_DEBUG")
                else []
            ),
        ]

    def _bundle(self, cid: str, sid: str, limits: Limits) -> Path:
        view = self.host.view
        mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            # POSIX shared memory for every user, as under bwrap (runsc's /dev has no writable shm of its own)
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro", "nosuid", "noexec"]},
            {"destination": "/run/rlk3", "type": "bind", "source": str(self.agent_dir), "options": ["rbind", "ro"]},
            # runsc puts a tmpfs on an empty /tmp unless the spec mounts something there; /tmp belongs on the
            # sandbox's disk (as under bwrap: snapshots and forks carry it, the quota counts it)
            {"destination": "/tmp", "type": "bind", "source": str(view / "root" / "tmp"), "options": ["rbind"]},
        ]
        for name in HOST_RO:
            host = Path("/") / name
            if host.is_dir() and not host.is_symlink():
                mounts.append(
                    {"destination": f"/{name}", "type": "bind", "source": str(host), "options": ["rbind", "ro"]}
                )
        ids = [{"containerID": 0, "hostID": ID_SHIFT, "size": ID_COUNT}]
        spec = {
            "ociVersion": "1.0.2",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": ["/usr/bin/python3", "-I", "-S", "/run/rlk3/agent.py", sid],
                "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
                "cwd": "/",
                "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted", "inheritable")},
                "rlimits": [{"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids}],
            },
            "root": {"path": str(view / "root"), "readonly": False},
            "hostname": "sandbox",
            "mounts": mounts,
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user")],
                "uidMappings": ids,
                "gidMappings": ids,
            },
        }
        bundle = self.bundles / cid
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    async def _start(self, sid: str, layers: list[str], upper: str, limits: Limits, cmd: list[str]) -> int:
        """Launch ``runsc <cmd> -bundle B <cid>`` in the sandbox's cgroups over its disk; returns the Gofer PID."""
        if self.available:
            raise HostError(self.available)
        cid = f"{sid}-{secrets.token_hex(3)}"
        self.cids[sid] = cid
        procs = self.cgroups.create(sid, limits, pids_max=HOST_TASKS_PER_GUEST * limits.pids + HOST_PIDS_HEADROOM)
        bundle = self._bundle(cid, sid, limits)
        log = bundle / "runsc.err"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            launcher = self.host._launcher(
                sid, procs, layers, upper, [*self._flags(), *cmd, "-bundle", str(bundle), cid], stderr=fd
            )
        finally:
            os.close(fd)
        code = await asyncio.wait_for(self.reaper.wait(launcher), 120)
        if code != 0:
            raise HostError(f"runsc {cmd[0]} of sandbox {sid} failed (exit {code}): {_tail(log)}")
        # runsc run/restore -detach returns once the container runs; its Gofer is in the sandbox's cgroup
        for pid in self.cgroups.procs(sid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read(11) == b"runsc-gofer":
                        return pid
            except OSError:
                continue
        raise HostError(f"runsc {cmd[0]} of sandbox {sid}: no Gofer process in its cgroup ({_tail(log)})")

    async def boot(self, sid: str, layers: list[str], upper: str, limits: Limits) -> int:
        """Start a fresh agent over the disk; returns the PID the agent's connection will come from."""
        return await self._start(sid, layers, upper, limits, ["run", "-detach"])

    async def restore(self, sid: str, image: str, layers: list[str], upper: str, limits: Limits) -> int:
        img = self.host.image_path(image)
        return await self._start(sid, layers, upper, limits, ["restore", "-detach", "-image-path", str(img)])

    async def dump(self, sid: str, pid: int, image: str) -> None:
        """``runsc checkpoint`` into images/<image>; the container stops (Manager.destroy cleans up)."""
        img = self.host.image_path(image)
        img.mkdir(parents=True, exist_ok=True)
        argv = [*self._flags(), "checkpoint", "-compression", "none", "-image-path", str(img), self._cid(sid)]
        code, out = await self.reaper.run(argv, check=False, timeout=120)
        if code != 0:
            raise HostError(f"runsc checkpoint of sandbox {sid} failed: {out[-1500:]}")

    async def wake(self, sid: str, pid: int) -> None:
        """SIGUSR1 to the container's init (the agent): reconnect now (after a restore or a failed dump)."""
        await self.reaper.run([*self._flags(), "kill", self._cid(sid), "USR1"], check=False, timeout=30)

    def _cid(self, sid: str) -> str:
        cid = self.cids.get(sid)
        if cid is None:
            raise HostError(f"sandbox {sid} has no gVisor container")
        return cid

    def freeze(self, sid: str) -> None:
        # the cgroup freezer stops the Sentry, the Gofer and every stub at once: 0 CPU, as under bwrap
        self.cgroups.freeze(sid, True)

    def thaw(self, sid: str) -> None:
        self.cgroups.freeze(sid, False)

    async def destroy(self, sid: str) -> None:
        """Kill the container's processes (cgroup.kill), remove its cgroups and runsc's records of it."""
        await self.cgroups.remove(sid)
        cid = self.cids.pop(sid, None)
        if cid is not None:
            await self._forget(cid)

    async def _forget(self, cid: str) -> None:
        await self.reaper.run([*self._flags(), "delete", "-force", cid], check=False, timeout=30)
        for leftover in (*self.root.glob(f"{cid}_sandbox:*"), self.root / f"runsc-{cid}.sock"):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        shutil.rmtree(self.bundles / cid, ignore_errors=True)

    async def forget_others(self, live: set[str]) -> None:
        """Drop runsc's records of containers whose sandbox no longer exists (after a crash or restart)."""
        for sid in [s for s in self.cids if s not in live]:
            await self._forget(self.cids.pop(sid))
        for bundle in self.bundles.iterdir() if self.bundles.exists() else ():
            if bundle.name not in self.cids.values():
                shutil.rmtree(bundle, ignore_errors=True)

    def cpu_usec(self, sid: str) -> int:
        return self.cgroups.cpu_usec(sid)

    def memory_bytes(self, sid: str) -> int:
        return self.cgroups.memory_bytes(sid)


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return "(no output)"
    return " | ".join(text.splitlines()[-6:]) or "(no output)"
