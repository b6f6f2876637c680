"""A real sandbox server (``python -m envs.sandbox serve``) started by the tests, driven by the e2b SDK."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .sandboxes import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
CG = Path("/sys/fs/cgroup")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    state: Path
    proc: subprocess.Popen
    log: Path

    @property
    def tag(self) -> str:
        return "rlk3-sbx-" + hashlib.sha1(str(self.state.resolve()).encode()).hexdigest()[:8]

    def rec(self, sid: str) -> dict:
        return json.loads((self.state / "registry" / "sandboxes" / f"{sid}.json").read_text())

    def leaves(self, sid: str) -> list[Path]:
        v2 = CG / "unified" if (CG / "unified" / "cgroup.procs").exists() else CG
        return [v2 / self.tag / sid, *(CG / c / self.tag / sid for c in ("memory", "pids", "cpu", "cpuacct"))]

    def cgroup_procs(self, sid: str) -> set[int]:
        out: set[int] = set()
        for leaf in self.leaves(sid):
            if (leaf / "cgroup.procs").exists():
                out.update(int(x) for x in (leaf / "cgroup.procs").read_text().split())
        return out

    def cpu_usec(self, sid: str) -> int:
        v2 = CG / "unified" if (CG / "unified" / "cgroup.procs").exists() else CG
        stat = (v2 / self.tag / sid / "cpu.stat").read_text()
        return int(next(line.split()[1] for line in stat.splitlines() if line.startswith("usage_usec")))

    def sandbox_mounts(self) -> list[str]:
        """Mounts of sandbox disks visible on the host (the server's own disk mount excluded)."""
        disk = str((self.state / "disk").resolve())
        with open("/proc/self/mountinfo") as f:
            return [ln.split()[4] for ln in f if ln.split()[4].startswith(disk + "/")]

    def runsc_files(self, sid: str) -> list[Path]:
        """runsc's records (state, lock, control socket) of the gVisor containers of sandbox ``sid``."""
        root = Path("/run") / self.tag / "gv"
        return [p for p in root.glob(f"*{sid}-*")] if root.exists() else []

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def backends(self) -> list[str]:
        return self.health()["backends"]

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": "test"}, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(state: Path, *extra: str) -> Server:
    port = _free_port()
    log = state.parent / f"{state.name}-server-{port}.log"
    logf = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "envs.sandbox",
            "serve",
            "--port",
            str(port),
            "--state",
            str(state),
            "--disk-gb",
            "16",
            *extra,
        ],
        cwd=ROOT,
        stdout=logf,
        stderr=subprocess.STDOUT,
    )
    logf.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sandbox server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sandbox server did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return Server(url, state, proc, log)


def kill_all(server: Server) -> None:
    with server.api() as c:
        for s in c.get("/v2/sandboxes", params={"limit": 1000}).json():
            c.delete(f"/sandboxes/{s['sandboxID']}")


@pytest.fixture(scope="package")  # stopped (with its warm pools) before the rest of the suite runs
def server(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the sandbox tests need root (namespaces, cgroups, mounts): run them as root, as CI does")
    state = tmp_path_factory.mktemp("sbx") / "state"
    srv = start_server(state)
    os.environ.update(E2B_API_KEY="rlk3-test", E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url)
    yield srv
    kill_all(srv)
    srv.stop()
    # the server must leave nothing behind: no cgroup of its own, no mount of its disk
    leftovers = [
        p for c in ("unified", "memory", "pids", "cpu", "cpuacct") if (p := CG / c / srv.tag).exists()
    ]
    assert not leftovers, f"cgroups left behind: {leftovers}"
    assert not srv.sandbox_mounts()


@pytest.fixture(params=BACKENDS)
def backend(request, server) -> str:
    """Runs a test once per backend; each sandbox asks for its backend through its metadata."""
    if request.param not in server.backends():
        pytest.fail(
            f"the {request.param} backend is not available on this machine: run `make system` "
            f"(scripts/setup.d/sandbox.sh installs bubblewrap and unpacks runsc into .cache/runsc)"
        )
    return request.param


@pytest.fixture
def server_factory():
    """Start extra servers (e.g. to restart one on the same state); each is stopped at the end."""
    started: list[Server] = []

    def start(state: Path, *extra: str) -> Server:
        srv = start_server(state, *extra)
        started.append(srv)
        return srv

    start.kill_all = kill_all
    yield start
    for srv in started:
        if srv.proc.poll() is None:
            kill_all(srv)
            srv.stop()
