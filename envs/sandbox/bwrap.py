"""The default backend: bubblewrap namespaces over a layered btrfs+overlayfs disk, cgroup limits, CRIU.

A sandbox's process tree is launched as ``unshare -m`` (a private mount namespace that holds the sandbox's
overlay mount, so the mount disappears with the sandbox and is never visible on the host) → ``sh`` (joins
the sandbox's cgroups, mounts the overlay) → ``bwrap`` → the agent as PID 1. CRIU restores run the same way
with ``criu restore`` in place of ``bwrap``, so a restored tree sits in fresh cgroups and namespaces.

Disk layout (one loop-mounted btrfs image per server state directory):

    layers/<id>/upper   sealed, read-only subvolumes: the base skeleton, template layers, snapshot layers
    uppers/<id>/upper   one writable subvolume per live sandbox with a qgroup limit (the disk quota)
    images/<id>/        CRIU images (memory pauses, memory snapshots, fork sources)
    /run/rlk3-sbx-<tag>/{root,run}  where the launcher's private mount namespace mounts the sandbox's
                        overlay and the agent directory (never visible in the host's namespace)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
import time
from pathlib import Path

from .host import (
    Cgroups,
    HostError,
    Limits,
    Reaper,
    ensure_disk,
    favor_dynamic_cgroups,
    qgroup_limit,
    release_disk,
    set_readonly,
    subvol_create,
    subvol_delete,
    subvol_snapshot,
)

log = logging.getLogger("rlk3.sandbox")
HOST_RO = ("usr", "bin", "lib", "lib32", "lib64", "libx32", "sbin")
# /etc is copied (not bound) so a sandbox can edit its own /etc and never sees host secrets such as shadow
ETC_ALLOW = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "environment",
    "gai.conf",
    "host.conf",
    "inputrc",
    "issue",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "login.defs",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "profile",
    "profile.d",
    "protocols",
    "python3",
    "python3.11",
    "rpc",
    "services",
    "skel",
    "ssl",
    "timezone",
    "xattr.conf",
    "npmrc",
    "nodejs",
)
PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"
CRIU_COMMON = [
    "--ext-mount-map",
    "auto",
    "--enable-external-sharing",
    "--enable-external-masters",
    "--tcp-established",
    "--file-locks",
    "--manage-cgroups=ignore",
    # A sandbox's network namespace holds nothing but loopback. CRIU would save and restore its addresses,
    # routes, rules, iptables and sysctls by running ~10 helper programs (ip, iptables-save, ...) on each
    # dump and restore, the largest part of their time; instead it leaves the namespace's configuration
    # alone (sockets are still checkpointed), and on restore RESTORE_HOOK brings loopback up again.
    "--empty-ns",
    "net",
    "--network-lock",
    "skip",
]
# CRIU's action script on restore: bring up loopback in the sandbox's fresh network namespace before any
# socket in it is restored (CRIU runs the script at every stage; it acts on one). restore_hook.c does the same
# ~10x faster; this is the fallback for a CRIU that setup did not build.
RESTORE_HOOK = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = setup-namespaces ] || exit 0
exec /usr/bin/nsenter -t "$CRTOOLS_INIT_PID" -n /usr/sbin/ip link set lo up
"""
# Sandbox ids 0..65535 are host ids 100000..165535: root in a sandbox is an unprivileged host user, so even
# where the kernel checks only file ownership (e.g. sysctls under /proc/sys), it is not the host's root. The
# map is wide because sandboxes use many ids (root, user 1000, nobody, and whatever a setup script creates)
# and the gVisor backend uses the same map, so layers read the same under both.
ID_SHIFT = 100000
ID_COUNT = 65536
ID_MAP = f"0 {ID_SHIFT} {ID_COUNT}"


# where CRIU (built by scripts/setup.d/sandbox.sh with RUNDIR set to this) caches its probe of the kernel's
# features; it keeps the cache only on a tmpfs, and probing anew costs ~15-40 ms on every dump and restore
CRIU_KDAT_DIR = Path("/dev/shm/rlk3-criu")


