"""Fidelity where a user looks: variants of one volume's training, side by side in one process.

Every variant is one ``pipeline.compute_step`` of the same volume (one rank) with the base settings
plus its own ``--set`` overrides, and reports the foreground figures of the held-out orbit views,
of the views 2x and 3x closer and off the orbit's lattice, of ``model.ply`` (SH colours), the
iterations, Gaussians and seconds. The first variant pays for compiling the kernels (its
``total_s`` is cold where the cache is empty); later ones run warm.

    python benchmarks/experiments/bench_fidelity.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --variant "sh=train.color_model=sh" --variant "lit=" --variant "lit_close=views.closeups=112"

Prints one JSON object per variant (a line each) and writes them all to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.config import load_config, parse_override  # noqa: E402
from insitu.groundtruth.views import pixel_size  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.step.pipeline import compute_step  # noqa: E402
from insitu.volume import downsample, read_raw, whole_block  # noqa: E402

KEYS = ("psnr", "psnr_foreground", "ssim_foreground", "psnr_foreground_near2", "psnr_foreground_near3",
        "psnr_foreground_off", "ply_psnr", "ply_psnr_foreground", "psnr_foreground_initial", "iterations",
        "target_reached_at", "gaussians_initial", "gaussians", "seeds_seconds", "ground_truth_seconds",
        "train_seconds", "evaluation_seconds", "total_seconds", "peak_gpu_memory_gb")


def volume_arguments(ap: argparse.ArgumentParser, *, iso: float | None = None, budget: int | None = 500_000) -> None:
    """The volume and the base settings of one training (this script's, bench_anatomy.py's and others'):
    ``iso`` the default iso value (None: ``--iso`` is required), ``budget`` the default seed budget (None:
    the package's)."""
    ap.add_argument("--data", required=True, help="a raw volume NAME_XxYxZ_DTYPE.raw")
    ap.add_argument("--iso", type=float, required=iso is None, default=iso)
    ap.add_argument("--downsample", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--views", type=int, default=448)
    ap.add_argument("--iterations", type=int, help="optimiser steps (default: the package's train.iterations)")
    ap.add_argument("--budget", type=int, default=budget, help="seeds (default: %(default)s; None: the package's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a base setting")


def base_settings(args: argparse.Namespace):
    """``(volume, overrides)``: the volume of ``--data`` and the settings of :func:`volume_arguments`."""
    volume = downsample(read_raw(args.data), args.downsample)
    base = {"input.iso": [args.iso], "views.count": args.views, "views.resolution": args.resolution,
            "run.progress": False, "run.device": args.device}
    if args.budget is not None:
        base["seeds.budget"] = args.budget
    if args.iterations is not None:
        base["train.iterations"] = args.iterations
    base.update(dict(parse_override(s) for s in args.set))
    return volume, base


def train_one_step(volume, overrides: dict, device: str):
    """One rank's cold step of ``volume`` with the settings ``overrides``, trained as ``compute_step`` trains it
    and kept in hand for an experiment on the trained model (bench_plyfit.py, bench_standard_files.py): returns
    ``(comm, cfg, layout, scene, trainer, clock)``, the clock's ``train`` lap the training alone."""
    from insitu.groundtruth.scene import make_scene
    from insitu.step import loop, pipeline
    from insitu.step.clock import PhaseClock
    from insitu.step.layouts import choose_layout
    from insitu.step.seeding import init_colors, seed_shard

    comm = init_comm(device=device)
    cfg = load_config(None, overrides)
    block = whole_block(volume)
    decomposition = pipeline.check_input(block, cfg, comm)
    layout = choose_layout(cfg, comm, block, decomposition)
    clock = PhaseClock(comm.device)
    seeding = seed_shard(block, cfg, comm, None)
    scene = make_scene(block, cfg, comm, decomposition=decomposition, targets=seeding.targets)
    shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
    trainer, scene = pipeline.make_trainer(shard, scene, layout, block, cfg, share=seeding.share,
                                           iterations=cfg.train.iterations, warm=None)
    clock.lap("setup")
    loop.train(trainer, scene, layout, cfg, clock, iterations=cfg.train.iterations, step=0, gaussians=len(shard),
               show=False)
    clock.lap("train")
    return comm, cfg, block, layout, scene, trainer, clock


def sigma_px(result) -> list[float] | None:
    """The 10th / 50th / 90th percentiles of the trained Gaussians' larger in-plane standard deviation, in
    pixels of the nearest orbit view that sees each centre (None without the step's cameras)."""
    import torch

    g, views = result.gaussians, result.cameras
    if views is None or len(g) == 0:
        return None
    with torch.no_grad():
        px = pixel_size(g.means, views.to(g.means.device), torch.arange(len(views.viewmats)))
        sigma = torch.exp(g.log_scales).max(dim=1).values / px
        sigma = sigma[torch.isfinite(sigma)]
        sigma = sigma[torch.randperm(len(sigma), device=sigma.device)[:1_000_000]].float()
        return [round(float(v), 3) for v in torch.quantile(sigma, torch.tensor([0.1, 0.5, 0.9], device=sigma.device))]


def variant_config(spec: str, base: dict):
    """``(name, settings, cfg)`` of one ``--variant NAME=KEY=VALUE,KEY=VALUE`` over the ``base`` settings."""
    name, _, settings = spec.partition("=")
    overrides = dict(base)
    parts = re.split(r",(?![^\[]*\])", settings)             # commas inside [..] belong to a list value
    overrides.update(dict(parse_override(s) for s in parts if s))
    return name, settings, load_config(None, overrides)


def variant_row(block, cfg, comm, name: str, settings: str, **extra) -> dict:
    """Train one variant (one ``compute_step``) and return its row of figures, ``extra`` after its name."""
    t0 = time.perf_counter()
    result = compute_step(block, cfg, comm)
    wall, m = time.perf_counter() - t0, result.metrics
    return {"variant": name, **extra, "settings": settings, "wall_s": round(wall, 2),
            **{k: m.get(k) for k in KEYS}, "sigma_px_orbit_q10_50_90": sigma_px(result)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    volume_arguments(ap)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=KEY=VALUE,KEY=VALUE",
                    help="a variant: its name, then its settings separated by commas (none: the base)")
    ap.add_argument("--json", help="write the variants' figures here")
    args = ap.parse_args()
    volume, base = base_settings(args)
    comm = init_comm(device=args.device)
    rows = []
    try:
        for spec in args.variant:
            name, settings, cfg = variant_config(spec, base)
            row = variant_row(whole_block(volume), cfg, comm, name, settings)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps({"data": Path(args.data).name, "iso": args.iso,
                                                   "resolution": args.resolution, "views": args.views,
                                                   "base": base, "variants": rows}, indent=1))
        shutdown(comm)


if __name__ == "__main__":
    main()
