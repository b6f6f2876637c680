"""A differential fuzzer of the caches: random agent-shaped traffic through a small engine, every greedy turn
computed wholly under the current weights checked against the full forward of its whole sequence (fp32, 1e-5).

Where the stress test (test_stress.py) draws many requests against one configuration and reloads the same weights,
this one draws the configuration too (pool size, block and checkpoint spacing, spill, superseded checkpoints,
checkpoints inside a step, shared prefill, padded prefill, asynchronous decode, the CPU kernels or the torch path)
and updates to really different weights. The traffic re-sends finished conversations cut at, one before and one
after block boundaries and reply ends (the prefix cache's checkpoints and tails), with twins (shared prefill),
extends, pauses, aborts, releases and memory release. A request that kept its cache across a weight update is not
checked (keeping it is the default, by design: docs/engine.md, "Weight updates and in-flight requests").

Its first form (an audit's script, drawing in another order) found a leader resumed from the prefix cache exactly
at its fork point being planned for zero tokens, at one seed in ~85; that case is test_api_edges.py's now. Seeds
0-39 of this form pass on the engine before that fix and after it. CI runs two; more:
``RLK3_FUZZ_SEEDS=$(seq -s, 0 39) pytest tests/rlk3/engine/test_cache_fuzz.py`` (~4.5 s a seed here)."""

import copy
import os
import random

import pytest
import torch

from rlk3.engine import EngineConfig, FinishReason, RequestStatus, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward

SEEDS = [int(s) for s in os.environ.get("RLK3_FUZZ_SEEDS", "0,1").split(",")]
VOCAB = 4096


