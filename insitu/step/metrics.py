"""Image quality of rendered views against their ground truth: PSNR, SSIM and, when possible, LPIPS.

The settings are those of the 3DGS evaluation: PSNR with a data range of 1, SSIM with an
11x11 Gaussian window of sigma 1.5, LPIPS with the VGG backbone; every metric is computed per
view and averaged over views.

    pred: [C, H, W, 3]  rendered views, channels last, values in [0, 1] (clamped to it)
    gt:   [C, H, W, 3]  ground-truth views, same shape

:meth:`QualityAccumulator.add_rgba` takes premultiplied RGBA instead and adds two figures that
the background cannot flatter: ``psnr_foreground``, the PSNR over the pixels where the ground
truth or the render has coverage (alpha above 1/255, what an 8-bit image shows), pooled over
the views, ``ssim_foreground``, the SSIM map's mean over those pixels, and ``psnr_white``,
render and ground truth both composited on white.

PSNR of a view that equals its ground truth exactly is ``inf`` (what torchmetrics returns; no
cap is applied, so a mean that contains such a view is ``inf`` too).

LPIPS needs the ImageNet-pretrained VGG16 backbone of torchvision, which torchvision downloads
on first use. Nothing is ever downloaded here: LPIPS is computed only when torchvision is
installed and the backbone weights are already in the torch hub cache
(``$TORCH_HOME/hub/checkpoints``); otherwise it is reported as unavailable (``None``).
Evaluation runs view by view to bound memory: :class:`QualityAccumulator` takes batches of
views and gives the mean (:meth:`QualityAccumulator.result`).
"""
from __future__ import annotations

import importlib
import math
import importlib.util
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import Tensor
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from insitu.render.compositing import foreground

SSIM_KERNEL = 11
SSIM_SIGMA = 1.5
LPIPS_NET = "vgg"
# torchmetrics' LPIPS backbone name -> the torchvision weights enum it loads (pretrained=True).
_TORCHVISION_WEIGHTS = {"vgg": "VGG16_Weights", "alex": "AlexNet_Weights", "squeeze": "SqueezeNet1_1_Weights"}
# how torchvision names those checkpoints (``vgg16-397923af.pth``): a quick look before importing it
_CHECKPOINT_PREFIX = {"vgg": "vgg16", "alex": "alexnet", "squeeze": "squeezenet1_1"}


@dataclass
class Quality:
    """Mean image quality over ``views`` views; ``lpips`` is None when LPIPS is unavailable."""

    psnr: float
    ssim: float
    lpips: float | None
    views: int
    psnr_foreground: float | None = None    # over covered pixels only, pooled over the views (add_rgba)
    psnr_white: float | None = None         # on a white background (add_rgba)
    ssim_foreground: float | None = None    # the SSIM map's mean over covered pixels, pooled (add_rgba)


@dataclass
class LpipsAvailability:
    """Whether LPIPS can be computed without a download, and why not when it cannot."""

    available: bool
    reason: str
    weights: Path | None = None     # the backbone checkpoint that is (or would be) loaded


