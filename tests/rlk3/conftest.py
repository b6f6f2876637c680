"""A k3-tiny fitted in seconds to a few general-domain demonstrations of mixed effort: sampled at temperature 1 it
answers at varied lengths (a few tokens at low effort, dozens at high), which partial-rollout tests need."""

from __future__ import annotations

import pytest
import torch

from harness import Harness
from harness.tokenizer import default_tokenizer
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.demos import build_demos


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


@pytest.fixture(scope="session")
def general_policy():
    tok = default_tokenizer()
    torch.manual_seed(0)
    demos = build_demos("general", 8, tokenizer=tok, error_rate=0.2, seed=3)
    model = fit(K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))), demo_rows(tok, demos, "chat"), 20)
    return model, tok
