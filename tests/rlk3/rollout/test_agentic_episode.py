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
from harness import Harness
from harness.tokenizer import default_tokenizer
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.agent_loop import LoopConfig
from rlk3.rollout.demos import DEFAULT_BUDGETS, build_demos
from rlk3.rollout.env import RolloutEnv
from rlk3.rollout.trajectory import Status


def fit(model, tok, demos, steps=200):
    """Train until every demonstrated assistant token is the argmax."""
    h = Harness("tiny", tok)
    rows = []
    for d in demos:
        ids, mask = h.assistant_mask(d.messages)
        rows.append((torch.tensor([ids]), torch.tensor([[i if m else -100 for i, m in zip(ids, mask)]])))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        total = 0.0
        for ids, labels in rows:
            loss = model(ids, labels=labels).loss
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if total / len(rows) < 0.005:
            break
    return model.eval()


@pytest.fixture(scope="module")
def fitted():
    tok = default_tokenizer()
    torch.manual_seed(0)
    demos = build_demos("coding", 1, tokenizer=tok, error_rate=0.0, seed=11)
    model = fit(K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))), tok, demos)
    return model, tok, demos[0]


def test_agentic_episode_end_to_end(fitted, tmp_path):
    model, tok, demo = fitted
    (task,) = [t for t in get_tasks("coding", "train", 1) if t.task_id == demo.task_id]
    with RolloutEnv(tok, domains=("coding",), state_dir=tmp_path) as env:
        loop = env.loop(RolloutEngine(model, EngineConfig(memory_bytes=64 << 20)),
                        LoopConfig(temperature=0.0, max_turn_tokens=256, max_context_tokens=4096))

        async def go():
            try:
                traj = loop.new_trajectory(task, effort=demo.effort, budget=DEFAULT_BUDGETS[demo.effort])
                return await loop.run(task, traj)
            finally:
                await loop.front.close()

        traj = asyncio.run(go())
    traj.validate()
    calls = [c["function"]["name"] for m in traj.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert calls[0] == "write_file" and calls[-1] == "submit", traj.messages
    tool_out = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert tool_out and not any(c.startswith("Error") for c in tool_out), tool_out
    assert traj.status == Status.FINISHED
    assert traj.metrics["passed"] is True and traj.reward == 1.0, traj.metrics["grade_reasons"]
    assert traj.metrics["loop"]["turns"] == len(calls)
    # tool output is in the stream but never trained on; the model's own tokens are
    n_tool = sum(1 for m in traj.loss_mask if m == 0)
    assert 0 < traj.num_generated < len(traj.token_ids) and n_tool > 0
