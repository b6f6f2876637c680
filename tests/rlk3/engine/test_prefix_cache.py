"""Acceptance item 3: a shared 2,000-token prefix is not prefilled again (up to one checkpoint interval), and a
hit never restores a KDA state from the wrong boundary. Also CPU spill and agent-marked turn ends."""

import time

import pytest

from rlk3.engine import EngineConfig, RequestStatus, RolloutEngine, SamplingParams
from rlk3.engine.prefix_cache import ROOT, block_hash
from tests.rlk3.engine._oracle import assert_greedy_matches_full_forward, mixed_workload, prompt

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _run(engine, p, sampling=GREEDY):
    """Generates one request; returns (result, tokens prefilled for it)."""
    before = engine.stats().prefill_tokens
    res = engine.generate([p], sampling)[0]
    return res, engine.stats().prefill_tokens - before


def _check(model, p, res):
    assert_greedy_matches_full_forward(model, p, res.token_ids, res.logprobs)


def test_shared_prefix_prefills_only_new_tokens_plus_one_interval(tiny):
    cfg = EngineConfig(memory_bytes=48 * 2**20, checkpoint_interval=1024, max_tokens_per_step=1024)
    engine = RolloutEngine(tiny, cfg)
    prefix = prompt(2000, seed=20)
    a = prefix + prompt(50, seed=21)
    res_a, filled_a = _run(engine, a)
    assert filled_a == len(a)  # a cold cache computes everything
    assert engine.stats().prefix_cache.checkpoints >= 2  # at 1024 (interval) and 2048 (the prompt's end)
    b = prefix + prompt(60, seed=22)
    res_b, filled_b = _run(engine, b)
    new_tokens = len(b) - len(prefix)
    assert filled_b <= new_tokens + cfg.checkpoint_interval, (filled_b, new_tokens)
    assert res_b.num_cached_tokens == 1024  # blocks 0-2 match; the latest checkpoint inside them is at 1024
    assert filled_b == len(b) - 1024
    _check(tiny, a, res_a)
    _check(tiny, b, res_b)
    stats = engine.stats().prefix_cache
    assert stats.hits == 1 and stats.hit_tokens == 1024


