import pytest
import torch

from rlk3.algo.advantages import group_advantages, reward_spread


def test_grpo_normalises_within_groups_and_zero_spread_is_zero():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    g = ["a", "a", "a", "a", "b", "b", "c", "c"]
    adv = group_advantages(r, g)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:6], torch.zeros(2))  # all equal: no signal
    assert adv[6] < 0 < adv[7]
    unscaled = group_advantages(r, g, scale=False)
    assert torch.allclose(unscaled[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_rloo_is_leave_one_out_and_reinforce_uses_the_batch_mean():
    r = torch.tensor([3.0, 1.0, 2.0])
    assert torch.allclose(group_advantages(r, ["g"] * 3, "rloo"), torch.tensor([1.5, -1.5, 0.0]))
    assert torch.allclose(group_advantages(r, ["x", "y", "z"], "reinforce"), torch.tensor([1.0, -1.0, 0.0]))
    assert torch.equal(reward_spread(r, ["g", "g", "h"]), torch.tensor([2.0, 0.0]))


def test_bad_estimator_named():
    with pytest.raises(ValueError, match=r"must be one of \['grpo', 'rloo', 'reinforce'\], got 'ppo'"):
        group_advantages(torch.zeros(2), ["a", "a"], "ppo")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce"])
def test_negative_scale_shrinks_only_below_baseline_advantages(estimator):
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    g = ["a"] * 4 + ["b"] * 4
    full = group_advantages(r, g, estimator)
    for s in (0.0, 0.25):
        got = group_advantages(r, g, estimator, negative_scale=s)
        assert torch.equal(got[full >= 0], full[full >= 0])
        assert torch.allclose(got[full < 0], s * full[full < 0])
    assert (group_advantages(r, g, estimator, negative_scale=0.0) >= 0).all()
    with pytest.raises(ValueError, match=r"negative_scale must be in \[0, 1\], got 1.5"):
        group_advantages(r, g, estimator, negative_scale=1.5)
