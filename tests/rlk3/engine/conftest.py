"""A k3-tiny model (fp32, CPU) shared by the engine tests."""

import pytest
import torch

from rlk3.model import K3Config, K3ForCausalLM


@pytest.fixture(scope="package")
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config()).eval()
