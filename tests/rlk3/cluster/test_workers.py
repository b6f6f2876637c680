"""The workers in-process (no Ray): what they build from a run's config."""

from pathlib import Path

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
