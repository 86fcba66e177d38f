"""Orbit cameras around the data: a Fibonacci sphere of views, train/test split.

Camera model (shared by the ground-truth ray caster and both rasterizers, as in gsplat):
``viewmats [N, 4, 4]`` world-to-camera, OpenCV axes (+x right, +y down, +z forward);
``Ks [N, 3, 3]`` pinhole intrinsics in pixels; pixel (u, v) has its centre at (u + 0.5, v + 0.5).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from insitu.errors import InputError


# What a view is for: training, the held-out orbit views, and the held-out views a viewer's user takes
# and the orbit never has: 2x closer (looking at the centre), 3x closer (looking at points on the
# surface) and at the orbit's distance off its lattice (the poles included).
ROLES = ("train", "test", "near2", "near3", "off")
HELD_OUT = ROLES[1:]


@dataclass
class Views:
    """A set of cameras looking at the data.

    viewmats: [N, 4, 4] world-to-camera matrices.
    Ks:       [N, 3, 3] intrinsics.
    width, height: image size in pixels.
    role:     [N] what each view is for, an index into ``ROLES`` (a bool tensor is taken as
              ``test``: True for the held-out orbit views, False for training).
    """

    viewmats: Tensor
    Ks: Tensor
    width: int
    height: int
    role: Tensor

    def __post_init__(self):
        if self.role.dtype == torch.bool:
            self.role = self.role.to(torch.int8)

    def __len__(self) -> int:
        return self.viewmats.shape[0]

    @property
    def test(self) -> Tensor:
        """[N] bool, the held-out orbit views."""
        return self.role == ROLES.index("test")

    def ids(self, role: str) -> Tensor:
        """The views of ``role`` (a name in ``ROLES``)."""
        return torch.nonzero(self.role == ROLES.index(role)).flatten()

    @property
    def train_ids(self) -> Tensor:
        return self.ids("train")

    @property
    def test_ids(self) -> Tensor:
        return self.ids("test")

    @property
    def positions(self) -> Tensor:
        """[N, 3] camera centres in world coordinates."""
        R = self.viewmats[:, :3, :3]
        t = self.viewmats[:, :3, 3:]
        return (-R.transpose(1, 2) @ t)[..., 0]

    def subset(self, ids: Tensor) -> "Views":
        return Views(self.viewmats[ids], self.Ks[ids], self.width, self.height, self.role[ids])

    def to(self, device) -> "Views":
        return Views(self.viewmats.to(device), self.Ks.to(device), self.width, self.height, self.role.to(device))

    @staticmethod
    def cat(parts: list["Views"]) -> "Views":
        """The views of ``parts`` (one image size) one after the other."""
        if len({(p.width, p.height) for p in parts}) != 1:
            raise ValueError(f"Views.cat: expected one image size, got {[(p.width, p.height) for p in parts]}")
        return Views(torch.cat([p.viewmats for p in parts]), torch.cat([p.Ks for p in parts]), parts[0].width,
                     parts[0].height, torch.cat([p.role for p in parts]))


def fibonacci_sphere(n: int) -> np.ndarray:
    """[n, 3] unit vectors spread evenly over the sphere (golden-angle spiral)."""
    i = np.arange(n, dtype=np.float64) + 0.5
    z = 1.0 - 2.0 * i / n
    r = np.sqrt(np.maximum(0.0, 1.0 - z * z))
    phi = i * math.pi * (3.0 - math.sqrt(5.0))
    return np.stack([r * np.cos(phi), r * np.sin(phi), z], axis=1)


def look_at(eye: np.ndarray, target: np.ndarray, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """[4, 4] world-to-camera matrix (OpenCV axes) of a camera at ``eye`` looking at ``target``."""
    forward = target - eye
    forward = forward / np.linalg.norm(forward)
    up = np.asarray(up, dtype=np.float64)
    if abs(np.dot(forward, up)) > 0.999:          # looking along the up axis: pick another
        up = np.array([0.0, 1.0, 0.0])
    right = np.cross(forward, up)
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    R = np.stack([right, down, forward])           # rows: camera axes in world coordinates
    m = np.eye(4)
    m[:3, :3] = R
    m[:3, 3] = -R @ eye
    return m


def orbit_distance(lo, hi, fov_deg: float, margin: float = 1.05) -> tuple[np.ndarray, float]:
    """(centre [3], distance): where the orbit cameras look and how far from it they stand, so that
    the bounding sphere of the box ``lo``..``hi`` fills the field of view."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    radius = 0.5 * float(np.linalg.norm(hi - lo))
    return 0.5 * (lo + hi), margin * radius / math.sin(math.radians(fov_deg) / 2)


