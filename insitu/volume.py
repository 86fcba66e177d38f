"""Fields on uniform grids: the block a rank holds, raw volume files, input checks.

Arrays are C-ordered ``[nz, ny, nx]`` (x varies fastest, as in the Open SciVis raw
files and in most simulations); world coordinates are ``(x, y, z)``:
``world = origin + spacing * (i, j, k)`` for ``data[k, j, i]``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from insitu.errors import InputError


@dataclass
class Block:
    """One rank's piece of a global 3D scalar field, with its ghost layers.

    data:         [nz, ny, nx] samples, ghost layers included.
    start:        global index (i, j, k) = (x, y, z) of ``data[0, 0, 0]``.
    global_shape: global number of samples (nx, ny, nz).
    owned_lo/hi:  global sample indices (x, y, z) of the cells this rank owns:
                  cells ``owned_lo <= c < owned_hi``, i.e. the box between those samples.
    origin:       world (x, y, z) of the global sample (0, 0, 0).
    spacing:      world size of one cell (dx, dy, dz).
    fields:       other fields on the same samples (e.g. a colour field), name -> array.
    """

    data: np.ndarray
    start: tuple[int, int, int]
    global_shape: tuple[int, int, int]
    owned_lo: tuple[int, int, int]
    owned_hi: tuple[int, int, int]
    origin: tuple[float, float, float] = (0.0, 0.0, 0.0)
    spacing: tuple[float, float, float] = (1.0, 1.0, 1.0)
    fields: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def shape_xyz(self) -> tuple[int, int, int]:
        nz, ny, nx = self.data.shape
        return (nx, ny, nz)

    def index_to_world(self, ijk: np.ndarray) -> np.ndarray:
        """Global sample index (x, y, z) -> world coordinates; works on [..., 3] arrays."""
        return np.asarray(self.origin) + np.asarray(self.spacing) * np.asarray(ijk, dtype=np.float64)

    @property
    def box(self) -> tuple[np.ndarray, np.ndarray]:
        """World bounds (lo, hi) of the owned cells."""
        return self.index_to_world(self.owned_lo), self.index_to_world(self.owned_hi)

    @property
    def data_box(self) -> tuple[np.ndarray, np.ndarray]:
        """World bounds (lo, hi) of all samples held, ghosts included."""
        lo = np.asarray(self.start)
        return self.index_to_world(lo), self.index_to_world(lo + np.asarray(self.shape_xyz) - 1)

    @property
    def global_box(self) -> tuple[np.ndarray, np.ndarray]:
        """World bounds (lo, hi) of the whole domain."""
        return self.index_to_world((0, 0, 0)), self.index_to_world(np.asarray(self.global_shape) - 1)

    @property
    def is_whole(self) -> bool:
        return tuple(self.shape_xyz) == tuple(self.global_shape)


def check_field(array: np.ndarray, name: str = "field", offset=(0, 0, 0), nonfinite: str = "error") -> np.ndarray:
    """Validate a 3D scalar field: 3 dimensions, at least 2 samples per axis, finite.

    offset:    global index (x, y, z) of ``array[0, 0, 0]``, for the positions in messages.
    nonfinite: "error": NaN/Inf samples are an InputError; "outside": they are let through (a mask,
               filled by :func:`outside_value` before the step trains).
    """
    array = np.asarray(array)
    if array.ndim != 3:
        raise InputError(f"{name}: expected a 3D array [nz, ny, nx], got {array.ndim}D with shape {array.shape}")
    if min(array.shape) < 2:
        raise InputError(f"{name}: expected at least 2 samples along each axis, got shape {array.shape}")
    if array.dtype.kind not in "uif":        # (timedelta64 counts as a number to numpy)
        raise InputError(f"{name}: expected a real numeric array, got dtype {array.dtype}")
    if np.issubdtype(array.dtype, np.floating) and nonfinite == "error":
        bad = ~np.isfinite(array)
        if bad.any():
            k, j, i = np.argwhere(bad)[0]
            x, y, z = i + offset[0], j + offset[1], k + offset[2]
            raise InputError(f"{name}: contains {int(bad.sum())} NaN/Inf value(s), "
                             f"first at (x={x}, y={y}, z={z}) = {array[k, j, i]}; if they mask a region "
                             "(e.g. land), give input.nonfinite=outside to count them as outside the surface")
    return array


def readable_field(array: np.ndarray) -> np.ndarray:
    """``array`` in a type that every stage reads: float16 as float32 (exactly) and long double as float64
    (scipy's interpolation, with which a warm start samples the field, reads neither), any other type in
    the machine's byte order (torch reads no other); ``array`` itself when it is one already."""
    dtype = array.dtype
    if dtype.kind == "f" and dtype.itemsize < 4:
        wanted = np.dtype(np.float32)
    elif dtype.kind == "f" and dtype.itemsize > 8:
        wanted = np.dtype(np.float64)
    else:
        wanted = dtype.newbyteorder("=")
    return array if wanted == dtype else array.astype(wanted)


def readable_block(block: Block) -> Block:
    """``block`` with its field and its other fields in types that every stage reads (:func:`readable_field`)."""
    return replace(block, data=readable_field(block.data),
                   fields={k: readable_field(v) for k, v in block.fields.items()})


# What a grid's origin and spacing (world units) may be. Training never sees the unit (it runs in the
# step's Frame: the smallest cell side is 1, the grid starts at 0); what bounds them is model.ply, which
# holds world coordinates in float32, and the viewers that draw it in float32.
SPACING_RANGE = (1e-15, 1e18)   # a cell side: a Gaussian of a thousandth of a 1e-15 cell still squares to
                                # a normal float32 (1e-36 > 1.2e-38; viewers form covariances from scale^2)
COORDINATE_MAX = 1e18           # |world coordinate|: its square (a distance^2) stays finite in float32 (3.4e38)
CELLS_MAX = 2 ** 20             # |world coordinate| / the smallest cell side: float32's 24 bits then resolve
                                # 1/8 of a cell (a Gaussian moved by at most 1/16 of one in model.ply); the
                                # grid's own extent in the step's frame is bounded alike
ANISOTROPY_MAX = 1e4            # largest / smallest cell side: beyond it a grid of as many samples on each axis
                                # is a sheet thinner than a pixel of views 10^4 pixels wide (and CELLS_MAX
                                # leaves it at most 105 samples along its long sides)


def _shown(values) -> str:
    return " ".join(f"{v:g}" for v in values)


def check_geometry(origin: Sequence[float] | None = None, spacing: Sequence[float] | None = None,
                   shape: Sequence[int] | None = None, *, names: tuple[str, str] = ("origin", "spacing"),
                   where: str = "", error: type[Exception] = InputError):
    """``(origin, spacing)`` as 3 floats each (x, y, z; either None when not given), checked for what
    float32 coordinates can hold (``SPACING_RANGE``, ``ANISOTROPY_MAX``, ``COORDINATE_MAX``, ``CELLS_MAX``);
    ``error`` otherwise, one line naming the input (``names``, after ``where``), the range and its value.

    shape: the grid's samples (x, y, z); with it, every world coordinate of the grid is checked, not
           only the origin's (the far corner ``origin + spacing * (shape - 1)`` too).
    Refused: not 3 finite values; a cell side outside ``SPACING_RANGE`` (0 and below included); the largest
    side over ``ANISOTROPY_MAX`` times the smallest; a world coordinate beyond ``COORDINATE_MAX``, or more
    than ``CELLS_MAX`` of the smallest cell sides from 0 (float32 cannot resolve a cell there), or a grid
    that spans more than that many.
    """
    prefix = f"{where}: " if where else ""

    def three(value: Any, name: str) -> tuple[float, float, float]:
        try:
            v = tuple(float(x) for x in np.asarray(value, dtype=np.float64).ravel())
        except (TypeError, ValueError):
            v = ()
        if len(v) != 3 or not all(math.isfinite(x) for x in v):
            raise error(f"{prefix}{name}: expected 3 finite values (x, y, z), got "
                        f"{_shown(v) if len(v) == 3 else repr(value)}")
        return v  # type: ignore[return-value]

    o = three(origin, names[0]) if origin is not None else None
    s = three(spacing, names[1]) if spacing is not None else None
    if s is not None:
        lo, hi = SPACING_RANGE
        if not all(lo <= v <= hi for v in s):
            raise error(f"{prefix}{names[1]}: expected 3 finite values in [{lo:g}, {hi:g}] (the sides of a cell; "
                        "float32, in which model.ply holds the model and viewers draw it, cannot square lengths "
                        f"beyond them: give the spacing in another unit), got {_shown(s)}")
        if max(s) > ANISOTROPY_MAX * min(s):
            raise error(f"{prefix}{names[1]}: expected the largest side of a cell at most {ANISOTROPY_MAX:g} times "
                        "the smallest (beyond, the grid is a sheet thinner than a pixel of its views), got "
                        f"{_shown(s)} ({max(s) / min(s):.3g} times)")
    grid = None if s is None or shape is None else tuple(int(n) for n in shape)
    if grid is not None:
        span = max(d * (n - 1) for d, n in zip(s, grid)) / min(s)
        if span > CELLS_MAX:
            raise error(f"{prefix}{names[1]}: expected a grid at most 2^20 = {CELLS_MAX} cells of its smallest side "
                        "across (float32 coordinates cannot resolve that cell across a wider one), got "
                        f"{_shown(s)} and {' x '.join(map(str, grid))} samples, {span:.6g} cells across")
    if o is None:
        return o, s
    corners = [o] if grid is None else [o, tuple(a + d * (n - 1) for a, d, n in zip(o, s, grid))]
    reach = max(abs(c) for corner in corners for c in corner)
    given = f"{_shown(o)}" + (f" with {names[1]} {_shown(s)}" if s is not None else "") \
        + (f" and {' x '.join(map(str, grid))} samples" if grid is not None else "")
    if reach > COORDINATE_MAX:
        raise error(f"{prefix}{names[0]}: expected the grid's world coordinates within +-{COORDINATE_MAX:g} (float32 "
                    "coordinates, in model.ply, overflow when squared beyond: give origin and spacing in another "
                    f"unit), got {given}, which reaches {reach:.6g}")
    if s is None:
        return o, s
    cell = min(s)
    if reach > CELLS_MAX * cell:
        raise error(f"{prefix}{names[0]}: expected the grid to lie within 2^20 = {CELLS_MAX} cells of 0 (cells of "
                    f"its smallest side, {cell:g}; float32 coordinates, in model.ply, cannot resolve a cell farther "
                    "out: shift the origin with input.origin so that the grid lies near 0), got "
                    f"{given}, {reach / cell:.6g} cells out")
    return o, s


@dataclass(frozen=True)
class Frame:
    """The coordinates a step trains in: ``world = origin + scale * internal``, with ``origin`` the world
    position of the global sample (0, 0, 0) and ``scale`` the smallest cell side, so that a grid given
    in any unit (metres: 1e-4 cells) is, inside the step, the grid in index units (origin 0, smallest
    side 1; bit for bit, with the same spacing on every axis), and nothing inside depends on the unit.
    The step's results leave it in world units (:meth:`gaussians_to_world`, :meth:`views_to_world`)."""

    origin: tuple[float, float, float] = (0.0, 0.0, 0.0)
    scale: float = 1.0

    @staticmethod
    def of(block: "Block") -> "Frame":
        return Frame(tuple(float(v) for v in block.origin), float(min(block.spacing)))

    def inside(self, block: "Block") -> "Block":
        """``block`` in this frame: origin 0, spacing in units of ``scale``."""
        return replace(block, origin=(0.0, 0.0, 0.0), spacing=tuple(float(v) / self.scale for v in block.spacing))

    def points_to_world(self, points) -> np.ndarray:
        """``[..., 3]`` points of this frame -> world (float64)."""
        return np.asarray(self.origin) + self.scale * np.asarray(points, dtype=np.float64)

    def gaussians_to_world(self, g):
        """Gaussians of this frame (:class:`insitu.surface.gaussians.Gaussians`) in world units: the means moved
        and scaled (in float64, then the means' own type), the scales scaled; the rest as it is."""
        return self.reframe(g, Frame())

    def reframe(self, g, target: "Frame"):
        """Gaussians of this frame in the frame ``target`` (a warm start whose grid moved or changed
        its cells); ``g`` itself when the frames are the same."""
        if target == self:
            return g
        import torch

        shift = torch.as_tensor((np.asarray(self.origin) - np.asarray(target.origin)) / target.scale,
                                dtype=torch.float64, device=g.means.device)
        means = (g.means.double() * (self.scale / target.scale) + shift).to(g.means.dtype)
        log_scales = g.log_scales + math.log(self.scale / target.scale)
        return replace(g, means=means, log_scales=log_scales)

    def views_to_world(self, views):
        """Cameras of this frame (:class:`insitu.groundtruth.views.Views`) in world units: each views the world
        as it viewed the frame (the same pixels), its camera coordinates scaled by ``scale``."""
        import torch

        vm = views.viewmats.double().clone()
        R, t = vm[:, :3, :3], vm[:, :3, 3]
        origin = torch.as_tensor(self.origin, dtype=torch.float64, device=vm.device)
        vm[:, :3, 3] = self.scale * t - R @ origin
        return replace(views, viewmats=vm.to(views.viewmats.dtype))


def whole_block(array: np.ndarray, origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0),
                fields: dict[str, np.ndarray] | None = None, name: str = "field") -> Block:
    """A Block that holds the whole domain (single rank, no ghosts)."""
    array = check_field(array, name)
    nz, ny, nx = array.shape
    for key, other in (fields or {}).items():
        if np.shape(other) != array.shape:
            raise InputError(f"{key}: expected the shape of {name} {array.shape}, got {np.shape(other)}")
    origin, spacing = check_geometry(origin, spacing, (nx, ny, nz))
    return Block(array, (0, 0, 0), (nx, ny, nz), (0, 0, 0), (nx - 1, ny - 1, nz - 1), origin, spacing,
                 dict(fields or {}))


