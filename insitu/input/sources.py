"""Timestep sources: ``for step in source:`` yields this rank's block of each timestep.

Sources:

- ``ArraySource``: a whole numpy array (one step), cut for this rank.
- ``RawSource``: a raw volume file (``NAME_XxYxZ_uint8.raw``), read and cut for this rank.
- ``BPSource``: replay of an ADIOS2 BP file, each rank reading only its own block.
- ``SSTSource``: a live ADIOS2 SST stream, each rank reading only its own block.

Every source is a context manager and an iterable of ``Step``::

    with open_source("run.bp", cfg, rank, size) as source:
        for step in source:
            train(step.block)

ADIOS2 readers are serial (the PyPI wheel has no MPI): every rank opens its own reader
and selects its block with a start/count selection (ghost layers included). Over SST
every rank is therefore its own reader cohort, and the writer must expect them all:
set its ``RendezvousReaderCount`` to the number of reader ranks (or 0 to start without
waiting for readers, in which case steps written before a reader joins are not seen by
it). With ``QueueFullPolicy=Discard`` the cohorts may see different steps; give the
sources an MPI communicator (``comm=``) and they agree collectively, at every step, on the
step they all hold (ranks that are behind skip forward), on the end of the stream, and on
errors, so that no rank is left waiting in a collective.

Failures raise ``SourceError`` (an ``insitu.errors.InputError`` and a ``RuntimeError``):
a stream that ends unexpectedly, or one that delivers no step in time. Input that cannot
be used (a missing file or variable, a variable that is not 3D, a truncated or corrupt
BP file, a step whose selection of samples cannot fit a rank's share of the machine's
memory, checked from the declared shape before anything is read) raises its subclass
``SourceInputError``. Every step completed before a failure has been yielded.
"""
from __future__ import annotations

import abc
import bisect
import math
import os
import re
import sys
import tempfile
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from insitu.config import Config
from insitu.errors import SourceError, SourceInputError
from insitu.input.bpfile import Probe, adios_message, check_bp, need_bytes, probe_bp, unique_step
from insitu.input.conventions import StepMeta, field_variable, geometry, number_record, step_number, step_time
from insitu.input.decomposition import block_extent, coords_rank, cut_block, split_dims
from insitu.parallel.agreement import agree_errors, first_error
from insitu.volume import Block, check_field, check_geometry, downsample, read_raw


@dataclass
class Step:
    """One timestep as this rank sees it.

    step:  the simulation's step number (the ``step`` variable when the writer wrote one,
           else the ADIOS2 step index).
    time:  the simulation time (the ``time`` variable when written, else ``float(step)``).
    block: this rank's block, one ghost layer included (``block.fields`` holds the colour field).
    """

    step: int
    time: float
    block: Block


class _Source(abc.ABC):
    """Context manager and iterable of Step; subclasses implement ``_steps``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[Step]:
        return self._steps()

    @abc.abstractmethod
    def _steps(self) -> Iterator[Step]:
        """Yield this rank's steps."""


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank/size: expected 0 <= rank < size and size >= 1, got rank={rank}, size={size}")


def _xyz3(name: str, value: Sequence[float]) -> tuple[float, float, float]:
    v = tuple(float(x) for x in np.asarray(value, dtype=np.float64).ravel())
    if len(v) != 3:
        raise SourceInputError(f"{name}: expected 3 values (x, y, z), got {value!r}")
    return v  # type: ignore[return-value]


class ArraySource(_Source):
    """A whole [nz, ny, nx] array as a single step, cut for this rank.

    array:  [nz, ny, nx] the global field (every rank passes the same array).
    fields: name -> [nz, ny, nx] other fields on the same samples (e.g. a colour field).
    downsample: keep every k-th sample per axis (box filter); spacing grows by k.
    nonfinite: "error" (NaN/Inf samples are an InputError) or "outside" (let through: a mask that
               the driver fills, :func:`insitu.step.driver.masked`).
    """

    def __init__(self, array: np.ndarray, *, rank: int = 0, size: int = 1,
                 origin: Sequence[float] = (0.0, 0.0, 0.0), spacing: Sequence[float] = (1.0, 1.0, 1.0),
                 fields: dict[str, np.ndarray] | None = None, step: int = 0, time: float = 0.0,
                 downsample: int = 1, name: str = "field", nonfinite: str = "error"):
        _check_rank(rank, size)
        if downsample < 1:
            raise ValueError(f"downsample: expected an integer >= 1, got {downsample}")
        array = check_field(array, name, nonfinite=nonfinite)
        for key, other in (fields or {}).items():
            if np.shape(other) != array.shape:
                raise SourceInputError(f"{key}: expected the shape of {name} {array.shape}, got {np.shape(other)}")
        self.array = _downsample(array, downsample)
        self.fields = {k: _downsample(np.asarray(v), downsample) for k, v in (fields or {}).items()}
        spacing = tuple(s * downsample for s in _xyz3("spacing", spacing))
        self.origin, self.spacing = check_geometry(origin, spacing, self.array.shape[::-1], error=SourceInputError)
        self.rank, self.size = rank, size
        self.step, self.time = int(step), float(time)

    def _steps(self) -> Iterator[Step]:
        block = cut_block(self.array, self.rank, self.size, self.origin, self.spacing, self.fields)
        # a read-only memory map (a .npy file) cut for one rank is a view of it: copy this rank's block
        if not block.data.flags.writeable:
            block.data = np.array(block.data)
        block.fields = {k: v if v.flags.writeable else np.array(v) for k, v in block.fields.items()}
        yield Step(self.step, self.time, block)


def _downsample(array: np.ndarray, factor: int) -> np.ndarray:
    out = downsample(array, factor)
    if min(out.shape) < 2:
        raise SourceInputError(f"downsample {factor}: leaves {out.shape} samples, expected >= 2 per axis")
    return out


class RawSource(ArraySource):
    """A raw volume file ``NAME_XxYxZ_DTYPE.raw`` (Open SciVis convention) as one step.

    Each rank reads the file and keeps its block. dims (x, y, z) and dtype default to
    those in the file name.
    """

    def __init__(self, path: str | Path, *, rank: int = 0, size: int = 1, dims: Sequence[int] | None = None,
                 dtype: str | None = None, downsample: int = 1,
                 origin: Sequence[float] = (0.0, 0.0, 0.0), spacing: Sequence[float] = (1.0, 1.0, 1.0),
                 nonfinite: str = "error"):
        self.path = Path(path)
        array = read_raw(self.path, tuple(dims) if dims is not None else None, dtype)
        super().__init__(array, rank=rank, size=size, origin=origin, spacing=spacing,
                         downsample=downsample, name=self.path.name, nonfinite=nonfinite)


