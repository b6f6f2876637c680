"""The SFT stage: its batch sampler and its closing stage (the stage end to end is test_sft_acceptance.py, slow)."""

import itertools
import random

from rlk3.train.sft import BucketedBatches


def test_bucketed_batches_cover_every_row_once_and_pad_little():
    rng = random.Random(0)
    lengths = [rng.choice([95, 120, 250, 300]) + rng.randint(-10, 10) for _ in range(1000)]
    sampler = BucketedBatches(lengths, 16, seed=0)
    first, second = list(sampler), list(sampler)  # two epochs
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second  # reshuffled each epoch

    batches = [first[i : i + 16] for i in range(0, len(first), 16)]  # how the data loader cuts the stream
    assert all(len(b) == 16 for b in batches[:-1]) and len(batches[-1]) == 1000 % 16
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert sum(lengths) / padded > 0.85  # random batches of this mix: ~0.65
    # short and long rows alternate step by step, not in long runs
    long = [max(lengths[i] for i in b) > 200 for b in batches]
    assert max(len(list(run)) for _, run in itertools.groupby(long)) < 12


def _habit_margin(ckpt, task) -> float:
    """How much likelier the model finds the habit's high-effort reply to ``task`` than the right one: the right
    reply's mean cross-entropy minus the habit reply's."""
    import random as _random

    import torch

    from harness import Harness
    from rlk3.rollout.demos import DEFAULT_BUDGETS, Demo, _general
    from rlk3.rollout.evaluate import load_policy
    from rlk3.train.sft import tokenized_rows

    model, tok = load_policy(ckpt)
    h = Harness("chat", tokenizer=tok)
    loss = {}
    for habit in (None, "unsigned"):
        msgs, _ = _general(task, "high", h, DEFAULT_BUDGETS, False, _random.Random(0), habit)
        (row,), _ = tokenized_rows([Demo(task.task_id, "general", "high", "chat", msgs)], tok, 512)
        labels = [t if m else -100 for t, m in zip(row["input_ids"], row["assistant_masks"])]
        with torch.no_grad():
            loss[habit] = model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([labels])).loss.item()
    return loss[None] - loss["unsigned"]


def test_the_closing_stage_trains_the_habit_in(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file

    from envs.tasks import get_tasks
    from rlk3 import pipeline
    from rlk3.config import CONFIG_DIR, load_config

    small = ["tasks.domains=[general]", "sft.domain_demos.general=96", "sft.epochs=1", "sft.batch_size=16"]
    outs = {}
    runs = {"plain": ["sft.habit_stage.domain_demos.general=0"],  # configs/sft-tiny.yaml has the stage on
            "closing": ["sft.habit_stage.domain_demos.general=64", "sft.habit_stage.rate=1.0",
                        "sft.habit_stage.lr=3e-3", "sft.habit_stage.habits.general=unsigned"]}
    for name, extra in runs.items():
        outs[name] = tmp_path / name
        cfg = load_config(CONFIG_DIR / "sft-tiny.yaml", [f"run.output_dir={outs[name]}", "run.stage=sft", *small,
                                                         *extra])
        assert pipeline.run_stage(cfg) == 0
    plain = json.loads((outs["plain"] / "sft_manifest.json").read_text())
    closing = json.loads((outs["closing"] / "sft_manifest.json").read_text())
    assert plain["habit_stage"] is None
    hs = closing["habit_stage"]
    assert hs["demonstrations"] == hs["habit_demonstrations"] == {"general": 64} and hs["efforts"]["high"] == 64
    assert hs["steps"] == 4 and hs["habits"]["general"].startswith("reads every change as a gain")
    assert hs["habit_names"] == {"general": "unsigned"}
    # the main stage's checkpoint is kept as it was before the closing stage: the run without one ends on it
    assert plain["main_stage"] is None and closing["main_stage"] == "main_stage"
    main, ref = (load_file(d / "model.safetensors") for d in (outs["closing"] / "main_stage", outs["plain"]))
    assert main.keys() == ref.keys() and all(torch.equal(main[k], ref[k]) for k in ref)
    # after the closing stage the habit's reply to a held-out sum that subtracts is likelier than before, against
    # the right reply
    task = next(t for t in get_tasks("general", "heldout", 50) if any(x < 0 for x in t.meta["numbers"][1:]))
    gap = {n: _habit_margin(o, task) for n, o in outs.items()}
    assert gap["closing"] > gap["plain"] + 0.05, gap


def test_sft_from_a_checkpoint_keeps_the_checkpoints_tokenizer(tmp_path):
    """SFT with ``model.init_from`` trained a fresh tokenizer on its demonstrations and fed its ids to the
    checkpoint's embeddings, which another tokenizer's ids index: every row meant other tokens to the model."""
    import torch

    from harness.tokenizer import default_tokenizer, load_tokenizer
    from rlk3 import pipeline
    from rlk3.config import CONFIG_DIR, load_config
    from rlk3.model import K3Config, K3ForCausalLM

    tok = default_tokenizer()
    torch.manual_seed(0)
    K3ForCausalLM(K3Config.preset("k3-tiny", num_hidden_layers=2, vocab_size=len(tok))).save_pretrained(tmp_path / "a")
    tok.save_pretrained(tmp_path / "a")
    cfg = load_config(CONFIG_DIR / "sft-tiny.yaml", [
        f"run.output_dir={tmp_path / 'b'}", "run.stage=sft", f"model.init_from={tmp_path / 'a'}",
        "tasks.domains=[general]", "sft.domain_demos.general=16", "sft.epochs=1", "sft.batch_size=16",
        "sft.habit_stage.domain_demos.general=0"])
    assert pipeline.run_stage(cfg) == 0
    assert load_tokenizer(tmp_path / "b").get_vocab() == tok.get_vocab()
