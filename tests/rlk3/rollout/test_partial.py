"""Partial rollouts: the λ cutoff, the carry-over buffer across iterations (nothing lost or duplicated), caches kept
across the pause, staleness restarts, and the buffer surviving a checkpoint round trip."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest
import torch

from harness import Harness
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.rollout.agent_loop import AgentLoop, EngineFront, LoopConfig
from rlk3.rollout.grading import Grading
from rlk3.rollout.partial import PartialRollouts, PromptSource
from rlk3.rollout.trajectory import Status


def make(model, tok, *, lam, groups=4, group_size=4, max_staleness=100, seed=0, top_up="groups"):
    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(memory_bytes=128 << 20))
    loop = AgentLoop(EngineFront(engine), {"general": Harness("chat", tok)}, grading=Grading(),
                     config=LoopConfig(temperature=1.0, max_turn_tokens=96, seed=seed))
    source = PromptSource(["general"], ["low", "high"], lambda effort, step: None, seed=seed)
    return PartialRollouts(loop, source, groups=groups, group_size=group_size, lam=lam, max_staleness=max_staleness,
                           top_up=top_up)


def perturb(engine, version):
    """A new policy version: small random changes to every weight (what a training step does)."""
    g = torch.Generator().manual_seed(version)
    new = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
           for k, v in engine.model.state_dict().items()}
    engine.update_weights(new, version)


def test_lambda_half_over_twenty_iterations(general_policy):
    model, tok = general_policy
    pr = make(model, tok, lam=0.5)
    engine = pr.loop.front.engine
    trained: list[str] = []
    created: set[str] = set()
    mixed_versions = 0
    kept_cache = 0

    async def go():
        nonlocal mixed_versions, kept_cache
        for it in range(20):
            before = {t.uid for t in pr.buffer if t.status == Status.PAUSED}
            ready, stats = await pr.iterate(it, engine.version)
            created.update(t.uid for t in pr.buffer)
            created.update(t.uid for t in ready)
            assert stats.finished_before_pause >= math.ceil(0.5 * stats.launched), stats
            assert stats.resumed == len(before)
            for t in ready:
                t.validate()
                assert t.finished and t.reward is not None
                if len(set(t.policy_versions)) > 1:
                    mixed_versions += 1
                    # resumed under the new weights on the cache it kept: no recomputation
                    if "recomputed" not in t.metrics:
                        kept_cache += 1
            assert all(len({t.uid for t in ready if t.group_id == g}) == 4 for g in {t.group_id for t in ready})
            trained.extend(t.uid for t in ready)
            perturb(engine, engine.version + 1)
        await pr.loop.front.close()

    asyncio.run(go())
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    left = {t.uid for t in pr.buffer}
    assert set(trained) | left == created and not set(trained) & left, "a trajectory was lost"
    assert mixed_versions > 0, "no trajectory spanned a weight update: the cutoff never paused a running one"
    assert kept_cache > 0


@pytest.mark.parametrize("top_up", ["groups", "trajectories"])
def test_top_up_modes(general_policy, top_up):
    """``groups`` keeps ``groups`` groups in flight, so carried groups whose early finishers wait shrink the batch;
    ``trajectories`` keeps ``groups × group_size`` unfinished samples running and starts more groups instead. Both
    lose and duplicate nothing, train whole groups only, and bound the buffer."""
    model, tok = general_policy
    G, S, stale = 3, 4, 2
    pr = make(model, tok, lam=0.5, groups=G, group_size=S, max_staleness=stale, top_up=top_up)
    engine = pr.loop.front.engine

    async def go():
        launched, groups_held, trained, created = [], [], [], set()
        for it in range(8):
            ready, stats = await pr.iterate(it, engine.version)
            launched.append(stats.launched)
            groups_held.append(len({t.group_id for t in pr.buffer}))
            created.update(t.uid for t in pr.buffer + ready)
            assert all(len([t for t in ready if t.group_id == g]) == S for g in {t.group_id for t in ready})
            trained.extend(t.uid for t in ready)
            perturb(engine, engine.version + 1)
        await pr.loop.front.close()
        return launched, groups_held, trained, created

    launched, groups_held, trained, created = asyncio.run(go())
    assert len(trained) == len(set(trained)) and set(trained) | {t.uid for t in pr.buffer} == created
    if top_up == "groups":
        assert max(groups_held) <= G and max(launched) <= G * S
        assert min(launched[1:]) < G * S, "expected carried groups to shrink a later iteration's batch"
    else:
        assert all(G * S <= n < G * S + S for n in launched), launched
        assert max(groups_held) <= (stale + 1) * G and max(groups_held) > G, groups_held


def test_lambda_one_is_synchronous(general_policy):
    model, tok = general_policy
    pr = make(model, tok, lam=1.0, groups=3)

    async def go():
        out = []
        for it in range(2):
            ready, stats = await pr.iterate(it, 0)
            out.append((ready, stats))
        await pr.loop.front.close()
        return out

    for ready, stats in asyncio.run(go()):
        assert stats.paused == 0 and stats.buffered == 0 and len(ready) == 12
        assert stats.finished == stats.launched == 12


def test_stale_trajectories_restart_with_their_uid(general_policy):
    """A version jump (a reload) makes paused trajectories too stale to resume: they restart under their uid, and
    so do their groups' early finishers, whose tokens are as old (kept, they trained 2 versions stale). Groups still
    complete afterwards, and no trained token lags by more than max_staleness."""
    model, tok = general_policy
    pr = make(model, tok, lam=0.25, max_staleness=1)
    engine = pr.loop.front.engine

    async def go():
        restarted, lags, trained = 0, [], []
        for it in range(6):
            ready, stats = await pr.iterate(it, engine.version)
            restarted += stats.restarted_stale
            lags += [engine.version - min(t.policy_versions) for t in ready if t.policy_versions]
            trained += [t.uid for t in ready] if it else []
            perturb(engine, engine.version + (2 if it == 0 else 1))
        await pr.loop.front.close()
        return restarted, lags, trained

    restarted, lags, trained = asyncio.run(go())
    assert restarted > 0 and trained
    assert max(lags) <= 1, lags
    assert len(trained) == len(set(trained))  # a restart keeps the uid and trains it once
    for t in pr.buffer:
        if t.policy_versions:  # everything kept is within the staleness bound of when it last ran
            assert max(t.policy_versions) - min(t.policy_versions) <= 1


def test_a_rollout_ahead_counts_staleness_against_the_version_it_trains_under(general_policy):
    """Under cluster.overlap a rollout samples while the previous iteration trains: what it returns trains one
    version after the engine's. Counted against the engine's version, a carried trajectory ran to its end one
    iteration late and trained max_staleness + 1 stale."""
    model, tok = general_policy
    pr = make(model, tok, lam=0.25, max_staleness=2)
    engine = pr.loop.front.engine

    async def go():
        lags = []
        for it in range(8):
            ready, _ = await pr.iterate(it, engine.version, ahead=1)
            lags += [engine.version + 1 - min(t.policy_versions) for t in ready if t.policy_versions]
            perturb(engine, engine.version + 1)
        await pr.loop.front.close()
        return lags

    lags = asyncio.run(go())
    assert max(lags) == 2, lags


def test_max_staleness_zero_pauses_nothing(general_policy):
    """With max_staleness 0 a paused trajectory could never resume (its next token would be one version on), and
    restarting it threw its work away and, with its group's early finishers, kept its group from ever completing:
    nothing is paused, every trained token is on-policy."""
    model, tok = general_policy
    pr = make(model, tok, lam=0.25, max_staleness=0, groups=2)
    engine = pr.loop.front.engine

    async def go():
        lags, paused = [], 0
        for it in range(3):
            ready, stats = await pr.iterate(it, engine.version)
            paused += stats.paused
            lags += [engine.version - min(t.policy_versions) for t in ready if t.policy_versions]
            perturb(engine, engine.version + 1)
        await pr.loop.front.close()
        return lags, paused

    lags, paused = asyncio.run(go())
    assert paused == 0 and len(lags) == 3 * 2 * 4 and set(lags) == {0}


def test_long_trajectories_finish_instead_of_restarting(general_policy):
    """A trajectory that one more pause would make stale runs to its end in this iteration: with a low λ the long
    tail is still trained (not restarted over and over), and no trained token lags by more than max_staleness."""
    model, tok = general_policy
    pr = make(model, tok, lam=0.25, max_staleness=1)
    engine = pr.loop.front.engine

    async def go():
        restarted, spans, trained = 0, [], []
        for it in range(8):
            ready, stats = await pr.iterate(it, engine.version)
            restarted += stats.restarted_stale
            spans += [engine.version - min(t.policy_versions) for t in ready if t.policy_versions]
            trained += ready
            perturb(engine, engine.version + 1)
        await pr.loop.front.close()
        return restarted, spans, trained

    restarted, spans, trained = asyncio.run(go())
    assert restarted == 0
    assert max(spans) == 1, "expected trajectories that spanned a weight update"
    assert all(t.metrics.get("restarts", 0) == 0 for t in trained + pr.buffer)


def test_buffer_survives_a_checkpoint_round_trip(general_policy):
    model, tok = general_policy
    pr = make(model, tok, lam=0.5)

    async def go():
        await pr.iterate(0, 0)
        await pr.loop.front.close()

    asyncio.run(go())
    assert pr.buffer, "expected carried-over trajectories"
    state = json.loads(json.dumps(pr.state(), allow_nan=True))
    other = make(model, tok, lam=0.5)
    other.load_state(state)
    assert [t.to_dict() for t in other.buffer] == [t.to_dict() for t in pr.buffer]
    assert other.source.position == pr.source.position and other.tasks == pr.tasks

    async def resume():  # a fresh engine: paused requests are recomputed from the saved streams
        ready, stats = await other.iterate(1, 0)
        await other.loop.front.close()
        return ready, stats

    ready, stats = asyncio.run(resume())
    assert stats.resumed == sum(1 for t in pr.buffer if not t.finished)
    assert any(t.metrics.get("recomputed") for t in ready + other.buffer if t.policy_versions)


def test_lambda_is_validated(general_policy):
    model, tok = general_policy
    with pytest.raises(ValueError, match=r"rollout\.lam must be in"):
        make(model, tok, lam=0.0)


def test_a_prompt_source_with_a_task_file_draws_its_train_tasks_only(tmp_path):
    """``tasks.files`` reached no stage: PromptSource drew the synthetic suite whatever file the run named. Given a
    file, it draws every train task of that file and never a held-out one, in the same order in every instance, and
    resumes that order from a saved position."""
    from envs.tasks.loaders import load
    from tests.envs.test_tasks import gsm8k_file

    f = gsm8k_file(tmp_path / "gsm8k.jsonl", 30)
    train = {t.task_id for t in load(f, "gsm8k", "train")}
    held = {t.task_id for t in load(f, "gsm8k", "heldout")}
    assert train and held

    def source():
        return PromptSource(["general"], ["high"], lambda effort, step: None, seed=1,
                            files={"general": (str(f), "gsm8k")})

    a = source()
    drawn = [a.next(0).task for _ in range(4 * len(train))]
    assert {t.task_id for t in drawn} == train  # all of them, and nothing else
    assert all(t.domain == "general" and t.grader == "answer" for t in drawn)
    b = source()
    assert [b.next(0).task.task_id for _ in range(len(drawn))] == [t.task_id for t in drawn]
    c, d = source(), source()
    for _ in range(7):
        c.next(0)
    d.load_state(c.state())
    assert [d.next(0).task.task_id for _ in range(10)] == [t.task_id for t in drawn[7:17]]
