"""Host plumbing for the bwrap backend: child processes, cgroups, the btrfs disk.

Everything here touches only what the server itself created: its own cgroup sub-tree (``rlk3-sbx-<hash>``
under each v1 controller and under the v2 hierarchy), its own loop-mounted btrfs image, its own children.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rlk3.sandbox")
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


class HostError(RuntimeError):
    """A host-side step (mount, cgroup, criu, ...) failed; the message says which and why."""


# --------------------------------------------------------------------------------------------- processes
class Reaper:
    """Spawns children with posix_spawn and reaps *every* child of the server in one thread.

    The server is a child subreaper: trees that CRIU restores with ``-d`` are reparented to it, and nobody
    else would reap them. Because one thread calls ``waitpid(-1)``, the server must not use ``subprocess``
    or ``asyncio.create_subprocess_*`` (they would lose their exit statuses); everything goes through here.
    """

    def __init__(self) -> None:
        if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise HostError("prctl(PR_SET_CHILD_SUBREAPER) failed")
        self._lock = threading.Lock()
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._done: dict[int, int] = {}  # statuses that arrived before anyone waited
        self._kick = threading.Event()
        threading.Thread(target=self._loop, name="reaper", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self._kick.wait(1.0)
                self._kick.clear()
                continue
            except InterruptedError:
                continue
            code = os.waitstatus_to_exitcode(status)
            with self._lock:
                waiter = self._waiters.pop(pid, None)
                if waiter is None:
                    self._done[pid] = code
                    if len(self._done) > 10000:  # restored trees' orphans nobody waits for
                        self._done.pop(next(iter(self._done)))
            if waiter is not None:
                loop, fut = waiter
                loop.call_soon_threadsafe(_set_result, fut, code)

    def spawn(
        self,
        argv: list[str],
        *,
        stdin: int | None = None,
        stdout: int | None = None,
        stderr: int | None = None,
        env: dict[str, str] | None = None,
        setsid: bool = False,
        pass_fds: tuple[int, ...] = (),
    ) -> int:
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        actions = [
            (os.POSIX_SPAWN_DUP2, stdin if stdin is not None else devnull, 0),
            (os.POSIX_SPAWN_DUP2, stdout if stdout is not None else devnull, 1),
            (os.POSIX_SPAWN_DUP2, stderr if stderr is not None else devnull, 2),
        ]
        for fd in pass_fds:
            os.set_inheritable(fd, True)
        try:
            pid = os.posix_spawn(
                argv[0], argv, env if env is not None else _base_env(), file_actions=actions, setsid=setsid
            )
        finally:
            os.close(devnull)
            for fd in pass_fds:
                os.set_inheritable(fd, False)
        self._kick.set()
        return pid

    async def wait(self, pid: int) -> int:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if pid in self._done:
                return self._done.pop(pid)
            self._waiters[pid] = (loop, fut)
        return await fut

    async def run(
        self,
        argv: list[str],
        *,
        timeout: float = 120.0,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """Run a host tool to completion; returns (exit code, combined output)."""
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self.spawn(argv, stdout=w, stderr=w, env=env)
        finally:
            os.close(w)
        out = bytearray()
        loop = asyncio.get_running_loop()
        eof = loop.create_future()
        os.set_blocking(r, False)

        def readable() -> None:
            try:
                data = os.read(r, 65536)
            except BlockingIOError:
                return
            if data:
                out.extend(data)
                if len(out) > 1 << 20:
                    del out[: len(out) - (1 << 20)]
            else:
                loop.remove_reader(r)
                if not eof.done():
                    eof.set_result(None)

        loop.add_reader(r, readable)
        try:
            code = await asyncio.wait_for(self.wait(pid), timeout)
            await asyncio.wait_for(eof, 5.0)
        except TimeoutError:
            os.kill(pid, 9)
            raise HostError(
                f"{argv[0]} timed out after {timeout:.0f}s: {out.decode(errors='replace')[-2000:]}"
            ) from None
        finally:
            loop.remove_reader(r)
            os.close(r)
        text = out.decode(errors="replace")
        if check and code != 0:
            raise HostError(f"{' '.join(argv[:3])} ... exited {code}: {text[-3000:]}")
        return code, text


def _set_result(fut: asyncio.Future, value: int) -> None:
    if not fut.done():
        fut.set_result(value)


def _base_env() -> dict[str, str]:
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


# --------------------------------------------------------------------------------------------- cgroups
V1 = ("memory", "pids", "cpu", "cpuacct")
CGROOT = Path("/sys/fs/cgroup")


def _v2_root() -> Path:
    # a hybrid host mounts cgroup2 at /sys/fs/cgroup/unified; a pure-v2 host at /sys/fs/cgroup itself
    unified = CGROOT / "unified"
    return unified if (unified / "cgroup.procs").exists() else CGROOT


@dataclass
class Limits:
    cpu_count: float = 1.0
    memory_mb: int = 512
    pids: int = 512
    disk_mb: int = 1024


async def favor_dynamic_cgroups(reaper: Reaper, v2_root: Path | None = None) -> bool:
    """Remount cgroup2 with ``favordynmods`` (Linux >= 6.0) unless it has it; returns whether it is on.

    Every sandbox start, restore and fork moves a process into its cgroups. The kernel guards migrations with
    one global percpu rwsem whose writer, after the lock has been idle for a while, waits for an RCU grace
    period: measured here, the four ``cgroup.procs`` writes of a launcher took 15 ms after 100 ms of quiet and
    0.4 ms with ``favordynmods``, which keeps the rwsem in its writer-friendly mode (forks and exits pay an
    uncontended atomic instead). systemd >= 255 can mount cgroup2 this way too. It lasts until the next
    reboot; a host that refuses the remount keeps working, only slower."""
    v2_root = v2_root or _v2_root()
    mounts = (line.split() for line in Path("/proc/self/mounts").read_text().splitlines())
    opts = next((f[3].split(",") for f in mounts if f[1] == str(v2_root) and f[2] == "cgroup2"), None)
    if opts is None:
        return False
    if "favordynmods" in opts:
        return True
    # mount(8), not mount(2): it carries the mount's other options (nsdelegate, nosuid, ...) over
    code, out = await reaper.run(["/usr/bin/mount", "-o", "remount,favordynmods", str(v2_root)], check=False)
    if code != 0:
        log.warning(
            "cgroup2 at %s kept its options (remount with favordynmods: %s); every sandbox start then "
            "waits ~15 ms for a cgroup migration",
            v2_root,
            out.strip(),
        )
    return code == 0


class Cgroups:
    """One sub-tree per server (``rlk3-sbx-<tag>``) and one leaf per sandbox in each hierarchy.

    Limits come from the v1 controllers (memory, pids, cpu); freeze, kill and CPU accounting from the v2
    core files (``cgroup.freeze``, ``cgroup.kill``, ``cpu.stat``), which work even with no v2 controller.
    """

    def __init__(self, tag: str) -> None:
        self.name = f"rlk3-sbx-{tag}"
        self.v2 = _v2_root() / self.name
        self.v1 = {c: CGROOT / c / self.name for c in V1 if (CGROOT / c / "cgroup.procs").exists()}
        missing = [c for c in ("memory", "pids", "cpu") if c not in self.v1]
        if missing:
            raise HostError(
                f"cgroup v1 controllers {missing} are not mounted under {CGROOT}; rlk3's bwrap backend "
                "needs memory, pids and cpu limits (see docs/sandbox.md)"
            )
        for d in [self.v2, *self.v1.values()]:
            d.mkdir(exist_ok=True)

    def leaves(self, sid: str) -> list[Path]:
        return [self.v2 / sid, *(d / sid for d in self.v1.values())]

    def create(self, sid: str, limits: Limits, *, pids_max: int | None = None) -> list[str]:
        """Make the sandbox's leaves and set limits; returns the cgroup.procs files a launcher joins.

        ``pids_max`` overrides ``limits.pids`` for backends that enforce the guest's limit themselves."""
        for d in self.leaves(sid):
            d.mkdir(exist_ok=True)
        mem = self.v1["memory"] / sid
        limit = str(limits.memory_mb << 20)
        _write(mem / "memory.limit_in_bytes", limit)
        if (mem / "memory.memsw.limit_in_bytes").exists():  # no swap here, but if there were, cap it too
            _write(mem / "memory.memsw.limit_in_bytes", limit)
        _write(self.v1["pids"] / sid / "pids.max", str(pids_max or limits.pids))
        cpu = self.v1["cpu"] / sid
        _write(cpu / "cpu.cfs_period_us", "100000")
        _write(cpu / "cpu.cfs_quota_us", str(max(1000, int(limits.cpu_count * 100000))))
        return [str(d / "cgroup.procs") for d in self.leaves(sid)]

    def procs(self, sid: str) -> list[int]:
        pids: set[int] = set()
        for d in self.leaves(sid):
            with contextlib.suppress(FileNotFoundError):
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return sorted(pids)

    def freeze(self, sid: str, frozen: bool, timeout: float = 5.0) -> None:
        leaf = self.v2 / sid
        _write(leaf / "cgroup.freeze", "1" if frozen else "0")
        if not frozen:
            return
        deadline = time.monotonic() + timeout
        while "frozen 1" not in (leaf / "cgroup.events").read_text():
            if time.monotonic() > deadline:
                raise HostError(f"cgroup {leaf} did not freeze within {timeout}s")
            time.sleep(0.0002)

    def cpu_usec(self, sid: str) -> int:
        for line in (self.v2 / sid / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1])
        return 0

    def memory_bytes(self, sid: str) -> int:
        try:
            return int((self.v1["memory"] / sid / "memory.usage_in_bytes").read_text())
        except FileNotFoundError:
            return 0

    def oom_kills(self, sid: str) -> int:
        try:
            text = (self.v1["memory"] / sid / "memory.oom_control").read_text()
        except FileNotFoundError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def kill(self, sid: str) -> None:
        """SIGKILL everything in the sandbox's leaf, frozen or not (cgroup.kill, Linux >= 5.14)."""
        leaf = self.v2 / sid
        if (leaf / "cgroup.kill").exists():
            _write(leaf / "cgroup.kill", "1")
        else:  # older kernels: thaw and kill each PID until none is left
            for pid in self.procs(sid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            _write(leaf / "cgroup.freeze", "0")

    async def remove(self, sid: str, timeout: float = 10.0) -> None:
        """Kill and remove the leaves; waits until the kernel lets them go (zombies are reaped meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            if any(d.exists() for d in self.leaves(sid)):
                self.kill(sid) if (self.v2 / sid).exists() else None
            busy = []
            for d in self.leaves(sid):
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    busy.append(str(d))
            if not busy:
                return
            if time.monotonic() > deadline:
                raise HostError(f"cgroups still busy after kill: {busy} (pids {self.procs(sid)})")
            await asyncio.sleep(0.005)

    def existing(self) -> set[str]:
        names: set[str] = set()
        for d in [self.v2, *self.v1.values()]:
            if d.exists():
                names.update(p.name for p in d.iterdir() if p.is_dir())
        return names

    def remove_tree(self) -> None:
        for d in [self.v2, *self.v1.values()]:
            with contextlib.suppress(OSError):
                d.rmdir()


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- btrfs disk
# This kernel has no XFS or ext4 quota support (CONFIG_XFS_QUOTA and CONFIG_QFMT_V2 are off), but btrfs
# qgroups are built into btrfs itself: each sandbox's writable layer is a subvolume with a qgroup limit.
_IOW = 1 << 30
_IOR = 2 << 30
BTRFS_IOC_SUBVOL_CREATE = _IOW | (4096 << 16) | (0x94 << 8) | 14
BTRFS_IOC_SNAP_DESTROY = _IOW | (4096 << 16) | (0x94 << 8) | 15
BTRFS_IOC_SUBVOL_SETFLAGS = _IOW | (8 << 16) | (0x94 << 8) | 26
BTRFS_IOC_QGROUP_LIMIT = _IOR | (48 << 16) | (0x94 << 8) | 43
BTRFS_IOC_SNAP_CREATE_V2 = _IOW | (4096 << 16) | (0x94 << 8) | 23
BTRFS_SUBVOL_RDONLY = 1 << 1
BTRFS_QGROUP_LIMIT_MAX_RFER = 1 << 0


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if b"/" in raw or len(raw) > 4000:
        raise HostError(f"bad subvolume name {name!r}")
    buf = bytearray(4096)
    buf[8 : 8 + len(raw)] = raw
    return buf


def subvol_create(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, _vol_args(path.name))
    finally:
        os.close(fd)


def subvol_snapshot(src: Path, dst: Path, *, readonly: bool = True) -> None:
    """A copy-on-write snapshot of subvolume ``src`` at ``dst``: constant time, whatever ``src`` holds.

    btrfs flushes ``src``'s dirty data first, so the snapshot holds every write made before the call."""
    sfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    dfd = os.open(dst.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        args = _vol_args(dst.name)  # struct btrfs_ioctl_vol_args_v2: fd, transid, flags, 4 x u64, name
        raw = dst.name.encode()
        args[:] = bytearray(4096)
        struct.pack_into("qQQ", args, 0, sfd, 0, BTRFS_SUBVOL_RDONLY if readonly else 0)
        args[56 : 56 + len(raw)] = raw
        fcntl.ioctl(dfd, BTRFS_IOC_SNAP_CREATE_V2, args)
    finally:
        os.close(sfd)
        os.close(dfd)


def subvol_delete(path: Path) -> None:
    if not path.exists():
        return
    set_readonly(path, False)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SNAP_DESTROY, _vol_args(path.name))
    finally:
        os.close(fd)


def set_readonly(path: Path, ro: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, struct.pack("Q", BTRFS_SUBVOL_RDONLY if ro else 0))
    finally:
        os.close(fd)


def qgroup_limit(path: Path, max_bytes: int) -> None:
    # qgroupid 0 means "the subvolume this fd is in"
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        args = struct.pack("QQQQQQ", 0, BTRFS_QGROUP_LIMIT_MAX_RFER, max_bytes, 0, 0, 0)
        fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, bytearray(args))
    finally:
        os.close(fd)


def mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def mounts_under(prefix: str) -> list[str]:
    prefix = os.path.realpath(prefix)
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix + "/")]


async def ensure_disk(reaper: Reaper, image: Path, mountpoint: Path, size_gb: int) -> None:
    """A sparse btrfs image with quotas on, loop-mounted at ``mountpoint`` (made once, kept)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    if mounted(mountpoint):
        return
    if not image.exists():
        with open(image, "wb") as f:
            f.truncate(size_gb << 30)
        await reaper.run(
            ["/usr/sbin/mkfs.btrfs", "-q", "-f", str(image)]
            if Path("/usr/sbin/mkfs.btrfs").exists()
            else ["/sbin/mkfs.btrfs", "-q", "-f", str(image)]
        )
        fresh = True
    else:
        fresh = False
    await reaper.run(["/usr/bin/mount", "-o", "loop,noatime", str(image), str(mountpoint)])
    if fresh:
        await reaper.run(["/usr/bin/btrfs", "quota", "enable", str(mountpoint)])


async def release_disk(reaper: Reaper, mountpoint: Path) -> None:
    """Unmount the image, first giving its free space back to the host: the sparse image keeps every block it ever
    wrote (layers, uppers and CRIU images of sandboxes long gone) until a discard punches the holes, and one RL
    run's server left 3-7 GB behind (a demo's ten, 27 GB); after the trim it keeps what is still stored."""
    if mounted(mountpoint):
        # deleted subvolumes are freed by btrfs's cleaner in the background: wait for it, then trim
        await reaper.run(["/usr/bin/btrfs", "filesystem", "sync", str(mountpoint)], check=False)  # commit: wakes it
        await reaper.run(["/usr/bin/btrfs", "subvolume", "sync", str(mountpoint)], check=False, timeout=300)
        await reaper.run(["/usr/sbin/fstrim", str(mountpoint)], check=False)
        await reaper.run(["/usr/bin/umount", str(mountpoint)], check=False)


def wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.002)
    return False


def proc_start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot; guards recorded PIDs against reuse after a server restart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
