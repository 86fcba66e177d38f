import numpy as np
import pytest
import torch
from conftest import sphere_field

from insitu.input.decomposition import cut_block
from insitu.surface.seeds import extract_seeds, init_gaussians, normal_to_quat
from insitu.volume import whole_block


def test_sphere_area_and_positions():
    f = sphere_field(24, dtype=np.float64)
    s = extract_seeds(whole_block(f, origin=(1, 2, 3), spacing=(0.5, 0.5, 0.5)), 7.0)
    r = 7.0 * 0.5
    c = np.array([1, 2, 3]) + 0.5 * 11.5
    np.testing.assert_allclose(np.linalg.norm(s.points - c, axis=1), r, atol=0.02)
    assert abs(s.total_area - 4 * np.pi * r * r) / (4 * np.pi * r * r) < 0.02
    radial = (s.points - c) / r
    assert np.abs(np.abs((radial * s.normals).sum(1)) - 1).max() < 0.05


def test_no_surface_gives_no_seeds():
    s = extract_seeds(whole_block(sphere_field(24, dtype=np.float64)), 100.0)
    assert len(s) == 0 and s.total_area == 0.0


@pytest.mark.parametrize("size", [2, 4])
def test_union_of_rank_surfaces_is_the_single_rank_surface(size):
    f = sphere_field(20, dtype=np.float64)
    whole = extract_seeds(whole_block(f), 6.3)

    def triangles(s):
        return sorted(tuple(sorted(map(tuple, t))) for t in np.round(s.points[s.faces], 5).tolist())

    parts = [extract_seeds(cut_block(f, r, size), 6.3) for r in range(size)]
    union = sorted(sum((triangles(p) for p in parts), []))
    assert union == triangles(whole)
    assert abs(sum(p.total_area for p in parts) - whole.total_area) < 1e-3


def test_normal_to_quat_rotates_z_onto_the_normal():
    from gsplat.utils import normalized_quat_to_rotmat

    n = np.random.default_rng(1).normal(size=(50, 3))
    n = np.concatenate([n / np.linalg.norm(n, axis=1, keepdims=True), [[0, 0, 1], [0, 0, -1]]])
    R = normalized_quat_to_rotmat(torch.tensor(normal_to_quat(n), dtype=torch.float64))
    np.testing.assert_allclose(R[:, :, 2].numpy(), n, atol=1e-9)


def test_budget_and_disc_shape():
    s = extract_seeds(whole_block(sphere_field(24, dtype=np.float64)), 7.0)
    g = init_gaussians(s, 100, opacity=0.6, thickness=0.1, sh_degree=2)
    assert len(g) == 100 and g.shN.shape == (100, 8, 3)
    sc = g.scales
    assert torch.allclose(sc[:, 2], 0.1 * sc[:, 0], rtol=1e-5)
    # discs of the subsampled surface together cover about its area
    assert 0.5 < float((np.pi * sc[:, 0] ** 2).sum()) / s.total_area < 3
    assert torch.allclose(g.opacities, torch.full((100,), 0.6), atol=1e-6)
    full = init_gaussians(s, 10 ** 9)
    assert len(full) == len(s)
    with pytest.raises(ValueError, match="opacity"):
        init_gaussians(s, 10, opacity=1.5)


