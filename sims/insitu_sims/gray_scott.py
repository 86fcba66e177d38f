"""3D Gray-Scott reaction-diffusion mini-app on mpi4py, writing through ADIOS2.

The model and its parameters follow the ADIOS2 Gray-Scott tutorial::

    du/dt = Du lap(u) - u v^2 + F (1 - u) + noise * r
    dv/dt = Dv lap(v) + u v^2 - (F + k) v

with ``lap`` the 7-point Laplacian divided by 6, a periodic ``L^3`` grid, explicit Euler
steps of ``dt`` and ``r`` uniform in (-1, 1) drawn per cell and per step. The initial
condition is ``U = 1, V = 0`` with a centred cube where ``U = 0.25, V = 0.33``.

The grid is split over the ranks with ``MPI.Compute_dims`` and a periodic Cartesian
communicator; every rank holds its block plus one ghost layer, exchanged with its six
face neighbours each step. The noise is a hash of (seed, step, global cell index), so
the same seed gives the same global field whatever the number of ranks.

Every ``plotgap`` steps the fields are written as global 3D arrays ``U`` and ``V``
(shape ``(L, L, L)``, C order ``[z, y, x]``) with scalars ``step`` and ``time`` and the
attributes ``origin`` and ``spacing`` (x, y, z), one ADIOS2 step per output, through BP5 or BP4
(file) or SST (stream). With a serial ADIOS2 (the PyPI wheel) the blocks are gathered to
rank 0, which writes; with an MPI-enabled ADIOS2 every rank writes its own block.

This module is a standalone simulation and does not import ``insitu``.

    mpiexec -n 4 python -m insitu_sims.gray_scott --L 64 --steps 1000 --plotgap 10 --engine BP5 --output gs.bp
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
from mpi4py import MPI

ENGINES = ("BP5", "BP4", "SST", "none")
SST_POLICIES = ("Block", "Discard")

Consumer = Callable[[int, float, dict, tuple, tuple], None]

L_MIN = 4       # the initial cube of V reaches L // 4 cells (at most 6) each way from the centre: below 4 there is
                # none, and U = 1, V = 0 stay uniform for ever


@dataclass
class GrayScottSettings:
    """Parameters of one run (defaults: the ADIOS2 Gray-Scott tutorial).

    engine:           "BP5" or "BP4" writes the file ``output``; "SST" streams under the name
                      ``output`` (readers open the same name); "none" writes nothing.
    sst_readers:      SST ``RendezvousReaderCount``: the writer's open waits for this many
                      readers (each serial reader process is its own reader cohort, so a
                      reader launched with ``mpiexec -n P`` needs ``P`` here); 0: do not wait.
    sst_queue_limit:  SST ``QueueLimit``: steps held for readers (0: unlimited).
    sst_policy:       SST ``QueueFullPolicy``: "Block" (the simulation waits for the
                      slowest reader) or "Discard" (the oldest queued step is dropped).
    sst_open_timeout_s: SST ``OpenTimeoutSecs``: how long the writer waits for its readers.
    """

    L: int = 64
    Du: float = 0.2
    Dv: float = 0.1
    F: float = 0.02
    k: float = 0.048
    dt: float = 1.0
    steps: int = 1000
    plotgap: int = 10
    noise: float = 0.1
    seed: int = 0
    output: str = "gs.bp"
    engine: str = "BP5"
    sst_readers: int = 1
    sst_queue_limit: int = 1
    sst_policy: str = "Block"
    sst_open_timeout_s: float = 60.0

    def validate(self) -> "GrayScottSettings":
        if not isinstance(self.L, int) or self.L < L_MIN:
            raise ValueError(f"L: expected an integer >= {L_MIN} (the initial cube of V is L // 4 cells each way "
                             f"from the centre), got {self.L!r}")
        if self.steps < 0:
            raise ValueError(f"steps: expected >= 0, got {self.steps}")
        if self.plotgap < 1:
            raise ValueError(f"plotgap: expected >= 1, got {self.plotgap}")
        if self.dt <= 0:
            raise ValueError(f"dt: expected > 0, got {self.dt}")
        if min(self.Du, self.Dv, self.F, self.k, self.noise) < 0:
            raise ValueError(f"Du, Dv, F, k, noise: expected >= 0, got "
                             f"{self.Du}, {self.Dv}, {self.F}, {self.k}, {self.noise}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.sst_policy not in SST_POLICIES:
            raise ValueError(f"sst_policy: expected one of {', '.join(SST_POLICIES)}, got {self.sst_policy!r}")
        if self.sst_readers < 0 or self.sst_queue_limit < 0:
            raise ValueError(f"sst_readers, sst_queue_limit: expected >= 0, got "
                             f"{self.sst_readers}, {self.sst_queue_limit}")
        if self.engine != "none" and not self.output:
            raise ValueError("output: expected a file or stream name when engine is not 'none'")
        return self


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
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


BLOCK_ARRAYS = 2 + 3 + 4 + 2           # of 8-byte values: u and v with their ghost layers, the noise's 3 hashes,
                                        # 4 work arrays, the 2 copies of an output


def memory_bytes(settings: GrayScottSettings, ranks: int, gathered: bool = False) -> int:
    """Bytes that the largest rank's part of a run on ``ranks`` ranks holds at once (its block's arrays, as
    :class:`GrayScott` and :func:`run` allocate them); ``gathered``: rank 0 also receives the whole grid to
    write it (a serial ADIOS2: a receive buffer and U and V whole)."""
    L = settings.L
    nx, ny, nz = largest_block(L, ranks)
    ghosts = (nx + 2) * (ny + 2) * (nz + 2)
    faces = 4 * ((ny + 2) * (nz + 2) + (nx + 2) * (nz + 2) + (nx + 2) * (ny + 2))   # the exchange's buffers
    return 8 * (2 * ghosts + (BLOCK_ARRAYS - 2) * nx * ny * nz + faces + (3 * L ** 3 if gathered else 0))


def machine_memory() -> int:
    """Bytes of physical memory of this machine."""
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class GrayScott:
    """One rank's piece of the periodic Gray-Scott grid.

    u, v:          [nz, ny, nx] float64 copies of the samples this rank owns (no ghosts).
    start:         global index (x, y, z) of ``u[0, 0, 0]``.
    global_shape:  (L, L, L) as (x, y, z).
    """

    def __init__(self, settings: GrayScottSettings, comm: MPI.Comm = MPI.COMM_WORLD):
        self.settings = settings.validate()
        L = settings.L
        dims = split_dims(L, comm.Get_size())                # (px, py, pz)
        self.cart = comm.Create_cart(dims, periods=[True, True, True], reorder=False)
        self.dims = tuple(dims)
        self.coords = tuple(self.cart.Get_coords(self.cart.Get_rank()))
        sc = [_split(L, p, c) for p, c in zip(self.dims, self.coords)]
        self.start = tuple(s for s, _ in sc)
        self.count = tuple(c for _, c in sc)                  # (nx, ny, nz)
        self.global_shape = (L, L, L)
        self.step_count = 0
        nx, ny, nz = self.count
        self._u = np.ones((nz + 2, ny + 2, nx + 2), dtype=np.float64)
        self._v = np.zeros_like(self._u)
        # initial cube, in global indices: [L/2 - d, L/2 + d) on every axis
        d = min(6, L // 4)
        lo, hi = L // 2 - d, L // 2 + d
        sl = []
        for s, c in zip(self.start, self.count):
            a, b = max(lo, s), min(hi, s + c)
            sl.append(slice(a - s + 1, b - s + 1) if b > a else slice(0, 0))
        cube = (sl[2], sl[1], sl[0])
        self._u[cube] = 0.25
        self._v[cube] = 0.33
        # global linear index of every owned cell (for the split-independent noise)
        x = np.arange(self.start[0], self.start[0] + nx, dtype=np.uint64)
        y = np.arange(self.start[1], self.start[1] + ny, dtype=np.uint64)
        z = np.arange(self.start[2], self.start[2] + nz, dtype=np.uint64)
        self._gidx = (z[:, None, None] * np.uint64(L * L) + y[None, :, None] * np.uint64(L)
                      + x[None, None, :])
        self._du, self._dv, self._uvv, self._tmp = (np.empty((nz, ny, nx)) for _ in range(4))
        self._hash, self._hash_tmp = np.empty_like(self._gidx), np.empty_like(self._gidx)
        # neighbours and contiguous face buffers per axis (array axis 2 = x, 1 = y, 0 = z)
        self._nbrs = [self.cart.Shift(axis, 1) for axis in range(3)]   # (lower, upper) per x, y, z
        self._bufs = []
        for axis in range(3):
            shape = list(self._u.shape)
            shape[2 - axis] = 1
            self._bufs.append([np.empty(shape) for _ in range(4)])

    # ---- state -------------------------------------------------------------------------
    @property
    def u(self) -> np.ndarray:
        return self._u[1:-1, 1:-1, 1:-1].copy()

    @property
    def v(self) -> np.ndarray:
        return self._v[1:-1, 1:-1, 1:-1].copy()

    @property
    def time(self) -> float:
        return self.step_count * self.settings.dt

    # ---- one step ----------------------------------------------------------------------
    def _exchange(self, a: np.ndarray) -> None:
        """Fill the ghost layer of ``a`` from the face neighbours (periodic)."""
        for axis in range(3):                      # x, y, z; later axes carry earlier ghosts
            ax = 2 - axis
            lower, upper = self._nbrs[axis]
            send_lo, send_hi, recv_lo, recv_hi = self._bufs[axis]

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

    def _noise(self, out: np.ndarray) -> np.ndarray:
        """Uniform (-1, 1) per owned cell into ``out``: a function of (seed, step, global index) only."""
        key = _splitmix64(np.array([self.settings.seed * 0x1000003 + self.step_count], dtype=np.uint64))
        key += np.uint64(0x9E3779B97F4A7C15)      # array arithmetic wraps silently
        z = self._hash
        np.add(self._gidx, key, out=z)
        t = self._hash_tmp
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(z, np.uint64(shift), out=t)
            z ^= t
            z *= np.uint64(mult)
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
        z >>= np.uint64(11)
        np.multiply(z, 2.0 / 2.0**53, out=out)
        out -= 1.0
        return out

    def _laplacian(self, a: np.ndarray, out: np.ndarray) -> np.ndarray:
        """7-point Laplacian / 6 of the interior of ``a`` (with ghosts) into ``out``."""
        np.add(a[:-2, 1:-1, 1:-1], a[2:, 1:-1, 1:-1], out=out)
        out += a[1:-1, :-2, 1:-1]
        out += a[1:-1, 2:, 1:-1]
        out += a[1:-1, 1:-1, :-2]
        out += a[1:-1, 1:-1, 2:]
        np.multiply(a[1:-1, 1:-1, 1:-1], 6.0, out=self._tmp)
        out -= self._tmp
        out *= 1.0 / 6.0
        return out

    def step(self) -> None:
        """Advance one time step (collective: every rank must call it)."""
        s = self.settings
        self._exchange(self._u)
        self._exchange(self._v)
        uc = self._u[1:-1, 1:-1, 1:-1]
        vc = self._v[1:-1, 1:-1, 1:-1]
        du, dv, uvv = self._du, self._dv, self._uvv
        np.multiply(vc, vc, out=uvv)
        uvv *= uc
        self._laplacian(self._u, du)            # du = Du lap(u) - u v^2 + F (1 - u) + noise r
        du *= s.Du
        du -= uvv
        np.subtract(1.0, uc, out=self._tmp)
        self._tmp *= s.F
        du += self._tmp
        if s.noise > 0:
            self._noise(self._tmp)
            self._tmp *= s.noise
            du += self._tmp
        self._laplacian(self._v, dv)            # dv = Dv lap(v) + u v^2 - (F + k) v
        dv *= s.Dv
        dv += uvv
        np.multiply(vc, s.F + s.k, out=self._tmp)
        dv -= self._tmp
        du *= s.dt
        dv *= s.dt
        uc += du
        vc += dv
        self.step_count += 1


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


class _Writer:
    """ADIOS2 output of U, V, step, time; serial ADIOS2 -> gather to rank 0."""

    def __init__(self, settings: GrayScottSettings, sim: GrayScott, comm: MPI.Comm):
        import adios2                           # optional (engine "none" writes nothing); seconds to import

        self.comm = comm
        self.sim = sim
        self.parallel = bool(adios2.is_built_with_mpi) and comm.Get_size() > 1
        self.writes = self.parallel or comm.Get_rank() == 0
        L = settings.L
        self.shape = [L, L, L]
        if self.parallel:
            self.start = list(reversed(sim.start))
            self.count = list(reversed(sim.count))
        else:
            self.start, self.count = [0, 0, 0], [L, L, L]
            self.boxes = comm.gather((sim.start, sim.count), root=0)
            if comm.Get_rank() == 0:
                self.counts = [int(np.prod(c)) for _, c in self.boxes]
                self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(int).tolist()
                self.recv = np.empty(sum(self.counts), dtype=np.float64)
                self.full = {n: np.empty((L, L, L), dtype=np.float64) for n in ("U", "V")}
        self.stream = None
        error = None
        if self.writes:
            try:
                self._open(adios2, settings)
            except Exception as e:           # every rank must learn it, or they wait in Gatherv
                error = e
        failed = comm.allreduce(error is not None, op=MPI.LOR)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"gray-scott: opening the {settings.engine} output {settings.output!r} failed "
                               "on another rank")

    def _open(self, adios2, settings: GrayScottSettings) -> None:
        comm = self.comm
        ad = adios2.Adios(comm=comm) if self.parallel else adios2.Adios()
        io = ad.declare_io("gray_scott")
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


def run(settings: GrayScottSettings, comm: MPI.Comm = MPI.COMM_WORLD,
        consumer: Consumer | None = None) -> RunStats:
    """Run ``settings.steps`` steps; every ``plotgap`` steps write and/or call ``consumer``.

    consumer: called on every rank as ``consumer(step, time, {"U": u, "V": v}, global_shape, start)``
              with u, v: [nz, ny, nx] owned samples, global_shape and start as (x, y, z).
    Returns the run's RunStats (same on every rank: rank 0's timings are broadcast).
    """
    sim = GrayScott(settings, comm)
    writer = _Writer(settings, sim, comm) if settings.engine != "none" else None
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
            fields_ = {"U": sim.u, "V": sim.v}
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


def parse_args(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_SELF) -> GrayScottSettings:
    """The settings of the command line ``argv``, checked for a run on the ranks of ``comm``: a value out of
    range, a grid that cannot be split over the ranks or does not fit this machine's memory ends the process
    with one line (from rank 0) and exit code 2."""
    ranks = comm.Get_size()

    def refuse(text: str) -> None:
        p.exit(2, f"{p.prog}: error: {text}\n" if comm.Get_rank() == 0 else None)

    p = argparse.ArgumentParser(description="3D Gray-Scott reaction-diffusion (ADIOS2 tutorial model) on MPI.")
    helps = {
        "L": "grid size (L^3 samples)", "Du": "diffusion of U", "Dv": "diffusion of V", "F": "feed rate",
        "k": "kill rate", "dt": "time step", "steps": "number of steps",
        "plotgap": "write every this many steps", "noise": "amplitude of the uniform noise on U",
        "seed": "noise seed (same seed, same field for any number of ranks)",
        "output": "BP5/BP4 file or SST stream name", "engine": "output engine",
        "sst_readers": "SST RendezvousReaderCount (0: do not wait for readers)",
        "sst_queue_limit": "SST QueueLimit (0: unlimited)", "sst_policy": "SST QueueFullPolicy",
        "sst_open_timeout_s": "SST OpenTimeoutSecs",
    }
    for f in fields(GrayScottSettings):
        kw = {"type": type(f.default), "default": f.default, "help": f"{helps[f.name]} (default: %(default)s)"}
        if f.name == "engine":
            kw["choices"] = ENGINES
        if f.name == "sst_policy":
            kw["choices"] = SST_POLICIES
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, **kw)
    ns = p.parse_args(argv)
    settings = GrayScottSettings(**{f.name: getattr(ns, f.name) for f in fields(GrayScottSettings)})
    try:
        settings.validate()
        split_dims(settings.L, ranks)
    except ValueError as e:
        refuse(str(e))
    need, have, gathered = memory_bytes(settings, ranks), machine_memory(), False
    # rank 0 gathers the grid to write it with a serial ADIOS2 (the PyPI wheel), and on one rank: asked of
    # ADIOS2 (seconds to import) only when that would not fit
    if settings.engine != "none" and memory_bytes(settings, ranks, gathered=True) > have:
        import adios2

        if ranks == 1 or not adios2.is_built_with_mpi:
            need, gathered = memory_bytes(settings, ranks, gathered=True), True
    if need > have:
        gib = 2.0 ** 30
        refuse(f"--L {settings.L}: the simulation needs {need / gib:.3g} GiB on a rank of {ranks} "
               f"({BLOCK_ARRAYS} arrays the size of its block, 8 bytes a sample"
               f"{', and the whole grid gathered on rank 0 to be written' if gathered else ''}); this machine has "
               f"{have / gib:.3g} GiB")
    return settings


def main(argv: list[str] | None = None) -> int:
    # adios2 imports torch and cupy when installed (for device buffers); this process
    # writes numpy arrays only, and skipping them saves seconds at start-up.
    for name in ("torch", "cupy"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    comm = MPI.COMM_WORLD
    settings = parse_args(argv, comm)
    stats = run(settings, comm)
    if comm.Get_rank() == 0:
        target = f" -> {settings.output}" if settings.engine != "none" else ""
        print(f"gray-scott L={settings.L} ranks={stats.ranks} steps={stats.steps} engine={settings.engine}{target}: "
              f"{stats.seconds:.3f} s, {stats.steps_per_s:.1f} steps/s "
              f"({stats.outputs} outputs, {stats.output_seconds:.3f} s in output)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
