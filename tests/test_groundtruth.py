"""Ray-cast ground truth: analytic sphere, sort-last compositing of blocks, colour maps, input checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from insitu.config import ViewConfig
from insitu.groundtruth.caster import COLORMAPS, apply_colormap, raycast
from insitu.groundtruth.views import look_at, orbit_views
from insitu.input.decomposition import cut_block
from insitu.volume import Block, whole_block

COLOR = (0.85, 0.8, 0.7)


def sphere_block(shape_xyz=(40, 40, 40), centre=(19.3, 20.1, 18.7), spacing=(1.0, 1.0, 1.0)) -> Block:
    """f = distance (world units) to ``centre``, sampled on a grid of ``shape_xyz`` samples."""
    axes = [np.arange(n) * s for n, s in zip(shape_xyz, spacing)]
    z, y, x = np.meshgrid(axes[2], axes[1], axes[0], indexing="ij")
    f = np.sqrt((x - centre[0]) ** 2 + (y - centre[1]) ** 2 + (z - centre[2]) ** 2)
    return whole_block(f.astype(np.float32), spacing=spacing)


def camera(target, direction, distance, focal, size):
    """One pinhole camera ``distance`` away from ``target`` along ``direction``, looking at it."""
    direction = np.asarray(direction, np.float64) / np.linalg.norm(direction)
    eye = np.asarray(target, np.float64) + distance * direction
    viewmat = torch.tensor(look_at(eye, np.asarray(target, np.float64)), dtype=torch.float32)[None]
    K = torch.tensor([[focal, 0, size / 2], [0, focal, size / 2], [0, 0, 1]], dtype=torch.float32)[None]
    return viewmat, K


@pytest.mark.parametrize("spacing", [(1.0, 1.0, 1.0), (0.8, 1.1, 0.9)])
def test_sphere_depth_coverage_and_shading(spacing):
    radius, distance, focal, size = 12.0, 200.0, 200.0, 33
    centre = (19.3 * spacing[0], 20.1 * spacing[1], 18.7 * spacing[2])
    shape = tuple(int(math.ceil(40 / s)) for s in spacing)
    block = sphere_block(shape, centre, spacing)
    viewmat, K = camera(centre, (0.3, -0.5, 0.8), distance, focal, size)
    rgba, depth = raycast(block, viewmat, K, size, size, radius, color=COLOR)
    assert rgba.shape == (1, size, size, 4) and depth.shape == (1, size, size)
    assert rgba.dtype == torch.float32 and depth.dtype == torch.float32

    # the centre pixel's ray passes through the sphere centre: first hit at distance - radius
    c = size // 2
    assert abs(float(depth[0, c, c]) - (distance - radius)) < 0.05
    # shading there: normal towards the camera, so ambient + diffuse + specular, times the colour
    expected = torch.tensor(COLOR) * (0.15 + 0.75 + 0.25)
    assert torch.allclose(rgba[0, c, c, :3], expected.clamp(0, 1), atol=0.01)
    assert float(rgba[0, c, c, 3]) == 1.0

    # coverage: the projected disc, radius f * tan(asin(r / D)) pixels around the image centre
    disc = focal * math.tan(math.asin(radius / distance))
    alpha = rgba[0, ..., 3]
    assert abs(float(alpha.sum()) - math.pi * disc ** 2) < 0.02 * math.pi * disc ** 2
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    r = torch.sqrt((xs - size / 2) ** 2 + (ys - size / 2) ** 2)
    assert bool((alpha[r < disc - 1] == 1).all())
    assert bool((alpha[r > disc + 1] == 0).all())
    assert bool(torch.isinf(depth[0][r > disc + 1]).all())
    assert bool(torch.isfinite(depth[0][r < disc - 1]).all())
    # premultiplied: colour never exceeds coverage times the brightest shade
    assert bool((rgba[0, ..., :3] <= alpha[..., None] + 1e-6).all())
    # partially covered pixels exist along the silhouette (antialiasing)
    assert int(((alpha > 0) & (alpha < 1)).sum()) > 0


@pytest.mark.parametrize("direction", [(0.3, -0.5, 0.8), (-0.7, 0.2, -0.4)])
def test_the_fixed_light_shades_a_sphere_as_its_analytic_normals_do(direction):
    """In the fixed light (FixedLight: ambient + key |n.k| + fill |n.f|) every pixel inside a sphere's outline is
    the colour times the intensity at the analytic normal where the pixel's ray meets the sphere, seen from any
    side; the headlight draws the same sphere otherwise."""
    from insitu.render.lighting import FIXED_LIGHT

    radius, distance, focal, size = 12.0, 200.0, 200.0, 33
    centre = np.array([19.3, 20.1, 18.7])
    block = sphere_block(centre=tuple(centre))
    viewmat, K = camera(centre, direction, distance, focal, size)
    rgba, _ = raycast(block, viewmat, K, size, size, radius, color=COLOR, supersample=1, light=FIXED_LIGHT)
    headlit, _ = raycast(block, viewmat, K, size, size, radius, color=COLOR, supersample=1)
    # each pixel's ray from the camera, met with the analytic sphere
    R, t = viewmat[0, :3, :3].double().numpy(), viewmat[0, :3, 3].double().numpy()
    eye = -R.T @ t
    v, u = np.mgrid[0:size, 0:size] + 0.5
    rays = np.stack([u, v, np.ones_like(u)], -1) @ np.linalg.inv(K[0].double().numpy()).T @ R
    rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
    b = rays @ (eye - centre)
    disc = b ** 2 - (np.sum((eye - centre) ** 2) - radius ** 2)
    inside = disc > 0.05 * radius ** 2                           # off the outline, where a pixel is partly covered
    hit = eye + (-b - np.sqrt(np.maximum(disc, 0)))[..., None] * rays
    normals = torch.tensor((hit - centre) / radius, dtype=torch.float32)
    want = torch.tensor(COLOR) * FIXED_LIGHT.intensity(normals)[..., None]
    assert int(inside.sum()) > 300
    assert bool((rgba[0, ..., 3][inside] == 1).all())
    err = (rgba[0, ..., :3] - want)[torch.from_numpy(inside)].abs()
    assert float(err.max()) < 0.01, float(err.max())
    assert float((headlit[0, ..., :3] - rgba[0, ..., :3])[torch.from_numpy(inside)].abs().mean()) > 0.05


def test_first_crossing_of_several_iso_values():
    radius_in, radius_out, distance = 8.0, 12.0, 200.0
    block = sphere_block()
    centre = (19.3, 20.1, 18.7)
    viewmat, K = camera(centre, (-0.6, 0.2, 0.4), distance, 200.0, 17)
    depths = {}
    for iso in ([radius_in], [radius_out], [radius_in, radius_out], (radius_out, radius_in)):
        _, depth = raycast(block, viewmat, K, 17, 17, iso, supersample=1)
        depths[tuple(iso)] = float(depth[0, 8, 8])
    assert abs(depths[(radius_in,)] - (distance - radius_in)) < 0.05
    assert abs(depths[(radius_out,)] - (distance - radius_out)) < 0.05
    assert depths[(radius_in, radius_out)] == depths[(radius_out,)]
    assert depths[(radius_out, radius_in)] == depths[(radius_out,)]


def gyroid_block_array(shape_xyz=(41, 37, 33)) -> np.ndarray:
    x, y, z = (np.arange(n, dtype=np.float64) / 5.0 for n in shape_xyz)
    z, y, x = np.meshgrid(z, y, x, indexing="ij")
    f = np.sin(x) * np.cos(y) + np.sin(y) * np.cos(z) + np.sin(z) * np.cos(x)
    return f.astype(np.float32)


def composite_by_depth(rgbas: list[torch.Tensor], depths: list[torch.Tensor]) -> torch.Tensor:
    """Front-to-back 'over' of premultiplied images, ordered per pixel by their hit depth."""
    rgba = torch.stack(rgbas)                       # [P, C, H, W, 4]
    order = torch.stack(depths).argsort(dim=0)      # [P, C, H, W], nearest first
    out = torch.zeros_like(rgba[0])
    transmittance = torch.ones_like(rgba[0][..., :1])
    for i in range(rgba.shape[0]):
        layer = rgba.gather(0, order[i][None, ..., None].expand(1, *rgba.shape[1:]))[0]
        out = out + transmittance * layer
        transmittance = transmittance * (1 - layer[..., 3:])
    return out


def split_and_whole(size, resolution=48, supersample=1, scale=1):
    """Render the gyroid whole and as ``size`` blocks; cameras' intrinsics scaled by ``scale``."""
    data = gyroid_block_array()
    whole = whole_block(data, spacing=(1.0, 1.2, 0.9))
    views = orbit_views(*whole.global_box, count=3, resolution=resolution)
    Ks = views.Ks.clone()
    Ks[:, :2] *= scale
    args = (views.viewmats, Ks, resolution * scale, resolution * scale, 0.3)
    ref = raycast(whole, *args, supersample=supersample)
    parts = [raycast(cut_block(data, r, size, spacing=whole.spacing), *args, supersample=supersample)
             for r in range(size)]
    return ref, parts


