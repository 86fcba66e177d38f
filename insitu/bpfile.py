"""ADIOS2 BP files: the BP5 format checked before ADIOS2 reads it, a metadata probe, step numbers.

ADIOS2 2.12 hangs or crashes on truncated or corrupt BP5 files, so :func:`check_bp5` checks the
index (``md.idx``), the metadata (``md.0``, ``mmd.0``) and the data subfiles (``data.N``) against
each other first, and :func:`probe_bp` reads every step's metadata in a child process. Every
problem raises :class:`insitu.errors.SourceInputError` naming the file at fault.
"""
from __future__ import annotations

import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SourceInputError


def adios_message(e: BaseException) -> str:
    """ADIOS2 exception text without its colour codes and time stamp."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    text = re.sub(r"^\w+(Error|Exception):\s*", "", text)
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class BP5Index:
    """What a BP5 directory's ``md.idx`` says: per step, metadata extent and data positions."""

    steps: list[tuple[int, int, list[int]]]   # (metadata pos, metadata size, data pos per writer)
    subfile: list[int]                        # subfile index of each writer


def check_bp5(path: str | Path) -> BP5Index | None:
    """Check that a BP5 directory is complete before ADIOS2 reads it.

    ADIOS2 2.12 hangs or crashes on truncated BP5 files, so the index (``md.idx``), the
    metadata (``md.0``, ``mmd.0``) and the data subfiles (``data.N``) are checked against
    each other first. Returns the parsed index, or None for other BP versions (left to ADIOS2).
    Raises SourceInputError naming the file at fault.
    """
    path = Path(path)
    if not path.exists():
        raise SourceInputError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise SourceInputError(f"{path}: expected an ADIOS2 BP directory (BP4/BP5), got a file")
    idx = path / "md.idx"
    if not idx.is_file():
        present = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise SourceInputError(f"{path}: not an ADIOS2 BP directory (no md.idx; it holds {present})")
    raw = idx.read_bytes()
    if len(raw) < 64 or not raw.startswith(b"ADIOS-BP"):
        raise SourceInputError(f"{idx}: truncated or corrupt index ({len(raw)} bytes, expected a 64-byte "
                               "'ADIOS-BP' header)")
    if raw[37] != 5:
        return None
    corrupt = f"{path}: truncated or corrupt BP5 file"
    pos, nwriters, subfile, steps = 64, 0, [], []
    while pos < len(raw):
        if pos + 9 > len(raw):
            raise SourceInputError(f"{corrupt} (md.idx ends inside a record header at byte {pos})")
        kind, length = raw[pos:pos + 1], struct.unpack_from("<Q", raw, pos + 1)[0]
        body = raw[pos + 9:pos + 9 + length]
        if len(body) != length or length % 8:
            raise SourceInputError(f"{corrupt} (md.idx record at byte {pos} is cut short)")
        words = struct.unpack(f"<{length // 8}Q", body)
        if kind == b"w":
            if len(words) < 3 or len(words) < 3 + words[0]:
                raise SourceInputError(f"{corrupt} (md.idx writer map at byte {pos} is inconsistent)")
            nwriters = words[0]
            subfile = list(words[3:3 + nwriters])
        elif kind == b"s":
            if len(words) < 3 or nwriters == 0:
                raise SourceInputError(f"{corrupt} (md.idx step record at byte {pos} is inconsistent)")
            md_pos, md_size, flushes = words[:3]
            per_writer = 2 * flushes + 1
            if len(words) != 3 + nwriters * per_writer:
                raise SourceInputError(f"{corrupt} (md.idx step record at byte {pos} has {len(words)} entries, "
                                       f"expected {3 + nwriters * per_writer})")
            data, flush_ranges = [], []
            for w in range(nwriters):
                chunk = words[3 + w * per_writer:3 + (w + 1) * per_writer]
                flush_ranges += [(w, chunk[2 * f], chunk[2 * f + 1]) for f in range(flushes)]
                data.append(chunk[-1])
            steps.append((md_pos, md_size, data))
            for w, p, n in flush_ranges:
                need_bytes(path / f"data.{subfile[w]}", p + n, corrupt, f"ADIOS step index {len(steps) - 1}")
        else:
            raise SourceInputError(f"{corrupt} (md.idx has an unknown record type {kind!r} at byte {pos})")
        pos += 9 + length
    if steps:
        md_end = max(p + n for p, n, _ in steps)
        need_bytes(path / "md.0", md_end, corrupt, f"the metadata of ADIOS step index {len(steps) - 1}")
    _check_mmd(path / "mmd.0", corrupt)
    for i, (_, _, data) in enumerate(steps):
        for w, p in enumerate(data):
            # the data of step i-1 ends where step i's starts: the file must reach that far
            need_bytes(path / f"data.{subfile[w]}", p, corrupt, f"ADIOS step index {max(i - 1, 0)}")
    return BP5Index(steps, subfile)


