"""Continuous batching with chunked prefill and a per-step token budget, over the one paged pool.

Every step the scheduler hands out at most ``max_tokens_per_step`` tokens to at most ``max_num_seqs`` sequences:

1. **decode**: every running request with one pending token gets it, oldest admission first;
2. **prefill, fair share**: running requests with a longer pending input, then waiting requests (FIFO, admitted
   while memory allows), each get at most ``prefill_chunk`` tokens;
3. **prefill, leftover**: what budget remains goes to those same prefills in order.

So a 100K-token prompt takes at most its fair share while short requests are waiting, and uses the whole budget
when they are not (budget-based admission: the short ones' first tokens arrive within a bounded number of steps).
A prefill chunk also ends at a block boundary that wants a KDA checkpoint, where the state is copied (with
``checkpoint_in_step`` at the second such boundary: the first one's checkpoint is taken inside the step, ``split``),
and at a turn end the agent loop marked (a tail checkpoint there; prefix_cache.py).

Shared prefill (``share_prefill``): a waiting request whose tokens equal those of a request being prefilled (a GRPO
group's samples of one prompt) is not admitted; it follows that leader, whose prefill stops once at its prompt's last
token. There each follower takes a copy of the leader's KDA slot, a reference to its full MLA pages and a copy of
the partial one, and computes the last token itself (its own logits, its own sample). A follower whose leader is
paused, aborted or overtaken is admitted as usual.

Memory: a request holds a KDA slot (``pages_per_slot`` pages) from admission and MLA pages as its tokens grow.
When a page is needed and none is free the scheduler reclaims, cheapest first: (1) unused prefix-cache entries
(LRU), (2) caches of finished requests kept for ``extend``, (3) younger running requests not yet scheduled in this
step are preempted (their cache is dropped; they are recomputed later, largely from the prefix cache), (4) paused
requests' caches. Waiting requests never preempt running ones; they wait. Nothing is ever allocated past the pool.
"""

from __future__ import annotations

import bisect
import itertools
import math

