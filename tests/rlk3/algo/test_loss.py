"""The policy loss: per-token importance correction (truncated and masked), clipping, aggregation."""

import math

import pytest
import torch

from rlk3.algo.loss import LossConfig, importance_weights, policy_loss, token_logprobs


def batch(B=3, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = torch.ones(B, T)
    mask[:, :2] = 0  # prompt tokens
    return logp, mask


def test_on_policy_gradient_is_the_policy_gradient():
    """Fresh tokens (behaviour = current) and r = 1: d loss / d logp = -A / N on every generated token."""
    logp, mask = batch()
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, m = policy_loss(logp, logp.detach(), adv, mask, LossConfig())
    loss.backward()
    n = mask.sum()
    assert torch.allclose(logp.grad, -(adv[:, None] * mask) / n)
    assert m["stale_frac"] == 0.0 and m["is_weight_mean"] == pytest.approx(1.0)


def test_stale_tokens_are_reweighted_per_token():
    logp, mask = batch()
    behaviour = logp.detach().clone()
    behaviour[0, 3] -= math.log(1.5)  # sampled when this token was less likely: w = 1.5
    behaviour[1, 4] += math.log(4.0)  # w = 0.25
    w, keep = importance_weights(logp, behaviour, mask, LossConfig(is_mode="truncate", is_cap=2.0))
    assert w[0, 3] == pytest.approx(1.5) and w[1, 4] == pytest.approx(0.25)
    assert w[0, 2] == pytest.approx(1.0) and keep.equal(mask.bool())
    behaviour[2, 5] -= math.log(10.0)  # w = 10 -> truncated to the cap
    w, _ = importance_weights(logp, behaviour, mask, LossConfig(is_mode="truncate", is_cap=2.0))
    assert w[2, 5] == pytest.approx(2.0)
    # the gradient of a reweighted token scales by w
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, behaviour, torch.ones(3), mask, LossConfig(is_cap=2.0))[0].backward()
    assert lp.grad[0, 3] / lp.grad[0, 2] == pytest.approx(1.5)
    assert lp.grad[2, 5] / lp.grad[2, 4] == pytest.approx(2.0)


def test_masked_is_drops_tokens_outside_the_band_and_all_masked_sequences_give_zero():
    logp, mask = batch()
    behaviour = logp.detach().clone()
    behaviour[0, 2:] -= math.log(5.0)  # every generated token of sequence 0 is far off-policy
    cfg = LossConfig(is_mode="mask", is_low=0.5, is_high=2.0, aggregation="seq-mean-token-mean")
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(lp, behaviour, torch.tensor([1.0, 1.0, 1.0]), mask, cfg)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(lp.grad[0], torch.zeros(6))  # contributes nothing, and no NaN
    assert (lp.grad[1:, 2:] != 0).all()
    assert m["is_masked_frac"] == pytest.approx(4 / 12)
    # every token masked: loss 0, gradient 0
    lp2 = logp.clone().requires_grad_(True)
    loss2, _ = policy_loss(lp2, logp.detach() - 5.0, torch.ones(3), mask, cfg)
    loss2.backward()
    assert loss2.item() == 0.0 and torch.equal(lp2.grad, torch.zeros_like(lp2))


def test_masked_is_normalises_by_generated_tokens_so_a_split_batch_gives_the_same_gradient():
    """Masked IS zeroes the dropped tokens; the mean is still over every generated token. Dividing by the kept
    tokens instead made each micro-batch's denominator depend on what was masked in it, so the trainer's
    accumulated gradient depended on how the batch was packed."""
    cfg = LossConfig(is_mode="mask", is_low=0.5, is_high=2.0)
    logp = torch.full((2, 4), -1.0)
    behaviour = logp.clone()
    behaviour[0, :3] -= math.log(5.0)  # 3 of sequence 0's 4 tokens far off-policy: masked
    mask, adv = torch.ones(2, 4), torch.ones(2)
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, behaviour, adv, mask, cfg)[0].backward()
    # on-policy kept tokens (w = r = 1): d loss / d logp = -A / (generated tokens = 8); masked tokens 0
    want = torch.full((2, 4), -1 / 8)
    want[0, :3] = 0.0
    torch.testing.assert_close(lp.grad, want)
    # the trainer's accumulation: each micro-batch's loss × its generated tokens / the batch's
    split = logp.clone().requires_grad_(True)
    for r in (0, 1):
        loss, _ = policy_loss(split[r : r + 1], behaviour[r : r + 1], adv[r : r + 1], mask[r : r + 1], cfg)
        (loss * mask[r].sum() / mask.sum()).backward()
    torch.testing.assert_close(split.grad, want)
    # per sequence too: sequence 0's one kept token weighs 1/4, not 1 (the mask must not amplify what it keeps)
    lp.grad = None
    policy_loss(lp, behaviour, adv, mask, LossConfig(is_mode="mask", aggregation="seq-mean-token-mean"))[0].backward()
    want = torch.full((2, 4), -1 / 8)  # -A / (|y_b| · B)
    want[0, :3] = 0.0
    torch.testing.assert_close(lp.grad, want)


