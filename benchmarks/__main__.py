"""The benchmarks' one entry: run a named case and record its rows (benchmarks/README.md).

    python -m benchmarks list                  the cases and their titles
    python -m benchmarks CASE [options]        run CASE; its rows -> benchmarks/results/<machine>.jsonl
    python -m benchmarks CASE --help           CASE's own options
    python -m benchmarks doc [--out FILE]      docs/performance.md from benchmarks/results/*.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import cases
from benchmarks.schema import VERSION, check_row

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def commit() -> str:
    """The checkout's short commit, '+dirty' when files outside the results and docs differ from it;
    $INSITU_COMMIT where this is no git checkout (the GPU machine's copy); else 'unknown'."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", ".",
                                ":!benchmarks/results", ":!docs"], capture_output=True, text=True,
                               check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("INSITU_COMMIT", "unknown")


def gpu_machine() -> str | None:
    """'nvidia-h200' (one GPU) or 'nvidia-h200-x2' (two), from what torch sees; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    return slug + (f"-x{n}" if n > 1 else "")


def fail(message: str) -> None:
    """The project's contract for bad input: one line on stderr, exit 2."""
    print(f"benchmarks: error: {message}", file=sys.stderr)
    sys.exit(2)


def common_parser(case: str, module) -> argparse.ArgumentParser:
    doc = (module.__doc__ or case).strip()
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {case}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("common options (every case)")
    g.add_argument("--tiny", action="store_true",
                   help="a CPU size with synthetic fields, about a minute on one core; records nothing unless "
                        "--results is given")
    g.add_argument("--data", type=Path, default=Path(os.environ.get("DATA", ROOT.parent / "shared" / "data")),
                   help="folder of the volumes (default $DATA, else ../shared/data)")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where torch sees a GPU, cpu with --tiny")
    g.add_argument("--machine", default=None,
                   help="the machine's name, its results file's (default: the GPU's name and count, e.g. "
                        "nvidia-h200-x2; on the CPU cpu-Ncore)")
    g.add_argument("--commit", default=None, help="the measured commit (default: git, $INSITU_COMMIT)")
    g.add_argument("--run", default=None, help="the run's name (default YYYYMMDD-HHMMSSZ-CASE)")
    g.add_argument("--run-dir", type=Path, default=None,
                   help="raw files here (default benchmarks/results/runs/RUN; a temporary folder with --tiny)")
    g.add_argument("--results", type=Path, default=None,
                   help="append the rows here (default benchmarks/results/MACHINE.jsonl)")
    g.add_argument("--no-record", action="store_true", help="print the rows only")
    g.add_argument("--note", default=None,
                   help="one line of context for every row (e.g. 'a machine shared with other jobs')")
    g.add_argument("--timeout", type=float, default=None, help="seconds allowed to each process the case starts")
    g.add_argument("--quiet", action="store_true", help="print only the summary line, not the rows")
    if hasattr(module, "add_arguments"):
        module.add_arguments(ap.add_argument_group(f"{case} options"))
    return ap


def run_case(case: str, argv: list[str]) -> list[dict]:
    try:
        module = cases.load(case)
    except ValueError as e:
        fail(str(e))
    args = common_parser(case, module).parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.tiny or gpu_machine() is None else "cuda"
    machine = args.machine or (gpu_machine() if args.device == "cuda" else None) or f"cpu-{os.cpu_count()}core"
    start = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    run = args.run or start.strftime("%Y%m%d-%H%M%SZ-") + case
    if args.run_dir is None:
        args.run_dir = Path(tempfile.mkdtemp(prefix=f"bench-run-{case}-")) if args.tiny else RESULTS / "runs" / run
    args.run_dir.mkdir(parents=True, exist_ok=True)
    record = not args.no_record and (args.results is not None or not args.tiny)
    results = args.results or RESULTS / f"{machine}.jsonl"
    common = {"schema": VERSION, "commit": args.commit or commit(), "machine": machine,
              "date": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "case": case, "run": run,
              "command": shlex.join(["python", "-m", "benchmarks", case, *argv])}
    try:
        case_rows = module.run(args)
    except SystemExit as e:          # a case that could measure nothing: its one line, exit 2
        if not any(args.run_dir.iterdir()):
            args.run_dir.rmdir()
        if isinstance(e.code, str):
            fail(e.code.removeprefix("benchmarks: error: "))
        raise
    rows = []
    for row in case_rows:
        clash = sorted(set(row) & set(common))
        if clash:
            raise ValueError(f"case {case}: its row {row.get('name')!r} sets the entry's field(s) {clash}")
        row = {k: v for k, v in row.items() if v is not None}
        if args.note:
            row["note"] = "; ".join(filter(None, (row.get("note"), args.note)))
        rows.append(check_row({**common, **row}))
    lines = "".join(json.dumps(r, sort_keys=False) + "\n" for r in rows)
    (args.run_dir / "rows.jsonl").write_text(lines)
    if record:
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as f:
            f.write(lines)
    if not args.quiet:
        sys.stdout.write(lines)
    print(f"benchmarks: {case}: {len(rows)} row(s); raw files in {args.run_dir}"
          + (f"; recorded in {results}" if record else "; not recorded"), file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ncases: " + ", ".join(cases.names()))
        return
    if argv[0] == "list":
        for name in cases.names():
            doc = (cases.load(name).__doc__ or "").strip().splitlines()
            print(f"{name:12s} {doc[0] if doc else ''}")
        return
    if argv[0] == "doc":
        from benchmarks import docgen
        docgen.main(argv[1:])
        return
    run_case(argv[0], argv[1:])


if __name__ == "__main__":
    main()
