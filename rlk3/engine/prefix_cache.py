"""Prefix cache: 512-token hash blocks whose MLA entries are shared pages, and KDA state checkpoints at some of the
block boundaries (DESIGN.md §4, the seed's "KDA states and MLA KV blocks share one paged pool").

* The token stream is cut into blocks of ``block_tokens``; block ``i``'s key is a hash of block ``i − 1``'s key and
  its own tokens, so a key names the whole prefix up to the end of that block.
* An entry holds the block's MLA pages (every MLA layer's latents for those tokens; reusable at any boundary) and,
  at some boundaries only, a **checkpoint**: a copy of every KDA layer's recurrent state and conv caches after
  the block's last token. A KDA state cannot be rewound, so it is reusable only where such a copy was taken.
* Lookup is two-stage: the longest run of matching keys, then the latest boundary inside it whose entry has a
  checkpoint; prefill resumes there. Because a checkpoint belongs to the entry of the block it ends, and that
  entry's key names the whole prefix, a state can only be restored where exactly that prefix was computed.
* **Tails**: where a sequence's computed tokens end off a block boundary — the end of a prompt, or of a finished
  generation (the model's own reply, which an agent loop re-sends in the next turn's conversation) — a tail
  entry holds the partial block's tokens after its last full block (key: the parent's key and those tokens), the
  MLA pages covering them (the last one partly filled) and a checkpoint there. A lookup that reaches a tail's
  parent resumes after the tail when its tokens follow; the request copies the partial page (it writes the rest).
* Eviction is LRU over entries that would free pages. A chain is touched leaf first, so its root is the most
  recently used and a prefix is evicted from its tail. With ``spill_bytes > 0`` evicted entries are copied to
  CPU memory (its own LRU) and come back on a hit.
* **Superseded checkpoints go first** (``drop_superseded``). A block's checkpoint is a whole KDA slot — in
  k3-small the bytes of 4,608 tokens of MLA latents, in k3-full 17,664. It is *superseded* when the cached chain
  below it runs to a deeper block checkpoint without branching: every cached continuation of it reaches that deeper
  state, so it serves only a request that leaves the chain between the two, which none has done yet. An agent loop
  that re-sends its conversation leaves one such checkpoint per turn (the next turn's is deeper, and the turn
  resumes from the reply's tail anyway), and every lookup of the conversation touches its block, so plain LRU keeps
  it as long as the conversation is alive: most of its footprint. Under memory pressure superseded checkpoints are
  dropped alone, in the order they were superseded, before any entry is evicted; the block keeps its MLA pages and
  its key, so the prefix still matches and resumes from the deeper checkpoint. A checkpoint at a branch point (a
  shared system prompt's, a GRPO prompt's) is not superseded and leaves only with its entry, by LRU. The cache
  indexes each key's cached child blocks (``children``); the superseded list is kept lazily (marked when a deeper
  checkpoint arrives on a linear path, checked again when used), since a branch or an eviction below can undo it.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from rlk3.engine.pool import PagedPool

ROOT = b"rlk3-prefix-root"


def block_hash(parent: bytes, tokens: list[int] | memoryview, *, tail: bool = False) -> bytes:
    """The chained key of one block: blake2b over the parent's key and the token ids (int64, little-endian); a tail's
    key is salted apart from any full block's. ``tokens``: a list of ints, or a view of int64s already packed (the
    same bytes)."""
    h = hashlib.blake2b(parent, digest_size=16, person=b"rlk3-tail" if tail else b"")
    # array's int64 bytes equal the tensor's (native little-endian) at a quarter of the cost: a re-sent 20K-token
    # conversation hashes 40 blocks in its admission
    h.update(tokens if isinstance(tokens, memoryview) else array.array("q", tokens))
    return h.digest()


@dataclass(eq=False)
class Entry:
    key: bytes
    depth: int  # blocks from the start: the boundary after this block is depth + 1 blocks in
    pages: list[int] | None = None  # MLA pages on the device (None while spilled)
    checkpoint: list[int] | None = None  # KDA slot pages on the device
    spilled_pages: torch.Tensor | None = None  # CPU copies while spilled
    spilled_checkpoint: torch.Tensor | None = None
    tail: int = 0  # a tail entry: its tokens (fewer than a block) after ``depth`` full blocks; 0 for a full block
    parent: bytes | None = None  # the key of the block before it (ROOT at depth 0); a tail's: the block it follows

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None or self.spilled_checkpoint is not None

    @property
    def spilled_bytes(self) -> int:
        return sum(t.numel() for t in (self.spilled_pages, self.spilled_checkpoint) if t is not None)


@dataclass
class Match:
    """A lookup's answer: resume after ``blocks`` blocks, from these entries (``blocks`` of them), the last of which
    holds the checkpoint; ``matched`` is the longest run of matching keys (>= blocks)."""

    blocks: int
    matched: int
    entries: list[Entry]


class PrefixCache:
    def __init__(self, pool: PagedPool, block_tokens: int, spill_bytes: int = 0, drop_superseded: bool = True):
        self.pool = pool
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // pool.layout.block_size if pool.layout.mla_layers else 0
        self.spill_limit = spill_bytes
        self.drop_superseded = drop_superseded
        self.device: OrderedDict[bytes, Entry] = OrderedDict()  # LRU first
        # block checkpoints marked superseded, in that order (lazily: ``_superseded`` checks each when it is used)
        self.superseded: OrderedDict[bytes, None] = OrderedDict()
        self.spilled: OrderedDict[bytes, Entry] = OrderedDict()
        self.spilled_bytes = 0
        self.tails: dict[bytes, set[tuple[int, bytes]]] = {}  # parent key -> (tail tokens, tail key), either store
        self.children: dict[bytes, set[bytes]] = {}  # parent key -> its full child blocks' keys, either store
        # counters for stats()
        self.lookups = self.hits = self.hit_tokens = self.tail_hits = self.tails_taken = 0
        self.evictions = self.spills = self.restores = self.checkpoints_taken = self.checkpoints_skipped = 0
        self.checkpoints_dropped = 0

    # -- contents

    @property
    def num_blocks(self) -> int:
        return len(self.device)

    @property
    def num_checkpoints(self) -> int:
        return sum(e.checkpoint is not None for e in self.device.values())

    @property
    def num_tails(self) -> int:
        return sum(e.tail > 0 for e in self.device.values())

    def pages_held(self) -> list[int]:
        out = []
        for e in self.device.values():
            out += (e.pages or []) + (e.checkpoint or [])
        return out

    def _get(self, key: bytes) -> Entry | None:
        return self.device.get(key) or self.spilled.get(key)

    def insert_block(self, key: bytes, depth: int, pages: list[int], parent: bytes) -> None:
        """Caches a computed block (the caller's MLA pages, shared by reference). A key already cached keeps its
        own pages. The caller touches the whole chain afterwards (``touch``) so that its root stays newest."""
        if key in self.device:
            return
        spilled = self.spilled.pop(key, None)
        if spilled is not None:  # computed again while spilled: the fresh device copy wins
            self.spilled_bytes -= spilled.spilled_bytes
            spilled.spilled_pages = spilled.spilled_checkpoint = None
        self.pool.incref(pages)
        self.device[key] = Entry(key, depth, pages=list(pages), parent=parent)
        self.children.setdefault(parent, set()).add(key)

    def touch(self, keys: list[bytes]) -> None:
        """Marks a chain used, leaf first, so that LRU eviction takes a prefix from its tail."""
        for key in reversed(keys):
            if key in self.device:
                self.device.move_to_end(key)

    # at most this many blocks are walked between a checkpoint and the one that supersedes it (at the defaults,
    # blocks of 512 and an interval of 2,048, they lie at most four apart); a longer stretch counts as not superseding
    SUPERSEDE_WALK = 64

    def _supersede_above(self, entry: Entry) -> None:
        """A block checkpoint arrived at ``entry``: the nearest block checkpoint above it is superseded when no
        branch lies between them (module docstring)."""
        node = self._get(entry.parent)
        for _ in range(self.SUPERSEDE_WALK):
            if node is None or len(self.children.get(node.key, ())) > 1:
                return
            if node.checkpoint is not None:
                self.superseded[node.key] = None
                return
            node = self._get(node.parent)

    def _superseded(self, entry: Entry) -> bool:
        """Whether the cached chain below ``entry`` runs to a deeper block checkpoint without branching."""
        node = entry
        for _ in range(self.SUPERSEDE_WALK):
            below = self.children.get(node.key, ())
            if len(below) != 1:
                return False
            node = self._get(next(iter(below)))
            if node is None:
                return False
            if node.has_checkpoint:
                return True
        return False

    def add_checkpoint(self, key: bytes, slot: list[int], protect: set[bytes] = frozenset()) -> bool:
        """Copies a request's KDA slot into a checkpoint for the block ``key`` (already inserted). Evicts LRU entries
        to make room; gives up (returns False) when that is not enough."""
        entry = self.device.get(key)
        if entry is None or entry.checkpoint is not None:
            return False
        pages = self._alloc(len(slot), protect | {key})
        if pages is None:
            self.checkpoints_skipped += 1
            return False
        self.pool.copy(slot, pages)
        entry.checkpoint = pages
        self._supersede_above(entry)
        self.checkpoints_taken += 1
        return True

    def reserve(self, n: int) -> list[int] | None:
        """``n`` pages for a checkpoint computed in a step before its block is inserted (``adopt_checkpoint``),
        evicting LRU entries as ``add_checkpoint`` would; None (counted as skipped) when that is not enough."""
        pages = self._alloc(n, set())
        if pages is None:
            self.checkpoints_skipped += 1
        return pages

    def adopt_checkpoint(self, key: bytes, pages: list[int]) -> bool:
        """Makes ``pages`` (a filled KDA slot from ``reserve``, reference passed on) the checkpoint of the cached block
        ``key``. False when the block is not cached or has a checkpoint: the caller keeps the pages."""
        entry = self.device.get(key)
        if entry is None or entry.checkpoint is not None:
            return False
        entry.checkpoint = list(pages)
        self._supersede_above(entry)
        self.checkpoints_taken += 1
        return True

    def add_tail(self, parent: bytes, depth: int, tokens: list[int], pages: list[int], slot: list[int],
                 protect: set[bytes] = frozenset(), evict: bool = True) -> bytes | None:
        """Caches a tail (module docstring): ``tokens`` after ``depth`` full blocks whose last key is ``parent``, the
        MLA ``pages`` covering them (shared by reference) and a copy of the KDA ``slot`` after them. Returns its key,
        or None when it is cached already or no room is found (after evicting LRU entries, if ``evict``)."""
        key = block_hash(parent, tokens, tail=True)
        if self._get(key) is not None:
            return None
        ckpt = self._alloc(len(slot), protect) if evict else self.pool.alloc(len(slot))
        if ckpt is None:
            self.checkpoints_skipped += 1
            return None
        self.pool.copy(slot, ckpt)
        self.pool.incref(pages)
        self.device[key] = Entry(key, depth, pages=list(pages), checkpoint=ckpt, tail=len(tokens), parent=parent)
        self.tails.setdefault(parent, set()).add((len(tokens), key))
        self.tails_taken += 1
        return key

    def match_tail(self, keys: list[bytes], tokens: list[int], start: int, limit: int) -> list[Entry] | None:
        """The tail that resumes furthest past ``start`` and at most at ``limit``, along the matched full-block keys
        ``keys`` of ``tokens``: the entries of its ``d`` full blocks and then the tail itself, or None."""
        if not self.tails:
            return None
        B = self.block_tokens
        for d in range(len(keys), start // B - 1, -1):
            for t, key in sorted(self.tails.get(keys[d - 1] if d else ROOT, ()), reverse=True):
                entry = self._get(key)
                if (start < d * B + t <= limit and entry is not None
                        and block_hash(entry.parent, tokens[d * B : d * B + t], tail=True) == key):
                    self.touch([*keys[:d], key])
                    return [*(self._get(k) for k in keys[:d]), entry]
        return None

    def _unindex(self, entry: Entry) -> None:
        """An entry left both stores: it leaves its parent's children, a tail its parent's index."""
        if not entry.tail:
            siblings = self.children.get(entry.parent)
            if siblings is not None:
                siblings.discard(entry.key)
                if not siblings:
                    del self.children[entry.parent]
        if entry.tail:
            options = self.tails.get(entry.parent)
            if options is not None:
                options.discard((entry.tail, entry.key))
                if not options:
                    del self.tails[entry.parent]

    def _alloc(self, n: int, protect: set[bytes]) -> list[int] | None:
        pages = self.pool.alloc(n)
        while pages is None and self.evict_one(protect):
            pages = self.pool.alloc(n)
        return pages

    # -- lookup

    def match(self, keys: list[bytes]) -> Match:
        """Longest run of cached keys, then the latest checkpoint inside it (module docstring). (The scheduler counts
        ``lookups`` per admission: one waiting for memory matches again every step.)"""
        chain: list[Entry] = []
        for key in keys:
            entry = self._get(key)
            if entry is None:
                break
            chain.append(entry)
        best = 0
        for i, entry in enumerate(chain):
            if entry.has_checkpoint:
                best = i + 1
        self.touch([e.key for e in chain])
        return Match(best, len(chain), chain[:best])

    def restore(self, entries: list[Entry], protect: set[bytes] = frozenset()) -> bool:
        """Brings spilled entries back to the device (pages and checkpoint). False when pages run out or a spilled
        copy has been dropped meanwhile; whatever was restored stays cached."""
        keep = protect | {e.key for e in entries}
        for entry in entries:
            if entry.key in self.device:
                continue
            if not self._bring_back(entry, keep):
                return False
        return True

    def _bring_back(self, entry: Entry, protect: set[bytes]) -> bool:
        if entry.key not in self.spilled:
            return False  # dropped from the CPU store since the lookup
        # out of the spill store while pages are found, so that spilling others cannot drop it
        del self.spilled[entry.key]
        self.spilled_bytes -= entry.spilled_bytes
        parts = [t for t in (entry.spilled_pages, entry.spilled_checkpoint) if t is not None]
        pages = self._alloc(sum(t.shape[0] for t in parts), protect)
        if pages is None:  # back in the store, which the search for pages may have filled with what it evicted
            self._spill_room(entry.spilled_bytes)
            self.spilled[entry.key] = entry
            self.spilled_bytes += entry.spilled_bytes
            return False
        n_mla = 0 if entry.spilled_pages is None else entry.spilled_pages.shape[0]
        if parts:
            self.pool.write(pages, torch.cat(parts))
        entry.pages = pages[:n_mla] if entry.spilled_pages is not None else []
        entry.checkpoint = pages[n_mla:] if entry.spilled_checkpoint is not None else None
        entry.spilled_pages = entry.spilled_checkpoint = None
        self.device[entry.key] = entry
        if entry.checkpoint is not None and not entry.tail:
            self._supersede_above(entry)
        self.restores += 1
        return True

    # -- eviction

    def _frees_pages(self, entry: Entry) -> bool:
        if entry.checkpoint is not None:
            return True
        return bool(entry.pages) and all(self.pool.refcount[p] == 1 for p in entry.pages)

    def evict_one(self, protect: set[bytes] = frozenset()) -> bool:
        """Frees at least one page: (``drop_superseded``) the first superseded block checkpoint alone, else the
        least recently used entry that frees any (module docstring). False when nothing frees a page."""
        if self.drop_superseded:
            for key in list(self.superseded):
                entry = self.device.get(key)
                if entry is None or entry.checkpoint is None or not self._superseded(entry):
                    del self.superseded[key]  # evicted, dropped, or a branch / an eviction below undid it
                elif key not in protect:
                    self._drop_checkpoint(entry)
                    return True
        for key, entry in self.device.items():
            if key in protect or not self._frees_pages(entry):
                continue
            self._evict(entry)
            return True
        return False

    def _drop_checkpoint(self, entry: Entry) -> None:
        """A block's checkpoint leaves the device; the block stays cached (its MLA pages, its key)."""
        del self.superseded[entry.key]
        pages, entry.checkpoint = entry.checkpoint, None
        self.checkpoints_dropped += 1
        self.pool.decref(pages)

    def _evict(self, entry: Entry) -> None:
        del self.device[entry.key]
        self.superseded.pop(entry.key, None)
        self.evictions += 1
        owned = (entry.pages or []) + (entry.checkpoint or [])
        if self.spill_limit > 0:
            pages = self.pool.read(entry.pages) if entry.pages else None
            ckpt = self.pool.read(entry.checkpoint) if entry.checkpoint else None
            size = sum(t.numel() for t in (pages, ckpt) if t is not None)
            if 0 < size <= self.spill_limit:
                self._spill_room(size)
                entry.spilled_pages, entry.spilled_checkpoint = pages, ckpt
                self.spilled[entry.key] = entry
                self.spilled_bytes += size
                self.spills += 1
        if entry.key not in self.spilled:
            self._unindex(entry)
        entry.pages = entry.checkpoint = None
        self.pool.decref(owned)

    def _spill_room(self, size: int) -> None:
        """Drops the least recently spilled entries until ``size`` more bytes fit under ``spill_bytes``."""
        while self.spilled_bytes + size > self.spill_limit and self.spilled:
            _, old = self.spilled.popitem(last=False)
            self.spilled_bytes -= old.spilled_bytes
            old.spilled_pages = old.spilled_checkpoint = None
            self._unindex(old)

    def check(self) -> None:
        """Raises ``AssertionError`` when the child index disagrees with the stores: every cached full block is
        indexed under its parent, and every indexed child is cached with that parent (``engine.check_invariants``)."""
        blocks = {k: e for store in (self.device, self.spilled) for k, e in store.items() if not e.tail}
        assert all(k in self.children.get(e.parent, ()) for k, e in blocks.items()), "a block missing from the index"
        indexed = [(parent, k) for parent, keys in self.children.items() for k in keys]
        assert all(k in blocks and blocks[k].parent == parent for parent, k in indexed), "a stale child in the index"
        assert len(indexed) == len(blocks), "a block indexed twice"

    def clear(self) -> None:
        """Drops everything (a weight update makes every cached state stale)."""
        for entry in list(self.device.values()):
            self.pool.decref((entry.pages or []) + (entry.checkpoint or []))
        self.device.clear()
        self.superseded.clear()
        self.children.clear()
        self.spilled.clear()
        self.tails.clear()
        self.spilled_bytes = 0
