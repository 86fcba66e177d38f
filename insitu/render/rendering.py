"""Rasterize 3D Gaussians into images: one interface, two backends.

``rasterize`` renders a shard of Gaussians into premultiplied colour and alpha for a
batch of cameras. Two backends compute the same image:

- ``"gsplat"``: ``gsplat.rasterization`` (CUDA kernels; classic or antialiased mode, no background).
- ``"torch"``: a pure-PyTorch rasterizer that follows gsplat's math step by step
  (EWA projection, ``eps2d`` blur and, antialiased, its opacity compensation,
  opacity-aware 3.33-sigma extent, alpha clamped at
  0.999, alphas below 1/255 skipped, front-to-back compositing that stops once the
  transmittance would fall to 1e-4). It runs on any device, is differentiable through
  autograd, and is the CPU training path and the oracle in tests.

The torch backend works on (Gaussian, pixel) pairs rather than padded tiles. Drawn
Gaussians are taken front to back in runs of at most ``_PAIR_BUDGET`` box pixels; each
is paired with the pixels of its extent box, pairs below the alpha threshold or on
pixels that are already done are dropped before autograd sees them, the rest are sorted
by pixel (depth order kept inside a pixel), and the transmittance is a running sum of
log(1 - alpha) restarted at every pixel and carried from run to run. Memory and time
follow the pairs actually composited (the projected area of the visible Gaussians),
never ``N x H x W``; the only Python loop is over the depth runs.

Camera model (as ``insitu.groundtruth.views`` and gsplat): ``viewmats`` world-to-camera, OpenCV
axes (+x right, +y down, +z forward); pinhole ``Ks`` in pixels; pixel ``(u, v)`` has
its centre at ``(u + 0.5, v + 0.5)``.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from insitu.render.shading import MAX_SH_DEGREE, sh_basis, sh_colors

__all__ = ["rasterize", "eval_sh", "blur_opacity_factors", "BACKENDS", "STANDARD_EPS2D"]

BACKENDS = ("auto", "gsplat", "torch")

# Constants shared with gsplat's CUDA rasterizer (include/Common.h, RasterizeToPixels3DGSFwd.cu).
ALPHA_THRESHOLD = 1.0 / 255.0
ALPHA_MAX = 0.999
TRANSMITTANCE_MIN = 1e-4
EXTENT_SIGMAS = 3.33

# The torch backend takes Gaussians front to back in runs of at most this many box pixels.
_PAIR_BUDGET = 1 << 16

STANDARD_EPS2D = 0.3    # px^2 the reference 3DGS rasterizer and the viewers that open a .ply add to every 2D covariance


def eval_sh(degree: int, dirs: Tensor, coeffs: Tensor) -> Tensor:
    """Evaluate real spherical harmonics of bands ``0..degree`` (gsplat's basis and order).

    Args:
        degree: highest band to use, 0..3.
        dirs: [..., 3] view directions (normalised here).
        coeffs: [..., K, 3] coefficients, K >= (degree + 1) ** 2; extra ones are ignored.

    Returns:
        [..., 3] the SH value (without the +0.5 offset that ``rasterize`` adds).
    """
    if not 0 <= degree <= MAX_SH_DEGREE:
        raise ValueError(f"eval_sh: expected a degree in 0..{MAX_SH_DEGREE}, got {degree}")
    if coeffs.shape[-2] < (degree + 1) ** 2:
        raise ValueError(f"eval_sh: degree {degree} needs >= {(degree + 1) ** 2} coefficients, "
                         f"got {coeffs.shape[-2]}")
    basis = sh_basis(degree, dirs)                                       # [..., B]
    return (basis[..., None] * coeffs[..., : basis.shape[-1], :]).sum(dim=-2)


def rasterize(
    means: Tensor,      # [N, 3]
    quats: Tensor,      # [N, 4]
    scales: Tensor,     # [N, 3]
    opacities: Tensor,  # [N]
    colors: Tensor,     # [N, 3], [C, N, D] or [N, K, 3]
    viewmats: Tensor,   # [C, 4, 4]
    Ks: Tensor,         # [C, 3, 3]
    width: int,
    height: int,
    *,
    sh_degree: int | None = None,
    backend: str = "auto",
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    eps2d: float = STANDARD_EPS2D,
    antialiased: bool = False,
    radius_clip: float = 0.0,
    tile_size: int = 16,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Render Gaussians into premultiplied colour and alpha for ``C`` cameras.

    Args:
        means: [N, 3] centres in world coordinates.
        quats: [N, 4] rotations (w, x, y, z), normalised here.
        scales: [N, 3] standard deviations along the local axes (activated).
        opacities: [N] opacities in [0, 1] (activated).
        colors: [N, K, 3] SH coefficients when ``sh_degree`` is set
            (K >= (sh_degree + 1) ** 2), else RGB: [N, 3], or [C, N, D] channels per camera
            (D = 3: RGB; any D: blended like colours, e.g. the lit model's base colour and normal).
        viewmats: [C, 4, 4] world-to-camera matrices (OpenCV axes).
        Ks: [C, 3, 3] pinhole intrinsics in pixels.
        width, height: image size in pixels.
        sh_degree: SH band to evaluate (0..3), or None for plain RGB colours. SH colours
            are evaluated along ``means - camera centre``, then ``+0.5`` and clamped at 0.
        backend: ``"gsplat"`` (CUDA only), ``"torch"`` (any device) or ``"auto"``
            (gsplat when the tensors are on CUDA and gsplat imports, else torch).
        near_plane, far_plane: Gaussians with camera depth outside (near, far) are culled.
        eps2d: added to the diagonal of every projected 2D covariance (px^2): the pixel filter.
            Standard 3DGS rasterizers and viewers add ``STANDARD_EPS2D``.
        antialiased: also scale each Gaussian's opacity in each camera by
            ``sqrt(det(cov2d) / det(cov2d + eps2d I))`` (gsplat's ``"antialiased"`` mode, Mip-Splatting's 2D
            filter): the blur then spreads a splat's footprint without adding to its integral, as a box filter
            of the pixel does, where ``False`` (gsplat's ``"classic"``) thickens what projects thinner than it.
        radius_clip: Gaussians whose pixel radius is <= this in both axes are culled.
        tile_size: gsplat's screen tile edge in pixels (the torch backend pairs
            Gaussians with pixels directly and does not use tiles).

    Returns:
        render: [C, H, W, 3] (or D) premultiplied colour ``sum_i w_i c_i`` (no background).
        alpha: [C, H, W, 1] accumulated opacity ``sum_i w_i``.
        info: ``means2d`` [C, N, 2] projected centres in pixels (its ``.grad`` is filled by
            backward), ``radii`` [C, N] int32 pixel radius,
            > 0 where the Gaussian is drawn, ``depths`` [C, N] camera depths, ``conics``
            [C, N, 3] inverse 2D covariances (xx, xy, yy) including ``eps2d``, ``backend``
            (the one chosen), ``width``, ``height``, ``n_cameras``. ``means2d``, ``depths``
            and ``conics`` are meaningful only where ``radii > 0`` (gsplat leaves the others
            uninitialised).

    With N = 0 the images are zeros, on the autograd graph of the inputs, and no kernel
    runs (whichever backend was chosen).
    """
    N, C = _validate(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                     sh_degree, backend, near_plane, far_plane, eps2d, antialiased, radius_clip, tile_size)
    chosen = _resolve_backend(backend, means.device)
    if chosen == "gsplat":
        if means.dtype != torch.float32:
            raise ValueError(f"rasterize: the gsplat backend expects float32 tensors, got {means.dtype}")
        if N > 0:
            return _rasterize_gsplat(means, quats, scales, opacities, colors, viewmats, Ks,
                                     width, height, sh_degree, near_plane, far_plane, eps2d,
                                     antialiased, radius_clip, tile_size)
    # The torch path also serves an empty shard for gsplat: its result is all zeros.
    render, alpha, info = _rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks,
                                           width, height, sh_degree, near_plane, far_plane,
                                           eps2d, antialiased, radius_clip)
    info["backend"] = chosen
    return render, alpha, info


