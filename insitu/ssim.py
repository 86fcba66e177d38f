"""Per-pixel structural similarity (SSIM) of images, channels last, over the valid window positions.

The settings are those of the 3DGS evaluation and of torchmetrics' defaults: an 11x11 Gaussian
window of sigma 1.5, data range 1, ``C1 = 0.01**2``, ``C2 = 0.03**2``, averaged over the colour
channels. Only window positions that lie wholly inside the image count (no padding), so the map
of an ``H x W`` image has ``(H - 10) x (W - 10)`` entries. torchmetrics'
``structural_similarity_index_measure(pred, gt, data_range=1.0)`` (1.9) reflect-pads the
images by 5 pixels and averages all ``H x W`` windows, border ones included: it equals
``ssim_map`` of the reflect-padded images, averaged (a test checks both). A map row depends
on the 11 image rows around it only, which is what lets the training loss split an image into
row bands exactly (:func:`insitu.training.band_loss`).
"""
from __future__ import annotations

import torch
from torch import Tensor

KERNEL = 11
SIGMA = 1.5
HALF = KERNEL // 2                  # rows (and columns) a window reaches beyond its centre
C1 = 0.01 ** 2
C2 = 0.03 ** 2


def _window(dtype: torch.dtype, device) -> Tensor:
    x = torch.arange(KERNEL, dtype=torch.float64) - HALF
    g = torch.exp(-x * x / (2 * SIGMA * SIGMA))
    return (g / g.sum()).to(dtype=dtype, device=device)


def ssim_map(pred: Tensor, gt: Tensor) -> Tensor:
    """SSIM of every valid window position, averaged over the channels (differentiable).

    pred: [B, H, W, 3] images (channels last, values in [0, 1]), H >= 11 and W >= 11.
    gt:   [B, H, W, 3] the reference images, same shape, dtype and device.

    Returns [B, H - 10, W - 10]: entry (b, i, j) is the SSIM of the 11x11 window whose
    top-left pixel is (i, j), i.e. centred on pixel (i + 5, j + 5).
    """
    for name, t in (("pred", pred), ("gt", gt)):
        if not isinstance(t, Tensor) or t.ndim != 4 or t.shape[-1] != 3 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a float tensor [B, H, W, 3], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if pred.shape != gt.shape or pred.dtype != gt.dtype or pred.device != gt.device:
        raise ValueError(f"pred, gt: expected the same shape, dtype and device, got {tuple(pred.shape)} "
                         f"{pred.dtype} {pred.device} and {tuple(gt.shape)} {gt.dtype} {gt.device}")
    B, H, W, _ = pred.shape
    if H < KERNEL or W < KERNEL:
        raise ValueError(f"pred, gt: expected images of at least {KERNEL} x {KERNEL} pixels, got {H} x {W}")
    x = pred.permute(0, 3, 1, 2)
    y = gt.permute(0, 3, 1, 2)
    stack = torch.cat([x, y, x * x, y * y, x * y], dim=1)         # [B, 15, H, W]
    g = _window(pred.dtype, pred.device)
    n = stack.shape[1]
    f = torch.nn.functional.conv2d(stack, g.view(1, 1, KERNEL, 1).expand(n, 1, KERNEL, 1), groups=n)
    f = torch.nn.functional.conv2d(f, g.view(1, 1, 1, KERNEL).expand(n, 1, 1, KERNEL), groups=n)
    mx, my, xx, yy, xy = f.split(3, dim=1)
    sxx, syy, sxy = xx - mx * mx, yy - my * my, xy - mx * my
    s = (2 * mx * my + C1) * (2 * sxy + C2) / ((mx * mx + my * my + C1) * (sxx + syy + C2))
    return s.mean(dim=1)
