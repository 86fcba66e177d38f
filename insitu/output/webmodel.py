"""The web copy of a model: Niantic's ``.spz`` (gzip-compressed, about 10x smaller than ``.ply``).

A reference 3DGS ``.ply`` holds 62 float32 per Gaussian at SH degree 3 (248 bytes: a 4M-Gaussian
model is about 1 GB). ``.spz`` (https://github.com/nianticlabs/spz, versions 2 and 3, the gzip ones)
quantizes every attribute to bytes and keeps the SH bands, which the ground truth's headlight shading needs:

    positions  [N, 3]  24-bit signed fixed point, ``fractional_bits`` chosen from the extent (in the header)
    alphas     [N]     sigmoid(opacity) * 255
    colors     [N, 3]  (sh0 * 0.15 + 0.5) * 255
    scales     [N, 3]  (log scale + 10) * 16
    rotations  version 2: [N, 3] bytes, x, y, z of the unit quaternion (x, y, z, w) with w >= 0, each
                       (c + 1) * 127.5; w = sqrt(1 - x^2 - y^2 - z^2) on reading.
               version 3: [N] uint32 "smallest three": index of the largest component of the unit
                       quaternion (x, y, z, w) in 2 bits, the other three in 10 bits each (sign, 9-bit
                       magnitude over 1/sqrt(2))
    sh         [N, K-1, 3]  round(sh * 128) + 128 (colour channel innermost)

in this order after a 16-byte header, the whole gzip-compressed: 19 (version 2) or 20 (version 3) + 9 (K-1)
bytes per Gaussian before compression. The header's flags byte says whether the model is meant to be drawn
antialiased (``FLAG_ANTIALIASED``).

Which version: F3D 4.0 reads version 3 wrong (it hands the quaternion on as (x, y, z, w) where its
shader takes (w, x, y, z), and it reads the SH bands from the offset of version 2's layout, a byte per
Gaussian early), so the standard copy, ``model.spz``, which any viewer may open, is written as version 2
(``STANDARD_SPZ_VERSION``), which F3D, Niantic's library, PlayCanvas splat-transform and Spark all read
right. Version 2's rotations are coarser (8 bits a component, w derived: a mean error of 0.75 degrees,
under 7 at worst, against 0.08 and 0.25 for version 3); :func:`encode_spz` picks, of the byte triples around
each quaternion, the one whose decoded rotation is nearest. A lit model's copy, drawn only by the
report's viewer and shaded by its rotations' normals, stays version 3 (the default).

SPZ's own frame is x right, y up, z back (RUB): :func:`encode_spz` turns the model's frame into it, a
rotation by 180 degrees about x (y and z negated; the quaternions' y and z too; each SH coefficient
times the parity of its basis function under that turn), and :func:`read_spz` turns it back, so that
an SPZ reader that converts from RUB to its own frame (Niantic's library, PlayCanvas splat-transform)
places the model as ``model.ply`` holds it. F3D and Spark take SPZ's frame as their own (y up) and draw
the file as it is: turned by that 180 degrees from ``model.ply``, which they draw unconverted too.
"""
from __future__ import annotations

import gzip
import itertools
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from insitu.output.files import atomic_write
from insitu.surface.gaussians import Gaussians, check_gaussians, numpy32

SPZ_MAGIC = 0x5053474E          # "NGSP"
SPZ_VERSION = 3                 # encode_spz's default: the precise rotations
SPZ_VERSIONS = (2, 3)
STANDARD_SPZ_VERSION = 2        # model.spz: the version every SPZ viewer reads right (F3D 4.0 misreads 3)
FLAG_ANTIALIASED = 0x1
# the sign of each SH coefficient (degree 1 to 3, 3DGS order) under the turn about x (y, z -> -y, -z):
# the parity of its basis polynomial in y and z (band 1: y, z, x; band 2: xy, yz, 3z^2-1, xz, x^2-y^2; band 3:
# y(3x^2-y^2), xyz, y(5z^2-1), z(5z^2-3), x(5z^2-1), z(x^2-y^2), x(x^2-3y^2))
RUB_SH_SIGNS = np.array([-1, -1, 1, -1, 1, 1, -1, 1, -1, 1, -1, -1, 1, -1, 1], dtype=np.float32)
_QUAT_MASK = (1 << 9) - 1
_COLOR_SCALE = 0.15


