"""The workers in-process (no Ray): what they build from a run's config."""

from pathlib import Path

import torch

from rlk3.cluster.workers import TrainWorker
from rlk3.config import load_config

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