def test_a_request_waiting_for_memory_counts_one_lookup_and_one_hit(tiny):
    """``hits`` counts admissions that resumed from a checkpoint. A request whose prefix matches but that waits for a
    slot (a running request holds the pool) looks the cache up again every step; each try counted a lookup and a
    hit, so a user reading hits / lookups to size the cache saw the steps spent waiting instead."""
    cfg = EngineConfig(memory_bytes=4 * 2**20, checkpoint_interval=16384, checkpoint_prompt_end=False,
                       checkpoint_generation_end=False)
    engine = RolloutEngine(tiny, cfg)
    p = prompt(600, seed=40)
    rid = engine.add_request(p, SamplingParams(max_tokens=1, temperature=0), turn_ends=[512])  # a checkpoint at 512
    while engine.has_unfinished():
        engine.step()
    engine.release(rid)
    pool = engine.stats().pool
    # a request that leaves fewer free pages than a KDA slot, the cached block kept
    filler = (pool.free_pages - pool.pages_per_slot - 3) * pool.block_size - 8
    big = engine.add_request(prompt(filler, seed=41), SamplingParams(max_tokens=6, temperature=0))
    while not engine.result(big).token_ids:
        engine.step()
    waiter = engine.add_request([*p, 5], SamplingParams(max_tokens=2, temperature=0))
    waited = 0
    while engine.requests[waiter].status == RequestStatus.WAITING:
        engine.step()
        waited += 1
    assert waited > 2  # it did wait for the filler's pages
    while engine.has_unfinished():
        engine.step()
    assert engine.result(waiter).num_cached_tokens == 512
    stats = engine.stats().prefix_cache
    assert (stats.lookups, stats.hits, stats.hit_tokens) == (3, 1, 512)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_hit_never_restores_a_state_from_the_wrong_boundary(tiny, backend):
    """Checkpoints at 512, 1024 and 1536 (interval 512), and tails at the prompt's end (1700) and where the generation
    ended (1703: the last sampled token is never computed). Prompts that diverge one token after / one token before
    a checkpoint must resume there / at the one before, never at a deeper checkpoint whose prefix they do not share;
    the same for the tails. Both runners (the CPU kernels', the torch path) take the checkpoints at 512 and 1536
    inside their steps (``checkpoint_in_step``): two prefill steps, where ending each chunk at its boundary takes
    four."""
    cfg = EngineConfig(memory_bytes=48 * 2**20, checkpoint_interval=512, max_tokens_per_step=1024, backend=backend)
    engine = RolloutEngine(tiny, cfg)
    base = prompt(1700, seed=30)
    first, _ = _run(engine, base)
    stats = engine.stats().prefix_cache
    assert (stats.checkpoints_taken, stats.tails_taken, stats.checkpoints) == (3, 2, 5)
    prefill_steps = engine.stats().steps - (len(first.token_ids) - 1)
    assert (engine.stats().split_checkpoints, prefill_steps) == (2, 2)
    assert engine.stats().kernels == ("torch" if backend == "torch" else "cpu")
    other = prompt(1800, seed=31)
    said = base + first.token_ids  # the conversation as an agent loop re-sends it, the reply included
    cases = [(1025, 1024), (1023, 512), (1024, 1024), (1536, 1536), (1537, 1536), (511, 0),
             (1699, 1536), (1700, 1700), (1702, 1700), (1703, 1703), (1704, 1703)]
    for diverge, resume in cases:
        p = said[:diverge] + other[diverge : diverge + 300]
        res, filled = _run(engine, p)
        assert res.num_cached_tokens == resume, (diverge, res.num_cached_tokens)
        assert filled == len(p) - resume
        _check(tiny, p, res)  # a state from another boundary would change these logprobs
    assert engine.stats().prefix_cache.tail_hits == 4
    engine.check_invariants()


def test_a_tail_hit_shares_the_full_pages_and_copies_the_partial_one(tiny):
    """The tail's partly filled MLA page is copied for the request that resumes there (it writes the rest of that
    page) while the request that made the tail goes on writing its own: both continue exactly, each equal to a full
    forward, and once both are released the cache's tail holds the only extra references."""
    cfg = EngineConfig(memory_bytes=48 * 2**20, checkpoint_interval=512, max_tokens_per_step=1024)
    engine = RolloutEngine(tiny, cfg)
    assert 701 % engine.layout.block_size  # the tail (189 tokens) ends inside a page
    base = prompt(701, seed=60)
    sampling = SamplingParams(max_tokens=24, temperature=0)
    results = {}
    owner = engine.add_request(base, sampling)
    while engine.stats().prefix_cache.tails == 0:
        results |= {r.request_id: r for r in engine.step()}
    for _ in range(3):  # the owner writes on into the tail's last page
        results |= {r.request_id: r for r in engine.step()}
    branch = base + prompt(40, seed=61)
    resumed = engine.add_request(branch, sampling)
    while engine.has_unfinished():
        results |= {r.request_id: r for r in engine.step()}
    assert results[resumed].num_cached_tokens == 701 and engine.stats().prefix_cache.tail_hits == 1
    _check(tiny, base, results[owner])
    _check(tiny, branch, results[resumed])
    engine.release([owner, resumed])
    engine.check_invariants()
    pool = engine.stats().pool
    assert pool.request_pages == 0 and pool.free_pages + pool.prefix_cache_pages == pool.total_pages


