"""Where the surface's error is: one volume trained with the defaults, its held-out error taken apart.

Trains one step as ``insitu run`` does (the phases of ``pipeline.compute_step``, one rank) and, for
the initial and the trained model, splits each held-out set's foreground error (the pixels where the
ground truth or the render has alpha > 1/255, as ``psnr_foreground``):

- ``inner``: pixels fully covered in both images (alpha > 0.99), ``edge``: the rest of the foreground;
  their shares of the squared error, their own PSNR, and the foreground's PSNR were either perfect;
- ``holes`` / ``spurious``: covered in the ground truth and under half in the render, and the reverse;
- ``low``: the share of the inner error that survives a 5x5 box filter of the difference (shading that
  is off over several pixels, not pixel-scale detail); ``bias``: the inner mean of render - truth;
- the same for two sets of training views (``train_orbit``, ``train_close``): what the model was fitted
  to, against the held-out sets it was not;
- by the ground truth's local contrast (|luminance difference| to the right and below neighbours):
  the inner pixels' share of the count and of the error per bin;
- of the model: each Gaussian's in-plane standard deviation in pixels of the nearest training view,
  its opacity, its normal against the field's at its centre and its centre's distance to the surface;
- with ``--roll DEG``, the trained model again on every view turned by DEG degrees about its optical axis
  (``trained_rolled``: the same eyes and look-at points, the ground truth cast anew), against the upright
  cameras every set has: whether the model holds the surface's edges at any angle to the pixel grid;
- by viewing direction (``by_polar``): each set's foreground PSNR pooled over its views whose direction
  lies within 25 degrees of a pole (the z axis), 25-50 degrees from one, or further: whether views off the
  orbit near the poles score lower because they are off the orbit (the orbit's own views there score
  higher) or because of what they see there (those score as low).

    python benchmarks/experiments/bench_anatomy.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --iterations 4000 --images out_dir

Prints one JSON object (and writes it to ``--json``); ``--images`` writes ground truth | render |
4x error PNGs of the middle of one view per held-out set.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.config import load_config  # noqa: E402
from insitu.groundtruth.scene import make_scene  # noqa: E402
from insitu.groundtruth.views import HELD_OUT, Views, pixel_size  # noqa: E402
from insitu.output.files import write_png  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.render.compositing import foreground  # noqa: E402
from insitu.step.clock import PhaseClock  # noqa: E402
from insitu.step.layouts import choose_layout  # noqa: E402
from insitu.step.loop import train  # noqa: E402
from insitu.step.pipeline import check_input, make_trainer  # noqa: E402
from insitu.step.seeding import init_colors, seed_shard  # noqa: E402
from insitu.training.appearance import BlockSamples, quat_normals  # noqa: E402
from insitu.training.trainer import render_bands, training_blur  # noqa: E402
from insitu.volume import iso_distance, unit_field, whole_block  # noqa: E402

from bench_fidelity import base_settings, volume_arguments  # noqa: E402  (benchmarks/, the script's folder)

CONTRAST_BINS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, math.inf)
POLAR_BINS = (0.0, 25.0, 50.0, 90.01)   # degrees between a view's direction and the nearest pole


def psnr(se: float, n: float) -> float:
    return float("inf") if se <= 0 else -10.0 * math.log10(se / max(n, 1.0))


class Anatomy:
    """Sums over views of premultiplied RGBA ``pred, gt: [C, H, W, 4]`` (on black)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.bins = np.zeros((2, len(CONTRAST_BINS) - 1))

    def add(self, pred: torch.Tensor, gt: torch.Tensor) -> None:
        pa, ga = pred[..., 3], gt[..., 3]
        diff = pred[..., :3] - gt[..., :3]                          # [C, H, W, 3]
        se = (diff ** 2).mean(-1)                                   # per pixel, the channels' mean
        fg = foreground(pa, ga)
        inner = (pa > 0.99) & (ga > 0.99)
        edge = fg & ~inner
        low = F.avg_pool2d(diff.permute(0, 3, 1, 2), 5, stride=1, padding=2).permute(0, 2, 3, 1)
        core = -F.max_pool2d(-inner[:, None].float(), 5, stride=1, padding=2)[:, 0] > 0.5   # inner, 2 px in
        lum = gt[..., :3].mean(-1)
        contrast = torch.zeros_like(lum)
        contrast[:, :, :-1] = (lum[:, :, 1:] - lum[:, :, :-1]).abs()
        contrast[:, :-1, :] = torch.maximum(contrast[:, :-1, :], (lum[:, 1:, :] - lum[:, :-1, :]).abs())
        add = lambda k, v: self.s.__setitem__(k, self.s.get(k, 0.0) + float(v))   # noqa: E731
        add("pixels", fg.numel())
        add("fg", fg.sum()), add("inner", inner.sum()), add("edge", edge.sum())
        add("se_fg", se[fg].sum()), add("se_inner", se[inner].sum()), add("se_edge", se[edge].sum())
        add("holes", ((ga > 0.99) & (pa < 0.5)).sum()), add("spurious", ((ga < 0.01) & (pa > 0.5)).sum())
        add("gt_partial", ((ga > 1 / 255) & (ga <= 0.99)).sum())
        add("se_alpha_fg", ((pa - ga) ** 2)[fg].sum())
        add("core", core.sum()), add("se_core", se[core].sum()), add("se_core_low", (low ** 2).mean(-1)[core].sum())
        add("bias_inner", diff.mean(-1)[inner].sum())
        which = torch.bucketize(contrast[inner], torch.tensor(CONTRAST_BINS[1:-1], device=contrast.device))
        self.bins[0] += torch.bincount(which, minlength=self.bins.shape[1]).cpu().numpy()
        self.bins[1] += torch.bincount(which, weights=se[inner].double(), minlength=self.bins.shape[1]).cpu().numpy()

    def result(self) -> dict:
        s = self.s
        return {
            "psnr_foreground": psnr(s["se_fg"], s["fg"]),
            "fg_fraction_of_image": s["fg"] / s["pixels"],
            "edge_fraction_of_fg": s["edge"] / s["fg"],
            "error_share_inner": s["se_inner"] / s["se_fg"], "error_share_edge": s["se_edge"] / s["se_fg"],
            "psnr_inner": psnr(s["se_inner"], s["inner"]), "psnr_edge": psnr(s["se_edge"], s["edge"]),
            "psnr_fg_if_edges_perfect": psnr(s["se_inner"], s["fg"]),
            "psnr_fg_if_inner_perfect": psnr(s["se_edge"], s["fg"]),
            "holes_fraction_of_fg": s["holes"] / s["fg"], "spurious_fraction_of_fg": s["spurious"] / s["fg"],
            "gt_partial_fraction_of_fg": s["gt_partial"] / s["fg"],
            "psnr_alpha_fg": psnr(s["se_alpha_fg"], s["fg"]),
            "inner_error_low_share": s["se_core_low"] / max(s["se_core"], 1e-30),
            "inner_bias": s["bias_inner"] / max(s["inner"], 1.0),
            "contrast_bins": list(CONTRAST_BINS[1:-1]),
            "inner_count_share_by_contrast": (self.bins[0] / self.bins[0].sum()).round(4).tolist(),
            "inner_error_share_by_contrast": (self.bins[1] / self.bins[1].sum()).round(4).tolist(),
            "inner_psnr_by_contrast": [round(psnr(e, c), 2) for c, e in self.bins.T],
        }


