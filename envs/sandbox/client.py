"""rlk3's side of the sandbox: the public ``e2b`` SDK, configured by two URLs.

The same rollout code runs against this repository's server, E2B's cloud, or an AgentENV deployment:

    local server   SandboxSettings(api_url="http://127.0.0.1:3000", sandbox_url="http://127.0.0.1:3000")
    E2B cloud      SandboxSettings(api_url=None, sandbox_url=None, api_key="e2b_...")   (the SDK's defaults)
    AgentENV       SandboxSettings(api_url="http://agentenv:PORT", sandbox_url="http://agentenv:PORT")

:class:`SandboxClient` is the ``Sandbox`` contract of DESIGN.md §3 (create, exec, files, pause, resume,
snapshot, fork, kill) as thin calls into ``e2b.AsyncSandbox``; nothing here talks HTTP itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from e2b import AsyncSandbox, CommandExitException


@dataclass(frozen=True)
class SandboxSettings:
    api_url: str | None = None  # REST API; None: the SDK's default (E2B cloud, or $E2B_API_URL)
    sandbox_url: str | None = None  # envd API; None: per-sandbox cloud hosts (or $E2B_SANDBOX_URL)
    api_key: str | None = None  # None: $E2B_API_KEY; a local server accepts any key
    request_timeout: float = 60.0
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def local(cls, url: str) -> SandboxSettings:
        """This repository's server: REST and envd share one port."""
        return cls(api_url=url, sandbox_url=url, api_key=os.environ.get("E2B_API_KEY", "rlk3-local"))

    def opts(self) -> dict:
        out: dict = {"request_timeout": self.request_timeout}
        if self.api_url:
            out["api_url"] = self.api_url
        if self.sandbox_url:
            out["sandbox_url"] = self.sandbox_url
        if self.api_key:
            out["api_key"] = self.api_key
        if self.headers:
            out["headers"] = dict(self.headers)
        return out


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


class SandboxClient:
    """DESIGN.md's ``Sandbox`` contract over the e2b SDK; sandboxes are named by their id."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self._open: dict[str, AsyncSandbox] = {}

    async def _sbx(self, sid: str) -> AsyncSandbox:
        if sid not in self._open:
            self._open[sid] = await AsyncSandbox.connect(sid, **self.settings.opts())
        return self._open[sid]

    async def create(
        self,
        template: str = "base",
        *,
        timeout: int = 600,
        metadata: dict | None = None,
        envs: dict | None = None,
    ) -> str:
        sbx = await AsyncSandbox.create(
            template, timeout=timeout, metadata=metadata, envs=envs, **self.settings.opts()
        )
        self._open[sbx.sandbox_id] = sbx
        return sbx.sandbox_id

    async def exec(
        self, sid: str, cmd: str, timeout: float = 60, *, user: str | None = None, cwd: str | None = None
    ) -> ExecResult:
        sbx = await self._sbx(sid)
        try:
            r = await sbx.commands.run(cmd, timeout=timeout, user=user, cwd=cwd)
        except CommandExitException as e:  # a non-zero exit is a result for an agent, not an error
            return ExecResult(e.exit_code, e.stdout, e.stderr)
        return ExecResult(r.exit_code, r.stdout, r.stderr)

    async def write(self, sid: str, path: str, data: str | bytes) -> None:
        await (await self._sbx(sid)).files.write(path, data)

    async def read(self, sid: str, path: str) -> bytes:
        return bytes(await (await self._sbx(sid)).files.read(path, format="bytes"))

    async def list(self, sid: str, path: str) -> list[str]:
        return [e.name for e in await (await self._sbx(sid)).files.list(path)]

    async def pause(self, sid: str, *, memory: bool = True) -> bool:
        sbx = await self._sbx(sid)
        return await sbx.pause(mode="full" if memory else "filesystem")

    async def resume(self, sid: str, *, timeout: int | None = None) -> None:
        self._open[sid] = await AsyncSandbox.connect(sid, timeout=timeout, **self.settings.opts())

    async def snapshot(self, sid: str, name: str | None = None) -> str:
        return (await (await self._sbx(sid)).create_snapshot(name)).snapshot_id

    async def fork(self, sid: str, n: int) -> list[str]:
        children = await (await self._sbx(sid)).fork(count=n)
        ids = []
        for c in children:
            if isinstance(c, Exception):
                raise c
            self._open[c.sandbox_id] = c
            ids.append(c.sandbox_id)
        return ids

    async def kill(self, sid: str) -> bool:
        sbx = self._open.pop(sid, None)
        if sbx is None:
            return await AsyncSandbox.kill(sid, **self.settings.opts())
        return await sbx.kill()
