"""The heat mini-app (moving sources): physics against a plain numpy model, the orbits, the same field for
any number of ranks, a surface that moves, merges and splits, its BP output replayed by ``insitu replay``,
and its input checks."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import adios2
import numpy as np
import pytest
from mpi4py import MPI
from scipy import ndimage
from conftest import TINY, insitu, launch, read_all, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sims"))
SIMS_ENV = {**subprocess_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'sims'}"}

from insitu_sims.heat import Heat, HeatSettings, parse_args, run, source_positions  # noqa: E402


def numpy_reference(s: HeatSettings, steps: int) -> np.ndarray:
    """The model on one periodic array with np.roll, the sources' Gaussians untruncated."""
    L = s.L
    T = np.zeros((L, L, L))
    z, y, x = np.mgrid[0:L, 0:L, 0:L].astype(float)
    for n in range(steps):
        lap = sum(np.roll(T, sh, ax) for ax in range(3) for sh in (-1, 1)) - 6.0 * T
        heat = sum(np.exp(-((x - px) ** 2 + (y - py) ** 2 + (z - pz) ** 2) / (2 * s.sigma ** 2))
                   for px, py, pz in source_positions(s, n * s.dt))
        T = T + s.dt * (s.kappa * lap - s.cooling * T + s.heating * heat)
    return T


def test_one_rank_matches_a_plain_numpy_model():
    s = HeatSettings(L=16, width=1.0, period=40.0, engine="none")
    sim = Heat(s, MPI.COMM_SELF)
    assert sim.T.shape == (16, 16, 16) and sim.start == (0, 0, 0) and not sim.T.any()
    for _ in range(30):
        sim.step()
    want = numpy_reference(s, 30)
    # the mini-app evaluates each Gaussian within 4 widths (exp(-8) of its peak beyond)
    np.testing.assert_allclose(sim.T, want, rtol=0, atol=30 * s.heating * np.exp(-8.0))
    assert sim.T.max() > 0.1 and sim.time == 30.0


def test_pairs_of_sources_meet_twice_an_orbit_and_stay_off_the_faces():
    s = HeatSettings(L=64, sources=5, period=400.0)
    start = source_positions(s, 0.0)
    assert start.shape == (5, 3)
    np.testing.assert_allclose(np.linalg.norm(start[0] - start[1]), 0.5 * 64)       # opposite on their circle
    np.testing.assert_allclose(source_positions(s, 100.0)[0], source_positions(s, 100.0)[1], atol=1e-9)
    np.testing.assert_allclose(source_positions(s, 300.0)[0], source_positions(s, 300.0)[1], atol=1e-9)
    np.testing.assert_allclose(source_positions(s, 150.0)[2], source_positions(s, 150.0)[3], atol=1e-9)
    assert np.linalg.norm(source_positions(s, 100.0)[2] - source_positions(s, 100.0)[3]) > 10   # slower pair
    every = np.concatenate([source_positions(s, t) for t in np.linspace(0, 1200, 97)])
    assert every.min() >= 64 / 4 - 1 and every.max() <= 3 * 64 / 4


def test_the_surface_grows_moves_merges_and_splits():
    masks = []

    def keep(step, time, fields, global_shape, start):
        masks.append(fields["T"] > 0.5)

    stats = run(HeatSettings(L=24, period=400.0, steps=400, plotgap=20, engine="none"), MPI.COMM_SELF, keep)
    assert stats.outputs == 20 and len(masks) == 20
    volumes = [int(m.sum()) for m in masks]
    pieces = [ndimage.label(m)[1] for m in masks]
    assert volumes[0] > 0 and max(volumes[:5]) > 2 * volumes[0]                      # grows from the sources
    assert all((a != b).sum() > 0.1 * min(a.sum(), b.sum()) for a, b in zip(masks, masks[1:]))   # moves
    apart = pieces.index(2)
    merged = pieces.index(1, apart)                                                    # the pair meets...
    assert max(pieces[merged:]) >= 2, pieces                                           # ...and parts again


