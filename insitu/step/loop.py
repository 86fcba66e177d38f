"""A step's training: the trainer's optimiser steps on the training views, watched.

:func:`train` is the loop: each iteration draws its views (:class:`insitu.training.sampling.ViewSampler`), takes
this rank's of them (the layout's), and makes one optimiser step on them (:func:`train_iteration`:
:meth:`insitu.training.trainer.Trainer.step` against their ground truth); the held-out views are
evaluated before training and every ``train.eval_every`` iterations, training stops once the quality
target is met, and a model that went non-finite is an error on every rank (:func:`check_training`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mpi4py import MPI
from torch import Tensor

from insitu.config import Config
from insitu.errors import TrainingDiverged
from insitu.groundtruth.scene import Scene
from insitu.parallel.agreement import agree_errors
from insitu.progress import figure, note, progress_bar
from insitu.step.clock import PhaseClock
from insitu.step.evaluation import evaluate_trainer, importing_metrics, render_now_score_later, target_reached
from insitu.step.layouts import Layout
from insitu.training.appearance import ColorModel
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer, nonfinite, render_bands, training_blur

if TYPE_CHECKING:
    from insitu.step.metrics import Quality


@dataclass
class Training:
    """What the training loop leaves (:func:`train`).

    initial: the figures of the model before the first iteration.
    history: one row per evaluation: iteration, psnr, ssim, psnr_foreground, ssim_foreground,
             gaussians (of the whole model) and the seconds since training began.
    reached: the iteration at which the quality target was met, or None.
    """

    initial: Quality
    history: list[dict]
    reached: int | None



def train_iteration(trainer: Trainer, scene: Scene, ids: Tensor, bg: Tensor, cfg: Config, comm) -> Tensor:
    """One optimiser step on views ``ids`` against ``bg`` ([B, 3] or [3]); collective. Returns this rank's loss."""
    blur = training_blur(cfg)
    render = lambda p: render_bands(p, scene.views, ids, scene.order, comm, background=bg,  # noqa: E731
                                    colors=trainer.colors, backend=cfg.train.backend,
                                    transfer=cfg.parallel.transfer, **blur)
    gt, gt_alpha = scene.gt_with_alpha(ids, bg)                     # one gather of the batch's views
    if cfg.train.pixel_loss != "l2":                                # no squared error's foreground
        gt_alpha = None
    return trainer.step(render, gt, rows=scene.rows, height=scene.views.height, comm=comm, gt_alpha=gt_alpha)


def train_iterations(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, count: int) -> Iterator[Tensor]:
    """``count`` optimiser steps of ``trainer`` on the training views, drawn by a :class:`ViewSampler` of
    ``cfg.train`` (each step's batch split among the layout's ranks by ``layout.batch``); yields this rank's
    loss after each step (collective over ``layout.comm``; stopping early is the same on every rank)."""
    draws = ViewSampler(scene, replace(cfg.train, batch=trainer.images_per_step))
    for _, (ids, bg) in zip(range(count), draws):
        mine, mine_bg = layout.batch(ids, bg)
        yield train_iteration(trainer, scene, mine, mine_bg, cfg, layout.train_comm)


DIVERGED_SETTINGS = ("check the learning rates (train.lr_*), train.min_scale_px and the views (views.fov_deg, "
                     "views.closeup_factors)")


def check_finite(tensors: dict[str, Tensor], comm, when: str, settings: str = DIVERGED_SETTINGS) -> None:
    """Raise :class:`insitu.errors.TrainingDiverged`, the same on every rank of ``comm``, when some rank's
    ``tensors`` (its shard: a trainer's ``params`` or ``Gaussians.tensors()``) hold NaN or infinite values;
    collective (one wait for the device, one agreement: not for every iteration). ``when`` says where the
    step stood ("after iteration 40 of 1500"), ``settings`` what to check."""
    mine = nonfinite(tensors)
    reports = agree_errors(comm.mpi if comm.size > 1 else None, mine or None)
    bad = [(rank, words) for rank, words in enumerate(reports) if words]
    if not bad:
        return
    words = list(dict.fromkeys(w for _, ws in bad for w in ws))
    ranks = f" on rank(s) {', '.join(str(r) for r, _ in bad)}" if comm.size > 1 else ""
    raise TrainingDiverged(f"training diverged: non-finite Gaussian {', '.join(words)} {when}{ranks}; {settings}")


