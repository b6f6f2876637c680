"""Shared fixtures and process settings for the suite."""

import pytest
import torch

# One intra-op thread: the suite shares two cores with sandbox servers, grader workers and their subprocesses,
# and OpenMP's barrier waits under oversubscription made small tensor ops ~100x slower here (measured: a tiny
# MoE layer's forward+backward took 9.6 s on 2 threads next to a busy process, 0.06 s on 1).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory):
    """The SFT stage as `python -m rlk3 sft configs/sft-tiny.yaml` runs it (CPU, the config's thread count), once
    per session: the checkpoint the SFT acceptance test grades and later stages can start from.
    Returns (checkpoint dir, manifest)."""
    import json

    from rlk3 import pipeline
    from rlk3.config import CONFIG_DIR, load_config

    out = tmp_path_factory.mktemp("sft")
    cfg = load_config(CONFIG_DIR / "sft-tiny.yaml", [f"run.output_dir={out}", "run.stage=sft"])
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(cfg.run.seed)
        assert pipeline.run_stage(cfg) == 0  # sets torch's threads to cluster.cpu_threads
    finally:
        torch.set_num_threads(threads)
    return out, json.loads((out / "sft_manifest.json").read_text())
