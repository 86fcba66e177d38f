"""Ground truth on P ranks vs one rank: ``insitu.groundtruth.scene.make_scene``.

Run as ``mpiexec -n P python dist_scene.py`` (supersample 1, then 2). The surface (an ellipsoid
through the middle of the domain, coloured by a second field) crosses every cut plane.
Every rank ray-casts its block and keeps its band of every view; rank 0 gathers the
bands and compares them with ``make_scene`` of the whole field on a one-rank
communicator (``MPI.COMM_SELF``). Prints the differences and ``OK rank r of P``; exits
non-zero when, with one ray per pixel, any value differs by more than 1e-3 (the bands
are float16), or, with 2 x 2 rays, the mean absolute difference is >= 1e-3 or more than
2% of the pixels differ by more than 1e-3 (a pixel whose sub-rays hit the surface in
two blocks is composited as two partial layers).
"""


import numpy as np
import torch
from mpi4py import MPI

from worker_report import fail  # tests/mpi is on sys.path
from insitu.config import Config
from insitu.groundtruth.scene import make_scene
from insitu.input.decomposition import cut_block
from insitu.parallel.comm import init_comm, shutdown
from insitu.render.compositing import gather_bands


def fields():
    """[nz, ny, nx] ellipsoid field (surface at 0) and a colour field, 29 x 30 x 31 samples."""
    z, y, x = np.meshgrid(np.arange(29.0), np.arange(30.0), np.arange(31.0), indexing="ij")
    u = np.sqrt(((x - 15.3) / 11) ** 2 + ((y - 14.6) / 9) ** 2 + ((z - 14.2) / 8) ** 2) - 1.0
    u += 0.05 * np.sin(0.7 * x) * np.cos(0.5 * y)
    return u.astype(np.float32), (x + 0.5 * z).astype(np.float32)


def config(supersample: int) -> Config:
    cfg = Config()
    cfg.input.iso = [0.0]
    cfg.input.color_var = "c"
    cfg.views.count = 6
    cfg.views.resolution = 48
    cfg.views.supersample = supersample
    cfg.views.background = [0.2, 0.1, 0.0]
    # the orbit alone: a ray exactly through a line where four blocks meet is clipped into both boxes or
    # neither, which the random close-up and off-orbit cameras hit now and then (1 pixel in 60000 on 4 ranks)
    cfg.views.closeups, cfg.views.held_out = 0, 0
    return cfg


def compare(images, ref, background, supersample: int, P: int) -> bool:
    """Print the differences; True when they are within the limits of the module docstring."""
    diff = (images - ref).abs()
    hit = ((ref - background).abs().sum(-1) > 1e-2).float().mean().item()
    pixels = (diff.amax(-1) <= 1e-3).float().mean().item()
    print(f"supersample {supersample}, {P} ranks: mean abs diff {diff.mean():.3g}, max {diff.max():.3g}, "
          f"{pixels:.3%} of pixels within 1e-3, surface on {hit:.1%} of pixels", flush=True)
    if supersample == 1:                # one ray per pixel: only the float16 rounding of the bands
        return bool(diff.max() <= 1e-3 and hit > 0.05)
    return bool(diff.mean() < 1e-3 and pixels >= 0.98 and hit > 0.05)


def main():
    comm = init_comm(device="cpu", timeout_s=60)
    P, rank = comm.size, comm.rank
    u, c = fields()
    one = init_comm(MPI.COMM_SELF, device="cpu") if rank == 0 else None
    for supersample in (1, 2):
        cfg = config(supersample)
        scene = make_scene(cut_block(u, rank, P, fields={"c": c}), cfg, comm)
        everything = torch.arange(len(scene.views))
        images = gather_bands(scene.gt_on(everything, scene.background), comm)     # premultiplied RGBA, on it
        if rank == 0:
            ref = make_scene(cut_block(u, 0, 1, fields={"c": c}), cfg, one)
            if images.shape[:-1] != ref.gt.shape[:-1] or ref.gt.shape[-1] != 4:
                fail(f"shapes {tuple(images.shape)} vs {tuple(ref.gt.shape)}")
            if not compare(images, ref.gt_on(everything, ref.background), scene.background, supersample, P):
                fail("distributed ground truth differs from the one-rank ground truth")
    if one is not None:
        shutdown(one)
    comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {rank} of {P}", flush=True)


if __name__ == "__main__":
    main()
