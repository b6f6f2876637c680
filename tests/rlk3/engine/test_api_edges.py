"""The public API at its edges: calls in unusual orders and states, repeated ids, parameters edited after they were
given, and a step that raises half-way. Each case once left a request that never finished, leaked pages or
recorded a wrong token; the engine must instead give what it gives without the odd call (or refuse the call and
change nothing), and end with every page accounted for."""

import re

import numpy as np
import pytest

import rlk3.engine.engine as engine_module
from rlk3.engine import (
    EngineConfig,
    EngineError,
    FinishReason,
    RequestStatus,
    RolloutEngine,
    SamplingParams,
    StopCheckError,
)
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, prompt


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0)


def new(tiny, **config):
    config.setdefault("memory_bytes", 16 * 2**20)
    return RolloutEngine(tiny, EngineConfig(**config))


def run(engine, limit=300):
    """Steps until nothing is left; a request that can never finish fails here instead of hanging."""
    out = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return out
        out += engine.step()
        engine.check_invariants()
    stuck = {r.request_id: (r.status.value, len(r.tokens), r.num_computed) for r in engine.requests.values()}
    raise AssertionError(f"still unfinished after {limit} steps: {stuck}")


def assert_all_pages_free(engine):
    engine.check_invariants()
    engine.release([r for r, q in engine.requests.items() if q.status == RequestStatus.FINISHED])
    engine.clear_prefix_cache()
    engine.check_invariants()
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages


@pytest.mark.parametrize("drop", ["release_memory", "recompute_update"])
def test_a_leader_admitted_again_after_sampling_is_not_followed_at_its_longer_prompt(tiny, drop):
    """A shares its prompt P (shared prefill) and samples a token; its cache is dropped (colocated training, or a
    weight update that recomputes) and it is admitted again with P + its token. B, with P, arrives later: it must
    not fork at A's new fork point (its own last token would count as computed, and it would never run)."""
    P = prompt(30, 11)
    alone = new(tiny).generate([P], greedy(8))[0].token_ids
    engine = new(tiny, recompute_on_weight_update=drop == "recompute_update")
    engine.add_request(P, greedy(8), request_id="A")
    engine.step()  # A's whole prompt and its first token
    if drop == "release_memory":
        engine.release_memory()
        engine.reacquire_memory()
    else:
        engine.update_weights({}, 1)  # no weight changes: the outputs stay comparable
    engine.add_request(P, greedy(8), request_id="B")
    done = {r.request_id: r for r in run(engine)}
    assert done["B"].token_ids == alone and done["A"].token_ids == alone
    assert_all_pages_free(engine)


def test_a_leader_extended_after_losing_its_cache_hands_its_follower_the_right_position(tiny):
    """B follows A (one prompt); A is paused mid-prefill, loses its cache and is extended: A's new fork point lies
    past B's prompt, so B is admitted on its own and generates what it generates alone."""
    P = prompt(200, 7)
    alone = new(tiny).generate([P], greedy(4))[0].token_ids
    engine = new(tiny, max_tokens_per_step=64, prefill_chunk=32)
    engine.add_request(P, greedy(4), request_id="A")
    engine.add_request(P, greedy(4), request_id="B")
    engine.step()
    assert engine.requests["B"].leader is engine.requests["A"]  # B follows A's prefill
    engine.pause("A")
    engine.release_memory()
    engine.reacquire_memory()
    engine.extend("A", prompt(100, 8))
    done = {r.request_id: r for r in run(engine)}
    assert done["B"].token_ids == alone
    assert_all_pages_free(engine)


class RaisingTokenizer:
    """A tokenizer whose decode raises on ids past its own vocabulary (sentencepiece does), as when the model's
    embedding is padded beyond the tokenizer's: here from a turn's third token on, which a decode step draws (with
    asynchronous decode, a step launched ahead of its read-back). A stop check decodes the turn's tokens after the
    prompt's last ``STOP_CONTEXT_TOKENS`` (engine._turn_tail_text): the third token's check is the first to decode
    that many and three more."""

    def decode(self, ids):
        if len(ids) >= engine_module.STOP_CONTEXT_TOKENS + 3:
            raise IndexError(f"piece id {ids[-1]} is out of range")
        return "".join(map(chr, ids))


