"""What the Python mini-apps share: the periodic ``L^3`` grid split over MPI ranks, the ghost-layer
exchange, the memory check and the ADIOS2 output of global 3D fields.

The output convention, which ``insitu replay`` and ``insitu stream`` read: every output is one ADIOS2
step holding each field as a global 3D float64 array (shape ``(L, L, L)``, C order ``[z, y, x]``),
the scalars ``step`` (int) and ``time`` (float), and, once, the attributes ``origin`` and ``spacing``
(x, y, z). With a serial ADIOS2 (the PyPI wheel) rank 0 gathers the blocks and writes; with an
MPI-enabled ADIOS2 every rank writes its own block.

This module does not import ``insitu``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

ENGINES = ("BP5", "BP4", "SST", "none")
SST_POLICIES = ("Block", "Discard")

# the output settings every mini-app takes, with their command-line help
OUTPUT_HELP = {
    "output": "BP5/BP4 file or SST stream name", "engine": "output engine",
    "sst_readers": "SST RendezvousReaderCount (0: do not wait for readers)",
    "sst_queue_limit": "SST QueueLimit (0: unlimited)", "sst_policy": "SST QueueFullPolicy",
    "sst_open_timeout_s": "SST OpenTimeoutSecs",
}


def check_output(settings: Any) -> None:
    """ValueError naming the setting when the output settings of ``settings`` (``engine``, ``output``,
    ``sst_*``) are out of range."""
    if settings.engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {settings.engine!r}")
    if settings.sst_policy not in SST_POLICIES:
        raise ValueError(f"sst_policy: expected one of {', '.join(SST_POLICIES)}, got {settings.sst_policy!r}")
    if settings.sst_readers < 0 or settings.sst_queue_limit < 0:
        raise ValueError(f"sst_readers, sst_queue_limit: expected >= 0, got "
                         f"{settings.sst_readers}, {settings.sst_queue_limit}")
    if settings.engine != "none" and not settings.output:
        raise ValueError("output: expected a file or stream name when engine is not 'none'")


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """Start and count of part ``index`` of ``n`` cells split in ``parts``."""
    a, b = index * n // parts, (index + 1) * n // parts
    return a, b - a


def grid_dims(ranks: int) -> tuple[int, int, int]:
    """How the grid is split over ``ranks`` ranks: (px, py, pz) blocks."""
    return tuple(MPI.Compute_dims(ranks, 3))


def largest_block(L: int, ranks: int) -> tuple[int, int, int]:
    """(nx, ny, nz) samples of the largest rank's block of the ``L^3`` grid split over ``ranks`` ranks."""
    return tuple(-(-L // p) for p in grid_dims(ranks))


def split_dims(L: int, ranks: int) -> tuple[int, int, int]:
    """How the ``L^3`` grid is split over ``ranks`` ranks, (px, py, pz); ValueError when an axis has fewer
    samples than ranks along it."""
    dims = grid_dims(ranks)
    if max(dims) > L:
        raise ValueError(f"L: expected at least {max(dims)} on {ranks} ranks (the grid is split over them "
                         f"{' x '.join(map(str, dims))}, a sample each at least), got {L}")
    return dims


def machine_memory() -> int:
    """Bytes of physical memory of this machine."""
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def face_bytes(L: int, ranks: int) -> int:
    """Bytes of the ghost exchange's face buffers (:func:`face_buffers`) of the largest rank's block."""
    nx, ny, nz = largest_block(L, ranks)
    return 8 * 4 * ((ny + 2) * (nz + 2) + (nx + 2) * (nz + 2) + (nx + 2) * (ny + 2))


class CartesianSplit:
    """One rank's place in the periodic ``L^3`` grid split over the ranks of ``comm``.

    cart:   the periodic Cartesian communicator (``MPI.Compute_dims``, no reordering).
    start:  global index (x, y, z) of the rank's first owned sample; count: its (nx, ny, nz).
    nbrs:   (lower, upper) neighbour ranks along x, y, z.
    """

    def __init__(self, L: int, comm: MPI.Comm):
        dims = split_dims(L, comm.Get_size())
        self.cart = comm.Create_cart(dims, periods=[True, True, True], reorder=False)
        self.dims = tuple(dims)
        self.coords = tuple(self.cart.Get_coords(self.cart.Get_rank()))
        parts = [split(L, p, c) for p, c in zip(self.dims, self.coords)]
        self.start = tuple(s for s, _ in parts)
        self.count = tuple(c for _, c in parts)
        self.nbrs = [self.cart.Shift(axis, 1) for axis in range(3)]

    def face_buffers(self) -> list[list[np.ndarray]]:
        """Contiguous face buffers per axis (x, y, z): send lower, send upper, receive lower, receive upper,
        for arrays of the block's shape with one ghost layer."""
        nx, ny, nz = self.count
        bufs = []
        for axis in range(3):
            shape = [nz + 2, ny + 2, nx + 2]
            shape[2 - axis] = 1
            bufs.append([np.empty(shape) for _ in range(4)])
        return bufs

    def exchange(self, a: np.ndarray, bufs: list[list[np.ndarray]]) -> None:
        """Fill the ghost layer of ``a`` ([nz + 2, ny + 2, nx + 2]) from the face neighbours (periodic); x, then
        y, then z, so that later axes carry the earlier ghosts (edges and corners included)."""
        for axis in range(3):
            ax = 2 - axis
            lower, upper = self.nbrs[axis]
            send_lo, send_hi, recv_lo, recv_hi = bufs[axis]

            def face(i):
                idx = [slice(None)] * 3
                idx[ax] = slice(i, i + 1)
                return tuple(idx)

            n = a.shape[ax]
            np.copyto(send_lo, a[face(1)])
            np.copyto(send_hi, a[face(n - 2)])
            # to lower, from upper: fills the upper ghost; and the reverse
            self.cart.Sendrecv(send_lo, dest=lower, sendtag=10 + axis, recvbuf=recv_hi, source=upper,
                               recvtag=10 + axis)
            self.cart.Sendrecv(send_hi, dest=upper, sendtag=20 + axis, recvbuf=recv_lo, source=lower,
                               recvtag=20 + axis)
            a[face(n - 1)] = recv_hi
            a[face(0)] = recv_lo


class FieldWriter:
    """ADIOS2 output of a mini-app's global 3D fields, one ADIOS2 step per :meth:`write` (the module's
    convention); a serial ADIOS2 gathers the blocks to rank 0, which writes.

    settings: the mini-app's settings (``engine``, ``output``, ``sst_*``); names: the fields written;
    io_name: the ADIOS2 IO's name; start, count: this rank's block (x, y, z) of the ``L^3`` grid.
    """

    def __init__(self, settings: Any, L: int, start: Sequence[int], count: Sequence[int], names: Sequence[str],
                 io_name: str, comm: MPI.Comm):
        import adios2                           # optional (engine "none" writes nothing); seconds to import

        self.comm = comm
        self.parallel = bool(adios2.is_built_with_mpi) and comm.Get_size() > 1
        self.writes = self.parallel or comm.Get_rank() == 0
        self.shape = [L, L, L]
        if self.parallel:
            self.start = list(reversed(start))
            self.count = list(reversed(count))
        else:
            self.start, self.count = [0, 0, 0], [L, L, L]
            self.boxes = comm.gather((tuple(start), tuple(count)), root=0)
            if comm.Get_rank() == 0:
                self.counts = [int(np.prod(c)) for _, c in self.boxes]
                self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(int).tolist()
                self.recv = np.empty(sum(self.counts), dtype=np.float64)
                self.full = {n: np.empty((L, L, L), dtype=np.float64) for n in names}
        self.stream = None
        error = None
        if self.writes:
            try:
                self._open(adios2, settings, io_name)
            except Exception as e:           # every rank must learn it, or they wait in Gatherv
                error = e
        failed = comm.allreduce(error is not None, op=MPI.LOR)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{io_name}: opening the {settings.engine} output {settings.output!r} failed "
                               "on another rank")

    def _open(self, adios2, settings: Any, io_name: str) -> None:
        comm = self.comm
        ad = adios2.Adios(comm=comm) if self.parallel else adios2.Adios()
        io = ad.declare_io(io_name)
        io.set_engine(settings.engine)
        if settings.engine == "SST":
            io.set_parameters({
                "RendezvousReaderCount": str(settings.sst_readers),
                "QueueLimit": str(settings.sst_queue_limit),
                "QueueFullPolicy": settings.sst_policy,
                "DataTransport": "WAN",
                "OpenTimeoutSecs": str(int(np.ceil(settings.sst_open_timeout_s))),
            })
        else:
            io.set_parameters({"Profile": "Off"})
        self._adios = ad
        self.stream = adios2.Stream(io, settings.output, "w", comm) if self.parallel \
            else adios2.Stream(io, settings.output, "w")
        self.stream.write_attribute("origin", np.zeros(3))
        self.stream.write_attribute("spacing", np.ones(3))

    def _gathered(self, name: str, local: np.ndarray) -> np.ndarray | None:
        sendbuf = np.ascontiguousarray(local).ravel()
        if self.comm.Get_rank() == 0:
            self.comm.Gatherv(sendbuf, [self.recv, self.counts, self.displs, MPI.DOUBLE], root=0)
            out = self.full[name]
            for (s, c), off, n in zip(self.boxes, self.displs, self.counts):
                out[s[2]:s[2] + c[2], s[1]:s[1] + c[1], s[0]:s[0] + c[0]] = \
                    self.recv[off:off + n].reshape(c[2], c[1], c[0])
            return out
        self.comm.Gatherv(sendbuf, None, root=0)
        return None

    def write(self, step: int, t: float, fields_: dict[str, np.ndarray]) -> None:
        """One ADIOS2 step: the fields ``fields_`` (this rank's [nz, ny, nx] owned samples each), ``step``
        and ``time``; collective."""
        data = fields_ if self.parallel else {n: self._gathered(n, a) for n, a in fields_.items()}
        if not self.writes:
            return
        s = self.stream
        s.begin_step()
        for name, arr in data.items():
            s.write(name, np.ascontiguousarray(arr), self.shape, self.start, self.count)
        if not self.parallel or self.comm.Get_rank() == 0:
            s.write("step", int(step))
            s.write("time", float(t))
        s.end_step()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


def add_settings_flags(p: argparse.ArgumentParser, settings_type: type, helps: dict[str, str], *,
                       unset: Sequence[str] = ()) -> None:
    """One ``--name`` flag per field of the dataclass ``settings_type`` (underscores as dashes), its help from
    ``helps`` with the default, a float for a field whose default is None; the engine and SST policy flags take
    their choices. ``unset``: fields whose flag defaults to None, not to the field's default (something else,
    such as a preset, fills them in when not given; their help says what)."""
    for f in fields(settings_type):
        kind = float if f.default is None else type(f.default)
        shown = "" if f.name in unset else f" (default: {f.default})"
        kw = {"type": kind, "default": None if f.name in unset else f.default, "help": helps[f.name] + shown}
        if f.name == "engine":
            kw["choices"] = ENGINES
        if f.name == "sst_policy":
            kw["choices"] = SST_POLICIES
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, **kw)


