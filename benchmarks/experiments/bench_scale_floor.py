"""The scale floor (``train.min_scale_px``) on Gray-Scott timesteps: the surface's figures on the orbit,
2x and 3x closer and off the orbit, and of ``model.ply``, per floor (one rank, the demo's settings for
the device, each step trained cold).

The simulation (``--L`` cells, the demo's parameters, no noise) runs to the last of ``--steps``; each of
those steps is trained from fresh seeds for ``--iterations`` iterations with each ``--floors`` value.
Prints one JSON line per run.

    python benchmarks/experiments/bench_scale_floor.py --steps 300 600 --iterations 300 --floors 0 1 1.5
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sims"))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from insitu.config import load_config  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.run.demo import CPU_SIMULATION, demo_defaults  # noqa: E402
from insitu.step.pipeline import compute_step  # noqa: E402
from insitu.volume import whole_block  # noqa: E402
from insitu_sims import gray_scott  # noqa: E402

KEYS = ("psnr_foreground", "psnr_foreground_near2", "psnr_foreground_near3", "psnr_foreground_off",
        "ply_psnr_foreground", "psnr", "gaussians", "train_seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=CPU_SIMULATION["L"])
    ap.add_argument("--steps", type=int, nargs="+", default=[300, 600])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--floors", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    fields = {}

    def keep(step, t, arrays, global_shape, start):
        fields[step] = np.array(arrays["V"], dtype=np.float32)

    settings = gray_scott.GrayScottSettings(L=args.L, steps=max(args.steps), plotgap=math.gcd(*args.steps),
                                            noise=0.0, engine="none").validate()
    gray_scott.run(settings, MPI.COMM_WORLD, consumer=lambda s, *a: keep(s, *a) if s in args.steps else None)
    comm = init_comm(device=args.device)
    overrides = {k: v for k, v in demo_defaults(gpu=args.device == "cuda").items() if not k.startswith("insitu.")}
    for step in args.steps:
        for floor in args.floors:
            cfg = load_config(None, {**overrides, "run.progress": False, "train.min_scale_px": floor})
            t0 = time.perf_counter()
            m = compute_step(whole_block(fields[step]), cfg, comm, step=step, iterations=args.iterations).metrics
            print(json.dumps({"step": step, "min_scale_px": floor, "iterations": args.iterations,
                              **{k: m.get(k) for k in KEYS}, "seconds": round(time.perf_counter() - t0, 2)}),
                  flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
