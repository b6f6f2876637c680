"""The RL driver on a real local Ray: a run end to end, a rollout worker killed mid-iteration, checkpoint/resume
after SIGKILLs equal to an uninterrupted run, and `ray job submit` of the quickstart recipe."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlk3.config import load_config

ROOT = Path(__file__).resolve().parents[3]
VOLATILE = ("time/", "rollout/engine", "rollout/restarts")


@pytest.fixture(scope="module")
def init_dir(general_policy, tmp_path_factory):
    model, tok = general_policy
    d = tmp_path_factory.mktemp("init")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def overrides(out, init, **extra):
    base = {"run.output_dir": str(out), "model.init_from": str(init), "run.iterations": 4,
            "run.checkpoint_every": 1, "cluster.cpu_threads": 1, "rollout.groups_per_iteration": 2,
            "rollout.group_size": 4, "rollout.max_new_tokens": 48, "train.lr": 3e-4}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def rows(out):
    p = Path(out) / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture
def ray_local():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


def test_a_rollout_worker_killed_mid_iteration_is_restarted(init_dir, tmp_path, ray_local):
    from rlk3.cluster.driver import run_rl

    cfg = load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "run", init_dir, **{"run.iterations": 3}))
    killed = []

    def killer():  # the worker's process title names the method it runs: kill it inside iteration 1's rollout
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            if len(rows(tmp_path / "run")) >= 1:
                out = subprocess.run(["pgrep", "-f", "ray::RolloutWorker.iterate"], capture_output=True, text=True)
                for pid in out.stdout.split():
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    final = run_rl(cfg, log=lambda *_: None)
    t.join(timeout=1)
    assert killed, "the rollout worker was never caught inside an iteration"
    r = rows(tmp_path / "run")
    assert [x["iteration"] for x in r] == [0, 1, 2]
    assert r[1]["rollout/restarts"] >= 1
    assert [x["trained"] for x in r] == [8, 8, 8] and r[-1]["samples"] == 24  # nothing lost
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["samples"] == 24 and (final / "model.safetensors").exists()


def _driver(out, init, log):
    return subprocess.Popen(
        [sys.executable, "-m", "rlk3", "rl", str(ROOT / "configs/quickstart.yaml"), *overrides(out, init)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )


@pytest.mark.slow
def test_resume_after_sigkills_equals_an_uninterrupted_run(init_dir, tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    with open(tmp_path / "ref.log", "wb") as log:
        assert _driver(ref_out, init_dir, log).wait(timeout=900) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    rng = random.Random(7)
    kills = 0
    with open(tmp_path / "killed.log", "ab") as log:
        for _ in range(3):  # three kills at random moments, each after some progress
            before = len(rows(out))
            p = _driver(out, init_dir, log)
            deadline = time.time() + 600
            while len(rows(out)) <= before and p.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 3.0))
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                kills += 1
            p.wait()
        assert _driver(out, init_dir, log).wait(timeout=900) == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert kills >= 2
    a, b = load_file(ref_out / "final/model.safetensors"), load_file(out / "final/model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert stable(rows(ref_out)) == stable(rows(out))


@pytest.mark.slow
def test_ray_job_submit_of_the_quickstart_recipe(init_dir, tmp_path):
    port = 28265 + os.getpid() % 1000
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DASHBOARD_PORT": str(port),
           "RLK3_OUTPUT_DIR": str(tmp_path / "job"), "PY": sys.executable}
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    try:
        r = subprocess.run(["bash", str(ROOT / "recipes/quickstart.sh"), f"model.init_from={init_dir}",
                            "run.iterations=2", "run.checkpoint_every=1", "rollout.groups_per_iteration=2",
                            "rollout.max_new_tokens=32"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "succeeded" in (r.stdout + r.stderr).lower()
        got = rows(tmp_path / "job")
        assert [x["iteration"] for x in got] == [0, 1]
        assert (tmp_path / "job/final/manifest.json").exists()
        assert (tmp_path / "job/checkpoints/iter-000002/trainer.pt").exists()
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_the_eval_recipe_submits_an_absolute_manifest_and_can_reserve_a_gpu(tmp_path):
    """recipes/eval.sh: the job runs in a copy of the repository without runs/, so the documented relative manifest
    path (runs/demo/manifest.json) was not there; RLK3_OUTPUT_DIR added run.output_dir, which eval refuses; and the
    entrypoint, where eval runs its models, could not ask for a GPU. A stand-in `ray` records what is submitted."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$RAY_ARGS"\n')
    (fake / "ray").chmod(0o755)
    env = {**os.environ, "PY": str(fake / "python"), "RAY_ADDRESS": "http://head:8265",
           "RAY_ARGS": str(tmp_path / "args"), "RLK3_OUTPUT_DIR": str(tmp_path / "out")}

    def submit(*args, **extra):
        subprocess.run(["bash", str(ROOT / "recipes/eval.sh"), *args], cwd=tmp_path, env={**env, **extra},
                       check=True, timeout=60)
        return (tmp_path / "args").read_text().splitlines()

    got = submit("runs/demo/manifest.json", "n=4")
    entry = got[got.index("--") + 1:]
    assert entry == [str(fake / "python"), "-m", "rlk3", "eval", str(tmp_path / "runs/demo/manifest.json"), "n=4"]
    assert "--entrypoint-num-gpus" not in got
    got = submit("m.json", RLK3_ENTRYPOINT_GPUS="1")
    assert got[got.index("--entrypoint-num-gpus") + 1] == "1" and got.index("--entrypoint-num-gpus") < got.index("--")
    r = subprocess.run(["bash", str(ROOT / "recipes/eval.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage: recipes/eval.sh <manifest.json>" in r.stderr


class _Method:  # an actor method stand-in: ``.remote(...)`` calls it in place
    def __init__(self, fn):
        self.remote = fn


def test_sync_sends_only_new_weights(monkeypatch):
    """With λ < 1 an iteration may complete no group and train nothing: the engine must not be sent the same
    version again (it refuses a version that is not newer, which stopped the run)."""
    from types import SimpleNamespace

    from rlk3.cluster import driver

    monkeypatch.setattr(driver.ray, "get", lambda x: x)
    engine_version = 0

    def update_weights(weights, version):
        nonlocal engine_version
        if version <= engine_version:  # what RolloutEngine.update_weights does
            raise ValueError(f"update_weights: version must be an int greater than the current {engine_version}")
        engine_version = version

    versions = iter([0, 1, 1, 2])  # the trainer's version after iterations that trained / did not
    cluster = driver.Cluster.__new__(driver.Cluster)
    cluster.cfg = load_config(ROOT / "configs/quickstart.yaml")  # cluster.weight_sync: object_store
    cluster.version, cluster._submit = 0, threading.RLock()
    cluster.trainer = SimpleNamespace(version=_Method(lambda: next(versions)), weights=_Method(lambda: {}))
    cluster.trainers = [cluster.trainer]
    cluster.worker = SimpleNamespace(update_weights=_Method(update_weights), __ray_ready__=_Method(lambda: True))
    assert [cluster.sync() for _ in range(4)] == [0, 1, 1, 2]
    assert engine_version == 2


def test_a_rollout_worker_restart_says_why_the_worker_died(monkeypatch, capsys):
    """The driver restarts a rollout worker that died, but its log line said only 'died': the cause Ray reports
    (killed, out of memory, a crash) was dropped unless the third attempt failed too."""
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from rlk3.cluster import driver

    monkeypatch.setattr(driver.ray, "get", lambda x: x)
    cause = "The actor died because its worker process has died. Worker exit type: SYSTEM_ERROR (out of memory)"

    def dies(it, ahead):
        raise RayActorError(error_msg=cause)

    def worker(iterate):
        return SimpleNamespace(iterate=_Method(iterate), state=_Method(lambda: {}), load_state=_Method(lambda s: None),
                               __ray_ready__=_Method(lambda: True))

    cluster = driver.Cluster.__new__(driver.Cluster)
    cluster.cfg = load_config(ROOT / "configs/quickstart.yaml")
    cluster.release_pool, cluster.version, cluster.worker, cluster._buffer = False, 0, worker(dies), None
    cluster.trainer = SimpleNamespace(version=_Method(lambda: 0))  # no step yet: the new worker's checkpoint is it
    monkeypatch.setattr(cluster, "_new_rollout", lambda: worker(lambda it, ahead: ([], {})))
    trajs, stats = cluster._rollout(1, None)
    assert trajs == [] and stats["restarts"] == 1
    out = capsys.readouterr().out
    assert "the rollout worker died in iteration 1 (RayActorError: " + cause in out


def test_a_colocated_trainer_gives_its_cached_gpu_memory_back_for_the_engine(monkeypatch):
    """Colocated on a GPU the engine, in another process, takes its pool back after training and sees only the memory
    the device reports free; the trainer's caching allocator kept the step's freed activations (and FSDP's gathered
    weights) reserved, so the reacquire could fail with PoolError. The train worker empties its cache after each
    step and gather when colocated on a GPU, and keeps it otherwise (a disaggregated trainer reuses it)."""
    from types import SimpleNamespace

    from rlk3.cluster.workers import TrainWorker

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for colocate, num_gpus, want in ((True, 1, 2), (False, 1, 0), (True, 0, 0)):
        emptied.clear()
        worker = TrainWorker.__new__(TrainWorker)
        worker.cfg = SimpleNamespace(cluster=SimpleNamespace(colocate=colocate, num_gpus=num_gpus))
        worker.rank = 0
        worker.trainer = SimpleNamespace(step=lambda trajs: {"train/loss": 0.0}, weights=lambda: {"w": torch.ones(2)})
        assert worker.step([]) == {"train/loss": 0.0}
        assert torch.equal(worker.weights()["w"], torch.ones(2))
        assert len(emptied) == want, (colocate, num_gpus)


def test_cuda_ipc_sync_keeps_no_gathered_copy_of_the_weights(monkeypatch):
    """cluster.weight_sync=cuda_ipc under data parallelism: every rank gathers the full weights, and every rank kept
    them (rank 0 for the handles, the others for nothing) until the next sync, through the next rollout and training
    step: a full model copy on each GPU, undoing FSDP's sharding. Only rank 0 keeps them, and only until the engine
    has copied them."""
    from types import SimpleNamespace

    from rlk3.cluster import driver
    from rlk3.cluster.workers import TrainWorker

    worker = TrainWorker.__new__(TrainWorker)
    worker.cfg = SimpleNamespace(cluster=SimpleNamespace(colocate=True, num_gpus=1))
    worker.rank, worker.trainer = 1, SimpleNamespace(weights=lambda: {"w": torch.ones(2)})
    assert worker.share_weights() == {} and getattr(worker, "_shared", None) is None

    monkeypatch.setattr(driver.ray, "get", lambda x: x)
    calls = []
    rank0 = SimpleNamespace(share_weights=_Method(lambda: calls.append("share") or {"w": "handle"}),
                            drop_shared=_Method(lambda: calls.append("drop")))
    cluster = driver.Cluster.__new__(driver.Cluster)
    cluster.cfg = SimpleNamespace(cluster=SimpleNamespace(weight_sync="cuda_ipc"))
    cluster.trainer, cluster.trainers, cluster._submit = rank0, [rank0], threading.RLock()
    cluster.worker = SimpleNamespace(open_cuda_weights=_Method(lambda h, v: calls.append(("open", h, v))))
    cluster._push(3)
    assert calls == ["share", ("open", {"w": "handle"}, 3), "drop"]


def test_an_evaluation_between_iterations_takes_the_released_pool_back():
    """Colocated on a GPU the driver releases the engine's pool after each rollout (training's turn for the memory)
    and evaluates after the sync: the engine refuses to step without its pool, which failed every evaluation. The
    worker takes the pool back for it and releases it again afterwards."""
    import asyncio
    from types import SimpleNamespace

    from harness.tokenizer import default_tokenizer
    from rlk3.cluster.workers import RolloutWorker
    from rlk3.engine import EngineConfig, RolloutEngine
    from rlk3.model import K3Config, K3ForCausalLM
    from rlk3.rollout.agent_loop import LoopConfig
    from rlk3.rollout.env import RolloutEnv

    tok = default_tokenizer()
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=len(tok))).eval()
    worker = RolloutWorker.__new__(RolloutWorker)  # the parts evaluate() uses, without Ray or a config tree
    worker.cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=8, max_total_tokens=2048),
                                 harness=SimpleNamespace(max_turns=None), tasks=SimpleNamespace(files={}))
    worker.engine = RolloutEngine(model, EngineConfig(memory_bytes=64 << 20))
    worker.env = RolloutEnv(tok, domains=("general",)).__enter__()
    worker.loop = worker.env.loop(worker.engine, LoopConfig())
    worker.aio = asyncio.new_event_loop()
    try:
        worker.release_memory()  # as Cluster._rollout leaves it when release_pool
        (res,) = worker.evaluate([("general", "low", None)], 2)
        assert res["n"] == 2 and res["failed"] == 0 and res["mean_tokens"] > 0
        assert worker.engine.released and not worker.engine.requests  # released again, nothing left behind
    finally:
        worker.close()


