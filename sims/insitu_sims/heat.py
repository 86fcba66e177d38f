"""3D heat equation with moving sources: a mini-app on mpi4py, writing through ADIOS2.

A temperature ``T`` on a periodic ``L^3`` grid (cells of side 1), heated by Gaussian sources that move on
circular orbits and cooled towards 0::

    dT/dt = kappa lap(T) - cooling T + power sum_i exp(-|x - p_i(t)|^2 / (2 width^2))

with ``lap`` the 7-point Laplacian (``sum of the 6 neighbours - 6 T``), explicit Euler steps of ``dt``
(stable for ``kappa dt <= 1/6``) and ``T = 0`` at the start. The sources come in pairs: the two of a
pair run in opposite directions on one circle about the grid's centre, so they meet twice an orbit;
pair ``p`` orbits at radius ``(0.25 - 0.05 p) L`` in the plane turned by ``60 p`` degrees about x, once
in ``period (1 + p / 2)`` steps (an odd count leaves the last source without its partner). The
isosurfaces of T (``--iso`` about 0.5 with the defaults, where T peaks near 1.5) therefore
grow from nothing, move with their sources, trail behind them, merge where two sources meet and split
where they part. Each source's Gaussian is evaluated within 4 widths of it, and the orbits keep the
sources at least ``L / 4`` from the faces (the width is at most ``L / 16``), so the sources themselves do
not wrap.

The grid is split over the ranks as the Gray-Scott mini-app splits it (:mod:`insitu_sims.grid`); the
field is a function of the global indices only, so any number of ranks gives the same field. Every
``plotgap`` steps ``T`` is written through BP5, BP4 or SST as the Gray-Scott mini-app writes ``U`` and
``V`` (a global ``(L, L, L)`` float64 array, C order ``[z, y, x]``, the scalars ``step`` and ``time``,
the attributes ``origin`` and ``spacing``), so ``insitu replay`` and ``insitu stream`` read it alike.

This module is a standalone simulation and does not import ``insitu``.

    python -m insitu_sims.heat --L 64 --steps 1000 --plotgap 50 --output heat.bp
    insitu replay heat.bp --var T --iso 0.5 --out heat_out
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np
from mpi4py import MPI

from insitu_sims.grid import (OUTPUT_HELP, CartesianSplit, RunStats, add_settings_flags, checked,
                              check_output, face_bytes, largest_block, run_command, run_steps)

Consumer = Callable[[int, float, dict, tuple, tuple], None]

L_MIN = 8           # the default width, L / 24, is then a third of a cell: below, a source is a point between samples
SOURCES_MAX = 8     # four pairs: pair 3 orbits at 0.1 L; a fifth would orbit at 0.05 L, about the centre
REACH = 4.0         # widths: each source's Gaussian is evaluated within this distance (exp(-8) beyond)


@dataclass
class HeatSettings:
    """Parameters of one run.

    kappa:    diffusivity, cells^2 per unit of time; ``kappa * dt`` at most 1/6 (explicit Euler).
    cooling:  rate at which T relaxes to 0, per unit of time; ``cooling * dt`` below 1.
    sources:  how many moving sources (1 to ``SOURCES_MAX``).
    width:    the sources' Gaussian width in cells; 0: ``L / 24``.
    power:    heating at a source's centre per unit of time; 0: ``1 / (8 width)``, with which T peaks near 1.5
              along a lone source's path (near 2 where two meet) for L from 32 to 128 with the defaults.
    period:   time of the first pair's orbit (the others' are longer).
    engine, output, sst_*: as in :class:`insitu_sims.gray_scott.GrayScottSettings`.
    """

    L: int = 64
    kappa: float = 0.1
    cooling: float = 0.005
    sources: int = 3
    width: float = 0.0
    power: float = 0.0
    period: float = 1000.0
    dt: float = 1.0
    steps: int = 1000
    plotgap: int = 10
    output: str = "heat.bp"
    engine: str = "BP5"
    sst_readers: int = 1
    sst_queue_limit: int = 1
    sst_policy: str = "Block"
    sst_open_timeout_s: float = 60.0

    @property
    def sigma(self) -> float:
        """The sources' width in cells."""
        return self.width if self.width > 0 else self.L / 24.0

    @property
    def heating(self) -> float:
        """The heating at a source's centre per unit of time."""
        return self.power if self.power > 0 else 1.0 / (8.0 * self.sigma)

    def validate(self) -> "HeatSettings":
        if not isinstance(self.L, int) or self.L < L_MIN:
            raise ValueError(f"L: expected an integer >= {L_MIN} (the sources' default width is L / 24 cells), "
                             f"got {self.L!r}")
        if self.steps < 0:
            raise ValueError(f"steps: expected >= 0, got {self.steps}")
        if self.plotgap < 1:
            raise ValueError(f"plotgap: expected >= 1, got {self.plotgap}")
        if not self.dt > 0:
            raise ValueError(f"dt: expected > 0, got {self.dt}")
        if not 0 <= self.kappa * self.dt <= 1 / 6:
            raise ValueError(f"kappa: expected kappa * dt in [0, 1/6] (explicit Euler of the 7-point Laplacian is "
                             f"unstable beyond), got kappa {self.kappa} with dt {self.dt}")
        if not 0 <= self.cooling * self.dt < 1:
            raise ValueError(f"cooling: expected cooling * dt in [0, 1), got cooling {self.cooling} with dt {self.dt}")
        if not isinstance(self.sources, int) or not 1 <= self.sources <= SOURCES_MAX:
            raise ValueError(f"sources: expected an integer from 1 to {SOURCES_MAX} (pairs on circles of radius "
                             f"0.25 L, 0.2 L, ...), got {self.sources!r}")
        if not 0 <= self.width <= self.L / 16:
            raise ValueError(f"width: expected a width in cells from 0 (L / 24) to L / 16 = {self.L / 16:g} (a "
                             f"wider source would reach past the faces), got {self.width}")
        if not self.power >= 0:
            raise ValueError(f"power: expected >= 0 (0: 1 / (8 width)), got {self.power}")
        if not self.period > 0:
            raise ValueError(f"period: expected > 0, got {self.period}")
        check_output(self)
        return self


