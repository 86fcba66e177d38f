"""Cold start: one fidelity case as the first process on a machine (empty kernel cache), then warm.

The first process compiles every kernel (an empty ``TRITON_CACHE_DIR`` of its own) and, with ``--evict``,
reads its libraries from the disk (the page cache dropped for Python's library folders and the package);
the next ``--warm`` processes run the same command with the kernels it left. Rows ``cold`` and ``warm``
(``warm_2``, ...; on the CPU, where nothing compiles, ``first`` and ``later``): the seconds of each phase
(seeds, ground truth, training, ``model.ply``'s fit) and the total, and the surface (the same model either way).

    python -m benchmarks coldstart                       # the bonsai, cold then warm
    python -m benchmarks coldstart --evict --case engine
    python -m benchmarks coldstart --tiny                # on the CPU: nothing compiles, a first and a second process
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks.cases.fidelity import CASES, case_volume, measure
from benchmarks.harness import evict_page_cache

TABLE = "run"   # cold against warm compares only within its run
COLUMNS = ("name", "seconds", "seeds_seconds", "ground_truth_seconds", "train_seconds", "ply_fit_seconds",
           "psnr_foreground", "kernel_cache")


def add_arguments(parser) -> None:
    parser.add_argument("--case", default="bonsai", choices=sorted(CASES), help="the fidelity case (default bonsai)")
    parser.add_argument("--evict", action="store_true",
                        help="drop the libraries' files from the page cache before the cold process")
    parser.add_argument("--warm", type=int, default=1, help="warm processes after the cold one (default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a configuration override for every process (repeatable)")


def run(args) -> list[dict]:
    if args.warm < 0:
        raise SystemExit(f"benchmarks: error: coldstart: --warm: expected 0 or more, got {args.warm}")
    volume, case_args = case_volume(args, "coldstart")
    cache = Path(tempfile.mkdtemp(prefix="bench-kc-"))
    evicted = evict_page_cache(Path(__file__).resolve().parents[2]) if args.evict else None
    rows = []
    try:
        for n in range(args.warm + 1):
            # on the CPU nothing compiles: a first and a later process
            first, later = ("cold", "warm") if args.device == "cuda" else ("first", "later")
            label = first if n == 0 else later if n == 1 else f"{later}_{n}"
            row = measure(args, label, volume, case_args, cache=cache)
            row["extra"] = {"case": "tiny" if args.tiny else args.case, "order": n + 1}
            if n == 0 and evicted:
                row["extra"]["evicted_gb"] = evicted["gb"]
            rows.append(row)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return rows
