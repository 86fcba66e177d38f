import importlib.machinery
import math
import sys
import types

import pytest
import torch

from insitu.step import metrics
from insitu.step.metrics import Quality, QualityAccumulator, image_quality, lpips_availability, psnr


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


def test_lpips_availability_follows_the_hub_cache(fake_torchvision, empty_hub, monkeypatch):
    imported = []
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real_import(name, *a))
    status = lpips_availability()
    expected = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    assert not status.available and "no vgg16 backbone weights" in status.reason
    assert imported == []                          # no weights of that name: torchvision is not imported
    expected.parent.mkdir(parents=True)
    (expected.parent / "vgg16-00000000.pth").write_bytes(b"x")     # a name torchvision does not use
    status = lpips_availability()
    assert not status.available and status.weights == expected and "not found" in status.reason
    assert imported == ["torchvision.models"]
    expected.write_bytes(b"x")
    status = lpips_availability()
    assert status.available and status.weights == expected
    other = empty_hub.parent / "elsewhere"
    assert not lpips_availability(hub_dir=other).available
    with pytest.raises(ValueError, match="LPIPS net must be one of"):
        lpips_availability("resnet")


def test_lpips_unusable_weights_fall_back_to_none(fake_torchvision, empty_hub):
    ckpt = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")

    def broken(net, device):
        raise RuntimeError("cannot load backbone")

    x = _views()
    acc = QualityAccumulator(lpips_model=broken)
    assert acc.lpips_status.available
    with pytest.warns(RuntimeWarning, match="LPIPS disabled"):
        acc.add(x, x)
    q = acc.result()
    assert q.lpips is None and q.ssim == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(RuntimeError, match="cannot load backbone"):
        image_quality(x, x, lpips=True, lpips_model=broken)


def test_lpips_value_used_when_available(fake_torchvision, empty_hub):
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

    gt = torch.zeros(3, 8, 8, 3)
    pred = torch.stack([torch.full((8, 8, 3), v) for v in (0.1, 0.2, 0.6)])
    acc = QualityAccumulator(lpips_model=lambda net, device: MeanAbs())
    acc.add(pred[:2], gt[:2])
    acc.add(pred[2:], gt[2:])
    assert acc.result().lpips == pytest.approx(0.3, rel=1e-6)
    assert isinstance(acc.result(), Quality)


# ----------------------------------------------------------------------- premultiplied RGBA: foreground, white

def test_add_rgba_counts_only_covered_pixels_in_the_foreground_psnr():
    """A 16 x 16 view whose ground truth covers a 4 x 4 square (alpha 1, grey 0.5) and whose render
    has the square 0.1 too bright plus a faint 2-pixel halo (alpha 0.2, white): on black the whole-image
    PSNR is flattered by the 232 empty background pixels, the foreground PSNR is not."""
    gt = torch.zeros(1, 16, 16, 4)
    gt[0, 4:8, 4:8] = torch.tensor([0.5, 0.5, 0.5, 1.0])
    pred = gt.clone()
    pred[0, 4:8, 4:8, :3] = 0.6
    pred[0, 10, 10:12] = torch.tensor([0.2, 0.2, 0.2, 0.2])   # premultiplied white at alpha 0.2
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(pred, gt, torch.zeros(3))
    q = acc.result()
    covered = 16 + 2
    mse_fg = (16 * 3 * 0.01 + 2 * 3 * 0.04) / (covered * 3)
    assert q.psnr_foreground == pytest.approx(10 * math.log10(1 / mse_fg), rel=1e-5)
    assert q.psnr == pytest.approx(10 * math.log10(256 * 3 / (16 * 3 * 0.01 + 2 * 3 * 0.04)), rel=1e-5)
    assert q.psnr - q.psnr_foreground == pytest.approx(10 * math.log10(256 / covered), rel=1e-5)
    # on white: the square as before (fully opaque); the halo is 0.2 + 0.8 = 1 = the white GT: no error
    assert q.psnr_white == pytest.approx(10 * math.log10(256 * 3 / (16 * 3 * 0.01)), rel=1e-5)


