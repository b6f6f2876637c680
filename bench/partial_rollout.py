"""Partial rollouts (issue 7): wall time per iteration at equal trained tokens for λ = 1.0 vs 0.7 vs 0.5, on a
long-tailed generation-length distribution, with the real engine, agent loop, grader and trainer on CPU.

    python bench/partial_rollout.py                 # k3-tiny, 8 groups x 4 samples, until 12K trained tokens per λ
    python bench/partial_rollout.py --quick         # a smoke run: 4 groups x 4, until 2K trained tokens per λ
    python bench/partial_rollout.py --ray-only      # the Ray driver's overhead: run_rl vs its workers in-process
    python bench/partial_rollout.py --ray-overlap   # the Ray driver per λ: synchronous vs cluster.overlap

Each λ runs the driver's loop in one process, from the same fitted policy and the same prompt order:
``PartialRollouts.iterate`` (schedule, generate, grade) → ``Trainer.step`` → ``engine.update_weights(
trainer.weights(), version)``, until the trained (generated, loss-masked) tokens reach ``--tokens``. Reported per λ:
seconds per 1K trained tokens and per iteration (ratio against λ = 1.0 measured in the same run), the time of each
phase, weight-sync time, and the scheduler's counts (paused, restarted for staleness, groups trained).

How the comparison is kept fair:
- *Side by side.* The λ runs advance together, one iteration at a time, the run with the least timed wall time
  going next, so on a shared machine every λ sees the same stretches of load. Wall time and the process's CPU time
  are both reported (with one intra-op thread the CPU time is the steadier of the two).
- *Steady state.* λ < 1 first runs ``max_staleness + 2`` (at most 10) untimed iterations on other prompts, so its
  carry-over buffer is full when timing starts (every trajectory finishes within max_staleness + 1 iterations of its
  first token); the timed iterations then start at prompt 0 like λ = 1's (which carries nothing over).
- *The same work.* The trainer takes its full step (forward, backward, clipping, AdamW) at ``--lr 0`` by default,
  and Quantile Balancing's router-bias update is off (``--qb-update``): λ < 1 takes several small steps where λ = 1
  takes one, and a policy that learns (or whose routing biases move: 12 zero-gradient QB steps changed 36 of 64
  seeded samples and the mean length by 20%) would sample a different length distribution at each λ, so equal
  trained tokens would compare different work. With a fixed policy the engine's seeded sampling gives a trajectory
  the same tokens whether or not it was paused, so every λ trains the same kind of trajectories.

The long tail. A k3-tiny is fitted in one to two minutes to ten general-domain demonstrations (as in
tests/rlk3/conftest.py) whose reply length depends on the stated effort: low answers at once (~6 tokens), medium
folds two operations per line (~15-50), high writes every step and then re-checks it 2, 6 or 16 times (~100-900).
Sampled at temperature 1 on prompts of all three efforts, the fitted model stops on its own at lengths spread over
two orders of magnitude (it follows the effort only loosely: about a quarter of the answers come at once, the rest
reason for tens to hundreds of tokens), capped at ``--max-new-tokens``. The p50 / p99 of the generated tokens of
every trained trajectory are printed. (The mix is sensitive: with one medium demonstration fewer, most answers come
at once, the p50 is 6 tokens, λ = 0.5's cutoff falls at ~6 tokens, long trajectories advance a few tokens per
iteration until the staleness bound makes an iteration wait for them, and λ = 0.5 gains nothing.)

Prints tables and writes bench/results/partial_rollout.json (``--ray-only``: partial_rollout-ray.json).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import print_table, write_json
from envs.tasks import general, get_tasks
from harness import Harness
from harness.tokenizer import default_tokenizer
from rlk3.config import TrainConfig
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.agent_loop import AgentLoop, EngineFront, LoopConfig
from rlk3.rollout.grading import Grading
from rlk3.rollout.partial import PartialRollouts, PromptSource
from rlk3.train.trainer import Trainer

PRESET = "chat"  # the general domain's harness preset (no tools)
# demonstrations: (effort, re-checks); high effort re-derives its sum this many more times
EFFORTS = ["low", "medium", "high"]  # the prompts' effort levels, drawn uniformly
DEMOS = [("low", 0)] * 4 + [("medium", 0)] * 3 + [("high", 2), ("high", 6), ("high", 16)]


# ------------------------------------------------------------------------------------------------ the policy


def demo_rows(tok) -> list[tuple[list[int], list[int]]]:
    """(token ids, assistant mask) of each demonstration, through the harness the policy will run under."""
    h = Harness(PRESET, tok)
    rows = []
    for task, (effort, checks) in zip(get_tasks("general", "train", len(DEMOS), start=100_000), DEMOS):
        p = general.problem_of(task)
        text, answer = general.reasoning(p, effort)
        text = " ".join([text] + [f"Check: {text}"] * checks) if text else ""
        reply = {"role": "assistant", "content": f"Answer: {answer}"} | ({"reasoning_content": text} if text else {})
        rows.append(h.assistant_mask([*h.start(task.prompt, effort=effort), reply]))
    return rows


def fit_policy(tok, steps: int, seed: int) -> K3ForCausalLM:
    """k3-tiny fitted full-batch to the demonstrations (two right-padded batches: short and long)."""
    rows = sorted(demo_rows(tok), key=lambda r: len(r[0]))
    batches = []
    for part in (rows[:-3], rows[-3:]):
        T = max(len(ids) for ids, _ in part)
        ids = torch.zeros(len(part), T, dtype=torch.long)
        labels = torch.full((len(part), T), -100)
        for r, (i, m) in enumerate(part):
            ids[r, : len(i)] = torch.tensor(i)
            labels[r, : len(i)] = torch.tensor([t if k else -100 for t, k in zip(i, m)])
        batches.append((ids, labels))
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        for ids, labels in batches:
            model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


# ------------------------------------------------------------------------------------------------ one λ


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))]) if xs else 0.0


class LambdaRun:
    """The driver's loop for one λ without Ray: ``PartialRollouts.iterate`` → ``Trainer.step`` →
    ``engine.update_weights(trainer.weights(), version)``, one iteration per ``iteration()`` call."""

    def __init__(self, model, tok, lam: float, args) -> None:
        self.lam, self.args = lam, args
        self.engine = RolloutEngine(copy.deepcopy(model), EngineConfig(memory_bytes=256 << 20, max_model_len=2048))
        self.loop = AgentLoop(EngineFront(self.engine), {"general": Harness(PRESET, tok)}, grading=Grading(),
                              config=LoopConfig(temperature=1.0, max_turn_tokens=args.max_new_tokens,
                                                max_context_tokens=2048, seed=args.seed))
        source = PromptSource(["general"], EFFORTS, lambda effort, step: None, seed=args.seed)
        self.pr = PartialRollouts(self.loop, source, groups=args.groups, group_size=args.group_size, lam=lam,
                                  max_staleness=args.max_staleness, top_up=args.top_up)
        self.warnings: list[str] = []
        self.trainer = Trainer(copy.deepcopy(model), TrainConfig(lr=args.lr, dead_signal_patience=10**9,
                                                                 qb_update=args.qb_update), log=self.warnings.append)
        self.it = 0
        self.iters: list[dict] = []
        self.lengths: list[int] = []
        self.trained_tokens = 0
        self.wall = self.cpu = 0.0
        self.loads: list[float] = []

    async def warm_up(self) -> None:
        """λ < 1: ``--warmup`` untimed iterations on other prompts (default ``max_staleness + 2``, at most 10), so
        the carry-over buffer is in its steady state when timing starts (every trajectory finishes within
        max_staleness + 1 iterations of its first token); the timed iterations then start at prompt 0, like λ = 1's.
        λ = 1 carries nothing over."""
        default = min(self.args.max_staleness, 8) + 2
        self.warmup = 0 if self.lam == 1.0 else (default if self.args.warmup is None else self.args.warmup)
        if not self.warmup:
            return
        self.pr.source.position = 10**6
        for _ in range(self.warmup):
            ready, _ = await self.pr.iterate(self.it, self.engine.version)
            if ready:
                self.trainer.step(ready)
                self.engine.update_weights(self.trainer.weights(), self.trainer.version)
            self.it += 1
        self.pr.source.position = 0
        self.buffered_start = sum(t.num_generated for t in self.pr.buffer)

    async def iteration(self) -> None:
        engine, trainer = self.engine, self.trainer
        self.loads.append(os.getloadavg()[0])
        c0, t0 = time.process_time(), time.perf_counter()
        before = engine.stats()
        ready, stats = await self.pr.iterate(self.it, engine.version)  # schedule + generate + grade
        t1 = time.perf_counter()
        metrics = trainer.step(ready) if ready else {}  # train
        t2 = time.perf_counter()
        if trainer.version > engine.version:  # sync
            engine.update_weights(trainer.weights(), trainer.version)
        t3 = time.perf_counter()
        self.wall += t3 - t0
        self.cpu += time.process_time() - c0
        after = engine.stats()
        tokens = sum(sum(t.loss_mask) for t in ready)
        rewards: dict[str, set] = {}
        for t in ready:
            rewards.setdefault(t.group_id, set()).add(t.reward)
        self.trained_tokens += tokens
        self.lengths += [t.num_generated for t in ready]
        self.iters.append(dict(
            iteration=len(self.iters), rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2, trained_seqs=len(ready),
            trained_tokens=tokens, train_loss_tokens=metrics.get("train/tokens", 0.0), launched=stats.launched,
            resumed=stats.resumed, paused=stats.paused, restarted_stale=stats.restarted_stale,
            groups_trained=stats.groups_trained, groups_with_reward_spread=sum(len(v) > 1 for v in rewards.values()),
            buffered=stats.buffered, engine_steps=after.steps - before.steps,
            generated_tokens=after.generated_tokens - before.generated_tokens,
            prefill_tokens=after.prefill_tokens - before.prefill_tokens,
            staleness_max=max((max(t.policy_versions) - min(t.policy_versions) for t in ready if t.policy_versions),
                              default=0),
        ))
        self.it += 1

    def summary(self) -> dict:
        iters, lengths, n = self.iters, self.lengths, len(self.iters)
        per = {k: sum(r[k] for r in iters) / n for k in ("rollout_s", "train_s", "sync_s")}
        groups = sum(r["groups_trained"] for r in iters)
        syncs = [r["sync_s"] for r in iters if r["sync_s"] > 0]
        return dict(
            lam=self.lam, warmup_iterations=self.warmup, iterations=n, trained_tokens=self.trained_tokens,
            trained_seqs=len(lengths), wall_s=self.wall, s_per_iteration=self.wall / n,
            s_per_1k_tokens=1000 * self.wall / self.trained_tokens, cpu_s=self.cpu,
            cpu_s_per_1k_tokens=1000 * self.cpu / self.trained_tokens,
            rollout_s_per_iteration=per["rollout_s"], train_s_per_iteration=per["train_s"],
            sync_s_per_iteration=per["sync_s"], rollout_share=per["rollout_s"] * n / self.wall,
            weight_sync_ms=1000 * statistics.median(syncs) if syncs else 0.0,
            gen_p50=pct(lengths, 0.5), gen_p90=pct(lengths, 0.9), gen_p99=pct(lengths, 0.99), gen_max=max(lengths),
            gen_mean=statistics.mean(lengths),
            # engine work: sampled tokens (the buffer's are not trained yet) and steps
            engine_generated_tokens=sum(r["generated_tokens"] for r in iters),
            engine_steps=sum(r["engine_steps"] for r in iters), prefill_tokens=sum(r["prefill_tokens"] for r in iters),
            buffered_generated_at_start=getattr(self, "buffered_start", 0),
            buffered_generated_at_end=sum(t.num_generated for t in self.pr.buffer),
            paused=sum(r["paused"] for r in iters), restarted_stale=sum(r["restarted_stale"] for r in iters),
            groups_per_iteration=groups / n,
            groups_with_reward_spread=sum(r["groups_with_reward_spread"] for r in iters) / max(1, groups),
            staleness_max=max(r["staleness_max"] for r in iters), dead_signal_warnings=len(self.warnings),
            load_average_mean=statistics.mean(self.loads), per_iteration=iters,
        )


async def run_lambdas(model, tok, lams: list[float], args) -> list[dict]:
    """All λ side by side: the run with the least timed wall time so far goes next, so every λ sees the same
    stretches of a shared machine's load."""
    runs = [LambdaRun(model, tok, lam, args) for lam in lams]
    for r in runs:
        await r.warm_up()
    while live := [r for r in runs if r.trained_tokens < args.tokens]:
        await min(live, key=lambda r: r.wall).iteration()
    for r in runs:
        await r.loop.front.close()
    return [r.summary() for r in runs]


