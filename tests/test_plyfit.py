"""The standard files' model merged per cell (insitu.step.plyfit.merge_cells, orbit_pixel)."""
from __future__ import annotations

import math

import pytest
import torch

from insitu.groundtruth.views import orbit_distance, orbit_views
from insitu.render.rendering import quat_scale_to_covar
from insitu.step.plyfit import eigh3, merge_cells, orbit_pixel, rotation_to_quat
from insitu.surface.gaussians import Gaussians
from insitu.surface.seeds import normal_to_quat_torch
from insitu.training.appearance import quat_normals


def discs(means, normals, scales, opacities, colors) -> Gaussians:
    """Gaussians at ``means`` whose local z axis is ``normals``; SH degree 1 (the higher band a ramp)."""
    means, normals, scales, opacities, colors = (torch.as_tensor(x, dtype=torch.float32)
                                                 for x in (means, normals, scales, opacities, colors))
    sh0 = colors.view(-1, 1, 3)
    return Gaussians(means, scales.log(), normal_to_quat_torch(torch.nn.functional.normalize(normals, dim=-1)),
                     torch.logit(opacities), sh0, sh0.repeat(1, 3, 1) * torch.arange(1.0, 4.0).view(1, 3, 1))


def test_a_gaussian_alone_in_its_cell_is_kept_as_it_is_and_cell_zero_keeps_all():
    """Cell 0: the model itself; cells far smaller than the spacing: every Gaussian bit for bit (in another
    order); sums over chunks of 7 Gaussians: what one chunk gives."""
    gen = torch.Generator().manual_seed(0)
    g = Gaussians(torch.rand(200, 3, generator=gen), torch.rand(200, 3, generator=gen).log() - 4,
                  torch.nn.functional.normalize(torch.randn(200, 4, generator=gen), dim=-1),
                  torch.randn(200, generator=gen), torch.rand(200, 1, 3, generator=gen),
                  torch.rand(200, 3, 3, generator=gen))
    assert merge_cells(g, 0.0) is g
    whole, parts = merge_cells(g, 0.3), merge_cells(g, 0.3, chunk=7)         # the sums over chunks: the same
    assert 0 < len(whole) < 200 and len(parts) == len(whole)
    for name, value in whole.tensors().items():
        torch.testing.assert_close(getattr(parts, name), value, atol=1e-5, rtol=1e-5)
    kept = merge_cells(g, 1e-6)
    order = torch.cdist(kept.means, g.means).argmin(1)
    assert sorted(order.tolist()) == list(range(200))
    for name, value in kept.tensors().items():
        assert torch.equal(value, getattr(g.select(order), name)), name


