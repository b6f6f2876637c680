"""Oracles the engine tests compare against: transformers' generate() and one full forward pass."""

import torch

from rlk3.engine import SamplingParams


def prompt(n: int, seed: int, vocab: int = 4096) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' own generate(), greedy, the request alone."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def hf_greedy_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' generate() on the whole batch, left-padded with an attention mask, greedy, n new tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


@torch.no_grad()
def full_forward_logprobs(model, ids: list[int], generated: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of each generated token under one full forward pass over the whole sequence."""
    logits = model(torch.tensor([ids + generated]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(generated)]


@torch.no_grad()
def assert_greedy_matches_full_forward(model, ids: list[int], generated: list[int], logprobs: list[float] | None = None,
                                       tol: float = 1e-5) -> list[float]:
    """Every generated token is the argmax of the full forward's logits at its position, and (when the engine's
    ``logprobs`` are given) its logprob equals the full forward's log-softmax there within ``tol``. Returns the full
    forward's logprobs."""
    logits = model(torch.tensor([ids + generated]), use_cache=False).logits[0].float()
    rows = logits[len(ids) - 1 : len(ids) - 1 + len(generated)]
    assert rows.argmax(-1).tolist() == generated
    ref = torch.log_softmax(rows, -1).gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()
    if logprobs is not None:
        assert len(logprobs) == len(ref)
        worst = max((abs(a - b) for a, b in zip(logprobs, ref)), default=0.0)
        assert worst <= tol, f"engine logprobs differ from the full forward's by up to {worst:.3g} (tolerance {tol})"
    return ref


def mixed_workload(engine, sampled: bool = False, new_weights: dict | None = None) -> list:
    """Prompts arriving together (steps of several sequences, short ones packed into one masked attention on CPU),
    a prefix-cache hit (a prefill resuming mid-prompt), a pause and resume, and an extension of a finished turn —
    after ``engine.update_weights(new_weights, version=1)`` when given. ``sampled``: the prompt that extends a cached
    prefix is drawn with a seed (top-p) instead of greedily. Returns every result, in order."""
    shared = prompt(300, seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    last = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=3) if sampled else greedy
    out = engine.generate([prompt(n, seed=n) for n in (5, 130, 2, 47, 19, 33)] + [shared + prompt(60, seed=60)],
                          [greedy] * 6 + [last])
    out += engine.generate([shared + prompt(90, seed=90), prompt(200, seed=200)],
                           SamplingParams(max_tokens=5, temperature=0))
    rid = engine.add_request(prompt(150, seed=150), SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    engine.pause(rid)
    engine.resume(rid)
    while engine.has_unfinished():
        engine.step()
    if new_weights is not None:
        engine.update_weights(new_weights, version=1)
    engine.extend(rid, prompt(170, seed=170))
    while engine.has_unfinished():
        engine.step()
    out.append(engine.result(rid))
    return out