def test_ppo_kl_is_the_mean_log_ratio_of_pi_old_to_pi_theta_over_kept_tokens():
    r = torch.tensor([[1.5, 0.5, 1.0, 3.0]])  # π_θ / π_old; the last token is masked by IS (π_old / μ = 4)
    old = torch.full_like(r, -1.0)
    behaviour = old.clone()
    behaviour[0, 3] -= math.log(4.0)
    _, m = policy_loss(old + r.log(), behaviour, torch.ones(1, 4), torch.ones(1, 4), LossConfig(is_mode="mask"),
                       old_logp=old)
    assert m["ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, rel=1e-5)


def test_icepop_rejects_outside_the_band_and_weights_the_kept_tokens_by_their_ratio():
    """``icepop``: ``mask``'s band, and each kept token's gradient scaled by its π_old / μ (under ``mask`` it is 1)."""
    logp = torch.full((1, 5), -1.0)
    behaviour = logp - torch.tensor([[1.5, 0.8, 4.0, 0.25, 1.0]]).log()  # π_old / μ per token
    mask = torch.ones(1, 5)
    grads = {}
    for mode in ("mask", "icepop"):
        lp = logp.clone().requires_grad_(True)
        loss, m = policy_loss(lp, behaviour, torch.ones(1), mask, LossConfig(is_mode=mode, is_low=0.5, is_high=2.0),
                              old_logp=logp)
        loss.backward()
        grads[mode] = lp.grad[0]
        assert m["is_masked_frac"] == pytest.approx(2 / 5)  # 4 and 0.25 are outside [0.5, 2]
    torch.testing.assert_close(grads["mask"], torch.tensor([-1, -1, 0, 0, -1]) / 5)
    torch.testing.assert_close(grads["icepop"], torch.tensor([-1.5, -0.8, 0, 0, -1.0]) / 5)


@pytest.mark.parametrize("mode,mean", [
    ("mask", (1.5 + 0.8 + 1.0) / 3),  # the kept tokens' ratios (4 and 0.25 are outside [0.5, 2])
    ("icepop", (1.5 + 0.8 + 1.0) / 3),  # the same, now the weights applied
    ("truncate", (1.5 + 0.8 + 2.0 + 0.25 + 1.0) / 5),  # the applied weights, 4 capped at 2
    ("none", (1.5 + 0.8 + 4.0 + 0.25 + 1.0) / 5),  # the uncorrected ratios
])
def test_is_weight_metrics_report_the_ratios_of_the_tokens_the_loss_keeps(mode, mean):
    """is_weight_mean: π_old / μ over the tokens the loss keeps, capped under truncate; is_weight_max: the largest
    ratio before the cap or the mask. Under mask and none both read 1 (the constant weight the loss applies), and
    under truncate the max never passed the cap."""
    w = torch.tensor([[1.5, 0.8, 4.0, 0.25, 1.0, 8.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])  # the 8 is padding
    old = torch.full_like(w, -1.0)
    cfg = LossConfig(is_mode=mode, is_cap=2.0, is_low=0.5, is_high=2.0)
    _, m = policy_loss(old.clone(), old - w.log(), torch.ones(1, 6), mask, cfg, old_logp=old)
    assert m["is_weight_mean"] == pytest.approx(mean, rel=1e-5)
    assert m["is_weight_max"] == pytest.approx(4.0, rel=1e-5)
    assert m["is_masked_frac"] == pytest.approx(2 / 5 if mode in ("mask", "icepop") else 0.0)


def test_ppo_clip_stops_the_gradient_outside_the_trust_region():
    logp, mask = batch()
    old = logp.detach() - 0.5  # ratio e^0.5 ≈ 1.65 > 1 + clip_high
    lp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(lp, old, torch.ones(3), mask, LossConfig(), old_logp=old)
    loss.backward()
    assert m["clip_frac"] == 1.0
    assert torch.equal(lp.grad, torch.zeros_like(lp))  # positive advantage, ratio above the clip: no push
    lp.grad = None
    policy_loss(lp, old, -torch.ones(3), mask, LossConfig(), old_logp=old)[0].backward()
    assert (lp.grad[mask.bool()] > 0).all()  # negative advantage is not clipped from this side


def test_clip_frac_counts_the_tokens_where_the_clip_binds():
    """verl's pg_clipfrac: the share of tokens where min() takes the clipped term, so the clip cuts the gradient —
    r > 1 + ε_high with A > 0, r < 1 − ε_low with A < 0. A ratio outside the range on the other side of its advantage
    keeps its full gradient and is not counted (it was: 5 of 6 here instead of 2)."""
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, is_mode="none")
    r = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0, 1.5, 2.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0]])  # the last is padding
    old = torch.full_like(r, -1.0)
    lp = (old + r.log()).requires_grad_(True)
    _, m = policy_loss(lp, old, adv, mask, cfg, old_logp=old)
    assert m["clip_frac"] == pytest.approx(2 / 6)  # 1.5 with A > 0 and 0.5 with A < 0
    # the same tokens, read off the gradient: generated, A ≠ 0, and no gradient
    policy_loss(lp, old, adv, mask, cfg, old_logp=old)[0].backward()
    cut = (lp.grad == 0) & (adv != 0) & mask.bool()
    assert cut.tolist() == [[True, False, True, False, False, False, False]]


