"""The RL driver: schedule → grade → train → sync → checkpoint → eval, on Ray.

    python -m rlk3 rl configs/quickstart.yaml [key=value ...]        (or under `ray job submit`, see recipes/)

The loop below is the whole algorithm; everything it calls is one method on a worker (rlk3/cluster/workers.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlk3.cluster.checkpoint import Checkpoints, MetricsLog, resume_point
from rlk3.cluster.workers import RolloutWorker, TrainWorker, budget_fn
from rlk3.config import heldout_notes, heldout_sizes
from rlk3.rollout.trajectory import Trajectory


def run_rl(cfg, log=print) -> Path:
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for note in heldout_notes(cfg):
        log(f"rl: {note}")
    cluster = Cluster(cfg, out)
    ckpts, metrics = Checkpoints(out / "checkpoints"), MetricsLog(out, cfg)
    start, rollout_state = 0, None
    if (saved := resume_point(ckpts, metrics, cfg.run.resume)) is not None:
        start, rollout_state = cluster.restore(saved), saved.rollout
        log(f"rl: resumed from {saved.path} at iteration {start}")
    _, budget = budget_fn(cfg)
    samples = metrics.last("samples", 0)
    ahead = None  # cluster.overlap: the next iteration's rollout, running while this one trains
    for it in range(start, cfg.run.iterations):
        t0 = time.perf_counter()
        # schedule (+ grade: episodes are graded as they end)
        trajs, stats, rollout_s = ahead.result() if ahead else cluster.rollout(it, rollout_state)
        rollout_state, ahead = None, None
        if cfg.run.stage == "mopd" and trajs:
            trajs, stats["distil"] = cluster.distil(trajs)  # per-token teacher rewards, routed by (domain, effort)
        t1 = time.perf_counter()
        if cluster.overlaps(it):  # iteration it + 1 samples under the current weights while this one trains
            ahead = cluster.rollout_ahead(it + 1)
        train_metrics = cluster.train(trajs) if trajs else {}  # train
        t2 = time.perf_counter()
        if ahead:
            ahead.result()  # the engine takes new weights once the overlapped rollout is done
        t3 = time.perf_counter()
        version = cluster.sync()  # sync
        t4 = time.perf_counter()
        samples += len(trajs)
        row = summarize(trajs, stats, train_metrics, it, budget.at(it), samples,
                        {"time/rollout_s": rollout_s, "time/train_s": t2 - t1, "time/overlap_wait_s": t3 - t2,
                         "time/sync_s": t4 - t3, "time/iteration_s": t4 - t0,
                         "rollout/overlapped": int(ahead is not None), "version": version})
        if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0:  # eval
            row.update(cluster.evaluate(budget.at(it)))
        metrics.write(row)
        log(one_line(row))
        if (it + 1) % cfg.run.checkpoint_every == 0 or it + 1 == cfg.run.iterations:  # checkpoint
            ckpts.save(it + 1, cluster.trainer_state(), cluster.rollout_state())
    final = out / "final"
    cluster.save_model(final, manifest={"stage": cfg.run.stage, "domains": list(cfg.tasks.domains),
                                        "effort": cfg.effort.level, "budget": budget.at(cfg.run.iterations),
                                        "iterations": cfg.run.iterations, "samples": samples,
                                        "last_metrics": metrics.last_row()})
    cluster.close()
    return final


def summarize(trajs: list[Trajectory], stats: dict, train: dict, it: int, budget: int, samples: int, extra: dict):
    n = max(len(trajs), 1)
    return {
        "iteration": it, "budget": budget, "samples": samples,
        "reward/mean": sum(t.reward or 0.0 for t in trajs) / n,
        "pass_rate": sum(bool(t.metrics.get("passed")) and not t.metrics.get("over_budget") for t in trajs) / n,
        "tokens/mean": sum(t.num_generated for t in trajs) / n,
        "over_budget_rate": sum(bool(t.metrics.get("over_budget")) for t in trajs) / n,
        "trained": len(trajs),
        "failed": sum(t.status == "failed" for t in trajs),
        "grader_errors": sum(bool(t.metrics.get("grader_error")) for t in trajs),
        "staleness/max": max((t.policy_versions[-1] - min(t.policy_versions) for t in trajs if t.policy_versions),
                             default=0),
        **{f"rollout/{k}": v for k, v in stats.items() if isinstance(v, int | float)},
        **stats.get("distil", {}),
        **train, **extra,
    }


def one_line(r: dict) -> str:
    ev = " ".join(f"{k}={v:.2f}" for k, v in r.items() if k.startswith("eval/") and k.endswith("pass_rate"))
    return (f"it {r['iteration']:>3} | reward {r['reward/mean']:+.3f} pass {r['pass_rate']:.2f} "
            f"tokens {r['tokens/mean']:.0f} over {r['over_budget_rate']:.2f} budget {r['budget']} | "
            f"trained {r['trained']} paused {r.get('rollout/paused', 0)} stale {r['staleness/max']} | "
            f"rollout {r['time/rollout_s']:.1f}s train {r['time/train_s']:.1f}s sync {r['time/sync_s']:.2f}s"
            + (f" | {ev}" if ev else "")
            + (f" | GRADER ERRORS {r['grader_errors']} (scored 0; see metrics['grade_reasons'])"
               if r.get("grader_errors") else ""))


def connect(cfg) -> None:
    """Join ``cluster.ray_address`` (None: start a local head), once per process."""
    if not ray.is_initialized():
        ray.init(address=cfg.cluster.ray_address, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})


def bundles(cfg) -> list[dict[str, int]]:
    """One run's placement group. Colocated: bundle r holds train rank r, and bundle 0 also the rollout worker (and
    MOPD's teacher pool); disaggregated: the rollout worker, then one bundle per train rank, then the teachers."""
    res = {"CPU": 1} | ({"GPU": 1} if cfg.cluster.num_gpus else {})
    n_train = cfg.cluster.train_workers
    return [res] * (n_train if cfg.cluster.colocate else 1 + n_train + (cfg.run.stage == "mopd"))


