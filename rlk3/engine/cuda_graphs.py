"""CUDA graphs of the decode step (every sequence computes one token), one per batch size in
``EngineConfig.cuda_graph_batch_sizes``, captured on first use. GPU only; never used on CPU.

A decode step launches a few hundred small kernels; replaying a captured graph removes their launch overhead,
which dominates decode at small batch. The runner's single-token path makes no host synchronisation (FLA's
fused recurrent kernel updates the KDA slots in place by index, the Triton kernel reads the paged MLA latents,
the MoE computes its experts densely), so it can be captured as is. Inputs live in static buffers: a batch of
``n`` sequences is copied into the first ``n`` rows of the smallest captured size ``>= n``; the remaining rows point
at a scratch KDA slot and a scratch MLA page held by this object, so they write nowhere that matters.

Weights are updated in place (``update_weights`` copies into the parameters, ``refresh_weights`` into the derived
tensors), so captured graphs stay valid across updates. ``release_memory`` drops the graphs with the pool.
"""

from __future__ import annotations

import math

import torch

from rlk3.engine.pool import PagedPool
from rlk3.engine.runner import ForwardBatch, ModelRunner, decode_conv_indices


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, pool: PagedPool, config):
        self.runner = runner
        self.pool = pool
        self.sizes = list(config.cuda_graph_batch_sizes)
        layout = pool.layout
        self.pages_per_slot = layout.pages_per_slot
        max_len = config.max_model_len or pool.num_pages * layout.block_size
        self.width = max(1, min(math.ceil(max_len / layout.block_size), pool.num_pages))
        scratch = pool.alloc(self.pages_per_slot + 1)
        if scratch is None:
            raise RuntimeError("cuda graphs: no free pages for the scratch slot")
        self.scratch = scratch
        dev, n = pool.device, max(self.sizes)
        long = dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(n, **long)
        self.slot_pages = torch.tensor([scratch[: self.pages_per_slot]] * n, **long).reshape(n, self.pages_per_slot)
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
        self.slot_pages[start:stop] = torch.tensor(self.scratch[: self.pages_per_slot], device=self.pool.device)
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

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits of a decode-only batch by graph replay, or None when no captured size fits (run it eagerly)."""
        n = batch.num_decode
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or batch.prefill_lens or batch.block_tables.shape[1] > self.width:
            return None
        if size not in self.graphs:
            self._capture(size)
        self.load(batch, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]
