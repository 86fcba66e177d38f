"""Time a warm start's surface policy (insitu.surface.follow) at a full step's size, on the training device.

A gyroid-like field (many folds: a large surface) on an ``--L``^3 grid, a model of ``--gaussians`` drawn on its
isosurface, then the field's phase shifted by ``--shift`` cells (the surface moves, part of the model goes
stale): the step's seeds (marching cubes, CPU) and the warm start's parts, each the median of 3 after a
warm-up, synchronised with the device:

    offsets    surface_offsets: the field at every centre and its gradient (grid_sample)
    coverage   coverage: which seed vertices no kept centre covers (a voxel grid on a GPU, a k-d tree on the CPU)
    plan       plan: both, the count steered, the faint and thinned ones
    warm       seeding.warm_shard: the plan, the new seeds drawn on the new triangles and tested, the shard built

    python benchmarks/bench_follow.py --L 256 --gaussians 2000000 --device cuda
    python benchmarks/bench_follow.py --L 64 --gaussians 200000 --device cpu

Prints one JSON line: the seconds of each part, the vertices, the Gaussians before and after, the stale and new
counts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insitu.config import Config  # noqa: E402
from insitu.step.seeding import warm_shard  # noqa: E402
from insitu.surface.follow import coverage, plan, surface_offsets  # noqa: E402
from insitu.surface.seeds import extract_seeds, init_gaussians  # noqa: E402
from insitu.volume import whole_block  # noqa: E402


def gyroid(L: int, period: float, shift: float) -> np.ndarray:
    """``[L, L, L]`` sin x cos y + sin y cos z + sin z cos x, ``period`` cells a turn, x shifted by ``shift`` cells."""
    z, y, x = (np.mgrid[0:L, 0:L, 0:L].astype(np.float32) * (2 * np.pi / period))
    x = x + shift * 2 * np.pi / period
    return (np.sin(x) * np.cos(y) + np.sin(y) * np.cos(z) + np.sin(z) * np.cos(x)).astype(np.float32)


def timed(fn, device: str):
    """(median seconds of 3 runs after a warm-up, the last result)."""
    def once():
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, out

    once()
    runs = [once() for _ in range(3)]
    return statistics.median(r[0] for r in runs), runs[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--period", type=float, default=32.0, help="cells per turn of the gyroid")
    ap.add_argument("--gaussians", type=int, default=2_000_000)
    ap.add_argument("--shift", type=float, default=0.5, help="cells the surface moves between the steps")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    before = whole_block(gyroid(args.L, args.period, 0.0))
    after = whole_block(gyroid(args.L, args.period, args.shift))
    model = init_gaussians(extract_seeds(before, 0.0), args.gaussians, fill=True, sh_degree=3, device=device)
    t = time.perf_counter()
    seeds = extract_seeds(after, 0.0)
    seeds_s = time.perf_counter() - t
    cfg = Config()
    cfg.input.iso = [0.0]
    offsets_s, offsets = timed(lambda: surface_offsets(after, [0.0], model.means), args.device)
    kept = offsets.projected[offsets.cells <= 0.25]
    coverage_s, _ = timed(lambda: coverage(seeds.points, seeds.areas, kept, device=device), args.device)
    plan_s, p = timed(lambda: plan(after, [0.0], seeds, model.means, model.opacity_logits, len(model),
                                   faint=cfg.train.densify.prune_opacity), args.device)
    warm_s, (shard, _, _, follow) = timed(lambda: warm_shard(model, seeds, cfg, after, device,
                                                             expected=len(model)), args.device)
    print(json.dumps({"device": args.device, "L": args.L, "vertices": len(seeds), "gaussians": len(model),
                      "after": len(shard), "stale": follow.stale, "new": follow.new,
                      "marching_cubes_s": round(seeds_s, 3), "offsets_s": round(offsets_s, 4),
                      "coverage_s": round(coverage_s, 4), "plan_s": round(plan_s, 4),
                      "warm_shard_s": round(warm_s, 4)}), flush=True)


if __name__ == "__main__":
    main()
