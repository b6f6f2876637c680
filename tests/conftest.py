"""Shared fixtures and process settings for the suite."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# One intra-op thread: the suite shares two cores with sandbox servers, grader workers and their subprocesses,
# and OpenMP's barrier waits under oversubscription made small tensor ops ~100x slower here (measured: a tiny
# MoE layer's forward+backward took 9.6 s on 2 threads next to a busy process, 0.06 s on 1).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The SFT stage the learning tests start from (`sft_run`) is ten minutes of one core, and the suite leaves one of the
# two cores mostly idle (sandboxes, graders, Ray start-ups wait more than they compute): the stage runs in a
# background process from the end of collection, niced so that the tests in front keep their core, and the tests
# that need it run last. It is the command a user runs (`python -m rlk3 sft`), which writes the same checkpoint, byte
# for byte, as the stage run in-process (SHA-256 compared on this machine).
SFT_USERS = "sft_run"
_sft: dict = {}


def _uses_sft(item) -> bool:
    return SFT_USERS in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    items.sort(key=_uses_sft)  # stable: everything else keeps its order, the SFT users go last


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(_uses_sft(item) for item in session.items):
        _start_sft()


def _start_sft() -> None:
    if _sft:
        return
    from rlk3.config import CONFIG_DIR

    root = Path(tempfile.mkdtemp(prefix="rlk3-sft-"))
    _sft.update(root=root, out=root / "checkpoint")
    with open(root / "sft.log", "w") as log:  # the child keeps its own descriptor
        _sft["proc"] = subprocess.Popen(
            [sys.executable, "-m", "rlk3", "sft", str(CONFIG_DIR / "sft-tiny.yaml"), f"run.output_dir={_sft['out']}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
            preexec_fn=lambda: os.nice(10),
        )


def pytest_sessionfinish(session, exitstatus):
    proc = _sft.get("proc")
    if proc is not None:
        if proc.poll() is None:  # the session ended before a test needed it (-x, Ctrl-C)
            proc.kill()
            proc.wait()
        shutil.rmtree(_sft["root"], ignore_errors=True)


@pytest.fixture(scope="session")
def sft_run():
    """The SFT stage as `python -m rlk3 sft configs/sft-tiny.yaml` runs it (CPU, the config's thread count), once
    per session, started in the background at the end of collection (above): the checkpoint the SFT acceptance test
    grades and later stages start from. Returns (checkpoint dir, manifest)."""
    import json

    _start_sft()
    try:
        rc = _sft["proc"].wait(timeout=3600)
    except subprocess.TimeoutExpired:
        _sft["proc"].kill()
        rc = "killed after an hour"
    if rc != 0:
        tail = (_sft["root"] / "sft.log").read_text(errors="replace")[-4000:]
        pytest.fail(f"python -m rlk3 sft configs/sft-tiny.yaml exited {rc}:\n{tail}")
    out = _sft["out"]
    return out, json.loads((out / "sft_manifest.json").read_text())
