"""Shared fixtures and process settings for the suite."""

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

# One intra-op thread: the suite shares two cores with sandbox servers, grader workers and their subprocesses,
# and OpenMP's barrier waits under oversubscription made small tensor ops ~100x slower here (measured: a tiny
# MoE layer's forward+backward took 9.6 s on 2 threads next to a busy process, 0.06 s on 1).
torch.set_num_threads(1)

# The SFT stage behind `sft_run` takes ~10 minutes of one core. The suite as a whole keeps the two cores busy about a
# third of its wall time (waits on Ray, sandboxes, graders), so when a selected test needs the checkpoint the stage
# starts in a subprocess as soon as collection is done and those tests run last: it trains in the time the rest of
# the suite leaves idle instead of holding one core while the other waits. One thread: the checkpoint is the same
# bytes however busy the machine is.
_SFT_WAIT_S = 3000
_SFT = pytest.StashKey[tuple]()  # (process, checkpoint dir, log file)


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items):
    users = [it for it in items if "sft_run" in getattr(it, "fixturenames", ())]
    if not users or config.option.collectonly:
        return
    items[:] = [it for it in items if it not in users] + users
    from rlk3.config import CONFIG_DIR

    out = Path(tempfile.mkdtemp(prefix="rlk3-sft-"))
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - the stage's output, read if it fails; closed at exit
    proc = subprocess.Popen([sys.executable, "-m", "rlk3", "sft", str(CONFIG_DIR / "sft-tiny.yaml"),
                             f"run.output_dir={out}"], stdout=log, stderr=subprocess.STDOUT)
    config.stash[_SFT] = (proc, out, log)


def pytest_unconfigure(config):
    sft = config.stash.get(_SFT, None)
    if sft is None:
        return
    proc, out, log = sft
    if proc.poll() is None:  # an interrupted or deselected-early session: do not leave a trainer behind
        proc.kill()
        proc.wait()
    log.close()
    shutil.rmtree(out, ignore_errors=True)
    Path(log.name).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_reaper_left():
    """A sandbox ``Manager`` built in the test process starts a thread that reaps every child (envs/sandbox/host.py,
    ``Reaper``): every later subprocess would lose its exit status (asyncio reports 255, torch's spawn ``None``), and
    tests far from the one at fault would fail. Managers belong in server processes; this names the test that
    left one behind."""
    yield
    assert not any(t.name == "reaper" for t in threading.enumerate()), (
        "this test left a sandbox Reaper thread in the test process; build Managers in a subprocess")


@pytest.fixture(scope="session")
def sft_run(pytestconfig):
    """The SFT stage as `python -m rlk3 sft configs/sft-tiny.yaml` runs it (CPU, the config's one thread), once per
    session, started in the background when collection ends (see above): the checkpoint the SFT acceptance test
    grades and later stages start from. Returns (checkpoint dir, manifest)."""
    proc, out, log = pytestconfig.stash[_SFT]
    try:
        rc = proc.wait(timeout=_SFT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = f"still running after {_SFT_WAIT_S} s (killed)"
    log.flush()
    assert rc == 0, f"`python -m rlk3 sft configs/sft-tiny.yaml` exited {rc}:\n{Path(log.name).read_text()[-4000:]}"
    return out, json.loads((out / "sft_manifest.json").read_text())