@pytest.mark.parametrize("async_decode,poll", [(False, False), (True, False), (True, True)])
def test_a_stop_check_that_raises_ends_its_request_and_no_other(tiny, async_decode, poll):
    prompts = [prompt(10, s) for s in range(5)]
    alone = new(tiny).generate(prompts[1:], greedy(6))
    config = EngineConfig(memory_bytes=16 * 2**20, async_decode=async_decode, sampler="counter")
    engine = RolloutEngine(tiny, config, tokenizer=RaisingTokenizer())
    ids = [engine.add_request(prompts[0], SamplingParams(max_tokens=6, temperature=0, stop=["never"]))]
    ids += [engine.add_request(p, greedy(6)) for p in prompts[1:]]
    finished, errors = [], []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        if poll:  # an agent loop polling: with asynchronous decode this settles the step in flight, and a stop
            engine.result(ids[1])  # check that raised while settling is raised by the next step(), not by result()
            engine.check_invariants()  # (which settles too)
        try:  # (not polling, it raises while step() reads back the step before the one it just launched)
            finished += engine.step()  # the others go on; the ended request is reported by the next step
        except StopCheckError as e:
            errors.append(str(e))
    assert len(errors) == 1 and re.fullmatch(r"request 'req-0': its stop strings could not be checked, the "
                                             r"tokenizer's decode raised IndexError: piece id \d+ is out of range; "
                                             r"the request was ended \(finish_reason abort\).*", errors[0]), errors
    by_id = {r.request_id: r for r in finished}
    assert sorted(by_id) == sorted(ids)
    culprit = by_id["req-0"]
    assert culprit.finish_reason == FinishReason.ABORT and len(culprit.token_ids) == 3  # its tokens kept
    assert [by_id[i].token_ids for i in ids[1:]] == [r.token_ids for r in alone]
    assert_all_pages_free(engine)


@pytest.mark.parametrize("async_decode", [False, True])
def test_a_draw_that_raises_recomputes_the_requests_it_left_without_a_token(tiny, monkeypatch, async_decode):
    """The step's forward advanced every row past its last token, then the draw raised: those requests are
    recomputed when they next run (seeded sampling draws the same tokens), the others are untouched."""
    prompts = [prompt(12 + 5 * s, s) for s in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    config = dict(sampler="counter", async_decode=async_decode)
    alone = [r.token_ids for r in new(tiny, **config).generate(prompts, params)]
    name = "sample_tensors" if async_decode else "sample"
    real, calls = getattr(engine_module, name), []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a draw that failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, name, fails_once)
    engine = new(tiny, **config)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    finished = []
    with pytest.raises(RuntimeError, match="a draw that failed"):
        while engine.has_unfinished():
            finished += engine.step()
    assert engine.stats().preemptions >= 1
    finished += run(engine)
    by_id = {r.request_id: r.token_ids for r in finished}
    assert [by_id[i] for i in ids] == alone
    assert_all_pages_free(engine)


def test_a_repeated_id_counts_once(tiny):
    P = prompt(10, 1)
    alone = new(tiny).generate([P], greedy(6))[0].token_ids
    engine = new(tiny)
    for cached in (True, False):  # paused after a step (its cache kept), or while still waiting
        engine.add_request(P, greedy(6), request_id="a")
        if cached:
            engine.step()
        engine.pause("a")
        engine.resume(["a", "a"])
        engine.check_invariants()  # in its queue once
        assert [r.token_ids for r in run(engine)] == [alone]
        engine.release(["a", "a"])
        assert "a" not in engine.requests
    engine.add_request(P, greedy(6), request_id="b")
    engine.step()
    out = engine.abort(["b", "b"])  # one result, the partial trajectory with it
    assert [(r.request_id, r.finish_reason, len(r.token_ids)) for r in out] == [("b", FinishReason.ABORT, 1)]
    assert_all_pages_free(engine)


def test_sampling_params_are_checked_again_and_copied_when_a_request_takes_them(tiny):
    engine = new(tiny)
    for field, value in [("max_tokens", 0), ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0),
                         ("top_k", -3), ("seed", -1), ("stop_token_ids", [-1])]:
        params = greedy(4)
        setattr(params, field, value)  # set after construction: __post_init__ did not see it
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
            engine.add_request([1, 2, 3], params)
    assert not engine.requests
    params = greedy(4)
    rid = engine.add_request(prompt(10, 2), params)
    params.max_tokens = 1000  # edited for the next batch: the queued request keeps its own
    (res,) = run(engine)
    assert res.request_id == rid and len(res.token_ids) == 4


