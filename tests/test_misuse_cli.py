"""Misuse of the command line's own values: the demo's grid, steps and plotgap (and the Gray-Scott
mini-app's), ``--config`` files that cannot be one, and configuration values outside what the code
that consumes them accepts. Every case: exit 2, one line naming the input, nothing written."""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI
from conftest import ROOT, insitu, launch, one_error, subprocess_env

from insitu.config import CONFIG_BYTES_MAX, TIMEOUT_S_MAX, load_config
from insitu.errors import ConfigError
from insitu.run.demo import check_demo, demo_defaults
from insitu_sims.gray_scott import GrayScott, GrayScottSettings, memory_bytes, parse_args


SIMS = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'sims'}"}     # the demo's simulation: this tree's


# ------------------------------------------------------------------------------------------ insitu demo

@pytest.mark.parametrize("args, message", [
    (["--L", "1"], r"--L 1: expected an integer >= 4 \(the simulation's initial cube of V is L // 4 cells"),
    (["--L", "3"], r"--L 3: expected an integer >= 4 "),
    (["--plotgap", "0"], r"--plotgap 0: expected an integer >= 1 "),
    (["--plotgap", "-5"], r"--plotgap -5: expected an integer >= 1 "),
    (["--steps", "-5"], r"--steps -5: expected an integer >= 1 "),
    (["--steps", "0"], r"--steps 0: expected an integer >= 1 "),
])
def test_demo_values_out_of_range_are_one_line(tmp_path, args, message):
    line = one_error(insitu("demo", *args, "--out", "out", cwd=tmp_path, env=SIMS))
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


def test_a_demo_grid_larger_than_memory_is_one_line_before_any_output(tmp_path):
    line = one_error(insitu("demo", "--L", "100000", "--out", "out", "--quiet", cwd=tmp_path, env=SIMS))
    assert line.startswith("insitu: error: --L 100000: the demo needs "), line
    assert "GiB per rank on 1 rank(s) (the simulation " in line and "this machine has " in line, line
    assert not (tmp_path / "out").exists()


def test_a_demo_whose_field_has_no_surface_ends_in_one_line_with_the_step_recorded(tmp_path):
    """At L = 8 the pattern of V has died out by step 300: no surface at the demo's iso value. The step is
    recorded as failed, the simulation runs to its end, and the run ends in one line, exit 2."""
    r = insitu("demo", "--L", "8", "--steps", "300", "--plotgap", "300", "--out", "out", "--quiet",
               cwd=tmp_path, env=SIMS)
    line = one_error(r)
    assert line.startswith("insitu: error: the demo trained no step (") and "no surface" in line, line
    assert "demo: simulation done" in r.stdout, r.stdout
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[1].startswith("300,failed,"), rows


def demo_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"L": None, "steps": None, "plotgap": None, **flags})


def test_the_demo_grid_must_give_every_rank_a_cell():
    """On 5 ranks the simulation splits the grid 5 x 1 x 1: the last block along x holds the grid's last
    sample and needs one more to own a cell."""
    cfg = load_config(None, defaults=demo_defaults(gpu=False))
    with pytest.raises(ConfigError, match=r"--L 5: expected at least 6 on 5 ranks \(the simulation splits the grid "
                                          r"5 x 1 x 1 over them"):
        check_demo(demo_args(L=5), cfg, 5, "cpu", 1 << 40)
    check_demo(demo_args(L=6), cfg, 5, "cpu", 1 << 40)
    check_demo(demo_args(L=4), cfg, 2, "cpu", 1 << 40)


def test_the_demo_memory_check_counts_the_step_only_where_it_trains_on_the_host():
    cfg = load_config(None, defaults=demo_defaults(gpu=False))
    with pytest.raises(ConfigError, match=r"--L 36: the demo needs .* the training step .* this machine has "):
        check_demo(demo_args(), cfg, 1, "cpu", 1 << 20)
    with pytest.raises(ConfigError) as e:                   # on a GPU the step is in the GPU's memory
        check_demo(demo_args(), cfg, 1, "cuda", 1 << 20)
    assert "--L 128: the demo needs" in str(e.value) and "training step" not in str(e.value)
    check_demo(demo_args(), cfg, 1, "cpu", 4 << 30)


# ------------------------------------------------------------------------------------------ the mini-app

def gray_scott(*args, cwd: Path) -> subprocess.CompletedProcess:
    return launch([sys.executable, "-m", "insitu_sims.gray_scott", *args], cwd=cwd, env={**subprocess_env(), **SIMS})


