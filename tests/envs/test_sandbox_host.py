"""The host-side choices that make pause, resume and fork fast (docs/sandbox.md, "Where the time goes"), and
what a sandbox still has because of them: a /dev without a tmpfs (CRIU tars a tmpfs on every dump and restore)
that works as bwrap's did, a devpts of its own, loopback up after a restore (the compiled CRIU hook), and cgroup2
mounted with ``favordynmods`` by the server (a migration otherwise waits for an RCU grace period)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2b import AsyncSandbox

from .conftest import ROOT
from .sandboxes import on

DEV_CHECK = """set -e
echo x > /dev/null
test "$(head -c 16 /dev/urandom | wc -c)" = 16
test "$(head -c 4 /dev/zero | od -An -tx1 | tr -d ' ')" = 00000000
python3 -c 'import os, pty; m, s = pty.openpty(); os.write(s, b"hi"); print(os.ttyname(s), os.read(m, 2).decode())'
ls -l /dev/fd/ > /dev/null && echo fd-ok
echo shared > /dev/shm/x && cat /dev/shm/x
ip -o link show lo | grep -q 'state UNKNOWN\\|UP' && echo lo-up
"""


def test_dev_works_and_survives_a_memory_pause(server, backend):
    async def go():
        sbx = await AsyncSandbox.create(metadata=on(backend))
        try:
            for _ in range(2):  # as booted, then as CRIU (or runsc) restored it
                r = await sbx.commands.run(DEV_CHECK)
                lines = r.stdout.split("\n")
                assert lines[0].startswith("/dev/pts/") and lines[0].endswith(" hi"), r.stdout
                assert lines[1:4] == ["fd-ok", "shared", "lo-up"], r.stdout
                assert await sbx.pause()
                await AsyncSandbox.connect(sbx.sandbox_id)
            if backend == "bwrap":
                # no tmpfs under /dev: only the device nodes and the sandbox's devpts are mounts there
                mounts = (await sbx.commands.run("cat /proc/self/mountinfo")).stdout.splitlines()
                under_dev = {
                    ln.split()[4]: ln.split(" - ")[1].split()[0] for ln in mounts if ln.split()[4].startswith("/dev")
                }
                assert "/dev" not in under_dev, under_dev
                assert under_dev["/dev/pts"] == "devpts", under_dev
                assert {under_dev[f"/dev/{n}"] for n in ("null", "zero", "urandom")} == {"devtmpfs"}, under_dev
        finally:
            await sbx.kill()

    asyncio.run(go())


def test_criu_restores_run_the_compiled_hook(server):
    hook = Path("/run") / server.tag / "criu-restore-hook"
    assert (ROOT / ".cache" / "criu" / "restore-hook").is_file(), "scripts/setup.d/sandbox.sh builds it"
    assert hook.read_bytes()[:4] == b"\x7fELF", "the server fell back to the shell hook"


MOUNT_FLAGS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "relatime": 1 << 21}


def _cgroup2() -> tuple[Path, list[str]]:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, opts, *_ = line.split()
        if fstype == "cgroup2":
            return Path(target), opts.split(",")
    raise AssertionError("no cgroup2 mount")


def test_the_server_mounts_cgroup2_with_favordynmods(tmp_path, server_factory):
    target, opts = _cgroup2()
    # take the option away (a mount(2) remount whose data leaves it out clears it, keeping every other option),
    # then a starting server must put it back
    flags = 32  # MS_REMOUNT
    for opt, bit in MOUNT_FLAGS.items():
        flags |= bit if opt in opts else 0
    data = ",".join(o for o in opts if o not in MOUNT_FLAGS and o not in ("rw", "favordynmods"))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(None, str(target).encode(), None, flags, data.encode()) == 0, ctypes.get_errno()
    assert "favordynmods" not in _cgroup2()[1]
    server_factory(tmp_path / "state")
    assert "favordynmods" in _cgroup2()[1]
    assert [o for o in _cgroup2()[1] if o != "favordynmods"] == [o for o in opts if o != "favordynmods"]


def test_boot_reads_its_pipe_without_a_thread_and_a_timed_out_read_reads_nothing_later():
    """A sandbox's boot reads bwrap's info pipe on the event loop (``read_to_eof``): with the default executor's
    only thread busy the read still completes (the pool has six threads on two cores, and 128 boots at once had
    queued behind them and timed out), and a read that timed out is gone, so a pipe that reuses its number is not
    read by it."""
    import concurrent.futures
    import threading

    from envs.sandbox.bwrap import read_to_eof

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait, 30)  # the pool's one thread, held
        try:
            r, w = os.pipe()

            async def write_later():
                for part in (b'{"child-pid": ', b"4242}"):
                    await asyncio.sleep(0.05)
                    os.write(w, part)
                os.close(w)

            got, _ = await asyncio.gather(read_to_eof(r, 5), write_later())
            os.close(r)
            assert got == b'{"child-pid": 4242}'

            r, w = os.pipe()
            with pytest.raises(TimeoutError):
                await read_to_eof(r, 0.1)
            os.close(r)
            os.close(w)
            r2, w2 = os.pipe()  # most likely the numbers just freed
            os.write(w2, b"for someone else")
            await asyncio.sleep(0.1)  # a reader left behind would run now and take the bytes
            os.set_blocking(r2, False)
            assert os.read(r2, 100) == b"for someone else"
            os.close(r2)
            os.close(w2)
        finally:
            gate.set()
            await busy

    asyncio.run(go())


MAX_STARTING_CHECK = """
import asyncio, os, sys
from pathlib import Path
from envs.sandbox.runtime import Live, Manager