# ------------------------------------------------------------------------------------------------ Ray


def ray_overhead(model, tok, args) -> dict:
    """The Ray driver against the same loop in one process. One config (configs/quickstart.yaml, the fitted policy
    as model.init_from, λ = ``--ray-lam``): ``--ray-iterations`` iterations of ``run_rl`` (rollout and train
    workers as Ray actors, weights through the object store), and the same iterations of the same two worker classes
    called in-process. The RL config states one effort level (high) and its budget (384 tokens) in every prompt, so
    its lengths differ from the table above; the two rows of this comparison share them."""
    import json
    import tempfile

    import ray

    from rlk3.cluster.driver import run_rl
    from rlk3.cluster.workers import RolloutWorker, TrainWorker

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="rlk3-bench-partial-") as tmp:
        init = Path(tmp) / "init"
        model.save_pretrained(str(init))
        tok.save_pretrained(str(init))

        def cfg(out: str):  # the quickstart's own budget (384): these runs predate ray_config's
            return ray_config(root, init, out, args, **{"effort.budget": 384},
                              **({"train.lr": args.lr} if args.lr > 0 else {}))

        # in-process: what run_rl's loop does, with the workers as plain objects
        c = cfg(f"{tmp}/inproc")
        t = time.perf_counter()
        rollout, trainer = RolloutWorker(c, f"{tmp}/inproc"), TrainWorker(c)
        setup = time.perf_counter() - t
        local, version = [], 0
        for it in range(args.ray_iterations):
            t0 = time.perf_counter()
            dicts, _ = rollout.iterate(it)
            t1 = time.perf_counter()
            if dicts:
                trainer.step(dicts)
            t2 = time.perf_counter()
            if trainer.version() > version:
                version = trainer.version()
                rollout.update_weights(trainer.weights(), version)
            local.append(dict(rollout_s=t1 - t0, train_s=t2 - t1, sync_s=time.perf_counter() - t2,
                              trained_tokens=sum(sum(d["loss_mask"]) for d in dicts)))
        rollout.close()

        # through Ray
        os.environ.pop("RAY_ADDRESS", None)
        t = time.perf_counter()
        run_rl(cfg(f"{tmp}/ray"), log=lambda *_: None)
        ray_wall = time.perf_counter() - t
        ray.shutdown()
        rows = [json.loads(x) for x in (Path(tmp) / "ray/metrics.jsonl").read_text().splitlines()]

    def total(rs, key):
        return sum(r[key] for r in rs)

    out = []
    for name, rs, keys, extra in (
        ("in-process workers", local, ("rollout_s", "train_s", "sync_s"), dict(setup_s=setup)),
        ("Ray driver (run_rl)", rows, ("time/rollout_s", "time/train_s", "time/sync_s"), dict(run_rl_wall_s=ray_wall)),
    ):
        n = len(rs)
        out.append(dict(path=name, lam=args.ray_lam, iterations=n, **{
            "rollout_s_per_iteration": total(rs, keys[0]) / n, "train_s_per_iteration": total(rs, keys[1]) / n,
            "sync_s_per_iteration": total(rs, keys[2]) / n,
            "s_per_iteration": sum(total(rs, k) for k in keys) / n}, **extra))
    trained = [sum(r["trained_tokens"] for r in local), sum(int(r.get("train/tokens", 0)) for r in rows)]
    out[0]["trained_tokens"], out[1]["trained_tokens"] = trained
    for r in out:
        r["ratio_vs_in_process"] = r["s_per_iteration"] / out[0]["s_per_iteration"]
    # what Ray adds outside the iterations: ray.init, placement group, actors, final checkpoint and model save
    out[1]["outside_iterations_s"] = ray_wall - out[1]["s_per_iteration"] * out[1]["iterations"]
    return dict(rows=out)


