"""Tests for insitu.render.rendering: hand-worked cases, gsplat's pure-torch pieces, gsplat on CUDA."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import torch

from insitu.groundtruth.views import look_at, orbit_views
from insitu.render import rendering
from insitu.render.rendering import ALPHA_MAX, ALPHA_THRESHOLD, TRANSMITTANCE_MIN, eval_sh, rasterize

SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199


def camera(f: float, cx: float, cy: float, n: int = 1, dtype=torch.float32):
    """n identity cameras at the origin looking down +z."""
    K = torch.tensor([[f, 0.0, cx], [0.0, f, cy], [0.0, 0.0, 1.0]], dtype=dtype)
    return torch.eye(4, dtype=dtype).expand(n, 4, 4).clone(), K.expand(n, 3, 3).clone()


def gaussians(means, scales, opacities, colors, dtype=torch.float32):
    """Axis-aligned Gaussians (identity quaternions) from nested lists."""
    means = torch.tensor(means, dtype=dtype)
    scales = torch.tensor(scales, dtype=dtype)
    if scales.dim() == 1:
        scales = scales[:, None].expand(-1, 3).clone()
    quats = torch.zeros(len(means), 4, dtype=dtype)
    quats[:, 0] = 1.0
    return means, quats, scales, torch.tensor(opacities, dtype=dtype), torch.tensor(colors, dtype=dtype)


def random_scene(n: int, seed: int, radius: float = 0.5, scale: float = 0.03, dtype=torch.float32):
    """n Gaussians on a sphere, random rotations, sizes, opacities and colours."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, 3, generator=g, dtype=dtype)
    means = radius * d / d.norm(dim=1, keepdim=True)
    quats = torch.randn(n, 4, generator=g, dtype=dtype)
    scales = scale * (0.5 + torch.rand(n, 3, generator=g, dtype=dtype))
    opacities = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=dtype)
    colors = torch.rand(n, 3, generator=g, dtype=dtype)
    return means, quats, scales, opacities, colors


# --------------------------------------------------------------------------- hand-worked cases

def test_single_isotropic_gaussian_matches_closed_form():
    f, z, W = 100.0, 5.0, 33
    var2d = 4.0                               # s_proj^2 + eps2d: one sigma is 2 pixels
    s_proj = math.sqrt(var2d - 0.3)
    s = s_proj * z / f
    opacity, rgb = 0.8, [0.2, 0.5, 0.9]
    viewmats, Ks = camera(f, 16.5, 16.5)      # the centre lands on pixel (16, 16)'s centre
    render, alpha, info = rasterize(*gaussians([[0.0, 0.0, z]], [s], [opacity], [rgb]),
                                    viewmats, Ks, W, W, backend="torch")
    assert render.shape == (1, W, W, 3) and alpha.shape == (1, W, W, 1)
    assert info["backend"] == "torch"
    torch.testing.assert_close(info["means2d"][0, 0], torch.tensor([16.5, 16.5]))
    assert info["radii"][0, 0] > 0
    for dx, dy in [(0, 0), (2, 0), (0, -2), (3, 1), (-4, 2)]:
        r2 = dx * dx + dy * dy
        want = opacity * math.exp(-0.5 * r2 / (s_proj**2 + 0.3))
        got = alpha[0, 16 + dy, 16 + dx, 0].item()
        assert got == pytest.approx(want, rel=1e-5), (dx, dy)
        torch.testing.assert_close(render[0, 16 + dy, 16 + dx], want * torch.tensor(rgb), rtol=1e-5, atol=1e-7)
    # One sigma away (2 pixels) is exactly opacity * exp(-1/2).
    assert alpha[0, 16, 18, 0].item() == pytest.approx(opacity * math.exp(-0.5), rel=1e-6)
    # Far outside the 3.33-sigma extent nothing is drawn.
    assert alpha[0, 16, 30, 0].item() == 0.0 and alpha[0, 0, 0, 0].item() == 0.0


