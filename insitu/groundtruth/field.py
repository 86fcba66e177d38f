"""What both ray casters read, prepared once per block on the device.

:class:`CastScene`: the block's field (:class:`Field`: the samples and the macro-cell distance
grid that skips empty space), its owned box and the whole domain's box in the block's local
index space, the march step, the iso values and the surface colour; :class:`Cameras`: the
cameras as ray directions. :func:`prepare_scene` builds the scene from a block.

Empty space: a macro cell (``MACRO`` voxels a side) is *active* when the range of its samples,
which bounds the trilinear field everywhere inside it, brackets an iso value; every other cell
stores its Chebyshev distance to the nearest active one (capped at ``SKIP_RADIUS_CAP``), so a
ray in empty space jumps over the whole empty cube of cells around it at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from insitu.groundtruth.colormaps import colormap_tensors
from insitu.render.lighting import HEADLIGHT, Light
from insitu.volume import Block, unit_colors, unit_field

MACRO = 8                 # voxels per macro-cell edge for empty-space skipping
SKIP_RADIUS_CAP = 16      # largest empty-space distance stored, in macro cells


@dataclass
class Field:
    """A block's samples on the device, with what marching needs to know about them.

    volume:     [1, 1, nz, ny, nx] samples (ghosts included), float32.
    size:       [3] samples per axis (x, y, z), float32.
    distance:   [mz * my * mx] Chebyshev distance of each macro cell to the nearest active
                one, in macro cells, capped at SKIP_RADIUS_CAP; 0 for active cells. float32.
    macro_dims: [3] macro cells per axis (x, y, z), float32.
    dims, macro: ``size`` and ``macro_dims`` as integers on the host (a kernel's launch arguments:
                reading them from the device would wait for the work queued before it).
    """

    volume: Tensor
    size: Tensor
    distance: Tensor
    macro_dims: Tensor
    dims: tuple[int, int, int]
    macro: tuple[int, int, int]

    def sample(self, q: Tensor) -> Tensor:
        """Trilinear field at local index positions ``q: [..., 3]`` (x, y, z) -> ``[...]``."""
        return trilinear(self.volume, q, self.size)


def trilinear(volume: Tensor, q: Tensor, size: Tensor) -> Tensor:
    """Trilinear interpolation of ``volume: [1, 1, nz, ny, nx]`` at index positions ``q: [..., 3]``
    (clamped to the samples, as the field's edge values continue outwards)."""
    return grid_sample(volume, q * (2.0 / (size - 1.0)) - 1.0)


def grid_sample(volume: Tensor, g: Tensor) -> Tensor:
    """Trilinear ``volume: [1, 1, nz, ny, nx]`` at positions ``g: [..., 3]`` normalised to [-1, 1]."""
    out = F.grid_sample(volume, g.reshape(1, 1, 1, -1, 3), mode="bilinear",
                        padding_mode="border", align_corners=True)
    return out.reshape(g.shape[:-1])


def iso_bins(f: Tensor, isos: Tensor) -> Tensor:
    """How many iso values are <= f (int32, same shape as ``f``): a crossing changes it."""
    if isos.numel() == 1:
        return (f >= isos[0]).to(torch.int32)
    return torch.bucketize(f, isos, out_int32=True, right=True)


def as_volume(array: np.ndarray, device: torch.device) -> Tensor:
    """[nz, ny, nx] array -> [1, 1, nz, ny, nx] float32 on ``device`` (converted there, so a
    uint8 volume travels as uint8)."""
    arr = np.ascontiguousarray(array)
    if arr.dtype not in (np.uint8, np.int16, np.int32, np.float32):
        arr = arr.astype(np.float32)
    elif not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device).to(torch.float32)[None, None]


def prepare_field(data: np.ndarray, isos: Tensor, device: torch.device) -> Field:
    """Upload ``data: [nz, ny, nx]`` and build the macro-cell distance grid for ``isos: [I]``."""
    volume = as_volume(data, device)
    nz, ny, nx = volume.shape[2:]
    cells = torch.tensor([nx - 1, ny - 1, nz - 1])
    mdims = (cells + MACRO - 1) // MACRO
    # samples m*MACRO .. (m+1)*MACRO bound the trilinear field in macro cell m
    pad = [int(mdims[0] * MACRO - cells[0]), int(mdims[1] * MACRO - cells[1]), int(mdims[2] * MACRO - cells[2])]
    padded = F.pad(volume, (0, pad[0], 0, pad[1], 0, pad[2]), mode="replicate")
    hi = F.max_pool3d(padded, kernel_size=MACRO + 1, stride=MACRO)
    lo = -F.max_pool3d(-padded, kernel_size=MACRO + 1, stride=MACRO)
    del padded
    reach = (iso_bins(lo, isos) != iso_bins(hi, isos)).float()
    distance = torch.zeros_like(reach)
    for _ in range(SKIP_RADIUS_CAP):
        empty = reach == 0
        if not bool(empty.any()):
            break
        distance += empty
        reach = F.max_pool3d(reach, kernel_size=3, stride=1, padding=1)
    return Field(volume, torch.tensor([nx, ny, nz], dtype=torch.float32, device=device),
                 distance.reshape(-1), mdims.to(device=device, dtype=torch.float32),
                 dims=(int(nx), int(ny), int(nz)), macro=tuple(int(m) for m in mdims.tolist()))


