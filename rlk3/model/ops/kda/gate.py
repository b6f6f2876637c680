"""KDA forget gates in log space, as torch references.

K3 bounds the gate: ``g = lower_bound · sigmoid(exp(A_log) · (x + dt_bias))`` lands in ``[lower_bound, 0)``, so one
token can never erase a channel completely and a 16-token chunk's cumulative decay stays inside bf16 range
(what lets FLA's ``safe_gate`` path use dense tensor-core tiles). Kimi Linear's unbounded softplus gate is kept
for the converter and the external oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Turns raw gate logits ``g [..., H, K]`` into log decays.

    ``A_log`` is per head ``[H]``; ``dt_bias`` per channel ``[H*K]``. With ``lower_bound`` set the gate is the
    bounded sigmoid form (``A_log=None`` means a rate of 1); otherwise the softplus form, which needs ``A_log``.
    """
    H, K = g.shape[-2:]
    x = g.to(output_dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(output_dtype).view(H, K)
    if lower_bound is not None:
        if A_log is not None:
            x = A_log.to(output_dtype).view(H, 1).exp() * x
        # sigmoid rounds to exactly 0 below about -104 in fp32; clamping at -80 (sigmoid ≈ 2e-35) keeps the gate
        # strictly inside [lower_bound, 0) as the safe-gate kernels assume, and changes nothing measurable
        return lower_bound * torch.sigmoid(x.clamp(min=-80.0))
    if A_log is None:
        raise ValueError("kda_gate: the softplus gate (lower_bound=None) needs A_log [H]; got None")
    return -A_log.to(output_dtype).view(H, 1).exp() * F.softplus(x)
