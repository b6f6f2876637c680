"""The SFT stage: demonstrations → a tokenizer → TRL's ``SFTTrainer`` on the K3 model → the checkpoint RL starts from.

1. Demonstrations per domain (``rlk3.rollout.demos``): reference solutions replayed through the harness at every
   effort level, imperfect on purpose.
2. A byte-level BPE tokenizer trained on the rendered demonstrations (``harness.tokenizer.train_tokenizer``), so
   the system prompts and tool syntax cost a handful of tokens, not hundreds.
3. The model from its preset with ``vocab_size = len(tokenizer)`` (or from ``model.init_from``).
4. ``trl.SFTTrainer`` on pre-tokenized rows (``input_ids`` + ``assistant_masks``): loss on assistant tokens only.
5. ``save_pretrained`` of model and tokenizer plus ``sft_manifest.json`` (demo counts, loss curve, wall time).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from harness import Harness
from harness.tokenizer import train_tokenizer
from rlk3.model import K3Config, K3ForCausalLM
from rlk3.rollout.demos import DOMAIN_PRESETS, Demo, build_demos


def render_corpus(demos: list[Demo], tokenizer) -> list[str]:
    """The demonstrations as the model will see them (chat template, each preset's syntax and tool list)."""
    harnesses = {p: Harness(p, tokenizer=tokenizer) for p in {d.preset for d in demos}}
    return [harnesses[d.preset].render_text(d.messages, add_generation_prompt=False) for d in demos]


def tokenized_rows(demos: list[Demo], tokenizer, max_length: int) -> tuple[list[dict], int]:
    """Pre-tokenized SFT rows; demonstrations longer than ``max_length`` are dropped (truncating would cut the
    answer off a conversation and teach an unfinished turn). Returns (rows, dropped)."""
    harnesses = {p: Harness(p, tokenizer=tokenizer) for p in {d.preset for d in demos}}
    rows, dropped = [], 0
    for d in demos:
        ids, mask = harnesses[d.preset].assistant_mask(d.messages)
        if len(ids) > max_length:
            dropped += 1
            continue
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return rows, dropped


def build_model(cfg, tokenizer) -> K3ForCausalLM:
    if cfg.model.init_from:
        return K3ForCausalLM.from_pretrained(cfg.model.init_from)
    k3 = K3Config.preset(
        cfg.model.preset,
        **{**dict(cfg.model.overrides), "vocab_size": len(tokenizer)},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(cfg.run.seed)
    return K3ForCausalLM(k3)


def run_sft(cfg, log=print) -> Path:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    demos: list[Demo] = []
    for domain in cfg.tasks.domains:
        demos += build_demos(domain, cfg.sft.demos_per_domain, error_rate=cfg.sft.demo_error_rate,
                             seed=cfg.run.seed, preset=DOMAIN_PRESETS[domain])
    log(f"sft: {len(demos)} demonstrations ({', '.join(cfg.tasks.domains)}) in {time.time() - t0:.1f}s")

    tok = train_tokenizer(render_corpus(demos, None), vocab_size=cfg.sft.vocab_size, out_dir=None)
    rows, dropped = tokenized_rows(demos, tok, cfg.sft.max_length)
    random.Random(cfg.run.seed).shuffle(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    log(f"sft: tokenizer {len(tok)} tokens; {len(rows)} rows, mean {sum(lengths) / len(lengths):.0f} tokens, "
        f"{dropped} dropped over max_length={cfg.sft.max_length}")

    model = build_model(cfg, tok)
    args = SFTConfig(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=cfg.sft.batch_size,
        learning_rate=cfg.sft.lr,
        num_train_epochs=cfg.sft.epochs,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.sft.warmup_ratio,  # a float in [0, 1) is a ratio of the total steps
        weight_decay=0.0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=cfg.model.dtype == "bfloat16",
        max_length=cfg.sft.max_length,
        train_sampling_strategy="group_by_length",
        seed=cfg.run.seed,
        dataloader_num_workers=0,
        disable_tqdm=False,
        gradient_checkpointing=False,  # a few-M-parameter model has activations to spare; recomputing costs ~30%
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    manifest = {
        "stage": "sft",
        "demonstrations": {d: sum(x.domain == d for x in demos) for d in cfg.tasks.domains},
        "imperfect_demonstrations": sum(not d.correct for d in demos),
        "rows": len(rows),
        "dropped_over_max_length": dropped,
        "tokens": sum(lengths),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "train_runtime_s": result.metrics.get("train_runtime"),
        "wall_s": time.time() - t0,
    }
    (out / "sft_manifest.json").write_text(json.dumps(manifest, indent=2))
    log(f"sft: done in {manifest['wall_s']:.0f}s, loss {manifest['loss_first']} -> {manifest['loss_last']}; "
        f"checkpoint in {out}")
    return out
