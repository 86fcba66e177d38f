"""What a process compiles, when, on which thread and for how long: one `insitu` command with
Triton's compilations recorded.

    python benchmarks/bench_compile.py --cache /tmp/kc --json compile.json -- \\
        run bonsai_256x256x256_uint8.raw --iso 40 --views 448 --resolution 1024 --out /tmp/o --quiet

``--cache`` is the Triton kernel cache for the command (``TRITON_CACHE_DIR``): an empty folder is a
first process on a fresh machine (cold), the same folder again a later one (warm). Every kernel
that goes through Triton's compiler (a compilation, or a load from the disk cache) is recorded with
its thread (``insitu-compile-*``: :mod:`insitu.compilation`'s background threads), its start
(seconds after this script started) and its seconds, and for real compilations the seconds of
each stage (``ttir``, ``ttgir``: the optimisation passes, ``llir``, ``ptx``, ``cubin``: ptxas).
Prints and writes one JSON object: the command's wall time (from this script's start, imports
included), the records, and per thread the seconds spent in the compiler.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="Triton's kernel cache for the command (TRITON_CACHE_DIR)")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the insitu command and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(Path(args.cache).resolve())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    records, version = record_compilations()
    from insitu.cli import main as insitu_main

    rc = insitu_main(command)
    wall = time.perf_counter() - T0
    threads: dict[str, float] = {}
    for r in records:
        threads[r["thread"]] = round(threads.get(r["thread"], 0.0) + r["seconds"], 2)
    out = {"command": command, "cache": args.cache, "triton": version, "rc": rc, "wall_s": round(wall, 2),
           "compiled": sum(1 for r in records if r["stages"]), "loaded": sum(1 for r in records if not r["stages"]),
           "seconds_by_thread": threads, "records": records}
    text = json.dumps(out)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")


def record_compilations() -> tuple[list[dict], str]:
    """Record every kernel that reaches Triton's compiler in this process: the list they fill as
    they come, and Triton's version."""
    import triton
    from triton import knobs
    from triton.runtime.jit import JITFunction

    records: list[dict] = []
    current = threading.local()
    do_compile = JITFunction._do_compile

    def timed(self, *a, **k):
        rec = {"kernel": self._fn_name, "thread": threading.current_thread().name,
               "start_s": round(time.perf_counter() - T0, 2), "stages": {}}
        current.rec = rec
        t = time.perf_counter()
        try:
            return do_compile(self, *a, **k)
        finally:
            rec["seconds"] = round(time.perf_counter() - t, 3)
            records.append(rec)

    def stages(backend, stages, options, language, capability):
        for name, f in list(stages.items()):
            def wrapped(src, metadata, f=f, name=name):
                t = time.perf_counter()
                try:
                    return f(src, metadata)
                finally:
                    rec = getattr(current, "rec", None)
                    if rec is not None:
                        rec["stages"][name] = round(time.perf_counter() - t, 3)
            stages[name] = wrapped

    JITFunction._do_compile = timed
    knobs.runtime.add_stages_inspection_hook = stages
    return records, triton.__version__


if __name__ == "__main__":
    main()
