"""Asynchronous decode (engine.py's docstring): a decode step launched before the previous one is read back, fed by
its sampled ids on the device. What a caller sees must be what the synchronous engine gives — the same tokens,
logprobs, versions and finish reasons through arrivals, stop tokens, pause/resume, a weight update and ``extend`` —
except that ``step()`` reports a finished request one call later. On a CPU nothing overlaps, but the same code
paths run (``async_decode=True``), so the bookkeeping is checked here; test_gpu.py runs it with CUDA graphs."""

import copy

import pytest
import torch

from rlk3.engine import EngineConfig, EngineConfigError, FinishReason, RequestStatus, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import prompt

LENGTHS = [5, 17, 40, 64, 3, 90, 33, 8]


def _params(i: int, stops: list[int]) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=12 + 3 * i, temperature=0, stop_token_ids=stops)
    return SamplingParams(max_tokens=12 + 3 * i, temperature=0.9, top_k=50, seed=100 + i, stop_token_ids=stops)


def _engine(model, sampler: str, async_decode: bool) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(memory_bytes=32 * 2**20, max_num_seqs=8, sampler=sampler,
                                             async_decode=async_decode))


def _stops(model, sampler: str) -> dict[int, list[int]]:
    """For each request, a token its own uninterrupted turn samples a few tokens in (so a stop really happens)."""
    engine = _engine(model, sampler, False)
    out = engine.generate([prompt(n, seed=i) for i, n in enumerate(LENGTHS)],
                          [_params(i, []) for i in range(len(LENGTHS))])
    return {i: [r.token_ids[3 + i % 4]] if i % 3 != 2 else [] for i, r in enumerate(out)}


def _workload(model, sampler: str, async_decode: bool, stops: dict[int, list[int]]):
    """Arrivals mid-run, a pause, a weight update, a resume, then extensions of finished turns; returns every result
    handed out (by step and pause), each request's final state, and the engine."""
    model = copy.deepcopy(model)  # update_weights writes into it
    engine = _engine(model, sampler, async_decode)
    handed, ids = [], {}

    def add(i):
        ids[i] = engine.add_request(prompt(LENGTHS[i], seed=i), _params(i, stops[i]))

    def steps(n=None):
        k = 0
        while engine.has_unfinished() and (n is None or k < n):
            handed.extend(engine.step())
            k += 1

    for i in range(6):
        add(i)
    steps(3)
    add(6)
    add(7)
    steps(4)
    engine.stats()  # settles the step in flight: statuses as the synchronous engine has them
    paused = [i for i in (1, 3, 5, 6, 7, 0, 2, 4) if engine.requests[ids[i]].status != RequestStatus.FINISHED][:2]
    assert len(paused) == 2
    handed.extend(engine.pause([ids[i] for i in paused]))
    steps(5)
    g = torch.Generator().manual_seed(7)
    head = model.lm_head.weight
    engine.update_weights({"lm_head.weight": head + 0.05 * torch.randn(head.shape, generator=g).to(head.device)},
                          version=1)
    # (a turn that ended on a stop token before the update had that token computed ahead under the old weights,
    # where the synchronous engine computes it when the turn is extended, under the new ones: extend later turns)
    before = {i for i in range(8) if engine.requests[ids[i]].status == RequestStatus.FINISHED}
    engine.resume(ids[paused[0]])
    steps()
    extended = [i for i in range(8) if engine.requests[ids[i]].status == RequestStatus.FINISHED and i not in before]
    extended = extended[:3]
    for i in extended:
        engine.extend(ids[i], prompt(7, seed=50 + i))
    engine.resume(ids[paused[1]])
    steps()
    final = {i: engine.result(ids[i]) for i in range(8)}
    return handed, final, engine, [ids[i] for i in extended]


