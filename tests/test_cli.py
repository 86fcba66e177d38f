"""The command line, as a user runs it: ``python -m insitu demo | run | replay | stream``,
on one process and under ``mpiexec -n 2``; bad input exits with code 2 and one line."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, followed_iterations, insitu, launch, uint8_ball

from insitu.output.ply import read_ply

SIM = ROOT / "sims" / "insitu_sims" / "gray_scott.py"
SUMMARY = re.compile(r"^(?:demo: )?step (\d+): surface PSNR ([\d.]+) dB, SSIM ([\d.]+)(?: \(2x and 3x closer: "
                     r"(?:[\d.]+|n/a) and (?:[\d.]+|n/a) dB\))?, whole image [\d.]+ dB, (\d+) Gaussians, (\d+) "
                     r"iterations, .*-> (.+)$", re.MULTILINE)
# larger than conftest's TINY: 4 iterations, more than the warm starts' 3 below
TINY = ["--views", "8", "--resolution", "24", "--iterations", "4", "--budget", "150", "--quiet",
        "--set", "views.supersample=1"]


def summaries(stdout: str) -> list[tuple[int, int, int]]:
    """(step, Gaussians, iterations) of every summary line."""
    return [(int(m[1]), int(m[4]), int(m[5])) for m in SUMMARY.finditer(stdout)]


def ply_count(step_dir: Path, count: int) -> int:
    """The Gaussians of the step's model.ply as its metrics.json counts them (``ply_gaussians``: the trained model
    merged for standard viewers), once that file's ``gaussians`` is the summary line's ``count``."""
    metrics = json.loads((step_dir / "metrics.json").read_text())
    assert metrics["gaussians"] == count >= metrics["ply_gaussians"], metrics
    return metrics["ply_gaussians"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    uint8_ball().tofile(d / "ball_12x12x12_uint8.raw")
    np.zeros(100, np.uint8).tofile(d / "short_12x12x12_uint8.raw")
    np.save(d / "flat.npy", np.zeros((4, 4), np.float32))
    (d / "unknown_key.yaml").write_text("train:\n  iterationz: 5\n")
    (d / "wrong_type.yaml").write_text("train:\n  iterations: many\n")
    return d


# ------------------------------------------------------------------------------------------ help

@pytest.mark.parametrize("command", [[], ["demo"], ["run"], ["replay"], ["stream"]],
                         ids=["insitu", "demo", "run", "replay", "stream"])
def test_help_mentions_out_and_config(command, tmp_path):
    r = insitu(*command, "--help", cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    if command:
        assert "--out" in text and "--config" in text
    else:
        assert all(c in text for c in ("demo", "run", "replay", "stream"))
    assert "usage: insitu" in text


def test_version(tmp_path):
    from insitu import __version__

    r = insitu("--version", cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"insitu-gs {__version__}", r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ run

def test_run_a_raw_file(inputs, tmp_path):
    r = insitu("run", inputs / "ball_12x12x12_uint8.raw", "--iso", "160", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (step, count, iterations), = summaries(r.stdout)
    assert (step, iterations) == (0, 4)
    model = read_ply(tmp_path / "out" / "step_000000" / "model.ply")
    assert len(model) == ply_count(tmp_path / "out" / "step_000000", count) > 0
    assert "done: 1 step(s) trained" in r.stdout
    for name in ("metrics.csv", "report.html", "step_000000/metrics.json"):
        assert (tmp_path / "out" / name).is_file(), name


@pytest.mark.mpi
def test_run_a_raw_file_on_two_ranks_writes_one_merged_model(inputs, tmp_path):
    loud = [a for a in TINY if a != "--quiet"]
    r = insitu("run", inputs / "ball_12x12x12_uint8.raw", "--iso", "160", *loud, "--out", "out",
               cwd=tmp_path, ranks=2, timeout=180)
    assert r.returncode == 0, r.stderr
    (step, count, _), = summaries(r.stdout)             # rank 0 alone reports
    # progress (a log here, not a terminal) counts the whole model's Gaussians, not rank 0's shard
    last = re.findall(r"^step 0 train: 4/4, loss [\d.]+, gaussians (\d+) ", r.stderr, re.MULTILINE)
    assert last == [str(count)], r.stderr
    assert step == 0
    models = list((tmp_path / "out").rglob("*.ply"))
    assert [p.relative_to(tmp_path / "out").as_posix() for p in models] == ["step_000000/model.ply"]
    assert len(read_ply(models[0])) == ply_count(models[0].parent, count) > 0
    assert r.stdout.count("done: 1 step(s) trained") == 1


# ------------------------------------------------------------------------------------------ bad input

BAD = {
    "raw size": (["run", "{d}/short_12x12x12_uint8.raw", "--iso", "1"],
                 r"short_12x12x12_uint8\.raw: file has 100 bytes, expected 1728"),
    "iso range": (["run", "{d}/ball_12x12x12_uint8.raw", "--iso", "300"],
                  r"iso value 300(\.0)? is outside the field's range \([0-9.]+, [0-9.]+\]"),
    "unknown key": (["run", "{d}/ball_12x12x12_uint8.raw", "--iso", "160", "--config", "{d}/unknown_key.yaml"],
                    r"train: unknown key\(s\) iterationz"),
    "wrong type": (["run", "{d}/ball_12x12x12_uint8.raw", "--iso", "160", "--config", "{d}/wrong_type.yaml"],
                   r"train\.iterations: expected an integer, got str 'many'"),
    "views 0": (["run", "{d}/ball_12x12x12_uint8.raw", "--iso", "160", "--views", "0"],
                r"views\.count: expected a value > 0, got 0"),
    "resolution -5": (["run", "{d}/ball_12x12x12_uint8.raw", "--iso", "160", "--resolution", "-5"],
                      r"views\.resolution: expected a value > 0, got -5"),
    "missing file": (["run", "{d}/missing_12x12x12_uint8.raw", "--iso", "160"],
                     r"missing_12x12x12_uint8\.raw: no such file"),
    "not 3D": (["run", "{d}/flat.npy", "--iso", "1"], r"expected a 3D array \[nz, ny, nx\], got 2D"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line_and_writes_no_step(inputs, tmp_path, case):
    args, message = BAD[case]
    r = insitu(*[a.format(d=inputs) for a in args], "--quiet", "--out", "out", cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("insitu: error: "), r.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not list(tmp_path.rglob("step_*")) and not list(tmp_path.rglob("*.ply"))
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["iso range", "missing file"])
def test_bad_input_on_two_ranks_exits_2_with_one_line(inputs, tmp_path, case):
    args, message = BAD[case]
    r = insitu(*[a.format(d=inputs) for a in args], "--quiet", "--out", "out", cwd=tmp_path, ranks=2, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("insitu: error: ")]
    assert len(lines) == 1 and re.search(message, lines[0]), r.stderr
    assert not list(tmp_path.rglob("step_*"))


# ------------------------------------------------------------------------------------------ demo

DEMO = ["demo", "--L", "16", "--steps", "40", "--plotgap", "20", "--views", "8", "--resolution", "24",
        "--iterations", "6", "--budget", "150", "--quiet", "--set", "views.supersample=1",
        "--set", "series.warm_iterations=4", "--out", "out"]


@pytest.mark.parametrize("ranks", [0, pytest.param(2, marks=pytest.mark.mpi)], ids=["1 process", "2 ranks"])
def test_demo_trains_every_plotgap(tmp_path, ranks):
    r = insitu(*DEMO, cwd=tmp_path, ranks=ranks, timeout=240)
    assert r.returncode == 0, r.stderr
    steps = sorted(p.name for p in (tmp_path / "out").glob("step_*"))
    assert steps == ["step_000020", "step_000040"]
    for s in steps:
        assert (tmp_path / "out" / s / "model.ply").is_file()
    assert [(s, it) for s, _, it in summaries(r.stdout)] == [(20, 6), (40, 4)]     # warm start at step 40


# ------------------------------------------------------------------------------------------ replay

@pytest.fixture(scope="module")
def gray_scott_bp(tmp_path_factory) -> Path:
    """A Gray-Scott run written to BP5: steps 10, 20, 30, 40 of a 16^3 grid."""
    d = tmp_path_factory.mktemp("gs")
    r = launch([sys.executable, SIM, "--L", "16", "--steps", "40", "--plotgap", "10", "--engine", "BP5",
                "--output", "gs.bp"], cwd=d)
    assert r.returncode == 0, r.stderr
    return d / "gs.bp"


REPLAY = ["--var", "U", "--iso", "0.6", *TINY, "--set", "series.warm_iterations=3", "--set", "series.warm_start=true",
          "--set", "series.follow_iterations=true"]


@pytest.mark.parametrize("select, steps", [([], [10, 20, 30, 40]), (["--every", "2"], [10, 30]),
                                           (["--steps", "20", "40"], [20, 40])],
                         ids=["all", "every 2", "steps 20 40"])
def test_replay_trains_the_selected_steps(gray_scott_bp, tmp_path, select, steps):
    r = insitu("replay", gray_scott_bp, *REPLAY, *select, "--out", "out", cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr
    got = summaries(r.stdout)
    assert [s for s, _, _ in got] == steps
    rows = [json.loads((tmp_path / "out" / f"step_{s:06d}" / "metrics.json").read_text()) for s in steps]
    assert [it for _, _, it in got] == [4] + [followed_iterations(m, 3, 4) for m in rows[1:]]   # warm after the first
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == [f"step_{s:06d}" for s in steps]
    for s, count, _ in got:
        d = tmp_path / "out" / f"step_{s:06d}"
        assert len(read_ply(d / "model.ply")) == ply_count(d, count)
    assert f"done: {len(steps)} step(s) trained" in r.stdout


def test_iterations_flag_bounds_warm_started_steps_too(gray_scott_bp, tmp_path):
    """``--iterations N`` is the iterations per step: a warm-started step must not train longer
    (series.warm_iterations is meant to shorten warm steps; with its default of 500, plain
    ``insitu replay ... --iterations 4`` trains the second step 500 iterations)."""
    r = insitu("replay", gray_scott_bp, "--var", "U", "--iso", "0.6", *TINY, "--steps", "10", "20",
               "--set", "series.warm_iterations=30", "--set", "series.warm_start=true", "--out", "out", cwd=tmp_path,
               timeout=240)
    assert r.returncode == 0, r.stderr
    assert [it for _, _, it in summaries(r.stdout)] == [4, 4]