def ray_config(root: Path, init: Path, out: str, args, **over):
    """configs/quickstart.yaml at the bench's scale, from the fitted policy; the effort budget equals
    ``--max-new-tokens`` so that it never cuts the tail (the bench is about time, not about budgets)."""
    from rlk3.config import load_config

    base = {"run.output_dir": out, "model.init_from": str(init), "run.iterations": args.ray_iterations,
            "run.checkpoint_every": 1000, "run.eval_every": 1000, "run.seed": args.seed,
            "cluster.cpu_threads": args.threads, "rollout.lam": args.ray_lam,
            "rollout.groups_per_iteration": args.groups, "rollout.group_size": args.group_size,
            "rollout.max_new_tokens": args.max_new_tokens, "rollout.max_total_tokens": 2048,
            "effort.budget": args.max_new_tokens, "rollout.max_staleness": args.max_staleness,
            "train.qb_update": args.qb_update, "train.dead_signal_patience": 10**9}
    return load_config(root / "configs/quickstart.yaml", [f"{k}={v}" for k, v in (base | over).items()])


def ray_lengths(root: Path, init: Path, tmp: str, args) -> dict:
    """The policy's generated-length distribution under the Ray runs' config: ``--ray-warmup`` synchronous
    iterations of the rollout worker in-process, nothing trained (the runs' own prompts, before any update)."""
    from rlk3.cluster.workers import RolloutWorker

    worker = RolloutWorker(ray_config(root, init, f"{tmp}/lengths", args, **{"rollout.lam": 1.0}), f"{tmp}/lengths")
    lengths = []
    for it in range(max(args.ray_warmup, 2)):
        dicts, _ = worker.iterate(it)
        lengths += [sum(d["loss_mask"]) for d in dicts]
    worker.close()
    return dict(samples=len(lengths), p50=pct(lengths, 0.5), p90=pct(lengths, 0.9), p99=pct(lengths, 0.99),
                max=max(lengths), mean=statistics.mean(lengths),
                p99_over_p50=pct(lengths, 0.99) / max(pct(lengths, 0.5), 1.0))