# --------------------------------------------------------------------------- validation

def _validate(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
              sh_degree, backend, near_plane, far_plane, eps2d, antialiased, radius_clip,
              tile_size) -> tuple[int, int]:
    named = {"means": means, "quats": quats, "scales": scales, "opacities": opacities,
             "colors": colors, "viewmats": viewmats, "Ks": Ks}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"rasterize: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"rasterize: {name} must be a floating-point tensor, got {t.dtype}")
    if means.dim() != 2 or means.shape[1] != 3:
        raise ValueError(f"rasterize: means: expected shape [N, 3], got {list(means.shape)}")
    N = means.shape[0]
    for name, t, tail in (("quats", quats, (4,)), ("scales", scales, (3,)),
                          ("opacities", opacities, ())):
        if tuple(t.shape) != (N, *tail):
            want = ", ".join(["N"] + [str(d) for d in tail])
            raise ValueError(f"rasterize: {name}: expected shape [{want}] = {[N, *tail]} "
                             f"(N from means), got {list(t.shape)}")
    if sh_degree is None:
        C = viewmats.shape[0] if viewmats.dim() == 3 else -1
        if not (tuple(colors.shape) == (N, 3) or colors.dim() == 3 and tuple(colors.shape[:2]) == (C, N)
                and colors.shape[2] >= 1):
            hint = " (SH coefficients [N, K, 3] need sh_degree)" if colors.dim() == 3 else ""
            raise ValueError(f"rasterize: colors: expected RGB of shape [N, 3] = {[N, 3]} or D channels per "
                             f"camera [C, N, D] = {[C, N, 'D']} when sh_degree is None, got "
                             f"{list(colors.shape)}{hint}")
    else:
        if (isinstance(sh_degree, bool) or not isinstance(sh_degree, int)
                or not 0 <= sh_degree <= MAX_SH_DEGREE):
            raise ValueError(f"rasterize: sh_degree: expected None or an int in 0..{MAX_SH_DEGREE}, "
                             f"got {sh_degree!r}")
        K = (sh_degree + 1) ** 2
        if colors.dim() != 3 or colors.shape[0] != N or colors.shape[2] != 3 or colors.shape[1] < K:
            raise ValueError(f"rasterize: colors: expected SH coefficients of shape [N, K, 3] "
                             f"with N = {N} and K >= {K} for sh_degree {sh_degree}, "
                             f"got {list(colors.shape)}")
    if viewmats.dim() != 3 or tuple(viewmats.shape[1:]) != (4, 4):
        raise ValueError(f"rasterize: viewmats: expected shape [C, 4, 4], got {list(viewmats.shape)}")
    C = viewmats.shape[0]
    if C == 0:
        raise ValueError("rasterize: viewmats: expected at least one camera, got C = 0")
    if tuple(Ks.shape) != (C, 3, 3):
        raise ValueError(f"rasterize: Ks: expected shape [C, 3, 3] = {[C, 3, 3]} (C from viewmats), "
                         f"got {list(Ks.shape)}")
    for name, t in named.items():
        if t.device != means.device:
            raise ValueError(f"rasterize: all tensors must be on one device: means is on "
                             f"{means.device}, {name} is on {t.device}")
        if t.dtype != means.dtype:
            raise ValueError(f"rasterize: all tensors must share one dtype: means is {means.dtype}, "
                             f"{name} is {t.dtype}")
    for name, v in (("width", width), ("height", height), ("tile_size", tile_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"rasterize: {name}: expected a positive int, got {v!r}")
    if backend not in BACKENDS:
        raise ValueError(f"rasterize: backend: expected one of {BACKENDS}, got {backend!r}")
    if not 0 <= near_plane < far_plane:
        raise ValueError(f"rasterize: expected 0 <= near_plane < far_plane, got "
                         f"near_plane={near_plane}, far_plane={far_plane}")
    if eps2d < 0:
        raise ValueError(f"rasterize: eps2d: expected >= 0, got {eps2d}")
    if not isinstance(antialiased, bool):
        raise ValueError(f"rasterize: antialiased: expected True or False, got {antialiased!r}")
    if radius_clip < 0:
        raise ValueError(f"rasterize: radius_clip: expected >= 0, got {radius_clip}")
    return N, C


@functools.lru_cache(maxsize=None)
def gsplat_import_error() -> str | None:
    """None when gsplat imports, else why it does not."""
    try:
        import gsplat  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA extension
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=None)
def _warn_torch_on_cuda() -> None:
    """Once per process: CUDA tensors, but gsplat does not import, so the (much slower) torch path runs."""
    warnings.warn(f"rasterize: gsplat does not import ({gsplat_import_error()}); backend 'auto' renders CUDA "
                  "tensors with the torch reference rasterizer, which is orders of magnitude slower. Install "
                  "gsplat, or pass backend='torch' to choose it knowingly.", RuntimeWarning, stacklevel=3)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if gsplat_import_error() is not None:
            _warn_torch_on_cuda()
            return "torch"
        return "gsplat"
    if device.type != "cuda":
        raise ValueError(f"rasterize: backend 'gsplat' needs CUDA tensors, got tensors on {device}; "
                         "use backend='torch' (or 'auto') on this device")
    err = gsplat_import_error()
    if err is not None:
        raise RuntimeError(f"rasterize: backend 'gsplat' requested but gsplat does not import ({err})")
    return "gsplat"


