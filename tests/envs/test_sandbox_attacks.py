"""Issue 4, item 3: attacks from inside a sandbox fail and leave the host unaffected.

Network tests aim only at a listener this test opens on the host's loopback; nothing else is ever a target.
Every attack runs on both backends (the ``sandbox`` fixture is parametrized over bwrap and gVisor); where
gVisor contains an attack differently (its own process limit, its whole-sandbox OOM), the test says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from e2b import AsyncSandbox, CommandExitException, SandboxException

from .sandboxes import on


def run(coro):
    return asyncio.run(coro)


async def sh(sbx: AsyncSandbox, cmd: str, *, user: str = "root", timeout: float = 60):
    """Run and return (exit code, stdout+stderr) whether or not it failed."""
    try:
        r = await sbx.commands.run(cmd, user=user, timeout=timeout)
        return r.exit_code, r.stdout + r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout + e.stderr


@pytest.fixture
def sandbox(server, backend):
    sbx = run(AsyncSandbox.create(metadata=on(backend)))
    yield sbx
    run(AsyncSandbox.kill(sbx.sandbox_id))


def test_network_egress_to_a_host_loopback_listener_fails(server, sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        _code, out = run(
            sh(
                sandbox,
                f"""python3 - <<'EOF'
import socket
for kind in ("tcp", "udp"):
    try:
        if kind == "tcp":
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.sendto(b"x", ("127.0.0.1", {port}))
        print(kind, "sent")
    except OSError as e:
        print(kind, "failed", e)
EOF
ls /sys/class/net 2>/dev/null || cat /proc/net/dev; echo routes; tail -n +2 /proc/net/route""",
            )
        )
        assert "tcp failed" in out, out  # its own loopback has no listener: the host's is unreachable
        with pytest.raises(TimeoutError):
            listener.accept()  # and nothing arrived on the host
        assert "eth" not in out and "ens" not in out  # only a loopback device
        assert out.strip().endswith("routes")  # no route anywhere
    finally:
        listener.close()


def test_cannot_read_or_write_host_files_server_state_or_other_sandboxes(server, sandbox):
    async def go():
        other = await AsyncSandbox.create()
        try:
            await other.files.write("/home/user/secret.txt", "other sandbox's secret")
            host_state = str(server.state)
            core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
            _, out = await sh(
                sandbox,
                f"""
