"""Where a training iteration's time goes: the pipeline's own loop, one rank (GPU or CPU).

Sets up a step as ``pipeline.compute_step`` does (seeds, ground truth, colours from the ground
truth, the Trainer with the step's schedule), then times ``insitu.step.loop.train_iteration`` over
``sampling.ViewSampler``:

- ``first_ms``: the first iteration alone (kernels compiled or loaded on first use), then the
  next ``--chunk`` iterations;
- ``chunks``: ms per iteration for each ``--chunk`` iterations up to ``--warm`` (densification on,
  as in a run), with the Gaussian count;
- ``profile``: ``torch.profiler`` over ``--profile`` steady iterations: wall and summed device
  kernel time per iteration (their ratio says whether the host or the device sets the pace),
  and the kernels that take the most time;
- ``variants``: steady ms per iteration with a random background, with the fixed one, and gsplat's
  bare rasterization forward + backward of the same model and views;
- ``metrics_import_s``: importing the evaluation's metrics (torchmetrics); ``metrics_first_s``: the first image-quality call of the process on a 64x64 image (torchmetrics'
  first use); ``evaluate_first_s``, ``evaluate_s``: the held-out evaluation before training (the
  first in the process) and one after the chunks.

Prints one JSON object.

    python benchmarks/experiments/bench_loop.py --data bonsai_256x256x256_uint8.raw --resolution 1024 --views 448
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.config import load_config, parse_override  # noqa: E402
from insitu.groundtruth.scene import make_scene  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.step import evaluation, loop, pipeline  # noqa: E402
from insitu.step.layouts import choose_layout  # noqa: E402
from insitu.step.seeding import init_colors, seed_shard  # noqa: E402
from insitu.training.sampling import ViewSampler  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402


def sync(comm) -> float:
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    return time.perf_counter()


def timed(comm, trainer, scene, cfg, draws, n: int) -> float:
    """ms per iteration over ``n`` iterations."""
    t = sync(comm)
    for _, (ids, bg) in zip(range(n), draws):
        loop.train_iteration(trainer, scene, ids, bg, cfg, comm)
    return (sync(comm) - t) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=448)
    ap.add_argument("--budget", type=int, default=500_000)
    ap.add_argument("--iterations", type=int, default=5000, help="length of the learning-rate schedule")
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--profile", type=int, default=30)
    ap.add_argument("--steady", type=int, default=200)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (as insitu run's --set)")
    args = ap.parse_args()

    comm = init_comm(device=args.device)
    overrides = {"input.iso": [args.iso], "views.count": args.views, "views.resolution": args.resolution,
                 "seeds.budget": args.budget, "train.iterations": args.iterations, "run.progress": False}
    overrides.update(dict(parse_override(s) for s in args.set))
    cfg = load_config(None, overrides)
    tc = cfg.train
    block = whole_block(read_raw(args.data))
    t0 = time.perf_counter()
    decomposition = pipeline.check_input(block, cfg, comm)      # as pipeline.compute_step sets a step up
    layout = choose_layout(cfg, comm, block, decomposition)
    seeding = seed_shard(block, cfg, comm, None)
    scene = make_scene(block, cfg, comm, decomposition=decomposition, targets=seeding.targets)
    shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
    trainer, scene = pipeline.make_trainer(shard, scene, layout, block, cfg, share=seeding.share,
                                           iterations=tc.iterations, warm=None)
    setup_s = sync(comm) - t0
    draws = iter(ViewSampler(scene, dataclasses.replace(tc, batch=trainer.images_per_step)))
    out = {"device": torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else "cpu",
           "resolution": args.resolution, "gaussians": len(trainer), "setup_s": round(setup_s, 2)}
    t = time.perf_counter()
    from insitu.step.metrics import image_quality  # torchmetrics: imported on the first evaluation of a run
    out["metrics_import_s"] = round(time.perf_counter() - t, 3)
    t = sync(comm)
    tiny = torch.rand(1, 64, 64, 3, device=comm.device)
    image_quality(tiny, tiny.flip(1))               # torchmetrics' first use in the process, on a tiny image
    out["metrics_first_s"] = round(sync(comm) - t, 3)
    t = sync(comm)
    evaluation.evaluate(trainer.params, scene, comm, colors=trainer.colors, backend=cfg.run.backend)
    out["evaluate_first_s"] = round(sync(comm) - t, 3)
    out["first_ms"] = round(timed(comm, trainer, scene, cfg, draws, 1), 1)
    chunks = []
    while trainer.iteration < args.warm:
        ms = timed(comm, trainer, scene, cfg, draws, args.chunk)
        chunks.append({"iteration": trainer.iteration, "ms_per_iteration": round(ms, 2), "gaussians": len(trainer)})
    out["chunks"] = chunks

    t = sync(comm)
    evaluation.evaluate(trainer.params, scene, comm, colors=trainer.colors, backend=cfg.run.backend)
    out["evaluate_s"] = round(sync(comm) - t, 3)

    steady = dataclasses.replace(tc, densify=dataclasses.replace(tc.densify, start=10**9, reset_every=0))
    trainer.cfg = steady
    if comm.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed(comm, trainer, scene, cfg, draws, args.profile)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        device_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.profile
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]
        out["profile"] = {"wall_ms": round(wall, 2), "device_kernel_ms": round(device_ms, 2),
                          "top": [{"name": e.key[:80], "ms": round(e.self_device_time_total / 1e3 / args.profile, 3),
                                   "calls": e.count // args.profile} for e in top]}
    variants = {}
    for name, over in (("random_background", {}), ("fixed_background", {"random_background": False})):
        cfg_v = dataclasses.replace(cfg, train=dataclasses.replace(steady, **over))
        trainer.cfg = cfg_v.train
        draws_v = iter(ViewSampler(scene, cfg_v.train))
        timed(comm, trainer, scene, cfg_v, draws_v, 10)
        variants[name] = round(timed(comm, trainer, scene, cfg_v, draws_v, args.steady), 2)
    if comm.device.type == "cuda":
        from bench_step import bare_raster_ms

        ns = argparse.Namespace(warmup=10, steps=args.steady, batch=tc.batch, sh_degree=trainer.sh_degree)
        variants["bare_gsplat"] = round(bare_raster_ms(trainer, scene, ns), 2)
    out["variants_ms"] = variants
    if comm.device.type == "cuda":
        out["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(comm.device) / 2**30, 2)
    print(json.dumps(out), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
