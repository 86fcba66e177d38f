"""The training loss on P ranks vs one rank: the ranks' band losses sum to the image loss, and
the gradients are the one-rank gradients, for any P and any band heights.

Run as ``mpiexec -n P python dist_loss.py``. Two parts (the second for P <= 4):

exchange: random images (float32) of several sizes, split into the ranks' row bands
          (:func:`insitu.render.compositing.band_rows`: bands under 5 rows, a last band of 3 rows,
          an empty band: 11 rows on 5 ranks, images under 11 rows or columns); each rank computes ``band_loss`` on
          its band, with the L1 pixel term and (four sizes) the squared error, whose scale (the
          mean |e| of a random foreground) sums over the ranks. The sum of the losses and the gradient of the sum with respect to every
          pixel must equal ``band_loss`` of the whole image on one rank within 1e-5.
render:   one sphere of Gaussians per block of an uneven split along x (cells cut at 10 and 38
          on 3 ranks, at 38 on 2; an even split would cut at 16 and 32, or 24), the blocks'
          order from ``scene.view_order`` (the validated decomposition's real edges). View 0's
          camera sits at x = 32.2 (block 1 of the real split, block 2 of an even one) and looks
          through block 1's sphere at block 2's. The gathered images must equal the one-rank
          render (1e-10, float64), and the order an even split would give must not (so the test
          can fail); the sum of the losses and every Gaussian's gradients (random background per
          view) must equal the one-rank values within 1e-5. On 4 ranks (cuts 10, 24, 38) the block
          [10, 24) holds no Gaussian.
Prints ``OK rank r of P`` on success; exits non-zero on any mismatch.
"""
import math
from dataclasses import replace

import numpy as np
import torch
from mpi4py import MPI

from worker_report import fail  # tests/mpi is on sys.path
from insitu.groundtruth.scene import block_decomposition, view_order
from insitu.groundtruth.views import Views, look_at, orbit_views
from insitu.input.decomposition import cut_block
from insitu.parallel.comm import init_comm, shutdown
from insitu.render.compositing import band_rows, gather_bands, visibility_order
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.training.appearance import ColorModel
from insitu.training.bandloss import band_loss
from insitu.training.trainer import colors_from_images, footprint_errors, footprint_sides, render_bands, to_params
from insitu.volume import Block

N = 49                                                   # samples per axis: 48 cells
CUTS = {1: [0, 48], 2: [0, 38, 48], 3: [0, 10, 38, 48], 4: [0, 10, 24, 38, 48]}   # cells along x
SPHERES = [(5.0, 24.0, 24.0), (34.0, 20.0, 24.0), (43.0, 44.0, 24.0)]
RADIUS = 2.0
CAMERA = np.array([32.2, 15.2, 24.0])                    # in block 1 (real), block 2 (even split of 3)
TOL = 1e-5


def exchange(comm, one) -> None:
    P, rank = comm.size, comm.rank
    cases = [(12, 16), (13, 14), (23, 17), (40, 33), (11, 12), (4, 16), (30, 9), (16, 16)]
    for (H, W), pixel in [(case, "l1") for case in cases] + [(case, "l2") for case in cases[:4]]:
        gen = torch.Generator().manual_seed(H * 100 + W)
        pred = torch.rand(2, H, W, 3, generator=gen)
        gt = (pred + 0.3 * torch.rand(2, H, W, 3, generator=gen)).clamp(0, 1)
        whole = pred.clone().requires_grad_()
        fg = torch.rand(2, H, W, 1, generator=gen) > 0.6 if pixel == "l2" else None
        ref = band_loss(whole, gt, ssim_weight=0.2, rows=(0, H), height=H, comm=one, pixel=pixel, foreground=fg)
        ref.backward()
        r0, r1 = band_rows(H, P)[rank]
        mine = pred[:, r0:r1].clone().requires_grad_()
        loss = band_loss(mine, gt[:, r0:r1], ssim_weight=0.2, rows=(r0, r1), height=H, comm=comm, pixel=pixel,
                         foreground=None if fg is None else fg[:, r0:r1])
        if not torch.isfinite(loss):
            fail(f"{H} x {W}: rank {rank} (rows {r0}:{r1}) has a non-finite loss {loss.item()}")
        loss.backward()
        total = comm.mpi.allreduce(loss.item())
        grad = gather_bands(mine.grad, comm)
        err = (grad - whole.grad).abs().max().item()
        scale = whole.grad.abs().max().item()
        if abs(total - ref.item()) > TOL or err > TOL * scale or not scale > 0:
            fail(f"{H} x {W}, {pixel} on {P} ranks (bands {band_rows(H, P)}): loss sum {total:.8f} vs one rank "
                 f"{ref.item():.8f}, gradient max abs diff {err:.3g} (max |grad| {scale:.3g})")
        if rank == 0:
            print(f"exchange {H} x {W}, {pixel}, bands {band_rows(H, P)}: loss {total:.7f} vs {ref.item():.7f}, "
                  f"gradient diff {err / scale:.2g} relative", flush=True)


