"""A step's figures: the held-out views scored as the layout evaluates (PSNR, SSIM, on the surface's pixels too).

:func:`evaluate` composites the model's views group by group (:func:`composites`) and scores them on rank 0
(:class:`insitu.step.metrics.QualityAccumulator`); :func:`evaluate_trainer` does so for a trainer's model in
its layout, :func:`closer_figures` for the held-out sets off the orbit, and :func:`model_quality` /
:func:`model_figures` for ``model.ply`` as a standard viewer draws it (one global sort). The metrics import
torchmetrics, which takes seconds: :func:`preload_evaluation` imports them on a thread while the step casts
its ground truth, and while that import lasts the initial figures are drawn first and scored after training
(:func:`render_now_score_later`).
"""
from __future__ import annotations

import importlib
import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from insitu.config import Config
from insitu.groundtruth.scene import Scene, view_groups
from insitu.groundtruth.views import HELD_OUT
from insitu.render.compositing import gather_bands
from insitu.render.rendering import STANDARD_EPS2D, gsplat_import_error, rasterize
from insitu.step.layouts import Layout
from insitu.surface.gaussians import Gaussians, gather_gaussians
from insitu.training.appearance import ColorModel, bake_light, standard_light
from insitu.training.ssim import gaussian_window
from insitu.training.trainer import Trainer, render_bands, training_blur

if TYPE_CHECKING:                       # the metrics import torchmetrics: seconds, so only on first use
    from insitu.step.metrics import Quality

Grouping = Callable[[list[int], int, int], list[list[int]]]     # (view ids, width, height) -> groups of them


_PRELOAD: list[threading.Thread] = []


def importing_metrics() -> bool:
    """Whether :func:`preload_evaluation`'s import is still under way."""
    return any(t.is_alive() for t in _PRELOAD)


def preload_evaluation(device: torch.device | None = None) -> None:
    """Import the evaluation's metrics on a background thread, once per process, then (``device``
    given) score a small pair on it (:func:`insitu.step.metrics.warm_up`: the first scoring of a process
    loads its kernels).

    Importing torchmetrics takes seconds on some machines (9–11 s on the GPU machine, where it imports
    transformers and torchvision); started once a step's seeds are drawn and its ray caster is compiled
    (not beside that compilation), the import runs beside ray casting, which
    queues its groups of views without waiting for the device, so that the host mostly waits for the
    device and the import has the interpreter; the first evaluation then finds the module
    imported (or draws now and scores later, :func:`render_now_score_later`). The import holds Python's
    lock for most of its time, and whatever gives the lock up beside it (a torch call, a wait on the
    device) waits to get it back: started before seeding, it put 0.8–1.0 s on the seeds (their marching
    cubes and device work) and 1.5–2 s on the ray casting; started once the ground truth is cast, beside
    training, it put 9.4 s on training. What a step imports lazily itself
    (gsplat and its densification ops, scipy's k-d tree) is imported first, on the calling thread; the step
    imports nothing else that the metrics' import does, so the two threads do not import the same
    modules at once. A failure on the background thread is ignored: the first evaluation then
    imports, and reports the error, as usual.
    """
    if _PRELOAD or "insitu.step.metrics" in sys.modules:
        return
    import scipy.spatial  # noqa: F401 - the warm start's k-d tree
    if gsplat_import_error() is None:
        import gsplat.strategy.ops  # noqa: F401 - densification's

    def run() -> None:
        try:
            metrics = importlib.import_module("insitu.step.metrics")
            if device is not None:
                with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                    metrics.warm_up(device)
        except Exception:       # noqa: BLE001 - the evaluation imports and scores again and raises there
            pass

    thread = threading.Thread(target=run, name="insitu-preload", daemon=True)
    _PRELOAD.append(thread)
    thread.start()