def ensure_kdat_dir() -> None:
    """A root-only directory for CRIU's cache; anything else in its place (made by another user) goes."""
    try:
        st = os.lstat(CRIU_KDAT_DIR)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(CRIU_KDAT_DIR)
            else:
                CRIU_KDAT_DIR.unlink()
            raise FileNotFoundError
    except FileNotFoundError:
        with contextlib.suppress(OSError):  # no /dev/shm: CRIU still works, only slower
            CRIU_KDAT_DIR.mkdir(mode=0o700)


def find_criu(explicit: str | None = None) -> str | None:
    """CRIU 4.1.1 built by scripts/setup.d/sandbox.sh into .cache/criu/, else $RLK3_CRIU, else PATH."""
    for cand in (
        explicit,
        os.environ.get("RLK3_CRIU"),
        str(Path(__file__).resolve().parents[2] / ".cache" / "criu" / "criu"),
        shutil.which("criu"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


class BwrapBackend:
    name = "bwrap"

    def __init__(self, state: Path, reaper: Reaper, *, disk_gb: int = 64, criu: str | None = None) -> None:
        for ch in ":, ":
            if ch in str(state):
                raise HostError(f"state directory {state} must not contain {ch!r} (overlayfs option syntax)")
        self.state = state
        self.reaper = reaper
        self.disk_gb = disk_gb
        self.disk = state / "disk"
        tag = hashlib.sha1(str(state.resolve()).encode()).hexdigest()[:8]
        self.cgroups = Cgroups(tag)
        self.view = Path(f"/run/rlk3-sbx-{tag}")
        # the agent's directory (its code and the server's socket) must be reachable by the sandbox's
        # unprivileged host uid, also when CRIU re-binds it on restore: a short path under /run, mode 755
        self.run_dir = self.view / "agent"
        self.criu = find_criu(criu)
        self.userns_holder: int | None = None
        self.userns_fd: int | None = None

    # ------------------------------------------------------------------------------------ setup
    async def start(self) -> None:
        for tool in ("/usr/bin/bwrap", "/usr/bin/unshare", "/usr/bin/btrfs"):
            if not os.access(tool, os.X_OK):
                raise HostError(f"{tool} is missing: run `make system` (scripts/setup.d/sandbox.sh) first")
        self.state.mkdir(parents=True, exist_ok=True)
        await favor_dynamic_cgroups(self.reaper)
        await ensure_disk(self.reaper, self.state / "disk.img", self.disk, self.disk_gb)
        for d in ("layers", "uppers", "images"):
            (self.disk / d).mkdir(exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for d in (self.view / "root", self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.view, 0o755)
        shutil.copyfile(Path(__file__).with_name("agent.py"), self.run_dir / "agent.py")
        if self.criu:
            ensure_kdat_dir()
            hook = self.run_dir.parent / "criu-restore-hook"  # outside run_dir: sandboxes never see it
            built = Path(self.criu).with_name("restore-hook")  # restore_hook.c, built beside CRIU by setup
            if built.is_file() and os.access(built, os.X_OK):
                shutil.copyfile(built, hook)
            else:
                log.warning("%s is missing (run `make system`): using the slower shell hook", built)
                hook.write_text(RESTORE_HOOK)
            os.chmod(hook, 0o755)
        self._start_userns_holder()

    def _start_userns_holder(self) -> None:
        # bwrap can map only one uid; a holder process owns a user namespace with the wide shifted map that
        # every freshly booted sandbox joins (nsenter, then bwrap as the namespace's root = host uid 100000).
        # Host root creates it so that host root owns it: this machine's root lacks CAP_SYS_RESOURCE, and
        # CRIU may read the rlimits of processes under another uid only in a namespace its caller owns.
        # CRIU-restored sandboxes get a user namespace of their own, also owned by host root.
        pid = self.reaper.spawn(
            [
                "/usr/bin/setpriv",
                "--pdeathsig",
                "KILL",
                "--",
                "/usr/bin/unshare",
                "--user",
                "--",
                "/usr/bin/sleep",
                "infinity",
            ],
            setsid=True,
        )
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user"):
            if time.monotonic() > deadline:
                raise HostError("user namespace holder did not start")
            time.sleep(0.001)
        for f in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{f}", "w") as fh:
                fh.write(ID_MAP)
        self.userns_holder = pid
        self.userns_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)

    async def stop(self, unmount: bool = True) -> None:
        if self.userns_holder:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.userns_holder, signal.SIGKILL)
            if self.userns_fd is not None:
                os.close(self.userns_fd)
            self.userns_holder = None
        if unmount:
            await release_disk(self.reaper, self.disk)
        self.cgroups.remove_tree()  # only succeeds once no sandbox leaf is left
        for f in ("agent.py", "agent.sock", "../criu-restore-hook"):
            with contextlib.suppress(OSError):
                (self.run_dir / f).unlink()
        for d in (self.view / "root", self.run_dir, self.view):
            with contextlib.suppress(OSError):
                d.rmdir()

    # ------------------------------------------------------------------------------------ layers
    def layer_path(self, layer: str) -> Path:
        return self.disk / "layers" / layer

    def upper_path(self, upper: str) -> Path:
        return self.disk / "uppers" / upper

    def image_path(self, image: str) -> Path:
        return self.disk / "images" / image

    def new_upper(self, upper: str, limits: Limits) -> None:
        path = self.upper_path(upper)
        subvol_create(path)
        (path / "upper").mkdir()
        (path / "work").mkdir()
        os.chown(path / "upper", ID_SHIFT, ID_SHIFT)  # the sandbox's "/" belongs to its own root
        qgroup_limit(path, limits.disk_mb << 20)

    def import_tree(self, upper: str, dest: str, src: Path) -> None:
        """Copy a host directory into a (stopped) sandbox's upper at ``dest``, owned by the sandbox's root."""
        target = self.upper_path(upper) / "upper" / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
        _shift_ids(target)
        parent = target.parent  # directories the copy created on the way are the sandbox root's too
        while parent != self.upper_path(upper) / "upper":
            os.lchown(parent, ID_SHIFT, ID_SHIFT)
            parent = parent.parent

    def seal(self, upper: str, layer: str) -> None:
        """Turn a writable upper into a read-only layer: a rename and a flag, constant time (no copy)."""
        src = self.upper_path(upper)
        dst = self.layer_path(layer)
        shutil.rmtree(src / "work", ignore_errors=True)
        os.rename(src, dst)
        set_readonly(dst, True)

    def delete_upper(self, upper: str) -> None:
        path = self.upper_path(upper)
        if path.exists():
            shutil.rmtree(path / "work", ignore_errors=True)  # overlay leaves root-owned 000 dirs here
            subvol_delete(path)

    def delete_layer(self, layer: str) -> None:
        subvol_delete(self.layer_path(layer))

    def delete_image(self, image: str) -> None:
        shutil.rmtree(self.image_path(image), ignore_errors=True)

    def layers_on_disk(self) -> set[str]:
        return {p.name for p in (self.disk / "layers").iterdir()}

    def uppers_on_disk(self) -> set[str]:
        return {p.name for p in (self.disk / "uppers").iterdir()}

    def images_on_disk(self) -> set[str]:
        return {p.name for p in (self.disk / "images").iterdir()}

    def build_base_layer(self) -> str:
        """The skeleton every sandbox starts from: empty mountpoints, merged-usr links, a copied /etc."""
        h = hashlib.sha256(f"rlk3-base-v4-{ID_MAP}".encode())
        for name in sorted(ETC_ALLOW):
            p = Path("/etc") / name
            if p.is_file() and not p.is_symlink():
                h.update(name.encode() + p.read_bytes())
            elif p.exists():
                h.update(name.encode())
        layer = "base-" + h.hexdigest()[:12]
        if self.layer_path(layer).exists():
            return layer
        tmp = self.upper_path(layer + ".tmp")
        if tmp.exists():
            subvol_delete(tmp)
        subvol_create(tmp)
        root = tmp / "upper"
        for d in (
            "proc",
            "dev",
            "sys",  # gVisor mounts a sysfs there; bwrap leaves it empty
            "tmp",
            "var/tmp",
            "run/rlk3",
            "home/user",
            "root",
            "opt",
            "etc",
            "mnt",
            "srv",
            "var/log",
            "var/cache",
            "var/lib",
            "usr",
        ):
            (root / d).mkdir(parents=True, exist_ok=True)
        _dev_skeleton(root / "dev")
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root / "var/tmp", 0o1777)
        os.chmod(root / "root", 0o700)
        os.chown(root / "home/user", 1000, 1000)
        for name in HOST_RO[1:]:
            host = Path("/") / name
            if host.is_symlink():
                os.symlink(os.readlink(host), root / name)
            elif host.is_dir():
                (root / name).mkdir()
        for name in ETC_ALLOW:
            src = Path("/etc") / name
            dst = root / "etc" / name
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            elif src.is_dir():
                shutil.copytree(src, dst, symlinks=True)
            elif src.is_file():
                shutil.copy2(src, dst)
        (root / "etc/passwd").write_text(PASSWD)
        (root / "etc/group").write_text(GROUP)
        (root / "etc/hostname").write_text("sandbox\n")
        (root / "etc/hosts").write_text("127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n")
        (root / "etc/resolv.conf").write_text("# no network: sandboxes have loopback only\n")
        _shift_ids(root)
        shutil.rmtree(tmp / "work", ignore_errors=True)
        os.rename(tmp, self.layer_path(layer))
        set_readonly(self.layer_path(layer), True)
        return layer

    # ------------------------------------------------------------------------------------ launch
    def _overlay_opts(self, layers: list[str], upper: str) -> str:
        # relative paths (the launcher runs in the disk root) keep the option string under one page
        lower = ":".join(f"layers/{layer}/upper" for layer in layers)
        return f"lowerdir={lower},upperdir=uppers/{upper}/upper,workdir=uppers/{upper}/work"

    def _launcher(
        self,
        sid: str,
        procs_files: list[str],
        layers: list[str],
        upper: str,
        then: list[str],
        info_fd: int | None = None,
        extra_fds: tuple[int, ...] = (),
        stderr: int | None = None,
    ) -> int:
        # In the launcher's private mount namespace the sandbox's root is mounted at a fixed path,
        # /run/rlk3-sbx-<tag>/root (one mount per namespace, so sandboxes never collide): bwrap runs as the
        # unprivileged sandbox uid and must be able to reach it whatever the state path is.
        script = (
            'set -e; for f in $RLK3_CGROUPS; do echo $$ > "$f"; done; cd "$RLK3_DISK"; '
            'mount -t overlay overlay -o "$RLK3_OVL" "$RLK3_VIEW/root"; '
            'exec "$@"'
        )
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "RLK3_CGROUPS": " ".join(procs_files),
            "RLK3_DISK": str(self.disk),
            "RLK3_OVL": self._overlay_opts(layers, upper),
            "RLK3_VIEW": str(self.view),
        }
        argv = [
            "/usr/bin/unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            script,
            "sh",
            *then,
        ]
        fds = tuple(fd for fd in (info_fd, *extra_fds) if fd is not None)
        return self.reaper.spawn(argv, env=env, setsid=True, pass_fds=fds, stderr=stderr)

    def _bwrap_argv(self, sid: str, info_fd: int) -> list[str]:
        argv = [
            "/usr/bin/nsenter",
            f"--user=/proc/self/fd/{self.userns_fd}",
            "--setuid=0",
            "--setgid=0",
            "--",
            "/usr/bin/bwrap",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--as-pid-1",
            # capabilities inside the sandbox's own user namespace only (the agent switches users for
            # commands); the host uid behind them is unprivileged
            "--cap-add",
            "ALL",
            "--new-session",
            "--hostname",
            "sandbox",
            "--bind",
            str(self.view / "root"),
            "/",
        ]
        for name in HOST_RO:
            host = Path("/") / name
            if host.is_dir() and not host.is_symlink():
                argv += ["--ro-bind", str(host), f"/{name}"]
        argv += ["--proc", "/proc"]
        for node in DEV_NODES:  # the host's device nodes on the skeleton's files (see _dev_skeleton)
            argv += ["--dev-bind", f"/dev/{node}", f"/dev/{node}"]
        argv += [
            "--ro-bind",
            str(self.run_dir),
            "/run/rlk3",
            "--chdir",
            "/",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/sbin:/usr/bin:/sbin:/bin",
            "--info-fd",
            str(info_fd),
            "/usr/bin/python3",
            "-I",
            "-S",
            "/run/rlk3/agent.py",
            sid,
        ]
        return argv

    async def boot(self, sid: str, layers: list[str], upper: str, limits: Limits) -> int:
        """Start a fresh agent over the disk; returns the agent's host PID."""
        procs = self.cgroups.create(sid, limits)
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            launcher = self._launcher(
                sid, procs, layers, upper, self._bwrap_argv(sid, w), info_fd=w, extra_fds=(self.userns_fd,)
            )
        finally:
            os.close(w)
        try:
            info = await read_to_eof(r, 10)
        finally:
            os.close(r)
        if not info:
            code = await asyncio.wait_for(self.reaper.wait(launcher), 10)
            raise HostError(f"sandbox launcher exited {code} before the sandbox started")
        # the launcher (bwrap's outer process) lives until the sandbox's PID 1 exits; the reaper reaps it
        pid = int(json.loads(info)["child-pid"])
        _protect(pid)
        return pid

    @property
    def live_checkpoint(self) -> bool:
        return self.criu is not None

    async def checkpoint_live(self, sid: str, pid: int, image: str, upper: str, layer: str) -> None:
        """Dump the tree into images/<image> and copy its disk into layers/<layer>, at one instant, and leave
        it running on its own disk: what fork and snapshot need, without stopping and restoring the source.

        The cgroup freezer stops the whole tree; while it is stopped btrfs snapshots the upper layer (copy on
        write, constant time) and CRIU seizes the tree (``--freeze-cgroup`` on an already frozen cgroup: it
        seizes, dumps, and leaves the cgroup frozen again); then the tree thaws."""
        self.cgroups.freeze(sid, True)
        try:
            subvol_snapshot(self.upper_path(upper), self.layer_path(layer))
            await self.dump(sid, pid, image, leave_running=True, freeze_cgroup=str(self.cgroups.v2 / sid))
        except BaseException:
            self.delete_layer(layer)
            raise
        finally:
            self.cgroups.freeze(sid, False)

    async def dump(
        self, sid: str, pid: int, image: str, *, leave_running: bool = False, freeze_cgroup: str | None = None
    ) -> float:
        """CRIU-dump the tree rooted at ``pid`` into images/<image>; returns seconds taken."""
        if not self.criu:
            raise HostError("CRIU is not available: run `make system` to build CRIU 4.1.1 into .cache/criu/")
        img = self.image_path(image)
        img.mkdir(parents=True, exist_ok=True)
        argv = [
            self.criu,
            "dump",
            "-t",
            str(pid),
            "-D",
            str(img),
            "-o",
            "dump.log",
            *CRIU_COMMON,
        ]
        if leave_running:
            argv.append("--leave-running")
        if freeze_cgroup:
            argv += ["--freeze-cgroup", freeze_cgroup]
        t = time.perf_counter()
        code, _ = await self.reaper.run(argv, check=False, timeout=120)
        if code != 0:
            raise HostError(f"criu dump of sandbox {sid} failed (exit {code}): {_log_tail(img / 'dump.log')}")
        return time.perf_counter() - t

    async def restore(self, sid: str, image: str, layers: list[str], upper: str, limits: Limits) -> int:
        """Restore images/<image> into fresh namespaces and cgroups over the disk; returns the agent PID."""
        if not self.criu:
            raise HostError("CRIU is not available: run `make system` to build CRIU 4.1.1 into .cache/criu/")
        img = self.image_path(image)
        procs = self.cgroups.create(sid, limits)
        pidfile = self.run_dir / f"restore-{sid}.pid"
        log = f"restore-{sid}.log"
        argv = [
            self.criu,
            "restore",
            "-D",
            str(img),
            "-o",
            log,
            "--root",
            str(self.view / "root"),
            "-d",
            "--pidfile",
            str(pidfile),
            *CRIU_COMMON,
            "--action-script",
            str(self.run_dir.parent / "criu-restore-hook"),
        ]
        launcher = self._launcher(sid, procs, layers, upper, argv)
        code = await asyncio.wait_for(self.reaper.wait(launcher), 120)
        if code != 0:
            tail = _log_tail(img / log)
            raise HostError(f"criu restore of sandbox {sid} failed (exit {code}): {tail}")
        pid = int(pidfile.read_text())
        pidfile.unlink()
        with contextlib.suppress(FileNotFoundError):
            (img / log).unlink()
        _protect(pid)
        return pid

    async def wake(self, sid: str, pid: int) -> None:
        """SIGUSR1 tells a held agent (after detach or restore) to reconnect now."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)

    def freeze(self, sid: str) -> None:
        self.cgroups.freeze(sid, True)

    def thaw(self, sid: str) -> None:
        self.cgroups.freeze(sid, False)

    async def destroy(self, sid: str) -> None:
        """Kill every process of the sandbox and remove its cgroups and mountpoint."""
        await self.cgroups.remove(sid)

    def cpu_usec(self, sid: str) -> int:
        return self.cgroups.cpu_usec(sid)

    def memory_bytes(self, sid: str) -> int:
        return self.cgroups.memory_bytes(sid)

    def alive(self, sid: str) -> bool:
        return bool(self.cgroups.procs(sid))


# /dev is a directory of the base layer, not the tmpfs that bwrap's --dev mounts: CRIU saves a tmpfs's files
# with tar on every dump and unpacks them on every restore (measured: 6.8 ms of a 44 ms restore, and as much on
# each dump and on each of a fork's children). These host nodes are bound onto empty files there, as --dev binds
# them; the agent mounts a devpts of the sandbox's own at /dev/pts.
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "ptmx": "pts/ptmx",
}


def _dev_skeleton(dev: Path) -> None:
    for node in DEV_NODES:
        (dev / node).touch()
    for name, target in DEV_LINKS.items():
        os.symlink(target, dev / name)
    (dev / "pts").mkdir()
    (dev / "shm").mkdir()
    os.chmod(dev / "shm", 0o1777)


def _shift_ids(root: Path) -> None:
    """Give the skeleton to the sandbox's ids (host 0 -> 100000, 1000 -> 101000)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if st.st_uid < ID_COUNT and st.st_gid < ID_COUNT:
                os.lchown(p, st.st_uid + ID_SHIFT, st.st_gid + ID_SHIFT)


def _protect(pid: int) -> None:
    # the agent must outlive an OOM inside its own sandbox; the memory bomb is what should die
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass


async def read_to_eof(fd: int, timeout: float) -> bytes:
    """Everything written to the pipe ``fd`` until its writers close it, read by the event loop itself.

    Not a blocking read in the default executor: that pool has min(32, cores + 4) threads, six on a 2-core machine,
    and each read holds its thread until its sandbox is up, so 128 sandboxes booting at once (an RL iteration's
    episodes) queued behind six and the last ones timed out before their read began (half of an iteration's
    episodes failed that way); and a read that timed out stayed blocked in its thread on a number the caller then
    closed and the process could reuse for another pipe."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    done: asyncio.Future[bytes] = loop.create_future()
    parts: list[bytes] = []

    def readable() -> None:
        try:
            part = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as e:
            loop.remove_reader(fd)
            if not done.done():
                done.set_exception(e)
            return
        if part:
            parts.append(part)
            return
        loop.remove_reader(fd)
        if not done.done():
            done.set_result(b"".join(parts))

    loop.add_reader(fd, readable)
    try:
        return await asyncio.wait_for(done, timeout)
    finally:
        loop.remove_reader(fd)


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return " | ".join((errors or lines)[-6:])
