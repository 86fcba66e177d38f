"""The reference ray caster: rays marched together as tensors (the CPU renderer and the tests' oracle).

Rays are marched in chunks. A ray is clipped to the block's owned box and marched in steps of
``step`` voxels through the trilinear interpolant of the samples; in empty space it jumps out of
the empty cube of macro cells around it at once (:mod:`insitu.groundtruth.field`). The jump ends
exactly where the ray leaves that cube (the field's side of every iso value is known up to there)
and fine sampling resumes on the ray's sample lattice, so no crossing is skipped and no dilation
of the active cells is needed. Along each ray the samples lie at multiples of the step from where
the ray enters the whole domain, whatever box it was clipped to, so blocks and the whole domain
sample alike. Rays that hit or leave the box are dropped from the working set after every pass.
The first crossing of any iso value is refined by bisection and a secant step, and the hit shaded
with the scene's light (:mod:`insitu.render.lighting`: the headlight, or a fixed light).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from insitu.groundtruth.colormaps import apply_colormap
from insitu.groundtruth.field import MACRO, Cameras, CastScene, grid_sample, iso_bins, trilinear

SAMPLES_PER_PASS = 8      # fine samples a ray takes per marching pass ...
MAX_WIDENING = 4          # ... times up to 2**MAX_WIDENING as the active rays thin out
GRADIENT_STEP = 1.0       # central-difference offset for normals, in voxels



def raycast_torch(scene: CastScene, cams: Cameras, W: int, H: int, supersample: int, chunk_rays: int,
                   progress: Callable[[int, int], None] | None) -> tuple[Tensor, Tensor]:
    """rgba [C, H, W, 4] and depth [C, H, W] of ``cams``, rays marched as tensors in chunks."""
    device = cams.axes.device
    C, s2 = cams.axes.shape[0], supersample ** 2
    n_pixels = C * H * W
    rgba = torch.zeros(n_pixels, 4, dtype=torch.float32, device=device)
    depth = torch.full((n_pixels,), math.inf, dtype=torch.float32, device=device)
    chunk_pixels = max(1, int(chunk_rays) // s2)
    views_done = 0
    for p0 in range(0, n_pixels, chunk_pixels):
        p1 = min(n_pixels, p0 + chunk_pixels)
        rays = torch.arange(p0 * s2, p1 * s2, device=device)
        origin, direction = cams.rays(rays, W, H, int(supersample))
        rgb, t = _cast(scene, origin, direction)
        hit = torch.isfinite(t)
        rgba[p0:p1, :3] = rgb.reshape(-1, s2, 3).mean(1)
        rgba[p0:p1, 3] = hit.reshape(-1, s2).float().mean(1)
        depth[p0:p1] = t.reshape(-1, s2).amin(1)
        if progress is not None:
            while views_done < p1 // (H * W):
                views_done += 1
                progress(views_done, C)
    return rgba.reshape(C, H, W, 4), depth.reshape(C, H, W)


def _cast(scene: CastScene, origin: Tensor, direction: Tensor) -> tuple[Tensor, Tensor]:
    """Shade rays ``origin, direction: [n, 3]`` (world): returns rgb [n, 3] (0 where no hit)
    and the ray parameter (camera z) of the hit [n] (+inf where none)."""
    n = origin.shape[0]
    device = origin.device
    rgb = torch.zeros(n, 3, dtype=torch.float32, device=device)
    depth = torch.full((n,), math.inf, dtype=torch.float32, device=device)
    qo = (origin - scene.origin) / scene.spacing
    qd = direction / scene.spacing
    qd = torch.where(qd.abs() < 1e-12, torch.full_like(qd, 1e-12), qd)
    t_enter, t_exit = _slab(qo, qd, scene.box_lo, scene.box_hi)
    inside = torch.nonzero(t_exit > t_enter).squeeze(1)
    if inside.numel() == 0:
        return rgb, depth
    qo, qd, t_enter, t_exit = qo[inside], qd[inside], t_enter[inside], t_exit[inside]
    dt = scene.step / direction[inside].norm(dim=1)
    # samples lie at t0 + k * dt, t0 where the ray enters the whole domain: the same for every block
    t0 = torch.minimum(_slab(qo, qd, scene.domain_lo, scene.domain_hi)[0], t_enter)
    b0 = iso_bins(scene.field.sample(qo + t_enter[:, None] * qd), scene.isos).float()
    k0 = torch.floor((t_enter - t0) / dt)
    state = torch.cat([qo, qd, dt[:, None], t0[:, None], t_enter[:, None], k0[:, None], t_exit[:, None],
                       b0[:, None]], 1)
    ray, ta, tb, iso_idx = _march(scene, state)
    if ray.numel() == 0:
        return rgb, depth
    qo, qd = qo[ray], qd[ray]
    t = _refine(scene, qo, qd, ta, tb, scene.isos[iso_idx])
    rows = inside[ray]
    rgb[rows] = _shade(scene, qo, qd, t)
    depth[rows] = t
    return rgb, depth


# columns of the marching state
_QO, _QD, _DT, _T0, _T, _K, _TEXIT, _BIN = slice(0, 3), slice(3, 6), 6, 7, 8, 9, 10, 11


def _slab(qo: Tensor, qd: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Where rays ``qo + t * qd`` ([n, 3] each, no zero in qd) enter and leave the box lo..hi
    ([3] each), entry clamped to t >= 0: t_enter, t_exit [n]; they miss it if t_exit <= t_enter."""
    t1 = (lo - qo) / qd
    t2 = (hi - qo) / qd
    return torch.minimum(t1, t2).amax(1).clamp_min(0.0), torch.maximum(t1, t2).amin(1)


