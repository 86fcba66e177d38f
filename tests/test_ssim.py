"""insitu.training.ssim: the per-pixel SSIM map against torchmetrics; the fused kernels against the reference."""
from __future__ import annotations

import pytest
import torch
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_tm

from insitu.training.ssim import ssim_map, ssim_map_reference


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
    assert float((ours - ref).detach().abs().max()) < 1e-5
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
@pytest.mark.parametrize("shape", [(1, 64, 96, 3), (2, 37, 300, 3), (1, 11, 11, 3), (1, 101, 75, 3)])
def test_fused_kernels_match_the_reference(shape):
    pred, gt = images(shape, seed=shape[2], device="cuda")
    fused = ssim_map(pred, gt.half())                  # ground truth travels as float16 in training
    ref = ssim_map_reference(pred.double(), gt.half().double())
    assert float((fused.double() - ref).abs().max()) < 2e-6             # float32 moments of x - 1/2, y - 1/2
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


def pair(b, h, w, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred = torch.rand(b, h, w, 3, generator=g, dtype=dtype)
    gt = (pred + 0.3 * torch.rand(b, h, w, 3, generator=g, dtype=dtype)).clamp(0, 1)
    return pred, gt


def first(x):
    return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_torchmetrics_default_ssim_is_the_mean_map_of_the_reflect_padded_images(dtype, tol):
    """torchmetrics (1.9) with its defaults averages every window of the reflect-padded images,
    border ones included; ssim_map of the same padded images, averaged, is the same number,
    while the mean over the valid windows alone differs."""
    pred, gt = pair(3, 30, 26, dtype=dtype, seed=1)
    pad = lambda x: torch.nn.functional.pad(first(x), (5, 5, 5, 5), mode="reflect").permute(0, 2, 3, 1)  # noqa: E731
    want = ssim_tm(first(pred), first(gt), data_range=1.0)
    assert float(ssim_map(pad(pred), pad(gt)).mean()) == pytest.approx(float(want), abs=tol)
    assert float(ssim_map(pred, gt).mean()) != pytest.approx(float(want), abs=1e-4)


def test_identical_images_give_one_and_a_row_depends_on_its_11_rows_only():
    pred, gt = pair(1, 30, 20)
    torch.testing.assert_close(ssim_map(gt, gt), torch.ones(1, 20, 10, dtype=torch.float64))
    changed = pred.clone()
    changed[:, 25] = 0.0                                    # image row 25: map rows 15..19 only
    diff = (ssim_map(changed, gt) - ssim_map(pred, gt)).abs().amax(dim=(0, 2))
    assert torch.all(diff[:15] == 0) and torch.all(diff[15:] > 0)


def test_gradients_match_torchmetrics_autograd():
    pred, gt = pair(2, 21, 16)
    w = torch.rand(2, 11, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x, y = pred.clone().requires_grad_(), pred.clone().requires_grad_()
    (w * ssim_map(x, gt)).sum().backward()
    _, full = ssim_tm(first(y), first(gt), data_range=1.0, return_full_image=True)
    (w * full[..., 5:-5, 5:-5].mean(dim=1)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert x.grad.abs().max() > 0


def test_ssim_l1_loss_is_the_weighted_sum_of_its_terms():
    from insitu.training.ssim import ssim_l1_loss

    pred, gt = pair(2, 30, 26, seed=4)
    x = pred.clone().requires_grad_()
    loss = ssim_l1_loss(x, gt, ssim_weight=0.2)
    want = 0.8 * (pred - gt).abs().mean() + 0.2 * (1 - ssim_map_reference(pred, gt).mean())
    assert float(loss.detach()) == pytest.approx(float(want), abs=1e-12)
    loss.backward()
    assert x.grad.abs().max() > 0
    with pytest.raises(ValueError, match=r"ssim_weight: expected a value in \[0, 1\], got 1.5"):
        ssim_l1_loss(pred, gt, ssim_weight=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 64, 96, 3), (2, 37, 300, 3), (1, 11, 11, 3)])
def test_fused_loss_matches_the_reference(shape):
    """The L1 + D-SSIM loss from the SSIM kernels (L1 summed in their first pass, its sign added in
    their last) against float64 torch, equal pixels included (the sign is 0 there)."""
    from insitu.training.ssim import ssim_l1_loss

    pred, gt = images(shape, seed=shape[1], device="cuda")
    pred = pred.detach()
    pred[:, -2:] = gt[:, -2:].half().float()
    x, x64 = pred.clone().requires_grad_(), pred.double().requires_grad_()
    ours = ssim_l1_loss(x, gt.half(), ssim_weight=0.2)
    g = gt.half().double()
    ref = 0.8 * (x64 - g).abs().mean() + 0.2 * (1 - ssim_map_reference(x64, g).mean())
    assert abs(float(ours) - float(ref)) < 1e-6
    (2.0 * ours).backward()
    (2.0 * ref).backward()
    assert float((x.grad.double() - x64.grad).abs().max()) < 1e-4 * float(x64.grad.abs().max())
