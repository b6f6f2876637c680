"""Norms and gated activations shared by the K3 layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight (as Kimi/DeepSeek do)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) · w · sigmoid(gate)`` over the last axis, in fp32: KDA's per-head output norm and gate."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU, K3's softcapped SwiGLU: ``β·tanh(g/β)·sigmoid(g) · β_lin·tanh(u/β_lin)``, computed in fp32.

    The sigmoid takes the *uncapped* gate, so near the origin this is SwiGLU and as β → ∞ it becomes
    ``silu(g)·u``; the output is bounded by ``β·β_lin`` (100 with K3's 4 and 25) however large the input.
    """
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain SwiGLU (Kimi Linear's MLP), in fp32 like SiTU so the two differ only by the caps."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


class GLU(nn.Module):
    """The gated activation a config asks for."""

    def __init__(self, hidden_act: str, situ_beta: float, situ_linear_beta: float):
        super().__init__()
        self.hidden_act, self.beta, self.linear_beta = hidden_act, situ_beta, situ_linear_beta

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "situ":
            return situ_glu(gate, up, self.beta, self.linear_beta)
        return silu_glu(gate, up)


class MLP(nn.Module):
    """A gated MLP (dense layer, shared experts): ``down(act(gate(x), up(x)))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, config):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = GLU(config.hidden_act, config.situ_beta, config.situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
