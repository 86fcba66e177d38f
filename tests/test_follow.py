"""The warm step's surface policy (insitu.surface.follow): stale Gaussians flagged, new surface found and the
count steered, on a sphere that shifts and grows, a blob that splits and a field that does not change."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import ndimage
from conftest import sphere_field

from insitu.surface.follow import (STALE_CELLS, Budget, CellIndex, coverage, follow_budget, plan, stale, submesh,
                                   surface_offsets, thinned, uncovered)
from insitu.surface.seeds import extract_seeds, init_gaussians
from insitu.volume import Frame, iso_distance, whole_block

N = 32
C = (N - 1) / 2


def shard_on(block, iso: float, count: int, seed: int = 0):
    """A model of ``count`` Gaussians drawn on the isosurface (as a cold start seeds it)."""
    return init_gaussians(extract_seeds(block, iso), count, fill=True, seed=seed)


def blobs(separation: float, amplitude: float) -> np.ndarray:
    """Two Gaussian blobs (width 3 cells) ``separation`` cells apart along x, both of ``amplitude``."""
    z, y, x = np.mgrid[0:N, 0:N, 0:N].astype(np.float64)
    g = sum(np.exp(-((x - C - s) ** 2 + (y - C) ** 2 + (z - C) ** 2) / 18.0)
            for s in (-separation / 2, separation / 2))
    return (amplitude * g).astype(np.float32)


# ------------------------------------------------------------------------------------------ a sphere that moves

OLD = dict(centre=(C, C, C), radius=6.0)
NEW = dict(centre=(C + 0.6, C, C), radius=6.2)        # shifted 0.6 cells along x and 0.2 cells larger


@pytest.fixture(scope="module")
def spheres():
    old = whole_block(sphere_field(N, OLD["centre"]))
    new = whole_block(sphere_field(N, NEW["centre"]))
    return old, new, shard_on(old, OLD["radius"], 3000)


def off_new_sphere(points: np.ndarray) -> np.ndarray:
    """Each point's exact distance (cells) to the new sphere."""
    return np.abs(np.linalg.norm(points - np.array(NEW["centre"]), axis=1) - NEW["radius"])


