"""One timestep, as data flows: block -> seeds -> shard -> views -> GT bands -> train -> evaluate -> export.

``run_step`` is collective: every rank of ``comm`` calls it with its own block. In the default
layout nothing of the volume or of the Gaussians moves between ranks during training; only images
do (sort-last compositing; :mod:`insitu.step.layouts`). Failures on one rank are agreed at phase
boundaries, so every rank ends with the same clear error instead of waiting in a collective.

:func:`compute_step` reads as the step's phases, each a function of its own module: the input checked
(:func:`check_input`), the step's GPU kernels compiled on background threads (:mod:`insitu.step.compilation`),
the seeds (:mod:`insitu.step.seeding`), the views and their ground truth (:func:`insitu.groundtruth.scene.make_scene`),
the seeds' colours, the trainer (:func:`make_trainer`) and its training loop (:mod:`insitu.step.loop`), the held-out
figures (:mod:`insitu.step.evaluation`), ``model.ply``'s fit for viewers (:mod:`insitu.step.plyfit`) and
metrics.json's record (:func:`step_metrics`); a :class:`insitu.step.clock.PhaseClock` times them. What it calls
that a caller may replace comes in a :class:`Collaborators`.
"""
from __future__ import annotations

import time as _time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI

from insitu.config import Config
from insitu.errors import InputError
from insitu.groundtruth.scene import Scene, block_decomposition, global_range, make_scene
from insitu.groundtruth.views import Views, pixel_size
from insitu.input.decomposition import Decomposition
from insitu.progress import note
from insitu.render.lighting import FIXED_LIGHT_VIEW
from insitu.step.clock import PhaseClock
from insitu.step.compilation import Ahead, KernelShapes, compile_ahead
from insitu.step.driver import after_training, follow_iterations, training_budget
from insitu.step.evaluation import (bound_figures, closer_figures, evaluate_trainer, file_metrics,
                                    importing_metrics, model_figures, preload_evaluation, standard_figures)
from insitu.step.layouts import Layout, choose_layout
from insitu.step.loop import BUDGET_EVERY, Training, train
from insitu.step.plyfit import model_ply
from insitu.step.seeding import Follow, init_colors, seed_shard
from insitu.surface.follow import surface_offsets
from insitu.surface.gaussians import Gaussians, gather_gaussians
from insitu.training.appearance import standard_light
from insitu.training.trainer import Trainer
from insitu.volume import Block, Frame, check_field, check_geometry, readable_block

if TYPE_CHECKING:                       # the metrics import torchmetrics: seconds, so only on first use
    from insitu.step.metrics import Quality


