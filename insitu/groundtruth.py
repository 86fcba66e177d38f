"""Ground-truth images: ray-cast a block's isosurface directly from its trilinear field.

No mesh is built. Every pixel shoots ``supersample x supersample`` rays on a regular
sub-pixel grid. A ray is clipped to the block's owned box, marched in steps of ``step``
voxels through the trilinear interpolant of the samples, its first crossing of any iso
value refined by bisection, and the hit shaded with a headlight Blinn-Phong model (solid
colour, or a second field mapped through a colour map). The image is premultiplied RGBA
with no background, plus the camera depth of the first hit, so the images of several
blocks composite sort-last (front to back) into the image of the whole domain.

Camera model as in :mod:`insitu.views`: ``viewmats [C, 4, 4]`` world-to-camera (OpenCV
axes), ``Ks [C, 3, 3]`` intrinsics in pixels, pixel ``(u, v)`` centred at ``(u + 0.5, v + 0.5)``.

Speed: rays are marched together as tensors. Empty space is skipped with a coarse grid
of macro cells (``MACRO`` voxels a side): a macro cell is *active* when the range of its
samples, which bounds the trilinear field everywhere inside it, brackets an iso value;
every other cell stores its Chebyshev distance to the nearest active one, so a ray in
empty space jumps over the whole empty cube of cells around it at once. The jump ends
exactly where the ray leaves that cube (the field's side of every iso value is known up
to there) and fine sampling resumes on the ray's sample lattice, so no crossing is
skipped and no dilation of the active cells is needed. Along each ray the samples lie at
multiples of the step from where the ray enters the whole domain, whatever box it was
clipped to, so blocks and the whole domain sample alike. Rays that hit or leave the box
are dropped from the working set after every pass.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .volume import Block, unit_colors, unit_field

try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None

MACRO = 8                 # voxels per macro-cell edge for empty-space skipping
SAMPLES_PER_PASS = 8      # fine samples a ray takes per marching pass ...
MAX_WIDENING = 4          # ... times up to 2**MAX_WIDENING as the active rays thin out
SKIP_RADIUS_CAP = 16      # largest empty-space distance stored, in macro cells
GRADIENT_STEP = 1.0       # central-difference offset for normals, in voxels

AMBIENT, DIFFUSE, SPECULAR, SHININESS = 0.15, 0.75, 0.25, 32

# Colour maps: (positions in [0, 1], RGB control colours), linearly interpolated.
# viridis: entries 0, 16, ..., 240, 255 of the 256-entry table of van der Walt & Smith (CC0).
_VIRIDIS_INDEX = (0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 255)
_VIRIDIS_RGB = (
    (0.267004, 0.004874, 0.329415), (0.282327, 0.094955, 0.417331), (0.278826, 0.175490, 0.483397),
    (0.258965, 0.251537, 0.524736), (0.229739, 0.322361, 0.545706), (0.199430, 0.387607, 0.554642),
    (0.172719, 0.448791, 0.557885), (0.149039, 0.508051, 0.557250), (0.127568, 0.566949, 0.550556),
    (0.120638, 0.625828, 0.533488), (0.157851, 0.683765, 0.501686), (0.246070, 0.738910, 0.452024),
    (0.369214, 0.788888, 0.382914), (0.515992, 0.831158, 0.294279), (0.678489, 0.863742, 0.189503),
    (0.845561, 0.887322, 0.099702), (0.993248, 0.906157, 0.143936),
)
COLORMAPS: dict[str, tuple[tuple[float, ...], tuple[tuple[float, float, float], ...]]] = {
    "viridis": (tuple(i / 255 for i in _VIRIDIS_INDEX), _VIRIDIS_RGB),
    "gray": ((0.0, 1.0), ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))),
}


def apply_colormap(values: Tensor, name: str = "viridis") -> Tensor:
    """Map ``values: [...]`` in [0, 1] (clamped) to colours ``[..., 3]`` through colour map ``name``."""
    if name not in COLORMAPS:
        raise ValueError(f"colormap: expected one of {sorted(COLORMAPS)}, got {name!r}")
    positions, colours = COLORMAPS[name]
    pos = torch.tensor(positions, dtype=torch.float32, device=values.device)
    rgb = torch.tensor(colours, dtype=torch.float32, device=values.device)
    v = values.to(torch.float32).clamp(0.0, 1.0)
    seg = torch.bucketize(v, pos[1:-1], right=True)             # segment 0 .. P-2
    w = ((v - pos[seg]) / (pos[seg + 1] - pos[seg])).unsqueeze(-1)
    return rgb[seg] + w * (rgb[seg + 1] - rgb[seg])


@dataclass
class _Field:
    """A block's samples on the device, with what marching needs to know about them.

    volume:     [1, 1, nz, ny, nx] samples (ghosts included), float32.
    size:       [3] samples per axis (x, y, z), float32.
    distance:   [mz * my * mx] Chebyshev distance of each macro cell to the nearest active
                one, in macro cells, capped at SKIP_RADIUS_CAP; 0 for active cells. float32.
    macro_dims: [3] macro cells per axis (x, y, z), float32.
    """

    volume: Tensor
    size: Tensor
    distance: Tensor
    macro_dims: Tensor

    def sample(self, q: Tensor) -> Tensor:
        """Trilinear field at local index positions ``q: [..., 3]`` (x, y, z) -> ``[...]``."""
        return _trilinear(self.volume, q, self.size)


def _trilinear(volume: Tensor, q: Tensor, size: Tensor) -> Tensor:
    """Trilinear interpolation of ``volume: [1, 1, nz, ny, nx]`` at index positions ``q: [..., 3]``
    (clamped to the samples, as the field's edge values continue outwards)."""
    return _grid_sample(volume, q * (2.0 / (size - 1.0)) - 1.0)


def _grid_sample(volume: Tensor, g: Tensor) -> Tensor:
    """Trilinear ``volume: [1, 1, nz, ny, nx]`` at positions ``g: [..., 3]`` normalised to [-1, 1]."""
    out = F.grid_sample(volume, g.reshape(1, 1, 1, -1, 3), mode="bilinear",
                        padding_mode="border", align_corners=True)
    return out.reshape(g.shape[:-1])


def _as_volume(array: np.ndarray, device: torch.device) -> Tensor:
    """[nz, ny, nx] array -> [1, 1, nz, ny, nx] float32 on ``device`` (converted there, so a
    uint8 volume travels as uint8)."""
    arr = np.ascontiguousarray(array)
    if arr.dtype not in (np.uint8, np.int16, np.int32, np.float32):
        arr = arr.astype(np.float32)
    elif not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device).to(torch.float32)[None, None]