@pytest.mark.parametrize("args, message", [
    (["--L", "100000", "--engine", "none"], "error: --L 100000: the simulation needs "),
    (["--L", "100000", "--output", "gs.bp"], "and the whole grid gathered on rank 0 to be written"),
    (["--L", "1"], "error: L: expected an integer >= 4 "),
    (["--steps", "-5"], "error: steps: expected >= 0, got -5"),
])
def test_the_mini_app_refuses_with_one_line(tmp_path, args, message):
    r = gray_scott(*args, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


class Ranks:
    """The size and rank parse_args asks of a communicator."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's names
        return self.size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank


def test_the_mini_app_refuses_a_grid_it_cannot_split_from_rank_0_only(capsys):
    for rank, said in ((0, True), (1, False)):
        with pytest.raises(SystemExit) as e:
            parse_args(["--L", "4", "--engine", "none"], Ranks(5, rank))
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert ("L: expected at least 5 on 5 ranks (the grid is split over them 5 x 1 x 1" in err) == said, err
    assert parse_args(["--L", "5", "--engine", "none"], Ranks(5)).L == 5


def test_the_mini_apps_memory_is_what_it_allocates():
    """memory_bytes counts the arrays GrayScott holds and the two copies an output hands out."""
    settings = GrayScottSettings(L=13, noise=0.1, engine="none")
    sim = GrayScott(settings, MPI.COMM_SELF)
    arrays = [v for v in vars(sim).values() if isinstance(v, np.ndarray)]
    arrays += [b for bufs in sim._bufs for b in bufs] + [sim.u, sim.v]
    assert memory_bytes(settings, 1) == sum(a.nbytes for a in arrays)
    assert memory_bytes(settings, 1, gathered=True) == sum(a.nbytes for a in arrays) + 3 * 8 * 13 ** 3


# ------------------------------------------------------------------------------------------ --config

def drop_root() -> list[str]:
    """A command prefix that drops root's file-permission override (setpriv)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("this test drops root's file-permission override with setpriv; run it as root")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
            "--inh-caps", "-dac_override,-dac_read_search"]