# --------------------------------------------------------------------------- gsplat backend

def _rasterize_gsplat(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                      sh_degree, near_plane, far_plane, eps2d, antialiased, radius_clip, tile_size):
    import gsplat

    means, quats, scales, opacities, colors, viewmats, Ks = (
        t.contiguous() for t in (means, quats, scales, opacities, colors, viewmats, Ks))
    if sh_degree is not None:       # gsplat's colours, with the coefficients' gradient deferrable
        colors = sh_colors(means, colors, _camera_centres(viewmats), sh_degree)      # [C, N, 3]
    render, alpha, meta = gsplat.rasterization(
        means, quats, scales, opacities, colors, viewmats, Ks, width, height,
        near_plane=near_plane, far_plane=far_plane, radius_clip=radius_clip, eps2d=eps2d,
        sh_degree=None, packed=False, tile_size=tile_size, backgrounds=None,
        render_mode="RGB", rasterize_mode="antialiased" if antialiased else "classic", absgrad=False)
    means2d = meta["means2d"]
    if means2d.requires_grad:
        means2d.retain_grad()
    radii = meta["radii"]
    if radii.dim() == 3:                     # gsplat >= 1.5 gives per-axis radii [C, N, 2]
        radii = radii.max(dim=-1).values
    info = {"means2d": means2d, "radii": radii.to(torch.int32), "depths": meta["depths"],
            "conics": meta["conics"], "backend": "gsplat", "width": width, "height": height,
            "n_cameras": viewmats.shape[0]}
    return render, alpha, info


