"""``python -m rlk3 <stage> <config.yaml> [key=value ...]``: one entry point for every stage.

Stages: ``sft`` (demonstrations → the checkpoint RL starts from), ``rl`` (one effort-budget teacher), ``teachers``
(the nine teachers), ``mopd`` (distil the teachers into one student), ``demo`` (all of them, then ``eval``), ``eval``
(every model of a manifest on the held-out slices: ``python -m rlk3 eval <manifest.json> [n=40] [device=auto]``, no
config). The config is composed and validated before anything is allocated (``rlk3.config``); ``--print-config``
shows the result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlk3.config import STAGES, ConfigError, check_paths, load_config, to_yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlk3", description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=STAGES)
    ap.add_argument("config", help="a run config YAML (its `defaults` name fragments under configs/)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.lam=0.7")
    ap.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    args = ap.parse_args(argv)
    if args.stage == "eval":  # python -m rlk3 eval <manifest.json> [n=40] [device=auto|cpu|cuda]
        from rlk3 import pipeline

        n, device = None, "auto"
        for item in args.overrides:  # its only settings (a manifest is not a run config)
            key, _, value = item.partition("=")
            if key == "n" and value.isdigit() and int(value) >= 1:
                n = int(value)
            elif key == "device" and value in pipeline.Evaluation.DEVICES:
                device = value
            else:
                print(f"eval: {item!r} is not a setting of eval; it takes n=<tasks per slice, an int >= 1> and "
                      f"device=<{'|'.join(pipeline.Evaluation.DEVICES)}> (the rest comes from the manifest)",
                      file=sys.stderr)
                return 2
        if args.print_config:
            print("eval: --print-config shows a run config; eval reads a manifest (print the file)", file=sys.stderr)
            return 2
        if not Path(args.config).is_file():
            print(f"eval: no manifest at {args.config} (the demo stage writes one: <run.output_dir>/manifest.json)",
                  file=sys.stderr)
            return 2
        try:
            pipeline.run_eval(args.config, n, device=pipeline.resolve_device(device))
        except (pipeline.DeviceError, pipeline.ManifestError) as e:
            print(f"eval: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = load_config(args.config, [*args.overrides, f"run.stage={args.stage}"])
        if not args.print_config:
            check_paths(cfg)  # run_stage checks them too; here its error reads as the config error it is
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    from rlk3 import pipeline

    return pipeline.run_stage(cfg)


if __name__ == "__main__":
    sys.exit(main())
