"""What ``model.ply``'s SH model costs and scores, by how it is fitted and refined, on one trained model.

Trains one step as ``pipeline.compute_step`` does (one rank, the package's defaults unless ``--set``),
then makes ``model.ply``'s shard (:func:`insitu.step.plyfit.model_ply`: the SH model made for standard viewers,
then ``output.ply_refine`` of the step's iterations trained as a standard viewer draws it, ``train.batch`` views
each) once per variant, each from the same trained model, and scores each as ``metrics.json``'s ``ply_*``
figures (:func:`insitu.step.evaluation.model_figures`, against the ground truth it was made for). A variant is
``NAME=KEY=VALUE,KEY=VALUE`` over those three settings; its seconds are the device's (synchronised).
Prints one JSON object; the trained model's own figures beside the variants'.

    python benchmarks/experiments/bench_plyfit.py --data bonsai_256x256x256_uint8.raw \\
        --variant default= --variant half=output.ply_refine=0.0625 --variant b1=train.batch=1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_fidelity import base_settings, train_one_step, volume_arguments  # noqa: E402  (benchmarks/, the script's folder)
from insitu.config import parse_override  # noqa: E402
from insitu.parallel.comm import shutdown  # noqa: E402
from insitu.step import evaluation, plyfit  # noqa: E402

VARIED = ("output.ply_refine", "output.ply_fit_views", "train.batch")


def variant(text: str) -> tuple[str, dict]:
    """``NAME=KEY=VALUE,KEY=VALUE`` (or ``NAME=`` for the defaults) -> (name, overrides)."""
    name, _, rest = text.partition("=")
    pairs = dict(parse_override(p) for p in rest.split(",") if p)
    unknown = set(pairs) - set(VARIED)
    if not name or unknown:
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE,... over {VARIED}, got keys {sorted(unknown)}")
    return name, pairs


def with_settings(cfg, pairs: dict):
    """``cfg`` with the dotted settings ``pairs`` replaced."""
    for key, value in pairs.items():
        section, field = key.split(".")
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    volume_arguments(ap, iso=40.0, budget=None)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                    help=f"a way to make model.ply, over {', '.join(VARIED)} (repeatable; the first also warms up)")
    args = ap.parse_args()
    variants = [variant(v) for v in args.variant] or [("default", {})]

    volume, overrides = base_settings(args)
    comm, cfg, _, layout, scene, trainer, clock = train_one_step(volume, overrides, args.device)
    q, _ = evaluation.evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained)
    trained = trainer.gaussians()
    gaussians, _ = layout.shard(trained)
    rows = {}
    for i, (name, pairs) in enumerate([variants[0]] + variants):       # the first twice: its first use warms up
        vcfg = with_settings(cfg, pairs)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        t = time.perf_counter()
        ply, _, ply_scene = plyfit.model_ply(trained, gaussians, trainer, scene, layout, vcfg)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        seconds = time.perf_counter() - t
        _, qm = evaluation.model_figures(gaussians, ply, ply_scene, layout, vcfg)
        qm = qm["test"]
        if i > 0:
            rows[name] = {"settings": pairs, "ply_fit_seconds": round(seconds, 3),
                          "ply_psnr_foreground": qm.psnr_foreground, "ply_ssim_foreground": qm.ssim_foreground,
                          "ply_psnr": qm.psnr}
            print(name, rows[name], file=sys.stderr, flush=True)
    out = {"device": torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else "cpu",
           "resolution": args.resolution, "views": len(scene.views), "gaussians": len(trained),
           "iterations": trainer.iteration, "train_seconds": round(clock.seconds["train"], 3),
           "psnr_foreground": q.psnr_foreground, "psnr": q.psnr, "variants": rows}
    print(json.dumps(out), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
