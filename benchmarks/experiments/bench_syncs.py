"""Where a step makes the host wait for the GPU: syncs by phase and by call site (CUDA only).

Sets a step up as ``pipeline.compute_step`` does (one rank), each phase under
``torch.cuda.set_sync_debug_mode("warn")``, and counts the syncs torch reports (a read of a device
value, a copy to the device from pageable memory, a stream synchronisation) by phase and by the
innermost call site in this package or gsplat:

- ``seeds``: :func:`insitu.step.seeding.seed_shard`;
- ``ground_truth``: :func:`insitu.groundtruth.scene.make_scene` (the ray caster's groups of views and their
  compositing);
- ``train_first``, ``train_steady``: ``--counted`` training iterations from the start
  (densification on) and again with densification off;
- ``evaluation``: the held-out evaluation (:func:`insitu.step.evaluation.evaluate_trainer`).

Syncs inside a compiled extension (gsplat's) reach C++'s warning printer instead of Python's: they
are counted from what the phase writes to the process's stderr (``native``), without a call site.

A sync costs the device the time the host then takes to queue its next work, and while another
thread holds Python's lock (the metrics' import beside seeding and ray casting) the wait to get the
lock back as well: BENCHMARKS.md, runs 84 and 87. Prints one JSON object.

    python benchmarks/experiments/bench_syncs.py --data bonsai_256x256x256_uint8.raw --resolution 1024 --views 448
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_fidelity import base_settings, volume_arguments  # noqa: E402  (benchmarks/, the script's folder)
from insitu.config import load_config  # noqa: E402
from insitu.groundtruth.scene import make_scene  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.step import evaluation, loop, pipeline  # noqa: E402
from insitu.step.layouts import choose_layout  # noqa: E402
from insitu.step.seeding import init_colors, seed_shard  # noqa: E402
from insitu.training.sampling import ViewSampler  # noqa: E402
from insitu.volume import whole_block  # noqa: E402

OURS = ("/insitu/", "/gsplat/")


class SyncCounter:
    """Counts the syncs torch reports inside :meth:`phase` blocks, by phase and by call site."""

    def __init__(self) -> None:
        self.by_phase: dict[str, collections.Counter] = {}
        self.seconds: dict[str, float] = {}
        self.native: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        sites = self.by_phase.setdefault(name, collections.Counter())

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if any(s in f.filename for s in OURS)]
            where = frames[-1] if frames else None
            sites[f"{Path(where.filename).name}:{where.lineno} {where.name}" if where else "elsewhere"] += 1

        torch.cuda.synchronize()
        sys.stderr.flush()
        saved = os.dup(2)
        log = tempfile.TemporaryFile()
        os.dup2(log.fileno(), 2)                # C++ warnings (an extension's syncs) go to fd 2
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            self.seconds[name] = round(time.perf_counter() - t, 3)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            self.native[name] = log.read().decode(errors="replace").count("synchronizing CUDA operation")
            log.close()

    def summary(self, top: int = 12) -> dict:
        return {name: {"syncs": sum(c.values()), "native": self.native.get(name), "seconds": self.seconds.get(name),
                       "sites": dict(c.most_common(top))} for name, c in self.by_phase.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    volume_arguments(ap, iso=40.0, budget=None)
    ap.add_argument("--counted", type=int, default=20, help="training iterations counted in each training phase")
    args = ap.parse_args()

    volume, overrides = base_settings(args)
    comm = init_comm(device=args.device)
    if comm.device.type != "cuda":
        raise SystemExit("bench_syncs.py: needs a CUDA device (syncs are a GPU's)")
    cfg = load_config(None, overrides)
    block = whole_block(volume)
    count = SyncCounter()
    decomposition = pipeline.check_input(block, cfg, comm)
    layout = choose_layout(cfg, comm, block, decomposition)
    with count.phase("seeds"):
        seeding = seed_shard(block, cfg, comm, None)
    with count.phase("ground_truth"):
        scene = make_scene(block, cfg, comm, decomposition=decomposition, targets=seeding.targets)
    shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
    trainer, scene = pipeline.make_trainer(shard, scene, layout, block, cfg, share=seeding.share,
                                           iterations=cfg.train.iterations, warm=None)
    draws = iter(ViewSampler(scene, dataclasses.replace(cfg.train, batch=trainer.images_per_step)))
    loop.train_iteration(trainer, scene, *next(draws), cfg, comm)       # first use: kernels load
    with count.phase("train_first"):
        for _, (ids, bg) in zip(range(args.counted), draws):
            loop.train_iteration(trainer, scene, ids, bg, cfg, comm)
    trainer.cfg = dataclasses.replace(cfg.train, densify=dataclasses.replace(cfg.train.densify, start=10**9,
                                                                             reset_every=0))
    with count.phase("train_steady"):
        for _, (ids, bg) in zip(range(args.counted), draws):
            loop.train_iteration(trainer, scene, ids, bg, cfg, comm)
    evaluation.evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained)   # imports, first use
    with count.phase("evaluation"):
        evaluation.evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained)
    out = {"device": torch.cuda.get_device_name(comm.device), "resolution": args.resolution,
           "views": len(scene.views), "gaussians": len(trainer), "iterations": args.counted,
           "phases": count.summary()}
    print(json.dumps(out), flush=True)
    shutdown(comm)


if __name__ == "__main__":
    main()
