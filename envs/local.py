"""Scratch directories on this machine behind the harness's ``SandboxAPI`` (exec / read / write / list).

**No isolation at all**: commands run as the calling user in a temporary directory. This exists for one job:
replaying *trusted* reference solutions quickly to build SFT demonstrations (thousands of short episodes, where
starting real sandboxes would dominate the time). Model output never runs here; the agent loop and the graders
always use real sandboxes (``envs.sandbox``).

The harness addresses files under its working directory (``/home/user`` by default); paths and commands are
rewritten onto the scratch directory, so tool outputs match what the same commands print in a sandbox.

``python3`` in a command is the first *binary* ``python3`` on the PATH (else the interpreter running this code),
never a version manager's shim: pyenv's is a shell script that runs ``pyenv`` first, and each call then cost ~10x
the CPU of a plain start (measured here: ~120 ms against ~12 ms), where the demonstrations of one SFT run make
about a thousand such calls.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


def _binary_python3() -> str:
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = Path(d or ".") / "python3"
        try:
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF" and os.access(p, os.X_OK):
                    return str(p)
        except OSError:
            continue
    return sys.executable


@dataclass
class LocalResult:
    exit_code: int
    stdout: str
    stderr: str


class LocalWorkdirs:
    def __init__(self, workdir: str = "/home/user", root: str | Path | None = None) -> None:
        self.workdir = workdir.rstrip("/")
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="rlk3-local-")) if root is None else Path(root)
        self._ids = itertools.count()
        self.dirs: dict[str, Path] = {}
        self._bin = Path(tempfile.mkdtemp(prefix="rlk3-local-bin-"))
        (self._bin / "python3").symlink_to(_binary_python3())
        self._env = {**os.environ, "PATH": f"{self._bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def create(self, files: dict[str, str] | None = None) -> str:
        sid = f"local-{next(self._ids)}"
        d = self.root / sid
        d.mkdir(parents=True)
        self.dirs[sid] = d
        for rel, text in (files or {}).items():
            p = self._path(sid, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return sid

    def kill(self, sid: str) -> None:
        shutil.rmtree(self.dirs.pop(sid), ignore_errors=True)

    def close(self) -> None:
        for sid in list(self.dirs):
            self.kill(sid)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self._bin, ignore_errors=True)

    def _path(self, sid: str, path: str) -> Path:
        d = self.dirs[sid]
        if path.startswith(self.workdir + "/") or path == self.workdir:
            path = path[len(self.workdir) :].lstrip("/")
        p = (d / path).resolve()
        if d.resolve() not in (p, *p.parents):
            raise PermissionError(f"path {path!r} leaves the scratch directory")
        return p

    async def exec(self, sid: str, cmd: str, timeout: float = 60) -> LocalResult:
        cmd = cmd.replace(self.workdir, str(self.dirs[sid]))
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", cmd, cwd=self.dirs[sid], env=self._env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return LocalResult(-1, "", f"timed out after {timeout} s")
        return LocalResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    async def read(self, sid: str, path: str) -> bytes:
        return self._path(sid, path).read_bytes()

    async def write(self, sid: str, path: str, data: str | bytes) -> None:
        p = self._path(sid, path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    async def list(self, sid: str, path: str) -> list[str]:
        return sorted(e.name for e in self._path(sid, path).iterdir())
