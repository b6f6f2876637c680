"""A k3-tiny model (fp32, CPU) shared by the engine tests."""

import pytest
import torch

from rlk3.model import K3Config, K3ForCausalLM


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """k3-tiny's matmuls are too small to gain from a second thread, and on a shared 2-core machine OpenMP's
    barriers make every op wait for a descheduled thread (a step measured 20-40x slower). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config()).eval()