def polar_degrees(views, ids) -> torch.Tensor:
    """[len(ids)] degrees between each view's direction (its optical axis) and the nearer pole (+-z)."""
    forward_z = views.viewmats[ids, 2, 2].double().abs().clamp(max=1.0)
    return torch.rad2deg(torch.acos(forward_z))


def by_polar(se: list[float], fg: list[float], polar: list[float]) -> dict:
    """The pooled foreground PSNR of the views in each of ``POLAR_BINS``, with their count."""
    out = {}
    for lo, hi in zip(POLAR_BINS[:-1], POLAR_BINS[1:]):
        inside = [i for i, a in enumerate(polar) if lo <= a < hi]
        out[f"{lo:g}-{min(hi, 90):g}"] = {"views": len(inside), "psnr_foreground": round(psnr(
            sum(se[i] for i in inside), sum(fg[i] for i in inside)), 3) if inside else None}
    return out


def rolled(views: Views, degrees: float) -> Views:
    """``views`` turned by ``degrees`` about each camera's optical axis (the same eyes, looking at the same points)."""
    a = math.radians(degrees)
    turn = torch.eye(4, dtype=views.viewmats.dtype, device=views.viewmats.device)
    turn[0, 0], turn[0, 1], turn[1, 0], turn[1, 1] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    return replace(views, viewmats=turn @ views.viewmats)


