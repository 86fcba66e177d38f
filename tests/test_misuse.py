"""Hostile input and misuse: every case a clear error (exit 2, one line, nothing written) or the
right result. Config and source cases are called directly; command-line cases run ``python -m
insitu`` (one process, or ``mpiexec -n 2`` where ranks matter)."""
from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import adios2
import numpy as np
import pytest
from conftest import TINY, bp_with_steps, insitu, one_error, sphere_field, subprocess_env

from insitu.config import check_memory, load_config, parse_override
from insitu.errors import ConfigError
from insitu.errors import SourceInputError
from insitu.input.sources import BPSource
from insitu.output.files import read_csv


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("files")
    np.save(d / "ball.npy", sphere_field(12))
    sphere_field(12, dtype=np.uint8).tofile(d / "ball_12x12x12_uint8.raw")
    sphere_field(12, dtype=np.uint8).tofile(d / "noname.raw")
    open(d / "empty.npy", "wb").close()
    (d / "truncated.npy").write_bytes((d / "ball.npy").read_bytes()[:-100])
    (d / "text.npy").write_text("0 1 2 3\n")
    np.save(d / "object.npy", np.array([{"a": 1}] * 8, dtype=object).reshape(2, 2, 2), allow_pickle=True)
    (d / "folder.npy").mkdir()
    (d / "folder.raw").mkdir()
    (d / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (d / "nested.yaml").write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "afile").write_text("x")
    os.mkfifo(d / "fifo.npy")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i > 1 else '*a'] * 9)}]\n" for i in range(1, 10))
    (d / "aliases.yaml").write_text(bomb)        # 9 levels of 9 aliases: 9**10 values if expanded
    return d


# ------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("key, value, message", [
    ("train.lr_means", -1, r"train\.lr_means: expected a value > 0, got -1"),
    ("views.fov_deg", math.nan, r"views\.fov_deg: expected a finite number, got nan"),
    ("train.seed", -1, r"train\.seed: expected a value >= 0, got -1"),
    ("views.supersample", 64, r"views\.supersample: expected 1\.\.8 .* got 64"),
    ("train.ssim_weight", 2, r"train\.ssim_weight: expected a value in \[0, 1\], got 2"),
    ("input.iso", [0.5, math.inf], r"input\.iso: expected a finite number"),
    ("input.dtype", "foo", r"input\.dtype: expected an integer or float type .* got 'foo'"),
    ("views.resolution", 5, r"views\.resolution: expected at least 6 pixels \(the held-out SSIM's 11 x 11 window"),
    ("views.test_every", 1, r"views\.test_every: expected at least 2 .* 1 holds out every view and leaves none"),
    ("views.colormap", "jet", r"views\.colormap: expected one of viridis, gray, got 'jet'"),
    ("train.ssim_target", 2, r"train\.ssim_target: expected a value in \[0, 1\], got 2"),
    ("train.psnr_target", -5, r"train\.psnr_target: expected a value > 0, got -5"),
    ("input.iso", [0.3, 0.5, 0.3], r"input\.iso: expected distinct iso values, got 0\.3 more than once"),
    ("output.dir", "", r"output\.dir: expected a folder name, got ''"),
])
def test_out_of_range_values_are_rejected_by_validation(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {key: value})


@pytest.mark.parametrize("text, message", [
    ("train.iterations=[unclosed", r"--set 'train\.iterations=\[unclosed': not valid YAML"),
    ("train.iterations=!!python/object/apply:os.system [echo hi]", r"not valid YAML \(could not determine a constructor"),
    ("train.iterations=" + "[" * 100 + "]" * 100, r"nested 100 levels deep, expected at most 32"),
    ("views.background=[&a 0.5, *a, *a]", r"YAML aliases are not accepted in a configuration \(found \*a on line 1\)"),
])
def test_invalid_yaml_in_set_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_override(text)


@pytest.mark.parametrize("name, message", [
    ("binary.yaml", r"not a text file"),
    ("nested.yaml", r"nested 5000 levels deep"),
    ("afile/../", r"is a directory"),
    ("aliases.yaml", r"aliases\.yaml: YAML aliases are not accepted in a configuration \(found \*a on line 2\)"),
])
def test_unusable_config_files_are_config_errors(files, name, message):
    path = files if name == "afile/../" else files / name
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_the_colormaps_the_config_accepts_are_the_ray_casters():
    from insitu.config import field_choices
    from insitu.groundtruth.caster import COLORMAPS

    assert sorted(field_choices("views.colormap")) == sorted(COLORMAPS)


