"""What a process compiles, when, on which thread and for how long: one `insitu` command with
Triton's compilations recorded.

    python benchmarks/experiments/bench_compile.py --cache /tmp/kc --json compile.json -- \\
        run bonsai_256x256x256_uint8.raw --iso 40 --views 448 --resolution 1024 --out /tmp/o --quiet

``--cache`` is the Triton kernel cache for the command (``TRITON_CACHE_DIR``): an empty folder is a
first process on a fresh machine (cold), the same folder again a later one (warm). Every kernel
that goes through Triton's compiler (a compilation, or a load from the disk cache) is recorded with
its thread (``insitu-compile-*``: :mod:`insitu.step.compilation`'s background threads), its start
(seconds after this script started) and its seconds, and for real compilations the seconds of
each stage (``ttir``, ``ttgir``: the optimisation passes, ``llir``, ``ptx``, ``cubin``: ptxas).
Prints and writes one JSON object: the command's wall time (from this script's start, imports
included), the records, and per thread the seconds spent in the compiler; and a timeline (seconds
after this script started) of the step's phases as they end (``PhaseClock.lap``), its waits for
compiled groups (:meth:`insitu.step.compilation.Ahead.wait`) and the package's background threads
(``insitu-compile-*``, ``insitu-preload``: the metrics' import) from start to end.

``--evict`` first drops from the machine's page cache every file of Python's library folders, of
``PYTHONPATH``'s and of the package (``posix_fadvise(DONTNEED)``; files no process maps), so that with
an empty ``--cache`` a process on a machine that ran others before reads its libraries from disk as a
first process on a freshly started machine does.

    python benchmarks/experiments/bench_compile.py --offline [--caster FILE] [--ssim FILE]

compiles the kernels instead, for an H100/H200 (sm_90) on any host, a GPU or none (Triton's
compiler and ptxas only; ``pip install triton`` where torch has none): the ray caster (the
bonsai's case: one iso value, no colour field), the loss's four SSIM kernels at 1024^2 and Adam's
kernel, each in an empty cache, with the seconds of each stage and of the coalescing pass
(``MLIR_ENABLE_TIMING``'s figure is the pass's share). ``--caster``/``--ssim``: another version of
``insitu/groundtruth/triton_caster.py`` / ``insitu/training/ssim.py`` to compile instead.
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
    ap.add_argument("--cache", default=None, help="Triton's kernel cache for the command (TRITON_CACHE_DIR)")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--package", default=str(Path(__file__).resolve().parents[2]),
                    help="the folder that holds the insitu package to run (default: this checkout)")
    ap.add_argument("--evict", action="store_true", help="drop the libraries' files from the page cache first")
    ap.add_argument("--offline", action="store_true", help="compile the kernels for sm_90 here, no command")
    ap.add_argument("--caster", help="with --offline: another version of insitu/groundtruth/triton_caster.py")
    ap.add_argument("--ssim", help="with --offline: another version of insitu/training/ssim.py")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the insitu command and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cache is None:
        if not args.offline:
            ap.error("--cache: expected a folder for the command's kernel cache")
        import tempfile

        args.cache = tempfile.mkdtemp()
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(Path(args.cache).resolve())
    sys.path.insert(0, str(Path(args.package).resolve()))
    if args.offline:
        return offline(args)
    sys.path.append(str(Path(__file__).resolve().parents[2]))     # benchmarks.harness, after the package
    from benchmarks.harness import evict_page_cache

    evicted = evict_page_cache(args.package) if args.evict else None
    try:
        from insitu.run.runner import prefetch_compiler
    except ImportError:         # a package tree from before it
        pass
    else:
        prefetch_compiler()     # as the command does at its start, before this script's imports below
    records, version = record_compilations()
    timeline = record_timeline()
    from insitu.cli import main as insitu_main

    rc = insitu_main(command)
    wall = time.perf_counter() - T0
    threads: dict[str, float] = {}
    for r in records:
        threads[r["thread"]] = round(threads.get(r["thread"], 0.0) + r["seconds"], 2)
    out = {"command": command, "cache": args.cache, "triton": version, "rc": rc, "wall_s": round(wall, 2),
           "compiled": sum(1 for r in records if r["stages"]), "loaded": sum(1 for r in records if not r["stages"]),
           "package": args.package, "seconds_by_thread": threads, "evicted": evicted, "timeline": timeline,
           "records": records}
    text = json.dumps(out)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")


def record_compilations() -> tuple[list[dict], str]:
    """Record every kernel that reaches Triton's compiler in this process: the list they fill as
    they come, and Triton's version (None, and nothing recorded, without Triton: a CPU-only torch)."""
    try:
        import triton
    except ImportError:
        return [], None
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

    def stage(name: str, seconds: float) -> None:
        rec = getattr(current, "rec", None)
        if rec is not None:
            rec["stages"][name] = seconds

    JITFunction._do_compile = timed
    knobs.runtime.add_stages_inspection_hook = stage_hook(stage)
    return records, triton.__version__