def test_add_rgba_on_a_background_equals_add_on_the_composited_images():
    g = torch.Generator().manual_seed(2)
    a = torch.rand(2, 12, 14, 1, generator=g)
    pred = torch.cat([torch.rand(2, 12, 14, 3, generator=g) * a, a], dim=-1)
    b = torch.rand(2, 12, 14, 1, generator=g)
    gt = torch.cat([torch.rand(2, 12, 14, 3, generator=g) * b, b], dim=-1)
    bg = torch.tensor([0.2, 0.5, 0.9])
    on = lambda x, c: x[..., :3] + (1 - x[..., 3:]) * c      # noqa: E731
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(pred, gt, bg)
    q = acc.result()
    ref = image_quality(on(pred, bg), on(gt, bg), lpips=False)
    assert (q.psnr, q.ssim) == pytest.approx((ref.psnr, ref.ssim), rel=1e-6)
    assert q.psnr_white == pytest.approx(psnr(on(pred, torch.ones(3)), on(gt, torch.ones(3))), rel=1e-6)
    # everything is covered here: the foreground is the whole images, its error pooled over both views
    mse = float(((on(pred, bg) - on(gt, bg)) ** 2).mean())
    assert q.psnr_foreground == pytest.approx(10 * math.log10(1 / mse), rel=1e-6)
    assert q.ssim_foreground == pytest.approx(q.ssim, rel=1e-5)     # same-size views: the mean of their means


def test_the_foreground_is_pooled_over_views_not_averaged_per_view():
    """One view nearly exact and one poor do not average to a flattering figure: each covered pixel
    counts once, so the foreground PSNR is that of the pooled squared error."""
    gt = torch.zeros(2, 12, 12, 4)
    gt[:, 3:9, 3:9] = torch.tensor([0.5, 0.5, 0.5, 1.0])
    pred = gt.clone()
    pred[0, 3:9, 3:9, :3] += 0.001
    pred[1, 3:9, 3:9, :3] += 0.1
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(pred, gt, torch.zeros(3))
    q = acc.result()
    pooled = 10 * math.log10(1 / ((0.001 ** 2 + 0.1 ** 2) / 2))
    assert q.psnr_foreground == pytest.approx(pooled, rel=1e-4)
    assert pooled < (60.0 + 20.0) / 2 - 15                          # the per-view mean would say 40 dB
    assert 0 < q.ssim_foreground < 1


def test_a_view_without_coverage_is_left_out_of_the_foreground_mean():
    empty = torch.zeros(1, 12, 12, 4)
    some = torch.zeros(1, 12, 12, 4)
    some[0, 2, 2] = torch.tensor([0.5, 0.5, 0.5, 1.0])
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(empty, empty, torch.zeros(3))                  # nothing covered: no foreground figure
    acc.add_rgba(some * 0.8, some, torch.zeros(3))
    q = acc.result()
    assert q.views == 2 and math.isfinite(q.psnr_foreground)
    assert q.psnr_foreground == pytest.approx(20.0, rel=1e-5)      # one pixel, 0.4 vs 0.5 on black
    only = QualityAccumulator(lpips=False)
    only.add_rgba(empty, empty, torch.zeros(3))
    assert math.isnan(only.result().psnr_foreground)
    with pytest.raises(ValueError, match=r"premultiplied RGBA \[C, H, W, 4\]"):
        only.add_rgba(empty[..., :3], empty[..., :3], torch.zeros(3))
    assert QualityAccumulator(lpips=False).result().psnr_white is None     # add() alone: not measured


@pytest.mark.gpu
def test_warm_up_scores_on_the_cuda_device():
    """The preload thread's warm-up runs the evaluation's scoring on the GPU, without LPIPS."""
    metrics.warm_up("cuda")
    assert "cuda" in metrics.WARMED_UP


def test_warm_up_scores_on_the_cpu_without_lpips(fake_torchvision, empty_hub):
    """On the CPU the warm-up scores its pair too, and never computes LPIPS: with weights that seem present
    but cannot be used (computing LPIPS would warn that it is disabled), it warns of nothing."""
    import warnings

    ckpt = empty_hub / "checkpoints" / "vgg16-397923af.pth"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"not a checkpoint")
    assert lpips_availability().available
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.warm_up(torch.device("cpu"))
    assert "cpu" in metrics.WARMED_UP
