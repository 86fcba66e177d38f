"""Is the lit model held back by its one normal? Shade each Gaussian with the field's normal at its centre.

The ground truth shades a hit with the ray caster's normal (the central difference of the trilinear field
over one sample each way), which on a CT volume's voxel-scale detail differs from the surface's own
orientation (the marching-cubes mesh's normals: 6 degrees for the bonsai's median vertex, 40 at the 90th
percentile). The lit model's one normal is its disc's axis: geometry and shading share it. This benchmark
trains variants of ``bench_fidelity.py`` with the lit colours shaded instead by the field's normal at each
Gaussian's centre (``BlockSamples.normals``, differentiable in the centre; the disc's rotation then shapes the
splat only), beside the same variants as built, and prints ``bench_fidelity``'s rows (``shading``: ``disc`` or
``field``).

    python benchmarks/experiments/bench_field_normals.py --data bonsai_256x256x256_uint8.raw --iso 40 --resolution 1024 \\
        --variant "base=" --variant "2M=seeds.budget=2000000,seeds.density=4" --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import insitu.training.appearance as appearance  # noqa: E402
from insitu.parallel.comm import init_comm, shutdown  # noqa: E402
from insitu.surface.seeds import normal_to_quat_torch  # noqa: E402
from insitu.volume import unit_field, whole_block  # noqa: E402

from bench_fidelity import base_settings, variant_config, variant_row, volume_arguments  # noqa: E402

DISC_SHADING = appearance.lit_colors


def field_shading(samples: appearance.BlockSamples):
    """A ``lit_colors`` that shades each Gaussian with the field's normal at its centre, not its disc's: the
    package's shading of a disc turned to that normal (the splat's own rotation is left to the rasterizer)."""
    def lit_colors(means, quats, base, campos, light=appearance.HEADLIGHT):
        return DISC_SHADING(means, normal_to_quat_torch(samples.normals(means)), base, campos, light)
    return lit_colors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    volume_arguments(ap)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=KEY=VALUE,KEY=VALUE")
    ap.add_argument("--shadings", nargs="+", default=["disc", "field"], choices=["disc", "field"])
    ap.add_argument("--json")
    args = ap.parse_args()
    volume, base = base_settings(args)
    comm = init_comm(device=args.device)
    block = whole_block(volume)
    unit, _ = unit_field(block.data, base["input.iso"][0])
    samples = appearance.BlockSamples(torch.from_numpy(np.ascontiguousarray(unit)).to(comm.device),
                                      origin=block.origin, spacing=block.spacing, start=block.start)
    rows = []
    try:
        for spec in args.variant:
            name, settings, cfg = variant_config(spec, base)
            for shading in args.shadings:
                appearance.lit_colors = DISC_SHADING if shading == "disc" else field_shading(samples)
                row = variant_row(block, cfg, comm, name, settings, shading=shading)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        appearance.lit_colors = DISC_SHADING
        if args.json:
            Path(args.json).write_text(json.dumps({"data": Path(args.data).name, "iso": args.iso,
                                                   "resolution": args.resolution, "base": base,
                                                   "variants": rows}, indent=1))
        shutdown(comm)


if __name__ == "__main__":
    main()
