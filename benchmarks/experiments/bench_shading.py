"""SH colours and their gradients for --gaussians Gaussians (SH degree 3), one camera, 1 GPU.

    python benchmarks/experiments/bench_shading.py --gaussians 4000000

Prints one JSON line, milliseconds (median, triton.testing.do_bench) of:
- ``gsplat``: gsplat's ``spherical_harmonics`` forward + backward (the coefficients' gradient
  ``[N, 16, 3]`` written out), then ShardAdam's step with that gradient;
- ``ours``: ``insitu.render.shading.sh_colors`` forward + backward with the gradient deferred, then ShardAdam's
  step forming it from its factors; per block size and warp count of the SH kernels
  (``insitu.render.shading._BLOCK``, ``_WARPS``);
- the forward alone of each (no gradient: what an evaluation runs).
"""
from __future__ import annotations

import argparse
import json

import torch

import insitu.render.shading as shading
from insitu.training.adam import ShardAdam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaussians", type=int, default=4_000_000)
    ap.add_argument("--cameras", type=int, default=1)
    args = ap.parse_args()
    from gsplat.cuda._wrapper import spherical_harmonics
    from triton.testing import do_bench

    n, C = args.gaussians, args.cameras
    g = torch.Generator(device="cuda").manual_seed(0)
    params = {"means": torch.nn.Parameter(torch.randn(n, 3, device="cuda", generator=g)),
              "colors": torch.nn.Parameter(0.2 * torch.randn(n, 16, 3, device="cuda", generator=g))}
    opt = ShardAdam(params, {"means": 1e-4, "colors": (2.5e-3, 1.25e-4)})
    campos = 5 * torch.randn(C, 3, device="cuda", generator=g)
    v = 1e-3 * torch.randn(C, n, 3, device="cuda", generator=g)

    def gsplat_step():
        dirs = params["means"][None] - campos[:, None]
        coeffs = params["colors"][None].expand(C, *params["colors"].shape)
        colors = torch.clamp_min(spherical_harmonics(3, dirs, coeffs) + 0.5, 0.0)
        (colors * v).sum().backward()
        opt.step()
        opt.zero_grad()

    def our_step():
        with shading.deferred_sh_gradients() as sh:
            colors = shading.sh_colors(params["means"], params["colors"], campos, 3)
        (colors * v).sum().backward()
        opt.step(sh)
        opt.zero_grad()

    def bench(fn):
        return round(do_bench(fn, warmup=10, rep=200, return_mode="median"), 3)

    out = {"gaussians": n, "cameras": C, "gsplat_sh_and_adam_ms": bench(gsplat_step)}
    with torch.no_grad():
        out["gsplat_forward_ms"] = bench(lambda: spherical_harmonics(
            3, params["means"][None] - campos[:, None], params["colors"][None].expand(C, *params["colors"].shape)))
    chosen = (shading._BLOCK, shading._WARPS)
    for block, warps in [(32, 4), (32, 2), (16, 2), (64, 4), (64, 8)]:
        shading._BLOCK, shading._WARPS = block, warps
        out[f"ours_sh_and_adam_ms {block}/{warps}"] = bench(our_step)
        with torch.no_grad():
            out[f"ours_forward_ms {block}/{warps}"] = bench(lambda: shading.sh_colors(
                params["means"], params["colors"], campos, 3))
    shading._BLOCK, shading._WARPS = chosen
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
