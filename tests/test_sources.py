"""Timestep sources: arrays, raw files, ADIOS2 BP replay and SST streams, and their faults.

SST writers and readers run as separate processes (the Gray-Scott mini-app writes, the
reader is tests/mpi/source_worker.py), each with a timeout."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import adios2
import numpy as np
import pytest
from mpi4py import MPI
from conftest import launch

from insitu.config import Config, from_dict
from insitu.errors import InputError, SourceError, SourceInputError
from insitu.input.decomposition import cut_block
from insitu.input.sources import ArraySource, BPSource, RawSource, SSTSource, Step, open_source

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "sims" / "insitu_sims" / "gray_scott.py"
WORKER = ROOT / "tests" / "mpi" / "source_worker.py"
sys.path.insert(0, str(ROOT / "sims"))

from insitu_sims.gray_scott import GrayScottSettings, run  # noqa: E402

GS = dict(L=16, steps=60, plotgap=10, noise=0.1, seed=3)
GS_ARGS = ["--L", "16", "--steps", "60", "--plotgap", "10", "--noise", "0.1", "--seed", "3"]


def full(path: Path, var: str = "U") -> dict[int, np.ndarray]:
    """step number -> global [nz, ny, nx] array of ``var`` (read whole, for comparisons)."""
    with adios2.FileReader(str(path)) as f:
        n = f.num_steps()
        numbers = np.atleast_1d(f.read("step", step_selection=[0, n]))
        data = f.read(var, step_selection=[0, n])
    per = data.shape[0] // n
    return {int(s): data[i * per:(i + 1) * per] for i, s in enumerate(numbers)}


def box(array: np.ndarray, step: Step) -> np.ndarray:
    (x, y, z), (nz, ny, nx) = step.block.start, step.block.data.shape
    return array[z:z + nz, y:y + ny, x:x + nx]


@pytest.fixture(scope="module")
def gs_bp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bp") / "gs.bp"
    run(GrayScottSettings(**GS, engine="BP5", output=str(path)), MPI.COMM_SELF)
    return path


def write_bp(path: Path, variables: dict[str, np.ndarray], attributes: dict | None = None, steps: int = 1,
             numbers: list[int] | None = None) -> Path:
    """A BP file with the same ``variables`` in every step (and a ``step`` variable if ``numbers``)."""
    with adios2.Stream(str(path), "w") as s:
        for name, value in (attributes or {}).items():
            s.write_attribute(name, np.asarray(value, dtype=np.float64))
        for i in range(len(numbers) if numbers else steps):
            s.begin_step()
            for name, a in variables.items():
                s.write(name, a, list(a.shape), [0] * a.ndim, list(a.shape))
            if numbers:
                s.write("step", int(numbers[i]))
            s.end_step()
    return path


# ---- arrays and raw files -------------------------------------------------------------------

def test_array_source_cuts_this_ranks_block():
    a = np.random.default_rng(0).random((9, 10, 11))
    c = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    for rank in range(2):
        with ArraySource(a, rank=rank, size=2, spacing=(1, 2, 3), fields={"c": c}, step=5, time=2.5) as src:
            steps = list(src)
        assert len(steps) == 1 and (steps[0].step, steps[0].time) == (5, 2.5)
        want = cut_block(a, rank, 2, spacing=(1, 2, 3), fields={"c": c})
        b = steps[0].block
        np.testing.assert_array_equal(b.data, want.data)
        np.testing.assert_array_equal(b.fields["c"], want.fields["c"])
        assert (b.start, b.owned_lo, b.owned_hi, b.spacing) == (want.start, want.owned_lo, want.owned_hi, (1, 2, 3))
    b = list(ArraySource(a, downsample=2))[0].block
    assert b.data.shape == (4, 5, 5) and b.spacing == (2.0, 2.0, 2.0) and b.global_shape == (5, 5, 4)


def test_array_source_checks_its_input():
    with pytest.raises(InputError, match="expected a 3D array"):
        ArraySource(np.zeros((4, 4)))
    with pytest.raises(InputError, match="c: expected the shape of field"):
        ArraySource(np.zeros((4, 4, 4)), fields={"c": np.zeros((4, 4, 3))})
    with pytest.raises(ValueError, match="expected 0 <= rank < size"):
        ArraySource(np.zeros((4, 4, 4)), rank=2, size=2)


def test_raw_source_reads_the_name_convention(tmp_path):
    a = np.random.default_rng(1).integers(0, 255, (4, 5, 6), dtype=np.uint8)
    path = tmp_path / "vol_6x5x4_uint8.raw"
    a.tofile(path)
    b = list(RawSource(path, rank=1, size=2))[0].block
    np.testing.assert_array_equal(b.data, cut_block(a, 1, 2).data)
    assert b.global_shape == (6, 5, 4)
    (tmp_path / "bad_6x5x5_uint8.raw").write_bytes(a.tobytes())
    with pytest.raises(InputError, match="file has 120 bytes, expected 150"):
        RawSource(tmp_path / "bad_6x5x5_uint8.raw")


# ---- BP replay --------------------------------------------------------------------------------

def test_bp_replay_reads_each_ranks_block_with_ghosts(gs_bp):
    ref, refv = full(gs_bp, "U"), full(gs_bp, "V")
    for rank in range(3):
        with BPSource(gs_bp, "U", rank=rank, size=3, color_var="V") as src:
            steps = list(src)
        assert [s.step for s in steps] == [10, 20, 30, 40, 50, 60]
        assert [s.time for s in steps] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
        want = cut_block(ref[60], rank, 3)
        b = steps[-1].block
        assert (b.start, b.owned_lo, b.owned_hi, b.global_shape) == \
               (want.start, want.owned_lo, want.owned_hi, (16, 16, 16))
        for s in steps:
            np.testing.assert_array_equal(s.block.data, box(ref[s.step], s))
            np.testing.assert_array_equal(s.block.fields["V"], box(refv[s.step], s))
        assert b.origin == (0.0, 0.0, 0.0) and b.spacing == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("steps, every, want", [
    ([20, 40, 60], 1, [20, 40, 60]),
    (None, 2, [10, 30, 50]),
    (None, 4, [10, 50]),
    ([20, 30, 40, 60, 70], 2, [20, 40]),
    ([5, 15], 1, []),
])
def test_bp_steps_selection_and_every(gs_bp, steps, every, want):
    with BPSource(gs_bp, "U", steps=steps, every=every, probe=False) as src:
        assert [s.step for s in src] == want


def test_bp_origin_and_spacing_come_from_attributes(tmp_path):
    a = np.random.default_rng(2).random((3, 4, 5))
    with_attrs = write_bp(tmp_path / "a.bp", {"f": a}, {"origin": [1, 2, 3], "spacing": [0.5, 0.25, 2]})
    b = list(BPSource(with_attrs, "f"))[0].block
    assert b.origin == (1.0, 2.0, 3.0) and b.spacing == (0.5, 0.25, 2.0) and b.global_shape == (5, 4, 3)
    np.testing.assert_array_equal(b.data, a)
    s = list(BPSource(write_bp(tmp_path / "b.bp", {"f": a}, steps=2), "f"))
    assert [x.step for x in s] == [0, 1] and [x.time for x in s] == [0.0, 1.0]      # no step/time variables
    assert s[0].block.origin == (0.0, 0.0, 0.0) and s[0].block.spacing == (1.0, 1.0, 1.0)
    with pytest.raises(SourceInputError, match=r"attribute spacing: expected 3 values \(x, y, z\)"):
        list(BPSource(write_bp(tmp_path / "c.bp", {"f": a}, {"spacing": [1, 2]}), "f"))


def test_bp_missing_variable_skips_the_step_listing_the_variables_present(gs_bp):
    # probed: a variable in none of the steps is refused before any is read (a mistyped name)
    with pytest.raises(SourceInputError, match=r"gs.bp: no variable 'W' in any of its 6 step\(s\); variables present: "
                                               "U, V, step, time$"):
        BPSource(gs_bp, "W")
    with pytest.raises(SourceInputError, match=r"no colour variable 'C' in any of the 1 step\(s\) asked for "
                                               r"\(--steps\); variables present: U, V, step, time$"):
        BPSource(gs_bp, "U", color_var="C", steps=[10])
    src = BPSource(gs_bp, "W", probe=False)          # each step without it is skipped, saying why
    assert list(src) == [] and len(src.skipped) == 6
    assert src.skipped[0] == (10, "no variable 'W' at step 10; variables present: U, V, step, time")
    src = BPSource(gs_bp, "U", color_var="C", steps=[10], probe=False)
    assert list(src) == [] and src.skipped == [(10, "no colour variable 'C' at step 10; variables present: U, V, "
                                                    "step, time")]


def test_bp_variable_that_is_not_3d(tmp_path, gs_bp):
    path = write_bp(tmp_path / "flat.bp", {"plane": np.zeros((4, 5)), "thin": np.zeros((1, 4, 5)),
                                           "f": np.zeros((2, 4, 5)), "g": np.zeros((3, 4, 5))})

    def reason(*args, **kw) -> str:
        src = BPSource(*args, **kw)
        assert list(src) == []
        return src.skipped[0][1]
    assert reason(path, "plane") == ("variable 'plane' is shape (4, 5) (double) at step 0, expected a 3D global "
                                     "array [z, y, x] with >= 2 samples per axis")
    assert reason(path, "thin").startswith("variable 'thin' is shape (1, 4, 5)")
    assert reason(gs_bp, "step", steps=[10]).startswith("variable 'step' is a single value (int64_t) at step 10")
    assert reason(path, "f", color_var="g") == ("colour variable 'g' has shape (3, 4, 5), expected the shape of 'f' "
                                                "(2, 4, 5) (step 0)")


def test_bp_file_that_does_not_exist(tmp_path):
    with pytest.raises(SourceInputError, match="nope.bp: no such file or directory"):
        BPSource(tmp_path / "nope.bp", "U")
    (tmp_path / "file.bp").write_text("not a BP directory")
    with pytest.raises(SourceInputError, match="expected an ADIOS2 BP4 or BP5 directory, got a file"):
        BPSource(tmp_path / "file.bp", "U")
    (tmp_path / "empty.bp").mkdir()
    with pytest.raises(SourceInputError, match="not an ADIOS2 BP directory .no md.idx"):
        BPSource(tmp_path / "empty.bp", "U")


@pytest.mark.parametrize("name, cut, yielded, message", [
    ("data.0", -8, [10, 20, 30, 40, 50], r"data.0 has \d+ bytes; step 60 \(ADIOS step index 5\) needs at least"),
    ("data.0", 0.5, None, r"data.0 has \d+ bytes; ADIOS step index \d needs at least"),
    ("md.0", -1, None, r"md.0 has \d+ bytes; the metadata of ADIOS step index 5 needs"),
    ("mmd.0", -1, None, "mmd.0 is cut short"),
    ("md.idx", -1, None, r"md.idx record at byte \d+ is cut short"),
    ("md.idx", 10, None, "md.idx: truncated or corrupt index"),
])
def test_bp_truncated_file_gives_a_clear_error(gs_bp, tmp_path, name, cut, yielded, message):
    # ADIOS2 itself hangs or crashes on these: the source must check before it reads
    path = tmp_path / "cut.bp"
    shutil.copytree(gs_bp, path)
    size = (path / name).stat().st_size
    os.truncate(path / name, int(size * cut) if isinstance(cut, float) else (size + cut if cut < 0 else cut))
    got = []
    with pytest.raises(SourceInputError, match=message):
        for s in BPSource(path, "U"):
            got.append(s.step)
    if yielded is not None:
        assert got == yielded        # every complete step before the truncated one


@pytest.mark.parametrize("name, offset, message", [
    ("mmd.0", 40, r"ADIOS2 crashed reading its metadata, signal 11"),
    ("md.0", 0, r"file corruption, no know format for Metadata Block"),
])
def test_bp_corrupt_metadata_gives_a_clear_error(gs_bp, tmp_path, name, offset, message):
    path = tmp_path / "bad.bp"
    shutil.copytree(gs_bp, path)
    raw = bytearray((path / name).read_bytes())
    raw[offset:offset + 64] = b"\xab" * 64
    (path / name).write_bytes(bytes(raw))
    with pytest.raises(SourceInputError, match=message):
        BPSource(path, "U")


def test_a_stream_is_iterated_once(gs_bp):
    src = BPSource(gs_bp, "U", steps=[10], probe=False)
    assert [s.step for s in src] == [10]
    with pytest.raises(SourceError, match="can be iterated once"):
        list(src)


def test_open_source_picks_the_kind(gs_bp, tmp_path):
    cfg = Config()
    assert isinstance(open_source(gs_bp, cfg), BPSource)
    assert isinstance(open_source(f"bp:{gs_bp}", cfg, 1, 2), BPSource)
    src = open_source("replay", str(gs_bp), from_dict({"input": {"steps": [30], "var": "V"}}), 1, 2)
    (step,) = list(src)
    assert step.step == 30 and step.block.start == cut_block(np.zeros((16, 16, 16)), 1, 2).start
    np.testing.assert_array_equal(step.block.data, box(full(gs_bp, "V")[30], step))
    np.zeros((4, 5, 6), np.uint8).tofile(tmp_path / "v_6x5x4_uint8.raw")
    assert isinstance(open_source(str(tmp_path / "v_6x5x4_uint8.raw"), cfg), RawSource)
    assert isinstance(open_source(np.zeros((3, 3, 3)), cfg), ArraySource)
    with pytest.raises(SourceInputError, match="cannot tell the kind of source"):
        open_source(str(tmp_path / "v.h5"), cfg)
    with pytest.raises(SourceInputError, match="a colour field needs a BP or SST source"):
        open_source(np.zeros((3, 3, 3)), from_dict({"input": {"color_var": "V"}}))
    with pytest.raises(ValueError, match="kind: expected one of"):
        open_source("hdf5", "x", cfg)


# ---- SST streams ------------------------------------------------------------------------------

def popen(cmd, cwd) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"timed out: {proc.args}\n{out}\n{err}") from None


def reader_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_sst_stream_from_a_separate_writer_matches_the_file(gs_bp, tmp_path):
    writer = popen([sys.executable, SIM, *GS_ARGS, "--engine", "SST", "--output", "gs_stream"], tmp_path)
    reader = launch([sys.executable, WORKER, "sst", "gs_stream", "U", gs_bp, "--timeout", "30"], cwd=tmp_path,
                    timeout=60)
    out, err = reader.stdout, reader.stderr
    wout, werr = finish(writer)
    assert writer.returncode == 0, werr
    lines = reader_lines(out)
    assert [x["step"] for x in lines[:-1]] == [10, 20, 30, 40, 50, 60], (out, err)
    assert all(x["equal"] for x in lines[:-1])
    assert lines[-1] == {"rank": 0, "end": "clean", "dropped": 0}
    assert "engine=SST" in wout


def test_a_stream_whose_writer_discards_says_how_many_steps_never_arrived(tmp_path):
    """A writer faster than its reader under QueueFullPolicy Discard (50 outputs in a few seconds, each step a
    second or more to train): the simulation keeps its pace, `insitu stream` trains the steps that reach it, in
    order, and its last line counts the writer's steps before the last one trained that never arrived."""
    from conftest import TINY, insitu

    from insitu.output.files import read_csv

    writer = popen([sys.executable, SIM, "--L", "48", "--steps", "1000", "--plotgap", "20", "--engine", "SST",
                    "--output", "fast", "--sst-policy", "Discard"], tmp_path)
    run = insitu("stream", "fast", "--var", "V", "--iso", "0.3", *TINY, "--out", "out", cwd=tmp_path, timeout=120)
    wout, werr = finish(writer)
    assert run.returncode == 0 and writer.returncode == 0, (run.stdout, run.stderr, werr)
    trained = [int(r["step"]) for r in read_csv(tmp_path / "out" / "metrics.csv")]
    assert trained == sorted(trained) and 1 < len(trained) < 50, trained
    never = max(trained) // 20 - len(trained)       # output k (0, 1, ...) is the simulation's step 20 (k + 1)
    assert never > 0 and f"done: {len(trained)} step(s) trained, {never} of the stream's steps never arrived (its " \
        "writer discarded them, SST QueueFullPolicy=Discard" in run.stdout, (trained, run.stdout)