def pixels_per_area(lo, hi, resolution: int, fov_deg: float) -> float:
    """Pixels that one unit of surface area facing an orbit camera covers at the orbit's centre."""
    _, distance = orbit_distance(lo, hi, fov_deg)
    focal = 0.5 * resolution / math.tan(math.radians(fov_deg) / 2)
    return (focal / distance) ** 2


def pixel_size(means: Tensor, views: Views, ids: Tensor, *, chunk: int | None = None) -> Tensor:
    """``[N]`` for each point ``means: [N, 3]`` (world) the width in world units of one pixel of the
    nearest of views ``ids`` whose image holds it (``depth / fx`` there), ``inf`` where none does:
    the finest detail those views resolve at the point. Views in chunks of ``chunk`` (default: as
    many as keep each temporary near 2**24 points, so 100M Gaussians take one view at a time)."""
    if means.ndim != 2 or means.shape[1] != 3:
        raise ValueError(f"pixel_size: means: expected [N, 3], got {tuple(means.shape)}")
    ids = torch.as_tensor(ids, device=views.viewmats.device).long()
    points = means.detach().float()
    best = torch.full((points.shape[0],), float("inf"), device=points.device)
    if chunk is None:
        chunk = (1 << 24) // max(points.shape[0], 1)
    for part in ids.split(max(int(chunk), 1)):
        vm = views.viewmats[part].to(points.device, torch.float32)
        Ks = views.Ks[part].to(points.device, torch.float32)
        cam = torch.einsum("cij,nj->cni", vm[:, :3, :3], points) + vm[:, None, :3, 3]     # [c, N, 3]
        z = cam[..., 2]
        safe = z.clamp(min=1e-12)
        u = Ks[:, 0, 0, None] * cam[..., 0] / safe + Ks[:, 0, 2, None]
        v = Ks[:, 1, 1, None] * cam[..., 1] / safe + Ks[:, 1, 2, None]
        inside = (z > 0) & (u >= 0) & (u < views.width) & (v >= 0) & (v < views.height)
        size = torch.where(inside, z / Ks[:, 0, 0, None], torch.full_like(z, float("inf")))
        best = torch.minimum(best, size.min(0).values)
    return best


def _intrinsics(count: int, resolution: int, fov_deg: float) -> np.ndarray:
    f = 0.5 * resolution / math.tan(math.radians(fov_deg) / 2)
    K = np.array([[f, 0.0, resolution / 2], [0.0, f, resolution / 2], [0.0, 0.0, 1.0]])
    return np.broadcast_to(K, (count, 3, 3)).copy()


def _views(eyes: np.ndarray, targets: np.ndarray, resolution: int, fov_deg: float, role: np.ndarray) -> Views:
    viewmats = np.stack([look_at(e, t) for e, t in zip(eyes, targets)]) if len(eyes) else np.zeros((0, 4, 4))
    return Views(torch.tensor(viewmats, dtype=torch.float32),
                 torch.tensor(_intrinsics(len(eyes), resolution, fov_deg), dtype=torch.float32),
                 resolution, resolution, torch.as_tensor(role, dtype=torch.int8))