@pytest.fixture(scope="module")
def heat_bp(tmp_path_factory) -> Path:
    """The same run written by 1 rank and by 2 ranks (gathered to rank 0, or each its block)."""
    tmp = tmp_path_factory.mktemp("heat")
    args = ["--L", "24", "--steps", "40", "--plotgap", "20", "--period", "160"]
    one = launch([sys.executable, "-m", "insitu_sims.heat", *args, "--output", "one.bp"], cwd=tmp, env=SIMS_ENV,
                 timeout=60)
    assert one.returncode == 0, one.stderr
    assert "heat L=24 ranks=1 steps=40 engine=BP5" in one.stdout
    two = launch([sys.executable, "-m", "insitu_sims.heat", *args, "--output", "two.bp"], ranks=2, cwd=tmp,
                 env=SIMS_ENV, timeout=60)
    assert two.returncode == 0 and "ranks=2" in two.stdout, two.stderr
    return tmp


@pytest.mark.mpi
def test_one_and_two_ranks_write_the_same_steps(heat_bp):
    s1, t1, one = read_all(heat_bp / "one.bp", "T")
    s2, t2, two = read_all(heat_bp / "two.bp", "T")
    assert s1 == s2 == [20, 40] and t1 == t2 == [20.0, 40.0] and one.shape == (2, 24, 24, 24)
    np.testing.assert_array_equal(one, two)
    assert one[0].max() > 0.5 and not np.array_equal(one[0] > 0.5, one[1] > 0.5)
    with adios2.FileReader(str(heat_bp / "two.bp")) as f:
        assert list(f.read_attribute("origin")) == [0.0, 0.0, 0.0]
        assert list(f.read_attribute("spacing")) == [1.0, 1.0, 1.0]


def test_insitu_replay_trains_every_step(heat_bp, tmp_path):
    """``insitu replay`` reads the file as it reads the Gray-Scott mini-app's."""
    r = insitu("replay", heat_bp / "one.bp", "--var", "T", "--iso", "0.5", *TINY, "--set", "series.warm_iterations=2",
               "--out", "out", cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == ["step_000020", "step_000040"]
    assert "done: 2 step(s) trained" in r.stdout


def test_settings_are_checked_up_front(capsys):
    with pytest.raises(ValueError, match=r"kappa: expected kappa \* dt in \[0, 1/6\]"):
        HeatSettings(kappa=0.2).validate()
    with pytest.raises(ValueError, match="sources: expected an integer from 1 to 8"):
        HeatSettings(sources=0).validate()
    with pytest.raises(ValueError, match="width: expected a width in cells from 0"):
        HeatSettings(L=32, width=3.0).validate()
    with pytest.raises(ValueError, match="engine: expected one of BP5, BP4, SST, none, got 'HDF5'"):
        HeatSettings(engine="HDF5").validate()
    with pytest.raises(SystemExit):
        parse_args(["--L", "4"])
    assert "L: expected an integer >= 8" in capsys.readouterr().err
    s = parse_args(["--L", "20", "--sources", "4", "--engine", "SST", "--sst-readers", "2"])
    assert (s.L, s.sources, s.engine, s.sst_readers, s.sigma) == (20, 4, "SST", 2, 20 / 24)


@pytest.mark.parametrize("args, message", [
    (["--kappa", "0.5", "--engine", "none"], "error: kappa: expected kappa * dt in [0, 1/6]"),
    (["--L", "100000"], "and the whole grid gathered on rank 0 to be written"),
    (["--sources", "9"], "error: sources: expected an integer from 1 to 8"),
])
def test_the_command_refuses_with_one_line(tmp_path, args, message):
    r = launch([sys.executable, "-m", "insitu_sims.heat", *args], cwd=tmp_path, env=SIMS_ENV, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_names_every_setting(tmp_path):
    r = launch([sys.executable, "-m", "insitu_sims.heat", "--help"], cwd=tmp_path, env=SIMS_ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--L", "--kappa", "--cooling", "--sources", "--width", "--power", "--period", "--plotgap",
                 "--engine", "--sst-readers"):
        assert flag in r.stdout
    assert "usage: python -m insitu_sims.heat" in r.stdout