def test_sst_writer_killed_mid_stream(tmp_path):
    writer = popen([sys.executable, SIM, "--L", "16", "--steps", "100000", "--plotgap", "10", "--engine", "SST",
                    "--output", "dying", "--sst-queue-limit", "1"], tmp_path)
    reader = launch([sys.executable, WORKER, "sst", "dying", "U", "-", "--timeout", "30", "--kill-pid", writer.pid,
                     "--kill-after", "2"], cwd=tmp_path, timeout=60)
    out, err = reader.stdout, reader.stderr
    finish(writer)
    assert writer.returncode == -signal.SIGKILL
    lines = reader_lines(out)
    got = [x["step"] for x in lines if "step" in x]
    assert got[:2] == [10, 20] and got == list(range(10, 10 * len(got) + 1, 10)), out
    assert lines[-1]["error"] == "SourceError", (out, err)
    assert lines[-1]["message"] == (f"dying: stream ended unexpectedly after step {got[-1]} "
                                    "(the writer stopped without closing it)")


def test_sst_writer_that_never_appears_times_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"nobody: no SST writer appeared within 2 s \(no contact file nobody.sst"):
        SSTSource("nobody", "U", timeout_s=2)
    waited = time.monotonic() - t0
    assert 1.5 < waited < 20, waited        # about the 2 s given (on ADIOS2's clock), not SSTSource's default 60 s