def _prepare_field(data: np.ndarray, isos: Tensor, device: torch.device) -> _Field:
    """Upload ``data: [nz, ny, nx]`` and build the macro-cell distance grid for ``isos: [I]``."""
    volume = _as_volume(data, device)
    nz, ny, nx = volume.shape[2:]
    cells = torch.tensor([nx - 1, ny - 1, nz - 1])
    mdims = (cells + MACRO - 1) // MACRO
    # samples m*MACRO .. (m+1)*MACRO bound the trilinear field in macro cell m
    pad = [int(mdims[0] * MACRO - cells[0]), int(mdims[1] * MACRO - cells[1]), int(mdims[2] * MACRO - cells[2])]
    padded = F.pad(volume, (0, pad[0], 0, pad[1], 0, pad[2]), mode="replicate")
    hi = F.max_pool3d(padded, kernel_size=MACRO + 1, stride=MACRO)
    lo = -F.max_pool3d(-padded, kernel_size=MACRO + 1, stride=MACRO)
    del padded
    reach = (_bins(lo, isos) != _bins(hi, isos)).float()
    distance = torch.zeros_like(reach)
    for _ in range(SKIP_RADIUS_CAP):
        empty = reach == 0
        if not bool(empty.any()):
            break
        distance += empty
        reach = F.max_pool3d(reach, kernel_size=3, stride=1, padding=1)
    return _Field(volume, torch.tensor([nx, ny, nz], dtype=torch.float32, device=device),
                  distance.reshape(-1), mdims.to(device=device, dtype=torch.float32))


def _check_inputs(block: Block, viewmats: Tensor, Ks: Tensor, width: int, height: int, iso,
                  color, color_field, color_range, colormap, supersample, step, refine, chunk_rays) -> list[float]:
    if not isinstance(viewmats, Tensor) or viewmats.ndim != 3 or tuple(viewmats.shape[1:]) != (4, 4):
        raise ValueError(f"viewmats: expected a tensor of shape [C, 4, 4], got "
                         f"{tuple(viewmats.shape) if isinstance(viewmats, Tensor) else type(viewmats).__name__}")
    if not isinstance(Ks, Tensor) or Ks.ndim != 3 or tuple(Ks.shape[1:]) != (3, 3):
        raise ValueError(f"Ks: expected a tensor of shape [C, 3, 3], got "
                         f"{tuple(Ks.shape) if isinstance(Ks, Tensor) else type(Ks).__name__}")
    if viewmats.shape[0] != Ks.shape[0] or viewmats.shape[0] == 0:
        raise ValueError(f"viewmats/Ks: expected the same number C >= 1 of cameras, "
                         f"got {viewmats.shape[0]} and {Ks.shape[0]}")
    last_row = Ks[:, 2].detach().cpu().double()
    if not torch.equal(last_row, torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64).expand_as(last_row)):
        raise ValueError(f"Ks: expected pinhole intrinsics with last row (0, 0, 1), got {last_row[0].tolist()}")
    if not bool((torch.linalg.det(Ks.detach().cpu().double()) != 0).all()):
        raise ValueError("Ks: expected invertible intrinsics (fx, fy != 0)")
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}: expected an integer > 0, got {value!r}")
    if isinstance(supersample, bool) or not isinstance(supersample, (int, np.integer)) or supersample < 1:
        raise ValueError(f"supersample: expected an integer >= 1, got {supersample!r}")
    if isinstance(refine, bool) or not isinstance(refine, (int, np.integer)) or refine < 0:
        raise ValueError(f"refine: expected an integer >= 0, got {refine!r}")
    if isinstance(step, bool) or not (isinstance(step, (int, float, np.number)) and 0 < step <= MACRO):
        raise ValueError(f"step: expected a march step in (0, {MACRO}] voxels, got {step!r}")
    if isinstance(chunk_rays, bool) or not isinstance(chunk_rays, (int, np.integer)) or chunk_rays < 1:
        raise ValueError(f"chunk_rays: expected an integer >= 1, got {chunk_rays!r}")
    isos = [iso] if isinstance(iso, (int, float, np.number)) else list(iso)
    if not isos:
        raise ValueError("iso: expected at least one iso value, got an empty sequence")
    try:
        isos = [float(v) for v in isos]
    except (TypeError, ValueError):
        raise ValueError(f"iso: expected a number or a sequence of numbers, got {iso!r}") from None
    if not all(math.isfinite(v) for v in isos):
        raise ValueError(f"iso: expected finite values, got {isos}")
    data = np.asarray(block.data)
    if data.ndim != 3 or min(data.shape) < 2:
        raise ValueError(f"block.data: expected a 3D array [nz, ny, nx] with >= 2 samples per axis, "
                         f"got shape {data.shape}")
    size = np.array(block.shape_xyz)
    lo = np.asarray(block.owned_lo) - np.asarray(block.start)
    hi = np.asarray(block.owned_hi) - np.asarray(block.start)
    if np.any(lo < 0) or np.any(hi > size - 1) or np.any(hi <= lo):
        raise ValueError(f"block: owned cells {tuple(block.owned_lo)}..{tuple(block.owned_hi)} must be a "
                         f"non-empty box inside the samples held, {tuple(block.start)} + {tuple(size)}")
    if np.any(np.asarray(block.spacing, dtype=np.float64) <= 0):
        raise ValueError(f"block.spacing: expected 3 values > 0, got {block.spacing}")
    if color_field is None:
        rgb = np.asarray(color, dtype=np.float64)
        if rgb.shape != (3,) or not np.all((rgb >= 0) & (rgb <= 1)):
            raise ValueError(f"color: expected 3 values in [0, 1], got {color!r}")
    else:
        if color_field not in block.fields:
            raise ValueError(f"color_field: no field {color_field!r} in the block; "
                             f"available: {sorted(block.fields) or 'none'}")
        if np.shape(block.fields[color_field]) != data.shape:
            raise ValueError(f"color_field {color_field!r}: expected the shape of the block's data "
                             f"{data.shape}, got {np.shape(block.fields[color_field])}")
        if color_range is None or len(color_range) != 2:
            raise ValueError(f"color_range: expected (lo, hi), the global range of {color_field!r}, "
                             f"got {color_range!r}")
        c_lo, c_hi = (float(v) for v in color_range)
        if not (math.isfinite(c_lo) and math.isfinite(c_hi) and c_hi >= c_lo):
            raise ValueError(f"color_range: expected finite lo <= hi, got {color_range!r}")
        if colormap not in COLORMAPS:
            raise ValueError(f"colormap: expected one of {sorted(COLORMAPS)}, got {colormap!r}")
    return sorted(set(isos))


