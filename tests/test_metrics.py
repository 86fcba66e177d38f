import importlib.machinery
import math
import sys
import types

import pytest
import torch

from insitu import metrics
from insitu.metrics import Quality, QualityAccumulator, image_quality, lpips_availability, psnr


def _views(c=2, h=24, w=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(c, h, w, 3, generator=g)


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """An empty torch hub cache, so no machine's cached weights leak into a test."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub"


@pytest.fixture
def fake_torchvision(monkeypatch):
    """A stand-in torchvision that names its VGG16 weights like the real one, and nothing else."""
    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    models = types.ModuleType("torchvision.models")
    models.__spec__ = importlib.machinery.ModuleSpec("torchvision.models", None)
    models.VGG16_Weights = types.SimpleNamespace(
        DEFAULT=types.SimpleNamespace(url="https://download.pytorch.org/models/vgg16-397923af.pth")
    )
    tv.models = models
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    return tv


def test_psnr_identical_is_inf():
    x = _views()
    assert psnr(x, x) == math.inf
    q = image_quality(x, x, lpips=False)
    assert q.psnr == math.inf


def test_psnr_known_mse():
    gt = torch.full((1, 16, 16, 3), 0.5)
    pred = gt.clone()
    pred[..., 0] += 0.1                     # one channel off by 0.1: mse = 0.01 / 3
    mse = 0.01 / 3
    assert psnr(pred, gt) == pytest.approx(10 * math.log10(1 / mse), rel=1e-5)
    assert psnr(pred[0], gt[0]) == pytest.approx(10 * math.log10(1 / mse), rel=1e-5)


def test_psnr_is_mean_over_views_not_pooled():
    gt = torch.full((2, 8, 8, 3), 0.5)
    pred = gt.clone()
    pred[0] += 0.1                          # mse 1e-2
    pred[1] += 0.01                         # mse 1e-4
    expected = (10 * math.log10(1e2) + 10 * math.log10(1e4)) / 2
    assert psnr(pred, gt) == pytest.approx(expected, rel=1e-4)


def test_ssim_identical_is_one_and_drops_with_noise():
    x = _views()
    assert image_quality(x, x, lpips=False).ssim == pytest.approx(1.0, abs=1e-6)
    noisy = (x + 0.2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    q = image_quality(noisy, x, lpips=False)
    assert q.ssim < 0.9
    assert q.views == 2


def test_accumulator_equals_whole_batch(empty_hub):
    gt = _views(c=5)
    pred = (gt + 0.05 * torch.randn(gt.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    whole = image_quality(pred, gt)
    acc = QualityAccumulator()
    for i in range(5):
        acc.add(pred[i : i + 1], gt[i : i + 1])
    part = acc.result()
    assert part.views == 5
    assert part.psnr == pytest.approx(whole.psnr, rel=1e-5)
    assert part.ssim == pytest.approx(whole.ssim, rel=1e-5)
    assert part.lpips is None and whole.lpips is None


def test_accumulator_empty_gives_nan():
    q = QualityAccumulator(lpips=False).result()
    assert q.views == 0 and math.isnan(q.psnr) and math.isnan(q.ssim) and q.lpips is None


def test_inputs_validated():
    x = _views()
    with pytest.raises(ValueError, match=r"\[C, H, W, 3\]"):
        image_quality(x.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2), lpips=False)
    with pytest.raises(ValueError, match="same shape"):
        image_quality(x[:1], x, lpips=False)
    with pytest.raises(ValueError, match="float"):
        image_quality((x * 255).to(torch.uint8), (x * 255).to(torch.uint8), lpips=False)
    with pytest.raises(ValueError, match="lpips must be"):
        image_quality(x, x, lpips="yes")


def test_lpips_none_when_weights_absent(empty_hub):
    x = _views()
    assert not lpips_availability().available
    assert image_quality(x, x).lpips is None
    with pytest.raises(RuntimeError, match="LPIPS was required"):
        image_quality(x, x, lpips=True)


def test_lpips_availability_without_torchvision(monkeypatch, empty_hub):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real_find_spec(name, *a)
    )
    status = lpips_availability()
    assert not status.available and "torchvision is not installed" in status.reason


def test_lpips_availability_follows_the_hub_cache(fake_torchvision, empty_hub):
    status = lpips_availability()
    expected = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    assert not status.available
    assert status.weights == expected and "not found" in status.reason
    expected.parent.mkdir(parents=True)
    expected.write_bytes(b"x")
    status = lpips_availability()
    assert status.available and status.weights == expected
    other = empty_hub.parent / "elsewhere"
    assert not lpips_availability(hub_dir=other).available
    with pytest.raises(ValueError, match="LPIPS net must be one of"):
        lpips_availability("resnet")


def test_lpips_unusable_weights_fall_back_to_none(fake_torchvision, empty_hub, monkeypatch):
    ckpt = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")

    def broken(net, device):
        raise RuntimeError("cannot load backbone")

    monkeypatch.setattr(metrics, "_lpips_model", broken)
    x = _views()
    acc = QualityAccumulator()
    assert acc.lpips_status.available
    with pytest.warns(RuntimeWarning, match="LPIPS disabled"):
        acc.add(x, x)
    q = acc.result()
    assert q.lpips is None and q.ssim == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(RuntimeError, match="cannot load backbone"):
        image_quality(x, x, lpips=True)


def test_lpips_value_used_when_available(fake_torchvision, empty_hub, monkeypatch):
    """With weights present, the LPIPS metric's per-batch sum is averaged over views."""
    ckpt = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"x")

    class MeanAbs(torch.nn.Module):             # stands in for the VGG metric: same update/compute protocol
        def reset(self):
            self.total = torch.zeros(())

        def update(self, a, b):
            assert a.shape[1] == 3 and a.ndim == 4  # channels first, as torchmetrics expects
            self.total = self.total + (a - b).abs().mean(dim=(1, 2, 3)).sum()

        def compute(self):
            return self.total

    monkeypatch.setattr(metrics, "_lpips_model", lambda net, device: MeanAbs())
    gt = torch.zeros(3, 8, 8, 3)
    pred = torch.stack([torch.full((8, 8, 3), v) for v in (0.1, 0.2, 0.6)])
    acc = QualityAccumulator()
    acc.add(pred[:2], gt[:2])
    acc.add(pred[2:], gt[2:])
    assert acc.result().lpips == pytest.approx(0.3, rel=1e-6)
    assert isinstance(acc.result(), Quality)