@pytest.mark.parametrize("size", [2, 4])
def test_blocks_composite_to_the_whole_domain(size):
    (ref, ref_depth), parts = split_and_whole(size)
    out = composite_by_depth([p[0] for p in parts], [p[1] for p in parts])
    diff = (out - ref).abs()
    assert float(ref[..., 3].mean()) > 0.2                      # the surface fills a good part of the views
    assert float(diff.mean()) < 1e-4
    assert float((diff.amax(-1) <= 1e-3).float().mean()) > 0.995
    # each block draws only inside its own box: together they hit exactly where the whole does
    nearest = torch.stack([p[1] for p in parts]).amin(0)
    hit = torch.isfinite(ref_depth)
    assert float((torch.isfinite(nearest) != hit).float().mean()) < 0.005
    both = hit & torch.isfinite(nearest)
    assert float((nearest[both] - ref_depth[both]).abs().median()) < 1e-3


def test_supersampling_averages_a_regular_subpixel_grid():
    (ref, _), _ = split_and_whole(1, resolution=24, supersample=2)
    (fine, _), _ = split_and_whole(1, resolution=24, supersample=1, scale=2)
    down = fine.reshape(3, 24, 2, 24, 2, 4).mean((2, 4))
    assert torch.allclose(ref, down, atol=1e-6)