def lpips_availability(net: str = LPIPS_NET, *, hub_dir: str | Path | None = None) -> LpipsAvailability:
    """Decide, without any network access, whether LPIPS with backbone ``net`` can be computed.

    It can when torchvision is importable, torchmetrics ships the LPIPS linear layers for
    ``net``, and the torchvision backbone checkpoint is already in ``hub_dir/checkpoints``
    (default: ``torch.hub.get_dir()``), the file torchvision would otherwise download.
    When no file of the backbone's name is there, the answer comes without importing
    torchvision (which takes seconds).
    """
    if net not in _TORCHVISION_WEIGHTS:
        raise ValueError(f"LPIPS net must be one of {sorted(_TORCHVISION_WEIGHTS)}, got {net!r}")
    if importlib.util.find_spec("torchvision") is None:
        return LpipsAvailability(False, "torchvision is not installed")
    hub = Path(hub_dir) if hub_dir is not None else Path(torch.hub.get_dir())
    if not any((hub / "checkpoints").glob(f"{_CHECKPOINT_PREFIX[net]}-*.pth")):
        return LpipsAvailability(False, f"no {_CHECKPOINT_PREFIX[net]} backbone weights in {hub / 'checkpoints'} "
                                        "(no download is attempted)")
    try:
        models = importlib.import_module("torchvision.models")
        url = getattr(models, _TORCHVISION_WEIGHTS[net]).DEFAULT.url
    except Exception as e:  # a broken torchvision install: LPIPS cannot run, the rest can
        return LpipsAvailability(False, f"torchvision cannot be used: {type(e).__name__}: {e}")
    weights = hub / "checkpoints" / os.path.basename(urlparse(url).path)
    if not weights.is_file():
        return LpipsAvailability(False, f"backbone weights not found at {weights} (no download is attempted)", weights)
    lin = importlib.util.find_spec("torchmetrics.functional.image.lpips")
    lin_path = Path(lin.origin).parent / "lpips_models" / f"{net}.pth" if lin and lin.origin else None
    if lin_path is None or not lin_path.is_file():
        return LpipsAvailability(False, f"torchmetrics has no LPIPS linear layers for {net!r}", weights)
    return LpipsAvailability(True, "ok", weights)


_LPIPS_LOCK = threading.Lock()
_LPIPS_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _lpips_model(net: str, device: torch.device) -> torch.nn.Module:
    """The torchmetrics LPIPS metric for ``net`` on ``device``, built once per process."""
    key = (net, str(device))
    if key not in _LPIPS_MODELS:
        from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

        _LPIPS_MODELS[key] = LearnedPerceptualImagePatchSimilarity(
            net_type=net, normalize=True, reduction="sum"
        ).to(device)
    return _LPIPS_MODELS[key]