@dataclass
class StepResult:
    """What one trained timestep leaves behind (on every rank).

    gaussians: this rank's trained shard (on the training device).
    metrics:   the step's figures (same on every rank).
    sh_degree: the SH degree training had reached (a warm start goes on from it).
    step, time: the simulation's step number and time.
    model:     the merged model on rank 0 (``output.ply_metrics``), else None: for the web copy.
    ply:       this rank's shard of ``model.ply`` (:func:`insitu.step.plyfit.model_ply`: the shard itself for a
               model that viewers draw as trained: SH colours and their blur).
    spz:       this rank's shard of ``model.spz`` where it is not ``ply``'s model (the trained Gaussians drawn
               antialiased: :func:`insitu.training.appearance.spz_trained`), else None.
    spz_whole: with ``spz``, that model gathered on rank 0 (None on the other ranks), once: for its figures and
               its file.
    images:    (name, gt [H, W, 3], pred [H, W, 3]) held-out images to write (rank 0), then those in the standard
               files' fixed light: (name, gt, model.spz's, model.ply's) (:func:`files_light_images`).
    cameras:   the step's views (for the report's viewer).
    frame:     the coordinates the step trained in (:class:`insitu.volume.Frame`), in which ``gaussians``,
               ``model``, ``ply`` and ``cameras`` are: ``frame.gaussians_to_world`` gives world units, as
               ``model.ply`` holds them.
    growth:    the factor by which the series' last cold step grew its seeds in training (its ``gaussians``
               over ``gaussians_initial``; this step's own when it started cold): a warm start from this
               result steers its count to its seeds times it (:func:`insitu.step.seeding.warm_shard`).
    tails:     the metrics of the series' latest step that wrote model files (key True) and of its latest that
               wrote none (False), this one's included: a warm step's time budget leaves what the latest step
               of its own kind took after training (with ``output.every``, only a step with model files fits them).
    warm_chain: the warm starts in a row that end with this step (0: it started cold); a step that would make it
               ``series.cold_every`` starts cold instead (:func:`compute_step`).
    offsets:   [N] each of ``gaussians``' distance (cells) to this step's isosurfaces at the end of the step
               (:func:`insitu.surface.follow.surface_offsets`; with ``series.warm_start``, else None): a warm start
               from this result takes a Gaussian for stale only if the new surface lies farther from it than
               that (:func:`insitu.surface.follow.stale`).
    :func:`write_step` writes the outputs and then drops ``model``, ``ply``, ``spz`` and ``images``.
    """

    gaussians: Gaussians
    metrics: dict = field(default_factory=dict)
    sh_degree: int = 0
    step: int = 0
    time: float = 0.0
    model: Gaussians | None = None
    ply: Gaussians | None = None
    spz: Gaussians | None = None
    spz_whole: Gaussians | None = None
    images: list = field(default_factory=list)
    cameras: Views | None = None
    frame: Frame = field(default_factory=Frame)
    growth: float = 1.0
    offsets: torch.Tensor | None = None
    tails: dict = field(default_factory=dict)
    warm_chain: int = 0


@dataclass(frozen=True)
class Collaborators:
    """What :func:`compute_step` calls that a caller may replace (to watch the step, or to time it); by default
    the real ones (:data:`REAL`).

    compile_ahead:      ``(cfg, comm, shapes=None) -> Ahead``, the step's kernels compiling
                        (:meth:`insitu.step.compilation.Compiler.compile_ahead`).
    make_scene:         the step's views and their ground truth (:func:`insitu.groundtruth.scene.make_scene`).
    preload_evaluation: ``(device)``, the metrics' import started (:func:`insitu.step.evaluation.preload_evaluation`).
    importing_metrics:  ``() -> bool``, whether that import still runs
                        (:func:`insitu.step.evaluation.importing_metrics`).
    trainer:            the trainer's class (:class:`insitu.training.trainer.Trainer`, or one that extends it).
    clock:              ``() -> seconds``, what the step's phases and its time budget are timed by
                        (``time.perf_counter``).
    """

    compile_ahead: Callable[..., Ahead] = compile_ahead
    make_scene: Callable[..., Scene] = make_scene
    preload_evaluation: Callable[[torch.device], None] = preload_evaluation
    importing_metrics: Callable[[], bool] = importing_metrics
    trainer: type[Trainer] = Trainer
    clock: Callable[[], float] = _time.perf_counter


REAL = Collaborators()


