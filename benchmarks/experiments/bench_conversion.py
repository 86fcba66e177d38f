"""The seeds' own figure: variants of the conversion of one field's isosurface, scored before and during training.

One field, one ground truth (cast once), then for every variant: the seeds made (the package's ``seed_shard``
with ``--set``-style overrides, or the conversion's own knobs), their held-out figures before any iteration
(orbit, 2x / 3x closer, off the orbit), where the error is (inside against outline, holes, spurious cover), and
for a variant with ``@train=N1+N2``, a training of N1 iterations from its seeds, and one of N2, each scored every
``--every`` iterations (the orbit's held-out views) and at its end. Fields: a raw volume (``--data``), or a
synthetic one (``--field sphere|blobs|sheet|gray_scott[:preset[:L[:steps]]]``).

    python benchmarks/experiments/bench_conversion.py --field sphere --resolution 128 --views 48 \\
        --variant "old=@old,@train=400" --variant "default=@train=400" --variant "f8=seeds.footprint=0.8"

A variant is settings (``KEY=VALUE``) and flags: ``@old`` the seeds before the conversion (points drawn at random on
the triangles, opacity 0.5, the old disc size), ``@newton=0`` no projection onto the isosurface.

Prints one JSON object per variant.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sims"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from insitu.config import load_config, parse_override  # noqa: E402
from insitu.surface import conversion  # noqa: E402
from insitu.surface.seeds import sample_surface_torch  # noqa: E402
from insitu.groundtruth.scene import make_scene  # noqa: E402
from insitu.groundtruth.views import HELD_OUT  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.step.clock import PhaseClock  # noqa: E402
from insitu.step.evaluation import evaluate_trainer  # noqa: E402
from insitu.step.layouts import choose_layout  # noqa: E402
from insitu.step.loop import train  # noqa: E402
from insitu.step.pipeline import check_input, make_trainer  # noqa: E402
from insitu.step.seeding import init_colors, seed_shard  # noqa: E402
from insitu.volume import downsample, read_raw, whole_block  # noqa: E402


ANATOMY = ("error_share_edge", "edge_fraction_of_fg", "psnr_inner", "psnr_edge", "holes_fraction_of_fg",
           "spurious_fraction_of_fg", "psnr_alpha_fg", "inner_bias", "psnr_fg_if_edges_perfect")


def synthetic(spec: str, cache: Path) -> tuple[np.ndarray, float]:
    """A synthetic field and its iso value: ``sphere``, ``blobs`` (many small features), ``sheet`` (a thin wavy
    plate), ``gray_scott[:preset[:L[:steps]]]`` (the mini-app's V, cached in ``cache``)."""
    name, *rest = spec.split(":")
    n = 64
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float32)
    if name == "sphere":
        return np.sqrt((x - 31.3) ** 2 + (y - 32.1) ** 2 + (z - 30.7) ** 2) / 20.0, 1.0
    if name == "blobs":
        rng = np.random.default_rng(1)
        f = np.zeros_like(x)
        for c, r in zip(rng.uniform(6, n - 6, (60, 3)), rng.uniform(1.5, 4.0, 60)):
            f += np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) / (2 * r * r))
        return f, 0.5
    if name == "sheet":
        h = 32 + 6 * np.sin(x / 9.0) * np.cos(y / 7.0)
        return np.abs(z - h) / 1.2, 1.0
    if name == "gray_scott":
        path = gray_scott_path(spec, cache)
        if not path.exists():
            make_gray_scott(spec, cache)
        return np.load(path), 0.3
    raise SystemExit(f"unknown field {spec!r}")


def gray_scott_spec(spec: str) -> tuple[str, int, int, int]:
    """``gray_scott[:preset[:L[:steps[:total]]]]`` -> (preset, L, steps run, steps the rates ramp over)."""
    _, *rest = spec.split(":")
    preset = rest[0] if rest else "tutorial"
    L = int(rest[1]) if len(rest) > 1 else 64
    steps = int(rest[2]) if len(rest) > 2 else 600
    total = int(rest[3]) if len(rest) > 3 else steps
    return preset, L, steps, total


def gray_scott_path(spec: str, cache: Path) -> Path:
    preset, L, steps, total = gray_scott_spec(spec)
    return cache / f"gs_{preset}_{L}_{steps}_{total}.npy"


def make_gray_scott(spec: str, cache: Path) -> None:
    """The mini-app's V after the spec's steps, on every rank of COMM_WORLD (``mpiexec -n K``), saved by rank 0."""
    from mpi4py import MPI

    from insitu_sims.gray_scott import PRESETS, GrayScott, GrayScottSettings
    preset, L, steps, total = gray_scott_spec(spec)
    comm = MPI.COMM_WORLD
    sim = GrayScott(GrayScottSettings(L=L, steps=total, engine="none", **PRESETS[preset]), comm)
    for _ in range(steps):
        sim.step()
    parts = comm.gather((sim.start, sim.v.astype(np.float32)), root=0)
    if comm.rank == 0:
        whole = np.zeros((L, L, L), np.float32)
        for (x, y, z), v in parts:
            nz, ny, nx = v.shape
            whole[z:z + nz, y:y + ny, x:x + nx] = v
        np.save(gray_scott_path(spec, cache), whole)


even_points, steps = conversion.surface_points, conversion.PROJECTION_STEPS


