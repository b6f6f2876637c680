"""Chunkwise KDA in plain torch: the CPU path for training and prefill, differentiable by autograd.

Within a chunk of C tokens write ``Γ_r = Σ_{s≤r} g_s`` (cumulative log decay per key channel) and
``δ_s = β_s (v_s − k_sᵀ D_s S_{s−1})`` (the delta each token writes). Unrolling the recurrence of ``naive.py``:

    S_r = diag(e^{Γ_r}) · (S_0 + Σ_{s≤r} diag(e^{−Γ_s}) k_s δ_sᵀ)

so the deltas solve one unit lower-triangular system per chunk,

    (I + A) Δ = diag(β) (V − (K ⊙ e^{Γ}) S_0),   A_rs = β_r Σ_c k_rc k_sc e^{Γ_rc − Γ_sc}  (s < r)

i.e. ``Δ = U − W S_0`` with ``U = (I+A)⁻¹ diag(β) V`` and ``W = (I+A)⁻¹ diag(β) (K ⊙ e^{Γ})`` (the WY form),
both independent of the state. The chunk's outputs and final state are then dense matmuls:

    O = (Q ⊙ e^{Γ}) S_0 + M Δ,      M_rs = Σ_c q_rc k_sc e^{Γ_rc − Γ_sc}  (s ≤ r)
    S_C = diag(e^{Γ_C}) S_0 + (K ⊙ e^{Γ_C − Γ})ᵀ Δ

Only the state hand-off between chunks is sequential. Every exponent above is ≤ 0 *if it is formed as a
difference*; factoring ``e^{Γ_r − Γ_s} = e^{Γ_r} e^{−Γ_s}`` overflows once a chunk decays by more than ~88 nats
(fp32), which the unbounded softplus gate reaches easily. So the decayed Gram matrices are built in 16-token
sub-chunks: off the diagonal a factorisation through the sub-chunk boundaries (``e^{Γ_r − Γ_b}``, ``e^{Γ_b − Γ_e}``,
``e^{Γ_e − Γ_s}``, every factor ≤ 1); on the diagonal one matmul when the decay inside each sub-chunk is bounded
(K3's gate: at most 5 nats a token) and exact pairwise differences when it is not (an unbounded softplus gate).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from rlk3.model.ops.kda._args import Shapes, check_inputs, compute_dtype, preprocess, state_in, state_out

CHUNK_SIZES = (16, 32, 64)
SUB_CHUNK = 16


# Largest decay (nats) inside one sub-chunk for which the diagonal blocks may be factored as
# e^{Γ_r − Γ_b} · e^{Γ_b − Γ_s}: the second factor reaches e^{decay}, which must stay finite (fp32 overflows past
# e^88.7). K3's bounded gate keeps a 16-token sub-chunk under 16 × 5 = 80 nats, so it always takes this path.
_SAFE_SUB_CHUNK_DECAY = {torch.float32: 85.0, torch.float64: 700.0}


def _decayed_gram(x: torch.Tensor, y: torch.Tensor, G: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """``M[..., r, s] = Σ_c x[r,c] y[s,c] exp(G[r,c] − G[s,c])`` for s < r (s ≤ r if inclusive), else 0.

    x, y, G: [..., C, K] with G non-increasing along C (a cumulative sum of log decays). Returns [..., C, C].
    """
    *lead, C, K = x.shape
    c = min(SUB_CHUNK, C)
    n = C // c
    xs, ys, Gs = (t.reshape(*lead, n, c, K) for t in (x, y, G))
    r_idx = torch.arange(c, device=x.device)
    keep = (r_idx[:, None] >= r_idx[None, :]) if inclusive else (r_idx[:, None] > r_idx[None, :])

    ends = Gs[..., -1, :]  # [..., n, K]   Γ at the last token of each sub-chunk
    starts = torch.cat([torch.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], dim=-2)  # Γ before sub-chunk i
    x_from_start = xs * (Gs - starts.unsqueeze(-2)).exp()  # x_r e^{Γ_r − Γ_b(i)}, factor <= 1

    # diagonal sub-blocks
    if bool((starts - ends).amax() < _SAFE_SUB_CHUNK_DECAY.get(x.dtype, 60.0)):
        # bounded decay inside every sub-chunk (always so for K3's gate): one matmul per block
        y_back = ys * (starts.unsqueeze(-2) - Gs).exp()  # y_s e^{Γ_b − Γ_s} <= e^{sub-chunk decay}
        diag = (x_from_start @ y_back.transpose(-1, -2)).masked_fill(~keep, 0.0)
    else:
        # exact pairwise exponent differences, masked to -inf before exp (no overflow whatever the decay)
        diff = Gs.unsqueeze(-2) - Gs.unsqueeze(-3)  # [..., n, c(r), c(s), K]
        diff = diff.masked_fill(~keep[..., None], float("-inf"))
        diag = torch.einsum("...irk,...isk,...irsk->...irs", xs, ys, diff.exp())
    if n == 1:
        return diag.reshape(*lead, C, C)

    # off-diagonal sub-blocks (j < i): factor through the boundaries, every factor <= 1
    y_to_end = ys * (ends.unsqueeze(-2) - Gs).exp()  # y_s e^{Γ_e(j) − Γ_s}
    between = starts.unsqueeze(-2) - ends.unsqueeze(-3)  # [..., n(i), n(j), K]: Γ_b(i) − Γ_e(j)
    blk = torch.arange(n, device=x.device)
    between = between.masked_fill(~(blk[:, None] > blk[None, :])[..., None], float("-inf"))
    off = (x_from_start.unsqueeze(-3) * between.exp().unsqueeze(-2)) @ y_to_end.unsqueeze(-4).transpose(-1, -2)
    eye = torch.eye(n, dtype=x.dtype, device=x.device)[:, :, None, None]
    full = off + eye * diag.unsqueeze(-3)  # [..., n(i), n(j), c(r), c(s)]
    return full.transpose(-3, -2).reshape(*lead, C, C)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower-triangular ``A [..., C, C]`` (C a power of two) by recursive 2×2 block
    inversion: ``[[E, 0], [L21, O]]⁻¹ = [[E⁻¹, 0], [−O⁻¹ L21 E⁻¹, O⁻¹]]``, all blocks of one size at once.
    Batched matmuls only (LAPACK's per-matrix triangular solve is slow for many small systems on a CPU), and
    stable: no power series whose terms grow combinatorially when keys repeat."""
    *lead, C, _ = A.shape
    inv = torch.ones(*lead, C, 1, 1, dtype=A.dtype, device=A.device)  # inverses of the 1x1 diagonal blocks
    b = 1
    while b < C:
        m = C // (2 * b)
        blocks = A.reshape(*lead, m, 2 * b, m, 2 * b).diagonal(dim1=-4, dim2=-2)  # [..., 2b, 2b, m]
        blocks = blocks.permute(*range(len(lead)), -1, -3, -2)  # [..., m, 2b, 2b]
        E, O = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -(O @ blocks[..., b:, :b] @ E)
        inv = torch.cat([torch.cat([E, torch.zeros_like(E)], -1), torch.cat([lower, O], -1)], -2)
        b *= 2
    return inv[..., 0, :, :]