def test_sst_stale_contact_file_of_a_dead_writer(tmp_path, monkeypatch):
    writer = popen([sys.executable, SIM, "--L", "16", "--steps", "100000", "--engine", "SST", "--output", "stale",
                    "--sst-readers", "0"], tmp_path)
    contact = tmp_path / "stale.sst"
    deadline = time.monotonic() + 30
    while not contact.exists() and time.monotonic() < deadline and writer.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    writer.kill()
    finish(writer)
    assert contact.exists()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError, match="stale.sst exists but the connection to its writer failed: either the "
                                          r"writer died without closing the stream \(then remove the stale file\), "
                                          "or it runs with settings this reader cannot use"):
        SSTSource("stale", "U", timeout_s=5)


SLOW_WRITER = """
import sys, time
sys.modules["torch"] = None
import numpy as np, adios2
ad = adios2.Adios(); io = ad.declare_io("w"); io.set_engine("SST")
io.set_parameters({"RendezvousReaderCount": "1", "DataTransport": "WAN", "OpenTimeoutSecs": "30"})
with adios2.Stream(io, "slow", "w") as s:
    s.begin_step(); s.write("U", np.ones((4, 5, 6)), [4, 5, 6], [0, 0, 0], [4, 5, 6]); s.write("step", 0); s.end_step()
    time.sleep(60)
"""


