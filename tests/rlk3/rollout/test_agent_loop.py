"""The agent loop against the real engine: trajectories, logprobs, budgets, pause/resume, and (with the real sandbox
server and graders) an agentic episode end to end."""

from __future__ import annotations

import asyncio

import pytest
import torch

from envs.tasks import get_tasks
from harness import Harness
from harness.harness import Parsed
from harness.tokenizer import default_tokenizer
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.agent_loop import AgentLoop, EngineFront, LoopConfig, LoopError
from rlk3.rollout.grading import Grading
from rlk3.rollout.trajectory import Status


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))).eval()


def run(coro):
    return asyncio.run(coro)


def general_loop(model, tok, **cfg):
    engine = RolloutEngine(model, EngineConfig(memory_bytes=64 << 20))
    return AgentLoop(EngineFront(engine), {"general": Harness("chat", tok)}, grading=Grading(),
                     config=LoopConfig(**cfg))


async def _episodes(loop, tasks, effort="low", budget=None, uid_prefix="u"):
    try:
        return await asyncio.gather(*(
            loop.run(t, loop.new_trajectory(t, effort=effort, budget=budget, uid=f"{uid_prefix}{i}"))
            for i, t in enumerate(tasks)))
    finally:
        await loop.front.close()



def _worst_logprob_gap(model, traj) -> float:
    """The largest gap between a trajectory's behaviour log-probs and log-softmax of the full forward over its
    stream (T = 1): the trainer's view of the same tokens."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([traj.token_ids])).logits[0].float(), -1)
    pos = [i for i, m in enumerate(traj.loss_mask) if m]
    return max(abs(logp[i - 1, traj.token_ids[i]].item() - b) for i, b in zip(pos, traj.behaviour_logprobs))

def test_episodes_are_valid_graded_and_logprobs_match_the_model(model, tok):
    loop = general_loop(model, tok, max_turn_tokens=24, seed=3)
    tasks = get_tasks("general", "heldout", 6)
    trajs = run(_episodes(loop, tasks))
    for t, task in zip(trajs, tasks):
        t.validate()
        assert t.status in (Status.FINISHED, Status.TRUNCATED)
        assert t.reward is not None and "passed" in t.metrics
        assert t.messages[-1]["role"] == "assistant"
        assert set(t.policy_versions) == {0}
        assert 1 <= t.num_generated <= 24
        # the behaviour logprobs are log-softmax(logits) of the full forward over the stream (T = 1)
        assert _worst_logprob_gap(model, t) < 1e-4
        assert t.group_id == task.task_id


def test_budget_stops_at_the_first_token_past_it_and_scores_minus_one(model, tok):
    loop = general_loop(model, tok, max_turn_tokens=64, seed=1)
    trajs = run(_episodes(loop, get_tasks("general", "heldout", 4), budget=10))
    over = [t for t in trajs if t.metrics.get("over_budget")]
    assert over, "an untrained model should not stop within 10 tokens"
    for t in over:
        assert t.num_generated == 11 and t.status == Status.TRUNCATED and t.reward == -1.0
    for t in trajs:
        assert t.num_generated <= 11
        assert "Token budget: 10 tokens" in t.messages[0]["content"]
        assert "Reasoning effort: low" in t.messages[0]["content"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pause_then_resume_equals_never_pausing(model, tok, temperature):
    tasks = get_tasks("general", "heldout", 4)
    ref = run(_episodes(general_loop(model, tok, max_turn_tokens=40, temperature=temperature, seed=5), tasks))

    async def paused_run():
        loop = general_loop(model, tok, max_turn_tokens=40, temperature=temperature, seed=5)
        jobs = [asyncio.ensure_future(loop.run(t, loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}")))
                for i, t in enumerate(tasks)]
        while loop.front.engine.stats().decode_tokens < 30:  # let them generate a few tokens each
            await asyncio.sleep(0.01)
        await loop.pause()
        first = await asyncio.gather(*jobs)
        paused = [t for t in first if t.status == Status.PAUSED]
        assert paused, "the pause came after every episode finished"
        for t in paused:
            assert t.metrics["loop"]["open"] > 0 and t.reward is None
            t.validate()
        loop.unpause()
        task_of = {t.task_id: t for t in tasks}
        rest = await asyncio.gather(*(loop.run(task_of[t.task_id], t) for t in paused))
        await loop.front.close()
        return first, rest

    first, rest = run(paused_run())
    done = {t.uid: t for t in first if t.status != Status.PAUSED} | {t.uid: t for t in rest}
    for r in ref:
        t = done[r.uid]
        assert t.token_ids == r.token_ids
        assert t.behaviour_logprobs == pytest.approx(r.behaviour_logprobs, abs=1e-5)
        assert t.reward == r.reward


def test_a_restarted_engine_recomputes_the_open_turn_greedy(model, tok):
    """The engine lost the paused request (an actor restart): the stream is prefilled again and the turn goes
    on from its last token; under greedy decoding the result equals the uninterrupted episode."""
    tasks = get_tasks("general", "heldout", 3)
    ref = run(_episodes(general_loop(model, tok, max_turn_tokens=40, temperature=0.0), tasks))

    async def go():
        loop = general_loop(model, tok, max_turn_tokens=40, temperature=0.0)
        jobs = [asyncio.ensure_future(loop.run(t, loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}")))
                for i, t in enumerate(tasks)]
        while loop.front.engine.stats().decode_tokens < 20:
            await asyncio.sleep(0.01)
        await loop.pause()
        first = await asyncio.gather(*jobs)
        await loop.front.close()
        fresh = general_loop(model, tok, max_turn_tokens=40, temperature=0.0)  # a new engine: nothing cached
        task_of = {t.task_id: t for t in tasks}
        paused = [t for t in first if t.status == Status.PAUSED]
        rest = await asyncio.gather(*(fresh.run(task_of[t.task_id], t) for t in paused))
        await fresh.front.close()
        return first, rest

    first, rest = run(go())
    assert rest and all(t.metrics.get("recomputed") == 1 for t in rest)
    done = {t.uid: t for t in first if t.status != Status.PAUSED} | {t.uid: t for t in rest}
    for r in ref:
        assert done[r.uid].token_ids == r.token_ids


def test_a_turn_restarted_then_paused_again_keeps_every_token(model, tok):
    """Paused mid-turn, the engine lost (a checkpoint reload, an actor restart), the turn recomputed on a new request
    and paused again before it ended, then resumed: the new request's turn began after the tokens the lost one
    generated, so the loop must not skip those again in its result (it dropped as many new tokens, and every later
    token was sampled over a stream the trajectory does not hold)."""
    tasks = get_tasks("general", "heldout", 3)
    ref = run(_episodes(general_loop(model, tok, max_turn_tokens=60, temperature=0.0), tasks))
    task_of = {t.task_id: t for t in tasks}

    async def until(loop, n):
        while loop.front.engine.stats().decode_tokens < n:
            await asyncio.sleep(0.005)

    async def go():
        loop = general_loop(model, tok, max_turn_tokens=60, temperature=0.0)
        jobs = [asyncio.ensure_future(loop.run(t, loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}")))
                for i, t in enumerate(tasks)]
        await until(loop, 15)
        await loop.pause()
        first = await asyncio.gather(*jobs)
        await loop.front.close()
        fresh = general_loop(model, tok, max_turn_tokens=60, temperature=0.0)  # a new engine: nothing cached
        jobs = [asyncio.ensure_future(fresh.run(task_of[t.task_id], t)) for t in first if t.status == Status.PAUSED]
        await until(fresh, 15)
        await fresh.pause()
        second = await asyncio.gather(*jobs)
        fresh.unpause()
        again = [t for t in second if t.status == Status.PAUSED]
        # paused again inside the first turn, which the new request took up part-way
        assert again and all(t.metrics["loop"]["open"] > 0 and t.metrics["loop"]["turns"] == 0 for t in again)
        rest = await asyncio.gather(*(fresh.run(task_of[t.task_id], t) for t in again))
        await fresh.front.close()
        return first, rest

    first, rest = run(go())
    assert all(t.metrics.get("recomputed") == 1 for t in rest)
    done = {t.uid: t for t in first if t.status != Status.PAUSED} | {t.uid: t for t in rest}
    for r in ref:
        t = done[r.uid]
        assert t.token_ids == r.token_ids and t.loss_mask == r.loss_mask
        assert t.behaviour_logprobs == pytest.approx(r.behaviour_logprobs, abs=1e-5)


def test_behaviour_logprobs_and_versions_equal_the_trainers_recompute(model, tok):
    """The ``Trajectory`` contract end to end: episodes through the loop's paths (turns cut at max_turn_tokens, turns
    ending on <|im_end|> or on EOS, malformed calls answered as tool turns, the context limit, a pause mid-turn, a
    weight update, the resume under the new weights), then the trainer's own recompute (``Trainer._padded``,
    ``_logits``, ``token_logprobs`` at the sampling temperature) under each token's version: the same generated
    tokens, the same log-probs. Top-p/top-k shape only the draw: the engine's log-prob, like the trainer's, is over
    the whole vocabulary."""
    import copy
    import random

    from rlk3.algo.loss import token_logprobs
    from rlk3.config import TrainConfig
    from rlk3.train.trainer import Trainer

    m = copy.deepcopy(model)
    end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    with torch.no_grad():  # the untrained model seldom stops: make both stop tokens likely, and alike
        w = m.get_output_embeddings().weight
        w[end] *= 16
        w[eos] = w[end]
    h = Harness("chat", tok)
    rng = random.Random(0)  # most turns a malformed call (another turn follows), some a final answer
    h.parse = lambda text: Parsed(text=text, content=text, reasoning=None,
                                  error=None if rng.random() < 0.2 else "no such tool")
    # recomputed caches: a token of version v is then exactly π_v's (by default a request keeps the cache it built
    # under older weights, and its later tokens are sampled over that: docs/engine.md)
    engine = RolloutEngine(m, EngineConfig(memory_bytes=64 << 20, recompute_on_weight_update=True))
    T = 0.7
    loop = AgentLoop(EngineFront(engine), {"general": h},
                     config=LoopConfig(temperature=T, top_p=0.9, top_k=50, max_turn_tokens=12, max_turns=6,
                                       max_context_tokens=150, seed=2))
    tasks = get_tasks("general", "heldout", 6)
    task_of = {t.task_id: t for t in tasks}
    g = torch.Generator().manual_seed(1)
    weights = {0: copy.deepcopy(m.state_dict())}
    weights[1] = {k: v + 3e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                  for k, v in weights[0].items()}

    async def go():
        jobs = [asyncio.ensure_future(loop.run(t, loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}")))
                for i, t in enumerate(tasks)]
        while engine.stats().decode_tokens < 30 and not all(j.done() for j in jobs):
            await asyncio.sleep(0.005)
        await loop.pause()
        first = await asyncio.gather(*jobs)
        loop.unpause()
        engine.update_weights(weights[1], 1)
        rest = await asyncio.gather(*(loop.run(task_of[t.task_id], t) for t in first if t.status == Status.PAUSED))
        await loop.front.close()
        return {t.uid: t for t in first} | {t.uid: t for t in rest}

    trajs = list(run(go()).values())
    ref = copy.deepcopy(model)
    trainer = Trainer(ref, TrainConfig(qb_update=False), temperature=T, log=lambda *_: None)
    worst = 0.0
    for t in trajs:
        t.validate()
        b = Trainer._padded([t], [torch.zeros(t.num_generated)])
        pos = b.mask[0].nonzero().squeeze(-1)
        assert len(pos) == t.num_generated and b.ids[0].tolist() == t.token_ids
        per_version = {}
        for v in sorted(set(t.policy_versions)):
            ref.load_state_dict(weights[v])
            with torch.no_grad():
                per_version[v] = token_logprobs(trainer._logits(ref, b), b.ids[:, 1:], T)[0][0]
        got = torch.stack([per_version[v][p] for p, v in zip(pos.tolist(), t.policy_versions)])
        worst = max(worst, float((got - b.behaviour[0, pos]).abs().max()))
    # paths the check must have crossed
    assert any(len(set(t.policy_versions)) == 2 for t in trajs), "no episode spanned the weight update"
    assert any(t.metrics.get("truncated") == "context" for t in trajs)
    assert any(eos in t.token_ids for t in trajs) and any(t.metrics["loop"]["turns"] > 1 for t in trajs)
    # fp32 agreement is ~1e-6; the bound leaves room for a router near-tie that the engine's batched arithmetic
    # breaks the other way (docs/engine.md: up to ~1e-3); a stream or temperature mismatch costs tenths of a nat
    assert worst < 1e-3, worst


def test_a_turn_cut_short_sends_its_end_token_to_the_engine(model, tok):
    """A turn that stops at max_turn_tokens gets the template's end-of-turn token in the trajectory; the engine must
    see it too, or every later turn is sampled over a different stream than the one the trainer recomputes (the
    behaviour log-probs then differ from the full forward's by far more than the correction tolerates)."""
    h = Harness("chat", tok)
    # every turn a malformed call: the loop answers with the error as a tool turn and asks for the next turn
    h.parse = lambda text: Parsed(text=text, content=text, reasoning=None, error="no such tool")
    engine = RolloutEngine(model, EngineConfig(memory_bytes=64 << 20))
    loop = AgentLoop(EngineFront(engine), {"general": h},
                     config=LoopConfig(max_turn_tokens=8, max_turns=3, temperature=0.0))
    task = get_tasks("general", "heldout", 1)[0]
    traj = run(_episodes(loop, [task]))[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert traj.metrics["loop"]["turns"] == 3 and traj.token_ids.count(end) >= 4  # system, user, 3 cut turns
    assert _worst_logprob_gap(model, traj) < 1e-4


def test_an_episode_that_raises_aborts_its_engine_request(model, tok):
    """An episode that ends in an exception (here every engine step fails: the pool is released) must not leave its
    request in the engine: nobody else knows its id, so it would stay for good (running to its end, or paused with
    its cache), and the next episode of the same uid (an evaluation's, say) would find the id taken."""
    loop = general_loop(model, tok, max_turn_tokens=8, temperature=0.0)
    engine = loop.front.engine
    tasks = get_tasks("general", "heldout", 2)

    async def go():
        engine.release_memory()
        trajs = [loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}") for i, t in enumerate(tasks)]
        failed = await asyncio.gather(*(loop.run(t, tr) for t, tr in zip(tasks, trajs)), return_exceptions=True)
        leaked = list(engine.requests)
        engine.reacquire_memory()
        try:
            again = await asyncio.gather(*(
                loop.run(t, loop.new_trajectory(t, effort="low", budget=None, uid=f"u{i}"))
                for i, t in enumerate(tasks)))
        finally:
            await loop.front.close()
        return failed, leaked, again

    failed, leaked, again = run(go())
    assert all(isinstance(e, LoopError) and "reacquire_memory" in str(e) for e in failed)
    assert leaked == []
    assert all(t.status in (Status.FINISHED, Status.TRUNCATED) and t.num_generated for t in again)
    assert not engine.requests


def test_a_tool_preset_without_sandboxes_is_refused(model, tok):
    engine = RolloutEngine(model, EngineConfig(memory_bytes=16 << 20))
    loop = AgentLoop(EngineFront(engine), {"coding": Harness("tiny", tok)}, config=LoopConfig())
    task = get_tasks("coding", "heldout", 1)[0]
    with pytest.raises(LoopError, match="has tools: pass sandboxes="):
        run(loop.run(task, loop.new_trajectory(task, effort="low", budget=None)))


def test_a_grader_that_raises_scores_a_fail_and_is_counted_apart():
    """A grader's exception scores the episode 0 (the iteration goes on) and is flagged, so the RL line, the metrics
    and the evaluation count it instead of passing it off as a weak policy (a sandbox race once failed most coding
    episodes that way)."""
    from rlk3.cluster.driver import summarize as iteration_row
    from rlk3.rollout.evaluate import summarize as slice_result
    from rlk3.rollout.trajectory import Trajectory

    class Broken:
        def grade(self, task, view):
            raise RuntimeError("criu restore failed")

    task = get_tasks("general", "heldout", 1)[0]
    grading = Grading()
    grading._graders[task.grader] = Broken()
    bad = Trajectory(task_id=task.task_id, messages=[{"role": "assistant", "content": "Answer: 3"}],
                     status=Status.FINISHED)
    grading.grade(task, bad)
    assert bad.metrics["grader_error"] is True and bad.metrics["passed"] is False and bad.reward <= 0
    assert bad.metrics["grade_reasons"][0] == "grader_error: RuntimeError: criu restore failed"
    good = Trajectory(task_id=task.task_id, messages=[{"role": "assistant", "content": "Answer: 3"}],
                      status=Status.FINISHED)
    Grading().grade(task, good)
    assert "grader_error" not in good.metrics
    assert iteration_row([bad, good], {}, {}, 0, 128, 2, {})["grader_errors"] == 1
    assert slice_result("general", "low", [bad, good]).grader_errors == 1
