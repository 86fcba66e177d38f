"""``insitu demo``: the Gray-Scott mini-app and the analysis, in situ, in one process per rank.

The simulation (``sims/gray_scott.py``) runs on every rank of the launch; every
``plotgap`` steps it hands its fields to an :class:`insitu.Adaptor`, which copies the
block and trains a splat model of the isosurface of V in the background while the
simulation goes on. Small defaults keep it under a few minutes on a 2-core CPU; on a
CUDA machine the same command trains with gsplat.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_DEFAULTS = {
    "input.var": "V", "input.iso": [0.3],
    "views.count": 48, "views.resolution": 96, "views.supersample": 2,
    "seeds.budget": 6000, "seeds.opacity": 0.8,
    "train.iterations": 600, "train.sh_degree": 1, "train.sh_increase_every": 200,
    "train.densify_from": 100, "train.densify_every": 100, "train.densify_until": 500,
    "train.opacity_reset_every": 0, "train.max_gaussians": 20000,
    "insitu.mode": "background", "insitu.queue": 1, "insitu.policy": "block",
    "insitu.warm_start": True, "insitu.warm_iterations": 300,
    "output.images": 4,
}


def _simulation():
    """The Gray-Scott mini-app: from an installed package, or from the source tree."""
    try:
        from sims import gray_scott
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        if not (root / "sims" / "gray_scott.py").is_file():
            raise
        sys.path.insert(0, str(root))
        from sims import gray_scott
    return gray_scott


def run_demo(args: argparse.Namespace, cfg, comm, writer) -> int:
    """Run the simulation with the adaptor attached; returns the number of steps trained."""
    from .adaptor import Adaptor

    gs = _simulation()
    settings = gs.GrayScottSettings(L=args.L, steps=args.steps, plotgap=args.plotgap, engine="none").validate()
    if comm.rank == 0:
        print(f"demo: Gray-Scott L={args.L}, {args.steps} steps on {comm.size} rank(s); training on V = "
              f"{cfg.input.iso} every {args.plotgap} steps ({cfg.insitu.mode}) on {comm.device}; "
              f"outputs in {cfg.output.dir}", flush=True)
    t0 = time.perf_counter()
    with Adaptor(comm.mpi, cfg) as adaptor:
        def consumer(step, t, fields, global_shape, start):
            adaptor.execute(step, t, fields, global_shape, start)
            if comm.rank == 0:
                print(f"demo: simulation step {step} handed to the analysis "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)

        stats = gs.run(settings, comm.mpi, consumer=consumer)
        if comm.rank == 0:
            print(f"demo: simulation done, {stats.steps_per_s:.1f} steps/s; finishing the analysis", flush=True)
    if comm.rank == 0:
        from .runner import summary

        for record in adaptor.stats.trained:
            print("demo: " + summary(record.metrics, Path(cfg.output.dir)), flush=True)
    return len(adaptor.stats.trained)
