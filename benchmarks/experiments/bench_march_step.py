"""How far the ground truth is from converged in its march step: a volume's orbit views cast with several
steps, each against the finest, on the surface (``psnr_foreground``: pixels where either image has alpha
above 1/255).

    python benchmarks/experiments/bench_march_step.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --views 2 --steps 0.5 0.25 0.125 0.0625

A ray marches samples ``step`` cells apart and looks for a change of side; where it grazes the surface,
or crosses a sheet thinner than the step, two samples can fall on the same side and the ray misses. The
misses depend on where each ray's samples fall, so they differ from view to view: an error no model of
the surface can fit. Prints one JSON line: the seconds of each cast and its PSNR against the finest.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.groundtruth.caster import raycast  # noqa: E402
from insitu.groundtruth.views import orbit_views  # noqa: E402
from insitu.step.metrics import QualityAccumulator  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402


def psnr_foreground(a, b) -> float:
    """The project's ``psnr_foreground`` of premultiplied ``a`` against ``b`` ([C, H, W, 4]) on black."""
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(a.float().cpu(), b.float().cpu(), torch.zeros(3))
    return acc.result().psnr_foreground


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a raw volume NAME_XxYxZ_DTYPE.raw")
    ap.add_argument("--iso", type=float, required=True)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=2, help="views of an orbit of 8, every third")
    ap.add_argument("--steps", type=float, nargs="+", default=[0.5, 0.25, 0.125, 0.0625])
    ap.add_argument("--supersample", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    block = whole_block(read_raw(args.data))
    lo, hi = block.box
    views = orbit_views(lo, hi, 8, args.resolution).subset(torch.arange(args.views) * 3 + 1).to(args.device)
    images, seconds = {}, {}
    for step in sorted(args.steps, reverse=True):
        t0 = time.perf_counter()
        images[step], _ = raycast(block, views.viewmats, views.Ks, views.width, views.height, args.iso,
                                  supersample=args.supersample, step=step, device=args.device)
        seconds[step] = round(time.perf_counter() - t0, 2)
    finest = min(args.steps)
    print(json.dumps({"data": Path(args.data).name, "iso": args.iso, "resolution": args.resolution,
                      "views": args.views, "device": str(args.device), "finest": finest, "seconds": seconds,
                      "psnr_foreground_against_finest": {s: round(psnr_foreground(images[s], images[finest]), 2)
                                                         for s in args.steps if s != finest}}))


if __name__ == "__main__":
    main()
