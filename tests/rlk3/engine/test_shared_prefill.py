"""Shared prefill (``EngineConfig.share_prefill``): requests with one prompt — a GRPO group's samples — compute it
once. Followers continue from a copy of the leader's cache at its prompt's last token and generate exactly what
they would have generated alone; a leader that is paused or aborted before the fork point leaves its followers to
be admitted as usual; the pool's bookkeeping holds throughout."""

import pytest

from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _engine(tiny, share=True, **kw):
    kw = dict(memory_bytes=48 * 2**20, block_size=16, **kw)
    return RolloutEngine(tiny, EngineConfig(share_prefill=share, **kw))


def _run(engine, prompts, params):
    """Adds every request before the first step (as a rollout batch arrives) and steps to the end, checking the
    pool's bookkeeping after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    out = [engine.result(i) for i in ids]
    engine.release(ids)
    return out


def _all_free(engine):
    engine.clear_prefix_cache()
    engine.check_invariants()
    s = engine.stats().pool
    return s.free_pages == s.total_pages


@pytest.mark.parametrize("length", [300, 257])  # the fork inside a page (a copy of it) / on a page boundary
def test_a_group_of_one_prompt_computes_it_once(tiny, length):
    group = prompt(length, seed=1)
    others = [prompt(40, seed=2), prompt(90, seed=3)]
    prompts = [group] * 4 + others[:1] + [group] * 4 + others[1:]
    engine = _engine(tiny)
    res = _run(engine, prompts, GREEDY)
    stats = engine.stats()
    assert stats.shared_prefill_tokens == 7 * (length - 1)
    # the leader computes its prompt but the last token in chunks; every member computes that token itself
    assert stats.prefill_tokens == (length - 1) + sum(len(p) for p in others)
    members = [r for p, r in zip(prompts, res) if p is group]
    assert sorted(r.num_cached_tokens for r in members) == [0] + [length - 1] * 7
    for p, r in zip(prompts, res):
        assert_greedy_matches_full_forward(tiny, p, r.token_ids, r.logprobs)
    alone = _engine(tiny, share=False)
    ref = _run(alone, prompts, GREEDY)
    assert alone.stats().shared_prefill_tokens == 0
    assert alone.stats().prefill_tokens == sum(len(p) for p in prompts)
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert _all_free(engine)


@pytest.mark.parametrize("sampler", ["generator", "counter"])
def test_seeded_members_sample_what_they_sample_alone(tiny, sampler):
    group = prompt(200, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(8)]
    shared = _engine(tiny, sampler=sampler)
    res = _run(shared, [group] * 8, params)
    assert shared.stats().shared_prefill_tokens == 7 * 199
    ref = _run(_engine(tiny, share=False, sampler=sampler), [group] * 8, params)
    assert [r.token_ids for r in res] == [r.token_ids for r in ref]
    assert len({tuple(r.token_ids) for r in res}) > 1  # the members' own streams, not copies of the leader's
    for a, b in zip(res, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


@pytest.mark.parametrize("what", ["pause", "abort"])
def test_followers_of_a_leader_that_stops_before_the_fork_are_admitted_as_usual(tiny, what):
    group = prompt(600, seed=5)
    engine = _engine(tiny, max_tokens_per_step=128, prefill_chunk=128)  # the prompt takes several steps
    lead = engine.add_request(group, GREEDY)
    engine.step()
    followers = [engine.add_request(group, GREEDY) for _ in range(3)]
    engine.step()
    engine.check_invariants()
    assert engine.requests[lead].followers  # they wait for it
    getattr(engine, what)(lead)
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    # the first follower became the others' leader: they share its prefill instead
    assert engine.stats().shared_prefill_tokens == 2 * (len(group) - 1)
    outs = [engine.result(f) for f in followers]
    for r in outs:
        assert_greedy_matches_full_forward(tiny, group, r.token_ids, r.logprobs)
    if what == "pause":
        engine.resume(lead)
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
        assert engine.result(lead).token_ids == outs[0].token_ids
        engine.release([lead])
    engine.release(followers)
    assert _all_free(engine)


def test_a_weight_update_before_the_fork_leaves_followers_to_compute_under_the_new_weights(tiny):
    import torch

    group = prompt(600, seed=6)
    engine = _engine(tiny, max_tokens_per_step=128, prefill_chunk=128)
    engine.add_request(group, GREEDY)  # the leader
    engine.step()
    followers = [engine.add_request(group, GREEDY) for _ in range(2)]
    engine.step()
    weights = {k: v.clone() for k, v in tiny.state_dict().items()}
    try:
        bumped = {k: v * 1.01 for k, v in weights.items() if k.endswith("lm_head.weight")}
        engine.update_weights(bumped, version=1)
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
        # the leader's cache is from version 0: nobody copies it; the first follower leads the second instead
        assert engine.stats().shared_prefill_tokens == len(group) - 1
        for f in followers:
            assert_greedy_matches_full_forward(tiny, group, engine.result(f).token_ids, engine.result(f).logprobs)
            assert engine.result(f).versions == [1] * GREEDY.max_tokens
    finally:
        with torch.no_grad():
            tiny.load_state_dict(weights)