def test_lru_eviction_spill_to_cpu_and_restore(tiny):
    """A pool too small to keep two long prefixes: with spill the first comes back from CPU memory on a hit;
    without, it is recomputed. Outputs are the same either way."""
    p1, p2 = prompt(1100, seed=40), prompt(1100, seed=41)
    outs = {}
    for spill in (0, 64 * 2**20):
        cfg = EngineConfig(memory_bytes=int(1.1 * 2**20), checkpoint_interval=512, max_tokens_per_step=512,
                           spill_bytes=spill)
        engine = RolloutEngine(tiny, cfg)
        _run(engine, p1)
        _run(engine, p2)  # evicts p1's blocks: the pool holds ~45 pages
        res, filled = _run(engine, [*p1, 7, 8, 9])
        stats = engine.stats().prefix_cache
        assert stats.evictions > 0
        if spill:
            # p1's blocks and its prompt-end tail come back: only the three new tokens are computed
            assert stats.restores > 0 and res.num_cached_tokens == 1100 and filled == 3
        else:
            assert stats.spilled_blocks == 0 and res.num_cached_tokens < 1024
        _check(tiny, [*p1, 7, 8, 9], res)
        outs[spill] = res.token_ids
        engine.check_invariants()
    assert outs[0] == outs[64 * 2**20]


def test_turn_ends_and_prompt_ends_keep_checkpoints_for_the_next_turn(tiny):
    """Multi-turn by fresh requests (the agent loop re-sends the conversation): turn k+1 resumes where turn k's
    generation ended (a tail checkpoint), not at the last interval checkpoint; with generation-end tails off, at
    turn k's prompt end; with prompt-end checkpoints off too, from the start (the only checkpoints are every 4096)."""
    conv0 = prompt(700, seed=50)
    for gen_end, prompt_end, resume in [(True, True, 703), (False, True, 700), (False, False, 0)]:
        cfg = EngineConfig(memory_bytes=48 * 2**20, checkpoint_interval=4096, max_tokens_per_step=2048,
                           checkpoint_generation_end=gen_end, checkpoint_prompt_end=prompt_end)
        engine = RolloutEngine(tiny, cfg)
        res, _ = _run(engine, conv0)
        conv = conv0 + res.token_ids + prompt(900, seed=51)
        res, filled = _run(engine, conv)
        assert res.num_cached_tokens == resume and filled == len(conv) - resume, (gen_end, prompt_end)
        _check(tiny, conv, res)
    cfg = EngineConfig(memory_bytes=48 * 2**20, checkpoint_interval=4096, max_tokens_per_step=2048)
    engine = RolloutEngine(tiny, cfg)
    # an explicit mark: the agent loop re-sends a conversation whose earlier turn ended at token 1100; without the
    # mark only the prompt's end would keep a checkpoint, and a conversation branching at 1100 would start over. The
    # mark keeps one at boundary 1024 and a tail at 1100 itself
    other = prompt(1900, seed=52)
    rid = engine.add_request(other, GREEDY, turn_ends=[1100])
    while engine.has_unfinished():
        engine.step()
    engine.release(rid)
    for at, resume in [(1100, 1100), (1099, 1024)]:
        branch = other[:at] + prompt(200, seed=53)
        res, filled = _run(engine, branch)
        assert res.num_cached_tokens == resume and filled == len(branch) - resume, at
        _check(tiny, branch, res)


