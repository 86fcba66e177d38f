"""Gaussians held on the isosurface (insitu.surface): quaternion algebra, the projection onto the
levels, the turned normals and thickness, and a training run that stays on a sphere."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from insitu.appearance import BlockSamples, quat_normals
from insitu.config import load_config
from insitu.parallel import init_comm, shutdown
from insitu.pipeline import compute_step, surface_hold
from insitu.surface import SurfaceHold, quat_multiply, turn_normals
from insitu.volume import iso_distance, whole_block

N, R = 24, 7.0          # samples per axis, sphere radius in cells


def sphere_field(n: int = N) -> np.ndarray:
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float32)
    c = (n - 1) / 2
    return np.sqrt((x - c) ** 2 + (y - c) ** 2 + (z - c) ** 2)


def rotation_matrix(q: torch.Tensor) -> torch.Tensor:
    w, x, y, z = torch.nn.functional.normalize(q, dim=-1).unbind(-1)
    return torch.stack([torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
                        torch.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
                        torch.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1)], -2)


def random_quats(n: int, seed: int = 0) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, 4, generator=torch.Generator().manual_seed(seed),
                                                     dtype=torch.float64), dim=1)


def test_quat_multiply_composes_the_rotations():
    a, b = random_quats(50, 1), random_quats(50, 2)
    torch.testing.assert_close(rotation_matrix(quat_multiply(a, b)), rotation_matrix(a) @ rotation_matrix(b))


def test_turn_normals_takes_the_z_axis_onto_the_nearer_side_by_the_smallest_turn():
    q = random_quats(200, 3)
    target = torch.nn.functional.normalize(torch.randn(200, 3, generator=torch.Generator().manual_seed(4),
                                                       dtype=torch.float64), dim=1)
    turned = turn_normals(q, target)
    z = quat_normals(turned)
    side = torch.sign((quat_normals(q) * target).sum(1, keepdim=True))
    torch.testing.assert_close(z, side * target)
    # the smallest turn: the rotation between the two frames is about an axis perpendicular to both normals,
    # by the angle between them (so the in-plane axes turn no more than the normal must)
    relative = rotation_matrix(turned) @ rotation_matrix(q).transpose(1, 2)
    angle = torch.arccos(((relative.diagonal(dim1=1, dim2=2).sum(1) - 1) / 2).clamp(-1, 1))
    between = torch.arccos((quat_normals(q) * side * target).sum(1).clamp(-1, 1))
    torch.testing.assert_close(angle, between, atol=1e-6, rtol=0)
    same = turn_normals(q, quat_normals(q))                     # already there: unchanged
    torch.testing.assert_close(rotation_matrix(same), rotation_matrix(q))
    with pytest.raises(ValueError, match=r"quats \[N, 4\] and normals \[N, 3\]"):
        turn_normals(q, target[:10])


@pytest.fixture(scope="module")
def hold():
    block = whole_block(sphere_field())
    samples = BlockSamples(torch.from_numpy(block.data), origin=block.origin, spacing=block.spacing,
                           start=block.start)
    return SurfaceHold(samples, torch.tensor([R, 100.0]), thickness=0.1), block


def test_project_moves_centres_onto_the_nearest_level_at_most_a_cell_per_step(hold):
    h, block = hold
    c = (N - 1) / 2
    dirs = torch.nn.functional.normalize(torch.randn(300, 3, generator=torch.Generator().manual_seed(5)), dim=1)
    radius = R + torch.empty(300).uniform_(-2.5, 2.5, generator=torch.Generator().manual_seed(6))
    means = c + dirs * radius[:, None]
    moved, normals = h.project(means)
    assert ((moved - means).norm(dim=1) <= 1.0 + 1e-5).all()          # one cell at most
    torch.testing.assert_close(normals, dirs, atol=2e-2, rtol=0)       # the field's (radial) normal
    for _ in range(4):                                                   # repeated, it converges
        moved, _ = h.project(moved)
    off = (h.samples.at(moved) - R).abs()                               # on the trilinear field's level
    assert off.max() < 1e-3, off.max()
    assert np.abs(np.linalg.norm(moved.numpy() - c, axis=1) - R).max() < 0.05      # and on the sphere
    torch.testing.assert_close(torch.nn.functional.normalize(moved - c, dim=1), dirs, atol=2e-3, rtol=0)
    outside = torch.tensor([[-3.0, 5.0, 5.0], [c, c, c]])               # out of the samples; zero gradient
    kept, n = h.project(outside)
    torch.testing.assert_close(kept, outside)
    assert (n == 0).all()
    with pytest.raises(ValueError, match="levels"):
        SurfaceHold(h.samples, torch.zeros(0))
    with pytest.raises(ValueError, match="thickness"):
        SurfaceHold(h.samples, torch.tensor([R]), thickness=0.0)


def test_apply_turns_the_discs_and_keeps_them_thin(hold):
    h, _ = hold
    c = (N - 1) / 2
    means = torch.tensor([[c + R + 0.4, c, c], [c, c - R + 0.3, c], [-5.0, 0.0, 0.0]])
    quats = random_quats(3, 7).float()
    log_scales = torch.log(torch.tensor([[1.0, 0.5, 0.4], [0.2, 0.3, 0.01], [1.0, 1.0, 1.0]]))
    before_q, before_s = quats.clone(), log_scales.clone()
    h.apply(means, quats, log_scales)
    assert abs(means[0, 0].item() - (c + R)) < 0.05 and abs(means[1, 1].item() - (c - R)) < 0.05
    z = quat_normals(quats)
    torch.testing.assert_close(z[0].abs(), torch.tensor([1.0, 0.0, 0.0]), atol=2e-2, rtol=0)
    torch.testing.assert_close(z[1].abs(), torch.tensor([0.0, 1.0, 0.0]), atol=2e-2, rtol=0)
    torch.testing.assert_close(torch.exp(log_scales[0]), torch.tensor([1.0, 0.5, 0.05]))     # 0.1 x 0.5
    torch.testing.assert_close(log_scales[1], before_s[1])                                   # thin already
    torch.testing.assert_close(quats[2], before_q[2])                   # outside the samples: left alone
    torch.testing.assert_close(means[2], torch.tensor([-5.0, 0.0, 0.0]))


@pytest.fixture(scope="module")
def comm():
    c = init_comm(device="cpu")
    yield c
    shutdown(c)


def trained(comm, on_surface: bool):
    cfg = load_config(None, {"input.iso": [R], "views.count": 24, "views.resolution": 48, "views.supersample": 1,
                             "views.held_out": 0, "views.closeups": 0, "seeds.budget": 400,
                             "train.iterations": 60, "train.backend": "torch", "train.progress": False,
                             "train.densify_from": 20, "train.densify_every": 20, "train.grad_threshold": 1e-6,
                             "train.lr_means": 5e-3, "train.on_surface": on_surface,
                             "output.ply_metrics": False, "parallel.device": "cpu"})
    block = whole_block(sphere_field())
    return compute_step(block, cfg, comm).gaussians, block


def test_training_on_surface_keeps_every_gaussian_on_the_sphere(comm):
    """With ``train.on_surface`` the trained centres (those split by densification too) lie on the sphere
    and their discs face its normal; without it the same run (a large position learning rate) strays."""
    held, block = trained(comm, True)
    free, _ = trained(comm, False)
    assert len(held) > 400                                              # densification split some
    dist = iso_distance(block, [R], held.means.numpy())
    assert np.quantile(dist, 0.99) < 0.05, np.quantile(dist, 0.99)
    c = (N - 1) / 2
    radial = torch.nn.functional.normalize(held.means - c, dim=1)
    cos = (quat_normals(held.quats) * radial).sum(1).abs()
    assert cos.min() > 0.99, cos.min()
    scales = torch.exp(held.log_scales)
    assert (scales[:, 2] <= 0.1 * scales[:, :2].min(1).values * (1 + 1e-4)).all()
    assert np.quantile(iso_distance(block, [R], free.means.numpy()), 0.99) > 0.1


def test_surface_hold_uses_the_unit_field_and_every_iso_value():
    """pipeline.surface_hold: the block's field at unit size with its levels (a float field of any
    magnitude), the thickness of ``train.surface_thickness`` (0: not held)."""
    field = sphere_field().astype(np.float64) * 1e-20
    block = whole_block(field)
    cfg = load_config(None, {"input.iso": [R * 1e-20, 9e-20], "train.surface_thickness": 0.0})
    h = surface_hold(block, cfg, torch.device("cpu"))
    assert h.thickness is None and h.levels.shape == (2,)
    c = (N - 1) / 2
    moved = torch.tensor([[c + R + 0.5, c, c], [c, c + 9.4, c]])
    for _ in range(4):
        moved, _ = h.project(moved)
    assert abs(moved[0, 0].item() - (c + R)) < 0.05 and abs(moved[1, 1].item() - (c + 9.0)) < 0.05
    assert math.isclose(float(load_config(None, {}).train.surface_thickness), 0.1)
