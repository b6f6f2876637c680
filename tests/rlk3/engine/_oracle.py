"""Oracles the engine tests compare against: transformers' generate() and one full forward pass."""

import torch


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
def assert_greedy_matches_full_forward(model, ids: list[int], generated: list[int], tol: float = 1e-5) -> None:
    """Every generated token is the argmax of the full forward's logits at its position, and its logprob equals
    the full forward's log-softmax there."""
    logits = model(torch.tensor([ids + generated]), use_cache=False).logits[0].float()
    rows = logits[len(ids) - 1 : len(ids) - 1 + len(generated)]
    assert rows.argmax(-1).tolist() == generated
    return torch.log_softmax(rows, -1).gather(1, torch.tensor(generated)[:, None])[:, 0].tolist()