def test_fill_samples_the_surface_up_to_the_budget():
    from insitu.surface.seeds import sample_surface

    f = sphere_field(24, dtype=np.float64)
    s = extract_seeds(whole_block(f), 7.0)
    more = sample_surface(s, 5 * len(s))
    c = np.full(3, 11.5)
    np.testing.assert_allclose(np.linalg.norm(more.points - c, axis=1), 7.0, atol=0.05)
    assert abs(more.total_area - s.total_area) < 1e-2 * s.total_area
    radial = (more.points - c) / 7.0
    assert np.abs(np.abs((radial * more.normals).sum(1)) - 1).max() < 0.05
    assert len(init_gaussians(s, 3 * len(s), fill=True)) == 3 * len(s)
    assert len(init_gaussians(s, 3 * len(s))) == len(s)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fill_on_the_device_samples_the_surface(device):
    from insitu.surface.seeds import normal_to_quat_torch, sample_surface_torch

    s = extract_seeds(whole_block(sphere_field(24, dtype=np.float64)), 7.0)
    points, normals = sample_surface_torch(s, 5 * len(s), seed=1, device=device)
    assert points.shape == (5 * len(s), 3) and points.device.type == device
    c = torch.full((3,), 11.5, device=device)
    assert float(((points - c).norm(dim=1) - 7.0).abs().max()) < 0.05
    radial = (points - c) / 7.0
    assert float(((radial * normals).sum(1).abs() - 1).abs().max()) < 0.05
    # uniform by area: each octant of the sphere gets about an eighth of the points
    octant = (((points - c) > 0).long() * torch.tensor([1, 2, 4], device=device)).sum(1)   # no integer matmul on CUDA
    share = torch.bincount(octant, minlength=8).float() / len(points)
    assert float((share - 0.125).abs().max()) < 0.01
    n = normals[:100].double()
    ref = torch.tensor(normal_to_quat(n.cpu().numpy()))
    torch.testing.assert_close(normal_to_quat_torch(n).cpu(), ref, atol=1e-6, rtol=0)
    if device == "cuda":
        g = init_gaussians(s, 3 * len(s), fill=True, sh_degree=1, opacity=0.4, device=device)
        cpu = init_gaussians(s, 3 * len(s), fill=True, sh_degree=1, opacity=0.4)
        assert len(g) == len(cpu) and g.means.device.type == "cuda"
        for name in ("log_scales", "opacity_logits", "sh0", "shN"):
            torch.testing.assert_close(getattr(g, name).cpu(), getattr(cpu, name), atol=1e-6, rtol=1e-5)


def plane_field(n=16, bump=False):
    """f = x index: the surface f = 7 is the plane of samples x = 7 (with ``bump``, a dent in it)."""
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float64)
    if bump:
        x = x + 2.5 * np.exp(-((y - 7.3) ** 2 + (z - 8.1) ** 2) / 8.0)
    return x


@pytest.mark.parametrize("bump", [False, True])
def test_a_surface_through_samples_on_a_block_boundary_is_seeded_exactly_once(bump):
    """A sample equal to the iso value counts as above it: the plane x = 7, which the splits of 2 and
    4 ranks cut along, is the crossing next to it, in the cells of one block only."""
    f = plane_field(bump=bump)
    whole = extract_seeds(whole_block(f), 7.0)
    assert len(whole) > 200

    def triangles(s):
        return sorted(tuple(sorted(map(tuple, t))) for t in np.round(s.points[s.faces], 5).tolist())

    for size in (2, 3, 4):
        parts = [extract_seeds(cut_block(f, r, size), 7.0) for r in range(size)]
        assert sorted(sum((triangles(p) for p in parts), [])) == triangles(whole), size
        assert abs(sum(p.total_area for p in parts) - whole.total_area) < 1e-6 * whole.total_area


@pytest.mark.parametrize("scale, offset", [(1e24, 0.0), (1e-24, 0.0), (1e60, 0.0), (1e-3, 1e6)])
def test_any_field_magnitude_gives_the_seeds_of_the_unit_field(scale, offset):
    f = sphere_field(24, dtype=np.float64)
    want = extract_seeds(whole_block(f), 7.0)
    got = extract_seeds(whole_block(offset + scale * f), offset + scale * 7.0)
    assert len(got) == len(want) > 100
    np.testing.assert_allclose(got.points, want.points, atol=1e-4)
    np.testing.assert_allclose(got.normals, want.normals, atol=1e-4)


def test_an_iso_value_equal_to_the_maximum_makes_a_surface_around_it():
    """f reaches its maximum 0 on a ball of radius 4: the iso value 0 is that ball's surface."""
    f = np.minimum(4.0 - sphere_field(24, dtype=np.float64), 0.0)
    s = extract_seeds(whole_block(f), 0.0)
    assert len(s) > 50
    radius = np.linalg.norm(s.points - 11.5, axis=1)
    assert 3.0 < radius.min() and radius.max() < 4.5