def compute_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0,
                 warm: StepResult | None = None, iterations: int | None = None,
                 using: Collaborators = REAL, settle: Callable[[], None] | None = None) -> StepResult:
    """Train a Gaussian splat model of this step's isosurface(s); collective over ``comm``. Writes nothing: the
    outputs travel in the result (:func:`write_step`).

    warm: the previous step's result on this rank: with ``series.warm_start``, its shard, refit to this step's
          surface, is trained on from the SH degree it had reached, instead of the surface converted afresh; in any
          case it sets the step's time budget (``series.step_seconds``) and takes its writing seconds.
          iterations: default ``cfg.train.iterations``; a
          warm step's grow by its start's share of new seeds (:func:`insitu.step.driver.follow_iterations`).
          The step starts cold all the same (fresh seeds, ``cfg.train.iterations``) where ``warm`` ends
          ``series.cold_every - 1`` warm starts in a row (a keyframe: a chain of warm steps drifts under cold
          ones) or where its start would be more than ``series.cold_above`` new seeds; ``warm`` still sets its
          time budget (``series.step_seconds``).
    using: what the step calls that a caller may replace (:class:`Collaborators`).
    settle: called on every rank once the ground truth is cast, before training: waits for the previous step's files
          (``StepWriter.wait``: :func:`run_step`), which were written meanwhile; its failure ends every rank here.
    The step trains in the block's :class:`insitu.volume.Frame` (its smallest cell side 1, the grid from 0),
    whatever the unit of its origin and spacing; the result stays in that frame (``frame``).
    """
    if warm is not None and not isinstance(warm, StepResult):
        raise TypeError(f"warm: expected the previous step's StepResult, got {type(warm).__name__}")
    clock = PhaseClock(comm.device, timer=using.clock)
    torch.manual_seed(cfg.train.seed + comm.rank)
    show = cfg.run.progress and comm.rank == 0
    iters = iterations if iterations is not None else cfg.train.iterations
    block = readable_block(block)                   # float16, long double, other byte orders: as scipy, torch read
    decomposition = check_input(block, cfg, comm)
    previous = warm                                 # the time budget's, a step started cold instead's too
                                                    # (a keyframe's is dropped before it is moved to this frame)
    if warm is not None and not cfg.series.warm_start:
        warm, iters = None, cfg.train.iterations   # the previous step: its time budget and tails, not its model
    if warm is not None and 0 < cfg.series.cold_every <= warm.warm_chain + 1:
        note(f"step {step}: starts cold after {warm.warm_chain} warm step(s) in a row (series.cold_every "
             f"{cfg.series.cold_every}: one step in {cfg.series.cold_every} starts cold)", show)
        warm, iters = None, cfg.train.iterations
    frame = Frame.of(block)
    block, warm = frame.inside(block), in_frame(warm, frame)
    layout = choose_layout(cfg, comm, block, decomposition)
    ahead = using.compile_ahead(cfg, comm)          # the planned shapes (started at the run's start, if it was)
    seeding = seed_shard(block, cfg, comm, warm.gaussians if warm is not None else None,
                         growth=warm.growth if warm is not None else 1.0,
                         offsets=warm.offsets if warm is not None else None)
    n0 = comm.mpi.allreduce(len(seeding.shard))
    follow = follow_counts(comm, seeding.follow)
    restart = seeding.restart
    if restart is not None:
        note(f"step {step}: {restart:.0%} of its warm start is new seeds (series.cold_above "
             f"{cfg.series.cold_above:g}): it starts cold", show)
        warm, iters = None, cfg.train.iterations
    chain = warm.warm_chain + 1 if warm is not None else 0
    if warm is not None:                            # as many more as the start's share of new seeds
        iters = follow_iterations(cfg, iters, follow["gaussians_new"], n0)
    note(f"step {step} seeds: {n0} Gaussians on {comm.size} rank(s) ({clock.lap('seeds', sync=False):.1f} s)", show)

    def cast_ready() -> None:                       # the views set and the field prepared (beside the compiling)
        ahead.wait("ray caster")
        using.preload_evaluation(comm.device)       # the metrics import beside the ray casting only

    scene = using.make_scene(block, cfg, comm, progress=show, decomposition=decomposition,
                             targets=seeding.targets, ready=cast_ready)
    clock.lap("scene")
    shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
    seconds = clock.lap("colors")
    if cfg.seeds.color_init != "constant" and cfg.train.color_model != "lit":
        note(f"step {step} colours from the ground truth ({seconds:.1f} s)", show)
    trainer, scene = make_trainer(shard, scene, layout, block, cfg, share=seeding.share, iterations=iters,
                                  warm=warm, trainer_class=using.trainer, ceiling=seeding.ceiling,
                                  settled=seeding.settled)
    del shard, seeding                              # the trainer holds its own copy
    clock.lap("setup")                              # the layout's set-up counts as ground-truth time
    if settle is not None:
        with comm.phase("export"):                  # the previous step's files (a failed write ends every rank)
            settle()
    clock.lap("writing")                            # waited for them: what they took beyond this step's start
    using.compile_ahead(cfg, comm, KernelShapes.of(scene, layout, trainer)).wait()     # those the step built
    files = cfg.output.writes_models(step)         # this step writes model files (fits them, scores them)
    like = previous.tails.get(files, previous.metrics) if previous is not None else None
    budget = training_budget(cfg, like, clock.total())
    if budget is not None and comm.size > 1:
        budget = comm.mpi.allreduce(budget, op=MPI.MIN)     # every rank stops at the same iteration
    if budget == 0.0 and like is not None and cfg.series.step_seconds is not None:
        note(f"step {step}: series.step_seconds ({cfg.series.step_seconds:g} s) is spent before its training "
             f"({clock.total():.1f} s so far, and {after_training(like):.1f} s after the last step's "
             f"training): it trains {BUDGET_EVERY} iterations; raise it for more", show)
    log = train(trainer, scene, layout, cfg, clock, iterations=iters, step=step, gaussians=n0, show=show,
                importing=using.importing_metrics, budget=budget)
    clock.lap("train")
    q, images = evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained,
                                 keep_images=cfg.output.images)
    closer = closer_figures(trainer, scene, layout, cfg)
    clock.lap("final figures")                      # (not reported: it ends the phase before the fit)
    trained = trainer.gaussians()
    gaussians, total = layout.shard(trained)
    merged, ply, spz, spz_whole, qm, qs, qb, ply_total = None, gaussians, None, None, None, None, None, None
    lit_images: list = []                           # the held-out views in the standard files' fixed light
    if files:                                       # else no model files: neither their fit nor their figures
        standard = model_ply(trained, gaussians, trainer, scene, layout, cfg)
        clock.lap("ply fit")
        ply_images: list | None = [] if standard_light(cfg) is not None else None
        merged, qm = model_figures(gaussians, standard.ply, standard.scene, layout, cfg, kept=ply_images)
        ply, spz = standard.ply, (standard.spz if standard.spz is not standard.ply else None)
        spz_images: list | None = [] if ply_images is not None and spz is not None else None
        if spz is not None:                         # (model.spz is written) gathered once: figures and file
            spz_whole = gather_gaussians(spz.to("cpu"), layout.comm.mpi)
            qs = standard_figures(spz_whole, standard.scene, layout, cfg, antialiased=True, gathered=True,
                                  kept=spz_images) if cfg.output.ply_metrics else None
        if qm is not None:                          # the viewers' bound, on the same ground truth
            qb = bound_figures(merged, standard.scene, layout, cfg, colors=trainer.colors_trained)
            lit_images = files_light_images([name for name, *_ in images], ply_images, spz_images)
        ply_total = comm.mpi.allreduce(len(ply))
    metrics = step_metrics(comm, trainer, log, q, qm, clock, step=step, time=time, initial=n0, total=total,
                           closer=closer, follow=follow, ply_total=ply_total, qs=qs, qb=qb, restart=restart,
                           chain=chain)
    orbit = scene.views.to("cpu").subset(torch.arange(cfg.views.count))        # the report's cameras
    growth = warm.growth if warm is not None else total / max(n0, 1)
    offsets = surface_offsets(block, cfg.input.iso, gaussians.means).cells if cfg.series.warm_start else None
    return StepResult(gaussians, metrics, sh_degree=trainer.sh_degree_trained, step=step, time=time,
                      model=merged, ply=ply, spz=spz, spz_whole=spz_whole,
                      images=images + lit_images, cameras=orbit, frame=frame,
                      growth=growth, offsets=offsets,
                      tails={**(previous.tails if previous is not None else {}), files: metrics},
                      warm_chain=chain)


