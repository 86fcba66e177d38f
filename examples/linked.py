"""In situ, linked into a Python simulation: the Adaptor trains in the background while
the simulation runs.   mpiexec -n 2 python examples/linked.py
"""
import sys
from pathlib import Path

from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sims")]        # insitu and insitu_sims from a checkout too
from insitu import Adaptor  # noqa: E402
from insitu_sims.gray_scott import GrayScott, GrayScottSettings  # noqa: E402

comm = MPI.COMM_WORLD
sim = GrayScott(GrayScottSettings(L=48, engine="none"), comm)
config = {"input": {"var": "V", "iso": [0.3]}, "views": {"count": 48, "resolution": 96},
          "train": {"iterations": 300, "sh_degree": 1}, "output": {"dir": "linked_out"},
          "run": {"mode": "background", "queue": 1, "policy": "discard"}}
with Adaptor(comm, config) as adaptor:               # finalize() on exit drains the queue
    for step in range(1, 1001):
        sim.step()
        if step % 250 == 0:                          # copies this rank's block and returns
            adaptor.execute(step, sim.time, {"V": sim.v, "U": sim.u}, sim.global_shape, sim.start)
if comm.rank == 0:
    for record in adaptor.stats.trained:
        print(f"step {record.step}: PSNR {record.metrics['psnr']:.2f} dB in {record.seconds:.1f} s")
