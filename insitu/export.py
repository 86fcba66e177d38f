"""Per-step outputs: the model as a standard 3DGS ``.ply``, images, metrics and a report.

Layout of an output directory::

    OUT/step_000120/model.ply       merged Gaussians, reference 3DGS layout (any 3DGS viewer reads it)
    OUT/step_000120/model.spz       its compressed web copy (insitu.webmodel), which the report's viewer reads
    OUT/step_000120/cameras.json    the step's orbit cameras, for the viewer
    OUT/step_000120/views/*.png     held-out views, ground truth | render
    OUT/step_000120/metrics.json
    OUT/step_000120/config.yaml     the configuration the step was trained with
    OUT/metrics.csv                 one row per step
    OUT/report.html                 every step: 3D viewer, timestep slider, images, plots (insitu.report)

Every file is written atomically: to a temporary file in the same directory, renamed over the
target only once complete, so a crash never leaves a half-written file. Writing is for one
process (in a parallel run, rank 0; the functions here do not check the rank), except the
model: ``write_ply(..., comm=comm)`` and :meth:`StepWriter.write_model` are collective, every
rank writing its own shard into the one ``model.ply`` at its offset.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.recfunctions import structured_to_unstructured
import torch
import yaml
from PIL import Image
from torch import Tensor

from insitu.gaussians import Gaussians

# ---------------------------------------------------------------------------------------------
# Atomic writes


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` when the block succeeds.

    When the block raises, the temporary file is removed and ``path`` (new or existing) is left
    untouched. The temporary file is not created in advance: the block creates it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written to the temporary file for {path}")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or str as UTF-8) to ``path`` atomically; returns the path."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return path


# ---------------------------------------------------------------------------------------------
# PLY in the reference 3DGS layout

_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2",
    "ushort": "u2", "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}


def ply_property_names(sh_degree: int) -> list[str]:
    """The vertex properties of a reference 3DGS ``.ply`` with SH degree ``sh_degree``, in order."""
    if sh_degree < 0:
        raise ValueError(f"sh_degree must be >= 0, got {sh_degree}")
    n_rest = 3 * ((sh_degree + 1) ** 2 - 1)
    return (
        ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
        + [f"f_rest_{i}" for i in range(n_rest)]
        + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    )


def _check_gaussians(g: Gaussians) -> int:
    """Validate the shapes of ``g``; returns N."""
    if not isinstance(g, Gaussians):
        raise TypeError(f"expected insitu.gaussians.Gaussians, got {type(g).__name__}")
    n = g.means.shape[0] if g.means.ndim == 2 else -1
    k1 = g.shN.shape[1] if g.shN.ndim == 3 else -1
    expected = {
        "means": ((n, 3), "[N, 3]"), "log_scales": ((n, 3), "[N, 3]"), "quats": ((n, 4), "[N, 4]"),
        "opacity_logits": ((n,), "[N]"), "sh0": ((n, 1, 3), "[N, 1, 3]"), "shN": ((n, k1, 3), "[N, K-1, 3]"),
    }
    for name, (shape, text) in expected.items():
        got = tuple(getattr(g, name).shape)
        if n < 0 or got != shape:
            raise ValueError(f"Gaussians.{name} must have shape {text} (N = len(means)), got {list(got)}")
    if math.isqrt(k1 + 1) ** 2 != k1 + 1:
        raise ValueError(f"Gaussians.shN must hold K-1 coefficients with K = 1, 4, 9 or 16, got K = {k1 + 1}")
    return n


def _np32(t: Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


_PLY_CHUNK_BYTES = 1 << 26           # records are built and written 64 MiB at a time


def _ply_header(n: int, sh_degree: int) -> bytes:
    names = ply_property_names(sh_degree)
    header = f"ply\nformat binary_little_endian 1.0\nelement vertex {n}\n"
    return (header + "".join(f"property float {name}\n" for name in names) + "end_header\n").encode("ascii")


def _ply_chunks(g: Gaussians) -> Iterator[np.ndarray]:
    """The vertex records of ``g`` ([rows, properties] little-endian float32), a chunk at a time."""
    n, k1 = len(g), g.shN.shape[1]
    width = len(ply_property_names(g.sh_degree))
    rows = max(1, _PLY_CHUNK_BYTES // (4 * width))
    rest_end = 9 + 3 * k1
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        records = np.empty((hi - lo, width), dtype="<f4")
        records[:, 0:3] = _np32(g.means[lo:hi])
        records[:, 3:6] = 0.0
        records[:, 6:9] = _np32(g.sh0[lo:hi])[:, 0, :]
        records[:, 9:rest_end] = _np32(g.shN[lo:hi]).transpose(0, 2, 1).reshape(hi - lo, 3 * k1)
        records[:, rest_end] = _np32(g.opacity_logits[lo:hi])
        records[:, rest_end + 1 : rest_end + 4] = _np32(g.log_scales[lo:hi])
        records[:, rest_end + 4 : rest_end + 8] = _np32(g.quats[lo:hi])
        yield records


def write_ply(path: str | Path, gaussians: Gaussians, *, comm: Any = None) -> Path:
    """Write ``gaussians`` as a binary little-endian ``.ply`` in the reference 3DGS layout, atomically.

    Values are pre-activation as stored: opacity logits, log scales, quaternions (w, x, y, z);
    normals are zero; ``f_rest`` is ``shN: [N, K-1, 3]`` transposed to ``[N, 3, K-1]`` and flattened.
    The records are built 64 MiB at a time (the shard may stay on the GPU).

    comm: an :class:`insitu.parallel.Comm` over several ranks makes the write collective:
          ``gaussians`` is this rank's shard and the file holds every rank's shard in rank order,
          byte for byte the file of the merged model (:func:`gather_gaussians` then ``write_ply``).
          Rank 0 writes the header and sizes the file, every rank writes its own records at its
          offset (an exclusive scan of the counts) with MPI-IO, and rank 0 renames the complete
          file into place; no rank ever holds more than its own shard. A failure on any rank
          raises :class:`insitu.errors.RankFailure` on every rank and leaves ``path`` untouched.
          Returns ``path`` on every rank.
    """
    if comm is not None and comm.size > 1:
        return _write_ply_parallel(Path(path), gaussians, comm)
    _check_gaussians(gaussians)
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "xb") as f:
            f.write(_ply_header(len(gaussians), gaussians.sh_degree))
            for records in _ply_chunks(gaussians):
                records.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    return path


def _write_ply_parallel(path: Path, shard: Gaussians, comm: Any) -> Path:
    from mpi4py import MPI

    from insitu.errors import RankFailure

    with comm.phase("model.ply: check"):
        _check_gaussians(shard)
    shapes = comm.allgather_object((len(shard), shard.sh_degree))
    degrees = sorted({d for _, d in shapes})
    if len(degrees) > 1:                                   # the same on every rank: raised on every rank
        raise ValueError(f"write_ply: ranks hold different SH degrees {[d for _, d in shapes]}")
    header = _ply_header(sum(n for n, _ in shapes), degrees[0])
    record = 4 * len(ply_property_names(degrees[0]))
    offset = len(header) + record * sum(n for n, _ in shapes[:comm.rank])
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp = Path(comm.mpi.bcast(str(tmp), root=0))
    try:
        with comm.phase("model.ply: create"):
            if comm.rank == 0:
                with open(tmp, "xb") as f:
                    f.write(header)
                    f.truncate(len(header) + record * sum(n for n, _ in shapes))
        with comm.phase("model.ply: write"):               # each rank its own file handle: independent I/O
            fh = MPI.File.Open(MPI.COMM_SELF, str(tmp), MPI.MODE_WRONLY)
            try:
                for records in _ply_chunks(shard):
                    fh.Write_at(offset, records)
                    offset += records.nbytes
                fh.Sync()
            finally:
                fh.Close()
        with comm.phase("model.ply: rename"):
            if comm.rank == 0:
                os.replace(tmp, path)
    except RankFailure:
        if comm.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        raise
    return path


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

    Extra vertex properties are ignored; the SH degree follows from the number of ``f_rest_*``.
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
    missing = [name for name in ply_property_names(degree) if name not in present and name not in ("nx", "ny", "nz")]
    if missing:
        raise ValueError(f"{path}: missing 3DGS vertex properties {missing}")

    table = structured_to_unstructured(v, dtype=np.float32)      # [N, properties], a view when all are float
    index = {name: i for i, name in enumerate(dtype.names or ())}

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


# ---------------------------------------------------------------------------------------------
# Images


def to_uint8(image: Tensor | np.ndarray) -> np.ndarray:
    """``image: [H, W, 3]`` or ``[H, W, 4]``, float in [0, 1] (clipped) or uint8 -> uint8 numpy array."""
    if isinstance(image, Tensor):
        image = image.detach().cpu().numpy()
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(f"image must have shape [H, W, 3] or [H, W, 4], got {list(image.shape)}")
    if image.dtype == np.uint8:
        return image
    if not np.issubdtype(image.dtype, np.floating):
        raise ValueError(f"image must be float in [0, 1] or uint8, got dtype {image.dtype}")
    return (np.clip(np.nan_to_num(image), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def write_png(path: str | Path, image: Tensor | np.ndarray) -> Path:
    """Write ``image: [H, W, 3|4]`` (float in [0, 1] or uint8) as a PNG, atomically."""
    data = to_uint8(image)
    path = Path(path)
    with atomic_path(path) as tmp:
        Image.fromarray(data, mode="RGBA" if data.shape[2] == 4 else "RGB").save(tmp, format="PNG")
    return path


def side_by_side(gt: Tensor | np.ndarray, pred: Tensor | np.ndarray, *, separator: int = 2,
                 separator_value: int = 255) -> np.ndarray:
    """``gt: [H, W, C]`` and ``pred: [H, W, C]`` -> uint8 ``[H, 2W + separator, C]``: GT | render.

    Images are float in [0, 1] or uint8, C = 3 or 4; the separator is a vertical bar of
    ``separator`` pixels of value ``separator_value`` (opaque white by default).
    """
    a, b = to_uint8(gt), to_uint8(pred)
    if a.shape != b.shape:
        raise ValueError(f"gt and pred must have the same shape, got {list(a.shape)} and {list(b.shape)}")
    if separator < 0:
        raise ValueError(f"separator must be >= 0 pixels, got {separator}")
    bar = np.full((a.shape[0], separator, a.shape[2]), separator_value, np.uint8)
    return np.concatenate([a, bar, b], axis=1)


# ---------------------------------------------------------------------------------------------
# Metrics: JSON, CSV


def _plain(obj: Any) -> Any:
    """``obj`` as plain JSON/YAML types; non-finite floats become None (strict JSON has no inf/NaN)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return _plain(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot write a {type(obj).__name__} as JSON: {obj!r}")


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` (dicts, lists, numbers, strings, dataclasses, numpy/torch scalars) as JSON, atomically.

    Non-finite floats (e.g. the PSNR of a perfect render, ``inf``) are written as ``null``.
    """
    return atomic_write(path, json.dumps(_plain(obj), indent=2, allow_nan=False) + "\n")


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The scalar entries of ``metrics`` as one CSV row: nested dicts (and dataclasses such as
    Quality) become dotted columns; lists and other non-scalars are left out (metrics.json keeps them)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, np.generic) or (isinstance(value, Tensor) and value.numel() == 1):
            value = value.item()
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[f"{prefix}{key}"] = value
    return out


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV file with a header line, as dicts of strings ([] when the file is absent)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append_csv(path: str | Path, row: Mapping[str, Any]) -> Path:
    """Append ``row`` to the CSV at ``path``, creating it with a header; atomic.

    New keys add columns at the end (old rows get empty cells); keys missing from ``row`` stay
    empty. The whole file is rewritten each time (it holds one row per step), so it is never
    left half-written.
    """
    path = Path(path)
    if not isinstance(row, Mapping) or not row:
        raise ValueError(f"row must be a non-empty mapping of column -> value, got {row!r}")
    columns: list[str] = []
    if path.exists():
        with open(path, newline="") as f:
            columns = next(csv.reader(f), [])
    rows = read_csv(path)
    columns += [str(k) for k in row if str(k) not in columns]
    rows.append({str(k): v for k, v in row.items()})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(path, buf.getvalue())


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` as the CSV at ``path`` (columns in order of first appearance), atomically."""
    columns = list(dict.fromkeys(str(k) for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({str(k): v for k, v in r.items()} for r in rows)
    return atomic_write(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------
# Step folders, report


STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_name(step: int) -> str:
    """``step_000120`` for step 120."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return f"step_{int(step):06d}"


def step_dir(out_root: str | Path, step: int) -> Path:
    """``out_root/step_000120`` for step 120, created."""
    d = Path(out_root) / step_name(step)
    d.mkdir(parents=True, exist_ok=True)
    return d


def _results(out: Path) -> tuple[list[int], list[Path]]:
    """(complete steps, every result file and folder) in an output folder."""
    done, found = [], []
    for p in out.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append(p)
            if (p / "metrics.json").is_file():
                done.append(int(m.group(1)))
        elif p.name in ("metrics.csv", "report.html") or re.match(r"^\.step_\d{6,}\..*\.(tmp|old)$", p.name):
            found.append(p)
    return sorted(done), found


def prepare_output(out_root: str | Path, existing: str = "refuse") -> list[int]:
    """Check that ``out_root`` can take this run's results before any work; returns the steps to keep.

    existing: what to do when the folder holds results (step folders, metrics.csv, report.html):
              "refuse" (raise ConfigError), "overwrite" (delete them; other files stay),
              "resume" (keep the complete steps, returned; remove partial ones).
    Raises ConfigError when the path (or a parent) is a file or the folder cannot be written.
    Creates nothing: the first step written creates the folder.
    """
    from insitu.errors import ConfigError

    out = Path(out_root)
    if existing not in ("refuse", "resume", "overwrite"):
        raise ValueError(f"existing: expected 'refuse', 'resume' or 'overwrite', got {existing!r}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out}: is a file, expected a folder (give another --out)")
    base = out
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"output.dir {out}: {base} is a file, so the folder cannot be created")
    try:
        with tempfile.TemporaryFile(dir=base, prefix=".insitu-probe."):
            pass
    except OSError as e:
        raise ConfigError(f"output.dir {out}: cannot write in {base} ({e.strerror or e})") from None
    if base != out:
        return []
    done, found = _results(out)
    if not found:
        return []
    if existing == "refuse":
        listed = ", ".join(map(str, done[:10])) + (", ..." if len(done) > 10 else "")
        raise ConfigError(f"output.dir {out}: holds the results of an earlier run"
                          + (f" (steps {listed})" if done else "")
                          + "; give --resume to keep its complete steps and train the others, --overwrite "
                            "to delete them, or another --out (in a config: output.existing)")
    for p in found:
        m = STEP_DIR.match(p.name)
        keep = existing == "resume" and (int(m.group(1)) in done if m else not p.name.startswith("."))
        if not keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return [] if existing == "overwrite" else done


