"""SSIM loss forward + backward: torchmetrics against insitu.training.ssim (Triton kernels on CUDA).

    python benchmarks/experiments/bench_ssim.py --size 2048 --batch 1 [--tune] [--against OLD_SSIM_PY]

Prints one JSON line: milliseconds of each (median, events via triton.testing.do_bench), also of
the training loss (``ssim_l1_loss``, the L1 term fused in), the largest differences of loss, map
and gradient from float64 on the same random images, with ``--tune`` the same for several tile
shapes and warp counts of the kernels, and with ``--against FILE`` the milliseconds of the
kernels of FILE, another version of ``insitu/training/ssim.py`` (``git show REV:insitu/training/ssim.py``).
"""
from __future__ import annotations

import argparse
import json

import torch
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_tm

import insitu.training.ssim
from bench_compile import load  # benchmarks/, the script's folder
from insitu.training.ssim import ssim_map, ssim_map_reference


def kernel_ms(mod, pred, gt, do_bench) -> dict:
    """Milliseconds of ``mod``'s SSIM map and training loss, forward and backward."""
    def map_step():
        (1 - mod.ssim_map(pred, gt).mean()).backward()

    def loss_step():
        mod.ssim_l1_loss(pred, gt, ssim_weight=0.2).backward()

    return {"fused_ms": round(do_bench(map_step, warmup=50, rep=300, return_mode="median"), 3),
            "loss_ms": round(do_bench(loss_step, warmup=50, rep=300, return_mode="median"), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tune", action="store_true",
                    help="also time the kernels' tile sizes and warps (insitu.training.ssim._TH, _TW, _WARPS)")
    ap.add_argument("--against", help="another version of insitu/training/ssim.py, timed the same way")
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
    ours = kernel_ms(insitu.training.ssim, pred, gt, do_bench)
    against = kernel_ms(load(args.against, "insitu.training._bench_ssim"), pred, gt, do_bench) if args.against else None
    a = ssim_map(pred, gt)
    ga, = torch.autograd.grad(a.mean(), pred)
    b = ssim_map_reference(pred.double(), gt.double())
    gb, = torch.autograd.grad(b.mean(), pred)
    tuned = {}
    if args.tune:
        import insitu.training.ssim as mod

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
    print(json.dumps({"size": args.size, "batch": args.batch, "torchmetrics_ms": round(ms_tm, 3), **ours,
                      **({"against": args.against, "against_ms": against} if against else {}),
                      "loss_diff_vs_float64": float((a.mean() - b.mean()).abs()),
                      "map_max_diff": float((a.double() - b).abs().max()),
                      "grad_max_diff": float((ga.double() - gb).abs().max()),
                      "grad_max": float(gb.abs().max()), **({"tuned": tuned} if tuned else {})}), flush=True)


if __name__ == "__main__":
    main()