def test_a_generation_end_tail_never_evicts_while_a_prompt_end_tail_may():
    """Most generations are never re-sent: their tails take only free pages. A prompt's (or a marked turn end's) tail
    evicts LRU entries like a block checkpoint does. Both refuse a tail already cached."""
    import torch

    from rlk3.engine.pool import PagedPool, PoolLayout
    from rlk3.engine.prefix_cache import ROOT, PrefixCache, block_hash
    from rlk3.model import K3Config

    lay = PoolLayout.for_model(K3Config(), torch.float32)
    pps = lay.pages_per_slot
    pool = PagedPool(lay, budget=(3 * pps + 1) * lay.page_bytes, device="cpu")
    cache = PrefixCache(pool, block_tokens=512)
    owner = pool.alloc(pps + 1)  # a request's slot and one MLA page
    old = [block_hash(ROOT, [1] * 512)]
    cache.insert_block(old[0], 0, [owner[-1]], ROOT)
    assert cache.add_checkpoint(old[0], owner[:pps])  # the pool is now one slot short of full
    assert pool.num_free == pps
    assert cache.add_tail(ROOT, 0, [5, 6, 7], [owner[-1]], owner[:pps], evict=False) is not None  # free pages
    assert pool.num_free == 0
    assert cache.add_tail(ROOT, 0, [5, 6, 8], [owner[-1]], owner[:pps], evict=False) is None
    assert cache.evictions == 0 and cache.num_tails == 1
    first = block_hash(ROOT, [5, 6, 7], tail=True)
    nine = cache.add_tail(ROOT, 0, [5, 6, 9], [owner[-1]], owner[:pps], evict=True)
    assert nine is not None and cache.evictions == 1 and old[0] not in cache.device  # the LRU entry made room
    ten = cache.add_tail(ROOT, 0, [5, 6, 10], [owner[-1]], owner[:pps])
    assert ten is not None and cache.evictions == 2 and first not in cache.device  # now the oldest tail
    assert cache.add_tail(ROOT, 0, [5, 6, 9], [owner[-1]], owner[:pps]) is None  # cached already
    assert cache.tails == {ROOT: {(3, nine), (3, ten)}}  # the evicted tail left the index with its entry
    cache.clear()
    pool.decref(owner)
    assert pool.num_free == pool.num_pages and not cache.tails


def test_a_restore_that_finds_no_pages_keeps_the_spill_store_within_its_bytes():
    """A spilled entry leaves the store while pages are sought for it; the search evicts device entries, which spill
    into the room it left. When no pages are found it goes back, and the store stays within ``spill_bytes`` (it went
    back unchecked, over the limit by the entries spilled meanwhile)."""
    import torch

    from rlk3.engine.pool import PagedPool, PoolLayout
    from rlk3.engine.prefix_cache import PrefixCache
    from rlk3.model import K3Config

    lay = PoolLayout.for_model(K3Config(), torch.float32, block_size=16, prefix_block_tokens=16)
    pps = lay.pages_per_slot
    pool = PagedPool(lay, budget=(3 * pps + 8) * lay.page_bytes, device="cpu")
    limit = (1 + pps) * lay.page_bytes  # exactly one block with its checkpoint
    cache = PrefixCache(pool, 16, spill_bytes=limit)

    def block(key):
        page = pool.alloc(1)
        cache.insert_block(key, 1, page, ROOT)
        pool.decref(page)

    block(b"E")
    slot = pool.alloc(pps)
    assert cache.add_checkpoint(b"E", slot)
    pool.decref(slot)
    assert cache.evict_one() and cache.spilled_bytes == limit  # E spills: its block and its checkpoint
    block(b"X")
    block(b"Y")
    held = pool.alloc(pool.num_free)  # every other page held by requests
    assert not cache.restore([cache.spilled[b"E"]])  # X and Y evicted (and spilled) for nothing
    assert cache.spilled_bytes <= limit and list(cache.spilled) == [b"E"]  # the entry asked for is the one kept
    cache.check()
    pool.decref(held)
    cache.clear()
    assert pool.num_free == pool.num_pages


def _cache(drop_superseded: bool = True, branch: int | None = None, branch_first: bool = True):
    """A cache over a pool that holds exactly one request (a KDA slot and one MLA page per block, plus one for a
    branch) and two checkpoints: blocks 0, 1, 2 of one chain with a checkpoint after block 0 and one after block 2;
    with ``branch`` a second child block of block ``branch`` (another conversation leaving the chain there), inserted
    before the checkpoints or after them. Returns (cache, pool, the chain's keys, the request's pages)."""
    import torch

    from rlk3.engine.pool import PagedPool, PoolLayout
    from rlk3.engine.prefix_cache import PrefixCache
    from rlk3.model import K3Config

    lay = PoolLayout.for_model(K3Config(), torch.float32)
    pps, blocks = lay.pages_per_slot, 3
    pool = PagedPool(lay, budget=(3 * pps + blocks + 1) * lay.page_bytes, device="cpu")
    cache = PrefixCache(pool, block_tokens=512, drop_superseded=drop_superseded)
    owner = pool.alloc(pps + blocks + 1)
    keys, parent = [], ROOT
    for d in range(blocks):
        key = block_hash(parent, [d + 1] * 512)
        cache.insert_block(key, d, [owner[pps + d]], parent)
        keys.append(key)
        parent = key
    cache.touch(keys)

    def fork():
        other = block_hash(keys[branch], [99] * 512)
        cache.insert_block(other, branch + 1, [owner[-1]], keys[branch])

    if branch is not None and branch_first:
        fork()
    assert cache.add_checkpoint(keys[0], owner[:pps]) and cache.add_checkpoint(keys[-1], owner[:pps])
    if branch is not None and not branch_first:
        fork()
    assert pool.num_free == 0
    return cache, pool, keys, owner