from rlk3.engine.config import EngineConfig
from rlk3.engine.pool import PagedPool
from rlk3.engine.prefix_cache import ROOT, PrefixCache, block_hash
from rlk3.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagedPool, prefix: PrefixCache | None, requests: dict):
        self.config = config
        self.pool = pool
        self.prefix = prefix
        self.requests: dict[str, Request] = requests  # every request the engine knows, any status
        self.waiting: list[Request] = []  # by arrival
        self.running: list[Request] = []  # by priority (admission order)
        self._admissions = itertools.count()
        self._finish_order = itertools.count()
        self.leaders: dict[tuple[int, ...], Request] = {}  # shared prefill: by prompt, requests others may follow
        self.version = 0  # the engine's weight version (blocks computed under older weights are not cached)
        self.split_ok = False  # checkpoints may be taken inside a chunk (set by the engine: checkpoint_in_step)
        # counters for stats()
        self.preemptions = self.dropped_caches = self.shared_prefill_tokens = 0

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    @property
    def block_tokens(self) -> int:
        return self.config.prefix_block_tokens

    # -- queues

    def enqueue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def add_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.priority)

    def remove(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    # -- sizes

    def pages_for(self, tokens: int) -> int:
        """Pages a request of ``tokens`` tokens needs in all: its MLA blocks and its KDA slot."""
        mla = math.ceil(tokens / self.block_size) if self.pool.layout.mla_layers else 0
        return mla + self.pool.layout.pages_per_slot

    # -- cache ownership

    def free_cache(self, req: Request) -> None:
        """Returns a request's pages to the pool (shared prefix pages just lose a reference)."""
        owned = list(req.pages) + (req.slot or []) + (req.split_slot or [])  # (a slot reserved for a failed step)
        req.pages, req.slot, req.split_at, req.split_slot = [], None, None, None
        req.num_computed = req.num_registered = 0
        self.pool.decref(owned)

    def preempt(self, req: Request, count: bool = True) -> None:
        """A running request loses its cache and waits to be recomputed. ``count``: whether ``stats()`` counts it
        (not for ``release_memory``, which drops every cache by design: the counters would then say memory pressure
        where there was none)."""
        self.running.remove(req)
        self.free_cache(req)
        self.enqueue(req)
        self.preemptions += count

    def drop_cache(self, req: Request, count: bool = True) -> None:
        """A paused or finished request loses its cache; it is recomputed when it runs again."""
        self.free_cache(req)
        self.dropped_caches += count

    def mark_finished(self, req: Request) -> None:
        req.finish_seq = next(self._finish_order)

    def _reclaim(self, need: int, requester: Request | None, planned: dict, allow_preempt: bool,
                 allow_paused: bool, protect: set[bytes] = frozenset()) -> bool:
        """Frees pages until ``need`` are free (the module docstring's order); False if that is impossible now."""
        while self.pool.num_free < need:
            if self.prefix is not None and self.prefix.evict_one(protect):
                continue
            finished = [r for r in self.requests.values() if r.status == RequestStatus.FINISHED and r.has_cache]
            if finished:
                self.drop_cache(min(finished, key=lambda r: r.finish_seq))
                continue
            if allow_preempt and requester is not None:
                victims = [r for r in self.running if r is not requester and r not in planned
                           and r.priority > requester.priority]
                if victims:
                    self.preempt(victims[-1])
                    continue
            if allow_paused:
                paused = [r for r in self.requests.values() if r.status == RequestStatus.PAUSED and r.has_cache]
                if paused:
                    self.drop_cache(min(paused, key=lambda r: r.arrival))
                    continue
            return False
        return True

    def _grow(self, req: Request, tokens: int, planned: dict) -> int:
        """Gives ``req`` MLA pages for up to ``req.num_computed + tokens`` tokens, reclaiming as needed. Returns how
        many of the ``tokens`` it can compute now (fewer when memory is short; 0 when none)."""
        if not self.pool.layout.mla_layers:
            return tokens
        bs = self.block_size
        want = math.ceil((req.num_computed + tokens) / bs) - len(req.pages)
        if want > 0:
            self._reclaim(want, req, planned, allow_preempt=True, allow_paused=True)
            got = self.pool.alloc(min(want, self.pool.num_free)) or []
            req.pages += got
        return max(0, min(tokens, len(req.pages) * bs - req.num_computed))

    # -- admission (with the prefix cache)

    def keys(self, req: Request, blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``blocks`` blocks (computed once, tokens are append-only)."""
        B = self.block_tokens
        packed = memoryview(req.packed) if req.packed is not None else None
        while len(req.keys) < blocks:
            b = len(req.keys)
            ids = packed if packed is not None and (b + 1) * B <= len(packed) else req.tokens
            req.keys.append(block_hash(req.keys[-1] if b else ROOT, ids[b * B : (b + 1) * B]))
        if packed is not None and len(req.keys) >= len(packed) // B:
            req.packed = None  # every full block it holds is hashed
        return req.keys[:blocks]

    def admit(self, req: Request, planned: dict) -> bool:
        """Gives a waiting request a KDA slot (restored from a prefix checkpoint when one matches)."""
        entries, protect, tail = [], set(), None
        if self.prefix is not None:
            # leave at least one token to compute: its logits give the next token
            B = self.block_tokens
            keys = self.keys(req, (len(req.tokens) - 1) // B)
            match = self.prefix.match(keys)
            protect = set(keys[: match.matched])
            found = self.prefix.match_tail(keys[: match.matched], req.tokens, match.blocks * B, len(req.tokens) - 1)
            if found is not None:  # a tail past the last full-block checkpoint: its chain, then the tail
                protect.add(found[-1].key)
                if self.prefix.restore(found, protect):
                    *entries, tail = found
            if tail is None and match.blocks and self.prefix.restore(match.entries, protect):
                entries = match.entries
        shared = [p for e in entries for p in e.pages]
        need = self.pool.layout.pages_per_slot
        partial = False
        if tail is not None and tail.pages:  # the tail's full pages are shared; its partly filled last page is copied
            partial = tail.tail % self.block_size != 0
            shared += tail.pages[:-1] if partial else tail.pages
            need += partial
        self.pool.incref(shared)  # ours now, whatever the cache evicts below
        ok = self._reclaim(need, None, planned, allow_preempt=False, allow_paused=not self.running, protect=protect)
        new = self.pool.alloc(need) if ok else None
        if new is None:
            self.pool.decref(shared)
            return False
        slot, own = new[: self.pool.layout.pages_per_slot], new[self.pool.layout.pages_per_slot :]
        if own:
            self.pool.copy(tail.pages[-1:], own)
        if tail is not None:
            self.pool.copy(tail.checkpoint, slot)
        elif entries:
            self.pool.copy(entries[-1].checkpoint, slot)
        else:
            self.pool.zero(slot)
        req.slot, req.pages = slot, shared + own
        req.num_computed = len(entries) * self.block_tokens + (tail.tail if tail is not None else 0)
        req.num_registered = len(entries)
        # prompt tokens of this turn (GenerationResult): a request preempted mid-turn may resume from a checkpoint
        # inside its own generated tokens, which were no prompt of it
        req.num_cached_tokens = min(req.num_computed, req.turn_start)
        if self.prefix is not None:
            # counted once the admission succeeds: a request waiting for memory looks the cache up again every step,
            # and counting each try made hits / lookups a count of steps spent waiting, not of admissions
            self.prefix.lookups += 1
            self.prefix.hits += bool(entries or tail is not None)
            self.prefix.tail_hits += tail is not None
            self.prefix.hit_tokens += req.num_computed
        req.cache_version = self.version
        req.priority = next(self._admissions)
        self.waiting.remove(req)
        self.add_running(req)
        return True

    # -- checkpoints and block registration

    def wants_checkpoint(self, req: Request, boundary: int) -> bool:
        return (boundary * self.block_tokens) % self.config.checkpoint_interval == 0 or boundary in req.marks

    def _wanted(self, req: Request) -> tuple[int, int]:
        """The next two positions past ``num_computed`` that want a checkpoint (a boundary on the interval or a
        marked one, or a tail mark off the boundaries)."""
        pos, B = req.num_computed, self.block_tokens
        interval = self.config.checkpoint_interval
        nxt = (pos // interval + 1) * interval
        wanted = {nxt, nxt + interval, *(m * B for m in req.marks if m * B > pos),
                  *(t for t in req.tail_marks if t > pos)}
        first, second = sorted(wanted)[:2]
        return first, second

    def _cut(self, req: Request) -> int:
        """Tokens from ``num_computed`` to the next boundary that wants a KDA checkpoint, or to the fork point of a
        leader with followers (a chunk ends there). With ``split_ok`` a chunk runs on past a block boundary's
        checkpoint to the next one (``split``: the checkpoint is taken inside the step); a tail checkpoint, at a
        request's own turn end, still ends the chunk."""
        cut = req.pending
        if req.followers and req.num_computed < req.fork_at:
            cut = req.fork_at - req.num_computed
        if self.prefix is None or req.cache_version != self.version:
            return cut
        first, second = self._wanted(req)
        stop = second if self.split_ok and first % self.block_tokens == 0 else first
        return min(cut, stop - req.num_computed)

    def split(self, plan: dict[Request, int]) -> None:
        """Marks each planned chunk that crosses a block boundary wanting a checkpoint (``_cut`` let it): the step
        copies the KDA state there into a slot reserved here (``Request.split_at`` / ``split_slot``), which
        ``register`` hands to the prefix cache. With no room for the slot the chunk ends at the boundary instead."""
        for req, n in plan.items():
            if not self.split_ok or n < 2 or self.prefix is None or req.cache_version != self.version:
                continue
            first, _ = self._wanted(req)
            if first % self.block_tokens or first >= req.num_computed + n:
                continue
            slot = self.prefix.reserve(self.pool.layout.pages_per_slot)
            if slot is None:
                plan[req] = first - req.num_computed
                continue
            req.split_at, req.split_slot = first, slot

    def register(self, req: Request) -> None:
        """After a step: hand newly completed blocks to the prefix cache, and a checkpoint at a wanted boundary."""
        split, req.split_at, slot, req.split_slot = req.split_at, None, req.split_slot, None
        if self.prefix is None or req.cache_version != self.version or req.slot is None:
            if slot is not None:
                self.pool.decref(slot)
            return
        B = self.block_tokens
        full = req.num_computed // B
        if full > req.num_registered:
            keys = self.keys(req, full)
            ppb = self.prefix.pages_per_block
            for b in range(req.num_registered, full):
                self.prefix.insert_block(keys[b], b, req.pages[b * ppb : (b + 1) * ppb], keys[b - 1] if b else ROOT)
            req.num_registered = full
            self.prefix.touch(keys)
        if slot is not None and not self.prefix.adopt_checkpoint(self.keys(req, split // B)[-1], slot):
            self.pool.decref(slot)
        if full and req.num_computed % B == 0 and self.wants_checkpoint(req, full):
            keys = self.keys(req, full)
            self.prefix.add_checkpoint(keys[-1], req.slot, protect=set(keys))
        if self.config.checkpoint_prompt_end and (req.num_computed == req.turn_start
                                                  or req.num_computed in req.tail_marks):
            self.save_tail(req)

    def save_tail(self, req: Request, evict: bool = True) -> None:
        """A tail checkpoint (prefix_cache.py) where the request's computed tokens end, when that is off a block
        boundary: the end of a prompt or extension (``register``), of a finished generation (the engine, with
        ``evict=False``: most generations are never re-sent, so theirs only take pages that are free)."""
        if self.prefix is None or req.cache_version != self.version or req.slot is None:
            return
        B, n = self.block_tokens, req.num_computed
        depth, t = divmod(n, B)
        if t == 0 or n > len(req.tokens) or depth > req.num_registered:
            return
        keys = self.keys(req, depth)
        pages = []
        if self.pool.layout.mla_layers:
            first = depth * self.prefix.pages_per_block
            pages = req.pages[first : first + math.ceil(t / self.block_size)]
        key = self.prefix.add_tail(keys[-1] if depth else ROOT, depth, req.tokens[depth * B : n], pages, req.slot,
                                   protect=set(keys), evict=evict)
        if key is not None:
            self.prefix.touch([*keys, key])

    # -- shared prefill

    def _can_lead(self, lead: Request) -> bool:
        """The leader is still known, in line or prefilling under the current weights, and short of its fork point
        (it computes nothing past it while it has followers)."""
        if self.requests.get(lead.request_id) is not lead or lead.num_computed >= lead.fork_at:
            return False
        return lead.status == RequestStatus.WAITING or (
            lead.status == RequestStatus.RUNNING and lead.cache_version == self.version)

    def _leads(self, lead: Request, req: Request) -> bool:
        """``lead`` can still hand ``req`` its cache: it can lead, and its fork point is ``req``'s last token."""
        return lead is not req and lead.fork_at == len(req.tokens) - 1 and self._can_lead(lead)

    def _follow(self, req: Request) -> bool:
        """Whether a waiting request waits for a leader (found now or earlier) instead of being admitted."""
        if req.leader is not None:
            if self._leads(req.leader, req):
                return True
            self._detach(req)
        if not self.leaders or req.num_computed or len(req.tokens) < 2:
            return False
        lead = self.leaders.get(tuple(req.tokens))
        if lead is None or not self._leads(lead, req):
            return False
        req.leader = lead
        lead.followers.append(req)
        return True

    def _lead(self, req: Request) -> None:
        """An admitted request with a prompt to prefill: later arrivals with the same tokens may follow it."""
        if req.fork_at and req.fork_at != len(req.tokens) - 1:
            # admitted again with more tokens (its cache was dropped after it sampled, or it was extended): it no
            # longer leads its old prompt, whose followers would otherwise fork at the new, longer position
            self._unlead(req)
        if self.config.share_prefill and req.pending >= 2:
            req.fork_at = len(req.tokens) - 1
            self.leaders[tuple(req.tokens)] = req

    def _unlead(self, req: Request) -> None:
        key = tuple(req.tokens[: req.fork_at + 1])  # tokens only grow: the prompt it was registered under
        if self.leaders.get(key) is req:
            del self.leaders[key]
        self._release_followers(req)
        req.fork_at = 0

    @staticmethod
    def _release_followers(lead: Request) -> None:
        """Those still waiting for ``lead`` are admitted as usual (or follow another leader)."""
        for f in lead.followers:
            if f.leader is lead:
                f.leader = None
        lead.followers = []

    @staticmethod
    def _detach(req: Request) -> None:
        """A follower stops following: off its leader's list too, or the leader would still stop at the fork point
        for nobody (and, resumed there, be planned for no tokens)."""
        lead, req.leader = req.leader, None
        if lead is not None and req in lead.followers:
            lead.followers.remove(req)

    def _fork_followers(self, planned: dict) -> None:
        """Leaders at their fork point hand their followers a copy of their cache; every other leader that can no
        longer be followed is forgotten (its followers are admitted as usual)."""
        for key, lead in list(self.leaders.items()):
            at_fork = (lead.status == RequestStatus.RUNNING and lead.num_computed == lead.fork_at
                       and lead.cache_version == self.version)
            if at_fork:
                for f in lead.followers:
                    if (f.leader is lead and f.status == RequestStatus.WAITING
                            and lead.fork_at == len(f.tokens) - 1):
                        f.leader = None
                        self._fork(lead, f, planned)
            if at_fork or not self._can_lead(lead):
                self._release_followers(lead)
                del self.leaders[key]

    def _fork(self, lead: Request, req: Request, planned: dict) -> None:
        """``req`` continues from ``lead``'s cache at ``lead.fork_at``; it stays waiting (to be admitted as usual)
        when the pool has no room without preempting."""
        at, pps = lead.fork_at, self.pool.layout.pages_per_slot
        full, part = divmod(at, self.block_size) if self.pool.layout.mla_layers else (0, 0)
        need = pps + (1 if part else 0)
        if not self._reclaim(need, None, planned, allow_preempt=False, allow_paused=not self.running):
            return
        new = self.pool.alloc(need)
        if new is None:
            return
        slot, own = new[:pps], new[pps:]
        self.pool.copy(lead.slot, slot)
        if own:  # the page the leader goes on writing: this request's copy of its first entries
            self.pool.copy([lead.pages[full]], own)
        shared = lead.pages[:full]
        self.pool.incref(shared)
        req.slot, req.pages = slot, shared + own
        req.num_computed = req.num_cached_tokens = at
        req.num_registered = lead.num_registered  # those blocks are in the prefix cache already (the same pages)
        req.cache_version = self.version
        req.priority = next(self._admissions)
        self.shared_prefill_tokens += at
        self.waiting.remove(req)
        self.add_running(req)

    # -- the step plan

    def schedule(self) -> list[tuple[Request, int]]:
        """The sequences of the next step and how many of their pending tokens each computes (module docstring)."""
        cfg = self.config
        budget = cfg.max_tokens_per_step
        plan: dict[Request, int] = {}
        for req in self.running:  # a slot reserved for a step that raised before ``register``
            if req.split_slot is not None:
                self.pool.decref(req.split_slot)
                req.split_at = req.split_slot = None
        if self.leaders:
            self._fork_followers(plan)

        # 1. decode: one token each, oldest first (a sequence with room in its last page needs no _grow: this loop
        # runs for every sequence at every step)
        page_tokens = self.block_size if self.pool.layout.mla_layers else None
        for req in list(self.running):
            if budget == 0 or len(plan) >= cfg.max_num_seqs:
                break
            if req.status != RequestStatus.RUNNING or len(req.tokens) - req.num_computed != 1:
                continue
            if page_tokens is None or req.num_computed < len(req.pages) * page_tokens or self._grow(req, 1, plan):
                plan[req] = 1
                budget -= 1

        # 2. prefill, fair share: running prefills, then admissions
        prefills = [r for r in self.running if len(r.tokens) - r.num_computed > 1 and r not in plan]
        for req in prefills:
            if budget == 0 or len(plan) >= cfg.max_num_seqs:
                break
            if req.status != RequestStatus.RUNNING:  # preempted by an older request in this loop
                continue
            n = self._grow(req, min(req.pending, cfg.prefill_chunk, budget, self._cut(req)), plan)
            if n:
                plan[req] = n
                budget -= n
        for req in list(self.waiting):
            if self._follow(req):
                continue  # computes nothing until its leader's prefill reaches the fork point
            if not budget or len(plan) >= cfg.max_num_seqs:
                break
            if not self.admit(req, plan):
                break  # FIFO: later arrivals do not overtake a request that is waiting for memory
            self._lead(req)
            n = self._grow(req, min(req.pending, cfg.prefill_chunk, budget, self._cut(req)), plan)
            if n:
                plan[req] = n
                budget -= n

        for req, n in list(plan.items()):  # a leader that found followers in this step stops at their fork point
            if req.followers and req.num_computed + n > req.fork_at:
                cut = req.fork_at - req.num_computed
                budget += n - cut
                if cut > 0:
                    plan[req] = cut
                else:  # already there (resumed at it from the prefix cache): its followers fork next step
                    del plan[req]

        # 3. prefill, leftover budget in order
        for req, n in list(plan.items()):
            if budget == 0:
                break
            if len(req.tokens) - req.num_computed <= n:  # a decode, or a prefill planned to its end
                continue
            room = min(req.pending, self._cut(req)) - n
            if room > 0:
                extra = self._grow_more(req, n, min(room, budget), plan)
                plan[req] = n + extra
                budget -= extra

        self.split(plan)
        # single-token sequences first (the batched decode path), each group in priority order
        order = sorted(plan.items(), key=lambda item: (item[1] != 1, item[0].priority))
        return order

    def _grow_more(self, req: Request, have: int, extra: int, planned: dict) -> int:
        """Like ``_grow`` for a request already planned for ``have`` tokens; never preempts (step 3 is a bonus)."""
        if not self.pool.layout.mla_layers:
            return extra
        bs = self.block_size
        want = math.ceil((req.num_computed + have + extra) / bs) - len(req.pages)
        if want > 0:
            self._reclaim(want, req, planned, allow_preempt=False, allow_paused=False)
            req.pages += self.pool.alloc(min(want, self.pool.num_free)) or []
        return max(0, min(extra, len(req.pages) * bs - req.num_computed - have))
