"""Hostile input and misuse: every case a clear error (exit 2, one line, nothing written) or the
right result. Config and source cases are called directly; command-line cases run ``python -m
insitu`` (one process, or ``mpiexec -n 2`` where ranks matter)."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import adios2
import numpy as np
import pytest

from insitu.config import ConfigError, check_memory, load_config, parse_override
from insitu.export import read_csv
from insitu.sources import BPSource, SourceInputError

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TINY = ["--views", "8", "--resolution", "16", "--iterations", "2", "--budget", "100", "--quiet",
        "--set", "views.supersample=1"]


def insitu(*args, cwd: Path, ranks: int = 0, timeout: float = 120, mpmd: list | None = None,
           prefix: list | None = None) -> subprocess.CompletedProcess:
    """``python -m insitu ARGS`` (under ``mpiexec -n ranks``; ``mpmd``: a second program's ARGS for rank 1)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "insitu", *map(str, args)]
    if mpmd is not None:
        cmd = [str(MPIEXEC), "-n", "1", *cmd, ":", "-n", "1", sys.executable, "-m", "insitu", *map(str, mpmd)]
    elif ranks:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    return subprocess.run([*(prefix or []), *cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def one_error(r: subprocess.CompletedProcess) -> str:
    """The run exited 2 with one ``insitu: error:`` line and no traceback; returns the line."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("insitu: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def ball(n: int = 12, dtype=np.float32) -> np.ndarray:
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float32)
    c = (n - 1) / 2
    return np.sqrt((x - c) ** 2 + (y - c) ** 2 + (z - c) ** 2).astype(dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("files")
    np.save(d / "ball.npy", ball())
    ball(dtype=np.uint8).tofile(d / "ball_12x12x12_uint8.raw")
    ball(dtype=np.uint8).tofile(d / "noname.raw")
    open(d / "empty.npy", "wb").close()
    (d / "truncated.npy").write_bytes((d / "ball.npy").read_bytes()[:-100])
    (d / "text.npy").write_text("0 1 2 3\n")
    np.save(d / "object.npy", np.array([{"a": 1}] * 8, dtype=object).reshape(2, 2, 2), allow_pickle=True)
    (d / "folder.npy").mkdir()
    (d / "folder.raw").mkdir()
    (d / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (d / "nested.yaml").write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "afile").write_text("x")
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
])
def test_out_of_range_values_are_rejected_by_validation(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {key: value})


@pytest.mark.parametrize("text, message", [
    ("train.iterations=[unclosed", r"--set 'train\.iterations=\[unclosed': not valid YAML"),
    ("train.iterations=!!python/object/apply:os.system [echo hi]", r"not valid YAML \(could not determine a constructor"),
    ("train.iterations=" + "[" * 100 + "]" * 100, r"nested 100 levels deep, expected at most 32"),
])
def test_invalid_yaml_in_set_is_a_config_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_override(text)


@pytest.mark.parametrize("name, message", [
    ("binary.yaml", r"not a text file"),
    ("nested.yaml", r"nested 5000 levels deep"),
    ("afile/../", r"is a directory"),
])
def test_unusable_config_files_are_config_errors(files, name, message):
    path = files if name == "afile/../" else files / name
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_memory_that_cannot_fit_is_refused_with_what_it_needs():
    cfg = load_config(None, {"views.resolution": 100000})
    with pytest.raises(ConfigError, match=r"need at least [\d.e+]+ GiB per rank \(ground truth .*; here has 16 GiB"):
        check_memory(cfg, 1, 16 * 2**30, "here")
    fill = load_config(None, {"seeds.budget": 10**12, "seeds.fill": True})
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
    (["{d}/ball.npy", "--budget", "1000000000000", "--set", "seeds.fill=true"], r"gaussians [\d.e+]+ GiB"),
    (["{d}/ball.npy", "--config", "{d}"], r"config file .*: is a directory, expected a YAML file"),
    (["{d}/ball.npy", "--config", "{d}/binary.yaml"], r"binary\.yaml: not a text file"),
    (["{d}/ball.npy", "--set", "train.iterations=[unclosed"], r"not valid YAML"),
    (["{d}/ball.npy", "--set", "views.supersample=64"], r"views\.supersample: expected 1\.\.8"),
], ids=["empty npy", "truncated npy", "text npy", "object npy", "folder npy", "folder raw", "dims without dtype",
        "dtype foo", "resolution 100000", "budget 1e12 fill", "config folder", "binary config", "unclosed set",
        "supersample 64"])
def test_bad_input_is_one_line_exit_2_and_no_output_folder(files, tmp_path, args, message):
    args = [a.format(d=files) for a in args]
    r = insitu("run", args[0], "--iso", "3", *TINY, *args[1:], "--out", "out", cwd=tmp_path)
    line = one_error(r)
    assert __import__("re").search(message, line), line
    assert not (tmp_path / "out").exists()           # nothing created for a run that cannot start


def test_a_flag_does_not_hide_an_invalid_set_value_for_its_key(files, tmp_path):
    r = insitu("run", files / "ball.npy", "--iso", "3", *TINY, "--set", "train.iterations=abc",
               "--out", "out", cwd=tmp_path)                      # TINY gives --iterations 2
    assert "train.iterations: expected an integer, got str 'abc'" in one_error(r)