def test_two_data_parallel_train_workers_train_like_one_and_resume(init_dir, tmp_path, ray_local):
    """cluster.train_workers=2: two train actors in one gloo process group (FSDP2), one iteration, against one
    train actor on the same rollouts; then a resume from the data-parallel checkpoint trains a second iteration."""
    from rlk3.cluster.driver import run_rl

    finals = {}
    for n in (1, 2):
        cfg = load_config(ROOT / "configs/quickstart.yaml",
                          overrides(tmp_path / f"n{n}", init_dir, **{"run.iterations": 1, "cluster.train_workers": n}))
        finals[n] = run_rl(cfg, log=lambda *_: None)
    one, two = load_file(finals[1] / "model.safetensors"), load_file(finals[2] / "model.safetensors")
    init = load_file(init_dir / "model.safetensors")
    assert one.keys() == two.keys()
    # Quantile Balancing's bias comes from pooled histograms under data parallelism: equal within a bin or two
    qb = [k for k in one if k.endswith("e_score_correction_bias")]
    assert qb and all(float((one[k] - two[k]).abs().max()) <= 5e-3 for k in qb)  # bins ~2e-3 wide
    moved = sum(float((one[k] - init[k]).pow(2).sum()) for k in one if k not in qb) ** 0.5
    parted = sum(float((one[k] - two[k]).pow(2).sum()) for k in one if k not in qb) ** 0.5
    assert moved > 1e-3 and parted / moved < 1e-3, (moved, parted)  # summation order only (test_parallel.py)
    r1, r2 = rows(tmp_path / "n1"), rows(tmp_path / "n2")
    assert r1[0]["trained"] == r2[0]["trained"] == 8
    assert r2[0]["train/loss"] == pytest.approx(r1[0]["train/loss"], rel=1e-4, abs=1e-7)
    # resume the data-parallel run from its checkpoint (full state dicts, loaded on every rank) for one more iteration
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      overrides(tmp_path / "n2", init_dir, **{"run.iterations": 2, "cluster.train_workers": 2,
                                                                "run.resume": True}))
    run_rl(cfg, log=lambda *_: None)
    assert [x["iteration"] for x in rows(tmp_path / "n2")] == [0, 1]
    assert load_file(tmp_path / "n2/final/model.safetensors").keys() == one.keys()


