"""The glTF copy of a model: ``model.glb``, glTF 2.0 binary with the ``KHR_gaussian_splatting`` extension.

The extension (Khronos, https://github.com/KhronosGroup/glTF/tree/main/extensions/2.0/Khronos/KHR_gaussian_splatting,
release candidate) stores Gaussians as a ``POINTS`` primitive whose attributes are, one accessor each, float32:

    POSITION                                       VEC3    the means
    KHR_gaussian_splatting:ROTATION                VEC4    unit quaternions in glTF's order (x, y, z, w)
    KHR_gaussian_splatting:SCALE                   VEC3    standard deviations along the local axes, linear
    KHR_gaussian_splatting:OPACITY                 SCALAR  sigmoid(opacity logit), in [0, 1]
    KHR_gaussian_splatting:SH_DEGREE_0_COEF_0      VEC3    band 0 (colour = 0.2820948 * sh0 + 0.5)
    KHR_gaussian_splatting:SH_DEGREE_l_COEF_n      VEC3    band l, coefficient n (m = n - l), bands 1 to 3 if any
    COLOR_0                                        VEC4    unsigned bytes, normalised: the band-0 colour (linear,
                                                           as glTF's COLOR_0 is) and the opacity, for viewers that
                                                           draw the points without the extension

The extension object says ``kernel: ellipse``, ``colorSpace: srgb_rec709_display`` (the colours are the images'
sRGB values, blended as they are), ``projection: perspective``, ``sortingMethod: cameraDistance``. Its SH basis
(real, with the Condon-Shortley phase, coefficients ordered m = -l..l) is the reference 3DGS code's and gsplat's, so
the coefficients are stored as trained. The extension is listed in ``extensionsUsed``, not ``extensionsRequired``: a
viewer without it draws a coloured point cloud.

Axes and units: glTF's up axis is +Y, the data's is +Z. The Gaussians are turned by -90 degrees about x
(:data:`TO_GLTF`: (x, y, z) -> (x, z, -y); the quaternions composed with it, the SH bands 1 to 3 rotated with it,
:func:`sh_rotation`), so that the file's +Y is the data's +Z. The positions stay in the step's frame
(:class:`insitu.volume.Frame`: the grid's index units from its first sample, which float32 holds to 2^-24 of the
grid's extent wherever the grid lies in the world), and the node's ``scale`` (the frame's, uniform) and
``translation`` (its origin, turned likewise; JSON numbers hold a double) place them in world units: a glTF viewer
shows ``model.ply``'s world, the data's +Z as its up. The node has no rotation: the extension asks viewers to rotate
the SH bands with a node's rotation, which not all do.

The asset's ``extras`` record ``antialiased``: whether the model is meant to be drawn with the antialiased blur (each
splat's opacity scaled to keep its integral as the viewer's 0.3 px^2 widens it), as SPZ's header flag says; the
extension has no such field.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from insitu.output.files import atomic_path
from insitu.render.shading import MAX_SH_DEGREE, sh_basis
from insitu.surface.gaussians import Gaussians, check_gaussians, numpy32
from insitu.volume import Frame

EXTENSION = "KHR_gaussian_splatting"
GLB_MAGIC = 0x46546C67          # "glTF"
GLB_VERSION = 2
JSON_CHUNK = 0x4E4F534A         # "JSON"
BIN_CHUNK = 0x004E4942          # "BIN\0"
FLOAT, UNSIGNED_BYTE = 5126, 5121
ARRAY_BUFFER = 34962
POINTS = 0
# the data's frame (+Z up) -> glTF's (+Y up): a turn by -90 degrees about x
TO_GLTF = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
_TO_GLTF_QUAT = (math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0)       # (w, x, y, z) of TO_GLTF
SPLAT = {                       # the extension object: what the file's Gaussians are and how they are drawn
    "kernel": "ellipse", "colorSpace": "srgb_rec709_display", "projection": "perspective",
    "sortingMethod": "cameraDistance"}
ROTATION, SCALE, OPACITY = (f"{EXTENSION}:{name}" for name in ("ROTATION", "SCALE", "OPACITY"))
_COMPONENTS = {"SCALAR": 1, "VEC3": 3, "VEC4": 4}
_DTYPES = {5120: np.int8, 5121: np.uint8, 5122: np.int16, 5123: np.uint16, 5125: np.uint32, 5126: np.float32}


def sh_name(degree: int, coefficient: int) -> str:
    """The attribute semantic of SH band ``degree``'s coefficient ``coefficient`` (0 to 2 * degree)."""
    return f"{EXTENSION}:SH_DEGREE_{degree}_COEF_{coefficient}"


