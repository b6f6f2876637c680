"""Bad input and invalid configuration: clear errors naming what is wrong."""

import copy

import numpy as np
import pytest
import torch

from rlk3.engine import (
    EngineConfig,
    EngineConfigError,
    EngineError,
    PoolError,
    RolloutEngine,
    SamplingParams,
    UnknownRequestError,
)
from tests.rlk3.engine._oracle import prompt


@pytest.fixture(scope="module")
def engine(tiny):
    return RolloutEngine(tiny, EngineConfig(memory_bytes=4 * 2**20))


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match=r"prompt_ids has token ids out of the vocabulary \[0, 4096\): min 1, max 4096"):  # noqa: E501
        engine.add_request([1, 4096])
    with pytest.raises(ValueError, match=r"out of the vocabulary \[0, 4096\): min -1"):
        engine.add_request([-1, 3])
    # beyond int64 (the packed form the range check reads): the same error, not an OverflowError
    with pytest.raises(ValueError, match=r"out of the vocabulary \[0, 4096\): min 3, max 18446744073709551616"):
        engine.add_request([3, 2**64])
    with pytest.raises(ValueError, match=r"out of the vocabulary \[0, 4096\): min -9223372036854775809, max 3"):
        engine.add_request([-(2**63) - 1, 3])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"must contain ints, got 1\.5"):
        engine.add_request([1, 1.5])
    with pytest.raises(ValueError, match=r"must contain ints, got True \(bool\)"):
        engine.add_request([1, True])  # an int to isinstance, not a token id
    with pytest.raises(ValueError, match=r"1-D integer tensor or array, got a Tensor of torch.float32 and shape \[3\]"):
        engine.add_request(torch.ones(3))
    for odd in (torch.tensor([True, False]), torch.ones(2, dtype=torch.complex64), torch.ones(2, 2, dtype=torch.long),
                np.ones(3), np.array([True, False])):  # bools would be stored as token ids True / False
        with pytest.raises(ValueError, match="must be a list of ints or a 1-D integer tensor or array, got a"):
            engine.add_request(odd)
    with pytest.raises(ValueError, match="list of ints or a 1-D integer tensor or array, got str"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match=r"turn_ends positions must be ints in \[1, 3\], got 4"):
        engine.add_request([1, 2, 3], turn_ends=[4])
    with pytest.raises(ValueError, match=r"turn_ends must be a list of token positions \(ints in \[1, 3\]\), got int"):
        engine.add_request([1, 2, 3], turn_ends=2)
    assert not engine.requests  # nothing refused above was queued
    # NumPy's integers (an array, or in a list) are token ids too, stored as Python ints
    for ids in ([1, np.int64(7)], np.array([1, 7], dtype=np.int32), np.array([1, 7], dtype=np.uint16)):
        rid = engine.add_request(ids)
        tokens = engine.requests[rid].tokens
        assert tokens == [1, 7] and all(type(t) is int for t in tokens), tokens
        engine.abort(rid)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), r"SamplingParams.max_tokens must be an int >= 1, got 0"),
        (dict(max_tokens=-3), r"SamplingParams.max_tokens must be an int >= 1, got -3"),
        (dict(temperature=-0.1), r"SamplingParams.temperature must be 0 \(greedy\) or a finite number >= 1e-05"),
        (dict(temperature=1e-40), r"SamplingParams.temperature must be 0 \(greedy\) or .* got 1e-40"),
        (dict(top_p=0.0), r"SamplingParams.top_p must be a number in \(0, 1\], got 0.0"),
        (dict(top_k=-1), r"SamplingParams.top_k must be an int >= 0, got -1"),
        (dict(stop_token_ids=[1, "x"]), r"SamplingParams.stop_token_ids must be a list of ints >= 0"),
        (dict(stop=[""]), r"SamplingParams.stop must be a list of non-empty strings"),
        (dict(seed=-1), r"SamplingParams.seed must be an int >= 0 and <= 18446744073709551615 or None, got -1"),
        (dict(seed=2**64), r"SamplingParams.seed must be an int >= 0 and <= 18446744073709551615 or None, got 1844"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        SamplingParams(**kwargs)


def test_sampling_that_needs_the_model_or_a_tokenizer(engine):
    with pytest.raises(ValueError, match=r"stop_token_ids \[5000\] are out of the vocabulary \[0, 4096\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[5000]))
    with pytest.raises(ValueError, match="stop strings\\) needs a tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=["</tool>"]))
    with pytest.raises(ValueError, match="sampling must be a SamplingParams, got dict"):
        engine.add_request([1, 2], {"max_tokens": 3})


def test_unknown_request_ids_and_wrong_states(engine):
    for call in (engine.pause, engine.resume, engine.abort, engine.release, engine.result):
        with pytest.raises(UnknownRequestError, match=r"unknown request id 'nope'"):
            call("nope")
    with pytest.raises(UnknownRequestError, match="unknown request id 'nope'"):
        engine.extend("nope", [1])
    for call in (engine.pause, engine.resume, engine.abort, engine.release):
        with pytest.raises(ValueError, match="request ids must be a str or an iterable of str, got NoneType"):
            call(None)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="r1")
    with pytest.raises(ValueError, match="request_id 'r1' is already in use"):
        engine.add_request([1], request_id="r1")
    with pytest.raises(UnknownRequestError):  # nothing is touched when one id of many is unknown
        engine.pause([rid, "nope"])
    assert engine.requests[rid].status.value == "waiting"
    with pytest.raises(EngineError, match="only paused or finished requests can be extended"):
        engine.extend(rid, [4])
    with pytest.raises(EngineError, match="resume: request 'r1' is waiting, not paused"):
        engine.resume(rid)
    with pytest.raises(EngineError, match="release: request 'r1' is waiting; abort it instead"):
        engine.release(rid)
    engine.abort(rid)
    with pytest.raises(UnknownRequestError):
        engine.result(rid)


def test_update_weights_rejects_bad_updates(tiny):
    engine = RolloutEngine(copy.deepcopy(tiny), EngineConfig(memory_bytes=4 * 2**20))
    before = engine.model.lm_head.weight.clone()
    with pytest.raises(ValueError, match=r"unknown weight 'lm_head.bias'"):
        engine.update_weights({"lm_head.weight": torch.zeros_like(before), "lm_head.bias": torch.zeros(3)}, 1)
    assert torch.equal(engine.model.lm_head.weight, before)  # checked before anything is copied
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \[3\], the model's is \[4096, 128\]"):
        engine.update_weights({"lm_head.weight": torch.zeros(3)}, 1)
    with pytest.raises(ValueError, match="version must be an int greater than the current 0, got 0"):
        engine.update_weights({}, 0)
    # a value that cannot be copied, late in the update, must not leave the earlier weights half-updated under
    # the old version: every value is checked before the first copy
    head = "lm_head.weight"
    last = list(engine.model.state_dict())[-2]
    assert last != head
    shape = engine.model.state_dict()[last].shape
    bad_values = [
        (torch.empty(shape, device="meta"), rf"'{last}' is a meta tensor \(no data\)"),
        (torch.zeros(shape).numpy(), rf"'{last}' must be a torch.Tensor, got ndarray"),
        (torch.zeros(shape, dtype=torch.long), rf"'{last}' has dtype torch.int64, the model's is torch.float32"),
        (torch.zeros(shape, dtype=torch.bool), rf"'{last}' has dtype torch.bool"),
        (torch.full(shape, float("nan")), rf"non-finite values \(NaN or inf\) in 1 weight\(s\): '{last}' "
                                          rf"\({shape.numel()} of {shape.numel()}\); nothing was copied"),
    ]
    for value, match in bad_values:
        with pytest.raises(ValueError, match=match):
            engine.update_weights({head: torch.zeros_like(before), last: value}, 1)
        assert torch.equal(engine.model.lm_head.weight, before) and engine.version == 0
    one_inf = engine.model.lm_head.weight.detach().clone()
    one_inf[3, 5] = float("-inf")
    with pytest.raises(ValueError, match=r"'lm_head.weight' \(1 of 524288\)"):
        engine.update_weights(iter([(head, one_inf)]), 1)
    with pytest.raises(ValueError, match=r"expected \(name, tensor\) pairs, got str"):
        engine.update_weights([head], 1)
    # a floating-point weight takes any floating-point precision (cast on copy), as streamed bf16 buckets are
    engine.update_weights({head: before.double() * 2}, 1)
    assert torch.equal(engine.model.lm_head.weight, before * 2) and engine.version == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(memory_bytes=1, memory_fraction=0.5), "set at most one of memory_bytes and memory_fraction"),
        (dict(memory_fraction=1.5), r"memory_fraction must be a number in \(0, 1\], got 1.5"),
        (dict(memory_bytes=0), r"memory_bytes must be an int >= 1 or None, got 0"),
        (dict(block_size=48), "block_size must be a power of two dividing prefix_block_tokens=512"),
        (dict(checkpoint_interval=700), "checkpoint_interval must be a multiple of prefix_block_tokens=512"),
        (dict(max_tokens_per_step=0), "max_tokens_per_step must be an int >= 1 or None, got 0"),
        (dict(backend="cuda"), r"backend must be one of \['auto', 'torch'\], got 'cuda'"),
        (dict(enable_prefix_cache="yes"), "enable_prefix_cache must be a bool, got 'yes'"),
        (dict(checkpoint_in_step=1), "checkpoint_in_step must be a bool, got 1"),
        (dict(drop_superseded_checkpoints=None), "drop_superseded_checkpoints must be a bool, got None"),
        (dict(cudnn_attention="on"), "cudnn_attention must be a bool, got 'on'"),
        (dict(cuda_graph_batch_sizes=[0]), "cuda_graph_batch_sizes must be a non-empty list of ints >= 1"),
        (dict(compile="yes"), r"compile must be a bool or None \(None: on CUDA only\), got 'yes'"),
        (dict(seed=2**70), r"EngineConfig.seed must be an int >= 0 and <= 18446744073709551615, got 1180"),
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(EngineConfigError, match=match):
        EngineConfig(**kwargs)


def test_memory_defaults():
    assert EngineConfig().memory_bytes == 256 * 2**20
    cfg = EngineConfig(memory_fraction=0.01)
    assert cfg.memory_bytes is None and cfg.memory_fraction == 0.01


def test_step_budget_defaults_by_device(tiny):
    """None resolves when the engine starts: 2048 tokens a step on CPU (8192 on CUDA); a set budget is kept."""
    assert EngineConfig().max_tokens_per_step is None
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=64 * 2**20, enable_prefix_cache=False))
    assert engine.config.max_tokens_per_step == 2048
    engine.add_request(prompt(3000, seed=1), SamplingParams(max_tokens=1, temperature=0))
    engine.step()
    assert engine.stats().prefill_tokens == 2048  # the first step's share of the 3,000-token prompt
    kept = RolloutEngine(tiny, EngineConfig(memory_bytes=64 * 2**20, max_tokens_per_step=100))
    assert kept.config.max_tokens_per_step == 100


