"""The conversion: a block's isosurface made into Gaussians that already draw it.

Points are spread evenly over the marching-cubes triangles (:func:`surface_points`: each triangle its share of
the count to within one, the points inside it a low-discrepancy sequence), then moved onto the trilinear
isosurface the ground truth casts (:meth:`IsoField.project`: Newton steps along the field's gradient). Each
becomes a flat disc that tiles the surface with its neighbours (:func:`discs`): its in-plane size from the area
it stands for, nearly opaque, so the seeds draw the surface before any training.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from insitu.surface.gaussians import Gaussians, rgb_to_sh0
from insitu.surface.seeds import Seeds, normal_to_quat_torch
from insitu.volume import Block, unit_field

R2 = (0.7548776662466927, 0.5698402909980532)    # the plastic number's R2 sequence: 2D points of low discrepancy


def surface_points(seeds: Seeds, density: float, *, seed: int = 0, origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0),
                   device=None) -> tuple[Tensor, Tensor]:
    """Points spread evenly over the triangles of ``seeds``, ``density`` of them per unit of area, and their
    normals interpolated: ``points: [M, 3]``, unit ``normals: [M, 3]`` (float32, on ``device``).

    Each triangle gets its expected count ``density * area`` rounded up or down at random, and its points are
    consecutive terms of the R2 sequence (a 2D sequence of low discrepancy) mapped into it by Heitz's
    low-distortion map, so that none fall together and no part is left bare. A triangle's draws are a function
    of the triangle alone and ``seed`` (:func:`triangle_keys`: its grid cell, ``origin`` and ``spacing`` the
    grid's, and its place among the cell's triangles): a surface cut between ranks gets the same points as on
    one rank.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if density <= 0 or len(seeds.faces) == 0:
        return torch.zeros(0, 3, device=device), torch.zeros(0, 3, device=device)
    tri = seeds.points[seeds.faces].astype(np.float64)                       # [F, 3, 3]
    area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    key = triangle_keys(tri, origin, spacing, seed)
    unit = lambda k: (k >> np.uint64(11)).astype(np.float64) / float(1 << 53)     # noqa: E731  [0, 1)
    counts = np.floor(density * area + unit(mix(key, 0))).astype(np.int64)
    shift = np.stack([unit(mix(key, 1)), unit(mix(key, 2))], 1)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, 3, device=device), torch.zeros(0, 3, device=device)
    faces = torch.as_tensor(seeds.faces, device=device)
    n = torch.as_tensor(counts, device=device)
    f = torch.repeat_interleave(torch.arange(len(counts), device=device), n)          # [M] each point's triangle
    first = torch.cumsum(n, 0) - n
    j = torch.arange(total, device=device) - first[f]                                 # its place in the triangle
    r2 = torch.tensor(R2, dtype=torch.float64, device=device)
    uv = torch.remainder(torch.as_tensor(shift, device=device)[f] + j[:, None].double() * r2, 1.0)
    u, v = uv[:, 0], uv[:, 1]                   # Heitz (2019): the square onto the triangle, low distortion
    upper = v > u
    a = torch.where(upper, 0.5 * u, u - 0.5 * v)
    b = torch.where(upper, v - 0.5 * u, 0.5 * v)
    w = torch.stack([1 - a - b, a, b], 1).float()[:, :, None]                       # barycentric [M, 3, 1]
    corners = faces[f]
    points = torch.as_tensor(seeds.points, device=device, dtype=torch.float32)
    normals = torch.as_tensor(seeds.normals, device=device, dtype=torch.float32)
    out_p = (points[corners] * w).sum(1)
    out_n = (normals[corners] * w).sum(1)
    return out_p, out_n / out_n.norm(dim=1, keepdim=True).clamp_min(1e-12)