def _camera_centres(viewmats: Tensor) -> Tensor:
    """[C, 4, 4] world-to-camera rigid transforms -> [C, 3] camera centres ``-R^T t``."""
    R, t = viewmats[:, :3, :3], viewmats[:, :3, 3]
    return -torch.einsum("cji,cj->ci", R, t)


# --------------------------------------------------------------------------- torch backend

@dataclass
class _Projected:
    """Gaussians projected into C cameras (the torch backend's intermediate state).

    means2d: [C, N, 2] pixel centres; conics: [C, N, 3] inverse 2D covariance (xx, xy, yy);
    depths: [C, N]; radii: [C, N, 2] int32 per-axis pixel radius, 0 where culled;
    compensations: [C, N] the antialiased mode's opacity factors (None in classic mode).
    """

    means2d: Tensor
    conics: Tensor
    depths: Tensor
    radii: Tensor
    compensations: Tensor | None = None


def quat_scale_to_covar(quats: Tensor, scales: Tensor) -> Tensor:
    """[N, 4] wxyz quaternions and [N, 3] scales -> [N, 3, 3] covariances R S S^T R^T."""
    w, x, y, z = F.normalize(quats, dim=-1).unbind(-1)
    R = torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ], dim=-1).reshape(-1, 3, 3)
    M = R * scales[:, None, :]
    return M @ M.transpose(1, 2)


