"""What a process pays the first time it touches each library a step uses (CUDA).

A step's first process on a machine pays, besides compiling Triton kernels (bench_compile.py), for
the first reads of its libraries from the disk and for CUDA's lazy loading of each library's
kernels at their first launch. This script times each piece in the order a step meets it, on tiny
inputs, so that what it measures is the first use and not the work:

    python benchmarks/experiments/bench_first_use.py --json first_use.json

run once as the first process on a fresh machine (cold) and once again (warm). The pieces: the
imports (torch, gsplat, the package's pipeline, the metrics: torchmetrics), CUDA's context, one
gsplat rasterization forward and backward of 64 Gaussians at 64^2 (a second time beside it: the
cost of the work itself), the evaluation's PSNR and SSIM (torchmetrics; its convolution is the
process's first) on a 64^2 pair, and a 4^3 block through the ray caster.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    seconds: dict[str, float] = {}

    def timed(name: str, fn):
        t = time.perf_counter()
        out = fn()
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            sys.modules["torch"].cuda.synchronize()
        seconds[name] = round(time.perf_counter() - t, 3)
        return out

    torch = timed("import torch", lambda: __import__("torch"))
    if not torch.cuda.is_available():
        raise SystemExit("bench_first_use.py measures CUDA's first uses: no CUDA device here")
    timed("cuda context", lambda: torch.zeros(1, device="cuda"))
    timed("import gsplat", lambda: __import__("gsplat"))
    timed("import insitu.step.pipeline", lambda: __import__("insitu.step.pipeline"))
    from insitu.render.rendering import rasterize

    g = torch.Generator().manual_seed(0)
    n = 64
    means = (torch.rand(n, 3, generator=g) - 0.5).cuda().requires_grad_()
    quats = torch.tensor([[1.0, 0, 0, 0]]).repeat(n, 1).cuda()
    scales = torch.full((n, 3), 0.05).cuda()
    opac = torch.full((n,), 0.8).cuda()
    colors = torch.rand(n, 3, generator=g).cuda()
    view = torch.eye(4)[None].cuda()
    view[0, 2, 3] = 3.0
    K = torch.tensor([[[64.0, 0, 32], [0, 64.0, 32], [0, 0, 1]]]).cuda()

    def draw():
        img, alpha, _ = rasterize(means, quats, scales, opac, colors, view, K, 64, 64, backend="gsplat",
                                  antialiased=True)
        (img.sum() + alpha.sum()).backward()

    timed("gsplat forward and backward", draw)
    timed("gsplat forward and backward again", draw)
    metrics = timed("import insitu.step.metrics (torchmetrics)", lambda: __import__("insitu.step.metrics").step.metrics)
    a = torch.rand(1, 3, 64, 64, generator=g).cuda()
    b = (a + 0.01).clamp(0, 1)
    timed("psnr", lambda: metrics._per_view_psnr(a, b))
    timed("ssim (the first convolution)", lambda: metrics._per_view_ssim_map(a, b))
    timed("ssim again", lambda: metrics._per_view_ssim_map(a, b))
    from insitu.groundtruth.caster import raycast_views
    from insitu.groundtruth.views import orbit_views
    from insitu.volume import whole_block
    import numpy as np

    block = whole_block(np.random.default_rng(0).random((4, 4, 4), dtype=np.float32))
    views = orbit_views(np.zeros(3), np.full(3, 3.0), 2, resolution=16)
    cast = lambda: list(raycast_views(block, views.viewmats.cuda(), views.Ks.cuda(), 16, 16, [0.5],  # noqa: E731
                                 views_per_call=2, supersample=2, device="cuda"))
    timed("ray caster (Triton: compiled or loaded)", cast)
    timed("ray caster again", cast)
    out = {"seconds": seconds, "wall_s": round(time.perf_counter() - T0, 3), "gpu": torch.cuda.get_device_name()}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
