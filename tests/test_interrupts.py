"""Runs interrupted while they wait for the next step: a step's files are written while the source waits for the
next one (a BP file still being written, an SST stream), and Ctrl-C or SIGTERM (a batch job's time limit) ends the
run at once, keeping every step reported as written, leaving no lock and no half-written step."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY, ROOT, subprocess_env

from insitu.output.files import read_csv

# a BP file whose writer writes step 0, then waits (for the file "go", at most two minutes) before its step 1
WAITING_WRITER = """
import sys, time
from pathlib import Path
sys.modules["torch"] = None
import numpy as np, adios2
n = 12
z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float32)
with adios2.Stream("slow.bp", "w") as s:
    for i in range(2):
        if i:
            deadline = time.monotonic() + 120
            while not Path("go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        s.begin_step()
        s.write("U", np.sqrt((x - 5.5 - i) ** 2 + (y - 5.5) ** 2 + (z - 5.5) ** 2), [n] * 3, [0] * 3, [n] * 3)
        s.end_step()
        print("wrote", i, flush=True)
"""


def wait_for(predicate, seconds: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"{what}: the run ended (exit {proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds:g} s")
        time.sleep(0.05)


@pytest.mark.parametrize("sig, code, name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_step_is_written_while_the_next_is_awaited_and_a_signal_keeps_it(tmp_path, sig, code, name):
    writer = subprocess.Popen([sys.executable, "-c", WAITING_WRITER], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    out = tmp_path / "out"
    try:
        assert writer.stdout.readline() == "wrote 0\n", writer.stderr.read()
        run = subprocess.Popen([sys.executable, "-m", "insitu", "replay", "slow.bp", "--var", "U", "--iso", "3", *TINY,
                                "--set", "input.timeout_s=300", "--set", "series.warm_start=true", "--out", "out"], cwd=tmp_path, env=subprocess_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            # step 0 is complete on disk, with its row and report, while the replay waits for step 1
            wait_for(lambda: (out / "step_000000" / "metrics.json").is_file(), 60, "step 0 written", run)
            wait_for(lambda: (out / "report.html").is_file() and "step_000000" in (out / "report.html").read_text(),
                     10, "step 0 in the report", run)
            assert [r["step"] for r in read_csv(out / "metrics.csv")] == ["0"]
            assert writer.poll() is None and run.poll() is None and not list(out.glob(".step_*"))
            t0 = time.monotonic()
            run.send_signal(sig)
            stdout, stderr = run.communicate(timeout=30)
            seconds = time.monotonic() - t0
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
    finally:
        (tmp_path / "go").touch()
        writer.communicate(timeout=60)
    assert run.returncode == code, stderr
    assert seconds < 15, seconds            # at once, not when the writer's next step comes (minutes here)
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
        f"insitu: interrupted ({name}); 1 step(s) complete in out (0): give --resume to train the others"), stderr
    assert "step 0: surface PSNR" in stdout
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".", "step_"))) == \
        [".warm_start", "step_000000"]      # no lock, no temporary folder (the series' warm chain, and step 0)
    assert not list((out / ".warm_start").glob(".*.tmp"))
    assert {"metrics.json", "model.ply", "model.lit.spz"} <= {p.name for p in (out / "step_000000").iterdir()}