def source_positions(settings: HeatSettings, t: float) -> np.ndarray:
    """``[sources, 3]`` positions (x, y, z, in cells) of the sources at time ``t``."""
    L, c = settings.L, (settings.L - 1) / 2.0
    out = np.empty((settings.sources, 3))
    for i in range(settings.sources):
        pair, partner = divmod(i, 2)
        radius = (0.25 - 0.05 * pair) * L
        turn = math.radians(60.0 * pair)
        angle = 2.0 * math.pi * t / (settings.period * (1.0 + 0.5 * pair))
        angle = math.pi - angle if partner else angle
        u, v = radius * math.cos(angle), radius * math.sin(angle)       # in the pair's plane
        out[i] = (c + u, c + v * math.cos(turn), c + v * math.sin(turn))
    return out


BLOCK_ARRAYS = 1 + 2 + 1                 # of 8-byte values: T with its ghost layer, 2 work arrays, a copy of an output


def memory_bytes(settings: HeatSettings, ranks: int, gathered: bool = False) -> int:
    """Bytes that the largest rank's part of a run on ``ranks`` ranks holds at once (as :class:`Heat` and
    :func:`run` allocate them); ``gathered``: rank 0 also receives the whole grid to write it (a serial
    ADIOS2: a receive buffer and T whole)."""
    L = settings.L
    nx, ny, nz = largest_block(L, ranks)
    ghosts = (nx + 2) * (ny + 2) * (nz + 2)
    return 8 * (ghosts + (BLOCK_ARRAYS - 1) * nx * ny * nz + (2 * L ** 3 if gathered else 0)) + face_bytes(L, ranks)


