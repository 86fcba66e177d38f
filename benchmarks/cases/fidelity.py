"""Fidelity: `insitu run` of each fidelity case with the package's defaults, as a user runs it.

One process per case, one after the other, one GPU (``CUDA_VISIBLE_DEVICES`` as given). Each row holds the
step's figures from its metrics.json: the surface (``psnr_foreground``) on the orbit's held-out views, 2x and
3x closer and off the orbit, the whole image, ``model.ply``, Gaussians and seconds, and whether the process
began with a cold or a warm kernel cache.

    python -m benchmarks fidelity                           # bonsai, engine, bonsai4m
    python -m benchmarks fidelity --only bonsai engine      # some of them
    python -m benchmarks fidelity --only bonsai --cold      # every process with an empty kernel cache
    python -m benchmarks fidelity --tiny                    # a synthetic ball on the CPU, seconds

Cases (``--only``; the volumes in ``--data``): bonsai, engine (1024^2, 448 views), bonsai_500k (the bonsai
with 500k seeds), engine_sh (SH colours, no close-ups: the settings before the lit model), bonsai4m
(4M Gaussians at 2048^2, ``seeds.fill``); ``tiny`` with ``--tiny``. The demo is the ``demo`` case.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.harness import insitu_argv, kernel_cache, metrics_row, read_metrics, run_logged, \
    synthetic_volume, tail

BONSAI = "bonsai_256x256x256_uint8.raw"
ENGINE = "engine_256x256x128_uint8.raw"
FID = ("--views", "448", "--resolution", "1024")
# name -> (volume file in --data, arguments after it)
CASES = {
    "bonsai": (BONSAI, ("--iso", "40", *FID)),
    "bonsai_500k": (BONSAI, ("--iso", "40", *FID, "--budget", "500000")),
    "engine": (ENGINE, ("--iso", "90", *FID)),
    "engine_sh": (ENGINE, ("--iso", "90", *FID, "--budget", "500000", "--iterations", "4000", "--batch", "1",
                           "--set", "train.color_model=sh", "--set", "views.closeups=0", "--set", "seeds.density=0")),
    "bonsai4m": (BONSAI, ("--iso", "40", "--views", "448", "--resolution", "2048", "--budget", "4000000",
                          "--set", "seeds.density=0", "--set", "seeds.fill=true")),
}
DEFAULT = ("bonsai", "engine", "bonsai4m")
# --tiny: the tests' tiny step (tests/conftest.py TINY) on a 16^3 ball
TINY_ARGS = ("--views", "8", "--resolution", "16", "--iterations", "2", "--budget", "100",
             "--set", "views.supersample=1")
COLUMNS = ("name", "psnr_foreground_initial", "psnr_foreground", "psnr", "psnr_foreground_near2",
           "psnr_foreground_near3", "psnr_foreground_off", "ply_psnr_foreground", "gaussians", "seconds", "kernel_cache")


def add_arguments(parser) -> None:
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE",
                        help=f"the cases to run, in this order (default: {' '.join(DEFAULT)}; "
                             f"of {', '.join(sorted(CASES))})")
    parser.add_argument("--cold", action="store_true",
                        help="each process with an empty kernel cache of its own (a first process on a fresh machine)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a configuration override for every case (repeatable)")


def case_volume(args, case: str) -> tuple[Path, tuple[str, ...]]:
    """The volume and the ``insitu run`` arguments of a case that runs one fidelity case (``args.case``): with
    ``--tiny`` a synthetic ball; else the case's file under ``--data``, which must be there."""
    if args.tiny:
        volume, iso = synthetic_volume(args.run_dir / "ball.npy")
        return volume, ("--iso", str(iso), *TINY_ARGS)
    file, case_args = CASES[args.case]
    volume = args.data / file
    if not volume.is_file():
        raise SystemExit(f"benchmarks: error: {case}: no volume {volume} (--data: the folder of {file})")
    return volume, case_args


def measure(args, name: str, volume: Path, case_args: tuple[str, ...], *, label: str | None = None,
            tree: Path | None = None, cache: Path | None = None) -> dict:
    """One `insitu run VOLUME CASE_ARGS` (and ``args.overrides``, ``--device``): its row, named ``label``.

    ``tree``: run the ``insitu`` package of that folder instead of this checkout's (an A/B of two trees: the
    process starts there, and ``python -m`` puts its working folder first on the path);
    ``cache``: the kernel cache folder (default the process's own). Logs and metrics.json go to ``args.run_dir``;
    the outputs (models) to a temporary folder, removed after."""
    label = label or name
    sets = [a for kv in getattr(args, "overrides", []) for a in ("--set", kv)]
    user_args = [*case_args, *sets]
    env, state = kernel_cache(args.device, cache)
    out = Path(tempfile.mkdtemp(prefix=f"bench-{label}-"))
    log = args.run_dir / f"{label}.log"
    try:
        argv = insitu_argv("run", volume.resolve(), *user_args, "--device", args.device, "--quiet", "--out", out)
        rc = run_logged(argv, log, timeout=args.timeout, env=env, cwd=tree)
        metrics = read_metrics(out)
        if metrics is not None:
            shutil.copy(out / "step_000000" / "metrics.json", args.run_dir / f"{label}_metrics.json")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    fields = {"cmd": " ".join(["insitu", "run", volume.name, *user_args]), "kernel_cache": state}
    if rc != 0 or metrics is None:
        return {"name": label, **fields, "device": args.device,
                "error": f"exit {rc}: {tail(log) or 'no output'} ({log.name})"}
    return metrics_row(metrics, label, **fields)


def run(args) -> list[dict]:
    if args.tiny:
        volume, iso = synthetic_volume(args.run_dir / "ball.npy")
        return [measure(args, "tiny", volume, ("--iso", str(iso), *TINY_ARGS))]
    names = args.only or DEFAULT
    for name in names:      # every volume checked before the first process starts
        if not (args.data / CASES[name][0]).is_file():
            raise SystemExit(f"benchmarks: error: fidelity: case {name}: no volume {args.data / CASES[name][0]} "
                             f"(--data: the folder of {CASES[name][0]})")
    rows = []
    for name in names:
        file, case_args = CASES[name]
        volume = args.data / file
        cache = Path(tempfile.mkdtemp(prefix="bench-kc-")) if args.cold else None
        rows.append(measure(args, name, volume, case_args, cache=cache))
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    return rows
