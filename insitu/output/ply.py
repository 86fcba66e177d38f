"""Gaussians as a ``.ply`` in the reference 3DGS layout (any 3DGS viewer reads it): write, read.

Each vertex also holds ``red green blue`` (uchar, the band-0 colour), so that tools that know plain PLY
point clouds (VTK: ParaView, pyvista; F3D) show a coloured cloud. The all-zero ``nx ny nz`` of the
reference layout are left out: VTK-based viewers take them for normals and shade every point black.

``write_ply(..., comm=comm)`` is collective: every rank writes its own shard into the one file at its
offset with MPI-IO. Writes are atomic (:func:`insitu.output.files.atomic_path`).
"""
from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.recfunctions import structured_to_unstructured
import torch
from torch import Tensor

from insitu.output.files import atomic_path, named_error
from insitu.surface.gaussians import SH_C0, Gaussians, check_gaussians, drop_bands, numpy32


_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2",
    "ushort": "u2", "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}


COLOR_NAMES = ("red", "green", "blue")


def ply_property_names(sh_degree: int) -> list[str]:
    """The float vertex properties of a 3DGS ``.ply`` with SH degree ``sh_degree``, in order (the reference
    layout without its zero normals); :func:`write_ply` adds ``COLOR_NAMES`` (uchar) after them."""
    if sh_degree < 0:
        raise ValueError(f"sh_degree must be >= 0, got {sh_degree}")
    n_rest = 3 * ((sh_degree + 1) ** 2 - 1)
    return (
        ["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2"]
        + [f"f_rest_{i}" for i in range(n_rest)]
        + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    )


def ply_dtype(sh_degree: int) -> np.dtype:
    """One vertex record of :func:`write_ply`: the float properties, then ``red green blue`` as uchar."""
    return np.dtype([(name, "<f4") for name in ply_property_names(sh_degree)] + [(c, "u1") for c in COLOR_NAMES])


def band0_rgb8(sh0: np.ndarray) -> np.ndarray:
    """``sh0: [N, 3]`` DC coefficients -> [N, 3] uint8 colours (``sh0 * SH_C0 + 0.5``, clipped to [0, 1])."""
    return np.clip(np.rint((sh0.astype(np.float64) * SH_C0 + 0.5) * 255.0), 0, 255).astype(np.uint8)


_PLY_CHUNK_BYTES = 1 << 26           # records are built and written 64 MiB at a time


def _ply_header(n: int, sh_degree: int) -> bytes:
    names = ply_property_names(sh_degree)
    header = f"ply\nformat binary_little_endian 1.0\nelement vertex {n}\n"
    return (header + "".join(f"property float {name}\n" for name in names)
            + "".join(f"property uchar {name}\n" for name in COLOR_NAMES) + "end_header\n").encode("ascii")