# ---- ADIOS2 ------------------------------------------------------------------------------


def _adios2():
    try:
        import adios2
    except ImportError as e:  # pragma: no cover - adios2 is installed where sources are used
        raise SourceError(f"reading ADIOS2 data needs the adios2 package ({e}); pip install adios2") from None
    return adios2


class _Unusable(Exception):
    """This step cannot be used (no such variable, not a 3D array, ...): it is skipped, the next one read."""


class _AdiosSource(_Source):
    """Shared step loop of BPSource and SSTSource (one serial ADIOS2 reader per rank).

    Steps whose field cannot be used (the variable missing, not a 3D array, a local array of several
    blocks, a sparse array without ``nonfinite="outside"``) are not yielded: they are listed in
    ``skipped`` as (step, reason), the same on every rank, and the next step is read.
    """

    engine = "BP5"

    def __init__(self, name: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None,
                 step_var: str | None = None, time_var: str | None = None, origin: Sequence[float] | None = None,
                 spacing: Sequence[float] | None = None, nonfinite: str = "error"):
        _check_rank(rank, size)
        if every < 1:
            raise ValueError(f"every: expected an integer >= 1, got {every}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite: expected one of {', '.join(NONFINITE)}, got {nonfinite!r}")
        if comm is not None and (comm.Get_rank() != rank or comm.Get_size() != size):
            raise ValueError(f"comm: rank/size {comm.Get_rank()}/{comm.Get_size()} differ from rank={rank}, size={size}")
        self.name = str(name)
        self.var, self.color_var = var, color_var
        self.step_var, self.time_var = step_var, time_var
        self.origin, self.spacing = origin, spacing
        self.nonfinite = nonfinite
        self.rank, self.size = rank, size
        self.steps = None if steps is None else {int(s) for s in steps}
        self.every = int(every)
        self.timeout_s = float(timeout_s)
        self.comm = comm if comm is not None and comm.Get_size() > 1 else None
        self.last_step: int | None = None        # the last step completed (yielded or skipped)
        self.dropped = 0                         # steps this rank held but dropped to agree with the others
        self.read_seconds: list[float] = []      # per step read: this rank's block (and end_step)
        self.seen: list[int] = []                # every step number met (read or not)
        self.skipped: list[tuple[int, str]] = []  # steps whose field could not be used, and why
        self.numbering: str | None = None        # what gave the step numbers (e.g. "variable 'step'")
        self._first: dict[int, int] = {}         # step number -> the ADIOS step index that gave it
        self._said: set[str] = set()             # notes printed once
        self._meta: StepMeta | None = None       # the current step's names and attribute readers
        self._field: str | None = None           # the current step's variable holding ``var``
        self._stream = None
        self._used = False
        self._open()
        self._room = memory_share(self.comm)     # (bytes, how counted): what one step's selection may take

    # -- subclass hooks ----------------------------------------------------------------------
    def _params(self) -> dict[str, str]:
        return {}

    def _open_error(self, e: Exception) -> SourceError:
        return SourceInputError(f"{self.name}: cannot open as ADIOS2 {self.engine} ({adios_message(e)})")

    def _check_step_data(self, stream) -> None:
        pass

    def _after(self) -> str:
        return f"after step {self.last_step}" if self.last_step is not None else "before its first step"

    def _ended_unexpectedly(self) -> SourceError:
        return SourceError(f"{self.name}: stream ended unexpectedly {self._after()} "
                           "(the writer stopped without closing it)")

    def _step_error(self, e: Exception) -> SourceError:
        return SourceError(f"{self.name}: reading the next step failed {self._after()} ({adios_message(e)})")

    # -- opening and closing -----------------------------------------------------------------
    def _open(self) -> None:
        adios2 = _adios2()
        error = None
        try:
            self._adios = adios2.Adios()
            io = self._adios.declare_io(f"insitu-reader-{self.engine}")
            io.set_engine(self.engine)
            io.set_parameters(self._params())
            self._stream = adios2.Stream(io, self.name, "r")
        except SourceError as e:
            error = e
        except Exception as e:
            error = self._open_error(e)
        self._agree(error)

    def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            try:
                stream.close()
            except Exception:
                pass             # a dead writer can make close complain; nothing is left to release

    def _agree(self, error: SourceError | None, skip: str | None = None) -> str | None:
        """Raise on every rank when any rank failed (no rank is left waiting); else the first rank's
        reason to skip this step, if any rank has one (every rank then skips it)."""
        if self.comm is not None:
            states = agree_errors(self.comm, (None if error is None else str(error), skip))
            bad = first_error([e for e, _ in states])
            if bad is not None and error is None:
                self.close()
                raise SourceError(f"rank {bad[0]}: {bad[1]}")
            skip = next((s for _, s in states if s is not None), None)
        if error is not None:
            self.close()
            raise error
        return skip

    def _say(self, text: str) -> None:
        """Print a note once (rank 0)."""
        if text not in self._said and self.rank == 0:
            print(text, file=sys.stderr, flush=True)
        self._said.add(text)

    # -- one step ------------------------------------------------------------------------------
    def _next_status(self):
        """ADIOS2's ``begin_step``, waiting up to ``timeout_s`` for the next step without holding the GIL: the
        adios2 binding holds it for as long as ``begin_step`` waits, which would stop the step writer's thread
        (the step just trained stays a ``.step_*.tmp`` folder) and every signal handler (Ctrl-C, SIGTERM) for that
        long. So it asks without waiting (timeout 0: a BP file that is still written, or an SST stream, answers
        at once) and sleeps ``POLL_S`` between asks, in Python."""
        not_ready = _adios2().bindings.StepStatus.NotReady
        deadline = _time.monotonic() + self.timeout_s
        while True:
            status = self._stream.begin_step(timeout=0.0)
            if status != not_ready or _time.monotonic() >= deadline:
                return status
            _time.sleep(min(POLL_S, max(deadline - _time.monotonic(), 0.0)))

    def _begin(self) -> tuple[str, int | None]:
        """Begin the next step: ("ok", step number) | ("end", None); raises SourceError."""
        adios2 = _adios2()
        s = self._stream
        try:
            status = self._next_status()
        except Exception as e:
            raise self._step_error(e) from None
        if status == adios2.bindings.StepStatus.EndOfStream:
            return "end", None
        if status == adios2.bindings.StepStatus.NotReady:
            raise SourceError(f"{self.name}: no step arrived within {self.timeout_s:g} s {self._after()}")
        if status != adios2.bindings.StepStatus.OK:
            raise self._ended_unexpectedly()
        try:
            index = int(s.current_step())
            self._meta = StepMeta.of(s)
            self._field = field_variable(self._meta, self.var)
            record = number_record(self._meta, self._field, self.step_var)
        except SourceError as e:
            raise SourceInputError(f"{self.name}: {e}") from None
        except Exception as e:
            raise self._step_error(e) from None
        number, numbering = step_number(record, index, self.name, self.step_var)
        if self.numbering is None and numbering == "the ADIOS step index" and index == 0:
            self._say(f"{self.name}: steps are numbered by their ADIOS step index (no variable step or Step, no "
                      "openPMD iteration); input.step_var names the variable or attribute that numbers them")
        self.numbering = self.numbering or numbering
        unique_step(number, index, self._first, self.name)
        self.seen.append(number)
        return "ok", number

    def _begin_agreed(self) -> tuple[str, int | None]:
        """Begin a step that every rank holds (ranks behind skip forward); collective with comm."""
        error = None
        try:
            state = self._begin()
        except SourceError as e:
            error, state = e, ("error", None)
        if self.comm is None:
            if error is not None:
                raise error
            return state
        while True:
            self._agree(error)
            states = self.comm.allgather(state)
            if any(kind == "end" for kind, _ in states):
                if state[0] == "ok":
                    self._stream.end_step()
                # a rank whose stream ended cannot catch up: the stream ends for all
                if any(kind == "ok" for kind, _ in states):
                    held = sorted({n for kind, n in states if kind == "ok"})
                    if self.rank == 0:
                        print(f"{self.name}: stream ended on some ranks; steps {held} held by others are dropped",
                              file=sys.stderr, flush=True)
                return "end", None
            target = max(n for _, n in states)
            if all(n == target for _, n in states):
                return state
            if state[1] < target:           # behind (Discard policy): drop this step, take the next
                self._stream.end_step()
                self.dropped += 1
                try:
                    state = self._begin()
                except SourceError as e:
                    error, state = e, ("error", None)

    def _variable(self, var: str, name: str | None, number: int, what: str = "variable") -> dict:
        """Where variable ``name`` (holding ``var``) lies in the file: ``shape`` (C order, the file's),
        ``blocks`` and whether it is a ``local`` array. _Unusable when the step cannot use it."""
        meta = self._meta
        if name is None:
            names = ", ".join(sorted(meta.variables)[:40]) or "none"
            more = ", ..." if len(meta.variables) > 40 else ""
            raise _Unusable(f"no {what} {var!r} at step {number}; variables present: {names}{more}")
        info = meta.variables[name]
        kind = info.get("Type", "?")
        if info.get("SingleValue") == "true":
            raise _Unusable(f"{what} {name!r} is a single value ({kind}) at step {number}, expected a 3D global "
                            "array [z, y, x] with >= 2 samples per axis")
        blocks = self._blocks(name)
        local = not info.get("Shape", "").strip()
        if local:
            if len(blocks) != 1:
                raise _Unusable(f"{what} {name!r} is a local array of {len(blocks)} blocks at step {number} (no "
                                "global shape: the file does not say where its blocks lie), which insitu does not "
                                "read; write it as a global array (shape, start and count), or as one block")
            shape = tuple(blocks[0]["count"])
        else:
            shape = tuple(int(x) for x in info["Shape"].split(",") if x.strip())
        if len(shape) != 3 or min(shape) < 2:
            raise _Unusable(f"{what} {name!r} is shape {shape} ({kind}) at step {number}, expected a 3D global "
                            "array [z, y, x] with >= 2 samples per axis")
        if kind not in _NUMERIC:
            raise _Unusable(f"{what} {name!r} is of type {kind} at step {number}, expected a real number type "
                            f"({', '.join(_NUMERIC)})")
        for i, b in enumerate(blocks):
            lo = b["start"] if b["start"] is not None and not local else [0] * len(shape)
            if len(lo) != len(shape) or len(b["count"]) != len(shape) or any(
                    s < 0 or c < 0 or s + c > n for s, c, n in zip(lo, b["count"], shape)):
                raise SourceInputError(f"{self.name}: truncated or corrupt BP file: block {i} of {what} {name!r} at "
                                       f"step {number} (start {b['start']}, count {b['count']}) lies outside its "
                                       f"declared shape {shape}")
        self._check_operators(name, number)
        return {"name": name, "shape": shape, "blocks": blocks, "local": local,
                "itemsize": np.dtype(_adios_dtype(kind)).itemsize}

    def _blocks(self, name: str) -> list[dict]:
        """The step's blocks of variable ``name``: ``start`` (None where ADIOS2 cannot say), ``count``,
        ``writer`` (None where unknown), in the file's C order."""
        s = self._stream
        try:
            info = s.engine.blocks_info(name, int(s.current_step()))
        except UnicodeDecodeError:
            # adios2's Python blocks_info returns the min/max of (u)int8 blocks as characters, which
            # fail to decode above 127: take each block's count from the variable instead
            var, out = s.inquire_variable(name), []
            while True:
                try:
                    var.set_block_selection(len(out))
                    count = list(var.count())
                except Exception:
                    return out
                out.append({"start": None, "count": count, "writer": None})
        ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
        return [{"start": ints(b["Start"]), "count": ints(b["Count"]), "writer": int(b.get("WriterID", 0))}
                for b in info]

    def _check_operators(self, name: str, number: int) -> None:
        """SourceInputError when the variable is compressed with an operator this ADIOS2 lacks."""
        try:
            ops = [op.Type() for op in self._stream.inquire_variable(name).operations()]
        except Exception:
            ops = []
        for op in ops:
            if not _has_operator(op):
                raise SourceInputError(_compressed_message(self.name, name, number, op))

    def _plan(self, number: int) -> dict:
        """Check this step's field before reading it: what this rank reads, where it lies, what masks.
        _Unusable when the step cannot be used; SourceInputError when the file cannot be."""
        field_ = self._variable(self.var, self._field, number)
        colour = None
        if self.color_var is not None:
            colour = self._variable(self.color_var, field_variable(self._meta, self.color_var), number,
                                    "colour variable")
            if colour["shape"] != field_["shape"]:
                raise _Unusable(f"colour variable {colour['name']!r} has shape {colour['shape']}, expected the shape "
                                f"of {field_['name']!r} {field_['shape']} (step {number})")
        geo = geometry(self._meta, field_["name"], self.name, self.origin, self.spacing, field_["shape"])
        axes = geo.axes
        zyx = tuple(field_["shape"][a] for a in axes)
        gshape = tuple(reversed(zyx))                                  # (x, y, z)
        dims = split_dims(gshape, self.size)
        ext = block_extent(self.rank, dims, gshape)
        start, count = [0, 0, 0], [0, 0, 0]
        for d, a in enumerate(axes):                                   # our (z, y, x) -> the file's axes
            start[a], count[a] = ext.start[2 - d], ext.count[2 - d]
        plan = {"field": field_, "colour": colour, "geometry": geo, "ext": ext, "gshape": gshape,
                "start": start, "count": count}
        variables = {key: var for key, var in (("field", field_), ("colour", colour)) if var is not None}
        widest, largest = largest_block(dims, gshape), [0, 0, 0]   # every rank checks it: the same verdict
        for d, a in enumerate(axes):
            largest[a] = widest[2 - d]
        self._check_room(list(variables.values()), largest, number)
        gaps = {key: self._coverage(var, start, count, number) for key, var in variables.items()}
        for key, (parts, why) in gaps.items():
            if why is not None and parts is None:
                raise _Unusable(why)
            if why is not None and self.nonfinite != "outside":
                raise _Unusable(why + "; give input.nonfinite=outside to count the uncovered samples as outside "
                                "the surface")
            plan[key + "_gap"] = parts if why is not None else None
        return plan

    def _coverage(self, var: dict, start: list[int], count: list[int],
                  number: int) -> tuple[list[tuple[slice, ...]] | None, str | None]:
        """Whether the variable's blocks cover this rank's selection (file order), from their boxes
        alone (nothing of the selection's size is allocated): ``(None, None)`` when they do; else
        ``(parts, why)``: the selection's slices that blocks cover (None where ADIOS2 does not say where
        the blocks lie, so the gap cannot be masked) and the sparse array's description."""
        if var["local"]:
            return None, None
        if any(b["start"] is None for b in var["blocks"]):
            total = math.prod(var["shape"])
            have = sum(math.prod(b["count"]) for b in var["blocks"])
            if have >= total:
                return None, None
            return None, (f"variable {var['name']!r} at step {number} is a sparse array: its blocks hold {have} of "
                          f"its {total} samples (the rest would read as 0), and for its type ADIOS2's Python "
                          "reader does not say where the blocks lie, so the gap cannot be masked")
        parts = []
        for b in var["blocks"]:
            lo = [max(s, bs) for s, bs in zip(start, b["start"])]
            hi = [min(s + c, bs + bc) for s, c, bs, bc in zip(start, count, b["start"], b["count"])]
            if all(h > l for l, h in zip(lo, hi)):
                parts.append((tuple(l - s for l, s in zip(lo, start)), tuple(h - s for h, s in zip(hi, start))))
        first = first_uncovered(parts, count)
        if first is None:
            return None, None
        k = tuple(int(i + s) for i, s in zip(first, start))
        return ([tuple(slice(l, h) for l, h in zip(lo, hi)) for lo, hi in parts],
                f"variable {var['name']!r} at step {number} is a sparse array: its blocks do not cover its global "
                f"shape {var['shape']} (sample {k} of the file's [slowest, ..., fastest] index is in no block; it "
                "would read as 0)")

    def _check_room(self, variables: list[dict], count: list[int], number: int) -> None:
        """SourceInputError when a selection of ``count`` samples (file order) of the step's variables
        cannot fit a rank's share of the machine's memory: the samples as read and the float32 copy the
        step makes of each (a sparse array's NaN-filled copy too, with ``nonfinite="outside"``), checked
        before any of it is allocated."""
        samples = math.prod(count)
        need, what, filled = 0, [], False
        for var in variables:
            itemsize = var["itemsize"]
            fill = self.nonfinite == "outside" and _sparse(var)
            need += samples * (itemsize + 4 + (gap_dtype(itemsize).itemsize if fill else 0))
            what.append(f"variable {var['name']!r} (declared shape {var['shape']}, {itemsize}-byte samples)")
            filled = filled or fill
        room, where = self._room
        if need > room:
            on = f"per rank on {self.size} ranks" if self.size > 1 else "on one rank"
            whose = "the largest rank's" if self.size > 1 else "its"
            copies = "the samples read and the float32 copy the step makes of them"
            if filled:
                copies += ", and a NaN-filled copy of the sparse array"
            raise SourceInputError(
                f"{self.name}: step {number}: {' and '.join(what)} need{'s' if len(what) == 1 else ''} at least "
                f"{_bytes(need)} {on} ({need} bytes for {whose} {' x '.join(map(str, count))} samples: {copies}), "
                f"more than a rank's {_bytes(room)} ({where}); run on more ranks (each reads its own block)")

    def _load(self, plan: dict, number: int) -> Step:
        """Read this rank's block of the planned step."""
        s = self._stream
        self._check_step_data(s)
        arrays = {}
        for key in ("field", "colour"):
            var = plan[key]
            if var is None:
                continue
            try:
                data = s.read(var["name"], plan["start"], plan["count"], **({"block_id": 0} if var["local"] else {}))
            except Exception as e:
                text = adios_message(e)
                op = re.search(r"didn't compile with (\w+) library|does not support (\w+) operation", text)
                if op:
                    raise SourceInputError(_compressed_message(self.name, var["name"], number,
                                                               op.group(1) or op.group(2))) from None
                raise SourceInputError(f"{self.name}: reading {var['name']!r} at step {number} failed ({text})") from None
            parts = plan[key + "_gap"]
            if parts is not None:             # a sparse array: what no block covers reads as NaN
                filled = np.full(data.shape, np.nan, gap_dtype(data.dtype.itemsize))
                for part in parts:
                    filled[part] = data[part]
                data = filled
            arrays[key] = np.ascontiguousarray(np.transpose(data, plan["geometry"].axes))
        geo = plan["geometry"]
        if geo.index_units:
            self._say(f"insitu: warning: {self.name}: no {' or '.join(geo.index_units)} for {plan['field']['name']!r} "
                      "in the file (attributes Fides_Origin/Fides_Spacing, openPMD gridGlobalOffset/gridSpacing, "
                      "origin/spacing or vtk.xml): the model is in index units (origin 0, spacing 1); give "
                      "input.origin and input.spacing")
        t = step_time(self._meta, plan["field"]["name"], number, self.name, self.time_var)
        ext = plan["ext"]
        fields = {self.color_var: arrays["colour"]} if "colour" in arrays else {}
        block = Block(arrays["field"], ext.start, plan["gshape"], ext.owned_lo, ext.owned_hi, geo.origin,
                      geo.spacing, fields)
        return Step(number, t, block)

    def _steps(self) -> Iterator[Step]:
        if self._used:
            raise SourceError(f"{self.name}: a stream can be iterated once; open a new source to read it again")
        self._used = True
        if self._stream is None:
            raise SourceError(f"{self.name}: the source is closed")
        arrived = 0
        try:
            while True:
                kind, number = self._begin_agreed()
                if kind == "end":
                    return
                t0 = _time.perf_counter()
                plan, error, skip = None, None, None
                if self.steps is None or number in self.steps:
                    try:
                        plan = self._plan(number)
                    except _Unusable as e:
                        skip = str(e)
                    except SourceError as e:
                        error = e
                skip = self._agree(error, skip)
                if skip is not None:
                    plan = None
                    self.skipped.append((number, skip))
                    self._say(f"{self.name}: step {number} skipped: {skip}")
                step = None
                if plan is not None:
                    arrived += 1
                    if (arrived - 1) % self.every == 0:
                        try:
                            step = self._load(plan, number)
                        except SourceError as e:
                            error = e
                if error is None:
                    self._stream.end_step()
                if step is not None:
                    self.read_seconds.append(_time.perf_counter() - t0)
                self._agree(error)
                self.last_step = number
                if step is not None:
                    yield step
        finally:
            self.close()