def _check(count: int, resolution: int, fov_deg: float, *, allow_zero: bool = False) -> None:
    if count < (0 if allow_zero else 1):
        raise ValueError(f"views: expected a view count > {-1 if allow_zero else 0}, got {count}")
    if resolution <= 0:
        raise ValueError(f"views: expected a resolution > 0, got {resolution}")
    if not 0 < fov_deg < 180:
        raise ValueError(f"views: expected a field of view in (0, 180) degrees, got {fov_deg}")


def orbit_views(lo, hi, count: int, resolution: int, fov_deg: float = 40.0,
                test_every: int = 8, margin: float = 1.05) -> Views:
    """``count`` cameras on a Fibonacci sphere around the box ``lo``..``hi`` (world, [3] each).

    Every camera looks at the box centre from a distance at which the box's bounding
    sphere fills the field of view; every ``test_every``-th view is held out (role ``test``).
    """
    _check(count, resolution, fov_deg)
    centre, distance = orbit_distance(lo, hi, fov_deg, margin)
    dirs = fibonacci_sphere(count)
    role = np.zeros(count, dtype=np.int8)
    if count > 1:
        role[::test_every] = ROLES.index("test")
    return _views(centre + distance * dirs, np.broadcast_to(centre, dirs.shape), resolution, fov_deg, role)


def random_directions(count: int, rng: np.random.Generator) -> np.ndarray:
    """[count, 3] unit vectors drawn uniformly on the sphere."""
    d = rng.normal(size=(count, 3))
    return d / np.linalg.norm(d, axis=1, keepdims=True)


