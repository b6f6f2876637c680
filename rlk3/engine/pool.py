"""One paged pool for both cache kinds of the K3 hybrid.

The byte budget is preallocated once as ``num_pages`` equal pages (``storage [num_pages, page_bytes]`` uint8, so
allocation can never exceed the budget). A page is used either

* as an **MLA block**: ``block_size`` consecutive tokens of one request, for every MLA layer the normalised latent
  ``[block_size, kv_lora_rank]`` and the rope slice ``[block_size, qk_rope_head_dim]`` (cache dtype); or
* as part of a **KDA state slot**: ``layers_per_page`` KDA layers' recurrent states ``[H, V, K]`` (fp32, V-first as
  FLA keeps them) and short-conv caches ``[kernel − 1, 3·H·K]`` (q, k, v side by side, cache dtype). A request's slot
  is ``pages_per_slot`` pages, not necessarily adjacent.

Typed views over ``storage`` (one per MLA layer and per KDA position in a page) give every kernel a plain strided
tensor: ``latent(m) [P, block_size, L]``, ``kda_state(s) [P, H, V, K]`` and so on; a request's data are rows of
those views selected by page index. FLA's fused recurrent decode offsets its state pool by ``stride(0)`` only,
so it updates slots in place inside these pages.

The page size is the larger of one MLA block and one KDA layer's state: ``block_size`` (auto) is the smallest power
of two from 16 whose MLA block holds at least one KDA layer, so neither use wastes much. K3's write-up puts twelve
512-token hash blocks in one 6144-token physical block; here a physical block is at most one hash block
(``block_size`` divides ``prefix_block_tokens``), so a cached prefix block is a set of whole pages shared by
reference count, with no copy-on-write.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every region starts cache-line aligned (and so at any dtype's alignment)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PoolError(RuntimeError):
    """The pool cannot be laid out or sized as asked (the message names the sizes)."""


@dataclass(frozen=True)
class PoolLayout:
    """Where everything sits inside a page (byte offsets), derived from the model config."""

    page_bytes: int
    block_size: int  # MLA tokens per page
    cache_dtype: torch.dtype
    mla_layers: tuple[int, ...]  # model layer indices of the MLA layers, in order
    kda_layers: tuple[int, ...]
    kv_lora_rank: int
    rope_dim: int
    kda_heads: int
    kda_head_dim: int
    conv_width: int  # kernel - 1 cached inputs
    latent_offsets: tuple[int, ...]  # per MLA layer
    rope_offsets: tuple[int, ...]
    layers_per_page: int  # KDA layers per state page (0 when the model has none)
    state_offsets: tuple[int, ...]  # per position in a state page
    conv_offsets: tuple[int, ...]

    @property
    def pages_per_slot(self) -> int:
        return math.ceil(len(self.kda_layers) / self.layers_per_page) if self.kda_layers else 0

    @property
    def mla_token_bytes(self) -> int:
        item = torch.empty((), dtype=self.cache_dtype).element_size()
        return len(self.mla_layers) * (self.kv_lora_rank + self.rope_dim) * item

    def kda_position(self, kda_ordinal: int) -> tuple[int, int]:
        """(page within the slot, position within the page) of the ``kda_ordinal``-th KDA layer."""
        return divmod(kda_ordinal, self.layers_per_page)

    @classmethod
    def for_model(
        cls, config, cache_dtype: torch.dtype, block_size: int | None = None, prefix_block_tokens: int = 512
    ) -> PoolLayout:
        item = torch.empty((), dtype=cache_dtype).element_size()
        kinds = config.layer_kinds
        mla = tuple(i for i, k in enumerate(kinds) if k == "mla")
        kda = tuple(i for i, k in enumerate(kinds) if k == "kda")
        L, R = config.kv_lora_rank, config.qk_rope_head_dim
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.kda_conv_kernel_size - 1
        state_bytes = _align(H * K * K * 4)
        conv_bytes = _align(W * 3 * H * K * item)
        layer_bytes = state_bytes + conv_bytes if kda else 0

        def mla_block_bytes(bs: int) -> int:
            return len(mla) * (_align(bs * L * item) + _align(bs * R * item))

        largest = prefix_block_tokens & -prefix_block_tokens  # the largest power of two dividing the hash block
        if block_size is None:
            block_size = min(16, largest)
            while block_size < largest and mla and mla_block_bytes(block_size) < layer_bytes:
                block_size *= 2
        page_bytes = _align(max(mla_block_bytes(block_size), layer_bytes, ALIGN))

        latent_offsets, rope_offsets, off = [], [], 0
        for _ in mla:
            latent_offsets.append(off)
            off += _align(block_size * L * item)
            rope_offsets.append(off)
            off += _align(block_size * R * item)
        layers_per_page = page_bytes // layer_bytes if kda else 0
        state_offsets = tuple(p * layer_bytes for p in range(layers_per_page))
        conv_offsets = tuple(p * layer_bytes + state_bytes for p in range(layers_per_page))
        return cls(
            page_bytes=page_bytes, block_size=block_size, cache_dtype=cache_dtype, mla_layers=mla, kda_layers=kda,
            kv_lora_rank=L, rope_dim=R, kda_heads=H, kda_head_dim=K, conv_width=W,
            latent_offsets=tuple(latent_offsets), rope_offsets=tuple(rope_offsets), layers_per_page=layers_per_page,
            state_offsets=state_offsets, conv_offsets=conv_offsets,
        )


def budget_bytes(memory_bytes: int | None, memory_fraction: float | None, device: torch.device) -> int:
    """The pool budget: an explicit byte count, or a fraction of what the device has free right now."""
    if memory_bytes is not None:
        return int(memory_bytes)
    free = device_free_bytes(device)
    if free is None:
        raise PoolError("memory_fraction on CPU needs /proc/meminfo's MemAvailable or a cgroup memory limit to size "
                        "the pool from, and neither could be read; set memory_bytes instead")
    return int(free * memory_fraction)


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on ``device``: CUDA's free memory plus what PyTorch's caching allocator
    holds unused; on the CPU, ``MemAvailable`` or the memory cgroup's headroom where that is smaller. None where it
    cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return _cpu_available_bytes()


# Where the CPU's free memory is read (module attributes, read at each call, so a test can point them at fakes)
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"  # this process's cgroup in each hierarchy
CGROUP_ROOT = "/sys/fs/cgroup"  # v2 mounted here; v1 controllers at CGROUP_ROOT/memory etc.
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (2^63 - 4096 bytes with 4 KiB pages); anything this large is
# no limit on any machine
_V1_UNLIMITED = 1 << 62


def _cpu_available_bytes() -> int | None:
    """What a new allocation can take on the CPU: the smaller of ``MemAvailable`` and the memory cgroup's headroom.
    In a container ``MemAvailable`` is the host's: a pool sized from it, or checked against it, passes and then
    gets the container OOM-killed once its pages are touched. None when neither can be read."""
    avail = _meminfo_available(MEMINFO)
    room = _cgroup_headroom(PROC_CGROUP, CGROUP_ROOT)
    if avail is None or room is None:
        return room if avail is None else avail
    return min(avail, room)


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(proc_cgroup: str, root: str) -> int | None:
    """The least headroom (limit less usage) over this process's memory cgroup and its ancestors that set a limit
    (a parent's limit bounds its children too), in cgroup v2 and v1 alike; None when none sets one or nothing can
    be read. Usage counts without the inactive file cache, which the kernel reclaims before it OOM-kills (the
    cgroup's working set, as the kubelet counts it; MemAvailable counts reclaimable cache as available too)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:  # "hierarchy-id:controllers:path"; v2's is "0::path"
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            base, v2 = root, True
        elif "memory" in controllers.split(","):
            base, v2 = os.path.join(root, "memory"), False
        else:
            continue
        leaf = os.path.join(base, path.lstrip("/"))
        # inside a container with its own cgroup namespace or mount, the path names the host's hierarchy while
        # the mount shows the container's own cgroup at its root
        d = leaf if os.path.isdir(leaf) else base
        while True:
            room = _level_headroom(d, v2)
            if room is not None:
                best = room if best is None else min(best, room)
            if os.path.normpath(d) == os.path.normpath(base):
                break
            d = os.path.dirname(d)
    return best


def _level_headroom(d: str, v2: bool) -> int | None:
    """One cgroup directory's limit less its usage (without inactive file cache), or None where it sets no limit."""
    if v2:
        # memory.high is a limit too: above it the kernel throttles the cgroup and reclaims hard, and a pool's
        # pages cannot be dropped
        limits = [_read_int(os.path.join(d, name)) for name in ("memory.max", "memory.high")]
        usage_file, inactive_keys = "memory.current", ("inactive_file",)
    else:
        limits = [_read_int(os.path.join(d, "memory.limit_in_bytes"))]
        usage_file, inactive_keys = "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")
    limits = [x for x in limits if x is not None and x < _V1_UNLIMITED]
    usage = _read_int(os.path.join(d, usage_file))
    if not limits or usage is None:
        return None
    inactive = _stat_field(os.path.join(d, "memory.stat"), inactive_keys)
    return max(0, min(limits) - max(0, usage - inactive))


def _read_int(path: str) -> int | None:
    """An integer file's value; None when absent, unreadable, or "max" (v2's no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_field(path: str, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` found in a memory.stat file (0 if none)."""
    try:
        with open(path) as f:
            fields = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
    except OSError:
        return 0
    for key in keys:
        if fields.get(key, "").isdigit():
            return int(fields[key])
    return 0


class PagedPool:
    """The preallocated pages, their reference counts and the typed views. Page ids are ints in ``[0, num_pages)``."""

    def __init__(self, layout: PoolLayout, budget: int, device: torch.device):
        self.layout = layout
        self.device = torch.device(device)
        self.budget = int(budget)
        self.num_pages = self.budget // layout.page_bytes
        need = layout.pages_per_slot + (1 if layout.mla_layers else 0)
        if self.num_pages < need:
            raise PoolError(
                f"a pool budget of {self.budget} bytes holds {self.num_pages} pages of {layout.page_bytes} bytes; "
                f"one request needs at least {need} (a KDA slot of {layout.pages_per_slot} pages + one MLA block): "
                f"set a budget of at least {need * layout.page_bytes} bytes"
            )
        self.storage: torch.Tensor | None = None
        self.reacquire()

    # -- lifetime

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel()

    def release(self) -> None:
        """Frees the device memory (colocation with training). Every page must already be free."""
        if self.num_free != self.num_pages:
            raise PoolError(f"release with {self.num_pages - self.num_free} pages still in use")
        self.storage = None
        self._views = {}
        self._zero_pending = []  # free pages: nothing to zero

    def reacquire(self) -> None:
        nbytes = self.num_pages * self.layout.page_bytes
        free = device_free_bytes(self.device)
        # refused up front: on CUDA the allocation would fail with a bare out-of-memory error, and on the CPU an
        # overcommitted one would succeed and get the process killed once the pages are touched
        if free is not None and nbytes > free:
            raise PoolError(f"the pool needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) but {self.device} has "
                            f"{free} bytes ({free / 2**30:.2f} GiB) free; lower memory_bytes, or set "
                            f"memory_fraction instead")
        try:
            # zeros, not empty: a masked-out slot read as 0 × NaN would still poison a softmax or a decayed state
            self.storage = torch.zeros(self.num_pages, self.layout.page_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:  # free memory went down since it was read (torch.OutOfMemoryError is one too)
            if "memory" not in str(e).lower():
                raise
            raise PoolError(f"allocating the pool's {nbytes} bytes on {self.device} failed: {e}; lower memory_bytes"
                            f" or memory_fraction") from e
        self.refcount = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: low page ids are handed out first
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._zero_pending: list[int] = []

    # -- allocation

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages with reference count 1, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise PoolError(f"incref of free page {p}")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drops one reference from each page; returns how many pages became free."""
        freed = 0
        for p in pages:
            if self.refcount[p] <= 0:
                raise PoolError(f"decref of free page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    # -- typed views

    def _view(self, kind: str, index: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self.flush()
        key = (kind, index)
        view = self._views.get(key)
        if view is None:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            view = self.storage[:, offset : offset + nbytes].view(dtype).view(self.num_pages, *shape)
            self._views[key] = view
        return view

    def latent(self, m: int) -> torch.Tensor:
        """MLA layer ``m`` (ordinal among MLA layers): ``[P, block_size, kv_lora_rank]``."""
        lay = self.layout
        return self._view("latent", m, lay.latent_offsets[m], lay.cache_dtype, (lay.block_size, lay.kv_lora_rank))

    def rope(self, m: int) -> torch.Tensor:
        lay = self.layout
        return self._view("rope", m, lay.rope_offsets[m], lay.cache_dtype, (lay.block_size, lay.rope_dim))

    def kda_state(self, position: int) -> torch.Tensor:
        """The recurrent states at ``position`` in a state page: ``[P, H, V, K]`` fp32."""
        lay = self.layout
        H, K = lay.kda_heads, lay.kda_head_dim
        return self._view("state", position, lay.state_offsets[position], torch.float32, (H, K, K))

    def kda_conv(self, position: int) -> torch.Tensor:
        """The short-conv caches at ``position``: ``[P, kernel − 1, 3·H·K]`` (q, k, v side by side)."""
        lay = self.layout
        width = 3 * lay.kda_heads * lay.kda_head_dim
        return self._view("conv", position, lay.conv_offsets[position], lay.cache_dtype, (lay.conv_width, width))

    # -- whole-page data movement (slots and blocks are whole pages)

    def zero(self, pages: list[int]) -> None:
        """Zeroes the pages, deferred: the slots a step admits are zeroed in one operation (one at a time, each
        was an index copy, a host sync and a write), before anything reads or writes pool data again — every other
        data access (``copy``, ``read``, ``write``, the typed views the runner reads) flushes first."""
        self._zero_pending += pages

    def flush(self) -> None:
        if self._zero_pending:
            pages, self._zero_pending = self._zero_pending, []
            self.storage[self._index(pages)] = 0

    def _index(self, pages: list[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.long)
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)  # no host synchronisation

    def copy(self, src: list[int], dst: list[int]) -> None:
        if src:
            self.flush()
            self.storage[self._index(dst)] = self.storage[self._index(src)]

    def read(self, pages: list[int]) -> torch.Tensor:
        """A CPU copy of the pages (spilling evicted prefix blocks)."""
        self.flush()
        data = self.storage[self._index(pages)]
        return data.to("cpu", non_blocking=False)

    def write(self, pages: list[int], data: torch.Tensor) -> None:
        self.flush()
        self.storage[self._index(pages)] = data.to(self.device)
