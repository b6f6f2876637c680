"""KDA decode over a state pool: each sequence's recurrent state lives in a slot of a shared pool and is updated
in place, selected by index (FLA's ``fused_recurrent_kda_fwd`` with ``ssm_state_indices`` and
``inplace_final_state=True``, the entry point vLLM and SGLang use for continuous batching).

The torch path gathers the selected slots, runs the per-token reference recurrence and scatters the new states
back; FLA's kernel reads and writes the slots where they lie. The pool may be strided along its first axis (the
engine's pages are larger than one state), but each slot's ``[HV, V, K]`` block must be contiguous, which is
what FLA's kernel assumes (it offsets by ``pool.stride(0)`` only).
"""

from __future__ import annotations

import torch

from rlk3.model.ops.kda._args import check_inputs, l2norm
from rlk3.model.ops.kda.gate import kda_gate
from rlk3.model.ops.kda.naive import naive_recurrent_kda


def _check_pool(q, v, state_pool, state_indices, state_v_first, fn):
    N, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    want = (HV, V, K) if state_v_first else (HV, K, V)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != want:
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        raise ValueError(
            f"{fn}: `state_pool` must be {layout} with slot shape {list(want)}, got {list(state_pool.shape)}"
        )
    if state_pool.dtype != torch.float32:
        raise ValueError(f"{fn}: `state_pool` must be float32 (states are kept in fp32), got {state_pool.dtype}")
    inner = state_pool[0] if state_pool.shape[0] else state_pool
    if state_pool.shape[0] and not inner.is_contiguous():
        raise ValueError(f"{fn}: each slot of `state_pool` must be contiguous (only the slot axis may be strided)")
    if state_indices.dim() != 1 or state_indices.numel() != N or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{fn}: `state_indices` must be a 1-D int32/int64 tensor with one slot per sequence (N={N}), "
            f"got dtype {state_indices.dtype} shape {list(state_indices.shape)}"
        )
    if state_indices.device != state_pool.device or q.device != state_pool.device:
        raise ValueError(f"{fn}: inputs, `state_pool` and `state_indices` must be on one device")


def _use_fla(q: torch.Tensor, backend: str | None) -> bool:
    from rlk3.model.ops.kda import _use_fla as use

    return use(q, backend, "fused_recurrent_kda_pool")


def fused_recurrent_kda_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    backend: str | None = None,
    check_unique: bool = True,
) -> torch.Tensor:
    """N sequences of T tokens (usually T = 1: one decode step each). q, k ``[N, T, H, K]``; v ``[N, T, HV, V]``;
    g ``[N, T, HV, K]``; beta ``[N, T, HV]``; ``state_pool [P, HV, V, K]`` fp32 (V-first) or ``[P, HV, K, V]``;
    ``state_indices [N]``: the slot of each sequence, all distinct. The selected slots are advanced by the T tokens
    in place; every other slot is left untouched. Returns ``o [N, T, HV, V]``.

    ``check_unique`` verifies that no slot is selected twice (a CPU sync on GPU; CUDA-graph capture turns it off).
    """
    fn = "fused_recurrent_kda_pool"
    check_inputs(
        q, k, v, g, beta, initial_state=None, state_v_first=state_v_first, cu_seqlens=None,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=False, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, fn=fn,
    )
    _check_pool(q, v, state_pool, state_indices, state_v_first, fn)
    if check_unique and torch.unique(state_indices).numel() != state_indices.numel():
        raise ValueError(f"{fn}: `state_indices` selects a slot twice: {state_indices.tolist()}")
    kwargs = dict(
        A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
    )
    if _use_fla(q, backend):
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        # the kernel indexes q/k/v/g/beta as dense [N, T, ...] arrays: make them so; the pool it offsets by stride(0).
        # In place, it stores the state after token t at slot ``indices[n·T + t]`` (its speculative-decoding layout,
        # a dense [N, T] table read without strides), so a 1-D table is right only for T = 1: for T > 1 every token
        # of sequence n names n's slot (the last store is the final state).
        T = q.shape[1]
        indices = state_indices if T == 1 else state_indices[:, None].expand(-1, T).contiguous()
        o, _ = fused_recurrent_kda_fwd(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            initial_state=state_pool, inplace_final_state=True, ssm_state_indices=indices, **kwargs,
        )
        return o
    idx = state_indices.long()
    S = state_pool.index_select(0, idx)
    lean = (
        q.shape[1] == 1 and state_v_first and use_gate_in_kernel and use_qk_l2norm_in_kernel
        and use_beta_sigmoid_in_kernel and q.shape[2] == v.shape[2] and q.dtype != torch.float64
    )
    if lean:  # one decode token in K3's configuration: the same recurrence in fewer, larger ops
        o, final = _decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S, A_log, dt_bias, scale, lower_bound,
                                allow_neg_eigval)
        o = o[:, None].to(v.dtype)
    else:
        o, final = naive_recurrent_kda(q, k, v, g, beta, initial_state=S, output_final_state=True, **kwargs)
    state_pool.index_copy_(0, idx, final.to(state_pool.dtype))
    return o


def _decode_step(q, k, v, g, beta, S, A_log, dt_bias, scale, lower_bound, allow_neg_eigval):
    """One token of the recurrence of ``naive.py`` for V-first states ``S [N, H, V, K]`` (fp32), with the in-kernel
    l2norm, gate and beta sigmoid: elementwise products and sums instead of N·H tiny matrix products."""
    f = torch.float32
    K = q.shape[-1]
    q, k, v = l2norm(q.to(f)) * (K**-0.5 if scale is None else scale), l2norm(k.to(f)), v.to(f)
    decay = kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=f).exp()  # [N, H, K]
    b = torch.sigmoid(beta.to(f)) * (2.0 if allow_neg_eigval else 1.0)  # [N, H]
    S = S * decay[:, :, None, :]  # decay each key channel
    residual = v - (S * k[:, :, None, :]).sum(-1)  # v - kᵀS, [N, H, V]
    S = torch.addcmul(S, (b[..., None] * residual)[..., None], k[:, :, None, :])  # delta-rule write
    return (S * q[:, :, None, :]).sum(-1), S