NONFINITE = ("error", "outside")
POLL_S = 0.05                   # seconds between asks for the next step of a stream (_AdiosSource._next_status)
_NUMERIC = ("int8_t", "char", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t",
            "float", "double", "long double")
_OPERATORS: dict[str, bool] = {}


def _has_operator(kind: str) -> bool:
    """Whether this ADIOS2 can (de)compress with operator ``kind`` (e.g. bzip2, zfp, sz, blosc)."""
    if kind not in _OPERATORS:
        try:
            _adios2().Adios().define_operator("insitu-probe", kind)
            _OPERATORS[kind] = True
        except Exception:
            _OPERATORS[kind] = False
    return _OPERATORS[kind]


def _compressed_message(where: str, name: str, number: int, op: str) -> str:
    adios2 = _adios2()
    return (f"{where}: variable {name!r} at step {number} is compressed with the {op} operator, which this ADIOS2 "
            f"({adios2.__version__}, {Path(adios2.__file__).parent}) was built without (the PyPI package has no "
            "compression operators); read it with an ADIOS2 built with it: docs/input.md, 'An ADIOS2 built from source'")


def first_uncovered(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
                    shape: Sequence[int]) -> tuple[int, int, int] | None:
    """The first sample (in C order) of a 3D grid of ``shape`` samples that none of ``boxes`` holds
    (each ``(lo, hi)``, ``hi`` exclusive, within the grid), or None when they cover the grid. A sweep
    along the slowest axis between the boxes' own boundaries, over a grid of those boundaries: its
    memory and time grow with the number of boxes, never with the grid's samples."""
    cuts = [sorted({0, int(n), *(b[0][d] for b in boxes), *(b[1][d] for b in boxes)}) for d, n in enumerate(shape)]
    events: dict[int, list[tuple[int, tuple[slice, slice]]]] = {}
    for lo, hi in boxes:
        z0, z1 = (bisect.bisect_left(cuts[0], v) for v in (lo[0], hi[0]))
        rows = tuple(slice(bisect.bisect_left(cuts[d], lo[d]), bisect.bisect_left(cuts[d], hi[d])) for d in (1, 2))
        events.setdefault(z0, []).append((1, rows))
        events.setdefault(z1, []).append((-1, rows))
    depth = np.zeros((len(cuts[1]) - 1, len(cuts[2]) - 1), np.int32)     # boxes over each cell of a slab
    for i in range(len(cuts[0]) - 1):
        for step, rows in events.get(i, ()):
            depth[rows] += step
        if not depth.all():
            j, k = np.argwhere(depth == 0)[0]
            return int(cuts[0][i]), int(cuts[1][j]), int(cuts[2][k])
    return None


