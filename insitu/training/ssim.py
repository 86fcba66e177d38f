"""Structural similarity per pixel: Triton kernels on CUDA, separable convolutions elsewhere.

``ssim_map(pred, gt)`` is the SSIM of every valid 11x11 window (Gaussian, sigma 1.5, data
range 1, C1 = 0.01^2, C2 = 0.03^2), averaged over the three channels, without padding:
``[B, H, W, 3] -> [B, H - 10, W - 10]``. It is torchmetrics' SSIM restricted to the windows
inside the image: ``structural_similarity_index_measure(..., data_range=1.0,
return_full_image=True)[1]`` (channels first) cropped by 5 pixels on every side and averaged
over the channels (variances clamped at 0 as there). torchmetrics 1.9's scalar SSIM averages
its whole reflect-padded map instead, border windows included, so it differs from
``ssim_map(...).mean()`` by the border's share (about 2e-5 on random 23x37 images).

On CUDA, forward and backward are two Triton kernels each (:class:`_FusedSSIM`), one per
direction of the separable window, every load a 2-D block at a shift of rows or of columns:
the forward sums the five moments (means, E[x^2], E[y^2], E[xy]) down the columns into
``[B, 15, H - 10, W]`` planes, then along the rows, and computes SSIM. Moments are taken of
``x - 1/2`` and ``y - 1/2``: variances do not change, and E[x^2] - mean^2 does not cancel
where the image is grey. The forward saves, per output and channel, the derivatives of SSIM
with respect to the window's mean, E[x^2] and E[xy] (planes of ``[B, 9, Ho, Wo]``); the
backward spreads them (times the incoming gradient, one value when it is that of a sum or
mean) back onto the pixels the same two ways:
``dS/dx_p = sum_o w(o - p) (a_o + 2 x_p b_o + y_p c_o)``. Elsewhere (CPU, or when Triton is
missing) the torch reference below computes the same map; it is also the tests' oracle.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

WINDOW, SIGMA = 11, 1.5
KERNEL, HALF = WINDOW, WINDOW // 2   # a map row depends on the HALF image rows above and below
C1, C2 = 0.01 ** 2, 0.03 ** 2

try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None


@functools.lru_cache(maxsize=16)           # built once per device and dtype, not at every step
def gaussian_window(size: int = WINDOW, sigma: float = SIGMA, device=None, dtype=torch.float32) -> Tensor:
    """The normalised 1-D Gaussian ``[size]`` (torchmetrics' ``_gaussian``), computed in ``dtype``; shared: read only."""
    x = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    g = torch.exp(-0.5 * (x / sigma) ** 2)
    return g / g.sum()


def _check(pred: Tensor, gt: Tensor) -> None:
    if not isinstance(pred, Tensor) or pred.ndim != 4 or pred.shape[-1] != 3:
        raise ValueError(f"pred: expected a tensor [B, H, W, 3], got "
                         f"{tuple(pred.shape) if isinstance(pred, Tensor) else type(pred).__name__}")
    if not isinstance(gt, Tensor) or gt.shape != pred.shape:
        raise ValueError(f"gt: expected the shape of pred {tuple(pred.shape)}, got "
                         f"{tuple(gt.shape) if isinstance(gt, Tensor) else type(gt).__name__}")
    if min(pred.shape[1:3]) < WINDOW:
        raise ValueError(f"pred: expected H, W >= {WINDOW} (the window), got {tuple(pred.shape[1:3])}")
    if gt.device != pred.device:
        raise ValueError(f"gt: expected the device of pred ({pred.device}), got {gt.device}")


def ssim_map(pred: Tensor, gt: Tensor) -> Tensor:
    """Per-pixel SSIM of ``pred`` against ``gt``, differentiable with respect to ``pred``.

    Args:
        pred: [B, H, W, 3] rendered images (channels last), data range 1.
        gt:   [B, H, W, 3] reference images (any float dtype; no gradient).

    Returns:
        [B, H - 10, W - 10] float32 (float64 for float64 ``pred`` off CUDA): SSIM of the 11x11 window whose top-left pixel is
        that position, averaged over the 3 channels.
    """
    _check(pred, gt)
    if pred.device.type == "cuda" and triton is not None:
        return _FusedSSIM.apply(pred, gt)
    if _interpret():                    # the kernels on CPU tensors (tests)
        return _FusedSSIM.apply(pred, gt)
    return ssim_map_reference(pred, gt)


def _interpret() -> bool:
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def ssim_map_reference(pred: Tensor, gt: Tensor) -> Tensor:
    """:func:`ssim_map` with torch's depthwise convolutions (separable: rows, then columns)."""
    _check(pred, gt)
    x = pred.permute(0, 3, 1, 2).to(torch.promote_types(pred.dtype, torch.float32))   # float64 stays
    y = gt.permute(0, 3, 1, 2).to(x.dtype)
    g = gaussian_window(device=x.device, dtype=x.dtype)
    wx, wy = g.view(1, 1, 1, WINDOW).repeat(15, 1, 1, 1), g.view(1, 1, WINDOW, 1).repeat(15, 1, 1, 1)
    stack = torch.cat([x, y, x * x, y * y, x * y], 1)                  # [B, 15, H, W]
    m = F.conv2d(F.conv2d(stack, wx, groups=15), wy, groups=15)
    mx, my, exx, eyy, exy = m.split(3, 1)
    sxx, syy = (exx - mx * mx).clamp(min=0.0), (eyy - my * my).clamp(min=0.0)      # as torchmetrics
    sxy = exy - mx * my
    s = ((2 * mx * my + C1) * (2 * sxy + C2)) / ((mx * mx + my * my + C1) * (sxx + syy + C2))
    return s.mean(1)


# _ssim_rows runs its channels as a run-time loop, the window's taps unrolled: Triton's coalescing
# pass grows faster than linearly with a kernel's memory operations, and with its 165 loads
# unrolled it took 4.0 of the four kernels' 10 s to compile (1.0 s so; a CPU host for sm_90,
# benchmarks/experiments/bench_compile.py --offline). The other kernels keep their channels unrolled: loops
# there cost a third more time at 2048^2 (bench_ssim.py --against).
if triton is not None:
    @triton.jit
    def _moments_cols(x_ptr, y_ptr, w_ptr, vm_ptr, l1_ptr, H, W, Ho, L1: tl.constexpr,
                      TH: tl.constexpr, TW: tl.constexpr):
        """Vertical pass: for output rows o and every column c, the window-weighted sums down the
        column of x', y', x'^2, y'^2, x'y' (x' = x - 1/2, y' = y - 1/2) per channel.
        x, y: [B, H, W, 3]; vm: [B, 15, Ho, W] (channel-major: 5 planes per channel). With L1 (a
        grid over all H rows), l1: [programs] each program's sum of |x - y| over its pixels."""
        b = tl.program_id(2).to(tl.int64)       # image offsets in 64 bits (large batches), 32 within
        rows = tl.program_id(1) * TH + tl.arange(0, TH)
        cols = tl.program_id(0) * TW + tl.arange(0, TW)
        ok = (rows < Ho)[:, None] & (cols < W)[None, :]
        pix_ok = (rows < H)[:, None] & (cols < W)[None, :]
        l1 = tl.zeros((TH, TW), dtype=tl.float32)
        dst = rows[:, None] * W + cols[None, :]
        xb = x_ptr + b * H * W * 3              # the image; 32-bit offsets within it
        yb = y_ptr + b * H * W * 3
        for ch in tl.static_range(3):
            sx = tl.zeros((TH, TW), dtype=tl.float32)
            sy = tl.zeros((TH, TW), dtype=tl.float32)
            sxx = tl.zeros((TH, TW), dtype=tl.float32)
            syy = tl.zeros((TH, TW), dtype=tl.float32)
            sxy = tl.zeros((TH, TW), dtype=tl.float32)
            for i in tl.static_range(11):
                wi = tl.load(w_ptr + i)
                off = ((rows[:, None] + i) * W + cols[None, :]) * 3 + ch
                m = pix_ok if L1 and i == 0 else ok             # the L1 term: every pixel, once
                xv = tl.load(xb + off, mask=m, other=0.5).to(tl.float32) - 0.5
                yv = tl.load(yb + off, mask=m, other=0.5).to(tl.float32) - 0.5
                if L1 and i == 0:
                    l1 += tl.abs(xv - yv)
                sx += wi * xv
                sy += wi * yv
                sxx += wi * xv * xv
                syy += wi * yv * yv
                sxy += wi * xv * yv
            plane = (b * 15 + ch * 5) * Ho * W
            tl.store(vm_ptr + plane + dst, sx, mask=ok)
            tl.store(vm_ptr + plane + Ho * W + dst, sy, mask=ok)
            tl.store(vm_ptr + plane + 2 * Ho * W + dst, sxx, mask=ok)
            tl.store(vm_ptr + plane + 3 * Ho * W + dst, syy, mask=ok)
            tl.store(vm_ptr + plane + 4 * Ho * W + dst, sxy, mask=ok)
        if L1:
            pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
            tl.store(l1_ptr + pid, tl.sum(l1))

    @triton.jit
    def _ssim_rows(vm_ptr, w_ptr, out_ptr, coef_ptr, W, Ho, Wo, SAVE: tl.constexpr,
                   TH: tl.constexpr, TW: tl.constexpr):
        """Horizontal pass of the vertical sums, then SSIM: out [B, Ho, Wo] (channel mean) and, with
        SAVE, coef [B, 9, Ho, Wo]: per channel dS/dmean_x, dS/dE[x'^2], dS/dE[x'y'], each / 3."""
        b = tl.program_id(2).to(tl.int64)       # image offsets in 64 bits (large batches), 32 within
        rows = tl.program_id(1) * TH + tl.arange(0, TH)
        cols = tl.program_id(0) * TW + tl.arange(0, TW)
        ok = (rows < Ho)[:, None] & (cols < Wo)[None, :]
        dst = rows[:, None] * Wo + cols[None, :]
        total = tl.zeros((TH, TW), dtype=tl.float32)
        for ch in range(3):
            mx = tl.zeros((TH, TW), dtype=tl.float32)
            my = tl.zeros((TH, TW), dtype=tl.float32)
            exx = tl.zeros((TH, TW), dtype=tl.float32)
            eyy = tl.zeros((TH, TW), dtype=tl.float32)
            exy = tl.zeros((TH, TW), dtype=tl.float32)
            src = vm_ptr + (b * 15 + ch * 5) * Ho * W + rows[:, None] * W + cols[None, :]
            for j in tl.static_range(11):
                wj = tl.load(w_ptr + j)
                mx += wj * tl.load(src + j, mask=ok, other=0.0)
                my += wj * tl.load(src + Ho * W + j, mask=ok, other=0.0)
                exx += wj * tl.load(src + 2 * Ho * W + j, mask=ok, other=0.0)
                eyy += wj * tl.load(src + 3 * Ho * W + j, mask=ok, other=0.0)
                exy += wj * tl.load(src + 4 * Ho * W + j, mask=ok, other=0.0)
            vx = exx - mx * mx                  # moments of x - 1/2: no cancellation at grey
            kx = (vx >= 0.0).to(tl.float32)     # variances clamped at 0, as torchmetrics
            ux = mx + 0.5
            uy = my + 0.5
            a1 = 2.0 * ux * uy + 0.0001
            a2 = 2.0 * (exy - mx * my) + 0.0009
            b1 = ux * ux + uy * uy + 0.0001
            b2 = tl.maximum(vx, 0.0) + tl.maximum(eyy - my * my, 0.0) + 0.0009
            den = b1 * b2
            s = a1 * a2 / den
            total += s
            if SAVE:
                plane = coef_ptr + (b * 9 + ch * 3) * Ho * Wo + dst
                tl.store(plane, 2.0 * (uy * a2 - my * a1 - s * (ux * b2 - mx * b1 * kx)) / den / 3.0, mask=ok)
                tl.store(plane + Ho * Wo, -s * kx / b2 / 3.0, mask=ok)
                tl.store(plane + 2 * Ho * Wo, 2.0 * a1 / den / 3.0, mask=ok)
        tl.store(out_ptr + b * Ho * Wo + dst, total / 3.0, mask=ok)

    @triton.jit
    def _spread_cols(coef_ptr, go_ptr, w_ptr, vg_ptr, H, Ho, Wo, GO_SCALAR: tl.constexpr,
                     TH: tl.constexpr, TW: tl.constexpr):
        """Backward, vertical pass: for pixel rows p and output columns c, the sums over the outputs
        o = p - 10 .. p of the column of w(p - o) go(o) coef(o). coef: [B, 9, Ho, Wo]; vg: [B, 9, H, Wo]."""
        b = tl.program_id(2).to(tl.int64)       # image offsets in 64 bits (large batches), 32 within
        rows = tl.program_id(1) * TH + tl.arange(0, TH)
        cols = tl.program_id(0) * TW + tl.arange(0, TW)
        ok = (rows < H)[:, None] & (cols < Wo)[None, :]
        dst = rows[:, None] * Wo + cols[None, :]
        g = tl.load(go_ptr) if GO_SCALAR else 0.0
        for k in tl.static_range(9):
            acc = tl.zeros((TH, TW), dtype=tl.float32)
            for i in tl.static_range(11):
                o = rows - i
                m = ((o >= 0) & (o < Ho))[:, None] & ok
                src = o[:, None] * Wo + cols[None, :]
                c = tl.load(coef_ptr + (b * 9 + k) * Ho * Wo + src, mask=m, other=0.0)
                if not GO_SCALAR:
                    c = c * tl.load(go_ptr + b * Ho * Wo + src, mask=m, other=0.0)
                acc += tl.load(w_ptr + i) * c
            if GO_SCALAR:
                acc = acc * g
            tl.store(vg_ptr + (b * 9 + k) * H * Wo + dst, acc, mask=ok)

    @triton.jit
    def _spread_rows(vg_ptr, x_ptr, y_ptr, w_ptr, gx_ptr, l1_ptr, H, W, Wo, L1: tl.constexpr,
                     TH: tl.constexpr, TW: tl.constexpr):
        """Backward, horizontal pass, then the pixels' gradient gx = P + 2 x' Q + y' R per channel,
        plus, with L1, l1 sign(x - y) (l1: the L1 term's weight, one value)."""
        b = tl.program_id(2).to(tl.int64)       # image offsets in 64 bits (large batches), 32 within
        rows = tl.program_id(1) * TH + tl.arange(0, TH)
        cols = tl.program_id(0) * TW + tl.arange(0, TW)
        ok = (rows < H)[:, None] & (cols < W)[None, :]
        for ch in tl.static_range(3):
            p = tl.zeros((TH, TW), dtype=tl.float32)
            q = tl.zeros((TH, TW), dtype=tl.float32)
            r = tl.zeros((TH, TW), dtype=tl.float32)
            base = vg_ptr + (b * 9 + ch * 3) * H * Wo + rows[:, None] * Wo
            for j in tl.static_range(11):
                oc = cols - j
                m = ((oc >= 0) & (oc < Wo))[None, :] & ok
                wj = tl.load(w_ptr + j)
                p += wj * tl.load(base + oc[None, :], mask=m, other=0.0)
                q += wj * tl.load(base + H * Wo + oc[None, :], mask=m, other=0.0)
                r += wj * tl.load(base + 2 * H * Wo + oc[None, :], mask=m, other=0.0)
            off = (rows[:, None] * W + cols[None, :]) * 3 + ch
            xv = tl.load(x_ptr + b * H * W * 3 + off, mask=ok, other=0.0).to(tl.float32) - 0.5
            yv = tl.load(y_ptr + b * H * W * 3 + off, mask=ok, other=0.0).to(tl.float32) - 0.5
            g = p + 2.0 * xv * q + yv * r
            if L1:
                g += tl.load(l1_ptr) * tl.where(xv > yv, 1.0, tl.where(xv < yv, -1.0, 0.0))
            tl.store(gx_ptr + b * H * W * 3 + off, g, mask=ok)


_TH, _TW, _WARPS = 4, 64, 4         # a program's tile (rows x columns) and warps (bench_ssim.py --tune)


def _grid(rows: int, cols: int, batch: int) -> tuple[int, int, int]:
    return (triton.cdiv(cols, _TW), triton.cdiv(rows, _TH), batch)


def _forward(x: Tensor, y: Tensor, save: bool, l1: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The map [B, Ho, Wo], the coefficients [B, 9, Ho, Wo] (or the map again without ``save``),
    the window and, with ``l1``, the programs' sums of |x - y| (else the map)."""
    B, H, W, _ = x.shape
    Ho, Wo = H - WINDOW + 1, W - WINDOW + 1
    w = gaussian_window(device=x.device)
    vm = torch.empty(B, 15, Ho, W, dtype=torch.float32, device=x.device)
    out = torch.empty(B, Ho, Wo, dtype=torch.float32, device=x.device)
    coef = torch.empty(B, 9, Ho, Wo, dtype=torch.float32, device=x.device) if save else out
    grid = _grid(H if l1 else Ho, W, B)
    sums = torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.float32, device=x.device) if l1 else out
    _moments_cols[grid](x, y, w, vm, sums, H, W, Ho, L1=l1, TH=_TH, TW=_TW, num_warps=_WARPS)
    _ssim_rows[_grid(Ho, Wo, B)](vm, w, out, coef, W, Ho, Wo, SAVE=save, TH=_TH, TW=_TW, num_warps=_WARPS)
    return out, coef, w, sums


def _backward(x: Tensor, y: Tensor, w: Tensor, coef: Tensor, go: Tensor, scalar: bool,
              l1: Tensor | None) -> Tensor:
    """The pixels' gradient [B, H, W, 3] of sum(go * map) (+ l1 * sum|x - y|); go [1] with ``scalar``."""
    B, H, W, _ = x.shape
    Ho, Wo = coef.shape[2:]
    vg = torch.empty(B, 9, H, Wo, dtype=torch.float32, device=x.device)
    gx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _spread_cols[_grid(H, Wo, B)](coef, go, w, vg, H, Ho, Wo, GO_SCALAR=scalar, TH=_TH, TW=_TW, num_warps=_WARPS)
    _spread_rows[_grid(H, W, B)](vg, x, y, w, gx, go if l1 is None else l1, H, W, Wo, L1=l1 is not None,
                                 TH=_TH, TW=_TW, num_warps=_WARPS)
    return gx


class _FusedSSIM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred: Tensor, gt: Tensor) -> Tensor:
        x, y = pred.contiguous(), gt.contiguous()
        out, coef, w, _ = _forward(x, y, save=pred.requires_grad, l1=False)
        if pred.requires_grad:
            ctx.save_for_backward(x, y, w, coef)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, y, w, coef = ctx.saved_tensors
        scalar = all(s == 0 for s in grad_out.stride())     # the gradient of a sum or mean: one value
        go = (grad_out[0, 0, :1] if scalar else grad_out).float().contiguous()
        return _backward(x, y, w, coef, go, scalar, None).to(x.dtype), None