def test_a_target_that_is_not_set_passes_validation():
    cfg = load_config(None, {"train.ssim_target": None, "train.psnr_target": None})
    assert cfg.train.ssim_target is None and cfg.train.psnr_target is None


def test_memory_that_cannot_fit_is_refused_with_what_it_needs():
    cfg = load_config(None, {"views.resolution": 100000})
    with pytest.raises(ConfigError, match=r"need at least [\d.e+]+ GiB per rank \(ground truth .*; here has 16 GiB"):
        check_memory(cfg, 1, 16 * 2**30, "here")
    fill = load_config(None, {"seeds.budget": 10**12, "seeds.fill": True, "seeds.density": 0})
    with pytest.raises(ConfigError, match=r"gaussians [\d.e+]+ GiB"):
        check_memory(fill, 2, 16 * 2**30, "here")
    check_memory(load_config(None, {"views.resolution": 512}), 1, 16 * 2**30)      # the defaults fit


# ------------------------------------------------------------------------------------------ command line: input

def test_a_float32_npy_on_one_rank_trains(files, tmp_path):
    # the read-only memory map must not reach marching cubes
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "step_000000" / "model.ply").is_file()


@pytest.mark.parametrize("args, message", [
    (["{d}/empty.npy"], r"empty\.npy: not a readable \.npy file"),
    (["{d}/truncated.npy"], r"truncated\.npy: not a readable \.npy file of shape \(12, 12, 12\) float32"),
    (["{d}/text.npy"], r"text\.npy: not a readable \.npy file"),
    (["{d}/object.npy"], r"object\.npy: expected an array of integers or floats, got dtype object"),
    (["{d}/folder.npy"], r"folder\.npy: is a directory, expected a \.npy file"),
    (["{d}/folder.raw"], r"folder\.raw: is a directory, expected a raw volume file"),
    (["{d}/noname.raw", "--dims", "12", "12", "12"], r"noname\.raw: dtype is not given and not in the name .* give --dtype$"),
    (["{d}/ball_12x12x12_uint8.raw", "--dtype", "foo"], r"input\.dtype: expected an integer or float type"),
    (["{d}/ball.npy", "--resolution", "100000"], r"need at least [\d.e+]+ GiB per rank .* has [\d.]+ GiB"),
    (["{d}/ball.npy", "--budget", "1000000000000", "--set", "seeds.density=0", "--set", "seeds.fill=true"],
     r"gaussians [\d.e+]+ GiB"),
    (["{d}/ball.npy", "--config", "{d}"], r"config file .*: is a directory, expected a YAML file"),
    (["{d}/ball.npy", "--config", "{d}/binary.yaml"], r"binary\.yaml: not a text file"),
    (["{d}/ball.npy", "--set", "train.iterations=[unclosed"], r"not valid YAML"),
    (["{d}/ball.npy", "--set", "views.supersample=64"], r"views\.supersample: expected 1\.\.8"),
    (["{d}/ball.npy", "--resolution", "5"], r"views\.resolution: expected at least 6 pixels"),
    (["{d}/ball.npy", "--set", "views.test_every=1"], r"views\.test_every: expected at least 2"),
    (["{d}/ball.npy", "--spacing", "nan", "1", "1"], r"--spacing: expected 3 finite values \(x, y, z\), got nan 1 1$"),
    (["{d}/ball.npy", "--spacing", "inf", "1", "1"], r"--spacing: expected 3 finite values .* got inf 1 1$"),
    (["{d}/ball.npy", "--spacing", "1e30", "1", "1"], r"--spacing: expected 3 finite values .* got 1e\+30 1 1$"),
    (["{d}/ball.npy", "--spacing", "0", "1", "1"], r"--spacing: expected 3 finite values"),
    (["{d}/ball.npy", "--backend", "gsplat", "--device", "cpu"],
     r"run\.backend: gsplat needs a CUDA device, and this run trains on cpu"),
    (["{d}/ball.npy", "--set", "views.colormap=jet"], r"views\.colormap: expected one of viridis, gray, got 'jet'"),
    (["{d}/ball.npy", "--ssim-target", "2"], r"train\.ssim_target: expected a value in \[0, 1\], got 2"),
    (["{d}/ball.npy", "--psnr-target", "-5"], r"train\.psnr_target: expected a value > 0, got -5"),
    (["{d}/ball.npy", "--iso", "3", "3"], r"input\.iso: expected distinct iso values, got 3 more than once"),
    (["{d}/ball.npy", "--color-var", "C"], r"input\.color_var 'C': a \.npy file holds one field, so there is no colour"),
    (["{d}/fifo.npy"], r"fifo\.npy: is a named pipe \(FIFO\), expected a \.npy or raw volume file$"),
    (["/dev/zero"], r"/dev/zero: is a character device, expected a \.npy or raw volume file$"),
    (["{d}/ball.npy", "--config", "{d}/aliases.yaml"], r"YAML aliases are not accepted in a configuration"),
], ids=["empty npy", "truncated npy", "text npy", "object npy", "folder npy", "folder raw", "dims without dtype",
        "dtype foo", "resolution 100000", "budget 1e12 fill", "config folder", "binary config", "unclosed set",
        "supersample 64", "resolution 5", "test_every 1", "spacing nan", "spacing inf", "spacing 1e30", "spacing 0",
        "gsplat on cpu", "colormap jet", "ssim target 2", "psnr target -5", "iso twice", "color var of npy",
        "fifo input", "dev zero input", "yaml aliases"])