def _chunk_forward(q, k, v, g, beta, S, chunk_size, states: list | None = None):
    """All inputs in the compute dtype, head-major: q, k, g [N, HV, T, K], v [N, HV, T, V], beta [N, HV, T],
    S [N, HV, K, V]; T divisible by chunk_size. Returns (o [N, HV, T, V], S). ``states``: a list that receives the
    state entering each chunk."""
    N, HV, T, K = q.shape
    C = chunk_size
    NT = T // C
    q, k, g = (t.reshape(N, HV, NT, C, K) for t in (q, k, g))
    v = v.reshape(N, HV, NT, C, -1)
    beta = beta.reshape(N, HV, NT, C, 1)

    G = g.cumsum(dim=-2)
    A = beta * _decayed_gram(k, k, G, inclusive=False)
    rhs = torch.cat([beta * k * G.exp(), beta * v], dim=-1)
    wu = unit_lower_inverse(A) @ rhs
    W, U = wu[..., :K], wu[..., K:]
    M = _decayed_gram(q, k, G, inclusive=True)
    q_decayed = q * G.exp()
    G_last = G[..., -1:, :]
    k_to_end = k * (G_last - G).exp()
    decay_last = G_last.exp().transpose(-1, -2)  # [N, HV, NT, K, 1]

    outs = []
    for t in range(NT):
        if states is not None:
            states.append(S)
        delta = U[:, :, t] - W[:, :, t] @ S
        outs.append(q_decayed[:, :, t] @ S + M[:, :, t] @ delta)
        S = decay_last[:, :, t] * S + k_to_end[:, :, t].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2).reshape(N, HV, T, -1)
    return o, S


def _to_padded(x: torch.Tensor, offs: list[int], T_pad: int) -> torch.Tensor:
    """[1, ΣT, ...] -> [N, T_pad, ...], each sequence left-aligned and zero-padded at its end."""
    pieces = [F.pad(x[0, a:b], (0, 0) * (x.dim() - 2) + (0, T_pad - (b - a))) for a, b in itertools.pairwise(offs)]
    return torch.stack(pieces, dim=0)


def torch_chunk_kda(
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
    return_intermediate_states: bool = False,
    _shapes: Shapes | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunkwise KDA with FLA's signature; see the module docstring. Returns (o in v.dtype, final state or None), and
    with ``return_intermediate_states`` also FLA's ``h``: the state entering every chunk of ``chunk_size`` tokens,
    ``[B, NT, HV, K, V]`` (``[.., V, K]`` with ``state_v_first``) in k's dtype; with ``cu_seqlens`` B = 1 and the
    sequences' chunks follow one another (sequence n's chunk j at ``Σ_{m<n} ceil(T_m / chunk_size) + j``)."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"torch_chunk_kda: `chunk_size` must be one of {CHUNK_SIZES}, got {chunk_size}")
    shapes = _shapes or check_inputs(
        q, k, v, g, beta, initial_state=initial_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, A_log=A_log,
        dt_bias=dt_bias, fn="chunk_kda",
    )
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf = preprocess(
        q, k, v, g, beta, shapes=shapes, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, dtype=dtype,
    )
    S0 = state_in(initial_state, shapes, state_v_first, dtype, q.device)
    longest = shapes.T if cu_seqlens is None else max(b - a for a, b in itertools.pairwise(cu_seqlens.tolist()))
    # a sequence shorter than the chunk gains nothing from padding up to it (same result, less work); the
    # intermediate states are promised on the caller's chunk grid
    while not return_intermediate_states and chunk_size > SUB_CHUNK and chunk_size // 2 >= longest:
        chunk_size //= 2

    # Pad every sequence at its end to a multiple of the chunk. Pad tokens carry k = v = β = 0 and g = 0
    # (no decay), so they leave the state exactly as the last real token left it.
    if cu_seqlens is None:
        offs = None
        T_pad = -(-shapes.T // chunk_size) * chunk_size
        tensors = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, T_pad - shapes.T)) for t in (qf, kf, vf, gf, bf)]
    else:
        offs = cu_seqlens.tolist()
        longest = max(b - a for a, b in itertools.pairwise(offs))
        T_pad = max(chunk_size, -(-longest // chunk_size) * chunk_size)
        tensors = [_to_padded(t, offs, T_pad) for t in (qf, kf, vf, gf, bf)]
    qp, kp, vp, gp, bp = (t.transpose(1, 2) for t in tensors)  # head-major

    entering = [] if return_intermediate_states else None
    o, S = _chunk_forward(qp, kp, vp, gp, bp, S0, chunk_size, entering)
    o = o.transpose(1, 2)  # [N, T_pad, HV, V]
    if offs is None:
        o = o[:, : shapes.T]
    else:
        o = torch.cat([o[n, : b - a] for n, (a, b) in enumerate(itertools.pairwise(offs))], dim=0).unsqueeze(0)
    out = o.to(v.dtype).contiguous(), (state_out(S, state_v_first) if output_final_state else None)
    if not return_intermediate_states:
        return out
    h = torch.stack(entering, dim=1)  # [N, NT_pad, HV, K, V]
    h = h.transpose(-1, -2) if state_v_first else h
    if offs is None:
        h = h[:, : -(-shapes.T // chunk_size)]
    else:
        h = torch.cat([h[n, : -(-(b - a) // chunk_size)] for n, (a, b) in enumerate(itertools.pairwise(offs))])[None]
    return *out, h.to(k.dtype).contiguous()
