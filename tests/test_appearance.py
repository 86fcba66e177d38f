"""The colour models: lit Gaussians shade as the ground truth does, their SH fit, their seeds."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from insitu.groundtruth.caster import apply_colormap, raycast
from insitu.groundtruth.views import fibonacci_sphere, look_at
from insitu.render.lighting import FIXED_LIGHT, HEADLIGHT, FixedLight, Headlight
from insitu.render.rendering import eval_sh
from insitu.surface.gaussians import SH_C0, Gaussians
from insitu.surface.seeds import normal_to_quat
from insitu.training.appearance import (BlockSamples, ColorModel, bake_light, base_colors, fit_sh, lit_colors,
                                        quat_normals)
from insitu.volume import whole_block


def unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_the_normal_is_the_local_z_axis_of_the_rotation():
    from gsplat.utils import normalized_quat_to_rotmat

    q = torch.randn(64, 4, dtype=torch.float64)
    R = normalized_quat_to_rotmat(q / q.norm(dim=1, keepdim=True))
    torch.testing.assert_close(quat_normals(3.0 * q), R[:, :, 2])
    n = unit(np.random.default_rng(0).normal(size=(20, 3)))
    torch.testing.assert_close(quat_normals(torch.tensor(normal_to_quat(n))), torch.tensor(n))


def test_lit_colours_follow_the_headlight_on_both_sides():
    base = torch.tensor([[0.8, 0.6, 0.4]], dtype=torch.float64)
    quats = torch.tensor(normal_to_quat(np.array([[0.0, 0.0, 1.0]])))
    means = torch.zeros(1, 3, dtype=torch.float64)
    angles = torch.tensor([0.0, 60.0, 89.0, 120.0, 180.0], dtype=torch.float64) * math.pi / 180
    campos = torch.stack([torch.sin(angles), torch.zeros_like(angles), torch.cos(angles)], 1) * 5.0
    out = lit_colors(means, quats, base, campos)
    cos = torch.cos(angles).abs()
    want = base[None] * (0.15 + 0.75 * cos + 0.25 * cos ** 32)[:, None, None]
    torch.testing.assert_close(out, want.clamp(0, 1))
    bright = lit_colors(means, quats, torch.ones(1, 3, dtype=torch.float64), campos[:1])
    assert torch.equal(bright, torch.ones(1, 1, 3, dtype=torch.float64))        # clamped as the ground truth


def test_lit_colours_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(3)
    means = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    quats = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    base = (0.2 + 0.5 * torch.rand(5, 3, generator=g, dtype=torch.float64)).requires_grad_()
    campos = torch.randn(3, 3, generator=g, dtype=torch.float64) * 6.0
    assert torch.autograd.gradcheck(lambda m, q, b: lit_colors(m, q, b, campos), (means, quats, base))


def test_a_lit_gaussian_on_the_surface_has_the_ground_truths_colour():
    """A lit Gaussian at a ray's hit, with the normal of BlockSamples.normals and the base colour of
    base_colors, is coloured as the ray caster shades that pixel, for a solid and a mapped colour."""
    n, c, radius = 32, np.array([15.2, 16.1, 14.7]), 9.0
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float64)
    f = np.sqrt((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2)
    block = whole_block(f.astype(np.float32), fields={"t": x.astype(np.float32)})
    samples = BlockSamples(torch.from_numpy(block.data), origin=block.origin, spacing=block.spacing,
                           start=block.start)
    for direction in ((0.3, -0.5, 0.8), (-0.7, 0.2, -0.1)):
        eye = c + 60.0 * unit(direction)
        viewmat = torch.tensor(look_at(eye, c), dtype=torch.float32)[None]
        size, focal = 21, 120.0
        K = torch.tensor([[focal, 0, size / 2], [0, focal, size / 2], [0, 0, 1]], dtype=torch.float32)[None]
        for kwargs in (dict(color=(0.85, 0.8, 0.7)), dict(color_field="t", color_range=(0.0, 31.0))):
            rgba, depth = raycast(block, viewmat, K, size, size, radius, supersample=1, **kwargs)
            rows, cols = torch.nonzero(rgba[0, ..., 3] == 1, as_tuple=True)
            assert len(rows) > 40
            # the hit points: along each pixel centre's ray, at its depth (camera z)
            R, t = viewmat[0, :3, :3].double(), viewmat[0, :3, 3].double()
            pix = torch.stack([cols + 0.5, rows + 0.5, torch.ones_like(rows, dtype=torch.float64)], 1).double()
            cam = (torch.linalg.inv(K[0].double()) @ pix.T).T * depth[0, rows, cols, None].double()
            hits = ((cam - t) @ R).float()
            normals = samples.normals(hits)
            base = base_colors(block, hits, **kwargs)
            quats = torch.tensor(normal_to_quat(normals.double().numpy()), dtype=torch.float32)
            got = lit_colors(hits, quats, base, torch.tensor(eye, dtype=torch.float32)[None])[0]
            torch.testing.assert_close(got, rgba[0, rows, cols, :3], atol=2e-3, rtol=0)


def test_the_sh_fit_is_the_least_squares_fit_of_the_lit_colours():
    n = unit(np.random.default_rng(5).normal(size=(6, 3)))
    quats = torch.tensor(normal_to_quat(n), dtype=torch.float32)
    base = torch.rand(6, 3, generator=torch.Generator().manual_seed(1)) * 0.8
    coeffs = fit_sh(quats, base, 3)
    assert coeffs.shape == (6, 16, 3)
    dirs = torch.tensor(fibonacci_sphere(512), dtype=torch.float32)               # view: camera -> Gaussian
    seen = lit_colors(torch.zeros(6, 3), quats, base, -dirs)                     # cameras at -dirs: [S, 6, 3]
    sh = eval_sh(3, dirs[:, None].expand(-1, 6, -1), coeffs[None].expand(512, -1, -1, -1)) + 0.5
    from insitu.render.shading import sh_basis
    basis = sh_basis(3, dirs)                                                     # [S, 16]
    residual = (seen - sh).permute(1, 2, 0)                                      # [6, 3, S]
    assert float((residual @ basis).abs().max()) < 1e-3 * 512                    # orthogonal to every basis function
    rms = float(((seen - sh) ** 2).mean().sqrt())
    assert rms < 0.05, rms                                                        # the headlight's cos**32 is sharp
    flat = fit_sh(quats, base, 3, Headlight(ambient=0.6, diffuse=0.0, specular=0.0))   # a constant: exact
    sh_flat = eval_sh(3, dirs[:, None].expand(-1, 6, -1), flat[None].expand(512, -1, -1, -1)) + 0.5
    torch.testing.assert_close(sh_flat, (0.6 * base)[None].expand(512, -1, -1), atol=1e-5, rtol=0)


def test_sh_fit_spends_its_bands_on_the_side_the_views_saw():
    """Gaussians seen only from the +normal side (their footprints' sides): the sides-weighted fit
    holds the lit colours on that side far better than the even fit over the whole sphere, at degree 1
    (one odd band) and 3; a Gaussian no view shows gets the even fit; a bad shape is refused."""
    n = np.array([[0.0, 0.0, 1.0], [0.6, 0.0, 0.8], [0.0, -1.0, 0.0]])
    quats = torch.tensor(normal_to_quat(n), dtype=torch.float32)
    base = torch.tensor([[0.8, 0.6, 0.4], [0.5, 0.5, 0.9], [0.9, 0.9, 0.9]])
    means = torch.zeros(3, 3)
    dirs = torch.tensor(fibonacci_sphere(512), dtype=torch.float32)              # directions to cameras
    normals = torch.tensor(n, dtype=torch.float32)
    cameras = 5.0 * dirs
    sides = torch.tensor([[300.0, 300.0], [120.0, 120.0], [0.0, 0.0]])          # front, whole: the third unseen
    for degree, better in ((1, 0.55), (3, 0.75)):
        even = fit_sh(quats, base, degree)
        sided = fit_sh(quats, base, degree, sides=sides)
        assert sided.shape == even.shape == (3, (degree + 1) ** 2, 3)
        seen = lit_colors(means, quats, base, cameras)                            # [V, N, 3]
        front = (dirs @ normals.T) > 0                                            # [V, N]

        def rms(coeffs, i):
            sh = eval_sh(degree, -dirs, coeffs[i][None].expand(512, -1, -1)) + 0.5   # along camera -> Gaussian
            return float(((sh - seen[:, i]) ** 2)[front[:, i]].mean().sqrt())
        for i in (0, 1):
            assert rms(sided, i) < better * rms(even, i), (degree, i, rms(sided, i), rms(even, i))
        torch.testing.assert_close(sided[2], even[2], atol=1e-4, rtol=0)          # unseen: the even fit
    with pytest.raises(ValueError, match=r"sides: expected \[3, 2\]"):
        fit_sh(quats, base, 3, sides=sides[:2])


def test_color_model_gives_the_rasterizer_sh_or_per_camera_colours():
    g = Gaussians(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[1.0, 0, 0, 0]] * 2), torch.zeros(2),
                  torch.full((2, 1, 3), 0.3), torch.zeros(2, 0, 3))
    campos = torch.tensor([[0.0, 0.0, 4.0], [0.0, 4.0, 0.0], [4.0, 0.0, 0.0]])
    colors, degree = ColorModel("lit").colors(g.means, g.quats, g.sh, campos)
    assert degree is None and colors.shape == (3, 2, 3)
    torch.testing.assert_close(colors[0], HEADLIGHT.intensity(torch.tensor(1.0)) * (0.3 * SH_C0 + 0.5)
                               * torch.ones(2, 3))
    torch.testing.assert_close(colors[1], HEADLIGHT.ambient * (0.3 * SH_C0 + 0.5) * torch.ones(2, 3))  # edge-on
    coeffs, degree = ColorModel("sh", 2).colors(g.means, g.quats, torch.zeros(2, 9, 3), campos)
    assert degree == 2 and coeffs.shape == (2, 9, 3)
    fitted = ColorModel("lit").as_sh(g, 3)
    assert fitted.sh_degree == 3 and torch.equal(fitted.means, g.means)
    with pytest.raises(ValueError, match="color model: expected one of"):
        ColorModel("phong")


def test_band_0_holds_the_fixed_light_alike_from_both_sides():
    """bake_light: a Gaussian facing the key light is brighter than one facing the fill and than one at right angles
    to both lights (the ambient term alone), a Gaussian facing away from a light as bright as one facing it (both
    lights two-sided), each colour base * intensity in band 0 whatever the degree, the higher bands 0; an SH viewer
    draws it alike from every side."""
    key, fill = np.array(FIXED_LIGHT.key_from), np.array(FIXED_LIGHT.fill_from)
    normals = np.stack([key, -key, fill, -fill, np.cross(key, fill)])
    base = torch.tensor([0.8, 0.6, 0.4]).expand(5, 3)
    g = Gaussians(torch.zeros(5, 3), torch.zeros(5, 3), torch.tensor(normal_to_quat(normals), dtype=torch.float32),
                  torch.zeros(5), ((base - 0.5) / SH_C0)[:, None].clone(), torch.zeros(5, 0, 3))
    for degree in (0, 3):
        baked = bake_light(g, FIXED_LIGHT, degree)
        assert baked.sh_degree == degree and not baked.shN.any()
        assert torch.equal(baked.quats, g.quats) and torch.equal(baked.opacity_logits, g.opacity_logits)
        rgb = baked.sh0[:, 0] * SH_C0 + 0.5
        lights = (FIXED_LIGHT.ambient + FIXED_LIGHT.key, FIXED_LIGHT.ambient + FIXED_LIGHT.key,
                  FIXED_LIGHT.ambient + FIXED_LIGHT.fill, FIXED_LIGHT.ambient + FIXED_LIGHT.fill, FIXED_LIGHT.ambient)
        torch.testing.assert_close(rgb, base * torch.tensor(lights)[:, None])
    assert rgb[0].sum() > rgb[2].sum() > rgb[4].sum()               # key, fill, ambient alone
    torch.testing.assert_close(rgb[0], rgb[1])                       # both sides of the key's plane alike
    torch.testing.assert_close(rgb[2], rgb[3])
    campos = torch.tensor(fibonacci_sphere(16), dtype=torch.float32) * 5.0
    seen = eval_sh(3, torch.nn.functional.normalize(g.means[None] - campos[:, None], dim=-1), baked.sh[None]) + 0.5
    torch.testing.assert_close(seen, rgb[None].expand(16, 5, 3))     # every viewer direction sees the same colour
    bright = bake_light(replace(g, sh0=torch.full((5, 1, 3), 100.0)), FIXED_LIGHT)
    torch.testing.assert_close(bright.sh0[:, 0] * SH_C0 + 0.5, torch.ones(5, 3))    # clamped as the ground truth
    with pytest.raises(ValueError, match="FixedLight.key_from: expected a direction"):
        FixedLight(key_from=(0.0, 0.0, 0.0))


def test_base_colours_of_a_colour_field_are_its_colour_map():
    z, y, x = np.mgrid[0:8, 0:8, 0:8].astype(np.float64)
    block = whole_block(x, fields={"t": 1e6 + 1e-3 * x}, origin=(1.0, 0.0, 0.0), spacing=(0.5, 1.0, 1.0))
    points = torch.tensor([[1.0, 3.0, 3.0], [2.75, 3.0, 3.0], [4.5, 2.0, 1.0]])
    got = base_colors(block, points, color_field="t", color_range=(1e6, 1e6 + 7e-3))
    torch.testing.assert_close(got, apply_colormap(torch.tensor([0.0, 0.5, 1.0])), atol=1e-5, rtol=0)
    solid = base_colors(block, points, color=(0.1, 0.2, 0.3))
    torch.testing.assert_close(solid, torch.tensor([[0.1, 0.2, 0.3]] * 3))