def test_engine_config_from_dict_rejects_unknown_keys():
    assert EngineConfig.from_dict({"max_num_seqs": 4}).max_num_seqs == 4
    with pytest.raises(EngineConfigError, match=r"unknown keys \['max_batch'\]"):
        EngineConfig.from_dict({"max_batch": 4})


def test_model_and_pool_errors(tiny):
    with pytest.raises(EngineConfigError, match="model must be a K3ForCausalLM, got Linear"):
        RolloutEngine(torch.nn.Linear(2, 2))
    msg = (r"a pool budget of 100000 bytes holds 4 pages of 24576 bytes; one request needs at least 7 \(a KDA slot "
           r"of 6 pages \+ one MLA block\): set a budget of at least 172032 bytes$")
    with pytest.raises(PoolError, match=msg):
        RolloutEngine(tiny, EngineConfig(memory_bytes=100_000))
    RolloutEngine(tiny, EngineConfig(memory_bytes=172032))  # that is enough
    # the prefill graphs' scratch (a KDA slot and a page) comes out of the same pool: the minimum says so
    msg = (r"the pool's 10 pages of 24576 bytes cannot hold the graphs' scratch \(7 pages\) and one request \(7 "
           r"pages\): set a budget of at least 344064 bytes \(14 pages\), or prefill_graphs / cuda_graphs off$")
    with pytest.raises(PoolError, match=msg):
        RolloutEngine(tiny, EngineConfig(memory_bytes=10 * 24576, prefill_graphs=True))
    RolloutEngine(tiny, EngineConfig(memory_bytes=344064, prefill_graphs=True))
    # more than the machine has: refused before allocating (on the CPU an overcommitted pool would be killed later)
    with pytest.raises(PoolError, match=r"the pool needs \d+ bytes \(1048576.00 GiB\) but cpu has \d+ bytes "
                                        r"\([\d.]+ GiB\) free; lower memory_bytes, or set memory_fraction instead"):
        RolloutEngine(tiny, EngineConfig(memory_bytes=2**50))


