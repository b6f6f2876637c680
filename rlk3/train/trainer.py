"""The RL trainer: one policy update on a batch of graded trajectories.

    advantages  group-normalised outcome rewards (GRPO / RLOO / REINFORCE), or per-token MOPD rewards
    log-probs   recomputed under the current weights at the sampling temperature, on generated tokens only
    loss        PPO-clip with per-token importance correction against the behaviour log-probs (truncated or
                masked IS), optional k3 KL to a reference, token-level aggregation over the whole batch
    QB          Quantile Balancing: every router's scores from this step's forward passes set its routing bias

    updates     ``minibatches`` × ``ppo_epochs`` optimizer steps per batch (verl's ppo_mini_batch_size and
                ppo_epochs): the batch is split into minibatches after the advantages are computed, and every step's
                PPO ratio is taken against the log-probs of the weights the batch started from (π_old) — the
                situation the clip is for. One update (the default) is plain on-policy policy gradient.

Single process on CPU and on one GPU; with a ``torch.distributed`` process group of several ranks the model is
FSDP2-sharded and each rank trains its share of every minibatch, the update equal to one process's on the whole
batch (rlk3/train/parallel.py says what changes). Micro-batches are packed by token count; the loss of each is
scaled so that the sum over micro-batches is its minibatch's aggregate, whatever the packing. The policy version counts
updates published to the engine (one per :meth:`Trainer.step`), not optimizer steps: staleness is measured in
what the sampler saw.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from rlk3.algo.advantages import group_advantages, reward_spread
from rlk3.algo.loss import MEAN_OVER, LossConfig, policy_loss, token_logprobs
from rlk3.model.quantile_balancing import histogram_edges, qb_bias_from_histogram, qb_histogram, quantile_balancing_bias
from rlk3.rollout.trajectory import Status, Trajectory
from rlk3.train import parallel

MAXIMA = ("is_weight_max", "staleness_max")  # metrics combined by their maximum, not summed


class DeadSignalError(RuntimeError):
    """Training has had no learning signal for too many steps in a row."""


@dataclass
class SharedPrefix:
    """``train.share_prompts``: each group's prompt runs once; its members continue from the same states."""

    ids: torch.Tensor  # [G, P] left-padded: each group's prompt but its last token, once
    mask: torch.Tensor  # [G, P] 1 on real tokens
    repeats: torch.Tensor  # [G] the group's rows in Batch.ids, which follow each other in group order


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] right-padded (with a prefix: each row's tokens after it)
    mask: torch.Tensor  # [B, T-1] 1 on generated target tokens
    behaviour: torch.Tensor  # [B, T-1] behaviour logprobs on targets (0 elsewhere)
    adv: torch.Tensor  # [B, T-1] per-token advantages
    old: torch.Tensor | None = None  # [B, T-1] π_old log-probs (several updates per batch only)
    ref: torch.Tensor | None = None  # [B, T-1] reference log-probs for the KL term, computed once per batch
    empty: bool = False  # a placeholder pass: this rank has less data than another (data parallel)
    valid: torch.Tensor | None = None  # [B, T] bool, False on padding: Quantile Balancing counts real tokens only
    prefix: SharedPrefix | None = None
    versions: torch.Tensor | None = None  # [B, T-1] the policy version that sampled each target (-1 elsewhere)


class Trainer:
    def __init__(self, model, cfg, *, temperature: float = 1.0, ref_model=None, log=print) -> None:
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.ref_model = ref_model
        self.log = log
        self.loss_cfg = LossConfig(
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_mode=cfg.is_mode, is_cap=cfg.is_cap,
            is_low=cfg.is_low, is_high=cfg.is_high, kl_coef=cfg.kl_coef, aggregation=cfg.aggregation,
        )
        self.rank, self.world = parallel.world()
        self.device = next(model.parameters()).device
        if self.world > 1:
            parallel.shard_model(model)  # before the optimizer: it must hold the sharded parameters
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.adam_beta2))
        self.version = 0  # updates published = the policy version the engine gets next
        self.opt_steps = 0  # optimizer steps taken (the warm-up counts these, not versions)
        self.dead_steps = 0
        self.routers = [m for m in model.modules() if hasattr(m, "pop_scores")]

    # ------------------------------------------------------------------ one step

    def advantages(self, trajs: list[Trajectory]) -> list[torch.Tensor]:
        """Per trajectory: advantages on its generated tokens (``[n_generated]``)."""
        if all(t.token_rewards is not None for t in trajs):  # MOPD: per-token rewards (+ α·outcome, added before)
            return [torch.tensor(t.token_rewards, dtype=torch.float32) for t in trajs]
        rewards = torch.tensor([float(t.reward) for t in trajs])
        adv = group_advantages(rewards, [t.group_id for t in trajs], self.cfg.estimator, self.cfg.scale_advantages,
                               negative_scale=self.cfg.negative_scale)
        return [torch.full((t.num_generated,), float(a)) for t, a in zip(trajs, adv)]

    def _pack(self, trajs: list[Trajectory], advs: list[torch.Tensor]) -> list[Batch]:
        order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))
        groups, cur, longest = [], [], 0
        for i in order:
            n = len(trajs[i].token_ids)
            if cur and max(longest, n) * (len(cur) + 1) > self.cfg.micro_batch_tokens:
                groups.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            groups.append(cur)
        return [self._padded([trajs[i] for i in g], [advs[i] for i in g]) for g in groups]

    @staticmethod
    def _padded(trajs: list[Trajectory], advs: list[torch.Tensor], cut: list[int] | None = None) -> Batch:
        """Right-padded rows of ``trajs``' tokens (from ``cut[r]`` on, when given) and their loss tensors."""
        cut = cut or [0] * len(trajs)
        T = max(len(t.token_ids) - c for t, c in zip(trajs, cut))
        ids = torch.zeros(len(trajs), T, dtype=torch.long)
        valid = torch.zeros(len(trajs), T, dtype=torch.bool)
        mask = torch.zeros(len(trajs), T - 1)
        beh = torch.zeros(len(trajs), T - 1)
        adv = torch.zeros(len(trajs), T - 1)
        ver = torch.full((len(trajs), T - 1), -1, dtype=torch.long)
        for r, (t, a, c) in enumerate(zip(trajs, advs, cut)):
            n = len(t.token_ids) - c
            ids[r, :n] = torch.tensor(t.token_ids[c:])
            valid[r, :n] = True
            m = torch.tensor(t.loss_mask[c + 1:], dtype=torch.float32)
            mask[r, : n - 1] = m
            pos = m.nonzero().squeeze(-1)
            # a first token that is generated has no context to be predicted from: it cannot be trained on
            skip = t.loss_mask[0]
            beh[r, pos] = torch.tensor(t.behaviour_logprobs[skip:], dtype=torch.float32)
            adv[r, pos] = a[skip:]
            ver[r, pos] = torch.tensor(t.policy_versions[skip:], dtype=torch.long)
        return Batch(ids, mask, beh, adv, valid=valid, versions=ver)

    def _pack_shared(self, trajs: list[Trajectory], advs: list[torch.Tensor]) -> list[Batch]:
        """``train.share_prompts``: a group's shared prefix is its members' common prompt up to the first generated
        token, less one token (every trained position then lies in the members' own rows, which start with that
        token). Rows are packed by their length after the prefix, as ``_pack`` packs whole rows (a group's members
        may land in different micro-batches: on a long-tailed length distribution padding a group's short samples
        to its longest would cost more than the prompt); each micro-batch runs the prefixes of the groups it holds
        once, then its rows from their states. Groups with less than two prompt tokens in common, and groups of
        one, go through ``_pack``."""
        by_group: dict[str, list[int]] = {}
        for i, t in enumerate(trajs):
            by_group.setdefault(t.group_id, []).append(i)
        cut = {}
        for members in by_group.values():
            ref = trajs[members[0]].token_ids
            lcp = min(trajs[i].loss_mask.index(1) if 1 in trajs[i].loss_mask else len(trajs[i].loss_mask)
                      for i in members)
            for i in members[1:]:
                ids = trajs[i].token_ids
                lcp = next((k for k in range(min(lcp, len(ids))) if ids[k] != ref[k]), min(lcp, len(ids)))
            for i in members:
                cut[i] = lcp - 1 if lcp >= 2 and len(members) > 1 else 0
        alone = [i for i in range(len(trajs)) if not cut[i]]
        parts, cur, longest, prefixes = [], [], 0, {}
        for i in sorted((i for i in cut if cut[i]), key=lambda i: (len(trajs[i].token_ids) - cut[i], i)):
            n, g = len(trajs[i].token_ids) - cut[i], trajs[i].group_id
            grown = {**prefixes, g: cut[i]}  # the prefixes this micro-batch would run, left-padded to the longest
            cost = max(longest, n) * (len(cur) + 1) + len(grown) * max(grown.values())
            if cur and cost > self.cfg.micro_batch_tokens:
                parts.append(cur)
                cur, longest, grown = [], 0, {g: cut[i]}
            cur.append(i)
            longest, prefixes = max(longest, n), grown
        if cur:
            parts.append(cur)
        out = []
        for part in parts:
            groups = list(dict.fromkeys(trajs[i].group_id for i in part))  # rows of a group next to each other
            rows = sorted(part, key=lambda i: (groups.index(trajs[i].group_id), part.index(i)))
            b = self._padded([trajs[i] for i in rows], [advs[i] for i in rows], [cut[i] for i in rows])
            heads = [next(i for i in rows if trajs[i].group_id == g) for g in groups]
            P = max(cut[i] for i in heads)
            ids = torch.zeros(len(heads), P, dtype=torch.long)
            mask = torch.zeros(len(heads), P, dtype=torch.long)
            for r, i in enumerate(heads):
                ids[r, P - cut[i]:] = torch.tensor(trajs[i].token_ids[: cut[i]])
                mask[r, P - cut[i]:] = 1
            repeats = torch.tensor([sum(trajs[i].group_id == g for i in rows) for g in groups])
            b.prefix = SharedPrefix(ids, mask, repeats)
            out.append(b)
        return out + (self._pack([trajs[i] for i in alone], [advs[i] for i in alone]) if alone else [])

    def _logits(self, model, b: Batch, qb: bool = False) -> torch.Tensor:
        """Logits at every position of ``b.ids`` but the last, [B, T-1, V]. With a shared prefix the prompts run
        first (left-padded, with their padding mask) and their KDA and MLA states are repeated for each group's
        rows, which then run only their own tokens — the same logits and gradients as the full rows (tested), for
        the prompt's compute once per group instead of once per sample. ``qb``: Quantile Balancing records the
        routing scores of real tokens only (each prompt token once)."""
        ids = b.ids.to(self.device)
        policy = model is self.model  # the reference model's routers record nothing
        if b.prefix is None:
            if policy:
                self._score_mask(qb, b.valid)
            return model(ids).logits[:, :-1]
        p = b.prefix
        if policy:
            self._score_mask(qb, p.mask.bool())
        out = model(p.ids.to(self.device), attention_mask=p.mask.to(self.device), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        cache.batch_repeat_interleave(p.repeats.to(self.device))
        if policy:
            own = b.valid.clone()
            own[:, 0] = False  # every row starts with the prompt's last token: counted in a group's first row only
            own[torch.cumsum(p.repeats, 0) - p.repeats, 0] = True
            self._score_mask(qb, own)
        keys = torch.cat([p.mask.repeat_interleave(p.repeats, 0), b.valid.long()], 1).to(self.device)
        return model(ids, attention_mask=keys, cache=cache, use_cache=True).logits[:, :-1]

    def _score_mask(self, on: bool, valid: torch.Tensor | None) -> None:
        for r in self.routers:
            r.record_scores = on
            r.score_mask = None if valid is None else valid.flatten()

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One policy update (``minibatches × ppo_epochs`` optimizer steps) on graded trajectories; failed ones
        are dropped. Returns metrics."""
        trajs = [t for t in trajs if t.status != Status.FAILED and t.num_generated > 0]
        metrics: dict[str, float] = {"train/sequences": len(trajs)}
        if not trajs:
            return self._dead(metrics, "no trainable trajectories")
        advs = self.advantages(trajs)
        n_mini = min(self.cfg.minibatches, len(trajs))
        epochs = self.cfg.ppo_epochs
        self.model.train()
        if n_mini * epochs == 1:
            parts = [list(range(len(trajs)))]
        else:
            # Minibatches from a permutation seeded by the version: deterministic (resume is bit-identical)
            # without another RNG stream in the checkpoint.
            perm = torch.randperm(len(trajs), generator=torch.Generator().manual_seed(1_000_003 + self.version))
            parts = [perm[i::n_mini].tolist() for i in range(n_mini)]
        shares = [self._share(trajs, ix) for ix in parts]  # this rank's part of each (all of it in one process)
        pack = self._pack_shared if self.cfg.share_prompts else self._pack
        packed = self._even_out([pack([trajs[i] for i in ix], [advs[i] for i in ix]) for ix in shares])
        if n_mini * epochs > 1:
            self._old_logprobs([b for mb in packed for b in mb])
        plan = [mb for _ in range(epochs) for mb in packed]
        sums: dict[str, float] = {}
        norms = []
        for batches in plan:
            norms.append(self._update(batches, sums))
        self.version += 1
        sums = self._reduce_metrics(sums)
        for k, v in sums.items():
            if k in MEAN_OVER:  # over every optimizer step's tokens, each mean over its own count
                metrics[f"train/{k}"] = v / max(sums[MEAN_OVER[k]], 1.0)
            elif k in MAXIMA:
                metrics[f"train/{k}"] = v
            elif k != "loss":  # a count of the batch's tokens, counted once
                metrics[f"train/{k}"] = v / epochs
        # the loss as aggregated (a token-weighted mean of micro-batch losses is that only for token-mean)
        metrics["train/loss"] = sums.get("loss", 0.0) / len(plan)
        grad_norm = sum(norms) / len(norms)
        metrics["train/grad_norm"] = grad_norm
        metrics["train/updates"] = len(plan)
        metrics["train/lr"] = self.opt.param_groups[0]["lr"]
        metrics["train/version"] = self.version
        if self.routers:
            metrics["train/qb_bias_absmax"] = max(float(r.e_score_correction_bias.abs().max()) for r in self.routers)
        rewards = torch.tensor([float(t.reward or 0.0) for t in trajs])
        spread = reward_spread(rewards, [t.group_id for t in trajs])
        mopd = all(t.token_rewards is not None for t in trajs)
        why = None
        if not mopd and bool((spread == 0).all()):
            why = "every group has zero reward spread"
        elif all(t.status == Status.TRUNCATED for t in trajs):
            why = "every sample was truncated"
        elif grad_norm == 0.0:
            why = "the gradient is zero"
        return self._dead(metrics, why) if why else self._alive(metrics)

    def _share(self, trajs: list[Trajectory], ix: list[int]) -> list[int]:
        """This rank's part of a minibatch: dealt out by length, so every rank gets about the same tokens."""
        if self.world == 1:
            return ix
        return sorted(ix, key=lambda i: (len(trajs[i].token_ids), i))[self.rank :: self.world]

    def _even_out(self, packed: list[list[Batch]]) -> list[list[Batch]]:
        """Pads every minibatch to the largest micro-batch count of any rank with empty passes: each forward
        and backward under FSDP2 is a collective, so every rank must run as many as the others."""
        if self.world == 1:
            return packed
        counts = parallel.all_reduce(torch.tensor([len(mb) for mb in packed], device=self.device),
                                     op=torch.distributed.ReduceOp.MAX)
        for mb, n in zip(packed, counts.tolist()):
            mb += [Batch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                         empty=True) for _ in range(n - len(mb))]
        return packed

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Sums across ranks (``MAXIMA``: their maximum); every rank has the same keys."""
        if self.world == 1:
            return sums
        keys = sorted(k for k in sums if k not in MAXIMA)
        total = parallel.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device))
        out = dict(zip(keys, total.tolist()))
        tops = sorted(k for k in sums if k in MAXIMA)
        if tops:
            top = torch.tensor([sums[k] for k in tops], dtype=torch.float64, device=self.device)
            out.update(zip(tops, parallel.all_reduce(top, op=torch.distributed.ReduceOp.MAX).tolist()))
        return out

    @torch.no_grad()
    def _old_logprobs(self, batches: list[Batch]) -> None:
        """π_old: the log-probs of the weights this batch started from, fixed for all of its optimizer steps."""
        for b in batches:
            ids = b.ids.to(self.device)
            b.old, _ = token_logprobs(self._logits(self.model, b), ids[:, 1:], self.temperature)

    def _update(self, batches: list[Batch], sums: dict[str, float]) -> float:
        """One optimizer step on the micro-batches of one minibatch; accumulates metrics into ``sums``."""
        # the minibatch's tokens and sequences on every rank: the aggregate is over all of them
        totals = parallel.all_reduce(torch.tensor([sum(float(b.mask.sum()) for b in batches),
                                                   float(sum(b.ids.shape[0] for b in batches if not b.empty))],
                                                  dtype=torch.float64, device=self.device))
        total_tokens, total_seqs = float(totals[0]), max(float(totals[1]), 1.0)
        for b in batches:
            ids, mask = b.ids.to(self.device), b.mask.to(self.device)
            logits = self._logits(self.model, b, qb=self.cfg.qb_update and not b.empty)
            logp, ent = token_logprobs(logits, ids[:, 1:], self.temperature)
            if b.ref is None and self.ref_model is not None and self.cfg.kl_coef > 0:  # fixed: once, not per epoch
                with torch.no_grad():
                    b.ref, _ = token_logprobs(self._logits(self.ref_model, b), ids[:, 1:], self.temperature)
            loss, m = policy_loss(logp, b.behaviour.to(self.device), b.adv.to(self.device), mask, self.loss_cfg,
                                  old_logp=b.old, ref_logp=b.ref, entropy=ent)
            if b.versions is not None:
                # stale = sampled by an older policy version than the one training (a resumed partial rollout,
                # an overlapped rollout), counted from the versions: the behaviour log-probs also differ from the
                # trainer's by the engine's numerics (bf16, another kernel), which is not staleness
                m["stale_frac"] = float(((b.versions < self.version) & (b.mask > 0)).sum()) / max(m["tokens"], 1)
            # versions behind the policy being trained (what rollout.max_staleness bounds; one more under
            # cluster.overlap): staleness/max, a span within one trajectory, reads 0 where every token lags by one
            lag = (self.version - b.versions)[b.mask > 0] if b.versions is not None else torch.zeros(0)
            m["staleness_max"] = float(lag.max()) if lag.numel() else 0.0
            weight = (float(mask.sum()) / max(total_tokens, 1.0) if self.cfg.aggregation == "token-mean"
                      else (0.0 if b.empty else b.ids.shape[0]) / total_seqs)
            # × world: FSDP averages the ranks' gradients, and each rank's loss is already its share of the total
            (loss * weight * self.world).backward()
            for k, v in m.items():
                if k == "loss":  # weighted as in the backward: the sum is the minibatch's aggregate (over ranks too)
                    sums[k] = sums.get(k, 0.0) + v * weight
                elif k in MAXIMA:
                    sums[k] = max(sums.get(k, 0.0), v)
                else:  # a mean becomes its total over its count; counts add up
                    sums[k] = sums.get(k, 0.0) + v * (m[MEAN_OVER[k]] if k in MEAN_OVER else 1.0)
            del logits
        grad_norm = parallel.to_float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        if not math.isfinite(grad_norm):
            self.opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}: the step was skipped")
        # Linear warm-up: a fresh AdamW's first steps move every weight by about the learning rate whatever the
        # gradient's size, which costs an SFT policy several points before any signal accumulates (docs/rl.md)
        lr = self.cfg.lr * min(1.0, (self.opt_steps + 1) / max(self.cfg.warmup_steps, 1))
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt_steps += 1
        self.opt.zero_grad(set_to_none=True)
        self._quantile_balance()
        return grad_norm

    def _alive(self, metrics):
        self.dead_steps = 0
        metrics["train/dead_steps"] = 0
        return metrics

    def _dead(self, metrics, why: str):
        self.dead_steps += 1
        metrics["train/dead_steps"] = self.dead_steps
        if self.dead_steps >= self.cfg.dead_signal_patience:
            raise DeadSignalError(
                f"no learning signal for {self.dead_steps} steps in a row ({why}); check rewards, budgets and "
                f"temperature, or raise train.dead_signal_patience"
            )
        self.log(f"warning: no learning signal this step ({why}); {self.dead_steps}/"
                 f"{self.cfg.dead_signal_patience} before stopping")
        return metrics

    @torch.no_grad()
    def _quantile_balance(self) -> None:
        for r in self.routers:
            r.record_scores, r.score_mask = False, None
            scores = r.pop_scores()
            if not self.cfg.qb_update:
                continue
            if self.world == 1:
                if scores is not None:
                    r.e_score_correction_bias.copy_(quantile_balancing_bias(scores, r.e_score_correction_bias,
                                                                            r.top_k))
                continue
            # several ranks: per-expert margin histograms summed across ranks (the bias is replicated, so the
            # bin edges agree); a rank that saw no tokens contributes zeros
            bias = r.e_score_correction_bias
            edges = histogram_edges(bias, self.cfg.qb_bins)
            counts = (qb_histogram(scores, bias, r.top_k, edges) if scores is not None
                      else torch.zeros(bias.numel(), self.cfg.qb_bins, dtype=torch.int64, device=bias.device))
            n = torch.tensor([0 if scores is None else scores.shape[0]], device=bias.device)
            parallel.all_reduce(counts)
            parallel.all_reduce(n)
            bias.copy_(qb_bias_from_histogram(counts, edges, int(n), r.top_k, dtype=bias.dtype))

    # ------------------------------------------------------------------ weights and state

    def weights(self) -> dict[str, torch.Tensor]:
        """What the engine gets: parameters and the (frozen at inference) routing biases."""
        if self.world > 1:
            return parallel.full_state_dict(self.model)  # a collective: every rank calls it
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state(self) -> dict:
        dp = self.world > 1  # full (unsharded) tensors, the optimizer's keyed by parameter name
        return {
            "model": parallel.full_state_dict(self.model) if dp else self.model.state_dict(),
            "optimizer": parallel.optimizer_state(self.model, self.opt) if dp else self.opt.state_dict(),
            "version": self.version,
            "opt_steps": self.opt_steps,
            "dead_steps": self.dead_steps,
        }

    def load_state(self, state: dict) -> None:
        if self.world > 1:
            parallel.load_full_state_dict(self.model, state["model"])
            parallel.load_optimizer_state(self.model, self.opt, state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.opt_steps = state["opt_steps"]
        self.dead_steps = state["dead_steps"]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
