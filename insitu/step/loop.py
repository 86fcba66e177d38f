"""A step's training: the trainer's optimiser steps on the training views, watched.

:func:`train` is the loop, on one screen: the model's figures before training (:func:`initial_figures`), then per
iteration a batch of views (:class:`insitu.training.sampling.ViewSampler`, this rank's of them as the layout says),
one optimiser step on them (:func:`train_iteration`: their ground truth and a render of the shard, given to
:meth:`insitu.training.trainer.Trainer.step`), progress, and every ``train.eval_every`` iterations the held-out
figures, until the quality target is met or the step's time budget is spent (:func:`out_of_time`: every rank
at the same iteration). A model that went non-finite is an error on every rank
(:func:`check_training`), found where the loop waits for the device anyway.
"""
from __future__ import annotations

import math
from collections.abc import Callable
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
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer, nonfinite, render_bands, training_blur

if TYPE_CHECKING:
    from insitu.step.metrics import Quality


@dataclass
class Training:
    """What the training loop leaves (:func:`train`).

    initial:    the figures of the model before the first iteration.
    history:    one row per evaluation (:func:`history_row`), the initial model's first.
    reached:    the iteration at which the quality target was met, or None.
    stopped_by: what ended the training: ``"iterations"`` (all of them done), ``"target"`` (the quality
                target met) or ``"time budget"`` (``train.time_budget_s`` or ``series.step_seconds`` spent).
    """

    initial: Quality
    history: list[dict]
    reached: int | None
    stopped_by: str = "iterations"


def train(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, clock: PhaseClock, *, iterations: int,
          step: int, gaussians: int, show: bool, importing: Callable[[], bool] = importing_metrics,
          budget: float | None = None) -> Training:
    """``iterations`` optimiser steps of ``trainer`` on the training views (collective over ``layout.comm``); the
    held-out views evaluated first (:func:`initial_figures`; ``importing``: whether this rank still imports the
    metrics) and every ``train.eval_every`` iterations, training stopped once the quality target is met or once the
    current phase of ``clock`` (the training's) has lasted ``budget`` seconds (default ``train.time_budget_s``;
    given the same on every rank: :func:`out_of_time`). ``gaussians``: the initial model's; ``show``: progress on
    this rank; ``clock`` times the evaluations (its ``evaluation`` spans).

    Training that diverges raises :class:`insitu.errors.TrainingDiverged` on every rank (:func:`check_training`):
    found where the loop waits for the device anyway (a progress update, an evaluation) and, at the latest,
    once the iterations are done, so that no NaN model is evaluated, written or warm-started from."""
    tc = cfg.train
    budget = tc.time_budget_s if budget is None else budget
    initial = initial_figures(trainer, scene, layout, cfg, clock, step=step, show=show, importing=importing)
    draws = iter(ViewSampler(scene, replace(tc, batch=trainer.images_per_step)))
    show_every = max(10, iterations // 100)     # each update waits for the device and reduces over ranks
    history, reached, stopped_by = [], None, "iterations"
    bar = progress_bar(iterations, f"step {step} train", show)
    try:
        for it in range(iterations):
            ids, bg = layout.batch(*next(draws))                    # this rank's views of the step's batch
            loss = train_iteration(trainer, scene, ids, bg, cfg, layout.train_comm)
            if cfg.run.progress and (it % show_every == 0 or it == iterations - 1):  # every rank: whole-model figures
                value = layout.loss(loss)
                check_training(trainer, layout, iterations, loss=value)     # (NaN Gaussians draw nothing:
                                                                            # the loss alone can stay finite)
                bar.set_postfix(loss=f"{value:.4f}", gaussians=layout.whole(len(trainer)))
            bar.update(1)
            if tc.eval_every and (it + 1) % tc.eval_every == 0 and it + 1 < iterations:
                check_training(trainer, layout, iterations)
                with clock.span("evaluation"):  # the queued iterations are training time, not evaluation
                    q, _ = evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained)
                history.append(history_row(q, it + 1, layout.whole(len(trainer)), clock.elapsed()))
                if target_reached(q, tc):
                    reached, stopped_by = it + 1, "target"
                    break
            if out_of_time(it + 1, iterations, budget, clock, layout.comm):
                stopped_by = "time budget"
                break
        check_training(trainer, layout, iterations)
    finally:
        bar.close()
    q0 = initial()
    return Training(q0, [history_row(q0, 0, gaussians, 0.0)] + history, reached, stopped_by)


