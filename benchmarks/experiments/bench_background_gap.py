"""How much a white background lowers PSNR when only the edges differ: two ground truths.

The same views of the same isosurface ray-cast with 2x2 and with 4x4 rays per pixel differ only
where a pixel is partly covered, i.e. at silhouettes. Judged like a trained model
(:meth:`insitu.step.metrics.QualityAccumulator.add_rgba`), their PSNR on black, on white and over the
covered pixels says how much of the gap between ``psnr`` and ``psnr_white`` any model with
imperfect edges shows on this shading: the headlight shading makes silhouettes dark
(``groundtruth.torch_caster.AMBIENT``), so an alpha error there costs little on black and much on white.
Prints one JSON line.

    python benchmarks/experiments/bench_background_gap.py --resolution 256 --views 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from insitu.groundtruth.caster import raycast_views  # noqa: E402
from insitu.groundtruth.views import orbit_views  # noqa: E402
from insitu.step.metrics import QualityAccumulator  # noqa: E402
from insitu.volume import read_raw, whole_block  # noqa: E402

BONSAI = Path(__file__).resolve().parents[3] / "shared" / "data" / "bonsai_256x256x256_uint8.raw"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=BONSAI)
    ap.add_argument("--iso", type=float, default=40.0)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--views", type=int, default=8)
    ap.add_argument("--supersample", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    block = whole_block(read_raw(args.data))
    lo, hi = block.global_box
    R = args.resolution
    views = orbit_views(lo, hi, args.views, R, 40.0, args.views).to(args.device)

    def cast(ss: int) -> torch.Tensor:
        out = torch.zeros(len(views), R, R, 4, device=args.device)
        for ids, rgba, _ in raycast_views(block, views.viewmats, views.Ks, R, R, [args.iso], views_per_call=2,
                                          supersample=ss, device=args.device):
            out[ids] = rgba
        return out

    a, b = (cast(s) for s in args.supersample)
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(a, b, torch.zeros(3, device=args.device))
    q = acc.result()
    print(json.dumps({"data": args.data.name, "iso": args.iso, "resolution": R, "views": args.views,
                      "supersample": args.supersample, "psnr_black": round(q.psnr, 2),
                      "psnr_white": round(q.psnr_white, 2), "psnr_foreground": round(q.psnr_foreground, 2),
                      "white_minus_black_db": round(q.psnr_white - q.psnr, 2)}), flush=True)


if __name__ == "__main__":
    main()