cat /etc/shadow; ls {host_state}; ls /work; ls /root/.cache; ls /tmp/pytest-of-root
grep -rl "other sandbox's secret" /home /tmp /root /var /opt /run /mnt /srv /etc 2>/dev/null
for p in /proc/[0-9]*; do ls $p/root/home/user 2>/dev/null; done | grep secret
echo pwn > /usr/bin/rlk3-pwn; touch /usr/lib/rlk3-pwn; echo '|/tmp/pwn' > /proc/sys/kernel/core_pattern
umount /usr; mount -o remount,rw /usr; echo done""",
            )
            assert "No such file" in out and "Read-only file system" in out
            assert "secret" not in out.replace("secret.txt", "")
            assert not os.path.exists("/usr/bin/rlk3-pwn") and not os.path.exists("/usr/lib/rlk3-pwn")
            assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern
            assert out.startswith("done")  # stdout (the last echo ran) comes before stderr
            # /usr is still mounted read-only inside: the umount and the remount failed
            _code, out = await sh(sandbox, "touch /usr/x 2>&1; grep ' /usr ' /proc/self/mounts")
            assert "Read-only" in out and " ro," in out
        finally:
            await other.kill()

    run(go())


def test_files_api_paths_cannot_escape(server, sandbox):
    async def go():
        passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
        registry = server.state / "registry"
        before = set(os.listdir(registry / "sandboxes"))
        # ../ and absolute paths resolve inside the sandbox's own root
        await sandbox.files.write("../../../../../../etc/passwd", "sandbox-local\n")
        assert await sandbox.files.read("/etc/passwd") == "sandbox-local\n"
        await sandbox.files.write(str(registry / "sandboxes" / "pwn.json"), "{}")
        # a symlink pointing at host-provided files ends in a read-only mount
        await sandbox.commands.run(
            "ln -s /usr/bin/python3 /home/user/py; ln -s /proc/1/root/usr/lib /home/user/l"
        )
        for target in ("/home/user/py", "/home/user/l/pwn"):
            with pytest.raises(SandboxException):
                await sandbox.files.write(target, "overwritten")
        assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd
        assert set(os.listdir(registry / "sandboxes")) == before
        assert Path("/usr/bin/python3").read_bytes()[:4] == b"\x7fELF"

    run(go())


def test_fork_bomb_is_capped_by_the_pids_limit(server, sandbox, backend):
    async def go():
        bystander = await AsyncSandbox.create()
        try:
            sid = sandbox.sandbox_id
            await sandbox.commands.run("bash -c ':(){ :|:& };:' >/dev/null 2>&1 &", user="root", timeout=10)
            await asyncio.sleep(2)
            pids_max = int((server.leaves(sid)[2] / "pids.max").read_text())
            assert len(server.cgroup_procs(sid)) <= pids_max
            if backend == "bwrap":
                assert int((server.leaves(sid)[2] / "pids.events").read_text().split()[1]) > 0  # the limit bit
            else:
                # gVisor: the Sentry holds the guest to RLIMIT_NPROC (a fork fails with EAGAIN inside); the
                # host limit, set far above it, is never reached (a Sentry refused a host task would panic)
                # and the Sentry is still there
                await asyncio.sleep(1)
                assert int((server.leaves(sid)[2] / "pids.events").read_text().split()[1]) == 0
                sentry = [p for p in server.cgroup_procs(sid) if _cmdline(p).startswith(b"runsc-sandbox")]
                assert sentry, "the Sentry died"
            # the host and the other sandboxes are unaffected
            assert subprocess.run(["true"]).returncode == 0
            assert (await bystander.commands.run("echo fine")).stdout == "fine\n"
            assert await sandbox.kill()
            assert not server.cgroup_procs(sid)
        finally:
            await bystander.kill()

    run(go())


_FORCED_CHARGE_SLACK = 64 * 4096


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_memory_bomb_is_oom_killed_inside_only(server, sandbox, backend):
    async def go():
        sid = sandbox.sandbox_id
        memcg = server.leaves(sid)[1]
        bystander = await AsyncSandbox.create()
        bomb = "python3 -c 'a=[]\nwhile True: a.append(bytearray(64 << 20))'"
        try:
            if backend == "bwrap":
                code, _out = await sh(sandbox, bomb, timeout=60)
                assert code != 0  # killed by the sandbox's own OOM killer
                oom = (memcg / "memory.oom_control").read_text()
                assert int(next(ln.split()[1] for ln in oom.splitlines() if ln.startswith("oom_kill "))) >= 1
                assert (await sandbox.commands.run("echo still-alive")).stdout == "still-alive\n"
            else:
                # gVisor has no OOM killer of its own. When the Sentry's memory file cannot grow past the
                # cgroup limit the guest gets ENOMEM (the bomb fails, the sandbox lives); when the limit is
                # hit on a page fault instead, the host's OOM killer takes the Sentry and the whole sandbox
                try:
                    code, _out = await sh(sandbox, bomb, timeout=60)
                    assert code != 0
                    assert (await sandbox.commands.run("echo still-alive")).stdout == "still-alive\n"
                except SandboxException:  # the Sentry is gone (polled: the stream can end before it is reaped)
                    for _ in range(100):
                        if not [p for p in server.cgroup_procs(sid) if _cmdline(p).startswith(b"runsc-sandbox")]:
                            break
                        await asyncio.sleep(0.1)
                    else:
                        raise AssertionError("the sandbox's stream failed but its Sentry lives on")
            # either way the sandbox never held more than its limit, and the others are unaffected. The
            # kernel force-charges a task that is already dying (an OOM victim, or one with SIGKILL
            # pending) past the limit rather than fail its allocation: at most one charge batch
            # (MEMCG_CHARGE_BATCH = 64 pages). CI saw one page over when the Sentry was killed; a
            # limit that was not enforced would be overrun by the 64 MiB allocations themselves.
            peak = int((memcg / "memory.max_usage_in_bytes").read_text())
            limit = int((memcg / "memory.limit_in_bytes").read_text())
            assert peak <= limit + _FORCED_CHARGE_SLACK, f"peak {peak} B over the {limit} B limit"
            assert (await bystander.commands.run("echo fine")).stdout == "fine\n"
        finally:
            await bystander.kill()

    run(go())


def test_disk_fill_stops_at_the_quota(server, sandbox):
    async def go():
        free_before = shutil.disk_usage("/").free
        _code, out = await sh(
            sandbox, "dd if=/dev/zero of=/home/user/fill bs=1M count=3000 2>&1; sync", timeout=120
        )
        assert "Disk quota exceeded" in out or "No space left" in out, out
        size = int((await sandbox.commands.run("stat -c %s /home/user/fill")).stdout)
        assert size <= (1024 + 64) << 20  # the template's 1 GiB quota (plus btrfs slack)
        assert free_before - shutil.disk_usage("/").free < 1200 << 20
        await sandbox.commands.run("rm /home/user/fill && echo x > /home/user/after")
        assert await sandbox.files.read("/home/user/after") == "x\n"

    run(go())


def test_proc_and_ptrace_cannot_reach_host_processes(server, sandbox):
    async def go():
        server_pid = server.proc.pid
        _code, out = await sh(
            sandbox,
            f"""
