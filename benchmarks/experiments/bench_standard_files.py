"""The standard files (model.ply, model.spz) as a standard viewer draws them, against the lit model the report draws.

Trains one step of a lit model (one rank, the package's defaults unless ``--set``) and scores it on the held-out
orbit views and the close-ups (``near2``, ``near3``) against the step's ground truth (the headlight). Then, once per
variant and from the same trained model, makes the standard files' model as a step does
(:func:`insitu.step.plyfit.model_ply`: with ``output.ply_light`` fixed, the ground truth of the views it needs cast
again in the fixed light, the colours baked in it and refit as standard viewers draw them; with ``headlight``, the SH
fit of the headlight refit against the step's ground truth) and scores it as ``metrics.json``'s ``ply_*`` figures
(:func:`insitu.step.evaluation.model_figures`: one global sort, ``STANDARD_EPS2D``, not antialiased) against the
ground truth it was made for. ``gap_*`` is the variant's surface PSNR minus the lit model's, per set of views;
``spz_*`` and ``spz_gap_*`` the same of model.spz where it holds the trained Gaussians (a model trained
antialiased), drawn antialiased as its header says (``STANDARD_EPS2D``, each splat's opacity scaled: Spark's default);
``spz_refit_gap_*`` that model refit as so drawn (``output.ply_refine`` of the iterations), for the first variant.
``relit`` is the trained model shaded with the fixed light, one colour per Gaussian, drawn as trained (its blur,
antialiased), against the fixed light's ground truth: what the representation holds before any refit;
``relit_classic_gap`` the same drawn as classic viewers draw (0.3 px² added, no scaling): model.spz in a viewer that
ignores its flag.
``blur_bound`` is that ground truth blurred by the viewers' 0.3 px² against itself: about the best a standard
viewer, which adds that blur to every Gaussian, can show of a perfect model.

A variant is ``NAME=KEY=VALUE,KEY=VALUE`` over ``output.*`` settings (``NAME=``: the defaults); its seconds
(``ply_fit_seconds``: casting, baking or fitting, refit) are the device's. Prints one JSON object.

    python benchmarks/experiments/bench_standard_files.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --variant merged= --variant unmerged=output.ply_merge=0 --variant merged3=output.ply_merge=3
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fidelity import base_settings, train_one_step, volume_arguments  # noqa: E402  (benchmarks/, the script's folder)
from insitu.config import load_config, parse_override  # noqa: E402
from insitu.groundtruth.scene import make_scene  # noqa: E402
from insitu.parallel.comm import shutdown  # noqa: E402
from insitu.render.lighting import FIXED_LIGHT  # noqa: E402
from insitu.render.rendering import STANDARD_EPS2D  # noqa: E402
from insitu.step import evaluation, plyfit  # noqa: E402
from insitu.training.appearance import ColorModel, bake_light  # noqa: E402
from insitu.training.trainer import to_params, training_blur  # noqa: E402

ROLES = evaluation.PLY_ROLES


def variant(text: str) -> tuple[str, dict]:
    """``NAME=KEY=VALUE,KEY=VALUE`` (or ``NAME=`` for the defaults) -> (name, overrides of output.*)."""
    name, _, rest = text.partition("=")
    pairs = dict(parse_override(p) for p in rest.split(",") if p)
    if not name or any(not key.startswith("output.") for key in pairs):
        raise SystemExit(f"--variant {text!r}: expected NAME=KEY=VALUE,... over output.* settings")
    return name, pairs


def figures(qualities: dict) -> dict:
    """Surface PSNR per set of views (``psnr_foreground`` on the orbit, ``psnr_foreground_near2``, ...)."""
    return {("psnr_foreground" if role == "test" else f"psnr_foreground_{role}"): q.psnr_foreground
            for role, q in qualities.items()}


def blur_bound(scene, ids: torch.Tensor, eps2d: float = STANDARD_EPS2D):
    """The ground truth of ``scene``'s views ``ids`` (one rank holds them whole) blurred by a Gaussian of variance
    ``eps2d`` px², scored against itself: about the best a viewer that adds that blur to every Gaussian can show."""
    from insitu.step.metrics import QualityAccumulator

    gt = scene.gt[ids].float().permute(0, 3, 1, 2)                    # [V, 4, H, W] premultiplied
    r = max(1, math.ceil(3 * math.sqrt(eps2d)))
    x = torch.arange(-r, r + 1, dtype=torch.float32, device=gt.device)
    k = torch.exp(-x ** 2 / (2 * eps2d))
    k = k / k.sum()
    blurred = torch.nn.functional.conv2d(gt.reshape(-1, 1, *gt.shape[2:]), k.view(1, 1, 1, -1), padding=(0, r))
    blurred = torch.nn.functional.conv2d(blurred, k.view(1, 1, -1, 1), padding=(r, 0)).reshape(gt.shape)
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(blurred.permute(0, 2, 3, 1), gt.permute(0, 2, 3, 1), scene.background)
    return acc.result()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    volume_arguments(ap, iso=40.0, budget=None)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                    help="a way to make the standard files, over output.* settings (repeatable; the first also "
                         "warms up)")
    args = ap.parse_args()
    variants = [variant(v) for v in args.variant] or [("default", {})]

    volume, overrides = base_settings(args)
    overrides["train.color_model"] = "lit"
    comm, cfg, block, layout, scene, trainer, clock = train_one_step(volume, overrides, args.device)
    lit = {role: evaluation.evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained,
                                             ids=scene.views.ids(role).tolist())[0]
           for role in ROLES if len(scene.views.ids(role))}
    lit = figures(lit)
    trained = trainer.gaussians()
    gaussians, _ = layout.shard(trained)

    # the trained model in the fixed light, drawn as trained, against the fixed light's ground truth
    held = torch.cat([scene.views.ids(role) for role in ROLES])
    fixed = layout.images(make_scene(block, cfg, comm, views=scene.views.subset(held), light=FIXED_LIGHT))
    baked = to_params(bake_light(trained, FIXED_LIGHT, 0))
    relit = figures({role: layout.evaluate(lambda c: evaluation.evaluate(
        baked, fixed, c, colors=ColorModel("sh", 0), backend=cfg.run.backend,
        ids=fixed.views.ids(role).tolist(), **training_blur(cfg)))[0] for role in ROLES if len(fixed.views.ids(role))})

    def drawn(antialiased: bool) -> dict:       # the same, drawn with a standard viewer's blur (0.3 px^2)
        return figures({role: layout.evaluate(lambda c: evaluation.evaluate(
            baked, fixed, c, colors=ColorModel("sh", 0), backend=cfg.run.backend, ids=fixed.views.ids(role).tolist(),
            eps2d=STANDARD_EPS2D, antialiased=antialiased))[0] for role in ROLES if len(fixed.views.ids(role))})

    relit_classic = drawn(False)                # model.spz in a viewer that ignores its flag
    blurred = figures({role: blur_bound(fixed, fixed.views.ids(role)) for role in ROLES if len(fixed.views.ids(role))})

    rows = {}
    for i, (name, pairs) in enumerate([variants[0]] + variants):       # the first twice: its first use warms up
        vcfg = load_config(None, {**overrides, **pairs})
        synchronize(comm.device)
        t = time.perf_counter()
        ply, spz, ply_scene = plyfit.model_ply(trained, gaussians, trainer, scene, layout, vcfg)
        synchronize(comm.device)
        seconds = time.perf_counter() - t
        _, qm = evaluation.model_figures(gaussians, ply, ply_scene, layout, vcfg)
        if i > 0:
            row = figures(qm)
            if spz is not ply:                  # model.spz: the trained Gaussians, drawn antialiased
                qs = figures(evaluation.standard_figures(spz, ply_scene, layout, vcfg, antialiased=True))
                row.update({f"spz_{k}": v for k, v in qs.items()})
                row.update({f"spz_gap_{k}": round(v - lit[k], 3) for k, v in qs.items() if k in lit})
                if i == 1:                      # the trained Gaussians refit as drawn antialiased (0.3 px^2)
                    synchronize(comm.device)
                    t = time.perf_counter()
                    refit = plyfit.refine_for_viewers(spz, trainer, ply_scene, layout, vcfg, antialiased=True)
                    synchronize(comm.device)
                    row["spz_refit_seconds"] = round(time.perf_counter() - t, 3)
                    qr = figures(evaluation.standard_figures(refit, ply_scene, layout, vcfg, antialiased=True))
                    row.update({f"spz_refit_gap_{k}": round(v - lit[k], 3) for k, v in qr.items() if k in lit})
            rows[name] = {"settings": pairs, "ply_fit_seconds": round(seconds, 3), "sh_degree": ply.sh_degree,
                          "gaussians": comm.mpi.allreduce(len(ply)),
                          **row, **{f"gap_{k}": round(v - lit[k], 3) for k, v in row.items() if k in lit}}
            print(name, rows[name], file=sys.stderr, flush=True)
    out = {"device": torch.cuda.get_device_name(comm.device) if comm.device.type == "cuda" else "cpu",
           "data": Path(args.data).name, "downsample": args.downsample, "resolution": args.resolution,
           "views": len(scene.views), "gaussians": len(trained), "iterations": trainer.iteration,
           "train_seconds": round(clock.seconds["train"], 3), "lit": lit, "relit": relit,
           "relit_gap": {k: round(v - lit[k], 3) for k, v in relit.items() if k in lit}, "blur_bound": blurred,
           "relit_classic_gap": {k: round(v - lit[k], 3) for k, v in relit_classic.items() if k in lit},
           "variants": rows}
    print(json.dumps(out), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
