"""How much does one optimizer step on each kind of data move the held-out pass rate? (docs/rl.md, third round)

From one SFT checkpoint, three arms take the same optimizer (the RL trainer's AdamW, same learning rate) for the
same number of steps, and the greedy general/high pass rate on held-out tasks is measured along the way:

    demos        fresh clean demonstrations (training tasks the SFT stage never saw), 16 per step: more SFT
    own-correct  the policy's own correct samples at temperature 1, 16 per step, resampled from the current policy
                 (rejection-sampling fine-tuning: the positive half of what an outcome reward can teach)
    grpo         the RL trainer itself (rlk3.train.trainer.Trainer) on groups × group_size fresh samples per step

It tells apart "the update cannot move this model" (every arm flat) from "the policy's own samples carry little
of what the demonstrations do" (demos up, the other two flat or down). CPU, one thread per run:

    .venv/bin/python -m bench.rl_signal --ckpt runs/sft-tiny --steps 100 --eval-every 25
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import time

import torch

from bench._common import print_table, write_json
from envs.tasks import get_tasks
from rlk3.config import TrainConfig
from rlk3.engine import EngineConfig, RolloutEngine
from rlk3.rollout.agent_loop import LoopConfig
from rlk3.rollout.demos import DEFAULT_BUDGETS, build_demos
from rlk3.rollout.env import RolloutEnv
from rlk3.rollout.evaluate import evaluate_policy, load_policy
from rlk3.train.sft import tokenized_rows
from rlk3.train.trainer import Trainer

EFFORT = "high"


def heldout(model, tok, n: int) -> float:
    res, _ = evaluate_policy(copy.deepcopy(model).eval(), tok, [("general", EFFORT, DEFAULT_BUDGETS[EFFORT])], n=n)
    return res[0].pass_rate


def sft_step(model, opt, seqs: list[tuple[list[int], list[int]]]) -> float:
    """One step of the SFT loss (mean over assistant tokens) on ``(token_ids, loss_mask)`` rows."""
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in seqs])
    labels = torch.tensor([[t if m else -100 for t, m in zip(i, mk)] + [-100] * (width - len(i)) for i, mk in seqs])
    attn = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in seqs])
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def sample(engine, env, tasks, k: int, tag: str, temperature: float = 1.0):
    loop = env.loop(engine, LoopConfig(temperature=temperature, max_turn_tokens=400, max_context_tokens=1024))

    async def main():
        async def one(t, j):
            tr = loop.new_trajectory(t, effort=EFFORT, budget=DEFAULT_BUDGETS[EFFORT], group_id=f"{tag}-{t.task_id}",
                                     uid=f"{tag}-{t.task_id}-{j}")
            return await loop.run(t, tr)
        try:
            return await asyncio.gather(*(one(t, j) for t in tasks for j in range(k)))
        finally:
            await loop.front.close()

    return asyncio.run(main())


def run_arm(arm: str, args) -> list[dict]:
    torch.manual_seed(args.seed)
    model, tok = load_policy(args.ckpt)
    model.config.use_cache = False
    model.train()
    cfg = TrainConfig(lr=args.lr, qb_update=False)
    trainer = Trainer(model, cfg, log=lambda *_: None)  # its AdamW (betas 0.9/0.99) for every arm
    rng = random.Random(args.seed)
    rows = [{"arm": arm, "step": 0, "samples": 0, "heldout": heldout(model, tok, args.n)}]
    print(rows[-1], flush=True)
    t0, seen = time.time(), 0
    if arm == "demos":
        demos = build_demos("general", 16 * args.steps, tokenizer=tok, error_rate=0.0, seed=args.seed, start=8000,
                           effort_weights={EFFORT: 1})
        data, _ = tokenized_rows(demos, tok, 512)
        rng.shuffle(data)
    engine = RolloutEngine(copy.deepcopy(model).eval(), EngineConfig(memory_bytes=256 << 20))
    pool = get_tasks("general", "train", 4096)
    queue: list[tuple[list[int], list[int]]] = []
    with RolloutEnv(tok, domains=("general",)) as env:
        for step in range(1, args.steps + 1):
            if arm == "demos":
                batch = data[(step - 1) * 16 : step * 16]
                seen += len(batch)
                sft_step(model, trainer.opt, [(r["input_ids"], r["assistant_masks"]) for r in batch])
            elif arm == "own-correct":
                while len(queue) < 16:
                    trs = sample(engine, env, rng.sample(pool, args.groups), args.group_size, f"{step}")
                    seen += len(trs)
                    queue += [(list(t.token_ids), list(t.loss_mask)) for t in trs if t.reward > 0]
                sft_step(model, trainer.opt, queue[:16])
                queue = queue[16:]
            else:  # grpo: one RL update per step, as the driver runs it
                trs = sample(engine, env, rng.sample(pool, args.groups), args.group_size, f"{step}")
                seen += len(trs)
                trainer.step(trs)
            engine.update_weights({k: v.detach().clone() for k, v in model.state_dict().items()}, step)
            if step % args.eval_every == 0 or step == args.steps:
                rows.append({"arm": arm, "step": step, "samples": seen, "heldout": heldout(model, tok, args.n),
                             "wall_s": round(time.time() - t0)})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="an SFT checkpoint directory (configs/sft-tiny.yaml's output)")
    p.add_argument("--arms", default="demos,own-correct,grpo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--groups", type=int, default=16, help="tasks sampled per round (grpo: per step)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--n", type=int, default=200, help="held-out tasks per evaluation")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ("demos", "own-correct", "grpo")]
    if bad:
        p.error(f"--arms: unknown {bad}; valid: demos, own-correct, grpo")
    rows = [r for a in arms for r in run_arm(a, args)]
    print_table(rows, ["arm", "step", "samples", "heldout", "wall_s"])
    write_json("rl_signal", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
