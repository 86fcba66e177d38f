"""insitu.ssim: the per-pixel SSIM map against torchmetrics; the fused kernels against the reference."""
from __future__ import annotations

import pytest
import torch
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_tm

from insitu.ssim import ssim_map, ssim_map_reference


def images(shape=(2, 23, 31, 3), seed=0, device="cpu"):
    """Random ground truth with a flat region (zero variance) and a noisy prediction of it."""
    g = torch.Generator().manual_seed(seed)
    gt = torch.rand(shape, generator=g)
    gt[:, : shape[1] // 3] = 0.5
    pred = (gt + 0.2 * torch.randn(shape, generator=g)).clamp(0, 1)
    pred[:, : shape[1] // 4] = 0.5
    return pred.to(device).requires_grad_(), gt.to(device)


def torchmetrics_map(pred, gt):
    """torchmetrics' full SSIM image, cropped to the windows inside the image, channel mean."""
    _, full = ssim_tm(pred.permute(0, 3, 1, 2), gt.permute(0, 3, 1, 2), data_range=1.0, return_full_image=True)
    return full[..., 5:-5, 5:-5].mean(1)


def test_map_and_gradient_match_torchmetrics():
    pred, gt = images()
    ours = ssim_map(pred, gt)
    assert ours.shape == (2, 13, 21)
    ref = torchmetrics_map(pred, gt)
    assert float((ours - ref).abs().max()) < 1e-5
    g_ours, = torch.autograd.grad(ours.mean(), pred)
    g_ref, = torch.autograd.grad(ref.mean(), pred)
    assert float(g_ref.abs().max()) > 1e-3
    assert float((g_ours - g_ref).abs().max()) < 1e-6
    # identical images: SSIM 1 everywhere
    assert torch.allclose(ssim_map(gt, gt), torch.ones(2, 13, 21), atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    pred, gt = images()
    with pytest.raises(ValueError, match=r"pred: expected a tensor \[B, H, W, 3\], got \(23, 31, 3\)"):
        ssim_map(pred[0], gt[0])
    with pytest.raises(ValueError, match="gt: expected the shape of pred"):
        ssim_map(pred, gt[:, :20])
    with pytest.raises(ValueError, match="H, W >= 11"):
        ssim_map(pred[:, :10], gt[:, :10])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 64, 96, 3), (2, 37, 300, 3), (1, 11, 11, 3)])
def test_fused_kernels_match_the_reference(shape):
    pred, gt = images(shape, seed=shape[2], device="cuda")
    fused = ssim_map(pred, gt.half())                  # ground truth travels as float16 in training
    ref = ssim_map_reference(pred.double(), gt.half().double())
    assert float((fused.double() - ref).abs().max()) < 3e-5             # float32 moments: E[x^2] - mean^2
    assert abs(float(fused.mean()) - float(ref.mean())) < 1e-6
    g_fused, = torch.autograd.grad(fused.mean() * 3.0, pred)
    g_ref, = torch.autograd.grad(ref.mean() * 3.0, pred)
    assert float((g_fused.double() - g_ref).abs().max()) < 1e-4 * float(g_ref.abs().max()) + 1e-9
    # and torchmetrics (float32) within 1e-4 in loss and gradients
    tm = torchmetrics_map(pred, gt.half().float())
    g_tm, = torch.autograd.grad(tm.mean(), pred)
    g_f, = torch.autograd.grad(ssim_map(pred, gt.half()).mean(), pred)
    assert abs(float(tm.mean()) - float(fused.mean())) < 1e-4
    assert float((g_tm - g_f).abs().max()) < 1e-4
