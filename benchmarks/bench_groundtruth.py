"""Time the ground-truth ray caster: all orbit views of a volume's isosurface.

    python benchmarks/bench_groundtruth.py --data /path/bonsai_256x256x256_uint8.raw --iso 40
    python benchmarks/bench_groundtruth.py --data sphere --views 4 --resolution 32 --device cpu

Prints one line: views, resolution, supersampling, seconds, views/s, peak GPU memory.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insitu.groundtruth import raycast  # noqa: E402
from insitu.views import orbit_views  # noqa: E402
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
    parser.add_argument("--step", type=float, default=0.5)
    parser.add_argument("--chunk-rays", type=int, default=1 << 22)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if args.data == "sphere":
        array = sphere(args.sphere_size)
        iso = args.iso if args.iso is not None else [array.shape[0] / 3]
    else:
        array = read_raw(args.data)
        iso = args.iso if args.iso is not None else [40.0]
    block = whole_block(array)
    views = orbit_views(*block.global_box, count=args.views, resolution=args.resolution).to(device)
    options = dict(supersample=args.supersample, step=args.step, chunk_rays=args.chunk_rays, device=device)

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


if __name__ == "__main__":
    main()
