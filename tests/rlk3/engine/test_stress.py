"""Acceptance item 5: a randomized stress of 500 requests (adds, aborts, pauses, resumes, extends, releases, a few
release/reacquire cycles; some prompts several times, so that followers share a leader's prefill) on a pool small
enough to force waiting, preemption and eviction. The pool never exceeds its budget, its bookkeeping is consistent
after every step, greedy outputs stay exact, seeded ones draw what they draw alone, and at the end every page is free
again."""

import os
import random

import pytest

from rlk3.engine import EngineConfig, FinishReason, RequestStatus, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt, resolved_ties

# more seeds by hand: RLK3_STRESS_SEEDS=1,2,3 (docs/engine.md, "Tests and benchmarks": 60 runs of seeds 1-30)
SEEDS = [int(s) for s in os.environ.get("RLK3_STRESS_SEEDS", "0").split(",")]


def _stress(tiny, seed: int, weight_updates: bool = False, stop_ids: tuple[int, ...] = (), **overrides):
    """The stress loop (module docstring), every step checked; returns the engine, its pages per slot and counts:
    ``extended``, ``released``, ``checked`` (greedy results against the full forward), ``reproduced`` (seeded ones
    against a fresh engine), ``stopped`` (first turns that ended on a stop id). ``weight_updates``: now and then
    ``update_weights`` with the same weights under a new version (the prefix cache is invalidated, paused and finished
    requests keep or recompute their caches: greedy outputs must not change). ``stop_ids``: every first turn stops on
    these."""
    rng = random.Random(seed)
    probe = RolloutEngine(tiny, EngineConfig(memory_bytes=4 * 2**20, block_size=16, prefix_block_tokens=16))
    page, slot = probe.layout.page_bytes, probe.layout.pages_per_slot
    budget = page * (7 * slot + 30)  # ~7 requests' KDA state and 480 tokens of MLA blocks
    cfg = dict(
        memory_bytes=budget, block_size=16, prefix_block_tokens=16, checkpoint_interval=32, max_num_seqs=10,
        max_tokens_per_step=96, prefill_chunk=24, spill_bytes=2 * 2**20,
    )
    engine = RolloutEngine(tiny, EngineConfig(**{**cfg, **overrides}))
    weights = {k: v.clone() for k, v in tiny.state_dict().items()} if weight_updates else None
    systems = [prompt(rng.randint(17, 40), seed=100 + i) for i in range(4)]  # shared prefixes: cache hits
    added = 0
    counts = dict(extended=0, released=0, checked=0, reproduced=0, stopped=0)
    greedy = set()
    recent = []
    seeded: dict[str, SamplingParams] = {}
    alone = RolloutEngine(tiny, EngineConfig(memory_bytes=64 * 2**20, sampler=engine.config.sampler))

    def check(res):
        if res.finish_reason == FinishReason.ABORT or not res.token_ids:
            return
        if res.turn == 0:  # the turn whose SamplingParams carry the stop ids
            assert not set(res.token_ids[:-1]) & set(stop_ids), res.request_id
            assert (res.finish_reason == FinishReason.STOP) == (res.token_ids[-1] in stop_ids), res.request_id
            counts["stopped"] += res.finish_reason == FinishReason.STOP
        if res.request_id in greedy:
            assert_greedy_matches_full_forward(tiny, res.prompt_token_ids, res.token_ids, res.logprobs)
            counts["checked"] += 1
        elif res.request_id in seeded and res.turn == 0:
            # seeded sampling draws what the request draws alone in a fresh engine, whatever shared its steps and
            # through preemption, prefix hits and spill (log-probs loosely: a router near-tie, _oracle.py, may move
            # them by ~1e-3 where the batch's arithmetic differs)
            ref = alone.generate([res.prompt_token_ids], seeded[res.request_id])[0]
            assert res.token_ids == ref.token_ids[: len(res.token_ids)], res.request_id
            assert max(abs(a - b) for a, b in zip(res.logprobs, ref.logprobs)) < 1e-2, res.request_id
            counts["reproduced"] += 1

    while added < 500 or engine.requests:
        if added < 500 and rng.random() < 0.6:
            for _ in range(rng.randint(1, 3)):
                p = rng.choice(systems) + prompt(rng.randint(1, 20), seed=1000 + added)
                if recent and rng.random() < 0.3:  # another sample of a recent prompt: shared prefill
                    p = rng.choice(recent)
                recent = [*recent, p][-4:]
                is_greedy = rng.random() < 0.5
                sp = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0 if is_greedy else 1.0,
                                    top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, added]),
                                    stop_token_ids=list(stop_ids))
                rid = engine.add_request(p, sp, turn_ends=[rng.randint(1, len(p))] if rng.random() < 0.2 else ())
                if is_greedy:
                    greedy.add(rid)
                elif sp.seed is not None:
                    seeded[rid] = sp
                added += 1
        if engine.requests and rng.random() < 0.5:
            rid = rng.choice(sorted(engine.requests))
            status = engine.requests[rid].status
            action = rng.random()
            if status in (RequestStatus.WAITING, RequestStatus.RUNNING) and action < 0.3:
                engine.pause(rid)
            elif status == RequestStatus.PAUSED and action < 0.6:
                engine.resume(rid)
            elif status in (RequestStatus.PAUSED, RequestStatus.FINISHED) and action < 0.75:
                if status == RequestStatus.FINISHED:
                    check(engine.result(rid))
                engine.extend(rid, prompt(rng.randint(1, 20), seed=5000 + counts["extended"]),
                              SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0 if rid in greedy else 1.0))
                counts["extended"] += 1
            elif action < 0.85:
                engine.abort(rid)
        for rid in [r for r, req in engine.requests.items() if req.status == RequestStatus.FINISHED]:
            roll = rng.random()
            if roll < 0.3 and engine.requests[rid].turn < 3:  # the next turn of a multi-turn conversation
                check(engine.result(rid))
                engine.extend(rid, prompt(rng.randint(1, 20), seed=5000 + counts["extended"]),
                              SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0 if rid in greedy else 1.0))
                counts["extended"] += 1
            elif roll < 0.9:
                check(engine.result(rid))
                engine.release(rid)
                counts["released"] += 1
        if added >= 500 and not engine.has_unfinished():  # let the paused ones finish
            for rid, req in list(engine.requests.items()):
                if req.status == RequestStatus.PAUSED:
                    engine.resume(rid)
        if weights is not None and rng.random() < 0.01:
            engine.update_weights(weights, engine.version + 1)
            engine.check_invariants()
        if rng.random() < 0.005:  # colocation: give the pool back mid-run, then take it again
            engine.release_memory()
            assert engine.pool.allocated_bytes == 0
            engine.check_invariants()
            engine.reacquire_memory()
        engine.step()
        engine.check_invariants()
        assert engine.pool.allocated_bytes <= budget
        assert engine.stats().pool.free_pages >= 0

    return engine, slot, counts


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["plain", "padded-prefill"])
def test_randomized_stress_of_500_requests(tiny, prefill_graphs, seed):
    """``plain``: the engine's CPU default (the CPU kernels). ``padded-prefill``: every all-prefill step padded to a
    bucket (the CUDA default's batches, run eagerly on the torch path whose pieces CUDA captures), its scratch slot
    and page taken from the same small pool."""
    ties = len(resolved_ties)
    engine, slot, counts = _stress(tiny, seed, prefill_graphs=prefill_graphs,
                                   backend="torch" if prefill_graphs else "auto")
    stats, checked = engine.stats(), counts["checked"]
    assert stats.preemptions > 0, "the pool must have been small enough to force preemption"
    assert stats.prefix_cache.hits > 0 and stats.prefix_cache.evictions > 0
    assert stats.shared_prefill_tokens > 0
    assert counts["extended"] > 50 and counts["released"] > 100 and checked > 100 and counts["reproduced"] > 50
    # a router near-tie taken the other way by the engine's arithmetic (_oracle.py) is rare; many would be a bug
    assert len(resolved_ties) - ties <= checked // 20, resolved_ties[ties:]
    assert stats.pool.request_pages == 0
    # most steps mix decodes with prefill (unpadded): seed 0 pads 10 or more, other seeds as few as one
    assert (stats.padded_prefill_steps >= (10 if seed == 0 else 1)) == prefill_graphs
    engine.clear_prefix_cache()
    engine.check_invariants()
    scratch = len(engine._prefill_graphs.scratch) if engine._prefill_graphs is not None else 0
    assert scratch == (slot + 1 if prefill_graphs else 0)  # taken with the pool, again after every release
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages - scratch