def test_clip_frac_is_over_the_tokens_masked_is_keeps():
    # masked IS drops a token whatever its ratio: it is neither counted nor in the denominator (verl's rejection
    # sampling removes it from the response mask the same way)
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, is_mode="mask", is_low=0.5, is_high=2.0)
    r = torch.tensor([[1.5, 1.5, 1.0, 1.0]])
    old = torch.full_like(r, -1.0)
    behaviour = old.clone()
    behaviour[0, 0] -= math.log(4.0)  # π_old / μ = 4: outside [0.5, 2], dropped
    _, m = policy_loss(old + r.log(), behaviour, torch.ones(1, 4), torch.ones(1, 4), cfg, old_logp=old)
    assert m["kept_tokens"] == 3 and m["clip_frac"] == pytest.approx(1 / 3)


def test_aggregations_differ_as_defined():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 3.0])
    token_mean = policy_loss(logp, logp, adv, mask, LossConfig(aggregation="token-mean"))[0]
    seq_mean = policy_loss(logp, logp, adv, mask, LossConfig(aggregation="seq-mean-token-mean"))[0]
    seq_sum = policy_loss(logp, logp, adv, mask, LossConfig(aggregation="seq-mean-token-sum"))[0]
    assert token_mean.item() == pytest.approx(-(4 * 1 + 3) / 5)
    assert seq_mean.item() == pytest.approx(-(1 + 3) / 2)
    assert seq_sum.item() == pytest.approx(-(4 + 3) / 2)


def test_kl_and_entropy_metrics_and_token_logprobs():
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    lp, ent = token_logprobs(logits, tokens, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(lp, ref)
    assert (ent > 0).all()
    mask = torch.ones(2, 5)
    _, m = policy_loss(lp, lp.detach(), torch.ones(2), mask, LossConfig(kl_coef=0.1), ref_logp=lp.detach() - 0.1,
                       entropy=ent)
    assert m["kl_ref"] == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-5)
    assert m["entropy"] == pytest.approx(float(ent.mean()), rel=1e-5)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match=r"loss.is_mode must be one of \['truncate', 'mask', 'icepop', 'none'\]"):
        LossConfig(is_mode="clip")
    with pytest.raises(ValueError, match=r"is_low <= 1 <= is_high"):
        LossConfig(is_low=1.5)
    with pytest.raises(ValueError, match=r"must have one shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), LossConfig())