@pytest.mark.parametrize("s_px", [0.2, 1.5])
def test_antialiased_blur_keeps_a_gaussians_integral(s_px):
    """Antialiased, the eps2d blur scales the opacity by s^2 / (s^2 + eps2d) (an isotropic splat of s px):
    the footprint's integral stays opacity * 2 pi s^2 whatever the blur; classic adds to it."""
    f, z, W, eps2d, opacity = 100.0, 5.0, 33, 0.3, 0.8
    viewmats, Ks = camera(f, 16.5, 16.5)
    g = gaussians([[0.0, 0.0, z]], [s_px * z / f], [opacity], [[1.0, 1.0, 1.0]])
    aa = rasterize(*g, viewmats, Ks, W, W, backend="torch", eps2d=eps2d, antialiased=True)[1][0, ..., 0]
    classic = rasterize(*g, viewmats, Ks, W, W, backend="torch", eps2d=eps2d)[1][0, ..., 0]
    var = s_px ** 2 + eps2d
    for dx, dy in [(0, 0), (1, 0), (0, -1), (1, 1)]:
        want = opacity * s_px ** 2 / var * math.exp(-0.5 * (dx * dx + dy * dy) / var)
        if want >= ALPHA_THRESHOLD:
            assert aa[16 + dy, 16 + dx].item() == pytest.approx(want, rel=1e-5), (dx, dy)
            assert classic[16 + dy, 16 + dx].item() == pytest.approx(want * var / s_px ** 2, rel=1e-5)
    if s_px > 1:                               # resolved by the pixels: the integral is 2 pi s^2 opacity
        assert float(aa.sum()) == pytest.approx(2 * math.pi * s_px ** 2 * opacity, rel=2e-2)


@pytest.mark.parametrize("antialiased", [True, False])
def test_blur_opacity_factors_keep_a_footprint_drawn_with_the_standard_blur(antialiased):
    """blur_opacity_factors: a Gaussian drawn with the standard blur (0.3, classic) and its opacity times the factor
    covers the image as it does drawn with the blur it was trained with (0.05, antialiased or not): the same alpha
    summed over the pixels; about 1 for a Gaussian wide in pixels, sqrt(det) ratio for a narrow one; 1 off the
    image and behind the camera."""
    f, z, W, opacity = 100.0, 5.0, 33, 0.5
    viewmats, Ks = camera(f, 16.5, 16.5)
    for s_px, want in ((0.6, None), (0.1, (0.01 if antialiased else 0.06) / 0.31), (10.0, None)):
        means, quats, scales, _, colors = gaussians([[0.0, 0.0, z]], [[s_px * z / f, s_px * z / f, 1e-4]], [opacity],
                                                    [[1.0, 1.0, 1.0]])
        factor, inside = rendering.blur_opacity_factors(means, quats, scales, viewmats, Ks, W, W, eps2d=0.05,
                                                        antialiased=antialiased)
        assert factor.shape == (1, 1) and bool(inside.all())
        if want is not None:
            assert float(factor) == pytest.approx(want, rel=1e-4), s_px
        if s_px == 10.0:
            assert float(factor) == pytest.approx(1.0, abs=0.005 if antialiased else 0.003)
        if s_px == 0.6:
            trained = rasterize(means, quats, scales, torch.tensor([opacity]), colors, viewmats, Ks, W, W,
                                backend="torch", eps2d=0.05, antialiased=antialiased)[1]
            standard = rasterize(means, quats, scales, opacity * factor[0], colors, viewmats, Ks, W, W,
                                 backend="torch", eps2d=0.3)[1]
            plain = rasterize(means, quats, scales, torch.tensor([opacity]), colors, viewmats, Ks, W, W,
                              backend="torch", eps2d=0.3)[1]
            assert float(standard.sum()) == pytest.approx(float(trained.sum()), rel=0.02)     # (alphas < 1/255 cut)
            assert float(plain.sum()) > 1.2 * float(trained.sum())          # wider and as opaque: more covered
    away = torch.tensor([[40.0, 0.0, z], [0.0, 0.0, -z]])
    factor, inside = rendering.blur_opacity_factors(away, torch.tensor([[1.0, 0, 0, 0]] * 2), torch.full((2, 3), 0.01),
                                                    viewmats, Ks, W, W, eps2d=0.05, antialiased=True)
    assert not bool(inside.any()) and torch.equal(factor, torch.ones(1, 2))


