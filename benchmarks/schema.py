"""The one row schema of every benchmark result (benchmarks/README.md explains each field).

Rows are JSON objects, one a line, in ``benchmarks/results/<machine>.jsonl``. ``COMMON`` fields are set by
the entry (``python -m benchmarks``), the others by the case. A figure that was not measured is absent or
None; ``extra`` holds a case's figures that have no field here (JSON values, its own keys).
"""
from __future__ import annotations

import re

VERSION = 1

NUMBER = (int, float)
# field -> (accepted types, meaning). Order: the order of benchmarks/README.md's table.
COMMON = {
    "schema": (int, "the schema's version (1)"),
    "commit": (str, "commit of the measured tree, 'unknown' when not known; '+dirty' when it had changes"),
    "machine": (str, "the machine's name: its results file is benchmarks/results/<machine>.jsonl"),
    "date": (str, "UTC start of the run, YYYY-MM-DDTHH:MM:SSZ (a day, YYYY-MM-DD, for migrated rows)"),
    "case": (str, "the case: a module of benchmarks/cases/"),
    "run": (str, "the run: its raw files are in benchmarks/results/runs/<run>/"),
    "command": (str, "the command that produced the row, e.g. 'python -m benchmarks fidelity --only bonsai'"),
}
CASE = {
    "name": (str, "what the row measured within its case (e.g. 'bonsai', 'engine', 'demo', 'old1')"),
    "cmd": (str, "the underlying command as a user types it (e.g. 'insitu run bonsai.raw --iso 40 ...')"),
    "step": (int, "the simulation's timestep (series and demo rows)"),
    "device": (str, "'cuda' or 'cpu'"),
    "ranks": (int, "MPI ranks (GPUs on a GPU machine)"),
    "kernel_cache": (str, "'cold' (the process began with an empty kernel cache / first on the machine) "
                          "or 'warm'; absent where no kernels compile (CPU) or unknown"),
    "psnr_foreground": (NUMBER, "surface PSNR (dB): held-out views on the orbit, pixels of the surface"),
    "psnr_foreground_initial": (NUMBER, "the same of the step's initial model, before any iteration (its seeds, or "
                                        "its warm start)"),
    "ssim_foreground": (NUMBER, "surface SSIM of the same views"),
    "psnr": (NUMBER, "whole-image PSNR (dB) of the same views"),
    "psnr_foreground_near2": (NUMBER, "surface PSNR (dB) of held-out views 2x closer"),
    "psnr_foreground_near3": (NUMBER, "surface PSNR (dB) of held-out views 3x closer"),
    "psnr_foreground_off": (NUMBER, "surface PSNR (dB) of held-out views off the orbit's lattice"),
    "ply_psnr_foreground": (NUMBER, "surface PSNR (dB) of model.ply (the SH fit) on the orbit's held-out views"),
    "spz_psnr_foreground": (NUMBER, "surface PSNR (dB) of model.spz drawn antialiased, where it holds the trained "
                                    "Gaussians, on the orbit's held-out views"),
    "gaussians": (int, "Gaussians of the trained model"),
    "iterations": (int, "optimiser steps trained"),
    "seconds": (NUMBER, "wall seconds of what the row measured (an `insitu run`: its total_seconds)"),
    "seeds_seconds": (NUMBER, "seconds of the initial Gaussians"),
    "ground_truth_seconds": (NUMBER, "seconds of the ground-truth images"),
    "train_seconds": (NUMBER, "seconds of training"),
    "ply_fit_seconds": (NUMBER, "seconds of model.ply's SH fit"),
    "peak_gpu_memory_gb": (NUMBER, "peak GPU memory (GB), the largest rank's"),
    "model_bytes": (int, "bytes of the model written"),
    "note": (str, "one line of context (e.g. 'first process of the run', 'migrated from BENCHMARKS.md')"),
    "error": (str, "why the part failed (one line, and its log): a failed part is a row, not a gap"),
    "extra": (dict, "the case's other figures: {key: JSON value}"),
}
FIELDS = {**COMMON, **CASE}
REQUIRED = (*COMMON, "name")
DEFAULT_COLUMNS = ("name", "psnr_foreground", "psnr", "ply_psnr_foreground", "gaussians", "seconds", "kernel_cache")
_DATE = re.compile(r"\d{4}-\d\d-\d\d(T\d\d:\d\d:\d\dZ)?")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_row(row: dict) -> dict:
    """``row`` if it follows the schema; ValueError naming the field, what was expected and what came."""
    if not isinstance(row, dict):
        raise ValueError(f"benchmark row: expected a dict, got {type(row).__name__}")
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise ValueError(f"benchmark row {row.get('name')!r}: unknown field(s) {', '.join(unknown)}: "
                         "expected fields of benchmarks/schema.py (a case's own figures go under 'extra')")
    for key in REQUIRED:
        if row.get(key) in (None, ""):
            raise ValueError(f"benchmark row {row.get('name')!r}: field {key!r} is missing")
    for key, value in row.items():
        types = FIELDS[key][0]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            raise ValueError(f"benchmark row {row.get('name')!r}: field {key!r} expected {want}, "
                             f"got {type(value).__name__} {value!r}")
    if row["schema"] != VERSION:
        raise ValueError(f"benchmark row {row['name']!r}: schema {row['schema']!r}, expected {VERSION}")
    if not _DATE.fullmatch(row["date"]):
        raise ValueError(f"benchmark row {row['name']!r}: date {row['date']!r}, expected YYYY-MM-DD[THH:MM:SSZ]")
    for key in ("machine", "case", "run"):
        if not _NAME.fullmatch(row[key]):
            raise ValueError(f"benchmark row {row['name']!r}: {key} {row[key]!r}, expected letters, digits, '.', "
                             "'_' or '-' (it names a file or folder)")
    if row.get("kernel_cache") not in (None, "cold", "warm"):
        raise ValueError(f"benchmark row {row['name']!r}: kernel_cache {row['kernel_cache']!r}, "
                         "expected 'cold', 'warm' or None")
    return row