def _march(scene: CastScene, state: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """March rays to their first iso crossing.

    state: [n, 12] per ray: qo (3), qd (3) local-index origin and direction, dt (march step in
    the ray parameter), t0 (where the ray enters the whole domain), t (current position), k (its
    lattice index: samples lie at t0 + k * dt, so they do not depend on the box the ray was
    clipped to), t_exit, and the bin of the field at t (how many iso values are <= f).

    Returns, for the rays that cross: their rows in ``state`` [h], the bracket ta, tb [h] and
    the index of the iso value crossed [h].
    """
    field, isos = scene.field, scene.isos
    device = state.device
    ray = torch.arange(state.shape[0], device=device)
    offsets = torch.arange(1, SAMPLES_PER_PASS * 2 ** MAX_WIDENING + 1, dtype=torch.float32, device=device)
    n_start = max(1, state.shape[0])
    mdims = field.macro_dims
    scale = 2.0 / (field.size - 1.0)
    found: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    # every pass moves a ray SAMPLES_PER_PASS lattice steps on (or more): a bound on the passes
    longest = float(((state[:, _TEXIT] - state[:, _T]) / state[:, _DT]).max()) if state.shape[0] else 0.0
    for _ in range(int(longest) // SAMPLES_PER_PASS + 3):
        if ray.numel() == 0:
            break
        # as rays finish, the rest take more samples per pass: fewer passes, same work per pass
        widen = min(MAX_WIDENING, max(0, int(math.log2(n_start / ray.numel()))))
        steps = offsets[:SAMPLES_PER_PASS << widen]
        qo, qd, dt = state[:, _QO], state[:, _QD], state[:, _DT]
        t0, t, k, t_exit = state[:, _T0], state[:, _T], state[:, _K], state[:, _TEXIT]
        b0 = state[:, _BIN].to(torch.int32)
        # 1. empty space: jump out of the empty cube of macro cells around the current one
        cell = torch.minimum(torch.floor((qo + t[:, None] * qd) / MACRO).clamp_min(0.0), mdims - 1)
        lin = (cell[:, 0] + mdims[0] * (cell[:, 1] + mdims[1] * cell[:, 2])).long()
        dist = field.distance[lin]
        radius = (dist - 1.0).clamp_min(0.0)[:, None]
        bound = torch.where(qd > 0, (cell + radius + 1.0) * MACRO, (cell - radius) * MACRO)
        t_leave = ((bound - qo) / qd).amin(1)
        # the field keeps one side of every iso value from t to t_leave: its bin holds there
        empty = dist > 0
        t = torch.where(empty, torch.minimum(torch.maximum(t_leave, t), t_exit), t)
        k = torch.where(empty, torch.maximum(torch.floor((t - t0) / dt), k), k)
        # 2. fine samples on the lattice
        kk = k[:, None] + steps
        tt = torch.minimum(torch.addcmul(t0[:, None], kk, dt[:, None]), t_exit[:, None])
        go, gd = qo * scale - 1.0, qd * scale                        # normalised grid coordinates
        fs = grid_sample(field.volume, torch.addcmul(go[:, None, :], tt[:, :, None], gd[:, None, :]))
        bins = iso_bins(fs, isos)
        change = bins != b0[:, None]               # the first change is the first crossing
        crossed = change.any(1)
        hit = torch.nonzero(crossed).squeeze(1)
        if hit.numel():
            j = change[hit].to(torch.uint8).argmax(1, keepdim=True)
            t_all = torch.cat([t[hit, None], tt[hit]], 1)
            b_a = b0[hit]
            b_b = bins[hit].gather(1, j)[:, 0]
            found.append((ray[hit], t_all.gather(1, j)[:, 0], t_all.gather(1, j + 1)[:, 0],
                          torch.where(b_b > b_a, b_a, b_a - 1).long()))
        go_on = torch.nonzero(~crossed & (tt[:, -1] < t_exit)).squeeze(1)
        state[:, _T] = tt[:, -1]
        state[:, _K] = kk[:, -1]
        state[:, _BIN] = bins[:, -1].float()
        state = state[go_on]
        ray = ray[go_on]
    if not found:
        empty_f = torch.zeros(0, dtype=torch.float32, device=device)
        return torch.zeros(0, dtype=torch.long, device=device), empty_f, empty_f, torch.zeros(0, dtype=torch.long,
                                                                                                device=device)
    rays, ta, tb, iso_idx = (torch.cat(parts) for parts in zip(*found))
    return rays, ta, tb, iso_idx


def _refine(scene: CastScene, qo: Tensor, qd: Tensor, ta: Tensor, tb: Tensor, iso: Tensor) -> Tensor:
    """Bisection then a secant step on brackets ``[ta, tb]`` ([h] each) of rays ``qo, qd: [h, 3]``
    around the crossing of ``iso: [h]``; returns the ray parameter of the crossing [h]."""
    sample = scene.field.sample
    fa = sample(qo + ta[:, None] * qd)
    fb = sample(qo + tb[:, None] * qd)
    side_a = fa >= iso
    for _ in range(scene.refine):
        tm = 0.5 * (ta + tb)
        fm = sample(qo + tm[:, None] * qd)
        same = (fm >= iso) == side_a
        ta, fa = torch.where(same, tm, ta), torch.where(same, fm, fa)
        tb, fb = torch.where(same, tb, tm), torch.where(same, fb, fm)
    denom = fb - fa
    w = torch.where(denom != 0, (iso - fa) / torch.where(denom != 0, denom, torch.ones_like(denom)),
                    torch.full_like(denom, 0.5)).clamp(0.0, 1.0)
    return ta + w * (tb - ta)


def _shade(scene: CastScene, qo: Tensor, qd: Tensor, t: Tensor) -> Tensor:
    """Colour [h, 3] of the hits at ray parameter ``t: [h]`` in the scene's light (``scene.light``)."""
    field = scene.field
    q = qo + t[:, None] * qd
    eye = torch.eye(3, dtype=torch.float32, device=q.device) * GRADIENT_STEP
    top = field.size - 1.0
    q_plus = torch.minimum(q[:, None, :] + eye, top)            # [h, 3 offsets, 3 coords]
    q_minus = (q[:, None, :] - eye).clamp_min(0.0)
    span = (q_plus - q_minus).diagonal(dim1=1, dim2=2)          # [h, 3]
    grad = (field.sample(q_plus) - field.sample(q_minus)) / (span * scene.spacing)
    view = -qd * scene.spacing
    view = view / view.norm(dim=1, keepdim=True)
    norm = grad.norm(dim=1, keepdim=True)
    normal = torch.where(norm > 0, grad / norm.clamp_min(1e-30), view)
    intensity = scene.light.shade(normal, view)     # either side of the surface alike; the Triton kernel's numbers
    if scene.color_volume is None:
        base = scene.color.expand(q.shape[0], 3)
    else:
        lo, hi = scene.color_range
        value = trilinear(scene.color_volume, q, field.size)
        base = apply_colormap((value - lo) / (hi - lo), scene.colormap)
    return (base * intensity[:, None]).clamp(0.0, 1.0)
