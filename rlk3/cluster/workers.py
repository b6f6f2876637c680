"""The two workers of a run. Plain classes: the driver wraps them as Ray actors (``ray.remote``); tests may also
use them in-process.

``RolloutWorker`` owns the engine, the sandbox service client, the graders and the partial-rollout scheduler;
``TrainWorker`` owns the trainable model and its optimizer. Colocated (the default), both live in one placement
group bundle and alternate: the rollout worker releases its engine pool while training runs
(``release_memory``) and takes it back for the next iteration; weights move through Ray's shared-memory object
store, a two-member NCCL/gloo broadcast group, or CUDA IPC handles on one GPU (``cluster.weight_sync``,
rlk3/cluster/weight_sync.py).
"""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path

import torch

from rlk3.algo.effort import BudgetSchedule
from rlk3.rollout.demos import DEFAULT_BUDGETS


def setup_process(cfg) -> None:
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(cfg.cluster.cpu_threads or 1)


def build_policy(cfg):
    """(model, tokenizer): the checkpoint in ``model.init_from`` (the SFT output), or a fresh preset model with the
    built-in tokenizer when there is none (smoke runs)."""
    from harness.tokenizer import default_tokenizer, load_tokenizer
    from rlk3.model import K3Config, K3ForCausalLM

    if cfg.model.init_from:
        path = Path(cfg.model.init_from)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.init_from={path}: no config.json there (expected an SFT/RL checkpoint)")
        return K3ForCausalLM.from_pretrained(str(path)), load_tokenizer(path)
    tok = default_tokenizer()
    k3 = K3Config.preset(cfg.model.preset, **{**dict(cfg.model.overrides), "vocab_size": len(tok)})
    return K3ForCausalLM(k3), tok


def budget_fn(cfg):
    """effort, step → the budget stated in the prompt and enforced. The run's own effort level anneals from
    ``effort.budget_start`` down to ``effort.budget``; other levels (MOPD's mixed prompts) use the defaults."""
    e = cfg.effort
    sched = BudgetSchedule(start=e.budget_start or e.budget, end=e.budget, steps=e.anneal_steps,
                           kind=e.schedule if e.budget_start else "constant")

    def at(effort: str, step: int) -> int:
        return sched.at(step) if effort == e.level else DEFAULT_BUDGETS[effort]

    return at, sched


def engine_config(cfg):
    """The rollout engine's settings from the run's config (``rollout.engine`` on top of the run's own)."""
    from rlk3.config import engine_settings
    from rlk3.engine import EngineConfig

    return EngineConfig(**engine_settings(cfg))


