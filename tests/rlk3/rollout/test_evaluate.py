"""Held-out evaluation of a domain whose tasks come from a task file (``tasks.files``)."""

from __future__ import annotations

import asyncio
import copy

import pytest

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


def test_an_evaluation_of_sandbox_free_domains_starts_no_sandbox_server(general_policy, monkeypatch):
    """A manifest that evaluates no agentic or coding task (their held-out sizes 0) still started the sandbox server
    for their (empty) slices: on a node without bubblewrap, a GPU box say, the evaluation failed before its first
    episode. Only domains with tasks to run get a harness and, with tools, the server."""
    from envs.sandbox.launch import LocalServer
    from rlk3.rollout.demos import DEFAULT_BUDGETS
    from rlk3.rollout.evaluate import evaluate_policy

    def start(self):
        raise AssertionError("the sandbox server was started")

    monkeypatch.setattr(LocalServer, "start", start)
    model, tok = general_policy
    slices = [(d, "high", DEFAULT_BUDGETS["high"]) for d in ("general", "agentic", "coding")]
    res, trajs = evaluate_policy(copy.deepcopy(model), tok, slices, {"general": 3, "agentic": 0, "coding": 0},
                                 loop_config=LoopConfig(temperature=0.0, max_turn_tokens=16))
    assert [(r.domain, r.n) for r in res] == [("general", 3), ("agentic", 0), ("coding", 0)] and len(trajs) == 3


@pytest.mark.gpu
def test_an_evaluation_on_the_gpu_scores_as_the_cpus(general_policy, tmp_path):
    """``python -m rlk3 eval`` on a GPU box (device=auto): each model's engine on the card, in the checkpoint's dtype
    (float32 here), greedy. The same policy scores the same on the GPU as on the CPU: a rounding-level difference
    can flip a near-tie token, so most episodes, not all, must be token-identical."""
    import json

    import torch

    from rlk3.pipeline import run_eval
    from rlk3.rollout.demos import DEFAULT_BUDGETS
    from rlk3.rollout.evaluate import evaluate_policy, load_policy

    model, tok = general_policy
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    slices = [("general", e, DEFAULT_BUDGETS[e]) for e in ("high", "low")]
    loop = LoopConfig(temperature=0.0, max_turn_tokens=64, max_context_tokens=1024)
    cpu, cpu_trajs = evaluate_policy(*load_policy(tmp_path / "base"), slices, 16, loop_config=loop)
    torch.cuda.reset_peak_memory_stats()
    policy, tok = load_policy(tmp_path / "base", device="cuda")
    assert {p.device.type for p in policy.parameters()} == {"cuda"}
    gpu, gpu_trajs = evaluate_policy(policy, tok, slices, 16, loop_config=loop)
    assert torch.cuda.max_memory_allocated() > 1 << 30  # the engine's pool (a quarter of free memory) sat on the card
    same = sum(a.token_ids == b.token_ids for a, b in zip(cpu_trajs, gpu_trajs))
    print(f"token-identical episodes: {same}/{len(cpu_trajs)}; pass rates cpu "
          f"{[r.pass_rate for r in cpu]} gpu {[r.pass_rate for r in gpu]}")
    assert [t.uid for t in cpu_trajs] == [t.uid for t in gpu_trajs] and same >= 0.8 * len(cpu_trajs)
    assert all(abs(a.pass_rate - b.pass_rate) <= 2 / 16 for a, b in zip(cpu, gpu))
    # the stage itself: the manifest's model in a process beside this one, on the card, eval.json written
    manifest = tmp_path / "manifest.json"
    # general alone (agentic and coding 0): no sandbox server, which a GPU node without bubblewrap cannot start
    manifest.write_text(json.dumps({"sft": str(tmp_path / "base"), "heldout": {"general": 4, "agentic": 0,
                                                                                "coding": 0},
                                    "loop": {"max_turns": 1, "max_turn_tokens": 32, "max_context_tokens": 512}}))
    lines = []
    run_eval(manifest, log=lines.append)
    (entry,) = json.loads((tmp_path / "eval.json").read_text())["models"]
    assert len(entry["slices"]) == 9 and any("(cuda)" in line for line in lines)
    assert sorted(s["n"] for s in entry["slices"]) == [0] * 6 + [4] * 3