def _ply_chunks(g: Gaussians) -> Iterator[np.ndarray]:
    """The vertex records of ``g`` (bytes: [rows, record size] uint8, :func:`ply_dtype`), a chunk at a time."""
    n, k1 = len(g), g.shN.shape[1]
    width = len(ply_property_names(g.sh_degree))
    rows = max(1, _PLY_CHUNK_BYTES // (4 * width + 3))
    rest_end = 6 + 3 * k1
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        floats = np.empty((hi - lo, width), dtype="<f4")
        floats[:, 0:3] = numpy32(g.means[lo:hi])
        sh0 = numpy32(g.sh0[lo:hi])[:, 0, :]
        floats[:, 3:6] = sh0
        floats[:, 6:rest_end] = numpy32(g.shN[lo:hi]).transpose(0, 2, 1).reshape(hi - lo, 3 * k1)
        floats[:, rest_end] = numpy32(g.opacity_logits[lo:hi])
        floats[:, rest_end + 1 : rest_end + 4] = numpy32(g.log_scales[lo:hi])
        floats[:, rest_end + 4 : rest_end + 8] = numpy32(g.quats[lo:hi])
        records = np.empty((hi - lo, 4 * width + 3), dtype=np.uint8)
        records[:, : 4 * width] = floats.view(np.uint8)
        records[:, 4 * width :] = band0_rgb8(sh0)
        yield records


def write_ply(path: str | Path, gaussians: Gaussians, *, comm: Any = None, sh_degree: int | None = None) -> Path:
    """Write ``gaussians`` as a binary little-endian ``.ply`` in the reference 3DGS layout, atomically.

    Values are pre-activation as stored: opacity logits, log scales, quaternions (w, x, y, z);
    ``f_rest`` is ``shN: [N, K-1, 3]`` transposed to ``[N, 3, K-1]`` and flattened; no normals; then
    ``red green blue`` (uchar), the band-0 colour. The records are built 64 MiB at a time (the shard may
    stay on the GPU).

    sh_degree: the SH bands above this degree are left out (:func:`drop_bands`); None: all of them.

    comm: an :class:`insitu.parallel.comm.Comm` over several ranks makes the write collective:
          ``gaussians`` is this rank's shard and the file holds every rank's shard in rank order,
          byte for byte the file of the merged model (:func:`gather_gaussians` then ``write_ply``).
          Rank 0 writes the header and sizes the file, every rank writes its own records at its
          offset (an exclusive scan of the counts) with MPI-IO, and rank 0 renames the complete
          file into place; no rank ever holds more than its own shard. A failure on any rank
          raises :class:`insitu.errors.RankFailure` on every rank and leaves ``path`` untouched.
          Returns ``path`` on every rank.
    """
    gaussians = drop_bands(gaussians, sh_degree)
    if comm is not None and comm.size > 1:
        return _write_ply_parallel(Path(path), gaussians, comm)
    check_gaussians(gaussians)
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "xb") as f:
            f.write(_ply_header(len(gaussians), gaussians.sh_degree))
            for records in _ply_chunks(gaussians):
                f.write(memoryview(records).cast("B"))     # not tofile: its errors lose errno and path
            f.flush()
            os.fsync(f.fileno())
    return path


def _write_ply_parallel(path: Path, shard: Gaussians, comm: Any) -> Path:
    from mpi4py import MPI

    from insitu.errors import RankFailure

    with comm.phase("model.ply: check"):
        check_gaussians(shard)
    shapes = comm.allgather_object((len(shard), shard.sh_degree))
    degrees = sorted({d for _, d in shapes})
    if len(degrees) > 1:                                   # the same on every rank: raised on every rank
        raise ValueError(f"write_ply: ranks hold different SH degrees {[d for _, d in shapes]}")
    header = _ply_header(sum(n for n, _ in shapes), degrees[0])
    record = ply_dtype(degrees[0]).itemsize
    offset = len(header) + record * sum(n for n, _ in shapes[:comm.rank])
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp = Path(comm.mpi.bcast(str(tmp), root=0))
    try:
        with comm.phase("model.ply: create"):
            if comm.rank == 0:
                try:
                    with open(tmp, "xb") as f:
                        f.write(header)
                        f.truncate(len(header) + record * sum(n for n, _ in shapes))
                except OSError as e:
                    raise named_error(e, path) from None
        with comm.phase("model.ply: write"):               # each rank its own file handle: independent I/O
            try:
                fh = MPI.File.Open(MPI.COMM_SELF, str(tmp), MPI.MODE_WRONLY)
                try:
                    for records in _ply_chunks(shard):
                        fh.Write_at(offset, records)
                        offset += records.nbytes
                    fh.Sync()
                finally:
                    fh.Close()
            except MPI.Exception as e:
                raise mpi_io_error(e, path) from None
        with comm.phase("model.ply: rename"):
            if comm.rank == 0:
                os.replace(tmp, path)
    except RankFailure:
        if comm.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        raise
    return path


MPI_IO_ERRNO = {"ERR_NO_SPACE": errno.ENOSPC, "ERR_QUOTA": errno.EDQUOT, "ERR_ACCESS": errno.EACCES,
                "ERR_READ_ONLY": errno.EROFS, "ERR_NO_SUCH_FILE": errno.ENOENT, "ERR_FILE_IN_USE": errno.EBUSY}
# ROMIO reports most write failures as ERR_IO, with the system's message at the end of its error stack
STACK_ERRNO = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS, errno.ENOENT, errno.EIO)