@pytest.mark.parametrize("drop_superseded", [True, False], ids=["superseded-first", "lru"])
def test_a_superseded_checkpoint_goes_before_any_block(drop_superseded):
    """An agent loop's conversation: the chain below the first checkpoint runs to a deeper one without branching,
    so every cached continuation reaches the deeper state. Under memory pressure the first is dropped alone: every
    block stays, the chain still matches and resumes at its end, and only a request leaving the chain inside it
    loses that resume point. Plain LRU instead evicts the chain's leaf (touched first), the latest checkpoint with
    it."""
    cache, pool, keys, owner = _cache(drop_superseded)
    assert list(cache.superseded) == [keys[0]]  # marked when the deeper checkpoint arrived
    assert cache.match(keys).blocks == 3
    assert cache.evict_one()
    assert pool.num_free == pool.layout.pages_per_slot
    if drop_superseded:
        assert (cache.checkpoints_dropped, cache.evictions) == (1, 0)
        assert all(k in cache.device for k in keys)  # every block and its MLA page stays
        assert cache.match(keys).blocks == 3  # the next turn still resumes at the end ...
        inside = cache.match(keys[:2])
        assert (inside.blocks, inside.matched) == (0, 2)  # ... and a branch inside the chain finds no state
        # nothing is superseded now: the LRU entry that frees pages (the leaf, with its checkpoint) leaves whole
        assert cache.evict_one() and (cache.checkpoints_dropped, cache.evictions) == (1, 1)
        assert keys[-1] not in cache.device
    else:
        assert (cache.checkpoints_dropped, cache.evictions) == (0, 1)
        assert keys[-1] not in cache.device  # the leaf went first, and the latest checkpoint with it
        assert cache.match(keys).blocks == 1
    cache.check()
    cache.clear()
    pool.decref(owner)
    assert pool.num_free == pool.num_pages and not cache.superseded and not cache.children


@pytest.mark.parametrize("branch_first", [True, False], ids=["branch-first", "branch-later"])
@pytest.mark.parametrize("branch", [0, 1])
def test_a_checkpoint_before_a_branch_is_not_superseded(branch, branch_first):
    """A second conversation leaving the chain right after the first checkpoint (block 0's child) or one block later
    (block 1's): a request branching there resumes from that checkpoint, which the deeper one does not replace. So
    it stays, and memory comes from an LRU entry. A branch that appears after the deeper checkpoint marked it
    superseded undoes the mark (checked again when used)."""
    cache, pool, keys, owner = _cache(branch=branch, branch_first=branch_first)
    assert list(cache.superseded) == ([] if branch_first else [keys[0]])
    assert cache.evict_one()
    assert (cache.checkpoints_dropped, cache.evictions) == (0, 1) and not cache.superseded
    assert cache.device[keys[0]].checkpoint is not None and keys[-1] not in cache.device
    cache.check()
    cache.clear()
    pool.decref(owner)