def test_bad_input_is_one_line_exit_2_and_no_output_folder(files, tmp_path, args, message):
    args = [a.format(d=files) for a in args]
    r = insitu("run", args[0], "--iso", "3", *TINY, *args[1:], "--out", "out", cwd=tmp_path)
    line = one_error(r)
    assert __import__("re").search(message, line), line
    assert not (tmp_path / "out").exists()           # nothing created for a run that cannot start


def test_cuda_asked_for_without_cuda_is_one_line_and_no_traceback(files, tmp_path):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--device", "cuda", "--out", "out", cwd=tmp_path,
               env={"CUDA_VISIBLE_DEVICES": ""})
    assert "run.device: 'cuda' asked for, but CUDA is not available on" in one_error(r)
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "run.device: 'cuda' asked for, but CUDA is not available on"),
    (["--backend", "gsplat", "--device", "cpu"], "run.backend: gsplat needs a CUDA device"),
], ids=["cuda without cuda", "gsplat on cpu"])
def test_a_device_or_backend_this_machine_lacks_is_one_line_on_two_ranks(files, tmp_path, flags, message):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, *flags, "--out", "out", cwd=tmp_path, ranks=2,
               timeout=180, env={"CUDA_VISIBLE_DEVICES": ""})
    assert message in one_error(r)
    assert "MPI_Abort" not in r.stderr and not (tmp_path / "out").exists()


def test_a_flag_does_not_hide_an_invalid_set_value_for_its_key(files, tmp_path):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--set", "train.iterations=abc",
               "--out", "out", cwd=tmp_path)                      # TINY gives --iterations 2
    assert "train.iterations: expected an integer, got str 'abc'" in one_error(r)


# ------------------------------------------------------------------------------------------ output folders

@pytest.mark.parametrize("out, message", [
    ("afile", r"output\.dir .*afile: is a file, expected a folder"),
    ("afile/sub", r"output\.dir .*afile/sub: .*afile is a file, so the folder cannot be created"),
])
def test_an_output_path_that_is_or_lies_under_a_file_is_refused_before_training(files, tmp_path, out, message):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--out", files / out, cwd=tmp_path)
    assert __import__("re").search(message, one_error(r))
    assert "step 0:" not in r.stdout                        # refused before any work


@pytest.mark.mpi
def test_an_output_path_under_a_file_is_refused_on_two_ranks_with_exit_2(files, tmp_path):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--out", files / "afile" / "sub", cwd=tmp_path,
               ranks=2, timeout=180)
    assert "afile is a file, so the folder cannot be created" in one_error(r)


def test_an_unwritable_output_folder_is_refused_before_training(files, tmp_path):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("this test drops root's file-permission override with setpriv; run it as root")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
            "--inh-caps", "-dac_override,-dac_read_search"]
    for out in (locked, locked / "sub"):
        r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--out", out, cwd=tmp_path, prefix=drop)
        assert f"cannot write in {locked} (Permission denied)" in one_error(r)
        assert "step 0:" not in r.stdout
    assert list(locked.iterdir()) == []


