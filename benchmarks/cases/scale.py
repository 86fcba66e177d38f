"""Scale: a model past one GPU's memory, the same `insitu run` at several sizes on 1 and 2 GPUs.

Each ``P:BUDGET`` of ``--runs`` is `insitu run` of the bonsai on P ranks (one GPU each) with BUDGET Gaussians
drawn on the isosurface (``seeds.fill``), 40 views at 2048^2, 30 iterations at SH degree 3 without growth,
``model.ply`` written in parallel (``--no-ply-on-one``: none on one rank). Each row: the largest rank's peak GPU
memory, seconds per iteration (``extra``: between the first and the last progress line of training), the
phases' seconds, the model's bytes; a run out of GPU memory is a row with that ``error``. The 2-rank rows' peaks
give a projection of each budget's peak on one GPU (``extra.projected_one_gpu_gb``).

    python -m benchmarks scale                                     # 2:25M 2:100M 1:25M 1:100M
    python -m benchmarks scale --runs 2:150000000 1:150000000 --no-ply-on-one
    python -m benchmarks scale --tiny                              # 1:100 1:400 on the CPU, tiny images
"""
from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from pathlib import Path

from benchmarks.cases.fidelity import BONSAI
from benchmarks.harness import insitu_argv, kernel_cache, metrics_row, mpi_argv, read_metrics, run_logged, \
    synthetic_volume, tail

COLUMNS = ("name", "ranks", "gaussians", "peak_gpu_memory_gb", "extra.seconds_per_iteration",
           "ground_truth_seconds", "train_seconds", "model_bytes", "extra.projected_one_gpu_gb", "seconds")


def spec(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected P:BUDGET (ranks and Gaussians, both at least 1), got {text!r}")
    return int(m[1]), int(m[2])


def add_arguments(parser) -> None:
    parser.add_argument("--runs", nargs="+", type=spec, metavar="P:BUDGET",
                        help="ranks and Gaussians, in order (default 2:25000000 2:100000000 1:25000000 1:100000000)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--no-ply-on-one", action="store_true", help="no model.ply for the 1-rank runs")


def seconds_per_iteration(log: str) -> float | None:
    """From the training's progress lines ``train: i/n ... (t s)``: (t_last - t_first) / (i_last - i_first)."""
    points = [(int(i), float(t)) for i, t in re.findall(r"train: (\d+)/\d+.*?\(([\d.]+) s\)", log)]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    (i0, t0), (i1, t1) = points[0], points[-1]
    return round((t1 - t0) / (i1 - i0), 4)


def project(rows: list[dict]) -> None:
    """A line through the first two 2-rank peaks (peak per rank = fixed + slope x Gaussians per rank): each
    row's projected peak on one GPU, in its ``extra``."""
    two = [r for r in rows if r.get("ranks") == 2 and r.get("peak_gpu_memory_gb") and r.get("gaussians")]
    if len(two) < 2 or two[0]["gaussians"] == two[1]["gaussians"]:
        return
    (n0, p0), (n1, p1) = [(r["gaussians"] / 2, r["peak_gpu_memory_gb"]) for r in two[:2]]
    slope = (p1 - p0) / (n1 - n0)
    for r in rows:
        budget = r["extra"]["budget"]
        r["extra"]["projected_one_gpu_gb"] = round(p0 + slope * (budget - n0), 1)


def run(args) -> list[dict]:
    if args.tiny:
        volume, iso = synthetic_volume(args.run_dir / "ball.npy")
        runs, size = args.runs or [(1, 100), (1, 400)], ("--views", "8", "--resolution", "16",
                                                          "--set", "views.supersample=1")
    else:
        volume, iso = args.data / BONSAI, 40.0
        if not volume.is_file():
            raise SystemExit(f"benchmarks: error: scale: no volume {volume} (--data: the folder of {BONSAI})")
        runs, size = args.runs or [(2, 25_000_000), (2, 100_000_000), (1, 25_000_000), (1, 100_000_000)], \
            ("--views", "40", "--resolution", "2048")
    env, state = kernel_cache(args.device)
    rows = []
    for ranks, budget in runs:
        case_args = ["--iso", f"{iso:g}", "--budget", str(budget), *size, "--iterations", str(args.iterations),
                     "--set", "seeds.density=0", "--set", "seeds.fill=true", "--set", "train.sh_degree=3",
                     "--set", f"train.sh_increase_every={max(1, args.iterations // 4)}",
                     "--set", "train.densify.start=1000000000", "--set", "train.densify.reset_every=0",
                     "--set", "output.images=2", "--set", "output.ply_metrics=false"]
        if ranks == 1 and args.no_ply_on_one:
            case_args += ["--set", "output.ply=false"]
        size_text = f"{budget / 1e6:g}M" if budget >= 1_000_000 else str(budget)
        name = f"{size_text}, {ranks} rank{'s' if ranks > 1 else ''}"
        out = Path(tempfile.mkdtemp(prefix="bench-scale-"))
        log = args.run_dir / f"scale_{ranks}_{budget}.log"
        try:
            rc = run_logged(mpi_argv(ranks, insitu_argv("run", volume.resolve(), *case_args, "--device", args.device,
                                                        "--out", out)),
                            log, timeout=args.timeout, env={**env, "PYTHONUNBUFFERED": "1"})
            metrics = read_metrics(out)
            ply = out / "step_000000" / "model.ply"
            ply_bytes = ply.stat().st_size if ply.is_file() else None
        finally:
            shutil.rmtree(out, ignore_errors=True)
        cmd = " ".join(["insitu", "run", volume.name, *case_args])
        extra = {"budget": budget}
        if rc != 0 or metrics is None:
            text = log.read_text(errors="replace").lower() if log.is_file() else ""
            why = "out of GPU memory" if "out of memory" in text else f"exit {rc}: {tail(log)}"
            rows.append({"name": name, "ranks": ranks, "cmd": cmd, "extra": extra, "error": f"{why} ({log.name})"})
            continue
        extra["seconds_per_iteration"] = seconds_per_iteration(log.read_text(errors="replace"))
        row = metrics_row(metrics, name, cmd=cmd, kernel_cache=state, extra=extra)
        if ply_bytes is not None:
            row["model_bytes"] = ply_bytes
        rows.append(row)
    project(rows)
    return rows
