"""Multi-rank scenarios for tests/test_adaptor.py: ``mpiexec -n 2 python adaptor_cases.py CASES OUTDIR``.

Each rank runs a small "simulation" loop that calls the Adaptor and writes what it saw
(trained steps, dropped steps, errors) to OUTDIR/rank<r>.json for the test to compare.
The injected process function is collective (an allgather of the step number), so ranks
that train different steps are caught as a mismatch instead of passing silently.
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time
import warnings
from time import sleep
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mpi4py  # noqa: E402

if len(sys.argv) > 1 and "thread_single" in sys.argv[1].split(","):
    mpi4py.rc.thread_level = "single"
from mpi4py import MPI  # noqa: E402
import numpy as np  # noqa: E402

from insitu.errors import ConfigError, InputError, InsituError  # noqa: E402
from insitu.run.adaptor import Adaptor  # noqa: E402

GLOBAL = (12, 10, 8)           # (nx, ny, nz)


class Result:
    def __init__(self, gaussians, metrics):
        self.gaussians = gaussians
        self.metrics = metrics


def field(step: int) -> np.ndarray:
    """The global [nz, ny, nx] field of a step: a known function of the global index."""
    z, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in GLOBAL[::-1]), indexing="ij")
    return x + 100 * y + 10000 * z + 1e6 * step


def local(step: int, rank: int, size: int):
    """This rank's slab along x (no ghosts), its start (x, y, z)."""
    nx = GLOBAL[0]
    lo, hi = rank * nx // size, (rank + 1) * nx // size
    return np.ascontiguousarray(field(step)[:, :, lo:hi]), (lo, 0, 0)


def make_process(delays: dict[int, float], fail: tuple[int, int] | None = None, log: list | None = None):
    """A collective stand-in for pipeline.run_step that checks its block and records calls."""

    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        rank = comm.rank
        steps = comm.mpi.allgather(step)
        if len(set(steps)) != 1:
            raise AssertionError(f"ranks train different steps: {steps}")
        sleep(delays.get(rank, 0.0))
        # the block holds a copy of the step's field, ghosts included
        s, c = block.start, block.shape_xyz
        expected = field(step)[s[2]:s[2] + c[2], s[1]:s[1] + c[1], s[0]:s[0] + c[0]]
        if not np.array_equal(block.data, expected):
            raise AssertionError(f"step {step}: block data differs from the field the simulation passed")
        if fail is not None and (step, rank) == fail:
            raise ValueError(f"boom at step {step}")
        if log is not None:
            log.append({"step": step, "time": time, "thread": threading.current_thread().name,
                        "warm": None if warm is None else warm.gaussians, "iterations": iterations})
        return Result(gaussians=step, metrics={"step": step})

    return process


def make_collective_process(fail_at: int | None = None, stall_at: int | None = None, stall_s: float = 0.0,
                            log: list | None = None):
    """A stand-in for pipeline.run_step whose work is a torch.distributed all-reduce (gloo), as training's is.

    At step ``fail_at`` rank 1 raises before the all-reduce, so rank 0's all-reduce waits until the group's
    timeout (run.timeout_s); at step ``stall_at`` rank 1 stalls ``stall_s`` seconds and returns without
    the all-reduce. Every step checks that the all-reduce summed one value per rank."""
    import torch

    def process(block, cfg, comm, *, step, time, writer, warm, iterations):
        if comm.rank == 1 and step == fail_at:
            raise ValueError(f"boom inside step {step}")
        if comm.rank == 1 and step == stall_at:
            sleep(stall_s)
            return Result(gaussians=step, metrics={"step": step})
        total = comm.all_reduce_sum(torch.ones(1))
        if int(total.item()) != comm.size:
            raise AssertionError(f"step {step}: the all-reduce gave {total.item()}")
        if log is not None:
            log.append({"step": step})
        return Result(gaussians=step, metrics={"step": step})

    return process


