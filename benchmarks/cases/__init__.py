"""The benchmark cases: one module per case, run by ``python -m benchmarks CASE [options]``.

A case is a module ``benchmarks/cases/NAME.py`` (NAME: lower case, no leading underscore) with

``run(args: argparse.Namespace) -> list[dict]``
    Runs the case and returns its rows (the row schema: ``benchmarks/schema.py``, benchmarks/README.md).
    A row holds the case's own fields only (``name`` at least, then figures); the entry adds the common
    fields (``schema``, ``commit``, ``machine``, ``date``, ``case``, ``run``, ``command``), checks every row
    with ``benchmarks.schema.check_row`` and appends them to ``benchmarks/results/<machine>.jsonl``.
    Raw files (logs, metrics.json, metrics.csv) go under ``args.run_dir`` (created by the entry;
    ``benchmarks/results/runs/<run>/``). A part that fails becomes a row with its ``error`` set (one
    line, and the log's name) rather than an exception, so the other parts' rows are still recorded;
    raise ``SystemExit("...")`` only when nothing could be measured.

``add_arguments(parser: argparse.ArgumentParser) -> None`` (optional)
    The case's own options. The entry has already added the common ones, present on every ``args``:

    ``args.tiny`` (bool)      a CPU size that runs in about a minute on one core: no data files, no GPU
                              (synthetic fields); what tests/test_benchmarks.py and a laptop run
    ``args.data`` (Path)      the folder of the volumes (``--data``, $DATA, default ../shared/data)
    ``args.run_dir`` (Path)   this run's raw-file folder, already created
    ``args.device`` (str)     "cuda" or "cpu" (``--device``; default cuda when torch sees a GPU, cpu with --tiny)
    ``args.timeout`` (float)  seconds allowed to each process the case starts (``--timeout``; None: no limit)
    ``args.quiet`` (bool)     the entry prints only its summary line, not the rows (a case may print less too)

``COLUMNS: tuple[str, ...]`` (optional)
    The row keys shown, in this order, in the case's table of docs/performance.md (default:
    ``benchmarks.schema.DEFAULT_COLUMNS``); ``extra.KEY`` shows ``row["extra"]["KEY"]``.

``TABLE: str`` (optional)
    ``"name"`` (default): the doc's table holds, for each row name, the rows of the latest run that has it;
    ``"run"``: the latest run's rows only (rows that compare only within their run, as an A/B's).

The module's docstring: its first line is the case's title in ``python -m benchmarks list`` and in
docs/performance.md; the rest says what it measures and how to run it.

Helpers for cases (``benchmarks/harness.py``): ``insitu_argv``, ``run_logged``, ``metrics_row``,
``csv_rows``, ``synthetic_volume`` (see their docstrings); a case uses them rather than its own copies.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def names() -> list[str]:
    """The cases' names, sorted: the modules of this package whose names do not start with '_'."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The case module ``name``; ValueError naming the cases that exist when there is none."""
    if name not in names():
        raise ValueError(f"unknown case {name!r}: expected one of {', '.join(names())}")
    module = importlib.import_module(f"{__name__}.{name}")
    if not callable(getattr(module, "run", None)):
        raise ValueError(f"case {name!r}: benchmarks/cases/{name}.py has no run(args) function")
    return module
