import numpy as np
import pytest
import torch

from insitu.groundtruth.views import Views, fibonacci_sphere, look_at, orbit_views, pixel_size


def test_pixel_size_is_depth_over_focal_of_the_nearest_view_that_sees_the_point():
    """Two cameras on the z axis looking at the origin (focal 100 px, 64 x 64): a point at the origin
    is 4 and 10 units from them, so one pixel there is 0.04 wide; a point that only the far camera holds
    in its image (off the near one's, or behind it) gets that camera's size; one off both images is inf."""
    eyes = np.array([[0.0, 0.0, 4.0], [0.0, 0.0, -10.0]])
    vm = torch.tensor(np.stack([look_at(e, np.zeros(3)) for e in eyes]), dtype=torch.float32)
    K = torch.tensor([[100.0, 0, 32], [0, 100.0, 32], [0, 0, 1]]).expand(2, 3, 3).contiguous()
    views = Views(vm, K, 64, 64, torch.zeros(2, dtype=torch.int8))
    points = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 20.0], [50.0, 0.0, 0.0]])
    got = pixel_size(points, views, torch.arange(2))
    # (2, 0, 0): 2 units off-axis at depth 4 falls off the near image (200 px from the centre), not the far one;
    # (0, 0, 20) is behind the near camera and 30 units in front of the far one
    expect = torch.tensor([0.04, 0.10, 0.30, float("inf")])
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=0)
    torch.testing.assert_close(pixel_size(points, views, torch.arange(2), chunk=1), expect, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match=r"means: expected \[N, 3\]"):
        pixel_size(points[:, :2], views, torch.arange(2))


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
