"""A warm step's surface policy: the model follows the surface from one timestep to the next.

Three rules, as functions of the previous step's Gaussians and the new step's field and seeds, local to a
rank (no communication, nothing trained), in torch on the device the Gaussians are on:

* :func:`stale`: the Gaussians whose centre is no longer on the surface go. The field at a centre is known
  (trilinear in the rank's block, ghost layer included); a centre is stale when its first-order distance to
  the nearest isosurface, ``|f - iso| / |grad f|``, is more than ``cells`` cells (:func:`surface_offsets`), or
  when the field cannot say (outside the block's samples, a flat field).
* :func:`coverage`: the new step's seeds on new surface, those that no kept Gaussian covers. The kept
  centres are first moved onto the new surface along the field's gradient (a Gaussian kept off a surface
  that moved still covers the piece of surface it stands over), then a seed is new when no moved centre lies
  within ``reach`` times the kept model's spacing, ``sqrt(area / kept)``, of it, and so is the band beside
  such seeds that no moved centre lies within one spacing of.
* :func:`follow_budget`: how many Gaussians the model holds after the warm start. It is steered towards
  ``expected``, the count a cold step would end the same surface with, within a factor ``slack`` (1.25): inside
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
import torch
import torch.nn.functional as F
from torch import Tensor

from insitu.surface.seeds import Seeds
from insitu.volume import Block, Frame, unit_field

STALE_CELLS = 0.25      # a centre farther off every isosurface than this, and farther than this beyond where its
                        # step left it, is stale: a quarter of a cell is a pixel or two of the views a step trains
                        # on, and a kept Gaussian so far off shows worse than a new seed on the surface does
REACH = 2.0             # a seed within this many of the kept model's spacings of a kept centre is covered: for
                        # centres strewn at random (Poisson) a surface point is left uncovered with probability
                        # exp(-pi REACH^2), 3.5e-6, so an unchanged surface gives no new seeds
SLACK = 1.25            # the kept model's count may stray this factor from the estimate of a cold step's before it is
                        # corrected: the estimate (seeds times a cold step's growth) is itself some percent off, and
                        # a step's count is to stay within 1.5 times a cold step's


def _points(points, name: str = "points", device=None) -> Tensor:
    """``points`` as a float32 ``[N, 3]`` tensor: a tensor stays on its device (or goes to ``device``), an
    array goes to ``device`` (default the CPU); ValueError."""
    if not isinstance(points, Tensor):
        points = torch.as_tensor(np.asarray(points, dtype=np.float32))
    if points.ndim != 2 or points.shape[1] != 3:
        raise ValueError(f"{name}: expected an [N, 3] array of positions, got shape {tuple(points.shape)}")
    return points.detach().to(device=device, dtype=torch.float32)


def _device(points, device=None) -> torch.device:
    """Where the work on ``points`` runs: ``device``, else a tensor's own device, else the CPU."""
    if device is not None:
        return torch.device(device)
    return points.device if isinstance(points, Tensor) else torch.device("cpu")


