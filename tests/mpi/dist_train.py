"""``insitu.step.pipeline.run_step`` on P ranks (CPU, gloo), in several situations.

Run as ``mpiexec -n P python dist_train.py MODE [DIR]``:

MODE train:  a tiny training run on three metaballs (its surface crosses the cut planes) on
             the P ranks, then the same again with rank 1 alone still importing the metrics (the
             initial figures drawn before training and scored after it: DIR/metrics_P_deferred.json),
             then the same run on one rank (rank 0 alone, on ``MPI.COMM_SELF``, the whole field as
             its block); rank 0 writes the metrics of both to DIR/metrics_P.json and DIR/metrics_1.json.
MODE replicated: as train (the deferred figures too), with ``run.layout: replicated`` (every rank trains the whole model
             on its own views; each keeps the Gaussians in its block at the end); the one-rank run
             takes the P views of a step at once (``train.batch = P``). Then a second step, warm-started
             from the first (30 iterations): its metrics in DIR/metrics_P_warm.json; then a step whose
             ``train.batch x P`` exceeds the training views must be an InputError on every rank.
MODE corner: a small sphere inside rank 0's block only: the other ranks hold no surface and
             must train (60 iterations) with 0 Gaussians without failing; rank 0 writes the metrics and the
             Gaussians of every rank (``per_rank``) to DIR/metrics_P.json.
MODE budget: a step with ``train.time_budget_s`` 25 on the P ranks, each on a fake clock that stands still but for
             1 + r seconds added by every optimiser step on rank r (:func:`conftest.ticking_clock`): every rank
             stops at the same iteration, the first look (every 10 iterations) past the budget on the fastest
             clock; rank 0 writes the metrics with every rank's iterations to DIR/metrics_P.json. Then a step of
             the surface moved 1 cell along x, warm-started from it: its warm-start counts (the same on every
             rank) to DIR/metrics_P_warm.json.
MODE fail:   two failing steps on the same ranks, one after the other:
             (nan)   rank 1's block holds a NaN;
             (color) cfg.input.color_var names a field that only rank 0 has, so rank 1 fails
                     inside the ground-truth stage (torch collective timeout
                     ``run.timeout_s`` = 5 s, agreement watchdog 10 s).
             Every rank must end each with a RankFailure naming rank 1.

Every trained step checks that the shapes of the kernels it compiled ahead, planned from the configuration, are
those of the objects it built (:class:`insitu.step.compilation.KernelShapes`).

Every rank prints ``OK rank r of P`` when it finished as the mode expects; in the failure
modes a rank prints ``[case] rank r caught RankFailure after S s: MESSAGE`` first. Any
other outcome raises (and the excepthook of ``init_comm`` aborts the job).
"""
import json
import math
from dataclasses import replace
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from insitu.config import Config
from insitu.errors import InputError, RankFailure
from insitu.input.decomposition import cut_block
from insitu.parallel.comm import init_comm, shutdown
from insitu.step.compilation import KernelShapes, compile_ahead
from insitu.step.layouts import training_ranks
from insitu.step.pipeline import Collaborators, run_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/, for conftest's helpers
from conftest import sphere_field, ticking_clock, tiny_config  # noqa: E402


