"""Structural similarity per pixel: a fused Triton kernel on CUDA, separable convolutions elsewhere.

``ssim_map(pred, gt)`` is the SSIM of every valid 11x11 window (Gaussian, sigma 1.5, data
range 1, C1 = 0.01^2, C2 = 0.03^2), averaged over the three channels, without padding:
``[B, H, W, 3] -> [B, H - 10, W - 10]``. It is torchmetrics' SSIM restricted to the windows
inside the image: ``structural_similarity_index_measure(..., data_range=1.0,
return_full_image=True)[1]`` (channels first) cropped by 5 pixels on every side and averaged
over the channels (variances clamped at 0 as there). torchmetrics 1.9's scalar SSIM averages
its whole reflect-padded map instead, border windows included, so it differs from
``ssim_map(...).mean()`` by the border's share (about 2e-5 on random 23x37 images).

On CUDA, forward and backward are one Triton kernel each (:class:`_FusedSSIM`). The window
is separable: a program holds a tile of outputs, walks down the input rows it needs, filters
each row horizontally once (11 taps) and adds it to every output row of the tile that the
vertical weights reach. The forward saves, per output and channel, the derivatives of SSIM
with respect to the window's mean, E[x^2] and E[xy]; the backward filters them (times the
incoming gradient) back onto the pixels: ``dS/dx_p = sum_o w(o - p) (a_o + 2 x_p b_o + y_p c_o)``.
Elsewhere (CPU, or when Triton is missing) the torch reference below computes the same map;
it is also the tests' oracle, with Triton's interpreter running the kernels on the CPU.
"""
from __future__ import annotations

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


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA, device=None, dtype=torch.float32) -> Tensor:
    """The normalised 1-D Gaussian ``[size]`` (torchmetrics' ``_gaussian``), computed in ``dtype``."""
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