@torch.no_grad()
def evaluate(params: dict, scene: Scene, comm, *, colors: ColorModel, backend: str, keep_images: int = 0,
             ids: list[int] | None = None, drawn: list[Tensor] | None = None, eps2d: float = STANDARD_EPS2D,
             antialiased: bool = False, groups: Grouping = view_groups):
    """PSNR/SSIM(/LPIPS), PSNR and SSIM over the covered pixels and PSNR on white of the sort-last
    composite over the views ``ids`` of the scene (default: the held-out views), in groups of views
    (``groups``: :func:`view_groups`), the model's colours as ``colors`` says; rank 0 also gets (gt, pred) of the
    first ``keep_images``. ``drawn``: those composites drawn before (:func:`composites`), not drawn again.
    ``eps2d``, ``antialiased``: the rasterizer's blur the model was trained with (px^2), and whether it keeps
    each splat's integral (:func:`insitu.render.rendering.rasterize`)."""
    from insitu.step.metrics import QualityAccumulator  # torchmetrics: seconds to import (preload_evaluation)

    acc = QualityAccumulator() if comm.rank == 0 else None
    images = []
    for group, full_pred, full_gt in composites(params, scene, comm, colors=colors, backend=backend, ids=ids,
                                                drawn=drawn, eps2d=eps2d, antialiased=antialiased, groups=groups):
        if comm.rank == 0:
            acc.add_rgba(full_pred, full_gt, scene.background)
            on = lambda x: (x[..., :3] + (1 - x[..., 3:]) * scene.background).clamp(0, 1).cpu()  # noqa: E731
            for j, i in enumerate(group[:max(keep_images - len(images), 0)]):
                images.append((f"view_{i:03d}", on(full_gt[j]), on(full_pred[j])))
    q = acc.result() if comm.rank == 0 else None
    q = comm.mpi.bcast(q, root=0)
    return q, images


def composites(params: dict, scene: Scene, comm, *, colors: ColorModel, backend: str,
               ids: list[int] | None = None, gt: bool = True,
               drawn: list[Tensor] | None = None,
               eps2d: float = STANDARD_EPS2D,
               antialiased: bool = False,
               groups: Grouping = view_groups) -> Iterator[tuple[list[int], Tensor, Tensor]]:
    """The sort-last composites of the views ``ids`` (default: the held-out views) group by group
    (``groups``: :func:`view_groups`): ``(group, pred [c, H, W, 4] premultiplied, gt [c, H, W, 4])``, the images on
    rank 0 (gathered from the bands; ``gt`` False: None); collective. ``drawn``: rank 0's ``pred`` of
    every group, drawn before (any list on the other ranks): only the ground truth is gathered."""
    black = torch.zeros_like(scene.background)
    views = scene.views
    for n, group in enumerate(groups(views.test_ids.tolist() if ids is None else list(ids), views.width,
                                     views.height)):
        chosen = torch.tensor(group, device=comm.device)
        with torch.no_grad():
            if drawn is None:
                pred, info = render_bands(params, views, chosen, scene.order, comm, background=black,
                                          colors=colors, backend=backend, eps2d=eps2d,
                                          antialiased=antialiased)
                full_pred = gather_bands(torch.cat([pred, info["alpha"]], dim=-1).float(), comm)  # premultiplied
            else:
                full_pred = drawn[n].to(comm.device).float() if comm.rank == 0 else None
            full_gt = gather_bands(scene.gt[chosen].float(), comm) if gt else None
        yield group, full_pred, full_gt