def ray_overlap(model, tok, args) -> dict:
    """The Ray driver (``run_rl``) for each λ in ``--lams``, top-up mode (λ < 1: ``--ray-top-ups``) and way of
    running: synchronous and colocated (rollout and training alternate in one bundle), or ``cluster.overlap``
    (disaggregated: iteration i + 1's rollout runs while iteration i trains, one policy version behind). Each run
    does ``--ray-warmup`` + ``--ray-iterations`` iterations; the warm-up ones are not timed (λ < 1's carry-over
    buffer fills, the overlap's pipeline starts), so the table compares steady states. Wall time per 1K trained
    tokens (``time/iteration_s``; start-up and the final save excluded), against synchronous λ = 1 in the same run.
    Same fitted policy as the tables above, configs/quickstart.yaml settings (one effort level, high; the budget
    set to ``--max-new-tokens``); the trainer learns at the config's lr unless ``--lr`` is given, so each run's
    lengths drift a little, which the per-token normalisation absorbs."""
    import json
    import tempfile

    import ray

    from rlk3.cluster.driver import run_rl

    root = Path(__file__).resolve().parents[1]
    out = []
    with tempfile.TemporaryDirectory(prefix="rlk3-bench-overlap-") as tmp:
        init = Path(tmp) / "init"
        model.save_pretrained(str(init))
        tok.save_pretrained(str(init))
        lengths = ray_lengths(root, init, tmp, args)
        print(f"  generated tokens: p50 {lengths['p50']:.0f}, p99 {lengths['p99']:.0f} "
              f"(p99/p50 = {lengths['p99_over_p50']:.1f}) over {lengths['samples']} samples", flush=True)
        for lam in [float(x) for x in args.lams.split(",")]:
            for top_up in ["groups"] if lam == 1.0 else args.ray_top_ups.split(","):
                for mode, extra in (("sync", {}), ("overlap", {"cluster.colocate": False, "cluster.overlap": True})):
                    run = f"{tmp}/{mode}-{lam}-{top_up}"
                    over = {"rollout.lam": lam, "rollout.top_up": top_up, "train.share_prompts": args.share_prompts,
                            "run.iterations": args.ray_warmup + args.ray_iterations, **extra,
                            **({"train.lr": args.lr} if args.lr > 0 else {})}
                    os.environ.pop("RAY_ADDRESS", None)
                    run_rl(ray_config(root, init, run, args, **over), log=lambda *_: None)
                    ray.shutdown()
                    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
                    rs = rows[args.ray_warmup:]
                    tokens = sum(int(r.get("train/tokens", 0)) for r in rs)
                    wall = sum(r["time/iteration_s"] for r in rs)
                    n = len(rs)
                    out.append(dict(lam=lam, top_up=top_up, mode=mode, iterations=n, trained_tokens=tokens,
                                    trained_seqs=sum(r["trained"] for r in rs), wall_s=wall,
                                    s_per_1k_tokens=1000 * wall / max(tokens, 1),
                                    launched=sum(r["rollout/launched"] for r in rs) / n,
                                    rollout_s=sum(r["time/rollout_s"] for r in rs) / n,
                                    train_s=sum(r["time/train_s"] for r in rs) / n,
                                    overlap_wait_s=sum(r["time/overlap_wait_s"] for r in rs) / n,
                                    sync_s=sum(r["time/sync_s"] for r in rs) / n,
                                    overlapped=sum(r["rollout/overlapped"] for r in rs),
                                    staleness_max=max(r["staleness/max"] for r in rs),
                                    load_average=os.getloadavg()[0]))
                    print(f"  {mode} λ={lam} top-up {top_up}: {tokens} trained tokens, {wall:.1f}s", flush=True)
    base = next(r for r in out if r["lam"] == 1.0 and r["mode"] == "sync")
    for r in out:
        r["ratio_vs_sync_lam1"] = r["s_per_1k_tokens"] / base["s_per_1k_tokens"]
    return dict(lengths=lengths, rows=out)


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lams", default="1.0,0.7,0.5")
    ap.add_argument("--tokens", type=int, default=12_000, help="trained tokens per λ")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations of λ < 1 (default max_staleness + 2)")
    ap.add_argument("--fit-steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-dir", type=Path, default=None,
                    help="load the fitted policy from here if saved, else fit and save it here")
    ap.add_argument("--quick", action="store_true", help="4 groups x 4, 2K trained tokens per λ")
    ap.add_argument("--top-up", choices=["groups", "trajectories"], default="groups",
                    help="rollout.top_up for λ < 1 (rlk3/rollout/partial.py)")
    ap.add_argument("--lr", type=float, default=0.0, help="the trainer's learning rate (0: the policy stays fixed)")
    ap.add_argument("--qb-update", action="store_true", help="Quantile Balancing router-bias updates on")
    ap.add_argument("--ray", action="store_true", help="also the Ray driver's overhead (see ray_overhead)")
    ap.add_argument("--ray-only", action="store_true", help="only the Ray driver's overhead")
    ap.add_argument("--ray-overlap", action="store_true",
                    help="only the Ray driver per λ, synchronous vs cluster.overlap (see ray_overlap)")
    ap.add_argument("--ray-lam", type=float, default=0.7)
    ap.add_argument("--ray-iterations", type=int, default=8, help="timed iterations per Ray run")
    ap.add_argument("--ray-warmup", type=int, default=4, help="untimed iterations first (--ray-overlap)")
    ap.add_argument("--share-prompts", action="store_true", help="train.share_prompts in every Ray run "
                    "(--ray-overlap)")
    ap.add_argument("--ray-top-ups", default="groups,trajectories", help="rollout.top_up values for λ < 1 "
                    "(--ray-overlap)")
    ap.add_argument("--out", default="partial_rollout")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.tokens = 4, 2_000
    torch.set_num_threads(args.threads)
    tok = default_tokenizer()

    t = time.perf_counter()
    if args.policy_dir is not None and (args.policy_dir / "config.json").is_file():
        model, how = K3ForCausalLM.from_pretrained(str(args.policy_dir)).eval(), f"loaded from {args.policy_dir}"
    else:
        model, how = fit_policy(tok, args.fit_steps, args.seed), f"fitted ({args.fit_steps} steps)"
        if args.policy_dir is not None:
            model.save_pretrained(str(args.policy_dir))
    fit_s = time.perf_counter() - t
    print(f"policy: k3-tiny {how} in {fit_s:.1f}s; load average {os.getloadavg()[0]:.2f}", flush=True)

    result = dict(args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, demos=DEMOS,
                  efforts=EFFORTS, fit_s=fit_s, policy=how, threads=args.threads)
    if args.ray_overlap:
        result["ray_overlap"] = ov = ray_overlap(model, tok, args)
        print(f"\nRay driver, synchronous (colocated) vs cluster.overlap (disaggregated), {args.ray_iterations} "
              f"iterations each, configs/quickstart.yaml, {args.groups} groups x {args.group_size}")
        print_table(ov["rows"], ["lam", "top_up", "mode", "iterations", "trained_tokens", "wall_s",
                                 "s_per_1k_tokens", "ratio_vs_sync_lam1", "launched", "rollout_s", "train_s",
                                 "overlap_wait_s", "sync_s", "overlapped", "staleness_max", "load_average"])
        result["load_average_end"] = os.getloadavg()
        write_json(args.out + "-overlap", result)
        return
    if not args.ray_only:
        result["rows"] = rows = asyncio.run(run_lambdas(model, tok, [float(x) for x in args.lams.split(",")], args))
        for r in rows:
            print(f"λ={r['lam']}: {r['warmup_iterations']} + {r['iterations']} iterations, {r['trained_tokens']} "
                  f"trained tokens in {r['wall_s']:.1f}s (mean load average {r['load_average_mean']:.2f})")
        base = next((r for r in rows if r["lam"] == 1.0), rows[0])
        for r in rows:
            r["ratio_s_per_1k_vs_lam1"] = r["s_per_1k_tokens"] / base["s_per_1k_tokens"]
            r["ratio_s_per_iteration_vs_lam1"] = r["s_per_iteration"] / base["s_per_iteration"]
            r["ratio_cpu_s_per_1k_vs_lam1"] = r["cpu_s_per_1k_tokens"] / base["cpu_s_per_1k_tokens"]
        tail = base["gen_p99"] / max(base["gen_p50"], 1)
        print(f"\nk3-tiny on CPU ({args.threads} thread), {args.groups} groups x {args.group_size}, max "
              f"{args.max_new_tokens} new tokens, max_staleness {args.max_staleness}, top-up by {args.top_up}, "
              f"until {args.tokens} trained tokens per λ; generated tokens at λ = {base['lam']}: p50 "
              f"{base['gen_p50']:.0f}, p99 {base['gen_p99']:.0f} (p99/p50 = {tail:.1f})")
        print_table(rows, ["lam", "iterations", "trained_tokens", "wall_s", "s_per_1k_tokens",
                           "ratio_s_per_1k_vs_lam1", "cpu_s_per_1k_tokens", "ratio_cpu_s_per_1k_vs_lam1",
                           "s_per_iteration", "rollout_s_per_iteration",
                           "train_s_per_iteration", "sync_s_per_iteration", "weight_sync_ms"])
        print()
        print_table(rows, ["lam", "gen_p50", "gen_p90", "gen_p99", "gen_max", "gen_mean", "trained_seqs",
                           "groups_per_iteration", "paused", "restarted_stale", "staleness_max",
                           "engine_generated_tokens", "buffered_generated_at_start", "buffered_generated_at_end"])
    if args.ray or args.ray_only:
        result["ray"] = ray = ray_overhead(model, tok, args)
        print(f"\nRay overhead: λ = {args.ray_lam}, {args.ray_iterations} iterations, configs/quickstart.yaml")
        print_table(ray["rows"], ["path", "iterations", "trained_tokens", "s_per_iteration", "ratio_vs_in_process",
                                  "rollout_s_per_iteration", "train_s_per_iteration", "sync_s_per_iteration",
                                  "setup_s", "run_rl_wall_s", "outside_iterations_s"])
    result["load_average_end"] = os.getloadavg()
    write_json(args.out + ("-ray" if args.ray_only else ""), result)


if __name__ == "__main__":
    main()
