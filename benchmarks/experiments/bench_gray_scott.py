"""Gray-Scott mini-app throughput: simulation steps/s with no output, BP5 files and SST streaming.

Each configuration runs the simulation as its own process (``mpiexec -n R`` for R > 1
ranks). For SST a reader process is spawned that only reads every step (one reader per
reader rank, each reading its block through ``insitu.input.sources.SSTSource``), so the number
measures what streaming costs the simulation.

    python benchmarks/experiments/bench_gray_scott.py --L 64 --steps 200 --plotgap 10 --ranks 1 2
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "sims" / "insitu_sims" / "gray_scott.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"

READER = """
import sys, time
sys.modules.setdefault("torch", None)          # adios2 imports torch when installed; not needed here
sys.path.insert(0, sys.argv[1])
from mpi4py import MPI
from insitu.input.sources import SSTSource
comm = MPI.COMM_WORLD
t0, n, nbytes = time.perf_counter(), 0, 0
with SSTSource(sys.argv[2], "U", rank=comm.rank, size=comm.size, timeout_s=120,
               comm=comm if comm.size > 1 else None) as src:
    for step in src:
        n += 1
        nbytes += step.block.data.nbytes
    read_ms = 1e3 * sum(src.read_seconds) / max(len(src.read_seconds), 1)
nbytes = comm.allreduce(nbytes)
read_ms = comm.allreduce(read_ms, op=MPI.MAX)
if comm.rank == 0:
    print(f"reader: {n} steps, {nbytes / 1e6:.1f} MB in {time.perf_counter() - t0:.2f} s, "
          f"read {read_ms:.1f} ms per step per rank", flush=True)
"""

# the full analysis attached: `insitu stream` trains a small model on every step it gets
ANALYSIS = ["-m", "insitu", "stream", "{name}", "--var", "V", "--iso", "0.3", "--views", "24", "--resolution", "64",
            "--iterations", "100", "--budget", "3000", "--quiet", "--timeout", "120", "--out", "analysis_out"]

LINE = re.compile(r"([\d.]+) s, ([\d.]+) steps/s \((\d+) outputs, ([\d.]+) s in output\)")


def launch(ranks: int, args: list[str]) -> list[str]:
    return ([str(MPIEXEC), "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, *args]


def run_one(L: int, steps: int, plotgap: int, ranks: int, engine: str, readers: int, policy: str,
            workdir: Path) -> dict:
    name = f"bench_{engine}_{ranks}.bp"
    sim = launch(ranks, [str(SIM), "--L", str(L), "--steps", str(steps), "--plotgap", str(plotgap),
                         "--engine", engine, "--output", name, "--sst-readers", str(readers), "--sst-policy",
                         policy])
    reader = None
    if engine == "SST":
        reader = subprocess.Popen(launch(readers, ["-c", READER, str(ROOT), name]), cwd=workdir,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elif engine == "SST+analysis":
        sim[sim.index("SST+analysis")] = "SST"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        reader = subprocess.Popen(launch(readers, [a.format(name=name) for a in ANALYSIS]), cwd=workdir,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.perf_counter()
    proc = subprocess.run(sim, cwd=workdir, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(sim)} failed:\n{proc.stderr}")
    m = LINE.search(proc.stdout)
    if m is None:
        raise RuntimeError(f"no timing line in: {proc.stdout}")
    seconds, sps, outputs, out_s = float(m[1]), float(m[2]), int(m[3]), float(m[4])
    note = ""
    if reader is not None:
        rout, rerr = reader.communicate(timeout=600)
        if reader.returncode != 0:
            raise RuntimeError(f"SST reader failed:\n{rerr}")
        lines = rout.strip().splitlines()
        note = lines[-1] if lines else ""
        if engine == "SST+analysis":
            note = f"{sum(1 for x in lines if x.startswith('step '))} steps trained"
    mb = outputs * 2 * L ** 3 * 8 / 1e6          # U and V, float64
    return {"engine": engine, "ranks": ranks, "steps/s": sps, "seconds": seconds, "output s": out_s,
            "output MB/s": mb / out_s if out_s > 0 and engine != "none" else float("nan"),
            "wall s": wall, "note": note}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--L", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--plotgap", type=int, default=10)
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--engines", nargs="+", default=["none", "BP5", "SST"], choices=["none", "BP5", "SST", "SST+analysis"],
                   help="SST+analysis: `insitu stream` trains on the stream (use --policy Discard)")
    p.add_argument("--readers", type=int, default=1, help="SST reader ranks (each its own cohort)")
    p.add_argument("--policy", default="Block", choices=["Block", "Discard"], help="SST QueueFullPolicy")
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_gs_") as tmp:
        for ranks in a.ranks:
            for engine in a.engines:
                rows.append(run_one(a.L, a.steps, a.plotgap, ranks, engine, a.readers, a.policy, Path(tmp)))
                r = rows[-1]
                print(f"  {engine:>4} ranks={ranks}: {r['steps/s']:.1f} steps/s {r['note']}", file=sys.stderr,
                      flush=True)
    print(f"\nGray-Scott L={a.L} ({a.L ** 3 / 1e6:.2f} M cells), {a.steps} steps, output every {a.plotgap} "
          f"(U and V, {2 * a.L ** 3 * 8 / 1e6:.1f} MB per output); SST: {a.readers} reader rank(s), {a.policy}\n")
    print("| engine | sim ranks | steps/s | s in output | output MB/s | reader |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        mbs = "-" if r["output MB/s"] != r["output MB/s"] else f"{r['output MB/s']:.0f}"
        print(f"| {r['engine']} | {r['ranks']} | {r['steps/s']:.1f} | {r['output s']:.3f} | {mbs} | {r['note']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
