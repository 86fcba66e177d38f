"""A field's unit does not change its model: a grid in any unit (cells from 1e-12 to 1e12, an origin far
from 0) trains the model of the grid in index units, up to the unit, through the library, model.ply and
the command line; origins and spacings that float32 coordinates cannot hold are refused at every entry
(configuration, ``--spacing``, a BP file's attributes, the Adaptor) with one line naming the input."""
from __future__ import annotations

import argparse
import json
import math
import re

import numpy as np
import pytest
import torch
from conftest import TINY, insitu, one_error, sphere_field, tiny_config

from bp_layouts import write_bp
from insitu.config import load_config
from insitu.errors import ConfigError, InputError, SourceInputError
from insitu.groundtruth.views import orbit_views
from insitu.input.sources import BPSource
from insitu.output.export import StepWriter
from insitu.output.ply import read_ply
from insitu.run.runner import check_input
from insitu.step.pipeline import compute_step, write_step
from insitu.surface.gaussians import Gaussians
from insitu.volume import Frame, check_geometry, whole_block

# the command line's settings: tiny, one view of each held-out set off the orbit, model.ply as trained
SETTINGS = [*TINY, "--set", "views.held_out=1", "--set", "output.ply_refine=0", "--set", "seeds.color_views=2"]
# the library's step: as small, the grid's surface a sphere of radius 4 (sphere_field(12) in cells)
SMALL = dict(iso=4.0, views=8, resolution=16, held_out=1, budget=100, images=1, iterations=4)
F64 = np.float64


def assert_same_model_up_to_the_unit(got: Gaussians, want: Gaussians, origin, scale: float) -> None:
    """``got`` (world units) is ``want`` (index units) moved to ``origin`` and scaled by ``scale``."""
    expected = torch.as_tensor(origin, dtype=torch.float64) + scale * want.means.double()
    rounding = 2.0 ** -23 * float(expected.abs().max())          # float32's, of the world coordinates
    assert float((got.means.double() - expected).abs().max()) <= rounding
    torch.testing.assert_close(got.log_scales, want.log_scales + math.log(scale), atol=1e-5, rtol=0)
    for name in ("quats", "opacity_logits", "sh0", "shN"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ the same model

@pytest.fixture(scope="module")
def index_units(comm, tmp_path_factory):
    """The step in index units (origin 0, spacing 1), trained and written."""
    out = tmp_path_factory.mktemp("index")
    result = compute_step(whole_block(sphere_field(12, dtype=F64)), tiny_config(**SMALL), comm)
    write_step(result, StepWriter(out), tiny_config(**SMALL), comm)
    return result, out / "step_000000"


@pytest.mark.parametrize("spacing, shift", [
    ((1e-12,) * 3, 1e3), ((1e-4,) * 3, -750.25), ((1e12,) * 3, 1e3), ((1e-4,) * 3, 0.0)],
    ids=["1e-12 m, 1e3 cells out", "1e-4 m, -750 cells", "1e12 m, 1e3 cells out", "1e-4 m at 0"])
def test_a_grid_in_any_unit_trains_the_model_of_index_units_up_to_the_unit(comm, tmp_path, index_units,
                                                                           spacing, shift):
    want, want_dir = index_units
    s = spacing[0]
    origin = (shift * s, -0.5 * shift * s, 2.0 * shift * s)
    cfg = tiny_config(**SMALL)
    cfg.input.iso = [4.0 * s]                                   # the field in the unit too (metres from the centre)
    got = compute_step(whole_block(sphere_field(12, dtype=F64) * s, origin=origin, spacing=spacing), cfg, comm)
    assert got.frame == Frame(origin, s)
    for key in ("psnr_foreground", "ssim_foreground", "psnr", "psnr_foreground_near2", "psnr_foreground_off",
                "gaussians_initial", "gaussians"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], abs=1e-6), key
    assert got.metrics["psnr_foreground"] > 10                  # a model of the sphere, not an empty image
    assert_same_model_up_to_the_unit(got.frame.gaussians_to_world(got.gaussians), want.gaussians, origin, s)
    write_step(got, StepWriter(tmp_path), cfg, comm)
    d = tmp_path / "step_000000"
    assert_same_model_up_to_the_unit(read_ply(d / "model.ply"), read_ply(want_dir / "model.ply"), origin, s)
    # the SPZ files and the cameras in the step's frame, the same as in index units
    for name in ("model.spz", "model.lit.spz"):
        assert (d / name).read_bytes() == (want_dir / name).read_bytes(), name
    cams, want_cams = (json.loads((p / "cameras.json").read_text()) for p in (d, want_dir))
    assert cams.pop("frame") == {"origin": list(origin), "scale": s}
    assert want_cams.pop("frame") == {"origin": [0.0, 0.0, 0.0], "scale": 1.0}
    assert cams == want_cams


