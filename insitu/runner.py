"""Drive the pipeline over a source of timesteps: the body of every CLI command."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import numpy as np

from .config import Config
from .volume import InputError


def say(comm, text: str) -> None:
    if comm is None or comm.rank == 0:
        print(text, flush=True)


def summary(metrics: dict, out: Path) -> str:
    return (f"step {metrics['step']}: PSNR {metrics['psnr']:.2f} dB, SSIM {metrics['ssim']:.4f}, "
            f"{metrics['gaussians']} Gaussians, {metrics['iterations']} iterations, "
            f"GT {metrics['ground_truth_seconds']:.1f} s, train {metrics['train_seconds']:.1f} s "
            f"-> {out / ('step_%06d' % metrics['step'])}")


def train_steps(steps, cfg: Config, comm, writer, out: Path) -> int:
    """Train every step a source yields (warm-starting from the previous one when configured)."""
    from .pipeline import run_step

    previous, done = None, 0
    items = iter(steps)
    while True:
        with comm.phase("read step"):          # a failed read on one rank ends every rank
            item = next(items, None)
        ended = comm.mpi.allgather(item is None)
        if all(ended):
            break
        if any(ended):
            raise InputError(f"the source ended on rank(s) {[r for r, e in enumerate(ended) if e]} "
                             "but not on the others")
        iterations = (min(cfg.insitu.warm_iterations, cfg.train.iterations)
                      if previous is not None and cfg.insitu.warm_start else None)
        result = run_step(item.block, cfg, comm, step=item.step, time=item.time, writer=writer,
                          warm=previous if cfg.insitu.warm_start else None, iterations=iterations)
        previous = result
        done += 1
        say(comm, summary(result.metrics, out))
    return done


def volume_source(args: argparse.Namespace, cfg: Config, rank: int, size: int):
    """The single-step source of ``insitu run``: a raw file or a .npy array, cut for this rank."""
    from .sources import ArraySource, RawSource

    path, spacing = Path(args.input), tuple(args.spacing)
    if path.suffix == ".npy":
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        return ArraySource(np.load(path, mmap_mode="r"), rank=rank, size=size, spacing=spacing,
                           downsample=cfg.input.downsample, name=path.name)
    return RawSource(path, rank=rank, size=size, dims=cfg.input.dims, dtype=cfg.input.dtype,
                     downsample=cfg.input.downsample, spacing=spacing)


def run_command(args: argparse.Namespace, cfg: Config) -> int:
    from .export import StepWriter
    from .parallel import RankFailure, init_comm, shutdown

    comm = init_comm(device=cfg.parallel.device, timeout_s=cfg.parallel.timeout_s, threads=cfg.parallel.threads)
    out = Path(cfg.output.dir)
    try:
        writer = StepWriter(out)
        if args.command == "demo":
            from .demo import run_demo

            n = run_demo(args, cfg, comm, writer)
        elif args.command == "run":
            with comm.phase("read input"):
                source = volume_source(args, cfg, comm.rank, comm.size)
            n = train_steps(source, cfg, comm, writer, out)
        else:
            from .sources import open_source

            with open_source(args.command, args.input, cfg, comm.rank, comm.size, comm=comm.mpi) as source:
                n = train_steps(source, cfg, comm, writer, out)
        say(comm, f"done: {n} step(s) trained; outputs in {out} (report: {out / 'report.html'})")
        return 0
    except (InputError, RankFailure) as e:     # the same on every rank: rank 0 says it
        if comm.rank == 0:
            print(f"insitu: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, InputError) else 1
    except Exception:                       # unexpected: never leave the other ranks waiting
        traceback.print_exc()
        sys.stderr.flush()
        if comm.size > 1:
            comm.mpi.Abort(1)
        return 1
    finally:
        shutdown(comm)
