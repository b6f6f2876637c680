"""Held-out evaluation: pass rate, mean generated tokens and over-budget rate per (domain, effort) slice.

Greedy decoding (pass@1) on each domain's held-out split, the same tasks for every model and effort, through the
same agent loop, sandboxes and graders as training. A slice's budget is stated in the system prompt and enforced
as in RL (an over-budget episode stops and does not pass).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from envs.tasks import get_tasks
from rlk3.rollout.agent_loop import AgentLoop
from rlk3.rollout.trajectory import Status, Trajectory


@dataclass
class SliceResult:
    domain: str
    effort: str
    n: int
    pass_rate: float
    mean_tokens: float
    over_budget_rate: float
    reward_mean: float
    failed: int  # environment failures (never counted as passes)
    grader_errors: int = 0  # episodes whose grader raised (scored as fails; a non-zero count is a broken setup)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(domain: str, effort: str, trajs: list[Trajectory]) -> SliceResult:
    n = len(trajs)
    return SliceResult(
        domain=domain,
        effort=effort,
        n=n,
        pass_rate=sum(bool(t.metrics.get("passed")) and not t.metrics.get("over_budget") for t in trajs) / max(n, 1),
        mean_tokens=sum(t.num_generated for t in trajs) / max(n, 1),
        over_budget_rate=sum(bool(t.metrics.get("over_budget")) for t in trajs) / max(n, 1),
        reward_mean=sum(t.reward or 0.0 for t in trajs) / max(n, 1),
        failed=sum(t.status == Status.FAILED for t in trajs),
        grader_errors=sum(bool(t.metrics.get("grader_error")) for t in trajs),
    )


async def evaluate_slices(
    loop: AgentLoop,
    slices: list[tuple[str, str, int | None]],
    n: int | Mapping[str, int],
    *,
    split: str = "heldout",
    concurrency: int = 64,
    progress=None,
    files: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[list[SliceResult], list[Trajectory]]:
    """``slices``: (domain, effort, budget). ``n`` tasks per slice, or per domain ({"general": 400, ...}): the first
    ``n`` of the domain's suite, or of its task file's split where ``files`` names one (domain → (path, format),
    ``tasks.files``; all of them when the split holds fewer, which ``SliceResult.n`` reports).
    Returns the per-slice summary and every trajectory (for inspection: ``metrics['grade_reasons']`` says why each
    one failed)."""
    sem = asyncio.Semaphore(concurrency)
    counts = {d: _count(n, d) for d in {s[0] for s in slices}}
    tasks = {d: get_tasks(d, split, k, files=files) for d, k in counts.items()}

    async def one(task, effort, budget):
        async with sem:
            traj = loop.new_trajectory(task, effort=effort, budget=budget, uid=f"eval-{task.task_id}-{effort}")
            out = await loop.run(task, traj)
            if progress is not None:
                progress()
            return out

    jobs = [(d, e, b, t) for d, e, b in slices for t in tasks[d]]
    trajs = await asyncio.gather(*(one(t, e, b) for _, e, b, t in jobs))
    out = []
    for d, e, _b in slices:
        mine = [tr for (dd, ee, _, _), tr in zip(jobs, trajs) if dd == d and ee == e]
        out.append(summarize(d, e, mine))
    return out, list(trajs)


def _count(n: int | Mapping[str, int], domain: str) -> int:
    """Held-out tasks per slice of ``domain``: ``n`` for every domain, or its entry."""
    return n[domain] if isinstance(n, Mapping) else n


def format_slices(results: list[SliceResult]) -> str:
    lines = [f"{'domain':<9} {'effort':<7} {'n':>4} {'pass':>6} {'tokens':>7} {'over':>6} {'grader errors':>13}"]
    for r in results:
        lines.append(f"{r.domain:<9} {r.effort:<7} {r.n:>4} {r.pass_rate:>6.1%} {r.mean_tokens:>7.1f} "
                     f"{r.over_budget_rate:>6.1%} {r.grader_errors:>13}")
    return "\n".join(lines)


def load_policy(path, *, dtype=None, device: str = "cpu"):
    """A checkpoint directory written by a stage (HF weights + tokenizer) → (model in eval mode on ``device``,
    tokenizer). The checkpoint's dtype unless ``dtype`` is given."""
    from harness.tokenizer import load_tokenizer
    from rlk3.model import K3ForCausalLM

    model = K3ForCausalLM.from_pretrained(str(path), **({"torch_dtype": dtype} if dtype else {})).eval()
    return model.to(device), load_tokenizer(path)


def default_engine_config(device):
    """The evaluation engine's pool: 256 MiB on the CPU (k3-tiny's held-out episodes fit many times over); on a GPU
    a quarter of the free memory up to 8 GiB (held-out episodes are a few thousand tokens each), so that a trainer
    sharing the card (the demo's student) keeps the rest."""
    import torch

    from rlk3.engine import EngineConfig
    from rlk3.engine.pool import device_free_bytes

    device = torch.device(device)
    if device.type != "cuda":
        return EngineConfig(memory_bytes=256 << 20)
    return EngineConfig(memory_bytes=min(8 << 30, device_free_bytes(device) // 4))


def evaluate_policy(
    model,
    tokenizer,
    slices: list[tuple[str, str, int | None]],
    n: int | Mapping[str, int],
    *,
    engine_config=None,
    loop_config=None,
    sandbox_url: str | None = None,
    files: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[list[SliceResult], list[Trajectory]]:
    """Greedy held-out evaluation of one policy on ``slices`` (see :func:`evaluate_slices`), on the model's
    device."""
    from rlk3.engine import RolloutEngine
    from rlk3.rollout.agent_loop import LoopConfig
    from rlk3.rollout.env import RolloutEnv

    engine = RolloutEngine(model, engine_config or default_engine_config(next(model.parameters()).device))
    cfg = loop_config or LoopConfig(temperature=0.0, max_turn_tokens=512, max_context_tokens=4096)
    # only domains with tasks to run: a manifest that evaluates no agentic or coding task (tasks.heldout_sizes.<d>=0)
    # needs no sandbox server, which a GPU node without bubblewrap could not start
    domains = tuple(sorted({d for d, _, _ in slices if _count(n, d)}))
    with RolloutEnv(tokenizer, domains=domains, sandbox_url=sandbox_url) as env:
        loop = env.loop(engine, cfg)

        async def main():
            try:
                return await evaluate_slices(loop, slices, n, files=files)
            finally:
                await loop.front.close()

        return asyncio.run(main())