def files_light_images(names: list[str], ply: list | None, spz: list | None) -> list:
    """The held-out views in the standard files' fixed light, for a user to compare another viewer's picture with:
    ``(NAME_fixed_light, gt, model.spz's, model.ply's)`` per view kept of model.ply's figures (``ply``: its
    ``(name, gt, pred)``, :func:`insitu.step.evaluation.model_quality`), model.spz's drawing (``spz``, as viewers
    that draw antialiased draw it) between them where it holds another model; ``ply`` None: none (the files are
    not lit by the fixed light, and the held-out images show their light already). ``names``: the step's held-out
    images' names (``view_008``: the orbit's view 8), in order: the files' scene holds the same held-out orbit
    views in the same order (:func:`insitu.step.plyfit.fixed_light_scene`), numbered within itself."""
    if not ply:
        return []
    drawn = [pred for _, _, pred in spz or []]
    return [(f"{name}{FIXED_LIGHT_VIEW}", gt, *drawn[k:k + 1], pred)
            for k, (name, (_, gt, pred)) in enumerate(zip(names, ply))]


def in_frame(warm: StepResult | None, frame: Frame) -> StepResult | None:
    """The previous step's result ``warm`` with its shard in this step's ``frame`` (the grid may have moved or its
    cells changed since); None for a cold start."""
    if warm is None or warm.frame == frame:
        return warm
    offsets = None if warm.offsets is None else warm.offsets * (warm.frame.scale / frame.scale)   # in its cells
    return replace(warm, gaussians=warm.frame.reframe(warm.gaussians, frame), frame=frame, offsets=offsets)


