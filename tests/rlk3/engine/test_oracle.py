"""The full-forward oracle the engine tests compare against resolves a router near-tie only by an exact match with
the other side of that tie, and fails on anything else."""

import copy

import pytest
import torch

from tests.rlk3.engine import _oracle
from tests.rlk3.engine._oracle import ROUTER_TIE, assert_greedy_matches_full_forward, prompt


def _router_input(model, router: int, tokens: list[int]) -> torch.Tensor:
    seen = []
    hook = _oracle._routers(model)[router].register_forward_hook(lambda mod, inputs, out: seen.append(inputs[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]), use_cache=False)
    finally:
        hook.remove()
    return seen[0]


def _selection(router, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return router.scores(x) + router.e_score_correction_bias


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens and their log-probs from full forwards of ``model`` (the stand-in for an engine)."""
    out, logprobs = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            row = torch.log_softmax(model(torch.tensor([out]), use_cache=False).logits[0, -1].float(), -1)
            out.append(int(row.argmax()))
            logprobs.append(row[out[-1]].item())
    return out[len(ids) :], logprobs


def _tie(tiny, router: int, position: int, tokens: list[int]):
    """A copy of ``tiny`` whose router ``router`` ties its k-th and (k+1)-th choices at ``position`` (through the
    selection-only bias), and a copy of that where the expert the tie left out wins by 2e-6 instead."""
    tied = copy.deepcopy(tiny)
    r = _oracle._routers(tied)[router]
    k = r.top_k
    sel = _selection(r, _router_input(tied, router, tokens)[position])
    order = sel.topk(k + 1).indices
    with torch.no_grad():
        r.e_score_correction_bias[order[k]] += sel[order[k - 1]] - sel[order[k]]
    sel = _selection(r, _router_input(tied, router, tokens)[position])
    chosen = set(sel.topk(k).indices.tolist())
    left_out = next(e for e in sel.topk(k + 1).indices.tolist() if e not in chosen)
    other = copy.deepcopy(tied)
    with torch.no_grad():
        _oracle._routers(other)[router].e_score_correction_bias[left_out] += 2e-6
    return tied, other


def test_a_near_tie_is_resolved_only_by_an_exact_match_with_its_other_side(tiny):
    ids = prompt(20, seed=3)
    router, position = 2, 22  # the row of the third generated token
    draft, _ = _greedy(tiny, ids, 8)
    tied, other = _tie(tiny, router, position, ids + draft)
    generated, logprobs = _greedy(other, ids, 8)  # an "engine" whose arithmetic took the tie the other way
    tokens = ids + generated
    r = _oracle._routers(tied)[router]
    top = _selection(r, _router_input(tied, router, tokens)[position]).topk(r.top_k + 1).values
    assert 0 <= (top[-2] - top[-1]).item() < ROUTER_TIE
    # precondition: the two sides of the tie differ by far more than the tolerance
    rows = _oracle._logits(tied, tokens)[len(ids) - 1 :]
    assert _oracle._mismatch(rows, generated, logprobs, 1e-5) is not None
    before = len(_oracle.resolved_ties)
    ref = assert_greedy_matches_full_forward(tied, ids, generated, logprobs)
    assert _oracle.resolved_ties[before:] and _oracle.resolved_ties[-1][:2] == (router, position)
    assert max(abs(a - b) for a, b in zip(ref, logprobs)) <= 1e-5
    wrong = list(logprobs)
    wrong[-1] += 1e-3  # the other side of the tie, but one log-prob off: no side matches
    with pytest.raises(AssertionError, match=r"router near-ties \(router, position, gap\) tried: \[\(2, 22, "):
        assert_greedy_matches_full_forward(tied, ids, generated, wrong)


def test_without_a_near_tie_a_difference_fails(tiny):
    ids = prompt(20, seed=3)
    generated, logprobs = _greedy(tiny, ids, 8)
    assert_greedy_matches_full_forward(tiny, ids, generated, logprobs)
    logprobs[4] += 1e-4
    with pytest.raises(AssertionError, match=r"differ from the full forward's by up to 0.0001 .* tried: \[\]"):
        assert_greedy_matches_full_forward(tiny, ids, generated, logprobs)
    with pytest.raises(AssertionError, match="differ from the full forward's argmax"):
        assert_greedy_matches_full_forward(tiny, ids, [*generated[:-1], (generated[-1] + 1) % 4096])