@dataclass(frozen=True)
class GlbModel:
    """A ``model.glb`` read back (:func:`read_glb`).

    gaussians:   the Gaussians in the step's frame and the data's axes (as written; float32, pre-activation).
    frame:       where that frame lies in the world (the node's scale and translation, turned back).
    antialiased: whether the model is meant to be drawn antialiased (the asset's ``extras``).
    """

    gaussians: Gaussians
    frame: Frame
    antialiased: bool


def sh_rotation(rotation: np.ndarray, degree: int) -> list[np.ndarray]:
    """The matrices that rotate SH coefficients with the directions: for ``rotation: [3, 3]`` (a proper rotation
    taking a direction d of the model to ``rotation @ d``), one ``[2l+1, 2l+1]`` float64 matrix ``D_l`` for each band
    l = 1 .. ``degree``, such that coefficients ``c`` of band l (3DGS order, m = -l..l) drawn along d give what
    ``D_l @ c`` gives along ``rotation @ d``. Solved exactly (each band is closed under rotation) by least squares
    on directions spread over the sphere."""
    rotation = np.asarray(rotation, np.float64)
    if rotation.shape != (3, 3) or not np.allclose(rotation @ rotation.T, np.eye(3), atol=1e-9) \
            or not np.isclose(np.linalg.det(rotation), 1.0):
        raise ValueError(f"sh_rotation: expected a [3, 3] rotation matrix, got {rotation.tolist()}")
    if not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"sh_rotation: expected an SH degree 0 to {MAX_SH_DEGREE}, got {degree}")
    k = np.arange(64) + 0.5                                      # a Fibonacci sphere: well spread directions
    z = 1.0 - 2.0 * k / 64
    phi = k * math.pi * (3.0 - math.sqrt(5.0))
    dirs = np.stack([np.sqrt(1 - z * z) * np.cos(phi), np.sqrt(1 - z * z) * np.sin(phi), z], 1)
    new = torch.from_numpy(dirs)                                 # directions of the rotated model
    old = torch.from_numpy(dirs @ rotation)                      # rotation.T @ d: where they came from
    a, b = sh_basis(degree, new).numpy(), sh_basis(degree, old).numpy()
    out = []
    for band in range(1, degree + 1):
        cols = slice(band * band, (band + 1) ** 2)
        out.append(np.linalg.lstsq(a[:, cols], b[:, cols], rcond=None)[0])
    return out


def to_gltf_axes(gaussians: Gaussians) -> Gaussians:
    """``gaussians`` (any frame with +Z up) turned into glTF's axes (+Y up) by :data:`TO_GLTF`: the means rotated,
    the quaternions (w, x, y, z) composed with the turn, the SH bands 1 to 3 rotated (:func:`sh_rotation`)."""
    return _turned(gaussians, TO_GLTF, _TO_GLTF_QUAT)


def from_gltf_axes(gaussians: Gaussians) -> Gaussians:
    """The inverse of :func:`to_gltf_axes`."""
    w, x, y, z = _TO_GLTF_QUAT
    return _turned(gaussians, TO_GLTF.T, (w, -x, -y, -z))


def _turned(g: Gaussians, rotation: np.ndarray, quat: tuple[float, float, float, float]) -> Gaussians:
    dd = dict(dtype=torch.float64, device=g.means.device)
    r = torch.as_tensor(rotation, **dd)
    means = (g.means.double() @ r.T).to(g.means.dtype)
    w0, x0, y0, z0 = quat
    w, x, y, z = g.quats.double().unbind(-1)
    quats = torch.stack([w0 * w - x0 * x - y0 * y - z0 * z, w0 * x + x0 * w + y0 * z - z0 * y,
                         w0 * y - x0 * z + y0 * w + z0 * x, w0 * z + x0 * y - y0 * x + z0 * w], -1)
    shN = g.shN.double().clone()
    for band, d in enumerate(sh_rotation(rotation, g.sh_degree), start=1):
        cols = slice(band * band - 1, (band + 1) ** 2 - 1)
        shN[:, cols] = torch.einsum("km,nmc->nkc", torch.as_tensor(d, **dd), shN[:, cols])
    return Gaussians(means, g.log_scales, quats.to(g.quats.dtype), g.opacity_logits, g.sh0,
                     shN.to(g.shN.dtype))