state = Path(sys.argv[1])
m = Manager(state / "state", max_starting=3)
assert Manager(state / "other").max_starting == max(4, 2 * (os.cpu_count() or 1))
try:
    Manager(state / "bad", max_starting=-2)
    raise SystemExit("max_starting=-2 was accepted")
except ValueError as e:
    assert "max_starting must be >= 1" in str(e), e
now, peak = 0, 0

async def start(live, image):  # stands in for the boot only: what is under test is who may start when
    global now, peak
    now += 1
    peak = max(peak, now)
    await asyncio.sleep(0.01)
    now -= 1

m._start = start

async def go():
    await asyncio.gather(*(m._launch(Live(None)) for _ in range(40)))

asyncio.run(go())
print(peak, now)
"""


def test_starts_wait_their_turn_beyond_max_starting(tmp_path):
    """At most ``max_starting`` sandboxes boot or restore at once (``Manager._launch``); the rest wait for a slot,
    so each start's own timeouts measure that start. Without the limit, 256 creates side by side on two busy cores
    failed a quarter to a half of them at bwrap's 10-s report timeout (docs/sandbox.md, "Starting many at once").

    In a process of its own: a Manager makes its process a child subreaper whose thread reaps *every* child, which
    in the test process would take the exit statuses of every later test's subprocesses (asyncio reports 255)."""
    r = subprocess.run([sys.executable, "-c", MAX_STARTING_CHECK, str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "0"], r.stdout  # the peak is the limit, and every start finished


def test_a_stopped_server_gives_its_disk_images_free_space_back(tmp_path, server_factory):
    """The state's sparse btrfs image keeps every block it ever wrote until a discard punches holes; the server
    trims it before unmounting (``release_disk``), so a finished run leaves only what is still stored (one RL
    run's image had kept 3-7 GB of sandboxes long gone)."""
    srv = server_factory(tmp_path / "state", "--pool", "0")
    image = tmp_path / "state" / "disk.img"

    def allocated() -> int:
        return image.stat().st_blocks * 512

    async def go():
        sbx = await AsyncSandbox.create(api_key="x", api_url=srv.url, sandbox_url=srv.url)
        await sbx.commands.run("head -c 300000000 /dev/urandom > /home/user/big && sync")
        await sbx.kill()

    before = allocated()
    asyncio.run(go())
    grown = allocated()
    assert grown - before > 250 << 20, (before, grown)  # the file really went into the image
    srv.stop()  # 0.8 s here: a commit wakes btrfs's cleaner, the deleted subvolumes are freed, then the trim
    assert allocated() < grown - (250 << 20), (before, grown, allocated())
