"""Warm start against cold start on a Gray-Scott step (one rank; the demo's settings for the device).

The simulation (``--L`` cells, the demo's parameters, no noise) runs to step ``--step``; step
``step - gap`` is trained from fresh seeds (the previous step), then step ``step`` is trained

- cold: from fresh seeds for ``--iterations`` iterations: its held-out PSNR is the target;
- warm: from the previous step's model (``insitu.step.seeding.warm_shard``), evaluated every
  ``--eval-every`` iterations, stopping at the first evaluation that reaches the cold step's
  foreground PSNR (the early stop judges the foreground);
- warm_fixed: from the previous step's model for ``series.warm_iterations`` steps, as the
  driver runs a warm-started step (``driver.StepDriver``), and ``warm_N`` for each of
  ``--warm-iterations N ...``.

``--package`` takes the package's defaults instead of the demo's (``--resolution`` sets the
images then); ``--set KEY=VALUE`` overrides either.

Prints, per gap, how much of the field changed side of the iso value, and one JSON line with
the cold and warm figures: PSNR, training seconds, total seconds of the step, the iteration at
which the warm start reached the target, and ``warm_over_cold`` (training seconds).

    python benchmarks/experiments/bench_warm_start.py --L 128 --step 480 --gap 10 80 --device cuda
    python benchmarks/experiments/bench_warm_start.py --L 128 --step 480 --gap 80 --device cuda --package --resolution 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sims"))

import numpy as np  # noqa: E402

from insitu.config import load_config, parse_override  # noqa: E402
from insitu.input.sources import ArraySource  # noqa: E402
from insitu.parallel.comm import init_comm  # noqa: E402
from insitu.run.demo import demo_defaults  # noqa: E402
from insitu.step import pipeline  # noqa: E402
from insitu_sims import gray_scott  # noqa: E402


def fields_at(L: int, steps: list[int], last: int, comm) -> dict[int, dict]:
    """U and V at the given simulation steps."""
    kept = {}

    def consumer(step, t, fields, global_shape, start):
        if step in steps:
            kept[step] = {k: v.copy() for k, v in fields.items()}

    gap = int(np.gcd.reduce([last] + steps))
    gray_scott.run(gray_scott.GrayScottSettings(L=L, steps=last, plotgap=gap, engine="none", noise=0.0).validate(),
                   comm.mpi, consumer=consumer)
    return kept


def pick(m: dict) -> dict:
    """The figures of a step's metrics that the comparison reports."""
    return {k: m.get(k) for k in ("psnr", "ssim", "psnr_foreground", "psnr_foreground_near2",
                                  "psnr_foreground_near3", "psnr_foreground_off", "iterations",
                                  "target_reached_at", "train_seconds", "total_seconds", "gaussians")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=32)
    ap.add_argument("--step", type=int, default=600)
    ap.add_argument("--gap", type=int, nargs="+", default=[30])
    ap.add_argument("--iterations", type=int, default=None, help="cold iterations (default: the demo's)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--package", action="store_true", help="the package's defaults instead of the demo's")
    ap.add_argument("--resolution", type=int, help="views.resolution (with --package: 1024 if not given)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting over the defaults")
    ap.add_argument("--warm-iterations", type=int, nargs="*", default=[], help="more warm steps of these lengths")
    args = ap.parse_args()
    if any(not 0 < g < args.step for g in args.gap):
        ap.error(f"--gap: expected values in 1..{args.step - 1}, got {args.gap}")
    comm = init_comm(device=args.device)
    overrides = {"run.progress": False, "run.device": args.device}
    if args.package:
        overrides.update({"input.var": "V", "input.iso": [0.3], "views.resolution": args.resolution or 1024})
    elif args.resolution:
        overrides["views.resolution"] = args.resolution
    overrides.update(dict(parse_override(s) for s in args.set))
    cfg = load_config(None, overrides, defaults=None if args.package else demo_defaults(comm.device.type == "cuda"))
    iterations = args.iterations or cfg.train.iterations
    fields = fields_at(args.L, [args.step - g for g in args.gap] + [args.step], args.step, comm)
    iso = cfg.input.iso[0]

    def block(step):
        f = fields[step]
        return next(iter(ArraySource(f["V"], fields={"U": f["U"]}, step=step))).block

    cold = pipeline.run_step(block(args.step), cfg, comm, step=args.step, iterations=iterations).metrics
    for gap in args.gap:
        before = args.step - gap
        moved = float(np.mean((fields[before]["V"] > iso) != (fields[args.step]["V"] > iso)))
        previous = pipeline.run_step(block(before), cfg, comm, step=before, iterations=iterations)
        target = dataclasses.replace(cfg.train, psnr_target=cold["psnr_foreground"], eval_every=args.eval_every)
        to_target = dataclasses.replace(cfg, train=target)
        warm = pipeline.run_step(block(args.step), to_target, comm, step=args.step, iterations=iterations,
                                 warm=previous).metrics
        fixed = {f"warm_{n}": pick(pipeline.run_step(block(args.step), cfg, comm, step=args.step, warm=previous,
                                                    iterations=n).metrics) for n in args.warm_iterations}
        fixed["warm_fixed"] = pick(pipeline.run_step(block(args.step), cfg, comm, step=args.step, warm=previous,
                                                     iterations=min(cfg.series.warm_iterations, iterations)).metrics)
        print(json.dumps({"L": args.L, "step": args.step, "gap": gap, "device": str(comm.device),
                          "settings": "package" if args.package else "demo", "set": args.set,
                          "changed_side_fraction": round(moved, 4), "cold": pick(cold), "warm": pick(warm),
                          **fixed,
                          "warm_over_cold": round(warm["train_seconds"] / cold["train_seconds"], 3)}), flush=True)


if __name__ == "__main__":
    main()