def _srgb_to_linear(c: np.ndarray) -> np.ndarray:
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def glb_arrays(gaussians: Gaussians) -> dict[str, np.ndarray]:
    """The primitive's attributes of ``gaussians`` (pre-activation, in glTF's axes: :func:`to_gltf_axes`), by
    semantic: ``[N, 3]`` or ``[N, 4]`` float32 (``[N]`` the opacity), ``COLOR_0`` ``[N, 4]`` uint8."""
    n = check_gaussians(gaussians)
    g = gaussians
    q = g.quats.detach().double().cpu()
    q = q / q.norm(dim=1, keepdim=True).clamp_min(1e-30)
    opacity = torch.sigmoid(g.opacity_logits.detach().double().cpu()).numpy()
    sh0 = numpy32(g.sh0)[:, 0, :]
    out = {"POSITION": numpy32(g.means), ROTATION: q[:, [1, 2, 3, 0]].numpy().astype(np.float32),
           SCALE: np.exp(g.log_scales.detach().double().cpu().numpy()).astype(np.float32),
           OPACITY: opacity.astype(np.float32), sh_name(0, 0): sh0}
    shN = numpy32(g.shN)
    for band in range(1, g.sh_degree + 1):
        for c in range(2 * band + 1):
            out[sh_name(band, c)] = np.ascontiguousarray(shN[:, band * band - 1 + c])
    rgb = _srgb_to_linear(np.clip(sh0.astype(np.float64) * 0.28209479177387814 + 0.5, 0.0, 1.0))
    color = np.concatenate([rgb, opacity[:, None]], 1)
    out["COLOR_0"] = np.clip(np.rint(color * 255.0), 0, 255).astype(np.uint8).reshape(n, 4)
    for name, a in out.items():
        if name != "COLOR_0" and not np.isfinite(a).all():
            raise ValueError(f"glb: the Gaussians' {name} must be finite")
    return out


def encode_glb(gaussians: Gaussians, *, frame: Frame | None = None, antialiased: bool = False) -> list[bytes]:
    """``gaussians`` (pre-activation, in ``frame``'s coordinates and the data's axes: +Z up) -> the pieces of a
    ``.glb`` file, in order (header, JSON chunk, binary chunk's header, its data): see the module's docstring.
    ``frame``: the step's (:class:`insitu.volume.Frame`; default world units), the node's scale and translation.
    ``antialiased``: the asset's ``extras``, whether the model is meant to be drawn antialiased."""
    n = check_gaussians(gaussians)
    frame = frame or Frame()
    if not (frame.scale > 0 and math.isfinite(frame.scale) and all(map(math.isfinite, frame.origin))):
        raise ValueError(f"glb: expected a frame of finite origin and positive scale, got {frame}")
    node: dict[str, Any] = {"name": "gaussians"}
    if frame.scale != 1.0:
        node["scale"] = [frame.scale] * 3
    if any(frame.origin):
        node["translation"] = (TO_GLTF @ np.asarray(frame.origin, np.float64)).tolist()
    gltf: dict[str, Any] = {
        "asset": {"version": "2.0", "generator": "insitu-gs", "extras": {"antialiased": antialiased}},
        "extensionsUsed": [EXTENSION], "scene": 0, "scenes": [{"nodes": [0]}], "nodes": [node]}
    blobs: list[bytes] = []
    if n:
        node["mesh"] = 0
        arrays = glb_arrays(to_gltf_axes(gaussians))
        accessors, views, attributes, offset = [], [], {}, 0
        for name, a in arrays.items():
            data = np.ascontiguousarray(a).tobytes()
            views.append({"buffer": 0, "byteOffset": offset, "byteLength": len(data), "target": ARRAY_BUFFER})
            accessor = {"bufferView": len(views) - 1, "componentType": UNSIGNED_BYTE if a.dtype == np.uint8 else FLOAT,
                        "count": n, "type": {1: "SCALAR", 3: "VEC3", 4: "VEC4"}[1 if a.ndim == 1 else a.shape[1]]}
            if a.dtype == np.uint8:
                accessor["normalized"] = True
            if name == "POSITION":
                accessor["min"], accessor["max"] = a.min(0).tolist(), a.max(0).tolist()
            attributes[name] = len(accessors)
            accessors.append(accessor)
            blobs.append(data)
            offset += len(data)                                   # every array's bytes a multiple of 4
        gltf.update(meshes=[{"name": "gaussians", "primitives": [{"attributes": attributes, "mode": POINTS,
                                                                   "extensions": {EXTENSION: dict(SPLAT)}}]}],
                    accessors=accessors, bufferViews=views, buffers=[{"byteLength": offset}])
    text = json.dumps(gltf, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 4)
    size = sum(map(len, blobs))
    total = 12 + 8 + len(text) + (8 + size if blobs else 0)
    if total >= 2 ** 32:
        raise ValueError(f"glb: {n} Gaussians make a file of {total} bytes; a .glb holds less than 4 GiB "
                         "(output.sh_degree 0 makes it smaller)")
    head = [struct.pack("<III", GLB_MAGIC, GLB_VERSION, total), struct.pack("<II", len(text), JSON_CHUNK), text]
    return head + ([struct.pack("<II", size, BIN_CHUNK)] + blobs if blobs else [])


