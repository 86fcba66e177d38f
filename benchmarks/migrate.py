"""Rows of the schema from the raw files of the runs made before ``python -m benchmarks`` (gpu_run.sh stages).

The latest measurement of each case: the fidelity cases and the GPU demo (runs 104, 108, 109), the A/B of
runs 108 and 109, the cold first process (run 105), the speed protocol (runs 18-20 on two H200, run 30 on
one) and the models past one GPU (runs 15-16). Every figure is read from the run's files in
``benchmarks/results/runs/``; what is written here is each run's provenance: its machine, the command that
made it, the commit that recorded its files (whose tree is the code it measured) and, where its logs lack a
timestamp, its day (BENCHMARKS.md's, now docs/log.md). Appends the rows of the runs a results file does not
hold yet, so a second call adds nothing:

    python -m benchmarks.migrate && python -m benchmarks doc
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from benchmarks.cases import fidelity, speed
from benchmarks.harness import csv_rows, metrics_row
from benchmarks.schema import VERSION, check_row

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks" / "results" / "runs"
FIDELITY = "DATA=.data FID_CASES='{}' benchmarks/gpu_run.sh fidelity"
FIDAB = "DATA=.data FID_AB='first:. old1:.old new1:. old2:.old new2:.' benchmarks/gpu_run.sh fidab"
NOTE = "migrated from the files of run {} (benchmarks/gpu_run.sh; docs/log.md); commit: the one that recorded them"


def recorded_by(folder: Path) -> str:
    """The commit that added the run's files: the code its tree holds is the code the run measured."""
    first = sorted(p for p in folder.iterdir() if p.is_file())[0]       # followed through the move into runs/
    out = subprocess.run(["git", "-C", str(ROOT), "log", "--follow", "--diff-filter=A", "--format=%h", "--",
                          str(first)], capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise SystemExit(f"benchmarks.migrate: no commit added {folder}")
    return out[-1]


def stamp(folder: Path, stage: str, day: str) -> str:
    """The time of the run's ``== STAGE DATE`` line (gpu_run.sh prints one per stage), else its day."""
    for log in sorted(folder.glob("*.log")):
        m = re.search(rf"^== {re.escape(stage)} (\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ)", log.read_text(errors="replace"),
                      re.M)
        if m:
            return m[1]
    return day


def command_of(case: str) -> str:
    file, args = fidelity.CASES[case]
    return " ".join(["insitu", "run", file, *args])


def fidelity_rows(run: str, cases: str, cache: dict) -> list[dict]:
    folder = RUNS / run
    rows = []
    for name in cases.split():
        if name == "demo":
            continue
        m = json.loads((folder / f"fid_{name}.json").read_text())
        rows.append(metrics_row(m, name, cmd=command_of(name), kernel_cache=cache.get(name), step=None))
    return rows


def demo_rows(run: str) -> list[dict]:
    return [metrics_row(s, "demo", cmd="insitu demo", kernel_cache="warm")
            for s in csv_rows(RUNS / run / "fid_demo_metrics.csv") if s.get("status") == "trained"]


def fidab_rows(run: str) -> list[dict]:
    rows = []
    for f in sorted(RUNS.joinpath(run).glob("fidab_*_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1])):
        label, order = f.stem[len("fidab_"):].rsplit("_", 1)
        tree = "." if label.startswith(("first", "new")) else ".old"
        rows.append(metrics_row(json.loads(f.read_text()), label, cmd=command_of("bonsai"), step=None,
                                kernel_cache=None if order == "1" else "warm",
                                extra={"tree": tree, "order": int(order), "case": "bonsai"}))
    return rows


def last_json(path: Path) -> dict:
    return json.loads([line for line in path.read_text().splitlines() if line.startswith("{")][-1])


def speed_rows_one_gpu() -> list[dict]:
    folder, cmd = RUNS / "run30", " ".join(["insitu", "run", fidelity.BONSAI, *speed.PROTOCOL])
    step = last_json(folder / "run30_stepprof.json")
    train = json.loads((folder / "run30_proto_train1_metrics.json").read_text())
    batch2 = json.loads((folder / "run30_proto_batch2x1_metrics.json").read_text())
    return [
        {"name": "step, 1 rank", "ranks": 1, "gaussians": step["gaussians"], "device": "cuda",
         "cmd": "python benchmarks/experiments/bench_step.py --data bonsai_256x256x256_uint8.raw --iso 40 "
                "--budget 4000000 --resolution 2048 --views 8 --steps 30 --profile 10",
         "extra": {k: step[k] for k in ("step_ms_median", "bare_raster_ms")}},
        metrics_row(train, "protocol, 1 rank", cmd=cmd, step=None,
                    extra={"target_reached_at": train.get("target_reached_at"), "ssim": train.get("ssim")}),
        metrics_row(batch2, "protocol, 2 views per step, 1 rank", step=None,
                    cmd=cmd.replace("--iterations 6000 --batch 1", "--iterations 3000 --batch 2")
                           .replace("train.eval_every=500", "train.eval_every=250"),
                    extra={"target_reached_at": batch2.get("target_reached_at"), "ssim": batch2.get("ssim")}),
    ]


def speed_rows_two_gpus(run: str) -> list[dict]:
    folder = RUNS / run
    cmd = " ".join(["insitu", "run", fidelity.BONSAI, *speed.PROTOCOL])
    rows = []
    if run == "run18":
        for n in (1, 2):
            gt = last_json(folder / f"run18_proto_gt{n}.json")
            rows.append({"name": f"gt, {n} rank{'s' if n > 1 else ''}", "ranks": n, "device": "cuda",
                         "ground_truth_seconds": gt["gt_seconds"],
                         "cmd": "python benchmarks/experiments/bench_groundtruth.py --pipeline --data "
                                "bonsai_256x256x256_uint8.raw --views 448 --resolution 2048",
                         "extra": {"grays_per_s": gt["grays_per_s"]}})
    if run == "run19":
        m = json.loads((folder / "run19_proto_train2_metrics.json").read_text())
        rows.append(metrics_row(m, "protocol, 2 ranks", cmd=cmd, step=None,
                                extra={"target_reached_at": m.get("target_reached_at"), "ssim": m.get("ssim")}))
    if run == "run20":
        m = json.loads((folder / "run20_proto_batch2_metrics.json").read_text())
        rows.append(metrics_row(m, "protocol, 2 views per step, 2 ranks", step=None,
                                cmd=cmd.replace("--iterations 6000 --batch 1", "--iterations 3000 --batch 2")
                                       .replace("train.eval_every=500", "train.eval_every=250"),
                                extra={"target_reached_at": m.get("target_reached_at"), "ssim": m.get("ssim")}))
    return rows


def scale_rows(run: str, summary: str) -> list[dict]:
    s = json.loads((RUNS / run / summary).read_text())
    rows = []
    for r in s["runs"]:
        budget, ranks = r["budget"], r["ranks"]
        name = f"{budget / 1e6:g}M, {ranks} rank{'s' if ranks > 1 else ''}"
        cmd = (f"insitu run {fidelity.BONSAI} --iso 40 --budget {budget} --views {s['views']} "
               f"--resolution {s['resolution']} --iterations {s['iterations']} --set seeds.fill=true ...")
        extra = {"budget": budget}
        if r.get("exit") != 0:
            why = "out of GPU memory" if r.get("out_of_memory") else f"exit {r.get('exit')}"
            rows.append({"name": name, "ranks": ranks, "cmd": cmd, "extra": extra, "error": why})
            continue
        extra["seconds_per_iteration"] = r["seconds_per_iteration"]
        if "projection" in s:
            extra["projected_one_gpu_gb"] = s["projection"]["one_gpu_peak_gb"].get(str(budget))
        rows.append({"name": name, "ranks": ranks, "device": "cuda", "cmd": cmd, "gaussians": r["gaussians"],
                     "psnr": r["psnr"], "peak_gpu_memory_gb": r["peak_gpu_gb_max_rank"],
                     "seeds_seconds": r["seeds_seconds"], "ground_truth_seconds": r["ground_truth_seconds"],
                     "train_seconds": r["train_seconds"], "seconds": r["wall_seconds"],
                     **({"model_bytes": r["model_ply_bytes"]} if r.get("model_ply_bytes") else {}), "extra": extra})
    return rows


# (run, case, stage for the timestamp, day, machine, command, rows)
SOURCES = [
    ("run15", "scale", "big100", "2026-11-30", "nvidia-h200-x2",
     'BIG_RUNS="2:25000000 2:100000000 1:25000000 1:100000000" benchmarks/gpu_run.sh big100',
     lambda: scale_rows("run15", "run15_big100_summary.json")),
    ("run16", "scale", "big100", "2026-11-30", "nvidia-h200-x2",
     'BIG_RUNS="2:150000000 1:150000000" BIG_ARGS=--no-ply benchmarks/gpu_run.sh big100',
     lambda: scale_rows("run16", "run16_big150_summary.json")),
    ("run18", "speed", "gt", "2026-11-30", "nvidia-h200-x2",
     "benchmarks/gpu_run.sh gt protocol recipe summary loop tests",
     lambda: speed_rows_two_gpus("run18")),
    ("run19", "speed", "proto2", "2026-11-30", "nvidia-h200-x2", "benchmarks/gpu_run.sh proto2",
     lambda: speed_rows_two_gpus("run19")),
    ("run20", "speed", "batch2", "2026-11-30", "nvidia-h200-x2", "benchmarks/gpu_run.sh batch2",
     lambda: speed_rows_two_gpus("run20")),
    ("run30", "speed", "stepprof", "2026-12-01", "nvidia-h200", "benchmarks/gpu_run.sh stepprof tests proto1 batch2x1",
     speed_rows_one_gpu),
    ("run104", "fidelity", "fidelity", "2026-12-04", "nvidia-h200", FIDELITY.format("engine bonsai bonsai4m demo"),
     lambda: fidelity_rows("run104", "engine bonsai bonsai4m",
                           {"engine": "warm", "bonsai": "warm", "bonsai4m": "warm"})),
    ("run104", "demo", "fidelity", "2026-12-04", "nvidia-h200", FIDELITY.format("engine bonsai bonsai4m demo"),
     lambda: demo_rows("run104")),
    ("run105", "coldstart", "coldab", "2026-12-04", "nvidia-h200",
     "COLD_AB='final:.' DATA=.data benchmarks/gpu_run.sh coldab",
     lambda: [metrics_row(json.loads((RUNS / "run105" / "coldab_final_1_metrics.json").read_text()), "cold",
                          cmd=command_of("bonsai"), kernel_cache="cold", step=None,
                          extra={"case": "bonsai", "order": 1, "evicted_gb":
                                 json.loads((RUNS / "run105" / "coldab_final_1.json").read_text())["evicted"]["gb"]})]),
    *((run, "fidelity", "fidelity", "2026-12-04", "nvidia-h200", FIDELITY.format("bonsai engine demo"),
       lambda run=run: fidelity_rows(run, "bonsai engine", {"engine": "warm"})) for run in ("run108", "run109")),
    *((run, "demo", "fidelity", "2026-12-04", "nvidia-h200", FIDELITY.format("bonsai engine demo"),
       lambda run=run: demo_rows(run)) for run in ("run108", "run109")),
    *((run, "fidab", "fidab", "2026-12-04", "nvidia-h200", FIDAB, lambda run=run: fidab_rows(run))
      for run in ("run108", "run109")),
]
NOTES = {
    ("run108", "fidelity"): "the bonsai the first fidelity process, after the GPU tests on a freshly started machine",
    ("run109", "fidelity"): "the bonsai the first fidelity process, after the GPU tests on a freshly started machine",
    ("run108", "fidab"): "'.old': the package at 757758e, before the round's fixes",
    ("run109", "fidab"): "'.old': the package of run 108 (30471ae)",
    ("run105", "coldstart"): "the first process on a freshly started machine, libraries evicted from the page cache",
    ("run104", "fidelity"): "the kernel cache warm from runs 102-103",
    ("run30", "speed"): "the code of 2026-12-01 (SH colours, one view per step): not measured since",
    ("run18", "speed"): "the code of 2026-11-30: not measured since",
    ("run19", "speed"): "the code of 2026-11-30: not measured since",
    ("run20", "speed"): "the code of 2026-11-30: not measured since",
    ("run15", "scale"): "the code of 2026-11-30: not measured since",
    ("run16", "scale"): "the code of 2026-11-30: not measured since",
}


def main() -> None:
    results = ROOT / "benchmarks" / "results"
    added = 0
    for run, case, stage, day, machine, command, make in SOURCES:
        path = results / f"{machine}.jsonl"
        have = {(json.loads(line)["run"], json.loads(line)["case"]) for line in path.read_text().splitlines()
                if line.strip()} if path.is_file() else set()
        if (run, case) in have:
            continue
        folder = RUNS / run
        common = {"schema": VERSION, "commit": recorded_by(folder), "machine": machine,
                  "date": stamp(folder, stage, day), "case": case, "run": run, "command": command}
        note = "; ".join(filter(None, (NOTES.get((run, case)), NOTE.format(run[3:]))))
        rows = [check_row({**common, **{k: v for k, v in r.items() if v is not None}, "note": note}) for r in make()]
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        added += len(rows)
    print(f"benchmarks.migrate: {added} row(s) added")


if __name__ == "__main__":
    main()
