"""The workers in-process (no Ray): what they build from a run's config."""

from pathlib import Path

import pytest
import torch

from rlk3.cluster.workers import TrainWorker
from rlk3.config import load_config
from rlk3.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


def test_the_kl_anchor_is_the_policys_starting_weights():
    """``train.kl_coef > 0`` anchors the policy to a frozen reference. Without ``model.init_from`` (a fresh preset
    model) the reference was a second ``build_policy``: another random model, drawn from the RNG the first had
    advanced, so the KL penalty pulled the policy towards noise."""
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["train.kl_coef=0.1", "model.init_from=null"])
    trainer = TrainWorker(cfg).trainer
    ref, policy = trainer.ref_model, trainer.model
    assert ref is not policy and not any(p.requires_grad for p in ref.parameters())
    ours, theirs = dict(policy.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_model_dtype_sets_the_rollout_engines_precision_and_the_trainer_stays_float32(tmp_path):
    """``model.dtype`` reached only SFT: an RL run of k3-small (``bfloat16`` in configs/model/k3-small.yaml)
    generated in float32. Now the rollout engine holds the policy at that dtype; the trainer keeps float32 weights,
    and their updates are cast into the engine's."""
    from rlk3.cluster.workers import RolloutWorker

    cfg = load_config(ROOT / "configs/quickstart.yaml", ["model.init_from=null", "model.dtype=bfloat16",
                                                          "model.overrides={num_hidden_layers: 2}"])
    rollout = RolloutWorker(cfg, str(tmp_path))
    try:
        engine = rollout.engine
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        train = TrainWorker(cfg)
        assert {p.dtype for p in train.trainer.model.parameters()} == {torch.float32}
        weights = train.weights()
        rollout.update_weights(weights, 1)
        name, w = next(iter(weights.items()))
        assert torch.equal(dict(engine.model.named_parameters())[name], w.to(torch.bfloat16))
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
        assert len(out.token_ids) == 4 and out.versions == [1] * 4
    finally:
        rollout.close()


def test_an_rl_iteration_trains_on_the_task_files_prompts_and_evaluates_on_its_heldout_ones(tmp_path, monkeypatch):
    """``tasks.files`` end to end: the real driver, rollout worker and trainer in this process (Ray's API stood in,
    tests/test_docs.py's ``_run_in_process``). Every episode of the iteration is one of the file's train tasks, and
    the evaluation after it runs the file's held-out tasks, none of the synthetic suite's."""
    from envs.tasks.loaders import load
    from rlk3.rollout.agent_loop import AgentLoop
    from tests.envs.test_tasks import gsm8k_file
    from tests.test_docs import _run_in_process

    f = gsm8k_file(tmp_path / "gsm8k.jsonl", 30)
    train = {t.task_id for t in load(f, "gsm8k", "train")}
    held = [t.task_id for t in load(f, "gsm8k", "heldout")]
    episodes = []  # (uid, task id) of every episode the agent loop runs
    real_run = AgentLoop.run

    async def run(self, task, traj):
        episodes.append((traj.uid, task.task_id))
        return await real_run(self, task, traj)

    monkeypatch.setattr(AgentLoop, "run", run)
    cfg = load_config(ROOT / "configs/quickstart.yaml", [
        f"tasks.files={{general: {f}}}", f"run.output_dir={tmp_path / 'run'}", "model.init_from=null",
        "model.overrides={num_hidden_layers: 2}", "run.iterations=1", "run.eval_every=1", "run.checkpoint_every=1",
        "run.log_tensorboard=false", "rollout.groups_per_iteration=3", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "cluster.cpu_threads=1"])
    rows = _run_in_process(monkeypatch, cfg)
    trained = [tid for uid, tid in episodes if not uid.startswith("eval-")]
    assert len(trained) == 6 and set(trained) <= train and all(t.startswith("gsm8k/train/") for t in trained)
    assert [tid for uid, tid in episodes if uid.startswith("eval-")] == held
    assert "eval/general/high/pass_rate" in rows[-1]


@pytest.mark.gpu
def test_a_bfloat16_rl_iteration_on_a_gpu(tmp_path):
    """k3-small as configs/model/k3-small.yaml runs it: the rollout engine in bfloat16 on the GPU, the trainer in
    float32 beside it (the colocated layout in one process, no Ray). The trainer's log-probs of the engine's tokens
    stay close to the engine's own (the importance weights the loss corrects with), an update reaches the engine
    cast to bfloat16, and the next iteration's tokens carry the new version."""
    from rlk3.cluster.workers import RolloutWorker

    cfg = load_config(ROOT / "configs/quickstart.yaml", [
        "model.init_from=null", "model.preset=k3-small", "model.dtype=bfloat16", "rollout.groups_per_iteration=4",
        "rollout.group_size=4", "rollout.max_new_tokens=48", "cluster.num_gpus=1",
        # 16 sequences at most: the graphs (each compiled on a fresh machine) of larger batches would go unused
        "rollout.engine.cuda_graph_batch_sizes=[1,2,4,8,16]"])
    rollout = RolloutWorker(cfg, str(tmp_path))
    try:
        engine = rollout.engine
        assert {(p.dtype, p.device.type) for p in engine.model.parameters()} == {(torch.bfloat16, "cuda")}
        trajs, _ = rollout.iterate(0)
        assert len(trajs) == 16 and all(set(t["policy_versions"]) == {0} for t in trajs)
        train = TrainWorker(cfg)
        assert {(p.dtype, p.device.type) for p in train.trainer.model.parameters()} == {(torch.float32, "cuda")}
        m = train.step(trajs)
        print({k: v for k, v in m.items() if k.startswith("train/")})
        # a random model's tokens sit near ties, where a rounding-level difference flips an MoE route: on an H100
        # the mean was 0.978 and the largest weight 3.41 (the loss caps or masks it, train.is_cap); a wrong
        # temperature, dtype or weight set moves the mean itself
        assert abs(m["train/is_weight_mean"] - 1) < 0.05 and m["train/is_weight_max"] < 20.0
        assert torch.isfinite(torch.tensor(m["train/loss"])) and m["train/version"] == 1
        # a random model's groups all score 0, so the step moved nothing: scaled, the update is seen to arrive
        weights = {k: 1.5 * w for k, w in train.weights().items()}
        rollout.update_weights(weights, 1)
        ours = dict(engine.model.named_parameters())
        assert all(torch.equal(ours[k], w.to("cuda", torch.bfloat16)) for k, w in weights.items() if k in ours)
        trajs, _ = rollout.iterate(1)
        versions = {v for t in trajs for v in t["policy_versions"]}
        assert 1 in versions and versions <= {0, 1}
    finally:
        rollout.close()
