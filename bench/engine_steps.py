"""Where a multi-turn conversation's prefill time goes, step by step (issue 3's multi-turn goal): the benchmark's
10 turns of +2,048 tokens (16 generated each), with the prefix cache and without, each run cold (compiling, capturing)
and then warm, printing every prefill step's new tokens, padding and time (synchronised around each step, so
each includes one device synchronisation). On CUDA that synchronisation also serialises a step's host work with the
previous step's GPU work, which the engine otherwise overlaps: there the times are upper bounds per step, and
``bench/engine.py``'s unsynchronised turn totals are the pipeline's cost. On CUDA the script first times one MLA
layer's attention of a turn's queries over a cached prefix three ways (k3-small's heads: the engine's call, SDPA with
a boolean [T, S] mask, SDPA with the lower-right causal bias), and ``--profile pc:10,no:6`` prints kernel tables of
those warm turns.

    python bench/engine_steps.py --device cuda [--profile pc:10,no:6,no:10]

Writes bench/results/engine-steps[-cuda].json.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from engine import sync  # bench/ is the script's directory
from engine_profile import profiled, show
from torch.nn.attention.bias import causal_lower_right

from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.engine.runner import prefill_attention
from rlk3.model import K3Config, K3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def attention_bench(device: torch.device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    return [attention_row(T, S, device, g)
            for T, S in ((2112, 10304), (4176, 12368), (6240, 14432), (8192, 16384), (2192, 20624))]


def attention_row(T: int, S: int, device: torch.device, g: torch.Generator) -> dict:
    """One MLA layer's attention of T new queries over S = prefix + T keys, k3-small's heads, bf16."""
    H, L, nope, rope_d, v_dim = 8, 256, 64, 32, 128
    r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    prefix = S - T
    qn, qr, lat, kr = r(1, T, H, nope), r(1, T, H, rope_d), r(1, S, L), r(1, S, rope_d)
    w_uk, w_uv = r(H, nope, L) * L**-0.5, r(H, v_dim, L) * L**-0.5
    scale = (nope + rope_d) ** -0.5
    pos = torch.arange(S, device=device)
    mask = (pos[None, :] <= pos[prefix:, None])[None, None]
    q = F.pad(torch.cat([qn, qr], -1).transpose(1, 2), (0, v_dim - nope - rope_d))
    k = torch.cat([torch.einsum("bsl,hdl->bhsd", lat, w_uk), kr[:, None].expand(-1, H, -1, -1)], -1)
    k = F.pad(k, (0, v_dim - nope - rope_d))
    v = torch.einsum("bsl,hdl->bhsd", lat, w_uv)
    calls = {
        "engine_call_ms": lambda: prefill_attention(qn, qr, lat, kr, w_uk, w_uv, scale, prefix=prefix),
        "sdpa_bool_mask_ms": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
        "sdpa_lower_right_ms": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(T, S), scale=scale),
    }
    row, outs = dict(T=T, S=S), {}
    for name, fn in calls.items():
        for _ in range(2):
            outs[name] = fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(5):
            fn()
        sync(device)
        row[name] = (time.perf_counter() - t) * 200
    row["max_abs_diff_mask_vs_bias"] = (outs["sdpa_bool_mask_ms"].float()
                                        - outs["sdpa_lower_right_ms"].float()).abs().max().item()
    print(f"attention T={T} S={S}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith("_ms"))
          + f"; |mask - bias| {row['max_abs_diff_mask_vs_bias']:.3g}", flush=True)
    return row


def conversation(model, device, cfg: EngineConfig, profile_turns=()) -> list[dict]:
    """The multi-turn benchmark's conversation with every prefill step timed."""
    gc.collect()
    engine = RolloutEngine(model, cfg)
    plain_step, log = engine.step, []

    def timed_step():
        before = engine.stats()
        sync(device)
        t = time.perf_counter()
        out = plain_step()
        sync(device)
        ms, after = (time.perf_counter() - t) * 1e3, engine.stats()
        if after.prefill_tokens > before.prefill_tokens:
            capture = (after.prefill_capture_seconds - before.prefill_capture_seconds) * 1e3
            log.append(dict(tokens=after.prefill_tokens - before.prefill_tokens, ms=ms - capture, capture_ms=capture,
                            padding=after.prefill_padding_tokens - before.prefill_padding_tokens))
        return out

    engine.step = timed_step
    vocab, g, conv, turns = model.config.vocab_size, torch.Generator().manual_seed(3), [], []
    sampling = SamplingParams(max_tokens=16, temperature=0)
    for turn in range(1, 11):
        conv = conv + torch.randint(1, vocab, (2048,), generator=g).tolist()
        first = len(log)
        if turn in profile_turns:  # kernel tables: CUDA only (engine_profile.profiled synchronises the GPU)
            out = []
            rows, wall = profiled(lambda c=conv, o=out: o.append(engine.generate([c], sampling)[0]))
            show(f"turn {turn} (profiled; its 16 decode steps included)", rows, wall, 1)
            res = out[0]
        else:
            res = engine.generate([conv], sampling)[0]
        turns.append(dict(turn=turn, context=len(conv), cached=res.num_cached_tokens, profiled=turn in profile_turns,
                          steps=log[first:]))
        conv = conv + res.token_ids
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", default="", help="warm turns to profile, e.g. pc:10,no:6 (pc = prefix cache)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.profile and not cuda:  # before minutes of cold turns, not at the first profiled one
        raise SystemExit(f"--profile {args.profile}: kernel tables need --device cuda (got --device {args.device})")
    if not cuda:
        torch.set_num_threads(1)
    preset, dtype = ("k3-small", torch.bfloat16) if cuda else ("k3-tiny", torch.float32)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset)).to(device, dtype).eval()
    out: dict = dict(device=str(device), preset=preset, torch=torch.__version__)
    if cuda:
        out["attention"] = attention_bench(device)
    wanted = [p.split(":") for p in args.profile.split(",") if p]
    for rep in ("cold", "warm"):
        for label, enable in (("pc", True), ("no", False)):
            prof = [int(t) for lab, t in wanted if lab == label] if rep == "warm" else []
            cfg = EngineConfig(memory_bytes=(40 * 2**30 if cuda else 256 * 2**20), enable_prefix_cache=enable)
            turns = conversation(model, device, cfg, prof)
            total = sum(s["ms"] for t in turns for s in t["steps"] if not t["profiled"])
            print(f"\n{rep}, prefix cache {'on' if enable else 'off'}: {total:.1f} ms of prefill steps "
                  f"(captures and profiled turns excluded)")
            for t in turns:
                steps = "; ".join(f"{s['tokens']} tokens (+{s['padding']} padding) {s['ms']:.1f} ms"
                                  for s in t["steps"])
                print(f"  turn {t['turn']}, context {t['context']}, cached {t['cached']}: {steps}")
            out[f"{rep}_{label}"] = turns
    path = ROOT / "bench" / "results" / f"engine-steps{'-cuda' if cuda else ''}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
