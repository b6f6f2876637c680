"""Partial rollouts: a λ cutoff per iteration and a carry-over buffer (DESIGN.md §2, issue 7).

Each iteration:

1. top up with fresh prompt groups of ``group_size`` samples each, after the carry-over buffer's groups:
   ``top_up="groups"`` (the default) to ``groups`` groups in all, ``top_up="trajectories"`` to
   ``groups × group_size`` *unfinished* trajectories (see below);
2. restart carried-over trajectories whose oldest token lags the current policy by more than ``max_staleness``
   versions (their cache and sandbox are dropped; the uid stays, so nothing is lost or duplicated);
3. run every unfinished trajectory (paused ones resume where they stopped: engine cache and sandbox kept);
4. once ``ceil(λ · launched)`` have finished, pause the rest — except the trajectories that one more pause would
   make stale (oldest token ``max_staleness`` versions behind): they run to their end in this iteration. Restarting
   them instead would throw their work away, and a trajectory longer than ``max_staleness + 1`` cutoffs' worth of
   tokens would never finish (the long tail would go untrained). So restarts only happen when the version jumps by
   more than one between iterations (a reload), and an early finisher waiting for a restarted sample's group is
   restarted with it: no trained token lags by more than ``max_staleness``. A rollout run while the previous
   iteration trains (``ahead``, ``cluster.overlap``) counts against the version it will train under. With
   ``max_staleness = 0`` (or 1 under overlap) a trajectory started now is already due: nothing is paused, and λ has
   no effect (the config refuses that combination);
5. hand over the groups whose samples have all finished (group-normalised advantages need whole groups); the
   rest — paused samples and the early finishers of their groups — stay in the buffer for the next iteration.

λ = 1 is synchronous RL (the buffer is empty between iterations, and both top-up modes launch ``groups`` groups).
With λ < 1 a group trains once its slowest sample finishes, possibly an iteration or two later, and its tokens then
span several policy versions: the trainer corrects each token by its importance ratio against the behaviour
log-prob recorded when it was sampled.

How λ meets group size, and what the top-up mode changes. A group whose slowest sample is paused keeps its early
finishers waiting in the buffer; a larger group makes it more likely that some sample is long. Topping up by
*groups* counts such a group as one of the ``groups`` in flight, so on a long-tailed length distribution an
iteration may run only one or two unfinished samples per carried group: the engine's batch shrinks, and fewer,
smaller groups train per iteration. The buffer never holds more than ``groups`` groups. Topping up by
*trajectories* fills the engine with ``groups × group_size`` unfinished samples every iteration (what a partial
rollout is for: the tail no longer idles the batch), starting more groups while the carried ones finish; the
buffer then holds up to ``(max_staleness + 1) × groups`` groups, since every group completes within
``max_staleness + 1`` iterations of its start (step 4). Either way a group trains only when whole.

The buffer and the prompt position are part of every checkpoint (``state`` / ``load_state``).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from envs.tasks import Task, file_tasks, get_tasks
from rlk3.rollout.agent_loop import AgentLoop
from rlk3.rollout.trajectory import Status, Trajectory


@dataclass
class Prompt:
    task: Task
    effort: str
    budget: int | None


class PromptSource:
    """Training prompts over a weighted domain mix and a set of effort levels; position ``p`` always draws the same
    prompt (seeded), so resuming at a saved position continues the same data order. A domain draws from the first
    ``train_size`` tasks of its synthetic suite's train split, or, when ``files`` names a task file for it
    (domain → (path, format), ``tasks.files``), from every task of that file's train split."""

    def __init__(
        self,
        domains: list[str],
        efforts: list[str],
        budget: Callable[[str, int], int | None],
        *,
        weights: list[float] | None = None,
        train_size: int = 4096,
        seed: int = 0,
        files: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        if not domains or not efforts:
            raise ValueError("PromptSource needs at least one domain and one effort level")
        if weights and len(weights) != len(domains):
            raise ValueError(f"tasks.weights has {len(weights)} entries for {len(domains)} domains")
        self.domains, self.efforts = list(domains), list(efforts)
        self.weights = list(weights) if weights else [1.0] * len(domains)
        self.budget = budget
        self.train_size = train_size
        self.seed = seed
        self.files = {d: tuple(f) for d, f in (files or {}).items() if d in self.domains}
        # the train tasks of each file, read once (and each record checked) when the source is made
        self.file_train = {d: file_tasks(self.files, d, "train") for d in self.files}
        for d, tasks in self.file_train.items():
            if not tasks:
                raise ValueError(f"tasks.files.{d}: {self.files[d][0]} has no train records (every record's question "
                                 "hashes to the held-out split; envs/tasks/loaders.py)")
        self.position = 0

    def next(self, step: int) -> Prompt:
        p = self.position
        self.position += 1
        rng = random.Random(f"prompts|{self.seed}|{p}")
        domain = rng.choices(self.domains, self.weights)[0]
        effort = rng.choice(self.efforts)
        if domain in self.file_train:
            pool = self.file_train[domain]
            task = pool[(p * 7919) % len(pool)]
        else:
            (task,) = get_tasks(domain, "train", 1, start=(p * 7919) % self.train_size)
        return Prompt(task, effort, self.budget(effort, step))

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, s: dict) -> None:
        self.position = int(s["position"])


@dataclass
class IterationStats:
    launched: int = 0
    resumed: int = 0
    fresh: int = 0
    finished: int = 0  # finished this iteration (before and after the cutoff)
    finished_before_pause: int = 0
    paused: int = 0
    restarted_stale: int = 0
    groups_trained: int = 0
    buffered: int = 0
    extra: dict = field(default_factory=dict)