@pytest.mark.parametrize("size", [2, 4])
def test_supersampled_blocks_differ_only_where_subsamples_hit_different_blocks(size):
    # sort-last compositing of antialiased pixels is exact unless a pixel's rays hit in different blocks
    (ref, _), parts = split_and_whole(size, resolution=32, supersample=2)
    _, fine = split_and_whole(size, resolution=32, supersample=1, scale=2)
    depth = torch.stack([p[1] for p in fine])                   # [P, C, 64, 64], one ray per pixel
    owner = torch.where(torch.isfinite(depth).any(0), depth.argmin(0), -1)
    owner = owner.reshape(3, 32, 2, 32, 2).permute(0, 1, 3, 2, 4).reshape(3, 32, 32, 4)
    mixed = (owner != owner[..., :1]).any(-1)
    out = composite_by_depth([p[0] for p in parts], [p[1] for p in parts])
    diff = (out - ref).abs().amax(-1)
    assert float(mixed.float().mean()) < 0.15
    assert float(diff[~mixed].max()) < 1e-3
    assert float(diff.mean()) < 0.02


def test_block_draws_only_its_owned_box():
    data = gyroid_block_array()
    views = orbit_views((0, 0, 0), (40, 36, 32), count=2, resolution=32)
    block = cut_block(data, 0, 2)
    lo, hi = block.box
    rgba, depth = raycast(block, views.viewmats, views.Ks, 32, 32, 0.3, supersample=1)
    # back-project the hits of pixel centres to world points
    v, u = torch.meshgrid(torch.arange(32) + 0.5, torch.arange(32) + 0.5, indexing="ij")
    for c in range(2):
        hit = torch.isfinite(depth[c])
        z = depth[c][hit].double()
        K, vm = views.Ks[c].double(), views.viewmats[c].double()
        cam = torch.stack([(u[hit] - K[0, 2]) / K[0, 0] * z, (v[hit] - K[1, 2]) / K[1, 1] * z, z], 1)
        world = (cam - vm[:3, 3]) @ vm[:3, :3]
        assert hit.any()
        assert bool((world >= torch.tensor(lo) - 1e-3).all() and (world <= torch.tensor(hi) + 1e-3).all())


