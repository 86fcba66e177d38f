"""Degenerate settings and training that diverges to NaN/Inf: views and scale floors that cannot work are
refused up front, in one line; a step whose training diverges is stopped with its reason in metrics.csv,
writes no model, ends ``insitu run`` with exit 2 and one line, and the next step of a series starts cold."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, insitu, run_mpi, uint8_ball
from insitu.config import Config, load_config
from insitu.errors import ConfigError, InputError, TrainingDiverged
from insitu.groundtruth.views import step_views
from insitu.output.export import StepWriter
from insitu.output.files import read_csv
from insitu.step.driver import StepDriver
from insitu.surface.gaussians import Gaussians
from insitu.step.loop import check_finite
from insitu.step.pipeline import run_step
from insitu.volume import whole_block

SETTINGS = [*TINY, "--set", "views.held_out=0"]
DIVERGING = {"lr_scales": 1e30}         # the first step sends every log scale to +-1e30: exp() overflows


# ------------------------------------------------------------------------------------------ settings

@pytest.mark.parametrize("overrides, message", [
    ({"views.fov_deg": 1e-9}, r"^views\.fov_deg: expected a field of view in \[1, 170\] degrees .* got 1e-09$"),
    ({"views.fov_deg": 0.5}, r"^views\.fov_deg: expected a field of view in \[1, 170\] degrees .* got 0\.5$"),
    ({"views.fov_deg": 175}, r"^views\.fov_deg: expected a field of view in \[1, 170\] degrees .* got 175$"),
    ({"views.closeup_factors": [2, 1e9]}, r"^views\.closeup_factors: expected one or more factors in \[1, 100\]"),
    ({"train.min_scale_px": 1e9}, r"^train\.min_scale_px: expected at most views\.resolution / 6 = 42\.6667 pixels"),
    ({"train.min_scale_px": 5, "views.resolution": 24},
     r"^train\.min_scale_px: expected at most views\.resolution / 6 = 4 pixels .* got 5$"),
], ids=["fov 1e-9", "fov 0.5", "fov 175", "closeup 1e9", "min_scale_px 1e9", "min_scale_px over res/6"])
def test_degenerate_view_and_scale_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)


def test_the_bounds_themselves_are_accepted():
    for overrides in ({"views.fov_deg": 1}, {"views.fov_deg": 170}, {"views.closeup_factors": [1, 100]},
                      {"train.min_scale_px": 4, "views.resolution": 24}):
        load_config(None, overrides)


def test_a_flag_is_the_resolution_a_set_scale_floor_is_checked_against(tmp_path):
    # the CLI checks the --set values over the flags: 10 px fits 64 pixels (the flag), not 24 (--set alone)
    from insitu.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "x.raw", "--iso", "1", "--resolution", "64", "--set",
                                      "train.min_scale_px=10", "--set", "views.resolution=24"])
    with pytest.raises(ConfigError, match=r"views\.resolution / 6 = 4 pixels"):
        config_from_args(args)                  # --set views.resolution=24 is checked, as a flag hides it
    args = build_parser().parse_args(["run", "x.raw", "--iso", "1", "--resolution", "64", "--set",
                                      "train.min_scale_px=10"])
    assert config_from_args(args).train.min_scale_px == 10


def test_cameras_whose_pixels_float32_cannot_resolve_are_refused_naming_the_settings():
    near = dict(count=8, resolution=64, closeups=2, closeup_factors=[2.0, 3.0], held_out=2)
    lo = np.zeros(3)
    step_views(lo, lo + 11, **near, targets=np.full((4, 3), 5.0))                 # data near 0: fine
    far = np.full(3, 1e7)                       # the same box 1e7 units off: float32 steps of 1, pixels of 0.3
    with pytest.raises(InputError, match=r"^views: a pixel of the orbit's cameras spans [\d.]+ world units .* "
                                         r"lower views\.resolution \(64\), or give the data coordinates nearer 0 "
                                         r"\(input\.origin\)$"):
        step_views(far, far + 11, **near, targets=np.full((4, 3), 1e7 + 5))
    off = np.full(3, 1e4)                       # the orbit resolves, the close-ups 100 times closer do not
    step_views(off, off + 11, **{**near, "closeup_factors": [2.0]}, targets=np.full((4, 3), 1e4 + 5))
    with pytest.raises(InputError, match=r"the close-ups 100 times closer .* or views\.closeup_factors,"):
        step_views(off, off + 11, **{**near, "closeup_factors": [100.0]}, targets=np.full((4, 3), 1e4 + 5))


# ------------------------------------------------------------------------------------------ detection

def shard(n: int = 5) -> Gaussians:
    return Gaussians(torch.zeros(n, 3), torch.zeros(n, 3), torch.ones(n, 4), torch.zeros(n),
                     torch.zeros(n, 1, 3), torch.zeros(n, 3, 3))


class Solo:                                     # one process: check_finite agrees with nobody
    size, mpi = 1, None


def test_non_finite_parameters_are_named_with_where_training_stood():
    check_finite(shard().tensors(), Solo(), "after iteration 3 of 9")          # finite: nothing raised
    g = shard()
    g.log_scales[2, 1] = float("inf")
    g.shN[4, 0, 2] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"^training diverged: non-finite Gaussian scales, colours after "
                                               r"iteration 3 of 9; check the learning rates \(train\.lr_\*\)"):
        check_finite(g.tensors(), Solo(), "after iteration 3 of 9")
    assert issubclass(TrainingDiverged, InputError)     # bad settings for this input: exit 2, the step recorded


@pytest.mark.mpi
def test_ranks_agree_when_one_ranks_shard_diverged():
    out = run_mpi(2, "nonfinite_worker.py")
    assert out.returncode == 0, out.stdout
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0: training diverged: non-finite Gaussian means after iteration 7 of 8 on rank(s) 1",
                     "rank 1: training diverged: non-finite Gaussian means after iteration 7 of 8 on rank(s) 1"], \
        out.stdout


def test_insitu_run_that_diverges_exits_2_with_one_line_and_records_the_step(tmp_path):
    uint8_ball().tofile(tmp_path / "ball_12x12x12_uint8.raw")
    r = insitu("run", tmp_path / "ball_12x12x12_uint8.raw", "--iso", "160", *SETTINGS, "--set", "train.lr_scales=1e30",
               "--out", "out", cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    line, = r.stderr.splitlines()
    assert line.startswith("insitu: error: training diverged: non-finite Gaussian ") and "train.lr_*" in line, line
    assert "after iteration 2 of 2" in line
    out = tmp_path / "out"
    assert not list(out.rglob("*.ply")) and not list(out.glob("step_*"))
    row, = read_csv(out / "metrics.csv")
    assert (row["step"], row["status"]) == ("0", "failed")
    assert row["reason"] == line.removeprefix("insitu: error: ")


# ------------------------------------------------------------------------------------------ a series

def series_config(out: Path) -> Config:
    cfg = load_config(None, {"input.iso": [160.0], "views.count": 8, "views.resolution": 16,
                             "views.supersample": 1, "views.held_out": 0, "seeds.budget": 100,
                             "train.iterations": 3, "run.backend": "torch", "run.progress": False,
                             "series.warm_iterations": 2, "series.warm_start": True, "train.color_model": "sh",
                             "views.closeups": 0,
                             "output.images": 0, "output.ply_metrics": False, "output.dir": str(out)})
    return cfg


def test_a_series_records_the_diverged_step_and_trains_the_next_one_cold(comm, tmp_path):
    cfg = series_config(tmp_path / "out")
    writer = StepWriter(tmp_path / "out")
    calls = []

    def process(block, cfg, comm, *, step, warm, iterations, **kw):
        """The pipeline's step; step 1 with a learning rate that makes it diverge."""
        calls.append((step, warm is not None, iterations))
        if step == 1:
            cfg = replace(cfg, train=replace(cfg.train, **DIVERGING))
        return run_step(block, cfg, comm, step=step, warm=warm, iterations=iterations, **kw)

    driver = StepDriver(cfg, comm, writer, process=process)
    block = whole_block(uint8_ball().astype(np.float32))
    driver.trained(driver.train(block, step=0, time=0.0))
    with pytest.raises(TrainingDiverged) as info:
        driver.train(block, step=1, time=1.0)
    writer.record(1, "failed", str(info.value))
    result = driver.train(block, step=2, time=2.0)
    driver.trained(result)
    # step 1 started warm from step 0 (2 iterations); step 2 cold, from seeds, for train.iterations
    assert calls == [(0, False, None), (1, True, 2), (2, False, None)]
    assert result.metrics["iterations"] == 3
    assert all(torch.isfinite(t).all() for t in result.gaussians.tensors().values())
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000000", "step_000002"]
    assert (out / "step_000002" / "model.ply").is_file()
    rows = {r["step"]: (r["status"], r["reason"]) for r in read_csv(out / "metrics.csv")}
    assert rows["0"] == ("trained", "") and rows["2"] == ("trained", "")
    assert rows["1"][0] == "failed" and rows["1"][1].startswith("training diverged: non-finite Gaussian ")