def test_a_protected_superseded_checkpoint_stays():
    """A superseded checkpoint in ``protect`` (an admission's or a registration's chain) is not dropped: an LRU
    entry goes instead."""
    cache, pool, keys, owner = _cache()
    assert cache.evict_one(protect={keys[0]})
    assert (cache.checkpoints_dropped, cache.evictions) == (0, 1)
    assert cache.device[keys[0]].checkpoint is not None and list(cache.superseded) == [keys[0]]
    cache.clear()
    pool.decref(owner)


@pytest.mark.parametrize("system,steps,share", [(0, 1, 3), (320, 2, 5)],
                         ids=["conversations", "shared-system-prompt"])
def test_agent_conversations_under_memory_pressure_keep_their_hits(tiny, system, steps, share):
    """Six conversations advance a turn at a time, each turn re-sending the conversation with the reply plus new
    tokens (an agentic rollout batch), in a pool of 1/``share`` of what an unbounded run's cache holds; in the second
    case every conversation opens with the same system prompt and a second RL step starts fresh conversations, which
    resume from the system prompt's checkpoint (a branch point: never superseded). (With these pools the measured
    ratios of plain LRU's prefill tokens to these are 1.46 and 1.32.) Dropping superseded checkpoints
    keeps nearly every hit an unbounded pool gets; plain LRU over whole entries recomputes more. Every variant
    generates what an unbounded pool does, and what a full forward gives."""
    base = dict(prefix_block_tokens=64, checkpoint_interval=128, max_tokens_per_step=1024)
    opening = prompt(system, seed=99)

    def rollout(cfg):
        engine = RolloutEngine(tiny, cfg)
        replies = []
        for step in range(steps):
            convs = [list(opening) for _ in range(6)]
            for turn in range(4):
                prompts = [c + prompt(160, seed=1000 * step + 100 * i + turn) for i, c in enumerate(convs)]
                results = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
                engine.check_invariants()
                convs = [p + r.token_ids for p, r in zip(prompts, results)]
                replies.append([r.token_ids for r in results])
        _check(tiny, prompts[0], results[0])
        return engine.stats(), replies, engine

    unbounded, want, engine = rollout(EngineConfig(memory_bytes=64 * 2**20, **base))
    budget = unbounded.pool.prefix_cache_pages * engine.layout.page_bytes // share
    first, got, _ = rollout(EngineConfig(memory_bytes=budget, **base))
    lru, got_lru, _ = rollout(EngineConfig(memory_bytes=budget, drop_superseded_checkpoints=False, **base))
    assert got == want and got_lru == want
    assert first.prefix_cache.checkpoints_dropped > 0 and lru.prefix_cache.checkpoints_dropped == 0
    assert first.prefill_tokens <= 1.1 * unbounded.prefill_tokens, (first.prefill_tokens, unbounded.prefill_tokens)
    assert lru.prefill_tokens >= 1.2 * first.prefill_tokens, (lru.prefill_tokens, first.prefill_tokens)


def _conversation(engine, turns: int = 4) -> list:
    """An agent loop re-sending a growing conversation: each turn's chunk crosses the 64-token boundaries that want
    checkpoints (interval 64 below) and ends at a tail checkpoint."""
    out, conv = [], []
    for turn in range(turns):
        conv = conv + prompt(150 + 7 * turn, seed=turn)
        res = engine.generate([conv], SamplingParams(max_tokens=5, temperature=0))[0]
        out.append(res)
        conv = conv + res.token_ids
    return out


@pytest.mark.parametrize("backend,padded", [("torch", False), ("torch", True), ("auto", False)],
                         ids=["torch", "torch-padded", "cpu-kernels"])
