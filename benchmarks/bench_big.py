"""A model past one GPU's memory: ~100M Gaussians at 2048² on 2 GPUs, and what one GPU would need.

One command (the GPU machine, ``benchmarks/gpu_run.sh big100`` runs it with ``$MPIRUN``)::

    python benchmarks/bench_big.py --data ../shared/data/bonsai_256x256x256_uint8.raw --iso 40 \\
        --budget 100000000 --out gpu_out/big100

1. ``insitu run`` on 2 ranks (one GPU each): ``--budget`` Gaussians drawn on the isosurface
   (``seeds.fill``), ``--views`` views at ``--resolution``, ``--iterations`` iterations without
   densification, the model written in parallel to ``model.ply``. From its metrics.json:
   PSNR/SSIM before and after, peak memory per GPU, seconds per stage.
2. ``bench_step.py`` (a fixed model, no densification) on 1 GPU at ``budget / 8`` and
   ``budget / 4`` Gaussians: peak memory and time per step; a line through the two gives the
   projected peak memory of the whole model on one GPU (it grows linearly with the Gaussians).
3. ``bench_step.py`` on 2 GPUs at ``budget / 4``: peak memory per GPU against 1 GPU, the same model.

Prints a summary and writes ``OUT/summary.json``; every run's log is kept in ``OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` with its output streamed into ``log`` (what a killed run printed stays there);
    returns (exit code, output, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
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


def step_json(out: str) -> dict | None:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="volume for `insitu run` (raw, .npy or .bp)")
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--budget", type=int, default=100_000_000)
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--views", type=int, default=40, help="orbit views; every 8th held out")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--sh-degree", type=int, default=3)
    ap.add_argument("--mpirun", default="mpirun --allow-run-as-root --bind-to none",
                    help="launcher command (add -x VAR as your MPI needs)")
    ap.add_argument("--out", default="gpu_out/big100")
    ap.add_argument("--model-dir", default="/tmp/big100", help="where `insitu run` writes (model.ply is large)")
    ap.add_argument("--run-timeout", type=float, default=360)
    ap.add_argument("--skip", nargs="*", default=[], choices=["run", "project", "halve"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mpirun = shlex.split(args.mpirun)
    summary: dict = {"data": args.data, "budget": args.budget, "resolution": args.resolution,
                     "views": args.views, "iterations": args.iterations, "sh_degree": args.sh_degree}

    def save() -> None:             # after every stage: a run cut at its limit keeps what it measured
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    if "run" not in args.skip:
        cmd = mpirun + ["-n", "2", sys.executable, "-m", "insitu", "run", args.data, "--iso", str(args.iso),
                        "--budget", str(args.budget), "--views", str(args.views),
                        "--resolution", str(args.resolution), "--iterations", str(args.iterations),
                        "--set", "seeds.fill=true", "--set", f"train.sh_degree={args.sh_degree}",
                        "--set", "train.densify_from=1000000000", "--set", "train.opacity_reset_every=0",
                        "--set", f"train.sh_increase_every={max(1, args.iterations // 4)}", "--set", "output.images=2",
                        "--set", "output.ply_metrics=false",
                        "--out", args.model_dir]          # progress bars in the log: how far a cut run got
        code, _, seconds = run(cmd, out / "run_2gpu.log", timeout=args.run_timeout)
        metrics_path = Path(args.model_dir) / "step_000000" / "metrics.json"
        if code == 0 and metrics_path.exists():
            m = json.loads(metrics_path.read_text())
            ply = Path(args.model_dir) / "step_000000" / "model.ply"
            summary["two_gpus"] = {
                "gaussians": m["gaussians"], "psnr_initial": m["psnr_initial"], "psnr": m["psnr"],
                "ssim": m["ssim"], "peak_gpu_memory_gb_max_rank": m.get("peak_gpu_memory_gb"),
                "seconds_per_iteration": round(m["train_seconds"] / max(m["iterations"], 1), 4),
                "seeds_seconds": m["seeds_seconds"], "ground_truth_seconds": m["ground_truth_seconds"],
                "train_seconds (iterations + one held-out evaluation)": m["train_seconds"],
                "model_write_seconds": m.get("model_write_seconds"),
                "model_ply_bytes": ply.stat().st_size if ply.exists() else None, "wall_seconds": round(seconds, 1)}
        else:
            summary["two_gpus"] = {"failed": f"exit {code}; see {out / 'run_2gpu.log'}"}
        save()

    step = [sys.executable, "benchmarks/bench_step.py", "--data", args.data, "--iso", str(args.iso),
            "--resolution", str(args.resolution), "--views", "8", "--steps", "10", "--warmup", "3",
            "--sh-degree", str(args.sh_degree)]
    points = []
    if "project" not in args.skip:
        for n in (args.budget // 8, args.budget // 4):
            code, text, _ = run(mpirun + ["-n", "1"] + step + ["--budget", str(n)], out / f"step_1gpu_{n}.log", 200)
            r = step_json(text) if code == 0 else None
            if r:
                points.append((r["gaussians"], r["peak_gpu_gb_per_rank"][0], r["step_ms_median"]))
        summary["one_gpu_measured"] = [{"gaussians": g, "peak_gpu_gb": p, "step_ms": s} for g, p, s in points]
        if len(points) == 2:
            (n0, p0, _), (n1, p1, _) = points
            slope = (p1 - p0) / (n1 - n0)
            total = summary.get("two_gpus", {}).get("gaussians") or args.budget
            summary["one_gpu_projected_peak_gb"] = round(p0 + slope * (total - n0), 1)
            summary["projection"] = f"linear through the two 1-GPU points: {p0:.2f} GB + {slope * 1e6:.4f} GB per 1M Gaussians"
        save()
    if "halve" not in args.skip:
        n = args.budget // 4
        code, text, _ = run(mpirun + ["-n", "2"] + step + ["--budget", str(n)], out / f"step_2gpu_{n}.log", 200)
        r = step_json(text) if code == 0 else None
        if r:
            one = [p for g, p, _ in points if abs(g - r["gaussians"]) < 0.01 * g]
            summary["same_model_2gpu"] = {"gaussians": r["gaussians"], "peak_gpu_gb_per_rank": r["peak_gpu_gb_per_rank"],
                                          "step_ms": r["step_ms_median"], "peak_gpu_gb_1gpu": one[0] if one else None}
    save()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
