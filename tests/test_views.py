import numpy as np
import pytest
import torch

from insitu.views import fibonacci_sphere, look_at, orbit_views


def test_fibonacci_sphere_is_even():
    d = fibonacci_sphere(448)
    np.testing.assert_allclose(np.linalg.norm(d, axis=1), 1.0, atol=1e-12)
    assert np.abs(d.mean(axis=0)).max() < 0.01          # balanced over the sphere


def test_look_at_projects_the_target_to_the_image_centre():
    eye, target = np.array([3.0, -4.0, 2.0]), np.array([0.5, 0.5, 0.5])
    m = look_at(eye, target)
    p = m @ np.append(target, 1.0)
    assert abs(p[0]) < 1e-12 and abs(p[1]) < 1e-12 and p[2] > 0
    np.testing.assert_allclose(m[:3, :3] @ m[:3, :3].T, np.eye(3), atol=1e-12)
    up = m @ np.array([0.5, 0.5, 1.5, 1.0])              # world +z points up: image -y
    assert up[1] < 0


def test_orbit_views_frame_the_box_and_hold_out_views():
    lo, hi = np.zeros(3), np.array([2.0, 1.0, 1.0])
    v = orbit_views(lo, hi, 40, 64, fov_deg=40, test_every=8)
    assert len(v) == 40 and v.width == v.height == 64
    assert v.test.sum() == 5 and v.test[0] and not v.test[1]
    corners = torch.tensor([[x, y, z, 1.0] for x in (0, 2) for y in (0, 1) for z in (0, 1)])
    cam = torch.einsum("nij,kj->nki", v.viewmats, corners)[..., :3]           # [N, 8, 3]
    pix = torch.einsum("nij,nkj->nki", v.Ks, cam)
    uv = pix[..., :2] / pix[..., 2:]
    assert (cam[..., 2] > 0).all() and (uv >= 0).all() and (uv <= 64).all()
    centre = v.positions.mean(0)
    assert torch.allclose(centre, torch.tensor([1.0, 0.5, 0.5]), atol=0.05)


@pytest.mark.parametrize("kwargs, message", [({"count": 0}, "view count > 0"),
                                             ({"resolution": -1}, "resolution > 0")])
def test_bad_view_parameters(kwargs, message):
    args = {"count": 8, "resolution": 16} | kwargs
    with pytest.raises(ValueError, match=message):
        orbit_views(np.zeros(3), np.ones(3), **args)
