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


@dataclass
class Views:
    """A set of cameras looking at the data.

    viewmats: [N, 4, 4] world-to-camera matrices.
    Ks:       [N, 3, 3] intrinsics.
    width, height: image size in pixels.
    test:     [N] bool, True for held-out views.
    """

    viewmats: Tensor
    Ks: Tensor
    width: int
    height: int
    test: Tensor

    def __len__(self) -> int:
        return self.viewmats.shape[0]

    @property
    def train_ids(self) -> Tensor:
        return torch.nonzero(~self.test).flatten()

    @property
    def test_ids(self) -> Tensor:
        return torch.nonzero(self.test).flatten()

    @property
    def positions(self) -> Tensor:
        """[N, 3] camera centres in world coordinates."""
        R = self.viewmats[:, :3, :3]
        t = self.viewmats[:, :3, 3:]
        return (-R.transpose(1, 2) @ t)[..., 0]

    def subset(self, ids: Tensor) -> "Views":
        return Views(self.viewmats[ids], self.Ks[ids], self.width, self.height, self.test[ids])

    def to(self, device) -> "Views":
        return Views(self.viewmats.to(device), self.Ks.to(device), self.width, self.height, self.test.to(device))


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


def orbit_views(lo, hi, count: int, resolution: int, fov_deg: float = 40.0,
                test_every: int = 8, margin: float = 1.05) -> Views:
    """``count`` cameras on a Fibonacci sphere around the box ``lo``..``hi`` (world, [3] each).

    Every camera looks at the box centre from a distance at which the box's bounding
    sphere fills the field of view; every ``test_every``-th view is held out.
    """
    if count <= 0:
        raise ValueError(f"views: expected a view count > 0, got {count}")
    if resolution <= 0:
        raise ValueError(f"views: expected a resolution > 0, got {resolution}")
    if not 0 < fov_deg < 180:
        raise ValueError(f"views: expected a field of view in (0, 180) degrees, got {fov_deg}")
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    centre = 0.5 * (lo + hi)
    radius = 0.5 * float(np.linalg.norm(hi - lo))
    half = math.radians(fov_deg) / 2
    distance = margin * radius / math.sin(half)
    dirs = fibonacci_sphere(count)
    viewmats = np.stack([look_at(centre + distance * d, centre) for d in dirs])
    f = 0.5 * resolution / math.tan(half)
    K = np.array([[f, 0.0, resolution / 2], [0.0, f, resolution / 2], [0.0, 0.0, 1.0]])
    Ks = np.broadcast_to(K, (count, 3, 3)).copy()
    test = np.zeros(count, dtype=bool)
    if count > 1:
        test[::test_every] = True
    return Views(torch.tensor(viewmats, dtype=torch.float32), torch.tensor(Ks, dtype=torch.float32),
                 resolution, resolution, torch.from_numpy(test))