def compare_with_synchronous(tiny, sampler: str, tol: float = 1e-5) -> tuple[RolloutEngine, RolloutEngine]:
    """The workload with ``async_decode`` off and on: the same results, handed out once each. Returns both engines
    (asynchronous, synchronous)."""
    stops = _stops(tiny, sampler)
    sync_handed, sync_final, sync_engine, sync_ext = _workload(tiny, sampler, False, stops)
    handed, final, engine, ext = _workload(tiny, sampler, True, stops)
    assert sync_engine.stats().overlapped_steps == 0
    assert ext == sync_ext and len(ext) >= 2
    assert any(r.finish_reason == FinishReason.STOP for r in sync_handed), "the workload must stop on a token"
    for i in range(8):
        a, b = final[i], sync_final[i]
        assert a.token_ids == b.token_ids, f"request {i}"
        assert a.finish_reason == b.finish_reason and a.versions == b.versions and a.turn == b.turn
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= tol
    # every finished turn handed out exactly once, whatever the call that reported it
    key = lambda r: (r.request_id, r.turn, r.status.value, tuple(r.token_ids))  # noqa: E731
    assert sorted(map(key, handed)) == sorted(map(key, sync_handed))
    assert len(set(map(key, handed))) == len(handed)
    engine.check_invariants()
    assert engine.stats().generated_tokens == sync_engine.stats().generated_tokens
    return engine, sync_engine


@pytest.mark.parametrize("sampler", ["counter", "generator"])
def test_async_decode_gives_what_the_synchronous_engine_gives(tiny, sampler):
    engine, sync_engine = compare_with_synchronous(tiny, sampler)
    if sampler == "counter":  # the sampled rows ran ahead too
        assert engine.stats().overlapped_steps > 20
    else:  # a dropped draw would shift a generator's stream: only all-greedy steps ran ahead
        assert 0 < engine.stats().overlapped_steps < sync_engine.stats().steps


def test_a_stop_token_is_computed_ahead_and_extend_continues_from_it(tiny):
    """Greedy: the request stops on the token its uninterrupted turn samples 5th. The step launched ahead computes
    that token, so the finished request's cache covers all its tokens (one more than the synchronous engine's), and
    an extension continues with the same tokens as in the synchronous engine."""
    p = prompt(30, seed=3)
    free = _engine(tiny, "counter", False).generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    stop = free.token_ids[4]
    n = free.token_ids.index(stop) + 1
    runs = {}
    for mode in (False, True):
        engine = _engine(tiny, "counter", mode)
        rid = engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))
        while engine.has_unfinished():
            engine.step()
        req = engine.requests[rid]
        assert req.finish_reason == FinishReason.STOP and len(req.tokens) == 30 + n
        computed = req.num_computed
        engine.extend(rid, prompt(6, seed=9), SamplingParams(max_tokens=8, temperature=0))
        while engine.has_unfinished():
            engine.step()
        runs[mode] = (computed, engine.result(rid))
    assert runs[False][0] == 30 + n - 1 and runs[True][0] == 30 + n
    assert runs[True][1].token_ids == runs[False][1].token_ids
    assert runs[True][1].num_cached_tokens == runs[False][1].num_cached_tokens + 1


def test_pause_of_a_request_that_finished_in_the_step_it_settles_returns_the_final_result(tiny):
    """The caller saw the request running (its last token was still in flight); ``pause`` reads that token back,
    finds the turn finished and returns the final result, which ``step()`` does not report again."""
    p = prompt(20, seed=4)
    free = _engine(tiny, "counter", False).generate([p], SamplingParams(max_tokens=10, temperature=0))[0]
    stop = free.token_ids[5]
    n = free.token_ids.index(stop) + 1
    engine = _engine(tiny, "counter", True)
    rid = engine.add_request(p, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))
    other = engine.add_request(prompt(9, seed=5), SamplingParams(max_tokens=30, temperature=0))
    reported = []
    req = engine.requests[rid]
    while len(req.tokens) < 20 + n - 1:  # the stop token is the one in flight after this
        reported += engine.step()
    assert req.status == RequestStatus.RUNNING and len(req.tokens) == 20 + n - 1 and engine._inflight is not None
    out = engine.pause([rid])[0]
    assert out.status == RequestStatus.FINISHED and out.finish_reason == FinishReason.STOP
    assert out.token_ids == free.token_ids[:n]
    while engine.has_unfinished():
        reported += engine.step()
    assert [r.request_id for r in reported] == [other]
    with pytest.raises(Exception, match="finished"):  # reported now: an ordinary finished request
        engine.pause([rid])


def test_async_decode_config_is_validated():
    with pytest.raises(EngineConfigError, match="async_decode must be a bool or None"):
        EngineConfig(async_decode="yes")
