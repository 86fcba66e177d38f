"""Training one rank's shard against its band of the ground-truth images.

Per iteration: render the shard for a batch of views (gsplat on CUDA, the torch
reference elsewhere), composite across ranks sort-last (each rank receives its row
band), L1 + D-SSIM on the band (:mod:`insitu.training.bandloss`: the SSIM windows reach 5 rows into
the neighbouring bands, so the ranks' losses sum to the whole image's), backward (the compositing
collectives run in reverse), Adam, then rank-local densification (clone / split / prune,
with gsplat's optimizer-aware ops) and a periodic opacity reset. Render and ground truth
are composited on the same background, a random one per view and iteration by default,
so that the opacities learn the ground truth's alpha (``train.random_background``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from insitu.config import Config, TrainConfig
from insitu.groundtruth.views import Views
from insitu.render.compositing import composite, foreground, over
from insitu.render.rendering import STANDARD_EPS2D, rasterize
from insitu.render.shading import deferred_sh_gradients
from insitu.surface.gaussians import Gaussians, rgb_to_sh0
from insitu.training.adam import ShardAdam
from insitu.training.appearance import ColorModel, quat_normals
from insitu.training.bandloss import band_loss

PARAM_NAMES = {"means": "means", "scales": "log_scales", "quats": "quats", "opacities": "opacity_logits"}


# What each tensor of a shard holds, in words, by its trainer name (PARAM_NAMES, "colors") or Gaussians field name
PARAM_WORDS = {"means": "means", "scales": "scales", "log_scales": "scales", "quats": "rotations",
               "opacities": "opacities", "opacity_logits": "opacities", "colors": "colours", "sh0": "colours",
               "shN": "colours"}


def nonfinite(tensors: dict[str, Tensor]) -> list[str]:
    """What of a shard holds NaN or infinite values: the words of ``PARAM_WORDS`` for the names of
    ``tensors`` (the trainer's ``params``, or ``Gaussians.tensors()``) that do, in order, each once.
    One wait for the device, however many tensors: for the points where the caller reads from it anyway."""
    if not tensors:
        return []
    flags = torch.stack([torch.isfinite(t.detach()).all() for t in tensors.values()])   # (a shard: one device)
    words = [PARAM_WORDS.get(name, name) for name, ok in zip(tensors, flags.tolist()) if not ok]
    return list(dict.fromkeys(words))


def training_blur(cfg: Config) -> dict:
    """The rasterizer's pixel filter a step trains and is evaluated with: ``eps2d`` and ``antialiased``
    keyword arguments (:func:`insitu.render.rendering.rasterize`) from ``cfg.train``."""
    return {"eps2d": cfg.train.eps2d, "antialiased": cfg.train.antialiased}


def to_params(g: Gaussians) -> dict[str, torch.nn.Parameter]:
    """Gaussians -> the parameter dict gsplat's strategy ops work on.

    The SH coefficients are one parameter, ``colors: [N, K, 3]`` (sh0 then shN), the layout the
    rasterizer reads: no per-step copy joins them (:class:`insitu.training.adam.ShardAdam` gives the bands their rates).
    """
    params = {k: torch.nn.Parameter(getattr(g, v).detach().clone().contiguous()) for k, v in PARAM_NAMES.items()}
    params["colors"] = torch.nn.Parameter(torch.cat([g.sh0, g.shN], dim=1).detach().contiguous())
    return params


def from_params(params: dict[str, Tensor]) -> Gaussians:
    colors = params["colors"].detach()
    return Gaussians(**{v: params[k].detach() for k, v in PARAM_NAMES.items()},
                     sh0=colors[:, :1].contiguous(), shN=colors[:, 1:].contiguous())


def render_bands(params: dict[str, Tensor], views: Views, ids: Tensor, order: Tensor, comm, *,
                 background: Tensor, colors: ColorModel | None, backend: str = "auto",
                 transfer: str = "float32", eps2d: float = STANDARD_EPS2D,
                 antialiased: bool = False) -> tuple[Tensor, dict]:
    """Render this rank's shard for views ``ids`` and composite across ranks.

    params: the shard (gsplat names, pre-activation).
    order:  [N_views, P] visibility keys of every rank for every view.
    background: [3] or [B, 3] (one per view) colour behind the model.
    colors: how ``params["colors"]`` ([N, K, 3]) give the colours seen from the views
            (:class:`insitu.training.appearance.ColorModel`); None: they are plain RGB, [N, 3].
    Returns ``pred [B, h_band, W, 3]`` (this rank's row band, background applied) and
    the rasterizer's info (``means2d`` for densification) plus ``alpha [B, h_band, W, 1]``,
    the band's composited alpha. ``transfer`` is the dtype the colour bands travel in
    between ranks.
    """
    viewmats = views.viewmats[ids]
    if colors is None:
        rgb, sh_degree = params["colors"], None
    else:
        rgb, sh_degree = colors.colors(params["means"], params["quats"], params["colors"],
                                       views.positions[ids])
    rgb, alpha, info = rasterize(
        params["means"], params["quats"], torch.exp(params["scales"]), torch.sigmoid(params["opacities"]),
        rgb, viewmats, views.Ks[ids], views.width, views.height, sh_degree=sh_degree, backend=backend, eps2d=eps2d,
        antialiased=antialiased)
    if not rgb.requires_grad:       # an empty shard: backward must still reach the collectives
        rgb, alpha = rgb.detach().requires_grad_(), alpha.detach().requires_grad_()
    if comm.size > 1:               # one rank holds the whole image: nothing to composite
        rgba = composite(rgb, alpha, order[ids.to(order.device)], comm,
                         transfer_dtype=None if transfer == "float32" else getattr(torch, transfer))
        rgb, alpha = rgba[..., :-1], rgba[..., -1:]
    info["alpha"] = alpha
    return over(rgb, alpha, background), info


def colors_from_images(gaussians: Gaussians, views: Views, ids: Tensor, order: Tensor, gt: Tensor, comm, *,
                       backend: str = "auto", batch: int = 1, only: Tensor | None = None,
                       eps2d: float = STANDARD_EPS2D, antialiased: bool = False) -> Gaussians:
    """Each Gaussian's colour (SH band 0) from the ground-truth pixels it covers; collective over ``comm``.

    gaussians: this rank's shard.
    views:     every view; ``ids: [V]`` the ones to read, ``order: [N_views, P]`` the ranks' visibility keys.
    gt:        [N_views, h_band, W, 4] this rank's band of every view, premultiplied RGBA.
    only:      [N] bool, the Gaussians whose colour is set (default: all); the others keep theirs
               but still occlude.
    The colour of Gaussian i is ``sum_p w_i(p) gt_rgb(p) / sum_p w_i(p) gt_alpha(p)`` over the pixels
    p of the views, ``w_i(p)`` its blending weight in the composited render (opacity times the
    transmittance in front of it, across ranks): the mean unpremultiplied ground-truth colour where
    the Gaussian shows. Both sums are gradients of the render with respect to the colours, so the
    distributed render's backward computes them exactly, on any number of ranks, one pass over
    the views. A Gaussian that shows in no view keeps its colour; higher SH bands are untouched.
    """
    if gt.ndim != 4 or gt.shape[-1] != 4 or gt.shape[0] != len(views):
        raise ValueError(f"gt: expected [{len(views)}, h_band, W, 4], got {tuple(gt.shape)}")
    n = len(gaussians)
    device, dtype = gaussians.means.device, gaussians.means.dtype
    colors = torch.ones(n, 3, device=device, dtype=dtype, requires_grad=True)   # the render is linear in them
    params = {"means": gaussians.means.detach(), "quats": gaussians.quats.detach(),
              "scales": gaussians.log_scales.detach(), "opacities": gaussians.opacity_logits.detach(),
              "colors": colors}
    num, den = torch.zeros(n, 3, device=device, dtype=dtype), torch.zeros(n, device=device, dtype=dtype)
    black = torch.zeros(3, device=device, dtype=dtype)
    for chunk in torch.as_tensor(ids, device=device).split(max(int(batch), 1)):
        pred, _ = render_bands(params, views, chunk, order, comm, background=black, colors=None,
                               backend=backend, eps2d=eps2d, antialiased=antialiased)
        target = gt[chunk.to(gt.device)].to(device=device, dtype=dtype)
        (pred * target[..., :3]).sum().backward(retain_graph=True)      # every rank: the collectives
        if colors.grad is not None:
            num += colors.grad
            colors.grad = None
        (pred[..., 0] * target[..., 3]).sum().backward()
        if colors.grad is not None:
            den += colors.grad[:, 0]
            colors.grad = None
    seen = den > 1e-6
    if only is not None:
        seen &= only.to(device)
    rgb = (num[seen] / den[seen, None]).clamp(0.0, 1.0)
    sh0 = gaussians.sh0.detach().clone()
    sh0[seen] = rgb_to_sh0(rgb)[:, None, :].to(sh0.dtype)
    return Gaussians(gaussians.means, gaussians.log_scales, gaussians.quats, gaussians.opacity_logits,
                     sh0, gaussians.shN)


def footprint_errors(params: dict[str, Tensor], views: Views, ids: Tensor, order: Tensor, comm, error: Tensor, *,
                     backend: str = "auto", transfer: str = "float32", eps2d: float = STANDARD_EPS2D,
                     antialiased: bool = False) -> Tensor:
    """``[N, 2]`` for each Gaussian of this rank's shard: the per-pixel ``error`` ([B, h, W, 1], this rank's
    band of views ``ids``) summed over the pixels it shows in, weighted by its blending weight in the
    composited render, and that weight summed; collective over ``comm``.

    The composited render is linear in the Gaussians' colours, so both sums are gradients: of the render
    of two channels of ones, against ``(error, 1)`` per pixel. The geometry is held fixed (nothing else
    gets a gradient), the weights include the transmittance through the other ranks' layers, and a pixel
    of another rank's band reaches the Gaussian through the compositing's backward: the sums are the
    one-rank sums on any number of ranks.
    """
    n = params["means"].shape[0]
    ones = torch.ones(len(ids), n, 2, device=params["means"].device, dtype=params["means"].dtype,
                      requires_grad=True)
    with torch.enable_grad():
        ch, alpha, _ = rasterize(params["means"].detach(), params["quats"].detach(),
                                 torch.exp(params["scales"].detach()), torch.sigmoid(params["opacities"].detach()),
                                 ones, views.viewmats[ids], views.Ks[ids], views.width, views.height,
                                 sh_degree=None, backend=backend, eps2d=eps2d, antialiased=antialiased)
        if not ch.requires_grad:       # an empty shard: backward must still reach the collectives
            ch = ch.detach().requires_grad_()
        if comm.size > 1:
            ch = composite(ch, alpha.detach(), order[ids.to(order.device)], comm,
                           transfer_dtype=None if transfer == "float32" else getattr(torch, transfer))[..., :-1]
        guide = torch.cat([error.to(ch.dtype), torch.ones_like(error, dtype=ch.dtype)], dim=-1)
        grad = torch.autograd.grad(ch, ones, guide, allow_unused=True)[0]
    return grad.sum(0) if grad is not None else ones.new_zeros(n, 2)


def footprint_sides(params: dict[str, Tensor], views: Views, ids: Tensor, order: Tensor, comm, *,
                    rows: tuple[int, int], backend: str = "auto", transfer: str = "float32",
                    eps2d: float = STANDARD_EPS2D, antialiased: bool = False) -> Tensor:
    """``[N, 2]`` for each Gaussian of this rank's shard its footprint in views ``ids`` (its blending
    weight summed over their pixels, as the composited render shows it: its area in pixels times its
    opacity and the transmittance in front of it, across ranks), summed over the views that see its
    front (the side its normal, the local z axis of its rotation, points to) and over all of them.
    One :func:`footprint_errors` per view (``rows``: this rank's band of image rows); collective over
    ``comm``. Memory: the two sums only, whatever the number of views."""
    means = params["means"]
    ids = torch.as_tensor(ids, device=means.device)
    sides = means.new_zeros(means.shape[0], 2)
    zero = means.new_zeros(1, rows[1] - rows[0], views.width, 1)
    with torch.no_grad():
        normals = quat_normals(params["quats"].detach())
        cameras = views.positions[ids].to(means.device)
        for k in range(len(ids)):
            w = footprint_errors(params, views, ids[k:k + 1], order, comm, zero, backend=backend,
                                 transfer=transfer, eps2d=eps2d, antialiased=antialiased)[:, 1]
            front = ((cameras[k] - means.detach()) * normals).sum(1) > 0
            sides[:, 0] += w * front
            sides[:, 1] += w
    return sides


@dataclass
class DensifyState:
    """Per-Gaussian statistics between two refines: ``grad2d``, ``count`` (the screen-space gradient
    criterion), both [N]."""

    grad2d: Tensor
    count: Tensor

    @staticmethod
    def zeros(n: int, device) -> "DensifyState":
        return DensifyState(*(torch.zeros(n, device=device) for _ in range(2)))

    def as_dict(self) -> dict[str, Tensor]:
        return {"grad2d": self.grad2d, "count": self.count}


@dataclass
class TrainResult:
    gaussians: Gaussians
    iterations: int
    seconds: float
    history: list[dict] = field(default_factory=list)


class Trainer:
    """Adam over one shard, with the reference 3DGS learning rates, schedules and densification.

    gaussians:    the initial shard.
    extent:       scene extent (radius of the global bounds) that scales position learning rates.
    box:          (lo [3], hi [3]) the means stay inside (this rank's block plus a margin).
    max_gaussians: this rank's cap for densification.
    total_iterations: the iterations this trainer runs (default ``cfg.iterations``): densification and opacity
                  resets keep clear of their end.
    schedule:     length of the means' learning-rate schedule (default ``total_iterations``); a warm step runs
                  the first ``total_iterations`` of a cold step's (``cfg.iterations``).
    settled:      [N] bool, the Gaussians a warm start kept (trained already): their opacities learn at
                  ``SETTLED_OPACITY_RATE`` of ``cfg.lr_opacities`` (Adam, restarted, moves every opacity by about its
                  full rate in its first steps, whatever its gradient: on a trained model, noise that a model of an
                  unchanged field lost quality by, step after step); the others at the full rate. None: all full.
    sh_degree_start: SH degree at iteration 0 (a warm start goes on at the degree it reached);
                     one more band every ``cfg.sh_increase_every`` iterations up to the shard's degree.
    replicas:     data parallelism: the ranks of this Comm each hold the same whole model and
                  train it on their own ``cfg.batch`` views; after every backward pass the
                  gradients and the densification statistics are averaged / summed over them (one
                  all-reduce), so every replica takes the same step, the one a single rank takes
                  with all ``cfg.batch * P`` views (learning rate and betas scaled for that batch).
    pixel_size:   ``pixel_size(means [N, 3]) -> [N]`` the world size of a pixel of the nearest training
                  view at each centre: the scale floor's (``cfg.min_scale_px``).
    """

    def __init__(self, gaussians: Gaussians, cfg: TrainConfig, *, extent: float, box: tuple[Tensor, Tensor],
                 max_gaussians: int, device, total_iterations: int | None = None, schedule: int | None = None,
                 settled: Tensor | None = None, sh_degree_start: int = 0, replicas=None,
                 pixel_size: Callable[[Tensor], Tensor] | None = None):
        self.cfg = cfg
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.images_per_step = cfg.batch * (self.replicas.size if self.replicas else 1)
        self.extent = float(extent)
        self.box = box
        self.max_gaussians = int(max_gaussians)
        self.device = device
        self.total = total_iterations or cfg.iterations
        self.schedule = schedule or self.total
        self.params = to_params(gaussians.to(device))
        self.sh_degree_max = gaussians.sh_degree
        self.sh_degree_start = int(sh_degree_start)
        B = self.images_per_step
        root = math.sqrt(B)                     # batched Adam: lr * sqrt(B), momentum per image kept
        lrs = {"means": cfg.lr_means * self.extent * root, "scales": cfg.lr_scales * root,
               "quats": cfg.lr_quats * root, "opacities": cfg.lr_opacities * root,
               "colors": (cfg.lr_sh0 * root, cfg.lr_shN * root)}
        self.adam = ShardAdam(self.params, lrs, betas=(0.9 ** B, 0.999 ** B), eps=1e-15)
        self.optimizers = self.adam.views       # what gsplat's densification ops update
        self.state = DensifyState.zeros(len(gaussians), device)
        self.opacity_rate = None                # [N] each opacity's share of its update (settled), or None
        if settled is not None:
            if settled.shape != (len(gaussians),):
                raise ValueError(f"settled: expected [N] = [{len(gaussians)}] flags, got shape {tuple(settled.shape)}")
            self.opacity_rate = torch.where(settled.to(device), self.SETTLED_OPACITY_RATE, 1.0).float()
        self.iteration = 0
        self.pixel_size = pixel_size
        self._floor: Tensor | None = None        # log scale floor [N], refreshed by _scale_floor
        self._floor_of = -1                      # the count it was computed for

    SETTLED_OPACITY_RATE = 0.1     # a warm start's kept Gaussians: their opacities' share of the learning rate

    def __len__(self) -> int:
        return self.params["means"].shape[0]

    @property
    def sh_degree(self) -> int:
        """SH degree the next iteration trains."""
        return self._sh_degree_at(self.iteration)

    @property
    def sh_degree_trained(self) -> int:
        """SH degree the last iteration trained (the start degree before any): the one to render with."""
        return self._sh_degree_at(max(self.iteration - 1, 0))

    def _sh_degree_at(self, iteration: int) -> int:
        return min(self.sh_degree_max, self.sh_degree_start + iteration // self.cfg.sh_increase_every)

    @property
    def colors(self) -> ColorModel:
        """The colour model the next iteration trains (SH: at the schedule's degree)."""
        return ColorModel(self.cfg.color_model, self.sh_degree)

    @property
    def colors_trained(self) -> ColorModel:
        """The colour model the last iteration trained: the one to render with."""
        return ColorModel(self.cfg.color_model, self.sh_degree_trained)

    def gaussians(self) -> Gaussians:
        return from_params(self.params)

    def _schedule(self) -> None:
        t = min(self.iteration / max(self.schedule, 1), 1.0)
        lr0 = self.cfg.lr_means * self.extent * math.sqrt(self.images_per_step)
        lr1 = self.cfg.lr_means_final * self.extent * math.sqrt(self.images_per_step)
        if lr0 <= 0:                                            # the means stay where they are
            lr = 0.0
        elif lr1 <= 0:                                          # to 0: linearly (no exponential reaches it)
            lr = (1 - t) * lr0
        else:
            lr = math.exp((1 - t) * math.log(lr0) + t * math.log(lr1))
        for group in self.optimizers["means"].param_groups:
            group["lr"] = lr

    def step(self, render: Callable[[dict], tuple[Tensor, dict]], gt: Tensor, *, rows: tuple[int, int],
             height: int, comm=None, gt_alpha: Tensor | None = None) -> Tensor:
        """One optimiser step. ``render(params) -> (pred band, info)``; gt: the matching GT band,
        rows ``rows`` of images of ``height`` rows (:func:`band_loss`; collective over ``comm``).
        gt_alpha: [B, h, W, 1] the band's ground-truth alpha; with ``cfg.pixel_loss`` "l2" it and the
        rendered alpha (``info["alpha"]``) give the foreground (alpha > 1/255 in either) whose mean
        |error| scales the squared error.

        Returns this rank's share of the loss, a 0-dim tensor on the device (reading it waits
        for the GPU, so callers read it only when they show it).
        """
        self._schedule()
        with deferred_sh_gradients() as sh:         # the SH colours' gradient stays factored for Adam
            pred, info = render(self.params)
        covered = None
        if self.cfg.pixel_loss == "l2" and gt_alpha is not None:   # what psnr_foreground scores
            covered = foreground(gt_alpha, info["alpha"].detach())
        loss = band_loss(pred, gt, ssim_weight=self.cfg.ssim_weight, rows=rows, height=height, comm=comm,
                         pixel=self.cfg.pixel_loss, foreground=covered, scale_comm=self.replicas)
        loss.backward()
        ahead = self._refines_ahead()
        seen = self._visible_gradients(info) if ahead else None
        if self.replicas is not None:
            sh.accumulate(self.params["colors"])    # the all-reduce sums gradients written out
            seen = self._all_reduce(seen)
        if seen is not None:
            self.state.grad2d += seen[0]
            self.state.count += seen[1]
        before = self.params["opacities"].detach().clone() if self.opacity_rate is not None else None
        self.adam.step(sh)
        if before is not None:                      # the settled ones' opacities: a share of Adam's step
            opacities = self.params["opacities"].data
            opacities.copy_(torch.lerp(before, opacities, self.opacity_rate))
        self.adam.zero_grad()
        self.iteration += 1
        self._densify()
        with torch.no_grad():                           # after densify: split samples new means too
            self.params["means"].data.clamp_(min=self.box[0], max=self.box[1])
            scales = self.params["scales"].data
            if self.cfg.min_scale_px > 0 and self.pixel_size is not None:
                scales[:, :2].clamp_(min=self._scale_floor()[:, None])  # in-plane (z: the normal)
            scales[:, 2].clamp_(min=scales[:, :2].amax(1) + self.THINNEST)
        return loss.detach()

    FLOOR_EVERY = 100                                   # iterations between refreshes of the scale floor
    THINNEST = math.log(1e-3)   # a disc's thickness over its in-plane size, at least (log): the square, its
                                # covariance's smallest eigenvalue over its largest, stays 8 times float32's
                                # resolution; a disc of 6e-5 over 0.26 (5e-8) made a sphere's training non-finite
                                # after 1222 iterations (its covariance no longer positive in float32)

    def _scale_floor(self) -> Tensor:
        """``[N]`` the log of ``cfg.min_scale_px`` pixels of the nearest training view that sees each
        Gaussian's centre (``pixel_size``; -inf where none does), refreshed every ``FLOOR_EVERY`` iterations
        and whenever densification changed the count: at the training views' distance the rasterizer's
        blur hides gaps between Gaussians smaller than a pixel, which a camera closer than every training
        view shows."""
        n = len(self)
        if self._floor_of != n or self.iteration % self.FLOOR_EVERY == 0:
            self._floor_of = n
            size = self.pixel_size(self.params["means"].detach())
            seen = torch.isfinite(size)
            log = torch.log(torch.where(seen, size, torch.ones_like(size))).to(self.params["scales"].dtype)
            self._floor = torch.where(seen, log + math.log(self.cfg.min_scale_px), torch.full_like(log, -math.inf))
        return self._floor

    def _refines_ahead(self) -> bool:
        """Whether a densification refine comes after this iteration (else its statistics go unused)."""
        until = min(self.cfg.densify.stop, self.total - 1)
        return max(self.iteration, self.cfg.densify.start) < until

    @torch.no_grad()
    def _visible_gradients(self, info: dict) -> tuple[Tensor, Tensor] | None:
        """This step's ``(grad2d [N], count [N])``: each Gaussian's screen-space gradient norm
        (pixels) summed over the views that see it, and their number; dense, no host sync."""
        m2d = info.get("means2d")
        if m2d is None or m2d.grad is None or len(self) == 0:
            return None
        g, C = m2d.grad, m2d.grad.shape[0]              # [C, N, 2], in NDC units: scaled to pixels
        norm = torch.hypot(g[..., 0] * (info["width"] / 2.0 * C), g[..., 1] * (info["height"] / 2.0 * C))
        visible = info["radii"] > 0                     # [C, N]
        return (norm * visible).sum(0), visible.sum(0).to(norm.dtype)

    @torch.no_grad()
    def _all_reduce(self, seen: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """Average the parameters' gradients and sum the densification statistics (``seen``) over the
        replicas, in one all-reduce. Every replica then holds the same values, so their steps (and their
        densification) stay identical."""
        n = len(self)
        if seen is None:
            seen = (torch.zeros(n, device=self.device), torch.zeros(n, device=self.device))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params.values()]
        flat = torch.cat([g.reshape(-1) for g in grads] + [seen[0], seen[1]])
        self.replicas.traffic.add(2 * flat.numel() * flat.element_size() * (self.replicas.size - 1)
                                  / self.replicas.size)
        dist.all_reduce(flat, group=self.replicas.group)
        P, offset = self.replicas.size, 0
        for p, g in zip(self.params.values(), grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).div_(P)
            offset += g.numel()
        return flat[offset:offset + n], flat[offset + n:offset + 2 * n]

    def _too_big_to_clone(self) -> Tensor:
        """``[N]`` bool: the Gaussians that densification splits rather than clones: gsplat's rule, those
        whose largest standard deviation exceeds 1% of the scene's extent."""
        largest = torch.exp(self.params["scales"]).max(dim=-1).values
        return largest > 0.01 * self.extent

    @torch.no_grad()
    def _densify(self) -> None:
        cfg, it = self.cfg, self.iteration
        until = min(cfg.densify.stop, self.total - 1)  # never add untrained Gaussians at the end
        refine = cfg.densify.start < it <= until and it % cfg.densify.every == 0 and len(self) > 0
        # no reset in the second half of training: the model needs iterations to recover from it
        reset = bool(cfg.densify.reset_every) and it % cfg.densify.reset_every == 0 \
            and it <= min(cfg.densify.stop, self.total // 2)
        if not (refine or reset):                       # most iterations: nothing to do
            return
        from gsplat.strategy.ops import duplicate, remove, reset_opa, split  # gsplat: lazy, seconds to import

        state = self.state.as_dict()            # gsplat's ops keep every tensor of it in step
        if self.opacity_rate is not None:       # (copies and split halves of a settled Gaussian: settled too)
            state["opacity_rate"] = self.opacity_rate
        if refine:
            grads = state["grad2d"] / state["count"].clamp_min(1)
            big = self._too_big_to_clone()
            high = grads > cfg.densify.grad_threshold
            room = max(self.max_gaussians - len(self), 0)
            clone, grow = high & ~big, high & big
            if int(clone.sum() + grow.sum()) > room:    # keep the cap: grow the strongest first
                keep = torch.zeros_like(high)
                top = torch.topk(torch.where(high, grads, -1.0), k=room).indices if room else grads[:0].long()
                keep[top] = True
                clone, grow = clone & keep, grow & keep
            if clone.any():
                duplicate(self.params, self.optimizers, state, clone)
                grow = torch.cat([grow, torch.zeros(int(clone.sum()), dtype=torch.bool, device=grow.device)])
            if grow.any():
                # the split's samples from a generator seeded by the step: the same on every replica
                # (run.layout=replicated) whatever else drew random numbers on some ranks only
                cuda = [self.device] if torch.device(self.device).type == "cuda" else []
                with torch.random.fork_rng(devices=cuda):
                    torch.manual_seed(self.cfg.seed * 1_000_003 + it)
                    split(self.params, self.optimizers, state, grow)
            low = torch.sigmoid(self.params["opacities"]) < cfg.densify.prune_opacity
            if it > cfg.densify.reset_every:
                low |= torch.exp(self.params["scales"]).max(dim=-1).values > 0.1 * self.extent
            if low.any() and int(low.sum()) < len(self):
                remove(self.params, self.optimizers, state, low)
        if self.opacity_rate is not None:
            self.opacity_rate = state.pop("opacity_rate")
        if refine:
            for v in state.values():
                v.zero_()
        if reset:
            reset_opa(self.params, self.optimizers, state, value=cfg.densify.prune_opacity * 2.0)
        self.state = DensifyState(**state)
