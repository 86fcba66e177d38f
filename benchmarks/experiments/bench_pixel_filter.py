"""What the rasterizer's pixel filter alone costs: the best image a splat model could draw against the
ground truth, whatever its Gaussians.

A splat rasterizer (gsplat "classic", the reference 3DGS one) evaluates each Gaussian at pixel centres
after adding ``eps2d`` px^2 to its projected covariance: even a perfect model draws the surface's
continuous image convolved with a Gaussian of variance ``eps2d``, sampled at pixel centres. The ground
truth averages ``s x s`` rays per pixel (a box filter). This script ray-casts held-out orbit views of a
volume with ``--fine`` x ``--fine`` point rays per pixel (the continuous image, as near as it gets), then
scores against the ground truth (``views.supersample`` = 2: the mean of the 2 x 2 sub-pixel rays, which
are the fine grid's when ``--fine`` is a multiple of 2):

- the continuous image box-filtered over the pixel (the ground truth with more rays: its own floor),
- the continuous image blurred by ``eps2d`` and sampled at the pixel centres, for each ``--eps2d``
  (the best a model drawn with that blur can do),

each as the project's ``psnr_foreground`` (:class:`insitu.step.metrics.QualityAccumulator`) and full-image PSNR.
CPU is enough (the torch ray caster): ``--fine 4`` at 1024^2 casts 16M rays per view.

    python benchmarks/experiments/bench_pixel_filter.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --views 4 --fine 4 --eps2d 0.3 0.2 0.1 0.05 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.groundtruth.caster import raycast  # noqa: E402
from insitu.groundtruth.views import orbit_views  # noqa: E402
from insitu.step.metrics import QualityAccumulator  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x: [V, C, H, W]`` convolved with a Gaussian of standard deviation ``sigma`` pixels (edges replicated)."""
    r = max(int(math.ceil(4 * sigma)), 1)
    t = torch.arange(-r, r + 1, dtype=x.dtype)
    k = torch.exp(-t ** 2 / (2 * sigma ** 2))
    k = (k / k.sum()).to(x.device)
    C = x.shape[1]
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1).repeat(C, 1, 1, 1), groups=C)
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1).repeat(C, 1, 1, 1), groups=C)


def at_pixel_centres(fine: torch.Tensor, f: int) -> torch.Tensor:
    """``fine: [V, C, f H, f W]`` (a smooth image on the fine grid) sampled at the centres of the coarse
    pixels: for even ``f`` the mean of the two fine samples on each side of the centre, per axis."""
    V, C, H, W = fine.shape
    x = fine.view(V, C, H // f, f, W // f, f)
    lo, hi = (f - 1) // 2, f // 2 + 1
    return x[:, :, :, lo:hi, :, lo:hi].mean((3, 5))


def scores(pred: torch.Tensor, gt: torch.Tensor) -> dict[str, float]:
    """``psnr_foreground`` and ``psnr`` of premultiplied ``[V, 4, H, W]`` images on black."""
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(pred.permute(0, 2, 3, 1).contiguous(), gt.permute(0, 2, 3, 1).contiguous(), torch.zeros(3))
    q = acc.result()
    return {"psnr_foreground": q.psnr_foreground, "psnr": q.psnr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a raw volume NAME_XxYxZ_DTYPE.raw")
    ap.add_argument("--iso", type=float, required=True)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=4, help="held-out orbit views (every 8th of 448)")
    ap.add_argument("--fine", type=int, default=4, help="point rays per pixel along each axis (even)")
    ap.add_argument("--eps2d", type=float, nargs="+", default=[0.3, 0.2, 0.1, 0.05])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.fine < 2 or args.fine % 2:
        ap.error(f"--fine: expected an even number >= 2, got {args.fine}")

    volume = read_raw(args.data).astype(np.float32)
    block = whole_block(volume)
    hi = np.array(volume.shape[::-1], dtype=float) - 1
    views = orbit_views(np.zeros(3), hi, 448, args.resolution)
    ids = views.test_ids[:args.views]

    def cast(rays_per_axis: int) -> torch.Tensor:
        """``[V, 4, r H, r W]``: one ray at the centre of each of ``r x r`` sub-pixels."""
        Ks = views.Ks[ids].clone()
        Ks[:, :2] *= rays_per_axis
        size = args.resolution * rays_per_axis
        image, _ = raycast(block, views.viewmats[ids], Ks, size, size, args.iso, supersample=1, backend="torch")
        return image.permute(0, 3, 1, 2).contiguous()

    t0 = time.perf_counter()
    f = args.fine
    fine = cast(f)
    gt = F.avg_pool2d(cast(2), 2) if f != 2 else F.avg_pool2d(fine, 2)      # views.supersample = 2
    rows = {"ground truth with {f}x{f} rays".format(f=f): scores(F.avg_pool2d(fine, f), gt)}
    for eps in args.eps2d:
        best = at_pixel_centres(gaussian_blur(fine, math.sqrt(eps) * f), f)
        rows[f"perfect model, eps2d {eps}"] = scores(best, gt)
    result = {"data": Path(args.data).name, "iso": args.iso, "resolution": args.resolution,
              "views": [int(i) for i in ids], "fine": f, "seconds": round(time.perf_counter() - t0, 1),
              "against_the_2x2_ground_truth": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