def triangle_keys(tri: np.ndarray, origin, spacing, seed: int = 0) -> np.ndarray:
    """``[F]`` uint64 keys of the triangles ``tri: [F, 3, 3]`` (world positions of their corners): a function of
    the grid cell each lies in (its centroid's, on the grid of ``origin`` and ``spacing``), of its place among
    that cell's triangles (by their centroids) and of ``seed``: integers, so the same triangle gets the same key on
    any rank, though its corners' float32 positions differ in their last bits from one rank count to another."""
    centroid = (tri.mean(1) - np.asarray(origin, np.float64)) / np.asarray(spacing, np.float64)
    cell = np.floor(centroid).astype(np.int64)
    order = np.lexsort((centroid[:, 2], centroid[:, 1], centroid[:, 0], cell[:, 2], cell[:, 1], cell[:, 0]))
    ordered = cell[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (ordered[1:] != ordered[:-1]).any(1)
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    place = np.empty(len(order), np.int64)
    place[order] = np.arange(len(order)) - start
    return integer_hash(np.column_stack([cell, place]), seed)


def integer_hash(values: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[M]`` uint64 keys of the rows of ``values: [M, K]`` (integers) and ``seed``: a 64-bit integer mix."""
    q = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(len(q), np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1), dtype=np.uint64)
        for column in range(q.shape[1]):
            h = (h ^ q[:, column]) * np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    return h


def point_hash(points: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[M]`` uint64 keys of ``points: [M, 3]``, a function of their coordinates rounded to 1e-3 and of
    ``seed`` alone (a 64-bit integer mix), so the same point gets the same key on any rank."""
    return integer_hash(np.round(np.asarray(points, np.float64).reshape(-1, 3) * 1000.0).astype(np.int64), seed)


def mix(key: np.ndarray, salt: int) -> np.ndarray:
    """``[M]`` uint64 keys mixed with ``salt`` (splitmix64's finaliser): another independent key per entry."""
    with np.errstate(over="ignore"):
        z = key + np.uint64(0x9E3779B97F4A7C15) * np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


PROJECTION_STEPS = 4    # Newton steps onto the trilinear isosurface: points on the marching-cubes triangles start a
                        # tenth of a cell off it on average; four steps leave them within 1e-6 cells


class IsoField:
    """A block's field at unit size on a device, trilinear between its samples, and its isosurfaces.

    block:       the field's samples (ghost layers included) and where they stand.
    isos:        the iso values.
    value_range: ``(min, max)`` of the whole field, every rank's block (:func:`insitu.volume.unit_field`): every
                 rank brings its block to unit size by the same map; default this block's range.
    """

    def __init__(self, block: Block, isos, device=None, *, value_range: tuple[float, float] | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        unit, levels = unit_field(block.data, isos, value_range)
        self.volume = torch.from_numpy(np.ascontiguousarray(unit, dtype=np.float32)).to(device)
        self.levels = torch.tensor(levels, dtype=torch.float32, device=device)
        spacing = np.asarray(block.spacing, np.float64)
        self.origin, self.grid = np.asarray(block.origin, np.float64), spacing     # global sample 0, the cells
        self.spacing = torch.as_tensor(spacing, dtype=torch.float32, device=device)
        self.offset = torch.as_tensor(np.asarray(block.origin, np.float64) + np.asarray(block.start) * spacing,
                                      dtype=torch.float32, device=device)
        nz, ny, nx = self.volume.shape
        self.top = torch.tensor([nx - 1, ny - 1, nz - 1], dtype=torch.float32, device=device)
        self.far = self.offset + self.top * self.spacing
        self.cell = float(spacing.min())

    def value_and_gradient(self, points: Tensor) -> tuple[Tensor, Tensor]:
        """The trilinear field at world ``points: [M, 3]`` and its exact gradient there (world units): ``[M]``,
        ``[M, 3]``. Points beyond the samples take the nearest sample's cell (clamped)."""
        q = ((points - self.offset) / self.spacing).clamp(min=0.0).minimum(self.top)
        base = q.floor().minimum((self.top - 1).clamp(min=0.0))
        t = q - base                                                 # [M, 3] within the cell
        i = base.long()
        nz, ny, nx = self.volume.shape
        flat = self.volume.reshape(-1)
        corner = {}
        for dz in (0, 1):
            for dy in (0, 1):
                for dx in (0, 1):
                    idx = ((i[:, 2] + dz).clamp(max=nz - 1) * ny + (i[:, 1] + dy).clamp(max=ny - 1)) * nx \
                        + (i[:, 0] + dx).clamp(max=nx - 1)
                    corner[dx, dy, dz] = flat[idx]
        x, y, z = t[:, 0], t[:, 1], t[:, 2]
        c00 = corner[0, 0, 0] * (1 - x) + corner[1, 0, 0] * x
        c10 = corner[0, 1, 0] * (1 - x) + corner[1, 1, 0] * x
        c01 = corner[0, 0, 1] * (1 - x) + corner[1, 0, 1] * x
        c11 = corner[0, 1, 1] * (1 - x) + corner[1, 1, 1] * x
        c0 = c00 * (1 - y) + c10 * y
        c1 = c01 * (1 - y) + c11 * y
        value = c0 * (1 - z) + c1 * z
        dx0 = (corner[1, 0, 0] - corner[0, 0, 0]) * (1 - y) + (corner[1, 1, 0] - corner[0, 1, 0]) * y
        dx1 = (corner[1, 0, 1] - corner[0, 0, 1]) * (1 - y) + (corner[1, 1, 1] - corner[0, 1, 1]) * y
        gx = dx0 * (1 - z) + dx1 * z
        gy = (c10 - c00) * (1 - z) + (c11 - c01) * z
        gz = c1 - c0
        return value, torch.stack([gx, gy, gz], 1) / self.spacing

    def project(self, points: Tensor, steps: int = PROJECTION_STEPS) -> Tensor:
        """``points: [M, 3]`` moved onto the nearest isosurface by ``steps`` Newton steps along the gradient of
        the trilinear field, each at most half a cell, kept within the samples (where a surface ends at the samples'
        edge, on that face); a point where the gradient vanishes stays."""
        p = points.to(self.volume.device, torch.float32)
        limit = 0.5 * self.cell
        for _ in range(steps):
            value, grad = self.value_and_gradient(p)
            gap = value[:, None] - self.levels[None, :]
            nearest = gap.gather(1, gap.abs().argmin(dim=1, keepdim=True))[:, 0]
            outward = torch.where(nearest[:, None] > 0, -grad, grad)          # where a step would take p
            grad = torch.where(((p <= self.offset) & (outward < 0)) | ((p >= self.far) & (outward > 0)), 0.0, grad)
            g2 = (grad * grad).sum(1)                                       # (along a face it ends at)
            move = torch.where(g2 > 0, nearest / g2.clamp(min=1e-30), torch.zeros_like(g2))[:, None] * grad
            length = move.norm(dim=1, keepdim=True)
            p = (p - move * (limit / length.clamp(min=limit))).clamp(min=self.offset).minimum(self.far)
        return p

    def distance(self, points: Tensor) -> Tensor:
        """``[M]`` first-order distance of ``points: [M, 3]`` to the nearest isosurface, in cells."""
        value, grad = self.value_and_gradient(points.to(self.volume.device, torch.float32))
        gap = (value[:, None] - self.levels[None, :]).abs().amin(1)
        return gap / grad.norm(dim=1).clamp(min=1e-30) / self.cell


def convert(seeds: Seeds, density: float, field: IsoField, *, footprint: float, opacity: float, thickness: float,
            color=(0.85, 0.8, 0.7), sh_degree: int = 0, seed: int = 0) -> Gaussians:
    """The isosurface of ``seeds`` (a block's marching-cubes mesh) as Gaussians that draw it: ``density`` points
    per unit of area spread evenly over the triangles (:func:`surface_points`), moved onto the trilinear
    isosurface of ``field`` (:meth:`IsoField.project`), each a flat disc (:func:`discs`) standing for
    ``1 / density`` of the surface, on ``field``'s device. The same surface gives the same Gaussians whatever
    the blocks it is cut into."""
    points, normals = surface_points(seeds, density, seed=seed, origin=field.origin, spacing=field.grid,
                                     device=field.volume.device)
    return discs(field.project(points, PROJECTION_STEPS), normals, 1.0 / density, footprint=footprint,
                 opacity=opacity, thickness=thickness, color=color, sh_degree=sh_degree)


def discs(points: Tensor, normals: Tensor, area: float, *, footprint: float, opacity: float, thickness: float,
          color=(0.85, 0.8, 0.7), sh_degree: int = 0) -> Gaussians:
    """Flat discs at ``points: [M, 3]`` facing ``normals: [M, 3]``, each standing for ``area`` of the surface:
    in-plane standard deviation ``footprint * sqrt(area)``, thickness ``thickness`` of it, opacity ``opacity``."""
    n = len(points)
    device = points.device
    sigma = max(footprint * math.sqrt(area), 1e-6)
    log_scales = torch.tensor([math.log(sigma), math.log(sigma), math.log(max(thickness * sigma, 1e-7))],
                              device=device).expand(n, 3).contiguous()
    rgb = torch.tensor(color, dtype=torch.float32, device=device).expand(n, 3)
    K = (sh_degree + 1) ** 2
    return Gaussians(
        means=points.contiguous(), log_scales=log_scales, quats=normal_to_quat_torch(normals),
        opacity_logits=torch.full((n,), math.log(opacity / (1 - opacity)), device=device),
        sh0=rgb_to_sh0(rgb).reshape(n, 1, 3).contiguous(),
        shN=torch.zeros(n, K - 1, 3, device=device),
    )