def spheres_field() -> np.ndarray:
    z, y, x = np.meshgrid(*(np.arange(N, dtype=np.float64),) * 3, indexing="ij")
    field = np.full((N, N, N), np.inf)
    for cx, cy, cz in SPHERES:
        field = np.minimum(field, np.sqrt((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2) - RADIUS)
    return field.astype(np.float32)


def slab_block(field: np.ndarray, cuts: list[int], rank: int) -> Block:
    """Rank ``rank``'s block of an x split at ``cuts`` (cells), one ghost layer where the grid goes on."""
    lo, hi = cuts[rank], cuts[rank + 1]
    s, e = max(lo - 1, 0), min(hi + 1, N - 1)
    return Block(np.ascontiguousarray(field[:, :, s:e + 1]), (s, 0, 0), (N, N, N), (lo, 0, 0), (hi, N - 1, N - 1))


def model(field: np.ndarray):
    g = init_gaussians(extract_seeds(cut_block(field, 0, 1), 0.0), 600, opacity=0.1, sh_degree=1, seed=0)
    gen = torch.Generator().manual_seed(1)
    g.log_scales = g.log_scales + np.log(0.5)            # small footprints: well inside each block
    g.sh0 = g.sh0 + 0.5 * torch.randn(g.sh0.shape, generator=gen)
    g.shN = 0.2 * torch.randn(g.shN.shape, generator=gen)
    return type(g)(**{k: v.to(torch.float64) for k, v in g.tensors().items()})


def views() -> Views:
    v = orbit_views((0, 0, 0), (48, 48, 48), count=3, resolution=40, fov_deg=45.0)
    W = H = 40
    f = 0.5 * W / math.tan(math.radians(30.0))
    K = torch.tensor([[f, 0, W / 2], [0, f, H / 2], [0, 0, 1]], dtype=torch.float64)
    first = torch.as_tensor(look_at(CAMERA, np.array(SPHERES[2])), dtype=torch.float64)
    return Views(torch.cat([first[None], v.viewmats.double()]), torch.cat([K[None], v.Ks.double()]), W, H,
                 torch.zeros(4, dtype=torch.bool))


def render_loss(params, vs, order, comm, gt, bg, colors=ColorModel("sh", 1)):
    """(gathered image, this rank's loss) of all views; gradients land in ``params``."""
    ids = torch.arange(len(vs))
    pred, _ = render_bands(params, vs, ids, order, comm, background=bg, colors=colors, backend="torch")
    r0, r1 = band_rows(vs.height, comm.size)[comm.rank]
    loss = band_loss(pred, gt[:, r0:r1], ssim_weight=0.2, rows=(r0, r1), height=vs.height, comm=comm)
    loss.backward()
    return gather_bands(pred.detach(), comm), loss.item()


def render(comm, one, colors) -> None:
    P, rank = comm.size, comm.rank
    field = spheres_field()
    block = slab_block(field, CUTS[P], rank)
    dec = block_decomposition(comm, block)
    if dec.dims != (P, 1, 1) or list(dec.edges[0]) != CUTS[P]:
        fail(f"decomposition: expected dims ({P}, 1, 1) and x edges {CUTS[P]}, got {dec.dims}, {dec.edges}")
    g = model(field)
    lo, hi = block.box
    m = g.means.numpy()
    mine = np.all((m >= lo) & (m < hi), axis=1)
    reach = 3.33 * torch.exp(g.log_scales).max(dim=1).values.numpy()
    inner = (lo > 0)[None] & (np.abs(m - lo) <= reach[:, None])
    outer = (hi < N - 1)[None] & (np.abs(hi - m) <= reach[:, None])
    if np.any((inner | outer)[mine]):
        fail("a Gaussian's footprint crosses a cut plane")
    vs = views()
    gen = torch.Generator().manual_seed(5)
    gt = torch.rand(len(vs), vs.height, vs.width, 3, generator=gen, dtype=torch.float64)
    bg = torch.rand(len(vs), 3, generator=gen, dtype=torch.float64)
    if colors.kind == "lit":                 # base colours and rotations of the lit model: K = 1
        g = replace(g, shN=g.shN[:, :0])
    params = to_params(g.select(torch.from_numpy(mine)))
    order = view_order(vs, block, dec)
    images, loss = render_loss(params, vs, order, comm, gt, bg, colors)
    total = comm.mpi.allreduce(loss)
    grads = {k: p.grad.numpy() if p.grad is not None else np.zeros(p.shape) for k, p in params.items()}
    gathered = comm.mpi.gather((np.flatnonzero(mine), grads), root=0)
    even = visibility_order(vs.positions, dec.dims, torch.zeros(3), torch.full((3,), 48.0),
                            torch.as_tensor(dec.coords))
    wrong, _ = render_loss(to_params(g.select(torch.from_numpy(mine))), vs, even, comm, gt, bg, colors)
    if rank == 0:
        whole = slab_block(field, CUTS[1], 0)
        ref_params = to_params(g)
        ref, ref_loss = render_loss(ref_params, vs, view_order(vs, whole, block_decomposition(one, whole)), one,
                                    gt, bg, colors)
        err = (images - ref).abs().max().item()
        if err > 1e-10:
            fail(f"images differ from the one-rank render: max abs diff {err:.3g}")
        miss = (wrong[0] - ref[0]).abs().max().item()
        if P in (2, 3) and miss < 1e-3:      # 4 ranks: even cut at 36, camera in block 2 either way
            fail(f"view 0 is not in the window an even split orders wrongly (diff {miss:.3g}): the test proves nothing")
        if abs(total - ref_loss) > TOL:
            fail(f"sum of the ranks' losses {total:.9f} vs one rank {ref_loss:.9f}")
        worst = 0.0
        for name, p in ref_params.items():
            full = np.zeros(p.shape)
            for idx, gr in gathered:
                full[idx] = gr[name]
            want = p.grad.numpy()
            scale = np.abs(want).max()
            rel = np.abs(full - want).max() / max(scale, 1e-300)
            if rel > TOL or not scale > 0:
                fail(f"gradient of {name}: relative error {rel:.3g} (max |grad| {scale:.3g})")
            worst = max(worst, rel)
        print(f"render ({colors.kind}): images max abs diff {err:.3g} (even-split order: {miss:.3g}); loss {total:.9f} vs "
              f"{ref_loss:.9f}; gradients max relative error {worst:.3g}; Gaussians per rank "
              f"{[len(i) for i, _ in gathered]}", flush=True)
    if colors.kind == "sh":
        colours(comm, one, g, mine, vs, order, block)
        footprints(comm, one, g, mine, vs, order)
        sides(comm, one, g, mine, vs, order)


def sides(comm, one, g, mine, vs, order) -> None:
    """``footprint_sides`` (model.ply's fit) on P ranks equals the one-rank sums; some Gaussians are
    seen from both sides, the front's share is in [0, 1]."""
    ids = torch.arange(len(vs))
    got = footprint_sides(to_params(g.select(torch.from_numpy(mine))), vs, ids, order, comm,
                          rows=band_rows(vs.height, comm.size)[comm.rank], backend="torch")
    gathered = comm.mpi.gather((np.flatnonzero(mine), got.numpy()), root=0)
    if comm.rank != 0:
        return
    whole = slab_block(spheres_field(), CUTS[1], 0)
    ref = footprint_sides(to_params(g), vs, ids, view_order(vs, whole, block_decomposition(one, whole)), one,
                          rows=(0, vs.height), backend="torch").numpy()
    full = np.zeros_like(ref)
    for idx, part in gathered:
        full[idx] = part
    err = np.abs(full - ref).max() / max(np.abs(ref).max(), 1e-300)
    seen = ref[:, 1] > 0
    share = ref[seen, 0] / ref[seen, 1]
    if err > TOL or seen.sum() < 0.5 * len(ref) or not (share.min() >= -1e-12 and share.max() <= 1 + 1e-12):
        fail(f"footprint sides: max relative diff to one rank {err:.3g}, {seen.sum()} seen, shares "
             f"{share.min():.3g}..{share.max():.3g}")
    print(f"footprint sides: max relative diff {err:.3g} to one rank, front share {share.mean():.3f} on average",
          flush=True)


def footprints(comm, one, g, mine, vs, order) -> None:
    """``footprint_errors`` on P ranks (each its band of a random error map) equals the one-rank sums."""
    gen = torch.Generator().manual_seed(11)
    error = torch.rand(len(vs), vs.height, vs.width, 1, generator=gen, dtype=torch.float64)
    ids = torch.arange(len(vs))
    r0, r1 = band_rows(vs.height, comm.size)[comm.rank]
    got = footprint_errors(to_params(g.select(torch.from_numpy(mine))), vs, ids, order, comm,
                           error[:, r0:r1].contiguous(), backend="torch")
    gathered = comm.mpi.gather((np.flatnonzero(mine), got.numpy()), root=0)
    if comm.rank != 0:
        return
    whole = slab_block(spheres_field(), CUTS[1], 0)
    ref = footprint_errors(to_params(g), vs, ids, view_order(vs, whole, block_decomposition(one, whole)), one,
                           error, backend="torch").numpy()
    full = np.zeros_like(ref)
    for idx, part in gathered:
        full[idx] = part
    err = np.abs(full - ref).max() / max(np.abs(ref).max(), 1e-300)
    if err > TOL or not (ref[:, 1] > 0).sum() > 0.5 * len(ref):
        fail(f"footprint errors: max relative diff to one rank {err:.3g}, {(ref[:, 1] > 0).sum()} seen")
    print(f"footprints: max relative diff {err:.3g} to one rank", flush=True)


def colours(comm, one, g, mine, vs, order, block) -> None:
    """``colors_from_images`` on P ranks (each its band of random premultiplied RGBA images) equals
    the one-rank fit; the Gaussians outside ``only`` keep their colour; the fit is not the input."""
    gen = torch.Generator().manual_seed(7)
    a = (torch.rand(len(vs), vs.height, vs.width, 1, generator=gen, dtype=torch.float64) > 0.2).double()
    gt = torch.cat([a * torch.rand(len(vs), vs.height, vs.width, 3, generator=gen, dtype=torch.float64), a], -1)
    only = torch.arange(len(g)) % 3 != 0
    ids = torch.tensor([0, 2, 3])
    r0, r1 = band_rows(vs.height, comm.size)[comm.rank]
    sel = torch.from_numpy(mine)
    fit = colors_from_images(g.select(sel), vs, ids, order, gt[:, r0:r1].contiguous(), comm, backend="torch",
                             batch=2, only=only[sel])
    gathered = comm.mpi.gather((np.flatnonzero(mine), fit.sh0.numpy()), root=0)
    if comm.rank != 0:
        return
    whole = slab_block(spheres_field(), CUTS[1], 0)
    ref = colors_from_images(g, vs, ids, view_order(vs, whole, block_decomposition(one, whole)), gt, one,
                             backend="torch", batch=1, only=only).sh0.numpy()
    full = np.zeros_like(ref)
    for idx, sh0 in gathered:
        full[idx] = sh0
    err = np.abs(full - ref).max()
    changed = np.abs(ref - g.sh0.numpy()).max(axis=(1, 2)) > 1e-6
    if err > TOL or changed[~only.numpy()].any() or changed.sum() < 0.5 * only.sum().item():
        fail(f"colours from images: max abs diff to one rank {err:.3g}, {changed.sum()} changed "
             f"({changed[~only.numpy()].sum()} outside only)")
    print(f"colours: max abs diff {err:.3g} to one rank, {changed.sum()} of {len(g)} set", flush=True)


def main():
    comm = init_comm(device="cpu", timeout_s=60)
    one = init_comm(MPI.COMM_SELF, device="cpu")
    exchange(comm, one)
    if comm.size in CUTS:
        for colors in (ColorModel("sh", 1), ColorModel("lit")):
            render(comm, one, colors)
    comm.mpi.Barrier()
    shutdown(one)
    shutdown(comm)
    print(f"OK rank {comm.rank} of {comm.size}", flush=True)


if __name__ == "__main__":
    main()