def write_glb(path: str | Path, gaussians: Gaussians, *, frame: Frame | None = None,
              antialiased: bool = False) -> Path:
    """Write ``gaussians`` as ``path`` (:func:`encode_glb`), atomically; returns the path.

    gaussians:   the model, pre-activation (:class:`insitu.surface.gaussians.Gaussians`: means ``[N, 3]``,
                 log_scales ``[N, 3]``, quats ``[N, 4]`` (w, x, y, z), opacity_logits ``[N]``, sh0 ``[N, 1, 3]``,
                 shN ``[N, K-1, 3]``, K = 1, 4, 9 or 16), in ``frame``'s coordinates with +Z up.
    frame:       the coordinates ``gaussians`` are in (default world units): the node's transform.
    antialiased: whether the model is meant to be drawn antialiased (recorded in the asset's ``extras``).
    """
    pieces = encode_glb(gaussians, frame=frame, antialiased=antialiased)
    with atomic_path(path) as tmp:
        with open(tmp, "xb") as f:
            for piece in pieces:
                f.write(piece)
    return Path(path)


def read_glb(path: str | Path) -> GlbModel:
    """Read a ``.glb`` of :func:`write_glb`'s layout: one node (scale uniform, no rotation) with one ``POINTS``
    primitive of ``KHR_gaussian_splatting``, its attributes float32 or the extension's normalised integer types.
    Returns the Gaussians turned back into the data's axes (:func:`from_gltf_axes`), in the node's frame. ValueError
    naming the file and what was expected for anything else."""
    path = Path(path)
    raw = path.read_bytes()

    def fail(what: str) -> ValueError:
        return ValueError(f"{path}: {what}")

    if len(raw) < 20:
        raise fail(f"too short for a glb header ({len(raw)} bytes)")
    magic, version, total = struct.unpack_from("<III", raw)
    if magic != GLB_MAGIC or version != GLB_VERSION:
        raise fail(f"not a glTF 2.0 binary (magic {magic:#x}, version {version}; expected {GLB_MAGIC:#x}, 2)")
    if total != len(raw):
        raise fail(f"the header says {total} bytes, the file has {len(raw)}")
    chunks, at = [], 12
    while at + 8 <= len(raw):
        size, kind = struct.unpack_from("<II", raw, at)
        if at + 8 + size > len(raw):
            raise fail(f"a chunk of {size} bytes at byte {at} runs past the file's end")
        chunks.append((kind, raw[at + 8:at + 8 + size]))
        at += 8 + size
    if not chunks or chunks[0][0] != JSON_CHUNK:
        raise fail("the first chunk is not JSON")
    try:
        gltf = json.loads(chunks[0][1])
    except ValueError as e:
        raise fail(f"its JSON chunk does not parse ({e})") from None
    binary = chunks[1][1] if len(chunks) > 1 and chunks[1][0] == BIN_CHUNK else b""
    try:
        return _model(gltf, binary)
    except (KeyError, IndexError, TypeError) as e:
        raise fail(f"not a KHR_gaussian_splatting model as write_glb writes it (missing or malformed {e})") from None
    except ValueError as e:
        raise fail(str(e)) from None