def test_weight_sync_by_broadcast_trains_like_the_object_store(init_dir, tmp_path, ray_local):
    """cluster.weight_sync=broadcast (rollout and training in separate bundles, a gloo group of two between train rank
    0 and the rollout worker) against the default object-store sync, colocated: the second and third iterations
    sample from the synced weights, so any tensor delivered wrong would change their tokens and rewards."""
    from rlk3.cluster.driver import run_rl

    finals = {}
    for mode, colocate in (("object_store", True), ("broadcast", False)):
        cfg = load_config(ROOT / "configs/quickstart.yaml",
                          overrides(tmp_path / mode, init_dir, **{"run.iterations": 3, "cluster.weight_sync": mode,
                                                                  "cluster.colocate": colocate}))
        finals[mode] = run_rl(cfg, log=lambda *_: None)
    a, b = rows(tmp_path / "object_store"), rows(tmp_path / "broadcast")
    assert len(a) == len(b) == 3 and stable(a) == stable(b)
    assert [r["version"] for r in b] == [1, 2, 3]  # three syncs, each to a new version
    wa, wb = (load_file(finals[m] / "model.safetensors") for m in ("object_store", "broadcast"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_overlap_samples_the_next_iteration_while_this_one_trains(init_dir, tmp_path, ray_local):
    """cluster.overlap (disaggregated): iteration i + 1's rollout runs during iteration i's training, so its tokens
    come from the weights before that update — one version behind, corrected per token — except right after a
    checkpoint, which waits for a quiet buffer. A resume from that checkpoint continues the same way."""
    from rlk3.cluster.driver import run_rl

    extra = {"run.iterations": 4, "run.checkpoint_every": 2, "cluster.colocate": False, "cluster.overlap": True}
    run_rl(load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir, **extra)),
           log=lambda *_: None)
    r = rows(tmp_path / "o")
    assert [x["rollout/overlapped"] for x in r] == [1, 0, 1, 0]  # none before a checkpoint or the end
    assert [x["version"] for x in r] == [1, 2, 3, 4]
    # iterations 1 and 3 were sampled under version 0 and 2 and trained at 1 and 3: every token is stale
    assert [x["train/stale_frac"] > 0.99 for x in r] == [False, True, False, True], [x["train/stale_frac"] for x in r]
    assert all(x["trained"] == 8 for x in r)  # complete groups, nothing lost (λ = 1)
    with pytest.raises(Exception, match=r"cluster.overlap=true .* set cluster.colocate=false"):
        load_config(ROOT / "configs/quickstart.yaml", ["cluster.overlap=true"])