def run_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0, writer=None,
             warm: StepResult | None = None, iterations: int | None = None,
             using: Collaborators = REAL) -> StepResult:
    """:func:`compute_step`, then :func:`write_step` with ``writer`` (when given); collective over ``comm``."""
    def settle() -> None:                       # the previous step's files: its writing seconds, for the budget
        seconds = writer.wait()
        if seconds is not None and warm is not None:
            warm.metrics["export_seconds"] = seconds

    overlap = writer is not None and getattr(writer, "overlap", False)
    result = compute_step(block, cfg, comm, step=step, time=time, warm=warm, iterations=iterations, using=using,
                          settle=settle if overlap else None)
    if writer is not None:
        write_step(result, writer, cfg, comm)
    return result


def write_step(result: StepResult, writer, cfg: Config, comm) -> None:
    """Write a computed step's outputs (collective): every rank its shard of ``model.ply`` at its
    offset in one file, then rank 0 the rest of the step (:class:`insitu.output.export.StepWriter`); with the
    writer's ``overlap``, on the writer's thread, while the caller goes on (the next step waits for it before
    training: :func:`run_step`; the caller's last step: ``writer.wait()``). ``export_seconds``, what rank 0's part
    took, joins rank 0's metrics once written (with ``overlap``, when the next step has waited for it): the next
    step's budget (:func:`insitu.step.driver.training_budget`)."""
    t_write = _time.perf_counter()
    shard = result.ply if result.ply is not None else result.gaussians
    writer.write_model(result.step, shard, comm, frame=result.frame, spz=result.spz, spz_whole=result.spz_whole)
    result.metrics["model_write_seconds"] = round(_time.perf_counter() - t_write, 3)
    model, images = result.model, result.images

    def rest() -> float:
        t_export = _time.perf_counter()
        writer.write(result.step, model, images, result.metrics, cfg, cameras=result.cameras, frame=result.frame)
        return round(_time.perf_counter() - t_export, 3)

    if getattr(writer, "overlap", False):
        if comm.rank == 0:
            writer.later(rest)                  # its seconds join the metrics when the next step waits for it
    else:
        with comm.phase("export"):              # a failed write (disk full...) ends every rank
            if comm.rank == 0:
                result.metrics["export_seconds"] = rest()
    result.model, result.ply, result.spz, result.spz_whole = None, None, None, None   # a warm start needs the shard
    result.images = []


def check_iso(comm, block: Block, iso: list[float]) -> tuple[float, float]:
    """The field's global range, after checking that every iso value makes a surface: a sample equal
    to an iso value counts as above it, so an iso value in ``(min, max]`` does."""
    vmin, vmax = global_range(comm, block.data)
    for v in iso:
        if not vmin < v <= vmax:
            raise InputError(f"iso value {v:.10g} is outside the field's range ({vmin:.10g}, {vmax:.10g}]: "
                             f"no surface to extract (a sample equal to the iso value counts as above it)")
    return vmin, vmax


