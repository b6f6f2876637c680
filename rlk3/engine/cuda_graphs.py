"""CUDA graphs of the decode step (every sequence computes one token), one per batch size in
``EngineConfig.cuda_graph_batch_sizes``, captured on first use. GPU only; never used on CPU.

A decode step launches a few hundred small kernels; replaying a captured graph removes their launch overhead,
which dominates decode at small batch. The runner's single-token path makes no host synchronisation (FLA's
fused recurrent kernel updates the KDA slots in place by index, the Triton kernel reads the paged MLA latents,
the MoE computes its experts densely), so it can be captured as is. Inputs live in static buffers: a batch of
``n`` sequences is copied into the first ``n`` rows of the smallest captured size ``>= n``; the remaining rows point
at a scratch KDA slot and a scratch MLA page held by this object, so they write nowhere that matters.

``PrefillGraphs`` (below) captures all-prefill steps too, piecewise: padded to a bucket, one graph per stretch
between MLA attention cores, which run eagerly in between.

Weights are updated in place (``update_weights`` copies into the parameters, ``refresh_weights`` into the derived
tensors), so captured graphs stay valid across updates. ``release_memory`` drops the graphs with the pool.
"""

from __future__ import annotations

import math
import time

import torch

from rlk3.engine.pool import PagedPool
from rlk3.engine.runner import ForwardBatch, GraphPad, KdaSplit, ModelRunner, decode_conv_indices, split_static