_PROBE = """
import sys
sys.modules["torch"] = None     # adios2 imports torch and cupy when present: slow, not needed here
sys.modules["cupy"] = None
import json
import adios2
numbers = []
with adios2.Stream(sys.argv[1], "r") as s:
    while s.begin_step(timeout=0.1) == adios2.bindings.StepStatus.OK:
        info = s.available_variables().get("step")
        s.available_attributes()
        if info is not None and info.get("SingleValue") == "true":
            value = s.read("step")
            value = value if isinstance(value, str) else value.tolist()
            numbers.append([info.get("Type", ""), value])
        else:
            numbers.append(None)
        s.end_step()
print(json.dumps(numbers))
"""


def step_number(kind: str, value: Any, index: int, name: str) -> int:
    """The step number that a writer's ``step`` variable (``value``, of ADIOS type ``kind``) gives
    ADIOS step ``index``; ``value`` None: no such variable, the index is the number.
    SourceInputError unless it is a non-negative integer."""
    if value is None:
        return int(index)
    where = f"{name}: variable 'step' at ADIOS step index {index}"
    if kind == "string" or isinstance(value, str):
        raise SourceInputError(f"{where} is a string ({value!r}); expected an integer step number")
    v = np.asarray(value, dtype=np.float64).ravel()
    if v.size != 1 or not np.isfinite(v[0]) or v[0] != np.floor(v[0]):
        raise SourceInputError(f"{where} is {value!r}; expected an integer step number")
    if v[0] < 0:
        raise SourceInputError(f"{where} is {int(v[0])}; expected a step number >= 0 (the outputs are named by it)")
    return int(v[0])


def unique_step(number: int, index: int, first: dict[int, int], name: str) -> None:
    """SourceInputError when ``number`` was given by another ADIOS step already (``first``: number -> index)."""
    if number in first and first[number] != index:
        raise SourceInputError(f"{name}: step number {number} is written at ADIOS step indices {first[number]} and "
                               f"{index}; expected each step number once (the outputs are named by it)")
    first[number] = index


def probe_bp(path: str | Path, timeout_s: float = 60.0) -> list[int]:
    """Read every step's metadata of a BP file in a child process; returns the step numbers.

    ADIOS2 can crash (segmentation fault) or hang on corrupt metadata; a child process
    turns either into a SourceInputError here instead of taking the reader down. The step
    numbers (the ``step`` variable, else the ADIOS step index) must be unique integers >= 0.
    """
    import json

    import subprocess

    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SourceInputError(f"{path}: ADIOS2 does not finish reading the metadata within {timeout_s:g} s "
                               "(corrupt file?)") from None
    if r.returncode < 0:
        raise SourceInputError(f"{path}: truncated or corrupt BP file (ADIOS2 crashed reading its metadata, "
                               f"signal {-r.returncode})")
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        raise SourceInputError(f"{path}: truncated or corrupt BP file "
                               f"({adios_message(RuntimeError(lines[-1])) if lines else 'exit ' + str(r.returncode)})")
    try:
        records = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SourceInputError(f"{path}: ADIOS2 read its metadata but listed no steps") from None
    numbers, first = [], {}
    for i, rec in enumerate(records):
        n = step_number(*(rec or ("", None)), i, str(path))
        unique_step(n, i, first, str(path))
        numbers.append(n)
    return numbers


def need_bytes(file: Path, size: int, corrupt: str, what: str) -> None:
    """SourceInputError unless ``file`` exists and holds at least ``size`` bytes (``what`` needs them)."""
    if not file.is_file():
        raise SourceInputError(f"{corrupt} ({file.name} is missing)")
    have = file.stat().st_size
    if have < size:
        raise SourceInputError(f"{corrupt} ({file.name} has {have} bytes; {what} needs at least {size})")


def _check_mmd(file: Path, corrupt: str) -> None:
    """``mmd.0``: records of (u64 id length, u64 info length, id, info) that tile the file."""
    if not file.is_file():
        raise SourceInputError(f"{corrupt} (mmd.0 is missing)")
    raw = file.read_bytes()
    pos = 0
    while pos < len(raw):
        if pos + 16 > len(raw):
            raise SourceInputError(f"{corrupt} (mmd.0 ends inside a record header at byte {pos})")
        a, b = struct.unpack_from("<QQ", raw, pos)
        pos += 16 + a + b
        if pos > len(raw):
            raise SourceInputError(f"{corrupt} (mmd.0 is cut short: a record needs {pos} bytes, "
                                   f"the file has {len(raw)})")