def runs_that_fit(cfg) -> int:
    """How many runs of ``cfg``'s placement group the Ray cluster holds at once (at least 1)."""
    connect(cfg)
    have, need = ray.cluster_resources(), bundles(cfg)
    return max(1, min(int(have.get(r, 0)) // sum(b.get(r, 0) for b in need) for r in need[0]))


class Cluster:
    """The Ray side: one placement group; rollout and train workers colocated in its bundle (or in two bundles
    when ``cluster.colocate`` is off). With ``cluster.train_workers`` = N > 1 there are N data-parallel train
    ranks, one bundle each (rank 0 shares the rollout worker's when colocated), joined into one process group.
    A rollout worker that dies is restarted, given the trainer's weights and the carry-over buffer as the last
    rollout left it: in a rollout, the iteration runs again; between rollouts (an evaluation, a weight push, a
    checkpoint), before the next call to it; in a weight push, at once. No trajectory is lost.

    Under ``cluster.overlap`` a rollout (and so a restart) runs on a thread while the driver trains: calls that go
    to every train rank are submitted under one lock, so each rank sees them in the same order (two collectives
    queued in different orders on two ranks would wait on each other forever)."""

    def __init__(self, cfg, out: Path) -> None:
        self.cfg, self.out = cfg, out
        connect(cfg)
        mopd = cfg.run.stage == "mopd"
        n_train, colocate = cfg.cluster.train_workers, cfg.cluster.colocate
        self.pg = placement_group(bundles(cfg), strategy="PACK")
        ray.get(self.pg.ready())
        share0 = 1.0 / (2 + mopd) if colocate else 1.0  # the actors of bundle 0 split its resources

        def opts(i, share=1.0):
            return dict(num_cpus=share, num_gpus=share if cfg.cluster.num_gpus else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i))

        def train_opts(rank):
            return opts(rank, share0 if rank == 0 else 1.0) if colocate else opts(1 + rank)

        self._rollout_opts = opts(0, share0)
        self.teachers = None
        if cfg.run.stage == "mopd":  # refused here, before any rollout, if a teacher's tokenizer differs
            from rlk3.cluster.teachers import TeacherPool

            teacher_opts = opts(0, share0) if colocate else opts(1 + n_train)
            self.teachers = ray.remote(TeacherPool).options(**teacher_opts).remote(
                dict(cfg.mopd.teachers), cfg.model.init_from, temperature=cfg.rollout.temperature or 1.0,
                max_resident=cfg.mopd.max_resident, threads=cfg.cluster.cpu_threads or 1)
            ray.get(self.teachers.__ray_ready__.remote())
        self.trainers = [ray.remote(TrainWorker).options(**train_opts(r)).remote(cfg, r, n_train)
                         for r in range(n_train)]
        if n_train > 1:  # data parallel: every rank joins rank 0's process group, then builds its trainer shard
            host, port = ray.get(self.trainers[0].address.remote())
            ray.get([t.join.remote(host, port) for t in self.trainers])
        self.trainer = self.trainers[0]
        self.worker = self._new_rollout()
        self._open_weight_group()
        # on a shared GPU the engine's pool makes room for training; on CPU memory is not the constraint and a
        # release would drop the caches paused trajectories keep across the iteration boundary
        self.release_pool = cfg.cluster.colocate and bool(cfg.cluster.num_gpus)
        self.version = 0  # the version the engine holds
        self._submit = threading.RLock()  # see the class docstring
        self._buffer: dict | None = None  # the rollout worker's carry-over buffer as its last rollout left it
        self._ahead_pool: ThreadPoolExecutor | None = None

    def _new_rollout(self):
        return ray.remote(RolloutWorker).options(**self._rollout_opts).remote(self.cfg, str(self.out))

    def _revive(self, why: str, e: BaseException, then: str = "") -> None:
        """A new rollout worker in the dead one's place: the weight group rejoined, the carry-over buffer as the
        last rollout left it, the trainer's weights labelled with their own version (under overlap the step
        running beside this may have finished; version 0 is the checkpoint the new worker loaded)."""
        # why it died (killed, out of memory, a crash in the engine) is in Ray's error: say it, or a run that
        # recovers leaves only 'died' in its log and a recurring cause goes unnoticed until it stops the run
        print(f"rl: the rollout worker died {why} ({type(e).__name__}: {e}); restarting it{then}", flush=True)
        self.worker = self._new_rollout()
        self._open_weight_group()
        if self._buffer is not None:
            ray.get(self.worker.load_state.remote(self._buffer))
        self.version = self._push() if ray.get(self.trainer.version.remote()) else 0

    def _death(self) -> RayActorError | None:
        """Ray's error if the rollout worker is dead (None while it answers)."""
        try:
            ray.get(self.worker.__ray_ready__.remote())
        except RayActorError as e:
            return e
        return None

    def _live_worker(self):
        """The rollout worker, revived first if it died since its last rollout."""
        if (e := self._death()) is not None:
            self._revive("between rollouts", e)
        return self.worker

    def _open_weight_group(self) -> None:
        """``cluster.weight_sync: broadcast``: train rank 0 and the rollout worker meet in a group of two."""
        if self.cfg.cluster.weight_sync == "broadcast":
            host, port = ray.get(self.trainer.address.remote())
            ray.get([self.trainer.open_weight_group.remote(host, port),
                     self.worker.open_weight_group.remote(host, port)])

    def _push(self, version: int | None = None) -> int:
        """Trainer weights → engine, as ``cluster.weight_sync`` says (rlk3/cluster/weight_sync.py); returns the
        version the engine now holds. ``version`` None: the trainer's, read in the same submission as the weights,
        so that the label is the weights' own even while a step is running (a restart during an overlapped step)."""
        mode = self.cfg.cluster.weight_sync
        with self._submit:  # the version read, then the weights, with no other train call between them on rank 0
            v = self.trainer.version.remote() if version is None else version
            if mode == "broadcast":  # sent inside the trainer's call: a step queued after it waits for it
                train = self._on_all("send_weights")
                taken = self.worker.recv_weights.remote(v)
            elif mode == "object_store":  # serialised when rank 0's call returns, before a step queued after it runs
                w = self._on_all("weights")  # the other ranks take part in gathering them
                train, taken = w[1:], self.worker.update_weights.remote(w[0], v)
            else:  # cuda_ipc: the engine reads the trainer's own tensors; no step may be submitted until it has
                refs = self._on_all("share_weights")
                ray.get(refs[1:])
                try:
                    ray.get(self.worker.open_cuda_weights.remote(refs[0], v))
                finally:  # copied (or refused): the trainer's tensors behind the handles are no longer needed
                    ray.get(self.trainer.drop_shared.remote())
                train, taken = [], None
        try:
            if taken is not None:
                ray.get(taken)
        except RayActorError:
            # the engine's side first: a rollout worker that dies as it takes a broadcast makes rank 0's send fail
            # too, and that failure is the worker's death, which the caller revives, not an error of the trainer's
            if train:
                ray.wait(train, num_returns=len(train))
            raise
        ray.get(train)
        return ray.get(v) if version is None else version

    def _on_all(self, method: str, *args) -> list:
        """Call a train method on every rank (under data parallelism each is a collective): one ref per rank."""
        with self._submit:
            return [getattr(t, method).remote(*args) for t in self.trainers]

    def restore(self, saved) -> int:
        ray.get(self._on_all("load_state", ray.put(saved.trainer)))
        self.sync()
        return saved.iteration

    def overlaps(self, it: int) -> bool:
        """Whether iteration ``it + 1``'s rollout runs during ``it``'s training (``cluster.overlap``): not past the
        end, and not when a checkpoint follows ``it`` (it must see the carry-over buffer with no rollout in flight)."""
        cfg = self.cfg
        return (cfg.cluster.overlap and it + 1 < cfg.run.iterations
                and (it + 1) % cfg.run.checkpoint_every != 0)

    def rollout_ahead(self, it: int) -> Future:
        """``rollout(it)`` on a thread (its Ray calls run while the driver trains); ``.result()`` as ``rollout``'s."""
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        return self._ahead_pool.submit(self.rollout, it, None, True)

    def rollout(self, it: int, state: dict | None, ahead: bool = False) -> tuple[list[Trajectory], dict, float]:
        """Iteration ``it``'s complete groups, the scheduler's stats and the seconds it took. ``ahead``: it runs while
        the previous iteration trains (``cluster.overlap``), so what it returns trains one version later."""
        t = time.perf_counter()
        trajs, stats = self._rollout(it, state, ahead)
        return trajs, stats, time.perf_counter() - t

    def _rollout(self, it: int, state: dict | None, ahead: bool = False) -> tuple[list[Trajectory], dict]:
        worker = self._live_worker()
        if state is not None:  # a resume: the checkpoint's buffer
            ray.get(worker.load_state.remote(state))
            self._buffer = state
        elif self._buffer is None:  # the first rollout of this driver
            self._buffer = ray.get(worker.state.remote())
        trains_under = self.version + ahead  # the version these trajectories will train under
        for attempt in range(3):
            try:
                if self.release_pool:
                    ray.get(self.worker.reacquire_memory.remote())
                # a restart during an overlapped step may have given the engine that version already
                dicts, stats = ray.get(self.worker.iterate.remote(it, trains_under - self.version))
                if self.release_pool:
                    ray.get(self.worker.release_memory.remote())  # training's turn for the memory
                # what a worker that dies before the next rollout restarts from (a death inside one reruns it from
                # the buffer as it began)
                self._buffer = ray.get(self.worker.state.remote())
                stats["restarts"] = attempt
                return [Trajectory.from_dict(d) for d in dicts], stats
            except RayActorError as e:
                if attempt == 2:
                    raise
                self._revive(f"in iteration {it}", e, " and running the iteration again")
        raise AssertionError("unreachable")

    def distil(self, trajs: list[Trajectory]) -> tuple[list[Trajectory], dict]:
        dicts, metrics = ray.get(self.teachers.score.remote([t.to_dict() for t in trajs], self.cfg.mopd.clip,
                                                            self.cfg.mopd.alpha))
        return [Trajectory.from_dict(d) for d in dicts], metrics

    def train(self, trajs: list[Trajectory]) -> dict:
        return ray.get(self._on_all("step", ray.put([t.to_dict() for t in trajs])))[0]

    def sync(self) -> int:
        """Trainer weights → engine when they are newer (with λ < 1 an iteration may complete no group and train
        nothing): through the object store, a broadcast group or CUDA IPC handles (``cluster.weight_sync``)."""
        version = ray.get(self.trainer.version.remote())
        if version > self.version:
            self._live_worker()  # one revived here starts with the trainer's weights
            if version > self.version:
                try:
                    self._push(version)
                    self.version = version
                except RayActorError as e:
                    if self._death() is None:  # another actor died (a train rank): not the rollout worker's to mend
                        raise
                    self._revive("during a weight push", e)  # the new worker gets the trainer's weights
        return self.version

    def evaluate(self, budget: int) -> dict:
        from rlk3.rollout.demos import DEFAULT_BUDGETS

        cfg = self.cfg
        if cfg.run.stage == "mopd":
            slices = [(d, e, DEFAULT_BUDGETS[e]) for d in cfg.tasks.domains for e in cfg.rollout.efforts]
        else:
            slices = [(d, cfg.effort.level, budget) for d in cfg.tasks.domains]
        res = ray.get(self._live_worker().evaluate.remote(slices, heldout_sizes(cfg)))
        out = {}
        for r in res:
            for k in ("pass_rate", "mean_tokens", "over_budget_rate"):
                out[f"eval/{r['domain']}/{r['effort']}/{k}"] = r[k]
        return out

    def trainer_state(self):
        return ray.get(self._on_all("state"))[0]

    def rollout_state(self):
        return ray.get(self._live_worker().state.remote())

    def save_model(self, path: Path, manifest: dict) -> None:
        path.mkdir(parents=True, exist_ok=True)
        ray.get(self._on_all("save_model", str(path)))
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))

    def close(self) -> None:
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown()
        with contextlib.suppress(RayActorError):
            ray.get(self.worker.close.remote())
        ray.util.remove_placement_group(self.pg)
