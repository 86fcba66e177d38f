import numpy as np
import pytest

from insitu.errors import InputError
from insitu.input.decomposition import block_extent, cut_block, split_dims
from insitu.volume import check_field, downsample, parse_raw_name, read_raw, whole_block

from conftest import shared_volume


def test_raw_name_and_read(tmp_path):
    a = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(2, 3, 4)       # z, y, x
    p = tmp_path / "thing_4x3x2_uint8.raw"
    a.tofile(p)
    assert parse_raw_name(p) == ((4, 3, 2), np.dtype("uint8"))
    np.testing.assert_array_equal(read_raw(p), a)


def test_raw_size_mismatch_is_a_clear_error(tmp_path):
    p = tmp_path / "thing_4x3x2_uint8.raw"
    np.zeros(23, np.uint8).tofile(p)
    with pytest.raises(InputError, match="has 23 bytes, expected 24"):
        read_raw(p)
    q = tmp_path / "noname.raw"
    np.zeros(8, np.uint8).tofile(q)
    with pytest.raises(InputError, match="dims and dtype are not given and not in the name"):
        read_raw(q)
    assert read_raw(q, dims=(2, 2, 2), dtype="uint8").shape == (2, 2, 2)
    with pytest.raises(InputError, match="no such file"):
        read_raw(tmp_path / "missing_2x2x2_uint8.raw")


def test_field_checks():
    with pytest.raises(InputError, match="expected a 3D array"):
        check_field(np.zeros((4, 4)))
    bad = np.zeros((3, 3, 3))
    bad[1, 2, 0] = np.nan
    with pytest.raises(InputError, match=r"NaN/Inf value\(s\), first at \(x=0, y=2, z=1\)"):
        check_field(bad)
    bad[1, 2, 0] = np.inf
    with pytest.raises(InputError, match="NaN/Inf"):
        check_field(bad)


def test_real_volume_reads():
    v = read_raw(shared_volume("engine_256x256x128_uint8.raw"))
    assert v.shape == (128, 256, 256) and v.max() > 180
    assert downsample(v, 4).shape == (32, 64, 64)


def test_whole_block_geometry():
    b = whole_block(np.zeros((4, 5, 6)), origin=(1, 2, 3), spacing=(0.5, 1, 2))
    assert b.global_shape == (6, 5, 4)
    lo, hi = b.global_box
    np.testing.assert_allclose(lo, [1, 2, 3])
    np.testing.assert_allclose(hi, [1 + 2.5, 2 + 4, 3 + 6])


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_decomposition_tiles_the_cells(size):
    gshape = (17, 12, 9)
    dims = split_dims(gshape, size)
    assert np.prod(dims) == size
    owned = np.zeros((gshape[2] - 1, gshape[1] - 1, gshape[0] - 1), int)
    for r in range(size):
        e = block_extent(r, dims, gshape)
        owned[e.owned_lo[2]:e.owned_hi[2], e.owned_lo[1]:e.owned_hi[1], e.owned_lo[0]:e.owned_hi[0]] += 1
        assert all(s <= lo and s + c - 1 >= hi for s, c, lo, hi in zip(e.start, e.count, e.owned_lo, e.owned_hi))
    assert (owned == 1).all()


def test_cut_block_matches_the_global_array():
    a = np.random.default_rng(0).random((9, 12, 17))
    for r in range(4):
        b = cut_block(a, r, 4)
        s, c = b.start, b.shape_xyz
        np.testing.assert_array_equal(b.data, a[s[2]:s[2] + c[2], s[1]:s[1] + c[1], s[0]:s[0] + c[0]])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_halo_exchange_fills_ghosts_of_a_simulation_split(ranks):
    from conftest import run_mpi

    proc = run_mpi(ranks, "halo_worker.py", timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count(": ok") == ranks


def test_iso_distance_is_the_distance_to_the_isosurface():
    from insitu.volume import Block, iso_distance

    n = 24
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(np.float32)
    c = (n - 1) / 2
    field = 2.0 * np.sqrt((x - c) ** 2 + (y - c) ** 2 + (z - c) ** 2)     # twice the distance from the centre
    # a block of the global grid (start 4 in x, 2 in y and z), spacing 0.5, origin (1, 2, 3)
    block = Block(field[2:, 2:, 4:], (4, 2, 2), (n, n, n), (4, 2, 2), (n - 1, n - 1, n - 1),
                  (1.0, 2.0, 3.0), (0.5, 0.5, 0.5))
    rng = np.random.default_rng(0)
    d = rng.normal(size=(200, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    r = rng.uniform(3.0, 7.0, size=(200, 1))                                # cells from the centre
    ijk = c + r * d
    ijk = ijk[np.all(ijk >= 4.5, axis=1)]                                    # inside the block's samples
    world = np.array([1.0, 2.0, 3.0]) + 0.5 * ijk
    got = iso_distance(block, [10.0, 40.0], world)                           # spheres of radius 5 and 20 cells
    want = 0.5 * np.abs(np.linalg.norm(ijk - c, axis=1) - 5.0)                 # world units: 0.5 per cell
    np.testing.assert_allclose(got, want, atol=0.5 * 0.15)                  # to first order: within 0.15 cells
    outside = np.array([1.0, 2.0, 3.0]) + 0.5 * np.array([[1.0, c, c], [c, c, n + 1.0]])
    assert np.all(np.isinf(iso_distance(block, [10.0], outside)))
    flat = Block(np.ones((4, 4, 4), np.uint8), (0, 0, 0), (4, 4, 4), (0, 0, 0), (3, 3, 3))
    assert np.all(np.isinf(iso_distance(flat, [0.5], np.full((2, 3), 1.5))))   # no gradient: no surface near


def test_unit_field_keeps_surfaces_and_brings_values_near_one():
    from insitu.volume import unit_field

    f = np.linspace(-3, 5, 2 * 3 * 4).reshape(2, 3, 4)
    for scale, offset in ((1e-24, 0.0), (1e24, 0.0), (1e-3, 1e6), (1.0, 0.0)):
        out, isos = unit_field(offset + scale * f, [offset + scale * 1.0, offset + scale * 2.0])
        assert out.dtype == np.float32 and np.abs(out).max() <= 1.0 + 1e-6
        np.testing.assert_allclose(out, (f - 1.5) / 4.5, atol=1e-6)
        np.testing.assert_allclose(isos, [-0.5 / 4.5, 0.5 / 4.5], atol=1e-6)
    u8 = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    out, isos = unit_field(u8, [7])
    assert out is u8 and isos == [7.0]              # exact in float32: uploaded as it is


def test_unit_colors_maps_the_range_and_a_constant_field_to_the_middle():
    from insitu.volume import unit_colors

    np.testing.assert_allclose(unit_colors(np.array([1e6, 1e6 + 1e-3, 1e6 + 2e-3]), 1e6, 1e6 + 2e-3), [0, 0.5, 1],
                               atol=1e-6)
    np.testing.assert_array_equal(unit_colors(np.full(4, 300.0), 300.0, 300.0), np.full(4, 0.5, np.float32))
    with pytest.raises(ValueError, match="lo <= hi"):
        unit_colors(np.zeros(2), 1.0, 0.0)