_RAW_NAME = re.compile(r"(?P<name>.+?)_(?P<x>\d+)x(?P<y>\d+)x(?P<z>\d+)_(?P<dtype>u?int\d+|float\d+)\.raw$")


RAW_TYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")


def _raw_name(path: str | Path) -> tuple[tuple[int, int, int], str] | None:
    """``NAME_XxYxZ_DTYPE.raw`` -> ((x, y, z), DTYPE as written), or None if the name does not follow it."""
    m = _RAW_NAME.match(Path(path).name)
    if not m:
        return None
    return (int(m["x"]), int(m["y"]), int(m["z"])), m["dtype"]


def parse_raw_name(path: str | Path) -> tuple[tuple[int, int, int], np.dtype] | None:
    """``NAME_XxYxZ_DTYPE.raw`` -> ((x, y, z), dtype), or None if the name does not follow it.
    InputError when the name's DTYPE is not a type that :func:`raw_dtype` takes (``uint7``)."""
    parsed = _raw_name(path)
    if parsed is None:
        return None
    return parsed[0], raw_dtype(parsed[1], name=Path(path).name)


def raw_dtype(dtype: str | np.dtype, *, name: str | None = None) -> np.dtype:
    """``dtype`` as a numpy integer or float dtype; InputError when it is none. ``name``: the file
    whose name gave ``dtype`` (the message then says so, and that ``--dtype`` overrides it)."""
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    # a name's type must be numpy's own name for it ("int1" is not int8)
    if out is None or out.kind not in "uif" or (name is not None and out.name != dtype):
        expected = f"an integer or float type ({', '.join(RAW_TYPES)})"
        if name is not None:
            raise InputError(f"{name}: the type in the file name, {dtype!r}, is not one insitu reads: expected "
                             f"{expected}; give --dtype (input.dtype), which overrides the name")
        raise InputError(f"dtype: expected {expected}, got {dtype!r}")
    return out