def test_under_overlap_max_staleness_bounds_what_the_trainer_sees(init_dir, tmp_path, ray_local):
    """An overlapped rollout trains one version after the engine's, so the scheduler counts staleness against that
    one: with λ < 1 carrying trajectories across iterations and ``max_staleness`` 2, no trained token lags the
    training version by more than 2 (counted against the engine's version, carried tokens reached 3). At 1,
    overlap and λ < 1 are refused: a paused trajectory would train 2 versions stale."""
    from rlk3.cluster.driver import run_rl

    extra = {"run.iterations": 6, "run.checkpoint_every": 100, "cluster.colocate": False, "cluster.overlap": True,
             "rollout.lam": 0.5, "rollout.max_staleness": 2}
    run_rl(load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir, **extra)),
           log=lambda *_: None)
    r = rows(tmp_path / "o")
    assert [x["rollout/overlapped"] for x in r] == [1, 1, 1, 1, 1, 0]
    lags = [x.get("train/staleness_max", 0) for x in r]
    assert max(lags) == 2, lags  # carried and overlapped tokens trained, none past the bound
    with pytest.raises(Exception, match=r"rollout.max_staleness=1 forbids that, so nothing could be paused: .* "
                                        r"rollout.max_staleness>=2"):
        load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir,
                                                                **{**extra, "rollout.max_staleness": 1}))


