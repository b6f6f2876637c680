"""The RL trainer on real k3-tiny forward/backward passes: the update direction, packing invariance, the
per-token importance correction, Quantile Balancing's bias shipped with the weights, the dead-signal guard."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlk3.config import TrainConfig
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.trajectory import Status, Trajectory
from rlk3.train.trainer import DeadSignalError, Trainer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=300))


def traj(model, uid, group, reward, *, prompt=8, gen=6, seed=0, stale=0.0, status=Status.FINISHED):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (prompt + gen,), generator=g).tolist()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    beh = [logp[i - 1, ids[i]].item() - stale for i in range(prompt, prompt + gen)]
    return Trajectory(uid=uid, group_id=group, task_id="t", token_ids=ids, loss_mask=[0] * prompt + [1] * gen,
                      behaviour_logprobs=beh, policy_versions=[0] * gen, reward=reward, status=status)


def seq_logp(model, t):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([t.token_ids])).logits[0].float(), -1)
    return sum(logp[i - 1, t.token_ids[i]].item() for i, m in enumerate(t.loss_mask) if m)


def cfg(**kw):
    base = dict(lr=1e-3, qb_update=False, dead_signal_patience=3)
    base.update(kw)
    return TrainConfig(**base)


def test_a_step_raises_the_rewarded_sample_and_lowers_the_other(model):
    m = copy.deepcopy(model)
    good, bad = traj(m, "a", "g", 1.0, seed=1), traj(m, "b", "g", 0.0, seed=2)
    before = seq_logp(m, good), seq_logp(m, bad)
    metrics = Trainer(m, cfg()).step([good, bad])
    after = seq_logp(m, good), seq_logp(m, bad)
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["train/tokens"] == 12 and metrics["train/version"] == 1
    assert metrics["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: ratio 1


def grads(model, trajs, micro_batch_tokens, **kw):
    """The (clipped) gradient the optimizer would apply."""
    m = copy.deepcopy(model)
    tr = Trainer(m, cfg(micro_batch_tokens=micro_batch_tokens, **kw))
    got = {}
    tr.opt.step = lambda *a, **k: got.update({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    tr.step(copy.deepcopy(trajs))
    return got


def test_packing_does_not_change_the_gradient(model):
    trajs = [traj(model, f"u{i}", f"g{i // 2}", float(i % 2), seed=i, gen=4 + i) for i in range(6)]
    one = grads(model, trajs, 10_000)  # one micro-batch, right-padded
    many = grads(model, trajs, 20)  # one sequence per micro-batch
    assert one.keys() == many.keys() and one
    for k in one:
        assert torch.allclose(one[k], many[k], atol=1e-7, rtol=1e-3), k


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packing_does_not_change_the_gradient_under_masked_is(model, aggregation):
    # masked IS drops tokens unevenly across micro-batches (5 of sequence 0's 6 here): the loss must still sum to
    # the same aggregate whether the batch runs as 1, 2 or 4 micro-batches (rows are 14 tokens)
    trajs = [traj(model, f"u{i}", f"g{i // 2}", float(i % 2), seed=i) for i in range(4)]
    trajs[0].behaviour_logprobs = [x - 2.0 if k < 5 else x for k, x in enumerate(trajs[0].behaviour_logprobs)]
    kw = dict(is_mode="mask", is_low=0.5, is_high=2.0, aggregation=aggregation)
    one = grads(model, trajs, 10_000, **kw)
    for tokens in (28, 14):
        split = grads(model, trajs, tokens, **kw)
        assert one.keys() == split.keys() and one
        for k in one:
            torch.testing.assert_close(one[k], split[k], atol=1e-6, rtol=1e-4, msg=k)


def test_the_logged_means_do_not_depend_on_the_packing_under_masked_is(model):
    # masked IS keeps 1 of sequence 0's 6 tokens: a mean over kept tokens (clip_frac) must be combined across
    # micro-batches by their kept counts, or one sequence per micro-batch reads otherwise than one micro-batch
    trajs = [traj(model, f"u{i}", f"g{i // 2}", float(i % 2), seed=i) for i in range(4)]
    trajs[0].behaviour_logprobs = [x - 2.0 if k < 5 else x for k, x in enumerate(trajs[0].behaviour_logprobs)]
    kw = dict(is_mode="mask", is_low=0.5, is_high=2.0, lr=3e-2, ppo_epochs=2, clip_low=0.05, clip_high=0.05)
    one, split = (Trainer(copy.deepcopy(model), cfg(micro_batch_tokens=t, **kw)).step(copy.deepcopy(trajs))
                  for t in (10_000, 14))
    assert one["train/clip_frac"] > 0  # the second epoch's ratios left the clip range
    # the second epoch runs on weights the packing moved by float rounding (Adam enlarges it on near-zero gradients)
    for k in ("train/clip_frac", "train/ppo_kl", "train/is_weight_mean", "train/is_masked_frac", "train/entropy"):
        assert split[k] == pytest.approx(one[k], rel=1e-3), k


@pytest.mark.parametrize("aggregation,want", [("token-mean", 0.4), ("seq-mean-token-mean", 0.0),
                                              ("seq-mean-token-sum", 2.0)])
def test_the_logged_loss_is_the_aggregate_whatever_the_packing(model, aggregation, want):
    # GRPO advantages +1/-1 in two groups of 2, generated lengths 2, 10, 4, 4; on-policy, the per-token loss is -A:
    # token-mean -(2 - 10 + 4 - 4) / 20 = 0.4; seq-mean-token-mean -(1 - 1 + 1 - 1) / 4 = 0; seq-mean-token-sum
    # -(2 - 10 + 4 - 4) / 4 = 2 — in one micro-batch and in several
    trajs = [traj(model, f"u{i}", f"g{i // 2}", 1.0 - i % 2, seed=i, gen=(2, 10, 4, 4)[i]) for i in range(4)]
    for tokens in (10_000, 12):
        m = Trainer(copy.deepcopy(model), cfg(micro_batch_tokens=tokens, aggregation=aggregation))
        assert m.step(copy.deepcopy(trajs))["train/loss"] == pytest.approx(want, abs=1e-5), tokens


def test_stale_tokens_are_corrected_per_token(model):
    # behaviour log-probs 0.5 nats below the current policy: w = e^0.5 ≈ 1.65; truncated IS caps it, masked IS drops it
    trajs = [traj(model, "a", "g", 1.0, seed=1, stale=0.5), traj(model, "b", "g", 0.0, seed=2, stale=0.5)]
    t = Trainer(copy.deepcopy(model), cfg(is_mode="truncate", is_cap=1.2)).step(copy.deepcopy(trajs))
    assert t["train/is_weight_mean"] == pytest.approx(1.2, abs=1e-4)
    m = Trainer(copy.deepcopy(model), cfg(is_mode="mask", is_low=0.8, is_high=1.5)).step(copy.deepcopy(trajs))
    assert m["train/is_masked_frac"] == pytest.approx(1.0)
    # every token masked: no gradient at all, the weights do not move
    frozen = copy.deepcopy(model)
    Trainer(frozen, cfg(is_mode="mask", is_low=0.8, is_high=1.5)).step(copy.deepcopy(trajs))
    for x, y in zip(frozen.parameters(), model.parameters()):
        assert torch.equal(x, y)


def test_is_weight_mean_under_masked_is_is_the_kept_tokens_ratio_whatever_the_packing(model):
    # π_old / μ: sequence a e^0.3 on 3 tokens (kept) and e^2 on 3 (masked), sequence b e^-0.2 on all 6 (kept); the
    # mean over the 9 kept tokens, in one micro-batch and in one per sequence
    a, b = traj(model, "a", "g", 1.0, seed=1), traj(model, "b", "g", 0.0, seed=2)
    a.behaviour_logprobs = [x - (0.3 if k < 3 else 2.0) for k, x in enumerate(a.behaviour_logprobs)]
    b.behaviour_logprobs = [x + 0.2 for x in b.behaviour_logprobs]
    want = (3 * math.exp(0.3) + 6 * math.exp(-0.2)) / 9
    for tokens in (10_000, 14):
        c = cfg(is_mode="mask", is_low=0.5, is_high=2.0, micro_batch_tokens=tokens)
        got = Trainer(copy.deepcopy(model), c).step(copy.deepcopy([a, b]))
        assert got["train/is_weight_mean"] == pytest.approx(want, abs=1e-4), tokens
        assert got["train/is_weight_max"] == pytest.approx(math.exp(2.0), rel=1e-4), tokens
        assert got["train/is_masked_frac"] == pytest.approx(3 / 12), tokens
        assert got["train/kept_tokens"] == 9, tokens


def test_stale_frac_counts_tokens_of_older_policy_versions_not_engine_rounding(model):
    # behaviour log-probs 1e-4 nats off the trainer's (an engine's numerics), one sample from the previous version:
    # half the tokens are stale, whatever the rounding
    a, b = traj(model, "a", "g", 1.0, seed=1, stale=1e-4), traj(model, "b", "g", 0.0, seed=2, stale=1e-4)
    b.policy_versions = [1] * b.num_generated
    tr = Trainer(copy.deepcopy(model), cfg())
    tr.version = 1
    assert tr.step([a, b])["train/stale_frac"] == pytest.approx(0.5)


def test_staleness_max_counts_versions_behind_the_policy_being_trained(model):
    # the trainer at version 3; a resumed partial rollout sampled under versions 1 and 2, and overlapped rollouts
    # under 2 only: one version behind, though no trajectory's own versions span anything
    a, b, c = (traj(model, u, "g", float(i % 2), seed=i) for i, u in enumerate("abc"))
    a.policy_versions = [1] * 3 + [2] * 3
    b.policy_versions = c.policy_versions = [2] * 6
    for trajs, want in (([a, b], 2), ([b, c], 1)):
        tr = Trainer(copy.deepcopy(model), cfg())
        tr.version = 3
        assert tr.step(copy.deepcopy(trajs))["train/staleness_max"] == want


def test_quantile_balancing_updates_the_bias_and_ships_it(model):
    m = copy.deepcopy(model)
    tr = Trainer(m, cfg(qb_update=True))
    tr.step([traj(m, "a", "g", 1.0, seed=1, gen=20), traj(m, "b", "g", 0.0, seed=2, gen=20)])
    biases = {k: v for k, v in tr.weights().items() if k.endswith("e_score_correction_bias")}
    assert biases and any(v.abs().max() > 0 for v in biases.values())
    for v in biases.values():
        assert v.mean().abs() < 1e-5  # mean-centred
    # frozen at inference: a forward in eval mode records nothing and leaves the bias alone
    before = {k: v.clone() for k, v in biases.items()}
    with torch.no_grad():
        m.eval()(torch.tensor([[5, 6, 7]]))
    assert all(torch.equal(before[k], m.state_dict()[k]) for k in before)


def test_quantile_balancing_counts_real_tokens_not_the_packing_padding(model):
    # one micro-batch (short rows padded to the longest) vs one per row (no padding): the same routing statistics
    trajs = [traj(model, f"u{i}", "g", float(i % 2), seed=i, prompt=4 + 3 * i, gen=4 + 5 * i) for i in range(4)]
    biases = []
    for tokens in (4096, 1):
        m = copy.deepcopy(model)
        Trainer(m, cfg(qb_update=True, lr=1e-9, micro_batch_tokens=tokens)).step(copy.deepcopy(trajs))
        biases.append({k: v for k, v in m.state_dict().items() if k.endswith("e_score_correction_bias")})
    assert biases[0] and any(v.abs().max() > 0 for v in biases[0].values())
    for k in biases[0]:
        torch.testing.assert_close(biases[0][k], biases[1][k], atol=1e-6, rtol=0)


def test_failed_trajectories_are_never_trained_on(model):
    m = copy.deepcopy(model)
    trajs = [traj(m, "a", "g", 1.0, seed=1), traj(m, "b", "g", 0.0, seed=2),
             traj(m, "c", "g", 0.0, seed=3, status=Status.FAILED)]
    assert Trainer(m, cfg()).step(trajs)["train/sequences"] == 2


def test_dead_signal_warns_then_stops(model):
    logs = []
    tr = Trainer(copy.deepcopy(model), cfg(dead_signal_patience=3), log=logs.append)
    same = [traj(model, "a", "g", 1.0, seed=1), traj(model, "b", "g", 1.0, seed=2)]
    tr.step(copy.deepcopy(same))
    tr.step(copy.deepcopy(same))
    assert len(logs) == 2 and "zero reward spread" in logs[0]
    with pytest.raises(DeadSignalError, match="no learning signal for 3 steps"):
        tr.step(copy.deepcopy(same))


def test_minibatches_and_epochs_take_several_steps_against_one_old_policy(model):
    trajs = [traj(model, f"u{i}", f"g{i // 4}", float(i % 2), seed=i, gen=5) for i in range(8)]
    m = copy.deepcopy(model)
    tr = Trainer(m, cfg(lr=3e-2, minibatches=2, ppo_epochs=2, clip_low=0.05, clip_high=0.05))
    steps = []
    inner = tr.opt.step
    tr.opt.step = lambda *a, **k: (steps.append(1), inner(*a, **k))
    metrics = tr.step(copy.deepcopy(trajs))
    assert len(steps) == 4 and metrics["train/updates"] == 4
    assert metrics["train/version"] == 1  # one update published to the engine, however many optimizer steps
    assert metrics["train/tokens"] == 40  # the batch's tokens, not 4 passes' worth
    # later steps see ratios against π_old (the weights the batch started from), and a large step leaves the clip
    assert metrics["train/clip_frac"] > 0
    # the rewarded samples gained on the others
    gain = [seq_logp(m, t) - seq_logp(model, t) for t in trajs]
    assert sum(gain[1::2]) / 4 > sum(gain[0::2]) / 4
    # deterministic: the minibatch split is seeded by the version, so a second run is bit-identical
    m2 = copy.deepcopy(model)
    Trainer(m2, cfg(lr=3e-2, minibatches=2, ppo_epochs=2, clip_low=0.05, clip_high=0.05)).step(copy.deepcopy(trajs))
    assert all(torch.equal(x, y) for x, y in zip(m.parameters(), m2.parameters()))



def test_kl_reference_is_computed_once_per_batch_and_anchors(model):
    trajs = [traj(model, f"u{i}", f"g{i // 4}", float(i % 2), seed=i, gen=5) for i in range(8)]
    ref = copy.deepcopy(model)
    calls = []
    inner = ref.forward
    ref.forward = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    tr = Trainer(copy.deepcopy(model), cfg(lr=3e-2, kl_coef=0.5, minibatches=2, ppo_epochs=3), ref_model=ref)
    metrics = tr.step(copy.deepcopy(trajs))
    assert metrics["train/updates"] == 6
    assert len(calls) == 2  # one forward per micro-batch (one per minibatch here), not one per epoch
    assert metrics["train/kl_ref"] > 0  # the policy moved away from the reference within the update


def test_warmup_ramps_the_learning_rate_per_optimizer_step_and_survives_a_checkpoint(model):
    trajs = [traj(model, f"u{i}", f"g{i // 4}", float(i % 2), seed=i, gen=5) for i in range(8)]
    c = cfg(lr=1e-3, warmup_steps=4, minibatches=2)
    seen = []

    def trainer():
        tr = Trainer(copy.deepcopy(model), c)
        inner = tr.opt.step
        tr.opt.step = lambda *a, **k: (seen.append(tr.opt.param_groups[0]["lr"]), inner(*a, **k))
        return tr

    tr = trainer()
    tr.step(copy.deepcopy(trajs))
    assert seen == pytest.approx([2.5e-4, 5e-4])  # counts optimizer steps (two minibatches), not iterations
    # a trainer restored from a checkpoint continues the ramp where it stopped
    tr2 = trainer()
    tr2.load_state(copy.deepcopy(tr.state()))
    metrics = tr2.step(copy.deepcopy(trajs))
    tr2.step(copy.deepcopy(trajs))
    assert seen[2:] == pytest.approx([7.5e-4, 1e-3, 1e-3, 1e-3])
    assert metrics["train/lr"] == pytest.approx(1e-3)


def test_the_first_step_of_a_fresh_adamw_moves_weights_by_about_the_learning_rate(model):
    # why the warm-up exists: Adam's bias-corrected first step is lr * g / |g| per weight, whatever |g| is
    trajs = [traj(model, f"u{i}", f"g{i // 4}", float(i % 2), seed=i, gen=5) for i in range(8)]
    moved = {}
    for warmup in (0, 10):
        m = copy.deepcopy(model)
        Trainer(m, cfg(lr=1e-3, warmup_steps=warmup)).step(copy.deepcopy(trajs))
        w, w0 = m.lm_head.weight, model.lm_head.weight
        moved[warmup] = (w - w0).abs()[(w - w0) != 0].median().item()
    assert moved[0] == pytest.approx(1e-3, rel=0.05)
    assert moved[10] == pytest.approx(1e-4, rel=0.05)


def shared_prompt_batch(model):
    """Groups as a rollout makes them: members share their prompt token for token and differ after it (a tool output
    inside one member's reply, loss-masked); plus a group whose members differ from the first token (nothing to
    share) and a group of one."""
    out = []
    for g, (prompt, gens) in enumerate([(9, [3, 7, 12, 5]), (14, [6, 2, 9]), (5, [4, 4])]):
        head = torch.randint(5, 300, (prompt,), generator=torch.Generator().manual_seed(100 + g)).tolist()
        for j, n in enumerate(gens):
            t = traj(model, f"s{g}-{j}", f"s{g}", float(j % 2), prompt=0, gen=n, seed=10 * g + j)
            ids = head + t.token_ids
            mask = [0] * prompt + [1] * n
            if g == 0 and j == 2:  # a tool's output inside the reply: context, not trained on
                mask[prompt + 4: prompt + 7] = [0, 0, 0]
            out.append(_regrade(model, ids, mask, t.uid, t.group_id, t.reward))
    out += [traj(model, f"d{j}", "d", float(j), seed=50 + j, prompt=6, gen=5) for j in range(2)]  # differ at token 0
    out.append(traj(model, "solo", "solo", 1.0, seed=60, prompt=7, gen=4))
    return out


def _regrade(model, ids, mask, uid, group, reward):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    beh = [logp[i - 1, ids[i]].item() for i, m in enumerate(mask) if m]
    return Trajectory(uid=uid, group_id=group, task_id="t", token_ids=ids, loss_mask=mask, behaviour_logprobs=beh,
                      policy_versions=[0] * len(beh), reward=reward, status=Status.FINISHED)


@pytest.mark.parametrize("micro_batch_tokens", [10_000, 30])
def test_shared_prompts_give_the_same_gradient_for_less_compute(model, micro_batch_tokens):
    """``train.share_prompts``: a group's prompt runs once and its members continue from its KDA/MLA states; the
    gradient, loss and metrics equal the full rows' (to float rounding), with fewer tokens through the model."""
    trajs = shared_prompt_batch(model)
    got, metrics, fed = {}, {}, {}
    for share in (False, True):
        m = copy.deepcopy(model)
        tr = Trainer(m, cfg(micro_batch_tokens=micro_batch_tokens, share_prompts=share))
        tr.opt.step = lambda *a, s=share, m=m, **k: got.update(
            {s: {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}})
        fed[share] = 0

        def count(_mod, args, s=share):
            fed[s] += args[0].numel()

        m.model.embed_tokens.register_forward_pre_hook(count)
        metrics[share] = tr.step(copy.deepcopy(trajs))
    assert got[False].keys() == got[True].keys() and got[False]
    for k in got[False]:
        torch.testing.assert_close(got[True][k], got[False][k], atol=1e-6, rtol=1e-4, msg=k)
    for k in ("train/tokens", "train/sequences", "train/loss", "train/is_weight_mean", "train/grad_norm"):
        assert metrics[True][k] == pytest.approx(metrics[False][k], rel=1e-5, abs=1e-7), k
    if micro_batch_tokens > 1000:  # one micro-batch: prompts of 9, 14, 5 tokens once instead of 4, 3, 2 times
        assert fed[True] <= fed[False] - ((4 - 1) * 8 + (3 - 1) * 13 + (2 - 1) * 4), fed


def test_shared_prompts_record_each_routed_token_once(model):
    m = copy.deepcopy(model)
    tr = Trainer(m, cfg(share_prompts=True, qb_update=True))
    trajs = shared_prompt_batch(m)
    (b, *rest) = tr._pack_shared(trajs, tr.advantages(trajs))
    assert b.prefix is not None and [x.prefix for x in rest] == [None]  # the unshareable groups: one plain batch
    tr._logits(m, b, qb=True)
    distinct = int(b.prefix.mask.sum()) + int(b.valid.sum()) - int(b.prefix.repeats.sum()) + len(b.prefix.repeats)
    for r in tr.routers:
        assert r.pop_scores().shape[0] == distinct