def evaluated_sets(views, orbit_count: int, per_set: int = 56) -> dict:
    """The held-out sets, and two sets of training views beside them (``train_orbit``: orbit views,
    ``train_close``: close-up training views; ``per_set`` of each, spread over their order), so that the
    gap between what the model was fitted to and what it was not shows."""
    sets = {role: views.ids(role) for role in HELD_OUT}
    train = views.ids("train")
    for name, ids in (("train_orbit", train[train < orbit_count]), ("train_close", train[train >= orbit_count])):
        step = max(1, len(ids) // per_set)
        sets[name] = ids[::step][:per_set]
    return sets


@torch.no_grad()
def take_apart(trainer, scene, comm, cfg, colors, images: Path | None, tag: str, per_set: int = 56) -> dict:
    views, out = scene.views, {}
    black = torch.zeros(3, device=comm.device)
    for role, ids in evaluated_sets(views, cfg.views.count, per_set).items():
        if len(ids) == 0:
            continue
        acc, se, fg = Anatomy(), [], []
        for j, part in enumerate(ids.split(4)):
            pred, info = render_bands(trainer.params, views, part, scene.order, comm, background=black,
                                      colors=colors, backend=cfg.run.backend, **training_blur(cfg))
            rgba, gt = torch.cat([pred, info["alpha"]], -1).float(), scene.gt[part].float()
            acc.add(rgba, gt)
            mask = foreground(rgba[..., 3], gt[..., 3])
            se += (((rgba[..., :3] - gt[..., :3]) ** 2).mean(-1) * mask).sum((1, 2)).tolist()
            fg += mask.sum((1, 2)).tolist()
            if images is not None and j == 0:
                h, w = gt.shape[1] // 4, gt.shape[2] // 4           # the middle half of the view
                a, b = gt[0, h:3 * h, w:3 * w, :3], rgba[0, h:3 * h, w:3 * w, :3]
                write_png(images / f"{tag}_{role}.png", torch.cat([a, b, ((b - a).abs() * 4).clamp(0, 1)], 1).cpu())
        out[role] = acc.result()
        out[role]["by_polar"] = by_polar(se, fg, polar_degrees(views, ids).tolist())
    return out


@torch.no_grad()
def model_stats(trainer, scene, block, cfg) -> dict:
    g = trainer.gaussians()
    scales = torch.exp(g.log_scales)
    inplane = scales.topk(2, dim=1).values                      # a disc's two larger axes
    px = pixel_size(g.means, scene.views, scene.views.train_ids)
    sigma_px = (inplane[:, 0] / px)[torch.isfinite(px)]
    unit, _ = unit_field(block.data, cfg.input.iso)
    samples = BlockSamples(torch.from_numpy(np.ascontiguousarray(unit)).to(g.means.device), origin=block.origin,
                           spacing=block.spacing, start=block.start)
    normal_cos = (samples.normals(g.means) * quat_normals(g.quats)).sum(1).abs()
    thin = scales.min(1).values / inplane[:, 1]
    dist = iso_distance(block, cfg.input.iso, g.means.cpu().numpy()) / float(min(block.spacing))
    q = lambda t, ps=(0.1, 0.5, 0.9): [round(float(v), 4) for v in torch.quantile(  # noqa: E731
        t.float()[torch.randperm(len(t), device=t.device)[:1_000_000]], torch.tensor(ps, device=t.device))]
    opacity = torch.sigmoid(g.opacity_logits)
    return {"gaussians": len(g), "sigma_px_q10_50_90": q(sigma_px), "anisotropy_q10_50_90": q(inplane[:, 1] / inplane[:, 0]),
            "thickness_q10_50_90": q(thin), "opacity_q10_50_90": q(opacity),
            "opacity_above_0.9": float((opacity > 0.9).float().mean()),
            "normal_cos_q10_50_90": q(normal_cos),
            "surface_distance_cells_q50_90_99": [round(float(v), 4) for v in np.quantile(dist[np.isfinite(dist)],
                                                                                         (0.5, 0.9, 0.99))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    volume_arguments(ap)
    ap.add_argument("--images", type=Path, help="write ground truth | render | error PNGs here")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--train-views", type=int, default=56, help="training views taken apart per training set")
    ap.add_argument("--roll", type=float, help="also take the trained model apart on every view turned by this "
                                               "many degrees about its optical axis")
    args = ap.parse_args()
    volume, overrides = base_settings(args)
    cfg = load_config(None, overrides)
    if args.images is not None:
        args.images.mkdir(parents=True, exist_ok=True)
    comm = init_comm(device=args.device)
    try:
        block = whole_block(volume)
        clock = PhaseClock(comm.device)
        torch.manual_seed(cfg.train.seed)
        decomposition = check_input(block, cfg, comm)
        layout = choose_layout(cfg, comm, block, decomposition)
        seeding = seed_shard(block, cfg, comm, None)
        scene = make_scene(block, cfg, comm, decomposition=decomposition, targets=seeding.targets)
        shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
        trainer, scene = make_trainer(shard, scene, layout, block, cfg, share=seeding.share,
                                      iterations=cfg.train.iterations, warm=None)
        result = {"data": Path(args.data).name, "iso": args.iso, "resolution": args.resolution,
                  "settings": args.set, "initial": take_apart(trainer, scene, comm, cfg, trainer.colors,
                                                              args.images, "initial", args.train_views),
                  "initial_model": model_stats(trainer, scene, block, cfg)}
        t0 = time.perf_counter()
        train(trainer, scene, layout, cfg, clock, iterations=cfg.train.iterations, step=0,
              gaussians=len(trainer), show=False)
        result["train_seconds"] = round(time.perf_counter() - t0, 2)
        result["trained"] = take_apart(trainer, scene, comm, cfg, trainer.colors_trained, args.images, "trained",
                                       args.train_views)
        result["trained_model"] = model_stats(trainer, scene, block, cfg)
        if args.roll is not None:
            turned = make_scene(block, cfg, comm, decomposition=decomposition, views=rolled(scene.views, args.roll))
            result["roll_degrees"] = args.roll
            result["trained_rolled"] = take_apart(trainer, turned, comm, cfg, trainer.colors_trained, args.images,
                                                  "rolled", args.train_views)
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        shutdown(comm)


if __name__ == "__main__":
    main()
