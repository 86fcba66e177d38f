"""The standard files' model (``model.ply``, ``model.spz``) of a model that viewers draw otherwise than training did.

Standard 3DGS viewers draw a ``.ply`` with SH colours and a blur of 0.3 px^2, without the antialiased mode; a model
trained so is written as it is (:func:`model_ply`). Otherwise the standard files get an SH model of their own, at
their SH degree (:func:`insitu.training.appearance.standard_degree`):

- a lit model, ``output.ply_light`` fixed (the default): its colours in a fixed key and fill light
  (:data:`insitu.render.lighting.FIXED_LIGHT`), which do not change with the view, baked into band 0
  (:func:`insitu.training.appearance.bake_light`), its opacities made for the viewers' blur (:func:`for_standard_blur`),
  against a ground truth cast again in that light for the views it is refit on and scored on
  (:func:`fixed_light_scene`). No SH degree holds the headlight, whose light moves with the camera: the report's
  viewer relights the lit model itself (``model.lit.spz``).
- a lit model, ``output.ply_light`` headlight: SH colours fitted to its headlit colour over the directions the views
  saw each side of a Gaussian from (:func:`fitted_sh`), against the step's ground truth;
- an SH model keeps its own colours.

That SH model then trains for ``output.ply_refine`` of the step's iterations as a viewer draws it
(:func:`refine_for_viewers`); the trained model itself is unchanged.

``model.spz`` of a model trained antialiased (:func:`insitu.training.appearance.spz_trained`) holds the trained
Gaussians themselves in those colours, unmerged, trained the same share of iterations as the viewers that draw
antialiased (as its header says) draw them: 0.3 px^2 added, each splat's opacity scaled to keep its integral;
else model.ply's model.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from insitu.config import Config
from insitu.groundtruth.scene import Scene, make_scene
from insitu.groundtruth.views import Views
from insitu.render.lighting import FixedLight
from insitu.render.rendering import STANDARD_EPS2D, blur_opacity_factors, quat_scale_to_covar
from insitu.step.evaluation import PLY_ROLES
from insitu.step.layouts import Layout
from insitu.step.loop import check_finite, train_iteration
from insitu.surface.gaussians import Gaussians, drop_bands
from insitu.training.appearance import (ColorModel, bake_light, drawn_otherwise, quat_normals, refits_ply,
                                        spz_trained, standard_degree, standard_light)
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer, footprint_sides, training_blur


class StandardModels(NamedTuple):
    """This rank's shards of the standard files' models (:func:`model_ply`) and the scene their figures are scored
    on.

    ply:   [N] model.ply's model.
    spz:   [M] model.spz's (and model.glb's): the trained Gaussians in model.ply's colours, refit as drawn antialiased
           (:func:`insitu.training.appearance.spz_trained`, with ``output.spz`` or ``output.glb``), else ``ply`` itself.
    scene: their ground truth (the fixed light's, for a lit model in it).
    """

    ply: Gaussians
    spz: Gaussians
    scene: Scene


def model_ply(trained: Gaussians, shard: Gaussians, trainer: Trainer, scene: Scene, layout: Layout,
              cfg: Config) -> StandardModels:
    """This rank's shards of the standard files' models and the scene their figures are scored on; collective over
    every rank of ``layout``. For a model that viewers draw as trained (SH colours and their blur:
    :func:`insitu.training.appearance.drawn_otherwise`): its ``shard`` of the ``trained`` model
    (:meth:`Trainer.gaussians`) and ``scene``. Else an SH model made for them and trained as viewers draw it
    (:func:`refine_for_viewers`): in the fixed light (:func:`insitu.training.appearance.standard_light`), the trained
    colours baked in it (:func:`insitu.training.appearance.bake_light`), the opacities made for the viewers' blur
    (:func:`for_standard_blur`) over the refit's views (:func:`refit_ids`), and the scene cast in that light
    (:func:`fixed_light_scene`); else :func:`fitted_sh` and ``scene``. Either is first merged per cell of
    ``output.ply_merge`` orbit pixels (:func:`merge_cells`, :func:`orbit_pixel`). model.spz's model: the trained
    Gaussians in those colours, not merged (:func:`insitu.training.appearance.spz_trained`), and trained as the
    viewers that draw antialiased draw them (:func:`refine_for_viewers` with ``antialiased``), else model.ply's."""
    if not drawn_otherwise(cfg.train.color_model, cfg.train.eps2d, cfg.train.antialiased):
        return StandardModels(shard, shard, scene)
    light = standard_light(cfg)
    cell = cfg.output.ply_merge * orbit_pixel(scene.views, cfg.views.count)
    if light is None:
        colored = fitted_sh(trained, trainer, scene, layout, cfg)
        fitted = merge_cells(colored, cell)
    else:
        ids = refit_ids(scene.views, cfg, trainer.images_per_step)
        colored = bake_light(trained, light, standard_degree(cfg, trained.sh_degree))
        fitted = for_standard_blur(merge_cells(colored, cell), scene.views, ids, cfg)
        scene = fixed_light_scene(scene, layout, cfg, light, ids)
    fitted = refine_for_viewers(fitted, trainer, scene, layout, cfg)
    check_finite(fitted.tensors(), layout.comm, "in model.ply's SH colours (their fit and refinement)",
                 "check the learning rates (train.lr_*) and output.ply_refine")
    ply = layout.shard(fitted)[0]
    if not (spz_trained(cfg) and (cfg.output.spz or cfg.output.glb)):   # neither model.spz nor model.glb: its
        return StandardModels(ply, ply, scene)                             # model is neither refit nor scored
    spz = refine_for_viewers(colored, trainer, scene, layout, cfg, antialiased=True)
    check_finite(spz.tensors(), layout.comm, "in model.spz's SH colours (their refinement)",
                 "check the learning rates (train.lr_*) and output.ply_refine")
    return StandardModels(ply, layout.shard(spz)[0], scene)


def orbit_pixel(views: Views, count: int) -> float:
    """The width in world units of one pixel at the orbit's centre seen from the orbit: the median, over the
    training views among the first ``count`` of ``views`` (the orbit's), of the camera's distance to the point
    their optical axes meet at (least squares) over its focal length in pixels. The same on every rank; 0 without
    such a view."""
    ids = views.train_ids[views.train_ids < count]
    if len(ids) == 0:
        return 0.0
    viewmats = views.viewmats[ids].double()
    rot, t = viewmats[:, :3, :3], viewmats[:, :3, 3:]
    eyes = -(rot.transpose(1, 2) @ t)[..., 0]
    axes = rot[:, 2]                                        # each camera's optical axis (+z looks forward)
    across = torch.eye(3, dtype=torch.float64, device=axes.device) - axes[:, :, None] * axes[:, None, :]
    centre = torch.linalg.pinv(across.sum(0)) @ (across @ eyes[..., None]).sum(0)
    distance = (eyes - centre[:, 0]).norm(dim=-1)
    return float((distance / views.Ks[ids, 0, 0].double()).median())


def merge_cells(gaussians: Gaussians, cell: float, *, chunk: int = 1 << 22) -> Gaussians:
    """``gaussians`` merged into one Gaussian per cube of side ``cell`` (world units; a grid on the origin) and
    per normal (the rotation's local z axis: the axis it is nearest to, and its sign, so that the two sides of a
    thin sheet stay apart), by their moments: each weighted by its opacity times its area (its two largest scales),
    the merged centre the weighted mean, its covariance the weighted mean of the covariances and the spread of
    the centres, its rotation and scales that covariance's axes (the smallest the normal, on the side of the mean
    normal), its SH colours the weighted mean, its opacity the summed weight over its area (at most 0.995). A
    Gaussian alone in its cell is kept as it is. ``cell`` 0: ``gaussians`` itself. The sums run over ``chunk``
    Gaussians at a time (in float64, about each cell's corner), bounding the memory of large shards.

    Standard viewers draw every Gaussian at least 0.3 px^2 wide without making it fainter: where a trained model
    holds many Gaussians to a pixel, they draw each too wide and too opaque. Merged per about a pixel, fewer and
    wider Gaussians are drawn nearer what the trained model shows, and the files are smaller."""
    n = len(gaussians)
    if cell <= 0 or n == 0:
        return gaussians
    g = gaussians
    with torch.no_grad():
        cells = torch.floor(g.means.double() / cell).long()
        normals = quat_normals(g.quats.float())
        axis = normals.abs().argmax(-1)
        kind = axis * 2 + (normals.gather(1, axis[:, None])[:, 0] < 0).long()     # 6 kinds of normal
        del axis
        lo = cells.min(0).values
        span = cells.max(0).values - lo + 1
        if float(span.double().prod()) * 6 < 2.0 ** 62:          # one int64 key a cell and kind: a fast unique
            flat = (((cells[:, 0] - lo[0]) * span[1] + cells[:, 1] - lo[1]) * span[2] + cells[:, 2] - lo[2]) * 6 + kind
            del cells, kind
            flat, group = torch.unique(flat, return_inverse=True)
            flat = flat // 6
            keys = torch.stack([flat // (span[1] * span[2]), flat // span[2] % span[1], flat % span[2]], 1) + lo
            del flat
        else:
            keys, group = torch.unique(torch.cat([cells, kind[:, None]], 1), dim=0, return_inverse=True)
            del cells, kind
        m = len(keys)
        dd = dict(dtype=torch.float64, device=g.means.device)
        sums = {"w": torch.zeros(m, **dd), "x": torch.zeros(m, 3, **dd), "xx": torch.zeros(m, 3, 3, **dd),
                "n": torch.zeros(m, 3, **dd), "sh0": torch.zeros(m, *g.sh0.shape[1:], **dd),
                "shN": torch.zeros(m, *g.shN.shape[1:], **dd)}
        for lo in range(0, n, chunk):
            part, at = g.select(torch.arange(lo, min(n, lo + chunk), device=g.means.device)), group[lo:lo + chunk]
            scales = torch.exp(part.log_scales.double())
            top = scales.sort(-1, descending=True).values
            w = torch.sigmoid(part.opacity_logits.double()) * top[:, 0] * top[:, 1] + 1e-300
            local = part.means.double() - keys[at, :3].double() * cell               # about the cell's corner
            terms = {"w": w, "x": local, "n": normals[lo:lo + chunk].double(), "sh0": part.sh0.double(),
                     "shN": part.shN.double(),
                     "xx": quat_scale_to_covar(part.quats.double(), scales) + local[:, :, None] * local[:, None, :]}
            for key, term in terms.items():
                sums[key].index_add_(0, at, term if key == "w" else w.view(-1, *[1] * (term.dim() - 1)) * term)
        total = sums.pop("w")
        mean = {key: value / total.view(-1, *[1] * (value.dim() - 1)) for key, value in sums.items()}
        centre = mean["x"]
        variances, axes = eigh3(mean["xx"] - centre[:, :, None] * centre[:, None, :])
        axes, variances = axes.flip(-1), variances.flip(-1).clamp_min(1e-30)       # the smallest axis last: z
        flip = (axes[:, :, 2] * mean["n"]).sum(-1) < 0                              # the normal's side kept
        axes[:, :, 2] = torch.where(flip[:, None], -axes[:, :, 2], axes[:, :, 2])
        det = (axes[:, :, 0] * torch.linalg.cross(axes[:, :, 1], axes[:, :, 2])).sum(-1)
        proper = det < 0                                                            # a rotation, not a reflection
        axes[:, :, 1] = torch.where(proper[:, None], -axes[:, :, 1], axes[:, :, 1])
        merged_scales = variances.sqrt()
        opacity = (total / (merged_scales[:, 0] * merged_scales[:, 1])).clamp(1e-6, 0.995)
        out = Gaussians(centre + keys[:, :3].double() * cell, merged_scales.log(), rotation_to_quat(axes),
                        torch.logit(opacity), mean["sh0"], mean["shN"])
        alone = torch.bincount(group, minlength=m)[group] == 1                      # kept as they are
        out = Gaussians(**{k: v.to(getattr(g, k).dtype).index_copy(0, group[alone], getattr(g, k)[alone])
                           for k, v in out.tensors().items()})
    return out


def eigh3(a: Tensor, *, sweeps: int = 5) -> tuple[Tensor, Tensor]:
    """The eigenvalues ``[N, 3]`` (ascending) and eigenvectors ``[N, 3, 3]`` (columns) of the symmetric ``a:
    [N, 3, 3]``, as ``torch.linalg.eigh``, by cyclic Jacobi rotations in ``sweeps`` sweeps: on CUDA, that call
    asks cuSOLVER's batched solver for a workspace that grows with the batch (349 GiB for a 2.6M-Gaussian model
    merged per cell), where this one needs a few copies of ``a``."""
    a = a.clone()
    v = torch.eye(3, dtype=a.dtype, device=a.device).expand_as(a).clone()
    rows = torch.arange(len(a), device=a.device)
    for _ in range(sweeps):
        for p, q in ((0, 1), (0, 2), (1, 2)):
            apq = a[:, p, q]
            zero = apq == 0
            theta = (a[:, q, q] - a[:, p, p]) / torch.where(zero, 1.0, 2 * apq)
            t = torch.sign(theta) / (theta.abs() + torch.sqrt(theta * theta + 1))
            t = torch.where(zero, 0.0, torch.where(theta == 0, 1.0, t))
            c = torch.rsqrt(t * t + 1)
            s = t * c
            j = torch.eye(3, dtype=a.dtype, device=a.device).repeat(len(a), 1, 1)
            j[:, p, p], j[:, q, q], j[:, p, q], j[:, q, p] = c, c, s, -s
            a = j.mT @ a @ j
            v = v @ j
    values, order = torch.diagonal(a, dim1=1, dim2=2).sort(-1)
    return values, v[rows[:, None], :, order].mT


def rotation_to_quat(rot: Tensor) -> Tensor:
    """``[N, 4]`` unit quaternions (w, x, y, z) of the rotation matrices ``rot: [N, 3, 3]``: of the four forms,
    the one whose leading term is largest (Shepperd's method), for precision."""
    r = rot
    forms = torch.stack([
        torch.stack([1 + r[:, 0, 0] + r[:, 1, 1] + r[:, 2, 2], r[:, 2, 1] - r[:, 1, 2], r[:, 0, 2] - r[:, 2, 0],
                     r[:, 1, 0] - r[:, 0, 1]], -1),
        torch.stack([r[:, 2, 1] - r[:, 1, 2], 1 + r[:, 0, 0] - r[:, 1, 1] - r[:, 2, 2], r[:, 0, 1] + r[:, 1, 0],
                     r[:, 0, 2] + r[:, 2, 0]], -1),
        torch.stack([r[:, 0, 2] - r[:, 2, 0], r[:, 0, 1] + r[:, 1, 0], 1 - r[:, 0, 0] + r[:, 1, 1] - r[:, 2, 2],
                     r[:, 1, 2] + r[:, 2, 1]], -1),
        torch.stack([r[:, 1, 0] - r[:, 0, 1], r[:, 0, 2] + r[:, 2, 0], r[:, 1, 2] + r[:, 2, 1],
                     1 - r[:, 0, 0] - r[:, 1, 1] + r[:, 2, 2]], -1)], 1)              # [N, 4 forms, 4]
    best = torch.diagonal(forms, dim1=1, dim2=2).argmax(-1)
    return torch.nn.functional.normalize(forms[torch.arange(len(r), device=r.device), best], dim=-1)


def refit_ids(views: Views, cfg: Config, batch: int) -> Tensor:
    """The training views of ``views`` that the standard files' model is made for in the fixed light: half
    close-ups, half the orbit's, each half spread evenly over its own; ``output.ply_views`` of them (at least a
    step's ``batch``), or, with fewer close-ups than half of that, every close-up and as many orbit views (only
    orbit views without close-ups). Half and half because the viewers' blur is fixed in pixels: what draws a
    Gaussian best from the orbit draws it worse close up, and the figures count the close-ups as much."""
    train = views.train_ids
    orbit, close = train[train < cfg.views.count], train[train >= cfg.views.count]
    k = max(cfg.output.ply_views, batch)
    n_close = min(k - k // 2, len(close))
    n_orbit = min(len(orbit), k if n_close == 0 else max(n_close, batch - n_close))

    def spread(ids: Tensor, n: int) -> Tensor:
        return ids[(torch.arange(n, device=ids.device) * len(ids)) // max(n, 1)]

    return torch.cat([spread(orbit, n_orbit), spread(close, n_close)])


def for_standard_blur(gaussians: Gaussians, views: Views, ids: Tensor, cfg: Config, *,
                      pairs: int = 1 << 22) -> Gaussians:
    """``gaussians`` (drawn as trained: ``train.eps2d``, ``train.antialiased``) with opacities for standard viewers'
    blur: each Gaussian's optical depth, ``-log(1 - opacity)``, scaled by the median, over the views ``ids`` whose
    image holds its centre, of :func:`insitu.render.rendering.blur_opacity_factors`. Drawn as those viewers draw it,
    a Gaussian narrower than their blur then covers about what it covered, fainter and wider, instead of as
    opaque and wider (which thickens outlines and thin parts, and draws a disc seen edge on, which the
    antialiased blur fades, as an opaque streak); scaling the depth rather than the opacity leaves the Gaussians
    of an opaque surface, which overlap, near opaque. A Gaussian no such view shows keeps its opacity. The refit
    starts from there. ``pairs``: (view, Gaussian) pairs projected at once, bounding memory."""
    ids = torch.as_tensor(ids, device=views.viewmats.device).long()
    n = len(gaussians)
    if n == 0 or len(ids) == 0:
        return gaussians
    viewmats, Ks = views.viewmats[ids], views.Ks[ids]
    chunk = max(1, pairs // len(ids))
    factors = []
    with torch.no_grad():
        for lo in range(0, n, chunk):
            g = gaussians.select(torch.arange(lo, min(n, lo + chunk), device=gaussians.means.device))
            f, inside = blur_opacity_factors(g.means.float(), g.quats.float(), torch.exp(g.log_scales.float()),
                                             viewmats.to(g.means.device, torch.float32),
                                             Ks.to(g.means.device, torch.float32), views.width, views.height,
                                             eps2d=cfg.train.eps2d, antialiased=cfg.train.antialiased)
            median = torch.where(inside, f, torch.full_like(f, float("nan"))).nanmedian(0).values
            factors.append(torch.nan_to_num(median, nan=1.0))
        opacity = torch.sigmoid(gaussians.opacity_logits.float()).clamp(max=1.0 - 1e-6)
        opacity = 1.0 - (1.0 - opacity).pow(torch.cat(factors))
        logits = torch.logit(opacity.clamp(1e-6, 1.0 - 1e-6)).to(gaussians.opacity_logits.dtype)
    return replace(gaussians, opacity_logits=logits)


def fixed_light_scene(scene: Scene, layout: Layout, cfg: Config, light: FixedLight, ids: Tensor) -> Scene:
    """The step's ground truth cast again in ``light``, for the views of ``scene`` that the standard files need, their
    roles kept: with a refit (:func:`insitu.training.appearance.refits_ply`) the training views ``ids``
    (:func:`refit_ids`), and with ``output.ply_metrics`` the held-out views they are scored on
    (:data:`insitu.step.evaluation.PLY_ROLES`); in the layout's form (:meth:`Layout.images`). With neither,
    ``scene`` itself (nothing is cast). Collective over ``layout.comm``."""
    views = scene.views
    parts = [ids] if refits_ply(cfg) else []
    if cfg.output.ply_metrics:
        parts += [views.ids(role) for role in PLY_ROLES]
    ids = torch.cat(parts) if parts else ids[:0]
    if len(ids) == 0:
        return scene
    fixed = make_scene(layout.block, cfg, layout.comm, views=views.subset(ids), light=light)
    return layout.images(fixed)


def fitted_sh(gaussians: Gaussians, trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> Gaussians:
    """The standard files' SH model of the trainer's model ``gaussians`` (its :meth:`Trainer.gaussians`) without the
    fixed light, at their degree (:func:`insitu.training.appearance.standard_degree`), in the trainer's layout: an SH
    model's own bands; a lit model's (``output.ply_light`` headlight) SH colours fitted to each Gaussian's headlit
    colour over the sphere's directions, each side of it weighted by its footprint in the views on that side, of
    ``output.ply_fit_views`` training views of ``scene`` spread over them
    (:func:`insitu.training.trainer.footprint_sides`, :func:`insitu.training.appearance.fit_sh`; 0 views: both sides
    alike). Collective over every rank of the layout."""
    degree = standard_degree(cfg, gaussians.sh_degree)
    if cfg.train.color_model == "sh":
        return drop_bands(gaussians, degree)
    train = scene.views.train_ids
    k = min(cfg.output.ply_fit_views, len(train))
    model = ColorModel(cfg.train.color_model)
    if k == 0:
        return model.as_sh(gaussians, degree)
    ids = train[torch.linspace(0, len(train) - 1, k).round().long().to(train.device)]
    sides = footprint_sides(trainer.params, scene.views, ids, scene.order, layout.train_comm,
                            rows=scene.rows, backend=cfg.run.backend, transfer=cfg.run.transfer,
                            **training_blur(cfg))
    return model.as_sh(gaussians, degree, sides=sides.to(gaussians.means.device))


def refine_for_viewers(fitted: Gaussians, trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, *,
                       antialiased: bool = False) -> Gaussians:
    """Optimiser steps (``output.ply_refine`` times the trainer's iterations) of the SH model ``fitted`` (in the
    trainer's layout) on the training views of ``scene``, drawn as standard 3DGS viewers draw a ``.ply`` (SH colours
    at their full degree, ``STANDARD_EPS2D``; ``antialiased``: as viewers that draw antialiased do): the model.ply
    that such a viewer shows closest to the ground truth. No
    densification, no opacity reset and the positions held (the Gaussians stay those of the trained model,
    where they are); the other learning rates and the image loss as in training; none when neither the standard
    files nor their figures are made. Collective over every rank of the layout (``layout.comm``: the replicas'
    gradients are summed over it)."""
    steps = round(cfg.output.ply_refine * trainer.iteration)
    if steps == 0 or not refits_ply(cfg):
        return fitted
    tc = replace(cfg.train, color_model="sh", eps2d=STANDARD_EPS2D, antialiased=antialiased, iterations=steps,
                 densify=replace(cfg.train.densify, start=10**9, reset_every=0), lr_means=0.0, lr_means_final=0.0,
                 seed=cfg.train.seed + 1)
    plain = replace(cfg, train=tc)
    viewer = Trainer(fitted, tc, extent=trainer.extent, box=trainer.box, max_gaussians=len(fitted),
                     device=trainer.device, total_iterations=steps, sh_degree_start=fitted.sh_degree,
                     replicas=layout.replicas, pixel_size=trainer.pixel_size)
    draws = ViewSampler(scene, replace(tc, batch=viewer.images_per_step))
    for _, (ids, bg) in zip(range(steps), draws):
        train_iteration(viewer, scene, *layout.batch(ids, bg), plain, layout.train_comm)
    return viewer.gaussians()
