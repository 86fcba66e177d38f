"""The in situ Adaptor: queue policies decided collectively, error propagation, sync mode, draining.

Each test launches ``mpiexec -n 2`` on tests/adaptor_cases.py (a small simulation loop with a
collective stand-in for the pipeline that fails if the ranks train different steps or if the
block it receives differs from the field the simulation passed) and compares what the ranks saw.
The last test runs the real pipeline end to end.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import followed_iterations, launch

HERE = Path(__file__).resolve().parent


def run_cases(cases: str, out: Path, timeout: float = 180) -> dict[str, list[dict]]:
    """Run comma-separated cases in one launch (torch and gloo start once); case -> [rank0, rank1]."""
    proc = launch([sys.executable, HERE / "adaptor_cases.py", cases, out], ranks=2, timeout=timeout)
    assert proc.returncode == 0, f"{cases}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return {c: [json.loads((out / c / f"rank{r}.json").read_text()) for r in range(2)] for c in cases.split(",")}


@pytest.fixture(scope="module")
def queue_cases(tmp_path_factory):
    return run_cases("discard,block,drain_false", tmp_path_factory.mktemp("queue"))


@pytest.fixture(scope="module")
def error_cases(tmp_path_factory):
    return run_cases("worker_error,error_at_finalize,sync,missing_field,bad_config,bad_decomposition,bad_time",
                     tmp_path_factory.mktemp("errors"))


@pytest.mark.mpi
def test_discard_trains_the_same_steps_on_every_rank(queue_cases):
    # rank 1 trains 7x slower than rank 0, the simulation steps with random pauses per rank
    r0, r1 = queue_cases["discard"]
    assert r0["errors"] == r1["errors"] == []
    assert r0["trained"] == r1["trained"]
    assert r0["dropped"] == r1["dropped"]
    trained, dropped = r0["trained"], r0["dropped"]
    assert sorted(trained + dropped) == list(range(30))     # every step either trained or dropped, once
    assert trained == sorted(trained) and trained[0] == 0
    assert 29 in trained                                      # the newest step wins
    assert len(dropped) > 10                                  # the slow worker could not keep up
    assert all(w == 0.0 for w in r0["waited"] + r1["waited"])   # discard never makes the simulation wait


@pytest.mark.mpi
def test_block_trains_every_step_in_order_and_waits_for_room(queue_cases):
    r0, r1 = queue_cases["block"]
    assert r0["trained"] == r1["trained"] == list(range(8))
    assert r0["dropped"] == r1["dropped"] == []
    assert max(r1["waited"]) > 0.03                           # the simulation waited for the slow worker
    assert [e["thread"] for e in r0["log"]] == ["insitu-worker-0"] * 8
    # warm start: every step after the first starts from the previous step's shard
    assert [(e["warm"], e["iterations"]) for e in r0["log"]] == [(None, None)] + [(s, 7) for s in range(7)]
    # each execute copies this rank's slab with its ghost layers once (float32)
    nz, ny = 8, 10
    assert r0["bytes"] == [nz * ny * (6 + 2) * 4] * 8         # x: 6 own + 2 ghost samples (close + ghost)
    assert r1["bytes"] == [nz * ny * (6 + 1) * 4] * 8


@pytest.mark.mpi
def test_finalize_without_drain_drops_waiting_steps_on_every_rank(queue_cases):
    r0, r1 = queue_cases["drain_false"]
    assert r0["trained"] == r1["trained"]
    assert r0["dropped"] == r1["dropped"]
    assert r0["dropped"], "the worker is slow: some steps were still waiting at finalize"
    assert sorted(r0["trained"] + r0["dropped"]) == list(range(5))


@pytest.mark.mpi
def test_worker_error_is_raised_once_on_every_rank_and_later_steps_train(error_cases):
    r0, r1 = error_cases["worker_error"]           # step 2 fails on rank 1 only
    assert r0["trained"] == r1["trained"] == [0, 1] + list(range(3, 12))
    for r in (r0, r1):
        assert len(r["errors"]) == 1 and r["errors"][0]["type"] == "InsituError"
        assert "training step 2 failed" in r["errors"][0]["message"]
        assert "rank 1: step 2: ValueError: boom at step 2" in r["errors"][0]["message"]
    assert r0["errors"][0]["step"] == r1["errors"][0]["step"] > 2   # same call on both ranks


@pytest.mark.mpi
def test_error_in_the_last_step_is_raised_by_finalize(error_cases):
    r0, r1 = error_cases["error_at_finalize"]       # step 3 (the last) fails on rank 0
    assert r0["errors"] == r1["errors"] == []
    assert r0["finalize_error"] == r1["finalize_error"]
    assert "rank 0: step 3: ValueError: boom at step 3" in r0["finalize_error"]


@pytest.mark.mpi
def test_sync_mode_trains_on_the_caller_thread_and_raises_at_once(error_cases):
    r0, r1 = error_cases["sync"]                    # step 3 fails on rank 1
    assert r0["mode"] == "sync" and r0["warnings"] == []
    assert r0["trained"] == r1["trained"] == [0, 1, 2, 4, 5]            # the failed step 3 does not stop it
    assert {e["thread"] for e in r0["log"] + r1["log"]} == {"MainThread"}
    for r in (r0, r1):
        assert len(r["errors"]) == 1
        assert r["errors"][0]["step"] == 3 and "boom at step 3" in r["errors"][0]["message"]


@pytest.mark.mpi
def test_background_without_thread_multiple_falls_back_to_sync_with_a_warning(tmp_path):
    r0, r1 = run_cases("thread_single", tmp_path)["thread_single"]
    for r in (r0, r1):
        assert r["mode"] == "sync"
        assert any("MPI_THREAD_MULTIPLE" in w for w in r["warnings"])
        assert {e["thread"] for e in r["log"]} == {"MainThread"}
    assert r0["trained"] == r1["trained"] == [0, 1, 2, 4, 5]


@pytest.fixture(scope="module")
def misuse_cases(tmp_path_factory):
    return run_cases("skip_execute,config_differs,silent_rank,bad_step_then_good", tmp_path_factory.mktemp("misuse"),
                     timeout=300)


@pytest.mark.mpi
def test_a_rank_that_skips_an_execute_gets_an_error_naming_both_steps(misuse_cases):
    r0, r1 = misuse_cases["skip_execute"]           # rank 1 skips execute(2)
    text = ("the ranks made different calls (every rank must call execute() for every step, then finalize()): "
            "rank 0: execute(step 2), rank 1: execute(step 3)")
    assert r0["errors"] == [{"step": 2, "type": "InputError", "message": text}]
    assert r1["errors"] == [{"step": 3, "type": "InputError", "message": text}]
    assert r0["trained"] == r1["trained"] == [0, 1]          # no step trained from a silent pairing


@pytest.mark.mpi
def test_ranks_with_different_configurations_get_a_config_error_naming_the_keys(misuse_cases):
    r0, r1 = misuse_cases["config_differs"]         # views.count 8 on rank 0, 9 on rank 1
    assert r0["errors"] == r1["errors"]
    assert r0["errors"][0]["type"] == "ConfigError"
    assert "rank 1 differs from rank 0 in views.count (8 vs 9)" in r0["errors"][0]["message"]


@pytest.mark.mpi
def test_a_rank_that_stops_calling_execute_does_not_hang_the_others(misuse_cases):
    r0, r1 = misuse_cases["silent_rank"]            # run.timeout_s 2; rank 1 calls execute(0) only
    first = r0["errors"][0]
    assert first["step"] == 1 and first["type"] == "InsituError"
    assert "did not answer within 2 s (run.timeout_s)" in first["message"]
    assert first["after_s"] > 1.9                  # it waited for the configured timeout, not less
    assert [e["step"] for e in r0["errors"]] == [1, 2, 9]    # unusable afterwards: raises at once
    assert r1["errors"][-1]["step"] == 9 and "did not answer" in r1["errors"][-1]["message"]
    assert r0["trained"] == r1["trained"] == [0]


@pytest.mark.mpi
def test_a_step_without_surface_is_reported_once_and_later_steps_train(misuse_cases):
    """The real pipeline in the background: step 0 uniform (a usual initial condition), then a sphere."""
    from insitu.output.files import read_csv

    r0, r1 = misuse_cases["bad_step_then_good"]
    for r in (r0, r1):
        assert r["trained"] == [1, 2]
        assert len(r["errors"]) == 1 and r["errors"][0]["step"] == 1           # from the next execute, once
        assert "training step 0 failed" in r["errors"][0]["message"]
        assert "outside the field's range (0, 0]" in r["errors"][0]["message"]
        assert [r["status"][s][0] for s in ("0", "1", "2")] == ["failed", "trained", "trained"]
    rows = read_csv(Path(r0["out"]) / "metrics.csv")
    assert [(row["step"], row["status"]) for row in rows] == [("0", "failed"), ("1", "trained"), ("2", "trained")]
    assert "no surface to extract" in rows[0]["reason"]


@pytest.fixture(scope="module")
def failure_cases(tmp_path_factory):
    return run_cases("collective_failure,simulation_raises", tmp_path_factory.mktemp("failures"), timeout=300)


@pytest.mark.mpi
def test_after_a_rank_fails_inside_a_collective_the_process_group_is_rebuilt_and_later_steps_train(failure_cases):
    r0, r1 = failure_cases["collective_failure"]     # rank 1 raises in step 1; rank 0's all-reduce times out
    assert r0["trained"] == r1["trained"] == [0, 2, 3]
    for r in (r0, r1):
        assert [e["type"] for e in r["errors"]] == ["InsituError"]
        assert "training step 1 failed on 2 of 2 rank(s)" in r["errors"][0]["message"]
        assert "rank 1: step 1: ValueError: boom inside step 1" in r["errors"][0]["message"]
        assert [r["status"][s][0] for s in "0123"] == ["trained", "failed", "trained", "trained"]


@pytest.mark.mpi
def test_a_rank_whose_simulation_ends_early_ends_the_analysis_on_every_rank_with_every_step_recorded(failure_cases):
    from insitu.output.files import read_csv

    r0, r1 = failure_cases["simulation_raises"]      # rank 1 raises at step 2 inside `with Adaptor(...)`
    first = r0["errors"][0]
    assert first["step"] == 2 and first["type"] == "InputError"
    assert "rank 0: execute(step 2), rank 1: finalize()" in first["message"]
    assert "the analysis has ended on every rank: rank(s) 1 called finalize()" in first["message"]
    assert [(e["step"], e["type"]) for e in r0["errors"][1:]] == [(3, "InsituError"), (4, "InsituError")]
    assert all(e["message"].startswith("the analysis has ended on every rank") for e in r0["errors"][1:])
    assert r1["errors"] == [{"step": "simulation", "type": "RuntimeError", "message": "the simulation diverged"}]
    for r in (r0, r1):
        assert sorted(r["status"]) == ["0", "1"]
        assert all(v[0] in ("trained", "skipped") for v in r["status"].values()), r["status"]
    assert r0["status"] == r1["status"] and r0["trained"] == r1["trained"]
    rows = {row["step"]: row["status"] for row in read_csv(Path(r0["out"]) / "metrics.csv")}
    assert {s: v[0] for s, v in r0["status"].items() if v[0] == "skipped"} == {s: v for s, v in rows.items()}


@pytest.mark.mpi
def test_a_stalled_rank_does_not_hang_the_others_and_the_steps_it_blocks_are_recorded(tmp_path):
    from insitu.output.files import read_csv

    r0, r1 = run_cases("stalled_rank", tmp_path, timeout=240)["stalled_rank"]
    assert r0["trained"] == [0] and r1["trained"] == [0]
    assert r0["status"]["1"][0] == "failed"
    assert "did not answer within 6 s" in r0["status"]["1"][1]
    for r in (r0, r1):
        assert all(r["status"][s][0] == "skipped" and "not trained: the ranks did not agree on training step 1"
                   in r["status"][s][1] for s in r["status"] if s not in ("0", "1")), r["status"]
        assert r["errors"] and all(e["type"] == "InsituError" for e in r["errors"])
        assert "training has stopped" in r["errors"][-1]["message"]
    rows = read_csv(Path(r0["out"]) / "metrics.csv")
    assert [row["status"] for row in rows if row["step"] == "1"] == ["failed"]
    assert all(row["status"] == "skipped" and row["reason"].startswith("not trained: the ranks did not agree")
               for row in rows if row["step"] not in ("0", "1"))


@pytest.mark.mpi
def test_missing_field_on_one_rank_raises_on_every_rank(error_cases):
    r0, r1 = error_cases["missing_field"]
    assert r0["errors"] == r1["errors"]
    assert r0["errors"][0]["type"] == "InputError"
    assert "rank 1: field 'U' (input.var) is not among the fields given: 'u'" in r0["errors"][0]["message"]
    assert r0["trained"] == r1["trained"] == []


@pytest.mark.mpi
def test_a_nan_time_on_one_rank_raises_on_every_rank_and_queues_the_step_on_none(error_cases):
    r0, r1 = error_cases["bad_time"]
    assert r0["errors"] == r1["errors"]
    assert [(e["step"], e["type"], e["status"]) for e in r0["errors"]] == [(1, "InputError", [0])]
    assert ("rank 1: time: expected a finite real number (the simulation's time at this step), got nan"
            in r0["errors"][0]["message"])
    assert r0["trained"] == r1["trained"] == [0, 1]
    assert r0["times"] == r1["times"] == [0.0, 0.1]


@pytest.mark.mpi
@pytest.mark.parametrize("case, words", [
    ("overlap", "ranks 0 and 1 overlap: rank 0 holds samples [0, 6) x [0, 10) x [0, 8), rank 1 holds [4, 12)"),
    ("duplicate", "ranks 0 and 1 overlap: rank 0 holds samples [0, 6) x [0, 10) x [0, 8), rank 1 holds [0, 6)"),
    ("gap", "leave a gap: they hold 880 of the 960 samples"),
    ("global_shape", "the ranks disagree on global_shape: rank 0 has (12, 10, 8), rank 1 has (12, 10, 9)"),
])
def test_a_bad_decomposition_is_an_input_error_on_every_rank_before_any_work(error_cases, case, words):
    r0, r1 = error_cases["bad_decomposition"]
    e0, e1 = ({e["case"]: e for e in r["errors"]}[case] for r in (r0, r1))
    assert e0 == e1 and e0["type"] == "InputError", (e0, e1)
    assert words in e0["message"], e0["message"]
    assert r0["trained"] == r1["trained"] == [4]                # nothing of the bad steps; the next one trains


@pytest.mark.mpi
def test_bad_config_on_one_rank_raises_on_every_rank(error_cases):
    r0, r1 = error_cases["bad_config"]
    assert r0["errors"] == r1["errors"]
    assert r0["errors"][0]["type"] == "ConfigError"
    assert "missing.yaml: does not exist" in r0["errors"][0]["message"]


def test_invalid_config_values_fail_before_any_work():
    from insitu.errors import ConfigError
    from insitu.run.adaptor import Adaptor

    with pytest.raises(ConfigError, match="run.policy: expected one of block, discard, got 'newest'"):
        Adaptor(None, {"run": {"policy": "newest"}}, process=lambda *a, **k: None)
    with pytest.raises(ConfigError, match="expected a Config, a dict, a YAML path or None, got int"):
        Adaptor(None, 3, process=lambda *a, **k: None)


def test_single_process_sync_run_and_stats(tmp_path):
    """Without a launcher: one rank, sync mode, wrong shapes rejected with a clear message."""
    from insitu.errors import InputError
    from insitu.run.adaptor import Adaptor

    seen = []

    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        seen.append((step, time, block.data.shape, block.start, block.fields["V"].dtype.name))
        return type("R", (), {"gaussians": None, "metrics": {}})()

    cfg = {"run": {"mode": "sync", "device": "cpu"}, "input": {"color_var": "V"}, "output": {"dir": str(tmp_path)}}
    u = np.zeros((4, 5, 6), np.float32)
    with Adaptor(None, cfg, process=process) as ad:
        ad.execute(3, 0.5, {"U": u, "V": u.astype(np.float64)}, (6, 5, 4), (0, 0, 0))
        with pytest.raises(InputError, match=r"field 'V': expected the shape of 'U' \(4, 5, 6\), got \(4, 2, 6\)"):
            ad.execute(4, 0.6, {"U": u, "V": u[:, :2]}, (6, 5, 4), (0, 0, 0))
        with pytest.raises(InputError, match=r"start \(1, 0, 0\) \+ count \(6, 5, 4\) .* inside global_shape"):
            ad.execute(5, 0.7, {"U": u, "V": u}, (6, 5, 4), (1, 0, 0))
    assert seen == [(3, 0.5, (4, 5, 6), (0, 0, 0), "float64")]
    assert ad.stats.bytes_copied == u.nbytes * 3
    assert len(ad.stats.executes) == 1 and ad.stats.executes[0].seconds > 0


@pytest.mark.mpi
def test_pipeline_end_to_end_in_the_background(tmp_path):
    """The real pipeline behind the Adaptor: two steps of a growing sphere, 2 ranks, warm start."""
    from insitu.output.ply import read_ply

    r0, r1 = run_cases("pipeline", tmp_path, timeout=300)["pipeline"]
    out = tmp_path / "pipeline" / "out"
    for step in (0, 1):
        d = out / f"step_{step:06d}"
        metrics = json.loads((d / "metrics.json").read_text())
        assert metrics["step"] == step and metrics["ranks"] == 2
        model = read_ply(d / "model.ply")
        assert len(model) == metrics["ply_gaussians"] > 0 and metrics["gaussians"] >= metrics["ply_gaussians"]
        assert metrics["psnr"] > 15
    first, warm = r0["metrics"]                 # step 1 warm-started: warm_iterations, more for new surface
    assert first["iterations"] == 20 and warm["iterations"] == followed_iterations(warm, 10, 20)
    assert [m["step"] for m in r0["metrics"]] == [m["step"] for m in r1["metrics"]] == [0, 1]
    assert (out / "metrics.csv").read_text().count("\n") == 3     # header + one row per step


def tiny_sync_config(out: Path) -> dict:
    """The real pipeline, one rank, sync mode, sizes that train a step in about a second on a CPU."""
    return {"run": {"mode": "sync", "progress": False, "backend": "torch", "device": "cpu"},
            "series": {"warm_iterations": 1, "warm_start": True, "follow_iterations": True}, "input": {"iso": [50]}, "seeds": {"budget": 100},
            "views": {"count": 8, "resolution": 16, "supersample": 1}, "train": {"iterations": 2},
            "output": {"dir": str(out), "images": 0}}


def sphere(n: int = 10, radius: float = 0.5) -> np.ndarray:
    """[n, n, n] samples 100 inside a ball of ``radius`` (the grid spans [-1, 1]) down to 0 outside; iso 50."""
    z, y, x = np.meshgrid(*(np.linspace(-1, 1, n),) * 3, indexing="ij")
    return np.clip(1.2 - np.sqrt(x**2 + y**2 + z**2) / radius, 0, 1) * 100


def test_float16_long_double_and_big_endian_fields_train_warm_started_steps(tmp_path):
    """torch reads no big-endian array, scipy's interpolation (a warm start samples the field with it) no
    float16 or long double: each is converted, so every step trains, the ones after the first warm-started."""
    from insitu.errors import InputError
    from insitu.output.files import read_csv
    from insitu.run.adaptor import Adaptor

    n = 10
    dtypes = [">u2", np.float16, np.longdouble]
    with Adaptor(None, tiny_sync_config(tmp_path)) as ad:
        for step, dtype in enumerate(dtypes):
            ad.execute(step, 0.5 * step, {"U": sphere(n, 0.5 + 0.05 * step).astype(dtype)}, (n, n, n), (0, 0, 0))
        for dtype in (bool, "m8[s]"):        # no numbers to train on: refused before the step
            with pytest.raises(InputError, match=re.escape("field 'U': expected a real numeric array (integers or "
                                                           f"floats), got dtype {np.dtype(dtype)}")):
                ad.execute(9, 9.0, {"U": sphere(n).astype(dtype)}, (n, n, n), (0, 0, 0))
    assert {s: v.status for s, v in ad.status.items()} == {s: "trained" for s in range(len(dtypes))}, ad.status
    assert [t.metrics["iterations"] for t in ad.stats.trained] == [2] + [followed_iterations(t.metrics, 1, 2)
                                                                        for t in ad.stats.trained[1:]]
    assert all(t.metrics["gaussians"] > 0 for t in ad.stats.trained)
    rows = read_csv(tmp_path / "metrics.csv")
    assert [(row["step"], row["status"]) for row in rows] == [(str(s), "trained") for s in range(len(dtypes))]


INVALID_CALLS = [    # (step, time, start) -> what the InputError says
    ((1, "noon", (0, 0, 0)), "time: expected a finite real number (the simulation's time at this step), got 'noon'"),
    ((1, float("nan"), (0, 0, 0)), "time: expected a finite real number (the simulation's time at this step), got nan"),
    ((1, np.float64("inf"), (0, 0, 0)), "time: expected a finite real number"),
    ((1, None, (0, 0, 0)), "time: expected a finite real number (the simulation's time at this step), got None"),
    ((1, True, (0, 0, 0)), "time: expected a finite real number (the simulation's time at this step), got True"),
    ((1, 10**400, (0, 0, 0)), "time: expected a finite real number"),
    ((-1, 0.5, (0, 0, 0)), "step: expected an integer >= 0 (the outputs are named by it), got -1"),
    ((1.0, 0.5, (0, 0, 0)), "step: expected an integer >= 0 (the outputs are named by it), got 1.0"),
    ((True, 0.5, (0, 0, 0)), "step: expected an integer >= 0 (the outputs are named by it), got True"),
    (("1", 0.5, (0, 0, 0)), "step: expected an integer >= 0 (the outputs are named by it), got '1'"),
    ((1, 0.5, (0.5, 0, 0)), "start: expected 3 integers (x, y, z), got (0.5, 0, 0)"),
    ((1, 0.5, ("0", 0, 0)), "start: expected 3 integers (x, y, z), got ('0', 0, 0)"),
    ((1, 0.5, (False, 0, 0)), "start: expected 3 integers (x, y, z), got (False, 0, 0)"),
    ((1, 0.5, (0, 0)), "start: expected 3 integers (x, y, z), got (0, 0)"),
]


def test_invalid_step_time_or_start_is_refused_before_anything_is_queued(tmp_path):
    """Each call of INVALID_CALLS is refused with an InputError naming the argument; nothing is queued or
    written; then the same step number trains (numpy scalars and integral floats pass)."""
    from insitu.errors import InputError
    from insitu.run.adaptor import Adaptor

    n = 10
    u = sphere(n).astype(np.float32)
    with Adaptor(None, tiny_sync_config(tmp_path)) as ad:
        ad.execute(0, 0.0, {"U": u}, (n, n, n), (0, 0, 0))
        csv = (tmp_path / "metrics.csv").read_bytes()
        listing = sorted(p.name for p in tmp_path.iterdir())
        for (step, time, start), words in INVALID_CALLS:
            with pytest.raises(InputError) as caught:
                ad.execute(step, time, {"U": u}, (n, n, n), start)
            assert words in str(caught.value), (step, time, start, str(caught.value))
            assert (tmp_path / "metrics.csv").read_bytes() == csv
            assert sorted(p.name for p in tmp_path.iterdir()) == listing
            assert list(ad.status) == [0] and len(ad.stats.executes) == 1
        ad.execute(np.int64(1), np.float32(0.25), {"U": u}, (n, n, n), (0.0, np.int32(0), np.uint8(0)))
    assert [(s, v.status) for s, v in ad.status.items()] == [(0, "trained"), (1, "trained")]
    metrics = json.loads((tmp_path / "step_000001" / "metrics.json").read_text())
    assert metrics["time"] == 0.25 and metrics["step"] == 1


@pytest.fixture(scope="module")
def fault_cases(tmp_path_factory):
    return run_cases("two_threads,disk_full", tmp_path_factory.mktemp("faults"))


@pytest.mark.mpi
def test_a_call_from_a_second_thread_is_refused_at_once_and_queues_nothing(fault_cases):
    """execute() from a second thread while the first's execute() trains: an InputError on each rank at once,
    naming both threads, before any collective; the steps then train in order, on both ranks alike."""
    for r in fault_cases["two_threads"]:
        [e] = r["errors"]
        assert e["type"] == "InputError" and e["after_s"] < 1.0 and e["status"] == [0], e
        assert e["message"] == ("execute(step 1): called on thread 'second-sim-thread' while execute(step 0) runs on "
                                "thread 'MainThread'; the Adaptor is not thread-safe (its calls are collective: every "
                                "rank must make them in the same order, which two threads cannot promise): make every "
                                "call from one thread")
        assert r["trained"] == [0, 1] and [e["thread"] for e in r["log"]] == ["MainThread"] * 2


@pytest.mark.mpi
def test_a_step_that_cannot_be_written_is_one_line_and_training_stops(fault_cases):
    """Rank 0's disk is full at step 1: each rank prints one line, step 1 is failed and no later step trains;
    every later call raises saying why, naming the file and the error code."""
    for rank, r in enumerate(fault_cases["disk_full"]):
        assert r["stderr"].splitlines() == [f"[insitu rank {rank}] step 1: RankFailure: phase 'export' failed on rank "
                                            f"0: OSError: [Errno 28] No space left on device (ENOSPC): "
                                            f"'{r['status']['1'][1].split(chr(39))[-2]}'"], r["stderr"]
        assert "Traceback" not in r["stderr"] and r["trained"] == [0] and [e["step"] for e in r["log"]] == [0, 1]
        assert r["status"]["1"][0] == "failed" and "(ENOSPC): " in r["status"]["1"][1]
        for s in ("2", "3", "4"):
            assert r["status"][s][0] == "skipped", r["status"]
            assert r["status"][s][1].startswith("not trained: step 1's files could not be written (OSError: [Errno "
                                                "28] No space left on device (ENOSPC): ")
            assert r["status"][s][1].endswith("), nor can later steps' be: free space or make output.dir writable")
        assert [e["step"] for e in r["errors"]] == [2, 3, 4] and all(e["type"] == "InsituError" for e in r["errors"])
        assert all("training has stopped (step 1's files could not be written" in e["message"] for e in r["errors"])


@pytest.mark.mpi
def test_a_program_that_ends_without_finalize_trains_what_is_queued_and_releases_the_folder(tmp_path):
    from insitu.output.files import read_csv

    proc = launch([sys.executable, HERE / "adaptor_cases.py", "no_finalize", tmp_path], ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0 = json.loads((tmp_path / "no_finalize" / "rank0.json").read_text())
    assert r0["queued"], "the worker is slow: steps were still waiting when the program ended"
    assert proc.stderr.count("insitu: warning: the program is ending without Adaptor.finalize() (") == 1, proc.stderr
    out = tmp_path / "no_finalize" / "out"
    assert [(row["step"], row["status"]) for row in read_csv(out / "metrics.csv")] == [(str(s), "trained")
                                                                                     for s in range(4)]
    assert not (out / ".insitu.lock").exists()


def test_one_rank_whose_output_is_read_only_stops_training_after_one_line(tmp_path, capsys, monkeypatch):
    """The step's files cannot be written (EROFS, as a read-only folder gives): one line, no traceback, training
    stops; the statuses stay readable although metrics.csv cannot be written either."""
    import errno

    from insitu.errors import InsituError
    from insitu.output.export import StepWriter
    from insitu.output.files import named_error
    from insitu.run.adaptor import Adaptor

    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        writer.write(step, None, [], {"psnr": 20.0}, cfg)
        return type("R", (), {"gaussians": None, "metrics": {}})()

    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(tmp_path / "out")}}
    u = np.zeros((4, 5, 6), np.float32)
    with Adaptor(None, cfg, process=process) as ad:
        ad.execute(0, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
        monkeypatch.setattr(StepWriter, "write", lambda self, step, *a, **k: (_ for _ in ()).throw(named_error(
            OSError(errno.EROFS, "Read-only file system"), tmp_path / "out" / f"step_{step:06d}")))
        for step in (1, 2):
            with pytest.raises(InsituError, match=r"training has stopped \(step 1's files could not be written "
                                                  r"\(OSError: \[Errno 30\] Read-only file system \(EROFS\): "):
                ad.execute(step, 0.0, {"U": u}, (6, 5, 4), (0, 0, 0))
    err = capsys.readouterr().err
    assert err.splitlines() == [f"[insitu rank 0] step 1: OSError: [Errno 30] Read-only file system (EROFS): "
                                f"'{tmp_path / 'out' / 'step_000001'}'"], err
    assert [(s, v.status) for s, v in ad.status.items()] == [(0, "trained"), (1, "failed"), (2, "skipped")]
    assert not (tmp_path / "out" / ".insitu.lock").exists()


def test_execute_buffers_names_a_count_under_1_and_a_buffer_of_another_size(tmp_path):
    from insitu.errors import InputError
    from insitu.run.adaptor import Adaptor

    seen = []
    cfg = {"run": {"mode": "sync", "device": "cpu"}, "output": {"dir": str(tmp_path / "o")}}
    u = np.zeros(4 * 5 * 6, np.float32)
    with Adaptor(None, cfg, process=lambda block, cfg, comm, *, step, **k: seen.append(step) or
                 type("R", (), {"gaussians": None, "metrics": {}})()) as ad:
        for count, words in (((6, 0, 4), r"count \(6, 0, 4\) \(x, y, z\): expected at least 1 sample this rank "
                                         r"holds along each axis, got count\[1\] = 0"),
                             ((6, 5, 5), r"field U: 480 bytes given, expected 600 \(count \(6, 5, 5\) of float32\)")):
            with pytest.raises(InputError, match=words):
                ad.execute_buffers(1, 0.0, [("U", memoryview(u), 9)], (6, 5, 5), (0, 0, 0), count)
        with pytest.raises(InputError, match=r"field name b'U\\xff': not UTF-8 text"):
            ad.execute_buffers(1, 0.0, [(b"U\xff", memoryview(u), 9)], (6, 5, 4), (0, 0, 0), (6, 5, 4))
        ad.execute_buffers(1, 0.0, [("U", memoryview(u), 9)], (6, 5, 4), (0, 0, 0), (6, 5, 4))
    assert seen == [1]