@pytest.mark.parametrize("near_first", [True, False])
def test_two_gaussians_composite_front_to_back(near_first):
    f, W = 80.0, 25
    viewmats, Ks = camera(f, 12.5, 12.5)
    near = ([0.0, 0.0, 4.0], 0.05, 0.7, [1.0, 0.0, 0.0])
    far = ([0.0, 0.0, 6.0], 0.075, 0.6, [0.0, 0.0, 1.0])
    order = [near, far] if near_first else [far, near]
    scene = gaussians(*[list(x) for x in zip(*order)])
    render, alpha, _ = rasterize(*scene, viewmats, Ks, W, W, backend="torch")

    def single(g, dx, dy):                    # alpha of one Gaussian at pixel offset (dx, dy)
        (_, _, z), s, op, _ = g
        var = (f * s / z) ** 2 + 0.3
        a = op * math.exp(-0.5 * (dx * dx + dy * dy) / var)
        return a if a >= ALPHA_THRESHOLD else 0.0   # gsplat skips alphas below 1/255

    for dx, dy in [(0, 0), (1, 0), (2, -1), (2, 2), (3, 3)]:
        a1, a2 = single(near, dx, dy), single(far, dx, dy)
        want_rgb = a1 * torch.tensor(near[3]) + (1 - a1) * a2 * torch.tensor(far[3])
        torch.testing.assert_close(render[0, 12 + dy, 12 + dx], want_rgb, rtol=1e-5, atol=1e-7)
        assert alpha[0, 12 + dy, 12 + dx, 0].item() == pytest.approx(a1 + (1 - a1) * a2, rel=1e-5)


def test_gradients_reach_every_parameter_and_means2d():
    means, quats, scales, opacities, colors = random_scene(300, seed=1)
    params = [t.requires_grad_() for t in (means, quats, scales, opacities, colors)]
    views = orbit_views([-0.5] * 3, [0.5] * 3, 2, 32)
    render, alpha, info = rasterize(*params, views.viewmats, views.Ks, 32, 32, backend="torch")
    w = torch.rand(render.shape, generator=torch.Generator().manual_seed(0))
    ((render * w).sum() + alpha.sum()).backward()
    for name, t in zip(["means", "quats", "scales", "opacities", "colors"], params):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name
    g2d = info["means2d"].grad
    assert g2d is not None and g2d.shape == (2, 300, 2)
    assert torch.isfinite(g2d).all() and g2d.abs().sum() > 0
    # Gaussians that are not drawn get no screen-space gradient.
    assert (g2d[info["radii"] == 0] == 0).all()


@pytest.mark.parametrize("budget, antialiased", [(1 << 16, False), (8, False), (1 << 16, True)])
def test_gradients_match_finite_differences(budget, antialiased, monkeypatch):
    monkeypatch.setattr(rendering, "_PAIR_BUDGET", budget)   # 8: one Gaussian per depth run
    dtype = torch.float64
    means, quats, scales, opacities, colors = gaussians(
        [[0.1, -0.05, 3.0], [-0.1, 0.1, 3.5], [0.0, 0.05, 4.0]],
        [[0.06, 0.04, 0.05], [0.05, 0.07, 0.06], [0.08, 0.05, 0.05]],
        [0.6, 0.7, 0.5], [[1.0, 0.2, 0.1], [0.1, 0.9, 0.3], [0.2, 0.3, 0.8]], dtype=dtype)
    quats = torch.tensor([[0.9, 0.1, 0.2, 0.1], [1.0, 0.0, 0.0, 0.3], [0.8, -0.2, 0.1, 0.0]], dtype=dtype)
    viewmats, Ks = camera(40.0, 6.0, 5.0, dtype=dtype)
    w = torch.rand(1, 10, 12, 3, generator=torch.Generator().manual_seed(3), dtype=dtype)

    def loss(m, q, s, o, c):
        render, alpha, _ = rasterize(m, q, s, o, c, viewmats, Ks, 12, 10, backend="torch", antialiased=antialiased)
        return (render * w).sum() + alpha.sum()

    inputs = tuple(t.clone().requires_grad_() for t in (means, quats, scales, opacities, colors))
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_empty_shard_returns_zeros_and_backward_works():
    means, quats, scales, opacities, colors = (t.requires_grad_() for t in (
        torch.zeros(0, 3), torch.zeros(0, 4), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3)))
    viewmats, Ks = camera(50.0, 8.0, 8.0, n=2)
    render, alpha, info = rasterize(means, quats, scales, opacities, colors, viewmats, Ks, 16, 12)
    assert render.shape == (2, 12, 16, 3) and alpha.shape == (2, 12, 16, 1)
    assert (render == 0).all() and (alpha == 0).all()
    assert info["means2d"].shape == (2, 0, 2) and info["radii"].shape == (2, 0)
    assert info["backend"] == "torch"
    (render.sum() + alpha.sum()).backward()
    assert means.grad is not None and means.grad.shape == (0, 3)
    assert info["means2d"].grad.shape == (2, 0, 2)