@dataclass
class Cameras:
    """Per-camera quantities. axes: [C, 3, 3] maps a pixel position (u, v, 1) to the world
    direction of its ray (R^T K^-1: camera z grows by one per unit); centre: [C, 3] world position."""

    axes: Tensor
    centre: Tensor

    @classmethod
    def make(cls, viewmats: Tensor, Ks: Tensor) -> "Cameras":
        rot_t = viewmats[:, :3, :3].transpose(1, 2)                 # camera-to-world rotation
        centre = -(rot_t @ viewmats[:, :3, 3:])[..., 0]
        axes = rot_t @ torch.linalg.inv(Ks.double()).float()         # pixel (u, v, 1) -> world direction
        return cls(axes, centre)

    def rays(self, rays: Tensor, width: int, height: int, supersample: int) -> tuple[Tensor, Tensor]:
        """World origins [n, 3] and directions [n, 3] of rays numbered ``rays: [n]`` over
        [C, H, W, s*s]; a direction advances the camera z by one per unit of the ray parameter."""
        s2 = supersample * supersample
        pixel = torch.div(rays, s2, rounding_mode="floor")
        sub = rays - pixel * s2
        view = torch.div(pixel, width * height, rounding_mode="floor")
        yx = pixel - view * (width * height)
        row = torch.div(yx, width, rounding_mode="floor")
        sub_row = torch.div(sub, supersample, rounding_mode="floor")
        u = (yx - row * width).float() + ((sub - sub_row * supersample).float() + 0.5) / supersample
        v = row.float() + (sub_row.float() + 0.5) / supersample
        axes = self.axes[view]                                       # [n, 3, 3]
        direction = axes[:, :, 0] * u[:, None] + axes[:, :, 1] * v[:, None] + axes[:, :, 2]
        return self.centre[view], direction


@dataclass
class CastScene:
    """Everything a ray needs, on the device. Positions are in the block's local index space
    ``q = (world - origin) / spacing`` with ``origin`` the world position of ``data[0, 0, 0]``.
    ``bounds`` holds origin, spacing, box_lo, box_hi, domain_lo, domain_hi and ``rgb`` the colour as
    float32 values on the host, and ``cmap`` the colour map's positions [K] and colours [K, 3] on the
    device (:func:`.colormaps.colormap_tensors`): a kernel launch takes them as they are, without
    reading the device (which would wait for the views cast before) or copying to it (which waits
    too) for every group of views."""

    field: Field
    isos: Tensor               # [I] sorted
    origin: Tensor             # [3]
    spacing: Tensor            # [3]
    box_lo: Tensor             # [3] owned box, local index space
    box_hi: Tensor             # [3]
    domain_lo: Tensor          # [3] the whole domain's box, local index space
    domain_hi: Tensor          # [3]
    step: float                # march step, world units
    refine: int
    color: Tensor              # [3]
    color_volume: Tensor | None
    color_range: tuple[float, float]
    colormap: str
    bounds: tuple[float, ...]   # 18 values
    rgb: tuple[float, float, float]
    cmap: tuple[Tensor, Tensor]
    light: Light = HEADLIGHT


def prepare_scene(block: Block, isos: list[float], *, color, color_field: str | None,
                  color_range: tuple[float, float] | None, colormap: str, step: float, refine: int,
                  device: torch.device, value_range: tuple[float, float] | None = None,
                  light: Light = HEADLIGHT) -> CastScene:
    """The :class:`CastScene` of ``block`` for the sorted iso values ``isos`` (checked arguments of
    :func:`insitu.groundtruth.caster.raycast`): the field at unit size (any magnitude gives the same
    surface; by ``value_range``, the whole field's, when given), the colour field mapped to [0, 1] through
    ``color_range``."""
    data, unit_isos = unit_field(block.data, isos, value_range)  # any magnitude: the same surface at unit size
    iso_values = torch.tensor(unit_isos, dtype=torch.float32, device=device)
    field = prepare_field(data, iso_values, device)
    color_volume = (as_volume(unit_colors(block.fields[color_field], *color_range), device)
                    if color_field is not None else None)
    start = np.asarray(block.start, dtype=np.float64)
    host = lambda values: tuple(float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1))  # noqa: E731
    origin = np.asarray(block.origin, dtype=np.float64) + start * np.asarray(block.spacing)
    box = (np.asarray(block.owned_lo) - start, np.asarray(block.owned_hi) - start)
    domain = (-start, np.asarray(block.global_shape) - 1 - start)
    return CastScene(
        field=field,
        isos=iso_values,
        origin=torch.tensor(origin, dtype=torch.float32, device=device),
        spacing=torch.tensor(block.spacing, dtype=torch.float32, device=device),
        box_lo=torch.tensor(box[0], dtype=torch.float32, device=device),
        box_hi=torch.tensor(box[1], dtype=torch.float32, device=device),
        domain_lo=torch.tensor(domain[0], dtype=torch.float32, device=device),
        domain_hi=torch.tensor(domain[1], dtype=torch.float32, device=device),
        step=float(step) * float(min(block.spacing)),
        refine=int(refine),
        color=torch.tensor(color, dtype=torch.float32, device=device),
        color_volume=color_volume,
        color_range=(0.0, 1.0),                 # the colour field comes mapped to [0, 1] (unit_colors)
        colormap=colormap,
        bounds=host(np.concatenate([origin, np.asarray(block.spacing, np.float64), *box, *domain])),
        rgb=host(color),
        cmap=colormap_tensors(colormap, device),
        light=light,
    )