@pytest.mark.slow  # a Ray cluster of its own, ~1 min: the default suite stays near 20 min
def test_a_rollout_worker_restarted_beside_a_finished_step_labels_the_weights_it_was_given(init_dir, tmp_path,
                                                                                           ray_local):
    """Under cluster.overlap iteration i + 1's rollout runs while iteration i trains, and the driver syncs only after
    both. A rollout worker that dies in between is restarted with the trainer's weights as they are then: once the
    step is done, version 1's. They were labelled with the driver's last synced version (0), so every token counted
    one version staler than it was, against max_staleness too. Now the label is read with the weights."""
    from rlk3.cluster.driver import Cluster

    extra = {"cluster.colocate": False, "cluster.overlap": True, "run.checkpoint_every": 100, "rollout.lam": 1.0}
    cluster = Cluster(load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir, **extra)),
                      tmp_path / "o")
    try:
        trajs, _, _ = cluster.rollout(0, None)
        cluster.train(trajs)  # the trainer is at version 1; the engine holds 0 until the driver's sync
        killed = []

        def killer():  # the overlapped rollout of iteration 1 dies inside its iterate call, after the step
            while not killed:
                out = subprocess.run(["pgrep", "-f", "ray::RolloutWorker.iterate"], capture_output=True, text=True)
                for pid in out.stdout.split():
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
                time.sleep(0.02)

        threading.Thread(target=killer, daemon=True).start()
        trajs, stats, _ = cluster.rollout(1, None, ahead=True)
        assert killed
        assert stats["restarts"] == 1 and cluster.version == 1
        assert {v for t in trajs for v in t.policy_versions} == {1}
        m = cluster.train(trajs)
        assert m["train/stale_frac"] == 0.0 and abs(m["train/is_weight_mean"] - 1) < 1e-3  # version 1's weights
        assert cluster.sync() == 2
    finally:
        cluster.close()


