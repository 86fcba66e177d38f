"""The image loss of sort-last training, split over the ranks' row bands.

Each rank's loss is its term of the whole image's loss ``(1 - w) E + w (1 - SSIM)``: the pixel
term E (L1, or the squared error) summed over its rows and divided by the whole image's values;
SSIM (:func:`insitu.training.ssim.ssim_map`, valid 11 x 11 windows) over the windows centred on its rows,
divided by the whole image's window count.
The windows reach ``HALF`` = 5 rows into the neighbouring bands: every band sends its first and
last 5 rows to the ranks whose halo reaches into it, and to no other (one ``all_to_all_single``
with empty chunks for the others, :class:`_HaloExchange`), and backward sends their gradients
back to their owners. So the ranks' losses sum to the one-rank loss and the gradients are the
one-rank gradients (:func:`band_loss`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from insitu.render.compositing import band_rows
from insitu.training.ssim import HALF, KERNEL, ssim_l1_loss, ssim_map


def _halo_partners(bands: list[tuple[int, int]], rank: int, height: int) -> tuple[list[bool], list[bool]]:
    """(send_to, recv_from) [P] flags: the ranks that need rows of this rank's band within their
    ``HALF``-row halo, and the ranks whose bands hold rows of this rank's halo (never itself)."""

    def halo(q):
        r0, r1 = bands[q]
        return [(max(r0 - HALF, 0), r0), (r1, min(r1 + HALF, height))]

    def meets(q, spans):
        a, b = bands[q]
        return a < b and any(lo < b and a < hi for lo, hi in spans)

    P = len(bands)
    return ([q != rank and meets(rank, halo(q)) for q in range(P)],
            [q != rank and meets(q, halo(rank)) for q in range(P)])


class _HaloExchange(torch.autograd.Function):
    """This rank's edge slab to the ranks that need it, theirs from the ranks it needs: one
    ``all_to_all`` with empty chunks for every other rank (traffic per rank does not grow with P).
    Backward sends the received slabs' gradients back to their owners and sums them."""

    @staticmethod
    def forward(ctx, slab, comm, send_to, recv_from):
        n = slab.numel()
        ctx.comm, ctx.shape = comm, slab.shape
        ctx.send, ctx.recv = [n if f else 0 for f in send_to], [n if f else 0 for f in recv_from]
        out = slab.new_empty(sum(ctx.recv))
        comm.traffic.add(sum(ctx.recv) * slab.element_size())      # what this rank receives
        dist.all_to_all_single(out, slab.reshape(-1).repeat(sum(send_to)), ctx.recv, ctx.send, group=comm.group)
        return out.view(-1, *slab.shape)

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send))
        ctx.comm.traffic.add(sum(ctx.send) * grad.element_size())
        dist.all_to_all_single(back, grad.contiguous().view(-1), ctx.send, ctx.recv, group=ctx.comm.group)
        return back.view(-1, *ctx.shape).sum(0), None, None, None


def _with_halo(x: Tensor, rows: tuple[int, int], height: int, comm) -> tuple[Tensor, Tensor]:
    """This rank's band with up to ``HALF`` rows of the neighbouring bands above and below.

    x: [B, h, W, C] rows ``rows`` of images of ``height`` rows (:func:`band_rows` of ``comm.size``).
    Returns ``(ext [B, h', W, C]`` rows ``max(r0 - 5, 0) : min(r1 + 5, height)``, ``received``): the
    rows of the other bands come from the first and last 5 rows of the bands they lie in, sent by
    their owners to the ranks whose halo they reach and to no other (a band shorter than 5 rows
    lends all it has; the rows 5 away always lie in such an edge slab), and backward returns
    their gradients to their owners.
    """
    bands = band_rows(height, comm.size)
    r0, r1 = rows
    if bands[comm.rank] != (r0, r1) or x.shape[1] != r1 - r0:
        raise ValueError(f"rows: expected this rank's band {bands[comm.rank]} of {height} rows with as many rows "
                         f"in x, got {rows} and {x.shape[1]} rows")
    h = x.shape[1]
    top = torch.nn.functional.pad(x[:, :HALF], (0, 0, 0, 0, 0, HALF - min(h, HALF)))
    bottom = torch.nn.functional.pad(x[:, max(h - HALF, 0):], (0, 0, 0, 0, HALF - min(h, HALF), 0))
    send_to, recv_from = _halo_partners(bands, comm.rank, height)
    received = _HaloExchange.apply(torch.cat([top, bottom], dim=1).contiguous(), comm, send_to, recv_from)
    slot = {q: i for i, q in enumerate(q for q, f in enumerate(recv_from) if f)}   # [n_recv, B, 2 * HALF, W, C]

    def lent(ys) -> list[Tensor]:
        """Image rows ``ys`` (outside this band) as slices of the received slabs, one per run of rows
        of one owner (plain slices: no index tensor to copy to the device)."""
        runs = []
        for y in ys:
            q = next(i for i, (a, b) in enumerate(bands) if a <= y < b)
            a, b = bands[q]
            i = HALF + y - (b - HALF) if y < r0 else y - a      # its bottom slab above us, top slab below
            if runs and runs[-1][0] == q and runs[-1][2] == i:
                runs[-1][2] += 1
            else:
                runs.append([q, i, i + 1])
        return [received[slot[q], :, i:j] for q, i, j in runs]

    ext = torch.cat(lent(range(max(r0 - HALF, 0), r0)) + [x] + lent(range(r1, min(r1 + HALF, height))), dim=1)
    return ext, received


