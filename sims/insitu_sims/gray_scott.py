"""3D Gray-Scott reaction-diffusion mini-app on mpi4py, writing through ADIOS2.

The model and its parameters follow the ADIOS2 Gray-Scott tutorial::

    du/dt = Du lap(u) - u v^2 + F (1 - u) + noise * r
    dv/dt = Dv lap(v) + u v^2 - (F + k) v

with ``lap`` the 7-point Laplacian divided by 6, a periodic ``L^3`` grid, explicit Euler
steps of ``dt`` and ``r`` uniform in (-1, 1) drawn per cell and per step. The initial
condition is ``U = 1, V = 0`` with a centred cube where ``U = 0.25, V = 0.33``. ``F`` and ``k``
may ramp linearly over the run (``F_end``, ``k_end``): the preset ``breakup`` ramps them from the
tutorial's rates into the spots regime, so that the surface of V changes character mid-run
(:data:`PRESETS`).

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
    python -m insitu_sims.gray_scott --preset breakup --L 128 --steps 2400 --plotgap 100 --output breakup.bp
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
from mpi4py import MPI

from insitu_sims.grid import (OUTPUT_HELP, CartesianSplit, RunStats, add_settings_flags, checked,
                              check_output, face_bytes, largest_block, run_command, run_steps)
from insitu_sims.grid import ENGINES, SST_POLICIES, grid_dims  # noqa: F401 - the demo's and users' names here

Consumer = Callable[[int, float, dict, tuple, tuple], None]

L_MIN = 4       # the initial cube of V reaches L // 4 cells (at most 6) each way from the centre: below 4 there is
                # none, and U = 1, V = 0 stay uniform for ever


# Named feed and kill rates (``--preset``; given flags override a preset's values):
#   tutorial: the ADIOS2 tutorial's F = 0.02, k = 0.048, held for the whole run: a connected labyrinth of thin
#             V shells grows out of the initial cube until it fills the box.
#   breakup:  F and k ramp linearly over the run from the tutorial's (0.02, 0.048) to (0.03, 0.062), the
#             self-replicating spots regime: the labyrinth's shells first grow as in the tutorial, then, past the
#             middle of the run (k about 0.055), tear into separate spots that keep dividing, so the surface
#             changes character (one connected sheet -> hundreds of small closed blobs) while it still grows.
#             With noise 0.1 on L = 128 over 2400 steps, the largest connected piece of V > 0.3 holds 98% of
#             those cells at step 200, 70% at 800, 31% at 1000, 7% at 1400 and 1% at 2400, when 1249 pieces
#             of 8 cells or more hold them.
PRESETS = {
    "tutorial": {"F": 0.02, "k": 0.048, "F_end": None, "k_end": None},
    "breakup": {"F": 0.02, "k": 0.048, "F_end": 0.03, "k_end": 0.062},
}


@dataclass
class GrayScottSettings:
    """Parameters of one run (defaults: the ADIOS2 Gray-Scott tutorial).

    F_end, k_end:     feed and kill rates at the end of the run: the rates ramp linearly from ``F``, ``k``
                      at step 0 to them at step ``steps`` (each step takes the rates of its start);
                      None: held at ``F``, ``k`` (:data:`PRESETS` names some).
    engine:           "BP5" or "BP4" writes the file ``output``; "SST" streams under the name
                      ``output`` (readers open the same name); "none" writes nothing.
    sst_readers:      SST ``RendezvousReaderCount``: the writer's open waits for this many
                      readers (each serial reader process is its own reader cohort, so a
                      reader launched with ``mpiexec -n P`` needs ``P`` here); 0: do not wait.
    sst_queue_limit:  SST ``QueueLimit``: steps held for readers (0: unlimited).
    sst_policy:       SST ``QueueFullPolicy``: "Block" (the simulation waits for the
                      slowest reader) or "Discard" (the oldest queued step is dropped,
                      and what is queued when the writer closes).
    sst_open_timeout_s: SST ``OpenTimeoutSecs``: how long the writer waits for its readers.
    """

    L: int = 64
    Du: float = 0.2
    Dv: float = 0.1
    F: float = 0.02
    k: float = 0.048
    F_end: float | None = None
    k_end: float | None = None
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
        ends = [v for v in (self.F_end, self.k_end) if v is not None]
        if ends and min(ends) < 0:
            raise ValueError(f"F_end, k_end: expected >= 0 (or not given: held at F, k), got "
                             f"{self.F_end}, {self.k_end}")
        check_output(self)
        return self

    def rates(self, step: int) -> tuple[float, float]:
        """(F, k) of the step that starts at step ``step`` (:attr:`F_end`, :attr:`k_end`)."""
        a = step / self.steps if self.steps else 0.0
        F = self.F if self.F_end is None else self.F + (self.F_end - self.F) * a
        k = self.k if self.k_end is None else self.k + (self.k_end - self.k) * a
        return F, k


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


BLOCK_ARRAYS = 2 + 3 + 4 + 2           # of 8-byte values: u and v with their ghost layers, the noise's 3 hashes,
                                        # 4 work arrays, the 2 copies of an output


def memory_bytes(settings: GrayScottSettings, ranks: int, gathered: bool = False) -> int:
    """Bytes that the largest rank's part of a run on ``ranks`` ranks holds at once (its block's arrays, as
    :class:`GrayScott` and :func:`run` allocate them); ``gathered``: rank 0 also receives the whole grid to
    write it (a serial ADIOS2: a receive buffer and U and V whole)."""
    L = settings.L
    nx, ny, nz = largest_block(L, ranks)
    ghosts = (nx + 2) * (ny + 2) * (nz + 2)
    return 8 * (2 * ghosts + (BLOCK_ARRAYS - 2) * nx * ny * nz + (3 * L ** 3 if gathered else 0)) \
        + face_bytes(L, ranks)


class GrayScott:
    """One rank's piece of the periodic Gray-Scott grid.

    u, v:          [nz, ny, nx] float64 copies of the samples this rank owns (no ghosts).
    start:         global index (x, y, z) of ``u[0, 0, 0]``.
    global_shape:  (L, L, L) as (x, y, z).
    """

    def __init__(self, settings: GrayScottSettings, comm: MPI.Comm = MPI.COMM_WORLD):
        self.settings = settings.validate()
        L = settings.L
        grid = CartesianSplit(L, comm)
        self._grid = grid
        self.cart, self.dims, self.coords = grid.cart, grid.dims, grid.coords
        self.start, self.count = grid.start, grid.count           # (x, y, z), (nx, ny, nz)
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
        self._nbrs = grid.nbrs                                   # (lower, upper) per x, y, z
        self._bufs = grid.face_buffers()

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
        self._grid.exchange(a, self._bufs)

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
        F, k = s.rates(self.step_count)
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
        self._tmp *= F
        du += self._tmp
        if s.noise > 0:
            self._noise(self._tmp)
            self._tmp *= s.noise
            du += self._tmp
        self._laplacian(self._v, dv)            # dv = Dv lap(v) + u v^2 - (F + k) v
        dv *= s.Dv
        dv += uvv
        np.multiply(vc, F + k, out=self._tmp)
        dv -= self._tmp
        du *= s.dt
        dv *= s.dt
        uc += du
        vc += dv
        self.step_count += 1




def run(settings: GrayScottSettings, comm: MPI.Comm = MPI.COMM_WORLD,
        consumer: Consumer | None = None) -> RunStats:
    """Run ``settings.steps`` steps; every ``plotgap`` steps write and/or call ``consumer``.

    consumer: called on every rank as ``consumer(step, time, {"U": u, "V": v}, global_shape, start)``
              with u, v: [nz, ny, nx] owned samples, global_shape and start as (x, y, z).
    Returns the run's RunStats (same on every rank: rank 0's timings are broadcast).
    """
    sim = GrayScott(settings, comm)
    return run_steps(sim, settings, comm, ("U", "V"), "gray_scott", lambda s: {"U": s.u, "V": s.v}, consumer)


RATES = ("F", "k", "F_end", "k_end")        # what a preset sets


def parse_args(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_SELF) -> GrayScottSettings:
    """The settings of the command line ``argv``, checked for a run on the ranks of ``comm``: a value out of
    range, a grid that cannot be split over the ranks or does not fit this machine's memory ends the process
    with one line (from rank 0) and exit code 2. ``--preset`` sets the rates (:data:`PRESETS`); ``--F``,
    ``--k``, ``--F-end``, ``--k-end`` given override it."""
    ranks = comm.Get_size()

    def refuse(text: str) -> None:
        p.exit(2, f"{p.prog}: error: {text}\n" if comm.Get_rank() == 0 else None)

    p = argparse.ArgumentParser(description="3D Gray-Scott reaction-diffusion (ADIOS2 tutorial model) on MPI.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tutorial",
                   help="feed and kill rates: tutorial, F 0.02 and k 0.048 held (a labyrinth that grows); breakup, "
                        "ramped from those to F 0.03, k 0.062 over the run (the labyrinth tears into spots that "
                        "divide) (default: tutorial)")
    helps = {
        "L": "grid size (L^3 samples)", "Du": "diffusion of U", "Dv": "diffusion of V",
        "F": "feed rate (default: the preset's)", "k": "kill rate (default: the preset's)",
        "F_end": "feed rate at the last step, ramped linearly from --F (default: the preset's; tutorial: none, "
                 "F held)",
        "k_end": "kill rate at the last step, ramped linearly from --k (default: the preset's; tutorial: none, "
                 "k held)",
        "dt": "time step", "steps": "number of steps",
        "plotgap": "write every this many steps", "noise": "amplitude of the uniform noise on U",
        "seed": "noise seed (same seed, same field for any number of ranks)", **OUTPUT_HELP,
    }
    add_settings_flags(p, GrayScottSettings, helps, unset=RATES)
    ns = p.parse_args(argv)
    given = {f.name: getattr(ns, f.name) for f in fields(GrayScottSettings)}
    rates = {name: given[name] if given[name] is not None else PRESETS[ns.preset][name] for name in RATES}
    settings = GrayScottSettings(**{**given, **rates})
    return checked(settings, ranks, memory_bytes, BLOCK_ARRAYS, refuse)


def main(argv: list[str] | None = None) -> int:
    return run_command("gray-scott", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
