"""The multi-turn benchmark's conversation (10 turns of +2,048 tokens, 16 generated each) on engines that differ in
their prefix-cache configuration, interleaved in one process so that every variant sees the same machine state:
each engine runs one untimed conversation (compilation, graph captures), then the variants take turns over ``--reps``
timed conversations; each keeps its best. Used to find what a cached turn's time is made of (docs/BENCHMARKS.md).

    python bench/multiturn_variants.py --device cuda --variants no_cache,default,no_interval,no_splits,in_step_off

Variants: ``no_cache``; ``default`` (the engine's defaults); ``no_interval`` (no interval checkpoints: only the turn
ends'); ``no_splits`` (no checkpoint at a block boundary inside a turn at all: only tails); ``in_step_off``
(``checkpoint_in_step`` off: a boundary checkpoint ends the chunk instead of splitting KDA); ``cudnn`` (the defaults
with ``cudnn_attention``: causal prefill calls on cuDNN at padded shapes). Set
``PYTORCH_CUDA_ALLOC_CONF`` in the environment to compare allocator settings (one process each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine import conversation
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.model import K3Config, K3ForCausalLM

VARIANTS = {
    "no_cache": dict(enable_prefix_cache=False),
    "default": dict(),
    "no_interval": dict(checkpoint_interval=1 << 20),
    "no_splits": dict(checkpoint_interval=1 << 20, checkpoint_prompt_end=False),
    "in_step_off": dict(checkpoint_in_step=False),
    "cudnn": dict(cudnn_attention=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="no_cache,default,no_splits")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/results/multiturn-variants.json"))
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {sorted(VARIANTS)}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset, dtype = ("k3-small", torch.bfloat16) if cuda else ("k3-tiny", torch.float32)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset)).to(device, dtype).eval()
    vocab = model.config.vocab_size
    base = dict(memory_bytes=(12 * 2**30 if cuda else 256 * 2**20), prefill_chunk=512,
                max_tokens_per_step=None if cuda else 512)
    engines = {n: RolloutEngine(model, EngineConfig(**base, **VARIANTS[n])) for n in names}
    for engine in engines.values():
        conversation(engine, vocab, 10, 2048, 16, device, 1000)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.reps):
        for n in names:
            c = conversation(engines[n], vocab, 10, 2048, 16, device, 3 + r)
            runs[n].append(dict(prefill_seconds=c["prefill_seconds"], prefill_tokens=c["prefill_tokens"],
                                split_checkpoints=c["split_checkpoints"],
                                turn_ms=[round(t["prefill_seconds"] * 1e3, 2) for t in c["turns"]],
                                token_ids=[t["token_ids"] for t in c["turns"]]))
    # greedy replies that differ from the first variant's, of all timed turns (a bf16 near-tie may flip one)
    unlike = {n: sum(a != b for x, y in zip(runs[n], runs[names[0]]) for a, b in zip(x["token_ids"], y["token_ids"]))
              for n in names}
    replies = args.reps * len(runs[names[0]][0]["token_ids"])
    best = {n: min(x["prefill_seconds"] for x in v) for n, v in runs.items()}
    print(f"\n{preset} ({dtype}, {device}), best of {args.reps}; ratio = no_cache / variant")
    print(f"| variant | prefill tokens | KDA splits | prefill s (best) | ratio | replies unlike {names[0]}'s |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        ratio = f"{best['no_cache'] / best[n]:.2f}x" if "no_cache" in best else "-"
        r = runs[n][0]
        print(f"| {n} | {r['prefill_tokens']} | {r['split_checkpoints']} | {best[n]:.4f} | {ratio} "
              f"| {unlike[n]} of {replies} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=str(device), gpu=torch.cuda.get_device_name(device) if cuda else None, preset=preset,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), torch=torch.__version__, runs=runs, best=best,
        replies_unlike_first_variant=unlike,
    ), indent=1))


if __name__ == "__main__":
    main()
