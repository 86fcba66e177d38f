"""Rank 1's shard holds a NaN mean, rank 0's does not; run as ``mpiexec -n 2 python nonfinite_worker.py``.

Every rank must raise the same TrainingDiverged (no rank left waiting in a later collective), print
``rank R: <message up to the settings' hint>`` (gathered and printed by rank 0) in one more collective (exit 0).
"""
import torch

from insitu.errors import TrainingDiverged
from insitu.parallel.comm import init_comm, shutdown
from insitu.step.loop import check_finite
from insitu.surface.gaussians import Gaussians


def main():
    comm = init_comm(device="cpu", timeout_s=60)
    n = 4 + comm.rank                           # shards of different sizes
    g = Gaussians(torch.zeros(n, 3), torch.zeros(n, 3), torch.ones(n, 4), torch.zeros(n), torch.zeros(n, 1, 3),
                  torch.zeros(n, 0, 3))
    if comm.rank == 1:
        g.means[2, 0] = float("nan")
    try:
        check_finite(g.tensors(), comm, "after iteration 7 of 8")
        text = f"rank {comm.rank}: nothing raised"
    except TrainingDiverged as e:
        text = f"rank {comm.rank}: {str(e).split(';')[0]}"
    said = comm.mpi.gather(text, root=0)        # every rank got here: none waits; rank 0 prints (no interleaving)
    if comm.rank == 0:
        print("\n".join(said), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
