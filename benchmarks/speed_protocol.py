"""Collect the speed protocol's figures into one JSON (``benchmarks/gpu_run.sh protocol`` runs it last).

Reads what the protocol's runs left in ``--dir`` (one JSON line or metrics.json each) and
writes ``--out`` with the keys below; a figure whose run was not made (or failed) is null.

    gt_s_{1,2}gpu       ground truth, 448 views at 2048^2, 2x2 rays per pixel (make_scene on P ranks)
    step_ms_1gpu        one training step, ~4M Gaussians, one view at 2048^2 (bench_step.py)
    bare_raster_ms_1gpu gsplat's rasterization forward + backward alone, same model and views
    train_s_{1,2}gpu    `insitu run` bonsai 1024^2 to PSNR 30 / SSIM 0.97: training (evaluations included)
    total_s_{1,2}gpu    the same run: seeds + ground truth + training
    psnr_/ssim_{1,2}gpu held-out quality at the stop; iterations_to_target (1 GPU)
    recipe_train_s_1024 the plain gsplat recipe (bench_recipe.py), same GT and initial Gaussians
    ours_train_s_1024   = train_s_1gpu
    iterations_to_target_constant_colors, train_s_1gpu_constant_colors: the 1-GPU run with constant colours
    ours_over_recipe    ours / recipe training time, with ``ours`` from ``proto_train1_side_metrics.json``
                        when present (the 1-GPU run made in the same command as the recipe), else train_s_1gpu
    train_s_2gpu_batch2, total_s_2gpu_batch2, iterations_to_target_2gpu_batch2: 2 GPUs, 2 views per step
    train_s_1gpu_batch2, total_s_1gpu_batch2, iterations_to_target_1gpu_batch2: the same on 1 GPU;
                        train_speedup_batch2 (1 -> 2 GPUs), ours_batch2_over_recipe (its training / the recipe's)
    evaluation_s_*      seconds of the evaluations inside the training time (the first one included)
    train_s_2gpu_replicated, total_s_2gpu_replicated, iterations_to_target_2gpu_replicated: 2 GPUs with
                        parallel.layout=replicated, one view per GPU and step; train_speedup_replicated against
                        the 1-GPU run with 2 views per step (the same images)
    sources             the contents of ``sources.json`` in ``--dir``, when the files come from several runs
    ply_psnr, ply_ssim, psnr_foreground, psnr_white (_1gpu, _2gpu): model.ply as a viewer draws it, etc.
    seeds_18m_s_1gpu    marching cubes + 18M Gaussians drawn on the GPU (bench_seeds.py)
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path


def _json(path: Path) -> dict | None:
    """The last JSON object line of a file, or the whole file as JSON; None if absent or unreadable."""
    if not path.exists():
        return None
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _get(d: dict | None, key: str):
    return None if d is None else d.get(key)


def _total(m: dict | None):
    if m is None:
        return None
    return round(m["seeds_seconds"] + m["ground_truth_seconds"] + m["train_seconds"], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the protocol's runs wrote their outputs")
    ap.add_argument("--out", default="benchmarks/results/speed_protocol.json")
    ap.add_argument("--gpu", default=None, help="GPU name (default: nvidia-smi's, on the GPU machine)")
    args = ap.parse_args()
    d = Path(args.dir)
    gt1, gt2 = _json(d / "proto_gt1.json"), _json(d / "proto_gt2.json")
    step = _json(d / "proto_step1.json")
    m1, m2 = _json(d / "proto_train1_metrics.json"), _json(d / "proto_train2_metrics.json")
    recipe = _json(d / "proto_recipe.json")
    seeds = _json(d / "proto_seeds.json")
    const1 = _json(d / "proto_const1_metrics.json")
    side = _json(d / "proto_train1_side_metrics.json") or m1
    batch2 = _json(d / "proto_batch2_metrics.json")
    batch2x1 = _json(d / "proto_batch2x1_metrics.json")
    repl2 = _json(d / "proto_repl2_metrics.json")
    recipe_s, side_s = _get(recipe, "train_s"), _get(side, "train_seconds")
    gpu = args.gpu
    if gpu is None:
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            gpu = None
    result = {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "total_s_1gpu": _total(m1), "total_s_2gpu": _total(m2),
        "gt_s_1gpu": _get(gt1, "gt_seconds"), "gt_s_2gpu": _get(gt2, "gt_seconds"),
        "train_s_1gpu": _get(m1, "train_seconds"), "train_s_2gpu": _get(m2, "train_seconds"),
        "step_ms_1gpu": _get(step, "step_ms_median"), "bare_raster_ms_1gpu": _get(step, "bare_raster_ms"),
        "iterations_to_target": _get(m1, "target_reached_at"),
        "psnr_1gpu": _get(m1, "psnr"), "psnr_2gpu": _get(m2, "psnr"),
        "ssim_1gpu": _get(m1, "ssim"), "ssim_2gpu": _get(m2, "ssim"),
        "recipe_train_s_1024": _get(recipe, "train_s"), "ours_train_s_1024": _get(m1, "train_seconds"),
        "recipe_iterations_to_target": _get(recipe, "target_reached_at"),
        "gt_grays_per_s_1gpu": _get(gt1, "grays_per_s"),
        "iterations_to_target_2gpu": _get(m2, "target_reached_at"),
        "iterations_to_target_constant_colors": _get(const1, "target_reached_at"),
        "train_s_1gpu_constant_colors": _get(const1, "train_seconds"),
        **{f"{k}_{n}gpu": _get(m, k) for k in ("ply_psnr", "ply_ssim", "psnr_foreground", "psnr_white")
           for n, m in ((1, m1), (2, m2))},
        "seeds_18m_s_1gpu": _get(seeds, "seeds_s"), "seeds_18m_fill_s_1gpu": _get(seeds, "fill_s"),
        "ours_train_s_1024_side_by_side": side_s,
        "ours_over_recipe": round(side_s / recipe_s, 3) if side_s and recipe_s else None,
        "train_s_2gpu_batch2": _get(batch2, "train_seconds"), "total_s_2gpu_batch2": _total(batch2),
        "iterations_to_target_2gpu_batch2": _get(batch2, "target_reached_at"),
        "train_s_1gpu_batch2": _get(batch2x1, "train_seconds"), "total_s_1gpu_batch2": _total(batch2x1),
        "iterations_to_target_1gpu_batch2": _get(batch2x1, "target_reached_at"),
        "train_speedup_batch2": (round(batch2x1["train_seconds"] / batch2["train_seconds"], 3)
                                 if batch2 and batch2x1 else None),
        "ours_batch2_over_recipe": (round(batch2x1["train_seconds"] / recipe_s, 3)
                                    if batch2x1 and recipe_s else None),
        **{f"evaluation_s_{name}": _get(m, "evaluation_seconds")
           for name, m in (("1gpu", m1), ("2gpu", m2), ("1gpu_batch2", batch2x1), ("2gpu_batch2", batch2))},
        **{f"psnr_{name}": _get(m, "psnr") for name, m in (("1gpu_batch2", batch2x1), ("2gpu_batch2", batch2))},
        **{f"ssim_{name}": _get(m, "ssim") for name, m in (("1gpu_batch2", batch2x1), ("2gpu_batch2", batch2))},
        "recipe_iterations": _get(recipe, "iterations"),
        "train_s_2gpu_replicated": _get(repl2, "train_seconds"), "total_s_2gpu_replicated": _total(repl2),
        "iterations_to_target_2gpu_replicated": _get(repl2, "target_reached_at"),
        "train_speedup_replicated": (round(batch2x1["train_seconds"] / repl2["train_seconds"], 3)
                                     if repl2 and batch2x1 else None),
    }
    if (d / "sources.json").exists():
        result["sources"] = json.loads((d / "sources.json").read_text())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
