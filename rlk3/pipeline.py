"""SFT → nine teachers → MOPD, as stages over one config tree. Each stage reads as the steps it takes."""

from __future__ import annotations

import torch


def _setup(cfg) -> None:
    torch.manual_seed(cfg.run.seed)
    if cfg.cluster.cpu_threads:
        torch.set_num_threads(cfg.cluster.cpu_threads)


def run_stage(cfg) -> int:
    _setup(cfg)
    if cfg.run.stage == "sft":
        from rlk3.train.sft import run_sft

        run_sft(cfg)
        return 0
    if cfg.run.stage == "rl":
        from rlk3.cluster.driver import run_rl

        run_rl(cfg)
        return 0
    raise NotImplementedError(f"stage {cfg.run.stage!r} is not implemented yet")