def test_sst_no_step_in_time(tmp_path):
    writer = popen([sys.executable, "-c", SLOW_WRITER], tmp_path)
    try:
        reader = launch([sys.executable, WORKER, "sst", "slow", "U", "-", "--timeout", "2"], cwd=tmp_path, timeout=60)
        out, err = reader.stdout, reader.stderr
    finally:
        writer.kill()
        finish(writer)
    lines = reader_lines(out)
    assert [x["step"] for x in lines if "step" in x] == [0], (out, err)
    assert lines[-1]["message"] == "slow: no step arrived within 2 s after step 0"


def test_a_stream_that_waits_for_its_next_step_leaves_the_other_threads_running(tmp_path, monkeypatch):
    """adios2's begin_step holds the GIL as long as it waits: the step writer's thread (the step just trained) and
    the signal handlers (Ctrl-C, SIGTERM) would wait with it. The source asks without waiting, and sleeps between."""
    import threading

    writer = popen([sys.executable, "-c", SLOW_WRITER], tmp_path)
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    monkeypatch.chdir(tmp_path)
    try:
        source = iter(SSTSource("slow", "U", timeout_s=3))
        assert next(source).step == 0
        thread = threading.Thread(target=tick)
        thread.start()
        t0 = time.monotonic()
        with pytest.raises(SourceError, match="slow: no step arrived within 3 s after step 0"):
            next(source)
        waited = time.monotonic() - t0
        stop.set()
        thread.join()
    finally:
        writer.kill()
        finish(writer)
    assert waited >= 3 and len(ticks) > 0.2 * waited / 0.01, (waited, len(ticks))   # the thread ran all along
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.0


