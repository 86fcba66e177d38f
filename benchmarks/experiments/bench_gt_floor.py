"""How close the ground truth is to itself: views cast with s x s rays per pixel against a finer reference.

A model trained on a ground truth of few rays per pixel is trained on each view's own quantisation of
the outlines and rims; this measures that floor on the surface (``psnr_foreground``, the evaluation's
own accumulator) for a raw volume or a Gray-Scott field (the demo's simulation, no noise):

    python benchmarks/experiments/bench_gt_floor.py --gray-scott 600 --L 32 --iso 0.3 --resolution 96 --device cpu
    python benchmarks/experiments/bench_gt_floor.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024

Prints one JSON line per supersampling: its foreground and whole-image PSNR against ``--reference``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sims"))

from insitu.config import ViewConfig  # noqa: E402
from insitu.groundtruth.caster import raycast_views  # noqa: E402
from insitu.groundtruth.views import orbit_views  # noqa: E402
from insitu.step.metrics import QualityAccumulator  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402


def gray_scott_field(steps: int, L: int) -> np.ndarray:
    """V of the Gray-Scott mini-app after ``steps`` steps on an L^3 grid, without noise (as the demos run it)."""
    from insitu_sims.gray_scott import GrayScott, GrayScottSettings

    sim = GrayScott(GrayScottSettings(L=L, steps=steps, noise=0.0, engine="none"))
    for _ in range(steps):
        sim.step()
    return sim.v.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a raw volume NAME_XxYxZ_DTYPE.raw")
    src.add_argument("--gray-scott", type=int, metavar="STEPS", help="the Gray-Scott field after STEPS steps")
    ap.add_argument("--L", type=int, default=32, help="with --gray-scott: the grid's size")
    ap.add_argument("--iso", type=float, required=True)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=16, help="orbit views cast")
    ap.add_argument("--supersample", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reference", type=int, default=8, help="rays per pixel along each axis of the reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    field = read_raw(args.data) if args.data else gray_scott_field(args.gray_scott, args.L)
    block = whole_block(field)
    nz, ny, nx = field.shape
    views = orbit_views(np.zeros(3), np.array([nx - 1, ny - 1, nz - 1], dtype=float), args.views,
                        resolution=args.resolution)

    def cast(s: int) -> torch.Tensor:
        return torch.cat([rgba for _, rgba, _ in raycast_views(
            block, views.viewmats, views.Ks, args.resolution, args.resolution, [args.iso], views_per_call=4,
            supersample=s, step=ViewConfig().march_step, device=args.device)])

    reference = cast(args.reference)
    for s in args.supersample:
        acc = QualityAccumulator(lpips=False)
        acc.add_rgba(cast(s), reference, torch.zeros(3))
        q = acc.result()
        print(json.dumps({"supersample": s, "reference": args.reference, "resolution": args.resolution,
                          "psnr_foreground": round(q.psnr_foreground, 2), "psnr": round(q.psnr, 2)}))


if __name__ == "__main__":
    main()