def read_raw(path: str | Path, dims: tuple[int, int, int] | None = None,
             dtype: str | np.dtype | None = None) -> np.ndarray:
    """Read a raw volume as [nz, ny, nx]; dims (x, y, z) and dtype default to those in its name
    (what is given wins: the name is only read for what is not)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a raw volume file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if dims is None or dtype is None:
        parsed = _raw_name(path)
        if parsed is None:
            missing = " and ".join(w for w, v in (("dims", dims), ("dtype", dtype)) if v is None)
            flags = " and ".join(f for f, v in (("--dims X Y Z", dims), ("--dtype", dtype)) if v is None)
            raise InputError(f"{path.name}: {missing} {'is' if ' and ' not in missing else 'are'} not given and not "
                             f"in the name (expected NAME_XxYxZ_uint8.raw); give {flags}")
        dims = dims or parsed[0]
        dtype = dtype or raw_dtype(parsed[1], name=path.name)
    dtype = raw_dtype(dtype)
    nx, ny, nz = (int(d) for d in dims)
    expected = nx * ny * nz * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise InputError(f"{path.name}: file has {size} bytes, expected {expected} "
                         f"for {nx}x{ny}x{nz} {dtype} ({nx}*{ny}*{nz}*{dtype.itemsize})")
    return np.fromfile(path, dtype=dtype).reshape(nz, ny, nx)


def iso_distance(block: Block, isos, points: np.ndarray) -> np.ndarray:
    """World distance ``[M]`` from each point ``points: [M, 3]`` (world x, y, z) to the nearest of the
    isosurfaces ``block.data == iso`` for ``iso`` in ``isos``, to first order: ``|f - iso| / |grad f|``,
    with ``f`` trilinear in the block's samples and its gradient the central difference of that over
    half a cell. ``inf`` for a point outside the block's samples (ghost layers included) or where the
    gradient vanishes."""
    from scipy.ndimage import map_coordinates

    points = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    spacing = np.asarray(block.spacing, dtype=np.float64)
    ijk = (points - np.asarray(block.origin)) / spacing - np.asarray(block.start)     # local (i, j, k)
    nz, ny, nx = block.data.shape
    inside = np.all((ijk >= 0) & (ijk <= np.array([nx - 1, ny - 1, nz - 1])), axis=1)

    def f(offset):
        return map_coordinates(block.data, (ijk + offset)[:, ::-1].T, order=1, mode="nearest", output=np.float64)

    h = 0.5
    grad = np.stack([(f(h * e) - f(-h * e)) / (2 * h * spacing[a]) for a, e in enumerate(np.eye(3))], axis=1)
    big = np.abs(grad).max(axis=1, keepdims=True)       # scaled first: no square underflows or overflows
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = np.where(big[:, 0] > 0, big[:, 0] * np.linalg.norm(grad / np.where(big > 0, big, 1.0), axis=1), 0.0)
    value = f(np.zeros(3))
    gap = np.min([np.abs(value - float(iso)) for iso in np.atleast_1d(isos)], axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(inside & (norm > 0), gap / norm, np.inf)
    return out


# Integer samples that float32 holds exactly, whose gradients cannot overflow it: used as they are.
_EXACT_IN_FLOAT32 = (np.uint8, np.int8, np.uint16, np.int16)


def unit_field(data: np.ndarray, isos, value_range: tuple[float, float] | None = None) -> tuple[np.ndarray, list[float]]:
    """``data: [nz, ny, nx]`` and its iso values mapped by one affine map ``f -> (f - shift) / scale`` so
    that the samples lie within [-1, 1] around the iso values, as float32; returns ``(field, isos)``.

    value_range: ``(min, max)`` of the whole field (every rank's block), so that every rank maps its block
    by the same map and its samples are the very float32 values one rank would have (a block's own range
    would round them differently, and a ray grazing the surface could hit on one rank count and miss on
    another); default this block's range.

    The map keeps every isosurface where it is and every gradient's direction, so surfaces, normals and
    shading do not change; what it removes is the magnitude: a density of 1e-24 (cgs units) squared in
    a float32 gradient norm underflows to 0, one of 1e24 overflows, and a float64 field of 1e6 plus a
    small variation loses that variation when cast to float32. The shift is taken in float64, before
    the cast. Small integer types (uint8, int8, uint16, int16) are returned unchanged (float32 holds
    them exactly), with their iso values as given.
    """
    values = [float(v) for v in np.atleast_1d(isos)]
    data = np.asarray(data)
    if data.dtype.type in _EXACT_IN_FLOAT32:
        return data, values
    shift = 0.5 * (min(values) + max(values))
    lo, hi = (float(np.min(data)), float(np.max(data))) if value_range is None else map(float, value_range)
    scale = max(hi - shift, shift - lo, max(values) - shift)
    if not np.isfinite(scale) or scale <= 0:
        scale = 1.0
    out = np.empty(data.shape, np.float32)
    rows = max(1, (1 << 24) // max(1, data[0].size))        # float64 temporaries of about 128 MB
    for k in range(0, data.shape[0], rows):
        out[k:k + rows] = (np.asarray(data[k:k + rows], np.float64) - shift) / scale
    return out, [float(np.float32((v - shift) / scale)) for v in values]


def unit_colors(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """A colour field ``values`` mapped to [0, 1] by its global range ``lo..hi`` (in float64, then
    float32). A constant field (``lo == hi``) maps to 0.5: one colour, the middle of the colour map."""
    lo, hi = float(lo), float(hi)
    if not (np.isfinite(lo) and np.isfinite(hi) and hi >= lo):
        raise ValueError(f"color range: expected finite lo <= hi, got ({lo}, {hi})")
    if hi == lo:
        return np.full(np.shape(values), 0.5, np.float32)
    return ((np.asarray(values, np.float64) - lo) / (hi - lo)).clip(0.0, 1.0).astype(np.float32)


def downsample(array: np.ndarray, factor: int) -> np.ndarray:
    """Box-filter downsampling by an integer factor per axis (trailing samples dropped)."""
    if factor == 1:
        return array
    nz, ny, nx = (s // factor * factor for s in array.shape)
    a = np.asarray(array[:nz, :ny, :nx], dtype=np.float32)
    return a.reshape(nz // factor, factor, ny // factor, factor, nx // factor, factor).mean(axis=(1, 3, 5))


def outside_value(lo: float, hi: float, isos) -> float:
    """The value that stands for a masked (NaN/Inf) sample with ``input.nonfinite: outside``, given
    the finite samples' global range ``lo..hi``: the mirror of ``hi`` below the lowest iso value
    (or ``lo``, if lower). It is below every iso value, so a surface that reaches the mask closes
    along its edge, and between a sample ``f > iso`` and a masked one the surface crosses at most
    half a cell from the sample (``(f - iso) / (f - fill) <= 1/2``): it never reaches past the
    middle of the cell into the mask. The range at most doubles, so the field's scale is kept."""
    iso = min(float(v) for v in np.atleast_1d(isos))
    fill = min(float(lo), 2.0 * iso - float(hi))
    if not fill < iso:                       # no finite sample above the iso value (then no surface)
        fill = iso - max(abs(iso), 1.0)
    return fill


def fill_nonfinite(array: np.ndarray, value: float) -> np.ndarray:
    """``array`` with its NaN/Inf samples set to ``value`` (a copy; unchanged when all are finite),
    in a float type that holds ``value`` below the iso values it was chosen for."""
    bad = ~np.isfinite(array)
    if not bad.any():
        return array
    out = np.array(array, dtype=np.result_type(array.dtype, np.float32))
    fill = out.dtype.type(value)
    if fill > value:                        # rounded up: take the next value below
        fill = np.nextafter(fill, out.dtype.type(-np.inf))
    out[bad] = fill
    return out
