"""Kimi Delta Attention ops: one dispatch point with FLA's names and layouts.

``chunk_kda`` (training, prefill) and ``fused_recurrent_kda`` (decode) call flash-linear-attention's Triton
kernels when the inputs are CUDA tensors and FLA imports; otherwise they run the torch references beside them
(``chunk.py``: chunkwise, differentiable; ``naive.py``: the per-token ground truth). ``backend="torch"`` forces
the reference on any device (the GPU tests compare the two); ``backend="fla"`` insists on FLA. The environment
variable ``RLK3_KDA_BACKEND`` (``torch`` | ``fla``) sets the default for calls that pass no backend, e.g. to run a
whole model on the reference path on a GPU.
``fused_recurrent_kda_pool`` (``pool.py``) is the decode step over a state pool updated in place by index.
"""

from __future__ import annotations

import functools
import os

import torch

from rlk3.model.ops.kda._args import check_inputs, l2norm
from rlk3.model.ops.kda.chunk import CHUNK_SIZES, torch_chunk_kda
from rlk3.model.ops.kda.gate import kda_gate
from rlk3.model.ops.kda.naive import naive_recurrent_kda
from rlk3.model.ops.kda.pool import fused_recurrent_kda_pool

__all__ = [
    "IDENTITY_LOGIT",
    "chunk_kda",
    "fla_available",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
    "kda_gate",
    "l2norm",
    "naive_recurrent_kda",
    "torch_chunk_kda",
]

BACKENDS = (None, "torch", "fla")

# A raw gate and beta logit that make a token the identity with the in-kernel gate and beta-sigmoid: decay
# e^0 (both gates of ``kda_gate`` reach 0 from below, softplus and sigmoid underflowing in fp32) and beta 0: the token
# leaves the state as it was and adds nothing to any other token's output, whatever its (finite) q, k and v; with q =
# k = v = 0 it also outputs 0. Finite, so that no kernel forms 0 · inf; representable in bf16 (fp32's exponent range).
IDENTITY_LOGIT = -1e30


@functools.cache
def _fla_ops():
    """FLA's kda module, or None. Without triton `fla.ops` does not import; on a CPU machine its kernels raise."""
    try:
        from fla.ops import kda as fla_kda
    except Exception:  # ImportError without triton; other errors from a broken triton install
        return None
    return fla_kda


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla_ops() is not None


def _use_fla(x: torch.Tensor, backend: str | None, fn: str) -> bool:
    if backend is None:
        backend = os.environ.get("RLK3_KDA_BACKEND") or None
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: `backend` must be one of {BACKENDS} (or RLK3_KDA_BACKEND unset), got {backend!r}")
    if backend == "torch":
        return False
    usable = x.is_cuda and _fla_ops() is not None
    if backend == "fla" and not usable:
        why = "inputs are not CUDA tensors" if not x.is_cuda else "flash-linear-attention is not importable"
        raise RuntimeError(f"{fn}: backend='fla' requested but {why}; use backend='torch' or None")
    return usable


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    return_intermediate_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """KDA over whole sequences. q, k ``[B,T,H,K]``; v ``[B,T,HV,V]``; g ``[B,T,HV,K]`` (log decay, or raw gate
    logits with ``use_gate_in_kernel``); beta ``[B,T,HV]``. Returns ``(o [B,T,HV,V], final_state | None)``.
    ``cu_seqlens_cpu``: the same offsets on the host, when the caller has them; on CUDA, validating and indexing
    the chunks from a device tensor waits for the GPU (trusted to equal ``cu_seqlens``, as FLA trusts it).
    ``use_graph``: FLA indexes the chunks on the device with static shapes (``cu_seqlens`` padded with empty
    sequences to ``max_num_seqs`` + 1 entries), so the call can be captured in a CUDA graph; the host copy is then
    only validated (at capture), never handed to FLA, whose replays see other offsets. The torch path ignores it.
    ``return_intermediate_states``: a third output, the state entering every chunk (``torch_chunk_kda``'s ``h``, in
    k's dtype: bf16 states for a bf16 model); FLA hands it out only in inference mode, which this call enters (its
    outputs are then inference tensors: read them, never write them in place)."""
    shapes = check_inputs(
        q, k, v, g, beta, initial_state=initial_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, fn="chunk_kda", cu_seqlens_cpu=cu_seqlens_cpu,
    )
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_kda: `chunk_size` must be one of {CHUNK_SIZES} (FLA takes 32 or 64), got {chunk_size}")
    if return_intermediate_states and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias)):
        raise ValueError("chunk_kda: `return_intermediate_states` is for inference (FLA computes it in inference "
                         "mode, without gradients); call it under torch.no_grad() or with inputs that do not "
                         "require grad")
    kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
    )
    if _use_fla(q, backend, "chunk_kda"):
        extra = dict(use_graph=True, max_num_seqs=max_num_seqs) if use_graph else dict(cu_seqlens_cpu=cu_seqlens_cpu)
        if not return_intermediate_states:
            return _fla_ops().chunk_kda(q, k, v, g, beta, **extra, **kwargs)
        with torch.inference_mode():
            return _fla_ops().chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **extra, **kwargs)
    return torch_chunk_kda(q, k, v, g, beta, _shapes=shapes, return_intermediate_states=return_intermediate_states,
                           **kwargs)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA for decode (forward only on FLA). Same layouts as ``chunk_kda``; as in FLA, a set
    ``lower_bound`` alone selects the bounded in-kernel gate."""
    check_inputs(
        q, k, v, g, beta, initial_state=initial_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=False, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, fn="fused_recurrent_kda",
    )
    kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
    )
    if _use_fla(q, backend, "fused_recurrent_kda"):
        return _fla_ops().fused_recurrent_kda(q, k, v, g, beta, **kwargs)
    return naive_recurrent_kda(q, k, v, g, beta, **kwargs)