def record_timeline() -> list[dict]:
    """Record, in the list returned as they come: each phase of a step as it ends, each wait for
    compiled groups, and each of the package's background threads (start and end)."""
    from insitu.step import clock, compilation

    events: list[dict] = []
    now = lambda: round(time.perf_counter() - T0, 3)        # noqa: E731
    lap, wait, start = clock.PhaseClock.lap, compilation.Ahead.wait, threading.Thread.start

    def timed_lap(self, name, **k):
        seconds = lap(self, name, **k)
        events.append({"phase": name, "end_s": now(), "seconds": round(seconds, 3)})
        return seconds

    def timed_wait(self, *names):
        t = time.perf_counter()
        wait(self, *names)
        events.append({"wait": list(names) or "all", "start_s": round(t - T0, 3),
                       "seconds": round(time.perf_counter() - t, 3)})

    def traced_start(self):
        if self.name.startswith("insitu-"):
            run = self.run

            def traced():
                event = {"thread": self.name, "start_s": now()}
                try:
                    run()
                finally:
                    event["end_s"] = now()
                    events.append(event)
            self.run = traced
        start(self)

    clock.PhaseClock.lap, compilation.Ahead.wait, threading.Thread.start = timed_lap, timed_wait, traced_start
    return events


def stage_hook(record):
    """Triton's ``add_stages_inspection_hook`` that times each stage of a compilation:
    ``record(stage, seconds)`` after it."""
    def hook(backend, stages, options, language, capability):
        for name, f in list(stages.items()):
            def timed(src, metadata, f=f, name=name):
                t = time.perf_counter()
                try:
                    return f(src, metadata)
                finally:
                    record(name, round(time.perf_counter() - t, 3))
            stages[name] = timed
    return hook


def load(path: str, name: str):
    """The module at ``path``, another version of an insitu module, as module ``name`` (its relative
    imports resolve in ``name``'s package): for the benchmarks that compare two versions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def offline(args) -> None:
    """Compile the kernels for sm_90 in empty caches; print one JSON object of their seconds."""
    import tempfile

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import insitu.training.adam as adam
    if args.caster:
        caster = load(args.caster, "insitu.groundtruth._bench_caster")
    else:
        import insitu.groundtruth.triton_caster as caster
    ssim = load(args.ssim, "insitu.training._bench_ssim") if args.ssim else __import__("insitu.training.ssim").training.ssim
    stages: dict[str, float] = {}
    knobs.runtime.add_stages_inspection_hook = stage_hook(stages.__setitem__)

    def compile_one(fn, ints=(), floats=(), constexprs=None, div16=(), num_warps=4) -> dict:
        """``fn`` with pointers (float32, 16-byte aligned), the named int32 (``div16``: multiples of
        16) and float32 arguments and the compile-time constants; its stages' seconds."""
        constexprs = dict(constexprs or {})
        sig = {n: "constexpr" if n in constexprs else "i32" if n in ints else "fp32" if n in floats else "*fp32"
               for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
                 if sig[n] == "*fp32" or n in div16}
        knobs.cache.dir = tempfile.mkdtemp()
        stages.clear()
        t = time.perf_counter()
        triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
        return {"seconds": round(time.perf_counter() - t, 2), **stages}

    f = caster._raycast_kernel
    out = {"triton": triton.__version__, "target": "sm_90", "caster": args.caster or "insitu",
           "ssim": args.ssim or "insitu"}
    out["_raycast_kernel"] = compile_one(
        f, ints={"nx", "ny", "nz", "mx", "my", "mz", "width", "height", "S", "n_cmap"},
        floats={"ox", "oy", "oz", "spx", "spy", "spz", "blx", "bly", "blz", "bhx", "bhy", "bhz", "dlx", "dly",
                "dlz", "dhx", "dhy", "dhz", "step", "cr", "cg", "cb", "c_lo", "c_hi"},
        constexprs={"n_iso": 1, "REFINE": 6, "HAS_CFIELD": False, "BLOCK": 128}, div16={"width", "height"})
    tiles = {"TH": ssim._TH, "TW": ssim._TW}
    for name, ints, flags, div16 in (("_moments_cols", {"H", "W", "Ho"}, {"L1": True}, {"H", "W"}),
                                     ("_ssim_rows", {"W", "Ho", "Wo"}, {"SAVE": True}, {"W"}),
                                     ("_spread_cols", {"H", "Ho", "Wo"}, {"GO_SCALAR": True}, {"H"}),
                                     ("_spread_rows", {"H", "W", "Wo"}, {"L1": True}, {"H", "W"})):
        out[name] = compile_one(getattr(ssim, name), ints=ints, constexprs={**flags, **tiles}, div16=div16,
                                num_warps=ssim._WARPS)
    fa = adam._adam_kernel
    names = fa.arg_names
    out["_adam_kernel"] = compile_one(
        fa, ints={n for n in names if n[0] in "ns" and n[1:].isdigit()} | {"C", "G", "KD"},
        floats={n for n in names if n[0] in "ac" and n[1:].isdigit()} | {"b1", "b2", "eps", "bc2_sqrt"},
        constexprs={**{f"R{i}": 0 for i in range(4)}, "R4": 3, **{f"F{i}": False for i in range(5)},
                    "BLOCK": adam._BLOCK}, num_warps=adam._WARPS)
    text = json.dumps(out)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