def test_color_field_maps_through_the_colormap():
    block = sphere_block()
    centre = (19.3, 20.1, 18.7)
    viewmat, K = camera(centre, (0.2, 0.9, -0.3), 200.0, 200.0, 17)
    first, last = COLORMAPS["viridis"][1][0], COLORMAPS["viridis"][1][-1]
    lo, hi = -2.0, 3.0
    for value, expected in ((lo, first), (hi, last), (lo - 5.0, first), (hi + 5.0, last)):
        block.fields = {"temperature": np.full_like(block.data, value)}
        mapped, _ = raycast(block, viewmat, K, 17, 17, 12.0, color_field="temperature", color_range=(lo, hi))
        solid, _ = raycast(block, viewmat, K, 17, 17, 12.0, color=expected)
        assert float(solid[..., 3].sum()) > 10
        assert torch.allclose(mapped, solid, atol=1e-5)
    # a varying field: the colour follows x through the map (left half darker blue, right yellow-green)
    x = np.broadcast_to(np.arange(block.data.shape[2], dtype=np.float32), block.data.shape)
    block.fields = {"x": np.ascontiguousarray(x)}
    viewmat, K = camera(centre, (0.0, 0.0, 1.0), 200.0, 200.0, 33)   # looking down -z: image x ~ world x
    rgba, _ = raycast(block, viewmat, K, 33, 33, 12.0, color_field="x", color_range=(0.0, 39.0), supersample=1)
    left, right = rgba[0, 16, 10, :3], rgba[0, 16, 22, :3]
    assert float(left[1]) < float(right[1])          # viridis green rises along the map


def test_apply_colormap_control_points_and_clamping():
    positions, colours = COLORMAPS["viridis"]
    out = apply_colormap(torch.tensor(positions))
    assert torch.allclose(out, torch.tensor(colours), atol=1e-6)
    ends = apply_colormap(torch.tensor([-1.0, 2.0]))
    assert torch.allclose(ends, torch.tensor([colours[0], colours[-1]]), atol=1e-6)
    mid = apply_colormap(torch.tensor([(positions[3] + positions[4]) / 2]))[0]
    assert torch.allclose(mid, (torch.tensor(colours[3]) + torch.tensor(colours[4])) / 2, atol=1e-6)
    gray = apply_colormap(torch.tensor([0.25]), "gray")[0]
    assert torch.allclose(gray, torch.full((3,), 0.25))
    with pytest.raises(ValueError, match="colormap"):
        apply_colormap(torch.tensor([0.5]), "jet")


def test_progress_is_reported_per_view():
    block = sphere_block((12, 12, 12), (5.5, 5.5, 5.5))
    views = orbit_views((0, 0, 0), (11, 11, 11), count=5, resolution=8)
    calls = []
    raycast(block, views.viewmats, views.Ks, 8, 8, 4.0, chunk_rays=100, progress=lambda d, n: calls.append((d, n)))
    assert calls == [(i, 5) for i in range(1, 6)]


