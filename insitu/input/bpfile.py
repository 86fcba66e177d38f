"""ADIOS2 BP files: the format checked before ADIOS2 reads it, a metadata probe, step numbers.

BP5 and BP4 are read (the engine is the file's own, :func:`check_bp` says which); BP3, ADIOS2's
format before 2.5 (a file ``NAME.bp`` with a folder ``NAME.bp.dir``), is refused with the command
that converts it. ADIOS2 2.12 hangs or crashes on truncated or corrupt BP files, so :func:`check_bp`
checks the index (``md.idx``), the metadata (``md.0``, BP5's ``mmd.0``) and the data subfiles
(``data.N``) against each other first, and :func:`probe_bp` reads every step's metadata in a child
process. Every problem raises :class:`insitu.errors.SourceInputError` naming the file at fault.
"""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from insitu.errors import SourceInputError
from insitu.input.conventions import step_number


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
    version: int = 5
    engine: str = "BP5"
    flushed: list[bool] = field(default_factory=list)   # per step: its writers flushed data before its end
    active: bool = False                      # the writer had not closed the file (it may still append)

    def data_region(self, path: str | Path, i: int, writer: int) -> tuple[Path, int, int | None, int]:
        """Where ``writer``'s data of ADIOS step index ``i`` lies: its subfile, its first byte, the byte where the
        next data of that subfile starts (another step's or writer's; the subfile's end for the last data of a
        closed file; None for the last of a file still written, which may grow there) and how many bytes of
        padding may lie between its data and that end (the next start's alignment, whose largest power of two
        bounds the padding before it, or none at a closed file's end)."""
        sub = self.subfile[writer]
        file = Path(path) / f"data.{sub}"
        start = self.steps[i][2][writer]
        later = [d[w] for _, _, d in self.steps for w in range(len(d)) if self.subfile[w] == sub and d[w] > start]
        if later:
            end = min(later)
            return file, start, end, end & -end
        if self.active or not file.is_file():
            return file, start, None, 0
        return file, start, file.stat().st_size, 0


@dataclass
class BP4Index:
    """What a BP4 directory holds: per step, where each writer's process group lies in the data."""

    steps: list[list[int]] = field(default_factory=list)   # per step: the data offset of each process group
    version: int = 4
    engine: str = "BP4"


BP3_CONVERT = 'adios2_reorganize {path} {new} BPFile "" BP5 ""'


def _bp3_error(path: Path) -> SourceInputError:
    new = path.with_name(path.stem + "-bp5.bp")
    return SourceInputError(
        f"{path}: an ADIOS2 BP3 file (the format of ADIOS2 before 2.5), which insitu does not read; it reads "
        f"BP4 and BP5. Convert it with ADIOS2's own tool: {BP3_CONVERT.format(path=path, new=new)} "
        f"(then replay {new})")


def _is_bp3_file(path: Path) -> bool:
    """A BP3 file ends with a mini-footer naming ADIOS-BP, its last byte the format version 3."""
    size = path.stat().st_size
    if size < 28:
        return False
    with open(path, "rb") as f:
        f.seek(max(0, size - 128))
        tail = f.read()
    return tail[-1] == 3 and b"ADIOS-BP" in tail


def check_bp(path: str | Path) -> BP5Index | BP4Index:
    """Check that a BP5 or BP4 directory is complete before ADIOS2 reads it; returns its index
    (``.engine``: the ADIOS2 engine that reads it).

    ADIOS2 2.12 hangs or crashes on truncated BP files, so the index (``md.idx``), the metadata
    (``md.0``, ``mmd.0``) and the data subfiles (``data.N``) are checked against each other first.
    Raises SourceInputError naming the file at fault; for a BP3 file, one that names the command
    converting it.
    """
    path = Path(path)
    if not path.exists():
        raise SourceInputError(f"{path}: no such file or directory")
    if not path.is_dir():
        if _is_bp3_file(path) or path.with_name(path.name + ".dir").is_dir():
            raise _bp3_error(path)
        raise SourceInputError(f"{path}: expected an ADIOS2 BP4 or BP5 directory, got a file")
    idx = path / "md.idx"
    if not idx.is_file():
        if path.name.endswith(".bp.dir") and path.with_name(path.name[:-4]).is_file():
            raise _bp3_error(path.with_name(path.name[:-4]))
        present = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise SourceInputError(f"{path}: not an ADIOS2 BP directory (no md.idx; it holds {present})")
    raw = idx.read_bytes()
    if len(raw) < 64 or not raw.startswith(b"ADIOS-BP"):
        raise SourceInputError(f"{idx}: truncated or corrupt index ({len(raw)} bytes, expected a 64-byte "
                               "'ADIOS-BP' header)")
    if raw[37] == 5:
        return _check_bp5(path, raw)
    if raw[37] == 4:
        return _check_bp4(path, raw)
    if raw[37] == 3:
        raise _bp3_error(path)
    raise SourceInputError(f"{idx}: BP format version {raw[37]}, expected 4 or 5")