INITIAL_TOKENS = 4096  # the decode graphs' first block-table width, in tokens (it grows with the sequences)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, pool: PagedPool, config):
        self.runner = runner
        self.pool = pool
        self.sizes = list(config.cuda_graph_batch_sizes)
        layout = pool.layout
        self.pages_per_slot = layout.pages_per_slot
        max_len = config.max_model_len or pool.num_pages * layout.block_size
        self.max_width = max(1, min(math.ceil(max_len / layout.block_size), pool.num_pages))
        # the block table's width (pages a row can hold) starts at INITIAL_TOKENS and doubles when a longer sequence
        # decodes, the graphs captured again at each growth. Sized up front it was max batch x every page of the pool
        # whenever max_model_len was unset: 8.3 GB of int64 for k3-tiny's small pages at a 100 GB pool, outside the
        # pool's budget. It also keeps the Triton decode's split count (from the table's width) near the eager one.
        self.width = min(self.max_width, math.ceil(INITIAL_TOKENS / layout.block_size))
        scratch = pool.alloc(self.pages_per_slot + 1)
        if scratch is None:
            raise RuntimeError("cuda graphs: no free pages for the scratch slot")
        self.scratch = scratch
        dev, n = pool.device, max(self.sizes)
        long = dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(n, **long)
        # the scratch slot's pages as a device row: a row that carries no sequence is reset from it by a device copy
        # (``torch.tensor(pages, device=cuda)`` copies from pageable memory and waits for the GPU: with asynchronous
        # decode, every step whose batch shrank stalled behind the step in flight)
        self.scratch_row = torch.tensor(scratch[: self.pages_per_slot], **long)
        self.slot_pages = self.scratch_row.repeat(n, 1)
        self.block_tables = torch.full((n, self.width), scratch[-1], **long)
        self.seq_lens = torch.ones(n, **long)
        self.write_pages = torch.full((n,), scratch[-1], **long)
        self.write_offsets = torch.zeros(n, **long)
        self.rows = torch.arange(n, **long)
        # rows [0, dirty_rows) and table columns [0, dirty_cols) may hold a real sequence's pages from an earlier
        # load; everything past them is the scratch slot and page already, so a load resets only what it must
        self.dirty_rows = self.dirty_cols = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}  # the captured inputs (kept alive with their graph)
        self.mempool = torch.cuda.graph_pool_handle()

    def close(self) -> None:
        """Gives the scratch pages back (before the pool is released)."""
        self.graphs.clear()
        self.outputs.clear()
        self.batches.clear()
        if self.scratch:
            self.pool.decref(self.scratch)
            self.scratch = []

    def _batch(self, size: int) -> ForwardBatch:
        conv_src, conv_new = decode_conv_indices(size, self.pool.layout.conv_width, self.pool.device)
        return ForwardBatch(
            input_ids=self.input_ids[:size], num_decode=size, prefill_starts=[], prefill_lens=[],
            slot_pages=self.slot_pages[:size], block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            write_pages=self.write_pages[:size], write_offsets=self.write_offsets[:size], logit_rows=self.rows[:size],
            conv_src=conv_src, conv_new=conv_new,
        )

    def _reset_rows(self, start: int, stop: int) -> None:
        """Rows that carry no sequence: the scratch slot and page, one cached token."""
        if stop <= start:
            return
        self.input_ids[start:stop] = 0
        self.slot_pages[start:stop] = self.scratch_row
        self.block_tables[start:stop] = self.scratch[-1]
        self.seq_lens[start:stop] = 1
        self.write_pages[start:stop] = self.scratch[-1]
        self.write_offsets[start:stop] = 0
        if stop >= self.dirty_rows:
            self.dirty_rows = min(self.dirty_rows, start)

    def _capture(self, size: int) -> None:
        self._reset_rows(0, max(self.sizes))  # warm-up and capture touch only the scratch slot and page
        batch = self.batches[size] = self._batch(size)
        self.runner.sync_ok = False
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisation, Triton compilation
                for _ in range(2):
                    self.runner.forward(self.pool, batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                self.outputs[size] = self.runner.forward(self.pool, batch)
            self.graphs[size] = graph
        finally:
            self.runner.sync_ok = True

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode batch of ``n <= size`` rows into the static inputs the graph of ``size`` reads; rows past
        ``n`` are reset to the scratch slot."""
        n, width = batch.num_decode, batch.block_tables.shape[1]
        self.input_ids[:n] = batch.input_ids
        self.slot_pages[:n] = batch.slot_pages
        self.block_tables[:n, :width] = batch.block_tables
        if self.dirty_cols > width:
            self.block_tables[:n, width : self.dirty_cols] = self.scratch[-1]
        self.seq_lens[:n] = batch.seq_lens
        self.write_pages[:n] = batch.write_pages
        self.write_offsets[:n] = batch.write_offsets
        self._reset_rows(n, self.dirty_rows)
        self.dirty_rows, self.dirty_cols = n, width

    def _widen(self, width: int) -> None:
        """A table of at least ``width`` columns (a power of two, at most ``max_width``); the graphs that read the
        old one are dropped and captured again on use. A replay still in flight keeps its graph and table alive:
        CUDA frees a destroyed graph at its completion, and the caching allocator reuses the old table's memory
        only after the work queued on this stream."""
        self.width = min(self.max_width, 1 << (width - 1).bit_length())
        self.block_tables = torch.full((len(self.rows), self.width), self.scratch[-1], dtype=torch.long,
                                       device=self.pool.device)
        self.dirty_cols = 0  # every column is the scratch page again; rows' other inputs stay as they are
        self.graphs.clear()
        self.outputs.clear()
        self.batches.clear()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of a decode-only batch by graph replay, or None when no captured size fits (run it eagerly)."""
        n, width = batch.num_decode, batch.block_tables.shape[1]
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or batch.prefill_lens or width > self.max_width:
            return None
        if width > self.width:
            self._widen(width)
        if size not in self.graphs:
            self._capture(size)
        self.load(batch, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]


# Prefill steps are padded to these shapes: token counts rounded up to 1/32 of their octave (at least 128 tokens:
# 2,100 tokens run as 2,176, so at most ~6% padding work; a cached turn of +2,048 tokens and the reply's last token,
# 2,049, pads 127 rows instead of 1/16's 255, though on the H200 the two timed the same within noise) and sequence
# counts up to the next of PREFILL_SEQ_BUCKETS (one more than the real sequences: the padding tokens form a sequence
# of their own). The PREFILL_MAX_SHAPES shapes used last keep their graphs (each holds its query and output buffers
# and logits).
PREFILL_MIN_QUANTUM = 128
PREFILL_SEQ_BUCKETS = (4, 16, 64, 256)
PREFILL_MAX_SHAPES = 24


def prefill_bucket(tokens: int, seqs: int, max_tokens: int) -> tuple[int, int] | None:
    """The padded ``(tokens, sequences)`` shape of an all-prefill step, or None when no bucket holds it."""
    q = max(PREFILL_MIN_QUANTUM, 1 << max(0, (tokens - 1).bit_length() - 5))
    padded = -(-tokens // q) * q
    n = next((b for b in PREFILL_SEQ_BUCKETS if b > seqs), None)
    if n is None or padded > max(max_tokens, PREFILL_MIN_QUANTUM):
        return None
    return padded, n


class _Pieces:
    """One captured prefill shape: its graphs (one more than the MLA layers), the static inputs they read, and for
    each MLA layer the query tensors the piece before it leaves and the buffer the piece after it reads."""

    def __init__(self, static: torch.Tensor):
        self.static = static
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.attends: list[tuple] = []  # (idx, attn, q_nope, q_rope, out) per MLA layer, in order
        self.logits: torch.Tensor | None = None


class PrefillGraphs:
    """Piecewise CUDA graphs of all-prefill steps (every sequence computes several tokens: new prompts, chunks,
    extensions after a prefix hit). A prefill step's GPU work is a few milliseconds, but it launches ~850 kernels
    with ~50 ms of host time between them (FLA's chunked KDA wrappers, the compiled blocks' guards:
    docs/BENCHMARKS.md), so a cached turn of an episode costs about what a cold one does. Captured, each MLA layer's
    attention core is the one part that stays eager: its shapes depend on how much each sequence has cached. Every
    other operation is static once the step is padded (``prefill_bucket``; the engine's batch builder pads, see
    ``GraphPad``): KDA runs FLA's graph mode (device-side chunk indexing over a fixed number of sequences), the MoE
    Hopper's grouped GEMM, the page writes and conv gathers index static buffers. So a step replays
    ``len(mla_layers) + 1`` graphs with the eager attention between them.

    Padding tokens are a sequence on a scratch KDA slot (zeroed before each step) writing a scratch MLA page, never
    attended by a real token; their rows are computed and dropped. On CPU, or with the torch backend, the same
    padded pieces run eagerly (that is what the CPU tests exercise: the padding and the split, against the plain
    step)."""

    def __init__(self, runner: ModelRunner, pool: PagedPool, capture: bool):
        self.runner = runner
        self.pool = pool
        self.capture = capture
        scratch = pool.alloc(pool.layout.pages_per_slot + 1)  # (the engine makes this holder on an empty pool)
        if scratch is None:
            raise RuntimeError("prefill graphs: no free pages for the scratch slot")
        self.scratch = scratch
        self.pieces: dict[tuple[int, int], _Pieces] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0  # spent capturing (warm-ups included), once per shape

    def close(self) -> None:
        self.pieces.clear()
        if self.scratch:
            self.pool.decref(self.scratch)
            self.scratch = []

    def scratch_slot(self) -> list[int]:
        return self.scratch[: self.pool.layout.pages_per_slot]

    def scratch_page(self) -> int:
        return self.scratch[-1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's real logit rows; the batch is padded (``batch.pad``)."""
        pad = batch.pad
        if not self.capture:
            self._zero_scratch()
            return self.runner.forward(self.pool, batch, attend=self._eager_attend)[: pad.logits]
        key = (batch.input_ids.shape[0], pad.seqs, pad.splits)
        pieces = self.pieces.pop(key, None)
        if pieces is None:
            while len(self.pieces) >= PREFILL_MAX_SHAPES:  # the least recently used shape goes
                self.pieces.pop(next(iter(self.pieces)))
            # the GPU first finishes the steps launched before this one (a long prompt's earlier chunks, launched
            # without a read-back): their time is prefill time, which capture_seconds must not take in
            torch.cuda.synchronize()
            start = time.perf_counter()
            pieces = self._capture(batch)
            torch.cuda.synchronize()
            self.capture_seconds += time.perf_counter() - start
        self.pieces[key] = pieces  # most recently used last
        self._zero_scratch()
        pieces.static.copy_(pad.static)
        for k, graph in enumerate(pieces.graphs):
            graph.replay()
            if k < len(pieces.attends):
                idx, attn, q_nope, q_rope, out = pieces.attends[k]
                n = pad.tokens
                out[:n] = self.runner.mla_attend(idx, attn, q_nope[:n], q_rope[:n], self.pool, batch)
        return pieces.logits[: pad.logits]

    def _zero_scratch(self) -> None:
        """The padding sequence starts from a zero state, whatever the last step or a capture left there."""
        if self.scratch_slot():
            self.pool.zero(self.scratch_slot())
            self.pool.flush()

    def _eager_attend(self, idx, attn, q_nope, q_rope, pool, b):
        """The padded step's attention run eagerly: the real tokens attend, the padding rows stay zero."""
        out = q_nope.new_zeros(q_nope.shape[0], attn.num_heads, attn.v_dim)
        n = b.pad.tokens
        if n:
            out[:n] = self.runner.mla_attend(idx, attn, q_nope[:n], q_rope[:n], pool, b)
        return out

    def _capture(self, batch: ForwardBatch) -> _Pieces:
        """Captures the batch's shape on a copy of its inputs that points every sequence at the scratch slot and
        page (warm-up and capture must not touch real state), with no real tokens (so no attention runs)."""
        pad = batch.pad
        static = pad.static.clone()
        dummy = self._dummy(batch, static)
        pieces = _Pieces(static)
        runner = self.runner
        runner.sync_ok = False
        try:
            main, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):  # warm-up: lazy initialisation, Triton compilation and autotuning
                for _ in range(2):
                    runner.forward(self.pool, dummy, attend=self._eager_attend)
                side.synchronize()
                graph = torch.cuda.CUDAGraph()

                def split(idx, attn, q_nope, q_rope, pool, b):
                    nonlocal graph
                    graph.capture_end()
                    pieces.graphs.append(graph)
                    with torch.cuda.stream(main):  # outside any capture, on the stream that replays and attends
                        out = q_nope.new_zeros(q_nope.shape[0], attn.num_heads, attn.v_dim)
                    side.wait_stream(main)
                    pieces.attends.append((idx, attn, q_nope, q_rope, out))
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self.mempool)
                    return out

                graph.capture_begin(pool=self.mempool)
                try:
                    pieces.logits = runner.forward(self.pool, dummy, attend=split)
                finally:
                    graph.capture_end()
                pieces.graphs.append(graph)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            runner.sync_ok = True
        return pieces

    def _dummy(self, batch: ForwardBatch, static: torch.Tensor) -> ForwardBatch:
        """``batch`` over ``static`` (the same views), rewritten as an all-padding step on the scratch slot."""
        pad = batch.pad
        T, N, S = batch.input_ids.shape[0], pad.seqs, pad.splits
        fields = split_static(static, T, N, self.pool.layout, S, self.runner.kda_chunk_size)
        fields["input_ids"].zero_()
        if fields["slot_pages"].numel():
            fields["slot_pages"][:] = torch.tensor(self.scratch_slot(), device=static.device)
        fields["write_pages"].fill_(self.scratch_page())
        fields["write_offsets"].zero_()
        fields["logit_rows"].zero_()
        cu = torch.full((N + 1,), T, dtype=torch.long)
        cu[0] = 0
        fields["cu"].copy_(cu)  # one padding sequence over every token (the conv gathers stay the batch's: in range)
        split = None
        if S:  # the padded KDA input as one padding sequence too, the checkpoints on the scratch slot
            rows = batch.kda_split.padded_rows
            kcu = torch.full((N + 1,), rows, dtype=torch.long)
            kcu[0] = 0
            fields["rows"].copy_(torch.arange(T))
            fields["src"].copy_(torch.arange(rows) % T)
            fields["ident"].copy_(torch.arange(T, rows))
            fields["kda_cu"].copy_(kcu)
            fields["hidx"].zero_()
            fields["conv_rows"][:N].copy_(fields["conv_new"])  # the conv caches, as the batch's; checkpoints' row 0
            fields["conv_rows"][N:].zero_()
            if fields["ckpt"].numel():
                fields["ckpt"][:] = torch.tensor(self.scratch_slot(), device=static.device)
            split = KdaSplit(**{f: fields[f] for f in ("rows", "src", "ident", "kda_cu", "hidx", "conv_rows", "ckpt")},
                             padded_rows=rows, cu_cpu=kcu)
        return ForwardBatch(
            input_ids=fields["input_ids"], num_decode=0, prefill_starts=[], prefill_lens=[],
            slot_pages=fields["slot_pages"], block_tables=batch.block_tables[:0], seq_lens=batch.seq_lens[:0],
            write_pages=fields["write_pages"], write_offsets=fields["write_offsets"], logit_rows=fields["logit_rows"],
            conv_src=fields["conv_src"], conv_new=fields["conv_new"], prefill_offsets=(fields["cu"], cu),
            pad=GraphPad(tokens=0, seqs=N, logits=0, static=static, splits=S), kda_split=split,
        )
