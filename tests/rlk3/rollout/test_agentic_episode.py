"""An agentic episode end to end: the real engine, the real sandbox server (through the e2b SDK), the real code
grader forking the episode's sandbox for judging.

The policy is k3-tiny fitted to one demonstration of the task (a few seconds of training), so its greedy episode
makes real tool calls: write solution.py in the sandbox, then submit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from envs.tasks import get_tasks
from harness.tokenizer import default_tokenizer
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.agent_loop import E2BEpisodeSandboxes, LoopConfig
from rlk3.rollout.demos import DEFAULT_BUDGETS, build_demos
from rlk3.rollout.env import RolloutEnv
from rlk3.rollout.trajectory import Status
from tests.rlk3._fit import demo_rows, fit


@pytest.fixture(scope="module")
def fitted():
    tok = default_tokenizer()
    torch.manual_seed(0)
    # a high-effort demonstration: write the function, check it with the shell, submit (three turns)
    demo = next(d for d in build_demos("coding", 8, tokenizer=tok, error_rate=0.0, seed=11) if d.effort == "high")
    model = fit(K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))), demo_rows(tok, [demo], "tiny"), 200,
                target=0.005)
    return model, tok, demo


def task_of(demo):
    i = int(demo.task_id.rsplit("/", 1)[1])
    (task,) = get_tasks("coding", "train", 1, start=i)
    assert task.task_id == demo.task_id
    return task


def episode(model, tok, demo, tmp_path, *, snapshot_turns=False, sandboxes_cls=None):
    task = task_of(demo)
    with RolloutEnv(tok, domains=("coding",), state_dir=tmp_path) as env:
        if sandboxes_cls is not None:
            env.sandboxes = sandboxes_cls(env.sandboxes.client)
        loop = env.loop(RolloutEngine(model, EngineConfig(memory_bytes=64 << 20)),
                        LoopConfig(temperature=0.0, max_turn_tokens=256, max_context_tokens=4096,
                                   snapshot_turns=snapshot_turns))

        async def go():
            try:
                traj = loop.new_trajectory(task, effort=demo.effort, budget=DEFAULT_BUDGETS[demo.effort])
                return await loop.run(task, traj)
            finally:
                await loop.front.close()

        return asyncio.run(go())


def tool_calls(traj):
    return [c["function"]["name"] for m in traj.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]


def test_agentic_episode_end_to_end(fitted, tmp_path):
    model, tok, demo = fitted
    traj = episode(model, tok, demo, tmp_path)
    traj.validate()
    calls = tool_calls(traj)
    assert calls == ["write_file", "shell", "submit"], traj.messages
    tool_out = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_out and not any(c.startswith("Error") for c in tool_out), tool_out
    assert traj.status == Status.FINISHED
    assert traj.metrics["passed"] is True and traj.reward == 1.0, traj.metrics["grade_reasons"]
    assert traj.metrics["loop"]["turns"] == len(calls)
    # tool output is in the stream but never trained on; the model's own tokens are
    n_tool = sum(1 for m in traj.loss_mask if m == 0)
    assert 0 < traj.num_generated < len(traj.token_ids) and n_tool > 0


class KillAfterFirstSnapshot(E2BEpisodeSandboxes):
    """The real sandbox service, plus a fault: right after the first turn's snapshot the sandbox is killed, as
    when a node or a sandbox process dies mid-episode."""

    killed: list[str] = []

    async def snapshot(self, sid):
        snap = await super().snapshot(sid)
        if not self.killed:
            self.killed.append(sid)
            await self.client.kill(sid)
        return snap


class KillAfterFirstTurn(E2BEpisodeSandboxes):
    killed: list[str] = []

    async def exec(self, sid, cmd, timeout=60):
        if not self.killed:  # the first shell call: the sandbox dies under it
            self.killed.append(sid)
            await self.client.kill(sid)
        return await super().exec(sid, cmd, timeout)


def test_a_killed_sandbox_is_restored_from_the_last_turn_snapshot(fitted, tmp_path):
    model, tok, demo = fitted
    KillAfterFirstSnapshot.killed = []
    traj = episode(model, tok, demo, tmp_path, snapshot_turns=True, sandboxes_cls=KillAfterFirstSnapshot)
    assert KillAfterFirstSnapshot.killed, "the fault was never injected"
    assert traj.sandbox_id != KillAfterFirstSnapshot.killed[0]  # it continued in the restored sandbox
    assert len(traj.metrics["recoveries"]) == 1 and traj.metrics["recoveries"][0]["turn"] == 2
    assert tool_calls(traj) == ["write_file", "shell", "submit"]
    # the restored sandbox had the file written before the snapshot: the check ran and the grade passes
    assert traj.status == Status.FINISHED and traj.reward == 1.0, traj.metrics["grade_reasons"]


def test_without_a_snapshot_the_episode_fails_cleanly(fitted, tmp_path):
    model, tok, demo = fitted
    KillAfterFirstTurn.killed = []
    traj = episode(model, tok, demo, tmp_path, snapshot_turns=False, sandboxes_cls=KillAfterFirstTurn)
    assert KillAfterFirstTurn.killed
    assert traj.status == Status.FAILED
    assert traj.metrics["failure"]["recovered"] is False and traj.metrics["failure"]["error"]
    assert traj.reward == 0.0 and any(r.startswith("environment_failed") for r in traj.metrics["grade_reasons"])
    traj.validate()


class KillWhileWritingFiles(E2BEpisodeSandboxes):
    """The sandbox dies while the task's files are written into it (under load a sandbox agent can drop its
    connection then); ``fail_times`` creations fail this way."""

    fail_times = 1
    killed: list[str] = []

    async def create(self, task, workdir):
        if len(self.killed) < self.fail_times:
            sid = await self.client.create(task.template, timeout=self.timeout_s)
            self.killed.append(sid)
            await self.client.kill(sid)
            await self.client.write(sid, f"{workdir}/x", "x")  # raises: the sandbox is gone
        return await super().create(task, workdir)


def test_a_sandbox_that_dies_while_created_is_created_again(fitted, tmp_path):
    model, tok, demo = fitted
    KillWhileWritingFiles.killed, KillWhileWritingFiles.fail_times = [], 1
    traj = episode(model, tok, demo, tmp_path, sandboxes_cls=KillWhileWritingFiles)
    assert len(KillWhileWritingFiles.killed) == 1
    assert traj.metrics["recoveries"][0]["turn"] == 0 and traj.metrics["recoveries"][0]["error"]
    assert traj.status == Status.FINISHED and traj.reward == 1.0, traj.metrics["grade_reasons"]


def test_a_sandbox_that_cannot_be_created_fails_the_episode_not_the_run(fitted, tmp_path):
    model, tok, demo = fitted
    KillWhileWritingFiles.killed, KillWhileWritingFiles.fail_times = [], 2
    traj = episode(model, tok, demo, tmp_path, sandboxes_cls=KillWhileWritingFiles)
    assert len(KillWhileWritingFiles.killed) == 2
    assert traj.status == Status.FAILED and traj.num_generated == 0
    assert traj.metrics["failure"]["stage"] == "create" and traj.metrics["failure"]["attempts"] == 2
    assert traj.reward == 0.0 and any(r.startswith("environment_failed") for r in traj.metrics["grade_reasons"])
    traj.validate()