def _model(gltf: dict, binary: bytes) -> GlbModel:
    scene = gltf["scenes"][gltf.get("scene", 0)]
    nodes = [gltf["nodes"][i] for i in scene.get("nodes", [])]
    if len(nodes) != 1:
        raise ValueError(f"expected one node in the scene, got {len(nodes)}")
    node = nodes[0]
    if "matrix" in node or "rotation" in node:
        raise ValueError("expected a node with scale and translation only (no matrix, no rotation)")
    scale = node.get("scale", [1.0, 1.0, 1.0])
    if len(set(scale)) != 1 or not scale[0] > 0:
        raise ValueError(f"expected a uniform positive scale, got {scale}")
    origin = TO_GLTF.T @ np.asarray(node.get("translation", [0.0, 0.0, 0.0]), np.float64)
    frame = Frame(tuple(float(v) for v in origin), float(scale[0]))
    antialiased = bool(gltf.get("asset", {}).get("extras", {}).get("antialiased", False))
    if "mesh" not in node:
        return GlbModel(Gaussians.empty(0), frame, antialiased)
    primitives = gltf["meshes"][node["mesh"]]["primitives"]
    if len(primitives) != 1 or EXTENSION not in primitives[0].get("extensions", {}):
        raise ValueError(f"expected one primitive with the {EXTENSION} extension")
    attributes = primitives[0]["attributes"]
    if primitives[0].get("mode", 4) != POINTS:
        raise ValueError(f"expected a POINTS primitive (mode 0), got mode {primitives[0].get('mode', 4)}")

    def array(name: str) -> np.ndarray:
        return _accessor(gltf, binary, attributes[name], name)

    degree = 0
    while degree < MAX_SH_DEGREE and sh_name(degree + 1, 0) in attributes:
        degree += 1
    shN = [array(sh_name(band, c)) for band in range(1, degree + 1) for c in range(2 * band + 1)]
    means, xyzw, scales = array("POSITION"), array(ROTATION), array(SCALE)
    opacity = np.clip(array(OPACITY).astype(np.float64), 1e-6, 1 - 1e-6)
    n = len(means)
    t = lambda x: torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32)  # noqa: E731
    g = Gaussians(t(means), t(np.log(np.maximum(scales.astype(np.float64), 1e-30))), t(xyzw[:, [3, 0, 1, 2]]),
                  t(np.log(opacity / (1 - opacity))), t(array(sh_name(0, 0))[:, None, :]),
                  t(np.stack(shN, 1) if shN else np.zeros((n, 0, 3))))
    check_gaussians(g)
    return GlbModel(from_gltf_axes(g), frame, antialiased)


def _accessor(gltf: dict, binary: bytes, index: int, name: str) -> np.ndarray:
    """Accessor ``index`` as float32 ``[count, components]`` (``[count]`` for a scalar), normalised integers
    mapped to [0, 1] or [-1, 1] as glTF says."""
    acc = gltf["accessors"][index]
    view = gltf["bufferViews"][acc["bufferView"]]
    dtype = np.dtype(_DTYPES[acc["componentType"]]).newbyteorder("<")
    k, count = _COMPONENTS[acc["type"]], int(acc["count"])
    stride = view.get("byteStride", k * dtype.itemsize)
    start = view.get("byteOffset", 0) + acc.get("byteOffset", 0)
    end = start + (count - 1) * stride + k * dtype.itemsize if count else start
    if end > view.get("byteOffset", 0) + view["byteLength"] or end > len(binary):
        raise ValueError(f"{name}: its accessor runs past its buffer")
    a = np.ndarray((count, k), dtype, binary, start, (stride, dtype.itemsize)).astype(np.float32)
    if acc.get("normalized"):
        a = a / np.iinfo(dtype).max if dtype.kind == "u" else np.maximum(a / np.iinfo(dtype).max, -1.0)
    return a[:, 0] if k == 1 else a