BUDGET_EVERY = 10       # iterations between two looks at the time budget: each waits for the device and
                        # reduces one number over the ranks, so a step overruns its budget by at most this many


def out_of_time(done: int, iterations: int, budget: float | None, clock: PhaseClock, comm) -> bool:
    """Whether training stops after ``done`` of ``iterations`` for its time budget: every ``BUDGET_EVERY``
    iterations (never after the last), once the current phase of ``clock`` has lasted ``budget`` seconds on
    some rank of ``comm`` (the ranks' longest, one all-reduce: every rank stops at the same iteration, as
    the compositing needs); collective when it looks. ``budget`` None: never."""
    if budget is None or done % BUDGET_EVERY or done >= iterations:
        return False
    elapsed = clock.elapsed(sync=True)
    if comm.size > 1:
        elapsed = comm.mpi.allreduce(elapsed, op=MPI.MAX)
    return elapsed >= budget


def train_iteration(trainer: Trainer, scene: Scene, ids: Tensor, bg: Tensor, cfg: Config, comm) -> Tensor:
    """One optimiser step of ``trainer`` on views ``ids`` against ``bg`` ([B, 3] or [3]): their ground truth
    (its alpha: the squared error's foreground) and the render of the shard composited over ``comm``, with the
    step's rasterizer (``cfg.train``); collective over ``comm``. Returns this rank's loss."""
    blur = training_blur(cfg)
    render = lambda p: render_bands(p, scene.views, ids, scene.order, comm, background=bg,  # noqa: E731
                                    colors=trainer.colors, backend=cfg.run.backend,
                                    transfer=cfg.run.transfer, **blur)
    gt, gt_alpha = scene.gt_with_alpha(ids, bg)                     # one gather of the batch's views
    if cfg.train.pixel_loss != "l2":                                # no squared error's foreground
        gt_alpha = None
    return trainer.step(render, gt, rows=scene.rows, height=scene.views.height, comm=comm, gt_alpha=gt_alpha)


def initial_figures(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, clock: PhaseClock, *, step: int,
                    show: bool, importing: Callable[[], bool]) -> Callable[[], Quality]:
    """The held-out figures of the trainer's model as it is now, as a function that gives them: scored now, or,
    while some rank still imports the metrics (``importing()``, :func:`insitu.step.evaluation.preload_evaluation`),
    drawn now and scored when the function is called, after training (:func:`render_now_score_later`), so
    that training need not wait for the import; collective, and so is the function. Each is a span
    ``evaluation`` of ``clock``; the figure is shown (``show``) when scored."""
    if layout.comm.mpi.allreduce(importing(), op=MPI.LOR):        # drawn now, scored after training
        with clock.span("evaluation"):
            later = render_now_score_later(trainer, scene, layout, cfg)

        def score() -> Quality:
            with clock.span("evaluation"):
                q = later()
            note(f"step {step} initial model: PSNR {figure(q.psnr_foreground)} dB on the surface", show)
            return q
        return score
    with clock.span("evaluation"):
        q, _ = evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors)
    note(f"step {step} initial model: PSNR {figure(q.psnr_foreground)} dB on the surface "
         f"({clock.spans['evaluation'][0]:.1f} s)", show)
    return lambda: q


def history_row(q: Quality, iteration: int, gaussians: int, seconds: float) -> dict:
    """metrics.json's ``history`` row of an evaluation: the figures ``q`` after ``iteration`` iterations, the whole
    model's ``gaussians`` and the ``seconds`` since training began."""
    return {"iteration": iteration, "psnr": q.psnr, "ssim": q.ssim, "psnr_foreground": q.psnr_foreground,
            "ssim_foreground": q.ssim_foreground, "gaussians": gaussians, "seconds": seconds}


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
