"""Seeds: marching cubes on a block, and the Gaussians initialised from them.

Each rank runs scikit-image's marching cubes over the cells it owns (the ghost layer
closes the cells on the upper faces), so the ranks' surfaces tile the global one
without cracks or overlaps. Every vertex becomes a candidate Gaussian: a flat disc in
the tangent plane, sized by the surface area around the vertex.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from skimage.measure import marching_cubes

from insitu.surface.gaussians import Gaussians, rgb_to_sh0
from insitu.volume import Block, unit_field

# what a sample equal to the iso value becomes: above it, by less than any float32 difference of samples
_ABOVE = np.float32(1e-30)


@dataclass
class Seeds:
    """Isosurface samples of one block.

    points:  [M, 3] world positions of the mesh vertices.
    normals: [M, 3] unit normals.
    areas:   [M] surface area each vertex stands for (a third of its triangles').
    faces:   [F, 3] triangles (indices into points).
    """

    points: np.ndarray
    normals: np.ndarray
    areas: np.ndarray
    faces: np.ndarray

    def __len__(self) -> int:
        return len(self.points)

    @property
    def total_area(self) -> float:
        return float(self.areas.sum())

    @staticmethod
    def empty() -> "Seeds":
        return Seeds(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32),
                     np.zeros(0, np.float32), np.zeros((0, 3), np.int64))


def owned_samples(block: Block) -> tuple[np.ndarray, np.ndarray]:
    """The samples spanning the block's owned cells: ([nz, ny, nx] view, start index (x, y, z))."""
    lo = np.asarray(block.owned_lo) - np.asarray(block.start)
    hi = np.asarray(block.owned_hi) - np.asarray(block.start) + 1
    return block.data[lo[2]:hi[2], lo[1]:hi[1], lo[0]:hi[0]], np.asarray(block.owned_lo)


def extract_seeds(block: Block, iso: float | list[float], *, value_range: tuple[float, float] | None = None) -> Seeds:
    """Marching cubes (scikit-image) at each iso value over the block's owned cells.

    A sample equal to an iso value counts as above it (as in the ray caster, ``f >= iso``), so a
    surface through samples, a plane of them on the boundary between two blocks included, is the
    crossing next to them and lies in exactly one block's cells: every rank count gives the same
    seeds. The field is brought to unit size around the iso value first
    (:func:`insitu.volume.unit_field`, by the whole field's ``value_range`` when given), so any
    magnitude or offset that float64 holds gives the surface of the same field at unit scale. A block whose owned cells do not cross an iso value
    gives no seeds (not an error: the caller checks that the surface exists somewhere in the
    global field).
    """
    values = [float(v) for v in np.atleast_1d(iso)]
    sub, start = owned_samples(block)
    parts = []
    if min(sub.shape) >= 2:
        for level in values:
            unit, (zero,) = unit_field(sub, [level], value_range)
            unit = np.asarray(unit, np.float32) - np.float32(zero)
            unit[unit == 0] = _ABOVE                # on the iso value: above it
            if not unit.min() < 0 < unit.max():
                continue
            verts, faces, normals, _ = marching_cubes(unit, level=0.0, allow_degenerate=False)
            if len(faces) == 0:
                continue
            ijk = verts[:, ::-1] + start                    # (z, y, x) local -> (x, y, z) global index
            points = block.index_to_world(ijk)
            normals = normals[:, ::-1] / np.asarray(block.spacing)   # gradient in world units
            normals /= np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-12)
            tri = points[faces]
            tri_area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
            areas = np.zeros(len(points))
            np.add.at(areas, faces.ravel(), np.repeat(tri_area / 3.0, 3))
            parts.append((points, normals, areas, faces))
    if not parts:
        return Seeds.empty()
    offsets = np.cumsum([0] + [len(p[0]) for p in parts[:-1]])
    return Seeds(
        np.concatenate([p[0] for p in parts]).astype(np.float32),
        np.concatenate([p[1] for p in parts]).astype(np.float32),
        np.concatenate([p[2] for p in parts]).astype(np.float32),
        np.concatenate([p[3] + o for p, o in zip(parts, offsets)]).astype(np.int64),
    )