def _u8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def fractional_bits(means: np.ndarray) -> int:
    """Fixed-point fraction bits for positions ``means: [N, 3]``: as many as 24 bits leave room for."""
    extent = float(np.abs(means).max()) if means.size else 1.0
    if not math.isfinite(extent):
        raise ValueError("spz: the Gaussians' means must be finite")
    return int(np.clip(22 - math.ceil(math.log2(max(extent, 1.0))), 0, 20))


def to_rub(gaussians: Gaussians) -> Gaussians:
    """``gaussians`` turned by 180 degrees about x (SPZ's frame from the model's, and back): positions and
    quaternions (w, x, y, z) with y and z negated, SH coefficients times ``RUB_SH_SIGNS``."""
    g = gaussians
    flip = torch.tensor([1.0, -1.0, -1.0], dtype=g.means.dtype, device=g.means.device)
    qflip = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=g.quats.dtype, device=g.quats.device)
    k1 = g.shN.shape[1]
    signs = torch.as_tensor(RUB_SH_SIGNS[:k1], dtype=g.shN.dtype, device=g.shN.device)[None, :, None]
    return Gaussians(g.means * flip, g.log_scales, g.quats * qflip, g.opacity_logits, g.sh0, g.shN * signs)


def encode_spz(gaussians: Gaussians, *, antialiased: bool = False, version: int = SPZ_VERSION) -> bytes:
    """``gaussians`` (pre-activation, as stored, in the model's frame) -> the bytes of a ``.spz`` file
    (SPZ's frame, :func:`to_rub`); ``antialiased``: the header's flag, whether the model was trained to be
    drawn with the antialiased blur; ``version``: 2 (rotations as x, y, z bytes, read right by every SPZ
    viewer) or 3 (smallest three: rotations about ten times finer)."""
    n = check_gaussians(gaussians)
    degree = gaussians.sh_degree
    if degree > 3:
        raise ValueError(f"spz holds SH degrees 0 to 3, got {degree}")
    if version not in SPZ_VERSIONS:
        raise ValueError(f"spz version: expected one of {SPZ_VERSIONS}, got {version!r}")
    g = to_rub(gaussians)
    means = numpy32(g.means).astype(np.float64)
    bits = fractional_bits(means)
    fixed = np.clip(np.rint(means * (1 << bits)), -(2**23 - 1), 2**23 - 1).astype("<i4")
    positions = fixed.view(np.uint8).reshape(n, 3, 4)[:, :, :3]          # little-endian low 3 bytes
    alphas = _u8(255.0 / (1.0 + np.exp(-numpy32(g.opacity_logits).astype(np.float64))))
    colors = _u8((numpy32(g.sh0)[:, 0, :] * _COLOR_SCALE + 0.5) * 255.0)
    scales = _u8((numpy32(g.log_scales) + 10.0) * 16.0)
    q = numpy32(g.quats).astype(np.float64)
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
    rotations = (_pack_quats if version == 3 else _pack_quats_v2)(q[:, [1, 2, 3, 0]])
    sh = _u8(numpy32(g.shN) * 128.0 + 128.0).reshape(n, -1)
    header = struct.pack("<IIIBBBB", SPZ_MAGIC, version, n, degree, bits,
                         FLAG_ANTIALIASED if antialiased else 0, 0)
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in (positions, alphas, colors, scales, rotations, sh))
    return gzip.compress(header + body, compresslevel=1, mtime=0)


