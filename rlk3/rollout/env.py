"""Everything an agent loop needs around the engine: harnesses per domain, the sandbox service, the graders.

``RolloutEnv`` starts this repository's sandbox server (unless ``sandbox_url`` points at one: E2B's cloud, an
AgentENV fleet, a server per node started by the driver), connects the e2b SDK client the tools use, and builds
the grading with a sandbox provider on the same server, so graders fork the episode's sandbox for judging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

from harness import Harness
from rlk3.rollout.agent_loop import AgentLoop, E2BEpisodeSandboxes, EngineFront, LoopConfig
from rlk3.rollout.demos import DOMAIN_PRESETS
from rlk3.rollout.grading import Grading


class RolloutEnv:
    def __init__(
        self,
        tokenizer,
        *,
        domains: tuple[str, ...] = ("general", "agentic", "coding"),
        presets: dict[str, str] | None = None,
        sandbox_url: str | None = None,
        sandbox_api_key: str | None = None,
        state_dir: str | Path | None = None,
        compose: str = "override",
        pool: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        presets = {**DOMAIN_PRESETS, **(presets or {})}
        self.harnesses = {d: Harness(presets[d], tokenizer) for d in domains}
        self.needs_sandbox = any(h.tools for h in self.harnesses.values())
        self.sandbox_url = sandbox_url
        self.sandbox_api_key = sandbox_api_key  # None: $E2B_API_KEY (a local server accepts any key)
        self.state_dir = Path(state_dir) if state_dir else None
        self.compose = compose
        self.pool = pool
        self.server = None
        self.sandboxes = None
        self.grading: Grading | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> RolloutEnv:
        grader_kwargs: dict[str, dict] = {}
        if self.needs_sandbox:
            from envs.sandbox.client import SandboxClient, SandboxSettings
            from rewards.workspace import E2BConfig, E2BSandboxes

            url = self.sandbox_url
            if url is None:
                from envs.sandbox.launch import LocalServer

                if self.state_dir is None:
                    self._tmp = tempfile.TemporaryDirectory(prefix="rlk3-sandboxes-")
                    self.state_dir = Path(self._tmp.name)
                self.server = LocalServer(self.state_dir / "state", pool=self.pool).start()
                url = self.server.url
            settings = SandboxSettings.local(url)
            if self.sandbox_api_key:
                settings = dataclasses.replace(settings, api_key=self.sandbox_api_key)
            self.sandboxes = E2BEpisodeSandboxes(SandboxClient(settings))
            workdirs = {h.preset.workdir for h in self.harnesses.values() if h.tools}
            if len(workdirs) > 1:
                raise ValueError(f"presets with tools must share one workdir for grading, got {sorted(workdirs)}")
            (workdir,) = workdirs
            cfg = E2BConfig(api_url=url, sandbox_url=url, api_key=settings.api_key or "rlk3-local", workdir=workdir)
            provider = E2BSandboxes(cfg)
            grader_kwargs = {"code": {"sandboxes": provider}, "command": {"sandboxes": provider}}
        self.grading = Grading(grader_kwargs, self.compose)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def loop(self, engine, config: LoopConfig | None = None, front: EngineFront | None = None) -> AgentLoop:
        return AgentLoop(front or EngineFront(engine), self.harnesses, sandboxes=self.sandboxes,
                         grading=self.grading, config=config)