@pytest.mark.parametrize("case, message", [
    ("long name", r"config file a{60}\.\.\. \(5000 characters\): cannot be opened \(File name too long\)$"),
    ("/dev/zero", r"config file /dev/zero: is a character device, expected a YAML file \(a regular file\)$"),
    ("fifo", r"config file fifo\.yaml: is a named pipe \(FIFO\), expected a YAML file \(a regular file\)$"),
    ("directory", r"config file folder\.yaml: is a directory, expected a YAML file$"),
    ("unreadable", r"config file locked\.yaml: cannot be read \(Permission denied\)$"),
    ("latin-1", r"config file latin\.yaml: not a text file \(byte 21 is not UTF-8\); expected YAML$"),
    ("huge", rf"config file huge\.yaml: holds {CONFIG_BYTES_MAX + 4} bytes, expected a YAML configuration of at "
             rf"most {CONFIG_BYTES_MAX} bytes \(1 MiB\)$"),
    ("under a file", r"config file afile/c\.yaml: cannot be opened \(Not a directory\)$"),
    ("empty name", r"config file: expected a file name, got ''$"),
])
def test_a_config_that_cannot_be_one_is_one_line(tmp_path, case, message):
    prefix = None
    name = {"long name": "a" * 5000, "/dev/zero": "/dev/zero", "fifo": "fifo.yaml", "directory": "folder.yaml",
            "unreadable": "locked.yaml", "latin-1": "latin.yaml", "huge": "huge.yaml", "under a file": "afile/c.yaml",
            "empty name": ""}[case]
    if case == "fifo":
        os.mkfifo(tmp_path / name)
    elif case == "directory":
        (tmp_path / name).mkdir()
    elif case == "unreadable":
        (tmp_path / name).write_text("train: {iterations: 3}\n")
        (tmp_path / name).chmod(0)
        prefix = drop_root()
    elif case == "latin-1":
        (tmp_path / name).write_bytes("train:\n  iterations: \xe9\n".encode("latin-1"))
    elif case == "huge":
        (tmp_path / name).write_text("# a\n" * (CONFIG_BYTES_MAX // 4 + 1))
    elif case == "under a file":
        (tmp_path / "afile").write_text("x")
    line = one_error(insitu("demo", "--config", name, "--out", "out", cwd=tmp_path, prefix=prefix, env=SIMS))
    assert re.search(message, line.removeprefix("insitu: error: ")), line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ config values

@pytest.mark.parametrize("key, value, message", [
    ("seeds.opacity", 0, r"seeds\.opacity: expected a value in \(0, 1\), got 0"),
    ("seeds.opacity", 1, r"seeds\.opacity: expected a value in \(0, 1\), got 1"),
    ("seeds.thickness", 1.5, r"seeds\.thickness: expected a value in \(0, 1\], got 1\.5"),
    ("train.densify.prune_opacity", 0.5, r"train\.densify\.prune_opacity: expected a value < 0\.5 \(an opacity "
                                         r"reset caps every opacity at twice it"),
    ("train.densify.prune_opacity", 0, r"train\.densify\.prune_opacity: expected a value > 0 while "
                                       r"train\.densify\.reset_every \(3000\) resets opacities"),
    ("run.timeout_s", 1e300, r"run\.timeout_s: expected a value <= 604800 \(seconds, a week"),
    ("input.timeout_s", TIMEOUT_S_MAX * 2, r"input\.timeout_s: expected a value <= 604800 "),
    ("run.threads", 2**31, r"run\.threads: expected a value <= 2147483647 \(torch takes a 32-bit count\)"),
    ("series.warm_iterations", 0, r"series\.warm_iterations: expected a value > 0, got 0"),
])
def test_values_the_consuming_code_refuses_are_refused_by_the_config(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {key: value})


@pytest.mark.parametrize("overrides", [
    {"seeds.opacity": 1e-6}, {"seeds.opacity": 1 - 1e-6}, {"seeds.thickness": 1},
    {"train.densify.prune_opacity": 0.4999}, {"train.densify.prune_opacity": 0, "train.densify.reset_every": 0},
    {"run.timeout_s": TIMEOUT_S_MAX}, {"input.timeout_s": TIMEOUT_S_MAX}, {"run.threads": 2**31 - 1},
    {"series.warm_iterations": 1},
])
def test_the_bounds_themselves_are_accepted(overrides):
    cfg = load_config(None, overrides)
    key, value = next(iter(overrides.items()))
    assert functools.reduce(getattr, key.split("."), cfg) == value


def test_the_set_flag_refuses_an_opacity_of_0_or_1(tmp_path):
    for value in ("0", "1"):
        line = one_error(insitu("demo", "--set", f"seeds.opacity={value}", "--out", "out", cwd=tmp_path, env=SIMS))
        assert f"seeds.opacity: expected a value in (0, 1), got {float(value)}" in line, line


def test_a_key_that_moved_is_one_line_naming_its_new_place_from_set_and_file_alike(tmp_path):
    line = one_error(insitu("demo", "--set", "parallel.device=cpu", "--out", "out", cwd=tmp_path, env=SIMS))  # old key
    assert line == "insitu: error: config: parallel.device is now run.device", line  # old key
    (tmp_path / "c.yaml").write_text("train:\n  densify_from: 100\n")  # old key
    line = one_error(insitu("demo", "--config", "c.yaml", "--out", "out", cwd=tmp_path, env=SIMS))
    assert line == "insitu: error: config: train.densify_from is now train.densify.start", line  # old key
    assert not (tmp_path / "out").exists()


def test_the_consumers_take_the_bounds_the_config_accepts():
    """The extremes the config accepts are what the code using them takes: the seeds' opacity (its logit) and
    thickness (its log) finite, the opacity reset's logit of twice prune_opacity finite (gsplat's reset_opa
    clamps the opacities to it), a week's timeout a wait that torch.distributed and poll take 3 times over."""
    from datetime import timedelta

    from insitu.surface.seeds import extract_seeds, init_gaussians
    from insitu.volume import whole_block

    z, y, x = np.mgrid[0:12, 0:12, 0:12]
    seeds = extract_seeds(whole_block(np.sqrt((x - 5.5) ** 2 + (y - 5.5) ** 2 + (z - 5.5) ** 2)), 4.0)
    for overrides in ({"seeds.opacity": 1e-6, "seeds.thickness": 1.0}, {"seeds.opacity": 1 - 1e-6}):
        sc = load_config(None, overrides).seeds
        g = init_gaussians(seeds, 50, opacity=sc.opacity, thickness=sc.thickness)
        assert torch.isfinite(g.opacity_logits).all() and torch.isfinite(g.log_scales).all()
    for refused in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"opacity: expected a value in \(0, 1\)"):
            init_gaussians(seeds, 50, opacity=refused)
    assert math.isfinite(torch.logit(torch.tensor(2 * 0.4999)).item())
    assert not math.isfinite(torch.logit(torch.tensor(2 * 0.5)).item())        # the bound refused
    timedelta(seconds=3 * TIMEOUT_S_MAX)
    assert 3 * TIMEOUT_S_MAX * 1000 <= 2**31 - 1


def test_a_key_set_twice_or_given_twice_in_the_file_is_one_line_before_any_output(tmp_path):
    np.save(tmp_path / "ball.npy", np.zeros((8, 8, 8), np.float32))
    line = one_error(insitu("run", "ball.npy", "--iso", "0.5", "--iterations", "10", "--set", "train.iterations=20",
                            "--out", "out", cwd=tmp_path))
    assert line == ("insitu: error: train.iterations: set twice, by --iterations 10 and by --set train.iterations=20; "
                    "give one of them"), line
    (tmp_path / "c.yaml").write_text("train:\n  iterations: 5\ntrain:\n  batch: 2\n")
    line = one_error(insitu("run", "ball.npy", "--iso", "0.5", "--config", "c.yaml", "--out", "out", cwd=tmp_path))
    assert line == ("insitu: error: config file c.yaml: section train appears twice (lines 1 and 3); YAML would keep "
                    "only the second: merge them into one"), line
    assert not (tmp_path / "out").exists()