# configurations the engine's defaults do not reach in the test above (a seeded sweep of 16 such configurations x 3
# seeds found nothing: docs/engine.md, "Tests and benchmarks")
CONFIGS = {
    "checkpoint-after-the-step": dict(checkpoint_in_step=False),
    "4-token-pages": dict(block_size=4),
    "small-steps-dense-checkpoints": dict(checkpoint_interval=16, max_tokens_per_step=32, prefill_chunk=8),
    "counter-sampler": dict(sampler="counter"),
    "weight-updates-keep-caches": dict(weight_updates=True, share_prefill=False),
    "weight-updates-recompute": dict(weight_updates=True, recompute_on_weight_update=True),
    "stop-token-ids": dict(stop_ids=tuple(random.Random(5).sample(range(1, 4096), 200))),  # ~1 in 5 first turns
}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_randomized_stress_under_other_configurations(tiny, overrides):
    """The same stress, every step checked, under settings that change what the scheduler and the prefix cache do;
    with weight updates (the same weights under a new version: the cache is invalidated, outputs must not move)."""
    ties = len(resolved_ties)
    engine, _, counts = _stress(tiny, 0, **overrides)
    stats, checked = engine.stats(), counts["checked"]
    assert stats.preemptions > 0 and counts["extended"] > 50 and counts["released"] > 100
    assert checked > 100 and counts["reproduced"] > 50
    assert (counts["stopped"] > 50) == ("stop_ids" in overrides)
    assert len(resolved_ties) - ties <= checked // 20, resolved_ties[ties:]
    if overrides.get("weight_updates"):
        assert engine.version > 3
    assert stats.pool.request_pages == 0
    engine.clear_prefix_cache()
    engine.check_invariants()
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages
