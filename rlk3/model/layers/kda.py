"""Kimi Delta Attention as K3 runs it (DESIGN.md §4).

Per head: q, k, v from linear projections, each through a causal depthwise short conv with SiLU; q and k
L2-normalised (in the op); a per-channel forget gate from a low-rank projection, bounded by default
``g = lower_bound · sigmoid(exp(A_log) · (x + dt_bias))`` with ``A_log`` per head and ``dt_bias`` per channel
(``kda_gate="softplus"`` gives Kimi Linear's unbounded gate); ``beta = sigmoid(b_proj(x))`` per head and token.
The output is a per-head RMSNorm times ``sigmoid`` of an output gate (full rank in K3, low rank in Kimi
Linear), then ``o_proj``. The recurrent state is fp32 and V-first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rlk3.model.cache import KDAState
from rlk3.model.layers.common import GatedRMSNorm
from rlk3.model.ops.kda import chunk_kda, fused_recurrent_kda


def causal_short_conv(
    x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor | None = None, pos_in_seq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x ``[B, T, D]``, weight ``[D, W]``, cache ``[B, W−1, D]`` (the previous
    inputs, zeros for a fresh sequence). ``pos_in_seq [T]`` (packed sequences) zeroes taps that would reach
    across a sequence start. Returns ``(y [B, T, D], new cache [B, W−1, D])``."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if cache is None:
        cache = x.new_zeros(B, W - 1, D)
    ext = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, W-1+T, D]
    y = torch.zeros_like(x)
    for j in range(W):
        back = W - 1 - j  # tap j reads the input `back` steps before t
        tap = ext[:, j : j + T]
        if pos_in_seq is not None and back > 0:
            tap = tap * (pos_in_seq >= back).to(x.dtype)[None, :, None]
        y = y + tap * weight[:, j].to(x.dtype)
    return F.silu(y), ext[:, ext.shape[1] - (W - 1) :]


class ShortConv(nn.Module):
    def __init__(self, dim: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, kernel_size))
        self.kernel_size = kernel_size

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.kernel_size)  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.weight, -bound, bound)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.kda_num_heads
        self.head_dim = K = config.kda_head_dim
        self.chunk_size = config.kda_chunk_size
        # the torch chunkwise path is fastest with 16-token chunks on a CPU (fewer wasted pairwise terms; same
        # result); FLA's kernels take the configured 32/64
        self.cpu_chunk_size = 16
        dim, hidden = H * K, config.hidden_size
        self.bounded = config.kda_gate == "bounded"
        self.lower_bound = config.kda_gate_lower_bound if self.bounded else None

        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv = ShortConv(dim, config.kda_conv_kernel_size)
        self.k_conv = ShortConv(dim, config.kda_conv_kernel_size)
        self.v_conv = ShortConv(dim, config.kda_conv_kernel_size)
        # forget-gate input: low rank (hidden -> head_dim -> H*K), in K3 as in Kimi Linear
        self.f_a_proj = nn.Linear(hidden, K, bias=False)
        self.f_b_proj = nn.Linear(K, dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        if config.kda_output_gate_rank is None:
            self.g_proj = nn.Linear(hidden, dim, bias=False)  # K3: one dense output gate
        else:
            self.g_a_proj = nn.Linear(hidden, config.kda_output_gate_rank, bias=False)
            self.g_b_proj = nn.Linear(config.kda_output_gate_rank, dim, bias=False)
        self.o_norm = GatedRMSNorm(K, eps=config.rms_norm_eps)  # one [K] weight shared by all heads
        self.o_proj = nn.Linear(dim, hidden, bias=False)

    def reset_gate_parameters(self) -> None:
        """FLA's init: dt from logU(1e-3, 1e-1) stored as inverse softplus; A_log zero for the bounded gate
        (a rate of 1), log U(1, 16) for the softplus gate."""
        with torch.no_grad():
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if self.bounded:
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(
        self,
        x: torch.Tensor,
        state: KDAState | None = None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        pos_in_seq: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KDAState | None]:
        """x ``[B, T, hidden]``; ``state`` continues earlier tokens (None: a fresh sequence); ``padding_mask``
        ``[B, T]`` zeroes pad positions so that (left) padding leaves the state untouched. Returns the output
        and, when a state was passed or ``T`` ends a prefill that should be cached, the new state."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if padding_mask is not None:
            x = x * padding_mask[..., None].to(x.dtype)
        conv_in = state.conv if state is not None else [None, None, None]
        q, cq = causal_short_conv(self.q_proj(x), self.q_conv.weight, conv_in[0], pos_in_seq)
        k, ck = causal_short_conv(self.k_proj(x), self.k_conv.weight, conv_in[1], pos_in_seq)
        v, cv = causal_short_conv(self.v_proj(x), self.v_conv.weight, conv_in[2], pos_in_seq)
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))
        g = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        beta = self.b_proj(x)

        kwargs = dict(
            A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
            initial_state=state.recurrent if state is not None else None, output_final_state=True,
            cu_seqlens=cu_seqlens,
        )
        # decode steps take the token-by-token kernel (forward only); prefill and training the chunked one
        decode = not torch.is_grad_enabled() and cu_seqlens is None and (64 if x.is_cuda else 1) >= T
        if decode:
            o, recurrent = fused_recurrent_kda(q, k, v, g, beta, **kwargs)
        else:
            chunk = self.chunk_size if x.is_cuda else self.cpu_chunk_size
            o, recurrent = chunk_kda(q, k, v, g, beta, safe_gate=self.bounded, chunk_size=chunk, **kwargs)

        gate = self._output_gate(x).view(B, T, H, K)
        o = self.o_norm(o, gate).reshape(B, T, H * K)
        new_state = KDAState(recurrent, [cq, ck, cv]) if cu_seqlens is None else None
        return self.o_proj(o), new_state
