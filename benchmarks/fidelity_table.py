"""benchmarks/results/fidelity.json and its table, from a `gpu_run.sh fidelity` run's files.

Reads ``DIR/fid_NAME.json`` (metrics.json of each `insitu run`), ``DIR/fid_demo_metrics.csv`` (the GPU
demo's timesteps) and, for the figures before the lit colour model, ``--before`` (a bench_fidelity.py
JSON whose variant ``sh`` ran the same bonsai command with SH colours); prints a Markdown table.

    python benchmarks/fidelity_table.py --dir RUN_DIR --before benchmarks/results/run32_fidelity.json \\
        --gpu "NVIDIA H200" --date 2026-12-01 --out benchmarks/results/fidelity.json
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

KEYS = ("psnr", "psnr_foreground", "psnr_foreground_near2", "psnr_foreground_near3", "psnr_foreground_off",
        "ply_psnr_foreground", "ssim_foreground", "iterations", "gaussians", "train_seconds", "total_seconds")
CASES = {"bonsai": "bonsai 1024^2 (iso 40)", "engine": "engine 1024^2 (iso 90)",
         "bonsai4m": "bonsai 4M Gaussians at 2048^2 (seeds.fill)"}


def figures(m: dict) -> dict:
    return {k: m.get(k) for k in KEYS}


def demo_rows(path: Path) -> list[dict]:
    """The GPU demo's trained timesteps (metrics.csv rows), their figures as numbers."""
    if not path.is_file():
        return []
    rows = []
    with path.open() as f:
        for r in csv.DictReader(f):
            if r.get("status", "trained") == "trained":
                rows.append({k: float(r[k]) if r.get(k) not in (None, "") else None for k in KEYS if k in r}
                            | {"step": int(r["step"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--before", type=Path)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = {"gpu": args.gpu, "date": args.date, "cases": {}}
    for name, label in CASES.items():
        f = args.dir / f"fid_{name}.json"
        if f.is_file():
            out["cases"][name] = {"case": label, "after": figures(json.loads(f.read_text()))}
    if (args.dir / "fid_engine_sh.json").is_file() and "engine" in out["cases"]:
        out["cases"]["engine"]["before"] = figures(json.loads((args.dir / "fid_engine_sh.json").read_text()))
    if args.before and args.before.is_file() and "bonsai" in out["cases"]:
        sh = next((v for v in json.loads(args.before.read_text())["variants"] if v["variant"] == "sh"), None)
        if sh:
            out["cases"]["bonsai"]["before"] = figures(sh)
    cold = args.dir / "fid_bonsai_cold.json"
    if cold.is_file() and "bonsai" in out["cases"]:
        out["cases"]["bonsai"]["after_cold_cache"] = figures(json.loads(cold.read_text()))
    steps = demo_rows(args.dir / "fid_demo_metrics.csv")
    if steps:
        out["cases"]["gray_scott"] = {"case": "insitu demo on the GPU: Gray-Scott L=128 at 512^2", "steps": steps}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    cols = ("psnr", "psnr_foreground", "psnr_foreground_near2", "psnr_foreground_near3", "psnr_foreground_off",
            "ply_psnr_foreground", "iterations", "gaussians", "total_seconds")
    print("| case | model | " + " | ".join(cols) + " |")
    print("| --- | --- |" + " --- |" * len(cols))
    fmt = lambda v: "" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)     # noqa: E731
    for name, case in out["cases"].items():
        for which in ("before", "after", "after_cold_cache"):
            if which in case:
                print(f"| {case['case']} | {which} | " + " | ".join(fmt(case[which].get(c)) for c in cols) + " |")
        for s in case.get("steps", []):
            print(f"| {case['case']}, step {s['step']} | after | " + " | ".join(fmt(s.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
