"""Kernels: torch references (CPU path and ground truth) beside the GPU paths, one dispatch point per op."""

from __future__ import annotations

import torch

_FLUSHED = False


def flush_denormals_on_cpu() -> None:
    """Turn on flush-to-zero for CPU float math, once per process.

    The chunkwise KDA form multiplies decay factors such as ``e^{Γ_r − Γ_b}`` that routinely fall below fp32's
    normal range (1.2e-38); x86 cores handle such denormal numbers through a slow microcode path, measured here
    at ~50x for a whole KDA layer. Values that small are zero for every purpose of this model, so they are
    flushed. (This is the process-wide ``torch.set_flush_denormal`` switch; it has no effect on CUDA.)
    """
    global _FLUSHED
    if not _FLUSHED:
        torch.set_flush_denormal(True)
        _FLUSHED = True