def _pack_quats(q: np.ndarray) -> np.ndarray:
    """``q: [N, 4]`` unit quaternions (x, y, z, w) -> [N] little-endian uint32, "smallest three"."""
    n = len(q)
    largest = np.argmax(np.abs(q), axis=1)
    q = np.where(q[np.arange(n), largest][:, None] < 0, -q, q)         # the largest one positive: dropped
    comp = largest.astype(np.uint32)
    for i in range(4):                                                  # first component in the high bits
        mag = np.rint(_QUAT_MASK * np.abs(q[:, i]) / math.sqrt(0.5)).clip(0, _QUAT_MASK).astype(np.uint32)
        packed = (comp << np.uint32(10)) | ((q[:, i] < 0).astype(np.uint32) << np.uint32(9)) | mag
        comp = np.where(largest == i, comp, packed)
    return comp.astype("<u4")


def _unpack_quats_v2(xyz: np.ndarray) -> np.ndarray:
    """Version 2's rotations, [N, 3] bytes -> [N, 4] (x, y, z, w), w >= 0 (not normalised: as readers decode)."""
    v = xyz.astype(np.float64) / 127.5 - 1.0
    return np.concatenate([v, np.sqrt(np.maximum(0.0, 1.0 - (v ** 2).sum(axis=1)))[:, None]], axis=1)


def _pack_quats_v2(q: np.ndarray, *, chunk: int = 1 << 20) -> np.ndarray:
    """``q: [N, 4]`` unit quaternions (x, y, z, w) -> [N, 3] bytes, version 2: x, y, z with w >= 0. Of the
    eight byte triples around ``(q + 1) * 127.5`` (each component rounded down or up), the one whose decoded
    rotation (w derived) is nearest to ``q``: rounding each component alone errs most where w is small. In torch
    (its threads), ``chunk`` rotations at a time: a few seconds in numpy for millions of Gaussians."""
    corners = torch.tensor(list(itertools.product((0.0, 1.0), repeat=3)), dtype=torch.float64)    # [8, 3]
    out = np.empty((len(q), 3), np.uint8)
    for lo in range(0, len(q), chunk):
        t = torch.from_numpy(np.ascontiguousarray(q[lo:lo + chunk], dtype=np.float64))
        t = torch.where(t[:, 3:] < 0, -t, t)
        cand = ((t[:, :3] * 127.5 + 127.5).floor()[:, None, :] + corners).clamp(0, 255)  # [n, 8, 3]
        v = cand / 127.5 - 1.0
        vv = (v * v).sum(-1)
        w = (1.0 - vv).clamp(min=0.0).sqrt()                                            # as readers derive it
        dot = ((v * t[:, None, :3]).sum(-1) + w * t[:, None, 3]).abs() / (vv + w * w).sqrt()
        best = dot.argmax(1)                                                            # the first of equals
        out[lo:lo + chunk] = cand[torch.arange(len(t)), best].to(torch.uint8).numpy()
    return out


