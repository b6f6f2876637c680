"""Pinning MoE routing between two runs of the same model (the GPU tests compare kernel paths with it)."""

import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def pinned_routing(routes=None):
    """Records each MoE router call's expert choice (``routes=None``), or replays recorded choices in call order
    with weights from the current scores, as ``K3Router.forward`` computes them."""
    from rlk3.model.layers.moe import K3Router

    original = K3Router.forward
    record = routes is None
    routes = [] if record else routes
    replay = iter(routes)

    def forward(self, x):
        idx, w = original(self, x)
        if record:
            routes.append(idx)
            return idx, w
        idx = next(replay)
        w = torch.sigmoid(F.linear(x.float(), self.weight.float())).gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling

    K3Router.forward = forward
    try:
        yield routes
    finally:
        K3Router.forward = original
    assert record or next(replay, None) is None, "the replayed run made fewer router calls than were recorded"