class RolloutWorker:
    def __init__(self, cfg, state_dir: str) -> None:
        from rlk3.config import task_files
        from rlk3.engine import RolloutEngine
        from rlk3.rollout.agent_loop import LoopConfig
        from rlk3.rollout.env import RolloutEnv
        from rlk3.rollout.partial import PartialRollouts, PromptSource

        setup_process(cfg)
        self.cfg = cfg
        model, self.tokenizer = build_policy(cfg)
        # generation runs at model.dtype (k3-small's bfloat16 halves the bytes a decode step reads); the trainer keeps
        # float32 weights, which update_weights casts into the engine's
        model = model.to(getattr(torch, cfg.model.dtype))
        if torch.cuda.is_available():  # a Ray actor sees the GPU of its bundle only (cluster.num_gpus > 0)
            model = model.cuda()
        self.engine = RolloutEngine(model.eval(), engine_config(cfg))
        self.env = RolloutEnv(self.tokenizer, domains=tuple(sorted(set(cfg.tasks.domains))),
                              sandbox_url=cfg.cluster.sandbox_url,
                              sandbox_api_key=cfg.cluster.sandbox_api_key, state_dir=Path(state_dir) / "sandboxes")
        self.env.__enter__()
        r = cfg.rollout
        self.loop = self.env.loop(self.engine, LoopConfig(
            temperature=r.temperature, top_p=r.top_p, max_turn_tokens=r.max_new_tokens,
            max_context_tokens=r.max_total_tokens, max_turns=cfg.harness.max_turns, seed=cfg.run.seed,
            snapshot_turns=r.snapshot_turns))
        budget, _ = budget_fn(cfg)
        efforts = [cfg.effort.level] if cfg.run.stage == "rl" else list(r.efforts)
        source = PromptSource(list(cfg.tasks.domains), efforts, budget, weights=list(cfg.tasks.weights) or None,
                              train_size=cfg.tasks.train_size, seed=cfg.run.seed, files=task_files(cfg))
        self.partial = PartialRollouts(self.loop, source, groups=r.groups_per_iteration, group_size=r.group_size,
                                       lam=r.lam, max_staleness=r.max_staleness, top_up=r.top_up)
        self.aio = asyncio.new_event_loop()

    def pid(self) -> int:
        return os.getpid()

    def iterate(self, step: int, ahead: int = 0) -> tuple[list[dict], dict]:
        """One iteration of partial rollouts; the complete groups' trajectories (as dicts) and the stats. ``ahead``
        (``cluster.overlap``): the previous iteration is training meanwhile, so these trajectories train under the
        version ``ahead`` (1) after the engine's; the scheduler counts staleness against that one, and
        ``rollout.max_staleness`` bounds what the trainer sees (against the engine's, a trained token could lag by
        one more)."""
        trajs, stats = self.aio.run_until_complete(self.partial.iterate(step, self.engine.version, ahead=int(ahead)))
        s = stats.__dict__.copy()
        s["engine"] = self.engine.stats().__dict__ if hasattr(self.engine.stats(), "__dict__") else {}
        return [t.to_dict() for t in trajs], s

    def update_weights(self, weights: dict, version: int) -> None:
        self.engine.update_weights(weights, version)

    def open_weight_group(self, host: str, port: int) -> None:
        """Join train rank 0's two-member group as the receiver (``cluster.weight_sync: broadcast``)."""
        from rlk3.cluster.weight_sync import WeightGroup

        self.wgroup = WeightGroup(host, port, 1, device=str(next(self.engine.model.parameters()).device))

    def recv_weights(self, version: int) -> None:
        stream = self.wgroup.recv()
        try:
            self.engine.update_weights(stream, version)
        finally:
            # the trainer's send blocks until every bucket is taken: an update the engine refuses before reading the
            # stream (a version that is not newer) must still take the rest, or the trainer waits out the group's
            # timeout and the next send/recv pair starts out of step. A no-op when the update read it all.
            for _ in stream:
                pass

    def open_cuda_weights(self, handles: dict, version: int) -> None:
        """``cluster.weight_sync: cuda_ipc``: copy from the trainer's GPU memory, device to device."""
        from rlk3.cluster.weight_sync import open_cuda

        self.engine.update_weights(open_cuda(handles), version)
        torch.cuda.synchronize()  # the copies are done before the trainer may touch its tensors again

    def release_memory(self) -> None:
        self.engine.release_memory()

    def reacquire_memory(self) -> None:
        self.engine.reacquire_memory()

    def state(self) -> dict:
        return self.partial.state()

    def load_state(self, s: dict) -> None:
        self.partial.load_state(s)

    def evaluate(self, slices: list[tuple[str, str, int | None]], n: int | dict[str, int]) -> list[dict]:
        from rlk3.config import task_files
        from rlk3.rollout.agent_loop import AgentLoop, LoopConfig
        from rlk3.rollout.evaluate import evaluate_slices

        greedy = AgentLoop(self.loop.front, self.loop.harnesses, sandboxes=self.loop.sandboxes,
                           grading=self.loop.grading,
                           config=LoopConfig(temperature=0.0, max_turn_tokens=self.cfg.rollout.max_new_tokens,
                                             max_context_tokens=self.cfg.rollout.max_total_tokens,
                                             max_turns=self.cfg.harness.max_turns))  # the rollouts' own limits
        # colocated on a GPU the driver released the pool after the rollout (training's turn for the memory), and
        # the engine refuses to step without it: take it back for the evaluation, and give it back afterwards
        released = self.engine.released
        if released:
            self.engine.reacquire_memory()
        try:
            res, _ = self.aio.run_until_complete(evaluate_slices(greedy, slices, n, files=task_files(self.cfg)))
        finally:
            if released:
                self.engine.release_memory()
        return [r.to_dict() for r in res]

    def close(self) -> None:
        self.aio.run_until_complete(self.loop.front.close())
        self.env.__exit__(None, None, None)


