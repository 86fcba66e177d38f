"""One timestep, as data flows: block -> seeds -> shard -> views -> GT bands -> train -> evaluate -> export.

``run_step`` is collective: every rank of ``comm`` calls it with its own block. Nothing
of the volume or of the Gaussians moves between ranks during training; only images
do (sort-last compositing). Failures on one rank are agreed at phase boundaries, so
every rank ends with the same clear error instead of waiting in a collective.
"""
from __future__ import annotations

import importlib
import math
import sys
import threading
import time as _time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from .compositing import band_rows, composite_full, gather_bands, over, visibility_order
from .config import Config
from .decomposition import Decomposition, decompose
from .gaussians import Gaussians, rgb_to_sh0
from .groundtruth import raycast_views
from .progress import note, progress_bar
from .seeds import Seeds, extract_seeds, init_gaussians, normal_to_quat_torch
from .training import Trainer, colors_from_images, footprint_errors, render_bands
from .appearance import BlockSamples, ColorModel, base_colors
from .views import HELD_OUT, Views, pixels_per_area, step_views
from .errors import InputError
from .volume import Block, check_field, iso_distance, unit_field


@dataclass
class StepResult:
    """What one trained timestep leaves behind (on every rank).

    gaussians: this rank's trained shard (on the training device).
    metrics:   the step's figures (same on every rank).
    sh_degree: the SH degree training had reached (a warm start goes on from it).
    step, time: the simulation's step number and time.
    model:     the merged model on rank 0 (``output.ply_metrics``), else None: for the web copy.
    images:    (name, gt [H, W, 3], pred [H, W, 3]) held-out images to write (rank 0).
    cameras:   the step's views (for the report's viewer).
    :func:`write_step` writes the outputs and then drops ``model`` and ``images``.
    """

    gaussians: Gaussians
    metrics: dict = field(default_factory=dict)
    sh_degree: int = 0
    step: int = 0
    time: float = 0.0
    model: Gaussians | None = None
    images: list = field(default_factory=list)
    cameras: Views | None = None


@dataclass
class Scene:
    """Everything about one step that training and evaluation share."""

    views: Views
    order: Tensor               # [N, P] visibility keys
    gt: Tensor                  # [N, h_band, W, 4] this rank's band of every view, premultiplied RGBA
    rows: tuple[int, int]       # this rank's band of image rows
    background: Tensor          # [3] the background of the evaluation (views.background)

    def gt_on(self, ids: Tensor, background: Tensor) -> Tensor:
        """[B, h_band, W, 3] float32 ground truth of views ``ids`` on ``background`` ([3] or [B, 3])."""
        rgba = self.gt[ids].float()
        return over(rgba[..., :3], rgba[..., 3:], background)


_PRELOAD: list[threading.Thread] = []


def preload_evaluation() -> None:
    """Import the evaluation's metrics on a background thread, once per process.

    Importing torchmetrics takes seconds on some machines (8.6 s on the GPU machine, run 18);
    started once a step's input is checked, the import overlaps seeding, ray casting and the seed
    colours instead of delaying the first evaluation, which then finds the module imported (or
    waits for the rest of the import). What a step imports lazily itself (gsplat and its
    densification ops, scipy's k-d tree) is imported first, on the calling thread; the step
    imports nothing else that the metrics' import does, so the two threads do not import the same
    modules at once. A failure on the background thread is ignored: the first evaluation then
    imports, and reports the error, as usual.
    """
    if _PRELOAD or "insitu.metrics" in sys.modules:
        return
    from .rendering import gsplat_import_error

    import scipy.spatial  # noqa: F401 - the warm start's k-d tree
    if gsplat_import_error() is None:
        import gsplat.strategy.ops  # noqa: F401 - densification's

    def run() -> None:
        try:
            importlib.import_module("insitu.metrics")
        except Exception:       # noqa: BLE001 - the evaluation imports it again and raises there
            pass

    thread = threading.Thread(target=run, name="insitu-preload", daemon=True)
    _PRELOAD.append(thread)
    thread.start()