def test_an_anisotropic_grid_in_metres_trains_the_model_of_its_index_units(comm, index_units):
    """Cells of 1e-4 x 2e-4 x 1e-4 m: the model of cells of 1 x 2 x 1 (the frame's unit: the smallest side)."""
    want = compute_step(whole_block(sphere_field(12, dtype=F64), spacing=(1.0, 2.0, 1.0)), tiny_config(**SMALL),
                        comm)
    cfg = tiny_config(**SMALL)
    cfg.input.iso = [4e-4]
    got = compute_step(whole_block(sphere_field(12, dtype=F64) * 1e-4, origin=(0.5, 0.0, -0.5),
                                   spacing=(1e-4, 2e-4, 1e-4)), cfg, comm)
    assert got.metrics["psnr_foreground"] == pytest.approx(want.metrics["psnr_foreground"], abs=1e-6)
    assert_same_model_up_to_the_unit(got.frame.gaussians_to_world(got.gaussians), want.gaussians,
                                     (0.5, 0.0, -0.5), 1e-4)


def test_a_warm_start_follows_its_model_into_the_next_steps_frame(comm):
    """The grid moves 2 cells along x between two steps, the surface staying where it is in the world: the
    previous step's model (densified past the seed budget) is kept as where the grid did not move, not
    dropped as lying 2 cells off the surface (as it would read in the new frame without being moved into it)."""
    cfg = tiny_config(**{**SMALL, "iterations": 8}, densify=dict(start=2, every=3, stop=7, grad_threshold=0.0))
    cfg.input.iso = [4e-4]
    s = 1e-4
    first = compute_step(whole_block(sphere_field(14, dtype=F64) * s, spacing=(s,) * 3), cfg, comm)
    assert first.metrics["gaussians"] > cfg.seeds.budget
    still = compute_step(whole_block(sphere_field(14, dtype=F64) * s, spacing=(s,) * 3), cfg, comm, warm=first,
                         iterations=1)
    moved = sphere_field(14, centre=(6.5 - 2.0, 6.5, 6.5), dtype=F64) * s   # the same world sphere, 2 cells further
    second = compute_step(whole_block(moved, origin=(2 * s, 0.0, 0.0), spacing=(s,) * 3), cfg, comm,
                          warm=first, iterations=1)
    assert second.frame == Frame((2 * s, 0.0, 0.0), s) != first.frame
    kept = second.metrics["gaussians_initial"]
    assert kept == pytest.approx(still.metrics["gaussians_initial"], rel=0.02) and kept > cfg.seeds.budget


def test_a_frame_maps_models_and_cameras_to_the_world_as_it_maps_points():
    a, b = Frame((0.1, -0.2, 5e-4), 1e-4), Frame((0.05, 0.025, -0.1), 3e-4)        # 2000 cells out, at most
    g = Gaussians(means=torch.rand(50, 3) * 10, log_scales=torch.randn(50, 3), quats=torch.randn(50, 4),
                  opacity_logits=torch.randn(50), sh0=torch.randn(50, 1, 3), shN=torch.zeros(50, 0, 3))
    assert a.reframe(g, a) is g
    via_b = b.gaussians_to_world(a.reframe(g, b))
    direct = a.gaussians_to_world(g)
    torch.testing.assert_close(via_b.means.double(), direct.means.double(), atol=1e-4 * 1e-4, rtol=1e-6)
    torch.testing.assert_close(via_b.log_scales, direct.log_scales, atol=1e-5, rtol=0)
    torch.testing.assert_close(direct.means.double(), torch.as_tensor(a.points_to_world(g.means.numpy())),
                               atol=1e-3 * 1e-4, rtol=1e-6)
    # every camera sees a world point at the pixel where it saw the frame's point
    views = orbit_views(np.zeros(3), np.full(3, 10.0), 4, 32)
    world = a.views_to_world(views)
    pts = g.means.double()

    def pixels(viewmats, Ks, p):
        cam = torch.einsum("nij,mj->nmi", viewmats.double()[:, :3, :3], p) + viewmats.double()[:, None, :3, 3]
        uvw = torch.einsum("nij,nmj->nmi", Ks.double(), cam)
        return uvw[..., :2] / uvw[..., 2:]

    torch.testing.assert_close(pixels(world.viewmats, world.Ks, torch.as_tensor(a.points_to_world(pts.numpy()))),
                               pixels(views.viewmats, views.Ks, pts), atol=1e-2, rtol=0)