def _positive(value: float, name: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return value


@dataclass(frozen=True)
class SurfaceOffsets:
    """Where points lie against the isosurfaces of a block (:func:`surface_offsets`), on the points' device.

    cells:     [N] first-order distance to the nearest isosurface, in cells (the block's smallest side);
               ``inf`` outside the block's samples or where the field's gradient vanishes.
    projected: [N, 3] each point moved along the gradient onto that surface (first order); the point
               itself where ``cells`` is ``inf``.
    """

    cells: Tensor
    projected: Tensor


def surface_offsets(block: Block, isos, points, *, frame: Frame | None = None, device=None) -> SurfaceOffsets:
    """:class:`SurfaceOffsets` of ``points: [N, 3]`` (numpy or a tensor) against the isosurfaces ``isos`` of
    ``block``: the field trilinear in the block's samples (ghost layers included, the nearest sample beyond
    them), its gradient the central difference of that over half a cell (as :func:`insitu.volume.iso_distance`,
    of which ``cells`` is the distance in cells); ``frame``: ``points`` are in that frame's coordinates, ``block``
    in world units. Computed on ``device`` (default: the points' own), in float32 on the field brought to unit
    size (:func:`insitu.volume.unit_field`: any magnitude, the same distances), the trilinear samples by
    ``grid_sample``: a few milliseconds for millions of points on a GPU."""
    if frame is not None:
        block = frame.inside(block)
    device = _device(points, device)
    points = _points(points, device=device)
    values = np.atleast_1d(np.asarray(isos, dtype=np.float64)).ravel()
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(f"isos: expected one or more finite iso values, got {isos!r}")
    unit, unit_isos = unit_field(block.data, values)
    volume = torch.from_numpy(np.ascontiguousarray(unit, dtype=np.float32)).to(device)[None, None]
    levels = torch.tensor(unit_isos, dtype=torch.float32, device=device)
    spacing64 = np.asarray(block.spacing, dtype=np.float64)
    spacing = torch.as_tensor(spacing64, dtype=torch.float32, device=device)
    offset = torch.as_tensor(np.asarray(block.origin, np.float64) + np.asarray(block.start) * spacing64,
                             dtype=torch.float64, device=device)
    ijk = ((points.double() - offset) / torch.as_tensor(spacing64, device=device)).float()   # local (i, j, k)
    nz, ny, nx = block.data.shape
    top = torch.tensor([nx - 1, ny - 1, nz - 1], dtype=torch.float32, device=device)
    inside = ((ijk >= 0) & (ijk <= top)).all(dim=1)
    scale = top.clamp(min=1.0)

    def field(q: Tensor) -> Tensor:             # trilinear, clamped to the samples (scipy's mode "nearest")
        g = (q.clamp(min=0.0).minimum(top) / scale) * 2.0 - 1.0
        return F.grid_sample(volume, g.reshape(1, 1, 1, -1, 3), mode="bilinear", padding_mode="border",
                             align_corners=True).reshape(-1)

    h = 0.5
    grad = torch.empty_like(points)
    for a in range(3):                          # world units
        e = torch.zeros(3, device=device)
        e[a] = h
        grad[:, a] = (field(ijk + e) - field(ijk - e)) / (2 * h * spacing[a])
    norm = grad.norm(dim=1)
    gap = field(ijk)[:, None] - levels[None, :]                     # [N, isos]
    nearest = gap.gather(1, gap.abs().argmin(dim=1, keepdim=True))[:, 0]
    known = inside & (norm > 0) & torch.isfinite(norm)
    safe = torch.where(known, norm, torch.ones_like(norm))
    step = torch.where(known, nearest / safe, torch.zeros_like(norm))                  # world distance, signed
    direction = torch.where(known[:, None], grad / safe[:, None], torch.zeros_like(grad))
    cells = torch.where(known, step.abs() / float(spacing64.min()), torch.full_like(step, math.inf))
    return SurfaceOffsets(cells, points - step[:, None] * direction)


def stale(block: Block, isos, means, *, cells: float = STALE_CELLS, then=None, frame: Frame | None = None,
          device=None) -> Tensor:
    """``[N]`` bool: the Gaussians (centres ``means: [N, 3]``) that are no longer on the surface: more than
    ``cells`` cells off every isosurface of ``block``, or where its field cannot place them
    (:func:`surface_offsets`). ``then: [N]``: each Gaussian's offset (cells) when its step ended (the same
    function on that step's field): a Gaussian up to ``3 * cells`` off is stale only if it is also more than
    ``cells`` farther off than that, so that what training left off the first-order surface (thin features,
    sharp edges, seeds still settling after a short warm step) stays where the field did not change; none
    farther off stays."""
    offsets = surface_offsets(block, isos, means, frame=frame, device=device)
    return _stale(offsets.cells, cells, then)


def _stale(now: Tensor, cells: float, then) -> Tensor:
    """:func:`stale` of the offsets ``now: [N]`` (cells)."""
    cells = _positive(cells, "cells")
    off = ~(now <= cells)
    if then is None:
        return off
    then = torch.as_tensor(then, dtype=now.dtype).to(now.device).reshape(-1)
    if then.shape != now.shape:
        raise ValueError(f"then: expected [N] = [{len(now)}] offsets, one per Gaussian, got shape {tuple(then.shape)}")
    return off & ~(now <= then.clamp(max=2 * cells) + cells)


CHUNK = 1 << 22         # candidate pairs (point, centre) measured at once


class CellIndex:
    """Centres binned in cubic cells, to ask which points have a centre within ``radius``: the cells' side is
    ``radius / sqrt(3)``, so a point whose own cell holds a centre is within reach of it, and the rest are
    measured against the centres of the cells around (2 cells each way). All torch, on the centres' device
    (a voxel grid: sort, then binary searches), where a k-d tree is CPU-bound."""

    def __init__(self, centres: Tensor, radius: float) -> None:
        self.centres, self.radius = centres, float(radius)
        lo, hi = centres.min(dim=0).values.double(), centres.max(dim=0).values.double()
        cell = self.radius / math.sqrt(3.0)
        extent = float((hi - lo).max())
        cell = max(cell, extent / 2**19)            # at most 2^19 cells a side: the keys fit int64
        self.exact = cell * math.sqrt(3.0) <= self.radius * (1 + 1e-6)     # a shared cell is within reach
        self.cell, self.lo = cell, lo
        self.span = math.ceil(self.radius / cell)
        self.dims = ((hi - lo) / cell).floor().long() + 1 + 2 * self.span      # room for every neighbour
        keys = self._keys(self._cells(centres))
        self.keys, self.order = torch.sort(keys)

    def _cells(self, points: Tensor) -> Tensor:
        """[M, 3] int64 cell of each point, shifted by ``span`` (a neighbour's index stays >= 0)."""
        return ((points.double() - self.lo) / self.cell).floor().long() + self.span

    def _keys(self, cells: Tensor) -> Tensor:
        return (cells[:, 0] * self.dims[1] + cells[:, 1]) * self.dims[2] + cells[:, 2]

    def covered(self, points: Tensor) -> Tensor:
        """[M] bool: the points with a centre within ``radius``."""
        out = torch.zeros(len(points), dtype=torch.bool, device=points.device)
        if len(points) == 0:
            return out
        cells = self._cells(points)
        far = ((cells < 0) | (cells >= self.dims)).any(dim=1)          # beyond every centre's reach
        todo = torch.nonzero(~far)[:, 0]
        if self.exact:                          # most points on a covered surface: their own cell holds one
            key = self._keys(cells[todo])
            pos = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)
            hit = self.keys[pos] == key
            out[todo[hit]] = True
            todo = todo[~hit]
        r = self.span
        steps = torch.stack(torch.meshgrid(*(torch.arange(-r, r + 1, device=points.device),) * 3,
                                           indexing="ij"), dim=-1).reshape(-1, 3)
        if self.exact:
            steps = steps[steps.any(dim=1)]
        ring = steps.abs().amax(dim=1)
        for shell in range(1, r + 1):           # the nearer cells first: most points are found there
            todo = todo[~out[todo]]
            self._search(points, cells, todo, steps[(ring <= shell) & (ring >= (shell if shell > 1 else 0))], out)
        return out

    def _search(self, points: Tensor, cells: Tensor, todo: Tensor, steps: Tensor, out: Tensor) -> None:
        """Set ``out`` for the points ``todo`` with a centre within reach in the cells ``steps: [S, 3]`` from
        their own."""
        for part in torch.split(todo, max(1, CHUNK // max(len(steps), 1))):
            # every (point, neighbouring cell) whose nearest point is within reach, in one pass
            own = cells[part]
            there = own[:, None, :] + steps[None]                                       # [P, S, 3]
            u = ((points[part].double() - self.lo) / self.cell - (own - self.span))[:, None, :]   # 0..1 in its cell
            gap = torch.where(steps > 0, steps - u, torch.where(steps < 0, u - steps - 1, torch.zeros_like(u)))
            near = (gap.clamp(min=0).square().sum(dim=2) * self.cell**2 <= self.radius**2) \
                & ((there >= 0) & (there < self.dims)).all(dim=2)
            which, step = torch.nonzero(near, as_tuple=True)
            key = self._keys(there[which, step])
            first = torch.searchsorted(self.keys, key)
            count = torch.searchsorted(self.keys, key, right=True) - first
            has = count > 0
            out[self._measure(points, part[which[has]], first[has], count[has])] = True

    def _measure(self, points: Tensor, idx: Tensor, first: Tensor, count: Tensor) -> Tensor:
        """The points ``idx`` with a centre within reach among the ``count`` sorted centres from ``first``."""
        found, ends = [], count.cumsum(0)
        lo, n = 0, len(count)
        while lo < n:                           # pairs (point, centre) in chunks of about CHUNK, whole points
            base = int(ends[lo - 1]) if lo else 0
            hi = max(int(torch.searchsorted(ends, torch.tensor(base + CHUNK, device=ends.device), right=True)),
                     lo + 1)
            c = count[lo:hi]
            pair = torch.repeat_interleave(torch.arange(lo, hi, device=c.device), c)
            within = torch.arange(len(pair), device=c.device) - (ends[lo:hi] - c - base)[pair - lo]
            centre = self.centres[self.order[first[pair] + within]]
            d2 = (points[idx[pair]] - centre).square().sum(dim=1)
            found.append(idx[pair[d2 <= self.radius**2]])
            lo = hi
        return torch.cat(found) if found else idx[:0]


def uncovered(points, centres, radius: float, *, device=None) -> Tensor:
    """``[M]`` bool: the ``points: [M, 3]`` with no ``centres: [K, 3]`` within ``radius`` (all of them when
    there are no centres, none with an infinite radius), on ``device`` (default the points' own): a
    :class:`CellIndex` on a GPU, scipy's k-d tree on the CPU (there the faster, on torch's threads)."""
    device = _device(points, device)
    points, centres = _points(points, device=device), _points(centres, "centres", device=device)
    if len(centres) == 0 or len(points) == 0:
        return torch.ones(len(points), dtype=torch.bool, device=device)
    radius = float(radius)
    if radius == math.inf:
        return torch.zeros(len(points), dtype=torch.bool, device=device)
    radius = _positive(radius, "radius")
    if device.type != "cpu":
        return ~CellIndex(centres, radius).covered(points)
    from scipy.spatial import cKDTree           # lazy for start-up time (the step's preload imports it first)

    tree = cKDTree(centres.numpy(), balanced_tree=False, compact_nodes=False)   # faster to build for one query
    d, _ = tree.query(points.numpy(), distance_upper_bound=radius, workers=torch.get_num_threads())
    return torch.from_numpy(~np.isfinite(d))


def coverage_radius(area: float, kept: int, reach: float = REACH) -> float:
    """How near a kept centre a point must be to count as covered: ``reach`` times the spacing of ``kept``
    Gaussians spread over ``area`` (``inf`` without an area or without Gaussians: nothing then is new)."""
    if kept <= 0 or not area > 0:
        return math.inf
    return reach * math.sqrt(area / kept)


@dataclass(frozen=True)
class Coverage:
    """The new step's seed points against the kept Gaussians (:func:`coverage`).

    new:       [M] bool, the points on new surface, on the points' device.
    radius:    the kept model's spacing (world units; ``inf`` with no kept Gaussian: every point is new): a point
               farther than it from every kept centre is uncovered.
    new_share: the part of the surface's area that is new (by the points' areas), in [0, 1].
    """

    new: Tensor
    radius: float
    new_share: float


def coverage(points, areas, centres, *, reach: float = REACH, device=None) -> Coverage:
    """Which of the seed ``points: [M, 3]`` (the surface's marching-cubes vertices, each standing for its
    ``areas: [M]``) lie on new surface, given the kept Gaussians' ``centres: [K, 3]`` (moved onto the new
    surface: :attr:`SurfaceOffsets.projected`). New surface is found with :func:`coverage_radius` (``reach``
    spacings of the kept model) of the covered area: first taken over the whole area, then over the area left
    covered by that first answer (where the surface grew, the kept Gaussians are denser on what they still
    cover than over the whole). A kept centre covers about one spacing around it, so the band between that and
    ``reach`` spacings, where it borders new surface, is new too (points farther than a spacing from every
    kept centre and within one of a new point): left out, it would stay a gap between the kept model and the
    new seeds. On an unchanged surface nothing is new, however unevenly the kept centres lie. The
    :attr:`Coverage.radius` returned is the spacing: a seed drawn on the new surface is kept where no kept
    centre lies within it (:func:`uncovered`). On ``device`` (default the points' own; :class:`CellIndex`)."""
    device = _device(points, device)
    points, centres = _points(points, device=device), _points(centres, "centres", device=device)
    areas = torch.as_tensor(np.asarray(areas.detach().cpu() if isinstance(areas, Tensor) else areas,
                                       dtype=np.float64)).ravel()
    if areas.shape != (len(points),) or not bool(torch.all(torch.isfinite(areas) & (areas >= 0))):
        raise ValueError(f"areas: expected [M] = [{len(points)}] finite areas >= 0, got shape {tuple(areas.shape)}")
    areas = areas.to(device)
    reach = _positive(reach, "reach")
    total = float(areas.sum())
    if len(centres) == 0 or total <= 0:
        return Coverage(torch.ones(len(points), dtype=torch.bool, device=device), math.inf,
                        1.0 if total > 0 else 0.0)
    new = uncovered(points, centres, coverage_radius(total, len(centres), reach))
    radius = coverage_radius(total - float(areas[new].sum()), len(centres), reach)
    if not math.isfinite(radius):               # nothing covered on the first pass: all of it is new
        return Coverage(torch.ones(len(points), dtype=torch.bool, device=device), math.inf, 1.0)
    new = uncovered(points, centres, radius)
    spacing = radius / reach
    if new.any():       # the band along new surface that the kept centres reach but do not cover: new as well
        new |= uncovered(points, centres, spacing) & ~uncovered(points, points[new], spacing)
    return Coverage(new, spacing, float(areas[new].sum()) / total)


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


def thinned(opacity_logits, drop: int) -> Tensor:
    """``[N]`` bool, the Gaussians kept when the ``drop`` least opaque of them go (by ``opacity_logits: [N]``,
    numpy or a tensor, on its device; ties by position)."""
    logits = opacity_logits.detach() if isinstance(opacity_logits, Tensor) \
        else torch.as_tensor(np.asarray(opacity_logits, dtype=np.float64))
    logits = logits.reshape(-1)
    if not (isinstance(drop, (int, np.integer)) and 0 <= drop <= len(logits)):
        raise ValueError(f"drop: expected an integer from 0 to {len(logits)} (the Gaussians), got {drop!r}")
    keep = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
    if drop:
        keep[torch.argsort(logits, stable=True)[:drop]] = False
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
    """One rank's warm start, decided (:func:`plan`); the masks on the device the plan ran on.

    keep:      [N] bool over the previous shard: not stale, not faint, and not thinned away.
    stale:     [N] bool over the previous shard: off the new surface (:func:`stale`).
    new:       [M] bool over the new seeds (vertices): on new surface.
    coverage:  the :class:`Coverage` (its radius: how a drawn seed is tested, :func:`uncovered`).
    budget:    the :class:`Budget`.
    projected: [K, 3] the kept centres moved onto the new surface (K: those neither stale nor faint, before
               thinning): what the coverage was measured against.
    cells:     [N] each previous centre's offset from the new surface (:attr:`SurfaceOffsets.cells`).
    """

    keep: Tensor
    stale: Tensor
    new: Tensor
    coverage: Coverage
    budget: Budget
    projected: Tensor
    cells: Tensor

    @property
    def dropped(self) -> int:
        """The previous shard's Gaussians that go although they are on the surface (faint, or thinned)."""
        return int((~self.keep & ~self.stale).sum())


def plan(block: Block, isos, seeds: Seeds, means, opacity_logits, expected: float, *,
         cells: float = STALE_CELLS, then=None, reach: float = REACH, slack: float = SLACK,
         ceiling: int | None = None, faint: float = 0.0, frame: Frame | None = None, device=None) -> FollowPlan:
    """:func:`stale` (``cells``, ``then``), :func:`coverage` and :func:`follow_budget` for one rank: the previous
    shard's centres ``means: [N, 3]`` and ``opacity_logits: [N]``, the new step's ``seeds`` (its marching-cubes
    vertices, in the coordinates of ``means``) and ``expected`` (:func:`follow_budget`). ``faint``: the
    Gaussians of an opacity below it go as well (they draw nothing, and a warm step, which does not densify,
    would never prune them). On ``device`` (default the means' own)."""
    device = _device(means, device)
    offsets = surface_offsets(block, isos, means, frame=frame, device=device)
    gone = _stale(offsets.cells, cells, then)
    logits = _logits(opacity_logits, len(gone), device)
    alive = ~gone & (torch.sigmoid(logits) >= faint)
    projected = offsets.projected[alive]
    cover = coverage(seeds.points, seeds.areas, projected, reach=reach, device=device)
    budget = follow_budget(expected, int(alive.sum()), cover.new_share, seeds.total_area, slack=slack,
                           ceiling=ceiling)
    keep = alive.clone()
    if budget.drop:
        keep[torch.nonzero(alive)[:, 0][~thinned(logits[alive], budget.drop)]] = False
    return FollowPlan(keep, gone, cover.new, cover, budget, projected, offsets.cells)


def _logits(opacity_logits, n: int, device) -> Tensor:
    """``opacity_logits`` as an ``[n]`` float tensor on ``device``; ValueError."""
    logits = opacity_logits.detach() if isinstance(opacity_logits, Tensor) \
        else torch.as_tensor(np.asarray(opacity_logits, dtype=np.float32))
    if logits.shape != (n,):
        raise ValueError(f"opacity_logits: expected [N] = [{n}], one per mean, got shape {tuple(logits.shape)}")
    return logits.to(device=device, dtype=torch.float32)