def test_extend_given_the_same_params_object_continues_the_random_stream(tiny):
    """The engine keeps a copy of the caller's params; an agent loop that passes its one object to every turn
    still continues the request's stream, as ``extend`` without params does (a new object with a seed starts that
    seed's stream: test_generation.py)."""
    P, tool = prompt(20, 4), prompt(9, 5)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    turns = {}
    for how in ("none", "same", "copy"):
        engine = new(tiny, sampler="generator")  # the sampler whose draws depend on the stream's state
        rid = engine.add_request(P, params)
        run(engine)
        engine.extend(rid, tool, {"none": None, "same": params, "copy": SamplingParams(**vars(params))}[how])
        turns[how] = run(engine)[0].token_ids
    assert turns["same"] == turns["none"] != turns["copy"]


def test_numpy_numbers_in_sampling_params_sample_like_python_ones(tiny):
    P = prompt(10, 3)
    ref = new(tiny).generate([P], SamplingParams(max_tokens=5, seed=3, top_k=50))[0].token_ids
    params = SamplingParams(max_tokens=np.int64(5), seed=np.uint64(3), top_k=np.int32(50), temperature=np.float32(1))
    assert type(params.seed) is int and type(params.max_tokens) is int and type(params.temperature) is float
    assert new(tiny).generate([P], params)[0].token_ids == ref


def test_extend_after_polling_with_async_decode_does_not_report_the_previous_turn(tiny):
    """With asynchronous decode a caller that polls ``result()`` until finished, then extends, must not get the
    previous turn's result from the next ``step()`` as if the new turn had finished."""
    engine = new(tiny, async_decode=True, sampler="counter")
    engine.add_request(prompt(10, 1), greedy(4), request_id="a")
    while engine.result("a").status != RequestStatus.FINISHED:
        engine.step()
    engine.extend("a", [5, 6, 7])
    reported = run(engine)
    assert [(r.request_id, r.turn, len(r.token_ids)) for r in reported] == [("a", 1, 4)]
    assert_all_pages_free(engine)


def test_pause_checks_every_id_before_pausing_any(tiny):
    engine = new(tiny)
    engine.add_request(prompt(10, 1), greedy(2), request_id="done")
    run(engine)
    engine.add_request(prompt(10, 2), greedy(8), request_id="live")
    engine.step()
    with pytest.raises(EngineError, match="pause: request 'done' is finished"):
        engine.pause(["live", "done"])
    assert engine.requests["live"].status == RequestStatus.RUNNING
    run(engine)
    assert_all_pages_free(engine)


def test_a_refused_extend_changes_nothing(tiny):
    engine = new(tiny)
    engine.add_request(prompt(10, 1), greedy(3), request_id="a")
    run(engine)
    before = list(engine.requests["a"].tokens)
    for turn_ends, match in [([9], r"turn_ends positions must be ints in \[1, 3\], got 9"),
                             (3, r"turn_ends must be a list of token positions")]:
        with pytest.raises(ValueError, match=match):
            engine.extend("a", [5, 6, 7], turn_ends=turn_ends)
        assert engine.requests["a"].tokens == before and engine.requests["a"].status == RequestStatus.FINISHED
    engine.extend("a", [5, 6, 7], turn_ends=[3])
    (res,) = run(engine)
    assert res.turn == 1 and res.prompt_token_ids == [*before, 5, 6, 7]


def test_wrong_kinds_of_arguments_are_named(tiny):
    engine = new(tiny)
    with pytest.raises(ValueError, match=r"state_dict must be a mapping of weight names to tensors .* got NoneType"):
        engine.update_weights(None, 1)
    with pytest.raises(ValueError, match=r"state_dict must be a mapping .* got K3ForCausalLM"):
        engine.update_weights(tiny, 1)
    with pytest.raises(ValueError, match=r"generate: sampling must be a SamplingParams \(one for all prompts\) or a "
                                         r"list of them \(one per prompt\), got dict"):
        engine.generate([[1, 2]], {"max_tokens": 2})
    with pytest.raises(ValueError, match="request ids must be a str or an iterable of str, got bytes"):
        engine.pause(b"ab")
    assert engine.version == 0 and not engine.requests


