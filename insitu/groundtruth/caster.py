"""Ground-truth images: ray-cast a block's isosurface directly from its trilinear field.

No mesh is built. Every pixel shoots ``supersample x supersample`` rays on a regular
sub-pixel grid. A ray is clipped to the block's owned box, marched in steps of ``step``
voxels through the trilinear interpolant of the samples, its first crossing of any iso
value refined by bisection, and the hit's base colour (solid, or a second field mapped through a
colour map) shaded with a light (:mod:`insitu.render.lighting`: the headlight's Blinn-Phong model, or a
fixed key and fill light). The image is premultiplied RGBA
with no background, plus the camera depth of the first hit, so the images of several
blocks composite sort-last (front to back) into the image of the whole domain.

Camera model as in :mod:`insitu.groundtruth.views`: ``viewmats [C, 4, 4]`` world-to-camera (OpenCV
axes), ``Ks [C, 3, 3]`` intrinsics in pixels, pixel ``(u, v)`` centred at ``(u + 0.5, v + 0.5)``.

This module is the entry point (:func:`raycast`, :func:`raycast_views`: inputs checked, the
field prepared once, a backend chosen); the casters are :mod:`.torch_caster` (the reference:
rays marched as tensors, empty space skipped with a macro-cell distance grid) and
:mod:`.triton_caster` (the same in one Triton kernel), both reading what :mod:`.field` prepares.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from insitu.groundtruth.colormaps import COLORMAPS, apply_colormap
from insitu.groundtruth.field import MACRO, Cameras, prepare_scene
from insitu.groundtruth.torch_caster import raycast_torch
from insitu.groundtruth.triton_caster import raycast_triton, triton
from insitu.render.lighting import HEADLIGHT, FixedLight, Headlight, Light
from insitu.volume import Block

__all__ = ["COLORMAPS", "apply_colormap", "raycast", "raycast_views"]


def _check_inputs(block: Block, viewmats: Tensor, Ks: Tensor, width: int, height: int, iso,
                  color, color_field, color_range, colormap, supersample, step, refine, chunk_rays,
                  light) -> list[float]:
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
    if not isinstance(light, (Headlight, FixedLight)):
        raise ValueError(f"light: expected a Headlight or a FixedLight (insitu.render.lighting), got "
                         f"{type(light).__name__}")
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
            progress: Callable[[int, int], None] | None = None, backend: str = "auto",
            value_range: tuple[float, float] | None = None, light: Light = HEADLIGHT) -> tuple[Tensor, Tensor]:
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
        backend: "triton" (one fused kernel; CUDA),
            "torch" (the reference: rays marched as tensors, in chunks of ``chunk_rays``),
            or "auto": triton on CUDA devices when Triton is installed, torch elsewhere.
        value_range: (min, max) of the whole field, every rank's block: the field is brought to unit size
            by that range (:func:`insitu.volume.unit_field`), so that every block is cast from the samples
            one rank would have; default this block's range.
        light: what the hits are shaded with: the headlight (the step's ground truth) or a fixed light
            (:class:`insitu.render.lighting.FixedLight`, the standard files' ground truth).

    Returns:
        rgba: [C, H, W, 4] premultiplied colour and coverage (alpha = fraction of rays that hit), float32.
        depth: [C, H, W] camera z of the nearest hit among a pixel's rays, +inf where none hit.
    """
    return next(iter(raycast_views(block, viewmats, Ks, width, height, iso, views_per_call=len(viewmats),
                                   color=color, color_field=color_field, color_range=color_range,
                                   colormap=colormap, supersample=supersample, step=step, refine=refine,
                                   device=device, chunk_rays=chunk_rays, progress=progress,
                                   backend=backend, value_range=value_range, light=light)))[1:]


def raycast_views(block: Block, viewmats: Tensor, Ks: Tensor, width: int, height: int,
                  iso: float | Sequence[float], *, views_per_call: int, color=(0.85, 0.8, 0.7),
                  color_field: str | None = None, color_range: tuple[float, float] | None = None,
                  colormap: str = "viridis", supersample: int = 2, step: float = 0.5, refine: int = 6,
                  device: str | torch.device | None = None, chunk_rays: int = 1 << 22,
                  progress: Callable[[int, int], None] | None = None, backend: str = "auto",
                  value_range: tuple[float, float] | None = None, ready: Callable[[], None] | None = None,
                  light: Light = HEADLIGHT):
    """:func:`raycast` for ``views_per_call`` views at a time, the field prepared once.

    Yields ``(ids [c], rgba [c, H, W, 4], depth [c, H, W])`` for consecutive groups of the
    C cameras (``ids`` on the device), so that the caller can use each group before the next
    one is drawn. ``ready()``, when given, is called once the field is prepared, just before the
    first group is cast (where a caller waits for the caster's kernel compiled on another thread).
    Other arguments as in :func:`raycast`.
    """
    isos_list = _check_inputs(block, viewmats, Ks, width, height, iso, color, color_field, color_range,
                              colormap, supersample, step, refine, chunk_rays, light)
    if isinstance(views_per_call, bool) or not isinstance(views_per_call, (int, np.integer)) or views_per_call < 1:
        raise ValueError(f"views_per_call: expected an integer >= 1, got {views_per_call!r}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    device = torch.device(device) if device is not None else viewmats.device
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton is not None else "torch"
    if backend == "triton" and triton is None:
        raise ValueError("backend: 'triton' needs the triton package (it ships with CUDA builds of torch)")
    scene = prepare_scene(block, isos_list, color=color, color_field=color_field, color_range=color_range,
                          colormap=colormap, step=step, refine=refine, device=device, value_range=value_range,
                          light=light)
    all_cams = Cameras.make(viewmats.to(device=device, dtype=torch.float32),
                            Ks.to(device=device, dtype=torch.float32))
    C = viewmats.shape[0]
    if ready is not None:
        ready()
    for v0 in range(0, C, int(views_per_call)):
        ids = torch.arange(v0, min(C, v0 + int(views_per_call)), device=device)
        cams = Cameras(all_cams.axes[ids], all_cams.centre[ids])
        if backend == "triton":
            rgba, depth = raycast_triton(scene, cams, int(width), int(height), int(supersample))
            if progress is not None:
                for done in range(v0 + 1, v0 + len(ids) + 1):
                    progress(done, C)
        else:
            shift = (lambda d, n, v0=v0: progress(v0 + d, C)) if progress is not None else None
            rgba, depth = raycast_torch(scene, cams, int(width), int(height), int(supersample),
                                        int(chunk_rays), shift)
        yield ids, rgba, depth
