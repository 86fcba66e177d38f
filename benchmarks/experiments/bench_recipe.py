"""The plain gsplat recipe on the project's ground truth and initial Gaussians (one GPU).

What a user could run instead of ``insitu run``: gsplat's ``DefaultStrategy``, the Inria
learning rates, L1 + 0.2 D-SSIM, one more SH band every 1000 iterations, one view per step,
around ``gsplat.rasterization``. The D-SSIM is fused-ssim's, as in gsplat's
``examples/simple_trainer.py``, when ``fused_ssim`` imports (a wheel for the GPU machine is in
``../shared/wheels``), else torchmetrics'; the JSON says which (``ssim_impl``). Same ground truth
(``make_scene``) and same initial Gaussians (``init_gaussians``) as the project's run; held-out
PSNR/SSIM, on the whole image and the foreground, every ``--eval-every`` iterations (the project's
``evaluate``; their time is left out of ``train_s``), stopping at the first one that meets the
targets (``--target-on foreground``: the surface's figures). Prints one JSON line per evaluation and
one at the end (with ``best_psnr_foreground``).

    python benchmarks/experiments/bench_recipe.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from insitu.config import load_config
from insitu.input.decomposition import cut_block
from insitu.parallel.comm import init_comm, shutdown
from insitu.groundtruth.scene import make_scene
from insitu.step.evaluation import evaluate
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.appearance import ColorModel
from insitu.volume import read_raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--views", type=int, default=448)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=500_000)
    ap.add_argument("--iterations", type=int, default=30_000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eps2d", type=float, default=0.3,
                    help="the rasterizer's pixel filter in training and evaluation (px^2; gsplat's default 0.3, "
                         "as a 3DGS user runs it; 0.05 is the project's train.eps2d)")
    ap.add_argument("--psnr-target", type=float, default=30.0)
    ap.add_argument("--ssim-target", type=float, default=0.97)
    ap.add_argument("--target-on", choices=("image", "foreground"), default="image",
                    help="judge the targets on the whole image (default) or the foreground")
    args = ap.parse_args()

    from gsplat import rasterization
    from gsplat.strategy import DefaultStrategy
    try:
        from fused_ssim import fused_ssim

        def ssim_fn(a, b):
            return fused_ssim(a, b, padding="valid")
        ssim_impl = "fused-ssim"
    except ImportError:
        from torchmetrics.functional.image import structural_similarity_index_measure

        def ssim_fn(a, b):
            return structural_similarity_index_measure(a, b, data_range=1.0)
        ssim_impl = "torchmetrics"

    comm = init_comm(device="auto")
    device = comm.device
    cfg = load_config(None, {"input.iso": [args.iso], "views.count": args.views,
                             "views.resolution": args.resolution, "seeds.budget": args.budget,
                             "train.sh_degree": 3})
    block = cut_block(read_raw(args.data), comm.rank, comm.size)
    t0 = time.perf_counter()
    seeds = extract_seeds(block, args.iso)
    g = init_gaussians(seeds, args.budget, color=cfg.views.surface_color, opacity=cfg.seeds.opacity,
                       thickness=cfg.seeds.thickness, sh_degree=3, seed=cfg.train.seed, device=device)
    scene = make_scene(block, cfg, comm)
    torch.cuda.synchronize(device)
    t_gt = time.perf_counter()
    glo, ghi = block.global_box
    extent = 0.5 * float(np.linalg.norm(ghi - glo))

    # --- the recipe: about as in gsplat's examples/simple_trainer.py --------------------------
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(t.detach().clone()) for k, t in (
        ("means", g.means), ("scales", g.log_scales), ("quats", g.quats), ("opacities", g.opacity_logits),
        ("sh0", g.sh0), ("shN", g.shN))})
    lrs = {"means": 1.6e-4 * extent, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2,
           "sh0": 2.5e-3, "shN": 2.5e-3 / 20}
    optimizers = {k: torch.optim.Adam([params[k]], lr=lr, eps=1e-15) for k, lr in lrs.items()}
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizers["means"], gamma=0.01 ** (1.0 / args.iterations))
    strategy = DefaultStrategy(verbose=False)
    strategy.check_sanity(params, optimizers)
    state = strategy.initialize_state(scene_scale=extent)
    views, train_ids = scene.views, scene.views.train_ids
    background = scene.background
    generator = torch.Generator().manual_seed(0)
    perm = torch.empty(0, dtype=torch.long)
    history, reached, eval_s = [], None, 0.0
    torch.cuda.synchronize(device)
    t_train = time.perf_counter()
    for step in range(args.iterations):
        if len(perm) == 0:
            perm = train_ids[torch.randperm(len(train_ids), generator=generator)].cpu()
        i, perm = int(perm[0]), perm[1:]
        colors = torch.cat([params["sh0"], params["shN"]], 1)
        rgb, alpha, info = rasterization(params["means"], params["quats"], torch.exp(params["scales"]),
                                     torch.sigmoid(params["opacities"]), colors, views.viewmats[i:i + 1],
                                     views.Ks[i:i + 1], views.width, views.height,
                                     sh_degree=min(step // 1000, 3), packed=False, eps2d=args.eps2d)
        rgb = rgb + (1.0 - alpha) * background                       # the ground truth's background
        gt = scene.gt_on(torch.tensor([i], device=device), background)   # premultiplied RGBA on it
        l1 = (rgb - gt).abs().mean()
        ssim = ssim_fn(rgb.permute(0, 3, 1, 2), gt.permute(0, 3, 1, 2))
        loss = 0.8 * l1 + 0.2 * (1.0 - ssim)
        strategy.step_pre_backward(params, optimizers, state, step, info)
        loss.backward()
        strategy.step_post_backward(params, optimizers, state, step, info, packed=False)
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % args.eval_every == 0:
            torch.cuda.synchronize(device)
            t_eval = time.perf_counter()
            joined = {k: params[k] for k in ("means", "scales", "quats", "opacities")}
            joined["colors"] = torch.cat([params["sh0"], params["shN"]], 1)
            q, _ = evaluate(joined, scene, comm, colors=ColorModel("sh", min(step // 1000, 3)), backend="auto",
                            eps2d=args.eps2d)
            eval_s += time.perf_counter() - t_eval
            history.append({"iteration": step + 1, "psnr": q.psnr, "ssim": q.ssim,
                            "psnr_foreground": q.psnr_foreground, "ssim_foreground": q.ssim_foreground,
                            "gaussians": len(params["means"]), "seconds": time.perf_counter() - t_train - eval_s})
            print(json.dumps({"evaluation": history[-1]}), flush=True)
            p, s = (q.psnr_foreground, q.ssim_foreground) if args.target_on == "foreground" else (q.psnr, q.ssim)
            if p >= args.psnr_target and s >= args.ssim_target:
                reached = step + 1
                break
    torch.cuda.synchronize(device)
    train_s = time.perf_counter() - t_train - eval_s
    last = history[-1] if history else {"psnr": math.nan, "ssim": math.nan}
    best = max(history, key=lambda h: h["psnr_foreground"]) if history else {}
    print(json.dumps({"recipe": "gsplat DefaultStrategy", "ssim_impl": ssim_impl, "target_on": args.target_on,
                      "eps2d": args.eps2d,
                      "best_psnr_foreground": best.get("psnr_foreground"),
                      "best_psnr_foreground_at": best.get("iteration"),
                      "best_psnr_foreground_s": best.get("seconds"),
                      "resolution": args.resolution, "views": args.views,
                      "gaussians_initial": len(g), "iterations": history[-1]["iteration"] if history else 0,
                      "target_reached_at": reached, "psnr": last["psnr"], "ssim": last["ssim"],
                      "seeds_and_gt_s": round(t_gt - t0, 3), "train_s": round(train_s, 3),
                      "eval_s": round(eval_s, 3),
                      "history": history}), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