def test_two_discs_of_one_side_in_a_cell_merge_by_their_moments_and_the_two_sides_stay_apart():
    """Two discs 0.2 apart in x, facing +z, one cell: one Gaussian at their weighted centre, whose x variance holds
    their spread, normal +z, colour the weighted mean (weights opacity x area), opacity the summed weight over
    its area. A third disc in the same cell facing -z (the sheet's other side) stays itself."""
    g = discs([[0.3, 0.5, 0.5], [0.5, 0.5, 0.5], [0.4, 0.5, 0.5]], [[0, 0, 1], [0, 0, 1], [0, 0, -1]],
              [[0.1, 0.1, 0.01], [0.1, 0.1, 0.01], [0.05, 0.05, 0.01]], [0.9, 0.3, 0.5],
              [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    m = merge_cells(g, 1.0)
    assert len(m) == 2
    normals = quat_normals(m.quats)
    i = int(normals[:, 2].argmax())
    w = torch.tensor([0.9, 0.3]) * 0.01
    torch.testing.assert_close(m.means[i], torch.tensor([(0.3 * 0.9 + 0.5 * 0.3) / 1.2, 0.5, 0.5]))
    torch.testing.assert_close(normals[i], torch.tensor([0.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    spread = float((w * (torch.tensor([0.3, 0.5]) - m.means[i, 0]) ** 2).sum() / w.sum())
    cov = quat_scale_to_covar(m.quats[i:i + 1], m.scales[i:i + 1])[0]
    torch.testing.assert_close(cov, torch.diag(torch.tensor([0.01 + spread, 0.01, 1e-4])), atol=1e-7, rtol=1e-4)
    torch.testing.assert_close(m.sh0[i, 0], torch.tensor([0.75, 0.0, 0.25]))
    torch.testing.assert_close(m.shN[i], m.sh0[i].repeat(3, 1) * torch.arange(1.0, 4.0).view(3, 1))
    area = float(m.scales[i, 0] * m.scales[i, 1])
    assert float(m.opacities[i]) == pytest.approx(min(0.995, float(w.sum()) / area), rel=1e-5)
    j = 1 - i
    assert normals[j, 2] == pytest.approx(-1.0, abs=1e-6) and m.sh0[j, 0].tolist() == [0.0, 1.0, 0.0]


def test_rotation_to_quat_gives_back_the_rotation_of_a_covariance():
    """The axes of a covariance made from a rotation and distinct scales, turned into a quaternion, make that
    covariance again."""
    gen = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(500, 4, generator=gen), dim=-1)
    scales = torch.rand(500, 3, generator=gen).double() + torch.tensor([2.0, 1.0, 0.0]).double()   # distinct
    cov = quat_scale_to_covar(q.double(), scales)
    _, axes = torch.linalg.eigh(cov)
    axes = axes.flip(-1)
    axes[:, :, 2] *= torch.linalg.det(axes)[:, None]                 # a rotation
    back = rotation_to_quat(axes)
    torch.testing.assert_close(quat_scale_to_covar(back, scales), cov, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("spectrum", ["random", "a double eigenvalue", "diagonal", "a thin sheet"])
def test_eigh3_decomposes_as_torch_linalg_eigh(spectrum):
    g = torch.Generator().manual_seed(3)
    n = 2000
    rot, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=g, dtype=torch.float64))
    values = {"random": torch.rand(n, 3, generator=g, dtype=torch.float64),
              "a double eigenvalue": torch.tensor([1e-6, 1.0, 1.0], dtype=torch.float64).expand(n, 3),
              "diagonal": torch.rand(n, 3, generator=g, dtype=torch.float64),
              "a thin sheet": torch.rand(n, 3, generator=g, dtype=torch.float64) * torch.tensor([1e-12, 1e-3, 1.0],
                                                                                                dtype=torch.float64)}
    a = torch.diag_embed(values[spectrum])
    if spectrum != "diagonal":
        a = rot @ a @ rot.mT
    w, v = eigh3(a)
    w0, v0 = torch.linalg.eigh(a)
    assert torch.allclose(w, w0, atol=1e-13)
    assert torch.allclose(v.mT @ v, torch.eye(3, dtype=a.dtype).expand_as(a), atol=1e-12)     # orthonormal
    assert torch.allclose(v @ torch.diag_embed(w) @ v.mT, a, atol=1e-12)
    assert torch.allclose((v[:, :, 0] * v0[:, :, 0]).sum(-1).abs(), torch.ones(n, dtype=a.dtype), atol=1e-9)


def test_orbit_pixel_is_the_orbit_distance_over_the_focal_length():
    lo, hi = (-1.0, -1.0, -1.0), (1.0, 1.0, 1.0)
    views = orbit_views(lo, hi, 12, 64, 40.0)
    _, distance = orbit_distance(lo, hi, 40.0)
    assert orbit_pixel(views, 12) == pytest.approx(distance / (32 / math.tan(math.radians(20.0))), rel=1e-5)
    assert orbit_pixel(views.subset(views.test_ids), 12) == 0.0        # no orbit view trains


def test_a_grid_too_large_for_one_key_merges_alike():
    """Cells over a span whose cells no int64 key numbers (one more Gaussian 1e7 cells away on every axis) merge
    by rows instead: the near ones as they merge alone."""
    gen = torch.Generator().manual_seed(2)
    near = Gaussians(torch.rand(300, 3, generator=gen), torch.rand(300, 3, generator=gen).log() - 4,
                     torch.nn.functional.normalize(torch.randn(300, 4, generator=gen), dim=-1),
                     torch.randn(300, generator=gen), torch.rand(300, 1, 3, generator=gen), torch.zeros(300, 0, 3))
    far = near.select(torch.tensor([0]))
    far.means += 1e6
    both = merge_cells(Gaussians(**{k: torch.cat([getattr(near, k), getattr(far, k)]) for k in near.names()}), 0.1)
    alone = merge_cells(near, 0.1)
    first = both.select(both.means[:, 0] < 1e5)
    assert len(first) == len(alone) < 300 and len(both) == len(alone) + 1
    for name, value in alone.tensors().items():
        torch.testing.assert_close(getattr(first, name), value, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_a_model_of_millions_merges_on_cuda_as_on_the_cpu():
    """Two million Gaussians in ~200k cells merge on CUDA (where a batched torch.linalg.eigh asked for hundreds of
    GiB) as they do on the CPU."""
    gen = torch.Generator().manual_seed(4)
    n = 2_000_000
    g = Gaussians(torch.rand(n, 3, generator=gen) * 64, torch.rand(n, 3, generator=gen).log() - 2,
                  torch.nn.functional.normalize(torch.randn(n, 4, generator=gen), dim=-1),
                  torch.randn(n, generator=gen), torch.rand(n, 1, 3, generator=gen), torch.zeros(n, 0, 3))
    on_cpu = merge_cells(g, 2.0)
    on_cuda = merge_cells(g.to(torch.device("cuda")), 2.0).to(torch.device("cpu"))
    assert len(on_cuda) == len(on_cpu) < n // 2
    for name in ("means", "opacity_logits", "sh0"):
        torch.testing.assert_close(getattr(on_cuda, name), getattr(on_cpu, name), atol=1e-4, rtol=1e-4)
    covar = [quat_scale_to_covar(m.quats.double(), m.log_scales.double().exp()) for m in (on_cuda, on_cpu)]
    torch.testing.assert_close(covar[0], covar[1], atol=1e-5, rtol=1e-4)     # the axes' signs may differ
