"""The C API and the Fortran module: build libinsitu_adaptor, the C Gray-Scott and the Fortran moving
sphere with CMake (find_package(InsituGS) from the installed package), run them on 2 ranks, and check
outputs and error reporting on every rank."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import followed_iterations, launch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def gray_scott_c(tmp_path_factory) -> Path:
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed to build the C adaptor (apt-get install cmake)"
    tmp = tmp_path_factory.mktemp("cbuild")
    prefix = tmp / "install"
    common = [f"-DPython3_EXECUTABLE={sys.executable}", f"-DMPI_C_COMPILER={BIN / 'mpicc'}"]
    for cmd in ([cmake, "-S", ROOT / "adaptors", "-B", tmp / "adaptor", f"-DCMAKE_INSTALL_PREFIX={prefix}", *common],
                [cmake, "--build", tmp / "adaptor"],
                [cmake, "--install", tmp / "adaptor"],
                [cmake, "-S", ROOT / "sims", "-B", tmp / "sims", f"-DCMAKE_PREFIX_PATH={prefix}", *common],
                [cmake, "--build", tmp / "sims"]):
        proc = launch(cmd, timeout=300)
        assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}"
    assert (prefix / "include" / "insitu_adaptor.h").is_file()
    assert (prefix / "lib" / "cmake" / "InsituGS" / "InsituGSConfigVersion.cmake").is_file()
    return tmp / "sims" / "gray_scott_c"


def config_file(tmp_path: Path, *, budget: int = 500, **input_) -> Path:
    """A config for a quick in situ run; ``input_`` overrides the input section (Gray-Scott's V, coloured by U)."""
    cfg = {"input": {"var": "V", "iso": [0.2], "color_var": "U", **input_}, "seeds": {"budget": budget},
           "views": {"count": 8, "resolution": 32, "supersample": 1},
           "train": {"iterations": 20}, "series": {"warm_iterations": 10, "warm_start": True, "follow_iterations": True},
           "output": {"dir": str(tmp_path / "out"), "images": 1},
           "run": {"progress": False, "backend": "torch", "device": "cpu", "timeout_s": 60, "mode": "background"}}
    path = tmp_path / "gs.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def sim_env() -> dict[str, str]:
    """No VIRTUAL_ENV / INSITU_*: the library starts the interpreter it was built with (baked in by CMake)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("INSITU_PYTHON", "INSITU_PYTHONPATH", "VIRTUAL_ENV", "PYTHONPATH")}


def run_sim(exe: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return launch([exe, "--L", "24", "--steps", "40", "--plotgap", "20", *args], ranks=2, cwd=tmp_path,
                  env=sim_env(), timeout=300)


@pytest.mark.mpi
def test_c_gray_scott_trains_in_situ(gray_scott_c, tmp_path):
    from insitu.output.ply import read_ply

    proc = run_sim(gray_scott_c, tmp_path, "--config", str(config_file(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "thread level 3" in proc.stdout                  # MPI_THREAD_MULTIPLE: background training
    out = tmp_path / "out"
    for step in (20, 40):
        d = out / f"step_{step:06d}"
        metrics = json.loads((d / "metrics.json").read_text())
        assert metrics["step"] == step and metrics["ranks"] == 2
        assert metrics["time"] == pytest.approx(1.0 * step)     # step * dt (default 1.0), as passed by the sim
        assert len(read_ply(d / "model.ply")) == metrics["ply_gaussians"] > 0
        assert (d / "views" / "view_000.png").is_file()
    warm = json.loads((out / "step_000040" / "metrics.json").read_text())            # warm start
    assert warm["iterations"] == followed_iterations(warm, 10, 20) < 20


@pytest.mark.mpi
def test_c_bad_config_fails_on_every_rank_with_a_clear_message(gray_scott_c, tmp_path):
    proc = run_sim(gray_scott_c, tmp_path, "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode != 0
    for rank in (0, 1):
        # two ranks share stderr and their lines may interleave: match the message, not a whole line
        assert re.search(f"gray_scott: rank {rank}: insitu_initialize[^\n]*?ConfigError", proc.stderr), proc.stderr
    assert proc.stderr.count("nope.yaml: does not exist") >= 2


@pytest.mark.mpi
def test_c_python_exception_in_execute_returns_an_error_on_every_rank(gray_scott_c, tmp_path):
    proc = run_sim(gray_scott_c, tmp_path, "--config", str(config_file(tmp_path, var="W")))
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"gray_scott: rank {rank}: insitu_execute failed at step 20: insitu_execute: InputError" in proc.stderr
    assert proc.stderr.count("field 'W' (input.var) is not among the fields given: 'U', 'V'") >= 2
    assert not (tmp_path / "out" / "step_000020").exists()


@pytest.mark.mpi
def test_c_gray_scott_matches_the_python_one_for_any_split(gray_scott_c, tmp_path):
    sys.path.insert(0, str(ROOT / "sims"))
    from insitu_sims.gray_scott import GrayScott, GrayScottSettings

    sim = GrayScott(GrayScottSettings(L=20, steps=30, engine="none"))
    for _ in range(30):
        sim.step()
    expected = f"sum U = {sim.u.sum():.12e}, sum V = {sim.v.sum():.12e}"
    for n in (1, 3):
        proc = launch([gray_scott_c, "--L", "20", "--steps", "30", "--no-insitu"], ranks=n, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout, (n, proc.stdout)


@pytest.mark.mpi
@pytest.mark.parametrize("env, words", [
    ({"INSITU_PYTHON": "/nonexistent/python"},
     "the Python interpreter /nonexistent/python, chosen by INSITU_PYTHON=/nonexistent/python, does not exist"),
    ({"VIRTUAL_ENV": "/nonexistent/venv"},           # a stale VIRTUAL_ENV: the venv was removed
     "the Python interpreter /nonexistent/venv/bin/python, chosen by VIRTUAL_ENV=/nonexistent/venv, does not exist"),
    ({"INSITU_PYTHON": "/bin/true"},                 # runs, but is no Python: Python starts from its build's paths
     "No module named 'mpi4py' (in Python started as /bin/true, chosen by INSITU_PYTHON=/bin/true: is it the python "
     "of the environment that holds insitu-gs and mpi4py"),
])
def test_c_a_wrong_interpreter_is_named_with_the_variable_that_chose_it(gray_scott_c, tmp_path, env, words):
    proc = launch([gray_scott_c, "--L", "8", "--steps", "2", "--plotgap", "1", "--config",
                   str(config_file(tmp_path))], ranks=1, cwd=tmp_path, env={**sim_env(), **env}, timeout=120)
    assert proc.returncode != 0
    assert "gray_scott: rank 0: insitu_initialize failed: insitu_initialize: " in proc.stderr, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
def test_c_a_negative_or_huge_count_and_a_name_not_utf8_are_named_on_every_rank(gray_scott_c, tmp_path):
    """Through ctypes: rank 1 alone passes each bad argument; both ranks return the error from that call."""
    library = gray_scott_c.parents[1] / "install" / "lib" / "libinsitu_adaptor.so"
    config = config_file(tmp_path, var="U", color_var=None)
    proc = launch([sys.executable, ROOT / "tests" / "mpi" / "c_execute_worker.py", library, config], ranks=2,
                  cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    expected = {"negative count": "rank 1: count (4, 4, -5) (x, y, z): expected at least 1 sample this rank holds "
                                  "along each axis, got count[2] = -5",
                "huge count": "rank 1: count (2097152, 2097152, 2097152) (x, y, z): 9.22e+18 samples of field U "
                              "(float32) are 3.69e+19 bytes, more than a process can address",
                "non-UTF-8 name": "rank 1: field name b'U\\xff': not UTF-8 text; expected a name in UTF-8"}
    assert sorted((r["case"], r["rank"]) for r in seen) == sorted((c, r) for c in expected for r in (0, 1))
    for r in seen:
        assert r["rc"] != 0 and r["error"].startswith("insitu_execute: InputError: step "), r
        assert expected[r["case"]] in r["error"], r
    assert not list((tmp_path / "out").glob("step_*"))


FORTRAN_COMPILERS = ("gfortran", "flang", "flang-new", "ifx", "ifort", "nvfortran")


@pytest.fixture(scope="module")
def sphere_f(gray_scott_c) -> Path:
    exe = gray_scott_c.parent / "sphere_f"
    if not exe.exists():
        if not any(shutil.which(c) for c in FORTRAN_COMPILERS):
            pytest.skip("no Fortran compiler on PATH (.ci/run installs gfortran): sphere_f not built")
        raise AssertionError("a Fortran compiler is present but sims/sphere.f90 was not built: see the CMake log")
    return exe


def sphere_config(tmp_path: Path, var: str = "D") -> Path:
    return config_file(tmp_path, budget=800, var=var, iso=[0.0], color_var=None)


def run_sphere(exe: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return launch([exe, *args], ranks=2, cwd=tmp_path, env=sim_env(), timeout=300)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["real8", "real4"])
def test_fortran_sphere_trains_in_situ_with_the_fortran_axis_order(sphere_f, tmp_path, kind):
    from insitu.output.ply import read_ply

    args = ["--config", str(sphere_config(tmp_path)), "--steps", "2"] + (["--real4"] if kind == "real4" else [])
    proc = run_sphere(sphere_f, tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"sphere_f: 2 steps done (real(c_{'float' if kind == 'real4' else 'double'}) fields)" in proc.stdout
    for step in (1, 2):
        metrics = json.loads((tmp_path / "out" / f"step_{step:06d}" / "metrics.json").read_text())
        assert metrics["step"] == step and metrics["ranks"] == 2 and metrics["time"] == pytest.approx(step)
    # step 1: a sphere of radius 6 centred at cell (x, y, z) = (13, 11, 8) of a 40 x 28 x 20 grid whose
    # z-slabs come from the two ranks; a(x, y, z) read in another axis order, or the slabs swapped, moves it
    first = tmp_path / "out" / "step_000001"
    means = read_ply(first / "model.ply").means.numpy()
    assert len(means) == json.loads((first / "metrics.json").read_text())["ply_gaussians"] > 50
    np.testing.assert_allclose(means.mean(0), [13.0, 11.0, 8.0], atol=0.5)
    np.testing.assert_allclose(means.max(0) - means.min(0), [12.0, 12.0, 12.0], atol=1.5)


@pytest.mark.mpi
def test_fortran_execute_error_reaches_every_rank_through_insitu_last_error(sphere_f, tmp_path):
    proc = run_sphere(sphere_f, tmp_path, "--config", str(sphere_config(tmp_path, var="W")), "--steps", "1")
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"sphere_f: rank {rank}: insitu_execute failed at step 1: insitu_execute: InputError" in proc.stderr
    assert proc.stderr.count("field 'W' (input.var) is not among the fields given: 'D'") >= 2, proc.stderr
    assert not (tmp_path / "out" / "step_000001").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("args, message", [(["--steps", "x"], "--steps needs an integer >= 0"),
                                           (["--config"], "--config needs a file name"),
                                           (["--frobnicate"], "unknown argument --frobnicate")])
def test_fortran_bad_command_line_exits_2_with_usage(sphere_f, tmp_path, args, message):
    proc = run_sphere(sphere_f, tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"sphere_f: {message}; usage: sphere_f" in proc.stderr