def test_chunking_does_not_change_the_image():
    block = whole_block(gyroid_block_array((20, 18, 16)))
    views = orbit_views((0, 0, 0), (19, 17, 15), count=2, resolution=16)
    a = raycast(block, views.viewmats, views.Ks, 16, 16, 0.1)
    b = raycast(block, views.viewmats, views.Ks, 16, 16, 0.1, chunk_rays=37)
    assert float(a[0][..., 3].mean()) > 0.2
    assert torch.allclose(a[0], b[0], atol=1e-6)
    assert torch.allclose(a[1], b[1], atol=1e-5)        # +inf where no hit, equal in both


def test_bad_inputs_raise_clear_errors():
    block = sphere_block((8, 8, 8), (3.5, 3.5, 3.5))
    block.fields = {"temperature": np.zeros_like(block.data)}
    views = orbit_views((0, 0, 0), (7, 7, 7), count=2, resolution=8)
    vm, K = views.viewmats, views.Ks
    cases = [
        (dict(viewmats=vm[:, :3]), r"viewmats: expected a tensor of shape \[C, 4, 4\], got \(2, 3, 4\)"),
        (dict(Ks=K[:, :2]), r"Ks: expected a tensor of shape \[C, 3, 3\]"),
        (dict(Ks=K[:1]), "same number"),
        (dict(Ks=K * 2), "last row"),
        (dict(width=0), "width: expected an integer > 0, got 0"),
        (dict(height=-3), "height"),
        (dict(supersample=0), "supersample: expected an integer >= 1"),
        (dict(step=0.0), "step"),
        (dict(refine=-1), "refine"),
        (dict(iso=[]), "iso: expected at least one"),
        (dict(iso=float("nan")), "iso: expected finite"),
        (dict(color=(1.0, 0.5)), "color: expected 3 values"),
        (dict(color_field="pressure", color_range=(0, 1)), r"no field 'pressure'.*available: \['temperature'\]"),
        (dict(color_field="temperature"), "color_range: expected"),
        (dict(color_field="temperature", color_range=(2.0, 1.0)), "lo <= hi"),
        (dict(color_field="temperature", color_range=(0, 1), colormap="jet"), "colormap"),
        (dict(chunk_rays=0), "chunk_rays"),
        (dict(light="key"), "light: expected a Headlight or a FixedLight .*, got str"),
    ]
    for change, message in cases:
        kwargs = dict(viewmats=vm, Ks=K, width=8, height=8, iso=2.0)
        kwargs.update(change)
        with pytest.raises(ValueError, match=message):
            raycast(block, kwargs.pop("viewmats"), kwargs.pop("Ks"), kwargs.pop("width"), kwargs.pop("height"),
                    kwargs.pop("iso"), **kwargs)


def blobs_array(shape_xyz=(64, 56, 48), count=12, seed=3) -> np.ndarray:
    """A few small Gaussian blobs in a mostly empty volume (lots of space to skip)."""
    rng = np.random.default_rng(seed)
    x, y, z = (np.arange(n, dtype=np.float64) for n in shape_xyz)
    z, y, x = np.meshgrid(z, y, x, indexing="ij")
    f = np.zeros_like(x)
    for _ in range(count):
        c = rng.uniform(4, np.array(shape_xyz) - 4)
        w = rng.uniform(1.5, 4.0)
        f += np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) / (2 * w * w))
    return f.astype(np.float32)


