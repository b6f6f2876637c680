"""A k3-tiny fitted in seconds to a few general-domain demonstrations of mixed effort: sampled at temperature 1 it
answers at varied lengths (a few tokens at low effort, dozens at high), which partial-rollout tests need."""

from __future__ import annotations

import pytest
import torch

from harness.tokenizer import default_tokenizer
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.demos import build_demos
from tests.rlk3._fit import demo_rows, fit


@pytest.fixture(scope="session")
def general_policy():
    tok = default_tokenizer()
    torch.manual_seed(0)
    demos = build_demos("general", 8, tokenizer=tok, error_rate=0.2, seed=3)
    model = fit(K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))), demo_rows(tok, demos, "chat"), 20)
    return model, tok