def _project(means, quats, scales, opacities, viewmats, Ks, width, height,
             near_plane, far_plane, eps2d, radius_clip, antialiased: bool = False) -> _Projected:
    """EWA splatting projection, as gsplat's fully fused projection (pinhole, classic or antialiased)."""
    covars = quat_scale_to_covar(quats, scales)                         # [N, 3, 3]
    Rv, tv = viewmats[:, :3, :3], viewmats[:, :3, 3]                     # [C, 3, 3], [C, 3]
    means_c = torch.einsum("cij,nj->cni", Rv, means) + tv[:, None, :]    # [C, N, 3]
    cov_c = torch.einsum("cij,njk,clk->cnil", Rv, covars, Rv)            # [C, N, 3, 3]
    x, y, z = means_c.unbind(-1)
    valid = (z > near_plane) & (z < far_plane)
    z = torch.where(valid, z, torch.ones_like(z))                        # keep culled ones finite
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]                        # [C, 1]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    # The Jacobian is taken at the centre clamped to 1.3x the field of view (as gsplat).
    lim_x_pos = (width - cx) / fx + 0.3 * (0.5 * width / fx)
    lim_x_neg = cx / fx + 0.3 * (0.5 * width / fx)
    lim_y_pos = (height - cy) / fy + 0.3 * (0.5 * height / fy)
    lim_y_neg = cy / fy + 0.3 * (0.5 * height / fy)
    tx = z * torch.minimum(torch.maximum(x / z, -lim_x_neg), lim_x_pos)
    ty = z * torch.minimum(torch.maximum(y / z, -lim_y_neg), lim_y_pos)
    j00, j02 = fx / z, -fx * tx / (z * z)
    j11, j12 = fy / z, -fy * ty / (z * z)
    s00, s01, s02 = cov_c[..., 0, 0], cov_c[..., 0, 1], cov_c[..., 0, 2]
    s11, s12, s22 = cov_c[..., 1, 1], cov_c[..., 1, 2], cov_c[..., 2, 2]
    a = j00 * j00 * s00 + 2 * j00 * j02 * s02 + j02 * j02 * s22 + eps2d
    b = j00 * j11 * s01 + j00 * j12 * s02 + j02 * j11 * s12 + j02 * j12 * s22
    c = j11 * j11 * s11 + 2 * j11 * j12 * s12 + j12 * j12 * s22 + eps2d
    det = a * c - b * b
    valid = valid & (det > 0)
    det = torch.where(valid, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], dim=-1)           # [C, N, 3]
    compensations = None
    if antialiased:     # the blur spreads the footprint and keeps its integral (gsplat's add_blur)
        det_orig = (a - eps2d) * (c - eps2d) - b * b
        compensations = torch.sqrt(torch.clamp(det_orig / det, min=0.0))
    means2d = torch.stack([fx * x / z + cx, fy * y / z + cy], dim=-1)    # [C, N, 2]

    with torch.no_grad():
        # Opacity-aware extent: beyond it alpha < 1/255 (gsplat passes opacities for this, times the
        # compensation in antialiased mode).
        op = opacities.detach()[None, :].expand_as(a)
        if compensations is not None:
            op = op * compensations.detach()
        valid = valid & (op >= ALPHA_THRESHOLD)
        extend = torch.sqrt(2.0 * torch.log(op.clamp(min=ALPHA_THRESHOLD) / ALPHA_THRESHOLD))
        extend = extend.clamp(max=EXTENT_SIGMAS)
        rx = torch.ceil(extend * torch.sqrt(a.detach().clamp(min=0)))
        ry = torch.ceil(extend * torch.sqrt(c.detach().clamp(min=0)))
        valid = valid & ~((rx <= radius_clip) & (ry <= radius_clip))
        mx, my = means2d.detach().unbind(-1)
        valid = valid & (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        radii = torch.where(valid[..., None], torch.stack([rx, ry], dim=-1), 0).to(torch.int32)
    return _Projected(means2d, conics, means_c[..., 2], radii, compensations)


def blur_opacity_factors(means: Tensor, quats: Tensor, scales: Tensor, viewmats: Tensor, Ks: Tensor, width: int,
                         height: int, *, eps2d: float, antialiased: bool,
                         to_eps2d: float = STANDARD_EPS2D) -> tuple[Tensor, Tensor]:
    """``(factor [C, N], inside [C, N])``: by how much each Gaussian's opacity must scale so that, drawn in each
    camera with the classic blur ``to_eps2d`` (standard viewers'), its footprint holds the opacity it holds drawn
    with ``eps2d`` (``antialiased`` or not): the integral over the image of its alpha, before clamping,
    ``opacity * 2 pi sqrt(det)`` of its projected covariance plus the blur (antialiased: of the covariance
    alone), so ``sqrt(det(S + e) / det(S + to_eps2d))`` with ``S`` its projected covariance (pixels^2, the EWA
    projection of :func:`rasterize`) and ``e`` 0 antialiased, else ``eps2d``. A Gaussian narrower than the blur
    spreads over more pixels drawn with a larger one: the factor is below 1. ``inside``: whether its centre lies
    in front of the camera and in the image (elsewhere the factor is 1)."""
    covars = quat_scale_to_covar(quats, scales)                         # [N, 3, 3]
    Rv, tv = viewmats[:, :3, :3], viewmats[:, :3, 3]
    means_c = torch.einsum("cij,nj->cni", Rv, means) + tv[:, None, :]    # [C, N, 3]
    cov_c = torch.einsum("cij,njk,clk->cnil", Rv, covars, Rv)            # [C, N, 3, 3]
    x, y, z = means_c.unbind(-1)
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    inside = z > 0
    z = torch.where(inside, z, torch.ones_like(z))
    u, v = fx * x / z + cx, fy * y / z + cy
    inside = inside & (u >= 0) & (u < width) & (v >= 0) & (v < height)
    j00, j02 = fx / z, -fx * x / (z * z)
    j11, j12 = fy / z, -fy * y / (z * z)
    s00, s01, s02 = cov_c[..., 0, 0], cov_c[..., 0, 1], cov_c[..., 0, 2]
    s11, s12, s22 = cov_c[..., 1, 1], cov_c[..., 1, 2], cov_c[..., 2, 2]
    a = j00 * j00 * s00 + 2 * j00 * j02 * s02 + j02 * j02 * s22
    b = j00 * j11 * s01 + j00 * j12 * s02 + j02 * j11 * s12 + j02 * j12 * s22
    c = j11 * j11 * s11 + 2 * j11 * j12 * s12 + j12 * j12 * s22
    e = 0.0 if antialiased else eps2d
    drawn = ((a + e) * (c + e) - b * b).clamp(min=0.0)
    standard = (a + to_eps2d) * (c + to_eps2d) - b * b
    factor = torch.sqrt(drawn / standard.clamp(min=1e-30))
    return torch.where(inside, factor, torch.ones_like(factor)), inside


@dataclass
class _Pairs:
    """(Gaussian, pixel) pairs to composite, ordered by pixel and front to back within one.

    gauss: [M] flat Gaussian index ``c * N + n``; pixel: [M] flat pixel index
    ``c * H * W + y * W + x``; px, py: [M] pixel column and row.
    """

    gauss: Tensor
    pixel: Tensor
    px: Tensor
    py: Tensor


def _falloff(g: Tensor, px: Tensor, py: Tensor) -> Tensor:
    """``log(opacity * exp(-sigma))`` at pixel centres.

    g: [M, >=6] rows of (mean x, mean y, conic xx, conic xy, conic yy, log opacity, ...);
    px, py: [M] pixel column and row.
    """
    mx, my, ca, cb, cc, log_op = g[:, :6].unbind(-1)
    dx = mx - (px.to(g.dtype) + 0.5)
    dy = my - (py.to(g.dtype) + 0.5)
    return log_op - (0.5 * (ca * dx * dx + cc * dy * dy) + cb * dx * dy)


@torch.no_grad()
def _pixel_boxes(proj: _Projected, width: int, height: int) -> tuple[Tensor, Tensor]:
    """Drawn Gaussians front to back and the pixel boxes their extents cover.

    Returns ``order`` [V] flat indices ``c * N + n`` sorted by depth, and ``boxes`` [V, 4]
    int64 (x0, y0, box width, box height), clipped to the image.
    """
    radii = proj.radii.reshape(-1, 2)
    order = torch.nonzero((radii > 0).all(dim=-1)).flatten()
    order = order[torch.argsort(proj.depths.reshape(-1)[order], stable=True)]
    m = proj.means2d.detach().reshape(-1, 2).index_select(0, order)
    r = radii.index_select(0, order).to(m.dtype)
    size = torch.tensor([width, height], device=m.device, dtype=m.dtype)
    lo = torch.minimum(torch.floor(m - r).clamp(min=0), size)
    hi = torch.minimum(torch.ceil(m + r).clamp(min=0), size)
    return order, torch.cat([lo, hi - lo], dim=1).long()


@torch.no_grad()
def _pairs(gauss: Tensor, boxes: Tensor, rows: Tensor, done: Tensor, N: int, width: int,
           height: int) -> _Pairs:
    """Pairs of Gaussians with the pixels of their boxes where alpha >= 1/255 and the pixel
    is not done yet, sorted by pixel; within a pixel they keep the order of ``gauss``.

    gauss: [V] flat indices; boxes: [V, 4]; rows: [V, >=6] as ``_falloff`` reads them;
    done: [C * H * W] bool, pixels whose transmittance already fell to 1e-4.
    """
    device = gauss.device
    counts = boxes[:, 2] * boxes[:, 3]
    owner = torch.repeat_interleave(torch.arange(gauss.numel(), device=device), counts)
    # Pair k of Gaussian i is pixel (x0 + k % w, y0 + k // w) of its box.
    per_gauss = torch.cat([boxes[:, :3], (torch.cumsum(counts, 0) - counts)[:, None], gauss[:, None]], 1)
    x0, y0, bw, first, g = per_gauss.index_select(0, owner).unbind(1)
    local = torch.arange(owner.numel(), device=device) - first
    ly = torch.div(local, bw, rounding_mode="floor")
    px, py = x0 + (local - ly * bw), y0 + ly
    pixel = (torch.div(g, N, rounding_mode="floor") * height + py) * width + px
    # Drop the pairs gsplat skips (alpha < 1/255) before anything is differentiated.
    keep = _falloff(rows.index_select(0, owner), px, py) >= math.log(ALPHA_THRESHOLD)
    keep = torch.nonzero(keep & ~done[pixel]).flatten()
    kept = torch.stack([g, px, py, pixel], dim=1).index_select(0, keep)   # [M, 4]
    pixel = kept[:, 3].int() if done.numel() < 2**31 else kept[:, 3]     # int32 sorts faster
    perm = torch.sort(pixel, stable=True).indices
    g, px, py, pixel = kept.index_select(0, perm).unbind(1)
    return _Pairs(g, pixel, px, py)


def _chunks(counts: Tensor, budget: int) -> list[tuple[int, int]]:
    """Split consecutive Gaussians into [start, stop) runs of at most ``budget`` box pixels
    (a Gaussian larger than that gets a run of its own)."""
    total = torch.cumsum(counts, 0)
    bounds, start = [], 0
    while start < counts.numel():
        before = total[start - 1] if start > 0 else 0
        stop = int(torch.searchsorted(total, before + budget, right=True))
        stop = max(stop, start + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def _composite(packed: Tensor, proj: _Projected, width: int, height: int, budget: int) -> Tensor:
    """Front-to-back alpha compositing of every camera's image; returns [C * H * W, 4].

    packed: [C * N, 7 + D] rows (mean2d, conic, log opacity, D colour channels, 1). Gaussians are taken
    in depth runs of at most ``budget`` box pixels; the log transmittance of every pixel
    is carried from run to run, and pixels that are done are skipped by later runs.
    """
    C, N = proj.depths.shape
    n_pixels = C * height * width
    device, dtype = packed.device, packed.dtype
    order, boxes = _pixel_boxes(proj, width, height)
    # An empty image stays on the autograd graph, so backward and means2d.grad still work.
    image = torch.zeros(n_pixels, packed.shape[1] - 6, device=device, dtype=dtype) + 0.0 * packed.sum()
    # Log transmittance per pixel, float64: sums over many pairs keep their precision.
    log_t = torch.zeros(n_pixels, device=device, dtype=torch.float64)
    done = torch.zeros(n_pixels, device=device, dtype=torch.bool)
    for start, stop in _chunks(boxes[:, 2] * boxes[:, 3], budget):
        gauss = order[start:stop]
        pairs = _pairs(gauss, boxes[start:stop], packed.detach().index_select(0, gauss), done,
                       N, width, height)
        if pairs.gauss.numel() == 0:
            continue
        rows = packed.index_select(0, pairs.gauss)                       # [M, 7 + D]
        alpha = torch.exp(_falloff(rows, pairs.px, pairs.py)).clamp(max=ALPHA_MAX)
        # Within a pixel: a running sum of log(1 - alpha), restarted at every pixel.
        log_1ma = torch.log1p(-alpha).double()
        cum = torch.cumsum(log_1ma, dim=0)
        with torch.no_grad():
            new_pixel = torch.ones_like(pairs.pixel, dtype=torch.bool)
            new_pixel[1:] = pairs.pixel[1:] != pairs.pixel[:-1]
            first = torch.nonzero(new_pixel).flatten()
            first = first.index_select(0, torch.cumsum(new_pixel, 0) - 1)
        offset = log_t.index_select(0, pairs.pixel) - (cum - log_1ma).index_select(0, first)
        log_t_after = cum + offset
        with torch.no_grad():
            live = log_t_after > math.log(TRANSMITTANCE_MIN)             # pixel done: exclusive
            done[pairs.pixel[~live]] = True
        weights = alpha * (torch.exp(log_t_after - log_1ma).to(dtype) * live)  # alpha_i * T_i
        image = image.index_add(0, pairs.pixel, weights[:, None] * rows[:, 6:])
        log_t = log_t.index_add(0, pairs.pixel, log_1ma * live)
    return image


def _rasterize_torch(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                     sh_degree, near_plane, far_plane, eps2d, antialiased, radius_clip):
    C, N = viewmats.shape[0], means.shape[0]
    proj = _project(means, quats, scales, opacities, viewmats, Ks, width, height,
                    near_plane, far_plane, eps2d, radius_clip, antialiased)
    means2d = proj.means2d
    if means2d.requires_grad:
        means2d.retain_grad()

    if sh_degree is None:
        rgb = colors if colors.dim() == 3 else colors[None].expand(C, N, 3)     # [C, N, 3]
    else:
        dirs = means[None, :, :] - _camera_centres(viewmats)[:, None, :]  # [C, N, 3]
        rgb = eval_sh(sh_degree, dirs, colors[None].expand(C, *colors.shape))
        rgb = torch.clamp_min(rgb + 0.5, 0.0)
    log_op = torch.log(opacities.clamp(min=1e-30))[None, :, None].expand(C, N, 1)
    if proj.compensations is not None:
        log_op = log_op + torch.log(proj.compensations.clamp(min=1e-30))[..., None]
    # One row per (camera, Gaussian): mean2d (2), conic (3), log opacity, the D colour channels, 1.
    packed = torch.cat([means2d, proj.conics, log_op, rgb, torch.ones_like(log_op)], dim=-1)
    packed = packed.reshape(C * N, packed.shape[-1])

    image = _composite(packed, proj, width, height, _PAIR_BUDGET).reshape(C, height, width, -1)
    info = {"means2d": means2d, "radii": proj.radii.max(dim=-1).values, "depths": proj.depths,
            "conics": proj.conics, "backend": "torch", "width": width, "height": height,
            "n_cameras": C}
    return image[..., :-1], image[..., -1:], info
