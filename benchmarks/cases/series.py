"""Series: a simulation's timesteps replayed with the package's defaults, against cold steps.

Each series is written by a mini-app of sims/insitu_sims through ADIOS2 (BP5), then replayed as a user replays
it, `insitu replay FILE --var VAR --iso ISO --views 448 --resolution 1024` (the package's defaults otherwise: every
step its surface converted afresh, `series.warm_start` off; ``--variant warm=series.warm_start=true`` replays the
steps warm-started from the ones before). One row per trained step (named after the
series): the surface (``psnr_foreground``), 2x and 3x closer, off the orbit, ``model.ply``, Gaussians,
iterations, the step's phases in seconds (seeds, ground truth, training, ply fit; ``seconds``: the whole
step) and the bytes of its model; ``extra`` holds the step's other figures (Gaussians it started from,
where a quality target was reached, evaluation and write seconds, and any column the step's metrics.csv
adds: a time budget's verdict, say).

``--steps`` replays only some of the written steps (the first of them cold; rows SERIES_fromFIRST, apart from the
whole series' rows); each ``--variant NAME=KEY=VALUE,...`` replays the same file once more with those overrides
(rows SERIES_NAME), e.g. ``--variant budget8=series.step_seconds=8``.

Every ``--cold-every``-th step (the 5th, 10th, ...) is also trained cold: the same file replayed once more
with ``--steps N1 N2 ... --set series.warm_start=false`` (one process; rows named SERIES_cold), and the warm
step's row gains ``extra.cold_psnr_foreground``, ``extra.cold_gaussians``, ``extra.below_cold_db`` (cold
minus warm surface PSNR) and ``extra.gaussians_over_cold`` (warm / cold).
``--stream SERIES`` trains that series once more as it is simulated: the mini-app writing through ADIOS2 SST
(``--sst-policy``: Block, the default, or Discard) and `insitu stream` reading it (rows SERIES_stream). Every row's
``extra`` holds the simulation's seconds, ``sim_seconds`` and ``sim_output_seconds`` (in output: writing the BP
file, or waiting for the SST reader): what training the series cost the simulation. A series whose simulation
fails is one row with its ``error``; so is a replay that trains nothing.

Series (``--only``; each 20 written steps):

    gray_scott   the ADIOS2 tutorial's Gray-Scott, noise on: L = 128, 960 steps, every 48th; V at 0.3
    breakup      Gray-Scott, --preset breakup (the labyrinth tears into dividing spots): L = 128, 2400 steps,
                 every 120th; V at 0.3
    heat         moving heat sources (insitu_sims.heat: blobs that grow, move, merge and split): L = 128,
                 2000 steps, every 100th; T at 0.5

    python -m benchmarks series --only gray_scott             # one series, and its stream
    python -m benchmarks series --only breakup heat --stream none
    python -m benchmarks series --tiny                        # every series at L = 16, 5 steps, tiny images
    python -m benchmarks series --only breakup --sim-ranks 8  # the mini-app on 8 ranks: 30 s instead of 258 s

``--sim-ranks K`` runs the mini-app on K MPI ranks (the same fields). A 20-step series at L = 128 with its cold
references took 8.6 min on one H100 for heat; the Gray-Scott ones take longer (``--steps`` splits them).

The BP files (at L = 128, 670 MB a Gray-Scott series, U and V, and 340 MB a heat one) go to a temporary
folder, removed afterwards (``--keep``: kept in the run's folder); each replay's metrics.csv and log are kept in
the run's folder.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import csv_rows, insitu_argv, kernel_cache, metrics_row, mpi_argv, run_logged, tail

ROOT = Path(__file__).resolve().parents[2]
# a mini-app's last line: its wall seconds and those in output
SIM_SUMMARY = re.compile(r": ([0-9.]+) s, [0-9.]+ steps/s \(\d+ outputs, ([0-9.]+) s in output\)")
VIEWS = ("--views", "448", "--resolution", "1024")
# --tiny: the tests' tiny step (tests/conftest.py TINY), warm steps as short
TINY_ARGS = ("--views", "8", "--resolution", "16", "--iterations", "2", "--budget", "100",
             "--set", "views.supersample=1", "--set", "series.warm_iterations=2")
# metrics.csv columns that are no schema field, kept under extra (the step's other figures)
EXTRA = ("gaussians_initial", "target_reached_at", "evaluation_seconds", "initial_evaluation_seconds",
         "color_init_seconds", "scene_seconds", "export_seconds", "model_write_seconds", "web_model_bytes")
# metrics.csv columns that are neither a figure here nor of interest (status, configuration echoes)
IGNORED = ("status", "reason", "time", "color_model", "eps2d", "antialiased", "test_views", "sh_degree", "lpips",
           "psnr_white", "psnr_initial", "ply_ssim_foreground", "ply_psnr", "ply_ssim",
           "ssim", "ssim_foreground_near2", "ssim_foreground_near3", "ssim_foreground_off", "psnr_near2",
           "psnr_near3", "psnr_off")
COLUMNS = ("name", "step", "psnr_foreground_initial", "psnr_foreground", "extra.cold_psnr_foreground",
           "psnr_foreground_near2", "psnr_foreground_near3", "psnr_foreground_off", "ply_psnr_foreground", "spz_psnr_foreground", "gaussians",
           "extra.cold_gaussians", "iterations", "seeds_seconds", "train_seconds", "seconds", "model_bytes")


@dataclass(frozen=True)
class Series:
    """A series: the mini-app (``insitu_sims.SIM``), its arguments at full size and with --tiny, the field."""

    sim: str
    args: tuple[str, ...]
    tiny: tuple[str, ...]
    var: str
    iso: float


SERIES = {
    "gray_scott": Series("gray_scott", ("--L", "128", "--steps", "960", "--plotgap", "48"),
                         ("--L", "16", "--steps", "50", "--plotgap", "10"), "V", 0.3),
    "breakup": Series("gray_scott", ("--preset", "breakup", "--L", "128", "--steps", "2400", "--plotgap", "120"),
                      ("--preset", "breakup", "--L", "16", "--steps", "50", "--plotgap", "10"), "V", 0.3),
    "heat": Series("heat", ("--L", "128", "--steps", "2000", "--plotgap", "100"),
                   ("--L", "16", "--width", "1", "--period", "100", "--steps", "50", "--plotgap", "10"), "T", 0.5),
}


def cadence(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0: no cold steps), got {text!r}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--only", nargs="+", choices=sorted(SERIES), metavar="SERIES",
                        help=f"the series to run, in this order (default: all of {', '.join(SERIES)})")
    parser.add_argument("--stream", default="gray_scott", choices=(*SERIES, "none"),
                        help="the series trained once more through ADIOS2 SST and `insitu stream` (default "
                             "gray_scott; none: no stream)")
    parser.add_argument("--cold-every", type=cadence, default=5, metavar="K",
                        help="a cold reference of every K-th step (default 5; 0: none)")
    parser.add_argument("--ranks", type=int, default=1, help="MPI ranks of each `insitu` process (default 1)")
    parser.add_argument("--sim-ranks", type=int, default=1, metavar="K",
                        help="MPI ranks of the mini-app (default 1; its fields do not depend on K: the "
                             "Gray-Scott noise is a hash of the global cell)")
    parser.add_argument("--sst-policy", default="Block", choices=("Block", "Discard"),
                        help="the stream's SST QueueFullPolicy (default Block: the simulation waits for the "
                             "training; Discard: it keeps its pace and the steps it outruns are dropped)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a configuration override of every replay and stream (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the BP files, in the run's folder")
    parser.add_argument("--steps", nargs="+", type=int, metavar="N",
                        help="replay only these written steps (default: all; the first trains cold)")
    parser.add_argument("--variant", action="append", default=[], type=variant, metavar="NAME=KEY=VALUE,...",
                        help="replay the written series once more with these overrides, rows SERIES_NAME "
                             "(repeatable), e.g. budget8=series.step_seconds=8")


def variant(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> (name, the replay's ``--set`` arguments)."""
    name, _, rest = text.partition("=")
    pairs = [p for p in rest.split(",") if p]
    if not name.isidentifier() or not pairs or not all("=" in p and "." in p.split("=")[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME=SECTION.KEY=VALUE,..., got {text!r}")
    return name, [a for p in pairs for a in ("--set", p)]


def sims_env() -> dict:
    """The mini-apps' environment: sims/ (insitu_sims) and the repository on PYTHONPATH, after what is there."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "sims"), os.environ.get("PYTHONPATH")]))}


def sim_argv(series: Series, tiny: bool, *extra: str) -> list[str]:
    return [sys.executable, "-m", f"insitu_sims.{series.sim}", *(series.tiny if tiny else series.args), *extra]


def user_args(args, series: Series) -> list[str]:
    """The replay's and the stream's arguments after the input: the field, the views, the overrides."""
    sets = [a for kv in args.overrides for a in ("--set", kv)]
    return ["--var", series.var, "--iso", f"{series.iso:g}", *(TINY_ARGS if args.tiny else VIEWS), *sets]


def step_rows(csv: Path, name: str, cmd: str, log: Path, cache: str | None) -> list[dict]:
    """The rows of a metrics.csv: a trained step's figures (schema fields, and ``extra``), a step that was not
    trained as a row with its ``error``."""
    rows = []
    for i, r in enumerate(csv_rows(csv)):
        if r.get("status") != "trained":
            rows.append({"name": name, "step": int(r["step"]), "cmd": cmd,
                         "error": f"step {r['step']}: {r.get('status')}: {r.get('reason') or ''} ({log.name})"})
            continue
        row = metrics_row(r, name, cmd=cmd, kernel_cache=cache if i == 0 or cache is None else "warm")
        known = set(row) | {"total_seconds", "step", "ranks", "device", *IGNORED}
        extra = {k: v for k, v in r.items() if v is not None and (k in EXTRA or k not in known)
                 and not k.startswith("history")}
        if extra:
            row["extra"] = extra
        rows.append(row)
    return rows


def replay(args, name: str, series: Series, bp: Path, work: Path, *more: str) -> list[dict]:
    """`insitu replay BP ...` (and ``more``): its rows named ``name``; one row with ``error`` when it trained
    nothing."""
    out = work / f"{name}_out"
    log = args.run_dir / f"{name}.log"
    env, cache = kernel_cache(args.device)
    argv = mpi_argv(args.ranks, insitu_argv("replay", bp, *user_args(args, series), *more, "--device", args.device,
                                            "--quiet", "--out", out))
    rc = run_logged(argv, log, timeout=args.timeout, env=env)
    cmd = " ".join(["insitu", "replay", bp.name, *user_args(args, series), *more])
    return collect(args, name, out, log, rc, cmd, cache)


def collect(args, name: str, out: Path, log: Path, rc: int, cmd: str, cache: str | None) -> list[dict]:
    csv = out / "metrics.csv"
    rows = []
    if csv.is_file():
        shutil.copy(csv, args.run_dir / f"{name}_metrics.csv")
        rows = step_rows(csv, name, cmd, log, cache)
    shutil.rmtree(out, ignore_errors=True)
    if rc != 0 or not any("error" not in r for r in rows):
        rows.append({"name": name, "cmd": cmd, "device": args.device,
                     "error": f"exit {rc}: {tail(log) or 'no output'} ({log.name})"})
    return rows


def compare(warm: list[dict], cold: list[dict]) -> None:
    """Each warm step that has a cold reference gains the cold step's figures in its ``extra``."""
    by_step = {r["step"]: r for r in cold if "error" not in r and "step" in r}
    for r in warm:
        c = by_step.get(r.get("step"))
        if c is None or "error" in r:
            continue
        extra = r.setdefault("extra", {})
        extra["cold_psnr_foreground"] = c.get("psnr_foreground")
        extra["cold_gaussians"] = c.get("gaussians")
        if r.get("psnr_foreground") is not None and c.get("psnr_foreground") is not None:
            extra["below_cold_db"] = round(c["psnr_foreground"] - r["psnr_foreground"], 3)
        if r.get("gaussians") and c.get("gaussians"):
            extra["gaussians_over_cold"] = round(r["gaussians"] / c["gaussians"], 3)


def simulate(args, name: str, series: Series, work: Path) -> tuple[Path | None, dict | None]:
    """The series written to ``work/NAME.bp``: its path, or None and an error row."""
    bp = work / f"{name}.bp"
    log = args.run_dir / f"{name}_sim.log"
    rc = run_logged(mpi_argv(args.sim_ranks, sim_argv(series, args.tiny, "--output", str(bp))), log,
                    timeout=args.timeout, env=sims_env())
    if rc != 0 or not bp.exists():
        return None, {"name": name, "device": args.device, "cmd": " ".join(sim_argv(series, args.tiny)[1:]),
                      "error": f"simulation: exit {rc}: {tail(log) or 'no output'} ({log.name})"}
    return bp, None


def sim_seconds(log: Path) -> dict:
    """The mini-app's own figures from the last summary line of its ``log``: ``sim_seconds`` (its wall time) and
    ``sim_output_seconds`` (of which in output: writing, or waiting for an SST reader); {} without one."""
    found = list(SIM_SUMMARY.finditer(log.read_text(errors="replace"))) if log.is_file() else []
    return {"sim_seconds": float(found[-1][1]), "sim_output_seconds": float(found[-1][2])} if found else {}


def with_sim(rows: list[dict], figures: dict) -> list[dict]:
    """``rows`` (the trained ones) with the simulation's ``figures`` in their ``extra``."""
    for r in rows if figures else []:
        if "error" not in r:
            r.setdefault("extra", {}).update(figures)
    return rows


def stream(args, name: str, series: Series, work: Path) -> list[dict]:
    """The series simulated again, through SST (``--sst-policy``), while `insitu stream` trains it: rows
    ``NAME_stream``, each with the simulation's seconds (:func:`sim_seconds`) and its policy."""
    label = f"{name}_stream"
    contact = f"{name}_sst"
    sim_log, log = args.run_dir / f"{label}_sim.log", args.run_dir / f"{label}.log"
    argv = mpi_argv(args.sim_ranks, sim_argv(series, args.tiny, "--engine", "SST", "--output", contact,
                                             "--sst-readers", str(args.ranks), "--sst-policy", args.sst_policy))
    with sim_log.open("w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        writer = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=work,
                                  env={**os.environ, **sims_env()})
    env, cache = kernel_cache(args.device)
    out = work / f"{label}_out"
    try:
        rc = run_logged(mpi_argv(args.ranks, insitu_argv("stream", contact, *user_args(args, series), "--device",
                                                         args.device, "--quiet", "--out", out)),
                        log, timeout=args.timeout, env=env, cwd=work)
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:     # the reader gave up: the writer waits for it for ever
            writer.kill()
            writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    cmd = " ".join(["insitu", "stream", contact, *user_args(args, series)])
    rows = with_sim(collect(args, label, out, log, rc, cmd, cache),
                    {**sim_seconds(sim_log), "sst_policy": args.sst_policy})
    if writer.returncode != 0:
        rows.append({"name": label, "cmd": " ".join(argv[1:]), "device": args.device,
                     "error": f"simulation: exit {writer.returncode}: {tail(sim_log) or 'no output'} ({sim_log.name})"})
    return rows


def run(args) -> list[dict]:
    for option, value in (("--ranks", args.ranks), ("--sim-ranks", args.sim_ranks)):
        if value < 1:
            raise SystemExit(f"benchmarks: error: series: {option} {value}: expected at least 1")
    names = args.only or list(SERIES)
    work = Path(tempfile.mkdtemp(prefix="bench-series-"))
    rows = []
    try:
        for name in names:
            series = SERIES[name]
            bp, failed = simulate(args, name, series, work)
            if failed is not None:
                rows.append(failed)
                continue
            only = ("--steps", *map(str, args.steps)) if args.steps else ()
            label = f"{name}_from{args.steps[0]}" if args.steps else name      # a part of the series: its own rows
            warm = with_sim(replay(args, label, series, bp, work, *only),
                            sim_seconds(args.run_dir / f"{name}_sim.log"))
            for variant_name, sets in args.variant:
                rows += replay(args, f"{label}_{variant_name}", series, bp, work, *only, *sets)
            trained = [r["step"] for r in warm if "error" not in r and "step" in r]
            cold_steps = trained[args.cold_every - 1::args.cold_every] if args.cold_every else []
            cold = replay(args, f"{label}_cold", series, bp, work, "--steps", *map(str, cold_steps),
                          "--set", "series.warm_start=false") if cold_steps else []
            compare(warm, cold)
            rows += warm + cold
            if args.keep:
                shutil.move(str(bp), args.run_dir / bp.name)
            else:
                shutil.rmtree(bp, ignore_errors=True)
        if args.stream != "none":
            rows += stream(args, args.stream, SERIES[args.stream], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