def mpi_io_error(error: Any, path: Path) -> OSError:
    """An MPI-IO failure (``mpi4py.MPI.Exception``, a multi-line error stack) as the one-line OSError it
    stands for, naming ``path`` (:func:`insitu.output.files.named_error`): disk full is ENOSPC."""
    from mpi4py import MPI

    kind = error.Get_error_class()
    code = next((c for name, c in MPI_IO_ERRNO.items() if getattr(MPI, name, None) == kind), None)
    if code is None:
        text = str(error)
        code = next((c for c in STACK_ERRNO if os.strerror(c) in text), errno.EIO)
    return named_error(OSError(code, os.strerror(code)), path)


def _read_header(f: io.BufferedReader, path: Path) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """Parse a PLY header up to ``end_header``: [(element, count, [(property, numpy type)])]."""
    if f.readline().strip() != b"ply":
        raise ValueError(f"{path} is not a PLY file (it does not start with 'ply')")
    fmt = None
    elements: list[tuple[str, int, list[tuple[str, str]]]] = []
    while True:
        line = f.readline()
        if not line:
            raise ValueError(f"{path}: the PLY header has no 'end_header'")
        words = line.decode("ascii", errors="replace").split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "end_header":
            break
        if words[0] == "format":
            fmt = words[1]
        elif words[0] == "element":
            elements.append((words[1], int(words[2]), []))
        elif words[0] == "property":
            if not elements:
                raise ValueError(f"{path}: PLY property before any element")
            if words[1] == "list":
                raise ValueError(f"{path}: list properties are not supported (element {elements[-1][0]!r})")
            if words[1] not in _PLY_TYPES:
                raise ValueError(f"{path}: unknown PLY property type {words[1]!r}")
            elements[-1][2].append((words[2], _PLY_TYPES[words[1]]))
    if fmt != "binary_little_endian":
        raise ValueError(f"{path}: expected format binary_little_endian, got {fmt!r}")
    return elements


def read_ply(path: str | Path) -> Gaussians:
    """Read a 3DGS ``.ply`` (as written by :func:`write_ply` or the reference code) into float32 Gaussians.

    Extra vertex properties (normals, colours) are ignored; the SH degree follows from the number of
    ``f_rest_*``.
    """
    path = Path(path)
    with open(path, "rb") as f:
        elements = _read_header(f, path)
        if not elements or elements[0][0] != "vertex":
            raise ValueError(f"{path}: expected 'vertex' as the first PLY element, got {[e[0] for e in elements]}")
        _, n, props = elements[0]
        dtype = np.dtype([(name, "<" + t) for name, t in props])
        v = np.fromfile(f, dtype=dtype, count=n)
    if len(v) < n:
        raise ValueError(f"{path}: truncated: {n} vertices of {dtype.itemsize} bytes expected, found {len(v)}")
    present = set(dtype.names or ())
    n_rest = sum(1 for name in present if name.startswith("f_rest_"))
    k = n_rest // 3 + 1
    if n_rest % 3 or math.isqrt(k) ** 2 != k:
        raise ValueError(f"{path}: {n_rest} f_rest_* properties; expected 3 * (K - 1) with K = 1, 4, 9 or 16")
    degree = math.isqrt(k) - 1
    missing = [name for name in ply_property_names(degree) if name not in present]
    if missing:
        raise ValueError(f"{path}: missing 3DGS vertex properties {missing}")

    floats = [name for name in dtype.names or () if dtype[name].kind == "f"]
    table = structured_to_unstructured(v[floats], dtype=np.float32)     # [N, float properties]
    index = {name: i for i, name in enumerate(floats)}

    def cols(*names: str) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(table[:, [index[name] for name in names]]))

    rest = [f"f_rest_{i}" for i in range(n_rest)]
    return Gaussians(
        means=cols("x", "y", "z"),
        log_scales=cols("scale_0", "scale_1", "scale_2"),
        quats=cols("rot_0", "rot_1", "rot_2", "rot_3"),
        opacity_logits=cols("opacity").reshape(n),
        sh0=cols("f_dc_0", "f_dc_1", "f_dc_2").reshape(n, 3, 1).transpose(1, 2).contiguous(),
        shN=(cols(*rest) if rest else torch.zeros(n, 0)).reshape(n, 3, k - 1).transpose(1, 2).contiguous(),
    )
