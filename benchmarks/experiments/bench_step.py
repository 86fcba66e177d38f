"""Time per training step of a fixed model on P ranks (run under mpirun -n P).

A model of about ``--budget`` Gaussians is seeded on the isosurface (points drawn on
the marching-cubes triangles up to the budget), split over the ranks by block; each
step renders ``--batch`` views at ``--resolution``, composites them across ranks,
computes the loss on each rank's band and runs backward and Adam. Densification is
off, so every P times the same model, and SH degree 3 is trained from the first step (as in
the bare rasterization it is compared with). ``--profile N`` adds N steps under
``torch.profiler``: device time per step and its largest kernels. Prints one JSON line (rank 0).

    mpirun -n 2 python benchmarks/experiments/bench_step.py --data ../shared/data/bonsai_256x256x256_uint8.raw \
        --iso 40 --budget 4000000 --resolution 2048 --steps 50
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from insitu.config import load_config
from insitu.input.decomposition import cut_block
from insitu.parallel.comm import init_comm, shutdown
from insitu.groundtruth.scene import make_scene
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.trainer import Trainer, render_bands
from insitu.volume import read_raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--budget", type=int, default=4_000_000)
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--views", type=int, default=16, help="distinct GT views to cycle through")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sh-degree", type=int, default=3)
    ap.add_argument("--transfer", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", type=int, default=0,
                    help="then N more steps under torch.profiler: device time per step and its largest kernels")
    args = ap.parse_args()

    comm = init_comm(device=args.device)
    cfg = load_config(None, {"input.iso": [args.iso], "views.count": args.views, "views.resolution": args.resolution,
                             "views.test_every": args.views, "train.sh_degree": args.sh_degree,
                             "train.batch": args.batch, "train.densify.start": 10 ** 9, "train.densify.reset_every": 0,
                             "run.progress": False, "run.transfer": args.transfer})
    block = cut_block(read_raw(args.data), comm.rank, comm.size)
    seeds = extract_seeds(block, args.iso)
    total = comm.mpi.allreduce(seeds.total_area)
    budget = int(round(args.budget * seeds.total_area / total))
    g = init_gaussians(seeds, budget, fill=True, sh_degree=args.sh_degree, seed=comm.rank, device=comm.device)
    n_all = comm.mpi.allreduce(len(g))
    t = time.perf_counter()
    scene = make_scene(block, cfg, comm)
    gt_s = time.perf_counter() - t
    lo, hi = block.box
    box = (torch.as_tensor(lo - 2, dtype=torch.float32, device=comm.device),
           torch.as_tensor(hi + 2, dtype=torch.float32, device=comm.device))
    glo, ghi = block.global_box
    trainer = Trainer(g, cfg.train, extent=0.5 * float(np.linalg.norm(ghi - glo)), box=box,
                      max_gaussians=len(g), device=comm.device, total_iterations=args.steps + args.warmup,
                      sh_degree_start=args.sh_degree)   # every band from the first step, as the bare raster
    ids_all = scene.views.train_ids
    times = []
    if comm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(comm.device)
    def one_step(i: int) -> float:
        ids = ids_all[torch.arange(i * args.batch, (i + 1) * args.batch) % len(ids_all)].to(comm.device)
        render = lambda p: render_bands(p, scene.views, ids, scene.order, comm, background=scene.background,  # noqa: E731
                                        colors=trainer.colors, backend="auto",
                                        transfer=args.transfer)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        comm.mpi.Barrier()
        t = time.perf_counter()
        gt = scene.gt_on(ids, scene.background)
        trainer.step(render, gt, rows=scene.rows, height=scene.views.height, comm=comm)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        return time.perf_counter() - t

    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            comm.traffic.reset()
        dt = one_step(i)
        if i >= args.warmup:
            times.append(dt)
    profile = None
    if args.profile and comm.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as profiler

        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = sum(one_step(args.warmup + args.steps + i) for i in range(args.profile)) / args.profile
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
        profile = {"wall_ms": round(wall * 1e3, 2),
                   "device_kernel_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3 / args.profile, 2),
                   "top": [{"name": e.key[:90], "ms": round(e.self_device_time_total / 1e3 / args.profile, 3),
                            "calls": e.count // args.profile} for e in top]}
    step_ms = comm.mpi.allreduce(statistics.median(times) * 1e3, op=__import__("mpi4py").MPI.MAX)
    bare_ms = bare_raster_ms(trainer, scene, args) if comm.size == 1 and comm.device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(comm.device) / 2**30 if comm.device.type == "cuda" else float("nan")
    peaks = comm.mpi.gather(round(peak, 2))
    moved = comm.mpi.gather(comm.traffic.bytes / args.steps)
    if comm.rank == 0:
        print(json.dumps({
            "ranks": comm.size, "device": str(comm.device), "gaussians": n_all, "resolution": args.resolution,
            "batch": args.batch, "sh_degree": args.sh_degree, "transfer": args.transfer,
            "step_ms_median": round(step_ms, 2), "images_per_s": round(1e3 * args.batch / step_ms, 1),
            "peak_gpu_gb_per_rank": peaks, "mb_moved_per_step_per_rank": [round(m / 2**20, 1) for m in moved],
            "gt_seconds_for_views": round(gt_s, 2), "gt_views": args.views,
            "bare_raster_ms": None if bare_ms is None else round(bare_ms, 2),
            **({"profile": profile} if profile else {}),
        }), flush=True)
    shutdown(comm)


def bare_raster_ms(trainer: Trainer, scene, args) -> float:
    """Median ms of gsplat's rasterization forward + backward alone, same model, same views
    (activated parameters as leaves, a fixed loss gradient)."""
    from gsplat import rasterization

    p = trainer.params
    leaves = [t.detach().clone().requires_grad_() for t in (
        p["means"], p["quats"], torch.exp(p["scales"]), torch.sigmoid(p["opacities"]),
        p["colors"])]
    ids_all, times = scene.views.train_ids, []
    for i in range(args.warmup + args.steps):
        ids = ids_all[torch.arange(i * args.batch, (i + 1) * args.batch) % len(ids_all)].to(leaves[0].device)
        torch.cuda.synchronize()
        t = time.perf_counter()
        rgb, alpha, _ = rasterization(*leaves, scene.views.viewmats[ids], scene.views.Ks[ids], scene.views.width,
                                      scene.views.height, sh_degree=args.sh_degree, packed=False)
        (rgb.sum() + alpha.sum()).backward()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
        for leaf in leaves:
            leaf.grad = None
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