class Heat:
    """One rank's piece of the periodic grid.

    T:             [nz, ny, nx] float64 copy of the samples this rank owns (no ghosts).
    start:         global index (x, y, z) of ``T[0, 0, 0]``.
    global_shape:  (L, L, L) as (x, y, z).
    """

    def __init__(self, settings: HeatSettings, comm: MPI.Comm = MPI.COMM_WORLD):
        self.settings = settings.validate()
        L = settings.L
        self._grid = CartesianSplit(L, comm)
        self.start, self.count = self._grid.start, self._grid.count
        self.global_shape = (L, L, L)
        self.step_count = 0
        nx, ny, nz = self.count
        self._T = np.zeros((nz + 2, ny + 2, nx + 2))
        self._lap = np.empty((nz, ny, nx))
        self._heat = np.empty((nz, ny, nx))
        self._bufs = self._grid.face_buffers()
        # the global coordinates (cells) of the owned samples, per axis
        self._axes = [np.arange(s, s + n, dtype=np.float64) for s, n in zip(self.start, self.count)]

    @property
    def T(self) -> np.ndarray:
        return self._T[1:-1, 1:-1, 1:-1].copy()

    @property
    def time(self) -> float:
        return self.step_count * self.settings.dt

    def _sources(self, out: np.ndarray) -> np.ndarray:
        """The sources' heating at the time this step starts, into ``out`` ([nz, ny, nx]): each Gaussian as
        the product of its three 1D factors, evaluated within ``REACH`` widths of its centre."""
        s = self.settings
        out.fill(0.0)
        sigma = s.sigma
        for p in source_positions(s, self.time):
            box = []
            for axis, centre in zip(self._axes, p):
                lo, hi = np.searchsorted(axis, (centre - REACH * sigma, centre + REACH * sigma))
                box.append((lo, hi, np.exp(-0.5 * ((axis[lo:hi] - centre) / sigma) ** 2)))
            (x0, x1, gx), (y0, y1, gy), (z0, z1, gz) = box
            if x1 > x0 and y1 > y0 and z1 > z0:
                out[z0:z1, y0:y1, x0:x1] += gz[:, None, None] * gy[None, :, None] * gx[None, None, :]
        out *= s.heating
        return out

    def step(self) -> None:
        """Advance one time step (collective: every rank must call it)."""
        s = self.settings
        a = self._T
        self._grid.exchange(a, self._bufs)
        lap = self._lap
        np.add(a[:-2, 1:-1, 1:-1], a[2:, 1:-1, 1:-1], out=lap)
        lap += a[1:-1, :-2, 1:-1]
        lap += a[1:-1, 2:, 1:-1]
        lap += a[1:-1, 1:-1, :-2]
        lap += a[1:-1, 1:-1, 2:]
        centre = a[1:-1, 1:-1, 1:-1]
        heat = self._sources(self._heat)
        lap *= s.kappa
        heat -= (6.0 * s.kappa + s.cooling) * centre      # (one temporary: the centre's terms together)
        lap += heat
        lap *= s.dt
        centre += lap
        self.step_count += 1




def run(settings: HeatSettings, comm: MPI.Comm = MPI.COMM_WORLD, consumer: Consumer | None = None) -> RunStats:
    """Run ``settings.steps`` steps; every ``plotgap`` steps (and at the last) write and/or call ``consumer``.

    consumer: called on every rank as ``consumer(step, time, {"T": T}, global_shape, start)`` with T the
              [nz, ny, nx] owned samples, global_shape and start as (x, y, z).
    Returns the run's RunStats (rank 0's timings, broadcast).
    """
    sim = Heat(settings, comm)
    return run_steps(sim, settings, comm, ("T",), "heat", lambda s: {"T": s.T}, consumer)


def parse_args(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_SELF) -> HeatSettings:
    """The settings of the command line ``argv``, checked for a run on the ranks of ``comm``: a value out of
    range, a grid that cannot be split over the ranks or does not fit this machine's memory ends the process
    with one line (from rank 0) and exit code 2."""
    ranks = comm.Get_size()

    def refuse(text: str) -> None:
        p.exit(2, f"{p.prog}: error: {text}\n" if comm.Get_rank() == 0 else None)

    p = argparse.ArgumentParser(
        prog="python -m insitu_sims.heat",
        description="3D heat equation with sources moving on circular orbits, on MPI, written through ADIOS2: "
                    "isosurfaces of T that grow, move, merge and split (with the defaults: insitu replay FILE "
                    "--var T --iso 0.5).")
    helps = {
        "L": "grid size (L^3 samples)",
        "kappa": "diffusivity, cells^2 per unit of time (kappa * dt <= 1/6)",
        "cooling": "relaxation rate of T towards 0",
        "sources": f"moving sources, 1 to {SOURCES_MAX}, in pairs that meet twice an orbit",
        "width": "the sources' Gaussian width in cells (0: L / 24)",
        "power": "heating at a source's centre per unit of time (0: 1 / (8 width), T then peaks near 1.5)",
        "period": "time of the first pair's orbit",
        "dt": "time step", "steps": "number of steps", "plotgap": "write every this many steps", **OUTPUT_HELP,
    }
    add_settings_flags(p, HeatSettings, helps)
    ns = p.parse_args(argv)
    settings = HeatSettings(**{f.name: getattr(ns, f.name) for f in fields(HeatSettings)})
    return checked(settings, ranks, memory_bytes, BLOCK_ARRAYS, refuse)


def main(argv: list[str] | None = None) -> int:
    return run_command("heat", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