def check_memory(need: int, gathered_need: int, *, L: int, ranks: int, writes: bool, arrays: int, refuse) -> None:
    """``refuse(text)`` (one line, exit 2) when the largest rank's part of a run needs more than this machine's
    memory: ``need`` bytes, or ``gathered_need`` where rank 0 gathers the grid to write it (a serial ADIOS2,
    or one rank), which is asked of ADIOS2 (seconds to import) only when that would not fit; ``arrays``: the
    block-sized arrays the message names."""
    have, gathered = machine_memory(), False
    if writes and gathered_need > have:
        import adios2

        if ranks == 1 or not adios2.is_built_with_mpi:
            need, gathered = gathered_need, True
    if need > have:
        gib = 2.0 ** 30
        refuse(f"--L {L}: the simulation needs {need / gib:.3g} GiB on a rank of {ranks} "
               f"({arrays} arrays the size of its block, 8 bytes a sample"
               f"{', and the whole grid gathered on rank 0 to be written' if gathered else ''}); this machine has "
               f"{have / gib:.3g} GiB")


@dataclass
class RunStats:
    """What a run did: steps, outputs and where the time went (seconds, rank 0's view)."""

    steps: int
    outputs: int
    seconds: float
    output_seconds: float
    ranks: int

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("inf")