def _fmt(value: str) -> str:
    try:
        x = float(value)
    except ValueError:
        return value
    if x.is_integer() and "." not in value and "e" not in value.lower():
        return value
    return f"{x:.4g}" if math.isfinite(x) else value


def write_report(out_dir: str | Path, *, title: str = "insitu-gs", steps: Collection[int] | None = None) -> Path:
    """Write ``out_dir/report.html`` (see :func:`insitu.report.write_report`), atomically; returns its path.

    steps: only these steps' folders (default: every ``step_XXXXXX`` folder)."""
    from .report import write_report as _write_report

    return _write_report(out_dir, title=title, steps=steps)


_VIEW_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class StepWriter:
    """Writes each step's outputs under ``out_root`` (see the module docstring), atomically.

    Only one process may write to ``out_root``: in a parallel run, every rank calls
    :meth:`write_model` with its shard (a collective: the ranks write one ``model.ply``
    together), then rank 0 alone calls :meth:`write` with ``gaussians=None`` for the rest.

    A step is written into a hidden temporary folder that is renamed to ``step_XXXXXX`` once
    complete, so a step's outputs appear together or not at all. ``metrics.csv`` holds one row
    per step with its ``status`` (trained, skipped, failed) and, unless trained, the ``reason``;
    the report lists this writer's trained steps. The folder is created by the first write.

    ply:  write ``model.ply`` (``output.ply``).
    done: steps already complete in ``out_root`` that this run keeps (``prepare_output`` with
          ``resume``): their rows of ``metrics.csv`` are kept, and the report lists them too.
    """

    def __init__(self, out_root: str | Path, *, ply: bool = True, done: Collection[int] = ()) -> None:
        self.out_root = Path(out_root)
        self.ply = ply
        self._lock = threading.Lock()           # rows come from a training thread and the caller's
        self.rows: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, Path] = {}     # step -> its temporary folder, until write() renames it
        done = {int(s) for s in done}
        for r in read_csv(self.csv_path) if done else []:
            with contextlib.suppress(KeyError, ValueError):
                if int(r["step"]) in done:       # complete: trained (a csv from before statuses has none)
                    self.rows[int(r["step"])] = {"step": r["step"], "status": r.get("status") or "trained",
                                                 **{k: v for k, v in r.items() if k not in ("step", "status")}}
        for step in done - set(self.rows):
            self.rows[step] = {"step": step, "status": "trained"}

    @property
    def csv_path(self) -> Path:
        return self.out_root / "metrics.csv"

    def write_model(self, step: int, gaussians: Gaussians, comm: Any = None) -> Path | None:
        """Write the step's ``model.ply`` into its folder in the making; returns the file's path
        (None with ``ply=False``). Collective when ``comm`` spans several ranks; :meth:`write`
        on rank 0 completes the step.

        gaussians: this rank's shard (any device); the file holds every rank's shard in rank
                   order (:func:`write_ply` with ``comm``).
        comm:      an :class:`insitu.parallel.Comm`, or None for one process.
        """
        if not self.ply:
            return None
        several = comm is not None and comm.size > 1
        if not several:
            return write_ply(self._folder(step) / "model.ply", gaussians)
        with comm.phase("export: step folder"):
            folder = str(self._folder(step)) if comm.rank == 0 else None
        folder = Path(comm.mpi.bcast(folder, root=0))
        try:
            return write_ply(folder / "model.ply", gaussians, comm=comm)
        except BaseException:
            if comm.rank == 0:
                shutil.rmtree(self._pending.pop(int(step)), ignore_errors=True)
            raise

    def _folder(self, step: int) -> Path:
        """The step's temporary folder (made on first use; :meth:`write` renames it into place)."""
        if int(step) not in self._pending:
            final = self.out_root / step_name(step)
            self.out_root.mkdir(parents=True, exist_ok=True)
            self._pending[int(step)] = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp",
                                                             dir=self.out_root))
        return self._pending[int(step)]

    @property
    def trained(self) -> list[int]:
        """Steps written (or kept) by this writer."""
        return sorted(s for s, r in self.rows.items() if r.get("status") == "trained")

    def write(
        self,
        step: int,
        gaussians: Gaussians | None,
        views: Sequence[tuple[str, Tensor | np.ndarray, Tensor | np.ndarray]],
        metrics: Mapping[str, Any],
        config: Any = None,
        *,
        cameras: Any = None,
    ) -> Path:
        """Write one step; returns its folder.

        gaussians: the merged model, for model.spz (and model.ply unless :meth:`write_model` wrote it);
                   None: no web copy (model.ply only from :meth:`write_model`); ``ply=False``: neither;
        views:     (name, gt [H, W, 3], pred [H, W, 3]) per image, written as views/<name>.png (GT | render);
        metrics:   values for metrics.json and one row of metrics.csv (nested dicts get dotted columns);
        config:    the configuration used (a dataclass with ``to_dict()``, a dataclass or a dict), as config.yaml.
        cameras:   the step's views (:class:`insitu.views.Views`), as cameras.json for the report's viewer.

        With a model, its web copy ``model.spz`` is written too, and ``model_bytes``, ``web_model_bytes``
        and ``export_seconds`` (writing the model, web copy, images and cameras) join the metrics.
        """
        for name, _, _ in views:
            if not isinstance(name, str) or not _VIEW_NAME.match(name):
                raise ValueError(f"view names must be plain file names ([A-Za-z0-9_.-]+), got {name!r}")
        final = self.out_root / step_name(step)
        t0 = time.perf_counter()
        d = self._folder(step)
        metrics = dict(metrics)
        try:
            if gaussians is not None and self.ply:
                from .webmodel import write_spz

                if not (d / "model.ply").exists():      # not written by write_model already
                    write_ply(d / "model.ply", gaussians)
                write_spz(d / "model.spz", gaussians)
                metrics["model_bytes"] = (d / "model.ply").stat().st_size
                metrics["web_model_bytes"] = (d / "model.spz").stat().st_size
            if views:
                (d / "views").mkdir(exist_ok=True)
            for name, gt, pred in views:
                write_png(d / "views" / f"{name}.png", side_by_side(gt, pred))
            if cameras is not None:
                from .report import cameras_json

                write_json(d / "cameras.json", cameras_json(cameras))
            metrics["export_seconds"] = round(time.perf_counter() - t0, 3)
            write_json(d / "metrics.json", {"step": int(step), **_plain(metrics)})
            if config is not None:
                cfg = config.to_dict() if hasattr(config, "to_dict") else config
                atomic_write(d / "config.yaml", yaml.safe_dump(_plain(cfg), sort_keys=False))
            d.chmod(0o755)
            if final.exists():                      # the same step again (overwrite): the old one goes
                old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.old")
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(d, final)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        finally:
            self._pending.pop(int(step), None)
        self._row(step, {"status": "trained", **flatten_metrics(metrics)})
        return final

    def record(self, step: int, status: str, reason: str) -> None:
        """A step that was not trained: ``status`` "skipped" or "failed", and why (one row of metrics.csv)."""
        if status not in ("skipped", "failed"):
            raise ValueError(f"status: expected 'skipped' or 'failed', got {status!r}")
        if self.rows.get(int(step), {}).get("status") == "trained":
            return                                  # a step trained earlier in this run stays trained
        step_name(step)
        self.out_root.mkdir(parents=True, exist_ok=True)
        self._row(step, {"status": status, "reason": " ".join(str(reason).split())})

    def _row(self, step: int, row: Mapping[str, Any]) -> None:
        with self._lock:
            self.rows[int(step)] = {"step": int(step), **row}
            write_csv(self.csv_path, list(self.rows.values()))
            write_report(self.out_root, steps=self.trained)