def _check_bp5(path: Path, raw: bytes) -> BP5Index:
    """The BP5 index ``raw`` (``md.idx``) checked against ``md.0``, ``mmd.0`` and the data subfiles."""
    corrupt = f"{path}: truncated or corrupt BP5 file"
    pos, nwriters, subfile, steps, flushed = 64, 0, [], [], []
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
            flushed.append(flushes > 0)
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
    return BP5Index(steps, subfile, flushed=flushed, active=raw[39] != 0)


def _check_bp4(path: Path, raw: bytes) -> BP4Index:
    """The BP4 index ``raw`` (``md.idx``: a 64-byte header, then per step a 64-byte record of its
    metadata's extent in ``md.0``) checked against ``md.0``, whose process-group index says where each
    writer's data of the step starts, and against the data subfiles, where each process group
    (``[PGI``, its length, ..., ``PGI]``) must be whole."""
    corrupt = f"{path}: truncated or corrupt BP4 file"
    if (len(raw) - 64) % 64:
        raise SourceInputError(f"{corrupt} (md.idx ends inside a step record: {len(raw)} bytes)")
    rows = [struct.unpack_from("<8Q", raw, pos) for pos in range(64, len(raw), 64)]
    for i, (_, _, pg, var, att, end, _, _) in enumerate(rows):
        if not pg <= var <= att <= end:
            raise SourceInputError(f"{corrupt} (md.idx record of ADIOS step index {i} is inconsistent)")
    if rows:
        need_bytes(path / "md.0", max(r[5] for r in rows), corrupt, f"the metadata of ADIOS step index {len(rows) - 1}")
    md = (path / "md.0").read_bytes() if rows else b""
    subfiles = sorted((p for p in path.glob("data.*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    if rows and not subfiles:
        raise SourceInputError(f"{corrupt} (data.0 is missing)")
    index = BP4Index()
    for i, row in enumerate(rows):
        offsets = _bp4_groups(md, row[2], row[3], f"{corrupt} (md.0: the process-group index of ADIOS step index {i})")
        _check_bp4_groups(subfiles, offsets, corrupt, f"ADIOS step index {i}")
        index.steps.append(offsets)
    return index


def _bp4_groups(md: bytes, start: int, end: int, where: str) -> list[int]:
    """The data offsets of a BP4 step's process groups, from its index in ``md[start:end]``
    (u64 count, u64 length, then per group a u16 length and a record ending in its u64 offset)."""
    if end - start < 16:
        raise SourceInputError(f"{where} is cut short)")
    count, _ = struct.unpack_from("<QQ", md, start)
    pos, offsets = start + 16, []
    for _ in range(count):
        if pos + 2 > end:
            raise SourceInputError(f"{where} is cut short)")
        length = struct.unpack_from("<H", md, pos)[0]
        if length < 8 or pos + 2 + length > end:
            raise SourceInputError(f"{where} is inconsistent)")
        offsets.append(struct.unpack_from("<Q", md, pos + 2 + length - 8)[0])
        pos += 2 + length
    return offsets


def _check_bp4_groups(subfiles: list[Path], offsets: list[int], corrupt: str, what: str) -> None:
    """Every process group at ``offsets`` must lie whole in a data subfile. The groups do not say
    which subfile (aggregator) holds them: each offset must be matched by as many subfiles that
    hold a whole group there as groups start at it."""
    whole: dict[int, int] = {}
    for off in set(offsets):
        for f in subfiles:
            size = f.stat().st_size
            if off + 12 > size:
                continue
            with open(f, "rb") as h:
                h.seek(off)
                head = h.read(12)
                if head[:4] != b"[PGI":
                    continue
                end = off + 4 + struct.unpack_from("<Q", head, 4)[0]
                if end > size:
                    continue
                h.seek(end - 4)
                if h.read(4) == b"PGI]":
                    whole[off] = whole.get(off, 0) + 1
    for off in set(offsets):
        if whole.get(off, 0) < offsets.count(off):
            names = ", ".join(f"{f.name} ({f.stat().st_size} bytes)" for f in subfiles)
            raise SourceInputError(f"{corrupt} ({what}: the data written at byte {off} is not whole in {names})")


_PROBE = """
import sys
sys.modules["torch"] = None     # adios2 imports torch and cupy when present: slow, not needed here
sys.modules["cupy"] = None
import json
import adios2
from insitu.input.conventions import StepMeta, field_variable, number_record
path, engine, var, step_var, color_var = (sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4] or None,
                                          sys.argv[5] or None)


def find(meta, name):
    try:
        return field_variable(meta, name) if name else None
    except ValueError:
        return None                 # several openPMD iterations in one step: the reader says so


def value_range(info):
    try:
        return [float(info["Min"]), float(info["Max"])]
    except (KeyError, TypeError, ValueError):
        return None


ad = adios2.Adios()
io = ad.declare_io("insitu-probe")
io.set_engine(engine)
records, fields, names, error = [], [], set(), None
try:
    s = adios2.Stream(io, path, "r")
except Exception as e:              # (BP4 reads every step's metadata here)
    if "already defined" not in str(e):
        raise
    print(json.dumps({"records": [], "fields": [], "variables": [], "error": str(e)}))
    sys.exit(0)
with s:
    try:
        while s.begin_step(timeout=0.1) == adios2.bindings.StepStatus.OK:
            meta = StepMeta.of(s)
            name, colour = find(meta, var), find(meta, color_var)
            records.append(number_record(meta, name, step_var))
            names.update(meta.variables)
            fields.append({"var": name is not None, "color": colour is not None,
                           "range": value_range(meta.variables[name]) if name is not None else None})
            # what the reader asks of the step, asked here first: ADIOS2 can crash on a corrupt block index
            # (an exception instead is left to the reader, which says it in its own words)
            for v, info in meta.variables.items():
                try:
                    if info.get("SingleValue") != "true":
                        s.engine.blocks_info(v, s.current_step())
                    if v == name and len(s.inquire_variable(v).shape()) == 3:
                        s.read(v, [0, 0, 0], [1, 1, 1])
                except Exception:
                    pass
            s.end_step()
    except Exception as e:          # a step ADIOS2 cannot begin: the steps before it are listed
        error = str(e)
print(json.dumps({"records": records, "fields": fields, "variables": sorted(names), "error": error}))
"""


@dataclass
class Probe:
    """What :func:`probe_bp` read of a BP file's steps, in ADIOS step order.

    numbers:   every step's number.
    fields:    per step: ``var`` (the field is in it), ``color`` (the colour field is), ``range`` (the field's
               [min, max] from ADIOS2's statistics, None where the file has none).
    variables: the names of every variable of every step.
    """

    numbers: list[int]
    fields: list[dict]
    variables: list[str]


def unique_step(number: int, index: int, first: dict[int, int], name: str) -> None:
    """SourceInputError when ``number`` was given by another ADIOS step already (``first``: number -> index)."""
    if number in first and first[number] != index:
        raise SourceInputError(f"{name}: step number {number} is written at ADIOS step indices {first[number]} and "
                               f"{index}; expected each step number once (the outputs are named by it)")
    first[number] = index


def probe_bp(path: str | Path, timeout_s: float = 60.0, *, var: str | None = None, step_var: str | None = None,
             engine: str = "BP5", color_var: str | None = None) -> Probe:
    """Read every step's metadata of a BP file in a child process: its step numbers, and per step whether it
    holds the field ``var`` (and the colour field ``color_var``) and the field's range (:class:`Probe`).

    ADIOS2 can crash (segmentation fault) or hang on corrupt metadata; a child process
    turns either into a SourceInputError here instead of taking the reader down. The step
    numbers (:func:`insitu.input.conventions.step_number`: ``step_var``, a ``step`` variable, the
    openPMD iteration of field ``var``, else the ADIOS step index) must be unique integers >= 0. A BP4 file
    whose variable changes its type between steps (ADIOS2 cannot read on) is a SourceInputError naming it.
    """
    env = dict(os.environ)          # the child imports this package from where this process did
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")) if p)
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, str(path), engine, var or "", step_var or "",
                            color_var or ""],
                           capture_output=True, text=True, errors="replace", timeout=timeout_s, env=env)
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
        answer = json.loads(r.stdout.strip().splitlines()[-1])
        records = answer["records"]
    except (IndexError, ValueError, KeyError, TypeError):
        raise SourceInputError(f"{path}: ADIOS2 read its metadata but listed no steps") from None
    numbers, first = [], {}
    for i, rec in enumerate(records):
        n, _ = step_number(rec, i, str(path), step_var)
        unique_step(n, i, first, str(path))
        numbers.append(n)
    if answer.get("error"):
        text = adios_message(RuntimeError(answer["error"]))
        changed = re.search(r"variable (\S+) already defined", text)
        where = f" after step {numbers[-1]} (at ADIOS step index {len(numbers)})" if numbers else ""
        if changed:
            raise SourceInputError(f"{path}: variable {changed.group(1)!r} changes its type between steps{where}, "
                                   "which ADIOS2 cannot read; write it with one type in every step (or the new type "
                                   "under another name)")
        raise SourceInputError(f"{path}: truncated or corrupt BP file: ADIOS2 cannot begin the step{where} ({text})")
    return Probe(numbers, answer["fields"], answer["variables"])


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