def test_a_bp_file_in_metres_replays_to_the_model_of_index_units(tmp_path):
    """The field a simulation in SI units writes: a 12^3 distance field in metres (cells of 1e-4 m, an origin
    in metres), iso 4e-4 m, against the same samples in index units, through ``insitu replay``."""
    field = sphere_field(12, dtype=F64)
    origin = [-0.05, 0.02, 1.5]
    write_bp(tmp_path / "si.bp", [{"V": field * 1e-4}], attributes={"spacing": [1e-4] * 3, "origin": origin})
    write_bp(tmp_path / "index.bp", [{"V": field}])
    for name, iso in (("si", "4e-4"), ("index", "4")):
        r = insitu("replay", tmp_path / f"{name}.bp", "--var", "V", "--iso", iso, *SETTINGS, "--out", name,
                   cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    si, index = (json.loads((tmp_path / n / "step_000000" / "metrics.json").read_text()) for n in ("si", "index"))
    for key in ("psnr_foreground", "ssim_foreground", "psnr_foreground_near2", "psnr_foreground_off", "gaussians"):
        assert si[key] == pytest.approx(index[key], abs=1e-3), key
    assert index["psnr_foreground"] > 10
    got, want = (read_ply(tmp_path / n / "step_000000" / "model.ply") for n in ("si", "index"))
    assert len(got) == len(want)
    expected = torch.as_tensor(origin, dtype=torch.float64) + 1e-4 * want.means.double()
    assert float((got.means.double() - expected).abs().max()) < 1e-2 * 1e-4      # within a hundredth of a cell


# ------------------------------------------------------------------------------------------ refused

# (what is given, the words of the refusal)
REFUSED = {
    "spacing 1e-300 1 1": ({"spacing": [1e-300, 1.0, 1.0]}, r"expected 3 finite values in \[1e-15, 1e\+18\]"),
    "spacing 1e30": ({"spacing": [1e30] * 3}, r"expected 3 finite values in \[1e-15, 1e\+18\] .* got 1e\+30 "),
    "spacing 1e-300": ({"spacing": [1e-300] * 3}, r"expected 3 finite values in \[1e-15, 1e\+18\]"),
    "spacing nan": ({"spacing": [math.nan, 1.0, 1.0]}, r"finite"),
    "spacing 1e-8 1 1": ({"spacing": [1e-8, 1.0, 1.0]}, r"at most 10000 times the smallest .* got 1e-08 1 1"),
    "origin 1e30": ({"origin": [1e30] * 3}, r"world coordinates within \+-1e\+18"),
    "origin 2e6 cells": ({"origin": [2e6, 0.0, 0.0]}, r"within 2\^20 = 1048576 cells of 0 .* shift the origin"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_check_geometry_refuses_what_float32_cannot_hold_naming_the_input(case):
    given, words = REFUSED[case]
    with pytest.raises(InputError, match=r"^where: (attribute origin|attribute spacing): .*" + words):
        check_geometry(given.get("origin", (0.0, 0.0, 0.0)), given.get("spacing", (1.0, 1.0, 1.0)), (12, 12, 12),
                       names=("attribute origin", "attribute spacing"), where="where")


@pytest.mark.parametrize("spacing, origin", [
    ((1e-12,) * 3, (1e3 * 1e-12,) * 3), ((1e12,) * 3, (-1e15, 0.0, 1e15)), ((1e-15, 1e-15, 1e-11), (0.0,) * 3),
    ((1.0,) * 3, (1e6, -1e6, 0.0)), ((1e-4,) * 3, (-100.0, 3.0, 1e-3))])
def test_check_geometry_accepts_any_unit_within_the_range(spacing, origin):
    assert check_geometry(origin, spacing, (12, 12, 12)) == (origin, spacing)


@pytest.mark.parametrize("case", REFUSED)
def test_the_configuration_refuses_it_naming_the_key(case):
    given, words = REFUSED[case]
    key = next(iter(given))
    if math.isnan(given[key][0]):
        words = r"expected a finite number"                    # (YAML's .nan) refused as a value of the key
    keys = {"input.origin": [0.0] * 3, "input.spacing": [1.0] * 3, f"input.{key}": given[key]}
    with pytest.raises(ConfigError, match=rf"^input\.{key}: .*{words}"):
        load_config(None, keys)


@pytest.mark.parametrize("case", [case for case, (given, _) in REFUSED.items() if "spacing" in given])
def test_insitu_run_refuses_its_spacing_flag_before_any_work(case):
    given, words = REFUSED[case]
    args = argparse.Namespace(command="run", input="ball.npy", spacing=given["spacing"])
    with pytest.raises(ConfigError, match=rf"^--spacing: .*{words}"):
        check_input(args, load_config(None, {"input.iso": [4.0]}), None)


@pytest.mark.parametrize("case", REFUSED)
def test_a_bp_files_attribute_is_refused_naming_the_attribute(tmp_path, case):
    given, words = REFUSED[case]
    path = write_bp(tmp_path / "f.bp", [{"V": sphere_field(12, dtype=F64)}], attributes=given)
    key = next(iter(given))
    if math.isnan(given[key][0]):
        words = r"all finite"
    with pytest.raises(SourceInputError, match=rf"f\.bp: attribute {key}: .*{words}"):
        list(BPSource(str(path), "V"))


@pytest.mark.parametrize("case", REFUSED)
def test_the_adaptor_refuses_it_before_the_step_is_queued(tmp_path, case):
    from insitu.run.adaptor import Adaptor

    given, words = REFUSED[case]
    trained = []

    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        trained.append(step)
        return type("R", (), {"gaussians": None, "metrics": {}})()

    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(tmp_path)}}
    u = sphere_field(12)
    with Adaptor(None, cfg, process=process) as ad:
        with pytest.raises(InputError, match=rf"{next(iter(given))}: .*{words}"):
            ad.execute(1, 0.0, {"U": u}, (12, 12, 12), (0, 0, 0), **given)
        ad.execute(2, 0.0, {"U": u}, (12, 12, 12), (0, 0, 0), spacing=(1e-4,) * 3, origin=(0.5, 0.0, 0.0))
    assert trained == [2]


@pytest.mark.parametrize("flags, words", [
    (["--spacing", "1e-300", "1", "1"], r"--spacing: expected 3 finite values in \[1e-15, 1e\+18\]"),
    (["--spacing", "nan", "1", "1"], r"--spacing: expected 3 finite values \(x, y, z\), got nan 1 1$"),
    (["--set", "input.origin=[1e30,1e30,1e30]"], r"input\.origin: expected the grid's world coordinates within"),
], ids=["spacing 1e-300 1 1", "spacing nan", "origin 1e30"])
def test_insitu_run_says_it_in_one_line_and_exits_2(tmp_path, flags, words):
    np.save(tmp_path / "ball.npy", sphere_field(12))
    r = insitu("run", tmp_path / "ball.npy", "--iso", "4", *TINY, *flags, "--out", "out", cwd=tmp_path)
    assert re.search(words, one_error(r))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attributes, flags, words", [
    ({"spacing": [1e-300, 1.0, 1.0]}, [], r"f\.bp: attribute spacing: expected 3 finite values in \[1e-15"),
    ({"origin": [1e30] * 3}, [], r"f\.bp: attribute origin: expected the grid's world coordinates within"),
    ({}, ["--set", "input.spacing=[1e-300,1,1]"], r"input\.spacing: expected 3 finite values in \[1e-15"),
], ids=["attribute spacing", "attribute origin", "input.spacing"])
def test_insitu_replay_says_it_in_one_line_and_exits_2(tmp_path, attributes, flags, words):
    write_bp(tmp_path / "f.bp", [{"V": sphere_field(12, dtype=F64)}], attributes=attributes)
    r = insitu("replay", tmp_path / "f.bp", "--var", "V", "--iso", "4", *TINY, *flags, "--out", "out", cwd=tmp_path)
    assert re.search(words, one_error(r))
    assert not (tmp_path / "out" / "step_000000").exists()
