"""Multi-rank check of insitu.parallel.comm: set-up, collectives, sub-communicators, reuse.

Run as ``mpiexec -n P python comm_worker.py`` (P even for the sub-communicator part).
"""
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from insitu.errors import RankFailure
from insitu.parallel.comm import init_comm, shutdown


def expect(cond, what):
    if not cond:
        print(f"FAIL rank {MPI.COMM_WORLD.rank}: {what}", flush=True)
        sys.exit(1)


def exercise(comm, world_ranks):
    """Collectives over ``comm`` whose ranks are the world ranks ``world_ranks``."""
    P, r = comm.size, comm.rank
    expect(comm.mpi.Get_size() == P and len(world_ranks) == P, f"size {P} vs {world_ranks}")
    expect(comm.allgather_object(MPI.COMM_WORLD.rank) == world_ranks, "allgather_object order")
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    expect(torch.equal(comm.all_reduce_sum(t), torch.full((3,), P * (P + 1) / 2, dtype=torch.float64)),
           "all_reduce_sum")
    g = comm.all_gather(torch.tensor([[r, 10 * r]], dtype=torch.float32))
    expect(g.shape == (P, 1, 2) and g[:, 0, 1].tolist() == [10.0 * q for q in range(P)], f"all_gather {g}")
    comm.traffic.reset()
    x = torch.arange(P * 2, dtype=torch.float32).view(P, 2) * (r + 1)
    s = comm.reduce_scatter(x)
    expect(s.tolist() == [(2 * r) * P * (P + 1) / 2, (2 * r + 1) * P * (P + 1) / 2], f"reduce_scatter {s}")
    expect(comm.traffic.calls == 1 and comm.traffic.bytes == round(P * 2 * 4 * (P - 1) / P), f"{comm.traffic}")
    comm.traffic.reset()
    a = comm.all_to_all(torch.tensor([[100 * r + q, -1.0] for q in range(P)], dtype=torch.float64))
    expect(a[:, 0].tolist() == [100.0 * q + r for q in range(P)], f"all_to_all {a}")
    expect(comm.traffic.calls == 1 and comm.traffic.bytes == round(2 * 8 * (P - 1)), f"{comm.traffic}")
    comm.agree(True)
    try:
        comm.agree(r != P - 1, f"bad input on {r}", where="input check")
        expect(False, "agree did not raise")
    except RankFailure as e:
        expect(e.ranks == [P - 1] and str(e) == f"input check failed on rank {P - 1}: bad input on {P - 1}",
               f"agree message: {e}")


def main():
    world = MPI.COMM_WORLD
    comm = init_comm(device="cpu", timeout_s=60)
    expect(comm.rank == world.rank and comm.size == world.size and comm.local_rank == world.rank,
           "rank/size/local_rank")
    expect(comm.mpi != world and comm.device == torch.device("cpu"), "dup and device")
    expect(comm.group is not None and dist.get_backend(comm.group) == "gloo", "gloo group")
    exercise(comm, list(range(world.size)))

    again = init_comm(world, device="cpu", timeout_s=60)     # torch.distributed initialised: reused
    expect(again.group is dist.group.WORLD, "default group reused")
    exercise(again, list(range(world.size)))
    shutdown(again)
    expect(dist.is_initialized(), "shutdown of a reused group kept the default group")

    # sub-communicator while torch.distributed spans the world: a new group, reversed rank order
    color = world.rank % 2
    sub = world.Split(color, key=-world.rank)
    half = init_comm(sub, device="cpu", timeout_s=60)
    members = [q for q in reversed(range(world.size)) if q % 2 == color]
    expect(half.group is not dist.group.WORLD, "new group for a sub-communicator")
    expect(half.local_rank == world.rank, f"local rank {half.local_rank}: the launcher's (one host: the world rank)")
    exercise(half, members)
    shutdown(half)
    shutdown(comm)
    expect(not dist.is_initialized(), "shutdown destroyed the default group it created")

    # sub-communicator with torch.distributed not initialised: the default group spans it
    half = init_comm(sub, device="cpu", timeout_s=60)
    exercise(half, members)
    shutdown(half)
    sub.Free()
    print(f"OK rank {world.rank} of {world.size}", flush=True)


if __name__ == "__main__":
    main()
