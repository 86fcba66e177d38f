"""Weighted view draws (``train.view_weight``) on P ranks against one process.

Run as ``mpiexec -n P python sampler_worker.py``. Every rank draws batches of 2P views from a
:class:`insitu.sampling.ViewSampler` over the step's ranks and records errors as the two layouts do:

bands:    every rank records every view of the batch with its band's part of the image's error
          (here view v's whole error in rank v % P's band, 0 in the others);
replicas: rank r records only its own two views of the batch, with the whole image's error.

A sampler in one process records every view with its whole error. Over four epochs (the first a
shuffle, the others weighted: a view comes up twice in one of them, and they differ from a uniform
sampler's) every rank draws the same views as the one process.

Prints ``OK rank r of P`` on success; exits non-zero on any mismatch.
"""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from worker_report import fail
from insitu.config import TrainConfig
from insitu.parallel import init_comm, shutdown
from insitu.sampling import ViewSampler
from insitu.views import orbit_views


def draws(sampler: ViewSampler, epochs: int, n: int, record) -> list[list[int]]:
    out, it = [], iter(sampler)
    for _ in range(epochs * (n // sampler.batch)):
        ids, _ = next(it)
        out.append(ids.tolist())
        record(sampler, ids)
    return out


def main() -> None:
    comm = init_comm(device="cpu")
    P, r = comm.size, comm.rank
    views = orbit_views(np.zeros(3), np.ones(3), 24, 8, test_every=8)
    scene = SimpleNamespace(views=views, background=torch.zeros(3))
    n = len(views.train_ids)
    error = torch.arange(1, len(views) + 1, dtype=torch.float64) ** 2             # view v's whole error
    tc = TrainConfig(batch=2 * P, view_weight=0.6, seed=5, progress=False)

    def whole(sampler, ids):
        sampler.record(ids, error[ids])

    def band(sampler, ids):                     # view v's error in rank v % P's band alone
        sampler.record(ids, torch.where(ids % P == r, error[ids], torch.zeros_like(error[ids])))

    def replica(sampler, ids):
        mine = ids[2 * r:2 * r + 2]
        sampler.record(mine, error[mine])

    reference = draws(ViewSampler(scene, tc), 4, n, whole)
    uniform = draws(ViewSampler(scene, replace(tc, view_weight=0.0)), 4, n, whole)
    per_epoch = n // (2 * P)
    epochs = [[v for batch in reference[e * per_epoch:(e + 1) * per_epoch] for v in batch] for e in range(4)]
    if len(set(epochs[0])) != len(epochs[0]) or all(len(set(e)) == len(e) for e in epochs[1:]):
        fail("the first epoch is not a shuffle, or no weighted epoch drew a view twice")
    if reference[:per_epoch] != uniform[:per_epoch] or reference[per_epoch:] == uniform[per_epoch:]:
        fail("the weighted draws should match the shuffle in the first epoch alone")
    for name, record in (("bands", band), ("replicas", replica)):
        mine = draws(ViewSampler(scene, tc, comm), 4, n, record)
        if mine != reference:
            fail(f"{name}: rank {r}'s draws differ from one process's")
        every = comm.mpi.allgather(mine)
        if any(d != mine for d in every):
            fail(f"{name}: the ranks drew different views")
        print(f"{name}: {P} ranks draw as one process, {len(mine)} batches", flush=True)
    comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {r} of {P}", flush=True)


if __name__ == "__main__":
    main()
