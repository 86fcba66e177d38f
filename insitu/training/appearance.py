"""How a Gaussian's colour is seen from a camera: the colour models.

``colors: [N, K, 3]`` is the shard's colour parameter in both models (SH coefficients' units;
band 0 is ``(rgb - 0.5) / SH_C0``):

- ``"lit"`` (the default): ``K = 1``, each Gaussian's *base* colour, and its normal, the local z
  axis of its rotation (a seed is a disc whose thin axis is the surface normal). Every camera
  sees it shaded with the ground truth's own light (:mod:`insitu.render.lighting`, a headlight: the
  shading follows the view direction), so the model holds the view-dependent shading exactly
  where three SH bands could not (the headlight's ``cos ** 32`` and the ``|cos|`` of a surface
  seen from both sides). The colours reach the rasterizer per camera, ``[C, N, 3]``. Shading each
  pixel instead, from the blended normals and base colours (deferred shading), trained 3 dB worse
  on the bonsai: with opaque discs a pixel's blended normal is mostly the
  front disc's anyway, and where discs mix, the mixed normal shades worse than the mixed colours.
- ``"sh"``: spherical harmonics along the view direction, one more band every
  ``train.sh_increase_every`` iterations up to ``train.sh_degree`` (the reference 3DGS model).

A standard 3DGS ``.ply`` holds one SH colour per Gaussian. :func:`bake_light` gives a lit model's
colours in a fixed light (:class:`insitu.render.lighting.FixedLight`), which band 0 holds exactly, as the standard
files carry them by default; :func:`fit_sh` gives its SH coefficients least-squares fitted to each Gaussian's
headlit colour (:func:`lit_colors`) over directions spread on the sphere, weighted towards the side of it that
the training views saw (what SH can hold of the headlight).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from insitu.groundtruth.caster import apply_colormap
from insitu.groundtruth.views import fibonacci_sphere
from insitu.render.lighting import FIXED_LIGHT, HEADLIGHT, FixedLight, Headlight
from insitu.render.rendering import STANDARD_EPS2D
from insitu.render.shading import MAX_SH_DEGREE, sh_basis
from insitu.surface.gaussians import SH_C0, Gaussians, rgb_to_sh0
from insitu.volume import Block, unit_colors

COLOR_MODELS = ("lit", "sh")
FIXED_LIGHT_DEGREE = 0          # the standard files' SH degree in the fixed light unless output.sh_degree says
                                # otherwise: band 0 holds the light (higher bands: bench_standard_files.py)


@dataclass(frozen=True)
class ColorModel:
    """The colour model of a shard, at one point of training.

    kind:      ``"lit"`` or ``"sh"``.
    sh_degree: ``"sh"``: the SH band to evaluate now (the schedule's); ``"lit"``: unused.
    light:     ``"lit"``: the light the Gaussians are shaded with (the ground truth's).
    """

    kind: str = "lit"
    sh_degree: int = 0
    light: Headlight = HEADLIGHT

    def __post_init__(self):
        if self.kind not in COLOR_MODELS:
            raise ValueError(f"color model: expected one of {COLOR_MODELS}, got {self.kind!r}")
        if not 0 <= self.sh_degree <= MAX_SH_DEGREE:
            raise ValueError(f"color model: expected an SH degree in 0..{MAX_SH_DEGREE}, got {self.sh_degree}")

    def at_degree(self, degree: int) -> "ColorModel":
        return replace(self, sh_degree=int(degree))

    def colors(self, means: Tensor, quats: Tensor, coeffs: Tensor, campos: Tensor) -> tuple[Tensor, int | None]:
        """What the rasterizer takes, ``(colors, sh_degree)``: ``coeffs: [N, K, 3]`` and the degree
        (``"sh"``), or ``[C, N, 3]`` colours seen from the cameras at ``campos: [C, 3]`` and None (``"lit"``).
        means: [N, 3]; quats: [N, 4] (w, x, y, z)."""
        if self.kind == "sh":
            return coeffs, self.sh_degree
        return lit_colors(means, quats, coeffs[:, 0] * SH_C0 + 0.5, campos, self.light), None

    def as_sh(self, gaussians: Gaussians, degree: int = 3, *, sides: Tensor | None = None) -> Gaussians:
        """``gaussians`` with SH colours (what a standard 3DGS viewer draws): a lit shard's fitted
        to its appearance (:func:`fit_sh`; each side weighted as the views saw it with ``sides: [N, 2]``),
        an SH shard as it is."""
        if self.kind == "sh" or len(gaussians) == 0 and gaussians.sh_degree == degree:
            return gaussians
        coeffs = fit_sh(gaussians.quats, gaussians.sh0[:, 0] * SH_C0 + 0.5, degree, self.light, sides=sides)
        return Gaussians(gaussians.means, gaussians.log_scales, gaussians.quats, gaussians.opacity_logits,
                         coeffs[:, :1].contiguous(), coeffs[:, 1:].contiguous())


def quat_normals(quats: Tensor) -> Tensor:
    """``[N, 3]`` the local z axis of each rotation ``quats: [N, 4]`` (w, x, y, z; normalised here):
    the third column of its rotation matrix, a disc's normal."""
    w, x, y, z = F.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([2 * (x * z + w * y), 2 * (y * z - w * x), 1 - 2 * (x * x + y * y)], dim=-1)


def lit_colors(means: Tensor, quats: Tensor, base: Tensor, campos: Tensor, light: Headlight = HEADLIGHT) -> Tensor:
    """``[C, N, 3]`` the colours of Gaussians lit by ``light`` as cameras at ``campos`` see them.

    means: [N, 3] centres (world); quats: [N, 4] rotations, whose local z axis is the normal;
    base: [N, 3] base colours; campos: [C, 3] camera centres (no gradient flows to them).
    Colour = ``clamp(base * light.intensity(|n . v|), 0, 1)``, ``v`` the unit direction from the
    Gaussian to the camera: the ground truth's shading of a surface point with that normal.
    Differentiable in means, quats and base.
    """
    for name, t, tail in (("means", means, 3), ("quats", quats, 4), ("base", base, 3), ("campos", campos, 3)):
        if t.ndim != 2 or t.shape[1] != tail:
            raise ValueError(f"lit_colors: {name}: expected [{'C' if name == 'campos' else 'N'}, {tail}], "
                             f"got {tuple(t.shape)}")
    if not means.shape[0] == quats.shape[0] == base.shape[0]:
        raise ValueError(f"lit_colors: expected one row per Gaussian in means, quats and base, got "
                         f"{means.shape[0]}, {quats.shape[0]}, {base.shape[0]}")
    view = F.normalize(campos.detach()[:, None, :] - means[None], dim=-1)         # [C, N, 3]
    cos = (view * quat_normals(quats)[None]).sum(-1).abs().clamp(max=1.0)
    return (base[None] * light.intensity(cos)[..., None]).clamp(0.0, 1.0)


def fit_sh(quats: Tensor, base: Tensor, degree: int = 3, light: Headlight = HEADLIGHT, *,
           directions: int = 512, sides: Tensor | None = None, floor: float = 0.05,
           chunk_floats: int = 1 << 25) -> Tensor:
    """``[N, (degree + 1) ** 2, 3]`` SH coefficients whose colour (SH + 0.5, as gsplat evaluates it)
    is the least-squares fit of the lit colours of :func:`lit_colors` over ``directions`` view
    directions spread evenly on the sphere.

    quats: [N, 4] rotations (normal: local z); base: [N, 3] base colours.
    sides: [N, 2] each Gaussian's footprint in the training views that see its front and in all of
           them (:func:`insitu.training.trainer.footprint_sides`), or None.

    The lit colour depends on ``|n . v|`` only: fitted over the whole sphere alike, three bands hold
    just its even part (at degree 1 a constant). With ``sides``, each Gaussian's fit weights the
    directions on each side of it by the share of its footprint seen from that side (at least
    ``floor``): a Gaussian on a closed surface is seen from one side only, and the fit spends its
    bands, the odd ones too, on that side. A Gaussian no view shows gets the even fit. (Fitting the
    cameras' own directions instead, weighted by the footprint in each, overfitted between 42 views.)
    """
    if not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"fit_sh: expected a degree in 0..{MAX_SH_DEGREE}, got {degree}")
    n, device = quats.shape[0], quats.device
    if sides is not None and tuple(sides.shape) != (n, 2):
        raise ValueError(f"fit_sh: sides: expected [{n}, 2] (front, whole footprint), got {tuple(sides.shape)}")
    k = (degree + 1) ** 2
    dirs = torch.tensor(fibonacci_sphere(directions), dtype=torch.float64, device=device)   # [S, 3]
    # gsplat evaluates SH along (mean - camera), the opposite of the direction to the camera
    basis = sh_basis(degree, -dirs)                                                      # [S, K]
    solve = torch.linalg.pinv(basis).float() if sides is None else None                 # [K, S]: one for all
    basis, dirs = basis.float(), dirs.float()
    chunk = max(1, chunk_floats // (directions * k))
    out = []
    with torch.no_grad():
        for lo in range(0, n, chunk):
            normal = quat_normals(quats[lo:lo + chunk].float())
            b = base[lo:lo + chunk].float()
            facing = normal @ dirs.T                                                      # [n, S]
            target = (b[:, None, :] * light.intensity(facing.abs().clamp(max=1.0))[..., None]).clamp(0.0, 1.0)
            target = target - 0.5                                                         # [n, S, 3]
            if sides is None:
                out.append(torch.einsum("ks,nsc->nkc", solve, target))
                continue
            front, whole = sides[lo:lo + chunk].float().clamp(min=0.0).unbind(1)
            share = torch.where(whole > 0, front / whole.clamp(min=1e-30), torch.full_like(whole, 0.5))
            weight = torch.where(facing > 0, share[:, None], 1.0 - share[:, None]).clamp(min=floor)   # [n, S]
            wb = weight[..., None] * basis                                                # [n, S, K]
            lhs = wb.transpose(1, 2) @ basis                                              # [n, K, K]
            out.append(torch.linalg.solve(lhs, wb.transpose(1, 2) @ target))
    if not out:
        return quats.new_zeros(0, k, 3)
    return torch.cat(out).to(quats.dtype)


def bake_light(gaussians: Gaussians, light: FixedLight, degree: int = 0) -> Gaussians:
    """A lit shard ``gaussians`` (base colours in band 0, normals the rotations' local z axes) with SH colours of
    ``degree`` that hold its colours in the fixed ``light``: band 0 ``clamp(base * light.intensity(n), 0, 1)``,
    what the ray caster draws a surface point with that normal and base colour in that light, alike from every
    side; the higher bands 0 (for a refit to use, :func:`insitu.step.plyfit.refine_for_viewers`)."""
    if not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"bake_light: expected a degree in 0..{MAX_SH_DEGREE}, got {degree}")
    with torch.no_grad():
        base = gaussians.sh0[:, 0].float() * SH_C0 + 0.5
        rgb = (base * light.intensity(quat_normals(gaussians.quats.float()))[:, None]).clamp(0.0, 1.0)
        sh0 = rgb_to_sh0(rgb).to(gaussians.sh0.dtype)[:, None]
    shN = gaussians.sh0.new_zeros(len(gaussians), (degree + 1) ** 2 - 1, 3)
    return Gaussians(gaussians.means, gaussians.log_scales, gaussians.quats, gaussians.opacity_logits,
                     sh0.contiguous(), shN)


class BlockSamples:
    """A block's samples on a device, to be read at world points (trilinear, clamped to the samples).

    volume: [nz, ny, nx] float32 samples (ghosts included) on the device the values are wanted on;
    origin, spacing: world position of global sample 0 and the cell size, (x, y, z);
    start: global index (x, y, z) of ``volume[0, 0, 0]``.
    """

    def __init__(self, volume: Tensor, *, origin, spacing, start) -> None:
        if volume.ndim != 3:
            raise ValueError(f"BlockSamples: volume: expected [nz, ny, nx], got {tuple(volume.shape)}")
        device = volume.device
        self.volume = volume.to(torch.float32)[None, None]
        self.spacing = torch.as_tensor(np.asarray(spacing, np.float64), dtype=torch.float32, device=device)
        self.offset = torch.as_tensor(np.asarray(origin, np.float64) + np.asarray(start) * np.asarray(spacing),
                                      dtype=torch.float32, device=device)
        nz, ny, nx = volume.shape
        self.top = torch.tensor([nx - 1, ny - 1, nz - 1], dtype=torch.float32, device=device)

    def local(self, points: Tensor) -> Tensor:
        """[M, 3] world points -> local index positions (x, y, z)."""
        return (points.to(self.offset.device, torch.float32) - self.offset) / self.spacing

    def sample(self, q: Tensor) -> Tensor:
        """[M] trilinear values at local index positions ``q: [M, 3]``, clamped to the samples."""
        g = (torch.minimum(q.clamp(min=0.0), self.top) / self.top.clamp(min=1.0)) * 2.0 - 1.0
        return F.grid_sample(self.volume, g.reshape(1, 1, 1, -1, 3), mode="bilinear", padding_mode="border",
                             align_corners=True).reshape(-1)

    def at(self, points: Tensor) -> Tensor:
        """[M] the field at world ``points: [M, 3]``."""
        return self.sample(self.local(points))

    def normals(self, points: Tensor) -> Tensor:
        """``[M, 3]`` unit normals at world ``points: [M, 3]``: the ray caster's (the central difference
        of the trilinear field over one sample each way, clamped to the samples), so a lit Gaussian
        starts with the normal the ground truth shades its point with; +z where the gradient vanishes.
        The field should be at unit size (:func:`insitu.volume.unit_field`): a gradient of 1e-24 squared
        underflows float32."""
        q = self.local(points)
        grad = []
        for axis in range(3):
            step = torch.zeros(3, device=q.device)
            step[axis] = 1.0
            plus, minus = torch.minimum(q + step, self.top), (q - step).clamp(min=0.0)
            span = (plus - minus)[:, axis].clamp(min=1e-12)
            grad.append((self.sample(plus) - self.sample(minus)) / (span * self.spacing[axis]))
        grad = torch.stack(grad, dim=1)
        norm = grad.norm(dim=1, keepdim=True)
        up = torch.tensor([0.0, 0.0, 1.0], device=grad.device).expand_as(grad)
        return torch.where(norm > 0, grad / norm.clamp(min=1e-30), up)


def base_colors(block: Block, points: Tensor, *, color=(0.85, 0.8, 0.7), color_field: str | None = None,
                color_range: tuple[float, float] | None = None, colormap: str = "viridis") -> Tensor:
    """``[M, 3]`` the ground truth's base colour at world ``points: [M, 3]`` (on their device): ``color``,
    or the colour field ``block.fields[color_field]`` (trilinear) mapped through ``colormap`` by its
    global range ``color_range`` (a constant field: the map's middle colour), as the ray caster colours
    the surface there before it shades it."""
    if color_field is None:
        return torch.as_tensor(color, dtype=torch.float32, device=points.device).expand(points.shape[0], 3)
    values = torch.from_numpy(unit_colors(block.fields[color_field], *color_range)).to(points.device)
    field = BlockSamples(values, origin=block.origin, spacing=block.spacing, start=block.start)
    return apply_colormap(field.at(points), colormap)


def drawn_otherwise(color_model: str, eps2d: float, antialiased: bool = False) -> bool:
    """Whether a standard 3DGS viewer draws a model trained with ``color_model`` and the rasterizer's blur
    ``eps2d`` (``antialiased`` or not) otherwise than training did: lit colours (a ``.ply`` holds SH colours
    only) or a blur other than the viewers' ``STANDARD_EPS2D``, added as they add it (not antialiased). Then
    ``model.ply`` holds an SH model fitted and trained as such a viewer draws it
    (:func:`insitu.step.plyfit.model_ply`), else the trained model itself."""
    return color_model != "sh" or eps2d != STANDARD_EPS2D or antialiased


def refits_ply(cfg) -> bool:
    """Whether a step of ``cfg`` (an :class:`insitu.config.Config`) trains the standard files' SH model as standard
    viewers draw it after training (:func:`insitu.step.plyfit.refine_for_viewers`): a model they draw otherwise, a
    share of iterations for it, and ``model.ply``, ``model.spz``, ``model.glb`` or their figures to make."""
    return drawn_otherwise(cfg.train.color_model, cfg.train.eps2d, cfg.train.antialiased) \
        and cfg.output.ply_refine > 0 \
        and (cfg.output.ply or cfg.output.spz or cfg.output.glb or cfg.output.ply_metrics)


def spz_trained(cfg) -> bool:
    """Whether ``model.spz`` of a step of ``cfg`` (an :class:`insitu.config.Config`) holds the trained Gaussians
    themselves, in the standard files' colours, with its header's flag "drawn antialiased": a model trained with the
    antialiased blur (``train.antialiased``). Viewers that draw antialiased (Spark by default, its ``blurAmount``
    0.3: gsplat's antialiased mode at ``STANDARD_EPS2D``; those that read SPZ's flag) draw such Gaussians as
    training did but for a wider blur, which the opacity scaling keeps faint where a Gaussian is under a pixel;
    model.ply's model, merged and refit for viewers that draw every Gaussian 0.3 px^2 wider and as opaque, would
    draw too faint there. The trained Gaussians are refit as such viewers draw them (their 0.3 px^2 is six times
    training's ``train.eps2d``): at 1024^2 that moves their surface +1.7 to +2.3 dB on the orbit and -0.1 to +1.1 dB
    close up (docs/log.md). Else model.spz holds model.ply's model."""
    return bool(cfg.train.antialiased)


def spz_blur(cfg, eps2d: float, antialiased: bool, iterations: int) -> tuple[float, bool]:
    """``(eps2d, antialiased)``: the blur ``model.spz``'s model of a step of ``cfg`` (an
    :class:`insitu.config.Config`) is made to be drawn with, for a model trained with ``eps2d`` (``antialiased`` or
    not) for ``iterations``: a model refit as viewers draw it (:func:`refits_ply`, and a refit of at least one
    iteration), theirs: ``STANDARD_EPS2D`` added, antialiased for the trained Gaussians (:func:`spz_trained`), as
    classic viewers add it for model.ply's model; a model not refit, the model's own."""
    if refits_ply(cfg) and round(cfg.output.ply_refine * iterations) > 0:
        return STANDARD_EPS2D, spz_trained(cfg)
    return eps2d, antialiased


def standard_light(cfg) -> FixedLight | None:
    """The fixed light that the standard files (``model.ply``, ``model.spz``) of a step of ``cfg`` (an
    :class:`insitu.config.Config`) are lit by: a lit model's with ``output.ply_light`` fixed; else None, they hold
    the model's own colours (an SH model's, or an SH fit of a lit model's headlight)."""
    return FIXED_LIGHT if cfg.train.color_model == "lit" and cfg.output.ply_light == "fixed" else None


def standard_degree(cfg, degree: int) -> int:
    """The SH degree of the standard files' model fitted for them (:func:`insitu.step.plyfit.model_ply`) from a
    trained model of SH ``degree``: ``output.sh_degree`` (at most ``degree`` for an SH model), else
    :data:`FIXED_LIGHT_DEGREE` in the fixed light, ``train.sh_degree`` for a lit model's headlight fit, an SH
    model's own ``degree``."""
    chosen = cfg.output.sh_degree
    if cfg.train.color_model == "sh":
        return degree if chosen is None else min(chosen, degree)
    if chosen is not None:
        return chosen
    return FIXED_LIGHT_DEGREE if standard_light(cfg) is not None else cfg.train.sh_degree
