"""A failure on one rank inside ``comm.phase``; run as ``mpiexec -n P python phase_worker.py MODE``.

MODE raise:      rank 1 raises in phase 'seeds'; every rank catches RankFailure, checks it,
                 and goes on to a second phase that succeeds (exit 0).
MODE uncaught:   same, but nobody catches it: every rank exits non-zero with the message.
MODE collective: rank 1 raises while the others wait in a torch collective (gloo timeout 3 s).
MODE hang:       rank 1 never reaches the phase boundary: the agree watchdog (2 s) aborts the job.
MODE die:        rank 1 exits outright (no MPI_Finalize) before the boundary: the job ends too.
MODE stray:      rank 1 raises outside any phase while rank 0 waits in an MPI collective:
                 the excepthook installed by init_comm aborts the job.
"""
import os
import sys
import time

import torch

from insitu.errors import RankFailure
from insitu.parallel.comm import init_comm


def main(mode):
    comm = init_comm(device="cpu", timeout_s=3 if mode == "collective" else 60,
                     watchdog_s={"hang": 2, "die": 2, "collective": 30}.get(mode))   # a loaded machine
                                                                              # may be slow to time out
    if mode == "hang" and comm.rank == 1:
        time.sleep(50)
        print("rank 1 woke", flush=True)        # the abort did not end this rank
    if mode == "die" and comm.rank == 1:
        os._exit(3)
    if mode == "stray":
        if comm.rank == 1:
            raise KeyError("stray failure")
        comm.allgather_object(None)
    try:
        with comm.phase("seeds"):
            if comm.rank == 1:
                raise ValueError("no isosurface crossing in block")
            if mode == "collective":
                comm.all_gather(torch.zeros(4))
    except RankFailure as failure:
        if mode == "uncaught":
            raise
        sys.stdout.write(f"rank {comm.rank} caught: {failure}\n")     # one write: one line
        sys.stdout.flush()
        assert 1 in failure.ranks, failure.ranks
        assert (failure.__cause__ is not None) == (comm.rank in failure.ranks)
        if mode == "collective":        # the timed-out group is spent; the job ends here
            return
    else:
        raise AssertionError("phase 'seeds' did not raise")
    with comm.phase("train"):
        comm.all_reduce_sum(torch.ones(2))
    print(f"rank {comm.rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