def _weights(tiny, n=3):
    """The model's own weights, then variants scaled elementwise by 1 ± 0.2 noise: really different outputs."""
    base = {k: v.clone() for k, v in tiny.state_dict().items()}
    out = [base]
    for i in range(1, n):
        g = torch.Generator().manual_seed(1000 + i)
        out.append({k: v * (1 + 0.2 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
                    for k, v in base.items()})
    return out


def _config(rng, page, slot):
    return EngineConfig(
        memory_bytes=page * (rng.randint(3, 7) * slot + rng.choice([rng.randint(16, 60), rng.randint(60, 250)])),
        block_size=16, prefix_block_tokens=16, checkpoint_interval=rng.choice([16, 32, 64]),
        max_num_seqs=rng.choice([3, 6, 10]), max_tokens_per_step=rng.choice([24, 48, 96]),
        prefill_chunk=rng.choice([8, 16, 24, 40]), spill_bytes=rng.choice([0, 0, 256 * 2**10, 4 * 2**20]),
        drop_superseded_checkpoints=rng.random() < 0.7, checkpoint_in_step=rng.random() < 0.7,
        recompute_on_weight_update=rng.random() < 0.5, share_prefill=rng.random() < 0.7,
        checkpoint_generation_end=rng.random() < 0.8, checkpoint_prompt_end=rng.random() < 0.85,
        backend=rng.choice(["auto", "auto", "torch"]), prefill_graphs=rng.random() < 0.3,
        async_decode=rng.random() < 0.3, sampler=rng.choice(["generator", "counter"]))


class Traffic:
    def __init__(self, tiny, seed):
        self.rng = rng = random.Random(seed)
        self.model = copy.deepcopy(tiny)
        self.weights = _weights(tiny)
        probe = RolloutEngine(self.model, EngineConfig(memory_bytes=4 * 2**20, block_size=16, prefix_block_tokens=16))
        self.config = _config(rng, probe.layout.page_bytes, probe.layout.pages_per_slot)
        self.engine = RolloutEngine(self.model, self.config)
        self.systems = [self.tokens(rng.randint(10, 70)) for _ in range(3)]  # shared system prompts
        self.stops = list(range(rng.randint(0, 3), VOCAB, 4))  # a quarter of the vocabulary: turns end early
        self.conversations: list[list[int]] = []  # finished ones, to re-send
        self.greedy: set[str] = set()
        self.stale: set[str] = set()  # kept a cache across a weight update (by design): not checked
        self.current = 0  # index of the weights loaded
        self.ids = 0
        self.checked = 0

    def tokens(self, n):
        return [self.rng.randint(1, VOCAB - 1) for _ in range(n)]

    def sampling(self, greedy):
        rng = self.rng
        return SamplingParams(max_tokens=rng.randint(1, 10), temperature=0 if greedy else 1.0, seed=rng.randint(0, 99),
                              stop_token_ids=self.stops if rng.random() < 0.3 else [])

    def check(self, rid):
        res = self.engine.requests[rid].result()
        if res.finish_reason in (None, FinishReason.ABORT) or not res.token_ids:
            return
        self.conversations.append(res.prompt_token_ids + res.token_ids)
        if rid in self.greedy and rid not in self.stale and all(v == self.engine.version for v in res.versions):
            assert_greedy_matches_full_forward(self.model, res.prompt_token_ids, res.token_ids, res.logprobs)
            self.checked += 1

    def prompt(self):
        rng = self.rng
        if self.conversations and rng.random() < 0.6:  # a re-send, cut near a block boundary or the reply's end
            c = rng.choice(self.conversations)
            cut = rng.choice([len(c), len(c) - 1, *range(16, len(c) + 1, 16)]) + rng.choice([-1, 0, 0, 1, 2])
            return c[: max(1, min(cut, len(c)))] + self.tokens(rng.choice([0, 1, 3, 10, 25]))
        return rng.choice(self.systems) + self.tokens(rng.randint(1, 40))

    def add(self):
        rng, prompt = self.rng, self.prompt()
        turn_ends = sorted(rng.sample(range(1, len(prompt) + 1), k=min(len(prompt), rng.choice([0, 0, 1, 2]))))
        greedy = rng.random() < 0.75
        for twin in range(2 if rng.random() < 0.2 else 1):  # a twin follows the first's prefill (shared prefill)
            rid = f"r{self.ids}"
            self.ids += 1
            self.engine.add_request(prompt, self.sampling(greedy), request_id=rid,
                                    turn_ends=() if twin else turn_ends)
            if greedy:
                self.greedy.add(rid)

    def extend(self, rid):
        rng, req = self.rng, self.engine.requests[rid]
        if req.status not in (RequestStatus.PAUSED, RequestStatus.FINISHED) or req.turn >= 4:
            return
        if req.status == RequestStatus.FINISHED:
            self.check(rid)
        new = self.tokens(rng.choice([1, 2, 5, 15, 16, 17, 30]))
        turn_ends = sorted(rng.sample(range(1, len(new) + 1), k=rng.choice([0, 1])))
        params = (SamplingParams(max_tokens=rng.randint(1, 8), temperature=0,
                                 stop_token_ids=self.stops if rng.random() < 0.3 else [])
                  if rid in self.greedy else None)
        self.engine.extend(rid, new, params, turn_ends=turn_ends)

    def update_weights(self):
        nxt = self.rng.choice([i for i in range(len(self.weights)) if i != self.current])
        if not self.config.recompute_on_weight_update:
            self.stale |= {rid for rid, r in self.engine.requests.items()
                           if r.has_cache or r.status == RequestStatus.RUNNING}
        self.engine.update_weights(self.weights[nxt], self.engine.version + 1)
        self.current = nxt

    def op(self):
        engine, rng, x = self.engine, self.rng, self.rng.random()
        ids = sorted(engine.requests)
        rid = rng.choice(ids) if ids else None
        status = engine.requests[rid].status if ids else None
        if x < 0.22:
            self.add()
        elif x < 0.30 and status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            engine.pause(rid)
        elif x < 0.38 and status == RequestStatus.PAUSED:
            engine.resume(rid)
        elif x < 0.48 and ids:
            self.extend(rid)
        elif x < 0.51 and ids:
            engine.abort(rid)
        elif x < 0.60 and status == RequestStatus.FINISHED:
            self.check(rid)
            engine.release(rid)
        elif x < 0.615:
            engine.release_memory()
            engine.reacquire_memory()
        elif x < 0.63:
            self.update_weights()
        else:
            engine.step()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_traffic_keeps_every_greedy_turn_exact(tiny, seed):
    t = Traffic(tiny, seed)
    engine = t.engine
    for _ in range(300):
        try:
            t.op()
        except ValueError as e:  # a drawn request larger than the pool (or the model): refused, nothing changed
            assert "the whole pool is" in str(e), e
        engine.check_invariants()
    engine.resume([rid for rid, r in engine.requests.items() if r.status == RequestStatus.PAUSED])
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        engine.step()
    else:
        raise AssertionError(f"seed {seed}: requests never finish under {t.config}")
    for rid in list(engine.requests):
        t.check(rid)
    assert t.checked >= 10, (t.checked, t.config)
    engine.release(list(engine.requests))
    engine.clear_prefix_cache()
    engine.check_invariants()
    scratch = len(engine._prefill_graphs.scratch) if engine._prefill_graphs is not None else 0
    assert engine.stats().pool.free_pages == engine.stats().pool.total_pages - scratch
