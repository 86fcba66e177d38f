"""Demo: `insitu demo` as a user runs it, one row per trained timestep and one for the whole command.

The demo's own settings for the device: with a GPU, Gray-Scott L = 128, six timesteps at 512^2; on the CPU
(``--device cpu``, what ``make demo`` runs) L = 36, two timesteps at 96^2. Each timestep's row holds its
figures from the demo's metrics.csv (``seconds``: the step's own); the row named ``LABEL (command)`` holds
the wall seconds of the whole command, simulation and start-up included.

    python -m benchmarks demo                        # the GPU demo (the CPU demo without a GPU)
    python -m benchmarks demo --device cpu           # `make demo`'s demo
    python -m benchmarks demo --label demo_pkg --set train.pixel_loss=l2 --set train.min_scale_px=0.5
    python -m benchmarks demo --tiny                 # a 12^3 grid, tiny steps, seconds
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import csv_rows, insitu_argv, kernel_cache, metrics_row, run_logged, tail

TINY_ARGS = ("--L", "12", "--steps", "20", "--plotgap", "10", "--views", "8", "--resolution", "16",
             "--iterations", "2", "--budget", "100", "--set", "views.supersample=1")
COLUMNS = ("name", "step", "psnr_foreground", "psnr", "psnr_foreground_near2", "psnr_foreground_near3",
           "psnr_foreground_off", "ply_psnr_foreground", "gaussians", "iterations", "seconds", "kernel_cache")


def add_arguments(parser) -> None:
    parser.add_argument("--label", default="demo", help="the rows' name (default demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a configuration override (repeatable)")


def run(args) -> list[dict]:
    user_args = [*(TINY_ARGS if args.tiny else ()), *(a for kv in args.overrides for a in ("--set", kv))]
    env, state = kernel_cache(args.device)
    out = Path(tempfile.mkdtemp(prefix="bench-demo-"))
    log = args.run_dir / f"{args.label}.log"
    try:
        start = time.perf_counter()
        rc = run_logged(insitu_argv("demo", *user_args, "--device", args.device, "--quiet", "--out", out), log,
                        timeout=args.timeout, env=env)
        wall = time.perf_counter() - start
        csv = out / "metrics.csv"
        steps = csv_rows(csv) if csv.is_file() else []
        if steps:
            shutil.copy(csv, args.run_dir / f"{args.label}_metrics.csv")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    cmd = " ".join(["insitu", "demo", *user_args])
    rows = []
    for s in steps:
        if s.get("status") == "trained":
            # the first timestep compiles what a cold cache lacks; the later ones find it compiled
            cache = state if not rows or state is None else "warm"
            rows.append(metrics_row(s, args.label, cmd=cmd, kernel_cache=cache))
        else:
            rows.append({"name": args.label, "step": int(s["step"]), "cmd": cmd,
                         "error": f"step {s['step']}: {s.get('status')} ({log.name})"})
    whole = {"name": f"{args.label} (command)", "cmd": cmd, "device": args.device, "seconds": round(wall, 3),
             "kernel_cache": state}
    if rc != 0 or not steps:
        whole["error"] = f"exit {rc}: {tail(log) or 'no output'} ({log.name})"
    return rows + [whole]