def check_input(block: Block, cfg: Config, comm) -> Decomposition:
    """Refuse unusable input before any work, with the same InputError on every rank; collective.

    Checks the grid's origin and spacing (:func:`insitu.volume.check_geometry`), the field (NaN,
    infinities) and the colour field, the ranks' blocks (a gap, an overlap, a non-Cartesian layout:
    :func:`insitu.groundtruth.scene.block_decomposition`) and that every iso value makes a surface
    (:func:`check_iso`). Returns the ranks' decomposition.
    """
    with comm.phase("input check"):              # local checks only: no collective inside a phase
        check_geometry(block.origin, block.spacing, block.global_shape)
        check_field(block.data, cfg.input.var, offset=block.start)
        if cfg.input.color_var is not None:
            if cfg.input.color_var not in block.fields:
                raise InputError(f"colour field {cfg.input.color_var!r} not given; fields present: "
                                 f"{', '.join(sorted(block.fields)) or 'none'}")
            check_field(block.fields[cfg.input.color_var], cfg.input.color_var, offset=block.start)
    decomposition = block_decomposition(comm, block)    # a gap or an overlap: an InputError on every rank
    check_iso(comm, block, cfg.input.iso)           # same verdict on every rank
    return decomposition


def make_trainer(shard: Gaussians, scene: Scene, layout: Layout, block: Block, cfg: Config, *, share: float,
                 iterations: int, warm: StepResult | None, trainer_class: type[Trainer] = Trainer,
                 ceiling: int | None = None, settled: torch.Tensor | None = None) -> tuple[Trainer, Scene]:
    """The trainer of the model this rank trains in ``layout``, and the scene it trains on; collective.

    shard: this rank's coloured shard (:func:`init_colors`); ``share``: its part of the surface area.
    The learning rates scale with the whole domain's extent; the means stay within the layout's
    bounds plus two cells; densification grows the whole model to ``train.densify.max_gaussians`` at most, or to
    ``ceiling`` (a warm start's: :attr:`insitu.step.seeding.Seeding.ceiling`). After a warm start training goes
    on at the SH degree ``warm`` reached, and its ``iterations`` are the first of a cold step's means' schedule
    (a schedule over the warm iterations alone would cut the rate a hundredfold within them: the new surface's
    seeds, and the kept Gaussians on a surface that moved, would settle before they got there).
    ``settled``: [N] bool over ``shard``, the Gaussians a warm start kept: their opacities learn at a tenth of
    the rate (:class:`insitu.training.trainer.Trainer`).
    ``trainer_class``: the trainer's class (:class:`insitu.training.trainer.Trainer`, or a caller's that extends
    it).
    """
    model, scene = layout.prepare(shard, scene)
    device, tc = layout.comm.device, cfg.train
    cap = layout.max_gaussians(min(tc.densify.max_gaussians, ceiling or tc.densify.max_gaussians), share, len(shard))
    lo, hi = layout.bounds
    margin = 2.0 * float(min(block.spacing))
    glo, ghi = block.global_box
    schedule = max(iterations, tc.iterations) if warm is not None else None
    trainer = trainer_class(model, tc, extent=0.5 * float(np.linalg.norm(ghi - glo)),
                            box=(torch.as_tensor(lo - margin, dtype=torch.float32, device=device),
                                 torch.as_tensor(hi + margin, dtype=torch.float32, device=device)),
                            max_gaussians=cap, device=device, total_iterations=iterations, schedule=schedule,
                            settled=layout.rows(settled) if settled is not None else None,
                            sh_degree_start=warm.sh_degree if warm is not None else 0,
                            replicas=layout.replicas,
                            pixel_size=lambda means: pixel_size(means, scene.views, scene.views.train_ids))
    return trainer, scene


def follow_counts(comm, follow: Follow | None) -> dict:
    """metrics.json's counts of a warm start (:class:`insitu.step.seeding.Follow`), summed over the ranks:
    ``gaussians_stale`` (removed, off the new surface), ``gaussians_dropped`` (removed on it: faint or
    thinned), ``gaussians_new`` (seeds added) and ``gaussians_moved`` (kept where the surface moved); None each
    for a cold start (the same on every rank); collective."""
    keys = ("gaussians_stale", "gaussians_dropped", "gaussians_new", "gaussians_moved")
    if follow is None:
        return dict.fromkeys(keys)
    counts = np.array([follow.stale, follow.dropped, follow.new, follow.moved], np.int64)
    return dict(zip(keys, comm.mpi.allreduce(counts).tolist()))


