"""Seed colours from the ground truth against a constant colour (CPU by default, one rank or more).

bonsai downsampled by ``--downsample`` (iso 40), the settings of ``tests/test_pipeline.py``'s bonsai
test unless changed; for each ``seeds.color_init`` and each ``--seeds`` value, ``run_step`` with a
held-out evaluation every ``--eval-every`` iterations. Prints one JSON line per run: the initial
and final held-out PSNR, the PSNR curve, and the first evaluated iteration at which each
``--targets`` PSNR was reached (null: not within ``--iterations``).

    python benchmarks/bench_color_init.py --iterations 500 --targets 24 26 --seeds 0 1
    python benchmarks/bench_color_init.py --scene metaballs --iterations 300 --eval-every 25 --seeds 3 4

``--scene metaballs``: the 2-rank test's scene and settings instead (``tests/mpi/dist_train.py``:
three metaballs, 24 views at 48², 2000 seeds with ``seeds.fill``); only ``--iterations``,
``--eval-every``, ``--color-views`` and the seeds apply.
    mpiexec -n 2 python benchmarks/bench_color_init.py ...        # the same on 2 ranks
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from insitu.config import Config  # noqa: E402
from insitu.input.decomposition import cut_block  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.step.pipeline import run_step  # noqa: E402
from insitu.volume import downsample, read_raw  # noqa: E402

BONSAI = Path("/work/shared/data/bonsai_256x256x256_uint8.raw")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scene", choices=("bonsai", "metaballs"), default="bonsai")
    ap.add_argument("--data", type=Path, default=BONSAI)
    ap.add_argument("--downsample", type=int, default=4)
    ap.add_argument("--views", type=int, default=40)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--budget", type=int, default=3000)
    ap.add_argument("--opacity", type=float, default=0.8)
    ap.add_argument("--iterations", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--color-views", type=int, default=16)
    ap.add_argument("--targets", type=float, nargs="*", default=[24.0, 26.0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--modes", nargs="*", default=["constant", "gt"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    comm = init_comm(device=args.device)
    if args.scene == "metaballs":
        sys.path.insert(0, str(ROOT / "tests" / "mpi"))
        import dist_train
        volume = dist_train.metaballs()
    else:
        volume = downsample(read_raw(args.data), args.downsample)
    for seed in args.seeds:
        for mode in args.modes:
            cfg = Config()
            cfg.input.iso = [40.0]
            cfg.views.count, cfg.views.resolution, cfg.views.supersample = args.views, args.resolution, 2
            cfg.seeds.budget, cfg.seeds.opacity = args.budget, args.opacity
            cfg.seeds.color_init, cfg.seeds.color_views = mode, args.color_views
            cfg.output.images = 0
            t = cfg.train
            t.iterations, t.sh_degree, t.sh_increase_every, t.seed = args.iterations, 1, 100, seed
            t.densify_from, t.densify_every, t.densify_until, t.opacity_reset_every = 100, 100, 400, 0
            t.max_gaussians, t.progress, t.eval_every = 2 * args.budget, False, args.eval_every
            t.backend = "torch" if args.device == "cpu" else "auto"
            if args.scene == "metaballs":
                cfg = dist_train.tiny_config(0.5)
                cfg.seeds.color_init, cfg.seeds.color_views = mode, args.color_views
                cfg.train.iterations, cfg.train.seed, cfg.train.eval_every = args.iterations, seed, args.eval_every
                cfg.parallel.device = args.device
            m = run_step(cut_block(volume, comm.rank, comm.size), cfg, comm).metrics
            curve = [(h["iteration"], round(h["psnr"], 3)) for h in m["history"]] + [(m["iterations"], round(m["psnr"], 3))]
            reached = {str(x): next((i for i, p in curve if p >= x), None) for x in args.targets}
            if comm.rank == 0:
                print(json.dumps({"color_init": mode, "seed": seed, "ranks": comm.size,
                                  "psnr_initial": round(m["psnr_initial"], 3), "psnr": round(m["psnr"], 3),
                                  "ssim": round(m["ssim"], 4), "iterations_to": reached,
                                  "color_init_seconds": m["color_init_seconds"],
                                  "train_seconds": m["train_seconds"], "curve": curve}), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