class TrainWorker:
    """One training rank. With ``world == 1`` (the default) the trainer is built at once; with several ranks the
    driver asks rank 0 for an address, every rank joins the process group (``join``: gloo on CPU, NCCL on GPUs, each
    actor's GPU is its device 0) and the trainer is built there, FSDP2-sharded. Under data parallelism every rank
    takes part in ``step``, ``weights``, ``state``, ``load_state`` and ``save_model`` (each is a collective); rank 0
    returns the results, the others ``None``/empty."""

    def __init__(self, cfg, rank: int = 0, world: int = 1) -> None:
        setup_process(cfg)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.trainer = None
        self.wgroup = None  # cluster.weight_sync: broadcast (rank 0 only)
        if world == 1:
            self._build()

    def address(self) -> tuple[str, int]:
        """Where the ranks meet (rank 0's node and a free port on it)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int) -> None:
        import torch.distributed as dist

        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world)
        self._build()

    def _build(self) -> None:
        from rlk3.train.trainer import Trainer

        cfg = self.cfg
        # a Ray actor sees only its bundle's GPU (none when cluster.num_gpus is 0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, self.tokenizer = build_policy(cfg)
        model = model.to(device, torch.float32)  # float32 weights and optimizer state, whatever the checkpoint's dtype
        ref = None
        if cfg.train.kl_coef > 0:
            # the anchor is the policy's starting weights: a copy, not a second build_policy, which without
            # model.init_from draws another random model from the advanced RNG
            ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.trainer = Trainer(model, cfg.train, temperature=cfg.rollout.temperature or 1.0, ref_model=ref)

    def step(self, trajs: list[dict]) -> dict:
        from rlk3.rollout.trajectory import Trajectory

        metrics = self.trainer.step([Trajectory.from_dict(d) for d in trajs])
        self._give_back_cache()
        return metrics

    def _give_back_cache(self) -> None:
        """Colocated on a GPU, the engine in the rollout worker's process takes its pool back next
        (``reacquire_memory``), and it can use only memory the device reports free: the activations and gathered
        weights this process just freed stay reserved by its caching allocator, invisible to the other process, and
        the reacquire would fail with PoolError (or leave the pool smaller than sized) for want of them."""
        if self.cfg.cluster.colocate and self.cfg.cluster.num_gpus and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def weights(self) -> dict:
        w = self.trainer.weights()
        out = {k: v.cpu() for k, v in w.items()} if self.rank == 0 else {}
        del w  # under data parallelism the gathered full weights: freed before the cache is given back
        self._give_back_cache()
        return out

    def open_weight_group(self, host: str, port: int) -> None:
        """Rank 0 opens the two-member group it broadcasts weights over (``cluster.weight_sync: broadcast``)."""
        from rlk3.cluster.weight_sync import WeightGroup

        if self.rank == 0:
            if self.wgroup is not None:  # a restarted rollout worker means a new group
                self.wgroup.close()
            self.wgroup = WeightGroup(host, port, 0, device=str(self.trainer.device))

    def send_weights(self) -> int:
        """Every rank gathers (a collective under data parallelism); rank 0 broadcasts. Returns bytes sent."""
        w = self.trainer.weights()
        return self.wgroup.send(w) if self.rank == 0 else 0

    def share_weights(self) -> dict:
        """CUDA IPC handles of rank 0's full weights (``cluster.weight_sync: cuda_ipc``); the tensors stay referenced
        here until the next call, so the handles stay valid while the engine copies."""
        from rlk3.cluster.weight_sync import share_cuda

        w = self.trainer.weights()  # under data parallelism a collective: full weights gathered on every rank
        if self.rank != 0:
            del w  # nothing is shared from here: not kept (a full copy per GPU would undo the sharding)
            self._give_back_cache()
            return {}
        self._shared = {k: v.contiguous() for k, v in w.items()}
        return share_cuda(self._shared)

    def drop_shared(self) -> None:
        """The engine has copied the shared weights (``open_cuda_weights`` synchronises before it returns): the
        tensors behind the handles may go. Under data parallelism they are a gathered full copy, which would
        otherwise stay on rank 0's GPU through the next rollout and training step."""
        self._shared = None
        self._give_back_cache()

    def version(self) -> int:
        return self.trainer.version

    def state(self) -> dict | None:
        s = self.trainer.state()
        return s if self.rank == 0 else None

    def load_state(self, s: dict) -> None:
        self.trainer.load_state(s)

    def save_model(self, path: str) -> None:
        if self.world == 1:
            self.trainer.model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            return
        from rlk3.model import K3ForCausalLM

        full = self.trainer.weights()  # gathered on every rank; rank 0 writes them through a plain model
        if self.rank == 0:
            plain = K3ForCausalLM(self.trainer.model.config)
            plain.load_state_dict({k: v.cpu() for k, v in full.items()})
            plain.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
