"""Differentiable sort-last compositing of the ranks' images over row bands.

Every rank renders its own shard of Gaussians for a batch of views into premultiplied
colour ``C_r`` and alpha ``A_r``. Blocks of a Cartesian split, sorted by their L1
distance in block-index space from the block holding the camera, are in a valid
front-to-back order (:func:`visibility_order`). Per view and pixel, with the layers
sorted front to back::

    T_r  = prod over layers j in front of r of (1 - A_j)
    RGBA = sum_r T_r * (C_r, A_r)

Images are cut into row bands, one per rank (:func:`band_rows`). Forward: an all-to-all
sends every rank's layer ``(C_r, A_r)`` of band ``q`` to rank ``q``, so each rank holds
all P layers of its own band only, composites them front to back and computes its loss
there. Backward: the band owner has the band gradient ``G`` and every layer of the band,
so it computes each layer's gradient::

    dL/dC_r = T_r * G_rgb
    dL/dA_r = T_r * (G_a - Q_r),   Q_r = sum over r' behind r of p_r' * prod over k strictly
                                         between r and r' of (1 - A_k),   p_r' = <G, (C_r', A_r')>

and a second all-to-all sends layer ``r``'s gradients back to rank ``r``. ``Q_r`` is
accumulated back to front (``Q = p_next + (1 - A_next) * Q``), so nothing is divided by
``1 - A`` (an alpha may be exactly 1). Forward and backward call their collectives
unconditionally on every rank, so all ranks always traverse the same collectives.

Traffic per rank and call, in values (``comm.traffic`` counts the bytes): the P - 1
bands of 4 channels (D + 1 for D channels) sent to (and received from) the other ranks,
``4 (P - 1) * B * h * W`` with ``h = ceil(H / P)``, i.e. about ``4 B H W`` forward and the same
backward, whatever P.
The colour channels may travel in a narrower ``transfer_dtype``; alphas and gradients
travel at the input dtype.

Each rank's loss on its band is a term of the global loss; ranks call ``backward`` on
their own band loss, and the gradients each rank gets for its layer are those of the sum
of all band losses.
"""
from __future__ import annotations

import torch
from torch import Tensor

from insitu.parallel.comm import Comm


def visibility_order(cam_positions: Tensor, dims: tuple[int, int, int], box_lo: Tensor, box_hi: Tensor,
                     rank_coords: Tensor, *, edges: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """Front-to-back order keys of the blocks of a Cartesian split (smaller = nearer).

    cam_positions: [B, 3] camera centres (world x, y, z).
    dims:          (px, py, pz) blocks along each axis.
    box_lo/box_hi: [3] world bounds of the whole grid, split evenly into ``dims`` blocks.
    rank_coords:   [P, 3] block index (x, y, z) of each rank.
    edges:         optional per-axis block boundaries ``(ex [px+1], ey [py+1], ez [pz+1])``
                   in world units, for splits that are not even (overrides box_lo/box_hi).

    Returns [B, P] keys: the L1 distance in block-index space from the block index of the
    camera (not clamped to the grid: a camera outside has indices < 0 or >= dims). Blocks
    with equal keys never overlap along a ray; :func:`composite` breaks ties by rank.
    """
    cam = torch.as_tensor(cam_positions)
    if cam.ndim != 2 or cam.shape[1] != 3:
        raise ValueError(f"cam_positions: expected shape [B, 3], got {tuple(cam.shape)}")
    if len(dims) != 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"dims: expected three block counts >= 1, got {dims}")
    coords = torch.as_tensor(rank_coords, device=cam.device)
    if coords.ndim != 2 or coords.shape[1] != 3:
        raise ValueError(f"rank_coords: expected shape [P, 3], got {tuple(coords.shape)}")
    cam = cam.to(torch.float64)
    if edges is None:
        lo = torch.as_tensor(box_lo, dtype=torch.float64, device=cam.device).reshape(3)
        hi = torch.as_tensor(box_hi, dtype=torch.float64, device=cam.device).reshape(3)
        if torch.any(hi <= lo):
            raise ValueError(f"box_lo/box_hi: expected box_hi > box_lo on every axis, got {lo.tolist()}, {hi.tolist()}")
        d = torch.tensor([float(v) for v in dims], dtype=torch.float64, device=cam.device)
        index = torch.floor((cam - lo) / (hi - lo) * d)
    else:
        cols = []
        for axis, (e, n) in enumerate(zip(edges, dims)):
            e = torch.as_tensor(e, dtype=torch.float64, device=cam.device).reshape(-1)
            if e.numel() != int(n) + 1 or torch.any(e[1:] <= e[:-1]):
                raise ValueError(f"edges[{axis}]: expected {int(n) + 1} increasing boundaries, got {e.tolist()}")
            cols.append(torch.searchsorted(e, cam[:, axis].contiguous(), right=True).to(torch.float64) - 1)
        index = torch.stack(cols, dim=1)
    return (index[:, None, :] - coords[None, :, :].to(torch.float64)).abs().sum(-1)


