"""The Gray-Scott mini-app's ramped feed and kill rates and its ``breakup`` preset: the rates of each step,
the command line's presets and overrides, and a labyrinth that tears into separate spots."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from scipy import ndimage

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sims"))

from insitu_sims.gray_scott import PRESETS, GrayScott, GrayScottSettings, parse_args  # noqa: E402


def test_the_rates_ramp_linearly_over_the_run():
    s = GrayScottSettings(**PRESETS["breakup"], steps=200)
    assert s.rates(0) == (0.02, 0.048)
    np.testing.assert_allclose(s.rates(100), (0.025, 0.055))
    np.testing.assert_allclose(s.rates(200), (0.03, 0.062))
    held = GrayScottSettings(F=0.03, k=0.06, steps=200)
    assert held.rates(0) == held.rates(150) == (0.03, 0.06)
    with pytest.raises(ValueError, match=r"F_end, k_end: expected >= 0 \(or not given: held at F, k\)"):
        GrayScottSettings(k_end=-0.01).validate()


def test_presets_and_the_flags_that_override_them():
    s = parse_args(["--engine", "none"])
    assert (s.F, s.k, s.F_end, s.k_end) == (0.02, 0.048, None, None)
    s = parse_args(["--preset", "breakup", "--engine", "none"])
    assert (s.F, s.k, s.F_end, s.k_end) == (0.02, 0.048, 0.03, 0.062)
    s = parse_args(["--preset", "breakup", "--k-end", "0.07", "--F", "0.022", "--engine", "none"])
    assert (s.F, s.k, s.F_end, s.k_end) == (0.022, 0.048, 0.03, 0.07)
    s = parse_args(["--k", "0.05", "--engine", "none"])
    assert (s.F, s.k, s.F_end, s.k_end) == (0.02, 0.05, None, None)


def largest_piece(v: np.ndarray, iso: float = 0.3) -> float:
    """The share of the cells over ``iso`` that the largest connected piece holds."""
    labels, n = ndimage.label(v > iso)
    sizes = np.bincount(labels.ravel())[1:]
    return float(sizes.max() / sizes.sum())


def test_breakup_tears_the_labyrinth_into_spots():
    """Two runs of the same noise: the tutorial's held rates keep V > 0.3 one connected labyrinth, the ramp
    to the spots regime tears it into separate pieces by two thirds of the run."""
    shares = {}
    for name in ("tutorial", "breakup"):
        sim = GrayScott(GrayScottSettings(**PRESETS[name], L=32, steps=600, engine="none"), MPI.COMM_SELF)
        for _ in range(400):
            sim.step()
        shares[name] = largest_piece(sim.v)
    assert shares["tutorial"] > 0.8 and shares["breakup"] < 0.5, shares