def metaballs(n: int = 40) -> np.ndarray:
    """[n, n, n] sum of three Gaussian blobs (the surface at 0.5 crosses the middle planes)."""
    z, y, x = np.meshgrid(*(np.linspace(0.0, 1.0, n),) * 3, indexing="ij")
    u = np.zeros_like(x)
    for cx, cy, cz, s in [(0.35, 0.45, 0.5, 0.16), (0.65, 0.55, 0.45, 0.14), (0.5, 0.5, 0.7, 0.12)]:
        u += np.exp(-((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2) / (2 * s * s))
    return u.astype(np.float32)


def corner_sphere(n: int = 32) -> np.ndarray:
    """[n, n, n] distance field of a sphere of radius 4 around sample (6, 6, 6) (surface at 0)."""
    return (sphere_field(n, centre=(6, 6, 6), dtype=np.float64) - 4.0).astype(np.float32)


def dist_config(iso: float) -> Config:
    """The step of these runs: 24 views of 48^2, 2000 seeds filling the surface, 60 iterations of one view per
    step (per replica in the replicated layout), on the CPU."""
    cfg = tiny_config(iso=iso, views=24, resolution=48, budget=2000, images=0, iterations=60, seed=3)
    cfg.seeds.fill = True
    cfg.run.device = "cpu"
    return cfg


def expect_failure(case: str, comm, cfg, block) -> None:
    t0 = time.monotonic()
    try:
        run_step(block, cfg, comm)
    except RankFailure as failure:
        print(f"[{case}] rank {comm.rank} caught RankFailure after {time.monotonic() - t0:.1f} s: {failure}",
              flush=True)
        if 1 not in failure.ranks:
            raise AssertionError(f"expected rank 1 among the failed ranks, got {failure.ranks}") from failure
        return
    raise AssertionError(f"[{case}] run_step did not fail")


def planned_shapes(cfg, comm, shapes=None):
    """compile_ahead, after checking that the shapes of the objects the step built (``shapes``, given before
    training) are those planned from the configuration alone (at a run's start and the step's)."""
    planned = KernelShapes.planned(cfg, *training_ranks(cfg, comm))
    if shapes is not None and shapes != planned:
        raise AssertionError(f"rank {comm.rank}: the step built {shapes}, planned were {planned}")
    return compile_ahead(cfg, comm, shapes)


def train(comm, cfg, field, path: Path, warm=None, importing=None):
    """run_step on comm with this rank's block (warm-started from ``warm``, the previous result on this
    rank, when given; ``importing``: whether this rank still imports the metrics, default the truth); rank 0
    writes the metrics to ``path``. Returns the result."""
    block = cut_block(field, comm.rank, comm.size)
    using = Collaborators(compile_ahead=planned_shapes)
    if importing is not None:
        using = replace(using, importing_metrics=importing)
    result = run_step(block, cfg, comm, warm=warm, iterations=30 if warm is not None else None, using=using)
    m = result.metrics
    per_rank = comm.allgather_object(len(result.gaussians))
    if not math.isfinite(m["psnr"]) or sum(per_rank) != m["gaussians"]:
        raise AssertionError(f"PSNR {m['psnr']}, Gaussians per rank {per_rank} vs {m['gaussians']}")
    if comm.rank == 0:
        path.write_text(json.dumps({**m, "per_rank": per_rank}, indent=1))
        print(f"{comm.size} rank(s): PSNR {m['psnr']:.2f} dB (initial {m['psnr_initial']:.2f}), "
              f"SSIM {m['ssim']:.4f}, Gaussians per rank {per_rank}, ground truth "
              f"{m['ground_truth_seconds']:.1f} s, train {m['train_seconds']:.1f} s", flush=True)
    return result


def budget(comm, cfg, out: Path) -> None:
    """MODE budget (the module's docstring)."""
    cfg.train.time_budget_s = 25.0
    field = metaballs()
    first = run_step(cut_block(field, comm.rank, comm.size), cfg, comm, using=ticking_clock(1.0 + comm.rank))
    m = first.metrics
    done = comm.allgather_object((m["iterations"], m["stopped_by"]))
    if comm.rank == 0:
        (out / f"metrics_{comm.size}.json").write_text(json.dumps({**m, "per_rank": done}, indent=1))
    moved = np.roll(field, 1, axis=2)          # the surface 1 cell further along x (the edges hold no surface)
    warm = run_step(cut_block(moved, comm.rank, comm.size), cfg, comm, warm=first, iterations=10)
    counts = comm.allgather_object([warm.metrics[k] for k in ("gaussians_stale", "gaussians_dropped",
                                                              "gaussians_new", "gaussians_initial")])
    if comm.rank == 0:
        (out / f"metrics_{comm.size}_warm.json").write_text(json.dumps({**warm.metrics, "per_rank": counts},
                                                                       indent=1))


def main(mode: str, out: Path | None) -> None:
    cfg = dist_config(0.0 if mode == "corner" else 0.5)
    if mode == "fail":
        cfg.run.timeout_s = 5.0
        cfg.train.iterations = 5
    comm = init_comm(device="cpu", timeout_s=cfg.run.timeout_s)
    P, rank = comm.size, comm.rank
    if mode == "fail":
        if rank == 0:
            print(f"run.timeout_s {cfg.run.timeout_s}", flush=True)
        field = metaballs()
        block = cut_block(field, rank, P)
        if rank == 1:
            block.data = block.data.copy()
            block.data[2, 3, 4] = np.nan
        expect_failure("nan", comm, cfg, block)
        cfg.input.color_var = "c"
        block = cut_block(field, rank, P, fields={"c": field} if rank == 0 else {})
        expect_failure("color", comm, cfg, block)
    elif mode == "corner":
        train(comm, cfg, corner_sphere(), out / f"metrics_{P}.json")
    elif mode == "budget":
        budget(comm, cfg, out)
    else:
        field = metaballs()
        if mode == "replicated":
            cfg.run.layout = "replicated"
        result = train(comm, cfg, field, out / f"metrics_{P}.json")
        # again, rank 1 alone still importing the metrics: every rank draws the initial figures now and
        # scores them later
        train(comm, cfg, field, out / f"metrics_{P}_deferred.json", importing=lambda: comm.rank == 1)
        if mode == "replicated":                # a warm start goes on from each rank's shard
            train(comm, cfg, field, out / f"metrics_{P}_warm.json", warm=result)
            too_many = replace(cfg, train=replace(cfg.train, batch=len(result.cameras.train_ids)))
            try:                                # the ranks' views of a step exceed the training views
                run_step(cut_block(field, rank, P), too_many, comm)
            except InputError as e:
                print(f"rank {rank}: InputError: {e}", flush=True)
            else:
                raise AssertionError("a batch of more views than the training views was not refused")
        if rank == 0:
            one = init_comm(MPI.COMM_SELF, device="cpu")
            if mode == "replicated":            # the same views per step as the P replicas
                cfg.train.batch *= P
            train(one, cfg, field, out / "metrics_1.json")
            shutdown(one)
        comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {rank} of {P}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)
