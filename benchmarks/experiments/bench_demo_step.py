"""One timestep of the CPU demo on its own: the Gray-Scott mini-app run to ``--step`` (the demo's
simulation: its L or ``--L``, no noise), then one cold ``compute_step`` of its V field with the CPU demo's
settings (``insitu.run.demo.DEMO_DEFAULTS`` without its in situ and output keys) and the ``--set`` ones.
Prints one JSON object: the step's surface figures, its Gaussians, its seconds and its evaluations.

    python benchmarks/experiments/bench_demo_step.py --step 600 --set train.iterations=2400
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "sims")]

from mpi4py import MPI  # noqa: E402

from insitu.config import load_config, parse_override  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.run.demo import CPU_SIMULATION, DEMO_DEFAULTS  # noqa: E402
from insitu.step.pipeline import compute_step  # noqa: E402
from insitu.volume import whole_block  # noqa: E402
from insitu_sims.gray_scott import GrayScott, GrayScottSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, default=600, help="the simulation step whose V is trained")
    ap.add_argument("--L", type=int, default=CPU_SIMULATION["L"], help="the simulation's grid (the CPU demo's by default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (as insitu run's --set)")
    args = ap.parse_args()
    sim = GrayScott(GrayScottSettings(L=args.L, noise=CPU_SIMULATION["noise"], steps=args.step,
                                      engine="none"), MPI.COMM_SELF)
    while sim.step_count < args.step:
        sim.step()
    overrides = {k: v for k, v in DEMO_DEFAULTS.items() if not k.startswith(("insitu.", "output."))}
    overrides.update({"run.progress": False, "output.ply": False})
    sets = dict(parse_override(s) for s in args.set)
    cfg = load_config(None, {**overrides, **sets})
    comm = init_comm(device="cpu")
    t = time.perf_counter()
    m = compute_step(whole_block(sim.v.astype("float32")), cfg, comm).metrics
    print(json.dumps({"L": args.L, "step": args.step, "settings": sets, "psnr_foreground": m["psnr_foreground"], "psnr": m["psnr"],
                      "gaussians_initial": m["gaussians_initial"], "gaussians": m["gaussians"],
                      "seconds": round(time.perf_counter() - t, 1),
                      "history": [(h["iteration"], round(h["psnr_foreground"], 2), h["gaussians"])
                                  for h in m["history"]]}), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