ls /proc | grep -E '^[0-9]+$' | wc -l; test -e /proc/{server_pid} && echo SEES-SERVER
kill -9 {server_pid} 2>&1; echo kill=$?
python3 -c "import ctypes; l=ctypes.CDLL(None, use_errno=True); \\
  print('ptrace', l.ptrace(16, {server_pid}, 0, 0), ctypes.get_errno())"
cat /proc/1/cmdline | tr '\\0' ' '""",
            user="user",
        )
        assert "SEES-SERVER" not in out
        assert "kill=1" in out  # no such process in its PID namespace
        assert "ptrace -1 3" in out or "ptrace -1 1" in out  # ESRCH (not visible) or EPERM
        assert int(out.split()[0]) < 20  # only the sandbox's own processes are visible
        assert server.proc.poll() is None  # the server is alive

    run(go())


def test_no_process_survives_kill(server, backend):
    async def go():
        sbx = await AsyncSandbox.create(metadata=on(backend))
        sid = sbx.sandbox_id
        marker = f"rlk3-survivor-{sid}"
        await sbx.commands.run(
            f"""nohup setsid bash -c 'trap "" TERM HUP INT; exec -a {marker} sleep 1000' >/dev/null 2>&1 &
            (setsid bash -c 'exec -a {marker} sleep 1001' &) ; sleep 0.2""",
            user="root",
            timeout=10,
        )
        inside = (await sbx.commands.run(f"pgrep -f {marker} | wc -l")).stdout.strip()
        assert int(inside) >= 2
        host = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        # bwrap: the sandbox's processes are host processes; gVisor: they exist only inside the Sentry
        assert (len(host) >= 2) == (backend == "bwrap")
        runsc = server.cgroup_procs(sid)
        assert await sbx.kill()
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        assert left == []
        assert not any(os.path.exists(f"/proc/{p}") for p in runsc)  # nor the Gofer, Sentry or stubs

    run(go())


def test_agent_socket_refuses_impostors(server, sandbox, backend):
    async def go():
        if backend == "gvisor":  # the socket's directory is root's only: a user cannot even reach it
            _code, out = await sh(sandbox, "ls /run/rlk3/ 2>&1", user="user")
            assert "Permission denied" in out
        _code, out = await sh(
            sandbox,
            """python3 - <<'EOF'
import socket, struct, json
s = socket.socket(socket.AF_UNIX); s.connect("/run/rlk3/agent.sock")
h = json.dumps({"ev": "hello", "sid": "x", "procs": []}).encode()
try:
    s.sendall(struct.pack(">II", len(h), 0) + h)
    print("closed" if s.recv(10) == b"" else "answered")
except (BrokenPipeError, ConnectionResetError):
    print("closed")
EOF""",
        )
        assert "closed" in out
        assert (await sandbox.commands.run("echo ok")).stdout == "ok\n"

    run(go())
