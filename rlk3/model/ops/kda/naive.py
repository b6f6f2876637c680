"""The KDA recurrence, one token at a time: the ground truth every other path is tested against.

Per value head, with the state ``S`` a ``K × V`` matrix (key axis first):

    S ← diag(exp(g_t)) · S                       decay each key channel (row) first
    S ← S + k_t ⊗ β_t (v_t − k_tᵀ S)             delta-rule write, measured against the decayed state
    o_t = (scale · q_t)ᵀ S                       read

Nothing here is clever on purpose. It accepts FLA's argument names and layouts, including the in-kernel
options (gate, l2norm, beta sigmoid), ``state_v_first`` and varlen ``cu_seqlens``.
"""

from __future__ import annotations

import itertools

import torch

from rlk3.model.ops.kda._args import check_inputs, compute_dtype, preprocess, state_in, state_out


def _recur(q, k, v, g, beta, S):
    """q, k, g: [N, T, HV, K]; v: [N, T, HV, V]; beta: [N, T, HV]; S: [N, HV, K, V]. Returns (o, S)."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        residual = v[:, t] - torch.einsum("nhk,nhkv->nhv", kt, S)
        S = S + torch.einsum("nhk,nhv->nhkv", kt, beta[:, t].unsqueeze(-1) * residual)
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``(o [B,T,HV,V] in v.dtype, final state or None)``; the state is fp32 (fp64 for fp64 inputs)."""
    shapes = check_inputs(
        q, k, v, g, beta, initial_state=initial_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, fn="naive_recurrent_kda",
    )
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf = preprocess(
        q, k, v, g, beta, shapes=shapes, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, dtype=dtype,
    )
    S0 = state_in(initial_state, shapes, state_v_first, dtype, q.device)
    if cu_seqlens is None:
        o, S = _recur(qf, kf, vf, gf, bf, S0)
    else:
        offs = cu_seqlens.tolist()
        pieces, finals = [], []
        for n, (a, b) in enumerate(itertools.pairwise(offs)):
            o_n, S_n = _recur(qf[:, a:b], kf[:, a:b], vf[:, a:b], gf[:, a:b], bf[:, a:b], S0[n : n + 1])
            pieces.append(o_n)
            finals.append(S_n)
        o, S = torch.cat(pieces, dim=1), torch.cat(finals, dim=0)
    return o.to(v.dtype), (state_out(S, state_v_first) if output_final_state else None)