def check_training(trainer: Trainer, layout: Layout, iterations: int, *, loss: float | None = None) -> None:
    """:func:`check_finite` of the trainer's model as it stands, and of the whole loss ``loss`` (the same on
    every rank: :meth:`Layout.loss`) when given; collective over ``layout.comm``."""
    when = f"after iteration {trainer.iteration} of {iterations}"
    check_finite(trainer.params, layout.comm, when)
    if loss is not None and not math.isfinite(loss):
        raise TrainingDiverged(f"training diverged: the loss is {loss} {when}; {DIVERGED_SETTINGS}")



def train(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, clock: PhaseClock, *, iterations: int,
          step: int, gaussians: int, show: bool) -> Training:
    """``iterations`` optimiser steps of ``trainer`` on the training views (collective); the held-out
    views evaluated first (scored after training while the metrics still import:
    :func:`render_now_score_later`) and every ``train.eval_every`` iterations, training stopped once
    the quality target is met. ``gaussians``: the initial model's; ``show``: progress on this rank.

    Training that diverges raises :class:`insitu.errors.TrainingDiverged` on every rank (:func:`check_training`):
    found where the loop waits for the device anyway (a progress update, an evaluation) and, at the latest,
    once the iterations are done, so that no NaN model is evaluated, written or warm-started from."""
    tc = cfg.train

    def scored(colors: ColorModel):
        with clock.span("evaluation"):          # the queued iterations are training time, not evaluation
            q, _ = evaluate_trainer(trainer, scene, layout, cfg, colors=colors)
        return q

    def row(q, iteration: int, count: int, seconds: float) -> dict:
        return {"iteration": iteration, "psnr": q.psnr, "ssim": q.ssim, "psnr_foreground": q.psnr_foreground,
                "ssim_foreground": q.ssim_foreground, "gaussians": count, "seconds": seconds}

    later = None
    if layout.comm.mpi.allreduce(importing_metrics(), op=MPI.LOR):  # drawn now, scored after training
        with clock.span("evaluation"):
            later = render_now_score_later(trainer, scene, layout, cfg)
    else:
        q0 = scored(trainer.colors)
        note(f"step {step} initial model: PSNR {figure(q0.psnr_foreground)} dB on the surface "
             f"({clock.spans['evaluation'][0]:.1f} s)", show)
    history = []
    bar = progress_bar(iterations, f"step {step} train", show)
    show_every = max(10, iterations // 100)     # each update waits for the device and reduces over ranks
    reached = None
    try:
        for it, loss in enumerate(train_iterations(trainer, scene, layout, cfg, iterations)):
            if tc.progress and (it % show_every == 0 or it == iterations - 1):     # every rank: whole-model figures
                value = layout.loss(loss)
                check_training(trainer, layout, iterations, loss=value)     # (NaN Gaussians draw nothing:
                                                                            # the loss alone can stay finite)
                bar.set_postfix(loss=f"{value:.4f}", gaussians=layout.whole(len(trainer)))
            bar.update(1)
            if tc.eval_every and (it + 1) % tc.eval_every == 0 and it + 1 < iterations:
                check_training(trainer, layout, iterations)
                q = scored(trainer.colors_trained)
                history.append(row(q, it + 1, layout.whole(len(trainer)), clock.elapsed()))
                if target_reached(q, tc):
                    reached = it + 1
                    break
        check_training(trainer, layout, iterations)
    finally:
        bar.close()
    if later is not None:
        with clock.span("evaluation"):
            q0 = later()
        note(f"step {step} initial model: PSNR {figure(q0.psnr_foreground)} dB on the surface", show)
    return Training(q0, [row(q0, 0, gaussians, 0.0)] + history, reached)