def test_reusing_an_output_folder_is_refused_then_resumed_or_overwritten(files, tmp_path):
    run = ("run", files / "ball.npy", "--iso", "3", *TINY, "--out", "out")
    first = insitu(*run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    model = tmp_path / "out" / "step_000000" / "model.ply"
    stamp = model.stat().st_mtime_ns
    (tmp_path / "out" / "step_000000" / "views" / "stale.png").write_bytes(b"")

    refused = insitu(*run, cwd=tmp_path)
    assert "holds the results of an earlier run (steps 0); give --resume" in one_error(refused)
    assert model.stat().st_mtime_ns == stamp

    resumed = insitu(*run, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step 0: complete in out, kept (--resume)" in resumed.stdout
    assert model.stat().st_mtime_ns == stamp                  # not trained again
    assert [r["step"] for r in read_csv(tmp_path / "out" / "metrics.csv")] == ["0"]

    overwritten = insitu(*run, "--overwrite", cwd=tmp_path)
    assert overwritten.returncode == 0, overwritten.stderr
    assert model.stat().st_mtime_ns != stamp
    rows = read_csv(tmp_path / "out" / "metrics.csv")
    assert [(r["step"], r["status"]) for r in rows] == [("0", "trained")]          # one row per step
    assert not (tmp_path / "out" / "step_000000" / "views" / "stale.png").exists()
    assert "stale.png" not in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize("flags", [[], ["--resume"]], ids=["no flag", "--resume"])
def test_a_run_trains_the_steps_a_killed_run_left_unfinished(files, tmp_path, flags):
    # a folder without a finished step holds no results: the run needs no flag to take it
    out = tmp_path / "out"
    (out / ".step_000000.abc.tmp").mkdir(parents=True)        # a step killed while being written
    (out / ".step_000000.abc.tmp" / "model.ply").write_bytes(b"partial")
    (out / "metrics.csv").write_text("step,status\n0,failed\n")
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--out", out, *flags, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "report.html", "report.json", "step_000000",
                                                     "viewer"]
    assert [(r["step"], r["status"]) for r in read_csv(out / "metrics.csv")] == [("0", "trained")]


def test_output_ply_false_writes_no_model(files, tmp_path):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--set", "output.ply=false", "--out", "out",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    step = tmp_path / "out" / "step_000000"
    assert (step / "metrics.json").is_file() and not (step / "model.ply").exists()


def test_a_step_that_fails_while_written_leaves_no_step_folder(tmp_path, monkeypatch):
    import torch

    import insitu.output.export as export
    from insitu.surface.gaussians import Gaussians

    writer = export.StepWriter(tmp_path / "out")

    def broken(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_json", broken)        # after model.ply and the views, before metrics.json
    g = Gaussians(means=torch.zeros(2, 3), log_scales=torch.zeros(2, 3), quats=torch.ones(2, 4),
                  opacity_logits=torch.zeros(2), sh0=torch.zeros(2, 1, 3), shN=torch.zeros(2, 0, 3))
    with pytest.raises(OSError, match="No space left"):
        writer.write(0, g, [("view_000", torch.rand(4, 4, 3), torch.rand(4, 4, 3))], {"psnr": 1.0})
    assert list((tmp_path / "out").iterdir()) == []           # no model.ply without its metrics.json


def test_a_model_that_fails_to_write_leaves_no_step_folder_in_the_making(tmp_path, monkeypatch):
    import torch

    import insitu.output.export as export
    from insitu.surface.gaussians import Gaussians

    def full(path, gaussians, comm=None, **options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_ply", full)
    writer = export.StepWriter(tmp_path / "out")
    g = Gaussians(means=torch.zeros(2, 3), log_scales=torch.zeros(2, 3), quats=torch.ones(2, 4),
                  opacity_logits=torch.zeros(2), sh0=torch.zeros(2, 1, 3), shN=torch.zeros(2, 0, 3))
    with pytest.raises(OSError, match="No space left"):
        writer.write_model(0, g)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_report_lists_only_this_runs_steps(tmp_path):
    from insitu.output.export import StepWriter

    out = tmp_path / "out"
    (out / "step_000007" / "views").mkdir(parents=True)      # a folder left by something else
    (out / "step_000007" / "views" / "old.png").write_bytes(b"")
    writer = StepWriter(out)
    writer.write(3, None, [], {"psnr": 20.0})
    writer.record(4, "failed", "iso value 9 is outside the field's range")
    report = (out / "report.html").read_text()
    assert "Step 3" in report and "Step 7" not in report and "old.png" not in report
    rows = read_csv(out / "metrics.csv")
    assert [(r["step"], r["status"], r["reason"]) for r in rows] == [
        ("3", "trained", ""), ("4", "failed", "iso value 9 is outside the field's range")]


# ------------------------------------------------------------------------------------------ ranks

@pytest.mark.mpi
def test_ranks_launched_with_different_configurations_get_a_config_error_naming_the_keys(files, tmp_path):
    base = ["run", files / "ball.npy", "--iso", "3", *TINY, "--out", "out"]
    r = insitu(*base, "--views", "9", mpmd=[*base, "--views", "10"], cwd=tmp_path, timeout=180)
    line = one_error(r)
    assert "the ranks run different configurations" in line
    assert "rank 1 differs from rank 0 in views.count (9 vs 10)" in r.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ BP step numbers

@pytest.mark.parametrize("numbers, message", [
    ([0, -3], r"variable 'step' at ADIOS step index 1 is -3; expected a step number >= 0"),
    ([0.0, 1.5], r"variable 'step' at ADIOS step index 1 is 1\.5; expected an integer step number"),
    ([0, 4, 4], r"step number 4 is written at ADIOS step indices 1 and 2; expected each step number once"),
    (["zero"], r"variable 'step' at ADIOS step index 0 is a string \('zero'\); expected an integer step number"),
], ids=["negative", "1.5", "duplicated", "string"])
def test_an_untrustworthy_bp_step_variable_is_refused_before_any_step(tmp_path, numbers, message):
    path = bp_with_steps(tmp_path / "s.bp", numbers)
    with pytest.raises(SourceInputError, match=message):
        BPSource(path, "U")
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert __import__("re").search(message, one_error(r))
    assert not (tmp_path / "out").exists()


def test_bp_step_numbers_are_checked_while_reading_too(tmp_path):
    # without the probe (e.g. a file still being written) the reader checks each step as it comes
    path = bp_with_steps(tmp_path / "s.bp", [0, 5, 5])
    got = []
    with pytest.raises(SourceInputError, match=r"step number 5 is written at ADIOS step indices 1 and 2"):
        for step in BPSource(path, "U", probe=False):
            got.append(step.step)
    assert got == [0, 5]


def test_steps_that_select_nothing_are_refused_and_absent_ones_named(tmp_path):
    path = bp_with_steps(tmp_path / "s.bp", [0, 10, 20])
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--steps", "5", "7", "--out", "out", cwd=tmp_path)
    assert "none of the steps asked for (5, 7) is in the file; its steps: 0, 10, 20" in one_error(r)
    assert not (tmp_path / "out").exists() and "report" not in r.stdout
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--steps", "7", "10", "--out", "out",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "warning: step(s) 7 asked for (--steps) are not in" in r.stdout
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == ["step_000010"]


@pytest.mark.mpi
def test_steps_that_select_nothing_are_refused_on_two_ranks(tmp_path):
    path = bp_with_steps(tmp_path / "s.bp", [0, 10])
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--steps", "5", "--out", "out", cwd=tmp_path,
               ranks=2, timeout=180)
    assert "none of the steps asked for (5) is in the file" in one_error(r)
    assert not (tmp_path / "out").exists()


def test_a_replay_goes_on_after_a_step_without_surface(tmp_path):
    path = tmp_path / "s.bp"
    with adios2.Stream(str(path), "w") as s:
        for n, field in ((0, np.zeros((12, 12, 12), np.float32)), (1, sphere_field(12))):   # step 0: no surface
            s.begin_step()
            s.write("U", field, [12, 12, 12], [0, 0, 0], [12, 12, 12])
            s.write("step", n)
            s.end_step()
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "done: 1 step(s) trained, 1 failed (step 0: iso value 3" in r.stdout
    rows = read_csv(tmp_path / "out" / "metrics.csv")
    assert [(r["step"], r["status"]) for r in rows] == [("1", "trained"), ("0", "failed")]
    assert "outside the field's range" in rows[1]["reason"]


# ------------------------------------------------------------------------------------------ the Adaptor, one rank

def _process(seen):
    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        seen.append(step)
        return type("R", (), {"gaussians": None, "metrics": {}})()
    return process


def test_the_adaptor_refuses_an_output_folder_with_results_and_resumes_when_asked(tmp_path):
    from insitu.config import from_dict
    from insitu.output.export import StepWriter
    from insitu.run.adaptor import Adaptor

    out = tmp_path / "out"
    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(out)}}
    StepWriter(out, provenance={"command": "adaptor"}).write(3, None, [], {"psnr": 20.0}, from_dict(cfg))
    with pytest.raises(ConfigError, match=r"holds the results of an earlier run \(steps 3\); give --resume"):
        Adaptor(None, cfg, process=_process([]))
    seen = []
    u = np.zeros((4, 5, 6), np.float32)
    with Adaptor(None, {**cfg, "output": {"dir": str(out), "existing": "resume"}}, process=_process(seen)) as ad:
        for step in (3, 4):
            ad.execute(step, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
    assert seen == [4]
    assert ad.status[3].status == "skipped" and "complete in the output folder" in ad.status[3].reason
    assert ad.status[4].status == "trained"


def test_the_adaptor_refuses_sizes_that_cannot_fit_and_an_output_path_under_a_file(tmp_path):
    from insitu.run.adaptor import Adaptor

    with pytest.raises(ConfigError, match=r"need at least [\d.e+]+ GiB per rank"):
        Adaptor(None, {"views": {"resolution": 100000}, "run": {"device": "cpu"},
                       "output": {"dir": str(tmp_path / "o")}}, process=_process([]))
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=r"is a file, so the folder cannot be created"):
        Adaptor(None, {"run": {"device": "cpu"}, "output": {"dir": str(tmp_path / "f" / "o")}},
                process=_process([]))