if triton is not None:
    @triton.jit
    def _ssim_fwd(x_ptr, y_ptr, w_ptr, out_ptr, coef_ptr, H, W, Ho, Wo,
                  SAVE: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
        """One [TH, TW] tile of outputs of image b; x, y: [B, H, W, 3]; out: [B, Ho, Wo];
        coef: [B, Ho, Wo, 9] (a, b, c per channel: dS/dmean_x, dS/dE[x^2], dS/dE[xy], / 3)."""
        b = tl.program_id(2)
        r0 = tl.program_id(1) * TH
        c0 = tl.program_id(0) * TW
        rows = r0 + tl.arange(0, TH)
        cols = c0 + tl.arange(0, TW)
        col_ok = cols < Wo
        out_ok = (rows < Ho)[:, None] & col_ok[None, :]
        total = tl.zeros((TH, TW), dtype=tl.float32)
        for ch in tl.static_range(3):
            mx = tl.zeros((TH, TW), dtype=tl.float32)
            my = tl.zeros((TH, TW), dtype=tl.float32)
            exx = tl.zeros((TH, TW), dtype=tl.float32)
            eyy = tl.zeros((TH, TW), dtype=tl.float32)
            exy = tl.zeros((TH, TW), dtype=tl.float32)
            for i in range(r0, r0 + TH + 10):
                hx = tl.zeros((TW,), dtype=tl.float32)
                hy = tl.zeros((TW,), dtype=tl.float32)
                hxx = tl.zeros((TW,), dtype=tl.float32)
                hyy = tl.zeros((TW,), dtype=tl.float32)
                hxy = tl.zeros((TW,), dtype=tl.float32)
                ok = col_ok & ((tl.zeros((TW,), dtype=tl.int32) + i) < H)
                base = (b * H + i) * W
                for dx in tl.static_range(11):
                    wd = tl.load(w_ptr + dx)
                    off = (base + cols + dx) * 3 + ch
                    xv = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
                    yv = tl.load(y_ptr + off, mask=ok, other=0.0).to(tl.float32)
                    hx += wd * xv
                    hy += wd * yv
                    hxx += wd * xv * xv
                    hyy += wd * yv * yv
                    hxy += wd * xv * yv
                d = i - rows                                        # vertical tap of each output row
                wv = tl.load(w_ptr + d, mask=(d >= 0) & (d < 11), other=0.0)[:, None]
                mx += wv * hx[None, :]
                my += wv * hy[None, :]
                exx += wv * hxx[None, :]
                eyy += wv * hyy[None, :]
                exy += wv * hxy[None, :]
            sxx = exx - mx * mx
            kx = (sxx >= 0.0).to(tl.float32)                    # variances clamped at 0, as torchmetrics
            a1 = 2.0 * mx * my + 0.0001
            a2 = 2.0 * (exy - mx * my) + 0.0009
            b1 = mx * mx + my * my + 0.0001
            b2 = tl.maximum(sxx, 0.0) + tl.maximum(eyy - my * my, 0.0) + 0.0009
            den = b1 * b2
            s = a1 * a2 / den
            total += s
            if SAVE:
                cbase = ((b * Ho + rows[:, None]) * Wo + cols[None, :]) * 9 + ch * 3
                da = 2.0 * (my * (a2 - a1) - mx * s * (b2 - b1 * kx)) / den
                tl.store(coef_ptr + cbase, da / 3.0, mask=out_ok)
                tl.store(coef_ptr + cbase + 1, -s * kx / b2 / 3.0, mask=out_ok)
                tl.store(coef_ptr + cbase + 2, 2.0 * a1 / den / 3.0, mask=out_ok)
        tl.store(out_ptr + (b * Ho + rows[:, None]) * Wo + cols[None, :], total / 3.0, mask=out_ok)

    @triton.jit
    def _ssim_bwd(x_ptr, y_ptr, w_ptr, coef_ptr, go_ptr, gx_ptr, H, W, Ho, Wo,
                  TH: tl.constexpr, TW: tl.constexpr):
        """One [TH, TW] tile of pixels of image b: gx = P + 2 x Q + y R, with P, Q, R the
        window-filtered (go * a, go * b, go * c) over the outputs whose windows hold the pixel."""
        b = tl.program_id(2)
        r0 = tl.program_id(1) * TH
        c0 = tl.program_id(0) * TW
        rows = r0 + tl.arange(0, TH)
        cols = c0 + tl.arange(0, TW)
        pix_ok = (rows < H)[:, None] & (cols < W)[None, :]
        for ch in tl.static_range(3):
            p = tl.zeros((TH, TW), dtype=tl.float32)
            q = tl.zeros((TH, TW), dtype=tl.float32)
            r = tl.zeros((TH, TW), dtype=tl.float32)
            for i in range(r0 - 10, r0 + TH):                   # output rows reaching the tile
                hp = tl.zeros((TW,), dtype=tl.float32)
                hq = tl.zeros((TW,), dtype=tl.float32)
                hr = tl.zeros((TW,), dtype=tl.float32)
                iv = tl.zeros((TW,), dtype=tl.int32) + i
                row_ok = (iv >= 0) & (iv < Ho)
                for dx in tl.static_range(11):
                    wd = tl.load(w_ptr + dx)
                    oc = cols - dx
                    ok = row_ok & (oc >= 0) & (oc < Wo)
                    o = (b * Ho + i) * Wo + oc
                    g = tl.load(go_ptr + o, mask=ok, other=0.0) * wd
                    hp += g * tl.load(coef_ptr + o * 9 + ch * 3, mask=ok, other=0.0)
                    hq += g * tl.load(coef_ptr + o * 9 + ch * 3 + 1, mask=ok, other=0.0)
                    hr += g * tl.load(coef_ptr + o * 9 + ch * 3 + 2, mask=ok, other=0.0)
                d = rows - i
                wv = tl.load(w_ptr + d, mask=(d >= 0) & (d < 11), other=0.0)[:, None]
                p += wv * hp[None, :]
                q += wv * hq[None, :]
                r += wv * hr[None, :]
            off = ((b * H + rows[:, None]) * W + cols[None, :]) * 3 + ch
            xv = tl.load(x_ptr + off, mask=pix_ok, other=0.0).to(tl.float32)
            yv = tl.load(y_ptr + off, mask=pix_ok, other=0.0).to(tl.float32)
            tl.store(gx_ptr + off, p + 2.0 * xv * q + yv * r, mask=pix_ok)


_TH, _TW = 16, 32                   # output tile of a program (the tests shrink it)


class _FusedSSIM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred: Tensor, gt: Tensor) -> Tensor:
        x = pred.contiguous()
        y = gt.contiguous()
        B, H, W, _ = x.shape
        Ho, Wo = H - WINDOW + 1, W - WINDOW + 1
        w = gaussian_window(device=x.device)
        out = torch.empty(B, Ho, Wo, dtype=torch.float32, device=x.device)
        save = pred.requires_grad
        coef = torch.empty(B, Ho, Wo, 9, dtype=torch.float32, device=x.device) if save else out
        grid = (triton.cdiv(Wo, _TW), triton.cdiv(Ho, _TH), B)
        _ssim_fwd[grid](x, y, w, out, coef, H, W, Ho, Wo, SAVE=save, TH=_TH, TW=_TW)
        if save:
            ctx.save_for_backward(x, y, w, coef)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, y, w, coef = ctx.saved_tensors
        B, H, W, _ = x.shape
        Ho, Wo = grad_out.shape[1:]
        gx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(W, _TW), triton.cdiv(H, _TH), B)
        _ssim_bwd[grid](x, y, w, coef, grad_out.contiguous().float(), gx, H, W, Ho, Wo, TH=_TH, TW=_TW)
        return gx.to(x.dtype), None


def ssim(pred: Tensor, gt: Tensor) -> Tensor:
    """Mean SSIM (0-dim), as torchmetrics' default ``structural_similarity_index_measure``."""
    return ssim_map(pred, gt).mean()


__all__ = ["ssim_map", "ssim_map_reference", "ssim", "gaussian_window", "C1", "C2", "WINDOW", "SIGMA"]
