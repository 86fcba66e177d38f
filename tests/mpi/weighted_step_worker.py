"""``insitu.pipeline.run_step`` with weighted view draws (``train.view_weight``) on P ranks, in both layouts.

Run as ``mpiexec -n P python weighted_step_worker.py``. Each rank holds its cut of three metaballs (CPU, gloo);
one step of 16 iterations (two and a half epochs of the 6 training views, one view per rank and iteration),
its ``model.ply`` refined for a quarter of them, first sort-last (``parallel.layout: sortlast``), then
replicated. Every :class:`insitu.sampling.ViewSampler` the step makes is watched:

- every batch is recorded with one finite error (>= 0, not all 0) per view this rank trained on: the
  batch's views in sort-last, this rank's share of them in the replicated layout;
- after the first epoch the draws are weighted (the sampler holds an error per training view);
- every rank draws the same batches.

Prints ``OK rank r of P`` on success; exits non-zero on any mismatch.
"""
import numpy as np

from dist_train import metaballs, tiny_config  # tests/mpi is on sys.path
from worker_report import fail
from insitu import pipeline
from insitu.decomposition import cut_block
from insitu.parallel import init_comm, shutdown
from insitu.sampling import ViewSampler

SAMPLERS: list["Watched"] = []


class Watched(ViewSampler):
    """A ViewSampler that keeps what it drew and what it was told."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drawn, self.recorded = [], []
        SAMPLERS.append(self)

    def __iter__(self):
        for ids, bg in super().__iter__():
            self.drawn.append(ids.tolist())
            yield ids, bg

    def record(self, ids, errors):
        self.recorded.append((ids.tolist(), None if errors is None else errors.detach().cpu().numpy()))
        super().record(ids, errors)


def main() -> None:
    comm = init_comm(device="cpu")
    P, r = comm.size, comm.rank
    pipeline.ViewSampler = Watched
    field = metaballs()
    for layout in ("sortlast", "replicated"):
        cfg = tiny_config(0.5)
        cfg.views.count = 8                         # 7 orbit views train, 1 is held out
        cfg.train.iterations, cfg.train.view_weight = 16, 0.5
        cfg.parallel.layout = layout
        cfg.output.ply_refine = 0.25
        SAMPLERS.clear()
        pipeline.run_step(cut_block(field, r, P), cfg, comm)
        if len(SAMPLERS) != 2:
            fail(f"{layout}: expected the training's and model.ply's samplers, got {len(SAMPLERS)}")
        training = SAMPLERS[0]
        per_rank = 1
        for sampler in SAMPLERS:
            for batch, (ids, errors) in zip(sampler.drawn, sampler.recorded):
                mine = batch if layout == "sortlast" else batch[r * per_rank:(r + 1) * per_rank]
                if ids != mine:
                    fail(f"{layout}: recorded views {ids}, trained on {mine} of the batch {batch}")
                if errors is None or errors.shape != (len(ids),) or not np.all(np.isfinite(errors)) \
                        or not np.all(errors >= 0):
                    fail(f"{layout}: views {ids} recorded with errors {errors}")
            if len(sampler.recorded) != len(sampler.drawn):
                fail(f"{layout}: {len(sampler.drawn)} batches drawn, {len(sampler.recorded)} recorded")
            total = comm.mpi.allreduce(float(sum(e.sum() for _, e in sampler.recorded)))
            if not total > 0:
                fail(f"{layout}: every recorded error is 0")
        if training.errors is None or training.probabilities() is None:
            fail(f"{layout}: the draws after the first epoch were not weighted")
        every = comm.mpi.allgather([s.drawn for s in SAMPLERS])
        if any(d != every[0] for d in every):
            fail(f"{layout}: the ranks drew different batches")
        print(f"{layout}: {P} ranks, {len(training.drawn)} + {len(SAMPLERS[1].drawn)} batches drawn alike, "
              f"weighted after the first epoch", flush=True)
    comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {r} of {P}", flush=True)


if __name__ == "__main__":
    main()