@pytest.mark.mpi
def test_sst_two_reader_ranks_each_their_own_cohort(gs_bp, tmp_path):
    writer = popen([sys.executable, SIM, *GS_ARGS, "--engine", "SST", "--output", "two", "--sst-readers", "2"],
                   tmp_path)
    reader = launch([sys.executable, WORKER, "sst", "two", "U", gs_bp, "--timeout", "30", "--every", "2", "--out",
                     "lines"], ranks=2, cwd=tmp_path, timeout=90)
    out, err = reader.stdout, reader.stderr
    finish(writer)
    assert writer.returncode == 0 and reader.returncode == 0, err
    lines = [x for r in (0, 1) for x in reader_lines((tmp_path / f"lines.{r}.jsonl").read_text())]
    for rank in (0, 1):
        mine = [x for x in lines if x["rank"] == rank]
        assert [x["step"] for x in mine[:-1]] == [10, 30, 50], (out, err)
        assert all(x["equal"] for x in mine[:-1]) and mine[-1]["end"] == "clean"
    starts = {tuple(x["start"]) for x in lines if "start" in x}
    assert starts == {(0, 0, 0), (6, 0, 0)}      # 15 cells: 7 | 8, one ghost layer


@pytest.mark.mpi
def test_ranks_agree_on_the_steps_they_all_hold(tmp_path):
    # rank 1's reader missed step 20 (as a cohort can under a Discard policy) and ends before
    # step 50: with comm, rank 0 skips 20, and both end when rank 1's stream ends
    a = np.zeros((4, 4, 4))
    write_bp(tmp_path / "r0.bp", {"U": a}, numbers=[10, 20, 30, 40, 50])
    write_bp(tmp_path / "r1.bp", {"U": a}, numbers=[10, 30, 40])
    proc = launch([sys.executable, WORKER, "bp", "r{rank}.bp", "U", "-", "--out", "agree"], ranks=2, cwd=tmp_path,
                  timeout=60)
    assert proc.returncode == 0, proc.stderr
    for rank, dropped in ((0, 1), (1, 0)):
        lines = reader_lines((tmp_path / f"agree.{rank}.jsonl").read_text())
        assert [x["step"] for x in lines[:-1]] == [10, 30, 40]
        assert lines[-1] == {"rank": rank, "end": "clean", "dropped": dropped}
    assert "r0.bp: stream ended on some ranks; steps [50] held by others are dropped" in proc.stderr