def test_train_calls_from_two_threads_reach_every_rank_in_one_order(monkeypatch):
    """Under cluster.overlap a rollout worker's restart pushes weights from the rollout thread while the driver's
    thread submits the step. With data parallelism both are collectives: rank 0 queued the step before the gather
    and rank 1 the gather before the step, and each waited for the other forever. Each call to every rank is now
    submitted under one lock."""
    from types import SimpleNamespace

    from rlk3.cluster import driver

    monkeypatch.setattr(driver.ray, "get", lambda x: x)
    seen = {0: [], 1: []}

    def rank(r):
        def call(name, out=None):
            def remote(*_):
                seen[r].append(name)
                time.sleep(0.002)  # a submission takes time: the other thread gets in between ranks if it can
                return out
            return _Method(remote)
        return SimpleNamespace(step=call("step"), weights=call("weights", {}), version=call("version", 1))

    cluster = driver.Cluster.__new__(driver.Cluster)
    cluster.cfg = SimpleNamespace(cluster=SimpleNamespace(weight_sync="object_store"))
    cluster.trainers = [rank(0), rank(1)]
    cluster.trainer, cluster._submit = cluster.trainers[0], threading.RLock()
    cluster.worker = SimpleNamespace(update_weights=_Method(lambda w, v: None))
    steps = threading.Thread(target=lambda: [cluster._on_all("step") for _ in range(30)])
    steps.start()
    for _ in range(30):
        cluster._push()
    steps.join()
    collective = [[name for name in seen[r] if name != "version"] for r in (0, 1)]  # version: rank 0 alone
    assert collective[0] == collective[1] and collective[0].count("step") == 30


