"""A step's scene: the views around the whole domain and this rank's band of their ground truth.

:func:`make_scene` ray-casts this rank's block for every view (:mod:`insitu.groundtruth`) and
composites the ranks' images sort-last into row bands (:func:`insitu.render.compositing.composite_full`):
each rank keeps the ground truth of its own rows, the rows its band loss needs. Training and
evaluation then read the same :class:`Scene`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from insitu.config import Config
from insitu.groundtruth.caster import raycast_views
from insitu.groundtruth.views import Views, step_views
from insitu.input.decomposition import Decomposition, decompose
from insitu.progress import progress_bar
from insitu.render.lighting import HEADLIGHT, Light
from insitu.render.compositing import band_rows, composite_full, over, visibility_order
from insitu.volume import Block


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
        return self.gt_with_alpha(ids, background)[0]

    def gt_with_alpha(self, ids: Tensor, background: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`gt_on` and the same views' alpha [B, h_band, W, 1] (float32), from one gather."""
        rgba = self.gt[ids].float()
        return over(rgba[..., :3], rgba[..., 3:], background), rgba[..., 3:]


def global_range(comm, array: np.ndarray) -> tuple[float, float]:
    """``(min, max)`` of ``array`` over every rank's; collective."""
    return (comm.mpi.allreduce(float(np.min(array)), op=MPI.MIN),
            comm.mpi.allreduce(float(np.max(array)), op=MPI.MAX))


def block_decomposition(comm, block: Block) -> Decomposition:
    """The ranks' owned cells as a validated Cartesian grid of blocks (dims, coords, real edges).

    Collective; a gap, an overlap, a non-Cartesian layout or ranks that disagree on the global
    shape is the same InputError on every rank (:func:`insitu.input.decomposition.decompose`).
    """
    boxes = comm.mpi.allgather((tuple(block.owned_lo), tuple(block.owned_hi), tuple(block.global_shape)))
    return decompose(*zip(*boxes), unit="cells")


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


def make_scene(block: Block, cfg: Config, comm, *, progress: bool = False,
               decomposition: Decomposition | None = None, targets: np.ndarray | None = None,
               ready: Callable[[], None] | None = None, views: Views | None = None,
               light: Light = HEADLIGHT) -> Scene:
    """The step's views (:func:`insitu.groundtruth.views.step_views`: the orbit, close-ups at the surface points
    ``targets: [M, 3]`` and the held-out sets off the orbit) and this rank's GT band of every view
    (ray-cast, composited).

    views: these cameras instead of the step's (the same on every rank; ``targets`` is then unused).
    decomposition: the ranks' blocks (:func:`block_decomposition`; built here when not given).
    ready: called once the views are set and the field prepared, before the first view is cast
           (:func:`insitu.groundtruth.caster.raycast_views`).
    light: what the surface is shaded with: the headlight (the step's ground truth) or the fixed light of the
           standard files' (:class:`insitu.render.lighting.FixedLight`).
    """
    device = comm.device
    lo, hi = block.global_box
    vc = cfg.views
    if views is None:
        views = step_views(lo, hi, count=vc.count, resolution=vc.resolution, fov_deg=vc.fov_deg,
                           test_every=vc.test_every, closeups=int(round(vc.closeups * vc.count)),
                           closeup_factors=vc.closeup_factors, held_out=vc.held_out, targets=targets)
    views = views.to(device)
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
                         step=vc.march_step, device=device, value_range=global_range(comm, block.data), ready=ready,
                         light=light)
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