def near_views(lo, hi, count: int, resolution: int, fov_deg: float = 40.0, *, closer: float,
               points: np.ndarray | None = None, role: str = "train", seed: int = 0) -> Views:
    """``count`` cameras ``closer`` times closer than the orbit, from directions drawn at random
    (off the orbit's lattice), as a viewer's user zooms in.

    points: None: every camera looks at the box centre from ``distance / closer``; else ``[M, 3]``
            points on the surface (the same on every rank): each camera looks at one of them from
            ``distance / closer`` along its direction, the point drawn among the quarter of the
            points that lie furthest out on the camera's side (what a user zooming in on the
            surface from outside looks at).
    role: a name in ``ROLES``; seed: the draws' seed (the same cameras for the same arguments).
    """
    _check(count, resolution, fov_deg, allow_zero=True)
    if not closer >= 1:
        raise ValueError(f"views: expected cameras at least as close as the orbit (closer >= 1), got {closer}")
    centre, distance = orbit_distance(lo, hi, fov_deg)
    rng = np.random.default_rng(seed)
    dirs = random_directions(count, rng)
    if points is None or len(points) == 0:
        targets = np.broadcast_to(centre, dirs.shape)
    else:
        p = np.asarray(points, np.float64).reshape(-1, 3)
        out = (p - centre) @ dirs.T                                          # [M, count]
        top = max(1, len(p) // 4)
        pick = np.argpartition(-out, top - 1, axis=0)[:top]                 # [top, count] furthest out
        targets = p[pick[rng.integers(0, top, size=count), np.arange(count)]]
    eyes = targets + (distance / closer) * dirs
    return _views(eyes, targets, resolution, fov_deg, np.full(count, ROLES.index(role), np.int8))


def off_orbit_views(lo, hi, count: int, resolution: int, fov_deg: float = 40.0, *, seed: int = 0) -> Views:
    """``count`` held-out cameras (role ``off``) at the orbit's distance, looking at the centre from
    directions off its lattice: half of them within 25 degrees of a pole, half anywhere."""
    _check(count, resolution, fov_deg, allow_zero=True)
    centre, distance = orbit_distance(lo, hi, fov_deg)
    rng = np.random.default_rng(seed)
    dirs = random_directions(count, rng)
    polar = np.arange(count) % 2 == 0
    cap = rng.uniform(math.cos(math.radians(25)), 1.0, size=count) * np.where(rng.random(count) < 0.5, -1, 1)
    ring = np.sqrt(np.maximum(0.0, 1 - cap ** 2))
    phi = rng.uniform(0, 2 * math.pi, size=count)
    dirs[polar] = np.stack([ring * np.cos(phi), ring * np.sin(phi), cap], 1)[polar]
    return _views(centre + distance * dirs, np.broadcast_to(centre, dirs.shape), resolution, fov_deg,
                  np.full(count, ROLES.index("off"), np.int8))


PIXEL_STEPS = 4                         # float32 steps of the world coordinates a pixel spans at least at its camera's
                                        # target: the Gaussians' positions then resolve a quarter of a pixel


def check_precision(lo, hi, *, resolution: int, fov_deg: float, cameras: list[tuple[str, float, str | None]]) -> None:
    """InputError unless a pixel of every camera, at the point it looks at, spans ``PIXEL_STEPS`` float32
    steps of the world coordinates there (the box ``lo``..``hi`` and the camera): finer, the Gaussians' means
    and the rays cannot be placed within a pixel, and the views show rounding. ``cameras``: (what they are,
    how many times closer than the orbit they stand, the setting that brings them closer or None)."""
    _, distance = orbit_distance(lo, hi, fov_deg)
    reach = float(np.max(np.abs(np.concatenate([np.asarray(lo, np.float64), np.asarray(hi, np.float64)]))))
    width = 2.0 * math.tan(math.radians(fov_deg) / 2) / resolution        # a pixel's size per unit of depth
    for what, factor, key in cameras:
        depth = distance / factor
        pixel, step = depth * width, float(np.spacing(np.float32(reach + depth)))
        if pixel < PIXEL_STEPS * step:
            raise InputError(
                f"views: a pixel of {what} spans {pixel:.3g} world units at the surface, under {PIXEL_STEPS} float32 "
                f"steps ({step:.3g} each) of coordinates as large as {reach + depth:.3g}: the Gaussians cannot be "
                f"placed within a pixel; lower views.resolution ({resolution})" + (f" or {key}" if key else "")
                + ", or give the data coordinates nearer 0 (input.origin)")


def step_views(lo, hi, *, count: int, resolution: int, fov_deg: float = 40.0, test_every: int = 8,
               closeups: int = 0, closeup_factors=(2.0, 3.0), held_out: int = 0,
               targets: np.ndarray | None = None) -> Views:
    """Every camera of a step, one after the other: the orbit (training and ``test`` views), then
    ``closeups`` training views closer than the orbit (spread over ``closeup_factors``, each looking at
    one of the surface points ``targets: [M, 3]``), then ``held_out`` views of each held-out set a viewer's
    user takes: ``near2`` (2x closer, at the centre), ``near3`` (3x closer, at surface points) and ``off``
    (the orbit's distance, off its lattice). The draws are seeded: the same cameras on every rank.
    InputError when a pixel of some camera is finer than float32 resolves (:func:`check_precision`)."""
    factors = [float(f) for f in closeup_factors]
    cameras = [("the orbit's cameras", 1.0, None)]
    cameras += [(f"the close-ups {f:g} times closer", f, "views.closeup_factors") for f in factors if closeups]
    cameras += [("the held-out views 3 times closer", 3.0, "views.held_out (0: none)")] if held_out else []
    check_precision(lo, hi, resolution=resolution, fov_deg=fov_deg, cameras=cameras)
    parts = [orbit_views(lo, hi, count, resolution, fov_deg, test_every)]
    for i, closer in enumerate(factors):
        n = closeups // len(factors) + (1 if i < closeups % len(factors) else 0)
        parts.append(near_views(lo, hi, n, resolution, fov_deg, closer=closer, points=targets, role="train",
                                seed=1000 + i))
    if held_out:
        parts += [near_views(lo, hi, held_out, resolution, fov_deg, closer=2.0, role="near2", seed=1),
                  near_views(lo, hi, held_out, resolution, fov_deg, closer=3.0, points=targets, role="near3", seed=2),
                  off_orbit_views(lo, hi, held_out, resolution, fov_deg, seed=3)]
    return Views.cat(parts)

