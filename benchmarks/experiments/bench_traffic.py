"""Bytes each rank moves per training step, as a function of P and the resolution (CPU, gloo).

A training step renders each rank's shard for a batch of views, composites the ranks' layers
sort-last (an all-to-all of band layers forward, one of layer gradients backward) and
backpropagates the band loss. ``comm.traffic`` counts the bytes each rank receives. The
model this checks, per rank and step, with ``h = ceil(H / P)``, float32 transfer::

    forward   4 (P - 1) B h W values   (the other ranks' 4-channel layers of my band)
    backward  4 (P - 1) B h W values   (my layer's gradients from the other band owners)
    total     32 (P - 1) B h W bytes  ~ 32 B H W (P - 1) / P: bounded in P

against the all-gather design it replaced (DESIGN.md): alphas and ``p`` all-gathered,
``(P - 1) B H W`` values each, plus colour bands ``4 (P - 1) / P B H W`` each way.

Driver (spawns ``mpiexec -n P`` for each P, writes one JSON)::

    python benchmarks/experiments/bench_traffic.py --ranks 1 2 3 4 --sizes 32 64 96 --out benchmarks/results/runs/unnumbered/cpu_traffic.json

It adds the predicted per-step time at P = 8, 32, 128 on a 25 GB/s network for 2048² views
(``--predict-*`` options), from single-node step times (docs/cluster.md explains the model).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def model_bytes(P: int, B: int, H: int, W: int, *, value_bytes: int = 4) -> dict:
    """Bytes per rank and step: the band-layer exchange (this design) and the all-gather one before it."""
    h = -(-H // P)
    band = 2 * 4 * (P - 1) * B * h * W * value_bytes
    gathered = value_bytes * (2 * (P - 1) * B * H * W + 2 * 4 * (P - 1) * B * h * W)
    return {"band_layers": band, "all_gather_design": gathered}


def worker(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from insitu.groundtruth.views import orbit_views
    from insitu.parallel.comm import init_comm, shutdown
    from insitu.render.compositing import band_rows, visibility_order
    from insitu.training.bandloss import band_loss
    from insitu.training.trainer import render_bands

    comm = init_comm(device="cpu", threads=1)
    P, rank = comm.size, comm.rank
    lo, hi = torch.zeros(3), torch.tensor([float(P), 1.0, 1.0])        # P blocks along x
    coords = torch.tensor([[p, 0, 0] for p in range(P)])
    g = torch.Generator().manual_seed(rank)
    n = args.gaussians
    params = {"means": torch.rand(n, 3, generator=g) * torch.tensor([1.0, 1.0, 1.0]) + torch.tensor([rank, 0.0, 0.0]),
              "quats": torch.randn(n, 4, generator=g), "scales": torch.full((n, 3), -3.0),
              "opacities": torch.zeros(n), "colors": torch.rand(n, 1, 3, generator=g)}
    params = {k: v.requires_grad_() for k, v in params.items()}
    rows = []
    for size in args.sizes:
        views = orbit_views(lo.numpy(), hi.numpy(), 8, size, 40.0, 4)
        order = visibility_order(views.positions, (P, 1, 1), lo, hi, coords)
        bg = torch.zeros(3)
        times, moved = [], []
        for step in range(args.warmup + args.steps):
            ids = torch.arange(step * args.batch, (step + 1) * args.batch) % len(views)
            comm.traffic.reset()
            comm.mpi.Barrier()
            t = time.perf_counter()
            pred, _ = render_bands(params, views, ids, order, comm, background=bg, sh_degree=0, backend="torch")
            loss = band_loss(pred, torch.zeros_like(pred), ssim_weight=0.0, rows=band_rows(size, P)[rank],
                             height=size, comm=comm)
            loss.backward()
            if step >= args.warmup:
                times.append(time.perf_counter() - t)
                moved.append(comm.traffic.bytes)
        want = model_bytes(P, args.batch, size, size)
        per_rank = comm.mpi.gather(moved[-1])
        seconds = comm.mpi.allreduce(statistics.median(times), op=__import__("mpi4py").MPI.MAX)
        if rank == 0:
            rows.append({"ranks": P, "batch": args.batch, "height": size, "width": size,
                         "bytes_per_step_per_rank": per_rank, "model_bytes": want["band_layers"],
                         "model_matches": all(b == want["band_layers"] for b in per_rank),
                         "all_gather_design_bytes": want["all_gather_design"],
                         "step_seconds_median": round(seconds, 5)})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    shutdown(comm)


def predict(args) -> dict:
    """Per-step time at P ranks for each model: compute ``a / P + b`` (fitted to its 1- and 2-GPU
    steps on one node, where the NVLink time is neglected) plus the bytes over the network."""
    R, B = args.predict_resolution, 1
    out = {"resolution": R, "batch": B, "network_GB_per_s": args.network_gbs, "models": []}
    for label, t1, t2 in args.predict_model:
        t1, t2 = float(t1), float(t2)
        a, b = 2 * (t1 - t2), 2 * t2 - t1
        model = {"model": label, "t1_ms": t1, "t2_ms": t2, "a_ms (work that divides by P)": round(a, 2),
                 "b_ms (per-rank work that does not)": round(b, 2), "rows": []}
        for P in args.predict_ranks:
            m = model_bytes(P, B, R, R)
            net = {k: v / (args.network_gbs * 1e9) * 1e3 for k, v in m.items()}
            model["rows"].append({"ranks": P, "compute_ms": round(a / P + b, 2),
                                  "band_layers_MB": round(m["band_layers"] / 1e6, 1),
                                  "band_layers_network_ms": round(net["band_layers"], 2),
                                  "step_ms_band_layers": round(a / P + b + net["band_layers"], 2),
                                  "speedup_band_layers": round(t1 / (a / P + b + net["band_layers"]), 1),
                                  "all_gather_design_MB": round(m["all_gather_design"] / 1e6, 1),
                                  "step_ms_all_gather_design": round(a / P + b + net["all_gather_design"], 2)})
        out["models"].append(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96], help="square view sizes H = W")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gaussians", type=int, default=200, help="per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/runs/unnumbered/cpu_traffic.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--network-gbs", type=float, default=25.0)
    ap.add_argument("--predict-ranks", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--predict-resolution", type=int, default=2048)
    ap.add_argument("--predict-model", nargs=3, action="append", metavar=("LABEL", "T1_MS", "T2_MS"),
                    help="a model's step time on 1 and on 2 GPUs of one node (repeatable); default as measured "
                         "(BENCHMARKS.md): 4M Gaussians 18.1 / 14.5 ms (runs 15 / 10), 100M 207.4 / 129.6 ms "
                         "(run 15, 2048^2, one view per step)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.predict_model = args.predict_model or [["4M Gaussians", "18.1", "14.5"], ["100M Gaussians", "207.4", "129.6"]]
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    rows = []
    for P in args.ranks:
        cmd = [mpiexec, "-n", str(P), sys.executable, __file__, "--worker", "--sizes", *map(str, args.sizes),
               "--batch", str(args.batch), "--gaussians", str(args.gaussians), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
                   OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"P={P} failed:\n{proc.stdout}\n{proc.stderr}")
        rows += json.loads(lines[0][len("RESULT "):])
        for r in rows[-len(args.sizes):]:
            print(f"P={P} {r['height']}x{r['width']} B={r['batch']}: {max(r['bytes_per_step_per_rank'])} bytes per rank "
                  f"(model {r['model_bytes']}, all-gather design {r['all_gather_design_bytes']}), "
                  f"{r['step_seconds_median'] * 1e3:.1f} ms per step", flush=True)
    result = {"measured": rows, "all_match_model": all(r["model_matches"] for r in rows),
              "prediction": predict(args), "command": " ".join(sys.argv)}
    for m in result["prediction"]["models"]:
        for r in m["rows"]:
            print(f"predicted, {m['model']}, P={r['ranks']}: {r['band_layers_MB']} MB -> {r['step_ms_band_layers']} ms "
                  f"per step, {r['speedup_band_layers']}x (all-gather design: {r['all_gather_design_MB']} MB -> "
                  f"{r['step_ms_all_gather_design']} ms)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}; every measurement matches the model: {result['all_match_model']}")


if __name__ == "__main__":
    main()