def test_empty_shard_with_sh_colours():
    viewmats, Ks = camera(50.0, 8.0, 8.0)
    render, alpha, _ = rasterize(torch.zeros(0, 3), torch.zeros(0, 4), torch.zeros(0, 3), torch.zeros(0),
                                 torch.zeros(0, 4, 3), viewmats, Ks, 16, 16, sh_degree=1)
    assert (render == 0).all() and (alpha == 0).all()


def test_gaussians_behind_camera_or_before_near_plane_are_culled():
    viewmats, Ks = camera(50.0, 8.0, 8.0)
    scene = gaussians([[0.0, 0.0, -5.0], [0.0, 0.0, 0.005], [0.0, 0.0, 0.0]], [0.5, 0.001, 0.5],
                      [0.9, 0.9, 0.9], [[1.0, 1.0, 1.0]] * 3)
    scene = tuple(t.requires_grad_() for t in scene)
    render, alpha, info = rasterize(*scene, viewmats, Ks, 16, 16, backend="torch")
    assert (alpha == 0).all() and (render == 0).all()
    assert (info["radii"] == 0).all()
    assert torch.isfinite(info["means2d"]).all()
    (render.sum() + alpha.sum()).backward()
    for t in scene:
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all()
    # Moved in front of the camera, the first one is drawn.
    front = gaussians([[0.0, 0.0, 5.0]], [0.5], [0.9], [[1.0, 1.0, 1.0]])
    _, alpha, info = rasterize(*front, viewmats, Ks, 16, 16, backend="torch")
    assert alpha.max() > 0.5 and info["radii"][0, 0] > 0


def test_sh_degree_1_colour_follows_view_direction():
    k = torch.tensor([[0.3, -0.2, 0.1], [0.5, 0.4, -0.3], [-0.6, 0.2, 0.8], [0.7, -0.5, 0.2]])
    mean = np.array([0.0, 0.0, 5.0])
    f, W = 60.0, 21
    # Camera 0 at the origin looking down +z; camera 1 at (5, 0, 5) looking down -x.
    eyes = [np.zeros(3), np.array([5.0, 0.0, 5.0])]
    viewmats = torch.tensor(np.stack([look_at(e, mean, up=(0.0, -1.0, 0.0)) for e in eyes]), dtype=torch.float32)
    Ks = torch.tensor([[f, 0, 10.5], [0, f, 10.5], [0, 0, 1]], dtype=torch.float32).expand(2, 3, 3)
    means, quats, scales, opacities, _ = gaussians([mean.tolist()], [0.1], [0.9], [[0.0, 0.0, 0.0]])
    render, alpha, info = rasterize(means, quats, scales, opacities, k[None], viewmats, Ks, W, W,
                                    sh_degree=1, backend="torch")
    torch.testing.assert_close(info["means2d"][:, 0], torch.full((2, 2), 10.5), rtol=0, atol=1e-4)
    for cam, d in enumerate([(0.0, 0.0, 1.0), (-1.0, 0.0, 0.0)]):
        x, y, z = d
        want = SH_C0 * k[0] - SH_C1 * y * k[1] + SH_C1 * z * k[2] - SH_C1 * x * k[3] + 0.5
        want = want.clamp(min=0.0)
        got = render[cam, 10, 10] / alpha[cam, 10, 10]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(render[0, 10, 10], render[1, 10, 10])
    # Coefficients beyond the requested band are ignored.
    extra = torch.cat([k, torch.full((5, 3), 9.0)])[None]
    render9, _, _ = rasterize(means, quats, scales, opacities, extra, viewmats, Ks, W, W,
                              sh_degree=1, backend="torch")
    torch.testing.assert_close(render9, render)


