"""Time the ground-truth ray caster: all orbit views of a volume's isosurface.

    python benchmarks/experiments/bench_groundtruth.py --data /path/bonsai_256x256x256_uint8.raw --iso 40
    python benchmarks/experiments/bench_groundtruth.py --data sphere --views 4 --resolution 32 --device cpu

Prints one line: views, resolution, supersampling, seconds, views/s, peak GPU memory. With
``--caster FILE`` the Triton backend runs the kernel of FILE, another version of
``insitu/groundtruth/triton_caster.py`` (e.g. ``git show REV:insitu/groundtruth/triton_caster.py``),
to time two versions side by side.

With ``--pipeline`` (run under ``mpirun -n P``), times what ``insitu run`` does instead:
``make_scene`` on P ranks (each ray-casts its block, the bands are composited sort-last),
after one warm-up call, and prints one JSON line (rank 0):

    mpirun -n 2 python benchmarks/experiments/bench_groundtruth.py --pipeline --data bonsai_256x256x256_uint8.raw \
        --views 448 --resolution 2048
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.config import ViewConfig  # noqa: E402
from insitu.groundtruth.caster import raycast  # noqa: E402
from insitu.groundtruth.views import orbit_views  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402


def sphere(n: int = 128) -> np.ndarray:
    """Distance to the centre of an n^3 grid: iso n/3 is a sphere filling a good part of the views."""
    axis = np.arange(n, dtype=np.float32) - (n - 1) / 2
    z, y, x = np.meshgrid(axis, axis, axis, indexing="ij")
    return np.sqrt(x * x + y * y + z * z)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="sphere", help="a NAME_XxYxZ_dtype.raw file, or 'sphere'")
    parser.add_argument("--sphere-size", type=int, default=128, help="samples per axis of the sphere field")
    parser.add_argument("--iso", type=float, nargs="+", default=None,
                        help="iso value(s); default 40 for a raw file, radius n/3 for the sphere")
    parser.add_argument("--views", type=int, default=448)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--supersample", type=int, default=2)
    parser.add_argument("--step", type=float, default=ViewConfig().march_step)
    parser.add_argument("--chunk-rays", type=int, default=1 << 22)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--pipeline", action="store_true", help="time make_scene on the MPI ranks")
    parser.add_argument("--caster", help="another version of insitu/groundtruth/triton_caster.py to run")
    args = parser.parse_args(argv)
    if args.caster:
        use_caster(args.caster)
    if args.pipeline:
        return pipeline(args)

    device = torch.device(args.device)
    if args.data == "sphere":
        array = sphere(args.sphere_size)
        iso = args.iso if args.iso is not None else [array.shape[0] / 3]
    else:
        array = read_raw(args.data)
        iso = args.iso if args.iso is not None else [40.0]
    block = whole_block(array)
    views = orbit_views(*block.global_box, count=args.views, resolution=args.resolution).to(device)
    options = dict(supersample=args.supersample, step=args.step, chunk_rays=args.chunk_rays, device=device,
                   backend=args.backend)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    warm = min(2, len(views))
    raycast(block, views.viewmats[:warm], views.Ks[:warm], args.resolution, args.resolution, iso, **options)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    rgba, _ = raycast(block, views.viewmats, views.Ks, args.resolution, args.resolution, iso, **options)
    sync()
    seconds = time.perf_counter() - start
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else "n/a (cpu)"
    name = Path(args.data).name if args.data != "sphere" else f"sphere {args.sphere_size}^3"
    print(f"groundtruth {name} iso={iso}: views={len(views)} resolution={args.resolution}^2 "
          f"supersample={args.supersample}x{args.supersample} device={device} seconds={seconds:.3f} "
          f"views/s={len(views) / seconds:.2f} coverage={float(rgba[..., 3].mean()):.3f} peak_gpu_memory={peak}")


def use_caster(path: str) -> None:
    """Make the Triton backend run ``raycast_triton`` of the module at ``path`` (a version of
    ``insitu/groundtruth/triton_caster.py``; its relative imports resolve in ``insitu.groundtruth``)."""
    import insitu.groundtruth.caster as gt
    from bench_compile import load                # benchmarks/, the script's folder

    gt.raycast_triton = load(path, "insitu.groundtruth._bench_caster").raycast_triton


def pipeline(args) -> None:
    import json

    from insitu.config import load_config
    from insitu.input.decomposition import cut_block
    from insitu.parallel.comm import init_comm, shutdown
    from insitu.groundtruth.scene import make_scene

    comm = init_comm(device="auto")
    iso = args.iso if args.iso is not None else [40.0]
    cfg = load_config(None, {"input.iso": iso, "views.count": args.views, "views.resolution": args.resolution,
                             "views.supersample": args.supersample})
    block = cut_block(read_raw(args.data), comm.rank, comm.size)
    warm = load_config(None, {"input.iso": iso, "views.count": 2, "views.resolution": 64})
    make_scene(block, warm, comm)                                 # compile, warm the caches
    seconds = []
    for _ in range(2):
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        comm.mpi.Barrier()
        start = time.perf_counter()
        scene = make_scene(block, cfg, comm)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        seconds.append(comm.mpi.allreduce(time.perf_counter() - start, op=__import__("mpi4py").MPI.MAX))
    cast = cast_seconds(block, cfg, comm)                         # each rank's ray casting alone
    casts = comm.mpi.allgather(cast)
    rays = args.views * args.resolution ** 2 * args.supersample ** 2
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "device": str(comm.device), "views": args.views,
                          "resolution": args.resolution, "supersample": args.supersample,
                          "gt_seconds": round(min(seconds), 3), "gt_seconds_runs": [round(s, 3) for s in seconds],
                          "grays_per_s": round(rays / min(seconds) / 1e9, 3),
                          "cast_seconds_per_rank": [round(c, 3) for c in casts],
                          "gt_mean": float(scene.gt.float().mean())}), flush=True)
    shutdown(comm)


def cast_seconds(block, cfg, comm) -> float:
    """Seconds this rank takes to ray-cast its block for every view, as ``make_scene`` groups them,
    without compositing: the slowest rank's figure against ``gt_seconds`` says what the compositing
    and the waiting for the slowest block cost."""
    from insitu.groundtruth.caster import raycast_views

    vc, device = cfg.views, comm.device
    views = orbit_views(*block.global_box, count=vc.count, resolution=vc.resolution, fov_deg=vc.fov_deg,
                        test_every=vc.test_every).to(device)
    chunk = max(1, (1 << 25 if device.type == "cuda" else 1 << 22) // (views.width * views.height))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in raycast_views(block, views.viewmats, views.Ks, views.width, views.height, cfg.input.iso,
                           views_per_call=chunk, color=vc.surface_color, supersample=vc.supersample, device=device):
        pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
