"""Acceptance item 6: update_weights changes outputs, invalidates the prefix cache and tags later tokens with the
new version; release_memory / reacquire_memory round-trip with outputs unchanged."""

import copy

import pytest
import torch

from rlk3.engine import EngineConfig, EngineError, RequestStatus, RolloutEngine, SamplingParams
from rlk3.model import K3Config, K3ForCausalLM
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _new_weights(seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return K3ForCausalLM(K3Config()).eval()


def _until_tokens(engine, rid, n):
    while len(engine.result(rid).token_ids) < n:
        engine.step()


def _finish(engine, rid):
    while engine.requests[rid].status != RequestStatus.FINISHED:
        engine.step()
    return engine.result(rid)


def test_update_weights_changes_outputs_invalidates_cache_and_tags_versions(tiny):
    model = copy.deepcopy(tiny)  # updated in place
    engine = RolloutEngine(model, EngineConfig(memory_bytes=32 * 2**20, checkpoint_interval=512))
    p = prompt(600, seed=90)
    before = engine.generate([p], GREEDY)[0]
    assert engine.stats().prefix_cache.checkpoints > 0
    again = engine.generate([[*p, 5]], GREEDY)[0]
    assert again.num_cached_tokens == 600  # the cache (p's prompt-end tail) works before the update ...

    in_flight = engine.add_request(prompt(40, seed=91), SamplingParams(max_tokens=10, temperature=0))
    _until_tokens(engine, in_flight, 4)
    new = _new_weights(1)
    engine.update_weights(new.state_dict(), version=1)
    stats = engine.stats()
    assert stats.version == 1 and stats.prefix_cache.blocks == 0 and stats.prefix_cache.checkpoints == 0
    res = _finish(engine, in_flight)
    assert res.versions == [0] * 4 + [1] * 6  # every token carries the version that sampled it

    after = engine.generate([[*p, 5]], GREEDY)[0]
    assert after.num_cached_tokens == 0  # ... and holds nothing from the old weights after it
    assert after.versions == [1] * 8
    assert after.token_ids != again.token_ids
    # the new weights' own greedy output and logprobs
    assert_greedy_matches_full_forward(new, [*p, 5], after.token_ids, after.logprobs)
    assert before.versions == [0] * 8

    # a partial update streamed as (name, tensor) pairs: only the LM head changes
    # drawn at the model's own init scale: a unit-variance head makes logits of ~±30, whose fp32 rounding alone
    # moves log-probs by ~2e-5 between two summation orders (the CPU kernels' AVX2 and AVX-512 builds differ)
    head = torch.randn_like(model.lm_head.weight) * model.config.initializer_range
    engine.update_weights(iter([("lm_head.weight", head)]), version=2)
    assert torch.equal(model.lm_head.weight, head)
    res = engine.generate([p], GREEDY)[0]
    new.lm_head.weight.data.copy_(head)
    assert_greedy_matches_full_forward(new, p, res.token_ids, res.logprobs)
    assert res.versions == [2] * 8


def test_paused_requests_keep_their_cache_by_default_or_recompute_when_asked(tiny):
    p = prompt(120, seed=92)
    new = _new_weights(2)
    for recompute in (False, True):
        model = copy.deepcopy(tiny)
        engine = RolloutEngine(model, EngineConfig(memory_bytes=16 * 2**20, recompute_on_weight_update=recompute))
        rid = engine.add_request(p, SamplingParams(max_tokens=12, temperature=0))
        _until_tokens(engine, rid, 5)
        engine.pause(rid)
        engine.update_weights(new.state_dict(), version=1)
        assert engine.requests[rid].has_cache == (not recompute)
        engine.resume(rid)
        res = _finish(engine, rid)
        assert res.versions == [0] * 5 + [1] * 7
        if recompute:  # recomputed under the new weights: exactly what they give from that prefix
            assert_greedy_matches_full_forward(new, p + res.token_ids[:5], res.token_ids[5:], res.logprobs[5:])
            assert engine.stats().dropped_caches == 1


def test_release_and_reacquire_memory_round_trip(tiny):
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20))
    prompts = [prompt(n, seed=93 + n) for n in (8, 60, 130)]
    first = engine.generate(prompts, GREEDY)
    straight = engine.generate([prompt(70, seed=99)], SamplingParams(max_tokens=20, temperature=0))[0]
    rid = engine.add_request(prompt(70, seed=99), SamplingParams(max_tokens=20, temperature=0))
    _until_tokens(engine, rid, 6)
    engine.pause(rid)

    engine.release_memory()
    stats = engine.stats()
    assert stats.pool.allocated_bytes == 0 and engine.pool.storage is None
    assert not engine.requests[rid].has_cache
    with pytest.raises(EngineError, match="reacquire_memory"):
        engine.step()
    engine.reacquire_memory()
    assert engine.stats().pool.allocated_bytes == engine.pool.num_pages * engine.layout.page_bytes

    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == [r.token_ids for r in first]
    engine.resume(rid)  # recomputed from its tokens, then continues as if nothing happened
    res = _finish(engine, rid)
    assert res.token_ids == straight.token_ids
    engine.check_invariants()


def test_release_memory_is_not_counted_as_memory_pressure(tiny):
    """``preemptions`` and ``dropped_caches`` tell a user the pool is short (docs/engine.md: memory pressure, weight
    update). ``release_memory`` drops every cache by design; counting those, a colocated run showed one dropped cache
    per carried-over trajectory every iteration in a pool that was never short."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20))
    running = engine.add_request(prompt(30, seed=100), SamplingParams(max_tokens=12, temperature=0))
    paused = engine.add_request(prompt(40, seed=101), SamplingParams(max_tokens=12, temperature=0))
    done = engine.add_request(prompt(20, seed=102), SamplingParams(max_tokens=2, temperature=0))
    _finish(engine, done)
    engine.pause(paused)
    assert all(engine.requests[r].has_cache for r in (running, paused, done))
    engine.release_memory()
    engine.reacquire_memory()
    stats = engine.stats()
    assert (stats.preemptions, stats.dropped_caches) == (0, 0)
    engine.resume(paused)
    _finish(engine, running)
    _finish(engine, paused)
    assert (engine.stats().preemptions, engine.stats().dropped_caches) == (0, 0)


def test_update_weights_takes_a_tied_models_own_state_dict():
    """With tie_word_embeddings the state dict names the one tensor twice (model.embed_tokens.weight and
    lm_head.weight); the engine looked names up in named_parameters(), which lists it once, and refused the trainer's
    full state dict as 'unknown weight lm_head.weight' at the first sync. Both names are accepted now, and two
    different values for the one tied tensor are refused by name rather than the last one silently winning."""
    torch.manual_seed(0)
    cfg = K3Config.preset("k3-tiny", vocab_size=300, tie_word_embeddings=True)
    engine = RolloutEngine(K3ForCausalLM(cfg).eval(), EngineConfig(memory_bytes=32 * 2**20))
    trained = K3ForCausalLM(cfg)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    engine.update_weights(trained.state_dict(), version=1)
    got = engine.model.state_dict()
    assert engine.version == 1 and all(torch.equal(got[k], v) for k, v in trained.state_dict().items())
    odd = {**trained.state_dict(), "lm_head.weight": torch.zeros_like(trained.lm_head.weight)}
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' and 'lm_head\.weight' are one tied weight"):
        engine.update_weights(odd, version=2)
    assert engine.version == 1 and torch.equal(engine.model.lm_head.weight, trained.lm_head.weight)
