"""Small numeric helpers shared by tests."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖a − e‖₂ / ‖e‖₂, i.e. FLA's relative RMS metric (the plain difference when the reference is all zero)."""
    actual, expected = actual.detach(), expected.detach()
    denom = expected.double().norm()
    diff = (actual.double() - expected.double()).norm()
    return float(diff / denom) if denom > 0 else float(diff)
