"""Atomic file writes and the small formats of the outputs: PNG images, JSON, CSV.

Every file is written atomically: to a temporary file in the same directory, renamed over the
target only once complete, so a crash never leaves a half-written file.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import json
import math
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Atomic writes


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` when the block succeeds.

    When the block raises, the temporary file is removed and ``path`` (new or existing) is left
    untouched; an OSError of the block (disk full...) is raised again naming ``path``
    (:func:`named_error`). The temporary file is not created in advance: the block creates it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        try:
            yield tmp
        except OSError as e:
            raise named_error(e, path) from None
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written to the temporary file for {path}")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def named_error(error: OSError, path: str | Path) -> OSError:
    """``error`` as one line that names ``path`` and the error's code, e.g. ``[Errno 28] No space left on
    device (ENOSPC): 'out/model.ply'``: a write that fails says where and why (numpy's and some
    libraries' errors name no file, or only a temporary one)."""
    code = errno.errorcode.get(error.errno) if isinstance(error.errno, int) else None
    text = " ".join(str(error.strerror or error).split())
    if code is None:
        return type(error)(f"{path}: {text}")
    return type(error)(error.errno, f"{text} ({code})", str(path))


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


def side_by_side(*images: Tensor | np.ndarray, separator: int = 2, separator_value: int = 255) -> np.ndarray:
    """``images``, each ``[H, W, C]`` (e.g. ground truth and render) -> uint8 ``[H, kW + (k-1) separator, C]``
    of the ``k`` images from left to right.

    Images are float in [0, 1] or uint8, C = 3 or 4; the separator is a vertical bar of
    ``separator`` pixels of value ``separator_value`` (opaque white by default).
    """
    if not images:
        raise ValueError("side_by_side: expected at least one image, got none")
    parts = [to_uint8(image) for image in images]
    if any(part.shape != parts[0].shape for part in parts):
        raise ValueError(f"side_by_side: expected images of one shape, got {[list(part.shape) for part in parts]}")
    if separator < 0:
        raise ValueError(f"separator must be >= 0 pixels, got {separator}")
    bar = np.full((parts[0].shape[0], separator, parts[0].shape[2]), separator_value, np.uint8)
    return np.concatenate([x for part in parts for x in (bar, part)][1:], axis=1)


# ---------------------------------------------------------------------------------------------
# Metrics: JSON, CSV


def plain(obj: Any) -> Any:
    """``obj`` as plain JSON/YAML types; non-finite floats become None (strict JSON has no inf/NaN)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist())
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
    return atomic_write(path, json.dumps(plain(obj), indent=2, allow_nan=False) + "\n")


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