def test_batched_views_equal_single_views():
    scene = random_scene(400, seed=2)
    views = orbit_views([-0.5] * 3, [0.5] * 3, 3, 24)
    render, alpha, info = rasterize(*scene, views.viewmats, views.Ks, 24, 20, backend="torch")
    assert render.shape == (3, 20, 24, 3)
    for c in range(3):
        r1, a1, i1 = rasterize(*scene, views.viewmats[c:c + 1], views.Ks[c:c + 1], 24, 20, backend="torch")
        torch.testing.assert_close(render[c:c + 1], r1)
        torch.testing.assert_close(alpha[c:c + 1], a1)
        assert torch.equal(info["radii"][c:c + 1], i1["radii"])


@pytest.mark.parametrize("budget", [1 << 16, 8])
def test_alpha_stays_in_range_and_opaque_stack_saturates(budget, monkeypatch):
    monkeypatch.setattr(rendering, "_PAIR_BUDGET", budget)
    # Twenty nearly opaque Gaussians on the axis: compositing stops once T would drop to 1e-4.
    n = 20
    viewmats, Ks = camera(50.0, 8.5, 8.5)
    scene = gaussians([[0.0, 0.0, 3.0 + 0.1 * i] for i in range(n)], [0.2] * n, [1.0] * n,
                      [[1.0, 0.5, 0.25]] * n)
    render, alpha, _ = rasterize(*scene, viewmats, Ks, 17, 17, backend="torch")
    assert (alpha >= 0).all() and (alpha <= 1).all()
    centre = alpha[0, 8, 8, 0].item()
    # Two Gaussians at alpha 0.999 leave T = 1e-6 <= 1e-4: only the first one is composited.
    assert centre == pytest.approx(ALPHA_MAX, rel=1e-6)
    torch.testing.assert_close(render[0, 8, 8], ALPHA_MAX * torch.tensor([1.0, 0.5, 0.25]))


# --------------------------------------------------------------------------- input validation