def simulate(adaptor: Adaptor, steps: int, rank: int, size: int, pause: float = 0.0, jitter: float = 0.0) -> list:
    rng = random.Random(rank)
    errors = []
    for step in range(steps):
        u, start = local(step, rank, size)
        try:
            adaptor.execute(step, 0.1 * step, {"U": u, "V": -u}, GLOBAL, start)
        except (InsituError, InputError) as e:      # the adaptor goes on: so does the simulation
            errors.append({"step": step, "type": type(e).__name__, "message": str(e)})
        u.fill(-1.0)                    # the simulation reuses its array at once
        sleep(pause + jitter * rng.random())
    return errors


def run(case: str, out: Path) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    out.mkdir(parents=True, exist_ok=True)
    base = {"run": {"device": "cpu", "timeout_s": 60}, "output": {"dir": str(out / "out")}}
    record: dict = {"rank": rank}
    log: list = []

    def config(**run):
        return {**base, "run": {**base["run"], **run}, "series": {"warm_iterations": 7, "warm_start": True}}

    if case == "discard":
        ad = Adaptor(comm, config(policy="discard", queue=1),
                     process=make_process({0: 0.02, 1: 0.15}, log=log))
        record["errors"] = simulate(ad, 30, rank, size, pause=0.01, jitter=0.03)
        ad.finalize()
    elif case == "block":
        ad = Adaptor(comm, config(policy="block", queue=2), process=make_process({1: 0.1}, log=log))
        record["errors"] = simulate(ad, 8, rank, size)
        ad.finalize()
    elif case == "drain_false":
        ad = Adaptor(comm, config(policy="block", queue=3), process=make_process({0: 0.2, 1: 0.3}, log=log))
        record["errors"] = simulate(ad, 5, rank, size)
        ad.finalize(drain=False)
    elif case == "worker_error":
        ad = Adaptor(comm, config(policy="block", queue=1), process=make_process({}, fail=(2, 1), log=log))
        record["errors"] = simulate(ad, 12, rank, size, pause=0.1)
        ad.finalize()                   # already reported: does not raise again, does not hang
    elif case == "error_at_finalize":
        ad = Adaptor(comm, config(policy="block", queue=1), process=make_process({}, fail=(3, 0), log=log))
        record["errors"] = simulate(ad, 4, rank, size)
        try:
            ad.finalize()
        except InsituError as e:
            record["finalize_error"] = str(e)
    elif case in ("sync", "thread_single"):
        cfg = config(policy="block") if case == "thread_single" else config(mode="sync")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ad = Adaptor(comm, cfg, process=make_process({}, fail=(3, 1), log=log))
        record["warnings"] = [str(w.message) for w in caught]
        record["mode"] = ad.mode
        record["errors"] = simulate(ad, 6, rank, size)
        ad.finalize()
    elif case == "missing_field":
        # rank 1 names its field differently: both ranks must raise from the same call
        ad = Adaptor(comm, config(mode="sync"), process=make_process({}, log=log))
        u, start = local(0, rank, size)
        try:
            ad.execute(0, 0.0, {"U" if rank == 0 else "u": u}, GLOBAL, start)
        except InputError as e:
            record["errors"] = [{"type": "InputError", "message": str(e)}]
        ad.finalize()
    elif case == "bad_decomposition":
        # boxes that do not tile the grid: the same InputError on both ranks, nothing trained;
        # then a good step trains normally
        ad = Adaptor(comm, config(mode="sync"), process=make_process({}, log=log))
        u, start = local(0, rank, size)
        nx = GLOBAL[0]
        bad = {
            "overlap": (field(0)[:, :, 4:], (4, 0, 0)) if rank == 1 else (u, start),
            "duplicate": local(0, 0, size),
            "gap": (field(0)[:, :, 7:], (7, 0, 0)) if rank == 1 else (u, start),
            "global_shape": (u, start),
        }
        record["errors"] = []
        for step, (name, (a, s0)) in enumerate(bad.items()):
            wrong = name == "global_shape" and rank == 1
            gshape = (nx, GLOBAL[1], GLOBAL[2] + 1) if wrong else GLOBAL
            try:
                ad.execute(step, 0.0, {"U": np.ascontiguousarray(a)}, gshape, s0)
                record["errors"].append({"case": name, "type": None, "message": ""})
            except InputError as e:
                record["errors"].append({"case": name, "type": type(e).__name__, "message": str(e)})
        ad.execute(len(bad), 0.0, {"U": local(len(bad), rank, size)[0]}, GLOBAL, start)
        ad.finalize()
    elif case == "bad_time":
        # rank 1 passes a NaN time at step 1: the same InputError on both ranks, step 1 queued on neither;
        # then step 1 with a valid time trains
        ad = Adaptor(comm, config(policy="block", queue=1), process=make_process({}, log=log))
        record["errors"] = []
        for step, time_ in ((0, 0.0), (1, float("nan") if rank == 1 else 0.1), (1, 0.1)):
            u, start = local(step, rank, size)
            try:
                ad.execute(step, time_, {"U": u}, GLOBAL, start)
            except InputError as e:
                record["errors"].append({"step": step, "type": type(e).__name__, "message": str(e),
                                         "status": sorted(ad.status)})
        ad.finalize()
        record["times"] = [e["time"] for e in log]
    elif case == "bad_config":
        path = out / ("missing.yaml" if rank == 1 else "good.yaml")
        if rank == 0:
            path.write_text("run:\n  mode: sync\n")
        comm.Barrier()
        try:
            Adaptor(comm, path, process=make_process({}))
            record["errors"] = []
        except ConfigError as e:
            record["errors"] = [{"type": "ConfigError", "message": str(e)}]
    elif case == "skip_execute":
        # rank 1 skips execute(2): the next call pairs execute(2) with execute(3) and must say so
        ad = Adaptor(comm, config(mode="sync"), process=make_process({}, log=log))
        errors = []
        for step in range(5):
            if rank == 1 and step == 2:
                continue
            u, start = local(step, rank, size)
            try:
                ad.execute(step, 0.0, {"U": u}, GLOBAL, start)
            except (InsituError, InputError) as e:
                errors.append({"step": step, "type": type(e).__name__, "message": str(e)})
                break
        ad.finalize()
        record["errors"] = errors
    elif case == "silent_rank":
        # rank 1 stops calling execute() for longer than run.timeout_s: rank 0 must not wait for ever
        ad = Adaptor(comm, config(mode="sync", timeout_s=2), process=make_process({}, log=log))
        errors = []
        t0 = time.monotonic()
        steps = 3 if rank == 0 else 1
        for step in range(steps):
            u, start = local(step, rank, size)
            try:
                ad.execute(step, 0.0, {"U": u}, GLOBAL, start)
            except (InsituError, InputError) as e:
                errors.append({"step": step, "type": type(e).__name__, "message": str(e),
                               "after_s": time.monotonic() - t0})
        if rank == 1:
            sleep(5)
        try:
            u, start = local(9, rank, size)
            ad.execute(9, 0.0, {"U": u}, GLOBAL, start)   # unusable now: raises at once
        except InsituError as e:
            errors.append({"step": 9, "type": "InsituError", "message": str(e)})
        ad.finalize()
        record["errors"] = errors
    elif case == "collective_failure":
        # rank 1 raises inside a step while rank 0 waits in a gloo collective until it times out
        ad = Adaptor(comm, config(policy="block", queue=1, timeout_s=3),
                     process=make_collective_process(fail_at=1, log=log))
        record["errors"] = simulate(ad, 4, rank, size, pause=0.2)
        try:
            ad.finalize()
        except InsituError as e:        # step 1's failure, when no execute() came after it
            record["errors"].append({"step": "finalize", "type": "InsituError", "message": str(e)})
        record["status"] = {s: [v.status, v.reason] for s, v in ad.status.items()}
    elif case == "stalled_rank":
        # rank 1's training stalls in step 1 for longer than any agreement waits: rank 0 must not wait for ever,
        # and neither rank's simulation (rank 1's waits for room in its queue)
        ad = Adaptor(comm, config(policy="block", queue=1, timeout_s=2),
                     process=make_collective_process(stall_at=1, stall_s=20, log=log))
        t0 = time.monotonic()
        record["errors"] = simulate(ad, 5, rank, size, pause=0.2)
        ad.finalize()
        record["seconds"] = time.monotonic() - t0
        record["status"] = {s: [v.status, v.reason] for s, v in ad.status.items()}
        record["out"] = str(out / "out")
    elif case == "simulation_raises":
        # rank 1's simulation raises at step 2 inside `with Adaptor(...)`; rank 0's goes on calling execute()
        errors = []
        ad = None
        try:
            with Adaptor(comm, config(policy="block", queue=2), process=make_process({0: 0.3, 1: 0.3}, log=log)) as ad:
                for step in range(5):
                    if rank == 1 and step == 2:
                        raise RuntimeError("the simulation diverged")
                    u, start = local(step, rank, size)
                    t = time.monotonic()
                    try:
                        ad.execute(step, 0.1 * step, {"U": u}, GLOBAL, start)
                    except (InsituError, InputError) as e:
                        errors.append({"step": step, "type": type(e).__name__, "message": str(e),
                                       "after_s": time.monotonic() - t})
        except RuntimeError as e:
            errors.append({"step": "simulation", "type": "RuntimeError", "message": str(e)})
        record["errors"] = errors
        record["status"] = {s: [v.status, v.reason] for s, v in ad.status.items()}
        record["out"] = str(out / "out")
    elif case == "two_threads":
        # while the main thread's execute(0) trains (sync), a second thread calls execute(1): refused at once on
        # each rank, nothing queued; then the main thread's execute(1) trains it
        training, refused = threading.Event(), threading.Event()
        inner = make_process({}, log=log)

        def process(block, cfg, comm_, **kw):
            training.set()
            refused.wait(30)
            return inner(block, cfg, comm_, **kw)

        ad = Adaptor(comm, config(mode="sync"), process=process)
        errors = []

        def second():
            training.wait(30)
            t = time.monotonic()
            u, start = local(1, rank, size)
            try:
                ad.execute(1, 0.1, {"U": u}, GLOBAL, start)
            except InputError as e:
                errors.append({"step": 1, "type": "InputError", "message": str(e), "after_s": time.monotonic() - t,
                               "status": sorted(ad.status)})
            refused.set()

        thread = threading.Thread(target=second, name="second-sim-thread")
        thread.start()
        for step in (0, 1):
            u, start = local(step, rank, size)
            ad.execute(step, 0.1 * step, {"U": u}, GLOBAL, start)
        thread.join()
        ad.finalize()
        record["errors"] = errors
    elif case == "disk_full":
        # rank 0 cannot write step 1's files (ENOSPC, in the export phase as the pipeline's writer): one line on
        # each rank's stderr, step 1 failed, training stops (no step after it trains), every later call says so
        import errno
        import io

        from insitu.output.files import named_error

        inner = make_process({}, log=log)

        def process(block, cfg, comm_, *, step, **kw):
            result = inner(block, cfg, comm_, step=step, **kw)
            with comm_.phase("export"):
                if step == 1 and comm_.rank == 0:
                    raise named_error(OSError(errno.ENOSPC, "No space left on device"), out / "out" / "model.ply")
            return result

        ad = Adaptor(comm, config(policy="block", queue=1), process=process)
        stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            record["errors"] = simulate(ad, 5, rank, size, pause=0.3)
            try:
                ad.finalize()
            except InsituError as e:
                record["errors"].append({"step": "finalize", "type": "InsituError", "message": str(e)})
        finally:
            stderr, sys.stderr = sys.stderr.getvalue(), stderr
        record["stderr"] = stderr
        record["status"] = {s: [v.status, v.reason] for s, v in ad.status.items()}
    elif case == "no_finalize":
        # the simulation ends without finalize() while steps wait in the queue (run alone: the process then exits)
        inner = make_process({0: 0.3, 1: 0.3}, log=log)

        def process(block, cfg, comm_, *, step, writer, **kw):     # each trained step leaves its folder
            result = inner(block, cfg, comm_, step=step, writer=writer, **kw)
            if comm_.rank == 0:
                writer.write(step, None, [], {"psnr": 20.0}, cfg)
            return result

        ad = Adaptor(comm, config(policy="block", queue=4), process=process)
        record["errors"] = simulate(ad, 4, rank, size)
        record["queued"] = sorted(s for s, v in ad.status.items() if v.status == "queued")
    elif case == "config_differs":
        cfg = config()
        cfg["views"] = {"count": 8 + rank}
        try:
            Adaptor(comm, cfg, process=make_process({}))
            record["errors"] = []
        except ConfigError as e:
            record["errors"] = [{"type": "ConfigError", "message": str(e)}]
    elif case == "bad_step_then_good":
        # the real pipeline: step 0 is uniform (no surface), steps 1 and 2 a sphere; background mode
        out_dir = out / "out"
        cfg = {**base, "run": {**base["run"], "mode": "background", "progress": False, "backend": "torch"},
               "series": {"warm_iterations": 2, "warm_start": True}, "input": {"var": "U", "iso": [0.5]}, "seeds": {"budget": 100},
               "views": {"count": 8, "resolution": 16, "supersample": 1},
               "train": {"iterations": 3},
               "output": {"dir": str(out_dir), "images": 0}}
        ad = Adaptor(comm, cfg)
        n = 12
        z, y, x = np.meshgrid(*(np.linspace(-1, 1, n, dtype=np.float32),) * 3, indexing="ij")
        sphere = np.clip(1.2 - np.sqrt(x**2 + y**2 + z**2) / 0.6, 0, 1)
        lo, hi = rank * n // size, (rank + 1) * n // size
        errors = []
        for step in range(3):
            u = np.zeros((n, n, n), np.float32) if step == 0 else sphere
            try:
                ad.execute(step, 0.0, {"U": np.ascontiguousarray(u[:, :, lo:hi])}, (n, n, n), (lo, 0, 0))
            except InsituError as e:
                errors.append({"step": step, "type": "InsituError", "message": str(e)})
            sleep(0.5)
        try:
            ad.finalize()
        except InsituError as e:
            errors.append({"step": "finalize", "type": "InsituError", "message": str(e)})
        record["errors"] = errors
        record["status"] = {s: [v.status, v.reason] for s, v in ad.status.items()}
        record["out"] = str(out_dir)
    elif case == "pipeline":
        # the real pipeline, tiny: a sphere that grows from step to step, trained in the background, warm-started
        # (series.cold_above 1: on this coarse grid most of the grown sphere's start is new seeds)
        cfg = {**base, "run": {**base["run"], "mode": "background", "progress": False, "backend": "torch"},
               "series": {"warm_iterations": 10, "cold_above": 1.0, "warm_start": True,
                          "follow_iterations": True}, "input": {"var": "U", "iso": [0.5]},
               "seeds": {"budget": 500},
               "views": {"count": 8, "resolution": 32, "supersample": 1},
               "train": {"iterations": 20}, "output": {**base["output"], "images": 1}}
        ad = Adaptor(comm, cfg)
        n = 16
        z, y, x = np.meshgrid(*(np.linspace(-1, 1, n, dtype=np.float32),) * 3, indexing="ij")
        r = np.sqrt(x**2 + y**2 + z**2)
        lo, hi = rank * n // size, (rank + 1) * n // size
        for step in range(2):
            u = np.ascontiguousarray(np.clip(1.2 - r / (0.5 + 0.1 * step), 0, 1)[:, :, lo:hi])
            ad.execute(step, 0.5 * step, {"U": u}, (n, n, n), (lo, 0, 0), spacing=(2 / (n - 1),) * 3)
        ad.finalize()
        record["metrics"] = [t.metrics for t in ad.stats.trained]
    else:
        raise SystemExit(f"unknown case {case!r}")
    if "ad" in locals():
        st = ad.stats
        record.update(trained=st.trained_steps, dropped=st.dropped,
                      waited=[r.waited_s for r in st.executes], executes=len(st.executes),
                      bytes=[r.bytes_copied for r in st.executes], seconds=[r.seconds for r in st.executes])
    record["log"] = log
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def main() -> None:
    """``adaptor_cases.py CASE[,CASE...] OUTDIR``: each case writes OUTDIR/CASE/rank<r>.json."""
    for case in sys.argv[1].split(","):
        run(case, Path(sys.argv[2]) / case)
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