def batches(scene: Scene, tc) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless training batches ``(ids [B], background [B, 3] or [3])`` on the device: the training
    views shuffled per epoch (an epoch's last partial batch is dropped), a random background per
    view when ``tc.random_background`` (else the evaluation's). Drawn one epoch at a time, from
    generators seeded by ``tc.seed``: the same on every rank, no host-device copy per iteration."""
    train_ids = scene.views.train_ids
    generator = torch.Generator().manual_seed(tc.seed)
    bg_generator = torch.Generator().manual_seed(tc.seed + 1)
    if len(train_ids) == 0:
        raise InputError("no training views: views.count and views.test_every leave every view held out")
    B = min(tc.batch, len(train_ids))
    while True:
        perm = torch.randperm(len(train_ids), generator=generator).to(train_ids.device)
        epoch = train_ids[perm]
        bgs = torch.rand(len(epoch), 3, generator=bg_generator).to(train_ids.device) if tc.random_background else None
        for i in range(0, len(epoch) - B + 1, B):
            yield epoch[i:i + B], (bgs[i:i + B] if bgs is not None else scene.background)


def train_iteration(trainer: Trainer, scene: Scene, ids: Tensor, bg: Tensor, cfg: Config, comm) -> Tensor:
    """One optimiser step on views ``ids`` against ``bg`` ([B, 3] or [3]); collective. Returns this rank's loss."""
    render = lambda p: render_bands(p, scene.views, ids, scene.order, comm, background=bg,  # noqa: E731
                                    colors=trainer.colors, backend=cfg.train.backend,
                                    transfer=cfg.parallel.transfer)
    footprints = lambda p, error: footprint_errors(p, scene.views, ids, scene.order, comm, error,  # noqa: E731
                                                   backend=cfg.train.backend, transfer=cfg.parallel.transfer)
    gt_alpha = scene.gt[ids][..., 3:].float() if cfg.train.alpha_weight > 0 else None
    return trainer.step(render, scene.gt_on(ids, bg), rows=scene.rows, height=scene.views.height, comm=comm,
                        gt_alpha=gt_alpha, footprints=footprints)


def global_range(comm, array: np.ndarray) -> tuple[float, float]:
    return (comm.mpi.allreduce(float(np.min(array)), op=MPI.MIN),
            comm.mpi.allreduce(float(np.max(array)), op=MPI.MAX))


def block_decomposition(comm, block: Block) -> Decomposition:
    """The ranks' owned cells as a validated Cartesian grid of blocks (dims, coords, real edges).

    Collective; a gap, an overlap, a non-Cartesian layout or ranks that disagree on the global
    shape is the same InputError on every rank (:func:`insitu.decomposition.decompose`).
    """
    boxes = comm.mpi.allgather((tuple(block.owned_lo), tuple(block.owned_hi), tuple(block.global_shape)))
    return decompose(*zip(*boxes), unit="cells")


def check_iso(comm, block: Block, iso: list[float]) -> tuple[float, float]:
    """The field's global range, after checking that every iso value makes a surface: a sample equal
    to an iso value counts as above it, so an iso value in ``(min, max]`` does."""
    vmin, vmax = global_range(comm, block.data)
    for v in iso:
        if not vmin < v <= vmax:
            raise InputError(f"iso value {v:.10g} is outside the field's range ({vmin:.10g}, {vmax:.10g}]: "
                             f"no surface to extract (a sample equal to the iso value counts as above it)")
    return vmin, vmax


def seed_count(cfg: Config, total_area: float, block: Block) -> int:
    """How many Gaussians the whole surface (``total_area``, world units) starts with: ``seeds.density`` per
    pixel of its area as the orbit's views see it (:func:`insitu.views.pixels_per_area`; one Gaussian per
    marching-cubes vertex would leave a coarse grid's surface at a few thousand Gaussians however large the
    images), at most ``seeds.budget``; with ``seeds.density: 0``, the budget."""
    if cfg.seeds.density <= 0:
        return cfg.seeds.budget
    lo, hi = block.global_box
    wanted = cfg.seeds.density * total_area * pixels_per_area(lo, hi, cfg.views.resolution, cfg.views.fov_deg)
    return int(min(cfg.seeds.budget, max(1, math.ceil(wanted))))


def warm_shard(warm: Gaussians, seeds: Seeds, budget: int, cfg: Config, block: Block, device, *,
               keep: float = 0.5, near: float = 1.0) -> tuple[Gaussians, Tensor]:
    """Previous step's shard refit to the new surface: drop Gaussians off it, seed where it is new.

    Returns the shard and ``fresh: [N]`` bool, its new seeds (they get the cold start's colours,
    :func:`init_colors`; the kept Gaussians keep their trained ones).

    keep: in cells; an old Gaussian is kept when the new field puts it within this distance of the
          isosurface (:func:`insitu.volume.iso_distance`). A vertex of the new surface within 1 cell
          (the rule before) kept stale Gaussians: on Gray-Scott L = 32, 30 steps apart, the warm step
          ended 1.8 dB below a cold one, 0.2 dB with this rule (BENCHMARKS.md).
    near: in cells; a new seed is added where no kept Gaussian lies within this distance of it.
    """
    from scipy.spatial import cKDTree

    fresh = init_gaussians(seeds, budget, color=cfg.views.surface_color, opacity=cfg.seeds.opacity,
                           thickness=cfg.seeds.thickness, sh_degree=warm.sh_degree, seed=cfg.train.seed,
                           device=device)
    if len(warm) == 0 or len(seeds) == 0:
        return fresh, torch.ones(len(fresh), dtype=torch.bool, device=device)
    old = warm.to(device)
    cell = float(min(block.spacing))
    off = iso_distance(block, cfg.input.iso, old.means.detach().cpu().numpy()) / cell
    old = old.select(torch.as_tensor(off <= keep, device=device))
    if len(old) == 0:
        return fresh, torch.ones(len(fresh), dtype=torch.bool, device=device)
    d_new, _ = cKDTree(old.means.cpu().numpy()).query(fresh.means.cpu().numpy(), distance_upper_bound=near * cell)
    add = torch.as_tensor(~np.isfinite(d_new), device=device)
    new = fresh.select(add)
    mask = torch.cat([torch.zeros(len(old), dtype=torch.bool, device=device),
                      torch.ones(len(new), dtype=torch.bool, device=device)])
    return Gaussians.cat([old, new]), mask


def lit_seeds(shard: Gaussians, block: Block, cfg: Config, color_range: tuple[float, float] | None, *,
              only: Tensor | None = None) -> Gaussians:
    """The lit colour model's seeds: each disc turned to the ground truth's normal at its centre and
    given the ground truth's base colour there (:class:`insitu.appearance.BlockSamples`,
    :func:`insitu.appearance.base_colors`), so that it starts shaded as the surface it stands for.
    ``only``: [N] bool, the Gaussians to set (a warm start's new seeds); default all. Local."""
    if len(shard) == 0:
        return shard
    device = shard.means.device
    unit, _ = unit_field(block.data, cfg.input.iso)
    samples = BlockSamples(torch.from_numpy(np.ascontiguousarray(unit)).to(device), origin=block.origin,
                           spacing=block.spacing, start=block.start)
    pick = torch.ones(len(shard), dtype=torch.bool, device=device) if only is None else only.to(device)
    means = shard.means[pick]
    quats, sh0 = shard.quats.clone(), shard.sh0.clone()
    quats[pick] = normal_to_quat_torch(samples.normals(means)).to(quats.dtype)
    base = base_colors(block, means, color=cfg.views.surface_color, color_field=cfg.input.color_var,
                       color_range=color_range, colormap=cfg.views.colormap)
    sh0[pick] = rgb_to_sh0(base)[:, None, :].to(sh0.dtype)
    return Gaussians(shard.means, shard.log_scales, quats, shard.opacity_logits, sh0, shard.shN)


def init_colors(shard: Gaussians, scene: "Scene", cfg: Config, comm, *, only: Tensor | None = None) -> Gaussians:
    """The seeds' colours as ``cfg.seeds.color_init`` says: ``gt`` reads them from ``cfg.seeds.color_views``
    training views spread over the orbit (:func:`insitu.training.colors_from_images`, collective),
    ``constant`` keeps ``views.surface_color``. ``only``: [N] bool, the Gaussians to colour (a warm
    start's new seeds); default all."""
    if cfg.seeds.color_init == "constant":
        return shard
    train = scene.views.train_ids
    k = min(cfg.seeds.color_views, len(train))
    ids = train[torch.linspace(0, len(train) - 1, k).round().long().to(train.device)] if k else train[:0]
    return colors_from_images(shard, scene.views, ids, scene.order, scene.gt, comm, backend=cfg.train.backend,
                              batch=cfg.train.batch, only=only)


def view_order(views: Views, block: Block, decomposition: Decomposition) -> Tensor:
    """[N, P] visibility keys of the ranks' blocks for every view, from the real block edges
    (an uneven split orders its blocks right for every camera)."""
    device = views.viewmats.device
    dec = decomposition
    lo, hi = block.global_box
    return visibility_order(views.positions, dec.dims, torch.as_tensor(lo, device=device),
                            torch.as_tensor(hi, device=device), torch.as_tensor(dec.coords, device=device),
                            edges=tuple(torch.as_tensor(e, device=device)
                                        for e in dec.world_edges(block.origin, block.spacing)))


def replicate(shard: Gaussians, scene: Scene, comm) -> tuple[Gaussians, Scene]:
    """The data-parallel layout (``parallel.layout: replicated``); collective over ``comm``.

    Returns the whole model (every rank's shard, in rank order) and a Scene of the whole images of
    every view, on every rank: each rank then trains the whole model on views of its own, alone
    (``comm.solo()``), and the trainer averages the gradients over the ranks.
    """
    from .gaussians import gather_gaussians

    model = gather_gaussians(shard.to("cpu"), comm.mpi, everywhere=True).to(comm.device)
    views = scene.views
    gt = torch.empty(len(views), views.height, views.width, 4, dtype=scene.gt.dtype, device=scene.gt.device)
    for group in view_groups(list(range(len(views))), views.width, views.height):
        gt[group] = gather_bands(scene.gt[group], comm)
    order = torch.zeros(len(views), 1, device=scene.order.device)     # one layer: nothing to composite
    return model, Scene(views, order, gt, (0, views.height), scene.background)


def surface_targets(comm, seeds: Seeds, per_rank: int = 256, seed: int = 0) -> np.ndarray:
    """``[M, 3]`` points on the whole surface, the same on every rank (collective): up to ``per_rank``
    of each rank's seeds, drawn with ``seed``, in rank order. Close-up cameras look at them."""
    rng = np.random.default_rng(seed + comm.rank)
    mine = seeds.points[rng.choice(len(seeds), size=min(per_rank, len(seeds)), replace=False)] if len(seeds) else \
        np.zeros((0, 3), np.float32)
    return np.concatenate(comm.mpi.allgather(np.asarray(mine, np.float64)))


def make_scene(block: Block, cfg: Config, comm, *, progress: bool = False,
               decomposition: Decomposition | None = None, targets: np.ndarray | None = None) -> Scene:
    """The step's views (:func:`insitu.views.step_views`: the orbit, close-ups at the surface points
    ``targets: [M, 3]`` and the held-out sets off the orbit) and this rank's GT band of every view
    (ray-cast, composited).

    decomposition: the ranks' blocks (:func:`block_decomposition`; built here when not given).
    """
    device = comm.device
    lo, hi = block.global_box
    vc = cfg.views
    views = step_views(lo, hi, count=vc.count, resolution=vc.resolution, fov_deg=vc.fov_deg,
                       test_every=vc.test_every, closeups=int(round(vc.closeups * vc.count)),
                       closeup_factors=vc.closeup_factors,
                       held_out=vc.held_out, targets=targets).to(device)
    dec = decomposition if decomposition is not None else block_decomposition(comm, block)
    order = view_order(views, block, dec)
    background = torch.tensor(vc.background, dtype=torch.float32, device=device)
    color_range = None
    if cfg.input.color_var:
        comm.agree(cfg.input.color_var in block.fields,
                   f"colour field {cfg.input.color_var!r} not given; fields present: "
                   f"{', '.join(sorted(block.fields)) or 'none'}", where="phase 'ground truth'")
        color_range = global_range(comm, block.fields[cfg.input.color_var])
    rows = band_rows(views.height, comm.size)[comm.rank]
    gt = torch.empty(len(views), rows[1] - rows[0], views.width, 4, dtype=torch.float16, device=device)
    bar = progress_bar(len(views), "ground truth", progress and comm.rank == 0)
    # groups of views of about 32M pixels on GPUs (one kernel launch each), 4M elsewhere
    chunk = max(1, (1 << (25 if device.type == "cuda" else 22)) // (views.width * views.height))
    cast = raycast_views(block, views.viewmats, views.Ks, views.width, views.height, cfg.input.iso,
                         views_per_call=chunk, color=vc.surface_color, color_field=cfg.input.color_var,
                         color_range=color_range, colormap=vc.colormap, supersample=vc.supersample,
                         device=device)
    # On GPUs with several ranks the compositing of a group runs on a stream of its own, so a rank
    # casts its next group while the all-to-all waits for the slower rank's casting of this one.
    side = torch.cuda.Stream(device) if device.type == "cuda" and comm.size > 1 else None
    done = []                                   # events of the groups composited on `side`
    while True:
        with comm.phase("ground truth"):      # local ray casting only; the compositing is collective
            ids, rgba, _ = next(cast, (None, None, None))
        if ids is None:
            break
        if side is None:
            gt[ids] = composite_full(rgba[..., :3], rgba[..., 3:], order[ids], comm).to(gt.dtype)
        else:
            side.wait_stream(torch.cuda.current_stream(device))        # this group is cast
            with torch.cuda.stream(side):
                gt[ids] = composite_full(rgba[..., :3], rgba[..., 3:], order[ids], comm).to(gt.dtype)
                done.append(torch.cuda.Event())
                done[-1].record(side)
            rgba.record_stream(side)            # its memory is not reused before the compositing is done
            ids.record_stream(side)
            if len(done) > 2:                   # at most two groups' images in flight
                done.pop(0).synchronize()
        bar.update(len(ids))
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
    bar.close()
    return Scene(views, order, gt, rows, background)


def view_groups(ids: list[int], width: int, height: int, pixels: int = 1 << 23) -> list[list[int]]:
    """``ids`` in consecutive groups of at most ``pixels`` pixels (at least one view each): evaluations
    render, gather and score a group at once instead of a view at a time."""
    n = max(1, pixels // (width * height))
    return [ids[i:i + n] for i in range(0, len(ids), n)]


@torch.no_grad()
def evaluate(params: dict, scene: Scene, comm, *, colors: ColorModel, backend: str, keep_images: int = 0,
             role: str = "test"):
    """PSNR/SSIM(/LPIPS), PSNR and SSIM over the covered pixels and PSNR on white of the sort-last
    composite over the held-out views of ``role`` (a name in :data:`insitu.views.ROLES`; in groups of
    views, :func:`view_groups`); rank 0 also gets (gt, pred) of the first few."""
    from .metrics import QualityAccumulator

    acc = QualityAccumulator() if comm.rank == 0 else None
    images = []
    black = torch.zeros_like(scene.background)
    views = scene.views
    for group in view_groups(views.ids(role).tolist(), views.width, views.height):
        ids = torch.tensor(group, device=comm.device)
        pred, info = render_bands(params, views, ids, scene.order, comm, background=black,
                                  colors=colors, backend=backend)
        full_pred = gather_bands(torch.cat([pred, info["alpha"]], dim=-1).float(), comm)     # premultiplied
        full_gt = gather_bands(scene.gt[ids].float(), comm)
        if comm.rank == 0:
            acc.add_rgba(full_pred, full_gt, scene.background)
            on = lambda x: (x[..., :3] + (1 - x[..., 3:]) * scene.background).clamp(0, 1).cpu()  # noqa: E731
            for j, i in enumerate(group[:max(keep_images - len(images), 0)]):
                images.append((f"view_{i:03d}", on(full_gt[j]), on(full_pred[j])))
    q = acc.result() if comm.rank == 0 else None
    q = comm.mpi.bcast(q, root=0)
    return q, images


@torch.no_grad()
def model_quality(model: Gaussians | None, scene: Scene, comm, *, backend: str):
    """PSNR and SSIM of the merged model as a splat viewer draws it: all Gaussians in one
    rasterization (one global depth sort, on rank 0) at the SH degree the file holds, the held-out
    views on ``scene.background``.

    model: the merged model on rank 0 (what ``model.ply`` holds; :func:`insitu.gaussians.gather_gaussians`),
           None on the other ranks. Collective (the ground-truth bands are gathered).
    Returns the Quality on every rank.
    """
    from .metrics import QualityAccumulator
    from .rendering import rasterize

    acc = QualityAccumulator(lpips=False) if comm.rank == 0 else None
    if comm.rank == 0:
        g = model.to(comm.device)
        colors = torch.cat([g.sh0, g.shN], dim=1)
    views = scene.views
    for group in view_groups(views.test_ids.tolist(), views.width, views.height):
        ids = torch.tensor(group, device=comm.device)
        full_gt = gather_bands(scene.gt[ids].float(), comm)
        if comm.rank == 0:
            rgb, alpha, _ = rasterize(g.means, g.quats, torch.exp(g.log_scales), torch.sigmoid(g.opacity_logits),
                                      colors, views.viewmats[ids], views.Ks[ids], views.width,
                                      views.height, sh_degree=g.sh_degree, backend=backend)
            acc.add_rgba(torch.cat([rgb, alpha], dim=-1).float(), full_gt, scene.background)
    return comm.mpi.bcast(acc.result() if comm.rank == 0 else None, root=0)


def target_reached(q, tc) -> bool:
    """True when a quality target is set and every target that is set is met, on the foreground (the
    covered pixels: a black background would flatter a full-image figure)."""
    if tc.psnr_target is None and tc.ssim_target is None:
        return False
    return ((tc.psnr_target is None or q.psnr_foreground >= tc.psnr_target)
            and (tc.ssim_target is None or q.ssim_foreground >= tc.ssim_target))


def run_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0, writer=None,
             warm: StepResult | None = None, iterations: int | None = None) -> StepResult:
    """:func:`compute_step`, then :func:`write_step` with ``writer`` (when given); collective over ``comm``."""
    result = compute_step(block, cfg, comm, step=step, time=time, warm=warm, iterations=iterations)
    if writer is not None:
        write_step(result, writer, cfg, comm)
    return result


def ply_colors(gaussians: Gaussians | None, cfg: Config) -> Gaussians | None:
    """What ``model.ply`` holds of a shard: SH colours of degree ``train.sh_degree``, fitted to a lit
    model's appearance (:meth:`insitu.appearance.ColorModel.as_sh`), an SH model's as trained."""
    if gaussians is None:
        return None
    return ColorModel(cfg.train.color_model).as_sh(gaussians, cfg.train.sh_degree)


def write_step(result: StepResult, writer, cfg: Config, comm) -> None:
    """Write a computed step's outputs (collective): every rank its shard of ``model.ply`` at its
    offset in one file, then rank 0 the rest of the step (:class:`insitu.export.StepWriter`)."""
    t_write = _time.perf_counter()
    writer.write_model(result.step, ply_colors(result.gaussians, cfg), comm)
    result.metrics["model_write_seconds"] = round(_time.perf_counter() - t_write, 3)
    with comm.phase("export"):                  # a failed write (disk full...) ends every rank
        if comm.rank == 0:
            writer.write(result.step, result.model, result.images, result.metrics, cfg, cameras=result.cameras)
    result.model, result.images = None, []      # written: a warm start needs only the shard


def compute_step(block: Block, cfg: Config, comm, *, step: int = 0, time: float = 0.0,
                 warm: StepResult | None = None, iterations: int | None = None) -> StepResult:
    """Train a Gaussian splat model of this step's isosurface(s); collective over ``comm``.
    Writes nothing: the outputs travel in the result (:func:`write_step`).

    warm: the previous step's result on this rank: its shard, refit to this step's surface, is
          trained on from the SH degree it had reached, instead of fresh seeds.
    iterations: training iterations (default ``cfg.train.iterations``).
    """
    if warm is not None and not isinstance(warm, StepResult):
        raise TypeError(f"warm: expected the previous step's StepResult, got {type(warm).__name__}")
    t0 = _time.perf_counter()
    device, tc = comm.device, cfg.train
    torch.manual_seed(tc.seed + comm.rank)
    with comm.phase("input check"):              # local checks only: no collective inside a phase
        check_field(block.data, cfg.input.var, offset=block.start)
        if cfg.input.color_var is not None:
            if cfg.input.color_var not in block.fields:
                raise InputError(f"colour field {cfg.input.color_var!r} not given; fields present: "
                                 f"{', '.join(sorted(block.fields)) or 'none'}")
            check_field(block.fields[cfg.input.color_var], cfg.input.color_var, offset=block.start)
    decomposition = block_decomposition(comm, block)    # a gap or an overlap: an InputError on every rank
    check_iso(comm, block, cfg.input.iso)           # same verdict on every rank
    lit = tc.color_model == "lit"
    color_range = global_range(comm, block.fields[cfg.input.color_var]) if cfg.input.color_var else None
    preload_evaluation()                            # the input is good: the step will train and evaluate
    with comm.phase("seeds"):
        seeds = extract_seeds(block, cfg.input.iso)
    total_area = comm.mpi.allreduce(seeds.total_area)
    share = seeds.total_area / total_area if total_area > 0 else 0.0
    budget = int(round(seed_count(cfg, total_area, block) * share))
    spacing = float(min(block.spacing))
    fresh = None                                 # the Gaussians whose colours the ground truth sets: all
    with comm.phase("initialise Gaussians"):
        if warm is not None:
            shard, fresh = warm_shard(warm.gaussians, seeds, budget, cfg, block, device)
        else:
            shard = init_gaussians(seeds, budget, color=cfg.views.surface_color, opacity=cfg.seeds.opacity,
                                   thickness=cfg.seeds.thickness, sh_degree=0 if lit else tc.sh_degree,
                                   seed=tc.seed + comm.rank, fill=cfg.seeds.fill or cfg.seeds.density > 0,
                                   device=device)
        if lit:                                  # normals and base colours: the ground truth's at each seed
            shard = lit_seeds(shard, block, cfg, color_range, only=fresh)
    n0 = comm.mpi.allreduce(len(shard))
    t_seed = _time.perf_counter()
    show = tc.progress and comm.rank == 0
    note(f"step {step} seeds: {n0} Gaussians on {comm.size} rank(s) ({t_seed - t0:.1f} s)", show)
    targets = surface_targets(comm, seeds, seed=tc.seed) if cfg.views.closeups or cfg.views.held_out else None
    scene = make_scene(block, cfg, comm, progress=show, decomposition=decomposition, targets=targets)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_scene = _time.perf_counter()
    if not lit:                                  # SH colours from the ground-truth images
        shard = init_colors(shard, scene, cfg, comm, only=fresh)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_color = _time.perf_counter()
    if cfg.seeds.color_init != "constant" and not lit:
        note(f"step {step} colours from the ground truth ({t_color - t_scene:.1f} s)", show)
    glo, ghi = block.global_box
    extent = 0.5 * float(np.linalg.norm(ghi - glo))
    replicated = cfg.parallel.layout == "replicated" and comm.size > 1
    if replicated:                               # each rank the whole model, its own views
        if tc.batch * comm.size > len(scene.views.train_ids):     # the same verdict on every rank
            raise InputError(f"parallel.layout=replicated: train.batch x ranks = {tc.batch} x {comm.size} views per "
                             f"step, more than the {len(scene.views.train_ids)} training views")
        model, scene = replicate(shard, scene, comm)
        run, (lo, hi), cap = comm.solo(), (glo, ghi), tc.max_gaussians
    else:                                        # each rank its block's Gaussians, composited sort-last
        model, run, (lo, hi), cap = shard, comm, block.box, max(int(tc.max_gaussians * share), len(shard))
    margin = 2.0 * spacing
    box = (torch.as_tensor(lo - margin, dtype=torch.float32, device=device),
           torch.as_tensor(hi + margin, dtype=torch.float32, device=device))
    iters = iterations if iterations is not None else tc.iterations
    trainer = Trainer(model, tc, extent=extent, box=box, max_gaussians=cap, device=device, total_iterations=iters,
                      sh_degree_start=warm.sh_degree if warm is not None else 0,
                      replicas=comm if replicated else None)
    model = shard = None                        # the trainer holds its own copy

    def whole(n: int) -> int:
        """Gaussians of the whole model, from this rank's ``n``."""
        return n if replicated else comm.mpi.allreduce(n)

    def on_rank0(work):
        """Replicated: ``work()`` on rank 0 alone (every rank holds the same model and images), inside
        a phase, so that a failure there ends every rank instead of leaving them in a collective."""
        out = None
        with comm.phase("evaluation"):
            if comm.rank == 0:
                out = work()
        return out

    def evaluated(**kw):
        """:func:`evaluate` of the trainer's model: sort-last on every rank; replicated on rank 0
        alone, its figures sent to every rank."""
        if not replicated:
            return evaluate(trainer.params, scene, comm, backend=tc.backend, **kw)
        q, images = on_rank0(lambda: evaluate(trainer.params, scene, run, backend=tc.backend, **kw)) or (None, [])
        return comm.mpi.bcast(q, root=0), images
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_gt = _time.perf_counter()
    evaluations = []                            # seconds of each evaluation inside the training time

    def scored(colors: ColorModel):
        if device.type == "cuda":
            torch.cuda.synchronize(device)      # the queued iterations are training time, not evaluation
        t = _time.perf_counter()
        q, _ = evaluated(colors=colors)
        evaluations.append(_time.perf_counter() - t)    # evaluate ends reading its figures: the device is done
        return q

    q0 = scored(trainer.colors)
    history = [{"iteration": 0, "psnr": q0.psnr, "ssim": q0.ssim, "psnr_foreground": q0.psnr_foreground,
                "ssim_foreground": q0.ssim_foreground, "gaussians": n0, "seconds": 0.0}]
    note(f"step {step} initial model: PSNR {q0.psnr:.2f} dB ({evaluations[0]:.1f} s)", show)
    bar = progress_bar(iters, f"step {step} train", show)
    show_every = max(10, iters // 100)          # each update waits for the device and reduces over ranks
    reached = None
    B = tc.batch
    for it, (ids, bg) in zip(range(iters), batches(scene, replace(tc, batch=trainer.images_per_step))):
        if replicated:                          # this rank's views of the step's batch
            ids, bg = ids[comm.rank * B:(comm.rank + 1) * B], (bg[comm.rank * B:(comm.rank + 1) * B]
                                                              if bg.ndim == 2 else bg)
        loss = train_iteration(trainer, scene, ids, bg, cfg, run)
        if tc.progress and (it % show_every == 0 or it == iters - 1):     # every rank: whole-model figures
            loss_all = comm.mpi.allreduce(float(loss)) / (comm.size if replicated else 1)
            bar.set_postfix(loss=f"{loss_all:.4f}", gaussians=whole(len(trainer)))
        bar.update(1)
        if tc.eval_every and (it + 1) % tc.eval_every == 0 and it + 1 < iters:
            q = scored(trainer.colors_trained)
            history.append({"iteration": it + 1, "psnr": q.psnr, "ssim": q.ssim, "psnr_foreground": q.psnr_foreground,
                            "ssim_foreground": q.ssim_foreground, "gaussians": whole(len(trainer)),
                            "seconds": _time.perf_counter() - t_gt})
            if target_reached(q, tc):
                reached = it + 1
                break
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_train = _time.perf_counter()
    q, images = evaluated(colors=trainer.colors_trained, keep_images=cfg.output.images)
    closer = {role: evaluated(colors=trainer.colors_trained, role=role)[0]      # the views the orbit never had
              for role in HELD_OUT[1:] if len(scene.views.ids(role))}
    gaussians = trainer.gaussians()
    if replicated:                          # back to shards: each rank keeps the Gaussians in its block
        owner = decomposition.owners(gaussians.means.detach().cpu().numpy(), block.origin, block.spacing)
        gaussians = gaussians.select(torch.as_tensor(owner == comm.rank, device=gaussians.means.device))
    total = comm.mpi.allreduce(len(gaussians))
    if replicated:                          # replicas that drifted apart would lose or repeat Gaussians
        comm.agree(total == len(trainer), f"replicated layout: the ranks kept {total} Gaussians of this rank's "
                                          f"model of {len(trainer)}", where="phase 'shards'")
    from .gaussians import gather_gaussians

    merged, qm = None, None                 # ply figures and the web copy need the whole model on rank 0
    if cfg.output.ply_metrics:
        merged = gather_gaussians(gaussians.to("cpu"), comm.mpi)    # what model.ply holds: on rank 0
        if replicated:                      # the whole images are on every rank: rank 0 draws alone
            qm = comm.mpi.bcast(on_rank0(lambda: model_quality(ply_colors(merged, cfg), scene, run,
                                                                backend=tc.backend)), root=0)
        else:
            qm = model_quality(ply_colors(merged, cfg) if comm.rank == 0 else None, scene, comm, backend=tc.backend)
    metrics = {
        "step": step, "time": time, "ranks": comm.size, "device": device.type,
        "psnr": q.psnr, "ssim": q.ssim, "psnr_initial": q0.psnr, "lpips": q.lpips,
        "ply_psnr": qm and qm.psnr, "ply_ssim": qm and qm.ssim, "psnr_foreground": q.psnr_foreground, "psnr_white": q.psnr_white,
        "ssim_foreground": q.ssim_foreground, "psnr_foreground_initial": q0.psnr_foreground,
        "ply_psnr_foreground": qm and qm.psnr_foreground, "ply_ssim_foreground": qm and qm.ssim_foreground,
        **{f"{key}_{role}": getattr(qr, key) for role, qr in closer.items()
           for key in ("psnr", "psnr_foreground", "ssim_foreground")},
        "color_model": tc.color_model,
        "test_views": q.views, "iterations": trainer.iteration, "target_reached_at": reached,
        "sh_degree": trainer.sh_degree_trained,
        "gaussians_initial": n0, "gaussians": total,
        "seeds_seconds": round(t_seed - t0 + (t_color - t_scene), 3),     # the seed colours included
        "ground_truth_seconds": round(t_gt - t_seed - (t_color - t_scene), 3),
        "color_init_seconds": round(t_color - t_scene, 3), "scene_seconds": round(t_scene - t_seed, 3),
        "train_seconds": round(t_train - t_gt, 3), "history": history,
        "initial_evaluation_seconds": round(evaluations[0], 3),     # both inside train_seconds
        "evaluation_seconds": round(sum(evaluations), 3),
    }
    if device.type == "cuda":
        metrics["peak_gpu_memory_gb"] = comm.mpi.allreduce(torch.cuda.max_memory_allocated(device) / 2**30,
                                                           op=MPI.MAX)
    metrics["total_seconds"] = round(_time.perf_counter() - t0, 3)
    return StepResult(gaussians, metrics, sh_degree=trainer.sh_degree_trained, step=step, time=time,
                      model=merged, images=images,
                      cameras=scene.views.to("cpu").subset(torch.arange(cfg.views.count)))    # the orbit's