class PartialRollouts:
    def __init__(
        self,
        loop: AgentLoop,
        source: PromptSource,
        *,
        groups: int,
        group_size: int,
        lam: float = 1.0,
        max_staleness: int = 4,
        max_parallel: int = 256,
        top_up: str = "groups",
    ) -> None:
        if not 0.0 < lam <= 1.0:
            raise ValueError(f"rollout.lam must be in (0, 1], got {lam}")
        if top_up not in ("groups", "trajectories"):
            raise ValueError(f"rollout.top_up must be 'groups' or 'trajectories', got {top_up!r}")
        self.loop = loop
        self.source = source
        self.groups = groups
        self.group_size = group_size
        self.lam = lam
        self.max_staleness = max_staleness
        self.max_parallel = max_parallel
        self.top_up = top_up
        self.buffer: list[Trajectory] = []
        self.tasks: dict[str, dict] = {}  # group id -> the task (as a dict, for checkpoints)

    # ------------------------------------------------------------------ one iteration

    def _new_groups(self) -> int:
        if self.top_up == "groups":
            return self.groups - len({t.group_id for t in self.buffer})
        unfinished = sum(not t.finished for t in self.buffer)
        return max(0, math.ceil((self.groups * self.group_size - unfinished) / self.group_size))

    def _top_up(self, step: int) -> list[Trajectory]:
        fresh = []
        for _ in range(self._new_groups()):
            pos = self.source.position
            prompt = self.source.next(step)
            gid = f"g{pos}"
            self.tasks[gid] = prompt.task.to_dict()
            for j in range(self.group_size):
                fresh.append(self.loop.new_trajectory(prompt.task, effort=prompt.effort, budget=prompt.budget,
                                                      group_id=gid, uid=f"{gid}-{j}"))
        return fresh

    async def _restart_stale(self, version: int, stats: IterationStats) -> None:
        for t in self.buffer:
            lag = version - min(t.policy_versions) if t.policy_versions else 0
            # an early finisher waiting for its group goes too: its tokens would train as stale as the paused ones
            if (t.status == Status.PAUSED or t.finished) and lag > self.max_staleness:
                if t.status == Status.PAUSED:
                    await self.loop.abandon(t)
                restarts = t.metrics.get("restarts", 0) + 1
                fresh = Trajectory(uid=t.uid, group_id=t.group_id, task_id=t.task_id, domain=t.domain,
                                   effort=t.effort, budget=t.budget, metrics={"restarts": restarts})
                t.__dict__.update(fresh.__dict__)
                t.status = Status.PAUSED  # not started yet; runs as a fresh episode
                stats.restarted_stale += 1

    async def iterate(self, step: int, version: int, progress=None, ahead: int = 0
                      ) -> tuple[list[Trajectory], IterationStats]:
        """Run one iteration; returns the trajectories of the groups complete now (in a fixed order). ``version``:
        the policy sampling now; ``ahead``: how many versions later what this returns trains (1 when the rollout
        runs while the previous iteration trains, ``cluster.overlap``). Staleness counts against the training
        version, so ``max_staleness`` bounds the lag the trainer sees."""
        stats = IterationStats()
        version += ahead
        await self._restart_stale(version, stats)
        carried = [t for t in self.buffer if not t.finished]
        fresh = self._top_up(step)
        self.buffer += fresh
        run = carried + fresh
        stats.resumed, stats.fresh, stats.launched = len(carried), len(fresh), len(run)
        # one pause would make these stale: they run to their end. One not started yet starts `ahead` behind the
        # version it will train under (with max_staleness 0, or under overlap at 1, nothing can be paused)
        due = {t.uid for t in run
               if version - (min(t.policy_versions) if t.policy_versions else version - ahead) >= self.max_staleness}
        need = math.ceil(self.lam * len(run))
        done_count = 0
        pause_sent = False
        sem = asyncio.Semaphore(self.max_parallel)

        async def one(t: Trajectory) -> Trajectory:
            nonlocal done_count, pause_sent
            async with sem:
                task = Task.from_dict(self.tasks[t.group_id])
                out = await self.loop.run(task, t)
            if out.finished:
                done_count += 1
                if not pause_sent:
                    stats.finished_before_pause += 1
                if progress is not None:
                    progress()
                if done_count >= need and not pause_sent and self.lam < 1.0:
                    pause_sent = True
                    await self.loop.pause(keep=due)
            return out

        self.loop.unpause()
        try:
            await asyncio.gather(*(one(t) for t in run))
        finally:
            self.loop.unpause()
        stats.finished = done_count
        stats.paused = sum(t.status == Status.PAUSED for t in run)
        by_group: dict[str, list[Trajectory]] = {}
        for t in self.buffer:
            by_group.setdefault(t.group_id, []).append(t)
        ready, keep = [], []
        for gid, members in by_group.items():
            if all(m.finished for m in members):
                ready += sorted(members, key=lambda m: m.uid)
                self.tasks.pop(gid, None)
                stats.groups_trained += 1
            else:
                keep += members
        self.buffer = keep
        stats.buffered = len(keep)
        return ready, stats

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        return {
            "buffer": [t.to_dict() for t in self.buffer],
            "tasks": dict(self.tasks),
            "source": self.source.state(),
        }

    def load_state(self, s: dict) -> None:
        self.buffer = [Trajectory.from_dict(d) for d in s["buffer"]]
        self.tasks = dict(s["tasks"])
        self.source.load_state(s["source"])