def render_now_score_later(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> Callable[[], Quality]:
    """The held-out figures of the trainer's model as it is now, for when torchmetrics is still
    importing (:func:`preload_evaluation`): the composites are drawn now and kept on rank 0's host
    (float16, the ground truth's own precision; ``1/views.test_every`` of the ground truth's
    pixels), and the returned ``score()`` scores them (collective, as :func:`evaluate_trainer`),
    so that training need not wait for the import."""
    colors, backend, blur = trainer.colors, cfg.run.backend, training_blur(cfg)

    def render(comm):
        kept = [pred.half().cpu() for _, pred, _ in
                composites(trainer.params, scene, comm, colors=colors, backend=backend, gt=False, **blur)]
        return None, kept if comm.rank == 0 else []

    _, kept = layout.evaluate(render)
    return lambda: layout.evaluate(lambda comm: evaluate(trainer.params, scene, comm, colors=colors,
                                                         backend=backend, drawn=kept, **blur))[0]


@torch.no_grad()
def model_quality(model: Gaussians | None, scene: Scene, comm, *, backend: str, ids: list[int] | None = None,
                  groups: Grouping = view_groups, antialiased: bool = False, eps2d: float = STANDARD_EPS2D,
                  colors: ColorModel | None = None, blur: float = 0.0, kept: list | None = None,
                  keep_images: int = 0):
    """PSNR and SSIM of the merged model as a splat viewer draws it: all Gaussians in one
    rasterization (one global depth sort, on rank 0) at the SH degree the file holds, with the viewers' blur
    ``eps2d`` (``STANDARD_EPS2D``; ``antialiased``: each splat's opacity scaled to keep its integral, as Spark and
    viewers that read SPZ's flag draw; else added as opaque, as the classic viewers of a .ply), the views ``ids`` of
    the scene (default: the held-out views) on ``scene.background``, in groups of views (``groups``:
    :func:`view_groups`).

    model:  the merged model on rank 0 (what ``model.ply`` holds; :func:`insitu.surface.gaussians.gather_gaussians`),
            None on the other ranks. Collective (the ground-truth bands are gathered).
    colors: how its colours are seen (:class:`insitu.training.appearance.ColorModel`; default its SH bands at its
            degree, as a file holds them); a lit model's are shaded per camera.
    blur:   a Gaussian of this variance (px^2) convolved with every drawn image before it is scored
            (:func:`blurred`; 0: none).
    kept:   a list that rank 0 extends by ``(name, gt [H, W, 3], pred [H, W, 3])`` of the first ``keep_images``
            views, composited on the background (as :func:`evaluate` keeps them).
    Returns the Quality on every rank.
    """
    from insitu.step.metrics import QualityAccumulator  # torchmetrics: seconds to import (preload_evaluation)

    acc = QualityAccumulator(lpips=False) if comm.rank == 0 else None
    if comm.rank == 0:
        g = model.to(comm.device)
        coeffs = torch.cat([g.sh0, g.shN], dim=1)
        seen = colors if colors is not None else ColorModel("sh", g.sh_degree)
    views = scene.views
    for group in groups(views.test_ids.tolist() if ids is None else list(ids), views.width, views.height):
        chosen = torch.tensor(group, device=comm.device)
        full_gt = gather_bands(scene.gt[chosen].float(), comm)
        if comm.rank == 0:
            rgb, sh_degree = seen.colors(g.means, g.quats, coeffs, views.positions[chosen])
            rgb, alpha, _ = rasterize(g.means, g.quats, torch.exp(g.log_scales), torch.sigmoid(g.opacity_logits),
                                      rgb, views.viewmats[chosen], views.Ks[chosen], views.width,
                                      views.height, sh_degree=sh_degree, backend=backend,
                                      eps2d=eps2d, antialiased=antialiased)
            drawn = blurred(torch.cat([rgb, alpha], dim=-1).float(), blur)
            acc.add_rgba(drawn, full_gt, scene.background)
            if kept is not None:
                on = lambda x: (x[..., :3] + (1 - x[..., 3:]) * scene.background).clamp(0, 1).cpu()  # noqa: E731
                for j, i in enumerate(group[:max(keep_images - len(kept), 0)]):
                    kept.append((f"view_{i:03d}", on(full_gt[j]), on(drawn[j])))
    return comm.mpi.bcast(acc.result() if comm.rank == 0 else None, root=0)


def blurred(images: Tensor, variance: float) -> Tensor:
    """``images: [V, H, W, C]`` (premultiplied RGBA, or any channels) convolved with a normalised Gaussian of
    ``variance`` px^2 in each image axis, sampled at the pixel centres as a rasterizer samples a splat (under a
    pixel the samples' own variance is a little less: 0.28 for 0.3), to 3 sigma; what is outside an image counts as
    transparent black. As a viewer's antialiased blur spreads every splat. ``variance`` 0: ``images`` itself."""
    if variance < 0:
        raise ValueError(f"blurred: expected a variance >= 0 px^2, got {variance}")
    if variance == 0:
        return images
    sigma = math.sqrt(variance)
    reach = max(1, math.ceil(3 * sigma))
    k = gaussian_window(2 * reach + 1, sigma, images.device, images.dtype)
    v, h, w, c = images.shape
    x = images.permute(0, 3, 1, 2).reshape(v * c, 1, h, w)
    x = F.conv2d(F.conv2d(x, k.view(1, 1, 1, -1), padding=(0, reach)), k.view(1, 1, -1, 1), padding=(reach, 0))
    return x.reshape(v, c, h, w).permute(0, 2, 3, 1)


def viewer_blur(cfg: Config) -> float:
    """The variance (px^2) that standard viewers' blur (``STANDARD_EPS2D``, which they add to every splat) adds to
    the image of a model of ``cfg`` drawn as trained (with ``train.eps2d``): the difference, at least 0."""
    return max(0.0, STANDARD_EPS2D - cfg.train.eps2d)


def evaluate_trainer(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config, *, colors: ColorModel,
                     keep_images: int = 0, ids: list[int] | None = None):
    """:func:`evaluate` of the trainer's model with ``colors`` on the views ``ids`` (default: the
    held-out views) as ``layout`` evaluates; collective. Returns the Quality on every rank and rank
    0's ``keep_images`` (name, gt, pred) images."""
    return layout.evaluate(lambda comm: evaluate(trainer.params, scene, comm, colors=colors,
                                                 backend=cfg.run.backend, keep_images=keep_images, ids=ids,
                                                 **training_blur(cfg)))


def closer_figures(trainer: Trainer, scene: Scene, layout: Layout, cfg: Config) -> dict[str, Quality]:
    """The trained model's figures on each held-out set off the orbit (``near2``, ``near3``, ``off``:
    :data:`insitu.groundtruth.views.HELD_OUT`) that the scene has; collective."""
    return {role: evaluate_trainer(trainer, scene, layout, cfg, colors=trainer.colors_trained,
                                   ids=scene.views.ids(role).tolist())[0]
            for role in HELD_OUT[1:] if len(scene.views.ids(role))}


PLY_ROLES = ("test", "near2", "near3")     # the held-out views the standard files' figures score


def model_figures(shard: Gaussians, ply: Gaussians, scene: Scene, layout: Layout, cfg: Config, *,
                  kept: list | None = None) -> tuple[Gaussians | None, dict[str, Quality] | None]:
    """With ``output.ply_metrics``: the merged model on rank 0 (as trained, for the report's viewer; None
    on the other ranks) and the figures of what ``model.ply`` holds (this rank's shard of it: ``ply``) as
    a viewer draws it (:func:`standard_figures`, which keeps images in ``kept``) against ``scene``'s ground truth
    (the standard files' scene: :func:`insitu.step.plyfit.model_ply`); else ``(None, None)``. Collective."""
    if not cfg.output.ply_metrics:
        return None, None
    merged = gather_gaussians(shard.to("cpu"), layout.comm.mpi)
    if ply is shard:                                # the same choice on every rank: the model is gathered once
        return merged, standard_figures(merged, scene, layout, cfg, gathered=True, kept=kept)
    return merged, standard_figures(ply, scene, layout, cfg, kept=kept)


def standard_figures(model: Gaussians | None, scene: Scene, layout: Layout, cfg: Config, *,
                     antialiased: bool = False, gathered: bool = False, kept: list | None = None,
                     **drawing) -> dict[str, Quality]:
    """The figures of a standard file's model (this rank's shard of it: ``model``; with ``gathered``, the same
    on every rank: the model already gathered on rank 0, None on the others) as a viewer draws it
    (:func:`model_quality`, ``antialiased`` or not; ``drawing``: its other drawing settings) against ``scene``'s
    ground truth, by held-out set: the orbit's (``test``) and the close-ups' of :data:`PLY_ROLES` that ``scene``
    has. ``kept``: rank 0 extends it by the first ``output.images`` orbit views (:func:`model_quality`).
    Collective."""
    whole = model if gathered else gather_gaussians(model.to("cpu"), layout.comm.mpi)
    figures = {}
    for role in PLY_ROLES:
        ids = scene.views.ids(role).tolist()
        if role == "test" or ids:
            keep = dict(kept=kept, keep_images=cfg.output.images) if role == "test" and kept is not None else {}
            figures[role], _ = layout.evaluate(lambda comm: (model_quality(whole, scene, comm, ids=ids,
                                                                           backend=cfg.run.backend,
                                                                           antialiased=antialiased,
                                                                           **keep, **drawing), []))
    return figures


def bound_figures(trained: Gaussians | None, scene: Scene, layout: Layout, cfg: Config, *,
                  colors: ColorModel) -> dict[str, Quality]:
    """The standard files' bound: the trained model's images as trained, in the files' light, blurred by what the
    viewers' 0.3 px^2 adds to training's blur (:func:`viewer_blur`, :func:`blurred`), scored against ``scene``'s
    ground truth (the standard files' scene: :func:`insitu.step.plyfit.model_ply`) on the held-out sets of
    :func:`standard_figures`.

    Every viewer of a standard file adds 0.3 px^2 to every splat: a perfect file would show the trained model's
    image blurred so, and no file shows better (but for noise: a file refit as drawn can sharpen a little what the
    blur spreads). The same bound holds for viewers that draw antialiased (model.spz: the blur keeps each splat's
    integral, as the convolution does) and for classic ones (model.ply: they add it as opaque, which a file can
    offset for one size on screen only, by fainter Gaussians). ``trained``: the trained model gathered on rank 0
    (None on the other ranks) in its own colours, seen as ``colors`` says (the trainer's ``colors_trained``); a lit
    model whose files are lit by the fixed light (:func:`insitu.training.appearance.standard_light`) is drawn in it
    (:func:`insitu.training.appearance.bake_light`). Collective."""
    light = standard_light(cfg)
    if light is not None and colors.kind == "lit":
        trained = bake_light(trained, light) if trained is not None else None
        colors = ColorModel("sh", 0)
    return standard_figures(trained, scene, layout, cfg, gathered=True, colors=colors, blur=viewer_blur(cfg),
                            **training_blur(cfg))


def file_metrics(figures: dict[str, Quality] | None, prefix: str = "ply") -> dict:
    """metrics.json's figures of a standard file (:func:`standard_figures`; None: each figure None), named after
    it by ``prefix`` (``ply``: model.ply, ``spz``: model.spz; ``bound``: their bound, :func:`bound_figures`): ``PREFIX_psnr_foreground``, ``PREFIX_ssim_foreground``,
    ``PREFIX_psnr`` and ``PREFIX_ssim`` on the orbit's held-out views, and ``PREFIX_psnr_foreground_ROLE``,
    ``PREFIX_ssim_foreground_ROLE`` on each set of close-ups."""
    q = figures["test"] if figures else None
    out = {f"{prefix}_psnr_foreground": q and q.psnr_foreground, f"{prefix}_ssim_foreground": q and q.ssim_foreground,
           f"{prefix}_psnr": q and q.psnr, f"{prefix}_ssim": q and q.ssim}
    for role, qr in (figures or {}).items():
        if role != "test":
            out[f"{prefix}_psnr_foreground_{role}"] = qr.psnr_foreground
            out[f"{prefix}_ssim_foreground_{role}"] = qr.ssim_foreground
    return out


def target_reached(q, tc) -> bool:
    """True when a quality target is set and every target that is set is met, on the foreground (the
    covered pixels: a black background would flatter a full-image figure)."""
    if tc.psnr_target is None and tc.ssim_target is None:
        return False
    return ((tc.psnr_target is None or q.psnr_foreground >= tc.psnr_target)
            and (tc.ssim_target is None or q.ssim_foreground >= tc.ssim_target))