def run_steps(sim: Any, settings: Any, comm: MPI.Comm, names: tuple[str, ...], app: str,
              fields_of: Callable[[Any], dict], consumer: Callable | None = None) -> RunStats:
    """Step ``sim`` (``.step()``, ``.step_count``, ``.time``, ``.start``, ``.count``, ``.global_shape``)
    ``settings.steps`` times; every ``plotgap`` steps (and at the last) write its fields ``fields_of(sim)``
    (named ``names``, for a writer named ``app``) and/or call ``consumer(step, time, fields, global_shape,
    start)`` on every rank. Returns the run's RunStats (the same on every rank: rank 0's timings)."""
    writer = FieldWriter(settings, settings.L, sim.start, sim.count, names, app, comm) \
        if settings.engine != "none" else None
    outputs, out_s = 0, 0.0
    comm.Barrier()
    t0 = time.perf_counter()
    try:
        while sim.step_count < settings.steps:
            for _ in range(min(settings.plotgap, settings.steps - sim.step_count)):
                sim.step()
            if sim.step_count % settings.plotgap and sim.step_count != settings.steps:
                continue
            t1 = time.perf_counter()
            fields_ = fields_of(sim)
            if writer is not None:
                writer.write(sim.step_count, sim.time, fields_)
            if consumer is not None:
                consumer(sim.step_count, sim.time, fields_, sim.global_shape, sim.start)
            out_s += time.perf_counter() - t1
            outputs += 1
    finally:
        if writer is not None:
            writer.close()
    comm.Barrier()
    elapsed = time.perf_counter() - t0
    elapsed, out_s = comm.bcast((elapsed, out_s), root=0)
    return RunStats(sim.step_count, outputs, elapsed, out_s, comm.Get_size())


