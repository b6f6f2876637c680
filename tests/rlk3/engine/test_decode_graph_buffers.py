"""The decode graphs' host-side bookkeeping on the CPU: ``DecodeGraphs`` with its capture replaced by an eager forward
over the same static buffers (the scratch rows, the block table and its growth), against an engine without graphs.
What CUDA's capture and replay add is tested on a GPU (test_gpu.py)."""

import pytest
import torch

from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.engine.cuda_graphs import INITIAL_TOKENS, DecodeGraphs
from rlk3.model import K3Config, K3ForCausalLM


class _Replay:
    def __init__(self, fn):
        self.replay = fn


class EagerGraphs(DecodeGraphs):
    """A 'graph' per batch size that runs the forward over the static inputs it would have captured."""

    captures = 0

    def _capture(self, size: int) -> None:
        self._reset_rows(0, max(self.sizes))
        batch = self.batches[size] = self._batch(size)
        self.captures += 1
        self.graphs[size] = _Replay(lambda: self.outputs.__setitem__(size, self.runner.forward(self.pool, batch)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("k3-tiny", num_hidden_layers=2)).eval()


def _graphed(model, monkeypatch, **cfg) -> RolloutEngine:
    engine = RolloutEngine(model, EngineConfig(**cfg))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    engine._graphs, engine._graphs_ok = EagerGraphs(engine.runner, engine.pool, engine.config), True
    return engine


def test_the_block_table_grows_with_the_longest_sequence_and_decodes_as_eager(model, monkeypatch):
    """With ``max_model_len`` unset the table was sized for one sequence holding the whole pool (the largest batch x
    every page, in int64, outside the pool's budget). It starts 4,096 tokens wide and doubles when a longer sequence
    decodes; the graphs that read the old table are dropped, and the replays still compute what eager decode does."""
    cfg = dict(memory_bytes=2**27, block_size=16)
    engine = _graphed(model, monkeypatch, **cfg)
    graphs = engine._graphs
    assert graphs.block_tables.shape == (max(graphs.sizes), INITIAL_TOKENS // 16)
    assert graphs.max_width == engine.pool.num_pages > 8 * graphs.width
    sampling = SamplingParams(max_tokens=6, temperature=0)
    engine.generate([[5] * 40], sampling)  # the graph of 1 captured over the first table
    assert graphs.width == 256 and 1 in graphs.graphs
    prompts = [[(i * 7919) % 4000 + 5 for i in range(4200)], [7] * 30, [9] * 70]  # 263 pages: a table of 512
    graphed = engine.generate(prompts, sampling)
    assert graphs.width == graphs.block_tables.shape[1] == 512 and graphs.captures >= 2
    eager = RolloutEngine(model, EngineConfig(**cfg)).generate(prompts, sampling)
    assert [(r.token_ids, r.logprobs) for r in graphed] == [(r.token_ids, r.logprobs) for r in eager]
    engine.check_invariants()


def test_a_table_never_grows_past_max_model_len(model, monkeypatch):
    engine = _graphed(model, monkeypatch, memory_bytes=2**27, block_size=16, max_model_len=1000)
    assert engine._graphs.width == engine._graphs.max_width == 63  # ceil(1000 / 16): under the initial 4,096 tokens
    out = engine.generate([[7] * 900], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 8 and engine._graphs.width == 63