def _check_pair(pred: Tensor, gt: Tensor) -> None:
    for name, t in (("pred", pred), ("gt", gt)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [C, H, W, 3], got {type(t).__name__}")
        if t.ndim != 4 or t.shape[-1] != 3:
            raise ValueError(f"{name} must have shape [C, H, W, 3] (channels last), got {list(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor with values in [0, 1], got dtype {t.dtype}")
    if pred.shape != gt.shape:
        raise ValueError(f"pred and gt must have the same shape, got {list(pred.shape)} and {list(gt.shape)}")


def _channels_first(x: Tensor) -> Tensor:
    return x.detach().float().clamp(0.0, 1.0).permute(0, 3, 1, 2).contiguous()


def _per_view_psnr(pred: Tensor, gt: Tensor) -> Tensor:
    """[C, 3, H, W] pair -> [C] PSNR of each view."""
    return peak_signal_noise_ratio(pred, gt, data_range=1.0, reduction="none", dim=(1, 2, 3))


def _per_view_ssim(pred: Tensor, gt: Tensor) -> Tensor:
    """[C, 3, H, W] pair -> [C] SSIM of each view."""
    return structural_similarity_index_measure(
        pred, gt, gaussian_kernel=True, sigma=SSIM_SIGMA, kernel_size=SSIM_KERNEL, data_range=1.0, reduction="none"
    )


def _per_view_ssim_map(pred: Tensor, gt: Tensor) -> tuple[Tensor, Tensor]:
    """[C, 3, H, W] pair -> ([C] SSIM of each view, [C, 3, H, W] its map, reflect-padded as torchmetrics
    pads it)."""
    ssim, full = structural_similarity_index_measure(
        pred, gt, gaussian_kernel=True, sigma=SSIM_SIGMA, kernel_size=SSIM_KERNEL, data_range=1.0, reduction="none",
        return_full_image=True)
    return ssim, full


def _psnr_of(mse: float) -> float:
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


class QualityAccumulator:
    """Adds batches of views and gives the mean quality over all views added.

    lpips: ``"auto"`` computes LPIPS when :func:`lpips_availability` says it can, else reports None;
           ``True`` requires it (raises when unavailable); ``False`` never computes it.
    lpips_model: ``(net, device) -> metric``, the LPIPS metric (torchmetrics', built once per process).
    """

    def __init__(self, *, lpips: bool | str = "auto", net: str = LPIPS_NET,
                 lpips_model: Callable[[str, torch.device], torch.nn.Module] = _lpips_model) -> None:
        if lpips not in (True, False, "auto"):
            raise ValueError(f"lpips must be True, False or 'auto', got {lpips!r}")
        self.net, self.lpips_model = net, lpips_model
        self.lpips_status = (
            lpips_availability(net) if lpips is not False else LpipsAvailability(False, "disabled")
        )
        if lpips is True and not self.lpips_status.available:
            raise RuntimeError(f"LPIPS was required but is unavailable: {self.lpips_status.reason}")
        self._use_lpips = self.lpips_status.available
        self._required = lpips is True
        self._psnr = 0.0
        self._ssim = 0.0
        self._lpips = 0.0
        self.views = 0
        self._fg_err, self._fg_pixels, self._fg_ssim, self._white, self._rgba_views = 0.0, 0.0, 0.0, 0.0, 0

    def add(self, pred: Tensor, gt: Tensor) -> None:
        """Add views ``pred: [C, H, W, 3]`` rendered and ``gt: [C, H, W, 3]`` ground truth, in [0, 1]."""
        _check_pair(pred, gt)
        if pred.shape[0] == 0:
            return
        self._add_channels_first(_channels_first(pred), _channels_first(gt))

    def _add_channels_first(self, p: Tensor, g: Tensor, ssim: Tensor | None = None) -> None:
        """``p, g: [C, 3, H, W]`` in [0, 1]: add their PSNR, SSIM (``ssim``: [C], when computed) and LPIPS."""
        self._psnr += _per_view_psnr(p, g).double().sum()        # sums stay on the device until result()
        self._ssim += (_per_view_ssim(p, g) if ssim is None else ssim).double().sum()
        self._lpips += self._lpips_sum(p, g) if self._use_lpips else 0.0
        self.views += p.shape[0]

    def add_rgba(self, pred: Tensor, gt: Tensor, background: Tensor) -> None:
        """Add views given as premultiplied RGBA ``pred, gt: [C, H, W, 4]``, judged on ``background [3]``.

        PSNR, SSIM and LPIPS are those of :meth:`add` on ``background``; besides, over the pixels
        where either image has alpha > 1/255 (the foreground: what the background cannot flatter),
        the PSNR of their squared error and the mean of the SSIM map, both pooled over all views
        (each covered pixel counts once, whatever view it is in), and the PSNR on white.
        """
        for name, t in (("pred", pred), ("gt", gt)):
            if not isinstance(t, Tensor) or t.ndim != 4 or t.shape[-1] != 4:
                raise ValueError(f"{name} must be premultiplied RGBA [C, H, W, 4], got {list(getattr(t, 'shape', []))}")
        if pred.shape != gt.shape:
            raise ValueError(f"pred and gt must have the same shape, got {list(pred.shape)} and {list(gt.shape)}")
        pred, gt = pred.detach().float(), gt.detach().float()
        bg = torch.as_tensor(background, dtype=torch.float32, device=pred.device).reshape(3)
        on = lambda x, b: (x[..., :3] + (1 - x[..., 3:]) * b).clamp(0.0, 1.0)   # noqa: E731
        p, g = _channels_first(on(pred, bg)), _channels_first(on(gt, bg))
        ssim, ssim_map = _per_view_ssim_map(p, g)
        self._add_channels_first(p, g, ssim)
        mask = foreground(pred[..., 3], gt[..., 3])[:, None].expand_as(p)    # [C, 3, H, W]
        self._fg_err += ((p - g) ** 2 * mask).double().sum()
        self._fg_pixels += mask.double().sum()
        self._fg_ssim += (ssim_map * mask).double().sum()
        white = torch.ones(3, device=pred.device)
        self._white += _per_view_psnr(_channels_first(on(pred, white)), _channels_first(on(gt, white))).double().sum()
        self._rgba_views += pred.shape[0]

    def _lpips_sum(self, p: Tensor, g: Tensor) -> float:
        try:
            with _LPIPS_LOCK, torch.no_grad():
                metric = self.lpips_model(self.net, p.device)
                metric.reset()
                for i in range(p.shape[0]):             # a view at a time: VGG's activations are large
                    metric.update(p[i:i + 1], g[i:i + 1])
                return float(metric.compute())
        except Exception as e:
            if self._required:
                raise
            # The weights were found but could not be used (e.g. a truncated checkpoint):
            # report LPIPS as unavailable for this evaluation rather than failing it.
            warnings.warn(f"LPIPS disabled: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            self._use_lpips = False
            self.lpips_status = LpipsAvailability(False, f"failed to run: {e}", self.lpips_status.weights)
            return 0.0

    def result(self) -> Quality:
        """Mean over all views added (NaN metrics when none were added)."""
        if self.views == 0:
            nan = float("nan")
            return Quality(nan, nan, nan if self._use_lpips else None, 0)
        n, fg_pixels = self.views, float(self._fg_pixels)         # the one wait for the device
        fg = fg_pixels > 0
        return Quality(float(self._psnr) / n, float(self._ssim) / n, self._lpips / n if self._use_lpips else None, n,
                       psnr_foreground=(_psnr_of(float(self._fg_err) / fg_pixels) if fg else
                                        float("nan") if self._rgba_views else None),
                       psnr_white=float(self._white) / self._rgba_views if self._rgba_views else None,
                       ssim_foreground=(float(self._fg_ssim) / fg_pixels if fg else
                                        float("nan") if self._rgba_views else None))


def image_quality(pred: Tensor, gt: Tensor, *, lpips: bool | str = "auto",
                  lpips_model: Callable[[str, torch.device], torch.nn.Module] = _lpips_model) -> Quality:
    """Mean PSNR, SSIM and LPIPS over views.

    pred: [C, H, W, 3] rendered views in [0, 1]; gt: [C, H, W, 3] ground truth.
    lpips: ``"auto"`` (when the weights are present locally), ``True`` (required) or ``False``.
    lpips_model: the LPIPS metric (:class:`QualityAccumulator`).
    """
    acc = QualityAccumulator(lpips=lpips, lpips_model=lpips_model)
    acc.add(pred, gt)
    return acc.result()


WARMED_UP: set[str] = set()            # the devices :func:`warm_up` has scored on in this process


def warm_up(device: torch.device | str) -> None:
    """Score one small pair of RGBA views on ``device`` as an evaluation scores its views (PSNR, SSIM
    and their foreground figures, no LPIPS), so that the process's first scoring, which loads their
    kernels, happens here: on the GPU machine the first PSNR and SSIM of a first process took 1.1 and
    0.3 s, later ones milliseconds (``benchmarks/experiments/bench_first_use.py``).
    :func:`insitu.step.evaluation.preload_evaluation` calls it on its thread after importing this module."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    side = SSIM_KERNEL + 5
    pred = torch.rand(1, side, side, 4, generator=g).to(device)
    gt = torch.rand(1, side, side, 4, generator=g).to(device)
    acc = QualityAccumulator(lpips=False)
    acc.add_rgba(pred, gt, torch.zeros(3))
    acc.result()
    WARMED_UP.add(str(device))


def psnr(pred: Tensor, gt: Tensor) -> float:
    """Mean per-view PSNR (dB, data range 1) of ``pred: [C, H, W, 3]`` against ``gt: [C, H, W, 3]``.

    A single view ``[H, W, 3]`` is accepted too. Identical images give ``inf``.
    """
    if isinstance(pred, Tensor) and pred.ndim == 3:
        pred = pred[None]
    if isinstance(gt, Tensor) and gt.ndim == 3:
        gt = gt[None]
    _check_pair(pred, gt)
    return float(_per_view_psnr(_channels_first(pred), _channels_first(gt)).mean())
