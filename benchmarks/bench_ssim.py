"""SSIM loss forward + backward: torchmetrics against insitu.ssim (Triton kernels on CUDA).

    python benchmarks/bench_ssim.py --size 2048 --batch 1 [--tune]

Prints one JSON line: milliseconds of each (median, events via triton.testing.do_bench), the
largest differences of loss, map and gradient from float64 on the same random images, and with
``--tune`` the same for several tile shapes and warp counts of the kernels.
"""
from __future__ import annotations

import argparse
import json

import torch
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_tm

from insitu.ssim import ssim_map, ssim_map_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tune", action="store_true",
                    help="also time the kernels' tile sizes and warps (insitu.ssim._TH, _TW, _WARPS)")
    args = ap.parse_args()
    from triton.testing import do_bench

    gt = torch.rand(args.batch, args.size, args.size, 3, device="cuda")
    pred = (gt + 0.1 * torch.randn_like(gt)).clamp(0, 1).requires_grad_()

    def tm_step():
        loss = 1 - ssim_tm(pred.permute(0, 3, 1, 2), gt.permute(0, 3, 1, 2), data_range=1.0)
        loss.backward()

    def fused_step():
        loss = 1 - ssim_map(pred, gt).mean()
        loss.backward()

    ms_tm = do_bench(tm_step, warmup=50, rep=300, return_mode="median")
    ms_fused = do_bench(fused_step, warmup=50, rep=300, return_mode="median")
    a = ssim_map(pred, gt)
    ga, = torch.autograd.grad(a.mean(), pred)
    b = ssim_map_reference(pred.double(), gt.double())
    gb, = torch.autograd.grad(b.mean(), pred)
    tuned = {}
    if args.tune:
        import insitu.ssim as mod

        chosen = (mod._TH, mod._TW, mod._WARPS)
        for rows, cols, warps in [(16, 64, 4), (8, 64, 4), (8, 32, 4), (4, 64, 4), (4, 128, 4), (8, 64, 2), (8, 128, 4)]:
            mod._TH, mod._TW, mod._WARPS = rows, cols, warps
            ms = do_bench(fused_step, warmup=20, rep=200, return_mode="median")
            m = ssim_map(pred, gt)
            g, = torch.autograd.grad(m.mean(), pred)
            tuned[f"{rows}x{cols}/{warps}"] = {
                "ms": round(ms, 3), "map_max_diff": float((m.detach().double() - b.detach()).abs().max()),
                "grad_max_diff": float((g.double() - gb).abs().max())}
        mod._TH, mod._TW, mod._WARPS = chosen
    print(json.dumps({"size": args.size, "batch": args.batch, "torchmetrics_ms": round(ms_tm, 3),
                      "fused_ms": round(ms_fused, 3),
                      "loss_diff_vs_float64": float((a.mean() - b.mean()).abs()),
                      "map_max_diff": float((a.double() - b).abs().max()),
                      "grad_max_diff": float((ga.double() - gb).abs().max()),
                      "grad_max": float(gb.abs().max()), **({"tuned": tuned} if tuned else {})}), flush=True)


if __name__ == "__main__":
    main()
