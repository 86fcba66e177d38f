"""Link the pipeline into a running simulation: ``Adaptor(comm, config).execute(step, time, fields, ...)``.

The simulation keeps its own MPI decomposition. Every ``execute()`` builds this rank's
Block (one collective halo exchange on the adaptor's own communicator), copies the
fields it needs and either trains the step at once (``run.mode: sync``) or hands it
to one worker thread per rank and returns (``run.mode: background``)::

    with Adaptor(MPI.COMM_WORLD, "gs.yaml") as adaptor:
        for step in range(n):
            sim.advance()
            adaptor.execute(step, sim.time, {"U": sim.u, "V": sim.v},
                            global_shape=(nx, ny, nz), start=(x0, y0, z0))

Background mode keeps a bounded queue of steps waiting to be trained
(``run.queue``). With policy ``block`` every step is trained and ``execute()``
waits for room; with ``discard`` the newest step wins and the oldest waiting step
is dropped. Training is collective, so every rank must train the same steps: the
decision to drop is taken collectively (an allgather on the simulation thread while
each rank's worker is kept from starting a new step), and only steps that no worker
has started are ever dropped. The worker trains on its own duplicated communicator,
so its collectives never interleave with the simulation thread's.

Errors are never lost, and one bad step never ends the analysis: a failure in a trained
step (no surface, NaN, an iso value out of range, an exception on one rank) is agreed across
ranks right after the step, recorded (``Adaptor.status[step]``, a "failed" row with the reason
in metrics.csv) and raised once, as ``InsituError`` with the same message on every rank, by the
next ``execute()`` (after it has taken its own step) or by ``finalize()``; then the training's
process group is rebuilt (a rank's collective may have timed out while another had left it,
which breaks the group) and later steps train as usual. In sync mode the step's own
``execute()`` raises it. Steps dropped by policy ``discard`` are recorded as "skipped". Invalid
input (a missing field, wrong shapes or dtypes, a step that is not an integer >= 0 or was given
before, a time that is not a finite number, a start that is not integers) raises InputError from
the same ``execute()`` call, on every rank, and that step is not taken (nothing is queued or written).

Agreement never hangs and never pairs different calls: every call starts with one
cross-rank decision (the call and step number, bad input, failures to report) that waits
at most ``run.timeout_s``. Ranks that call ``execute()`` with different step numbers
get an InputError naming each rank's call; when some call ``finalize()`` (a simulation that
ends early on one rank), the analysis ends on every rank: the steps queued are trained (or,
with ``finalize(drain=False)``, recorded as skipped), every rank raises the InputError, and
later calls raise InsituError at once. A rank that does not call at all makes the others raise
InsituError after the timeout, after which the adaptor is unusable (every call raises,
``finalize()`` frees what it can) while the simulation goes on. The ranks agree on a trained
step's outcome within 3 x ``run.timeout_s``; a rank whose training stalls past that
stops the training on every rank (the others tell it, and each other, with a message that
even a rank waiting for room in its queue sees): the step is recorded as failed, the steps
after it as skipped with the reason, and every later ``execute()`` raises InsituError saying
so, while the simulation goes on. At start, the ranks compare their validated configurations
(a hash): a difference is a ConfigError naming the keys; sizes that cannot fit in the
device's memory, a rasterizer the device lacks and an output folder that cannot take the
results (a file, unwritable, written by another run, holding an earlier run's results unless
``output.existing`` is resume or overwrite, or, with resume, steps made from another input or
configuration) are ConfigErrors too. Rank 0 holds the output folder's lock until ``finalize()``.

A step whose files cannot be written (a full disk, a read-only folder: an OSError on any rank) is recorded as
failed with one line on each rank's stderr, and training stops there: later steps are recorded as skipped and
every later ``execute()`` raises InsituError saying why, while the simulation goes on.

The Adaptor is not thread-safe: every call is collective, and every rank must make the calls in the same order,
which calls from two threads of a rank cannot promise (serialising them would still pair different steps across
ranks). A call made while another thread is inside one raises InputError at once, on that rank, before any
collective; make every call from one thread. A program that ends without ``finalize()`` is finalized when the
interpreter exits (a warning on rank 0's stderr; the queued steps are trained, the folder released); if it has
ended MPI first, those steps are recorded as skipped instead.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import math
import numbers
import sys
import threading
import time as _time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from insitu.config import Config, RunConfig, check_backend, check_memory, from_dict, load_config, validate
from insitu.errors import AgreementTimeout, ConfigError, InputError, InsituError, RankFailure
from insitu.input.decomposition import block_from_local
from insitu.output.export import StepWriter, claim_output
from insitu.parallel.agreement import agree_errors, compare_configs
from insitu.parallel.comm import device_memory, init_comm, remove_abort_hook, shutdown
from insitu.render.rendering import gsplat_import_error
from insitu.step.driver import StepDriver
from insitu.volume import Block, check_geometry

# dtype codes shared with the C API (adaptors/insitu_adaptor.h: INSITU_UINT8 ...).
C_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.uint16), 4: np.dtype(np.int16),
    5: np.dtype(np.uint32), 6: np.dtype(np.int32), 7: np.dtype(np.uint64), 8: np.dtype(np.int64),
    9: np.dtype(np.float32), 10: np.dtype(np.float64),
}


@dataclass
class ExecuteRecord:
    """What one ``execute()`` call cost the simulation.

    seconds:      wall time spent on the caller's thread (halo exchange, copies, decision,
                  waiting for room, and in sync mode the training itself).
    bytes_copied: bytes of field data copied out of the simulation's arrays.
    waited_s:     part of ``seconds`` spent waiting for room in the queue (policy block).
    dropped:      steps that this call removed from the queue (policy discard).
    """

    step: int
    seconds: float
    bytes_copied: int
    waited_s: float = 0.0
    dropped: list[int] = field(default_factory=list)


@dataclass
class TrainedRecord:
    """One step trained by the pipeline: its wall time and the pipeline's metrics."""

    step: int
    seconds: float
    metrics: dict[str, Any]


