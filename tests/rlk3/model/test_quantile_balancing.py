"""Quantile Balancing against the write-up's claims and against DeepSeek-V3's sign update."""

import pytest
import torch

from rlk3.model.quantile_balancing import (
    aux_free_sign_update,
    cutoff_margins,
    expert_load,
    histogram_edges,
    qb_bias_from_histogram,
    qb_histogram,
    quantile_balancing_bias,
    target_load,
    topk_with_bias,
)


def skewed_scores(N=4096, E=64, skew=3.0, seed=0):
    """Sigmoid router scores where a few experts win most tokens: per-expert offsets spread over ±skew."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g, dtype=torch.float64) + torch.linspace(-skew, skew, E, dtype=torch.float64)
    return torch.sigmoid(logits)


def imbalance(scores, bias, k):
    load = expert_load(topk_with_bias(scores, bias, k), scores.shape[1]).double()
    return float(load.max() / load.mean())


@pytest.mark.parametrize(("N", "E", "k"), [(4096, 64, 8), (1024, 16, 2), (960, 30, 3)])
def test_exactly_q_tokens_clear_each_new_threshold(N, E, k):
    scores = skewed_scores(N, E)
    bias = torch.randn(E, dtype=torch.float64) * 0.1
    assert (N * k) % E == 0
    q = target_load(N, k, E)
    new = quantile_balancing_bias(scores, bias, k, center=False)
    # with the batch's cutoffs held fixed: token i picks expert j iff s_ij + b_j > alpha_i
    alpha = (scores + bias).topk(k + 1, dim=-1).values[:, k]
    load = ((scores + new) > alpha[:, None]).sum(0)
    # Ties: every token's (k+1)-th expert j has margin exactly b_j (old), so an expert whose q-th and (q+1)-th
    # margins fall in that group cannot be given exactly q tokens by any threshold. Everywhere else: exactly q.
    top = (-cutoff_margins(scores, bias, k)).topk(q + 1, dim=0).values  # the q+1 largest margins, descending
    untied = top[q - 1] > top[q]
    assert untied.float().mean() >= 0.75
    assert (load[untied] == q).all(), load[untied].tolist()
    # in margin space the threshold -b_j lies strictly between the q-th and (q+1)-th largest margins
    assert ((top[q - 1] > -new) & (-new > top[q]))[untied].all()
    # a tied expert gets the tokens strictly above the tie: as close to q as any threshold can get, never more
    assert (load[~untied] < q).all()
    # mean-centring shifts every bias by one constant, which changes no selection
    centred = quantile_balancing_bias(scores, bias, k)
    assert abs(float(centred.mean())) < 1e-12
    assert torch.allclose(centred - new, (centred - new)[0].expand(E))


def test_qb_balances_a_skewed_batch_in_five_updates_and_beats_the_sign_update():
    scores, k, E = skewed_scores(), 8, 64
    start = imbalance(scores, torch.zeros(E, dtype=torch.float64), k)
    qb = torch.zeros(E, dtype=torch.float64)
    sign = torch.zeros(E, dtype=torch.float64)
    qb_trace, sign_trace = [], []
    for _ in range(5):
        qb = quantile_balancing_bias(scores, qb, k)
        load = expert_load(topk_with_bias(scores, sign, k), E)
        sign = aux_free_sign_update(load, sign, gamma=0.001)
        qb_trace.append(imbalance(scores, qb, k))
        sign_trace.append(imbalance(scores, sign, k))
    assert start > 3.0  # the batch is heavily skewed to begin with
    assert qb_trace[-1] < 1.1, qb_trace
    assert sign_trace[-1] > 2.0 * qb_trace[-1], (qb_trace, sign_trace)  # gamma=0.001 barely moves in 5 steps


def test_histogram_estimate_is_within_one_bin_of_exact():
    scores, k, E = skewed_scores(N=3000, E=32, seed=3), 4, 32
    bias = torch.randn(E, dtype=torch.float64) * 0.3
    edges = histogram_edges(bias, bins=500)
    width = float(edges[1] - edges[0])
    # two "data-parallel ranks" each count their half; the pooled counts are what an all-reduce would give
    halves = scores.split(1500)
    counts = sum(qb_histogram(h, bias, k, edges) for h in halves)
    assert counts.dtype == torch.int64 and counts.sum() == 3000 * E
    est = qb_bias_from_histogram(counts, edges, n_tokens=3000, k=k, center=False, dtype=torch.float64)
    exact = quantile_balancing_bias(scores, bias, k, center=False)
    assert (est - exact).abs().max() <= width
    est_c = qb_bias_from_histogram(counts, edges, n_tokens=3000, k=k, dtype=torch.float64)
    assert (est_c - quantile_balancing_bias(scores, bias, k)).abs().max() <= 2 * width


def test_bad_inputs():
    s = torch.rand(10, 8)
    with pytest.raises(ValueError, match=r"`scores` must be \[N, E\]"):
        quantile_balancing_bias(s[0], torch.zeros(8), 2)
    with pytest.raises(ValueError, match=r"`bias` must be \[E\]=\[8\]"):
        quantile_balancing_bias(s, torch.zeros(7), 2)
    with pytest.raises(ValueError, match=r"top-k must be in \[1, E-1\]=\[1, 7\], got 8"):
        quantile_balancing_bias(s, torch.zeros(8), 8)
