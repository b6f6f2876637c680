"""Held-out evaluation of a domain whose tasks come from a task file (``tasks.files``)."""

from __future__ import annotations

import asyncio
import copy

from harness import Harness
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.rollout.agent_loop import AgentLoop, EngineFront, LoopConfig
from rlk3.rollout.evaluate import evaluate_slices
from rlk3.rollout.grading import Grading


def test_a_domain_with_a_task_file_is_evaluated_on_the_files_heldout_tasks(general_policy, tmp_path):
    """Evaluation drew the synthetic held-out split whatever ``tasks.files`` named. With a file it runs the file's
    held-out tasks, every one of them when the split holds fewer than asked (the slice's ``n`` says how many)."""
    from envs.tasks.loaders import load
    from tests.envs.test_tasks import gsm8k_file

    model, tok = general_policy
    f = gsm8k_file(tmp_path / "gsm8k.jsonl", 30)
    held = load(f, "gsm8k", "heldout")
    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(memory_bytes=128 << 20))
    loop = AgentLoop(EngineFront(engine), {"general": Harness("chat", tok)}, grading=Grading(),
                     config=LoopConfig(temperature=0.0, max_turn_tokens=16))

    async def run(n):
        try:
            return await evaluate_slices(loop, [("general", "high", None)], n, files={"general": (str(f), "gsm8k")})
        finally:
            await loop.front.close()

    (res,), trajs = asyncio.run(run({"general": 64}))
    assert 0 < len(held) < 64 and res.n == len(held)
    assert [t.task_id for t in trajs] == [t.task_id for t in held]
    assert all(t.task_id.startswith("gsm8k/heldout/") for t in trajs)  # none of the file's train tasks