def step_metrics(comm, trainer: Trainer, log: Training, q: Quality, qm: dict[str, Quality] | None,
                 clock: PhaseClock, *, step: int, time: float, initial: int, total: int,
                 closer: dict[str, Quality], follow: dict | None = None, ply_total: int | None = None,
                 qs: dict[str, Quality] | None = None, qb: dict[str, Quality] | None = None,
                 restart: float | None = None, chain: int = 0) -> dict:
    """metrics.json's figures of a trained step, the same on every rank (collective on CUDA: the peak
    memory of the ranks). ``q``: the final evaluation, ``qm``: the model files' (:func:`model_figures`, or None),
    ``qs``: model.spz's where it holds another model (:func:`standard_figures`; None: no ``spz_*`` figures),
    ``qb``: the standard files' bound (:func:`insitu.step.evaluation.bound_figures`; None: no ``bound_*`` figures),
    ``closer``: the held-out sets off the orbit (:func:`closer_figures`), ``initial``, ``total``: the
    whole model's Gaussians before and after training, ``ply_total``: the standard files' model's
    (:func:`insitu.step.plyfit.model_ply`), ``follow``: a warm start's counts (:func:`follow_counts`),
    ``restart``: a dropped warm start's share of new seeds (``cold_restart``), ``chain``: the warm starts in a row
    that end with this step (``warm_chain``, 0: it started cold). ``total_seconds`` is read last."""
    seconds, evaluations = clock.seconds, clock.spans["evaluation"]
    metrics = {
        "step": step, "time": time,             # the surface's figures first: what a user looks at
        "psnr_foreground": q.psnr_foreground, "ssim_foreground": q.ssim_foreground,
        **{f"{key}_{role}": getattr(qr, key) for role, qr in closer.items()
           for key in ("psnr_foreground", "ssim_foreground", "psnr")},
        **file_metrics(qm), **(file_metrics(qs, "spz") if qs is not None else {}),
        **(file_metrics(qb, "bound") if qb is not None else {}),
        "psnr": q.psnr, "ssim": q.ssim, "psnr_initial": log.initial.psnr, "lpips": q.lpips,
        "psnr_foreground_initial": log.initial.psnr_foreground,
        "psnr_white": q.psnr_white,
        "ranks": comm.size, "device": comm.device.type, "color_model": trainer.cfg.color_model,
        "eps2d": trainer.cfg.eps2d, "antialiased": trainer.cfg.antialiased,
        "test_views": q.views, "iterations": trainer.iteration, "target_reached_at": log.reached,
        "stopped_by": log.stopped_by, "cold_restart": None if restart is None else round(restart, 4),
        "warm_chain": chain,
        "sh_degree": trainer.sh_degree_trained,
        "gaussians_initial": initial, "gaussians": total, "ply_gaussians": ply_total,
        **(follow or follow_counts(comm, None)),
        "seeds_seconds": round(seconds["seeds"] + seconds["colors"], 3),      # the seed colours included
        "ground_truth_seconds": round(seconds["scene"] + seconds["setup"], 3),
        "color_init_seconds": round(seconds["colors"], 3), "scene_seconds": round(seconds["scene"], 3),
        "train_seconds": round(seconds["train"], 3), "ply_fit_seconds": round(seconds.get("ply fit", 0.0), 3),
        "writing_wait_seconds": round(seconds["writing"], 3),      # for the previous step's files, before training
        "history": log.history,
        "initial_evaluation_seconds": round(evaluations[0], 3),     # both inside train_seconds
        "evaluation_seconds": round(sum(evaluations), 3),
    }
    if comm.device.type == "cuda":
        metrics["peak_gpu_memory_gb"] = comm.mpi.allreduce(torch.cuda.max_memory_allocated(comm.device) / 2**30,
                                                           op=MPI.MAX)
    metrics["total_seconds"] = round(clock.total(), 3)
    return metrics