@pytest.mark.parametrize("workload", [mixed_workload, _conversation], ids=["mixed", "conversation"])
def test_checkpoints_taken_inside_a_step_change_no_result(tiny, backend, padded, workload):
    """``checkpoint_in_step`` (the torch runner's chunked KDA read at the boundary, plain and in padded steps — the
    prefill graphs' pieces run eagerly —, and the CPU kernels' runner's two passes): the same tokens and log-probs
    (fp32, within 1e-6) as ending each chunk at its checkpoint boundary, the same tokens prefilled, checkpoints taken
    and cache hits, in fewer steps; the pool's bookkeeping (the reserved checkpoint slots included) intact after every
    step."""
    cfg = dict(memory_bytes=16 * 2**20, max_tokens_per_step=256, prefill_chunk=64, prefix_block_tokens=64,
               checkpoint_interval=64, backend=backend, prefill_graphs=padded)
    runs = []
    for in_step in (False, True):
        engine = RolloutEngine(tiny, EngineConfig(**cfg, checkpoint_in_step=in_step))
        step = engine.step

        def checked(step=step, engine=engine):
            out = step()
            engine.check_invariants()
            return out

        engine.step = checked
        runs.append((workload(engine), engine.stats()))
    (want, before), (got, after) = runs
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-6
    assert before.split_checkpoints == 0 and after.split_checkpoints >= 6
    assert after.steps <= before.steps - after.split_checkpoints // 2
    assert (after.prefill_tokens, after.prefix_cache.checkpoints_taken, after.prefix_cache.hit_tokens) == (
        before.prefill_tokens, before.prefix_cache.checkpoints_taken, before.prefix_cache.hit_tokens)
    assert (after.padded_prefill_steps > 0) == padded
    assert after.kernels == ("cpu" if backend == "auto" else "torch")


@pytest.mark.parametrize("backend,padded", [("torch", False), ("torch", True), ("auto", False)],
                         ids=["torch", "torch-padded", "cpu-kernels"])
def test_a_checkpoint_inside_a_step_that_starts_off_the_chunk_grid_resumes_exactly(tiny, backend, padded):
    """A turn resumed after a tail (position 40: a 37-token prompt, then 3 generated) crosses the boundaries at 64 and
    128; the first is taken inside the step, 25 rows in, so the chunked kernel's grid (chunks of 64 from the step's
    first row) misses it unless identity rows align it (runner.KdaSplit). A later prompt sharing 100 tokens of that
    turn resumes from that checkpoint and must generate what a cache-less engine does (tokens, log-probs within
    1e-5: the state restored is the one at 64, not at 39 or 103)."""
    assert tiny.config.kda_chunk_size == 64
    cfg = dict(memory_bytes=16 * 2**20, max_tokens_per_step=256, prefill_chunk=256, prefix_block_tokens=64,
               checkpoint_interval=64, backend=backend, prefill_graphs=padded)
    engine = RolloutEngine(tiny, EngineConfig(**cfg))
    first = engine.generate([prompt(37, seed=50)], SamplingParams(max_tokens=3, temperature=0))[0]
    turn = prompt(37, seed=50) + first.token_ids[:-1] + prompt(150, seed=51)
    before = engine.stats()
    second = engine.generate([turn], SamplingParams(max_tokens=2, temperature=0))[0]
    after = engine.stats()
    assert second.num_cached_tokens == 39  # the tail: the last sampled token is never computed
    assert after.split_checkpoints - before.split_checkpoints == 1
    assert (after.padded_prefill_steps > before.padded_prefill_steps) == padded
    probe = turn[:100] + prompt(20, seed=52)
    got = engine.generate([probe], SamplingParams(max_tokens=6, temperature=0))[0]
    assert got.num_cached_tokens == 64
    fresh = RolloutEngine(tiny, EngineConfig(**cfg, enable_prefix_cache=False))
    want = fresh.generate([probe], SamplingParams(max_tokens=6, temperature=0))[0]
    assert got.token_ids == want.token_ids
    assert max(abs(x - y) for x, y in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-5
    engine.check_invariants()


def test_a_checkpoint_without_room_ends_the_chunk_at_its_boundary(tiny, monkeypatch):
    """When no slot can be reserved for a checkpoint inside a chunk (the pool full even after evicting), the chunk ends
    at the boundary, as with ``checkpoint_in_step`` off: the same steps and results, nothing reserved or leaked."""
    cfg = dict(memory_bytes=16 * 2**20, max_tokens_per_step=256, prefill_chunk=64, prefix_block_tokens=64,
               checkpoint_interval=64, backend="torch")
    off = RolloutEngine(tiny, EngineConfig(**cfg, checkpoint_in_step=False))
    full = RolloutEngine(tiny, EngineConfig(**cfg))
    monkeypatch.setattr(full.prefix, "reserve", lambda n: None)
    want, got = _conversation(off), _conversation(full)
    assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in want]
    assert full.stats().split_checkpoints == 0 and full.stats().steps == off.stats().steps
    full.check_invariants()


