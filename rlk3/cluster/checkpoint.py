"""Checkpoints and the metrics log.

A checkpoint is a directory ``checkpoints/iter-<k>/`` written atomically (a temporary name, then a rename):
``trainer.pt`` (model, optimizer, policy version, dead-signal counter — torch.save), ``rollout.json`` (the carry-over
buffer as lossless trajectory JSON, the tasks of its groups, the prompt position), ``meta.json`` (iteration).
Everything else a run needs is a function of these and the config: sampling seeds derive from (run seed, trajectory
uid, turn), the budget schedule from the iteration. Resuming re-runs the iterations after the checkpoint and
truncates ``metrics.jsonl`` to it, so an interrupted run ends with the same weights and metrics as an uninterrupted
one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Saved:
    path: Path
    iteration: int
    trainer: dict
    rollout: dict


class Checkpoints:
    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(self, iteration: int, trainer: dict, rollout: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"iter-{iteration:06d}"
        tmp = self.root / f".tmp-{iteration:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "rollout.json").write_text(json.dumps(rollout, allow_nan=True))
        (tmp / "meta.json").write_text(json.dumps({"iteration": iteration}))
        for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        for old in sorted(self.root.glob("iter-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Saved | None:
        for d in sorted(self.root.glob("iter-*"), reverse=True):
            try:
                meta = json.loads((d / "meta.json").read_text())
                return Saved(d, int(meta["iteration"]), torch.load(d / "trainer.pt", weights_only=False),
                             json.loads((d / "rollout.json").read_text()))
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                print(f"checkpoint {d} is unreadable ({type(e).__name__}: {e}); trying an older one")
        return None


def resume_point(ckpts: Checkpoints, metrics: MetricsLog, resume: bool) -> Saved | None:
    """The checkpoint a run continues from (None: iteration 0). Rows of the iterations it will run again are dropped
    from ``metrics.jsonl`` — also when there is no checkpoint yet: a run killed after writing iteration 0's row but
    before its first checkpoint starts over at 0 and would otherwise log that iteration twice."""
    saved = ckpts.latest() if resume else None
    metrics.truncate(saved.iteration if saved is not None else 0)
    return saved


class MetricsLog:
    """``metrics.jsonl`` (one object per iteration, the report's input: docs/report.md) and TensorBoard scalars."""

    def __init__(self, out: Path, cfg) -> None:
        self.path = Path(out) / "metrics.jsonl"
        self.base = {"stage": cfg.run.stage, "run": cfg.run.name,
                     "domain": cfg.tasks.domains[0] if len(cfg.tasks.domains) == 1 else "mixed",
                     "effort": cfg.effort.level if cfg.run.stage == "rl" else "mixed"}
        self.tb = None
        if cfg.run.log_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
            except ImportError:
                self.tb = None

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a line cut by a kill: it and anything after it are redone
        return out

    def truncate(self, iteration: int) -> None:
        keep = [r for r in self.rows() if r.get("iteration", -1) < iteration]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def last(self, key: str, default=None):
        rows = self.rows()
        return rows[-1].get(key, default) if rows else default

    def last_row(self) -> dict:
        rows = self.rows()
        return rows[-1] if rows else {}

    def write(self, row: dict) -> None:
        row = {**self.base, **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, row["iteration"])
            self.tb.flush()