def band_rows(height: int, size: int) -> list[tuple[int, int]]:
    """Row band ``(start, stop)`` of each rank: ``ceil(height / size)`` rows each, the last
    ones shorter (or empty) where the height is not a multiple of ``size``."""
    if height < 1 or size < 1:
        raise ValueError(f"band_rows: expected height >= 1 and size >= 1, got {height}, {size}")
    h = -(-height // size)
    return [(min(p * h, height), min((p + 1) * h, height)) for p in range(size)]


def front_to_back(order: Tensor) -> Tensor:
    """[B, P] order keys -> [B, P] ranks sorted front to back (ties by rank index)."""
    return torch.sort(order, dim=1, stable=True).indices


def _check(rgb: Tensor, alpha: Tensor, order: Tensor, comm: Comm, transfer_dtype) -> None:
    if rgb.ndim != 4 or rgb.shape[-1] < 1:
        raise ValueError(f"rgb: expected shape [B, H, W, D] (D >= 1 channels), got {tuple(rgb.shape)}")
    if alpha.shape != rgb.shape[:-1] + (1,):
        raise ValueError(f"alpha: expected shape {tuple(rgb.shape[:-1]) + (1,)} to match rgb, "
                         f"got {tuple(alpha.shape)}")
    if not rgb.is_floating_point() or alpha.dtype != rgb.dtype:
        raise ValueError(f"rgb, alpha: expected the same floating dtype, got {rgb.dtype}, {alpha.dtype}")
    if rgb.device != alpha.device:
        raise ValueError(f"rgb, alpha: expected the same device, got {rgb.device}, {alpha.device}")
    if transfer_dtype is not None and not transfer_dtype.is_floating_point:
        raise ValueError(f"transfer_dtype: expected a floating dtype or None, got {transfer_dtype}")
    if order.shape != (rgb.shape[0], comm.size):
        raise ValueError(f"order: expected shape [B, P] = [{rgb.shape[0]}, {comm.size}], got {tuple(order.shape)}")


def _by_depth(stack: Tensor, perm: Tensor) -> Tensor:
    """stack [P, B, ...] by rank, perm [B, P] ranks front to back -> [P, B, ...] by depth."""
    return stack[perm.t(), torch.arange(stack.shape[1], device=stack.device)]


def _forward(rgb: Tensor, alpha: Tensor, perm: Tensor, comm: Comm, transfer_dtype):
    """-> (band [B, hb, W, D + 1], layers [P, B, h, W, D + 1] of this band by depth, T [P, B, h, W, 1])."""
    P, rank = comm.size, comm.rank
    B, H, W, D = rgb.shape
    h = -(-H // P)
    layer = torch.cat([rgb, alpha], dim=-1)                 # [B, H, W, D + 1]
    if h * P != H:
        layer = torch.nn.functional.pad(layer, (0, 0, 0, 0, 0, h * P - H))
    chunks = layer.view(B, P, h, W, D + 1).transpose(0, 1)  # [P, B, h, W, D + 1]: band q for rank q
    if transfer_dtype is not None and transfer_dtype != chunks.dtype:
        colour = comm.all_to_all(chunks[..., :D].to(transfer_dtype)).to(rgb.dtype)
        layers = torch.cat([colour, comm.all_to_all(chunks[..., D:])], dim=-1)
    else:
        layers = comm.all_to_all(chunks)                    # [P, B, h, W, D + 1]: every rank's layer of my band
    layers = _by_depth(layers, perm)
    trans = torch.cat([torch.ones_like(layers[:1, ..., D:]),          # T: exclusive product, front to back
                       torch.cumprod(1 - layers[:-1, ..., D:], dim=0)], dim=0)
    band = (trans * layers).sum(0)                          # [B, h, W, 4]
    start, stop = band_rows(H, P)[rank]
    return band[:, :stop - start], layers, trans


class _Composite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rgb, alpha, perm, comm, transfer_dtype):
        band, layers, trans = _forward(rgb, alpha, perm, comm, transfer_dtype)
        ctx.comm = comm
        ctx.height = rgb.shape[1]
        ctx.save_for_backward(perm, layers, trans)
        return band

    @staticmethod
    def backward(ctx, grad_band):
        comm: Comm = ctx.comm
        perm, layers, trans = ctx.saved_tensors
        P, H = comm.size, ctx.height
        _, B, h, W, D1 = layers.shape
        D = D1 - 1
        G = grad_band.to(layers.dtype)
        if G.shape[1] != h:
            G = torch.nn.functional.pad(G, (0, 0, 0, 0, 0, h - G.shape[1]))
        p = (G * layers).sum(-1, keepdim=True)              # [P, B, h, W, 1] by depth
        # Q_m = sum over layers behind m of p * prod of (1 - A) strictly between, back to front
        q = torch.zeros_like(trans)
        for m in range(P - 2, -1, -1):
            q[m] = p[m + 1] + (1 - layers[m + 1, ..., D:]) * q[m + 1]
        by_depth = trans * torch.cat([G[..., :D].expand(P, -1, -1, -1, -1), G[..., D:] - q], dim=-1)
        by_rank = torch.empty_like(by_depth)
        by_rank[perm.t(), torch.arange(B, device=perm.device)] = by_depth
        grads = comm.all_to_all(by_rank)                    # [P, B, h, W, D + 1]: my layer's gradient, band by band
        grad = grads.transpose(0, 1).reshape(B, P * h, W, D1)[:, :H]
        return grad[..., :D], grad[..., D:], None, None, None


def composite(rgb: Tensor, alpha: Tensor, order: Tensor, comm: Comm, *,
              transfer_dtype: torch.dtype | None = None) -> Tensor:
    """Composite every rank's layer front to back; return this rank's row band. Collective.

    rgb:   [B, H, W, D] premultiplied colour (or any D premultiplied channels, e.g. the lit model's
           base colour and normal) of this rank's shard, on ``comm.device``.
    alpha: [B, H, W, 1] its alpha, in [0, 1].
    order: [B, P] visibility keys of the ranks (smaller = nearer, ties by rank), the same
           on every rank (:func:`visibility_order`).
    transfer_dtype: dtype the colour channels travel in between ranks (e.g. ``torch.bfloat16``);
           default the input dtype. Alphas and gradients always travel at the input dtype.

    Returns [B, hb, W, D + 1] the premultiplied channels and alpha of rows ``band_rows(H, P)[rank]``,
    differentiable with respect to ``rgb`` and ``alpha``. One rank: ``cat(rgb, alpha)``.
    """
    _check(rgb, alpha, order, comm, transfer_dtype)
    if comm.size == 1:
        return torch.cat([rgb, alpha], dim=-1)
    perm = front_to_back(order.to(rgb.device))
    return _Composite.apply(rgb, alpha, perm, comm, transfer_dtype)


class _Over(torch.autograd.Function):
    """``rgb + (1 - alpha) * background``: two kernels forward, three (element-wise) backward."""

    @staticmethod
    def forward(ctx, rgb: Tensor, alpha: Tensor, background: Tensor) -> Tensor:
        bg = background.to(rgb.dtype).expand(rgb.shape[0], 3).contiguous()
        ctx.save_for_backward(bg)
        return torch.addcmul(rgb, 1.0 - alpha, bg.view(-1, 1, 1, 3))

    @staticmethod
    def backward(ctx, grad: Tensor):
        bg, = ctx.saved_tensors
        return grad, (grad * bg.view(-1, 1, 1, 3)).sum(-1, keepdim=True).neg_(), None


def foreground(alpha_a: Tensor, alpha_b: Tensor) -> Tensor:
    """The pixels either image covers: alpha over 1/255 (what an 8-bit image shows) in ``alpha_a`` or
    ``alpha_b`` (same shape, bool). What ``psnr_foreground`` scores and the squared error's scale averages."""
    return (alpha_a > 1 / 255) | (alpha_b > 1 / 255)


def over(rgb: Tensor, alpha: Tensor, background: Tensor) -> Tensor:
    """Premultiplied colour over a background: ``rgb + (1 - alpha) * background``.

    rgb: [B, H, W, 3]; alpha: [B, H, W, 1]; background: [3] or [B, 3]. Returns [B, H, W, 3],
    differentiable with respect to ``rgb`` and ``alpha``.
    """
    if rgb.ndim != 4 or rgb.shape[-1] != 3 or alpha.shape != (*rgb.shape[:3], 1):
        raise ValueError(f"rgb, alpha: expected [B, H, W, 3] and [B, H, W, 1], got {tuple(rgb.shape)}, "
                         f"{tuple(alpha.shape)}")
    if background.shape not in ((3,), (rgb.shape[0], 3)):
        raise ValueError(f"background: expected [3] or [{rgb.shape[0]}, 3], got {tuple(background.shape)}")
    return _Over.apply(rgb, alpha, background)


def composite_full(rgb: Tensor, alpha: Tensor, order: Tensor, comm: Comm, *,
                   transfer_dtype: torch.dtype | None = None) -> Tensor:
    """:func:`composite` without autograd (ground-truth images): same arguments, same band."""
    _check(rgb, alpha, order, comm, transfer_dtype)
    with torch.no_grad():
        if comm.size == 1:
            return torch.cat([rgb, alpha], dim=-1)
        perm = front_to_back(order.to(rgb.device))
        return _forward(rgb, alpha, perm, comm, transfer_dtype)[0]


def gather_bands(band: Tensor, comm: Comm) -> Tensor:
    """Assemble the full images from every rank's band (evaluation, export). Collective.

    band: [B, hb, W, C] this rank's rows (:func:`band_rows`).  Returns [B, H, W, C] on every rank.
    """
    if band.ndim != 4:
        raise ValueError(f"band: expected shape [B, hb, W, C], got {tuple(band.shape)}")
    if comm.size == 1:
        return band
    heights = comm.allgather_object(int(band.shape[1]))
    h = max(heights)
    padded = torch.nn.functional.pad(band, (0, 0, 0, 0, 0, h - band.shape[1])) if band.shape[1] < h else band
    stack = comm.all_gather(padded.contiguous())            # [P, B, h, W, C]
    return torch.cat([stack[p, :, :n] for p, n in enumerate(heights)], dim=1)
