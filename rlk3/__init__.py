"""rlk3: agentic RL and multi-teacher on-policy distillation for K3-style hybrid models."""

__version__ = "0.1.0"
