"""A/B: one fidelity case from several code trees, one process after the other, on one machine.

Each ``LABEL=DIR`` runs the case (`insitu run`, as the fidelity case does) with the ``insitu`` package of DIR
("." this checkout; e.g. ``git worktree add .old COMMIT``), in the order given; a label given twice runs
twice. Repeat each tree and interleave them (``first=. old1=.old new1=. old2=.old new2=.``): the first
process of a machine is cold, and two processes of the same code differ by a few percent. The row's
``extra`` holds the tree and the process's place in the order.

    python -m benchmarks fidab first=. old1=.old new1=. old2=.old new2=.
    python -m benchmarks fidab --case engine base=. new=../other
    python -m benchmarks fidab --tiny a=. b=.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.cases.fidelity import CASES, case_volume, measure

TABLE = "run"   # an A/B compares only within its run
COLUMNS = ("name", "psnr_foreground", "psnr", "seconds", "seeds_seconds", "ground_truth_seconds",
           "train_seconds", "ply_fit_seconds", "kernel_cache")


def tree(spec: str) -> tuple[str, Path]:
    label, sep, folder = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", label) or not folder:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR (LABEL: letters, digits, '.', '_', '-'), got {spec!r}")
    path = Path(folder)
    if not (path / "insitu" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected a folder holding an insitu package, "
                                         f"found no {path / 'insitu'}")
    return label, path


def add_arguments(parser) -> None:
    parser.add_argument("trees", nargs="*", type=tree, default=[("base", Path("."))], metavar="LABEL=DIR",
                        help="the code trees, in the order they run (default base=.)")
    parser.add_argument("--case", default="bonsai", choices=sorted(CASES), help="the fidelity case (default bonsai)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a configuration override for every process (repeatable)")


def run(args) -> list[dict]:
    volume, case_args = case_volume(args, "fidab")
    rows = []
    for n, (label, folder) in enumerate(args.trees, 1):
        row = measure(args, args.case, volume, case_args, label=f"{label}_{n}", tree=folder)
        row["name"] = label
        row["extra"] = {"tree": str(folder), "order": n, "case": "tiny" if args.tiny else args.case}
        rows.append(row)
    return rows
