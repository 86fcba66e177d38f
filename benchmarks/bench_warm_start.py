"""Warm start against cold start on a Gray-Scott step, with the demo's settings (CPU, one rank).

The simulation (L cells, the demo's parameters) runs to step 600; the step ``600 - gap`` is
trained from fresh seeds, then step 600 is trained for ``--iterations`` from fresh seeds (cold)
and from the previous model refit by ``pipeline.warm_shard`` with each ``--near`` (in cells).
Prints how much of the field changed side of the iso value, and held-out PSNR / SSIM and
the number of Gaussians for each start.

    python benchmarks/bench_warm_start.py --gap 30 300 --near 1 2 --seeds 0 1
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from insitu import pipeline  # noqa: E402
from insitu.config import load_config  # noqa: E402
from insitu.demo import DEMO_DEFAULTS  # noqa: E402
from insitu.parallel import init_comm  # noqa: E402
from insitu.sources import ArraySource  # noqa: E402
from sims import gray_scott  # noqa: E402


def fields_at(L: int, gap: int, comm) -> dict[int, dict]:
    """U and V at steps 600 - gap and 600."""
    kept = {}

    def consumer(step, t, fields, global_shape, start):
        if step in (600 - gap, 600):
            kept[step] = {k: v.copy() for k, v in fields.items()}

    gray_scott.run(gray_scott.GrayScottSettings(L=L, steps=600, plotgap=gap, engine="none").validate(), comm.mpi,
                   consumer=consumer)
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, default=32)
    ap.add_argument("--gap", type=int, nargs="+", default=[30, 300], help="simulation steps between the two")
    ap.add_argument("--near", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--iterations", type=int, default=300, help="iterations on step 600")
    args = ap.parse_args()
    if any(g < 1 or 600 % g for g in args.gap):
        ap.error(f"--gap: expected divisors of 600, got {args.gap}")
    comm = init_comm(device="cpu")
    print("seed  gap  start          PSNR   SSIM    Gaussians")
    for seed in args.seeds:
        cfg = load_config(None, {"train.progress": False, "train.seed": seed, "parallel.device": "cpu"},
                          defaults=DEMO_DEFAULTS)
        for gap in args.gap:
            fields = fields_at(args.L, gap, comm)
            iso = cfg.input.iso[0]
            moved = np.mean((fields[600 - gap]["V"] > iso) != (fields[600]["V"] > iso))
            print(f"# gap {gap}: {100 * moved:.1f}% of the samples changed side of V = {iso}", flush=True)

            def block(step):
                f = fields[step]
                return next(iter(ArraySource(f["V"], fields={"U": f["U"]}, step=step))).block

            previous = pipeline.run_step(block(600 - gap), cfg, comm, step=600 - gap)
            runs = [("cold", None)] + [(f"warm near {n:g}", n) for n in args.near]
            for name, near in runs:
                refit = functools.partial(pipeline.warm_shard, near=near or 1.0)
                with mock.patch.object(pipeline, "warm_shard", refit):     # run_step's refit, at this near
                    r = pipeline.run_step(block(600), cfg, comm, step=600, iterations=args.iterations,
                                          warm=previous if near is not None else None)
                m = r.metrics
                print(f"{seed:4d} {gap:4d}  {name:13s} {m['psnr']:6.2f} {m['ssim']:.4f} {m['gaussians']:9d}",
                      flush=True)

if __name__ == "__main__":
    main()