def test_offsets_are_the_distance_to_the_surface_and_project_onto_it(spheres):
    _, new, shard = spheres
    means = shard.means.numpy()
    got = surface_offsets(new, [NEW["radius"]], shard.means)            # a tensor as well as an array
    # first order in a trilinear field: within a few hundredths of a cell of the exact distance
    np.testing.assert_allclose(got.cells, off_new_sphere(means), atol=0.05)
    # the numpy reference (float64, scipy's trilinear samples): the same to float32's rounding
    np.testing.assert_allclose(got.cells, iso_distance(new, [NEW["radius"]], means), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(off_new_sphere(got.projected.numpy()), 0.0, atol=0.05)
    outside = surface_offsets(new, [NEW["radius"]], np.array([[-3.0, C, C], [C, C, N + 1.0]]))   # off the grid
    assert torch.isinf(outside.cells).all()
    np.testing.assert_array_equal(outside.projected, [[-3.0, C, C], [C, C, N + 1.0]])
    flat = surface_offsets(whole_block(np.full((8, 8, 8), 2.0, np.float32)), [1.0], np.array([[3.0, 3.5, 4.0]]))
    assert torch.isinf(flat.cells).all()                                    # no gradient: nowhere to go


def test_stale_gaussians_are_those_off_the_moved_surface(spheres):
    _, new, shard = spheres
    means = shard.means.numpy()
    gone = stale(new, [NEW["radius"]], means, cells=0.5)
    exact = off_new_sphere(means)
    clear = np.abs(exact - 0.5) > 0.05                      # first order: within a few hundredths of a cell
    np.testing.assert_array_equal(gone[clear], exact[clear] > 0.5)
    x = (means[:, 0] - C) / OLD["radius"]
    assert gone[x > 0.9].all() and not gone[x < 0.1].any()    # the leading side moved 0.8 cells, the rest less
    assert 0.1 < gone.float().mean() < 0.5
    assert stale(new, [NEW["radius"]], means, cells=2.0).sum() == 0
    assert stale(new, [NEW["radius"], 2.0], means, cells=0.5).sum() == gone.sum()   # a second, distant surface
    quarter = stale(new, [NEW["radius"]], means)            # the default: a quarter of a cell
    clear = np.abs(exact - STALE_CELLS) > 0.05
    np.testing.assert_array_equal(quarter[clear], exact[clear] > STALE_CELLS)


def test_what_training_left_off_the_surface_stays_until_the_surface_moves_away_from_it():
    """Gaussians 0.4 cells off an unchanged sphere (as training leaves some by thin or sharp features): stale by
    their offset alone, not given their offset when their step ended; once the sphere has shrunk by 0.3 cells
    away from them (0.7 off, more than a quarter of a cell beyond 0.4), stale again; Gaussians 0.8 cells off
    (more than three quarters) are stale whatever their offset was."""
    field = sphere_field(N)
    block = whole_block(field)
    off = shard_on(whole_block(field), 6.4, 800).means              # 0.4 cells outside the sphere of radius 6
    then = surface_offsets(block, [6.0], off).cells
    assert stale(block, [6.0], off).all() and not stale(block, [6.0], off, then=then).any()
    assert not stale(block, [5.8], off, then=then).any() and stale(block, [5.7], off, then=then).all()
    far = shard_on(whole_block(field), 6.8, 800).means
    assert stale(block, [6.0], far, then=surface_offsets(block, [6.0], far).cells).all()
    with pytest.raises(ValueError, match=r"then: expected \[N\] = \[800\] offsets, one per Gaussian, got shape"):
        stale(block, [6.0], off, then=then[:5])


def test_new_surface_is_the_leading_side_where_nothing_was_kept(spheres):
    _, new, shard = spheres
    gone = stale(new, [NEW["radius"]], shard.means, cells=0.5)
    kept = surface_offsets(new, [NEW["radius"]], shard.means[~torch.as_tensor(gone)]).projected
    seeds = extract_seeds(new, NEW["radius"])
    cover = coverage(seeds.points, seeds.areas, kept)
    u = (seeds.points[:, 0] - NEW["centre"][0]) / NEW["radius"]
    # the kept centres, moved onto the new sphere along its radii, are where a ray from its centre meets the
    # old one within half a cell: x / r below 0.4605; they cover a spacing beyond, new surface past it
    assert cover.new[u > 0.75].all() and not cover.new[u < 0.1].any()
    edge = math.cos(math.acos(0.4605) - cover.radius / NEW["radius"])
    assert cover.new_share == pytest.approx((1 - edge) / 2, abs=0.03)     # a cap's share of a sphere's area
    assert cover.new_share == pytest.approx(seeds.areas[cover.new].sum() / seeds.total_area)
    assert 0.25 < cover.radius < 0.75            # the kept model's spacing, in cells


def test_an_unchanged_field_gives_no_stale_gaussians_and_no_new_seeds(spheres):
    old, _, shard = spheres
    seeds = extract_seeds(old, OLD["radius"])
    logits = shard.opacity_logits
    p = plan(old, [OLD["radius"]], seeds, shard.means, logits, expected=len(shard))
    assert p.keep.all() and not p.new.any()
    assert p.budget == Budget(len(shard), len(shard) / seeds.total_area, 0, 0, 0)
    # a model drawn apart from the seeds (another draw, another count) covers them as well
    other = shard_on(old, OLD["radius"], 1200, seed=7)
    p = plan(old, [OLD["radius"]], seeds, other.means, other.opacity_logits, expected=1000)
    assert p.keep.all() and not p.new.any() and (p.budget.new, p.budget.extra, p.budget.drop) == (0, 0, 0)


def test_a_plan_seeds_the_new_surface_at_the_kept_models_density(spheres):
    _, new, shard = spheres
    seeds = extract_seeds(new, NEW["radius"])
    p = plan(new, [NEW["radius"]], seeds, shard.means, shard.opacity_logits, expected=len(shard))
    kept = int(p.keep.sum())
    assert kept == (~stale(new, [NEW["radius"]], shard.means)).sum()         # in the band: nothing thinned
    assert p.budget.target == round(kept / (1 - p.coverage.new_share))
    assert p.budget.new == round(p.budget.target * p.coverage.new_share) and p.budget.extra == p.budget.drop == 0
    # the seeds a step then draws on the new triangles, tested against the kept centres as the vertices were
    part = submesh(seeds, p.new)
    drawn = init_gaussians(part, round(p.budget.density * part.total_area), fill=True, seed=3)
    added = uncovered(drawn.means, p.projected, p.coverage.radius).sum()
    assert abs(added - p.budget.new) < 0.25 * p.budget.new


def test_the_new_seeds_leave_no_gap_between_them_and_the_kept_model():
    """Half a sphere's model kept, the other half new: with the seeds a step draws on the new surface, the
    surface points along the border (a cell either side of it) lie within 1.3 times as far from the nearest
    centre as elsewhere, on average; new surface taken from ``reach`` spacings of the kept centres on leaves a
    band between them (about 1.45 times)."""
    from scipy.spatial import cKDTree

    from insitu.surface.seeds import sample_surface

    block = whole_block(sphere_field(N))
    seeds = extract_seeds(block, 10.0)
    model = shard_on(block, 10.0, 3000)
    half = model.means[:, 0] < C
    p = plan(block, [10.0], seeds, model.means, torch.where(half, 0.0, -20.0), expected=3000, faint=0.005)
    assert torch.equal(p.keep, half) and p.stale.sum() == 0     # the other half faint: dropped
    part = submesh(seeds, p.new.numpy())
    drawn = init_gaussians(part, round(p.budget.density * part.total_area), fill=True, seed=3)
    centres = torch.cat([model.means[half], drawn.means[uncovered(drawn.means, p.projected, p.coverage.radius)]])
    assert len(centres) == pytest.approx(3000, rel=0.08)        # the new half at the kept half's density
    assert p.coverage.radius == pytest.approx(math.sqrt(seeds.total_area / len(centres)), rel=0.1)
    probe = sample_surface(seeds, 20000, 1).points
    gap, _ = cKDTree(centres.numpy()).query(probe)
    border = np.abs(probe[:, 0] - C) < 1.0
    assert gap[border].mean() < 1.3 * gap[~border].mean(), (gap[border].mean(), gap[~border].mean())


# ------------------------------------------------------------------------------------------ a blob that splits

def test_a_blob_that_splits_loses_its_waist_and_gains_two_inner_caps():
    """Two overlapping blobs, fading: the surface at 0.5 pinches at the waist into two pieces while the outer
    caps shrink by less than half a cell (kept, with a stale distance of half a cell)."""
    iso = 0.5
    before, after = whole_block(blobs(9.6, 1.0)), whole_block(blobs(9.6, 0.85))
    assert ndimage.label(before.data > iso)[1] == 1 and ndimage.label(after.data > iso)[1] == 2
    shard = shard_on(before, iso, 3000)
    means = shard.means.numpy()
    seeds = extract_seeds(after, iso)
    p = plan(after, [iso], seeds, shard.means, shard.opacity_logits, expected=len(shard), cells=0.5)
    x = means[:, 0] - C
    assert not p.keep[np.abs(x) < 1.0].any()                    # the waist went
    assert p.keep[np.abs(x) > 6.0].all()                        # the outer caps stay
    sx = seeds.points[:, 0] - C
    assert p.new.any() and np.abs(sx[p.new]).max() < 4.0       # new surface: the caps that face each other
    assert not p.new[np.abs(sx) > 6.0].any()


# ------------------------------------------------------------------------------------------ frames, counts

def test_a_frame_places_the_centres_as_the_step_holds_them():
    """A block in world units (origin and spacing in metres) and centres in its frame: the same answer as
    the grid in index units."""
    field = sphere_field(N, OLD["centre"])
    index = whole_block(field)
    world = whole_block(field, origin=(2.0, -1.0, 0.5), spacing=(0.5, 0.5, 0.5))
    means = shard_on(index, 7.0, 500).means.numpy()          # 1 cell off the surface at 6
    frame = Frame.of(world)
    np.testing.assert_array_equal(stale(world, [6.0], means, frame=frame, cells=1.2),
                                  stale(index, [6.0], means, cells=1.2))
    assert not stale(world, [6.0], means, frame=frame, cells=1.2).any()
    assert stale(world, [6.0], means, frame=frame, cells=0.8).all()
    # the same centres in world units against the world block
    assert stale(world, [6.0], frame.points_to_world(means), cells=0.8).all()


@pytest.mark.parametrize("expected, kept, share, ceiling, want", [
    (1000, 1000, 0.0, None, (1000, 0, 0, 0)),           # unchanged: flat
    (1000, 800, 0.2, None, (1000, 200, 0, 0)),          # new surface at the kept model's density
    (1000, 1200, 0.2, None, (1500, 300, 0, 0)),         # denser kept model, within the band: carried on
    (1000, 2000, 0.0, None, (1500, 0, 0, 500)),         # above the band: thinned to its top
    (1000, 500, 0.0, None, (667, 0, 167, 0)),           # below the band: topped up to its bottom
    (1000, 1400, 0.0, 1200, (1200, 0, 0, 200)),         # the ceiling
    (1000, 0, 1.0, None, (1000, 1000, 0, 0)),           # nothing kept: a cold step's count
])
def test_the_budget_follows_a_cold_steps_count_within_the_slack(expected, kept, share, ceiling, want):
    b = follow_budget(expected, kept, share, 50.0, ceiling=ceiling, slack=1.5)
    assert (b.target, b.new, b.extra, b.drop) == want
    assert b.density == pytest.approx(b.target / 50.0)


def test_thinning_drops_the_least_opaque():
    np.testing.assert_array_equal(thinned(np.array([0.3, -1.0, 2.0, -1.0]), 2), [True, False, True, False])
    np.testing.assert_array_equal(thinned(torch.tensor([0.3, -1.0]), 0), [True, True])


def test_a_submesh_holds_the_triangles_on_flagged_vertices():
    seeds = extract_seeds(whole_block(sphere_field(16)), 5.0)
    half = seeds.points[:, 0] > 7.5
    part = submesh(seeds, half)
    assert 0.45 < part.total_area / seeds.total_area < 0.6
    assert part.faces.max() == len(part) - 1 and (part.points[:, 0] > 7.5 - 1.5).all()
    assert len(submesh(seeds, np.zeros(len(seeds), bool))) == 0


@pytest.mark.parametrize("call, message", [
    (lambda b: stale(b, [5.0], np.zeros((3, 2))), r"points: expected an \[N, 3\] array of positions, got shape"),
    (lambda b: stale(b, [5.0], np.zeros((3, 3)), cells=0), "cells: expected a finite number > 0, got 0"),
    (lambda b: stale(b, [], np.zeros((3, 3))), "isos: expected one or more finite iso values"),
    (lambda b: coverage(np.zeros((3, 3)), np.ones(2), np.zeros((1, 3))), r"areas: expected \[M\] = \[3\]"),
    (lambda b: follow_budget(100, 10, 1.5, 1.0), r"new_share: expected a share in \[0, 1\], got 1.5"),
    (lambda b: follow_budget(100, 10, 0.5, 1.0, slack=0.5), "slack: expected a factor >= 1"),
    (lambda b: thinned(np.zeros(3), 4), "drop: expected an integer from 0 to 3"),
])
def test_bad_arguments_are_refused_saying_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call(whole_block(sphere_field(12)))


@pytest.mark.parametrize("chunk", [1 << 22, 500])
def test_the_voxel_grid_covers_the_points_a_kd_tree_finds_a_centre_near(monkeypatch, chunk):
    """The GPU's search (:class:`CellIndex`, here on the CPU) against scipy's k-d tree (the reference, and what
    the CPU uses): centres strewn over a box and a tight cluster of them, points around and beyond, radii from
    under a cell's spacing to the box's size; the pairs measured in chunks of 500 (whole points at a time) as in
    one; a grid too fine for 64-bit keys widens its cells."""
    from scipy.spatial import cKDTree

    import insitu.surface.follow as follow

    monkeypatch.setattr(follow, "CHUNK", chunk)
    rng = np.random.default_rng(0)
    centres = np.concatenate([rng.random((400, 3)) * 10, 3.0 + rng.random((300, 3)) * 0.2]).astype(np.float32)
    points = (rng.random((3000, 3)) * 12 - 1).astype(np.float32)
    for radius in (0.05, 0.3, 1.0, 2.5, 20.0):
        d, _ = cKDTree(centres).query(points, distance_upper_bound=radius)
        got = CellIndex(torch.from_numpy(centres), radius).covered(torch.from_numpy(points))
        assert got.dtype == torch.bool and np.array_equal(got.numpy(), np.isfinite(d)), radius
        assert np.array_equal(uncovered(points, centres, radius).numpy(), ~np.isfinite(d)), radius
    far = torch.tensor([[0.0, 0.0, 0.0], [1e6, 1e6, 1e6]])
    assert CellIndex(far, 0.01).covered(torch.tensor([[0, 0, 1e-3], [1e6, 1e6, 1e6 + 0.5]])).tolist() == [True, False]
    assert uncovered(points[:3], centres[:0], 1.0).all() and not uncovered(points[:3], centres, math.inf).any()


def test_the_coverage_radius_shrinks_to_the_covered_area():
    """Where most of the surface is new, the kept centres are denser on what they cover than over the whole:
    the second pass's radius is the smaller."""
    seeds = extract_seeds(whole_block(sphere_field(N)), 10.0)
    left = seeds.points[seeds.points[:, 0] < C - 5]
    cover = coverage(seeds.points, seeds.areas, left)
    first = 2.0 * math.sqrt(seeds.total_area / len(left))
    assert cover.radius < 0.7 * first and cover.new_share > 0.6
