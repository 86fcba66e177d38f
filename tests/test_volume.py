import numpy as np
import pytest

from insitu.decomposition import block_extent, cut_block, split_dims
from insitu.volume import check_field, downsample, parse_raw_name, read_raw, whole_block
from insitu.errors import InputError

from conftest import SHARED_DATA


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
    path = SHARED_DATA / "engine_256x256x128_uint8.raw"
    v = read_raw(path)
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
