"""An output folder's safety, as a user meets it on the command line: one run at a time (the folder is
locked, a second run is refused naming the first), ``--resume`` keeps only steps made from the same input
and configuration, a run killed at the wrong moment is resumed with its metrics and report rebuilt and its
temporary files removed, a full disk is one line naming ENOSPC and the file, and output paths that cannot
work are refused before any work."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, bp_with_steps, insitu, launch, mpiexec, one_error, sphere_field, subprocess_env

from insitu.output.files import read_csv
from insitu.output.folder import LOCK_NAME, lock_output


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    np.save(d / "ball.npy", sphere_field(12))
    np.save(d / "ball2.npy", sphere_field(12))
    bp_with_steps(d / "six.bp", [0, 10, 20, 30, 40, 50])
    return d


def run_args(inputs: Path, out, *extra) -> list:
    return ["run", inputs / "ball.npy", "--iso", "3", *TINY, "--out", out, *extra]


def start(*args, cwd: Path) -> subprocess.Popen:
    """``python -m insitu ARGS`` in the background."""
    return subprocess.Popen([sys.executable, "-m", "insitu", *map(str, args)], cwd=cwd, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 300) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < seconds, f"{path} did not appear"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ one run at a time

def test_a_run_on_a_folder_another_process_holds_is_refused_naming_its_pid_and_host(inputs, tmp_path):
    out = tmp_path / "out"
    with lock_output(out, "insitu replay m16.bp"):
        r = insitu(*run_args(inputs, out), cwd=tmp_path)
        line = one_error(r)
        assert (f"output.dir {out}: in use by another run (PID {os.getpid()} on {socket.gethostname()}, "
                "insitu replay m16.bp, since ") in line
        assert "step 0:" not in r.stdout
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    assert not out.exists()                          # the lock made the folder; released, nothing is left


def test_a_second_run_while_the_first_writes_is_refused_and_the_first_ones_results_stay_its_own(inputs, tmp_path):
    out = tmp_path / "out"
    first = start("replay", inputs / "six.bp", "--var", "U", "--iso", "3", *TINY, "--out", out, cwd=tmp_path)
    try:
        wait_for(out / LOCK_NAME, first)
        first.send_signal(signal.SIGSTOP)           # the first run holds its lock, still writing, all along the second
        try:
            second = insitu("replay", inputs / "six.bp", "--var", "U", "--iso", "5", *TINY, "--steps", "0", "10",
                            "--out", out, cwd=tmp_path)
        finally:
            first.send_signal(signal.SIGCONT)
        assert f"in use by another run (PID {first.pid} on {socket.gethostname()}, insitu replay" in one_error(second)
    finally:
        stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    rows = read_csv(out / "metrics.csv")
    assert [(r["step"], r["status"]) for r in rows] == [(str(s), "trained") for s in (0, 10, 20, 30, 40, 50)]
    for s in (0, 10):
        assert "- 3.0" in (out / f"step_{s:06d}" / "config.yaml").read_text()     # input.iso of the first run
    assert not (out / LOCK_NAME).exists()


def test_resume_never_deletes_the_temporary_folder_of_a_run_that_is_writing(inputs, tmp_path):
    out = tmp_path / "out"
    partial = out / ".step_000003.abcd1234.tmp"
    partial.mkdir(parents=True)
    (partial / "model.ply").write_bytes(b"being written")
    with lock_output(out, "insitu run other.npy"):
        r = insitu(*run_args(inputs, out, "--resume"), cwd=tmp_path)
        assert "in use by another run" in one_error(r)
        assert (partial / "model.ply").read_bytes() == b"being written"


def test_a_killed_run_leaves_no_lock_and_is_resumed(inputs, tmp_path):
    out = tmp_path / "out"
    slow = ["--var", "U", "--iso", "3", *TINY, "--iterations", "100"]
    first = start("replay", inputs / "six.bp", *slow, "--out", out, cwd=tmp_path)
    try:
        wait_for(out / "step_000000" / "metrics.json", first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert (out / LOCK_NAME).exists()                # the killed run's record stays; its lock went with it
    r = insitu("replay", inputs / "six.bp", *slow, "--steps", "0", "10", "--resume", "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 0: complete in" in r.stdout
    rows = read_csv(out / "metrics.csv")
    assert [(row["step"], row["status"]) for row in rows][:2] == [("0", "trained"), ("10", "trained")]
    assert (out / "report.html").is_file() and not (out / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------ --resume compares

def test_resume_refuses_kept_steps_of_another_configuration_naming_the_keys(inputs, tmp_path):
    first = insitu(*run_args(inputs, "out"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    model = tmp_path / "out" / "step_000000" / "model.ply"
    stamp = model.stat().st_mtime_ns
    r = insitu(*run_args(inputs, "out", "--resume", "--iso", "4", "--resolution", "24"), cwd=tmp_path)
    line = one_error(r)
    assert ("output.dir out: --resume would keep steps made from another input or configuration (step 0: "
            "input.iso ([3.0] kept vs [4.0] now); views.resolution (16 kept vs 24 now)); give the same input and "
            "settings, --overwrite, or another --out") in line
    assert model.stat().st_mtime_ns == stamp and "step 0:" not in r.stdout


@pytest.mark.parametrize("change, key", [
    (["--spacing", "2", "1", "1"], "spacing ([1.0, 1.0, 1.0] kept vs [2.0, 1.0, 1.0] now)"),
    ("ball2", "ball.npy' kept vs '"),
], ids=["spacing", "input file"])
def test_resume_refuses_kept_steps_of_another_input(inputs, tmp_path, change, key):
    assert insitu(*run_args(inputs, "out"), cwd=tmp_path).returncode == 0
    args = run_args(inputs, "out", "--resume")
    if change == "ball2":
        args[1] = inputs / "ball2.npy"
    else:
        args += change
    line = one_error(insitu(*args, cwd=tmp_path))
    assert "--resume would keep steps made from another input or configuration (step 0: " in line and key in line


def test_resume_accepts_settings_that_change_only_how_the_run_runs(inputs, tmp_path):
    assert insitu(*run_args(inputs, "out"), cwd=tmp_path).returncode == 0
    r = insitu(*run_args(inputs, "out", "--resume", "--set", "run.timeout_s=100", "--set", "run.threads=1"),
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 0: complete in out, kept (--resume)" in r.stdout


# ------------------------------------------------------------------------------------------ killed at the wrong moment

def test_resume_rebuilds_metrics_and_report_from_the_steps_and_removes_what_a_killed_run_was_writing(inputs, tmp_path):
    out = tmp_path / "out"
    r = insitu("replay", inputs / "six.bp", "--var", "U", "--iso", "3", *TINY, "--steps", "0", "10", "--out", out,
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    figures = {s: json.loads((out / f"step_{s:06d}" / "metrics.json").read_text()) for s in (0, 10)}
    # what a kill while step 10's row went into metrics.csv, and another before the report, leave behind
    rows = read_csv(out / "metrics.csv")
    (out / "metrics.csv").write_text("step,status,psnr\n0,trained," + rows[0]["psnr"] + "\n")
    orphans = [out / ".metrics.csv.0123456789ab.tmp", out / ".report.html.0123456789ab.tmp",
               out / "viewer" / ".viewer.js.0123456789ab.tmp"]
    for p in orphans:
        p.write_text("half")
    (out / "report.html").unlink()
    (out / "report.json").unlink()
    r = insitu("replay", inputs / "six.bp", "--var", "U", "--iso", "3", *TINY, "--steps", "0", "10", "--resume",
               "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "done: 0 step(s) trained, 2 kept from the earlier run (--resume)" in r.stdout
    rows = {row["step"]: row for row in read_csv(out / "metrics.csv")}
    for s in (0, 10):
        assert rows[str(s)]["status"] == "trained"
        assert float(rows[str(s)]["psnr"]) == pytest.approx(figures[s]["psnr"])
        assert float(rows[str(s)]["gaussians"]) == figures[s]["gaussians"]
    assert [s["step"] for s in json.loads((out / "report.json").read_text())["steps"]] == [0, 10]
    assert "Step 10" in (out / "report.html").read_text()
    assert not any(p.exists() for p in orphans)


# ------------------------------------------------------------------------------------------ whole steps only

def written(out: Path, step: int) -> Path:
    """A step as the writer writes it (metrics.json recording its files, config.yaml, a held-out image), untrained."""
    from insitu.config import Config
    from insitu.output.export import StepWriter

    image = np.full((4, 4, 3), 0.5, np.float32)
    return StepWriter(out).write(step, None, [("test_000", image, image)], {"psnr": 30.0, "gaussians": 7}, Config())


def test_resume_keeps_only_steps_whose_files_are_whole_and_says_which_are_trained_again(tmp_path, capsys):
    from insitu.output.export import prepare_output

    out = tmp_path / "out"
    folders = [written(out, s) for s in range(4)]
    recorded = json.loads((folders[0] / "metrics.json").read_text())["files"]
    assert recorded == {p.relative_to(folders[0]).as_posix(): p.stat().st_size
                        for p in folders[0].rglob("*") if p.is_file() and p.name != "metrics.json"}
    assert set(recorded) == {"config.yaml", "views/test_000.png"}
    (folders[1] / "views" / "test_000.png").unlink()
    os.truncate(folders[2] / "config.yaml", 100)
    (folders[3] / "metrics.json").write_text('{"step": 3, "psnr": 3')         # cut short
    capsys.readouterr()
    assert prepare_output(out, "resume") == [0]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"insitu: warning: output.dir {out}: step 1 is not whole (views/test_000.png is missing): it is "
                   "trained again",
                   f"insitu: warning: output.dir {out}: step 2 is not whole (config.yaml has 100 bytes, its "
                   f"metrics.json records {recorded['config.yaml']}): it is trained again",
                   f"insitu: warning: output.dir {out}: step 3 is not whole (its metrics.json cannot be read: "
                   "Expecting ',' delimiter: line 1 column 22 (char 21)): it is trained again"], err
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000000"]


def test_resume_of_a_replay_whose_model_files_were_cut_trains_those_steps_again(inputs, tmp_path):
    out = tmp_path / "out"
    replay = ("replay", inputs / "six.bp", "--var", "U", "--iso", "3", *TINY, "--steps", "0", "10", "20", "--out", out)
    assert insitu(*replay, cwd=tmp_path).returncode == 0
    (out / "step_000010" / "model.lit.spz").unlink()
    os.truncate(out / "step_000020" / "model.ply", 100)
    r = insitu(*replay, "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 10 is not whole (model.lit.spz is missing): it is trained again" in r.stderr
    assert re.search(r"step 20 is not whole \(model\.ply has 100 bytes, its metrics\.json records \d+\)", r.stderr)
    assert all(text in r.stdout for text in ("step 0: complete in", "step 10: surface PSNR", "step 20: surface PSNR"))
    assert "done: 2 step(s) trained, 1 kept from the earlier run (--resume)" in r.stdout
    from insitu.output.export import step_whole
    assert all(step_whole(out / f"step_{s:06d}") is None for s in (0, 10, 20))


# ------------------------------------------------------------------------------------------ only what insitu wrote

@pytest.mark.parametrize("existing", ["overwrite", "resume"])
def test_overwrite_and_resume_delete_only_step_folders_insitu_wrote_and_name_the_others(tmp_path, existing):
    from insitu.config import ConfigError
    from insitu.output.export import prepare_output

    out = tmp_path / "out"
    written(out, 0)
    mine = out / "step_000777" / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("a user's")
    with pytest.raises(ConfigError, match=rf"^output.dir {out}: step_000777 is not a step folder insitu wrote \(it has "
                                          rf"no metrics.json\), and --{existing} deletes only what insitu wrote; move "
                                          "it away, or give another --out$"):
        prepare_output(out, existing)
    assert mine.is_file() and (out / "step_000000" / "metrics.json").is_file()
    mine.unlink()
    mine.parent.rmdir()
    step = written(out, 1)                                      # a step insitu wrote, with a user's file added
    (step / "notes.txt").write_text("mine")
    (step / "views" / "mine.jpg").write_text("mine")
    os.truncate(step / "config.yaml", 10)                        # (not whole: resume would delete it too)
    with pytest.raises(ConfigError, match=r"step_000001 is not a step folder insitu wrote \(it holds notes.txt, "
                                          r"views/mine.jpg, which insitu does not write\)"):
        prepare_output(out, existing)
    assert (step / "notes.txt").is_file()
    (step / "notes.txt").unlink()
    (step / "views" / "mine.jpg").unlink()
    (out / ".warm_start").mkdir()
    assert prepare_output(out, existing) == ([] if existing == "overwrite" else [0])
    assert (out / ".warm_start").exists() == (existing == "resume")


def test_overwrite_on_the_command_line_leaves_a_users_step_folder(inputs, tmp_path):
    mine = tmp_path / "out" / "step_000777" / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("a user's")
    line = one_error(insitu(*run_args(inputs, "out", "--overwrite"), cwd=tmp_path))
    assert "output.dir out: step_000777 is not a step folder insitu wrote (it has no metrics.json)" in line
    assert mine.read_text() == "a user's" and sorted(os.listdir(tmp_path / "out")) == ["step_000777"]


# ------------------------------------------------------------------------------------------ the warm chain resumed

def test_a_resumed_series_equals_the_uninterrupted_one(inputs, tmp_path):
    """A replay stopped after two steps (as a killed job's) and resumed goes on from the kept step's model, saved at
    full precision: every later step as the uninterrupted run's, bit for bit. Without that state (an earlier
    insitu's steps) the next step starts cold, said, and the series' cold steps stay where they were."""
    series = ("replay", inputs / "six.bp", "--var", "U", "--iso", "3", *TINY, "--set", "series.cold_every=3",
              "--set", "series.warm_start=true")
    steps = ("--steps", "0", "10", "20", "30")
    assert insitu(*series, *steps, "--out", "whole", cwd=tmp_path).returncode == 0
    assert insitu(*series, "--steps", "0", "10", "--out", "cut", cwd=tmp_path).returncode == 0
    assert sorted(os.listdir(tmp_path / "cut" / ".warm_start")) == ["step_000000.rank0of1.pt",
                                                                     "step_000010.rank0of1.pt"]
    shutil.copytree(tmp_path / "cut", tmp_path / "old")
    shutil.rmtree(tmp_path / "old" / ".warm_start")
    r = insitu(*series, *steps, "--resume", "--out", "cut", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 10 (kept, --resume): its model restored as the next step's warm start" in r.stdout
    old = insitu(*series, *steps, "--resume", "--out", "old", cwd=tmp_path)
    assert old.returncode == 0, old.stderr
    assert ("insitu: warning: step 10 (kept, --resume): its model cannot be restored as the next step's warm start "
            "(no state of it is saved in .warm_start (written by an earlier insitu, or removed)): the next step starts "
            "cold, and the steps up to the series' next cold one differ from an uninterrupted run's") in old.stdout

    def figures(out: str, step: int) -> tuple:
        m = json.loads((tmp_path / out / f"step_{step:06d}" / "metrics.json").read_text())
        return m["warm_chain"], m["gaussians"], m["psnr_foreground"], m["files"]["model.ply"]

    for step in (20, 30):
        assert figures("cut", step) == figures("whole", step), step
    assert [figures(out, 20)[0] for out in ("whole", "old")] == [2, 0]          # cold instead of warm
    assert figures("old", 30) == figures("whole", 30)                            # the cold step where it was


# ------------------------------------------------------------------------------------------ disk full

@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_full_disk_is_one_line_naming_enospc_and_the_file_and_leaves_no_half_step(inputs, tmp_path, ranks):
    if not shutil.which("unshare"):
        pytest.fail("this test mounts a small tmpfs in a user and mount namespace: it needs unshare (util-linux)")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = [sys.executable, "-m", "insitu", *map(str, run_args(inputs, disk / "out"))]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    script = (f"mount -t tmpfs -o size=8k tmpfs {disk} || exit 99\n"
              + " ".join(f"'{c}'" for c in command) + "\necho rc=$?\nls -A " + str(disk / "out") + "\n")
    r = launch(["unshare", "--map-root-user", "--mount", "sh", "-c", script], cwd=tmp_path, timeout=300)
    assert r.returncode != 99, f"cannot mount a tmpfs in a user namespace here: {r.stderr}"
    assert "rc=1" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "MPI_Abort" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("insitu: error: ")]
    assert len(errors) == 1, r.stderr
    assert "No space left on device (ENOSPC)" in errors[0], errors[0]
    fitted = re.search(r"/(model\.(ply|spz|lit\.spz)|views/\w+\.png)'", errors[0])     # the file that did not fit
    assert fitted, errors[0]
    listed = r.stdout.split("rc=1", 1)[1].split()
    assert not [name for name in listed if name.startswith(("step_", ".step_"))], listed   # no half step


# ------------------------------------------------------------------------------------------ paths that cannot work

@pytest.mark.parametrize("case, message", [
    ("not utf-8", r"output.dir b'out\xff': the name is not UTF-8 text; give a folder name in UTF-8"),
    ("dangling link", "output.dir out: out is a symbolic link to {tmp}/nowhere, which does not exist"),
    ("under a dangling link", "output.dir out/sub: out is a symbolic link to {tmp}/nowhere, which does not exist"),
    ("metrics.csv a folder", "output.dir out: out/metrics.csv is a folder, expected a file (the run writes it)"),
    ("viewer a file", "output.dir out: out/viewer is a file, expected a folder (the report's viewer goes there)"),
    ("step folder a file", "output.dir out: out/step_000000 is a file, expected a step folder"),
    ("empty", "output.dir: expected a folder name, got ''"),
])
def test_output_paths_that_cannot_work_are_refused_before_any_work(inputs, tmp_path, case, message):
    out: str | bytes = "out"
    if case == "not utf-8":
        out = b"out\xff"
    elif case in ("dangling link", "under a dangling link"):
        (tmp_path / "out").symlink_to(tmp_path / "nowhere")
        out = "out" if case == "dangling link" else "out/sub"
    elif case == "metrics.csv a folder":
        (tmp_path / "out" / "metrics.csv").mkdir(parents=True)
    elif case == "viewer a file":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "viewer").write_text("")
    elif case == "step folder a file":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "step_000000").write_text("")
    elif case == "empty":
        out = ""
    before = sorted(os.listdir(tmp_path))
    r = insitu(*run_args(inputs, out), cwd=tmp_path)
    line = one_error(r)
    assert message.format(tmp=tmp_path) in line, line
    assert "step 0:" not in r.stdout
    assert sorted(os.listdir(tmp_path)) == before
    assert not (tmp_path / "nowhere").exists()