def normal_to_quat(normals: np.ndarray) -> np.ndarray:
    """[M, 3] unit normals -> [M, 4] quaternions (w, x, y, z) that rotate +z onto them."""
    z = np.array([0.0, 0.0, 1.0])
    n = np.asarray(normals, np.float64)
    axis = np.cross(np.broadcast_to(z, n.shape), n)
    cos = np.clip(n[:, 2], -1.0, 1.0)
    q = np.concatenate([(1.0 + cos)[:, None], axis], axis=1)    # half-angle trick, then normalise
    flip = cos < -1.0 + 1e-8                                    # n == -z: rotate by pi about x
    q[flip] = [0.0, 1.0, 0.0, 0.0]
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def sample_surface(seeds: Seeds, count: int, seed: int = 0) -> Seeds:
    """``count`` points drawn uniformly (by area) on the triangles, normals interpolated.

    Each returned point stands for ``total_area / count``; faces are dropped.
    """
    if count <= 0 or len(seeds.faces) == 0:
        return Seeds.empty()
    rng = np.random.default_rng(seed)
    tri = seeds.points[seeds.faces].astype(np.float64)                      # [F, 3, 3]
    area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    f = rng.choice(len(area), size=count, p=area / area.sum())
    u, v = rng.random(count), rng.random(count)
    flip = u + v > 1
    u[flip], v[flip] = 1 - u[flip], 1 - v[flip]
    w = np.stack([1 - u - v, u, v], axis=1)[:, :, None]                     # barycentric [count, 3, 1]
    points = (tri[f] * w).sum(1)
    normals = (seeds.normals[seeds.faces[f]] * w).sum(1)
    normals /= np.maximum(np.linalg.norm(normals, axis=1, keepdims=True), 1e-12)
    return Seeds(points.astype(np.float32), normals.astype(np.float32),
                 np.full(count, area.sum() / count, np.float32), np.zeros((0, 3), np.int64))


