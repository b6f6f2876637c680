"""Sampling one token per sequence, with the logprob the trainer recomputes.

The logprob of the chosen token is taken under ``softmax(logits / temperature)`` over the whole vocabulary (plain
``softmax(logits)`` for greedy), before top-k / top-p: that is the behaviour distribution a trainer can recompute
from the same logits, and what the per-token off-policy correction divides by. Top-k / top-p only restrict where
the draw may land.

Two samplers give the same distribution and the same guarantees — a seeded request gets the same tokens whatever
else shares its batch, and a paused or extended request continues its random stream where it stopped:

- ``generator`` (the default): each request draws from its own ``torch.Generator``, one row at a time.
- ``counter`` (``EngineConfig.sampler``): the noise of request ``r`` at token position ``t`` for vocabulary entry
  ``v`` is a hash of ``(seed_r, t, v)`` (splitmix64), turned into Gumbel noise; the token is
  ``argmax(log p + noise)`` over the top-k / top-p support (the Gumbel-max trick draws exactly from the renormalised
  restricted distribution). Every row is sampled by the same batched ops (~65 operators, ~95 with top-p), so a batch
  of 128 rows costs as many kernel launches on a GPU as one row, where the generator sampler dispatches 6-15 per
  drawn row (776 at batch 128, 1,928 with top-p: bench/sampling.py). On a CPU the hashing costs more than it saves
  above ~32 rows (a 64-bit hash per vocabulary entry). The position, not a generator's state, carries the stream.
  The two samplers draw different tokens for the same seed.
"""

from __future__ import annotations

import torch

from rlk3.engine.config import SEED_MAX, SamplingParams
from rlk3.model.ops import cpu

# splitmix64 (Steele, Lea & Flood 2014), in int64 arithmetic: multiplication wraps modulo 2^64 and a logical right
# shift is an arithmetic one masked to the remaining bits
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def generator_seed(seed: int) -> int:
    """What a request's ``torch.Generator`` is seeded with: splitmix64 of its seed, a bijection of 64-bit ints.
    PyTorch's CPU generator (mt19937) keeps only the low 32 bits of the seed it is given, so seeds that differ only
    above bit 31 (``s`` and ``s + 2**32``: an iteration packed into the high bits) would draw the same tokens;
    mixed, every bit of the seed moves those 32. (CUDA's Philox keeps all 64 bits: there no two seeds collide.)"""
    return int(_mix(torch.tensor(counter_key(seed)) + _GOLDEN)) & SEED_MAX  # the counter's own mix, one element


def counter_key(seed: int) -> int:
    """A 64-bit seed as the int64 the counter sampler's hash keys hold: its two's-complement bits, one key per seed
    (folding it modulo 2**63 made ``s`` and ``s + 2**63`` draw alike)."""
    return seed - 2**64 if seed >= 2**63 else seed


_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 under 1


def counter_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``keys [n, 2]`` int64 (seed, position) → uniforms ``[n, vocab]`` in (0, 1), float32 (24 random bits each)."""
    row = _mix(keys[:, 0] + _mix(keys[:, 1] * _GOLDEN))  # one stream per (seed, position)
    v = torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device) * _GOLDEN
    bits = _shr(_mix(row[:, None] + v[None, :]), 40)  # the top 24 bits
    # (bits + 0.5) / 2^24 lies in (0, 1), but float32 rounds its top value, 1 - 2^-25, to 1.0, whose Gumbel noise
    # is +inf: that entry would win every draw it is in (one in 2^24 per entry, ~1% of K3's rows), outside top-k /
    # top-p too (-inf + inf is NaN, which argmax takes). The top cell is held just under 1 instead.
    return ((bits.float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def restrict(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of log-probabilities with the entries outside each row's top-k / top-p support set to -inf. ``top_k``
    ``[n]`` (0: off), ``top_p`` ``[n]`` (1: off). The same support as ``_restrict``: top-k keeps every entry at least
    as probable as the k-th (ties included); top-p keeps the smallest prefix reaching top_p of the top-k mass, and
    always the most probable entry."""
    V = logp.shape[-1]
    sorted_p, order = logp.exp().sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    keep = sorted_p >= sorted_p.gather(1, (k - 1)[:, None])
    kept = sorted_p * keep
    before = kept.cumsum(-1) - kept
    keep &= (before < top_p[:, None] * kept.sum(-1, keepdim=True)) | (top_p[:, None] >= 1.0)
    support = torch.zeros_like(keep).scatter(1, order, keep)
    return logp.masked_fill(~support, float("-inf"))


def _restrict(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities of one row after top-k and top-p (unnormalised; multinomial normalises)."""
    probs = logp.exp()
    if top_k and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        total = sorted_p.sum()
        # keep the smallest prefix reaching top_p of the (possibly top-k restricted) mass; the first token always
        before = sorted_p.cumsum(0) - sorted_p
        keep = before < top_p * total
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return probs


def to_device(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the GPU: ``torch.tensor(values, device=cuda)`` copies
    from pageable memory and synchronises the stream, which would stall a step launched behind another."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def sample_tensors(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` without the copy to the host: (token ids ``[n]`` long, their logprobs ``[n]`` float32) on the
    logits' device. With the counter sampler (or all rows greedy) nothing here waits for the GPU."""
    logits = logits.float()
    dev = logits.device
    temps = [p.temperature if not p.greedy else 1.0 for p in params]
    if any(t != 1.0 for t in temps):  # (x / 1.0 is x: an all-greedy or T = 1 batch skips the copy and the divide)
        logp = torch.log_softmax(logits / to_device(temps, dev, torch.float32)[:, None], dim=-1)
    else:
        logp = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn and keys is not None:
        rows = to_device(drawn, dev) if len(drawn) < len(params) else slice(None)  # every row: no index copy
        sub = logp[rows]
        if any(params[i].top_k or params[i].top_p < 1.0 for i in drawn):
            sub = restrict(sub, to_device([params[i].top_k for i in drawn], dev),
                           to_device([params[i].top_p for i in drawn], dev, torch.float32))
        gumbel = -torch.log(-torch.log(counter_uniform(keys[rows], logp.shape[-1])))
        tokens[rows] = (sub + gumbel).argmax(dim=-1)
    else:
        for i in drawn:
            p = params[i]
            probs = _restrict(logp[i], p.top_k, p.top_p)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    keys: torch.Tensor | None = None, cpu_kernels: bool = False,
) -> tuple[list[int], list[float]]:
    """logits ``[n, V]`` (any float dtype) → (token per row, its logprob per row). ``keys`` ``[n, 2]`` (seed,
    position) selects the counter sampler; None the per-request generators. ``cpu_kernels``: an all-greedy batch of
    float32 CPU logits takes the fused argmax + log-softmax kernel (one pass instead of ~0.5 ms of torch ops at
    batch 32 x 4,096)."""
    if cpu_kernels and logits.dtype == torch.float32 and logits.device.type == "cpu" and all(p.greedy for p in params):
        tokens, chosen = cpu.argmax_logprob(logits)
        return tokens.tolist(), chosen.tolist()
    tokens, chosen = sample_tensors(logits, params, generators, keys)
    # one device-to-host copy (each waits for the GPU); float64 holds every token id and float32 log-prob exactly
    drawn_tokens, logprobs = torch.stack([tokens.double(), chosen.double()]).tolist()
    return [int(t) for t in drawn_tokens], logprobs