def test_the_adaptor_refuses_a_step_number_given_before(tmp_path):
    from insitu.errors import InputError
    from insitu.run.adaptor import Adaptor

    seen = []
    u = np.zeros((4, 5, 6), np.float32)
    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(tmp_path / "o")}}
    with Adaptor(None, cfg, process=_process(seen)) as ad:
        ad.execute(5, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
        with pytest.raises(InputError, match=r"step 5: given to execute\(\) before; each step number once"):
            ad.execute(5, 1.0, {"U": u + 1}, (6, 5, 4), (0, 0, 0))
        ad.execute(3, 2.0, {"U": u}, (6, 5, 4), (0, 0, 0))
    assert seen == [5, 3] and ad.stats.trained_steps == [5, 3]


def test_the_adaptor_refuses_to_resume_steps_of_another_configuration(tmp_path):
    from insitu.config import from_dict
    from insitu.output.export import StepWriter
    from insitu.run.adaptor import Adaptor

    out = tmp_path / "out"
    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(out), "existing": "resume"}}
    StepWriter(out, provenance={"command": "adaptor"}).write(3, None, [], {"psnr": 20.0}, from_dict(cfg))
    with pytest.raises(ConfigError, match=r"--resume would keep steps made from another input or configuration "
                                          r"\(step 3: input\.iso \(\[0\.25\] kept vs \[0\.5\] now\)\)"):
        Adaptor(None, {**cfg, "input": {"iso": [0.5]}}, process=_process([]))
    assert (out / "step_000003" / "metrics.json").is_file()