def sample_surface_torch(seeds: Seeds, count: int, seed: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_surface` on ``device`` (the GPU path of ``init_gaussians(fill=True)``).

    Returns points [count, 3] and unit normals [count, 3], float32 tensors on ``device``:
    triangles drawn by area (inverse CDF of the cumulative areas), points uniform on them.
    The draws come from torch's generator seeded with ``seed``, not numpy's.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if count <= 0 or len(seeds.faces) == 0:
        return torch.zeros(0, 3, device=device), torch.zeros(0, 3, device=device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    points = torch.as_tensor(seeds.points, device=device, dtype=torch.float32)
    normals = torch.as_tensor(seeds.normals, device=device, dtype=torch.float32)
    faces = torch.as_tensor(seeds.faces, device=device)
    tri = points[faces]                                                      # [F, 3, 3]
    area = 0.5 * torch.linalg.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]).norm(dim=1)
    cdf = torch.cumsum(area.double(), 0)
    r = torch.rand(count, generator=gen, device=device, dtype=torch.float64) * cdf[-1]
    f = torch.searchsorted(cdf, r).clamp_max(len(area) - 1)
    uv = torch.rand(count, 2, generator=gen, device=device)
    flip = uv.sum(1) > 1
    uv = torch.where(flip[:, None], 1 - uv, uv)
    w = torch.stack([1 - uv[:, 0] - uv[:, 1], uv[:, 0], uv[:, 1]], 1)[:, :, None]   # barycentric [count, 3, 1]
    corners = faces[f]
    out_p = (points[corners] * w).sum(1)
    out_n = (normals[corners] * w).sum(1)
    out_n = out_n / out_n.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return out_p, out_n


def normal_to_quat_torch(n: torch.Tensor) -> torch.Tensor:
    """:func:`normal_to_quat` for a tensor ``n: [M, 3]`` (unit normals) -> [M, 4] (w, x, y, z)."""
    cos = n[:, 2].clamp(-1.0, 1.0)
    q = torch.stack([1.0 + cos, -n[:, 1], n[:, 0], torch.zeros_like(cos)], 1)   # (1 + cos, z x n)
    flip = cos < -1.0 + 1e-6
    q[flip] = torch.tensor([0.0, 1.0, 0.0, 0.0], device=n.device, dtype=q.dtype)
    return q / q.norm(dim=1, keepdim=True)


def init_gaussians(seeds: Seeds, budget: int, *, color=(0.85, 0.8, 0.7), colors: np.ndarray | None = None,
                   opacity: float = 0.5, thickness: float = 0.1, sh_degree: int = 0, seed: int = 0,
                   fill: bool = False, device=None) -> Gaussians:
    """Flat discs on the surface, at most ``budget`` of them.

    seeds:     the block's isosurface samples.
    budget:    largest number of Gaussians; when the surface has more vertices, ``budget`` of
               them are drawn without replacement with probability proportional to their area,
               and each then stands for ``total_area / budget``.
    color:     [3] initial RGB, or ``colors`` [M, 3] per seed (e.g. colour-mapped second field).
    thickness: disc thickness as a fraction of its radius.
    fill:      when the surface has fewer vertices than ``budget``, draw ``budget`` points on its
               triangles instead (``sample_surface``), independently at random, so the model starts at the
               budget. On a CUDA ``device`` the points are drawn there (``sample_surface_torch``). A step's
               seeds are not drawn so but converted (:func:`insitu.surface.conversion.convert`); these draws
               serve the tests and benchmarks that want a shard of a given size, and the seeds before the
               conversion (``benchmarks/experiments/bench_conversion.py``'s ``@old``).
    Returns a Gaussians shard with SH degree ``sh_degree`` (higher bands zero).
    """
    if budget < 0:
        raise ValueError(f"budget: expected >= 0, got {budget}")
    if not 0.0 < opacity < 1.0:
        raise ValueError(f"opacity: expected a value in (0, 1), got {opacity}")
    M = len(seeds)
    if M == 0 or budget == 0:
        return Gaussians.empty(sh_degree, device)
    if fill and M < budget and colors is None:
        if device is not None and torch.device(device).type == "cuda":
            return _filled_on_device(seeds, budget, color, opacity, thickness, sh_degree, seed, device)
        seeds, M = sample_surface(seeds, budget, seed), budget
    areas = seeds.areas.astype(np.float64)
    if M > budget:
        rng = np.random.default_rng(seed)
        p = areas / areas.sum() if areas.sum() > 0 else None
        idx = np.sort(rng.choice(M, size=budget, replace=False, p=p))
        area = np.full(budget, seeds.total_area / budget)
    else:
        idx = np.arange(M)
        area = np.maximum(areas, 1e-12)
    radius = np.sqrt(area / math.pi)
    sigma_t = np.maximum(0.8 * radius, 1e-6)
    scales = np.stack([sigma_t, sigma_t, np.maximum(thickness * sigma_t, 1e-7)], axis=1)
    rgb = np.broadcast_to(np.asarray(color, np.float64), (len(idx), 3)) if colors is None else colors[idx]
    K = (sh_degree + 1) ** 2
    n = len(idx)
    # a copy that torch may write: a broadcast view of one row (one Gaussian) is contiguous already, but
    # read-only, and torch warns on a read-only array
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32, device=device)  # noqa: E731
    return Gaussians(
        means=t(seeds.points[idx]),
        log_scales=t(np.log(scales)),
        quats=t(normal_to_quat(seeds.normals[idx])),
        opacity_logits=t(np.full(n, math.log(opacity / (1 - opacity)))),
        sh0=rgb_to_sh0(t(rgb)).reshape(n, 1, 3),
        shN=torch.zeros(n, K - 1, 3, device=device),
    )


def _filled_on_device(seeds: Seeds, budget: int, color, opacity: float, thickness: float, sh_degree: int,
                      seed: int, device) -> Gaussians:
    """``init_gaussians(fill=True)`` with the points drawn and the discs built on ``device``."""
    points, normals = sample_surface_torch(seeds, budget, seed, device)
    sigma_t = max(0.8 * math.sqrt(seeds.total_area / budget / math.pi), 1e-6)
    log_scales = torch.tensor([math.log(sigma_t), math.log(sigma_t), math.log(max(thickness * sigma_t, 1e-7))],
                              device=device).expand(budget, 3).contiguous()
    rgb = torch.tensor(color, dtype=torch.float32, device=device).expand(budget, 3)
    K = (sh_degree + 1) ** 2
    return Gaussians(
        means=points, log_scales=log_scales, quats=normal_to_quat_torch(normals),
        opacity_logits=torch.full((budget,), math.log(opacity / (1 - opacity)), device=device),
        sh0=rgb_to_sh0(rgb).reshape(budget, 1, 3).contiguous(),
        shN=torch.zeros(budget, K - 1, 3, device=device),
    )