@pytest.mark.parametrize("change, message", [
    (dict(means=torch.zeros(4, 2)), r"means: expected shape \[N, 3\], got \[4, 2\]"),
    (dict(quats=torch.zeros(3, 4)), r"quats: expected shape \[N, 4\] = \[4, 4\] .*got \[3, 4\]"),
    (dict(scales=torch.zeros(4)), r"scales: expected shape \[N, 3\] = \[4, 3\] .*got \[4\]"),
    (dict(opacities=torch.zeros(4, 1)), r"opacities: expected shape \[N\] = \[4\] .*got \[4, 1\]"),
    (dict(colors=torch.zeros(4, 4)), r"colors: expected RGB of shape \[N, 3\] = \[4, 3\].*got \[4, 4\]"),
    (dict(colors=torch.zeros(4, 1, 3)), r"got \[4, 1, 3\] \(SH coefficients \[N, K, 3\] need sh_degree\)"),
    (dict(colors=torch.zeros(4, 1, 3), sh_degree=1), r"K >= 4 for sh_degree 1, got \[4, 1, 3\]"),
    (dict(colors=torch.zeros(4, 16, 3), sh_degree=4), r"sh_degree: expected None or an int in 0..3, got 4"),
    (dict(viewmats=torch.zeros(2, 3, 4)), r"viewmats: expected shape \[C, 4, 4\], got \[2, 3, 4\]"),
    (dict(Ks=torch.zeros(3, 3, 3)), r"Ks: expected shape \[C, 3, 3\] = \[2, 3, 3\] .*got \[3, 3, 3\]"),
    (dict(width=0), r"width: expected a positive int, got 0"),
    (dict(height=12.5), r"height: expected a positive int, got 12.5"),
    (dict(backend="cuda"), r"backend: expected one of \('auto', 'gsplat', 'torch'\), got 'cuda'"),
    (dict(means=torch.zeros(4, 3, dtype=torch.float64)), r"one dtype: means is torch.float64, quats is torch.float32"),
    (dict(opacities=torch.zeros(4, dtype=torch.int64)), r"opacities must be a floating-point tensor"),
    (dict(near_plane=2.0, far_plane=1.0), r"near_plane < far_plane"),
    (dict(antialiased="yes"), r"antialiased: expected True or False, got 'yes'"),
])
def test_bad_inputs_raise_clear_errors(change, message):
    args = dict(means=torch.zeros(4, 3), quats=torch.zeros(4, 4), scales=torch.zeros(4, 3),
                opacities=torch.zeros(4), colors=torch.zeros(4, 3), viewmats=torch.zeros(2, 4, 4),
                Ks=torch.zeros(2, 3, 3), width=16, height=12)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        rasterize(**args)


def test_gsplat_backend_on_cpu_tensors_is_refused():
    scene = random_scene(5, seed=0)
    viewmats, Ks = camera(50.0, 8.0, 8.0)
    with pytest.raises(ValueError, match="backend 'gsplat' needs CUDA tensors, got tensors on cpu"):
        rasterize(*scene, viewmats, Ks, 16, 16, backend="gsplat")
    _, _, info = rasterize(*scene, viewmats, Ks, 16, 16, backend="auto")
    assert info["backend"] == "torch"


# --------------------------------------------------------------------------- against gsplat's pure-torch pieces

