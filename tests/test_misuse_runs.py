"""Runs that misuse the command line: ``--resume`` over an input changed since (its files' sizes and
modification times, and each step's field hash, are compared), ``insitu run``/``replay``/``stream`` without
an iso value (refused with the field's range), a surface too small to train (skipped, exit 2, never a
model reported as success) and figures that are not numbers (recorded and printed as absent, never nan)."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, bp_with_steps, insitu, launch, one_error, sphere_field

from insitu.output.files import read_csv

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{9}"


def changed_file(then: int, now: int) -> str:
    """The resume refusal's text for ball.npy of ``then`` bytes when kept, ``now`` bytes now (a pattern)."""
    return (rf"output\.dir out: --resume would keep steps made from another input or configuration \(step 0: ball\.npy "
            rf"\({then} bytes modified {STAMP} kept vs {now} bytes modified {STAMP} now\)\); give the same input and "
            r"settings, --overwrite, or another --out")


def spot(n: int = 12) -> np.ndarray:
    """Zero but for one sample of 1: at iso 0.5, a surface around that sample, under a pixel of a 16 px view."""
    field = np.zeros((n, n, n), np.float32)
    field[n // 2, n // 2, n // 2] = 1.0
    return field


def save_keeping_mtime(path: Path, array: np.ndarray) -> None:
    """Overwrite the .npy ``path`` with ``array`` and give it back its modification time (as ``cp -p`` or a
    file system with coarse times would): only the field's values tell the file changed."""
    st = path.stat()
    np.save(path, array)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ------------------------------------------------------------------------------------------ --resume, input changed

def test_resume_keeps_the_same_input_and_refuses_one_overwritten_since(tmp_path):
    field = tmp_path / "ball.npy"
    np.save(field, sphere_field(12))
    run = ("run", field, "--iso", "3", *TINY, "--out", "out")
    first = insitu(*run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("insitu run: ball.npy (12x12x12 samples), iso 3: 8 views of 16x16 px, 2 iterations "
                                    "of 4 view(s), on 1 rank(s) (cpu); outputs in out\n"), first.stdout
    step = tmp_path / "out" / "step_000000"
    recorded = json.loads((step / "metrics.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{24}", recorded["field_hash"]), recorded
    assert recorded["provenance"]["files"] == {"ball.npy": {"bytes": field.stat().st_size,
                                                           "mtime_ns": field.stat().st_mtime_ns}}
    assert "field_hash" not in read_csv(tmp_path / "out" / "metrics.csv")[0]
    stamp = (step / "metrics.json").stat().st_mtime_ns

    kept = insitu(*run, "--resume", cwd=tmp_path)           # unchanged: the step is kept
    assert kept.returncode == 0, kept.stderr
    assert "step 0: complete in out, kept (--resume)" in kept.stdout and "surface PSNR" not in kept.stdout

    save_keeping_mtime(field, sphere_field(12) + 0.5)          # other values, same size and time: the field hash
    line = one_error(insitu(*run, "--resume", cwd=tmp_path))
    assert re.search(r"output\.dir out: --resume would keep step 0, made from other values of its field than the "
                     r"input holds now \(field hash [0-9a-f]{24} kept vs [0-9a-f]{24} now\); give the input it was "
                     r"made from, --overwrite, or another --out", line), line
    assert recorded["field_hash"] in line

    size = field.stat().st_size
    np.save(field, sphere_field(12) + 1.0)                   # same size, written now: its modification time
    line = one_error(insitu(*run, "--resume", cwd=tmp_path))
    assert re.search(changed_file(size, size), line), line

    np.save(field, sphere_field(12, dtype=np.float64))      # another size
    line = one_error(insitu(*run, "--resume", cwd=tmp_path))
    assert re.search(changed_file(size, field.stat().st_size), line), line
    assert (step / "metrics.json").stat().st_mtime_ns == stamp      # the kept step was left as it was


def test_resume_of_a_replay_refuses_a_bp_file_written_again(tmp_path):
    path = bp_with_steps(tmp_path / "six.bp", [0, 10])
    run = ("replay", path, "--var", "U", "--iso", "3", *TINY, "--steps", "0", "--out", "out")
    first = insitu(*run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    files = json.loads((tmp_path / "out" / "step_000000" / "metrics.json").read_text())["provenance"]["files"]
    assert {"data.0", "md.0"} <= set(files), files
    bp_with_steps(path, [0, 10, 20])                         # the same name, written again
    line = one_error(insitu(*run, "--resume", cwd=tmp_path))
    assert re.search(rf"\(step 0: (data|md)\.\S+ \(\d+ bytes modified {STAMP} kept vs \d+ bytes modified {STAMP} "
                     r"now\)", line), line


# ------------------------------------------------------------------------------------------ no iso value

def test_run_without_iso_is_refused_with_the_field_range_before_any_work(tmp_path):
    np.save(tmp_path / "ball.npy", sphere_field(12))
    r = insitu("run", tmp_path / "ball.npy", *TINY, "--out", "out", cwd=tmp_path)
    line = one_error(r)
    assert re.fullmatch(r"insitu: error: no iso value given: give --iso V \(or input\.iso in a --config file\), the "
                        r"value whose isosurface is trained; ball\.npy ranges over \[0\.866025, 9\.52628\], and its "
                        r"histogram splits best at ([\d.]+) \(Otsu's threshold\): try --iso \1", line), line
    assert not (tmp_path / "out").exists() and "insitu run:" not in r.stdout


def test_replay_and_stream_without_iso_are_refused(tmp_path):
    path = bp_with_steps(tmp_path / "six.bp", [0])
    line = one_error(insitu("replay", path, "--var", "U", *TINY, "--out", "out", cwd=tmp_path))
    assert re.search(r"no iso value given: give --iso V \(or input\.iso in a --config file\), the value of U whose "
                     r"isosurface is trained; U \(step 0\) ranges over \[0\.866025, 9\.52628\]", line), line
    line = one_error(insitu("stream", "nowhere.bp", "--var", "U", *TINY, "--out", "out", cwd=tmp_path, timeout=60))
    assert "no iso value given: give --iso V" in line and "a stream's field is not read" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, config, given", [
    ([], None, False),
    (["--iso", "0.25"], None, True),                       # the default's value, given: given
    (["--set", "input.iso=0.5"], None, True),
    ([], "input:\n  iso: [0.0]\n", True),
    ([], "input:\n  iso: 1\n", True),
    ([], "train:\n  iterations: 3\n", False),
], ids=["nothing", "--iso", "--set", "file [0]", "file 1", "file without iso"])
def test_an_iso_value_is_given_by_a_flag_a_set_or_the_config_file(tmp_path, args, config, given):
    from insitu.cli import build_parser, iso_given

    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        args = [*args, "--config", str(tmp_path / "c.yaml")]
    assert iso_given(build_parser().parse_args(["run", "x.npy", *args])) is given


# ------------------------------------------------------------------------------------------ nothing to train

def earlier_results(out: Path) -> Path:
    """An output folder holding an earlier run's step 0 (metrics.json, config.yaml), without training one."""
    from insitu.config import Config
    from insitu.output.export import StepWriter

    return StepWriter(out).write(0, None, [], {"psnr": 30.0, "gaussians": 7}, Config())


def test_a_mistyped_var_or_an_iso_outside_every_step_is_refused_before_anything_is_written(tmp_path):
    path = bp_with_steps(tmp_path / "two.bp", [0, 10])          # U: [0.866, 9.53] at both steps
    replay = ("replay", path, *TINY, "--out", "out")
    line = one_error(insitu(*replay, "--var", "V", "--iso", "3", cwd=tmp_path))
    assert line == f"insitu: error: {path}: no variable 'V' in any of its 2 step(s); variables present: U, step"
    line = one_error(insitu(*replay, "--var", "U", "--color-var", "C", "--iso", "3", cwd=tmp_path))
    assert line.endswith("two.bp: no colour variable 'C' in any of its 2 step(s); variables present: U, step")
    line = one_error(insitu(*replay, "--var", "U", "--iso", "20", cwd=tmp_path))
    assert line == (f"insitu: error: {path}: no step has a surface at iso 20: U ranges over [0.866025, 9.52628] at "
                    "step 0, [0.866025, 9.52628] at step 10; an iso value must lie within a step's (min, max] (--iso)")
    assert not (tmp_path / "out").exists()
    np.save(tmp_path / "ball.npy", sphere_field(12))
    line = one_error(insitu("run", "ball.npy", "--iso", "0.5", *TINY, "--out", "out", cwd=tmp_path))
    assert line == ("insitu: error: ball.npy: iso value 0.5 is outside the field's range (0.8660253882, 9.526279449]: "
                    "no surface to extract (a sample equal to the iso value counts as above it)")
    assert not (tmp_path / "out").exists()
    # nothing lost: --overwrite of an earlier run's folder is refused before it deletes
    step = earlier_results(tmp_path / "kept")
    for args in (("--var", "V", "--iso", "3"), ("--var", "U", "--iso", "20")):
        one_error(insitu(*replay[:-1], "kept", *args, "--overwrite", cwd=tmp_path))
        assert (step / "metrics.json").is_file()


# ------------------------------------------------------------------------------------------ a surface too small

def test_a_surface_too_small_to_train_is_skipped_and_the_run_exits_2(tmp_path):
    np.save(tmp_path / "spot.npy", spot())
    r = insitu("run", tmp_path / "spot.npy", "--iso", "0.5", *TINY, "--out", "out", cwd=tmp_path)
    line = one_error(r)
    reason = re.fullmatch(r"insitu: error: (the isosurface at iso 0\.5 has only 8 triangle\(s\), about [\d.e-]+ pixels "
                          r"of a 16x16 view: too small to train; the field ranges over \[0, 1\]: give an iso value "
                          r"whose surface is larger \(--iso\), or a larger --resolution)", line)
    assert reason, line
    rows = read_csv(tmp_path / "out" / "metrics.csv")
    assert rows == [{"step": "0", "status": "skipped", "reason": reason[1]}], rows
    assert not list((tmp_path / "out").glob("step_*")) and "surface PSNR" not in r.stdout
    assert "nan" not in (r.stdout + r.stderr).lower()
    # a folder that holds no step holds no result: the run with another iso value takes it as it is
    np.save(tmp_path / "ball.npy", sphere_field(12))
    r = insitu("run", tmp_path / "ball.npy", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in read_csv(tmp_path / "out" / "metrics.csv")] == ["0"]


# ------------------------------------------------------------------------------------------ never nan

def test_figures_that_are_not_numbers_are_recorded_and_printed_as_absent(tmp_path):
    from insitu.config import Config
    from insitu.output.export import StepWriter
    from insitu.progress import summary

    nan = float("nan")
    metrics = {"psnr_foreground": 31.5, "ssim_foreground": 0.97, "psnr_foreground_near2": nan,
               "psnr_foreground_near3": 22.25, "psnr": 40.0, "psnr_foreground_initial": nan, "gaussians": 7,
               "iterations": 2, "ground_truth_seconds": 1.0, "train_seconds": 2.0}
    folder = StepWriter(tmp_path / "out").write(0, None, [], metrics, Config())
    row, = read_csv(tmp_path / "out" / "metrics.csv")
    assert row["psnr_foreground_near2"] == "" and row["psnr_foreground_initial"] == "" and row["psnr"] == "40.0"
    recorded = json.loads((folder / "metrics.json").read_text())
    assert recorded["psnr_foreground_near2"] is None and recorded["psnr_foreground_near3"] == 22.25
    for text in ((tmp_path / "out" / "metrics.csv").read_text(), (tmp_path / "out" / "report.html").read_text()):
        assert "nan" not in text.lower()
    line = summary({**metrics, "step": 0}, tmp_path / "out")
    assert "(2x and 3x closer: n/a and 22.2 dB)" in line and "nan" not in line.lower(), line
    line = summary({**metrics, "step": 0, "psnr_foreground_near3": nan}, tmp_path / "out")
    assert "closer" not in line and "nan" not in line.lower(), line


def test_one_seed_converts_to_torch_without_a_user_warning(tmp_path):
    """A surface with one Gaussian: its colour was a read-only broadcast view, which torch warns about."""
    code = ("import numpy as np\n"
            "from insitu.input.decomposition import cut_block\n"
            "from insitu.surface.seeds import extract_seeds, init_gaussians\n"
            "field = np.zeros((12, 12, 12), np.float32); field[6, 6, 6] = 1\n"
            "print(len(init_gaussians(extract_seeds(cut_block(field, 0, 1), [0.5]), 1)))\n")
    r = launch([sys.executable, "-W", "error::UserWarning", "-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr


def test_log_progress_reports_the_first_unit_of_work(capsys):
    from insitu.progress import LogProgress

    bar = LogProgress(448, "ground truth")
    bar.update(1)
    assert re.fullmatch(r"ground truth: 1/448 \([\d.]+ s\)\n", capsys.readouterr().err)
    for _ in range(447):
        bar.update(1)
    counts = re.findall(r"ground truth: (\d+)/448", capsys.readouterr().err)
    assert counts == [str(44 * k) for k in range(1, 11)] + ["448"], counts
