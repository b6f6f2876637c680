"""Trainer → engine weight transfer, the three ways ``cluster.weight_sync`` picks:

* ``object_store`` — train rank 0 returns its full weights as a Ray object; the rollout worker reads them from the
  node's shared-memory object store (one node) and copies them into the engine in place. The default on CPU.
* ``broadcast`` — train rank 0 and the rollout worker form a two-member process group of their own (gloo on CPU,
  NCCL on GPUs; the disaggregated layout of verl/OpenRLHF, where the engine sits on other devices) and rank 0
  broadcasts the weights in flat buckets. Nothing passes through Ray but the call itself.
* ``cuda_ipc`` — colocated on one GPU: rank 0 hands out CUDA IPC handles of its tensors (a few hundred bytes
  each) and the engine copies from that memory directly, device to device; no copy through host memory.

``WeightGroup`` is the broadcast side; ``share_cuda``/``open_cuda`` the IPC side. Both are plain functions of
tensors, so tests run them between ordinary processes as well as between Ray actors.

Broadcast protocol (one ``send`` ↔ one ``recv``): a header — the layout as JSON bytes (names, shapes, dtypes, in
send order) preceded by its length — then one flat buffer per bucket of same-dtype tensors of at most
``bucket_bytes``. The receiver learns everything from the header, so a trainer in fp32 can feed an engine in bf16
(the engine's ``copy_`` converts), and a name or shape the engine does not have is refused by
``RolloutEngine.update_weights`` by name, not met as a size mismatch deep in NCCL.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import timedelta

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}


class WeightGroup:
    """A process group of two: rank 0 sends (the trainer), rank 1 receives (the rollout worker). Independent of the
    default process group, so train ranks that already form a data-parallel group can still open it."""

    def __init__(self, host: str, port: int, rank: int, *, device: str = "cpu", timeout_s: float = 600.0,
                 bucket_bytes: int = 64 << 20) -> None:
        from torch.distributed import TCPStore

        if rank not in (0, 1):
            raise ValueError(f"WeightGroup: rank must be 0 (sender) or 1 (receiver), got {rank}")
        self.rank, self.device, self.bucket_bytes = rank, torch.device(device), bucket_bytes
        timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, port, 2, is_master=rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            self.pg = ProcessGroupNCCL(self.store, rank, 2, ProcessGroupNCCL.Options())
        else:
            from torch.distributed import ProcessGroupGloo

            self.pg = ProcessGroupGloo(self.store, rank, 2, timeout)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast(t, 0).wait()
        return t

    def send(self, weights: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast every tensor; returns the bytes sent."""
        names = list(weights)
        layout = [[n, list(weights[n].shape), str(weights[n].dtype)] for n in names]
        header = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8).to(self.device)
        self._bcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.device))
        self._bcast(header)
        sent = 0
        for bucket in _buckets(layout, self.bucket_bytes):
            flat = torch.cat([weights[n].detach().reshape(-1).to(self.device) for n, _, _ in bucket])
            sent += self._bcast(flat).numel() * flat.element_size()
        return sent

    def recv(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 1: ``(name, tensor)`` pairs as they arrive (views into each bucket's buffer), for
        ``RolloutEngine.update_weights``. Consume it whole: the sender blocks until every bucket is taken."""
        n = self._bcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        header = self._bcast(torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        layout = json.loads(bytes(header.cpu().numpy()).decode())
        for bucket in _buckets(layout, self.bucket_bytes):
            dtype = _DTYPES[bucket[0][2]]
            flat = self._bcast(torch.empty(sum(math.prod(s) for _, s, _ in bucket), dtype=dtype, device=self.device))
            at = 0
            for name, shape, _ in bucket:
                k = math.prod(shape)
                yield name, flat[at : at + k].view(shape)
                at += k

    def close(self) -> None:
        self.pg = None
        self.store = None


def _buckets(layout: list, cap: int) -> Iterator[list]:
    """Consecutive same-dtype runs of the layout, cut at ``cap`` bytes (a tensor larger than ``cap`` goes alone)."""
    bucket, size = [], 0
    for entry in layout:
        nbytes = math.prod(entry[1]) * _DTYPES[entry[2]].itemsize
        if bucket and (entry[2] != bucket[0][2] or size + nbytes > cap):
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def share_cuda(weights: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """CUDA IPC handles of ``weights`` (picklable, a few hundred bytes per tensor). The caller must keep the tensors
    alive until the receiver has copied them."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = {}
    for name, t in weights.items():
        if not t.is_cuda:
            raise ValueError(f"share_cuda: {name!r} is on {t.device}; CUDA IPC needs CUDA tensors "
                             "(cluster.weight_sync=cuda_ipc is for a trainer on a GPU)")
        if not t.is_contiguous():  # a contiguous() copy made here would be freed under the receiver
            raise ValueError(f"share_cuda: {name!r} is not contiguous; pass contiguous tensors and keep them alive")
        out[name] = reduce_tensor(t.detach())
    return out


def open_cuda(handles: dict[str, tuple]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors behind ``share_cuda``'s handles, mapped into this process (same GPU, no copy)."""
    for name, (rebuild, args) in handles.items():
        yield name, rebuild(*args)
