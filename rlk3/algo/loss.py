"""The policy loss: PPO-clip with per-token off-policy correction against the behaviour log-probabilities.

Three policies meet here. ``μ`` sampled the tokens (the engine recorded ``log μ`` per token, possibly several
policy versions ago: partial rollouts resume under new weights); ``π_old`` is the policy at the start of this
optimisation step (the PPO anchor; equal to the current policy on the first minibatch); ``π_θ`` is being trained.

    r_t = π_θ(t) / π_old(t)                         PPO ratio, clipped to [1 − ε_low, 1 + ε_high]
    w_t = π_old(t) / μ(t)                           importance weight for staleness, no gradient
    loss_t = −w_t · min(r_t A_t, clip(r_t) A_t)     (+ β · KL(π_θ ‖ π_ref), k3 estimator)

``w`` is what makes λ < 1 (pausing half-finished trajectories and resuming them under new weights) sound:
tokens sampled by an older policy are reweighted token by token. Ways to tame it:

* ``truncate``: ``w ← min(w, C)`` (truncated importance sampling);
* ``mask``: tokens with ``w`` outside ``[low, high]`` contribute nothing, the others count at weight 1 (token-level
  rejection, verl's ``rollout_rs: token``);
* ``icepop``: the same band, and a kept token is weighted by its ``w`` (IcePop; slime's ``--use-icepop``): rejection
  of the tokens too far off-policy to correct, importance weighting of the rest;
* ``none``: ``w = 1`` (pure PPO; only right when every token is on-policy).

Aggregation: ``token-mean`` (every generated token in the batch weighs the same), ``seq-mean-token-mean`` (each
sequence weighs the same) or ``seq-mean-token-sum``. The means count every generated token, masked-IS drops
included (their terms are 0), so the result does not depend on how a batch is split into micro-batches. A sequence
whose tokens are all masked contributes 0, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IS_MODES = ("truncate", "mask", "icepop", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# policy_loss's means and the token count each is over: micro-batches combine by that count, so a mean over the kept
# tokens stays exact however the IS-masked ones fall across micro-batches
MEAN_OVER = {"clip_frac": "kept_tokens", "ppo_kl": "kept_tokens", "is_weight_mean": "kept_tokens",
             "is_masked_frac": "tokens", "stale_frac": "tokens", "kl_ref": "tokens", "entropy": "tokens"}


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO's clip-higher: room for low-probability tokens to grow
    is_mode: str = "truncate"
    is_cap: float = 2.0  # truncate: w <= is_cap
    is_low: float = 0.5  # mask, icepop: keep tokens with is_low <= w <= is_high
    is_high: float = 2.0
    kl_coef: float = 0.0
    aggregation: str = "token-mean"

    def __post_init__(self) -> None:
        if self.is_mode not in IS_MODES:
            raise ValueError(f"loss.is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"loss.clip_low must be in [0, 1), clip_high >= 0; got {self.clip_low}, {self.clip_high}")
        if not 0 < self.is_low <= 1 <= self.is_high:
            raise ValueError(f"loss: need 0 < is_low <= 1 <= is_high, got is_low={self.is_low} is_high={self.is_high}")
        if self.is_cap < 1:
            raise ValueError(f"loss.is_cap must be >= 1, got {self.is_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")


def is_ratio(old_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """``π_old / μ`` per token, before truncation or masking (no gradient)."""
    return (old_logp - behaviour_logp).detach().clamp(max=30.0).exp()  # clamp: exp(huge) is inf, and inf * 0 NaN


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig):
    """``(w, keep)``: the per-token staleness weight (no gradient) and the mask of tokens that count. ``mask`` mode
    keeps a token at weight 1 (it rejects, it does not reweight); ``icepop`` rejects the same and reweights the rest."""
    w = is_ratio(old_logp, behaviour_logp)
    keep = mask.bool()
    if cfg.is_mode == "truncate":
        w = w.clamp(max=cfg.is_cap)
    elif cfg.is_mode in ("mask", "icepop"):
        keep = keep & (w >= cfg.is_low) & (w <= cfg.is_high)
        if cfg.is_mode == "mask":
            w = torch.ones_like(w)
    else:
        w = torch.ones_like(w)
    return w, keep


def aggregate(per_token: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Sum of ``per_token`` over ``keep``, normalised by the generated tokens (``mask``).
    Masked IS zeroes a dropped token's term but leaves it in the denominator (IcePop's ``1/|y|``): the denominator
    is then known before the forward pass, so a micro-batch's share (``mask.sum() / batch tokens``, the trainer's
    weight) sums to the whole batch's mean however the batch is packed, and masking a sequence's off-policy tokens
    does not scale up the ones it keeps."""
    keep = keep.to(per_token.dtype)
    count = mask.to(per_token.dtype)
    if how == "token-mean":
        return (per_token * keep).sum() / count.sum().clamp(min=1.0)
    per_seq = (per_token * keep).sum(-1)
    if how == "seq-mean-token-mean":
        per_seq = per_seq / count.sum(-1).clamp(min=1.0)
    return per_seq.mean()


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """All per-token tensors ``[B, T]`` aligned on the stream (``mask`` = 1 on generated tokens); ``advantages``
    ``[B]`` (one per sequence) or ``[B, T]``. Returns the scalar loss and metrics for logging."""
    if logp.shape != behaviour_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"policy_loss: logp {list(logp.shape)}, behaviour_logp {list(behaviour_logp.shape)} and mask "
            f"{list(mask.shape)} must have one shape [B, T]"
        )
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    old = logp.detach() if old_logp is None else old_logp.detach()
    w, keep = importance_weights(old, behaviour_logp, mask, cfg)
    ratio = (logp - old).exp()
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    per_token = -w * surrogate
    kl = None
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp.detach() - logp
        kl = d.exp() - d - 1  # k3: unbiased, non-negative estimate of KL(π_θ ‖ π_ref)
        per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, keep, mask, cfg.aggregation)

    m = mask.bool()
    n = m.sum().clamp(min=1)
    n_kept = keep.sum().clamp(min=1)
    with torch.no_grad():
        # the clip binds where min() takes the clipped term (verl's pg_clipfrac): r > 1 + ε_high with A > 0 or
        # r < 1 − ε_low with A < 0; a ratio outside the range on the other side still gets its full gradient
        binds = (clipped * advantages < ratio * advantages) & keep
        raw = is_ratio(old, behaviour_logp)
        # what the kept tokens' ratios are: the weight applied under truncate and icepop; under mask and none the loss
        # applies 1, and the mean of w itself (constant 1) said nothing about how far off-policy the trained tokens were
        seen = w if cfg.is_mode in ("truncate", "icepop") else raw
        metrics = {
            "loss": float(loss),
            "tokens": int(m.sum()),
            "kept_tokens": int(keep.sum()),
            "clip_frac": float(binds.sum() / n_kept),
            # verl's ppo_kl: mean log(π_old / π_θ), how far this optimizer step has moved from π_old (0 on the first)
            "ppo_kl": float(torch.where(keep, old - logp.detach(), 0.0).sum() / n_kept),
            "is_weight_mean": float((seen * keep).sum() / n_kept),
            "is_weight_max": float(raw[m].max()) if m.any() else 0.0,  # before the cap or the mask: compare with them
            "is_masked_frac": float((m & ~keep).sum() / n),
            # behaviour ≠ π_old; the trainer, which knows each token's policy version, logs that count instead
            "stale_frac": float(((old - behaviour_logp).abs() > 1e-6)[m].float().mean()) if m.any() else 0.0,
        }
        if kl is not None:
            metrics["kl_ref"] = float((kl * m).sum() / n)
        if entropy is not None:
            metrics["entropy"] = float((entropy * m).sum() / n)
    return loss, metrics


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """``log softmax(logits / T)`` of the next tokens and the per-token entropy; logits ``[B, T, V]`` predict
    ``tokens [B, T]`` (already shifted). Computed in fp32: the quantity the engine recorded while sampling."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    return chosen, entropy
