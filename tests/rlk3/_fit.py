"""Fitting k3-tiny to a few demonstrations in seconds, for tests that need a policy that behaves (varied answer
lengths, real tool calls) without a full SFT run."""

from __future__ import annotations

import torch

from harness import Harness


def fit(model, rows, steps: int, lr: float = 3e-3, target: float = 0.0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        total = 0.0
        for ids, labels in rows:
            loss = model(ids, labels=labels).loss
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if total / len(rows) < target:
            break
    return model.eval()


def demo_rows(tok, demos, preset):
    """One right-padded batch (causal layers: padding after a sequence does not change it)."""
    h = Harness(preset, tok)
    pairs = [h.assistant_mask(d.messages) for d in demos]
    T = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros(len(pairs), T, dtype=torch.long)
    labels = torch.full((len(pairs), T), -100)
    for r, (i, m) in enumerate(pairs):
        ids[r, : len(i)] = torch.tensor(i)
        labels[r, : len(i)] = torch.tensor([t if k else -100 for t, k in zip(i, m)])
    return [(ids, labels)]
