"""A step's initial shard: Gaussians seeded on this rank's part of the isosurface, or the previous step's refit to it.

:func:`seed_shard` extracts the surface (:func:`insitu.surface.seeds.extract_seeds`), refuses one too small to
train (:func:`check_surface`), and either converts it into :func:`seed_count` seeds that already draw it
(:func:`cold_shard`: :func:`insitu.surface.conversion.convert`) or makes the previous step's shard follow the surface
(:func:`warm_shard`, the policy of :mod:`insitu.surface.follow`, its new surface converted); the lit colour model's
seeds are turned and coloured as the ground truth shades the surface (:func:`lit_seeds`). Once the ground truth is cast,
:func:`init_colors` gives the SH model's seeds their colours from it. :func:`surface_targets` are the points the
close-up cameras look at.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from insitu.config import Config
from insitu.errors import SurfaceTooSmall
from insitu.groundtruth.scene import Scene, global_range
from insitu.groundtruth.views import pixels_per_area
from insitu.surface.conversion import IsoField, convert, point_hash
from insitu.surface.follow import SLACK, plan, submesh, uncovered
from insitu.surface.gaussians import Gaussians, rgb_to_sh0
from insitu.surface.seeds import Seeds, extract_seeds, init_gaussians, normal_to_quat_torch
from insitu.training.appearance import BlockSamples, base_colors
from insitu.training.trainer import colors_from_images, training_blur
from insitu.volume import Block


@dataclass
class Seeding:
    """This rank's initial shard (:func:`seed_shard`).

    shard:   the Gaussians.
    fresh:   [N] bool, the Gaussians whose colours are still to be set (None: all).
    share:   this rank's part of the whole surface's area, by which it takes its part of the seeds'
             count (and of ``train.densify.max_gaussians`` in sort-last).
    targets: [M, 3] points on the whole surface, the same on every rank (:func:`surface_targets`):
             what the close-up cameras look at.
    follow:  a warm start's counts on this rank (:class:`Follow`), None for a cold start.
    ceiling: a warm start's most Gaussians over all ranks, the same on every rank: the top of the band its count
             is steered in (:data:`insitu.surface.follow.SLACK` times the count a cold step would end with), past
             which a warm step long enough to densify (past ``train.densify.start``) does not grow; None for a
             cold start (``train.densify.max_gaussians``).
    settled: [N] bool, a warm start's kept Gaussians where the surface did not move (:func:`warm_shard`: their
             opacities learn slower, :class:`insitu.training.trainer.Trainer`), None for a cold start.
    restart: a warm start dropped for one that is more than ``series.cold_above`` new seeds: that share (the
             same on every rank; the start is then cold), else None.
    """

    shard: Gaussians
    fresh: Tensor | None
    share: float
    targets: np.ndarray
    follow: Follow | None = None
    ceiling: int | None = None
    settled: Tensor | None = None
    restart: float | None = None


@dataclass(frozen=True)
class Follow:
    """What a warm start did to the previous step's shard on one rank (:func:`warm_shard`).

    stale:   Gaussians removed because their centre is off the new surface.
    dropped: Gaussians removed although on the surface: faint (below ``train.densify.prune_opacity``), or thinned
             where the kept model was denser than the count steered to.
    new:     seeds added (on new surface, and on the covered surface where the kept model was too thin).
    moved:   kept Gaussians where the surface moved (not settled: their offset from it changed by more than
             ``SETTLED_CELLS``; 0 where the previous offsets are unknown).
    """

    stale: int
    dropped: int
    new: int
    moved: int = 0


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


def seeds_fill(cfg: Config) -> bool:
    """Whether seeds are points drawn on the triangles (a density of seeds per pixel, or with ``seeds.density: 0``
    and ``seeds.fill`` the budget's) rather than the marching-cubes vertices: cold and warm starts alike."""
    return cfg.seeds.density > 0 or cfg.seeds.fill


def model_sh_degree(cfg: Config) -> int:
    """The SH degree of the model a step trains: ``train.sh_degree``, or 0 for the lit colour model (a base
    colour per Gaussian, shaded per view). Seeds are made at it; the kernels compiled ahead are those of it."""
    return 0 if cfg.train.color_model == "lit" else cfg.train.sh_degree


def seed_shard(block: Block, cfg: Config, comm, warm: Gaussians | None, *, growth: float = 1.0,
               offsets: Tensor | None = None) -> Seeding:
    """This rank's initial shard: Gaussians seeded on its block's surface (its share of :func:`seed_count`),
    or ``warm`` (the previous step's shard on this rank) made to follow the surface (:func:`warm_shard`; its
    Gaussians' ``offsets`` from the previous step's surface, when known), its count steered to what a cold
    step would end with: the seeds times ``growth`` (the factor by which a cold step of the series grew its
    seeds); with the lit colour model, turned and coloured as the ground truth shades the surface
    (:func:`lit_seeds`); a warm start more than ``series.cold_above`` new seeds over all ranks is dropped for a
    cold one (``restart``); collective."""
    lit = cfg.train.color_model == "lit"
    color_range = global_range(comm, block.fields[cfg.input.color_var]) if cfg.input.color_var else None
    value_range = global_range(comm, block.data)   # every rank's block brought to unit size alike
    with comm.phase("seeds"):
        seeds = extract_seeds(block, cfg.input.iso, value_range=value_range)
        field = IsoField(block, cfg.input.iso, comm.device, value_range=value_range)
    total_area = comm.mpi.allreduce(seeds.total_area)
    check_surface(comm, seeds, total_area, block, cfg, value_range)
    share = seeds.total_area / total_area if total_area > 0 else 0.0
    count = seed_count(cfg, total_area, block)
    fresh, settled, follow, ceiling, restart = None, None, None, None, None
    with comm.phase("initialise Gaussians"):
        if warm is not None:
            shard, fresh, settled, follow = warm_shard(warm, seeds, cfg, block, field,
                                                       expected=count * share * growth,
                                                       ceiling=int(cfg.train.densify.max_gaussians * share),
                                                       then=offsets)
            ceiling = min(cfg.train.densify.max_gaussians, math.ceil(SLACK * count * growth))
            new, total = comm.mpi.allreduce(np.array([follow.new, len(shard)], np.int64)).tolist()
            if new > cfg.series.cold_above * total:         # moved almost wholly: no better than fresh seeds
                restart, warm, fresh, settled, follow, ceiling = new / total, None, None, None, None, None
        if warm is None:
            shard = cold_shard(seeds, count, total_area, field, cfg, seed=cfg.train.seed + comm.rank)
        if lit:                                  # normals and base colours: the ground truth's at each seed
            shard, fresh = lit_seeds(shard, block, cfg, color_range, field=field, only=fresh), None
    needed = cfg.views.closeups > 0 or cfg.views.held_out > 0
    targets = surface_targets(comm, seeds, seed=cfg.train.seed) if needed else np.zeros((0, 3))
    return Seeding(shard, fresh, share, targets, follow, ceiling, settled, restart)


def cold_shard(seeds: Seeds, count: int, total_area: float, field: IsoField, cfg: Config, *, seed: int) -> Gaussians:
    """A cold start's Gaussians on this rank's part of the surface: with :func:`seeds_fill`, the surface converted
    (:func:`insitu.surface.conversion.convert`) at ``count`` seeds over its whole area ``total_area`` (every rank's,
    so that the surface gets the same seeds on any number of ranks); else discs on its marching-cubes vertices,
    this rank's share of ``count`` (drawn by area with ``seed`` where there are more). On ``field``'s device."""
    if seeds_fill(cfg):         # (the ranks' sums of the area differ in their last bits: the density is rounded)
        return convert(seeds, float(f"{count / total_area:.5g}"), field, **disc_settings(cfg), seed=cfg.train.seed)
    return init_gaussians(seeds, int(round(count * seeds.total_area / total_area)), color=cfg.views.surface_color,
                          opacity=cfg.seeds.opacity, thickness=cfg.seeds.thickness, sh_degree=model_sh_degree(cfg),
                          seed=seed, device=field.volume.device)


def disc_settings(cfg: Config, sh_degree: int | None = None) -> dict:
    """The discs' settings of a conversion (:func:`insitu.surface.conversion.convert`) in ``cfg``, at the model's
    SH degree or ``sh_degree``."""
    return dict(footprint=cfg.seeds.footprint, opacity=cfg.seeds.opacity, thickness=cfg.seeds.thickness,
                color=cfg.views.surface_color, sh_degree=model_sh_degree(cfg) if sh_degree is None else sh_degree)


MIN_SURFACE_PIXELS = 1.0               # a surface that covers less of a view leaves nothing to train on: a
                                       # model of a Gaussian or two, scored on a few pixels (or on none)


def check_surface(comm, seeds: Seeds, total_area: float, block: Block, cfg: Config,
                  value_range: tuple[float, float]) -> None:
    """SurfaceTooSmall on every rank when the whole isosurface (``total_area``, world units) covers less than
    ``MIN_SURFACE_PIXELS`` of an orbit view: a convex surface's mean projected area is a quarter of its area,
    at :func:`insitu.groundtruth.views.pixels_per_area` pixels a unit of area; collective (its triangles are
    counted)."""
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
              field: IsoField | None = None, only: Tensor | None = None) -> Gaussians:
    """The lit colour model's seeds: each disc turned to the ground truth's normal at its centre and
    given the ground truth's base colour there (:class:`insitu.training.appearance.BlockSamples`,
    :func:`insitu.training.appearance.base_colors`), so that it starts shaded as the surface it stands for.
    ``field``: the block's field at unit size (:class:`insitu.surface.conversion.IsoField`, the step's), else made
    here. ``only``: [N] bool, the Gaussians to set (a warm start's new seeds); default all. Local."""
    if len(shard) == 0:
        return shard
    device = shard.means.device
    if field is None:
        field = IsoField(block, cfg.input.iso, device)
    samples = BlockSamples(field.volume.to(device), origin=block.origin, spacing=block.spacing, start=block.start)
    pick = torch.ones(len(shard), dtype=torch.bool, device=device) if only is None else only.to(device)
    means = shard.means[pick]
    quats, sh0 = shard.quats.clone(), shard.sh0.clone()
    quats[pick] = normal_to_quat_torch(samples.normals(means)).to(quats.dtype)
    base = base_colors(block, means, color=cfg.views.surface_color, color_field=cfg.input.color_var,
                       color_range=color_range, colormap=cfg.views.colormap)
    sh0[pick] = rgb_to_sh0(base)[:, None, :].to(sh0.dtype)
    return Gaussians(shard.means, shard.log_scales, quats, shard.opacity_logits, sh0, shard.shN)


