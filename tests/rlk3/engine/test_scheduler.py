"""Acceptance item 4 (budget-based admission) and the scheduler's memory behaviour: waiting, preemption with
recompute, a request larger than the pool refused up front."""

import pytest

from rlk3.engine import EngineConfig, RequestStatus, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt


def _steps_to_first_token(engine, ids, limit):
    """Steps until every request in ``ids`` has produced a token (None if ``limit`` steps are not enough)."""
    for step in range(1, limit + 1):
        engine.step()
        if all(engine.result(i).token_ids for i in ids):
            return step
    return None


@pytest.mark.parametrize("fair", [True, False], ids=["fair-share", "no-fair-share"])
def test_a_50k_prompt_does_not_starve_short_requests(tiny, fair):
    """A 50K-token prompt is admitted first; 8 short requests arrive next. With fair shares each short request has
    its first token within 2 steps; with the long prefill allowed the whole budget they wait (the test can fail)."""
    budget = 512
    cfg = EngineConfig(memory_bytes=48 * 2**20, max_tokens_per_step=budget, prefill_chunk=64 if fair else budget,
                       checkpoint_interval=8192)
    engine = RolloutEngine(tiny, cfg)
    long_id = engine.add_request(prompt(50_000, seed=60), SamplingParams(max_tokens=1, temperature=0))
    engine.step()  # the long prompt is admitted and starts its prefill
    assert 0 < engine.requests[long_id].num_computed < 50_000
    short = [engine.add_request(prompt(10 + 13 * i, seed=61 + i), SamplingParams(max_tokens=3, temperature=0))
             for i in range(8)]
    steps = _steps_to_first_token(engine, short, limit=2 if fair else 6)
    if fair:
        assert steps is not None and steps <= 2
        assert engine.requests[long_id].num_computed < 50_000  # and the long one kept going meanwhile
    else:
        assert steps is None  # starved for 6 steps
    engine.abort([long_id, *short])
    engine.check_invariants()
    assert engine.stats().pool.request_pages == 0


def test_preemption_under_memory_pressure_recomputes_and_gives_the_same_tokens(tiny):
    """A pool for about two requests' worth of pages and eight requests: the scheduler admits what fits, preempts
    the youngest when a running request needs a page, recomputes it later; greedy outputs are unchanged."""
    prompts = [prompt(40 + 7 * i, seed=70 + i) for i in range(8)]
    probe = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20))
    page, slot = probe.layout.page_bytes, probe.layout.pages_per_slot
    # room for 3 slots + 5 MLA blocks of 64 tokens: fewer than the 8 requests need together
    cfg = EngineConfig(memory_bytes=page * (3 * slot + 5), max_tokens_per_step=256, enable_prefix_cache=False)
    engine = RolloutEngine(tiny, cfg)
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        peak = max(peak, engine.stats().num_running)
        assert engine.pool.allocated_bytes <= cfg.memory_bytes
    stats = engine.stats()
    assert stats.preemptions > 0 and peak <= 3
    for p, i in zip(prompts, ids):
        res = engine.result(i)
        assert len(res.token_ids) == 40
        assert_greedy_matches_full_forward(tiny, p, res.token_ids, res.logprobs)
    engine.release(ids)
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages


def test_a_request_recomputed_mid_turn_counts_only_its_prompt_as_cached(tiny, monkeypatch):
    """``num_cached_tokens`` counts prompt tokens of the turn that were not computed for it. A request preempted
    mid-turn (here by a step that raised) resumes from the prefix cache at a checkpoint inside its own generated
    tokens: it reported 512 cached tokens for a 100-token prompt."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=32 * 2**20, checkpoint_interval=512))
    p = prompt(100, seed=80)
    rid = engine.add_request(p, SamplingParams(max_tokens=440, temperature=0))
    while len(engine.result(rid).token_ids) < 430:  # past the checkpoint at 512
        engine.step()

    def raises(*args, **kwargs):
        monkeypatch.undo()
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "forward", raises)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step()
    assert engine.stats().preemptions == 1
    while engine.has_unfinished():
        engine.step()
    res = engine.result(rid)
    assert engine.stats().prefix_cache.hit_tokens == 512  # it did resume inside its generation
    assert res.num_cached_tokens == len(p) == len(res.prompt_token_ids)
    assert_greedy_matches_full_forward(tiny, p, res.token_ids, res.logprobs)


def test_paused_caches_are_dropped_only_as_a_last_resort_and_recomputed(tiny):
    probe = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20))
    page, slot = probe.layout.page_bytes, probe.layout.pages_per_slot
    cfg = EngineConfig(memory_bytes=page * (2 * slot + 4), enable_prefix_cache=False)
    engine = RolloutEngine(tiny, cfg)
    a, b = prompt(100, seed=80), prompt(100, seed=81)
    ra = engine.add_request(a, SamplingParams(max_tokens=30, temperature=0))
    for _ in range(5):
        engine.step()
    engine.pause(ra)
    assert engine.requests[ra].has_cache
    rb = engine.add_request(b, SamplingParams(max_tokens=100, temperature=0))  # needs more than is left
    while engine.requests[rb].status != RequestStatus.FINISHED:
        engine.step()
        engine.check_invariants()
    assert not engine.requests[ra].has_cache and engine.stats().dropped_caches == 1
    engine.resume(ra)
    while engine.requests[ra].status != RequestStatus.FINISHED:
        engine.step()
    assert_greedy_matches_full_forward(tiny, a, engine.result(ra).token_ids, engine.result(ra).logprobs)


def test_a_request_larger_than_the_pool_is_refused_with_sizes(tiny):
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=2**20))
    total = engine.pool.num_pages
    with pytest.raises(ValueError, match=rf"needs 3010 tokens \(prompt \+ max_tokens\) = \d+ pages of 24576 bytes "
                                         rf"\(\d+ bytes\), but the whole pool is {total} pages"):
        engine.add_request(prompt(3000, seed=1), SamplingParams(max_tokens=10))
    rid = engine.add_request(prompt(100, seed=1), SamplingParams(max_tokens=10))
    engine.pause(rid)
    with pytest.raises(ValueError, match="but the whole pool is"):
        engine.extend(rid, prompt(3000, seed=2))
