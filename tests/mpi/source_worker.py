"""Reader process for the source tests: read a BP file or SST stream with one reader per rank.

    [mpiexec -n P] python source_worker.py {bp|sst} NAME VAR REFERENCE.bp [--timeout S]
        [--steps N ...] [--every K] [--kill-pid PID --kill-after N] [--sleep S] [--out PREFIX]

Every rank reads its own block of every step and compares it (ghost layers included)
with the same box of the global array in REFERENCE.bp (read whole with ADIOS2; "-": no
reference, "equal" is then null). One JSON
line per rank and step ({"rank", "step", "time", "start", "count", "equal"}), then one
final line per rank: {"rank", "end": "clean", "dropped"} or {"rank", "error": type, "message"}
("dropped": steps the rank held but skipped to agree with the others). --sleep: the last
rank sleeps S seconds after each step (a slow reader).
The lines go to stdout, or with --out to PREFIX.RANK.jsonl (ranks' stdout can interleave).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# adios2 imports torch when installed; this reader does not need it (seconds at start-up)
sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import adios2  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from insitu.errors import SourceError  # noqa: E402
from insitu.input.sources import BPSource, SSTSource  # noqa: E402


def reference(path: str, var: str) -> dict[int, np.ndarray]:
    with adios2.FileReader(path) as f:
        n = f.num_steps()
        numbers = np.atleast_1d(f.read("step", step_selection=[0, n]))
        full = f.read(var, step_selection=[0, n])
    per = full.shape[0] // n
    return {int(s): full[i * per:(i + 1) * per] for i, s in enumerate(numbers)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("bp", "sst"))
    p.add_argument("name")
    p.add_argument("var")
    p.add_argument("reference")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--steps", type=int, nargs="+")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--kill-pid", type=int)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--out")
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    name = a.name.format(rank=rank)              # "{rank}" in NAME: a different file per rank
    ref = reference(a.reference, a.var) if a.reference != "-" else None
    cls = BPSource if a.kind == "bp" else SSTSource
    seen = 0

    out = open(f"{a.out}.{rank}.jsonl", "w") if a.out else sys.stdout

    def say(obj):
        print(json.dumps({"rank": rank, **obj}), file=out, flush=True)

    try:
        with cls(name, a.var, rank=rank, size=size, steps=a.steps, every=a.every, timeout_s=a.timeout,
                 comm=comm if size > 1 else None) as source:
            for step in source:
                b = step.block
                (x, y, z), (nz, ny, nx) = b.start, b.data.shape
                equal = None if ref is None else \
                    bool(np.array_equal(b.data, ref[step.step][z:z + nz, y:y + ny, x:x + nx]))
                say({"step": step.step, "time": step.time, "start": list(b.start), "count": [nx, ny, nz],
                     "owned": [list(b.owned_lo), list(b.owned_hi)], "global": list(b.global_shape),
                     "equal": equal})
                seen += 1
                if a.kill_pid and seen == a.kill_after:
                    os.kill(a.kill_pid, signal.SIGKILL)
                if a.sleep and rank == size - 1:
                    time.sleep(a.sleep)
        say({"end": "clean", "dropped": source.dropped})
    except SourceError as e:
        say({"error": type(e).__name__, "message": str(e)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
