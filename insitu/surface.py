"""Gaussians held on the isosurface they draw: centres on it, discs turned to its normal, kept thin.

A photograph's scene has no known geometry, so 3DGS lets the optimiser move every Gaussian freely.
Here the surface is known exactly (the field and its iso values are in memory), and a free
optimiser uses its freedom to stray: on the bonsai at 1024² the trained centres lie a median 0.33
and a 99th percentile 2.2 cells off the surface they started on, 10% of the discs are turned more
than 23 degrees from its normal and some thicken to a quarter of their width (BENCHMARKS.md,
``bench_anatomy.py``), and most of the surface's error is along contours, where such strays
show. :class:`SurfaceHold` puts them back after every optimiser step:

- each centre moves onto the nearest iso level along the field's gradient (one Newton step of the
  trilinear field, at most a cell; repeated every step it converges as the optimiser moves it);
- each disc's normal (its local z axis, the lit colour model's normal) turns by the smallest
  rotation onto the field's normal there (either side: the headlight shades both alike), so its
  in-plane axes keep their orientation;
- each disc's thickness (its z scale) stays at most ``thickness`` times its smaller in-plane scale.

Gaussians whose centre lies outside the block's samples, where the gradient vanishes or far from
any level (``SurfaceHold.REACH``) are left as they are. The hold is local to the rank's block (sort-last: a rank's Gaussians stay within its
block plus a margin that its ghost samples cover).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .appearance import BlockSamples, quat_normals


def quat_multiply(a: Tensor, b: Tensor) -> Tensor:
    """``[N, 4]`` the Hamilton products ``a * b`` of quaternions ``a, b: [N, 4]`` (w, x, y, z): the
    rotation of ``b`` followed by that of ``a``."""
    aw, av = a[:, :1], a[:, 1:]
    bw, bv = b[:, :1], b[:, 1:]
    return torch.cat([aw * bw - (av * bv).sum(1, keepdim=True),
                      aw * bv + bw * av + torch.linalg.cross(av, bv, dim=1)], dim=1)


def turn_normals(quats: Tensor, normals: Tensor) -> Tensor:
    """``[N, 4]`` the rotations ``quats: [N, 4]`` (w, x, y, z) turned by the smallest rotation that takes
    each one's local z axis onto ``normals: [N, 3]`` (unit) or its opposite, whichever is nearer."""
    if quats.ndim != 2 or quats.shape[1] != 4 or normals.shape != (quats.shape[0], 3):
        raise ValueError(f"turn_normals: expected quats [N, 4] and normals [N, 3], got {tuple(quats.shape)} "
                         f"and {tuple(normals.shape)}")
    now = quat_normals(quats)
    target = torch.where((now * normals).sum(1, keepdim=True) < 0, -normals, normals)
    turn = F.normalize(torch.cat([1.0 + (now * target).sum(1, keepdim=True),
                                  torch.linalg.cross(now, target, dim=1)], dim=1), dim=1)
    return quat_multiply(turn, F.normalize(quats, dim=1))


@dataclass
class SurfaceHold:
    """The isosurfaces ``field == level`` of a block's samples, onto which Gaussians are held.

    samples:   the block's field (:class:`insitu.appearance.BlockSamples`, at unit size).
    levels:    [L] the iso values in the samples' units.
    thickness: a disc's largest z scale as a fraction of its smaller in-plane scale (None: not held).
    """

    samples: BlockSamples
    levels: Tensor
    thickness: float | None = 0.1

    REACH = 3.0             # cells: a centre farther from a level (to first order) is not near a surface

    def __post_init__(self) -> None:
        if self.levels.ndim != 1 or self.levels.numel() == 0:
            raise ValueError(f"SurfaceHold: levels: expected [L] iso values, got {tuple(self.levels.shape)}")
        if self.thickness is not None and not self.thickness > 0:
            raise ValueError(f"SurfaceHold: thickness: expected a positive fraction or None, got {self.thickness}")

    def project(self, means: Tensor) -> tuple[Tensor, Tensor]:
        """``(moved [N, 3], normals [N, 3])`` for centres ``means: [N, 3]``: each moved by one Newton step
        along the gradient onto its nearest level (by at most one cell), and the unit normal there before
        the move; a centre outside the samples, on a vanishing gradient or farther than ``REACH`` cells
        from the level (to first order) stays, with normal 0."""
        q = self.samples.local(means)
        inside = ((q >= 0) & (q <= self.samples.top)).all(1)
        value = self.samples.sample(q)
        grad = self.samples.gradient(means)
        norm2 = (grad * grad).sum(1)
        level = self.levels.to(value)[(value[:, None] - self.levels.to(value)[None]).abs().argmin(1)]
        step = ((value - level) / norm2.clamp(min=1e-30))[:, None] * grad
        cell = float(self.samples.spacing.min())
        length = step.norm(dim=1, keepdim=True)
        ok = inside & (norm2 > 0) & torch.isfinite(norm2) & (length[:, 0] <= self.REACH * cell)
        step = step * (cell / length.clamp(min=cell))                     # at most one cell
        moved = torch.where(ok[:, None], means - step, means)
        normals = torch.where(ok[:, None], grad / norm2.clamp(min=1e-30).sqrt()[:, None], torch.zeros_like(grad))
        return moved, normals

    @torch.no_grad()
    def apply(self, means: Tensor, quats: Tensor, log_scales: Tensor) -> None:
        """Hold the Gaussians ``means: [N, 3]``, ``quats: [N, 4]`` (w, x, y, z), ``log_scales: [N, 3]``
        (the rasterizer's ``exp``: x, y in-plane, z the normal's) on the surface, in place."""
        if means.shape[0] == 0:
            return
        moved, normals = self.project(means)
        means.copy_(moved.to(means.dtype))
        turned = normals.abs().sum(1) > 0
        quats.copy_(torch.where(turned[:, None], turn_normals(quats, torch.where(
            turned[:, None], normals, torch.tensor([0.0, 0.0, 1.0], device=normals.device))), quats))
        if self.thickness is not None:
            top = log_scales[:, :2].min(1).values + math.log(self.thickness)
            log_scales[:, 2].copy_(torch.minimum(log_scales[:, 2], top))
