"""Argument checks and the preprocessing shared by every KDA path (naive, torch chunkwise, FLA).

The argument names, layouts and flags are FLA's (``fla.ops.kda.chunk_kda``): q, k ``[B,T,H,K]``, v ``[B,T,HV,V]``
with ``HV % H == 0`` (grouped value attention), g ``[B,T,HV,K]`` in log space, beta ``[B,T,HV]``, states
``[N,HV,K,V]`` or ``[N,HV,V,K]`` with ``state_v_first``. Errors name the argument and the shape it should have.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from rlk3.model.ops.kda.gate import kda_gate

L2NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class Shapes:
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int  # number of sequences (B, or len(cu_seqlens) - 1)


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None,
    state_v_first: bool,
    cu_seqlens: torch.Tensor | None,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    safe_gate: bool,
    lower_bound: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    fn: str,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> Shapes:
    """Validates everything a KDA call receives; raises ``ValueError`` naming the argument and the expectation."""
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: `{name}` must be a floating-point tensor, got dtype {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"{fn}: `q` must be [B, T, H, K] (4-D), got shape {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: `k` must have q's shape [B, T, H, K]={list(q.shape)}, got {_shape(k)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"{fn}: `v` must be [B, T, HV, V] with B={B}, T={T}, got {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"{fn}: `v` has HV={HV} value heads, which must be a multiple of H={H} (q/k heads)")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"{fn}: `g` must be [B, T, HV, K]={[B, T, HV, K]} (log-space decay), got {_shape(g)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"{fn}: `beta` must be [B, T, HV]={[B, T, HV]}, got {_shape(beta)}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"{fn}: q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")
    if K > 256:
        raise ValueError(f"{fn}: key head dim K={K} is too large; KDA supports K <= 256")

    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(
                f"{fn}: with `cu_seqlens` the batch must be flattened to B=1 ([1, sum(T), H, K]), got B={B}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
            raise ValueError(
                f"{fn}: `cu_seqlens` must be a 1-D int32/int64 tensor [N+1] of offsets, "
                f"got dtype {cu_seqlens.dtype} shape {_shape(cu_seqlens)}"
            )
        host = cu_seqlens_cpu
        if host is not None and (host.device.type != "cpu" or host.shape != cu_seqlens.shape):
            raise ValueError(
                f"{fn}: `cu_seqlens_cpu` must be cu_seqlens' offsets on the host (a CPU tensor of shape "
                f"{_shape(cu_seqlens)}), got {_shape(cu_seqlens_cpu)} on {cu_seqlens_cpu.device}"
            )
        # the values are read from the host copy when there is one: reading a device tensor waits for the GPU
        offs = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        if offs[0] != 0 or offs[-1] != T or any(b < a for a, b in itertools.pairwise(offs)):
            raise ValueError(
                f"{fn}: `cu_seqlens` must start at 0, be non-decreasing and end at T={T}; got {offs[:8]}"
                + ("..." if len(offs) > 8 else "")
            )
        N = len(offs) - 1

    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{fn}: `initial_state` must be {layout}={list(want)}, got {_shape(initial_state)}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{fn}: `initial_state` must be float32 (the recurrent state is kept in fp32), "
                f"got {initial_state.dtype}"
            )

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError(f"{fn}: `A_log` [HV] is required when use_gate_in_kernel=True and lower_bound is None")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"{fn}: `A_log` must have HV={HV} elements (one per head), got {_shape(A_log)}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(
                f"{fn}: `dt_bias` must have HV*K={HV * K} elements (one per channel), got {_shape(dt_bias)}"
            )
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(f"{fn}: safe_gate=True with use_gate_in_kernel=True needs `lower_bound` in [-5, 0)")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"{fn}: `lower_bound` must be in the safe range [-5, 0), got {lower_bound}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    return Shapes(B, T, H, K, HV, V, N)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64 (tests at 1e-10), fp32 otherwise: the state is never kept below fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def preprocess(
    q, k, v, g, beta, *, shapes: Shapes, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias, dtype,
):
    """Applies the in-kernel options in torch: returns q (scaled, expanded to HV heads), k (expanded), v, g, beta
    as ``dtype`` tensors, exactly the inputs of the plain recurrence."""
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=dtype)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    groups = shapes.HV // shapes.H
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    if scale is None:
        scale = shapes.K**-0.5
    return q * scale, k, v, g, beta


def state_in(initial_state, shapes: Shapes, state_v_first: bool, dtype, device) -> torch.Tensor:
    """The initial state as ``[N, HV, K, V]`` in the compute dtype (zeros when absent)."""
    if initial_state is None:
        return torch.zeros(shapes.N, shapes.HV, shapes.K, shapes.V, dtype=dtype, device=device)
    s = initial_state.to(dtype)
    return s.transpose(-1, -2) if state_v_first else s


def state_out(S: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    S = S.transpose(-1, -2) if state_v_first else S
    return S.contiguous() if S.dtype == torch.float64 else S.float().contiguous()
