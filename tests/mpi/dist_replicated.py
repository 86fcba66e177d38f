"""Data parallelism (``run.layout: replicated``) against one rank that takes the whole batch.

Run as ``mpiexec -n P python dist_replicated.py [cuda]`` (CPU by default; ``cuda``: one GPU per rank,
NCCL, the torch rasterizer in float64 there too). Every rank builds the same model (seeds of the
whole metaballs field, float64) and the same whole ground truth (cast alone, ``comm.solo()``). Then

replicated: ``Trainer(replicas=comm)`` with ``train.batch = 1``: at each step rank r trains on view
            r of the step's P views (``sampling.ViewSampler`` with a batch of P, the same on every rank);
reference:  on rank 0 alone, ``Trainer`` with ``train.batch = P`` on all P views of each step;

from the same random seed, twice:

exact:      4 steps, no densification: the replicas equal the reference within 1e-9 (float64: the
            averaged gradients of P backward passes against the gradient of one);
densify:    8 steps, densification every 2 steps from step 2 (a low gradient threshold: clones and
            splits happen) and an opacity reset at step 6, rank 0 drawing random numbers the others do
            not draw before every step: the replicas are identical on every rank (bitwise) and hold as
            many Gaussians as the reference, more than at the start. (Their values drift from the
            reference's by more than rounding: Adam turns gradients of nearly 0, which differ in
            their last bits, into steps of the full learning rate.)

Prints ``OK rank r of P`` on success; exits non-zero on any mismatch.
"""
import sys
from dataclasses import replace

import numpy as np
import torch

from dist_train import metaballs  # tests/mpi is on sys.path
from worker_report import fail
from insitu.config import Config
from insitu.groundtruth.scene import make_scene
from insitu.groundtruth.views import Views
from insitu.parallel.comm import init_comm, shutdown
from insitu.step.loop import train_iteration
from insitu.surface.gaussians import Gaussians
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.sampling import ViewSampler
from insitu.training.trainer import Trainer
from insitu.volume import whole_block


def config(steps: int, densify: bool) -> Config:
    cfg = Config()
    cfg.input.iso = [0.5]
    cfg.views.count, cfg.views.resolution, cfg.views.supersample = 12, 32, 1
    cfg.run.backend, cfg.run.progress = "torch", False
    t = cfg.train
    t.batch, t.iterations = 1, steps
    t.densify.start, t.densify.every, t.densify.grad_threshold = (1 if densify else 10**6), 2, 1e-7
    t.densify.reset_every = 6 if densify else 0
    return cfg


def train(trainer: Trainer, scene, cfg, comm, run, *, per_rank: int, perturb: bool = False) -> None:
    """``cfg.train.iterations`` steps; each step's batch is the same on every rank, this rank takes
    its ``per_rank`` views. ``perturb``: rank 0 alone draws from torch's generators before each step
    (as rank 0's evaluations may), so the replicas' random states differ."""
    torch.manual_seed(7)
    draws = iter(ViewSampler(scene, replace(cfg.train, batch=trainer.images_per_step)))
    for _ in range(cfg.train.iterations):
        if perturb and comm.rank == 0:
            torch.rand(5, device=comm.device)
            torch.rand(5)
        ids, bg = next(draws)
        lo, hi = (comm.rank * per_rank, (comm.rank + 1) * per_rank) if trainer.replicas else (0, len(ids))
        train_iteration(trainer, scene, ids[lo:hi], bg[lo:hi], cfg, run)


def flat(trainer: Trainer) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in trainer.params.values()]).cpu().numpy()


def compare(comm, scene, g, box, steps: int, densify: bool) -> None:
    P, rank, solo = comm.size, comm.rank, comm.solo()
    cfg = config(steps, densify)
    lo, hi = box
    options = dict(extent=0.5 * float(np.linalg.norm(hi - lo)),
                   box=(torch.as_tensor(lo - 2.0, device=comm.device), torch.as_tensor(hi + 2.0, device=comm.device)),
                   max_gaussians=10**6, device=comm.device, total_iterations=steps)
    replica = Trainer(g, cfg.train, replicas=comm, **options)
    train(replica, scene, cfg, comm, solo, per_rank=1, perturb=True)
    mine = flat(replica)
    every = comm.mpi.gather(mine, root=0)
    if rank != 0:
        return
    what = "densify" if densify else "exact"
    if any(a.shape != mine.shape or not np.array_equal(a, mine) for a in every):
        fail(f"{what}: the replicas differ after {steps} steps: sizes {[a.size for a in every]}")
    reference = Trainer(g, replace(cfg.train, batch=P), **options)
    train(reference, scene, cfg, comm, solo, per_rank=P)
    if len(reference) != len(replica):
        fail(f"{what}: replicated {len(replica)} Gaussians, one rank with the whole batch {len(reference)}")
    err = float(np.max(np.abs(mine - flat(reference))))
    if densify and len(replica) == len(g):
        fail("densify: the number of Gaussians did not change: the test would not see densification")
    if not densify and not err < 1e-9:
        fail(f"exact: replicated vs one rank with the whole batch: max difference {err:.3g}")
    print(f"{what}: {P} replicas, {steps} steps, {len(g)} -> {len(replica)} Gaussians, identical on every rank"
          + ("" if densify else f", max difference to one rank {err:.2g}"), flush=True)


def main(device: str) -> None:
    comm = init_comm(device=device)
    block = whole_block(metaballs())
    scene = make_scene(block, config(1, False), comm.solo())
    v = scene.views
    scene = replace(scene, views=Views(v.viewmats.double(), v.Ks.double(), v.width, v.height, v.test))
    g = init_gaussians(extract_seeds(block, 0.5), 300, color=(0.8, 0.6, 0.4), sh_degree=1, seed=0, device=comm.device)
    g = Gaussians(**{k: t.double() for k, t in g.tensors().items()})
    torch.set_default_dtype(torch.float64)      # gsplat's split draws its samples in the default dtype
    compare(comm, scene, g, block.global_box, 4, densify=False)
    compare(comm, scene, g, block.global_box, 8, densify=True)
    comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {comm.rank} of {comm.size}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