def random_points(seeds, density, *, seed=0, device=None):
    """The seeds before the conversion: ``density * area`` points drawn independently on the triangles."""
    return sample_surface_torch(seeds, int(round(density * seeds.total_area)), seed, device)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def figures(trainer, scene, layout, cfg, colors) -> dict:
    """Surface PSNR of the orbit's held-out views and of each held-out set, and the whole image's."""
    q, _ = evaluate_trainer(trainer, scene, layout, cfg, colors=colors)
    out = {"psnr_foreground": round(q.psnr_foreground, 2), "psnr": round(q.psnr, 2)}
    for role in HELD_OUT[1:]:
        ids = scene.views.ids(role).tolist()
        if ids:
            q, _ = evaluate_trainer(trainer, scene, layout, cfg, colors=colors, ids=ids)
            out[role] = round(q.psnr_foreground, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a raw volume NAME_XxYxZ_DTYPE.raw")
    ap.add_argument("--field", help="a synthetic field instead (sphere, blobs, sheet, gray_scott:preset:L:steps:total)")
    ap.add_argument("--iso", type=float)
    ap.add_argument("--downsample", type=int, default=1)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--views", type=int, default=48)
    ap.add_argument("--held-out", type=int, default=6)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a base setting")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=KEY=VALUE,...")
    ap.add_argument("--every", type=int, default=100, help="iterations between two scores of a training run")
    ap.add_argument("--anatomy", action="store_true", help="where the seeds' error is (bench_anatomy.py)")
    ap.add_argument("--images", type=Path, help="with --anatomy: ground truth | render | error PNGs here")
    ap.add_argument("--cache", type=Path, default=Path("/tmp"))
    ap.add_argument("--make", action="store_true", help="only make --field's Gray-Scott field (under mpiexec)")
    args = ap.parse_args()
    if args.images is not None:
        args.images.mkdir(parents=True, exist_ok=True)
    if args.make:
        make_gray_scott(args.field, args.cache)
        return
    if args.data:
        volume, iso = downsample(read_raw(args.data), args.downsample), args.iso
    else:
        volume, iso = synthetic(args.field, args.cache)
        iso = args.iso if args.iso is not None else iso
    base = {"input.iso": [iso], "views.count": args.views, "views.resolution": args.resolution,
            "views.held_out": args.held_out, "run.progress": False, "run.device": args.device,
            "train.eval_every": 0}
    base.update(dict(parse_override(s) for s in args.set))
    comm = init_comm(device=args.device)
    try:
        block = whole_block(volume)
        scene = None
        for spec in args.variant:
            name, _, settings = spec.partition("=")
            parts = [x for x in re.split(r",(?![^\[]*\])", settings) if x]
            lengths = [int(n) for x in parts if x.startswith("@train=") for n in x[7:].split("+")]
            overrides = dict(base)
            if "@old" in parts:                 # the seeds before the conversion (random points, half opaque)
                overrides.update({"seeds.opacity": 0.5, "seeds.footprint": 0.8 / np.sqrt(np.pi)})
            overrides.update(dict(parse_override(x) for x in parts if not x.startswith("@")))
            conversion.surface_points = random_points if "@old" in parts else even_points
            conversion.PROJECTION_STEPS = 0 if "@old" in parts or "@newton=0" in parts else steps
            cfg = load_config(None, overrides)
            torch.manual_seed(cfg.train.seed)
            decomposition = check_input(block, cfg, comm)
            layout = choose_layout(cfg, comm, block, decomposition)
            sync()
            t0 = time.perf_counter()
            seeding = seed_shard(block, cfg, comm, None)
            sync()
            seconds = time.perf_counter() - t0
            if scene is None:
                t0 = time.perf_counter()
                scene = make_scene(block, cfg, comm, decomposition=decomposition, targets=seeding.targets)
                print(json.dumps({"ground_truth_s": round(time.perf_counter() - t0, 2)}), flush=True)
            shard = init_colors(seeding.shard, scene, cfg, comm, only=seeding.fresh)
            row = {"variant": name, "settings": settings, "gaussians": len(shard), "seeds_s": round(seconds, 3)}
            for n in [0] + lengths:
                run = replace(cfg, train=replace(cfg.train, eval_every=args.every if n else 0))
                trainer, sc = make_trainer(shard, scene, layout, block, run, share=seeding.share,
                                           iterations=max(n, 1), warm=None)
                if n == 0:
                    row["initial"] = figures(trainer, sc, layout, cfg, trainer.colors)
                    if args.anatomy:
                        from bench_anatomy import take_apart
                        parts = take_apart(trainer, sc, comm, cfg, trainer.colors, args.images, name, per_set=8)
                        row["anatomy"] = {k: round(v, 3) for k, v in parts["test"].items() if k in ANATOMY}
                    continue
                clock = PhaseClock(comm.device)
                log = train(trainer, sc, layout, run, clock, iterations=n, step=0, gaussians=len(trainer), show=False)
                row[f"it{n}"] = {**figures(trainer, sc, layout, cfg, trainer.colors_trained),
                                 "train_s": round(clock.lap("train"), 2), "gaussians": len(trainer),
                                 "curve": [(h["iteration"], round(h["psnr_foreground"], 2)) for h in log.history]}
            print(json.dumps(row), flush=True)
    finally:
        shutdown(comm)


if __name__ == "__main__":
    main()
