"""Speed: the speed protocol, the bonsai at 1024^2 trained to PSNR 30 / SSIM 0.97, on 1 and more GPUs.

Parts (``--parts``):

- ``protocol``: `insitu run` of the bonsai, 448 views at 1024^2, one view per step, 500k seeds, SH degree 3,
  evaluated every 500 iterations, stopping at PSNR 30 and SSIM 0.97 (at most 6000 iterations), on each of
  ``--ranks`` (one GPU a rank): iterations to the target, seconds of the ground truth, training and total;
- ``step``: one training step of a fixed ~4M-Gaussian model at 2048^2 against gsplat's bare rasterization
  (``benchmarks/experiments/bench_step.py``): ms per step in ``extra``;
- ``gt``: the ground truth alone, 448 views at 2048^2, 2x2 rays per pixel (``bench_groundtruth.py --pipeline``).

    python -m benchmarks speed                          # all parts on 1 GPU
    python -m benchmarks speed --ranks 1 2              # and on 2 (MPI: $MPIRUN, default Open MPI's mpirun)
    python -m benchmarks speed --tiny                   # the protocol's command at the tests' tiny size, CPU
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.cases.fidelity import BONSAI, TINY_ARGS
from benchmarks.harness import insitu_argv, kernel_cache, metrics_row, mpi_argv, read_metrics, run_logged, \
    synthetic_volume, tail

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
PROTOCOL = ("--iso", "40", "--views", "448", "--resolution", "1024", "--iterations", "6000", "--batch", "1",
            "--psnr-target", "30", "--ssim-target", "0.97", "--budget", "500000", "--set", "train.eval_every=500",
            "--set", "train.sh_degree=3")
PARTS = ("protocol", "step", "gt")
COLUMNS = ("name", "ranks", "gaussians", "iterations", "psnr", "ground_truth_seconds", "train_seconds", "seconds",
           "extra.step_ms_median", "extra.bare_raster_ms", "kernel_cache")


def add_arguments(parser) -> None:
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="default: all")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1], help="ranks (GPUs) of each part (default 1)")


def json_line(log: Path) -> dict | None:
    """The last line of ``log`` that is a JSON object (what the experiment scripts print last)."""
    for line in reversed(log.read_text(errors="replace").splitlines() if log.is_file() else []):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def protocol(args, volume: Path, case_args, ranks: int) -> dict:
    name = f"protocol, {ranks} rank{'s' if ranks > 1 else ''}"
    env, state = kernel_cache(args.device)
    out = Path(tempfile.mkdtemp(prefix="bench-speed-"))
    log = args.run_dir / f"protocol_{ranks}.log"
    try:
        rc = run_logged(mpi_argv(ranks, insitu_argv("run", volume.resolve(), *case_args, "--device", args.device,
                                                    "--quiet", "--out", out)), log, timeout=args.timeout, env=env)
        metrics = read_metrics(out)
        if metrics is not None:
            (args.run_dir / f"protocol_{ranks}_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    cmd = " ".join(["insitu", "run", volume.name, *case_args])
    if rc != 0 or metrics is None:
        return {"name": name, "ranks": ranks, "cmd": cmd, "error": f"exit {rc}: {tail(log)} ({log.name})"}
    return metrics_row(metrics, name, cmd=cmd, kernel_cache=state,
                       extra={"target_reached_at": metrics.get("target_reached_at"), "ssim": metrics.get("ssim")})


def script(args, part: str, ranks: int, argv: list[str]) -> dict:
    """An experiment script's one JSON line as a row's ``extra``."""
    name = f"{part}, {ranks} rank{'s' if ranks > 1 else ''}"
    log = args.run_dir / f"{part}_{ranks}.log"
    env, state = kernel_cache(args.device)
    rc = run_logged(mpi_argv(ranks, argv), log, timeout=args.timeout, env=env)
    figures = json_line(log)
    cmd = " ".join(["python", *map(str, argv[1:])]).replace(str(args.data) + "/", "")
    if rc != 0 or figures is None:
        return {"name": name, "ranks": ranks, "cmd": cmd, "error": f"exit {rc}: {tail(log)} ({log.name})"}
    row = {"name": name, "ranks": ranks, "cmd": cmd, "device": args.device, "kernel_cache": state, "extra": figures}
    if "gt_seconds" in figures:
        row["ground_truth_seconds"] = float(figures["gt_seconds"])
    return row


def run(args) -> list[dict]:
    if args.tiny:
        volume, iso = synthetic_volume(args.run_dir / "ball.npy")
        return [protocol(args, volume, ("--iso", str(iso), *TINY_ARGS), ranks) for ranks in args.ranks]
    volume = args.data / BONSAI
    if not volume.is_file():
        raise SystemExit(f"benchmarks: error: speed: no volume {volume} (--data: the folder of {BONSAI})")
    rows = []
    for ranks in args.ranks:
        if "gt" in args.parts:
            rows.append(script(args, "gt", ranks, [sys.executable,
                                                  str(EXPERIMENTS / "bench_groundtruth.py"), "--pipeline", "--data",
                                                  str(volume), "--views", "448", "--resolution", "2048"]))
        if "step" in args.parts:
            rows.append(script(args, "step", ranks, [sys.executable, str(EXPERIMENTS / "bench_step.py"),
                                                    "--data", str(volume), "--iso", "40", "--budget", "4000000",
                                                    "--resolution", "2048", "--views", "8", "--steps", "30"]))
        if "protocol" in args.parts:
            rows.append(protocol(args, volume, PROTOCOL, ranks))
    return rows