def test_projection_matches_gsplat_torch_impl():
    from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci

    means, quats, scales, opacities, colors = random_scene(500, seed=4)
    opacities = torch.ones_like(opacities)     # gsplat's torch impl has no opacity-aware extent
    views = orbit_views([-0.5] * 3, [0.5] * 3, 3, 48)
    _, _, info = rasterize(means, quats, scales, opacities, colors, views.viewmats, views.Ks, 48, 40,
                           backend="torch")
    covars, _ = _quat_scale_to_covar_preci(quats, scales, compute_preci=False)
    radii, means2d, depths, conics, _ = _fully_fused_projection(
        means, covars, views.viewmats, views.Ks, 48, 40, eps2d=0.3, near_plane=0.01)
    torch.testing.assert_close(info["means2d"], means2d, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(info["depths"], depths)
    torch.testing.assert_close(info["conics"], conics, rtol=1e-4, atol=1e-6)
    # Same culling; extents agree to the pixel (3.33 sigma vs sqrt(2 ln 255) = 3.3290 sigma).
    radii = radii.max(dim=-1).values
    assert torch.equal(info["radii"] > 0, radii > 0)
    assert (info["radii"] - radii).abs().max() <= 1


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_eval_sh_matches_gsplat(degree):
    from gsplat.cuda._torch_impl import _spherical_harmonics

    g = torch.Generator().manual_seed(degree)
    dirs = torch.randn(200, 3, generator=g, dtype=torch.float64)
    coeffs = torch.randn(200, 16, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(eval_sh(degree, dirs, coeffs), _spherical_harmonics(degree, dirs, coeffs))


def _gsplat_kernel_reference(means, quats, scales, opacities, colors, viewmats, Ks, width, height,
                             tile_size, antialiased=False):
    """gsplat's pipeline with its pure-torch projection and tile intersection, then a literal
    per-pixel transcription of its forward kernel (RasterizeToPixels3DGSFwd.cu)."""
    from gsplat.cuda._torch_impl import (_fully_fused_projection, _isect_offset_encode, _isect_tiles,
                                         _quat_scale_to_covar_preci)

    C, N = viewmats.shape[0], means.shape[0]
    covars, _ = _quat_scale_to_covar_preci(quats, scales, compute_preci=False)
    radii, means2d, depths, conics, compensations = _fully_fused_projection(
        means, covars, viewmats, Ks, width, height, eps2d=0.3, near_plane=0.01, calc_compensations=antialiased)
    if antialiased:                           # gsplat's rasterization: opacities times the compensations
        opacities = (opacities[None, :] * compensations).reshape(-1)
    else:
        opacities = opacities[None, :].expand(C, N).reshape(-1)
    tiles_x, tiles_y = math.ceil(width / tile_size), math.ceil(height / tile_size)
    _, isect_ids, flatten_ids = _isect_tiles(means2d, radii, depths, tile_size, tiles_x, tiles_y)
    offsets = _isect_offset_encode(isect_ids, C, tiles_x, tiles_y).flatten().tolist() + [len(flatten_ids)]
    m2d, con = means2d.reshape(-1, 2).tolist(), conics.reshape(-1, 3).tolist()
    ids, ops, rgb = flatten_ids.tolist(), opacities.tolist(), colors.tolist()
    render = np.zeros((C, height, width, 3))
    alpha = np.zeros((C, height, width, 1))
    for c in range(C):
        for i in range(height):
            for j in range(width):
                tile = (c * tiles_y + i // tile_size) * tiles_x + j // tile_size
                px, py, T, out = j + 0.5, i + 0.5, 1.0, np.zeros(3)
                for g in ids[offsets[tile]:offsets[tile + 1]]:
                    (x, y), (a, b, cc), op = m2d[g], con[g], ops[g]
                    dx, dy = x - px, y - py
                    sigma = 0.5 * (a * dx * dx + cc * dy * dy) + b * dx * dy
                    al = min(ALPHA_MAX, op * math.exp(-sigma))
                    if sigma < 0 or al < ALPHA_THRESHOLD:
                        continue
                    next_T = T * (1 - al)
                    if next_T <= TRANSMITTANCE_MIN:
                        break
                    out += np.asarray(rgb[g % N]) * al * T
                    T = next_T
                render[c, i, j], alpha[c, i, j, 0] = out, 1 - T
    return torch.tensor(render, dtype=torch.float32), torch.tensor(alpha, dtype=torch.float32)


@pytest.mark.parametrize("budget, antialiased", [(1 << 16, False), (40, False), (1 << 16, True)])
def test_render_matches_gsplat_kernel_transcription(budget, antialiased, monkeypatch):
    # A small budget splits the Gaussians into many depth runs (transmittance carried over).
    monkeypatch.setattr(rendering, "_PAIR_BUDGET", budget)
    means, quats, scales, opacities, colors = random_scene(60, seed=5, scale=0.08)
    # A stack of near-opaque Gaussians in front, so some pixels stop at T <= 1e-4.
    stack = random_scene(6, seed=6, radius=0.05, scale=0.12)
    means = torch.cat([means, stack[0] + torch.tensor([0.0, 0.0, -1.2])])
    quats, scales = torch.cat([quats, stack[1]]), torch.cat([scales, stack[2]])
    opacities = torch.cat([opacities, torch.full((6,), 0.995)])
    colors = torch.cat([colors, stack[4]])
    views = orbit_views([-0.5] * 3, [0.5] * 3, 2, 20)
    views.viewmats[1] = torch.tensor(look_at(np.array([0.0, 0.0, -2.5]), np.zeros(3)), dtype=torch.float32)
    width, height = 22, 18
    render, alpha, _ = rasterize(means, quats, scales, opacities, colors, views.viewmats, views.Ks,
                                 width, height, backend="torch", antialiased=antialiased)
    want_render, want_alpha = _gsplat_kernel_reference(means, quats, scales, opacities, colors,
                                                       views.viewmats, views.Ks, width, height, 8, antialiased)
    assert want_alpha.max() > 0.99            # the opaque stack is in view
    torch.testing.assert_close(alpha, want_alpha, rtol=0, atol=2e-5)
    torch.testing.assert_close(render, want_render, rtol=0, atol=2e-5)


# --------------------------------------------------------------------------- gsplat on CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("antialiased", [False, True])
def test_gsplat_and_torch_backends_agree_on_cuda(antialiased):
    device = torch.device("cuda")
    scene = [t.to(device) for t in random_scene(4000, seed=7, scale=0.02)]
    g = torch.Generator().manual_seed(8)
    sh = torch.cat([scene[4][:, None, :] - 0.5, 0.2 * torch.randn(4000, 3, 3, generator=g).to(device)], 1)
    sh[:, 0] /= SH_C0
    views = orbit_views([-0.5] * 3, [0.5] * 3, 4, 128).to(device)
    weights = torch.rand(4, 128, 128, 3, generator=g).to(device)

    results = {}
    for backend in ("gsplat", "torch"):
        params = [t.detach().clone().requires_grad_() for t in (*scene[:4], sh)]
        render, alpha, info = rasterize(*params, views.viewmats, views.Ks, 128, 128, sh_degree=1,
                                        backend=backend, antialiased=antialiased)
        assert info["backend"] == backend
        ((render * weights).sum() + alpha.sum()).backward()
        results[backend] = (render.detach(), alpha.detach(), info, [p.grad for p in params])

    (r_g, a_g, i_g, grads_g), (r_t, a_t, i_t, grads_t) = results["gsplat"], results["torch"]
    assert a_g.mean() > 0.05                  # the scene is in view
    assert (r_g - r_t).abs().mean() < 1e-3
    assert (a_g - a_t).abs().mean() < 1e-3
    # Same Gaussians drawn (a float ulp may flip a Gaussian right at the image border).
    drawn_g, drawn_t = i_g["radii"] > 0, i_t["radii"] > 0
    assert (drawn_g != drawn_t).float().mean() < 1e-3
    both = drawn_g & drawn_t                  # gsplat leaves culled entries uninitialised
    torch.testing.assert_close(i_g["means2d"].detach()[both], i_t["means2d"].detach()[both],
                               rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(i_g["depths"][both], i_t["depths"][both], rtol=1e-5, atol=1e-5)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    names = ["means", "quats", "scales", "opacities", "sh"]
    for name, gg, gt in zip(names, grads_g, grads_t):
        err = rel(gg, gt)
        assert err < 2e-2, f"{name}: gradient relative error {err:.3g}"
    err = rel(i_g["means2d"].grad, i_t["means2d"].grad)
    assert err < 2e-2, f"means2d: gradient relative error {err:.3g}"


@pytest.mark.gpu
def test_gsplat_backend_handles_empty_shard_on_cuda():
    device = torch.device("cuda")
    empty = [torch.zeros(0, 3, device=device), torch.zeros(0, 4, device=device),
             torch.zeros(0, 3, device=device), torch.zeros(0, device=device), torch.zeros(0, 3, device=device)]
    views = orbit_views([-0.5] * 3, [0.5] * 3, 2, 32).to(device)
    render, alpha, info = rasterize(*empty, views.viewmats, views.Ks, 32, 32, backend="gsplat")
    assert info["backend"] == "gsplat" and render.shape == (2, 32, 32, 3)
    assert (render == 0).all() and (alpha == 0).all()


def test_auto_warns_once_when_cuda_tensors_fall_back_to_torch(monkeypatch):
    """No gsplat on a CUDA device: 'auto' still renders (the torch path), and says so once."""
    from insitu.render import rendering

    monkeypatch.setattr(rendering, "gsplat_import_error", lambda: "ImportError: no gsplat")
    rendering._warn_torch_on_cuda.cache_clear()
    cuda = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="torch reference rasterizer"):
        assert rendering._resolve_backend("auto", cuda) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rendering._resolve_backend("auto", cuda) == "torch"          # once per process
        assert rendering._resolve_backend("auto", torch.device("cpu")) == "torch"   # CPU: no warning
    rendering._warn_torch_on_cuda.cache_clear()
