"""The training render path on P ranks vs one rank, same Gaussians, float64.

Run as ``mpiexec -n P python dist_render.py``. The field holds one small sphere in the
middle of every rank's block; the Gaussians are seeded from it once (the same on every
rank), and each rank keeps those whose means lie in its owned box. Every rank renders its
shard through ``insitu.training.trainer.render_bands`` (torch rasterizer + sort-last compositing)
and back-propagates a weighted sum over its band; rank 0 gathers the full images and every
Gaussian's gradients and compares them with ``render_bands`` of all Gaussians on a
one-rank communicator (``MPI.COMM_SELF``). No Gaussian footprint crosses a cut plane, so
the per-block compositing equals the per-Gaussian one up to rounding.
Prints ``OK rank r of P`` on success; exits non-zero on any mismatch.
"""

import numpy as np
import torch
from mpi4py import MPI

from worker_report import fail  # tests/mpi is on sys.path
from insitu.groundtruth.scene import block_decomposition, view_order
from insitu.groundtruth.views import Views, orbit_views
from insitu.input.decomposition import block_extent, cut_block, split_dims
from insitu.parallel.comm import init_comm, shutdown
from insitu.render.compositing import band_rows, gather_bands
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.appearance import ColorModel
from insitu.training.trainer import render_bands, to_params

N = 33                       # samples per axis
RADIUS = 3.0                 # sphere radius in cells


def spheres_field(size: int) -> np.ndarray:
    """[N, N, N] distance to the nearest block centre minus RADIUS (one sphere per block of a ``size`` split)."""
    shape = (N, N, N)
    dims = split_dims(shape, size)
    z, y, x = np.meshgrid(*(np.arange(N, dtype=np.float64),) * 3, indexing="ij")
    field = np.full(shape, np.inf)
    for r in range(size):
        ext = block_extent(r, dims, shape)
        c = 0.5 * (np.asarray(ext.owned_lo) + np.asarray(ext.owned_hi))
        field = np.minimum(field, np.sqrt((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) - RADIUS)
    return field.astype(np.float32)


def all_gaussians(field: np.ndarray):
    """The model of every sphere, float64, with random colours and view-dependent SH (degree 1)."""
    whole = cut_block(field, 0, 1)
    seeds = extract_seeds(whole, 0.0)
    g = init_gaussians(seeds, 300, opacity=0.3, sh_degree=1, seed=0)
    gen = torch.Generator().manual_seed(1)
    g.log_scales = g.log_scales + np.log(0.5)             # small footprints: well inside each block
    g.sh0 = g.sh0 + 0.5 * torch.randn(g.sh0.shape, generator=gen)
    g.shN = 0.2 * torch.randn(g.shN.shape, generator=gen)
    g.opacity_logits = g.opacity_logits + 0.3 * torch.randn(g.opacity_logits.shape, generator=gen)
    return g


def as_double(g):
    return type(g)(**{k: v.to(torch.float64) for k, v in g.tensors().items()})


def render(params, views, block, comm, weight):
    """Full images (gathered) and the gradients of sum(weight * image) w.r.t. this rank's params."""
    order = view_order(views, block, block_decomposition(comm, block))
    ids = torch.arange(len(views))
    bg = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    pred, _ = render_bands(params, views, ids, order, comm, background=bg, colors=ColorModel("sh", 1), backend="torch")
    a, b = band_rows(views.height, comm.size)[comm.rank]
    (pred * weight[:, a:b]).sum().backward()
    return gather_bands(pred.detach(), comm)


def main():
    comm = init_comm(device="cpu", timeout_s=60)
    P, rank = comm.size, comm.rank
    field = spheres_field(P)
    block = cut_block(field, rank, P)
    model = as_double(all_gaussians(field))
    lo, hi = block.box
    m = model.means.numpy()
    mine = np.all((m >= lo) & (m < hi), axis=1)
    owners = comm.allgather_object(mine)
    if not np.all(np.sum(owners, axis=0) == 1):
        fail("every Gaussian must lie in exactly one block")
    if P > 1 and not all(o.any() for o in owners):
        fail("every block must hold Gaussians")
    # margin of every owned Gaussian's 3.33-sigma extent to the cut planes of its block
    reach = 3.33 * torch.exp(model.log_scales).max(dim=1).values.numpy()
    inner = lo > 0
    outer = hi < np.asarray(block.global_box[1])
    gap = np.minimum(np.where(inner, m - lo, np.inf), np.where(outer, hi - m, np.inf)).min(axis=1)
    if np.any(gap[mine] <= reach[mine]):
        fail("a Gaussian's footprint crosses a cut plane")

    v = orbit_views(*block.global_box, count=6, resolution=40, fov_deg=45.0)
    views = Views(v.viewmats.double(), v.Ks.double(), v.width, v.height, v.test)
    weight = torch.randn(len(views), views.height, views.width, 3, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)

    params = to_params(model.select(torch.from_numpy(mine)))
    images = render(params, views, block, comm, weight)
    grads = {k: p.grad.numpy() if p.grad is not None else np.zeros(p.shape) for k, p in params.items()}
    gathered = comm.mpi.gather((np.flatnonzero(mine), grads), root=0)

    if rank == 0:
        one = init_comm(MPI.COMM_SELF, device="cpu")
        whole = cut_block(field, 0, 1)
        ref_params = to_params(model)
        ref = render(ref_params, views, whole, one, weight)
        shutdown(one)
        err = (images - ref).abs().max().item()
        if images.shape != ref.shape or err > 1e-10:
            fail(f"images differ from the one-rank render: max abs diff {err:.3g}")
        covered = ((ref - torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)).abs().sum(-1) > 1e-3).float().mean()
        if covered < 0.02:
            fail(f"the spheres cover only {covered:.3%} of the pixels: nothing to compare")
        worst = 0.0
        for name, p in ref_params.items():
            full = np.zeros(p.shape)
            for idx, g in gathered:
                full[idx] = g[name]
            want = p.grad.numpy()
            scale = max(np.abs(want).max(), 1e-12)
            rel = np.abs(full - want).max() / scale
            if rel > 1e-9 or not np.abs(want).max() > 0:
                fail(f"gradient of {name}: relative error {rel:.3g} (max |grad| {scale:.3g})")
            worst = max(worst, rel)
        print(f"images max abs diff {err:.3g}; gradients max relative error {worst:.3g}; {len(model)} Gaussians, "
              f"per rank {[int(o.sum()) for o in owners]}", flush=True)
    comm.mpi.Barrier()
    shutdown(comm)
    print(f"OK rank {rank} of {P}", flush=True)


if __name__ == "__main__":
    main()
