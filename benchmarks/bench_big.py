"""A model past one GPU's memory: the same `insitu run` at several model sizes on 1 and 2 GPUs.

One command (the GPU machine; ``benchmarks/gpu_run.sh big100`` runs it with ``$MPIRUN``)::

    python benchmarks/bench_big.py --data ../shared/data/bonsai_256x256x256_uint8.raw --iso 40 \\
        --runs 2:25000000 2:100000000 1:25000000 1:100000000 --out gpu_out/big100

Each ``P:BUDGET`` is ``insitu run`` on P ranks (one GPU each) with BUDGET Gaussians drawn on the
isosurface (``seeds.fill``), ``--views`` views at ``--resolution``, ``--iterations`` iterations at
SH degree 3 without densification, the model written in parallel to one ``model.ply`` (on one
rank: ``--no-ply-on-one`` skips it). From its metrics.json and progress lines: peak GPU memory
(largest rank), seconds per iteration (between the first and the last progress line of the
training), PSNR/SSIM before and after, seconds per stage, the model file's size and write time;
a run that ran out of GPU memory is recorded as such. A line through the 2-rank peaks gives
the projected peak of every budget on one GPU (its shard is P times larger).

Writes ``OUT/summary.json`` after every run (a run cut at its limit keeps what came before);
every run's log is kept in ``OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` with its output streamed into ``log``; returns (exit code, output, seconds)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep what is there
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(map(shlex.quote, cmd)) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                  cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = 124
    seconds = time.perf_counter() - t
    print(f"[{seconds:6.1f} s, exit {code}] {log.name}", flush=True)
    return code, log.read_text(), seconds


def seconds_per_iteration(log: str) -> float | None:
    """From the training's progress lines ``train: i/n ... (t s)``: (t_last - t_first) / (i_last - i_first)."""
    points = [(int(i), float(t)) for i, t in re.findall(r"train: (\d+)/\d+.*?\(([\d.]+) s\)", log)]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    (i0, t0), (i1, t1) = points[0], points[-1]
    return round((t1 - t0) / (i1 - i0), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="volume for `insitu run` (raw, .npy or .bp)")
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--runs", nargs="+", default=["2:25000000", "2:100000000", "1:25000000", "1:100000000"],
                    help="P:BUDGET pairs, in order")
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--views", type=int, default=40, help="orbit views; every 8th held out")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--mpirun", default="mpirun --allow-run-as-root --bind-to none",
                    help="launcher command (add -x VAR as your MPI needs)")
    ap.add_argument("--out", default="gpu_out/big100")
    ap.add_argument("--model-dir", default="/tmp/big", help="where `insitu run` writes (model.ply is large)")
    ap.add_argument("--no-ply-on-one", action="store_true", help="no model.ply for the 1-rank runs")
    ap.add_argument("--no-ply", action="store_true", help="no model.ply at all")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"data": args.data, "resolution": args.resolution, "views": args.views,
                     "iterations": args.iterations, "sh_degree": 3, "runs": []}
    for spec in args.runs:
        P, budget = (int(x) for x in spec.split(":"))
        model_dir = Path(f"{args.model_dir}_{P}_{budget}")
        cmd = shlex.split(args.mpirun) + [
            "-n", str(P), sys.executable, "-m", "insitu", "run", args.data, "--iso", str(args.iso),
            "--budget", str(budget), "--views", str(args.views), "--resolution", str(args.resolution),
            "--iterations", str(args.iterations), "--set", "seeds.density=0", "--set", "seeds.fill=true",
            "--set", "train.sh_degree=3",
            "--set", f"train.sh_increase_every={max(1, args.iterations // 4)}",
            "--set", "train.densify_from=1000000000", "--set", "train.opacity_reset_every=0",
            "--set", "output.images=2", "--set", "output.ply_metrics=false", "--overwrite", "--out", str(model_dir)]
        if args.no_ply or (P == 1 and args.no_ply_on_one):
            cmd += ["--set", "output.ply=false"]
        code, log, seconds = run(cmd, out / f"run_{P}gpu_{budget}.log", args.timeout)
        row: dict = {"ranks": P, "budget": budget, "exit": code, "wall_seconds": round(seconds, 1)}
        metrics = model_dir / "step_000000" / "metrics.json"
        if code == 0 and metrics.exists():
            m = json.loads(metrics.read_text())
            ply = model_dir / "step_000000" / "model.ply"
            row.update({k: m.get(k) for k in ("gaussians", "psnr_initial", "psnr", "ssim", "seeds_seconds",
                                              "ground_truth_seconds", "color_init_seconds", "train_seconds",
                                              "model_write_seconds")})
            row["peak_gpu_gb_max_rank"] = round(m["peak_gpu_memory_gb"], 2)
            row["seconds_per_iteration"] = seconds_per_iteration(log)
            row["model_ply_bytes"] = ply.stat().st_size if ply.exists() else None
        elif "out of memory" in log.lower():
            row["out_of_memory"] = True
        summary["runs"].append(row)
        two = [r for r in summary["runs"] if r["ranks"] == 2 and "peak_gpu_gb_max_rank" in r]
        if len(two) >= 2:               # peak per rank = a + b * (Gaussians per rank)
            (n0, p0), (n1, p1) = [(r["gaussians"] / 2, r["peak_gpu_gb_max_rank"]) for r in two[:2]]
            b = (p1 - p0) / (n1 - n0)
            summary["projection"] = {"gb_per_million_per_rank": round(b * 1e6, 4), "fixed_gb": round(p0 - b * n0, 2),
                                     "one_gpu_peak_gb": {str(r["budget"]): round(p0 + b * (r["budget"] - n0), 1)
                                                         for r in summary["runs"]}}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