def raycast(block: Block, viewmats: Tensor, Ks: Tensor, width: int, height: int, iso: float | Sequence[float], *,
            color=(0.85, 0.8, 0.7), color_field: str | None = None, color_range: tuple[float, float] | None = None,
            colormap: str = "viridis", supersample: int = 2, step: float = 0.5, refine: int = 6,
            device: str | torch.device | None = None, chunk_rays: int = 1 << 22,
            progress: Callable[[int, int], None] | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Ray-cast the isosurface(s) of ``block``'s field, inside its owned box, for C cameras.

    Args:
        block: the field with its ghost layers; only the surface inside ``block.box`` is drawn,
            the ghosts serve interpolation and gradients at the box faces.
        viewmats: [C, 4, 4] world-to-camera matrices (OpenCV axes).
        Ks: [C, 3, 3] intrinsics in pixels.
        width, height: image size in pixels.
        iso: one iso value or several; a ray stops at the first crossing of any of them.
        color: surface RGB in [0, 1] when no ``color_field`` is given.
        color_field: name of a field in ``block.fields`` that colours the surface through
            ``colormap``, normalised by ``color_range`` (required then: the global (lo, hi); a
            constant field, lo == hi, is the colour map's middle colour).
        colormap: a name in ``COLORMAPS``.
        supersample: rays per pixel along each axis (regular sub-pixel grid).
        step: march step in voxels (units of the smallest spacing), in (0, MACRO].
        refine: bisection steps on each crossing (a secant step follows).
        device: where to compute and return; default the device of ``viewmats``.
        chunk_rays: rays marched together, bounding memory (about 300 bytes a ray at the peak);
            large chunks keep the GPU busy: a chunk takes as many passes as its longest ray.
        progress: called as ``progress(views_done, C)`` each time a view is complete.
        backend: "triton" (one fused kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``),
            "torch" (the reference: rays marched as tensors, in chunks of ``chunk_rays``),
            or "auto": triton on CUDA devices when Triton is installed, torch elsewhere.

    Returns:
        rgba: [C, H, W, 4] premultiplied colour and coverage (alpha = fraction of rays that hit), float32.
        depth: [C, H, W] camera z of the nearest hit among a pixel's rays, +inf where none hit.
    """
    return next(iter(raycast_views(block, viewmats, Ks, width, height, iso, views_per_call=len(viewmats),
                                   color=color, color_field=color_field, color_range=color_range,
                                   colormap=colormap, supersample=supersample, step=step, refine=refine,
                                   device=device, chunk_rays=chunk_rays, progress=progress,
                                   backend=backend)))[1:]


def raycast_views(block: Block, viewmats: Tensor, Ks: Tensor, width: int, height: int,
                  iso: float | Sequence[float], *, views_per_call: int, color=(0.85, 0.8, 0.7),
                  color_field: str | None = None, color_range: tuple[float, float] | None = None,
                  colormap: str = "viridis", supersample: int = 2, step: float = 0.5, refine: int = 6,
                  device: str | torch.device | None = None, chunk_rays: int = 1 << 22,
                  progress: Callable[[int, int], None] | None = None, backend: str = "auto"):
    """:func:`raycast` for ``views_per_call`` views at a time, the field prepared once.

    Yields ``(ids [c], rgba [c, H, W, 4], depth [c, H, W])`` for consecutive groups of the
    C cameras (``ids`` on the device), so that the caller can use each group before the next
    one is drawn. Arguments as in :func:`raycast`.
    """
    isos_list = _check_inputs(block, viewmats, Ks, width, height, iso, color, color_field, color_range,
                              colormap, supersample, step, refine, chunk_rays)
    if isinstance(views_per_call, bool) or not isinstance(views_per_call, (int, np.integer)) or views_per_call < 1:
        raise ValueError(f"views_per_call: expected an integer >= 1, got {views_per_call!r}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    device = torch.device(device) if device is not None else viewmats.device
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton is not None else "torch"
    if backend == "triton" and triton is None:
        raise ValueError("backend: 'triton' needs the triton package (it ships with CUDA builds of torch)")
    data, unit_isos = unit_field(block.data, isos_list)         # any magnitude: the same surface at unit size
    isos = torch.tensor(unit_isos, dtype=torch.float32, device=device)
    field = _prepare_field(data, isos, device)
    color_volume = (_as_volume(unit_colors(block.fields[color_field], *color_range), device)
                    if color_field is not None else None)
    start = np.asarray(block.start, dtype=np.float64)
    scene = _Scene(
        field=field,
        isos=isos,
        origin=torch.tensor(np.asarray(block.origin, dtype=np.float64) + start * np.asarray(block.spacing),
                            dtype=torch.float32, device=device),
        spacing=torch.tensor(block.spacing, dtype=torch.float32, device=device),
        box_lo=torch.tensor(np.asarray(block.owned_lo) - start, dtype=torch.float32, device=device),
        box_hi=torch.tensor(np.asarray(block.owned_hi) - start, dtype=torch.float32, device=device),
        domain_lo=torch.tensor(-start, dtype=torch.float32, device=device),
        domain_hi=torch.tensor(np.asarray(block.global_shape) - 1 - start, dtype=torch.float32, device=device),
        step=float(step) * float(min(block.spacing)),
        refine=int(refine),
        color=torch.tensor(color, dtype=torch.float32, device=device),
        color_volume=color_volume,
        color_range=(0.0, 1.0),                 # the colour field comes mapped to [0, 1] (unit_colors)
        colormap=colormap,
    )
    all_cams = _Cameras.make(viewmats.to(device=device, dtype=torch.float32),
                             Ks.to(device=device, dtype=torch.float32))
    C = viewmats.shape[0]
    for v0 in range(0, C, int(views_per_call)):
        ids = torch.arange(v0, min(C, v0 + int(views_per_call)), device=device)
        cams = _Cameras(all_cams.axes[ids], all_cams.centre[ids])
        if backend == "triton":
            rgba, depth = _raycast_triton(scene, cams, int(width), int(height), int(supersample))
            if progress is not None:
                for done in range(v0 + 1, v0 + len(ids) + 1):
                    progress(done, C)
        else:
            shift = (lambda d, n, v0=v0: progress(v0 + d, C)) if progress is not None else None
            rgba, depth = _raycast_torch(scene, cams, int(width), int(height), int(supersample),
                                         int(chunk_rays), shift)
        yield ids, rgba, depth


def _raycast_torch(scene: "_Scene", cams: "_Cameras", W: int, H: int, supersample: int, chunk_rays: int,
                   progress: Callable[[int, int], None] | None) -> tuple[Tensor, Tensor]:
    """rgba [C, H, W, 4] and depth [C, H, W] of ``cams``, rays marched as tensors in chunks."""
    device = cams.axes.device
    C, s2 = cams.axes.shape[0], supersample ** 2
    n_pixels = C * H * W
    rgba = torch.zeros(n_pixels, 4, dtype=torch.float32, device=device)
    depth = torch.full((n_pixels,), math.inf, dtype=torch.float32, device=device)
    chunk_pixels = max(1, int(chunk_rays) // s2)
    views_done = 0
    for p0 in range(0, n_pixels, chunk_pixels):
        p1 = min(n_pixels, p0 + chunk_pixels)
        rays = torch.arange(p0 * s2, p1 * s2, device=device)
        origin, direction = cams.rays(rays, W, H, int(supersample))
        rgb, t = _cast(scene, origin, direction)
        hit = torch.isfinite(t)
        rgba[p0:p1, :3] = rgb.reshape(-1, s2, 3).mean(1)
        rgba[p0:p1, 3] = hit.reshape(-1, s2).float().mean(1)
        depth[p0:p1] = t.reshape(-1, s2).amin(1)
        if progress is not None:
            while views_done < p1 // (H * W):
                views_done += 1
                progress(views_done, C)
    return rgba.reshape(C, H, W, 4), depth.reshape(C, H, W)


@dataclass
class _Cameras:
    """Per-camera quantities. axes: [C, 3, 3] maps a pixel position (u, v, 1) to the world
    direction of its ray (R^T K^-1: camera z grows by one per unit); centre: [C, 3] world position."""

    axes: Tensor
    centre: Tensor

    @classmethod
    def make(cls, viewmats: Tensor, Ks: Tensor) -> "_Cameras":
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
class _Scene:
    """Everything a ray needs, on the device. Positions are in the block's local index space
    ``q = (world - origin) / spacing`` with ``origin`` the world position of ``data[0, 0, 0]``."""

    field: _Field
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


def _cast(scene: _Scene, origin: Tensor, direction: Tensor) -> tuple[Tensor, Tensor]:
    """Shade rays ``origin, direction: [n, 3]`` (world): returns rgb [n, 3] (0 where no hit)
    and the ray parameter (camera z) of the hit [n] (+inf where none)."""
    n = origin.shape[0]
    device = origin.device
    rgb = torch.zeros(n, 3, dtype=torch.float32, device=device)
    depth = torch.full((n,), math.inf, dtype=torch.float32, device=device)
    qo = (origin - scene.origin) / scene.spacing
    qd = direction / scene.spacing
    qd = torch.where(qd.abs() < 1e-12, torch.full_like(qd, 1e-12), qd)
    t_enter, t_exit = _slab(qo, qd, scene.box_lo, scene.box_hi)
    inside = torch.nonzero(t_exit > t_enter).squeeze(1)
    if inside.numel() == 0:
        return rgb, depth
    qo, qd, t_enter, t_exit = qo[inside], qd[inside], t_enter[inside], t_exit[inside]
    dt = scene.step / direction[inside].norm(dim=1)
    # samples lie at t0 + k * dt, t0 where the ray enters the whole domain: the same for every block
    t0 = torch.minimum(_slab(qo, qd, scene.domain_lo, scene.domain_hi)[0], t_enter)
    b0 = _bins(scene.field.sample(qo + t_enter[:, None] * qd), scene.isos).float()
    k0 = torch.floor((t_enter - t0) / dt)
    state = torch.cat([qo, qd, dt[:, None], t0[:, None], t_enter[:, None], k0[:, None], t_exit[:, None],
                       b0[:, None]], 1)
    ray, ta, tb, iso_idx = _march(scene, state)
    if ray.numel() == 0:
        return rgb, depth
    qo, qd = qo[ray], qd[ray]
    t = _refine(scene, qo, qd, ta, tb, scene.isos[iso_idx])
    rows = inside[ray]
    rgb[rows] = _shade(scene, qo, qd, t)
    depth[rows] = t
    return rgb, depth


# columns of the marching state
_QO, _QD, _DT, _T0, _T, _K, _TEXIT, _BIN = slice(0, 3), slice(3, 6), 6, 7, 8, 9, 10, 11


def _slab(qo: Tensor, qd: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Where rays ``qo + t * qd`` ([n, 3] each, no zero in qd) enter and leave the box lo..hi
    ([3] each), entry clamped to t >= 0: t_enter, t_exit [n]; they miss it if t_exit <= t_enter."""
    t1 = (lo - qo) / qd
    t2 = (hi - qo) / qd
    return torch.minimum(t1, t2).amax(1).clamp_min(0.0), torch.maximum(t1, t2).amin(1)


def _bins(f: Tensor, isos: Tensor) -> Tensor:
    """How many iso values are <= f (int32, same shape as ``f``): a crossing changes it."""
    if isos.numel() == 1:
        return (f >= isos[0]).to(torch.int32)
    return torch.bucketize(f, isos, out_int32=True, right=True)


def _march(scene: _Scene, state: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """March rays to their first iso crossing.

    state: [n, 12] per ray: qo (3), qd (3) local-index origin and direction, dt (march step in
    the ray parameter), t0 (where the ray enters the whole domain), t (current position), k (its
    lattice index: samples lie at t0 + k * dt, so they do not depend on the box the ray was
    clipped to), t_exit, and the bin of the field at t (how many iso values are <= f).

    Returns, for the rays that cross: their rows in ``state`` [h], the bracket ta, tb [h] and
    the index of the iso value crossed [h].
    """
    field, isos = scene.field, scene.isos
    device = state.device
    ray = torch.arange(state.shape[0], device=device)
    offsets = torch.arange(1, SAMPLES_PER_PASS * 2 ** MAX_WIDENING + 1, dtype=torch.float32, device=device)
    n_start = max(1, state.shape[0])
    mdims = field.macro_dims
    scale = 2.0 / (field.size - 1.0)
    found: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    # every pass moves a ray SAMPLES_PER_PASS lattice steps on (or more): a bound on the passes
    longest = float(((state[:, _TEXIT] - state[:, _T]) / state[:, _DT]).max()) if state.shape[0] else 0.0
    for _ in range(int(longest) // SAMPLES_PER_PASS + 3):
        if ray.numel() == 0:
            break
        # as rays finish, the rest take more samples per pass: fewer passes, same work per pass
        widen = min(MAX_WIDENING, max(0, int(math.log2(n_start / ray.numel()))))
        steps = offsets[:SAMPLES_PER_PASS << widen]
        qo, qd, dt = state[:, _QO], state[:, _QD], state[:, _DT]
        t0, t, k, t_exit = state[:, _T0], state[:, _T], state[:, _K], state[:, _TEXIT]
        b0 = state[:, _BIN].to(torch.int32)
        # 1. empty space: jump out of the empty cube of macro cells around the current one
        cell = torch.minimum(torch.floor((qo + t[:, None] * qd) / MACRO).clamp_min(0.0), mdims - 1)
        lin = (cell[:, 0] + mdims[0] * (cell[:, 1] + mdims[1] * cell[:, 2])).long()
        dist = field.distance[lin]
        radius = (dist - 1.0).clamp_min(0.0)[:, None]
        bound = torch.where(qd > 0, (cell + radius + 1.0) * MACRO, (cell - radius) * MACRO)
        t_leave = ((bound - qo) / qd).amin(1)
        # the field keeps one side of every iso value from t to t_leave: its bin holds there
        empty = dist > 0
        t = torch.where(empty, torch.minimum(torch.maximum(t_leave, t), t_exit), t)
        k = torch.where(empty, torch.maximum(torch.floor((t - t0) / dt), k), k)
        # 2. fine samples on the lattice
        kk = k[:, None] + steps
        tt = torch.minimum(torch.addcmul(t0[:, None], kk, dt[:, None]), t_exit[:, None])
        go, gd = qo * scale - 1.0, qd * scale                        # normalised grid coordinates
        fs = _grid_sample(field.volume, torch.addcmul(go[:, None, :], tt[:, :, None], gd[:, None, :]))
        bins = _bins(fs, isos)
        change = bins != b0[:, None]               # the first change is the first crossing
        crossed = change.any(1)
        hit = torch.nonzero(crossed).squeeze(1)
        if hit.numel():
            j = change[hit].to(torch.uint8).argmax(1, keepdim=True)
            t_all = torch.cat([t[hit, None], tt[hit]], 1)
            b_a = b0[hit]
            b_b = bins[hit].gather(1, j)[:, 0]
            found.append((ray[hit], t_all.gather(1, j)[:, 0], t_all.gather(1, j + 1)[:, 0],
                          torch.where(b_b > b_a, b_a, b_a - 1).long()))
        go_on = torch.nonzero(~crossed & (tt[:, -1] < t_exit)).squeeze(1)
        state[:, _T] = tt[:, -1]
        state[:, _K] = kk[:, -1]
        state[:, _BIN] = bins[:, -1].float()
        state = state[go_on]
        ray = ray[go_on]
    if not found:
        empty_f = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(0, dtype=torch.long, device=device), empty_f, empty_f, torch.zeros(0, dtype=torch.long,
                                                                                                device=device)
    rays, ta, tb, iso_idx = (torch.cat(parts) for parts in zip(*found))
    return rays, ta, tb, iso_idx


def _refine(scene: _Scene, qo: Tensor, qd: Tensor, ta: Tensor, tb: Tensor, iso: Tensor) -> Tensor:
    """Bisection then a secant step on brackets ``[ta, tb]`` ([h] each) of rays ``qo, qd: [h, 3]``
    around the crossing of ``iso: [h]``; returns the ray parameter of the crossing [h]."""
    sample = scene.field.sample
    fa = sample(qo + ta[:, None] * qd)
    fb = sample(qo + tb[:, None] * qd)
    side_a = fa >= iso
    for _ in range(scene.refine):
        tm = 0.5 * (ta + tb)
        fm = sample(qo + tm[:, None] * qd)
        same = (fm >= iso) == side_a
        ta, fa = torch.where(same, tm, ta), torch.where(same, fm, fa)
        tb, fb = torch.where(same, tb, tm), torch.where(same, fb, fm)
    denom = fb - fa
    w = torch.where(denom != 0, (iso - fa) / torch.where(denom != 0, denom, torch.ones_like(denom)),
                    torch.full_like(denom, 0.5)).clamp(0.0, 1.0)
    return ta + w * (tb - ta)


def _shade(scene: _Scene, qo: Tensor, qd: Tensor, t: Tensor) -> Tensor:
    """Headlight Blinn-Phong colour [h, 3] of the hits at ray parameter ``t: [h]``."""
    field = scene.field
    q = qo + t[:, None] * qd
    eye = torch.eye(3, dtype=torch.float32, device=q.device) * GRADIENT_STEP
    top = field.size - 1.0
    q_plus = torch.minimum(q[:, None, :] + eye, top)            # [h, 3 offsets, 3 coords]
    q_minus = (q[:, None, :] - eye).clamp_min(0.0)
    span = (q_plus - q_minus).diagonal(dim1=1, dim2=2)          # [h, 3]
    grad = (field.sample(q_plus) - field.sample(q_minus)) / (span * scene.spacing)
    view = -qd * scene.spacing
    view = view / view.norm(dim=1, keepdim=True)
    norm = grad.norm(dim=1, keepdim=True)
    normal = torch.where(norm > 0, grad / norm.clamp_min(1e-30), view)
    cos = (normal * view).sum(1).abs().clamp(max=1.0)          # normal flipped to face the camera
    # light at the eye: l = v, so h = v and n.h = n.l
    intensity = AMBIENT + DIFFUSE * cos + SPECULAR * cos.pow(SHININESS)
    if scene.color_volume is None:
        base = scene.color.expand(q.shape[0], 3)
    else:
        lo, hi = scene.color_range
        value = _trilinear(scene.color_volume, q, field.size)
        base = apply_colormap((value - lo) / (hi - lo), scene.colormap)
    return (base * intensity[:, None]).clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The same ray caster as one Triton kernel (CUDA): a program marches BLOCK pixels of one view,
# their supersample rays one after the other, each to its first crossing, refines and shades
# it in registers and writes the pixel's averaged RGBA and nearest depth. Same lattice, same
# empty-space jumps (checked before every sample instead of every pass: the jumps are exact,
# so the samples taken outside skipped space are the same), same bisection, secant and shading.

if triton is not None:
    @triton.jit
    def _tri_sample(vol, qx, qy, qz, nx, ny, nz):
        """Trilinear field at index positions (qx, qy, qz), clamped to the samples (border)."""
        x = tl.minimum(tl.maximum(qx, 0.0), (nx - 1).to(tl.float32))
        y = tl.minimum(tl.maximum(qy, 0.0), (ny - 1).to(tl.float32))
        z = tl.minimum(tl.maximum(qz, 0.0), (nz - 1).to(tl.float32))
        x0 = tl.minimum(x.to(tl.int32), nx - 2)
        y0 = tl.minimum(y.to(tl.int32), ny - 2)
        z0 = tl.minimum(z.to(tl.int32), nz - 2)
        fx = x - x0.to(tl.float32)
        fy = y - y0.to(tl.float32)
        fz = z - z0.to(tl.float32)
        i = (z0 * ny + y0) * nx + x0
        sxy = nx * ny
        v000 = tl.load(vol + i)
        v001 = tl.load(vol + i + 1)
        v010 = tl.load(vol + i + nx)
        v011 = tl.load(vol + i + nx + 1)
        v100 = tl.load(vol + i + sxy)
        v101 = tl.load(vol + i + sxy + 1)
        v110 = tl.load(vol + i + sxy + nx)
        v111 = tl.load(vol + i + sxy + nx + 1)
        c00 = v000 + fx * (v001 - v000)
        c01 = v010 + fx * (v011 - v010)
        c10 = v100 + fx * (v101 - v100)
        c11 = v110 + fx * (v111 - v110)
        c0 = c00 + fy * (c01 - c00)
        c1 = c10 + fy * (c11 - c10)
        return c0 + fz * (c1 - c0)

    @triton.jit
    def _tri_bins(f, isos, n_iso):
        """How many iso values are <= f."""
        b = tl.zeros(f.shape, dtype=tl.int32)
        for j in range(n_iso):
            b += (f >= tl.load(isos + j)).to(tl.int32)
        return b

    # integers that are 1 (one subsample, a one-cell macro grid) must stay integers, not constants
    @triton.jit(do_not_specialize=["nx", "ny", "nz", "mx", "my", "mz", "S"])
    def _raycast_kernel(vol, dist, isos, n_iso, cams, rgba_out, depth_out,
                        nx, ny, nz, mx, my, mz,
                        ox, oy, oz, spx, spy, spz,
                        blx, bly, blz, bhx, bhy, bhz, dlx, dly, dlz, dhx, dhy, dhz,
                        step, width, height, S,
                        cr, cg, cb, cvol, cmap_pos, cmap_rgb, n_cmap, c_lo, c_hi,
                        REFINE: tl.constexpr, HAS_CFIELD: tl.constexpr, BLOCK: tl.constexpr):
        view = tl.program_id(1)
        pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        pix_ok = pix < width * height
        row = pix // width
        col = pix - row * width
        cam = cams + view * 12
        a00, a01, a02 = tl.load(cam + 0), tl.load(cam + 1), tl.load(cam + 2)
        a10, a11, a12 = tl.load(cam + 3), tl.load(cam + 4), tl.load(cam + 5)
        a20, a21, a22 = tl.load(cam + 6), tl.load(cam + 7), tl.load(cam + 8)
        cx, cy, cz = tl.load(cam + 9), tl.load(cam + 10), tl.load(cam + 11)
        qox = (cx - ox) / spx
        qoy = (cy - oy) / spy
        qoz = (cz - oz) / spz
        rgb_r = tl.zeros((BLOCK,), dtype=tl.float32)
        rgb_g = tl.zeros((BLOCK,), dtype=tl.float32)
        rgb_b = tl.zeros((BLOCK,), dtype=tl.float32)
        hits = tl.zeros((BLOCK,), dtype=tl.float32)
        near = tl.full((BLOCK,), float("inf"), dtype=tl.float32)
        fmx = mx.to(tl.float32)
        fmy = my.to(tl.float32)
        fmz = mz.to(tl.float32)
        for s in range(S * S):
            sr = s // S
            u = col.to(tl.float32) + ((s - sr * S).to(tl.float32) + 0.5) / S
            v = row.to(tl.float32) + (sr.to(tl.float32) + 0.5) / S
            dx = a00 * u + a01 * v + a02
            dy = a10 * u + a11 * v + a12
            dz = a20 * u + a21 * v + a22
            qdx = dx / spx
            qdy = dy / spy
            qdz = dz / spz
            qdx = tl.where(tl.abs(qdx) < 1e-12, 1e-12, qdx)
            qdy = tl.where(tl.abs(qdy) < 1e-12, 1e-12, qdy)
            qdz = tl.where(tl.abs(qdz) < 1e-12, 1e-12, qdz)
            # the owned box, and the whole domain (where the sample lattice starts)
            t1x, t2x = (blx - qox) / qdx, (bhx - qox) / qdx
            t1y, t2y = (bly - qoy) / qdy, (bhy - qoy) / qdy
            t1z, t2z = (blz - qoz) / qdz, (bhz - qoz) / qdz
            t_enter = tl.maximum(tl.maximum(tl.maximum(tl.minimum(t1x, t2x), tl.minimum(t1y, t2y)),
                                            tl.minimum(t1z, t2z)), 0.0)
            t_exit = tl.minimum(tl.minimum(tl.maximum(t1x, t2x), tl.maximum(t1y, t2y)), tl.maximum(t1z, t2z))
            u1x, u2x = (dlx - qox) / qdx, (dhx - qox) / qdx
            u1y, u2y = (dly - qoy) / qdy, (dhy - qoy) / qdy
            u1z, u2z = (dlz - qoz) / qdz, (dhz - qoz) / qdz
            t_dom = tl.maximum(tl.maximum(tl.maximum(tl.minimum(u1x, u2x), tl.minimum(u1y, u2y)),
                                          tl.minimum(u1z, u2z)), 0.0)
            t0 = tl.minimum(t_dom, t_enter)
            dt = step / tl.sqrt(dx * dx + dy * dy + dz * dz)
            active = pix_ok & (t_exit > t_enter)
            b0 = _tri_bins(_tri_sample(vol, qox + t_enter * qdx, qoy + t_enter * qdy, qoz + t_enter * qdz,
                                       nx, ny, nz), isos, n_iso)
            k = tl.floor((t_enter - t0) / dt)
            t = t_enter
            hit = tl.zeros((BLOCK,), dtype=tl.int1)
            ta = t
            tb = t
            iso_i = tl.zeros((BLOCK,), dtype=tl.int32)
            while tl.max(active.to(tl.int32), axis=0) > 0:
                # empty space: jump out of the empty cube of macro cells around the current one
                px = qox + t * qdx
                py = qoy + t * qdy
                pz = qoz + t * qdz
                cellx = tl.minimum(tl.maximum(tl.floor(px / 8.0), 0.0), fmx - 1.0)
                celly = tl.minimum(tl.maximum(tl.floor(py / 8.0), 0.0), fmy - 1.0)
                cellz = tl.minimum(tl.maximum(tl.floor(pz / 8.0), 0.0), fmz - 1.0)
                lin = (cellx + fmx * (celly + fmy * cellz)).to(tl.int32)
                d = tl.load(dist + lin, mask=active, other=0.0)
                radius = tl.maximum(d - 1.0, 0.0)
                bx = tl.where(qdx > 0, (cellx + radius + 1.0) * 8.0, (cellx - radius) * 8.0)
                by = tl.where(qdy > 0, (celly + radius + 1.0) * 8.0, (celly - radius) * 8.0)
                bz = tl.where(qdz > 0, (cellz + radius + 1.0) * 8.0, (cellz - radius) * 8.0)
                t_leave = tl.minimum(tl.minimum((bx - qox) / qdx, (by - qoy) / qdy), (bz - qoz) / qdz)
                empty = d > 0
                t = tl.where(empty, tl.minimum(tl.maximum(t_leave, t), t_exit), t)
                k = tl.where(empty, tl.maximum(tl.floor((t - t0) / dt), k), k)
                # one fine sample on the lattice
                k = k + 1.0
                tn = tl.minimum(t0 + k * dt, t_exit)
                f = _tri_sample(vol, qox + tn * qdx, qoy + tn * qdy, qoz + tn * qdz, nx, ny, nz)
                b = _tri_bins(f, isos, n_iso)
                crossed = active & (b != b0)
                ta = tl.where(crossed, t, ta)
                tb = tl.where(crossed, tn, tb)
                iso_i = tl.where(crossed, tl.where(b > b0, b0, b0 - 1), iso_i)
                hit = hit | crossed
                t = tn
                active = active & ~crossed & (tn < t_exit)
            # bisection, then a secant step
            iso = tl.load(isos + iso_i, mask=hit, other=0.0)
            fa = _tri_sample(vol, qox + ta * qdx, qoy + ta * qdy, qoz + ta * qdz, nx, ny, nz)
            fb = _tri_sample(vol, qox + tb * qdx, qoy + tb * qdy, qoz + tb * qdz, nx, ny, nz)
            side_a = fa >= iso
            for _ in tl.static_range(REFINE):
                tm = 0.5 * (ta + tb)
                fm = _tri_sample(vol, qox + tm * qdx, qoy + tm * qdy, qoz + tm * qdz, nx, ny, nz)
                same = (fm >= iso) == side_a
                ta = tl.where(same, tm, ta)
                fa = tl.where(same, fm, fa)
                tb = tl.where(same, tb, tm)
                fb = tl.where(same, fb, fm)
            den = fb - fa
            w = tl.where(den != 0, (iso - fa) / tl.where(den != 0, den, 1.0), 0.5)
            w = tl.minimum(tl.maximum(w, 0.0), 1.0)
            th = ta + w * (tb - ta)
            # headlight Blinn-Phong at the hit
            qx = qox + th * qdx
            qy = qoy + th * qdy
            qz = qoz + th * qdz
            topx = (nx - 1).to(tl.float32)
            topy = (ny - 1).to(tl.float32)
            topz = (nz - 1).to(tl.float32)
            xp, xm = tl.minimum(qx + 1.0, topx), tl.maximum(qx - 1.0, 0.0)
            yp, ym = tl.minimum(qy + 1.0, topy), tl.maximum(qy - 1.0, 0.0)
            zp, zm = tl.minimum(qz + 1.0, topz), tl.maximum(qz - 1.0, 0.0)
            qyc = tl.minimum(qy, topy)
            qzc = tl.minimum(qz, topz)
            qxc = tl.minimum(qx, topx)
            gx = (_tri_sample(vol, xp, qyc, qzc, nx, ny, nz) - _tri_sample(vol, xm, tl.maximum(qy, 0.0),
                  tl.maximum(qz, 0.0), nx, ny, nz)) / ((xp - xm) * spx)
            gy = (_tri_sample(vol, qxc, yp, qzc, nx, ny, nz) - _tri_sample(vol, tl.maximum(qx, 0.0), ym,
                  tl.maximum(qz, 0.0), nx, ny, nz)) / ((yp - ym) * spy)
            gz = (_tri_sample(vol, qxc, qyc, zp, nx, ny, nz) - _tri_sample(vol, tl.maximum(qx, 0.0),
                  tl.maximum(qy, 0.0), zm, nx, ny, nz)) / ((zp - zm) * spz)
            vx = -qdx * spx
            vy = -qdy * spy
            vz = -qdz * spz
            vn = tl.sqrt(vx * vx + vy * vy + vz * vz)
            vx, vy, vz = vx / vn, vy / vn, vz / vn
            gn = tl.sqrt(gx * gx + gy * gy + gz * gz)
            gs = tl.maximum(gn, 1e-30)
            cos = tl.where(gn > 0, (gx / gs) * vx + (gy / gs) * vy + (gz / gs) * vz, 1.0)
            cos = tl.minimum(tl.abs(cos), 1.0)
            c2 = cos * cos
            c4 = c2 * c2
            c8 = c4 * c4
            c16 = c8 * c8
            intensity = 0.15 + 0.75 * cos + 0.25 * (c16 * c16)
            if HAS_CFIELD:
                value = (_tri_sample(cvol, qx, qy, qz, nx, ny, nz) - c_lo) / (c_hi - c_lo)
                value = tl.minimum(tl.maximum(value, 0.0), 1.0)
                seg = tl.zeros((BLOCK,), dtype=tl.int32)
                for j in range(1, n_cmap - 1):
                    seg += (value >= tl.load(cmap_pos + j)).to(tl.int32)
                p0 = tl.load(cmap_pos + seg)
                p1 = tl.load(cmap_pos + seg + 1)
                wc = (value - p0) / (p1 - p0)
                r0 = tl.load(cmap_rgb + seg * 3)
                g0 = tl.load(cmap_rgb + seg * 3 + 1)
                bb0 = tl.load(cmap_rgb + seg * 3 + 2)
                base_r = r0 + wc * (tl.load(cmap_rgb + seg * 3 + 3) - r0)
                base_g = g0 + wc * (tl.load(cmap_rgb + seg * 3 + 4) - g0)
                base_b = bb0 + wc * (tl.load(cmap_rgb + seg * 3 + 5) - bb0)
            else:
                base_r = tl.zeros((BLOCK,), dtype=tl.float32) + cr
                base_g = tl.zeros((BLOCK,), dtype=tl.float32) + cg
                base_b = tl.zeros((BLOCK,), dtype=tl.float32) + cb
            rgb_r += tl.where(hit, tl.minimum(tl.maximum(base_r * intensity, 0.0), 1.0), 0.0)
            rgb_g += tl.where(hit, tl.minimum(tl.maximum(base_g * intensity, 0.0), 1.0), 0.0)
            rgb_b += tl.where(hit, tl.minimum(tl.maximum(base_b * intensity, 0.0), 1.0), 0.0)
            hits += hit.to(tl.float32)
            near = tl.minimum(near, tl.where(hit, th, float("inf")))
        inv = 1.0 / (S * S).to(tl.float32)
        out = (view * (width * height) + pix).to(tl.int64)
        tl.store(rgba_out + out * 4, rgb_r * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 1, rgb_g * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 2, rgb_b * inv, mask=pix_ok)
        tl.store(rgba_out + out * 4 + 3, hits * inv, mask=pix_ok)
        tl.store(depth_out + out, near, mask=pix_ok)


_TRITON_BLOCK = 128     # pixels per program


def _raycast_triton(scene: "_Scene", cams: "_Cameras", width: int, height: int, supersample: int):
    """rgba [C, H, W, 4] and depth [C, H, W] of ``cams`` through the Triton kernel."""
    C = cams.axes.shape[0]
    device = cams.axes.device
    rgba = torch.empty(C, height, width, 4, dtype=torch.float32, device=device)
    depth = torch.empty(C, height, width, dtype=torch.float32, device=device)
    packed = torch.cat([cams.axes.reshape(C, 9), cams.centre], 1).contiguous()
    f = scene.field
    nx, ny, nz = (int(v) for v in f.size.tolist())
    mx, my, mz = (int(v) for v in f.macro_dims.tolist())
    o, sp = scene.origin.tolist(), scene.spacing.tolist()
    bl, bh = scene.box_lo.tolist(), scene.box_hi.tolist()
    dl, dh = scene.domain_lo.tolist(), scene.domain_hi.tolist()
    positions, colours = COLORMAPS[scene.colormap]
    cmap_pos = torch.tensor(positions, dtype=torch.float32, device=device)
    cmap_rgb = torch.tensor(colours, dtype=torch.float32, device=device).reshape(-1)
    cvol = scene.color_volume if scene.color_volume is not None else f.volume
    c = scene.color.tolist()
    grid = (triton.cdiv(width * height, _TRITON_BLOCK), C)
    _raycast_kernel[grid](
        f.volume, f.distance, scene.isos, scene.isos.numel(), packed, rgba, depth,
        nx, ny, nz, mx, my, mz, *o, *sp, *bl, *bh, *dl, *dh,
        float(scene.step), width, height, supersample,
        c[0], c[1], c[2], cvol, cmap_pos, cmap_rgb, len(positions), *scene.color_range,
        REFINE=scene.refine, HAS_CFIELD=scene.color_volume is not None, BLOCK=_TRITON_BLOCK)
    return rgba, depth