def test_empty_space_skipping_does_not_change_the_image(monkeypatch):
    import insitu.groundtruth.field as field

    block = whole_block(blobs_array())
    views = orbit_views(*block.global_box, count=3, resolution=40)
    args = (block, views.viewmats, views.Ks, 40, 40, [0.3, 0.6])
    skipped = raycast(*args)
    monkeypatch.setattr(field, "SKIP_RADIUS_CAP", 0)              # every macro cell marched finely
    marched = raycast(*args)
    assert float(skipped[0][..., 3].mean()) > 0.02
    assert torch.allclose(skipped[0], marched[0], atol=1e-5)
    assert torch.equal(torch.isinf(skipped[1]), torch.isinf(marched[1]))
    hit = torch.isfinite(marched[1])
    assert torch.allclose(skipped[1][hit], marched[1][hit], atol=1e-4)


def test_camera_inside_the_volume_sees_the_surface_around_it():
    # inside a sphere of radius 12 (f < iso), looking along +x: the wall is 12 ahead
    block = sphere_block()
    centre = np.array([19.3, 20.1, 18.7])
    viewmat = torch.tensor(look_at(centre, centre + np.array([1.0, 0.0, 0.0])), dtype=torch.float32)[None]
    K = torch.tensor([[10.0, 0, 8.0], [0, 10.0, 8.0], [0, 0, 1]])[None]
    rgba, depth = raycast(block, viewmat, K, 16, 16, 12.0, supersample=1)
    assert bool((rgba[..., 3] == 1).all())
    # pixel (7, 7) looks 0.05 rad off the axis: the wall at radius 12 along the ray
    assert abs(float(depth[0, 7, 7]) - 12.0 / math.sqrt(1 + 2 * (0.5 / 10.0) ** 2)) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("supersample", [1, 2])