def test_reacquire_memory_refuses_a_pool_the_device_cannot_hold_and_can_retry(tiny, monkeypatch):
    """After release_memory the trainer may still hold the memory: reacquire_memory says so instead of dying, the
    engine stays released (step refuses), and a later reacquire, once memory is back, generates as before."""
    from rlk3.engine import pool as pool_mod

    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20))
    sp = SamplingParams(max_tokens=5, temperature=0)
    before = engine.generate([prompt(20, seed=3)], sp)[0].token_ids
    engine.release_memory()
    monkeypatch.setattr(pool_mod, "_cpu_available_bytes", lambda: 2**20)  # the trainer holds the rest
    with pytest.raises(PoolError, match=r"the pool needs 16\d{6} bytes \(0.02 GiB\) but cpu has 1048576 bytes"):
        engine.reacquire_memory()
    engine.add_request(prompt(20, seed=3), sp, request_id="later")
    with pytest.raises(EngineError, match="the pool was released"):
        engine.step()
    monkeypatch.undo()
    engine.reacquire_memory()
    while engine.has_unfinished():
        engine.step()
    assert engine.result("later").token_ids == before


def test_generate_rejects_mismatched_sampling(engine):
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.generate([prompt(3, seed=1), prompt(3, seed=2)], [SamplingParams()])
    with pytest.raises(ValueError, match="non-empty list of token-id lists"):
        engine.generate([])


def test_the_finiteness_check_of_update_weights_reads_large_weights_in_pieces():
    """update_weights checks a 2 GiB embedding in pieces (a bounded boolean temporary); the pieces cover every
    element once, so a NaN in the last one is still seen."""
    from rlk3.engine.engine import _chunks, _finite_flags

    t = torch.arange(37, dtype=torch.float32).reshape(37, 1)
    pieces = _chunks(t, 8)
    assert [p.numel() for p in pieces] == [8, 8, 8, 8, 5]
    assert torch.equal(torch.cat(pieces), t.view(-1))
    t[36, 0] = float("nan")
    assert [bool(f) for f in _finite_flags(t)] == [False]  # the default piece size: one piece here
    assert [bool(torch.isfinite(p).all()) for p in _chunks(t, 8)] == [True] * 4 + [False]
    assert [p.shape for p in _chunks(t.reshape(1, 37).t().t().expand(2, 37), 8)] == [torch.Size([2, 37])]
