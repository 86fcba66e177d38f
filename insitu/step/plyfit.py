"""``model.ply`` of a model that viewers draw otherwise than training did: SH colours, trained as viewers draw.

Standard 3DGS viewers draw a ``.ply`` with SH colours and a blur of 0.3 px^2, without the antialiased mode; a model
trained so is written as it is (:func:`model_ply`). Otherwise a lit model's colours become SH colours fitted to
its lit colour over the directions the views saw each side of a Gaussian from (:func:`ply_shard`; an SH model
keeps its own), and that SH model then trains for ``output.ply_refine`` of the step's iterations as a viewer draws
it (:func:`refine_for_viewers`); the trained model itself is unchanged.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from insitu.config import Config
from insitu.groundtruth.scene import Scene
from insitu.render.rendering import STANDARD_EPS2D
from insitu.step.layouts import Layout
from insitu.step.loop import check_finite, train_iteration
from insitu.surface.gaussians import Gaussians
from insitu.training.appearance import ColorModel, drawn_otherwise, refits_ply
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer, footprint_sides, training_blur


def model_ply(trained: Gaussians, shard: Gaussians, trainer: Trainer, scene: Scene, layout: Layout,
              cfg: Config) -> Gaussians:
    """This rank's shard of ``model.ply``: its ``shard`` of the ``trained`` model (:meth:`Trainer.gaussians`) for a
    model that viewers draw as trained (SH colours and their blur: :func:`insitu.training.appearance.drawn_otherwise`),
    else its shard of :func:`ply_shard`; collective over every rank of ``layout``."""
    if not drawn_otherwise(cfg.train.color_model, cfg.train.eps2d, cfg.train.antialiased):
        return shard
    return layout.shard(ply_shard(trained, trainer, scene, layout, cfg))[0]


def ply_shard(gaussians: Gaussians, trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> Gaussians:
    """What ``model.ply`` holds of the trainer's model ``gaussians`` (its :meth:`Trainer.gaussians`) when
    viewers draw it otherwise than training did (:func:`insitu.training.appearance.drawn_otherwise`), in the trainer's
    layout; collective over every rank of the layout (``layout.comm``).

    A lit model's colours become SH colours of degree ``train.sh_degree`` fitted to each Gaussian's lit colour
    over the sphere's directions, each side of it weighted by its footprint in the views on that side, of
    ``output.ply_fit_views`` training views spread over them (:func:`insitu.training.trainer.footprint_sides`,
    :func:`insitu.training.appearance.fit_sh`; 0 views: both sides alike). Then that SH model trains, for an
    ``output.ply_refine`` share of the step's iterations, as a standard viewer draws it (:func:`refine_for_viewers`)."""
    if cfg.train.color_model == "sh":
        fitted = gaussians
    else:
        train = scene.views.train_ids
        k = min(cfg.output.ply_fit_views, len(train))
        model = ColorModel(cfg.train.color_model)
        if k == 0:
            fitted = model.as_sh(gaussians, cfg.train.sh_degree)
        else:
            ids = train[torch.linspace(0, len(train) - 1, k).round().long().to(train.device)]
            sides = footprint_sides(trainer.params, scene.views, ids, scene.order, layout.train_comm,
                                    rows=scene.rows, backend=cfg.run.backend, transfer=cfg.run.transfer,
                                    **training_blur(cfg))
            fitted = model.as_sh(gaussians, cfg.train.sh_degree, sides=sides.to(gaussians.means.device))
    fitted = refine_for_viewers(fitted, trainer, scene, layout, cfg)
    check_finite(fitted.tensors(), layout.comm, "in model.ply's SH colours (their fit and refinement)",
                 "check the learning rates (train.lr_*) and output.ply_refine")
    return fitted


def refine_for_viewers(fitted: Gaussians, trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> Gaussians:
    """Optimiser steps (``output.ply_refine`` times the trainer's iterations) of the SH model ``fitted`` (in the
    trainer's layout) on the training views, drawn as standard 3DGS viewers draw a ``.ply`` (SH colours at their
    full degree, ``STANDARD_EPS2D``): the model.ply that such a viewer shows closest to the ground truth. No
    densification, no opacity reset and the positions held (the Gaussians stay those of the trained model,
    where they are); the other learning rates and the image loss as in training; none when neither ``model.ply``
    nor its figures are made. Collective over every rank of the layout (``layout.comm``: the replicas' gradients
    are summed over it)."""
    steps = round(cfg.output.ply_refine * trainer.iteration)
    if steps == 0 or not refits_ply(cfg):
        return fitted
    tc = replace(cfg.train, color_model="sh", eps2d=STANDARD_EPS2D, antialiased=False, iterations=steps,
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

