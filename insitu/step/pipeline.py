"""One timestep, as data flows: block -> seeds -> shard -> views -> GT bands -> train -> evaluate -> export.

``run_step`` is collective: every rank of ``comm`` calls it with its own block. In the default
layout nothing of the volume or of the Gaussians moves between ranks during training; only images
do (sort-last compositing; :mod:`insitu.step.layouts`). Failures on one rank are agreed at phase
boundaries, so every rank ends with the same clear error instead of waiting in a collective.

:func:`compute_step` reads as the step's phases, each a function of its own: :func:`check_input`,
:func:`insitu.step.compilation.compile_ahead` (the step's GPU kernels, on background threads),
:func:`seed_shard`, :func:`insitu.groundtruth.scene.make_scene`, :func:`init_colors`, :func:`make_trainer`, :func:`train`,
:func:`evaluate_trainer`, the layout's shards, :func:`model_figures` and :func:`step_metrics`; a
:class:`PhaseClock` times them.
"""
from __future__ import annotations

import importlib
import math
import sys
import threading
import time as _time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from insitu.config import Config
from insitu.errors import InputError, SurfaceTooSmall, TrainingDiverged
from insitu.groundtruth.scene import Scene, block_decomposition, global_range, make_scene, view_groups
from insitu.groundtruth.views import HELD_OUT, Views, pixel_size, pixels_per_area
from insitu.input.decomposition import Decomposition
from insitu.parallel.agreement import agree_errors
from insitu.progress import figure, note, progress_bar
from insitu.render.compositing import gather_bands
from insitu.render.rendering import STANDARD_EPS2D, gsplat_import_error, rasterize
from insitu.step.compilation import compile_ahead
from insitu.step.layouts import Layout, choose_layout
from insitu.surface.gaussians import Gaussians, gather_gaussians, rgb_to_sh0
from insitu.surface.seeds import Seeds, extract_seeds, init_gaussians, normal_to_quat_torch
from insitu.training.appearance import BlockSamples, ColorModel, base_colors, drawn_otherwise, refits_ply
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer, colors_from_images, footprint_sides, nonfinite, render_bands
from insitu.volume import Block, Frame, check_field, check_geometry, iso_distance, readable_block, unit_field

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
    ply:       this rank's shard of ``model.ply`` (:func:`ply_shard`; the shard itself for a model that viewers
               draw as trained: SH colours and their blur).
    images:    (name, gt [H, W, 3], pred [H, W, 3]) held-out images to write (rank 0).
    cameras:   the step's views (for the report's viewer).
    frame:     the coordinates the step trained in (:class:`insitu.volume.Frame`), in which ``gaussians``,
               ``model``, ``ply`` and ``cameras`` are: ``frame.gaussians_to_world`` gives world units, as
               ``model.ply`` holds them.
    :func:`write_step` writes the outputs and then drops ``model``, ``ply`` and ``images``.
    """

    gaussians: Gaussians
    metrics: dict = field(default_factory=dict)
    sh_degree: int = 0
    step: int = 0
    time: float = 0.0
    model: Gaussians | None = None
    ply: Gaussians | None = None
    images: list = field(default_factory=list)
    cameras: Views | None = None
    frame: Frame = field(default_factory=Frame)


@dataclass
class PhaseClock:
    """Wall-clock seconds of a step's phases, for metrics.json's ``*_seconds``.

    device:  the step's device. On CUDA a phase ends (:meth:`lap`) once the device has done the
             work queued so far, so that the kernels a phase queued count to it.
    seconds: phase name -> seconds, of the phases ended so far (in order).
    spans:   name -> the seconds of each span timed inside a phase (:meth:`span`), in order.
    """

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)
    spans: dict[str, list[float]] = field(default_factory=dict)
    started: float = field(default_factory=_time.perf_counter)
    mark: float = field(init=False)             # when the current phase began

    def __post_init__(self) -> None:
        self.mark = self.started

    def _now(self, sync: bool) -> float:
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return _time.perf_counter()

    def lap(self, name: str, *, sync: bool = True) -> float:
        """End the current phase as ``name`` (after the device's queued work when ``sync``) and
        begin the next; returns the phase's seconds."""
        now = self._now(sync)
        self.seconds[name] = now - self.mark
        self.mark = now
        return self.seconds[name]

    def elapsed(self) -> float:
        """Seconds since the current phase began (not waiting for the device)."""
        return _time.perf_counter() - self.mark

    def total(self) -> float:
        """Seconds since the clock started (not waiting for the device)."""
        return _time.perf_counter() - self.started

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as one more span ``name``, from when the device has done the work queued
        before it (that is the current phase's); the block ends by reading its results from the
        device, so its end does not wait."""
        start = self._now(True)
        yield
        self.spans.setdefault(name, []).append(_time.perf_counter() - start)


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


_PRELOAD: list[threading.Thread] = []


def importing_metrics() -> bool:
    """Whether :func:`preload_evaluation`'s import is still under way."""
    return any(t.is_alive() for t in _PRELOAD)


def preload_evaluation(device: torch.device | None = None) -> None:
    """Import the evaluation's metrics on a background thread, once per process, then (``device``
    given) score a small pair on it (:func:`insitu.step.metrics.warm_up`: the first scoring of a process
    loads its kernels).

    Importing torchmetrics takes seconds on some machines (9–11 s on the GPU machine, where it imports
    transformers and torchvision); started once a step's seeds are drawn and its ray caster is compiled
    (not beside that compilation), the import runs beside ray casting, which
    queues its groups of views without waiting for the device, so that the host mostly waits for the
    device and the import has the interpreter; the first evaluation then finds the module
    imported (or draws now and scores later, :func:`render_now_score_later`). The import holds Python's
    lock for most of its time, and whatever gives the lock up beside it (a torch call, a wait on the
    device) waits to get it back: started before seeding, it put 0.8–1.0 s on the seeds (their marching
    cubes and device work) and 1.5–2 s on the ray casting; started once the ground truth is cast, beside
    training, it put 9.4 s on training. What a step imports lazily itself
    (gsplat and its densification ops, scipy's k-d tree) is imported first, on the calling thread; the step
    imports nothing else that the metrics' import does, so the two threads do not import the same
    modules at once. A failure on the background thread is ignored: the first evaluation then
    imports, and reports the error, as usual.
    """
    if _PRELOAD or "insitu.step.metrics" in sys.modules:
        return
    import scipy.spatial  # noqa: F401 - the warm start's k-d tree
    if gsplat_import_error() is None:
        import gsplat.strategy.ops  # noqa: F401 - densification's

    def run() -> None:
        try:
            metrics = importlib.import_module("insitu.step.metrics")
            if device is not None:
                with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                    metrics.warm_up(device)
        except Exception:       # noqa: BLE001 - the evaluation imports and scores again and raises there
            pass

    thread = threading.Thread(target=run, name="insitu-preload", daemon=True)
    _PRELOAD.append(thread)
    thread.start()



def training_blur(cfg: Config) -> dict:
    """The rasterizer's pixel filter the step trains and is evaluated with: ``eps2d`` and ``antialiased``
    keyword arguments (:func:`insitu.render.rendering.rasterize`) from ``cfg.train``."""
    return {"eps2d": cfg.train.eps2d, "antialiased": cfg.train.antialiased}


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


@dataclass
class Seeding:
    """This rank's initial shard (:func:`seed_shard`).

    shard:   the Gaussians.
    fresh:   [N] bool, the Gaussians whose colours are still to be set (None: all).
    share:   this rank's part of the whole surface's area, by which it takes its part of the seeds'
             count (and of ``train.max_gaussians`` in sort-last).
    targets: [M, 3] points on the whole surface, the same on every rank (:func:`surface_targets`):
             what the close-up cameras look at.
    """

    shard: Gaussians
    fresh: Tensor | None
    share: float
    targets: np.ndarray


def seed_count(cfg: Config, total_area: float, block: Block) -> int:
    """How many Gaussians the whole surface (``total_area``, world units) starts with: ``seeds.density`` per
    pixel of its area as the orbit's views see it (:func:`insitu.groundtruth.views.pixels_per_area`; one Gaussian per
    marching-cubes vertex would leave a coarse grid's surface at a few thousand Gaussians however large the
    images), at most ``seeds.budget``; with ``seeds.density: 0``, the budget (:func:`seeds_fill` says whether
    as points drawn on the triangles or as marching-cubes vertices)."""
    if cfg.seeds.density <= 0:
        return cfg.seeds.budget
    lo, hi = block.global_box
    wanted = cfg.seeds.density * total_area * pixels_per_area(lo, hi, cfg.views.resolution, cfg.views.fov_deg)
    return int(min(cfg.seeds.budget, max(1, math.ceil(wanted))))


def surface_targets(comm, seeds: Seeds, count: int = 512, seed: int = 0) -> np.ndarray:
    """``[M, 3]`` points on the whole surface (M <= ``count``), the same on every rank and for any number of
    ranks (collective): the seed points whose coordinates hash lowest (:func:`point_hash`), over every rank's
    seeds; a vertex on a seam between blocks, which both blocks hold, counts once. Close-up cameras look at
    them, so the close-up views do not change with the decomposition."""
    keys = point_hash(seeds.points, seed)
    mine = np.argsort(keys, kind="stable")[:count]
    parts = comm.mpi.allgather((keys[mine], np.asarray(seeds.points[mine], np.float64)))
    all_keys = np.concatenate([k for k, _ in parts])
    all_points = np.concatenate([p for _, p in parts]).reshape(-1, 3)
    _, first = np.unique(all_keys, return_index=True)          # sorted by key, one of each
    return all_points[first[:count]]


def point_hash(points: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[M]`` uint64 keys of ``points: [M, 3]``, a function of their coordinates rounded to 1e-3 and of
    ``seed`` alone (a 64-bit integer mix), so the same point gets the same key on any rank."""
    q = np.round(np.asarray(points, np.float64).reshape(-1, 3) * 1000.0).astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        for axis in range(3):
            h = (h ^ q[:, axis]) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    return h


def seeds_fill(cfg: Config) -> bool:
    """Whether seeds are points drawn on the triangles (a density of seeds per pixel, or with ``seeds.density: 0``
    and ``seeds.fill`` the budget's) rather than the marching-cubes vertices: cold and warm starts alike."""
    return cfg.seeds.density > 0 or cfg.seeds.fill


def seed_shard(block: Block, cfg: Config, comm, warm: StepResult | None) -> Seeding:
    """This rank's initial shard: Gaussians seeded on its block's surface, or the previous step's
    shard refit to it (``warm``, :func:`warm_shard`), as many as :func:`seed_count` says; with the lit
    colour model, turned and coloured as the ground truth shades the surface (:func:`lit_seeds`);
    collective."""
    lit = cfg.train.color_model == "lit"
    color_range = global_range(comm, block.fields[cfg.input.color_var]) if cfg.input.color_var else None
    value_range = global_range(comm, block.data)   # every rank's block brought to unit size alike
    with comm.phase("seeds"):
        seeds = extract_seeds(block, cfg.input.iso, value_range=value_range)
    total_area = comm.mpi.allreduce(seeds.total_area)
    check_surface(comm, seeds, total_area, block, cfg, value_range)
    share = seeds.total_area / total_area if total_area > 0 else 0.0
    budget = int(round(seed_count(cfg, total_area, block) * share))
    fresh = None
    with comm.phase("initialise Gaussians"):
        if warm is not None:
            shard, fresh = warm_shard(warm.gaussians, seeds, budget, cfg, block, comm.device, rank=comm.rank)
        else:
            shard = init_gaussians(seeds, budget, color=cfg.views.surface_color, opacity=cfg.seeds.opacity,
                                   thickness=cfg.seeds.thickness, sh_degree=0 if lit else cfg.train.sh_degree,
                                   seed=cfg.train.seed + comm.rank, fill=seeds_fill(cfg), device=comm.device)
        if lit:                                  # normals and base colours: the ground truth's at each seed
            shard, fresh = lit_seeds(shard, block, cfg, color_range, only=fresh), None
    needed = cfg.views.closeups > 0 or cfg.views.held_out > 0
    targets = surface_targets(comm, seeds, seed=cfg.train.seed) if needed else np.zeros((0, 3))
    return Seeding(shard, fresh, share, targets)


MIN_SURFACE_PIXELS = 1.0               # a surface that covers less of a view leaves nothing to train on: a
                                       # model of a Gaussian or two, scored on a few pixels (or on none)


def check_surface(comm, seeds: Seeds, total_area: float, block: Block, cfg: Config,
                  value_range: tuple[float, float]) -> None:
    """SurfaceTooSmall on every rank when the whole isosurface (``total_area``, world units) covers less than
    ``MIN_SURFACE_PIXELS`` of an orbit view: a convex surface's mean projected area is a quarter of its area,
    at :func:`insitu.groundtruth.views.pixels_per_area` pixels a unit of area; collective (its triangles are counted)."""
    lo, hi = block.global_box
    pixels = total_area * pixels_per_area(lo, hi, cfg.views.resolution, cfg.views.fov_deg) / 4
    triangles = comm.mpi.allreduce(len(seeds.faces))
    if pixels >= MIN_SURFACE_PIXELS:
        return
    isos = ", ".join(f"{v:.6g}" for v in cfg.input.iso)
    res = cfg.views.resolution
    raise SurfaceTooSmall(f"the isosurface at iso {isos} has only {triangles} triangle(s), about {pixels:.2g} "
                          f"pixels of a {res}x{res} view: too small to train; the field ranges over "
                          f"[{value_range[0]:.6g}, {value_range[1]:.6g}]: give an iso value whose surface is larger "
                          "(--iso), or a larger --resolution")


def lit_seeds(shard: Gaussians, block: Block, cfg: Config, color_range: tuple[float, float] | None, *,
              only: Tensor | None = None) -> Gaussians:
    """The lit colour model's seeds: each disc turned to the ground truth's normal at its centre and
    given the ground truth's base colour there (:class:`insitu.training.appearance.BlockSamples`,
    :func:`insitu.training.appearance.base_colors`), so that it starts shaded as the surface it stands for.
    ``only``: [N] bool, the Gaussians to set (a warm start's new seeds); default all. Local."""
    if len(shard) == 0:
        return shard
    device = shard.means.device
    unit, _ = unit_field(block.data, cfg.input.iso)
    samples = BlockSamples(torch.from_numpy(np.ascontiguousarray(unit)).to(device), origin=block.origin,
                           spacing=block.spacing, start=block.start)
    pick = torch.ones(len(shard), dtype=torch.bool, device=device) if only is None else only.to(device)
    means = shard.means[pick]
    quats, sh0 = shard.quats.clone(), shard.sh0.clone()
    quats[pick] = normal_to_quat_torch(samples.normals(means)).to(quats.dtype)
    base = base_colors(block, means, color=cfg.views.surface_color, color_field=cfg.input.color_var,
                       color_range=color_range, colormap=cfg.views.colormap)
    sh0[pick] = rgb_to_sh0(base)[:, None, :].to(sh0.dtype)
    return Gaussians(shard.means, shard.log_scales, quats, shard.opacity_logits, sh0, shard.shN)


def warm_shard(warm: Gaussians, seeds: Seeds, budget: int, cfg: Config, block: Block, device, *,
               keep: float = 0.5, near: float | None = None, rank: int = 0) -> tuple[Gaussians, Tensor]:
    """Previous step's shard refit to the new surface: drop Gaussians off it, seed where it is new.

    Returns the shard and ``fresh: [N]`` bool, its new seeds (they get the cold start's colours,
    :func:`init_colors`; the kept Gaussians keep their trained ones).

    keep: in cells; an old Gaussian is kept when the new field puts it within this distance of the
          isosurface (:func:`insitu.volume.iso_distance`). A vertex of the new surface within 1 cell
          (the rule before) kept stale Gaussians: on Gray-Scott L = 32, 30 steps apart, the warm step
          ended 1.8 dB below a cold one, 0.2 dB with this rule.
    near: in cells; a new seed is added where no kept Gaussian lies within this distance of it. None:
          the side of the area each new seed stands for (``sqrt(area / seeds)``), so that where the
          kept Gaussians are sparser than a cold start's seeds the new ones fill in (a fixed cell kept
          seeds by density, several per cell, out of every cell with one kept Gaussian: the Gray-Scott
          L = 128 warm step at 1024^2 started from 200k Gaussians where a cold one seeds 551k).
    rank: this rank's number, for the new seeds' draws (as the cold start's).
    The new seeds are drawn as a cold start draws them (``seeds.density``, or ``seeds.fill`` with a density
    of 0: points on the triangles up to ``budget``; else the vertices).
    """
    from scipy.spatial import cKDTree           # lazy for start-up time (preload_evaluation imports it first)

    fresh = init_gaussians(seeds, budget, color=cfg.views.surface_color, opacity=cfg.seeds.opacity,
                           thickness=cfg.seeds.thickness, sh_degree=warm.sh_degree, seed=cfg.train.seed + rank,
                           fill=seeds_fill(cfg), device=device)
    if len(warm) == 0 or len(seeds) == 0:
        return fresh, torch.ones(len(fresh), dtype=torch.bool, device=device)
    old = warm.to(device)
    cell = float(min(block.spacing))
    off = iso_distance(block, cfg.input.iso, old.means.detach().cpu().numpy()) / cell
    old = old.select(torch.as_tensor(off <= keep, device=device))
    if len(old) == 0:
        return fresh, torch.ones(len(fresh), dtype=torch.bool, device=device)
    reach = near * cell if near is not None else math.sqrt(seeds.total_area / max(len(fresh), 1))
    d_new, _ = cKDTree(old.means.cpu().numpy()).query(fresh.means.cpu().numpy(), distance_upper_bound=reach)
    add = torch.as_tensor(~np.isfinite(d_new), device=device)
    new = fresh.select(add)
    mask = torch.cat([torch.zeros(len(old), dtype=torch.bool, device=device),
                      torch.ones(len(new), dtype=torch.bool, device=device)])
    return Gaussians.cat([old, new]), mask


def init_colors(shard: Gaussians, scene: "Scene", cfg: Config, comm, *, only: Tensor | None = None) -> Gaussians:
    """The SH model's seed colours as ``cfg.seeds.color_init`` says: ``gt`` reads them from
    ``cfg.seeds.color_views`` training views spread over the orbit
    (:func:`insitu.training.trainer.colors_from_images`, collective), ``constant`` keeps ``views.surface_color``.
    ``only``: [N] bool, the Gaussians to colour (a warm start's new seeds); default all. The lit model's
    seeds have their colours from the field already (:func:`lit_seeds`)."""
    if cfg.seeds.color_init == "constant" or cfg.train.color_model == "lit":
        return shard
    train = scene.views.train_ids
    k = min(cfg.seeds.color_views, len(train))
    ids = train[torch.linspace(0, len(train) - 1, k).round().long().to(train.device)] if k else train[:0]
    return colors_from_images(shard, scene.views, ids, scene.order, scene.gt, comm, backend=cfg.train.backend,
                              batch=cfg.train.batch, only=only, **training_blur(cfg))


def make_trainer(shard: Gaussians, scene: Scene, layout: Layout, block: Block, cfg: Config, *, share: float,
                 iterations: int, warm: StepResult | None) -> tuple[Trainer, Scene]:
    """The trainer of the model this rank trains in ``layout``, and the scene it trains on; collective.

    shard: this rank's coloured shard (:func:`init_colors`); ``share``: its part of the surface area.
    The learning rates scale with the whole domain's extent; the means stay within the layout's
    bounds plus two cells; training goes on at the SH degree ``warm`` reached.
    """
    model, scene = layout.prepare(shard, scene)
    device, tc = layout.comm.device, cfg.train
    lo, hi = layout.bounds
    margin = 2.0 * float(min(block.spacing))
    glo, ghi = block.global_box
    trainer = Trainer(model, tc, extent=0.5 * float(np.linalg.norm(ghi - glo)),
                      box=(torch.as_tensor(lo - margin, dtype=torch.float32, device=device),
                           torch.as_tensor(hi + margin, dtype=torch.float32, device=device)),
                      max_gaussians=layout.max_gaussians(tc.max_gaussians, share, len(shard)), device=device,
                      total_iterations=iterations, sh_degree_start=warm.sh_degree if warm is not None else 0,
                      replicas=layout.replicas,
                      pixel_size=lambda means: pixel_size(means, scene.views, scene.views.train_ids))
    return trainer, scene


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


@torch.no_grad()
def evaluate(params: dict, scene: Scene, comm, *, colors: ColorModel, backend: str, keep_images: int = 0,
             ids: list[int] | None = None, drawn: list[Tensor] | None = None, eps2d: float = STANDARD_EPS2D,
             antialiased: bool = False):
    """PSNR/SSIM(/LPIPS), PSNR and SSIM over the covered pixels and PSNR on white of the sort-last
    composite over the views ``ids`` of the scene (default: the held-out views), in groups of views
    (:func:`view_groups`), the model's colours as ``colors`` says; rank 0 also gets (gt, pred) of the
    first ``keep_images``. ``drawn``: those composites drawn before (:func:`composites`), not drawn again.
    ``eps2d``, ``antialiased``: the rasterizer's blur the model was trained with (px^2), and whether it keeps
    each splat's integral (:func:`insitu.render.rendering.rasterize`)."""
    from insitu.step.metrics import QualityAccumulator  # torchmetrics: seconds to import (preload_evaluation)

    acc = QualityAccumulator() if comm.rank == 0 else None
    images = []
    for group, full_pred, full_gt in composites(params, scene, comm, colors=colors, backend=backend, ids=ids,
                                                drawn=drawn, eps2d=eps2d, antialiased=antialiased):
        if comm.rank == 0:
            acc.add_rgba(full_pred, full_gt, scene.background)
            on = lambda x: (x[..., :3] + (1 - x[..., 3:]) * scene.background).clamp(0, 1).cpu()  # noqa: E731
            for j, i in enumerate(group[:max(keep_images - len(images), 0)]):
                images.append((f"view_{i:03d}", on(full_gt[j]), on(full_pred[j])))
    q = acc.result() if comm.rank == 0 else None
    q = comm.mpi.bcast(q, root=0)
    return q, images


def composites(params: dict, scene: Scene, comm, *, colors: ColorModel, backend: str,
               ids: list[int] | None = None, gt: bool = True,
               drawn: list[Tensor] | None = None,
               eps2d: float = STANDARD_EPS2D,
               antialiased: bool = False) -> Iterator[tuple[list[int], Tensor, Tensor]]:
    """The sort-last composites of the views ``ids`` (default: the held-out views) group by group
    (:func:`view_groups`): ``(group, pred [c, H, W, 4] premultiplied, gt [c, H, W, 4])``, the images on
    rank 0 (gathered from the bands; ``gt`` False: None); collective. ``drawn``: rank 0's ``pred`` of
    every group, drawn before (any list on the other ranks): only the ground truth is gathered."""
    black = torch.zeros_like(scene.background)
    views = scene.views
    groups = view_groups(views.test_ids.tolist() if ids is None else list(ids), views.width, views.height)
    for n, group in enumerate(groups):
        chosen = torch.tensor(group, device=comm.device)
        with torch.no_grad():
            if drawn is None:
                pred, info = render_bands(params, views, chosen, scene.order, comm, background=black,
                                          colors=colors, backend=backend, eps2d=eps2d,
                                          antialiased=antialiased)
                full_pred = gather_bands(torch.cat([pred, info["alpha"]], dim=-1).float(), comm)  # premultiplied
            else:
                full_pred = drawn[n].to(comm.device).float() if comm.rank == 0 else None
            full_gt = gather_bands(scene.gt[chosen].float(), comm) if gt else None
        yield group, full_pred, full_gt


def render_now_score_later(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> Callable[[], Quality]:
    """The held-out figures of the trainer's model as it is now, for when torchmetrics is still
    importing (:func:`preload_evaluation`): the composites are drawn now and kept on rank 0's host
    (float16, the ground truth's own precision; ``1/views.test_every`` of the ground truth's
    pixels), and the returned ``score()`` scores them (collective, as :func:`evaluate_trainer`),
    so that training need not wait for the import."""
    colors, backend, blur = trainer.colors, cfg.train.backend, training_blur(cfg)

    def render(comm):
        kept = [pred.half().cpu() for _, pred, _ in
                composites(trainer.params, scene, comm, colors=colors, backend=backend, gt=False, **blur)]
        return None, kept if comm.rank == 0 else []

    _, kept = layout.evaluate(render)
    return lambda: layout.evaluate(lambda comm: evaluate(trainer.params, scene, comm, colors=colors,
                                                         backend=backend, drawn=kept, **blur))[0]


@torch.no_grad()
def model_quality(model: Gaussians | None, scene: Scene, comm, *, backend: str, ids: list[int] | None = None):
    """PSNR and SSIM of the merged model as a splat viewer draws it: all Gaussians in one
    rasterization (one global depth sort, on rank 0) at the SH degree the file holds, the views
    ``ids`` of the scene (default: the held-out views) on ``scene.background``.

    model: the merged model on rank 0 (what ``model.ply`` holds; :func:`insitu.surface.gaussians.gather_gaussians`),
           None on the other ranks. Collective (the ground-truth bands are gathered).
    Returns the Quality on every rank.
    """
    from insitu.step.metrics import QualityAccumulator  # torchmetrics: seconds to import (preload_evaluation)

    acc = QualityAccumulator(lpips=False) if comm.rank == 0 else None
    if comm.rank == 0:
        g = model.to(comm.device)
        colors = torch.cat([g.sh0, g.shN], dim=1)
    views = scene.views
    for group in view_groups(views.test_ids.tolist() if ids is None else list(ids), views.width, views.height):
        chosen = torch.tensor(group, device=comm.device)
        full_gt = gather_bands(scene.gt[chosen].float(), comm)
        if comm.rank == 0:
            rgb, alpha, _ = rasterize(g.means, g.quats, torch.exp(g.log_scales), torch.sigmoid(g.opacity_logits),
                                      colors, views.viewmats[chosen], views.Ks[chosen], views.width,
                                      views.height, sh_degree=g.sh_degree, backend=backend,
                                      eps2d=STANDARD_EPS2D)
            acc.add_rgba(torch.cat([rgb, alpha], dim=-1).float(), full_gt, scene.background)
    return comm.mpi.bcast(acc.result() if comm.rank == 0 else None, root=0)


def evaluate_trainer(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, *, colors: ColorModel,
                     keep_images: int = 0, ids: list[int] | None = None):
    """:func:`evaluate` of the trainer's model with ``colors`` on the views ``ids`` (default: the
    held-out views) as ``layout`` evaluates; collective. Returns the Quality on every rank and rank
    0's ``keep_images`` (name, gt, pred) images."""
    return layout.evaluate(lambda comm: evaluate(trainer.params, scene, comm, colors=colors,
                                                 backend=cfg.train.backend, keep_images=keep_images, ids=ids,
                                                 **training_blur(cfg)))


def closer_figures(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> dict[str, Quality]:
    """The trained model's figures on each held-out set off the orbit (``near2``, ``near3``, ``off``:
    :data:`insitu.groundtruth.views.HELD_OUT`) that the scene has; collective."""
    return {role: evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained,
                                   ids=scene.views.ids(role).tolist())[0]
            for role in HELD_OUT[1:] if len(scene.views.ids(role))}


def model_figures(shard: Gaussians, ply: Gaussians, scene: Scene, layout: Layout,
                  cfg: Config) -> tuple[Gaussians | None, Quality | None]:
    """With ``output.ply_metrics``: the merged model on rank 0 (as trained, for the report's viewer; None
    on the other ranks) and the figures of what ``model.ply`` holds (this rank's shard of it: ``ply``) as
    a viewer draws it (:func:`model_quality`, on every rank); else ``(None, None)``. Collective."""
    if not cfg.output.ply_metrics:
        return None, None
    merged = gather_gaussians(shard.to("cpu"), layout.comm.mpi)
    whole = gather_gaussians(ply.to("cpu"), layout.comm.mpi) if ply is not shard else merged
    quality, _ = layout.evaluate(lambda comm: (model_quality(whole, scene, comm, backend=cfg.train.backend), []))
    return merged, quality


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
                                    rows=scene.rows, backend=cfg.train.backend, transfer=cfg.parallel.transfer,
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
                 densify_from=10**9, opacity_reset_every=0, lr_means=0.0, lr_means_final=0.0,
                 seed=cfg.train.seed + 1)
    plain = replace(cfg, train=tc)
    viewer = Trainer(fitted, tc, extent=trainer.extent, box=trainer.box, max_gaussians=len(fitted),
                     device=trainer.device, total_iterations=steps, sh_degree_start=fitted.sh_degree,
                     replicas=layout.replicas, pixel_size=trainer.pixel_size)
    for _ in train_iterations(viewer, scene, layout, plain, steps):
        pass
    return viewer.gaussians()


def target_reached(q, tc) -> bool:
    """True when a quality target is set and every target that is set is met, on the foreground (the
    covered pixels: a black background would flatter a full-image figure)."""
    if tc.psnr_target is None and tc.ssim_target is None:
        return False
    return ((tc.psnr_target is None or q.psnr_foreground >= tc.psnr_target)
            and (tc.ssim_target is None or q.ssim_foreground >= tc.ssim_target))


def step_metrics(comm, trainer: Trainer, log: Training, q: Quality, qm: Quality | None, clock: PhaseClock, *,
                 step: int, time: float, initial: int, total: int, closer: dict[str, Quality]) -> dict:
    """metrics.json's figures of a trained step, the same on every rank (collective on CUDA: the peak
    memory of the ranks). ``q``: the final evaluation, ``qm``: the model file's figures (or None),
    ``closer``: the held-out sets off the orbit (:func:`closer_figures`), ``initial``, ``total``: the
    whole model's Gaussians before and after training. ``total_seconds`` is read last."""
    seconds, evaluations = clock.seconds, clock.spans["evaluation"]
    metrics = {
        "step": step, "time": time,             # the surface's figures first: what a user looks at
        "psnr_foreground": q.psnr_foreground, "ssim_foreground": q.ssim_foreground,
        **{f"{key}_{role}": getattr(qr, key) for role, qr in closer.items()
           for key in ("psnr_foreground", "ssim_foreground", "psnr")},
        "ply_psnr_foreground": qm and qm.psnr_foreground, "ply_ssim_foreground": qm and qm.ssim_foreground,
        "psnr": q.psnr, "ssim": q.ssim, "psnr_initial": log.initial.psnr, "lpips": q.lpips,
        "psnr_foreground_initial": log.initial.psnr_foreground,
        "ply_psnr": qm and qm.psnr, "ply_ssim": qm and qm.ssim, "psnr_white": q.psnr_white,
        "ranks": comm.size, "device": comm.device.type, "color_model": trainer.cfg.color_model,
        "eps2d": trainer.cfg.eps2d, "antialiased": trainer.cfg.antialiased,
        "test_views": q.views, "iterations": trainer.iteration, "target_reached_at": log.reached,
        "sh_degree": trainer.sh_degree_trained,
        "gaussians_initial": initial, "gaussians": total,
        "seeds_seconds": round(seconds["seeds"] + seconds["colors"], 3),      # the seed colours included
        "ground_truth_seconds": round(seconds["scene"] + seconds["setup"], 3),
        "color_init_seconds": round(seconds["colors"], 3), "scene_seconds": round(seconds["scene"], 3),
        "train_seconds": round(seconds["train"], 3), "ply_fit_seconds": round(seconds["ply fit"], 3),
        "history": log.history,
        "initial_evaluation_seconds": round(evaluations[0], 3),     # both inside train_seconds
        "evaluation_seconds": round(sum(evaluations), 3),
    }
    if comm.device.type == "cuda":
        metrics["peak_gpu_memory_gb"] = comm.mpi.allreduce(torch.cuda.max_memory_allocated(comm.device) / 2**30,
                                                           op=MPI.MAX)
    metrics["total_seconds"] = round(clock.total(), 3)
    return metrics


def run_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0, writer=None,
             warm: StepResult | None = None, iterations: int | None = None) -> StepResult:
    """:func:`compute_step`, then :func:`write_step` with ``writer`` (when given); collective over ``comm``."""
    result = compute_step(block, cfg, comm, step=step, time=time, warm=warm, iterations=iterations)
    if writer is not None:
        write_step(result, writer, cfg, comm)
    return result


def write_step(result: StepResult, writer, cfg: Config, comm) -> None:
    """Write a computed step's outputs (collective): every rank its shard of ``model.ply`` at its
    offset in one file, then rank 0 the rest of the step (:class:`insitu.output.export.StepWriter`)."""
    t_write = _time.perf_counter()
    shard = result.ply if result.ply is not None else result.gaussians
    writer.write_model(result.step, result.frame.gaussians_to_world(shard), comm)
    result.metrics["model_write_seconds"] = round(_time.perf_counter() - t_write, 3)
    with comm.phase("export"):                  # a failed write (disk full...) ends every rank
        if comm.rank == 0:
            writer.write(result.step, result.model, result.images, result.metrics, cfg, cameras=result.cameras,
                         frame=result.frame)
    result.model, result.ply, result.images = None, None, []    # written: a warm start needs only the shard


def compute_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0,
                 warm: StepResult | None = None, iterations: int | None = None) -> StepResult:
    """Train a Gaussian splat model of this step's isosurface(s); collective over ``comm``.
    Writes nothing: the outputs travel in the result (:func:`write_step`).

    warm: the previous step's result on this rank: its shard, refit to this step's surface, is
          trained on from the SH degree it had reached, instead of fresh seeds.
    iterations: training iterations (default ``cfg.train.iterations``).
    The step trains in the block's :class:`insitu.volume.Frame` (its smallest cell side 1, the grid from
    0), whatever the unit of its origin and spacing; the result stays in that frame (``frame``).
    """
    if warm is not None and not isinstance(warm, StepResult):
        raise TypeError(f"warm: expected the previous step's StepResult, got {type(warm).__name__}")
    clock = PhaseClock(comm.device)
    torch.manual_seed(cfg.train.seed + comm.rank)
    show = cfg.train.progress and comm.rank == 0
    iters = iterations if iterations is not None else cfg.train.iterations
    block = readable_block(block)                   # float16, long double, other byte orders: as scipy, torch read
    decomposition = check_input(block, cfg, comm)
    frame = Frame.of(block)
    block = frame.inside(block)
    if warm is not None and warm.frame != frame:     # the grid moved or its cells changed since
        warm = replace(warm, gaussians=warm.frame.reframe(warm.gaussians, frame), frame=frame)
    layout = choose_layout(cfg, comm, block, decomposition)
    ahead = compile_ahead(cfg, comm)                # (started at the run's start, if it was)
    seeding = seed_shard(block, cfg, comm, warm)
    n0 = comm.mpi.allreduce(len(seeding.shard))
    seconds = clock.lap("seeds", sync=False)
    note(f"step {step} seeds: {n0} Gaussians on {comm.size} rank(s) ({seconds:.1f} s)", show)

    def cast_ready() -> None:                       # the views set and the field prepared (beside the compiling)
        ahead.wait("ray caster")
        preload_evaluation(comm.device)             # the metrics import beside the ray casting only

    scene = make_scene(block, cfg, comm, progress=show, decomposition=decomposition, targets=seeding.targets,
                       ready=cast_ready)
    clock.lap("scene")
    shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
    seconds = clock.lap("colors")
    if cfg.seeds.color_init != "constant" and cfg.train.color_model != "lit":
        note(f"step {step} colours from the ground truth ({seconds:.1f} s)", show)
    trainer, scene = make_trainer(shard, scene, layout, block, cfg, share=seeding.share, iterations=iters,
                                  warm=warm)
    del shard, seeding                              # the trainer holds its own copy
    clock.lap("setup")                              # the layout's set-up counts as ground-truth time
    ahead.wait()
    log = train(trainer, scene, layout, cfg, clock, iterations=iters, step=step, gaussians=n0, show=show)
    clock.lap("train")
    q, images = evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained,
                                 keep_images=cfg.output.images)
    closer = closer_figures(trainer, scene, layout, cfg)
    clock.lap("final figures")                      # (not reported: it ends the phase before the fit)
    trained = trainer.gaussians()
    gaussians, total = layout.shard(trained)
    ply = layout.shard(ply_shard(trained, trainer, scene, layout, cfg))[0] \
        if drawn_otherwise(cfg.train.color_model, cfg.train.eps2d, cfg.train.antialiased) else gaussians
    clock.lap("ply fit")
    merged, qm = model_figures(gaussians, ply, scene, layout, cfg)
    metrics = step_metrics(comm, trainer, log, q, qm, clock, step=step, time=time, initial=n0, total=total,
                           closer=closer)
    orbit = scene.views.to("cpu").subset(torch.arange(cfg.views.count))        # the report's cameras
    return StepResult(gaussians, metrics, sh_degree=trainer.sh_degree_trained, step=step, time=time,
                      model=merged, ply=ply, images=images, cameras=orbit, frame=frame)
