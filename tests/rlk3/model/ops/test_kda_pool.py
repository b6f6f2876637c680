"""KDA decode over a state pool: in-place by index, equal to running each sequence alone; FLA's kernel on GPU."""

import pytest
import torch

from rlk3.model.ops.kda import fused_recurrent_kda, fused_recurrent_kda_pool
from tests._util import rel_err


def _inputs(N, T, H, K, device="cpu"):
    """Raw in-kernel inputs as K3's layer passes them (gate logits, beta logits, un-normalised q/k)."""
    mk = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    return mk(N, T, H, K), mk(N, T, H, K), mk(N, T, H, K), mk(N, T, H, K), mk(N, T, H)


KW = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          lower_bound=-5.0, state_v_first=True)


def _strided_pool(P, H, K, device="cpu", pad=37):
    """A pool whose slots sit inside larger pages (stride(0) > H*K*K), as the engine lays them out."""
    pages = torch.randn(P, H * K * K + pad, device=device)
    return pages[:, : H * K * K].view(P, H, K, K)


@pytest.mark.parametrize("T", [1, 3])
def test_pool_step_equals_separate_sequences_and_leaves_other_slots(T):
    N, H, K, P = 4, 2, 16, 9
    q, k, v, g, beta = _inputs(N, T, H, K)
    A_log, dt_bias = torch.randn(H) * 0.1, torch.randn(H * K) * 0.1
    pool = _strided_pool(P, H, K)
    assert pool.stride(0) != H * K * K
    before = pool.clone()
    idx = torch.tensor([7, 0, 3, 5])
    o = fused_recurrent_kda_pool(q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, **KW)
    o_ref, s_ref = fused_recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=before[idx].contiguous(),
        output_final_state=True, **KW,
    )
    assert rel_err(o, o_ref) <= 1e-6
    assert rel_err(pool[idx], s_ref) <= 1e-6
    untouched = [i for i in range(P) if i not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])  # bit-identical, as FLA's own vLLM test demands


def test_pool_rejects_bad_arguments():
    q, k, v, g, beta = _inputs(2, 1, 2, 16)
    pool = torch.zeros(4, 2, 16, 16)
    with pytest.raises(ValueError, match="selects a slot twice"):
        fused_recurrent_kda_pool(q, k, v, g, beta, pool, torch.tensor([1, 1]), **KW)
    with pytest.raises(ValueError, match=r"`state_pool` must be \[P, HV, V, K\] with slot shape \[2, 16, 16\]"):
        fused_recurrent_kda_pool(q, k, v, g, beta, torch.zeros(4, 2, 8, 16), torch.tensor([0, 1]), **KW)
    with pytest.raises(ValueError, match="must be float32"):
        fused_recurrent_kda_pool(q, k, v, g, beta, pool.double(), torch.tensor([0, 1]), **KW)
    with pytest.raises(ValueError, match=r"one slot per sequence \(N=2\)"):
        fused_recurrent_kda_pool(q, k, v, g, beta, pool, torch.tensor([0, 1, 2]), **KW)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H,K,T", [(2, 32, 1), (8, 128, 1), (8, 128, 5)])
def test_fla_pool_decode_equals_torch_reference(H, K, T):
    """FLA's fused recurrent kernel, updating strided state slots in place by index, equals the torch path; with
    T > 1 tokens a sequence, no state lands in another sequence's slot (FLA's in-place store is per token)."""
    N, P = 16, 40
    q, k, v, g, beta = _inputs(N, T, H, K, device="cuda")
    A_log, dt_bias = torch.randn(H, device="cuda") * 0.1, torch.randn(H * K, device="cuda") * 0.1
    pool_fla = _strided_pool(P, H, K, device="cuda")
    pool_ref = pool_fla.clone()
    before = pool_fla.clone()
    idx = torch.randperm(P, device="cuda")[:N]
    o_fla = fused_recurrent_kda_pool(
        q, k, v, g, beta, pool_fla, idx, A_log=A_log, dt_bias=dt_bias, backend="fla", **KW
    )
    o_ref = fused_recurrent_kda_pool(
        q, k, v, g, beta, pool_ref, idx, A_log=A_log, dt_bias=dt_bias, backend="torch", **KW
    )
    assert rel_err(o_fla, o_ref) <= 1e-5
    assert rel_err(pool_fla[idx], pool_ref[idx]) <= 1e-5
    mask = torch.ones(P, dtype=torch.bool, device="cuda")
    mask[idx] = False
    assert torch.equal(pool_fla[mask], before[mask])