def largest_block(dims: tuple[int, int, int], global_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The samples (x, y, z), ghost layers included, of the largest rank's block in a ``dims`` split of
    ``global_shape``: per axis the widest of that axis's blocks (the ranks take every combination)."""
    exts = [block_extent(coords_rank(tuple(min(k, p - 1) for p in dims), dims), dims, global_shape)
            for k in range(max(dims))]
    return tuple(max(e.count[d] for e in exts) for d in range(3))  # type: ignore[return-value]


def _sparse(var: dict) -> bool:
    """Whether a global array's blocks (where ADIOS2 says where they lie) leave part of its shape uncovered."""
    blocks = var["blocks"]
    if var["local"] or any(b["start"] is None for b in blocks):
        return False
    return first_uncovered([(b["start"], [s + c for s, c in zip(b["start"], b["count"])]) for b in blocks],
                           var["shape"]) is not None


def gap_dtype(itemsize: int) -> np.dtype:
    """The float type that a sparse array's samples of ``itemsize`` bytes are read into, NaN in its gaps."""
    return np.dtype(np.float64 if itemsize > 2 else np.float32)


def memory_share(comm: Any = None) -> tuple[int, str]:
    """A rank's share of its machine's memory, in bytes, and how it was counted: the physical memory (or
    the memory limit of the process's control group, a batch job's, where lower) divided among the ranks
    of ``comm`` (an mpi4py communicator, or None) on that machine; the lowest of the ranks' shares.
    Collective over ``comm``."""
    total, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the machine's memory"
    limit = cgroup_memory_limit()
    if limit is not None and limit < total:
        total, where = limit, "the memory limit of this job's control group"
    ranks = 1
    if comm is not None:
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        ranks = local.Get_size()
        local.Free()
    share = (total // ranks, f"{_bytes(total)} of {where}, shared by {ranks} ranks on this machine" if ranks > 1
             else where)
    return min(comm.allgather(share)) if comm is not None else share   # the same on every rank


def cgroup_memory_limit() -> int | None:
    """The lowest memory limit over this process's control group and the groups above it (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), or None where none is set or readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text(errors="replace").splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.strip().lstrip("/")
        if not folder.is_dir():                 # a container sees its own group as the root
            folder = base
        for group in (folder, *folder.parents):
            try:
                text = (group / name).read_text(errors="replace").strip()
            except OSError:
                text = ""
            if text.isdigit():
                limits.append(int(text))
            if group == base:
                break
    return min(limits) if limits else None


def _bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the figure above 1 (e.g. ``141 GiB``)."""
    for power, unit in zip(range(60, 0, -10), ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB")):
        if n >= 1 << power:
            return f"{n / (1 << power):.3g} {unit}"
    return f"{n} bytes"


class BPSource(_AdiosSource):
    """Replay an ADIOS2 BP file (BP4 or BP5) step by step; this rank reads only its block.

    path:      the BP directory (e.g. ``gs.bp``) written with ``var`` as a global 3D array.
    var:       the field to read (in an openPMD series also a mesh record, e.g. ``rho``); color_var:
               an optional second field on the same grid.
    steps:     only these step numbers; every: then keep every k-th of those that can be used.
    timeout_s: a file still being written: give up when no new step comes for this long.
    comm:      optional MPI communicator of the readers: errors are then raised on every rank.
    probe:     first read all metadata in a child process (``probe_bp``), so that a corrupt
               file gives an error instead of crashing this process (rank 0 only with comm).
    step_var, time_var, origin, spacing: override the file's conventions (insitu.input.conventions).
    nonfinite: "outside": a sparse array's uncovered samples read as NaN (counted as outside the
               surface by the driver); "error": a sparse step is skipped.
    """

    def __init__(self, path: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None,
                 probe: bool = True, **conventions: Any):
        self._index = None
        self.numbers: list[int] | None = None    # every step number in the file (from the probe)
        self.ranges: dict[int, tuple[float, float] | None] | None = None  # the field's, per step asked for
        error = None
        try:
            self._index = check_bp(path)
            self.engine = self._index.engine
            if probe and (comm is None or comm.Get_rank() == 0):
                found = probe_bp(path, timeout_s, var=var, step_var=conventions.get("step_var"),
                                 engine=self.engine, color_var=color_var)
                self.numbers = found.numbers
                if steps is not None and not set(steps) & set(self.numbers):
                    raise SourceInputError(
                        f"{path}: none of the steps asked for ({', '.join(map(str, sorted(set(steps))))}) is in "
                        f"the file; its steps: {', '.join(map(str, self.numbers[:20]))}"
                        f"{', ...' if len(self.numbers) > 20 else ''}")
                self.ranges = probed_fields(path, found, var, color_var, steps)
        except SourceError as e:
            error = e
        if comm is not None and comm.Get_size() > 1:
            bad = first_error(agree_errors(comm, None if error is None else str(error)))
            if error is None and bad is not None:
                raise SourceInputError(bad[1])
            self.numbers, self.ranges = comm.bcast((self.numbers, self.ranges), root=0)
        if error is not None:
            raise error
        super().__init__(path, var, rank=rank, size=size, color_var=color_var, steps=steps, every=every,
                         timeout_s=timeout_s, comm=comm, **conventions)

    def _params(self) -> dict[str, str]:
        return {"OpenTimeoutSecs": str(max(1, int(np.ceil(self.timeout_s))))}

    def _ended_unexpectedly(self) -> SourceError:
        return SourceInputError(f"{self.name}: the file cannot be read {self._after()} (truncated or corrupt?)")

    def _step_error(self, e: Exception) -> SourceError:
        return SourceInputError(f"{self.name}: truncated or corrupt BP file: reading the next step failed "
                                f"{self._after()} ({adios_message(e)})")

    def _check_step_data(self, stream) -> None:
        """The step's data must be in the file and of its variables' declared types, before anything is read: a
        truncated step hangs ADIOS2, and so can a variable whose type changed between steps, which a BP5 file does
        not record (its metadata keeps the type the variable was first written with, so the step's data holds
        fewer or more bytes than that type needs). BP4: every step's data is checked by check_bp. BP5: each
        writer's data of the step, from its blocks' sizes, against the bytes between its start and the next
        data in its subfile (padding aside); SourceInputError naming the step and the type change."""
        if self._index is None:
            return
        i = int(stream.current_step())
        if i >= len(self._index.steps):               # the file grew since it was opened
            self._index = check_bp(self.name)
            if i >= len(self._index.steps):
                return
        if self._index.version == 4:
            return
        need: dict[int | None, int] = {}
        arrays: dict[int | None, list[tuple[str, str, int, int]]] = {}  # writer -> (variable, type, samples, size)
        exact = not self._index.flushed[i]            # every byte of the step accounted for
        for var, info in stream.available_variables().items():
            if info.get("SingleValue") == "true":
                continue
            if stream.inquire_variable(var).operations():
                exact = False                         # compressed: its bytes are not its samples'
                continue
            kind = info.get("Type", "")
            exact = exact and kind in _ADIOS_TYPES
            itemsize = np.dtype(_adios_dtype(kind)).itemsize
            for b in self._blocks(var):
                samples = int(np.prod(b["count"]))
                need[b["writer"]] = need.get(b["writer"], 0) + samples * itemsize
                arrays.setdefault(b["writer"], []).append((var, kind, samples, itemsize))
        corrupt = f"{self.name}: truncated or corrupt BP5 file"
        number = self.seen[-1] if self.seen else i
        what = f"step {number} (ADIOS step index {i})"
        last = i + 1 == len(self._index.steps)
        for w, nbytes in need.items():
            if w is None or w >= len(self._index.subfile):
                continue
            file, start, end, padding = self._index.data_region(self.name, i, w)
            slack = padding + 64 * len(arrays[w])     # (and each block's own alignment)
            have = end - start if end is not None else None
            short = have is not None and nbytes > have
            if short or (exact and have is not None and have - nbytes > slack):
                changed = _type_changed(arrays[w], have, slack)
                if changed is not None:
                    raise SourceInputError(f"{self.name}: step {number}: {changed} ({have} bytes in {file.name} from "
                                           f"byte {start}); write it with one type in every step (or the new type "
                                           "under another name)")
                if not short:
                    raise SourceInputError(
                        f"{corrupt} ({what}: its data in {file.name} holds {have} bytes, more than its variables "
                        f"need at their declared types: {nbytes} ({_arrays_text(arrays[w])}); a variable's type "
                        "changed between steps?)")
            if last or short:
                need_bytes(file, start + nbytes, corrupt, what + (
                    "" if last else f" (its data ends at byte {end}, where the next data starts: or a variable's "
                                    "type changed between steps)"))
        if None in need and last:  # blocks whose writer ADIOS2 does not name: the subfiles together must hold them
            files = [Path(self.name) / f"data.{n}" for n in self._index.subfile]
            starts = self._index.steps[i][2]
            room = sum(max(0, f.stat().st_size - min(p for p, g in zip(starts, files) if g == f))
                       for f in set(files) if f.is_file())
            total = sum(need.values())
            if room < total:
                raise SourceInputError(f"{corrupt} (the data subfiles hold {room} bytes after the start of {what}, "
                                       f"which needs at least {total})")


def _type_changed(arrays: list[tuple[str, str, int, int]], have: int | None, slack: int) -> str | None:
    """What a writer's data of a step (``have`` bytes, ``slack`` of them padding at most) says of its one variable's
    type when it holds another whole number of bytes a sample than the declared type's (``arrays``: its blocks'
    variable, type, samples and sample size); None when it holds several variables, or no such number."""
    if have is None or len({name for name, *_ in arrays}) != 1:
        return None
    name, kind, _, itemsize = arrays[0]
    samples = sum(n for _, _, n, _ in arrays)
    fits = [k for k in (1, 2, 4, 8, 16) if samples * k <= have <= samples * k + slack]   # (padding only adds)
    if not fits or max(fits) == itemsize:
        return None
    return (f"variable {name!r} is declared {kind}, {_bytes_each(itemsize)} (the type it was first written with: a "
            f"BP5 file keeps that one), but the step's data holds {_bytes_each(max(fits))} for its {samples} "
            "samples: its type changed between steps")


def _bytes_each(k: int) -> str:
    return f"{k} byte{'s' if k > 1 else ''} a sample"


def _arrays_text(arrays: list[tuple[str, str, int, int]]) -> str:
    """``U: 8000 double, V: 27 float`` of a writer's blocks (variable, type, samples, sample size)."""
    total: dict[tuple[str, str], int] = {}
    for name, kind, n, _ in arrays:
        total[name, kind] = total.get((name, kind), 0) + n
    return ", ".join(f"{name}: {n} {kind}" for (name, kind), n in total.items())


_ADIOS_TYPES = {"int8_t": np.int8, "char": np.int8, "uint8_t": np.uint8, "int16_t": np.int16,
                "uint16_t": np.uint16, "int32_t": np.int32, "uint32_t": np.uint32, "int64_t": np.int64,
                "uint64_t": np.uint64, "float": np.float32, "double": np.float64, "long double": np.longdouble,
                "float complex": np.complex64, "complex": np.complex64, "double complex": np.complex128}


def probed_fields(path: str | Path, found: Probe, var: str, color_var: str | None,
                  steps: Sequence[int] | None) -> dict[int, tuple[float, float] | None]:
    """The field's range in each step asked for (``steps``, None: all) that holds it, from the probe of the file
    (:func:`insitu.input.bpfile.probe_bp`; None where the file records none); SourceInputError when no step asked
    for holds the field ``var``, or the colour field ``color_var`` (a mistyped name: every step would be skipped),
    naming the variables the file holds."""
    asked = [(n, f) for n, f in zip(found.numbers, found.fields) if steps is None or n in steps]
    names = ", ".join(found.variables[:40]) + (", ..." if len(found.variables) > 40 else "")
    which = f"the {len(asked)} step(s) asked for (--steps)" if steps is not None else f"its {len(asked)} step(s)"
    for key, name, what in (("var", var, "variable"), ("color", color_var, "colour variable")):
        if name is not None and asked and not any(f[key] for _, f in asked):
            raise SourceInputError(f"{path}: no {what} {name!r} in any of {which}; variables present: "
                                   f"{names or 'none'}")
    return {n: (tuple(f["range"]) if f["range"] is not None else None) for n, f in asked if f["var"]}


def _adios_dtype(name: str):
    return _ADIOS_TYPES.get(name, np.uint8)


class SSTSource(_AdiosSource):
    """Read a live ADIOS2 SST stream as its steps arrive; this rank reads only its block.

    name:      the stream name the writer opened (its contact file is ``name + ".sst"``,
               relative to the writer's working directory).
    timeout_s: how long to wait for the writer to appear, and then for each next step.
    The writer must expect this rank as a reader: ``RendezvousReaderCount`` = number of
    reader ranks (each is its own cohort), or 0, and send its data over the WAN transport
    (``DataTransport=WAN``, or unset where its ADIOS2 then picks WAN): this reader, the serial
    ADIOS2 of PyPI, has no MPI, RDMA or UCX transport. A writer that closes the stream ends the
    iteration; a writer that dies raises SourceError after the last completed step.
    Other arguments as for BPSource.
    """

    engine = "SST"

    def __init__(self, name: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None,
                 **conventions: Any):
        self._opened_at = _time.monotonic()
        super().__init__(name, var, rank=rank, size=size, color_var=color_var, steps=steps, every=every,
                         timeout_s=timeout_s, comm=comm, **conventions)

    def _params(self) -> dict[str, str]:
        return {"OpenTimeoutSecs": str(max(1, int(np.ceil(self.timeout_s)))), "DataTransport": "WAN"}

    @property
    def undelivered(self) -> int:
        """How many of the writer's steps before the last one this reader met never reached it: the writer
        discarded them (``QueueFullPolicy=Discard`` while this reader trained) or wrote them before it joined
        (``RendezvousReaderCount=0``). The writer's step indices number its steps; what it discards after the
        last step met (at its close, say) no reader can see."""
        indices = set(self._first.values())
        return max(indices) + 1 - len(indices) if indices else 0

    def _open(self) -> None:
        with _stderr_copied():              # _open_error reads what ADIOS2 printed meanwhile
            super()._open()

    def _open_error(self, e: Exception) -> SourceError:
        contact = Path(self.name + ".sst")
        waited = _time.monotonic() - self._opened_at
        reason = sst_open_reason(_stderr_copied.current())
        if reason is not None:
            return SourceError(f"{self.name}: cannot connect to the SST writer: {reason}")
        if contact.exists() and waited < self.timeout_s:
            return SourceError(
                f"{self.name}: the writer's contact file {contact} exists but the connection to its writer failed: "
                f"either the writer died without closing the stream (then remove the stale file), or it runs with "
                f"settings this reader cannot use: another ADIOS2 version than this reader's "
                f"{_adios2().__version__}, or a DataTransport other than WAN; {SST_WORKS} ({adios_message(e)})")
        if not contact.exists():
            return SourceError(f"{self.name}: no SST writer appeared within {self.timeout_s:g} s "
                               f"(no contact file {contact}; is the simulation running, in this directory?)")
        return SourceError(f"{self.name}: cannot connect to the SST writer ({adios_message(e)}); {SST_WORKS}")


SST_WORKS = ("writer settings that work with this reader: DataTransport=WAN (or unset where the writer's ADIOS2 "
             "then picks WAN), RendezvousReaderCount = the number of reader ranks (or 0), and the same ADIOS2 "
             "version (docs/input.md, 'SST streams')")


def sst_open_reason(said: str) -> str | None:
    """The cause of a failed SST open, from what ADIOS2's SST layer printed (it says more on its
    standard error than in the exception); None when it names none."""
    m = re.search(r"writer is using the (\S+) DataPlane", said)
    if m:
        return (f"the writer sends its data over the {m.group(1)!r} transport (DataTransport), which this reader "
                f"(ADIOS2 {_adios2().__version__}, without MPI, RDMA or UCX) cannot load; set the writer's "
                f"DataTransport=WAN (in its adios2.xml or engine parameters); {SST_WORKS}")
    if re.search(r"is not an ADIOS2 SST Engine Contact file", said):
        return ("the contact file is not an SST contact file (another program's file of that name, or an SST "
                f"of an incompatible ADIOS2 version); {SST_WORKS}")
    if "The writer exited before contact could be made" in said:
        return "the writer exited before the reader could connect"
    return None


class _stderr_copied:
    """Copy what C code writes to file descriptor 2 while the block runs (it still reaches stderr):
    ADIOS2's SST layer prints the causes of failures there, not in its exceptions."""

    _active: list["_stderr_copied"] = []

    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self._text = None
        _stderr_copied._active.append(self)
        return self

    def text(self) -> str:
        """What was written so far (the whole of it once the block ended)."""
        if self._text is not None:
            return self._text
        self._file.flush()
        self._file.seek(0)
        return self._file.read().decode(errors="replace")

    @classmethod
    def current(cls) -> str:
        return cls._active[-1].text() if cls._active else ""

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._text = self.text()
        self._file.close()
        _stderr_copied._active.remove(self)
        if self._text:
            sys.stderr.write(self._text)
            sys.stderr.flush()


_KINDS = {"array": "array", "raw": "raw", "bp": "bp", "replay": "bp", "sst": "sst", "stream": "sst"}


def open_source(*args: Any, comm: Any = None) -> _Source:
    """Open a source configured by ``cfg.input``; two call forms::

        open_source(path_or_array, cfg, rank=0, size=1)
        open_source(kind, path, cfg, rank=0, size=1)

    path_or_array: a numpy array [nz, ny, nx] (ArraySource); ``"sst:NAME"`` (SSTSource),
                   ``"bp:PATH"`` (BPSource), ``"raw:PATH"`` (RawSource); or a path:
                   ``*.raw`` -> raw, a BP directory or ``*.bp`` -> bp.
    kind:          "replay" or "bp", "stream" or "sst", "raw", "array" (the CLI command).
    comm:          optional mpi4py communicator of the ranks (BP/SST): steps, the end of
                   the stream and errors are then agreed collectively at every step.
    """
    if len(args) >= 2 and isinstance(args[1], Config):
        target, cfg, rest, kind = args[0], args[1], args[2:], None
    elif len(args) >= 3 and isinstance(args[2], Config):
        kind, target, cfg, rest = args[0], args[1], args[2], args[3:]
        if kind not in _KINDS:
            raise ValueError(f"kind: expected one of {', '.join(_KINDS)}, got {kind!r}")
    else:
        raise TypeError("open_source: expected (path_or_array, cfg, rank, size) or (kind, path, cfg, rank, size)")
    if len(rest) > 2:
        raise TypeError(f"open_source: too many arguments ({len(args)})")
    rank, size = (tuple(rest) + (0, 1)[len(rest):])
    inp = cfg.input
    if kind is None and isinstance(target, np.ndarray):
        kind = "array"
    elif kind is None:
        text = str(target)
        prefix, sep, rest_ = text.partition(":")
        if sep and prefix in ("sst", "bp", "raw"):
            kind, target = prefix, rest_
        else:
            p = Path(text)
            if p.suffix == ".raw":
                kind = "raw"
            elif p.suffix == ".bp" or (p / "md.idx").is_file():
                kind = "bp"
            else:
                raise SourceInputError(f"{text}: cannot tell the kind of source; expected a .raw file, a BP "
                                       "directory (.bp), or sst:NAME for a stream")
    kind = _KINDS[kind]
    if kind in ("array", "raw") and inp.color_var is not None:
        raise SourceInputError(f"input.color_var={inp.color_var!r}: a colour field needs a BP or SST source "
                               f"with that variable; a {kind} source has one field")
    geo = {"origin": tuple(inp.origin or (0.0, 0.0, 0.0)), "spacing": tuple(inp.spacing or (1.0, 1.0, 1.0)),
           "nonfinite": inp.nonfinite}
    if kind == "array":
        if not isinstance(target, np.ndarray):
            raise SourceInputError(f"array source: expected a numpy array, got {type(target).__name__}")
        return ArraySource(target, rank=rank, size=size, downsample=inp.downsample, name=inp.var, **geo)
    if kind == "raw":
        return RawSource(target, rank=rank, size=size, dims=inp.dims, dtype=inp.dtype, downsample=inp.downsample,
                         **geo)
    cls = BPSource if kind == "bp" else SSTSource
    return cls(str(target), inp.var, rank=rank, size=size, color_var=inp.color_var, steps=inp.steps,
               every=inp.every, timeout_s=inp.timeout_s, comm=comm, step_var=inp.step_var, time_var=inp.time_var,
               origin=inp.origin, spacing=inp.spacing, nonfinite=inp.nonfinite)