SETTLED_CELLS = 0.05    # a kept Gaussian whose offset from the surface changed by more than this (cells) stands where
                        # the surface moved: its opacity learns at the full rate, as a new seed's does


def warm_shard(warm: Gaussians, seeds: Seeds, cfg: Config, block: Block, field: IsoField, *, expected: float,
               ceiling: int | None = None, then: Tensor | None = None) -> tuple[Gaussians, Tensor, Tensor, Follow]:
    """The previous step's shard made to follow the new surface (:func:`insitu.surface.follow.plan`, on
    ``device``): the Gaussians whose centre is off it go (stale: a quarter of a cell off it, and as far beyond
    ``then``, their offsets when their step ended, where known: :func:`insitu.surface.follow.stale`), so do the
    faint ones (an opacity below ``train.densify.prune_opacity``: a warm step shorter than
    ``train.densify.start`` prunes nothing); new surface gets seeds at the kept model's density; the count is
    steered towards ``expected`` (what a cold step would end this rank's surface with) within the factor
    :data:`insitu.surface.follow.SLACK`, at most ``ceiling``, by seeds on the covered surface or by thinning the
    least opaque.

    Returns the shard (the kept Gaussians first), ``fresh: [N]`` bool, its new seeds (they get the cold
    start's colours, :func:`init_colors`; the kept Gaussians keep their trained ones), ``settled: [N]`` bool,
    the kept Gaussians where the surface did not move (their offset from it changed by at most
    ``SETTLED_CELLS`` since ``then``; all kept ones where ``then`` is unknown): their opacities learn slower
    (:class:`insitu.training.trainer.Trainer`), and the counts (:class:`Follow`). The new seeds are converted
    (:func:`insitu.surface.conversion.convert`) on ``field``'s device, as a cold start's.
    """
    device = field.volume.device
    old = warm.to(device)
    p = plan(block, cfg.input.iso, seeds, old.means, old.opacity_logits, expected, ceiling=ceiling, then=then,
             faint=cfg.train.densify.prune_opacity, device=device)
    kept = old.select(p.keep)
    discs = disc_settings(cfg, old.sh_degree)
    parts = [kept]
    if p.budget.new > 0:                        # converted on the new triangles, kept where no kept centre covers
        drawn = convert(submesh(seeds, p.new.cpu().numpy()), p.budget.density, field, **discs, seed=cfg.train.seed + 1)
        parts.append(drawn.select(uncovered(drawn.means, p.projected, p.coverage.radius)))
    if p.budget.extra > 0 and seeds.total_area > 0:     # the kept model too thin: more on the whole surface
        parts.append(convert(seeds, p.budget.extra / seeds.total_area, field, **discs, seed=cfg.train.seed + 2))
    shard = Gaussians.cat(parts)
    fresh = torch.arange(len(shard), device=device) >= len(kept)
    settled = ~fresh
    if then is not None:                        # kept where the surface did not move: settled
        moved = (p.cells - torch.as_tensor(then, device=device)).abs()[p.keep] > SETTLED_CELLS
        settled[:len(kept)] &= ~moved
    return shard, fresh, settled, Follow(stale=int(p.stale.sum()), dropped=p.dropped, new=len(shard) - len(kept),
                                         moved=int((~settled[:len(kept)]).sum()))


def init_colors(shard: Gaussians, scene: Scene, cfg: Config, comm, *, only: Tensor | None = None) -> Gaussians:
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
    return colors_from_images(shard, scene.views, ids, scene.order, scene.gt, comm, backend=cfg.run.backend,
                              batch=cfg.train.batch, only=only, **training_blur(cfg))