def test_the_adaptor_refuses_a_folder_another_process_writes(tmp_path):
    from insitu.run.adaptor import Adaptor

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from insitu.output.folder import lock_output; "
                               f"lock = lock_output({str(out)!r}, 'insitu replay other.bp'); print('locked', flush=True); "
                               "sys.stdin.read(); lock.release()"], env=subprocess_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(out)}}
        with pytest.raises(ConfigError, match=rf"in use by another run \(PID {holder.pid} on "
                                              rf"{re.escape(socket.gethostname())}, insitu replay other\.bp, since"):
            Adaptor(None, cfg, process=_process([]))
    finally:
        holder.communicate("", timeout=30)
    assert not out.exists()                                     # its holder made it and removed it


def test_the_adaptor_rejects_a_step_number_that_cannot_name_an_output(tmp_path):
    from insitu.errors import InputError
    from insitu.run.adaptor import Adaptor

    seen = []
    u = np.zeros((4, 5, 6), np.float32)
    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(tmp_path / "o")}}
    with Adaptor(None, cfg, process=_process(seen)) as ad:
        for bad in (-1, 1.5):
            with pytest.raises(InputError, match=r"step: expected an integer >= 0"):
                ad.execute(bad, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
        ad.execute(2, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
    assert seen == [2]
