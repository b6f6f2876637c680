"""Frozen teachers for MOPD: per-token log-probs of the student's own tokens, routed by (domain, effort).

``TeacherPool`` is one Ray actor holding every teacher's checkpoint path; models are loaded on demand and at most
``max_resident`` stay in memory (least recently used are dropped), so nine teachers share one device with the
student: the driver sends each iteration's rollouts in one call and the pool scores them grouped by teacher, one
teacher resident at a time when memory is short.

Guards (checked when the pool is built, before any rollout): every teacher's tokenizer must equal the student's
(same vocabulary, same special tokens) — a mismatched teacher is refused with its key and path; every key must be
``"<domain>/<effort>"`` with a known domain and effort; a rollout whose (domain, effort) has no teacher is an
error (``TeacherRoutingError``), never silently scored by another.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from rlk3.algo.mopd import mopd_token_rewards, route
from rlk3.rollout.trajectory import DOMAINS, EFFORTS, Trajectory


class TeacherConfigError(ValueError):
    pass


def parse_teachers(teachers: dict[str, str]) -> dict[tuple[str, str], Path]:
    out = {}
    for key, path in teachers.items():
        domain, _, effort = str(key).partition("/")
        if domain not in DOMAINS or effort not in EFFORTS:
            raise TeacherConfigError(
                f"mopd.teachers key {key!r} must be '<domain>/<effort>' with domain in {list(DOMAINS)} and effort "
                f"in {list(EFFORTS)}"
            )
        p = Path(path)
        if not (p / "config.json").is_file():
            raise TeacherConfigError(f"mopd.teachers[{key!r}] = {p}: no checkpoint there (config.json missing)")
        out[(domain, effort)] = p
    if not out:
        raise TeacherConfigError("mopd.teachers is empty: give one checkpoint per '<domain>/<effort>' to distil")
    return out


def check_tokenizers(teachers: dict[tuple[str, str], Path], student_tokenizer) -> None:
    from harness.tokenizer import load_tokenizer

    want = student_tokenizer.get_vocab()
    for key, path in teachers.items():
        got = load_tokenizer(path).get_vocab()
        if got != want:
            diff = len(set(got.items()) ^ set(want.items()))
            raise TeacherConfigError(
                f"teacher {key[0]}/{key[1]} ({path}) has a different tokenizer from the student ({len(got)} vs "
                f"{len(want)} tokens, {diff} entries differ): its log-probs would score other tokens; distil only "
                f"from teachers trained from the same SFT checkpoint"
            )


class TeacherPool:
    def __init__(self, teachers: dict[str, str], student_tokenizer_dir: str | None, *, temperature: float = 1.0,
                 max_resident: int = 9, threads: int = 1, device: str | None = None) -> None:
        torch.set_num_threads(threads)
        self.paths = parse_teachers(teachers)
        # the GPU of the actor's bundle when it has one (cluster.num_gpus > 0): scoring is a full forward of every
        # trajectory by its teacher, a model as large as the student. In float32 whatever model.dtype says: on an H100
        # a bfloat16 teacher moved one of four tokens' rewards by 0.39 nats (k3-tiny), the size of the signal itself
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        from harness.tokenizer import default_tokenizer, load_tokenizer

        # a student without a checkpoint speaks the built-in tokenizer (rlk3.cluster.workers.build_policy)
        student = load_tokenizer(student_tokenizer_dir) if student_tokenizer_dir else default_tokenizer()
        check_tokenizers(self.paths, student)
        self.temperature = temperature
        self.max_resident = max_resident
        self.resident: OrderedDict[tuple[str, str], torch.nn.Module] = OrderedDict()
        self.loads = 0

    def _model(self, key):
        from rlk3.model import K3ForCausalLM

        if key in self.resident:
            self.resident.move_to_end(key)
            return self.resident[key]
        while len(self.resident) >= self.max_resident:
            self.resident.popitem(last=False)  # offload the least recently used teacher
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # an offloaded teacher's memory, for the next one and the colocated workers
        m = K3ForCausalLM.from_pretrained(str(self.paths[key])).to(self.device, torch.float32)
        m = m.eval().requires_grad_(False)
        self.resident[key] = m
        self.loads += 1
        return m

    @torch.no_grad()
    def logprobs(self, key, t: Trajectory) -> torch.Tensor:
        """The teacher's log-probs (at the sampling temperature) of the trajectory's generated tokens."""
        ids = torch.tensor([t.token_ids], device=self.device)
        logits = self._model(key)(ids).logits[0, :-1].float() / self.temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()
        pos = [i - 1 for i, m in enumerate(t.loss_mask) if m and i > 0]
        out = lp[pos]
        if t.loss_mask and t.loss_mask[0]:  # a generated first token has no context: no teacher signal
            out = torch.cat([torch.tensor([0.0]), out])
        return out

    def score(self, trajs: list[dict], clip: float, alpha: float) -> tuple[list[dict], dict]:
        """Sets ``token_rewards`` on every trajectory; returns them and per-teacher metrics (KL estimate, count)."""
        items = [Trajectory.from_dict(d) for d in trajs]
        by_teacher: dict[tuple[str, str], list[int]] = {}
        for i, t in enumerate(items):
            route(self.paths, t.domain, t.effort)  # raises TeacherRoutingError for an unknown slice
            by_teacher.setdefault((t.domain, t.effort), []).append(i)
        metrics: dict[str, float] = {}
        for key in sorted(by_teacher):
            kls, n_tok = 0.0, 0
            for i in by_teacher[key]:
                t = items[i]
                if t.num_generated == 0:
                    t.token_rewards = []
                    continue
                teacher = self.logprobs(key, t)
                student = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
                outcome = torch.tensor([float(t.reward or 0.0)])
                r = mopd_token_rewards(student[None], teacher[None], torch.ones(1, len(student)), clip, outcome, alpha)
                t.token_rewards = r[0].tolist()
                kls += float((student - teacher).sum())  # Monte-Carlo estimate of KL(student ‖ teacher)
                n_tok += len(student)
            name = f"{key[0]}/{key[1]}"
            metrics[f"kl/{name}"] = kls / max(n_tok, 1)
            metrics[f"mopd/trajectories/{name}"] = len(by_teacher[key])
        metrics["mopd/teacher_loads"] = self.loads
        return [t.to_dict() for t in items], metrics