def test_a_step_that_raises_leaks_no_reserved_checkpoint_slot(tiny, monkeypatch):
    """A step whose forward raises after the scheduler reserved a checkpoint slot inside its chunk: the request is
    recomputed (its cache, the slot with it, given back), or an abort gives everything back, and the request then
    generates what an engine that never failed generates."""
    cfg = EngineConfig(memory_bytes=16 * 2**20, max_tokens_per_step=256, prefix_block_tokens=64,
                       checkpoint_interval=64, backend="torch")
    engine = RolloutEngine(tiny, cfg)
    rid = engine.add_request(prompt(200, seed=5), GREEDY)
    forward = engine._forward

    def fails(batch):
        monkeypatch.setattr(engine, "_forward", forward)
        assert batch.kda_split is not None  # the failing step is one that reserved a slot
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_forward", fails)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    req = engine._get(rid)
    assert req.split_slot is None and req.status == RequestStatus.WAITING and engine.stats().preemptions == 1
    engine.check_invariants()  # the reserved slot went back with the rest of the request's cache
    other = engine.add_request(prompt(200, seed=6), GREEDY)  # the same failure, then an abort: its pages all go back
    monkeypatch.setattr(engine, "_forward", fails)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.abort(other)
    engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    want = RolloutEngine(tiny, cfg).generate([prompt(200, seed=5)], GREEDY)[0]
    assert (engine.result(rid).token_ids, engine.result(rid).logprobs) == (want.token_ids, want.logprobs)


def test_prefill_seconds_count_the_admission_and_its_prefix_lookup(tiny, monkeypatch):
    """A prefix hit's lookup and restore happen in the scheduler's admission; ``prefill_seconds`` (what the
    multi-turn benchmark compares) includes it, so a cached side cannot look faster by moving work there."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20))
    schedule, slept = engine.scheduler.schedule, []

    def slow_admission():
        if engine.scheduler.waiting:
            slept.append(1)
            time.sleep(0.2)
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", slow_admission)
    before = engine.stats()
    engine.generate([prompt(30, seed=1)], SamplingParams(max_tokens=2, temperature=0))
    after = engine.stats()
    assert slept == [1] and after.prefill_seconds - before.prefill_seconds >= 0.2


def test_block_keys_read_the_packed_prompt_and_equal_the_keys_of_its_list(tiny):
    """``add_request`` packs the prompt into int64s once (its range check reads them) and the admission's block hashes
    read slices of that instead of packing each block again. The keys must be exactly those of the token list (the
    blocks registered later, after generated tokens or ``extend``, hash the list), and the packed copy is dropped once
    every full block in it is hashed."""
    B = 512
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=48 * 2**20, prefix_block_tokens=B))
    p = prompt(5 * B + 100, seed=30)
    req = engine.requests[engine.add_request(p, GREEDY)]
    assert req.packed is not None and list(req.packed) == p

    def chain(n):
        keys = []
        for b in range(n):
            keys.append(block_hash(keys[-1] if b else ROOT, p[b * B : (b + 1) * B]))
        return keys

    assert engine.scheduler.keys(req, 3) == chain(3)
    assert req.packed is not None  # blocks 3 and 4 are still to hash from it
    assert engine.scheduler.keys(req, 5) == chain(5)
    assert req.packed is None
    off = RolloutEngine(tiny, EngineConfig(memory_bytes=48 * 2**20, enable_prefix_cache=False))
    assert off.requests[off.add_request(p, GREEDY)].packed is None  # nothing will hash it