PIXEL_TERMS = ("l1", "l2")


def _pixel_term(pred: Tensor, gt: Tensor, pixel: str, count: int, comm, foreground: Tensor | None) -> Tensor:
    """This rank's share of the pixel term over the whole images of ``count`` values (see :func:`band_loss`)."""
    diff = pred - gt
    if pixel == "l1":
        return diff.abs().sum() / count
    with torch.no_grad():                           # mean |e| of the whole images' foreground, on every rank
        err = diff.abs()
        total = err.sum()
        if foreground is None:                      # a tensor made on the device: no copy for the host to wait on
            fg_sum, n_fg = total, err.new_full((), float(err.numel()))
        else:
            fg_sum, n_fg = (err * foreground).sum(), foreground.sum().to(err.dtype) * err.shape[-1]
        sums = torch.stack([fg_sum, n_fg, total]).double()
        if comm is not None and comm.size > 1:
            comm.all_reduce_sum(sums)
        mean_abs = torch.where(sums[1] > 0, sums[0] / sums[1].clamp(min=1), sums[2] / count)
        scale = (2.0 * mean_abs).clamp(min=1e-12).to(diff.dtype)
    return diff.square().sum() / count / scale


def band_loss(pred: Tensor, gt: Tensor, *, ssim_weight: float, rows: tuple[int, int], height: int,
              comm=None, pixel: str = "l1", foreground: Tensor | None = None, scale_comm=None) -> Tensor:
    """This rank's term of the image loss ``(1 - w) E + w (1 - SSIM)``; the ranks' terms sum to it exactly.

    pred, gt: [B, h, W, 3] rows ``rows = (r0, r1)`` of images of ``height`` rows, this rank's band
              (:func:`insitu.render.compositing.band_rows`); ``comm`` None or one rank: the whole image.
    pixel: the pixel term ``E``. ``"l1"``: the mean of ``|e|``, ``e = pred - gt``, over all pixels and
           channels of the whole images. ``"l2"``: the mean of ``e**2`` over them, divided by twice the
           mean of ``|e|`` over the whole images' foreground (a number, no gradient; summed over the
           ranks; all pixels where no rank has foreground): the squared error that PSNR measures, with a
           gradient of ``e / mean|e|`` per value where L1's is ``sign(e)``, so of L1's size on the
           foreground whatever the error's size and however much background the views frame, and the
           SSIM weight and densification's gradient threshold mean what they mean with L1.
    foreground: [B, h, W, 1] this band's foreground pixels (bool or 0/1; None: every pixel), for "l2".
    scale_comm: the ranks whose images share that mean (a collective over them; default ``comm``, the
           ranks of the bands; replicas of the whole model pass theirs, so that each takes the step of
           one rank with all their views).
    SSIM is the mean of :func:`insitu.training.ssim.ssim_map` over the whole images' valid windows
    (``(H - 10) x (W - 10)`` per view). A rank scores the windows centred on its own rows, with the 5
    rows above and below taken from the neighbouring bands (a collective: every rank calls it, empty
    bands too, which give 0). Images under 11 x 11 pixels have no SSIM window: the loss is ``E``
    alone, on any number of ranks.
    """
    if pred.shape != gt.shape or pred.ndim != 4 or pred.shape[-1] != 3:
        raise ValueError(f"pred, gt: expected the same shape [B, h, W, 3], got {tuple(pred.shape)}, {tuple(gt.shape)}")
    if pixel not in PIXEL_TERMS:
        raise ValueError(f"pixel: expected one of {PIXEL_TERMS}, got {pixel!r}")
    if foreground is not None and foreground.shape != (*pred.shape[:-1], 1):
        raise ValueError(f"foreground: expected [B, h, W, 1] = {(*pred.shape[:-1], 1)}, got {tuple(foreground.shape)}")
    B, h, W, _ = pred.shape
    if h != rows[1] - rows[0]:
        raise ValueError(f"rows: expected {h} rows to match pred, got {rows}")
    size = 1 if comm is None else comm.size
    if size == 1 and rows != (0, height):
        raise ValueError(f"rows: expected the whole image (0, {height}) on one rank, got {rows}")
    with_ssim = ssim_weight > 0 and height >= KERNEL and W >= KERNEL
    count = B * height * W * 3
    scale_comm = scale_comm or comm
    if size == 1 and with_ssim:                     # the whole image: the SSIM kernels' pass (with L1 in it)
        if pixel == "l1":
            return ssim_l1_loss(pred, gt, ssim_weight=ssim_weight)
        return ssim_l1_loss(pred, gt, ssim_weight=1.0) * ssim_weight \
            + (1 - ssim_weight) * _pixel_term(pred, gt, pixel, count, scale_comm, foreground)
    term = _pixel_term(pred, gt, pixel, count, scale_comm, foreground)
    if not with_ssim:
        return term
    ext, received = _with_halo(torch.cat([pred, gt], dim=-1), rows, height, comm)
    x, y = ext[..., :3], ext[..., 3:]
    spare = 0.0 * received.sum()                    # this rank's backward always reaches the exchange
    windows = B * (height - 2 * HALF) * (W - 2 * HALF)
    if x.shape[1] >= KERNEL:                        # the windows centred on this band's rows
        m = ssim_map(x, y)
        dssim = (m.numel() - m.sum()) / windows
    else:
        dssim = pred.new_zeros(())
    return (1 - ssim_weight) * term + ssim_weight * dssim + spare
