"""Time seeding: marching cubes (CPU) and a filled budget of Gaussians drawn on the device.

    python benchmarks/experiments/bench_seeds.py --data bonsai_256x256x256_uint8.raw --iso 40 --budget 18000000

Prints one JSON line: seconds for marching cubes, for init_gaussians(fill=True) on the device
(median of 3 after a warm-up), and the Gaussians made.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.volume import read_raw, whole_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--budget", type=int, default=18_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    block = whole_block(read_raw(args.data))
    t = time.perf_counter()
    seeds = extract_seeds(block, args.iso)
    mc_s = time.perf_counter() - t

    def fill():
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        g = init_gaussians(seeds, args.budget, fill=True, sh_degree=3, device=args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, len(g)

    fill()
    runs = [fill() for _ in range(3)]
    fill_s = statistics.median(r[0] for r in runs)
    print(json.dumps({"device": args.device, "vertices": len(seeds), "gaussians": runs[0][1],
                      "marching_cubes_s": round(mc_s, 3), "fill_s": round(fill_s, 3),
                      "seeds_s": round(mc_s + fill_s, 3)}), flush=True)


if __name__ == "__main__":
    main()