def test_cuda_matches_cpu(supersample):
    block = whole_block(blobs_array(), fields={"x": np.broadcast_to(
        np.arange(64, dtype=np.float32), (48, 56, 64)).copy()})
    views = orbit_views(*block.global_box, count=4, resolution=64)
    options = dict(color_field="x", color_range=(0.0, 63.0), supersample=supersample)
    cpu = raycast(block, views.viewmats, views.Ks, 64, 64, [0.3, 0.6], **options)
    gpu = raycast(block, views.viewmats.cuda(), views.Ks.cuda(), 64, 64, [0.3, 0.6], **options)
    assert gpu[0].device.type == "cuda" and gpu[1].device.type == "cuda"
    assert float(cpu[0][..., 3].mean()) > 0.02
    diff = (gpu[0].cpu() - cpu[0]).abs().amax(-1)
    assert float((diff <= 1e-3).float().mean()) > 0.999
    assert torch.equal(torch.isinf(gpu[1].cpu()), torch.isinf(cpu[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("light", ["headlight", "fixed"])
@pytest.mark.parametrize("rank", [0, 2])
def test_triton_kernel_matches_the_torch_path_on_blocks(rank, light):
    # a block of a 4-way cut (ghosts, owned box inside the samples), anisotropic spacing, 2x2 rays; either light
    from insitu.render.lighting import FIXED_LIGHT, HEADLIGHT

    data = gyroid_block_array()
    block = cut_block(data, rank, 4, spacing=(1.0, 1.2, 0.9))
    views = orbit_views(*block.global_box, count=3, resolution=96)
    args = (block, views.viewmats.cuda(), views.Ks.cuda(), 96, 96, [0.3, 0.5])
    shade = {"headlight": HEADLIGHT, "fixed": FIXED_LIGHT}[light]
    ref = raycast(*args, backend="torch", light=shade)
    fast = raycast(*args, backend="triton", light=shade)
    assert float(ref[0][..., 3].mean()) > 0.02
    diff = (fast[0] - ref[0]).abs().amax(-1)
    assert float((diff <= 1e-3).float().mean()) > 0.999
    assert torch.equal(torch.isinf(fast[1]), torch.isinf(ref[1]))
    hit = torch.isfinite(ref[1])
    assert float((fast[1][hit] - ref[1][hit]).abs().max()) < 1e-3


def test_the_scene_holds_its_launch_values_on_the_host_as_the_device_holds_them():
    """The Triton launch reads the scene's scalars from the host (reading them from the device would wait
    for the views queued before): they must be the device tensors' float32 values, the colour map too."""
    from insitu.groundtruth.field import prepare_scene

    block = cut_block(gyroid_block_array(), 2, 4, spacing=(1.0, 1.2, 0.9), origin=(0.5, -2.0, 3.25))
    scene = prepare_scene(block, [0.3, 0.5], color=(0.85, 0.8, 0.7), color_field=None, color_range=None,
                          colormap="viridis", step=0.5, refine=6, device=torch.device("cpu"))
    device = torch.cat([scene.origin, scene.spacing, scene.box_lo, scene.box_hi, scene.domain_lo, scene.domain_hi])
    assert scene.bounds == tuple(device.tolist()) and len(scene.bounds) == 18
    assert scene.rgb == tuple(scene.color.tolist())
    assert scene.field.dims == tuple(int(v) for v in scene.field.size.tolist())
    assert scene.field.macro == tuple(int(v) for v in scene.field.macro_dims.tolist())
    assert scene.field.dims == tuple(block.shape_xyz)
    positions, colours = COLORMAPS["viridis"]
    assert scene.cmap[0].tolist() == torch.tensor(positions, dtype=torch.float32).tolist()
    assert scene.cmap[1].tolist() == torch.tensor(colours, dtype=torch.float32).tolist()


@pytest.mark.gpu
def test_triton_groups_of_views_after_the_first_are_cast_without_waiting_for_the_device():
    """raycast_views queues each later group of views without a sync (a sync would leave the device idle
    while the host, perhaps waiting for Python's lock, queues the next group)."""
    from insitu.groundtruth.caster import raycast_views

    block = whole_block(blobs_array())
    views = orbit_views(*block.global_box, count=6, resolution=64)
    cast = raycast_views(block, views.viewmats.cuda(), views.Ks.cuda(), 64, 64, [0.3, 0.6], views_per_call=2,
                         backend="triton")
    first = next(cast)                          # the scene is prepared here (its macro grid reads the device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rest = list(cast)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(ids) for ids, _, _ in [first] + rest] == [2, 2, 2]
    assert float(rest[-1][1][..., 3].mean()) > 0.02


@pytest.mark.parametrize("scale, offset", [(1e24, 0.0), (1e-24, 0.0), (1e60, 0.0), (1e-60, 0.0), (1e-3, 1e6)])
def test_any_field_magnitude_draws_the_unit_field_image(scale, offset):
    """The same surface at any magnitude and offset float64 holds: the image of the unit field
    (a float32 gradient norm of 1e-24 underflowed, one of 1e24 overflowed, and 1e6 + 1e-3 f lost f)."""
    unit = sphere_block((24, 24, 24), (11.3, 12.1, 10.7))
    viewmat, K = camera((11.3, 12.1, 10.7), (0.3, -0.5, 0.8), 80.0, 90.0, 25)
    want, want_depth = raycast(unit, viewmat, K, 25, 25, 7.0)
    scaled = whole_block(offset + scale * unit.data.astype(np.float64))
    got, depth = raycast(scaled, viewmat, K, 25, 25, offset + scale * 7.0)
    assert float(want[..., 3].sum()) > 50
    assert (got - want).abs().max() < 2e-3
    finite = torch.isfinite(want_depth)
    assert torch.equal(finite, torch.isfinite(depth))
    assert (depth[finite] - want_depth[finite]).abs().max() < 1e-3


def test_a_constant_color_field_is_the_middle_colour_of_the_map():
    block = sphere_block()
    centre = (19.3, 20.1, 18.7)
    viewmat, K = camera(centre, (0.2, 0.9, -0.3), 200.0, 200.0, 17)
    block.fields = {"temperature": np.full_like(block.data, 300.0)}
    mapped, _ = raycast(block, viewmat, K, 17, 17, 12.0, color_field="temperature", color_range=(300.0, 300.0))
    middle = tuple(apply_colormap(torch.tensor([0.5]))[0].tolist())
    solid, _ = raycast(block, viewmat, K, 17, 17, 12.0, color=middle)
    assert float(solid[..., 3].sum()) > 10
    assert torch.allclose(mapped, solid, atol=1e-5)


def test_a_march_step_shorter_than_a_thin_sheet_finds_it_on_every_ray_and_a_longer_one_misses_some():
    """A sheet 0.3 cells thick (the trilinear field is 1 - |x - 10| around x = 10, iso 0.85): rays march
    samples ``step`` cells apart, so a step of 0.5 cells jumps over it on part of the rays while 0.125 finds
    it on all (``views.march_step``: a coarse step's ground truth misses where a ray grazes the surface,
    and misses differently from view to view)."""
    n = 21
    f = np.zeros((n, n, n), np.float32)
    f[:, :, 10] = 1.0                                  # x = 10: the sheet's middle plane
    block = whole_block(f)
    size, focal, distance = 24, 60.0, 60.0
    viewmat, K = camera((10.0, 10.0, 10.0), (1.0, 0.35, 0.2), distance, focal, size)
    covered = {}
    for step in (0.5, 0.125):
        rgba, _ = raycast(block, viewmat, K, size, size, 0.85, supersample=1, step=step, backend="torch")
        covered[step] = rgba[0, ..., 3]
    middle = covered[0.125][6:18, 6:18]               # the sheet fills the middle of the image
    assert bool((middle == 1).all())
    missed = int((covered[0.5][6:18, 6:18] < 1).sum())
    assert 0.1 * middle.numel() < missed < middle.numel()


def test_more_rays_per_pixel_draw_an_outline_closer_to_its_true_coverage():
    """A sphere's outline: with s x s rays a partly covered pixel's alpha is a multiple of 1 / s^2, so
    2 x 2 rays quantise the coverage in quarters; 4 x 4 (``views.supersample``'s default) come closer to
    a 12 x 12 cast on the outline's pixels (the error that differs from view to view)."""
    block = sphere_block()
    size = 40
    viewmat, K = camera((19.3, 20.1, 18.7), (0.3, 0.8, -0.5), 80.0, 90.0, size)
    alpha = {s: raycast(block, viewmat, K, size, size, 12.0, supersample=s, backend="torch")[0][0, ..., 3]
             for s in (2, 4, 12)}
    outline = (alpha[12] > 0) & (alpha[12] < 1)
    assert int(outline.sum()) > 40
    for s in (2, 4):
        assert torch.allclose(alpha[s] * s * s, (alpha[s] * s * s).round(), atol=1e-4)
    err = {s: float((alpha[s] - alpha[12])[outline].abs().mean()) for s in (2, 4)}
    assert err[4] < 0.6 * err[2], err
    assert ViewConfig().supersample == 4

def test_raycast_views_calls_ready_once_with_the_field_prepared_before_the_first_cast(monkeypatch):
    """``ready`` runs once, after the field is prepared and before the first group of views is cast
    (the pipeline waits there for the caster's kernel compiled on another thread)."""
    import insitu.groundtruth.caster as gt

    events = []
    prepare, cast = gt.prepare_scene, gt.raycast_torch
    monkeypatch.setattr(gt, "prepare_scene", lambda *a, **k: events.append("prepared") or prepare(*a, **k))
    monkeypatch.setattr(gt, "raycast_torch", lambda *a, **k: events.append("cast") or cast(*a, **k))
    block = whole_block(blobs_array())
    views = orbit_views(*block.global_box, count=4, resolution=16)
    groups = gt.raycast_views(block, views.viewmats, views.Ks, 16, 16, [0.3, 0.6], views_per_call=2,
                              backend="torch", ready=lambda: events.append("ready"))
    assert events == []                         # nothing before the first group is asked for
    assert [len(ids) for ids, _, _ in groups] == [2, 2]
    assert events == ["prepared", "ready", "cast", "cast"]
