"""The counter sampler (sampling.py): its draws follow softmax(logits / T) restricted to the same top-k / top-p
support as the generator sampler, and are decided by (seed, position) alone."""

import math

import pytest
import torch

from rlk3.engine import EngineConfig, EngineConfigError, RolloutEngine, SamplingParams
from rlk3.engine.sampling import _restrict, counter_uniform, generator_seed, restrict, sample


def keys(seed, positions):
    return torch.stack([torch.full((len(positions),), seed), torch.as_tensor(positions)], dim=1).long()


def within_five_sigma(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum().item()
    freq = counts / n
    sigma = (probs * (1 - probs) / n).sqrt()
    bad = (freq - probs).abs() > 5 * sigma + 1e-9
    assert not bad.any(), f"frequencies {freq[bad].tolist()} against probabilities {probs[bad].tolist()}"


def test_uniforms_are_uniform_and_independent_across_positions_and_entries():
    u = counter_uniform(keys(7, range(4000)), 64)  # 256,000 draws
    assert u.min() > 0 and u.max() < 1
    hist = torch.histc(u, bins=16, min=0, max=1)
    within_five_sigma(hist, torch.full((16,), 1 / 16))
    # neighbouring positions and neighbouring entries are uncorrelated
    x = u - 0.5
    for a, b in ((x[1:], x[:-1]), (x[:, 1:], x[:, :-1])):
        corr = (a * b).mean() / (a.std() * b.std())
        assert abs(corr) < 5 / math.sqrt(a.numel()), corr


def test_the_top_uniform_stays_under_one_and_its_entry_wins_no_draw_by_it():
    """24 random bits b give (b + 0.5) / 2^24, whose top value float32 rounded to 1.0: Gumbel noise +inf, so that
    entry won the draw whatever its probability, outside top-k / top-p too (-inf + inf = NaN, argmax's pick). Seed 0
    at position 2,775 draws those bits for entry 502 of a 4,096-entry vocabulary (one entry in 2^24 does, per row:
    ~1% of the rows of K3's 163,840-entry vocabulary)."""
    u = counter_uniform(keys(0, [2775]), 4096)
    assert u[0, 502] == 1.0 - 2.0**-24 and u.max() < 1  # the top cell, just under 1
    logits = torch.zeros(1, 4096)
    logits[0, 7], logits[0, 502] = 40.0, -40.0  # entry 7 has all the mass
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=0.5, top_p=0.5)):
        tokens, logprobs = sample(logits, [params], [None], keys=keys(0, [2775]))
        assert tokens == [7] and logprobs[0] > -1e-6, (params, tokens, logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_counter_draws_follow_the_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    n = 40_000
    params = [SamplingParams(temperature=temperature, seed=0)] * n
    tokens, logprobs = sample(logits.expand(n, -1), params, [None] * n, keys=keys(3, range(n)))
    probs = torch.softmax(logits / temperature, dim=-1)
    within_five_sigma(torch.bincount(torch.tensor(tokens), minlength=12).float(), probs)
    assert logprobs[0] == pytest.approx(math.log(probs[tokens[0]].item()), abs=1e-5)


def test_restricted_support_equals_the_generator_samplers():
    torch.manual_seed(1)
    logp = torch.log_softmax(torch.randn(60, 40) * 3, dim=-1)
    ks = torch.tensor([0, 1, 3, 10, 40, 100] * 10)
    ps = torch.tensor([1.0, 0.9, 0.5, 0.05, 1e-6] * 12)
    got = restrict(logp, ks, ps).isfinite()
    for i in range(60):
        want = _restrict(logp[i], int(ks[i]), float(ps[i])) > 0
        assert torch.equal(got[i], want), (i, int(ks[i]), float(ps[i]))


def test_draws_stay_in_the_support_in_proportion():
    torch.manual_seed(2)
    logits = torch.randn(30)
    n = 30_000
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=0.95, seed=0)] * n
    tokens, _ = sample(logits.expand(n, -1), params, [None] * n, keys=keys(11, range(n)))
    support = _restrict(torch.log_softmax(logits, -1), 4, 0.95)
    counts = torch.bincount(torch.tensor(tokens), minlength=30).float()
    assert counts[support == 0].sum() == 0
    within_five_sigma(counts[support > 0], support[support > 0] / support.sum())


def test_seed_and_position_decide_the_draw_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=1.0, seed=0)] * 8
    k = torch.tensor([[5, 100], [6, 100], [5, 101], [5, 100], [2**62, 7], [0, 0], [1, 0], [5, 100]])
    full, _ = sample(logits[[0] * 8], params, [None] * 8, keys=k)
    assert full[0] == full[3] == full[7]  # the same key and logits: the same token
    alone, _ = sample(logits[:1], params[:1], [None], keys=k[:1])
    assert alone[0] == full[0]
    # other seeds and positions draw other noise: over 200 positions two seeds agree only by chance
    a, _ = sample(logits[[0] * 200], [params[0]] * 200, [None] * 200, keys=keys(5, range(200)))
    b, _ = sample(logits[[0] * 200], [params[0]] * 200, [None] * 200, keys=keys(6, range(200)))
    assert sum(x == y for x, y in zip(a, b)) < 150


@pytest.mark.parametrize("sampler", ["generator", "counter"])
def test_every_64_bit_seed_has_its_own_stream(tiny, sampler):
    """Seeds that differ only in their high bits draw different tokens: PyTorch's CPU generator keeps only the low
    32 bits of its seed (``s`` and ``s + 2**32`` drew alike before the seed was mixed), and the counter sampler's
    keys once folded seeds modulo 2**63. The same seed still draws the same tokens, up to the largest, 2**64 - 1."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=2**24, sampler=sampler))
    seeds = [5, 5 + 2**32, 5 + 2**63, 2**63 - 1, 2**64 - 1, 2**40 + 5]
    prompt = [3, 1, 4, 1, 5]
    drawn = [r.token_ids for r in engine.generate([prompt] * len(seeds),
                                                  [SamplingParams(max_tokens=12, seed=s) for s in seeds])]
    assert len({tuple(t) for t in drawn}) == len(seeds), drawn
    again = engine.generate([prompt], SamplingParams(max_tokens=12, seed=2**64 - 1))[0].token_ids
    assert again == drawn[4]
    # the mix is splitmix64's first output for the seed (the reference generator's known value for seed 0)
    assert generator_seed(0) == 0xE220A8397B1DCDAF


def test_sampler_is_validated_and_defaults_to_the_generator_on_cpu(tiny):
    with pytest.raises(EngineConfigError, match=r"sampler must be 'generator', 'counter' or None \(counter on CUDA"):
        EngineConfig(sampler="gumbel")
    assert not RolloutEngine(tiny, EngineConfig(memory_bytes=2**22)).counter_sampling
    assert RolloutEngine(tiny, EngineConfig(memory_bytes=2**22, sampler="counter")).counter_sampling
