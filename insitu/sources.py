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
BP file) raises its subclass ``SourceInputError``. Every step completed before a
failure has been yielded.
"""
from __future__ import annotations

import abc
import sys
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .agreement import agree_errors, first_error
from .bpfile import adios_message, check_bp5, need_bytes, probe_bp, step_number, unique_step
from .config import Config
from .decomposition import block_extent, cut_block, split_dims
from .errors import SourceError, SourceInputError
from .volume import Block, check_field, downsample, read_raw


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
    """

    def __init__(self, array: np.ndarray, *, rank: int = 0, size: int = 1,
                 origin: Sequence[float] = (0.0, 0.0, 0.0), spacing: Sequence[float] = (1.0, 1.0, 1.0),
                 fields: dict[str, np.ndarray] | None = None, step: int = 0, time: float = 0.0,
                 downsample: int = 1, name: str = "field"):
        _check_rank(rank, size)
        if downsample < 1:
            raise ValueError(f"downsample: expected an integer >= 1, got {downsample}")
        array = check_field(array, name)
        for key, other in (fields or {}).items():
            if np.shape(other) != array.shape:
                raise SourceInputError(f"{key}: expected the shape of {name} {array.shape}, got {np.shape(other)}")
        self.array = _downsample(array, downsample)
        self.fields = {k: _downsample(np.asarray(v), downsample) for k, v in (fields or {}).items()}
        self.origin = _xyz3("origin", origin)
        self.spacing = tuple(s * downsample for s in _xyz3("spacing", spacing))
        if min(self.spacing) <= 0:
            raise SourceInputError(f"spacing: expected values > 0, got {spacing!r}")
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
                 origin: Sequence[float] = (0.0, 0.0, 0.0), spacing: Sequence[float] = (1.0, 1.0, 1.0)):
        self.path = Path(path)
        array = read_raw(self.path, tuple(dims) if dims is not None else None, dtype)
        super().__init__(array, rank=rank, size=size, origin=origin, spacing=spacing,
                         downsample=downsample, name=self.path.name)


# ---- ADIOS2 ------------------------------------------------------------------------------


def _adios2():
    try:
        import adios2
    except ImportError as e:  # pragma: no cover - adios2 is installed where sources are used
        raise SourceError(f"reading ADIOS2 data needs the adios2 package ({e}); pip install adios2") from None
    return adios2


