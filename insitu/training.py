"""Training one rank's shard against its band of the ground-truth images.

Per iteration: render the shard for a batch of views (gsplat on CUDA, the torch
reference elsewhere), composite across ranks sort-last (each rank receives its row
band), L1 + D-SSIM on the band, backward (the compositing collectives run in reverse),
Adam, then rank-local densification (clone / split / prune, with gsplat's
optimizer-aware ops) and a periodic opacity reset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .compositing import composite
from .config import TrainConfig
from .gaussians import Gaussians
from .rendering import rasterize
from .ssim import ssim_map
from .views import Views

PARAM_NAMES = {"means": "means", "scales": "log_scales", "quats": "quats", "opacities": "opacity_logits"}


def to_params(g: Gaussians) -> dict[str, torch.nn.Parameter]:
    """Gaussians -> the parameter dict gsplat's strategy ops work on.

    The SH coefficients are one parameter, ``colors: [N, K, 3]`` (sh0 then shN), the layout the
    rasterizer reads: no per-step copy joins them (:class:`ColorAdam` gives the bands their rates).
    """
    params = {k: torch.nn.Parameter(getattr(g, v).detach().clone().contiguous()) for k, v in PARAM_NAMES.items()}
    params["colors"] = torch.nn.Parameter(torch.cat([g.sh0, g.shN], dim=1).detach().contiguous())
    return params


def from_params(params: dict[str, Tensor]) -> Gaussians:
    colors = params["colors"].detach()
    return Gaussians(**{v: params[k].detach() for k, v in PARAM_NAMES.items()},
                     sh0=colors[:, :1].contiguous(), shN=colors[:, 1:].contiguous())


class ColorAdam(torch.optim.Optimizer):
    """Adam over SH coefficients ``colors: [N, K, 3]``: band 0 (sh0) at ``lr``, the others at ``lr_rest``.

    The same update as ``torch.optim.Adam`` on sh0 and shN apart, in one pass over the joined
    tensor (a Triton kernel on CUDA). State as torch's Adam (``step``, ``exp_avg``,
    ``exp_avg_sq``), so gsplat's densification ops keep it in step with the parameter.
    """

    def __init__(self, params, *, lr: float, lr_rest: float, betas=(0.9, 0.999), eps: float = 1e-15):
        super().__init__(params, dict(lr=lr, lr_rest=lr_rest, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                n = float(state["step"])
                bc1, bc2_sqrt = 1 - b1 ** n, math.sqrt(1 - b2 ** n)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                if p.is_cuda and _adam_kernel is not None and p.is_contiguous() and g.is_contiguous():
                    _adam_kernel[(triton.cdiv(p.numel(), 1024),)](
                        p, g, m, v, p.numel(), p.shape[1], group["lr"] / bc1, group["lr_rest"] / bc1,
                        b1, b2, group["eps"], bc2_sqrt, BLOCK=1024)
                    continue
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / bc2_sqrt).add_(group["eps"])
                p[:, :1].addcdiv_(m[:, :1], denom[:, :1], value=-group["lr"] / bc1)
                p[:, 1:].addcdiv_(m[:, 1:], denom[:, 1:], value=-group["lr_rest"] / bc1)


try:                                    # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl

    @triton.jit
    def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, row, step0, step_rest, b1, b2, eps, bc2_sqrt,
                     BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = tl.load(p_ptr + offs, mask=mask)
        m = m + (1.0 - b1) * (g - m)
        v = b2 * v + (1.0 - b2) * g * g
        lr = tl.where(offs % (row * 3) < 3, step0, step_rest)      # band 0: the first 3 of each row
        p = p - lr * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, p, mask=mask)
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = _adam_kernel = None


def render_bands(params: dict[str, Tensor], views: Views, ids: Tensor, order: Tensor, comm, *,
                 background: Tensor, sh_degree: int, backend: str = "auto",
                 transfer: str = "float32") -> tuple[Tensor, dict]:
    """Render this rank's shard for views ``ids`` and composite across ranks.

    params: the shard (gsplat names, pre-activation).
    order:  [N_views, P] visibility keys of every rank for every view.
    Returns ``pred [B, h_band, W, 3]`` (this rank's row band, background applied) and
    the rasterizer's info (``means2d`` for densification). ``transfer`` is the dtype the
    colour bands travel in between ranks.
    """
    rgb, alpha, info = rasterize(
        params["means"], params["quats"], torch.exp(params["scales"]), torch.sigmoid(params["opacities"]),
        params["colors"], views.viewmats[ids], views.Ks[ids], views.width, views.height,
        sh_degree=sh_degree, backend=backend)
    if not rgb.requires_grad:       # an empty shard: backward must still reach the collectives
        rgb, alpha = rgb.detach().requires_grad_(), alpha.detach().requires_grad_()
    rgba = composite(rgb, alpha, order[ids.to(order.device)], comm,
                     transfer_dtype=None if transfer == "float32" else getattr(torch, transfer))
    return rgba[..., :3] + (1.0 - rgba[..., 3:]) * background, info


def band_loss(pred: Tensor, gt: Tensor, *, ssim_weight: float, band_fraction: float) -> Tensor:
    """(1 - w) L1 + w (1 - SSIM) over the band, scaled so that the ranks' losses sum to the image loss.

    pred, gt: [B, h, W, 3]. SSIM: the mean of :func:`insitu.ssim.ssim_map` (windows inside the band).
    """
    l1 = (pred - gt).abs().mean()
    if ssim_weight > 0 and min(pred.shape[1:3]) >= 11:
        ssim = ssim_map(pred, gt).mean()            # fused Triton kernels on CUDA
        loss = (1 - ssim_weight) * l1 + ssim_weight * (1 - ssim)
    else:
        loss = l1
    return loss * band_fraction


@dataclass
class DensifyState:
    grad2d: Tensor
    count: Tensor

    @staticmethod
    def zeros(n: int, device) -> "DensifyState":
        return DensifyState(torch.zeros(n, device=device), torch.zeros(n, device=device))


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
    total_iterations: length of the learning-rate schedule (default ``cfg.iterations``).
    sh_degree_start: SH degree at iteration 0 (a warm start goes on at the degree it reached);
                     one more band every ``cfg.sh_increase_every`` iterations up to the shard's degree.
    """

    def __init__(self, gaussians: Gaussians, cfg: TrainConfig, *, extent: float, box: tuple[Tensor, Tensor],
                 max_gaussians: int, device, total_iterations: int | None = None, sh_degree_start: int = 0):
        self.cfg = cfg
        self.extent = float(extent)
        self.box = box
        self.max_gaussians = int(max_gaussians)
        self.device = device
        self.total = total_iterations or cfg.iterations
        self.params = to_params(gaussians.to(device))
        self.sh_degree_max = gaussians.sh_degree
        self.sh_degree_start = int(sh_degree_start)
        B = cfg.batch
        lrs = {"means": cfg.lr_means * self.extent, "scales": cfg.lr_scales, "quats": cfg.lr_quats,
               "opacities": cfg.lr_opacities}
        betas = (0.9 ** B, 0.999 ** B)          # batched Adam: lr * sqrt(B), momentum per image kept
        fused = torch.device(device).type == "cuda"     # one kernel per parameter on GPUs
        self.optimizers = {k: torch.optim.Adam([self.params[k]], lr=lr * math.sqrt(B), betas=betas, eps=1e-15,
                                               fused=fused or None)
                           for k, lr in lrs.items()}
        self.optimizers["colors"] = ColorAdam([self.params["colors"]], lr=cfg.lr_sh0 * math.sqrt(B),
                                              lr_rest=cfg.lr_shN * math.sqrt(B), betas=betas, eps=1e-15)
        self.state = DensifyState.zeros(len(gaussians), device)
        self.iteration = 0

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

    def gaussians(self) -> Gaussians:
        return from_params(self.params)

    def _schedule(self) -> None:
        t = min(self.iteration / max(self.total, 1), 1.0)
        lr0 = self.cfg.lr_means * self.extent * math.sqrt(self.cfg.batch)
        lr1 = self.cfg.lr_means_final * self.extent * math.sqrt(self.cfg.batch)
        for group in self.optimizers["means"].param_groups:
            group["lr"] = math.exp((1 - t) * math.log(lr0) + t * math.log(lr1))

    def step(self, render: Callable[[dict], tuple[Tensor, dict]], gt: Tensor, band_fraction: float) -> Tensor:
        """One optimiser step. ``render(params) -> (pred band, info)``; gt: the matching GT band.

        Returns this rank's share of the loss, a 0-dim tensor on the device (reading it waits
        for the GPU, so callers read it only when they show it).
        """
        self._schedule()
        pred, info = render(self.params)
        loss = band_loss(pred, gt, ssim_weight=self.cfg.ssim_weight, band_fraction=band_fraction)
        loss.backward()
        self._accumulate(info)
        for opt in self.optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.iteration += 1
        self._densify()
        with torch.no_grad():                           # after densify: split samples new means too
            self.params["means"].data.clamp_(min=self.box[0], max=self.box[1])
        return loss.detach()

    @torch.no_grad()
    def _accumulate(self, info: dict) -> None:
        m2d = info.get("means2d")
        if m2d is None or m2d.grad is None or len(self) == 0:
            return
        grads = m2d.grad.clone()                        # [C, N, 2] pixels
        grads[..., 0] *= info["width"] / 2.0 * grads.shape[0]
        grads[..., 1] *= info["height"] / 2.0 * grads.shape[0]
        visible = info["radii"] > 0                     # [C, N]
        ids = torch.where(visible)[1]
        self.state.grad2d.index_add_(0, ids, grads[visible].norm(dim=-1))
        self.state.count.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    @torch.no_grad()
    def _densify(self) -> None:
        cfg, it = self.cfg, self.iteration
        until = min(cfg.densify_until, self.total - 1)  # never add untrained Gaussians at the end
        refine = cfg.densify_from < it <= until and it % cfg.densify_every == 0 and len(self) > 0
        # no reset in the second half of training: the model needs iterations to recover from it
        reset = bool(cfg.opacity_reset_every) and it % cfg.opacity_reset_every == 0 \
            and it <= min(cfg.densify_until, self.total // 2)
        if not (refine or reset):                       # most iterations: nothing to do
            return
        from gsplat.strategy.ops import duplicate, remove, reset_opa, split

        state = {"grad2d": self.state.grad2d, "count": self.state.count}   # gsplat's ops keep it in step
        if refine:
            grads = state["grad2d"] / state["count"].clamp_min(1)
            big = torch.exp(self.params["scales"]).max(dim=-1).values > 0.01 * self.extent
            high = grads > cfg.grad_threshold
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
                split(self.params, self.optimizers, state, grow)
            low = torch.sigmoid(self.params["opacities"]) < cfg.prune_opacity
            if it > cfg.opacity_reset_every:
                low |= torch.exp(self.params["scales"]).max(dim=-1).values > 0.1 * self.extent
            if low.any() and int(low.sum()) < len(self):
                remove(self.params, self.optimizers, state, low)
            state["grad2d"].zero_()
            state["count"].zero_()
        if reset:
            reset_opa(self.params, self.optimizers, state, value=cfg.prune_opacity * 2.0)
        self.state = DensifyState(state["grad2d"], state["count"])
