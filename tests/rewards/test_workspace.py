"""The local bwrap workspace enforces what graders rely on: no network, read-only system, memory / pids /
time / output limits, forks that do not write back, and host-side file access that follows no symlink."""

import os
from pathlib import Path

import pytest

from rewards.workspace import Limits, LocalSandboxes, _gpu_binds, bwrap_available, tree_hash

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="needs bubblewrap (scripts/setup.d/graders.sh)")


@pytest.fixture
def ws(tmp_path):
    sandboxes = LocalSandboxes(tmp_path)
    return sandboxes.open(sandboxes.create({"hello.txt": "hi"}))


def py(ws, code, **lim):
    return ws.exec(["python3", "-I", "-c", code], limits=Limits(**lim) if lim else None)


def test_runs_in_workspace_with_files(ws):
    r = py(ws, "print(open('hello.txt').read())")
    assert r.exit_code == 0 and r.stdout == b"hi\n"


def test_no_network(ws):
    r = py(ws, "import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('1.1.1.1', 80)))")
    assert r.exit_code == 0 and int(r.stdout) != 0  # unreachable: the sandbox has only its own loopback


def test_system_is_read_only_and_host_is_hidden(ws):
    r = ws.exec(["sh", "-c", "touch /usr/x 2>&1; ls /work /home 2>&1 | head -2; echo done"])
    assert b"Read-only file system" in r.stdout and b"done" in r.stdout
    assert b"wt-" not in r.stdout  # the repository and other worktrees are not visible


def test_memory_limit_kills(ws):
    r = py(ws, "x = bytearray(600 << 20)\nprint('allocated')", memory_mb=200)
    assert r.exit_code != 0 and b"allocated" not in r.stdout
    assert r.oom_killed


def test_wall_timeout_kills_the_whole_tree(ws):
    r = ws.exec(["sh", "-c", "sleep 30 & sleep 30"], limits=Limits(timeout_s=1))
    assert r.timed_out and r.wall_s < 15


def test_output_is_capped(ws):
    r = py(ws, "import sys\nsys.stdout.write('x' * (20 << 20))", max_output_bytes=1000)
    assert r.truncated and len(r.stdout) == 1000


def test_pids_limit(ws):
    code = (
        "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
        "    n += 1\nprint(n)"
    )
    r = py(ws, code, pids=32, timeout_s=20)
    assert 0 < int(r.stdout) < 32  # the fork bomb stops at the cgroup's pids.max


def test_cgroups_created_are_removed(ws):
    py(ws, "print(1)", memory_mb=100)
    own = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line]
    if own:
        base = Path("/sys/fs/cgroup/memory") / own[0].lstrip("/")
        assert not list(base.glob(f"rlk3-graders-{os.getpid()}*"))


def test_fork_does_not_write_back(ws):
    before = tree_hash(ws)
    child = ws.fork()
    child.exec(["sh", "-c", "echo changed > hello.txt; touch new.txt"])
    assert child.read_file("hello.txt") == b"changed\n"
    assert tree_hash(ws) == before
    child.close()
    assert not child.root.exists()


def test_host_side_access_refuses_planted_symlinks(ws):
    os.symlink("/etc", ws.root / "tests")
    with pytest.raises(PermissionError):
        ws.write_file("tests/passwd", "owned")
    with pytest.raises(PermissionError):
        ws.read_file("tests/hostname")
    with pytest.raises(ValueError):
        ws.write_file("../escape.txt", "x")


def test_gpu_binds_name_every_nvidia_node(tmp_path):
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    args = _gpu_binds(str(tmp_path))
    bound = [args[i + 2] for i in range(0, len(args), 3)]
    assert args[0::3] == ["--dev-bind"] * 4
    assert bound == ["/dev/nvidia-caps", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]
    assert _gpu_binds(str(tmp_path / "none")) == []


def test_gpu_is_off_by_default(ws):
    r = ws.exec(["sh", "-c", "ls /dev"])
    assert b"nvidia" not in r.stdout
