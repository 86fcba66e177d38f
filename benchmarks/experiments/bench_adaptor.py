"""What linking the Adaptor costs a simulation: Gray-Scott time per step with the adaptor off,
in sync mode and in background mode.

    mpiexec -n 2 python benchmarks/experiments/bench_adaptor.py --L 48 --steps 200 --plotgap 50

Prints, per mode: seconds per simulation step (rank 0, whole run including training in
sync mode), the overhead against "off", the time the simulation thread spent inside
execute() per call, and the bytes copied per execute() (this rank's block with ghosts).
Background mode's overhead is the figure to protect: the training runs in a worker thread
(competing for the same cores on a CPU-only machine).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "sims"))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from insitu_sims.gray_scott import GrayScottSettings, run  # noqa: E402
from insitu.run.adaptor import Adaptor  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--L", type=int, default=48)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plotgap", type=int, default=50)
    p.add_argument("--iso", type=float, default=0.2)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="run.threads: torch CPU threads (0: default)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    out = Path(tempfile.mkdtemp(prefix="bench_adaptor_")) if comm.rank == 0 else None
    out = Path(comm.bcast(str(out) if out else None))
    settings = GrayScottSettings(L=args.L, steps=args.steps, plotgap=args.plotgap, engine="none")
    base = {"input": {"var": "V", "iso": [args.iso]}, "seeds": {"budget": 2000},
            "views": {"count": 16, "resolution": 64, "supersample": 1},
            "train": {"iterations": args.iterations}, "output": {"images": 0},
            "run": {"progress": False, "device": args.device, "threads": args.threads},
            "series": {"warm_iterations": max(args.iterations // 2, 1)}}
    rows = []
    for mode in ("off", "sync", "background"):
        adaptor = None
        if mode != "off":
            cfg = {**base, "run": {**base["run"], "mode": mode}, "output": {"images": 0, "dir": str(out / mode)}}
            adaptor = Adaptor(comm, cfg)
        comm.Barrier()
        t0 = time.perf_counter()
        stats = run(settings, comm, consumer=adaptor.execute if adaptor else None)
        sim_s = stats.seconds
        if adaptor is not None:
            adaptor.finalize()
        total = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        st = adaptor.stats if adaptor else None
        rows.append((mode, sim_s / settings.steps, total,
                     st.caller_seconds / max(len(st.executes), 1) if st else 0.0,
                     st.bytes_copied // max(len(st.executes), 1) if st else 0,
                     len(st.trained) if st else 0))
    if comm.rank == 0:
        off = rows[0][1]
        print(f"Gray-Scott L={args.L}, {args.steps} steps, execute every {args.plotgap}, {comm.size} rank(s), "
              f"torch threads {torch.get_num_threads()}")
        print(f"{'mode':<11} {'s/step':>9} {'overhead':>9} {'execute s':>10} {'bytes/exec':>11} "
              f"{'trained':>8} {'total s':>8}")
        for mode, per_step, total, exec_s, nbytes, trained in rows:
            print(f"{mode:<11} {per_step:9.5f} {100 * (per_step / off - 1):8.1f}% {exec_s:10.4f} {nbytes:11d} "
                  f"{trained:8d} {total:8.2f}")
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