# ---------------------------------------------------------------------------------------------
# Merging shards


def gather_gaussians(local: Gaussians, mpi_comm: Any) -> Gaussians | None:
    """Collect every rank's shard on rank 0 as one model, in rank order (a collective).

    local:    this rank's Gaussians (any device; every rank must have the same SH degree)
    mpi_comm: an mpi4py communicator, or None for a single process.

    Returns the merged float32 Gaussians on the CPU on rank 0, None on the other ranks; with one
    rank (or no communicator) returns ``local`` unchanged. Arrays move with MPI Gatherv (no pickling
    of the data). Mismatched shards raise ValueError on every rank, so none is left waiting.
    """
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        _check_gaussians(local)
        return local
    rank = mpi_comm.Get_rank()
    try:
        n, mine = _check_gaussians(local), (len(local), local.sh_degree, None)
    except (TypeError, ValueError) as e:
        n, mine = 0, (0, -1, f"rank {rank}: {e}")
    meta = mpi_comm.gather(mine, root=0)
    error = None
    if rank == 0:
        errors = [m[2] for m in meta if m[2]]
        degrees = [m[1] for m in meta]
        if errors:
            error = "gather_gaussians: " + "; ".join(errors)
        elif len(set(degrees)) > 1:
            error = f"gather_gaussians: ranks hold different SH degrees {degrees}"
    error = mpi_comm.bcast(error, root=0)
    if error:
        raise ValueError(error)
    counts = [m[0] for m in meta] if rank == 0 else None
    merged = {}
    for name, t in local.tensors().items():
        width = math.prod(t.shape[1:])
        send = np.ascontiguousarray(_np32(t).reshape(n, width))
        if width == 0:                      # SH degree 0 has no shN: nothing to move
            merged[name] = torch.zeros((sum(counts) if rank == 0 else 0,) + tuple(t.shape[1:]))
        elif rank == 0:
            recv = np.empty((sum(counts), width), np.float32)
            mpi_comm.Gatherv(send, (recv, [c * width for c in counts]), root=0)
            merged[name] = torch.from_numpy(recv).reshape((sum(counts),) + tuple(t.shape[1:]))
        else:
            mpi_comm.Gatherv(send, None, root=0)
    return Gaussians(**merged) if rank == 0 else None