class _AdiosSource(_Source):
    """Shared step loop of BPSource and SSTSource (one serial ADIOS2 reader per rank)."""

    engine = "BP5"

    def __init__(self, name: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None):
        _check_rank(rank, size)
        if every < 1:
            raise ValueError(f"every: expected an integer >= 1, got {every}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        if comm is not None and (comm.Get_rank() != rank or comm.Get_size() != size):
            raise ValueError(f"comm: rank/size {comm.Get_rank()}/{comm.Get_size()} differ from rank={rank}, size={size}")
        self.name = str(name)
        self.var, self.color_var = var, color_var
        self.rank, self.size = rank, size
        self.steps = None if steps is None else {int(s) for s in steps}
        self.every = int(every)
        self.timeout_s = float(timeout_s)
        self.comm = comm if comm is not None and comm.Get_size() > 1 else None
        self.last_step: int | None = None        # the last step completed (yielded or skipped)
        self.dropped = 0                         # steps this rank held but dropped to agree with the others
        self.read_seconds: list[float] = []      # per step read: this rank's block (and end_step)
        self.seen: list[int] = []                # every step number met (read or not)
        self._first: dict[int, int] = {}         # step number -> the ADIOS step index that gave it
        self._stream = None
        self._used = False
        self._open()

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
        self._agree_error(error)

    def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            try:
                stream.close()
            except Exception:
                pass             # a dead writer can make close complain; nothing is left to release

    def _agree_error(self, error: SourceError | None) -> None:
        """Raise on every rank when any rank failed (no rank is left waiting)."""
        if self.comm is not None:
            bad = first_error(agree_errors(self.comm, None if error is None else str(error)))
            if bad is not None and error is None:
                self.close()
                raise SourceError(f"rank {bad[0]}: {bad[1]}")
        if error is not None:
            self.close()
            raise error

    # -- one step ------------------------------------------------------------------------------
    def _begin(self) -> tuple[str, int | None]:
        """Begin the next step: ("ok", step number) | ("end", None); raises SourceError."""
        adios2 = _adios2()
        s = self._stream
        try:
            status = s.begin_step(timeout=self.timeout_s)
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
            info = s.available_variables().get("step")
            value = None
            if info is not None and info.get("SingleValue") == "true":
                value = s.read("step")
        except Exception as e:
            raise self._step_error(e) from None
        number = step_number(info.get("Type", "") if info else "", value, index, self.name)
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
            self._agree_error(error)
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

    def _attr3(self, name: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
        s = self._stream
        if name not in s.available_attributes():
            return default
        try:
            return _xyz3(f"{self.name}: attribute {name}", s.read_attribute(name))
        except SourceInputError:
            raise
        except Exception as e:
            raise SourceInputError(f"{self.name}: attribute {name} cannot be read ({adios_message(e)})") from None

    def _shape_of(self, var: str, available: dict, number: int) -> tuple[int, ...]:
        if var not in available:
            names = ", ".join(sorted(available)) or "none"
            raise SourceInputError(f"{self.name}: no variable {var!r} at step {number}; variables present: {names}")
        info = available[var]
        text = info.get("Shape", "")
        shape = tuple(int(x) for x in text.split(",") if x.strip())
        if len(shape) != 3 or min(shape) < 2:
            what = "a single value" if not shape else f"shape {shape}"
            raise SourceInputError(f"{self.name}: variable {var!r} is {what} ({info.get('Type', '?')}), "
                                   "expected a 3D global array [z, y, x] with >= 2 samples per axis")
        return shape

    def _read(self, number: int) -> Step:
        s = self._stream
        available = s.available_variables()
        zyx = self._shape_of(self.var, available, number)
        if self.color_var is not None:
            czyx = self._shape_of(self.color_var, available, number)
            if czyx != zyx:
                raise SourceInputError(f"{self.name}: colour variable {self.color_var!r} has shape {czyx}, "
                                       f"expected the shape of {self.var!r} {zyx}")
        gshape = tuple(reversed(zyx))                                  # (x, y, z)
        ext = block_extent(self.rank, split_dims(gshape, self.size), gshape)
        start, count = list(reversed(ext.start)), list(reversed(ext.count))
        self._check_step_data(s)
        try:
            data = s.read(self.var, start, count)
            fields = {self.color_var: s.read(self.color_var, start, count)} if self.color_var else {}
        except Exception as e:
            raise SourceInputError(f"{self.name}: reading {self.var!r} at step {number} failed "
                                   f"({adios_message(e)})") from None
        t = float(s.read("time")) if "time" in available and available["time"].get("SingleValue") == "true" \
            else float(number)
        block = Block(data, ext.start, gshape, ext.owned_lo, ext.owned_hi,
                      self._attr3("origin", (0.0, 0.0, 0.0)), self._attr3("spacing", (1.0, 1.0, 1.0)), fields)
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
                keep = self.steps is None or number in self.steps
                if keep:
                    keep = arrived % self.every == 0
                    arrived += 1
                error, step = None, None
                t0 = _time.perf_counter()
                if keep:
                    try:
                        step = self._read(number)
                    except SourceError as e:
                        error = e
                if error is None:
                    self._stream.end_step()
                if step is not None:
                    self.read_seconds.append(_time.perf_counter() - t0)
                self._agree_error(error)
                self.last_step = number
                if step is not None:
                    yield step
        finally:
            self.close()


class BPSource(_AdiosSource):
    """Replay an ADIOS2 BP file step by step; this rank reads only its block.

    path:      the BP directory (e.g. ``gs.bp``) written with ``var`` as a global 3D array.
    var:       the field to read; color_var: an optional second field on the same grid.
    steps:     only these step numbers; every: then keep every k-th of those (0, k, 2k, ...).
    timeout_s: a file still being written: give up when no new step comes for this long.
    comm:      optional MPI communicator of the readers: errors are then raised on every rank.
    probe:     first read all metadata in a child process (``probe_bp``), so that a corrupt
               file gives an error instead of crashing this process (rank 0 only with comm).
    """

    engine = "BP5"

    def __init__(self, path: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None,
                 probe: bool = True):
        self._index = None
        self.numbers: list[int] | None = None    # every step number in the file (from the probe)
        error = None
        try:
            self._index = check_bp5(path)
            if probe and (comm is None or comm.Get_rank() == 0):
                self.numbers = probe_bp(path, timeout_s)
                if steps is not None and not set(steps) & set(self.numbers):
                    raise SourceInputError(
                        f"{path}: none of the steps asked for ({', '.join(map(str, sorted(set(steps))))}) is in "
                        f"the file; its steps: {', '.join(map(str, self.numbers[:20]))}"
                        f"{', ...' if len(self.numbers) > 20 else ''}")
        except SourceError as e:
            error = e
        if comm is not None and comm.Get_size() > 1:
            bad = first_error(agree_errors(comm, None if error is None else str(error)))
            if error is None and bad is not None:
                raise SourceInputError(bad[1])
            self.numbers = comm.bcast(self.numbers, root=0)
        if error is not None:
            raise error
        super().__init__(path, var, rank=rank, size=size, color_var=color_var, steps=steps, every=every,
                         timeout_s=timeout_s, comm=comm)

    def _params(self) -> dict[str, str]:
        return {"OpenTimeoutSecs": str(max(1, int(np.ceil(self.timeout_s))))}

    def _ended_unexpectedly(self) -> SourceError:
        return SourceInputError(f"{self.name}: the file cannot be read {self._after()} (truncated or corrupt?)")

    def _step_error(self, e: Exception) -> SourceError:
        return SourceInputError(f"{self.name}: truncated or corrupt BP file: reading the next step failed "
                                f"{self._after()} ({adios_message(e)})")

    def _check_step_data(self, stream) -> None:
        """The step's data must be in the file (a truncated last step would hang ADIOS2)."""
        if self._index is None:
            return
        i = int(stream.current_step())
        if i >= len(self._index.steps):               # the file grew since it was opened
            self._index = check_bp5(self.name)
            if self._index is None or i >= len(self._index.steps):
                return
        if i + 1 < len(self._index.steps):
            return                                    # check_bp5 saw step i+1 start inside the file
        need: dict[int, int] = {}
        for var, info in stream.available_variables().items():
            if info.get("SingleValue") == "true" or stream.inquire_variable(var).operations():
                continue
            itemsize = np.dtype(_adios_dtype(info.get("Type", ""))).itemsize
            for b in stream.engine.blocks_info(var, i):
                count = [int(c) for c in b["Count"].split(",") if c.strip()]
                w = int(b.get("WriterID", 0))
                need[w] = need.get(w, 0) + int(np.prod(count)) * itemsize
        corrupt = f"{self.name}: truncated or corrupt BP5 file"
        for w, nbytes in need.items():
            if w < len(self._index.subfile):
                need_bytes(Path(self.name) / f"data.{self._index.subfile[w]}", self._index.steps[i][2][w] + nbytes,
                           corrupt, f"step {self.seen[-1] if self.seen else i} (ADIOS step index {i})")


def _adios_dtype(name: str):
    table = {"int8_t": np.int8, "char": np.int8, "uint8_t": np.uint8, "int16_t": np.int16,
             "uint16_t": np.uint16, "int32_t": np.int32, "uint32_t": np.uint32, "int64_t": np.int64,
             "uint64_t": np.uint64, "float": np.float32, "double": np.float64,
             "float complex": np.complex64, "complex": np.complex64, "double complex": np.complex128}
    return table.get(name, np.uint8)


class SSTSource(_AdiosSource):
    """Read a live ADIOS2 SST stream as its steps arrive; this rank reads only its block.

    name:      the stream name the writer opened (its contact file is ``name + ".sst"``,
               relative to the writer's working directory).
    timeout_s: how long to wait for the writer to appear, and then for each next step.
    The writer must expect this rank as a reader: ``RendezvousReaderCount`` = number of
    reader ranks (each is its own cohort), or 0. A writer that closes the stream ends the
    iteration; a writer that dies raises SourceError after the last completed step.
    Other arguments as for BPSource.
    """

    engine = "SST"

    def __init__(self, name: str | Path, var: str, *, rank: int = 0, size: int = 1, color_var: str | None = None,
                 steps: Sequence[int] | None = None, every: int = 1, timeout_s: float = 60.0, comm: Any = None):
        self._opened_at = _time.monotonic()
        super().__init__(name, var, rank=rank, size=size, color_var=color_var, steps=steps, every=every,
                         timeout_s=timeout_s, comm=comm)

    def _params(self) -> dict[str, str]:
        return {"OpenTimeoutSecs": str(max(1, int(np.ceil(self.timeout_s)))), "DataTransport": "WAN"}

    def _open_error(self, e: Exception) -> SourceError:
        contact = Path(self.name + ".sst")
        waited = _time.monotonic() - self._opened_at
        if contact.exists() and waited < self.timeout_s:
            return SourceError(f"{self.name}: the writer's contact file {contact} exists but its writer does not "
                               f"answer (it died without closing the stream; remove the stale file) "
                               f"({adios_message(e)})")
        if not contact.exists():
            return SourceError(f"{self.name}: no SST writer appeared within {self.timeout_s:g} s "
                               f"(no contact file {contact}; is the simulation running, in this directory?)")
        return SourceError(f"{self.name}: cannot connect to the SST writer ({adios_message(e)})")


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
    if kind == "array":
        if not isinstance(target, np.ndarray):
            raise SourceInputError(f"array source: expected a numpy array, got {type(target).__name__}")
        return ArraySource(target, rank=rank, size=size, downsample=inp.downsample, name=inp.var)
    if kind == "raw":
        return RawSource(target, rank=rank, size=size, dims=inp.dims, dtype=inp.dtype, downsample=inp.downsample)
    cls = BPSource if kind == "bp" else SSTSource
    return cls(str(target), inp.var, rank=rank, size=size, color_var=inp.color_var, steps=inp.steps,
               every=inp.every, timeout_s=inp.timeout_s, comm=comm)