@pytest.mark.parametrize("backend", ["auto", "torch"])  # the CPU kernels' runner, and the torch path
def test_a_leader_resumed_from_the_prefix_cache_at_its_fork_point_is_not_planned_for_no_tokens(tiny, backend):
    """Leader L (with a follower F) is preempted before its fork point; meanwhile another request caches a
    checkpoint exactly there, so L resumes at its fork point. It must not be planned for zero tokens (counted as
    a decode row, the step raised, and on the torch path a decoding request D sharing the step had its state
    advanced twice); F forks, and every output equals the full forward."""
    engine = new(tiny, block_size=16, prefix_block_tokens=16, checkpoint_interval=32, prefill_chunk=40,
                 max_tokens_per_step=2, max_num_seqs=2, backend=backend)
    P = prompt(33, 1)  # L's fork point, 32, is a block boundary with an interval checkpoint
    Q = [*P[:32], *prompt(30, 2)]
    engine.add_request([5], greedy(40), request_id="D")
    engine.add_request(Q, greedy(4), request_id="Q")
    engine.pause("Q")
    engine.add_request(P, greedy(3), request_id="L")
    engine.add_request(P, greedy(3), request_id="F")
    engine.step()
    assert engine.requests["F"].leader is engine.requests["L"]
    engine.release_memory()  # L preempted short of its fork point, still leading F
    engine.reacquire_memory()
    engine.resume("Q")  # computes P[:32] first: the checkpoint at L's fork point
    done = {r.request_id: r for r in run(engine, limit=600)}
    assert sorted(done) == ["D", "F", "L", "Q"]
    assert done["L"].num_cached_tokens == 32  # resumed at its fork point
    for r in done.values():
        assert_greedy_matches_full_forward(tiny, r.prompt_token_ids, r.token_ids, r.logprobs)
    assert_all_pages_free(engine)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_forward_that_raises_after_writing_states_recomputes_its_requests(tiny, monkeypatch, backend):
    """A forward that raised part-way may have advanced KDA states and conv caches in place (a device error, an
    out-of-memory error in a later layer): its requests are recomputed, so no token is applied twice."""
    prompts = [prompt(9 + 7 * s, s) for s in range(3)]
    alone = [r.token_ids for r in new(tiny, backend=backend).generate(prompts, greedy(6))]
    engine = new(tiny, backend=backend)
    ids = [engine.add_request(p, greedy(6)) for p in prompts]
    for fail_at in (0, 3):  # a prefill step, then a decode step
        for _ in range(fail_at):
            engine.step()
        def writes_then_raises(*args, forward=engine.runner.forward, **kwargs):
            monkeypatch.setattr(engine.runner, "forward", forward)
            forward(*args, **kwargs)  # every state of the step written
            raise RuntimeError("out of memory in the LM head")

        monkeypatch.setattr(engine.runner, "forward", writes_then_raises)
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.step()
        engine.check_invariants()
    by_id = {r.request_id: r.token_ids for r in run(engine)}
    assert [by_id[i] for i in ids] == alone
    assert engine.stats().preemptions >= 3
    assert_all_pages_free(engine)


def test_the_graphs_scratch_pages_are_taken_with_the_pool(tiny):
    """Taken at first use, the graphs' scratch could find the pool full (admission fills it to the last page) and
    stop the step; so it is taken with the pool, and a request is sized against the pages left."""
    page_bytes = new(tiny).layout.page_bytes
    engine = new(tiny, prefill_graphs=True, memory_bytes=40 * page_bytes)
    scratch = engine.layout.pages_per_slot + 1
    assert len(engine._prefill_graphs.scratch) == scratch
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages - scratch
    page_tokens = engine.layout.block_size
    room = (engine.pool.num_pages - scratch - engine.layout.pages_per_slot) * page_tokens
    with pytest.raises(ValueError, match=f"the whole pool is {engine.pool.num_pages} pages .*, {scratch} of them "
                                         "the graphs' scratch"):
        engine.add_request([1] * (room - 15), greedy(16))
    engine.add_request([1] * (room - 16), greedy(16))  # exactly what is left
    batch = [engine.add_request(prompt(60, 100 + i), greedy(8)) for i in range(8)]  # more than the pool holds
    done = {r.request_id for r in run(engine, limit=3000)}
    assert set(batch) <= done
    engine.release_memory()
    engine.reacquire_memory()
    assert len(engine._prefill_graphs.scratch) == scratch
    assert_all_pages_free_but(engine, scratch)


def assert_all_pages_free_but(engine, scratch):
    engine.release([r for r, q in engine.requests.items() if q.status == RequestStatus.FINISHED])
    engine.clear_prefix_cache()
    engine.check_invariants()
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages - scratch