@dataclass
class AdaptorStats:
    """Timings of an Adaptor on this rank: ``executes`` per call, ``trained`` per trained step."""

    executes: list[ExecuteRecord] = field(default_factory=list)
    trained: list[TrainedRecord] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)

    @property
    def caller_seconds(self) -> float:
        return sum(r.seconds for r in self.executes)

    @property
    def bytes_copied(self) -> int:
        return sum(r.bytes_copied for r in self.executes)

    @property
    def trained_steps(self) -> list[int]:
        return [r.step for r in self.trained]


@dataclass
class StepStatus:
    """What became of one step handed to ``execute()`` (``Adaptor.status[step]``).

    status: "queued" (waiting or training), "trained", "failed" (reason: the agreed error,
            also raised once by a later call) or "skipped" (reason: dropped by policy discard
            or finalize(drain=False), or complete in the output folder on resume).
    """

    step: int
    status: str
    reason: str = ""


@dataclass
class _Item:
    index: int          # position in the sequence of enqueued steps (same on every rank)
    step: int
    time: float
    block: Block


def _load(config: Config | dict | str | Path | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return validate(config)
    if isinstance(config, dict):
        return from_dict(config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise ConfigError(f"config: expected a Config, a dict, a YAML path or None, got {type(config).__name__}")


def _report(what: str, messages: list[str | None]) -> str:
    """One text for every rank: ``what``, then each distinct message with the ranks that gave it."""
    by_text: dict[str, list[int]] = {}
    for r, m in enumerate(messages):
        if m:
            by_text.setdefault(m, []).append(r)
    n = sum(len(r) for r in by_text.values())
    lines = [f"  rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in by_text.items()]
    return f"{what} on {n} of {len(messages)} rank(s):\n" + "\n".join(lines)


def _integers(name: str, value) -> tuple[int, int, int]:
    """``value`` as 3 integers (x, y, z): ints, numpy integers or floats of integral value (2.0, not 0.5)."""
    def integer(v):
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            return int(v)
        if isinstance(v, (float, np.floating)) and float(v).is_integer():
            return int(v)
        return None
    try:
        out = None if isinstance(value, (str, bytes)) else [integer(v) for v in value]
    except TypeError:
        out = None
    if out is None or len(out) != 3 or None in out:
        raise InputError(f"{name}: expected 3 integers (x, y, z), got {value!r}")
    return tuple(out)   # type: ignore[return-value]


def _step_time(value) -> float:
    """The step's time as a float: a finite real number (numpy's too), not a bool."""
    try:
        out = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    except OverflowError:               # an int beyond float's range
        out = None
    if out is None or not math.isfinite(out):
        raise InputError(f"time: expected a finite real number (the simulation's time at this step), got {value!r}")
    return out


def _triple(name: str, value, kind=int) -> tuple:
    try:
        out = tuple(kind(v) for v in value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: expected 3 numbers (x, y, z), got {value!r}") from None
    if len(out) != 3:
        raise InputError(f"{name}: expected 3 numbers (x, y, z), got {len(out)}: {value!r}")
    return out


_HALT_TAG = 7           # the tag of halt notices on the adaptor's notice communicator


class Adaptor:
    """In situ training of Gaussian splatting models inside a running MPI simulation.

    comm:    the simulation's mpi4py communicator (every rank of it calls every method);
             ``None`` means ``MPI.COMM_WORLD``. The adaptor works on duplicates of it.
    config:  a Config, a nested dict of sections, a YAML path, or None (defaults).
             An invalid config raises ConfigError on every rank.
    process: the function that trains one step, ``process(block, cfg, comm, *, step, time,
             warm, iterations) -> result`` with ``result.metrics``, where ``warm`` is the
             previous step's result or None; collective over ``comm`` (a ``parallel.Comm``).
             Defaults to ``pipeline.run_step``.
    provenance: what the steps come from, recorded in each step's metrics.json and compared with
             the kept steps' when ``output.existing`` is resume (default ``{"command": "adaptor"}``).

    status:  step -> :class:`StepStatus` (queued, trained, failed or skipped, and why), on every rank.

    Not thread-safe: call it from one thread (a call while another thread is inside one is an InputError).
    Without ``finalize()`` (or ``with``), the interpreter's exit finalizes it, with a warning.
    """

    def __init__(self, comm=None, config: Config | dict | str | Path | None = None, *,
                 process: Callable[..., Any] | None = None, provenance: dict | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        self._sim = comm.Dup()              # the simulation thread's collectives
        self._timeout = RunConfig().timeout_s
        self._broken: str | None = None     # a cross-rank decision timed out: the adaptor is unusable
        self._work = self._base = self._notice = self._lock = None
        self._thread: threading.Thread | None = None
        self._freed = False
        self._calling = threading.Lock()    # held by the thread inside a call (execute, finalize): one at a time
        self._caller: tuple[str, str] | None = None     # ... that call and its thread's name
        self._provenance = dict(provenance) if provenance is not None else {"command": "adaptor"}
        try:
            error, cfg = None, None
            try:
                cfg = _load(config)
            except (ConfigError, OSError) as e:
                error = str(e)
            self._agree([error], "invalid configuration", ConfigError)
            self._timeout = cfg.run.timeout_s
            compare_configs(self._sim, cfg, self._timeout)      # the same validated configuration everywhere
            self._setup(comm, cfg, process)
        except BaseException:
            self._free()
            raise

    def _setup(self, comm, cfg: Config, process) -> None:
        MPI = self._MPI
        self.cfg: Config = cfg
        self.rank = self._sim.Get_rank()
        self.size = self._sim.Get_size()
        self.mode = cfg.run.mode
        if self.mode == "background" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn("run.mode background needs MPI initialised with MPI_THREAD_MULTIPLE "
                          f"(got thread level {MPI.Query_thread()}); training synchronously instead. "
                          "Initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
                          "to train in the background.", RuntimeWarning, stacklevel=3)
            self.mode = "sync"
        self._base = comm.Dup()              # the training's agreements, and the base of its process groups
        self._notice = comm.Dup()            # halt notices between the ranks (_halt), from any thread
        self._settle_s = 3 * cfg.run.timeout_s  # a rank stuck in a collective (timeout_s) or in a
                                                # phase's agreement (2 x timeout_s) has given up by then
        # the training's own duplicate of comm + torch.distributed group (the worker thread's in background
        # mode); a timed-out agreement inside a step raises (the simulation goes on) instead of aborting the job
        self._work = init_comm(self._base, device=cfg.run.device, timeout_s=cfg.run.timeout_s,
                               threads=cfg.run.threads, abort_on_timeout=False)
        error, done = None, []
        try:                                 # before any step: sizes that cannot fit, an unusable output folder
            check_memory(cfg, self.size, device_memory(self._work.device), f"device {self._work.device}")
            check_backend(cfg, self._work.device.type, gsplat_import_error())
            if self.rank == 0:
                self._lock, done = claim_output(cfg.output.dir, cfg.output.existing, config=cfg,
                                                provenance=self._provenance, command="insitu Adaptor")
        except (ConfigError, OSError) as e:
            error = str(e)
        gathered = self._gather("checking memory and the output folder", (error, done))
        if any(e for e, _ in gathered):
            raise ConfigError(_report("unusable configuration", [e for e, _ in gathered]))
        self._done = set(gathered[0][1])     # complete in the output folder (output.existing: resume)
        self._writer = StepWriter(cfg.output.dir, output=cfg.output, done=self._done, provenance=self._provenance)
        if self.rank == 0 and self._done:
            self._writer.publish()           # metrics.csv and the report of the kept steps, rebuilt
        self._driver = StepDriver(cfg, self._work, self._writer, process=process)
        from insitu.step.compilation import compile_ahead

        compile_ahead(cfg, self._work)       # the GPU kernels compile while the simulation computes its first steps
        self.stats = AdaptorStats()
        self.status: dict[int, StepStatus] = {}
        self._closed = False
        self._ended: str | None = None       # why later calls raise: the analysis ended on every rank
        self._given: set[int] = set()        # step numbers execute() took
        self._failures: list[tuple[int, str]] = []   # agreed failures of trained steps, in order
        self._reported: set[int] = set()             # ... of which these were raised already
        self._halted: str | None = None      # training stopped for good, and why (_halt)
        self._unwritable = False             # a step's files could not be written (training stopped)
        self._sent: list[Any] = []           # halt notices sent (requests)
        # queue state, guarded by self._cond
        self._cond = threading.Condition()
        self._queue: collections.deque[_Item] = collections.deque()
        self._enqueued = 0                   # steps put in the queue, on every rank the same
        self._started = 0                    # 1 + queue index of the last step the worker started
        self._stop = False
        if self.mode == "background":
            self._thread = threading.Thread(target=self._worker, name=f"insitu-worker-{self.rank}", daemon=True)
            self._thread.start()
        atexit.register(self._at_exit)       # a program that ends without finalize() loses no queued step

    # ------------------------------------------------------------------ public API
    def execute(self, step: int, time: float, fields: dict[str, np.ndarray], global_shape, start, *,
                origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0)) -> None:
        """Hand one timestep to the pipeline (collective: every rank calls it for every step).

        step, time:   the simulation's step number, an integer >= 0 (each one once: it names the step's
                      outputs), and its time, a finite real number (Python's or numpy's).
        fields:       name -> this rank's [nz, ny, nx] C-ordered array (no ghost layers) of integers or
                      floats, any width (float16 and long double are trained in float32 and float64);
                      the field ``cfg.input.var`` (and ``cfg.input.color_var`` if set) is used.
        global_shape: (nx, ny, nz) samples of the whole grid (integers).
        start:        global index (x, y, z) of this rank's ``array[0, 0, 0]`` (integers; 2.0 passes, 0.5 does not).
        origin, spacing: world position of sample (0, 0, 0) and size of one cell.

        Returns once the data is copied (background) or the step is trained (sync).
        Raises InsituError if an earlier step failed on any rank or training has stopped,
        InputError if the fields are unusable on any rank or the step number was given before, or, at
        once and on this rank alone, if another thread is inside a call of this Adaptor.
        """
        with self._one_caller(f"execute(step {step!r})"):
            self._execute(step, time, fields, global_shape, start, origin, spacing, None)

    def execute_buffers(self, step: int, time: float, buffers: list[tuple[str | None, Any, int]],
                        global_shape, start, count, origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0)) -> None:
        """``execute()`` for the C API: fields as raw buffers, viewed without a copy.

        buffers: (name, buffer or None, dtype code of ``C_DTYPES``) per field; each buffer
                 holds ``count[0] * count[1] * count[2]`` values, x fastest. A name that is not UTF-8
                 comes as bytes (refused, naming it).
        count:   (nx, ny, nz) samples this rank holds.
        """
        error = None
        fields: dict[str, np.ndarray] = {}
        try:
            count = _integers("count", count)
            low = [a for a in range(3) if count[a] < 1]
            if low:
                raise InputError(f"count {count} (x, y, z): expected at least 1 sample this rank holds along each "
                                 f"axis, got count[{low[0]}] = {count[low[0]]}")
            samples = math.prod(count)
            for name, buf, code in buffers:
                if isinstance(name, bytes):
                    raise InputError(f"field name {name!r}: not UTF-8 text; expected a name in UTF-8, such as 'V'")
                if not name:
                    raise InputError("field name: expected a non-empty string, got NULL or ''")
                if code not in C_DTYPES:
                    raise InputError(f"field {name}: unknown dtype code {code}; expected one of "
                                     + ", ".join(f"{k} ({v})" for k, v in C_DTYPES.items()))
                if buf is None:
                    raise InputError(f"field {name}: data is a NULL pointer")
                nbytes = samples * C_DTYPES[code].itemsize
                if nbytes > sys.maxsize:
                    raise InputError(f"count {count} (x, y, z): {samples:.3g} samples of field {name} "
                                     f"({C_DTYPES[code]}) are {nbytes:.3g} bytes, more than a process can address; "
                                     "expected the samples this rank holds")
                if memoryview(buf).nbytes != nbytes:
                    raise InputError(f"field {name}: {memoryview(buf).nbytes} bytes given, expected {nbytes} "
                                     f"(count {count} of {C_DTYPES[code]})")
                fields[name] = np.frombuffer(buf, dtype=C_DTYPES[code]).reshape(count[::-1])
        except (InputError, ValueError, TypeError) as e:
            error = str(e)
        with self._one_caller(f"execute(step {step!r})"):
            self._execute(step, time, fields, global_shape, start, origin, spacing, error)

    def finalize(self, drain: bool = True) -> None:
        """Train the steps still waiting (``drain=False``: drop them), stop the worker, free the
        communicators, release the output folder. Collective. Raises InsituError for failed steps
        not reported yet. A rank that calls finalize() while others call execute() ends the analysis
        on every rank (all of them raise InputError, after the same clean end). InputError at once if another
        thread is inside a call of this Adaptor."""
        with self._one_caller("finalize()"):
            if self._closed:
                return
            try:
                if self._broken is not None:     # the ranks no longer agree: leave without collectives
                    self._closed = True
                    self._stop_worker(wait_s=1.0)
                    return
                self._same_call(("finalize()", None), drain=drain)
                self._raise_failures(self._close(drain))
            finally:
                self._free()

    def __enter__(self) -> "Adaptor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """finalize(); with an exception on its way out of the block, finalize(drain=False), whose own
        error is printed instead of replacing the simulation's."""
        if exc_type is None:
            self.finalize()
            return
        try:
            self.finalize(drain=False)
        except (InsituError, InputError) as e:
            print(f"[insitu rank {getattr(self, 'rank', '?')}] finalize() after {exc_type.__name__}: "
                  f"{' '.join(str(e).split())}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _one_caller(self, call: str) -> Iterator[None]:
        """Hold the Adaptor for ``call`` on this thread; an InputError, at once and before any collective, when
        another thread is inside a call: the calls are collective, every rank must make them in the same order,
        and calls from two threads would pair different steps across ranks (or fork the warm chain on one)."""
        if not self._calling.acquire(blocking=False):
            other, thread = self._caller or ("another call", "another thread")
            raise InputError(f"{call}: called on thread {threading.current_thread().name!r} while {other} runs on "
                             f"thread {thread!r}; the Adaptor is not thread-safe (its calls are collective: every "
                             "rank must make them in the same order, which two threads cannot promise): make every "
                             "call from one thread")
        self._caller = (call, threading.current_thread().name)
        try:
            yield
        finally:
            self._caller = None
            self._calling.release()

    def _at_exit(self) -> None:
        """At the interpreter's exit without :meth:`finalize` (registered by ``_setup``): say so on stderr, then
        finalize (the steps still queued are trained, the output folder released); once MPI has ended, record
        them as not trained instead and release the folder. Collective as finalize() is, with the ranks that
        finalize() or exit."""
        if self._freed or self._closed:
            return
        queued = sorted(s for s, st in self.status.items() if st.status == "queued")
        steps = f" ({len(queued)} step(s) queued: {', '.join(map(str, queued))})" if queued else ""
        if self._MPI.Is_finalized():
            reason = "not trained: MPI ended before Adaptor.finalize() was called"
            print(f"insitu: warning: rank {self.rank}: the program ended MPI without Adaptor.finalize(){steps}; "
                  "those steps are not trained: call finalize() (or use `with Adaptor(...)`) before MPI ends",
                  file=sys.stderr, flush=True)
            self._closed = self._freed = True
            with self._cond:
                self._queue.clear()
                self._stop = True
                self._cond.notify_all()
            self._skipped(queued, reason)
            if self._lock is not None:
                self._lock.release()
            return
        if self.rank == 0:
            print(f"insitu: warning: the program is ending without Adaptor.finalize(){steps}; finalizing now"
                  f"{', training them' if queued else ''} (call finalize(), or use `with Adaptor(...)`)",
                  file=sys.stderr, flush=True)
        try:
            self.finalize()
        except (InsituError, InputError) as e:
            print(f"[insitu rank {self.rank}] finalize() at exit: {' '.join(str(e).split())}", file=sys.stderr,
                  flush=True)

    def _gather(self, what: str, obj: Any) -> list[Any]:
        """Allgather on the simulation communicator within ``run.timeout_s``; past that the
        adaptor is unusable (InsituError now and from every later call), the simulation goes on."""
        try:
            return agree_errors(self._sim, obj, seconds=self._timeout, what=what)
        except AgreementTimeout as e:
            self._broken = f"{e}; the adaptor trains nothing more"
            if hasattr(self, "_cond"):
                self._halt(self._broken)
            raise InsituError(self._broken) from None

    def _agree(self, errors: list[str | None], what: str, kind: type[Exception]) -> None:
        """Gather this rank's error messages; raise on every rank if any rank has one."""
        gathered = self._gather(what, "; ".join(e for e in errors if e) or None)
        if any(gathered):
            raise kind(_report(what, gathered))

    def _same_call(self, call: tuple[str, int | None], error: str | None = None, *, drain: bool = True) -> list[dict]:
        """First decision of every call: all ranks make the same call (method, step), which of them has
        bad input or failed steps to report, and whether training has stopped on any. Returns each
        rank's answer ({"call", "error", "pending", "halted", "drain"}). Different calls are an
        InputError; when a rank called finalize(), the analysis ends on every rank first."""
        self._poll_notices()
        what = call[0].replace("()", f"(step {call[1]})") if call[1] is not None else call[0]
        gathered = self._gather(what, {"call": call, "error": error, "pending": self._pending(),
                                       "halted": self._halted, "drain": drain})
        halted = next((g["halted"] for g in gathered if g["halted"]), None)
        if halted is not None:
            self._halt(halted, tell=False)
        calls = [g["call"] for g in gathered]
        if all(c == call for c in calls):
            return gathered

        def name(c):
            return f"execute(step {c[1]})" if c[0] == "execute()" else c[0]
        text = ("the ranks made different calls (every rank must call execute() for every step, then finalize()): "
                + ", ".join(f"rank {r}: {name(c)}" for r, c in enumerate(calls)))
        leaving = [r for r, c in enumerate(calls) if c[0] == "finalize()"]
        if not leaving:
            raise InputError(text)
        self._ended = (f"the analysis has ended on every rank: rank(s) {', '.join(map(str, leaving))} called "
                       "finalize() while the others called execute()")
        failures: list[list[tuple[int, str]]] = []
        try:
            failures = self._close(all(g["drain"] for g in gathered if g["call"][0] == "finalize()"))
        finally:
            self._free()
        reports = [m for _, m in sorted({s: m for f in failures for s, m in f if s not in self._reported}.items())]
        raise InputError("\n".join([f"{text}; {self._ended}", *reports]))

    def _close(self, drain: bool) -> list[list[tuple[int, str]]]:
        """The collective end of the analysis (finalize(), or a rank's finalize() against the others'
        execute()): drop the waiting steps unless ``drain``, let the worker finish, then gather the
        failures not yet reported (returned, every rank's)."""
        self._closed = True
        if self._thread is not None:
            dropped = []
            with self._cond:
                if not drain:
                    dropped = self._drop_waiting(keep=0)
                self._stop = True
                self._cond.notify_all()
            self.stats.dropped.extend(dropped)
            self._skipped(dropped, "dropped: finalize(drain=False)")
            self._join_worker()
        return self._gather("finalize()", self._pending())

    def _join_worker(self) -> None:
        """Wait for the worker to train what it holds; once training has stopped, not at all (a worker stuck
        in a step is left behind: it trains nothing more when it wakes)."""
        while self._thread.is_alive() and self._halted is None:
            self._thread.join(0.1)
            self._poll_notices()

    def _free(self) -> None:
        """Free the communicators and the process group, release the output folder; once."""
        if self._freed:
            return
        self._freed = True
        atexit.unregister(self._at_exit)
        if self._lock is not None:
            self._lock.release()
        if getattr(self, "_halted", None) is None:
            if self._work is not None:
                shutdown(self._work)        # the worker's own communicator and process group
            for c in (self._base, self._notice):
                if c is not None:
                    c.Free()
        elif self._work is not None:        # a stuck worker may wake and use them, notices may be on their way
            remove_abort_hook(self._work)
        if self._broken is None:            # a pending operation may remain on it otherwise
            self._sim.Free()

    def _pending(self) -> list[tuple[int, str]]:
        with self._cond:
            return [f for f in self._failures if f[0] not in self._reported]

    def _raise_failures(self, gathered: list[list[tuple[int, str]]], extra: str | None = None) -> None:
        """Raise, once, the failures that any rank knows of and that were not raised yet (and ``extra``)."""
        failures = dict(sorted({s: m for pending in gathered for s, m in pending if s not in self._reported}.items()))
        self._reported.update(failures)
        lines = list(failures.values()) + ([extra] if extra else [])
        if lines:
            raise InsituError("\n".join(lines))

    def _skipped(self, steps: list[int], reason: str) -> None:
        with self._cond:
            for s in steps:
                self.status[s] = StepStatus(s, "skipped", reason)
        if self.rank == 0:
            for s in steps:
                self._write_status(s, "skipped", reason)

    def _failed(self, step: int, report: str) -> None:
        """A trained step failed (the agreed ``report``): recorded, raised once by a later call."""
        with self._cond:
            self._failures.append((step, report))
            self.status[step] = StepStatus(step, "failed", report)
            self._cond.notify_all()
        if self.rank == 0:
            self._write_status(step, "failed", report)

    def _write_status(self, step: int, status: str, reason: str) -> None:
        if self._unwritable:                # a step's files could not be written: nor can metrics.csv be
            return
        try:
            self._writer.record(step, status, reason)
        except OSError as e:                # the status stays readable in self.status
            print(f"[insitu rank {self.rank}] metrics.csv: {e}", file=sys.stderr, flush=True)

    def _halt(self, reason: str, *, tell: bool = True) -> None:
        """Training stops for good: a decision between the training ranks timed out (a rank's training hangs
        or died), or another rank's training stopped. The steps waiting or training are recorded as
        skipped with ``reason``; with ``tell``, every other rank is told (:meth:`_poll_notices`), so that
        none waits for room in its queue for ever. Any thread."""
        with self._cond:
            if self._halted is not None:
                return
            self._halted = reason
            self._queue.clear()
            stranded = sorted(s for s, st in self.status.items() if st.status == "queued")
            self._cond.notify_all()
        if tell and self._notice is not None:
            for r in range(self.size):
                if r != self.rank:
                    self._sent.append(self._notice.isend(reason, dest=r, tag=_HALT_TAG))
        self._skipped(stranded, f"not trained: {reason}")

    def _poll_notices(self) -> None:
        """Take the halt notices that other ranks sent (:meth:`_halt`); any thread."""
        if self._notice is None or self._freed:
            return
        while (message := self._notice.improbe(source=self._MPI.ANY_SOURCE, tag=_HALT_TAG)) is not None:
            self._halt(message.recv(), tell=False)

    def _stop_worker(self, wait_s: float) -> None:
        if self._thread is not None:
            with self._cond:
                self._queue.clear()
                self._stop = True
                self._cond.notify_all()
            self._thread.join(wait_s)

    def _check(self, fields, global_shape, start) -> tuple[tuple, tuple]:
        cfg = self.cfg.input
        if not isinstance(fields, dict):
            raise InputError(f"fields: expected a dict name -> [nz, ny, nx] array, got {type(fields).__name__}")
        gshape = _integers("global_shape", global_shape)
        start = _integers("start", start)
        wanted = [cfg.var] + ([cfg.color_var] if cfg.color_var else [])
        shape = None
        for name in wanted:
            if name not in fields:
                raise InputError(f"field {name!r} (input.{'var' if name == cfg.var else 'color_var'}) is not "
                                 f"among the fields given: {', '.join(map(repr, fields)) or 'none'}")
            a = fields[name]
            if not isinstance(a, np.ndarray) or a.ndim != 3:
                raise InputError(f"field {name!r}: expected a 3D array [nz, ny, nx], got "
                                 f"{type(a).__name__} with shape {np.shape(a)}")
            if a.dtype.kind not in "uif":     # (timedelta64 counts as a number to numpy)
                raise InputError(f"field {name!r}: expected a real numeric array (integers or floats), "
                                 f"got dtype {a.dtype}")
            if shape is not None and a.shape != shape:
                raise InputError(f"field {name!r}: expected the shape of {cfg.var!r} {shape}, got {a.shape}")
            shape = a.shape
        count = shape[::-1]
        if min(count) < 1 or any(s < 0 or s + c > g for s, c, g in zip(start, count, gshape)):
            raise InputError(f"start {start} + count {count} (x, y, z): expected inside global_shape {gshape}")
        return gshape, start

    def _execute(self, step, time, fields, global_shape, start, origin, spacing, error) -> None:
        t0 = _time.perf_counter()
        if self._closed:
            raise InsituError(self._ended or "execute() after finalize()")
        if self._broken is not None:
            raise InsituError(self._broken)
        # 1. agree: the same call on every rank, unusable input on any rank, failures to report
        gshape = start_ = None
        number = None                       # the step number, once it is one
        try:
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
                raise InputError(f"step: expected an integer >= 0 (the outputs are named by it), got {step!r}")
            step = number = int(step)
            time = _step_time(time)
            if step in self._given:
                raise InputError(f"step {step}: given to execute() before; each step number once (it names the "
                                 "step's outputs)")
            if error is None:
                gshape, start_ = self._check(fields, global_shape, start)
                origin, spacing = check_geometry(origin, spacing, gshape)
        except (InputError, ConfigError) as e:
            error = str(e)
        gathered = self._same_call(("execute()", number), error)
        if any(g["error"] for g in gathered):
            call = f"step {step}" if number is not None else "execute()"
            raise InputError(_report(f"{call}: invalid input", [g["error"] for g in gathered]))
        self._given.add(step)
        pending = [g["pending"] for g in gathered]
        record = ExecuteRecord(step=step, seconds=0.0, bytes_copied=0)
        if self._halted is not None:         # training has stopped: the step is recorded, not trained
            self._skipped([step], f"not trained: {self._halted}")
        elif step in self._done:             # complete in the output folder (output.existing: resume)
            self.status[step] = StepStatus(step, "skipped", "complete in the output folder (resume)")
        else:
            # 2. copy: the halo exchange builds new arrays with ghost layers (collective)
            cfg = self.cfg.input
            block = block_from_local(fields[cfg.var], start_, gshape, self._sim, origin, spacing)
            record.bytes_copied = block.data.nbytes
            if cfg.color_var:
                color = block_from_local(fields[cfg.color_var], start_, gshape, self._sim, origin, spacing)
                block.fields[cfg.color_var] = color.data
                record.bytes_copied += color.data.nbytes
            # 3. train now (its failure is agreed inside), or queue
            with self._cond:
                self.status[step] = StepStatus(step, "queued")
            if self.mode == "sync":
                self._train(step, time, block)
                pending.append(self._pending())
            else:
                self._enqueue(_Item(0, step, float(time), block), record)
        record.seconds = _time.perf_counter() - t0
        self.stats.executes.append(record)
        # this call's step was taken: earlier failures, once; and, every call, that training has stopped
        self._raise_failures(pending, f"training has stopped ({self._halted}); step {step} was not trained"
                             if self._halted is not None and self.status[step].status != "trained" else None)

    def _drop_waiting(self, keep: int) -> list[int]:
        """Drop the oldest steps that no worker on any rank has started, so that at most
        ``keep`` of them remain. Collective; call with ``self._cond`` held so the worker
        cannot start a step between the allgather and the drop."""
        started = max(self._gather("dropping waiting steps", self._started))   # index < started: running or done
        waiting = [it for it in self._queue if it.index >= started]   # the same items on every rank
        dropped = waiting[:max(len(waiting) - keep, 0)]
        for it in dropped:
            self._queue.remove(it)
        return [it.step for it in dropped]

    def _enqueue(self, item: _Item, record: ExecuteRecord) -> None:
        capacity = self.cfg.run.queue
        with self._cond:
            if self.cfg.run.policy == "discard":
                record.dropped = self._drop_waiting(keep=capacity - 1)
                self.stats.dropped.extend(record.dropped)
            else:
                t = _time.perf_counter()
                while len(self._queue) >= capacity and self._thread.is_alive() and self._halted is None:
                    self._cond.wait(0.1)
                    self._poll_notices()     # a rank whose training stopped: this worker may never make room
                record.waited_s = _time.perf_counter() - t
            if self._halted is None:         # (after a halt, _halt recorded this step as skipped)
                item.index = self._enqueued
                self._enqueued += 1
                self._queue.append(item)
                self._cond.notify_all()
        self._skipped(record.dropped, f"dropped: newer steps arrived while it waited (run.policy discard, "
                                      f"run.queue {capacity})")

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop and self._halted is None:
                    self._cond.wait()
                if not self._queue or self._halted is not None:
                    return
                item = self._queue.popleft()
                self._started = item.index + 1
                self._cond.notify_all()
            self._train(item.step, item.time, item.block)

    def _train(self, step: int, time: float, block: Block) -> None:
        """Train one step on the worker communicator; afterwards all ranks agree whether it succeeded
        (within 3 x ``run.timeout_s``), so every rank records the same outcome. After a failure the
        process group is rebuilt (:meth:`_rebuild`) and the next steps train; an agreement that times
        out stops the training (:meth:`_halt`)."""
        t0 = _time.perf_counter()
        message = None
        result = None
        unwritable = None                   # a write that failed here (a full disk, a read-only folder): its error
        try:
            result = self._driver.train(block, step=step, time=time)
        except Exception as e:           # noqa: BLE001 - every failure is reported, none is lost
            message = f"step {step}: {type(e).__name__}: {e}"
            cause = e if isinstance(e, OSError) else e.__cause__ if isinstance(e.__cause__, OSError) else None
            unwritable = cause and f"{type(cause).__name__}: {' '.join(str(cause).split())}"
            agreed = isinstance(e, RankFailure) and e.__cause__ is None   # another rank's failure, told here
            one_line = isinstance(e, InputError) or cause is not None or agreed   # a traceback tells no more
            detail = " ".join(message.split()) + "\n" if one_line else traceback.format_exc()
            print(f"[insitu rank {self.rank}] {detail}", end="", file=sys.stderr, flush=True)
        self._poll_notices()
        if self._halted is not None:        # the other ranks gave up on this step: nothing more to agree on
            return
        try:
            gathered = agree_errors(self._base, message and (message, unwritable), seconds=self._settle_s,
                                    what=f"agreeing on training step {step}")
        except AgreementTimeout as e:
            self._failed(step, f"training step {step} failed: {e}" + (f"; rank {self.rank}: {message}" if message else ""))
            self._halt(f"the ranks did not agree on training step {step} within {self._settle_s:g} s "
                       "(3 x run.timeout_s): a rank's training hangs or died")
            return
        if any(gathered):                   # reported once, recorded; the next steps train as usual
            written = next((w for _, w in filter(None, gathered) if w), None)
            if written is not None:         # ... unless no step can be written: training stops, on every rank
                self._unwritable = True     # (metrics.csv neither: the statuses stay in self.status)
            self._failed(step, _report(f"training step {step} failed", [g and g[0] for g in gathered]))
            if written is not None:
                self._halt(f"step {step}'s files could not be written ({written}), nor can later steps' be: "
                           "free space or make output.dir writable", tell=False)
                return
            self._rebuild(step)
            return
        self._driver.trained(result)
        with self._cond:
            self.status[step] = StepStatus(step, "trained")
        self.stats.trained.append(TrainedRecord(int(step), _time.perf_counter() - t0, dict(result.metrics)))

    def _rebuild(self, step: int) -> None:
        """A new communicator and process group for the next steps, after step ``step`` failed: the failure
        may have left the group's connections broken (a rank's collective timed out while another had left
        it). Collective over the training ranks, within ``run.timeout_s``; failing, training stops."""
        try:
            agree_errors(self._base, None, seconds=self._timeout, what=f"rebuilding the process group after step {step}")
            shutdown(self._work)
            rc = self.cfg.run
            self._work = init_comm(self._base, device=rc.device, timeout_s=rc.timeout_s, threads=rc.threads,
                                   abort_on_timeout=False)
        except Exception as e:           # noqa: BLE001 - the simulation goes on without training
            self._halt(f"rebuilding the process group after step {step} failed ({type(e).__name__}: {e})")
            return
        self._driver.comm = self._work
