"""ShardAdam's step on a model of --gaussians Gaussians (SH degree 3: 59 floats each), 1 GPU.

    python benchmarks/experiments/bench_adam.py --gaussians 4000000

Prints one JSON line: milliseconds per step (median, triton.testing.do_bench) for each block size
and warp count of the kernel (``insitu.training.adam._BLOCK``, ``_WARPS``), and the bandwidth that is: an
Adam step reads parameter, gradient and two moments and writes parameter and moments (7 x 4 bytes
per float).
"""
from __future__ import annotations

import argparse
import json

import torch

import insitu.training.adam as adam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaussians", type=int, default=4_000_000)
    args = ap.parse_args()
    from triton.testing import do_bench

    n = args.gaussians
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "colors": (n, 16, 3)}
    params = {k: torch.nn.Parameter(torch.randn(*s, device="cuda")) for k, s in shapes.items()}
    opt = adam.ShardAdam(params, {"means": 1e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2,
                                  "colors": (2.5e-3, 1.25e-4)})
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    floats = sum(p.numel() for p in params.values())
    chosen, out = (adam._BLOCK, adam._WARPS), {"gaussians": n, "floats": floats}
    for block, warps in [(1024, 4), (2048, 8), (4096, 8), (1024, 8), (4096, 16)]:
        adam._BLOCK, adam._WARPS = block, warps
        ms = do_bench(opt.step, warmup=10, rep=200, return_mode="median")
        out[f"{block}/{warps}"] = {"ms": round(ms, 3), "gb_per_s": round(7 * 4 * floats / ms / 1e6, 1)}
    adam._BLOCK, adam._WARPS = chosen
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