@pytest.mark.slow  # a Ray cluster of its own, ~1 min: the default suite stays near 20 min
def test_a_rollout_worker_that_dies_between_rollouts_is_revived_with_its_buffer(init_dir, tmp_path, ray_local):
    """Only a death inside a rollout was restarted: a rollout worker that died outside one (idle while the trainer
    steps, in an evaluation, a weight push, a checkpoint's state read) stopped the run at the driver's next call to
    it. It is revived before that call, with the carry-over buffer its last rollout left (λ < 1: paused and early
    finished trajectories) and the trainer's weights."""
    import ray

    from rlk3.cluster.driver import Cluster

    extra = {"rollout.lam": 0.5, "rollout.max_staleness": 2, "run.checkpoint_every": 100}
    cluster = Cluster(load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir, **extra)),
                      tmp_path / "o")

    def kill(actor):  # dead before the driver's next call (ray.kill returns before the process is gone)
        pid = ray.get(actor.pid.remote())
        os.kill(pid, signal.SIGKILL)
        while True:  # until reaped or a zombie; /proc/<pid> may vanish between any two reads of it
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return
            if state == "Z":
                return
            time.sleep(0.01)

    try:
        it, trajs = 0, []
        while not trajs:  # with λ = 0.5 an iteration may complete no group
            trajs, _, _ = cluster.rollout(it, None)
            it += 1
        buffer = cluster.rollout_state()
        assert buffer["buffer"]  # trajectories carried into the next iteration
        cluster.train(trajs)
        kill(cluster.worker)  # idle while the trainer stepped
        assert cluster.sync() == 1 and cluster.rollout_state() == buffer
        kill(cluster.worker)
        assert "eval/general/high/pass_rate" in cluster.evaluate(512)
        kill(cluster.worker)
        assert cluster.rollout_state() == buffer
        trajs, stats, _ = cluster.rollout(it, None)
        assert stats["restarts"] == 0 and trajs
        carried = {t["uid"] for t in buffer["buffer"]}  # each trained now or still carried: none lost
        assert carried <= {t.uid for t in trajs} | {t["uid"] for t in cluster.rollout_state()["buffer"]}
        assert max(v for t in trajs for v in t.policy_versions) == 1
    finally:
        cluster.close()


@pytest.mark.slow  # a Ray cluster of its own per sync mode, ~1 min each: the default suite stays near 20 min
@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_a_rollout_worker_that_dies_taking_a_weight_push_is_revived_with_the_weights(init_dir, tmp_path, ray_local,
                                                                                    monkeypatch, sync):
    """A rollout worker that died while it took the trainer's weights (out of memory in the copy, say) stopped the
    run: the driver's sync raised Ray's error, and with ``broadcast`` rank 0's send failed beside it, its peer gone.
    It is revived at once, the new worker given the weights (over a fresh group for ``broadcast``), and the next
    rollout samples from them: its tokens are labelled with the new version, and the trainer's recompute of their
    log-probs matches the engine's."""
    import ray

    from rlk3.cluster import driver
    from rlk3.cluster.workers import RolloutWorker

    died = tmp_path / "died"

    class DiesTakingWeights(RolloutWorker):  # the first worker dies in its first weight update, halfway through
        def _first(self) -> bool:
            if died.exists():
                return False
            died.write_text(str(os.getpid()))
            return True

        def update_weights(self, weights, version):
            if self._first():
                os._exit(1)
            super().update_weights(weights, version)

        def recv_weights(self, version):
            if self._first():
                next(self.wgroup.recv())  # the header and the first bucket taken, the rest of the send in flight
                os._exit(1)
            super().recv_weights(version)

    monkeypatch.setattr(driver, "RolloutWorker", DiesTakingWeights)
    extra = {"cluster.weight_sync": sync, "cluster.colocate": sync != "broadcast", "run.checkpoint_every": 100,
             "rollout.lam": 1.0}
    cluster = driver.Cluster(load_config(ROOT / "configs/quickstart.yaml", overrides(tmp_path / "o", init_dir,
                                                                                     **extra)), tmp_path / "o")
    try:
        trajs, _, _ = cluster.rollout(0, None)
        cluster.train(trajs)
        first = ray.get(cluster.worker.pid.remote())
        assert cluster.sync() == 1
        assert died.read_text() == str(first) and ray.get(cluster.worker.pid.remote()) != first
        trajs, stats, _ = cluster.rollout(1, None)
        assert stats["restarts"] == 0 and {v for t in trajs for v in t.policy_versions} == {1}
        m = cluster.train(trajs)
        assert m["train/stale_frac"] == 0.0 and abs(m["train/is_weight_mean"] - 1) < 1e-3  # version 1's weights
        assert cluster.sync() == 2  # the (new) worker takes the next push as any other
    finally:
        cluster.close()
