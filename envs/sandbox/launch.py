"""Start this repository's sandbox server as a child process (the driver's "sandbox service per node").

    with LocalServer(state_dir) as srv:          # or srv = LocalServer(...).start(); ...; srv.stop()
        client = SandboxClient(SandboxSettings.local(srv.url))

The server runs in its own process (it is a subreaper for CRIU restores and owns cgroups and mounts); this
wrapper picks a free port, waits for ``/health``, and on ``stop`` asks it to exit (SIGTERM: it kills its sandboxes
and unmounts), then kills it if it does not.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started the server dies (a killed rollout worker
    or driver must not leave its sandbox server running and holding the state directory)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(
        self,
        state: str | Path,
        *,
        port: int | None = None,
        disk_gb: int = 16,
        pool: int | None = None,
        extra: tuple[str, ...] = (),
        start_timeout_s: float = 120.0,
    ) -> None:
        self.state = Path(state)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--state", str(self.state), "--disk-gb", str(disk_gb), *extra]
        if pool is not None:
            self.args += ["--pool", str(pool)]
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log = self.state.parent / f"{self.state.name}-server-{self.port}.log"

    def start(self) -> LocalServer:
        self.state.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "envs.sandbox", "serve", *self.args],
                cwd=ROOT,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
            )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sandbox server did not answer /health in {self.start_timeout_s:.0f} s:\n"
                                   f"{self.tail()}")
            time.sleep(0.1)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> LocalServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
