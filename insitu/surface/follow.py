"""A warm step's surface policy: the model follows the surface from one timestep to the next.

Three rules, as functions of the previous step's Gaussians and the new step's field and seeds, local to a
rank (no communication, nothing trained), on the CPU:

* :func:`stale`: the Gaussians whose centre is no longer on the surface go. The field at a centre is known
  (trilinear in the rank's block, ghost layer included); a centre is stale when its first-order distance to
  the nearest isosurface, ``|f - iso| / |grad f|``, is more than ``cells`` cells (:func:`surface_offsets`), or
  when the field cannot say (outside the block's samples, a flat field).
* :func:`coverage`: the new step's seeds on new surface, those that no kept Gaussian covers. The kept
  centres are first moved onto the new surface along the field's gradient (a Gaussian kept half a cell off
  a surface that moved still covers the piece of surface it stands over), then a seed is new when no moved
  centre lies within ``reach`` times the kept model's spacing, ``sqrt(area / kept)``, of it.
* :func:`follow_budget`: how many Gaussians the model holds after the warm start. It is steered towards
  ``expected``, the count a cold step would end the same surface with, within a factor ``slack``: inside
  that band the kept model's own density is carried on (new surface is seeded at it, nothing else
  changes, so a field that stops changing keeps its count); a kept model thinner than the band is topped up
  with seeds on the covered surface too, a denser one thinned (:func:`thinned`: the least opaque go).

:func:`plan` applies the three to one rank's previous shard and new seeds; :func:`submesh` gives the
triangles on the new surface, on which a step draws its new seeds. ``expected`` is the step's to estimate: a
cold step starts from ``seed_count`` seeds (``seeds.density`` per pixel of area, at most ``seeds.budget``; this
rank its share) and densification grows them by a factor its own metrics record (``gaussians`` over
``gaussians_initial``), which a series carries from its last cold step; a warm step, whose
``series.warm_iterations`` are below ``train.densify.start`` by default, does not densify.

Coordinates: ``points`` and ``means`` are in the coordinates of ``block`` (``world = origin + spacing *
index``); with ``frame`` (:class:`insitu.volume.Frame`), they are in that frame's coordinates and ``block``
in world units, as a step holds its Gaussians in ``Frame.of(block)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from insitu.surface.seeds import Seeds
from insitu.volume import Block, Frame

STALE_CELLS = 0.5       # a centre farther off every isosurface than this is stale (the warm start's rule so far)
REACH = 2.0             # a seed within this many of the kept model's spacings of a kept centre is covered: for
                        # centres strewn at random (Poisson) a surface point is left uncovered with probability
                        # exp(-pi REACH^2), 3.5e-6, so an unchanged surface gives no new seeds
SLACK = 1.5             # the kept model's count may stray this factor from a cold step's before it is corrected


def _points(points, name: str = "points") -> np.ndarray:
    """``points`` as a float64 ``[N, 3]`` array (a tensor on any device is copied to the CPU); ValueError."""
    if hasattr(points, "detach"):
        points = points.detach().to("cpu").double().numpy()
    out = np.asarray(points, dtype=np.float64)
    if out.ndim != 2 or out.shape[1] != 3:
        raise ValueError(f"{name}: expected an [N, 3] array of positions, got shape {tuple(out.shape)}")
    return out


def _positive(value: float, name: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return value


@dataclass(frozen=True)
class SurfaceOffsets:
    """Where points lie against the isosurfaces of a block (:func:`surface_offsets`).

    cells:     [N] first-order distance to the nearest isosurface, in cells (the block's smallest side);
               ``inf`` outside the block's samples or where the field's gradient vanishes.
    projected: [N, 3] each point moved along the gradient onto that surface (first order); the point
               itself where ``cells`` is ``inf``.
    """

    cells: np.ndarray
    projected: np.ndarray


def surface_offsets(block: Block, isos, points, *, frame: Frame | None = None) -> SurfaceOffsets:
    """:class:`SurfaceOffsets` of ``points: [N, 3]`` (numpy or a tensor) against the isosurfaces ``isos`` of
    ``block``: the field trilinear in the block's samples (ghost layers included), its gradient the central
    difference of that over half a cell (as :func:`insitu.volume.iso_distance`, of which ``cells`` is the
    distance in cells); ``frame``: ``points`` are in that frame's coordinates, ``block`` in world units."""
    from scipy.ndimage import map_coordinates      # lazy for start-up time, as the warm start's k-d tree

    if frame is not None:
        block = frame.inside(block)
    points = _points(points)
    values = np.atleast_1d(np.asarray(isos, dtype=np.float64)).ravel()
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(f"isos: expected one or more finite iso values, got {isos!r}")
    spacing = np.asarray(block.spacing, dtype=np.float64)
    ijk = (points - np.asarray(block.origin)) / spacing - np.asarray(block.start)     # local (i, j, k)
    nz, ny, nx = block.data.shape
    inside = np.all((ijk >= 0) & (ijk <= np.array([nx - 1, ny - 1, nz - 1])), axis=1)

    def field(offset) -> np.ndarray:
        return map_coordinates(block.data, (ijk + offset)[:, ::-1].T, order=1, mode="nearest", output=np.float64)

    h = 0.5
    grad = np.stack([(field(h * e) - field(-h * e)) / (2 * h * spacing[a]) for a, e in enumerate(np.eye(3))],
                    axis=1)                                     # world units
    big = np.abs(grad).max(axis=1, keepdims=True)               # scaled first: no square under- or overflows
    unit = grad / np.where(big > 0, big, 1.0)
    norm = big[:, 0] * np.linalg.norm(unit, axis=1)
    gap = field(np.zeros(3))[:, None] - values[None, :]         # [N, isos]
    nearest = gap[np.arange(len(gap)), np.argmin(np.abs(gap), axis=1)]
    known = inside & (norm > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(known, nearest / np.where(norm > 0, norm, 1.0), 0.0)              # world distance, signed
        direction = np.where(known[:, None], unit / np.linalg.norm(unit, axis=1, keepdims=True).clip(1e-300), 0.0)
    cells = np.where(known, np.abs(step) / float(spacing.min()), np.inf)
    return SurfaceOffsets(cells, points - step[:, None] * direction)


def stale(block: Block, isos, means, *, cells: float = STALE_CELLS, frame: Frame | None = None) -> np.ndarray:
    """``[N]`` bool: the Gaussians (centres ``means: [N, 3]``) that are no longer on the surface: more than
    ``cells`` cells off every isosurface of ``block``, or where its field cannot place them
    (:func:`surface_offsets`)."""
    cells = _positive(cells, "cells")
    return ~(surface_offsets(block, isos, means, frame=frame).cells <= cells)


def _tree(centres: np.ndarray):
    """A k-d tree of ``centres`` (built unbalanced: faster to build for the one or two queries it serves)."""
    from scipy.spatial import cKDTree           # lazy for start-up time (the step's preload imports it first)

    return cKDTree(centres, balanced_tree=False, compact_nodes=False)


def _beyond(tree, points: np.ndarray, radius: float) -> np.ndarray:
    """[M] bool: the points with no point of ``tree`` within ``radius``."""
    d, _ = tree.query(points, distance_upper_bound=radius, workers=-1)
    return ~np.isfinite(d)


def uncovered(points, centres, radius: float) -> np.ndarray:
    """``[M]`` bool: the ``points: [M, 3]`` with no ``centres: [K, 3]`` within ``radius`` (all of them when
    there are no centres)."""
    points, centres = _points(points), _points(centres, "centres")
    if len(centres) == 0 or len(points) == 0:
        return np.ones(len(points), dtype=bool)
    return _beyond(_tree(centres), points, _positive(radius, "radius"))


def coverage_radius(area: float, kept: int, reach: float = REACH) -> float:
    """How near a kept centre a point must be to count as covered: ``reach`` times the spacing of ``kept``
    Gaussians spread over ``area`` (``inf`` without an area or without Gaussians: nothing then is new)."""
    if kept <= 0 or not area > 0:
        return math.inf
    return reach * math.sqrt(area / kept)


@dataclass(frozen=True)
class Coverage:
    """The new step's seed points against the kept Gaussians (:func:`coverage`).

    new:       [M] bool, the points on new surface (no kept centre within ``radius``).
    radius:    the coverage radius used (world units; ``inf`` with no kept Gaussian: every point is new).
    new_share: the part of the surface's area that is new (by the points' areas), in [0, 1].
    """

    new: np.ndarray
    radius: float
    new_share: float


def coverage(points, areas, centres, *, reach: float = REACH) -> Coverage:
    """Which of the seed ``points: [M, 3]`` (the surface's marching-cubes vertices, each standing for its
    ``areas: [M]``) lie on new surface, given the kept Gaussians' ``centres: [K, 3]`` (moved onto the new
    surface: :attr:`SurfaceOffsets.projected`). The radius is :func:`coverage_radius` of the covered area:
    first taken over the whole area, then over the area left covered by that first answer (where the
    surface grew, the kept Gaussians are denser on what they still cover than over the whole)."""
    points, centres = _points(points), _points(centres, "centres")
    areas = np.asarray(areas, dtype=np.float64).ravel()
    if areas.shape != (len(points),) or not np.all(np.isfinite(areas) & (areas >= 0)):
        raise ValueError(f"areas: expected [M] = [{len(points)}] finite areas >= 0, got shape {areas.shape}")
    reach = _positive(reach, "reach")
    total = float(areas.sum())
    if len(centres) == 0 or total <= 0:
        return Coverage(np.ones(len(points), dtype=bool), math.inf, 1.0 if total > 0 else 0.0)
    tree = _tree(centres)
    new = _beyond(tree, points, coverage_radius(total, len(centres), reach))
    radius = coverage_radius(total - float(areas[new].sum()), len(centres), reach)
    if math.isfinite(radius):
        new = _beyond(tree, points, radius)
    else:                                       # nothing covered on the first pass: all of it is new
        new = np.ones(len(points), dtype=bool)
    return Coverage(new, radius, float(areas[new].sum()) / total)


@dataclass(frozen=True)
class Budget:
    """How many Gaussians a warm start makes of the kept ones (:func:`follow_budget`).

    target:  the Gaussians the model is steered to, over this rank's surface.
    density: ``target`` per unit of area: new seeds are drawn at it.
    new:     seeds to add on the new surface (``target`` times its share of the area).
    extra:   seeds to add on the covered surface (the kept model thinner than ``expected / slack``).
    drop:    kept Gaussians to remove (the kept model denser than ``expected * slack``: :func:`thinned`).
    """

    target: int
    density: float
    new: int
    extra: int
    drop: int


def follow_budget(expected: float, kept: int, new_share: float, area: float, *, slack: float = SLACK,
                  ceiling: int | None = None) -> Budget:
    """The warm start's counts on this rank.

    expected:  the Gaussians a cold step would end this rank's surface with (the step's estimate: the cold
               start's seed count times the growth a cold step's training had; the module's docstring).
    kept:      the previous step's Gaussians that are not stale.
    new_share: the part of the surface's area no kept Gaussian covers (:attr:`Coverage.new_share`).
    area:      the surface's area on this rank.
    slack:     the band ``[expected / slack, expected * slack]`` within which the kept model's own density
               is carried on unchanged.
    ceiling:   at most this many Gaussians (e.g. this rank's share of ``train.densify.max_gaussians``).

    The kept model's density over the whole surface is ``kept / (1 - new_share)``; the target is that,
    clamped to the band (and the ceiling); the new surface gets ``target * new_share`` seeds and the covered
    surface is brought to ``target * (1 - new_share)``, by seeds added there or kept Gaussians dropped.
    """
    expected = float(expected)
    if not (math.isfinite(expected) and expected >= 0):
        raise ValueError(f"expected: expected a finite count >= 0, got {expected!r}")
    if not (isinstance(kept, (int, np.integer)) and kept >= 0):
        raise ValueError(f"kept: expected an integer >= 0, got {kept!r}")
    if not 0.0 <= float(new_share) <= 1.0:
        raise ValueError(f"new_share: expected a share in [0, 1], got {new_share!r}")
    slack = _positive(slack, "slack")
    if slack < 1:
        raise ValueError(f"slack: expected a factor >= 1, got {slack!r}")
    if ceiling is not None and not (isinstance(ceiling, (int, np.integer)) and ceiling >= 0):
        raise ValueError(f"ceiling: expected an integer >= 0 or None, got {ceiling!r}")
    covered = 1.0 - float(new_share)
    carried = kept / covered if kept > 0 and covered > 0 else expected
    target = min(max(carried, expected / slack), expected * slack)
    if ceiling is not None:
        target = min(target, float(ceiling))
    new = int(round(target * float(new_share)))
    on_covered = target * covered               # (= kept inside the band)
    extra = max(0, int(round(on_covered - kept)))
    drop = max(0, int(round(kept - on_covered)))
    target = int(round(target))
    return Budget(target, target / area if area > 0 else 0.0, new, extra, drop)


def thinned(opacity_logits, drop: int) -> np.ndarray:
    """``[N]`` bool, the Gaussians kept when the ``drop`` least opaque of them go (by ``opacity_logits: [N]``,
    numpy or a tensor; ties by position)."""
    if hasattr(opacity_logits, "detach"):
        opacity_logits = opacity_logits.detach().to("cpu").double().numpy()
    logits = np.asarray(opacity_logits, dtype=np.float64).ravel()
    if not (isinstance(drop, (int, np.integer)) and 0 <= drop <= len(logits)):
        raise ValueError(f"drop: expected an integer from 0 to {len(logits)} (the Gaussians), got {drop!r}")
    keep = np.ones(len(logits), dtype=bool)
    if drop:
        keep[np.argsort(logits, kind="stable")[:drop]] = False
    return keep


def submesh(seeds: Seeds, vertices: np.ndarray) -> Seeds:
    """The part of ``seeds``' mesh on the flagged ``vertices: [M]`` (bool): every triangle with a flagged
    corner, with its corners; each vertex's area a third of its triangles' there. A step draws new seeds on
    it (:func:`insitu.surface.seeds.init_gaussians` with ``fill``), only where the surface is new."""
    vertices = np.asarray(vertices, dtype=bool).ravel()
    if vertices.shape != (len(seeds),):
        raise ValueError(f"vertices: expected [M] = [{len(seeds)}] flags, one per seed, got shape {vertices.shape}")
    faces = seeds.faces[vertices[seeds.faces].any(axis=1)] if len(seeds.faces) else seeds.faces
    if len(faces) == 0:
        return Seeds.empty()
    used, index = np.unique(faces, return_inverse=True)
    faces = index.reshape(-1, 3).astype(np.int64)
    points = seeds.points[used]
    tri = points[faces].astype(np.float64)
    tri_area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    areas = np.zeros(len(used))
    np.add.at(areas, faces.ravel(), np.repeat(tri_area / 3.0, 3))
    return Seeds(points, seeds.normals[used], areas.astype(np.float32), faces)


@dataclass(frozen=True)
class FollowPlan:
    """One rank's warm start, decided (:func:`plan`).

    keep:     [N] bool over the previous shard: not stale, and not thinned away.
    new:      [M] bool over the new seeds (vertices): on new surface.
    coverage: the :class:`Coverage` (its radius: how a drawn seed is tested, :func:`uncovered`).
    budget:   the :class:`Budget`.
    projected: [K, 3] the kept centres moved onto the new surface (K = the not-stale ones, before thinning).
    """

    keep: np.ndarray
    new: np.ndarray
    coverage: Coverage
    budget: Budget
    projected: np.ndarray


def plan(block: Block, isos, seeds: Seeds, means, opacity_logits, expected: float, *,
         cells: float = STALE_CELLS, reach: float = REACH, slack: float = SLACK, ceiling: int | None = None,
         frame: Frame | None = None) -> FollowPlan:
    """:func:`stale`, :func:`coverage` and :func:`follow_budget` for one rank: the previous shard's centres
    ``means: [N, 3]`` and ``opacity_logits: [N]``, the new step's ``seeds`` (its marching-cubes vertices, in
    the coordinates of ``means``) and ``expected`` (:func:`follow_budget`)."""
    offsets = surface_offsets(block, isos, means, frame=frame)
    alive = offsets.cells <= _positive(cells, "cells")
    projected = offsets.projected[alive]
    cover = coverage(seeds.points, seeds.areas, projected, reach=reach)
    budget = follow_budget(expected, int(alive.sum()), cover.new_share, seeds.total_area, slack=slack,
                           ceiling=ceiling)
    keep = alive.copy()
    if budget.drop:
        logits = opacity_logits.detach().to("cpu").numpy() if hasattr(opacity_logits, "detach") \
            else np.asarray(opacity_logits)
        keep[np.flatnonzero(alive)[~thinned(logits[alive], budget.drop)]] = False
    return FollowPlan(keep, cover.new, cover, budget, projected)
