"""Padded all-prefill steps (``EngineConfig.prefill_graphs``, cuda_graphs.PrefillGraphs). On CUDA they replay
piecewise graphs; on CPU the same padded pieces run eagerly, which is what these tests check: the padding (a
padding sequence on a scratch slot, empty sequences up to the bucket, rows dropped after the LM head) and the split
at each MLA layer's attention change no result. They run the torch path (backend="torch"), whose pieces are the ones
CUDA captures (the CPU kernels ignore the padded builder's conv gathers and chunk indices). The captured graphs
themselves are checked on the H200 (test_gpu.py)."""

import pytest

import rlk3.engine.engine as engine_module
from rlk3.engine import EngineConfig, EngineConfigError, RolloutEngine, SamplingParams
from rlk3.engine.cuda_graphs import PREFILL_SEQ_BUCKETS, prefill_bucket
from tests.rlk3.engine._oracle import mixed_workload, prompt


def test_padded_prefill_steps_generate_what_plain_steps_generate(tiny):
    """The same tokens and log-probs (fp32: bit for bit here; bounded at 1e-6), with padded steps of several buckets
    really taken, and the pool's bookkeeping (the graphs' scratch pages included) intact throughout."""
    cfg = dict(memory_bytes=16 * 2**20, max_tokens_per_step=256, prefill_chunk=64, prefix_block_tokens=64,
               checkpoint_interval=64, backend="torch")
    plain = RolloutEngine(tiny, EngineConfig(**cfg, prefill_graphs=False))
    padded = RolloutEngine(tiny, EngineConfig(**cfg, prefill_graphs=True))
    shapes = []
    build = padded._batch

    def recorded(plan):
        batch = build(plan)
        if batch.pad is not None:
            shapes.append((batch.pad.tokens, batch.input_ids.shape[0], len(plan), batch.pad.seqs, len(batch.packed)))
            padded.check_invariants()
        return batch

    padded._batch = recorded
    want, got = mixed_workload(plain), mixed_workload(padded)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-6
    stats = padded.stats()
    assert plain.stats().padded_prefill_steps == 0
    assert stats.padded_prefill_steps == len(shapes) >= 4
    assert stats.prefill_padding_tokens == sum(t_pad - t for t, t_pad, *_ in shapes) > 0
    assert stats.prefix_cache.hit_tokens > 0
    assert any(n > 1 for _, _, n, _, _ in shapes) and any(packed for *_, packed in shapes)
    assert len({(t_pad, seqs) for _, t_pad, _, seqs, _ in shapes}) >= 2  # several buckets
    padded.check_invariants()
    scratch = len(padded._prefill_graphs.scratch)
    assert scratch == padded.layout.pages_per_slot + 1
    padded.release_memory()  # the scratch pages go back with the pool, and are taken again with it (before any
    padded.reacquire_memory()  # request: at first use the pool could be full)
    assert padded.stats().pool.free_pages == padded.stats().pool.total_pages - scratch
    assert len(padded._prefill_graphs.scratch) == scratch
    padded.check_invariants()


def test_mixed_and_oversized_steps_run_unpadded(tiny, monkeypatch):
    """Only all-prefill steps within a bucket are padded: a step with decode rows beside a prefill chunk, or more
    sequences than the largest bucket holds, runs as it is."""
    monkeypatch.setattr(engine_module, "prefill_bucket", lambda tokens, seqs, most: prefill_bucket(tokens, seqs, most)
                        if seqs < 3 else None)
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20, max_tokens_per_step=64, prefill_chunk=16,
                                              prefill_graphs=True, backend="torch"))
    kinds = []
    build = engine._batch

    def recorded(plan):
        batch = build(plan)
        kinds.append((batch.pad is not None, min(n for _, n in plan), len(plan)))
        return batch

    engine._batch = recorded
    engine.generate([prompt(n, seed=n) for n in (40, 90)], SamplingParams(max_tokens=3))
    engine.generate([prompt(n, seed=n) for n in (30, 31, 32)], SamplingParams(max_tokens=3))
    assert any(pad for pad, _, _ in kinds)
    for pad, shortest, n in kinds:
        assert pad == (shortest > 1 and n < 3), (pad, shortest, n)
    assert any(shortest == 1 and n > 1 for _, shortest, n in kinds)  # a prefill chunk beside decode rows


@pytest.mark.parametrize(
    "tokens,seqs,most,want",
    [
        (1, 1, 8192, (128, 4)),
        (128, 3, 8192, (128, 4)),  # three real sequences and the (empty) padding one
        (129, 4, 8192, (256, 16)),
        (2100, 1, 8192, (2176, 4)),  # a cached turn: +2,048 tokens and at most one block
        (2049, 1, 8192, (2176, 4)),  # +2,048 tokens and the reply's last token
        (4097, 63, 8192, (4352, 64)),
        (8192, 255, 8192, (8192, 256)),
        (8192, 256, 8192, None),  # no room for the padding sequence
        (8193, 1, 8192, None),  # over the step budget
        (2048, 1, 2048, (2048, 4)),
    ],
)
def test_prefill_buckets(tokens, seqs, most, want):
    assert prefill_bucket(tokens, seqs, most) == want


def test_prefill_buckets_bound_the_padding_and_the_shapes():
    """A step pads fewer than 128 tokens or 1/16 of its own, and a step budget of 8,192 tokens has at most 48 token
    buckets (x 4 sequence buckets) to capture."""
    shapes = set()
    for tokens in range(1, 8193):
        padded, _ = prefill_bucket(tokens, 1, 8192)
        assert 0 <= padded - tokens < max(128, tokens / 16), tokens
        shapes.add(padded)
    assert len(shapes) <= 48 and len(PREFILL_SEQ_BUCKETS) == 4


def test_prefill_graphs_config_is_checked():
    with pytest.raises(EngineConfigError, match=r"prefill_graphs must be a bool or None .*got 'yes'"):
        EngineConfig(prefill_graphs="yes")
    assert EngineConfig().prefill_graphs is None


def test_prefill_graphs_default_off_on_cpu(tiny):
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=8 * 2**20))
    engine.generate([prompt(40, seed=1)], SamplingParams(max_tokens=2))
    assert not engine.prefill_graphs and engine.stats().padded_prefill_steps == 0
    assert engine._prefill_graphs is None  # no scratch pages taken