def _unpack_quats(comp: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_pack_quats`: [N] uint32 -> [N, 4] (x, y, z, w)."""
    comp = comp.astype(np.uint32)
    largest = comp >> np.uint32(30)
    q = np.zeros((len(comp), 4))
    for i in (3, 2, 1, 0):                                              # low bits hold the last component
        skip = largest == i
        value = math.sqrt(0.5) * (comp & np.uint32(_QUAT_MASK)) / _QUAT_MASK
        value = np.where((comp >> np.uint32(9)) & np.uint32(1), -value, value)
        q[:, i] = np.where(skip, 0.0, value)
        comp = np.where(skip, comp, comp >> np.uint32(10))
    q[np.arange(len(q)), largest] = np.sqrt(np.maximum(0.0, 1.0 - (q ** 2).sum(axis=1)))
    return q


def write_spz(path: str | Path, gaussians: Gaussians, *, antialiased: bool = False,
              version: int = SPZ_VERSION) -> Path:
    """Write ``gaussians`` as a ``.spz`` file (:func:`encode_spz`), atomically; returns the path."""
    return atomic_write(path, encode_spz(gaussians, antialiased=antialiased, version=version))


def spz_antialiased(path: str | Path) -> bool:
    """Whether the ``.spz`` file's header says its model is drawn antialiased."""
    return bool(_spz_bytes(Path(path))[14] & FLAG_ANTIALIASED)


def spz_count(path: str | Path) -> int:
    """The number of Gaussians the ``.spz`` file's header gives (only the header is decompressed)."""
    with gzip.open(path, "rb") as f:
        header = f.read(16)
    if len(header) < 16:
        raise ValueError(f"{path}: too short for an spz header ({len(header)} bytes)")
    magic, _, n = struct.unpack_from("<III", header)
    if magic != SPZ_MAGIC:
        raise ValueError(f"{path}: not an spz file (magic {magic:#x}, expected {SPZ_MAGIC:#x})")
    return int(n)


def _spz_bytes(path: Path) -> bytes:
    """The decompressed bytes of the ``.spz`` file ``path``; ValueError naming it when they cannot be read."""
    try:
        raw = gzip.decompress(path.read_bytes())
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:    # truncated, not gzip, corrupt
        raise ValueError(f"{path}: not a readable spz file (a gzip stream): {type(e).__name__}: {e}") from None
    if len(raw) < 16:
        raise ValueError(f"{path}: too short for an spz header ({len(raw)} bytes)")
    return raw


def read_spz(path: str | Path) -> Gaussians:
    """Read a version-2 or version-3 ``.spz`` file into float32 Gaussians (quantized values, pre-activation),
    turned from SPZ's frame into the model's (:func:`to_rub`)."""
    path = Path(path)
    raw = _spz_bytes(path)
    magic, version, n, degree, bits, _, _ = struct.unpack_from("<IIIBBBB", raw)
    if magic != SPZ_MAGIC:
        raise ValueError(f"{path}: not an spz file (magic {magic:#x}, expected {SPZ_MAGIC:#x})")
    if version not in SPZ_VERSIONS:
        raise ValueError(f"{path}: spz version {version}; this reader reads versions {SPZ_VERSIONS}")
    k1 = (degree + 1) ** 2 - 1
    sizes = [9 * n, n, 3 * n, 3 * n, (3 if version == 2 else 4) * n, 3 * k1 * n]
    if len(raw) != 16 + sum(sizes):
        raise ValueError(f"{path}: {len(raw) - 16} data bytes for {n} Gaussians of degree {degree}, "
                         f"expected {sum(sizes)}")
    parts, offset = [], 16
    for size in sizes:
        parts.append(np.frombuffer(raw, np.uint8, size, offset))
        offset += size
    pos, alpha, color, scale, rot, sh = parts
    b = pos.reshape(n, 3, 3).astype(np.int32)
    fixed = (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16))
    fixed = np.where(fixed >= 1 << 23, fixed - (1 << 24), fixed)
    xyzw = _unpack_quats(rot.view("<u4")) if version == 3 else _unpack_quats_v2(rot.reshape(n, 3))
    a = np.clip(alpha / 255.0, 1e-6, 1 - 1e-6)
    t = lambda x: torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32)  # noqa: E731
    return to_rub(Gaussians(
        means=t(fixed / float(1 << bits)),
        log_scales=t(scale.reshape(n, 3) / 16.0 - 10.0),
        quats=t(xyzw[:, [3, 0, 1, 2]]),
        opacity_logits=t(np.log(a / (1 - a))),
        sh0=t((color.reshape(n, 1, 3) / 255.0 - 0.5) / _COLOR_SCALE),
        shN=t((sh.reshape(n, k1, 3).astype(np.float64) - 128.0) / 128.0),
    ))
