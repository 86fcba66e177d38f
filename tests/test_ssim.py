"""ssim_map: per-pixel SSIM over the valid 11 x 11 windows, channels last, checked against torchmetrics."""
import pytest
import torch
from torchmetrics.functional.image import structural_similarity_index_measure as tm_ssim

from insitu.ssim import ssim_map


def pair(b, h, w, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred = torch.rand(b, h, w, 3, generator=g, dtype=dtype)
    gt = (pred + 0.3 * torch.rand(b, h, w, 3, generator=g, dtype=dtype)).clamp(0, 1)
    return pred, gt


def first(x):
    return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize("h, w", [(11, 11), (23, 17), (40, 33)])
def test_the_map_is_torchmetrics_full_image_without_its_padded_border(h, w):
    """torchmetrics' full SSIM image (reflect-padded by 5) cropped by 5 on every side: the valid windows."""
    pred, gt = pair(2, h, w)
    m = ssim_map(pred, gt)
    assert m.shape == (2, h - 10, w - 10)
    _, full = tm_ssim(first(pred), first(gt), data_range=1.0, return_full_image=True)
    torch.testing.assert_close(m, full[..., 5:-5, 5:-5].mean(dim=1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_torchmetrics_default_ssim_is_the_mean_map_of_the_reflect_padded_images(dtype, tol):
    """torchmetrics (1.9) with its defaults averages every window of the reflect-padded images,
    border ones included; ssim_map of the same padded images, averaged, is the same number,
    while the mean over the valid windows alone differs."""
    pred, gt = pair(3, 30, 26, dtype=dtype, seed=1)
    pad = lambda x: torch.nn.functional.pad(first(x), (5, 5, 5, 5), mode="reflect").permute(0, 2, 3, 1)  # noqa: E731
    want = tm_ssim(first(pred), first(gt), data_range=1.0)
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
    _, full = tm_ssim(first(y), first(gt), data_range=1.0, return_full_image=True)
    (w * full[..., 5:-5, 5:-5].mean(dim=1)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)
    assert x.grad.abs().max() > 0


@pytest.mark.parametrize("shape, words", [((1, 10, 20, 3), "at least 11 x 11 pixels, got 10 x 20"),
                                          ((1, 20, 20, 4), r"\[B, H, W, 3\]")])
def test_inputs_are_checked(shape, words):
    x = torch.rand(shape)
    with pytest.raises(ValueError, match=words):
        ssim_map(x, x)
    with pytest.raises(ValueError, match="same shape"):
        ssim_map(torch.rand(1, 12, 12, 3), torch.rand(1, 12, 13, 3))