class _FusedLoss(torch.autograd.Function):
    """``(1 - weight) mean|pred - gt| + weight (1 - mean ssim_map)`` in the SSIM kernels' two passes."""

    @staticmethod
    def forward(ctx, pred: Tensor, gt: Tensor, weight: float) -> Tensor:
        x, y = pred.contiguous(), gt.contiguous()
        out, coef, w, sums = _forward(x, y, save=pred.requires_grad, l1=True)
        ctx.weight, ctx.n, ctx.windows = weight, x.numel(), out.numel()
        if pred.requires_grad:
            ctx.save_for_backward(x, y, w, coef)
        return (1 - weight) * sums.sum() / x.numel() + weight * (1 - out.sum() / out.numel())

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y, w, coef = ctx.saved_tensors
        g = grad.reshape(1).float()
        go = g * (-ctx.weight / ctx.windows)
        l1 = g * ((1 - ctx.weight) / ctx.n)
        return _backward(x, y, w, coef, go, True, l1).to(x.dtype), None, None


def ssim_l1_loss(pred: Tensor, gt: Tensor, *, ssim_weight: float) -> Tensor:
    """The image loss ``(1 - ssim_weight) L1 + ssim_weight (1 - SSIM)``, 0-dim, differentiable in ``pred``.

    Args:
        pred: [B, H, W, 3] rendered images, data range 1.
        gt:   [B, H, W, 3] reference images (any float dtype; no gradient).
        ssim_weight: the SSIM term's weight in [0, 1].

    L1 is the mean of ``|pred - gt|`` over all pixels and channels, SSIM the mean of
    :func:`ssim_map`. On CUDA both terms come from the SSIM kernels, forward and backward (the
    L1 term adds no pass over the images); elsewhere from torch operations.
    """
    _check(pred, gt)
    if not 0.0 <= ssim_weight <= 1.0:
        raise ValueError(f"ssim_weight: expected a value in [0, 1], got {ssim_weight}")
    if (pred.device.type == "cuda" and triton is not None) or _interpret():
        return _FusedLoss.apply(pred, gt, float(ssim_weight))
    l1 = (pred - gt).abs().mean()
    return (1 - ssim_weight) * l1 + ssim_weight * (1 - ssim_map_reference(pred, gt).mean())


def ssim(pred: Tensor, gt: Tensor) -> Tensor:
    """Mean SSIM (0-dim), as torchmetrics' default ``structural_similarity_index_measure``."""
    return ssim_map(pred, gt).mean()


__all__ = ["ssim_map", "ssim_map_reference", "ssim", "ssim_l1_loss", "gaussian_window", "C1", "C2", "WINDOW", "SIGMA"]
