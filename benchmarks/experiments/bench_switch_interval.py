"""How much a thread importing torchmetrics slows a loop beside it that often gives up Python's
lock, at several switch intervals (``sys.setswitchinterval``); one fresh process per interval.

The loop stands for a step's host side: each of its steps runs five 300 x 300 matrix products (torch
gives up the lock while it computes, as it does while it waits on a device) and a little Python.
A thread that gives up the lock waits up to one switch interval to get it back from a thread that
runs Python, so beside an import the loop's steps stretch by up to an interval per product. Prints
one JSON line per interval: the import's time, the loop's time per step during it and alone.

    python benchmarks/experiments/bench_switch_interval.py --intervals 0.005 0.0005 0.0002
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import importlib, json, sys, threading, time
import torch
torch.set_num_threads(1)
a = torch.randn(300, 300)

def loop(n):
    t = time.perf_counter()
    for _ in range(n):
        for _ in range(5):
            a @ a
        sum(range(200))
    return time.perf_counter() - t

loop(50)
alone = loop(400) / 400
before = sys.getswitchinterval()
sys.setswitchinterval(float(sys.argv[1]))
t0, out = time.perf_counter(), {}
def imp():
    importlib.import_module(sys.argv[2])
    out["import_s"] = time.perf_counter() - t0
thread = threading.Thread(target=imp)
thread.start()
steps, t = 0, time.perf_counter()
while thread.is_alive():
    loop(10)
    steps += 10
during = (time.perf_counter() - t) / steps
sys.setswitchinterval(before)
print(json.dumps({"switch_interval_s": float(sys.argv[1]), "import_s": round(out["import_s"], 3),
                  "step_ms_during_import": round(1e3 * during, 3), "step_ms_alone": round(1e3 * alone, 3),
                  "slowdown": round(during / alone, 2)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0005, 0.0002])
    ap.add_argument("--module", default="torchmetrics", help="what the thread imports")
    args = ap.parse_args()
    for interval in args.intervals:
        out = subprocess.run([sys.executable, "-c", CHILD, str(interval), args.module], capture_output=True,
                             text=True, check=True)
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