def checked(settings: Any, ranks: int, memory_bytes: Callable[..., int], arrays: int, refuse) -> Any:
    """``settings`` after their own checks (``validate()``), the grid's split over ``ranks`` and the memory
    check (``memory_bytes(settings, ranks, gathered=...)`` against the machine's); ``refuse(message)`` ends
    the command with one line otherwise."""
    try:
        settings.validate()
        split_dims(settings.L, ranks)
    except ValueError as e:
        refuse(str(e))
    # rank 0 gathers the grid to write it with a serial ADIOS2 (the PyPI wheel), and on one rank
    check_memory(memory_bytes(settings, ranks), memory_bytes(settings, ranks, gathered=True), L=settings.L,
                 ranks=ranks, writes=settings.engine != "none", arrays=arrays, refuse=refuse)
    return settings


def run_command(name: str, parse_args: Callable, run: Callable, argv: list[str] | None) -> int:
    """A mini-app's command: its settings from ``argv`` (``parse_args(argv, comm)``), ``run(settings, comm)``
    and, on rank 0, one line saying what it did."""
    # adios2 imports torch and cupy when installed (for device buffers); this process
    # writes numpy arrays only, and skipping them saves seconds at start-up.
    for module in ("torch", "cupy"):
        sys.modules.setdefault(module, None)  # type: ignore[arg-type]
    comm = MPI.COMM_WORLD
    settings = parse_args(argv, comm)
    stats = run(settings, comm)
    if comm.Get_rank() == 0:
        target = f" -> {settings.output}" if settings.engine != "none" else ""
        print(f"{name} L={settings.L} ranks={stats.ranks} steps={stats.steps} engine={settings.engine}{target}: "
              f"{stats.seconds:.3f} s, {stats.steps_per_s:.1f} steps/s "
              f"({stats.outputs} outputs, {stats.output_seconds:.3f} s in output)", flush=True)
    return 0
