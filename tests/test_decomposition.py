"""decompose: the ranks' boxes as a validated Cartesian grid of blocks, or an InputError naming ranks and boxes."""
import numpy as np
import pytest
import torch

from insitu.errors import InputError
from insitu.input.decomposition import block_extent, decompose, split_dims
from insitu.render.compositing import visibility_order

SHAPE = (12, 10, 8)          # samples (nx, ny, nz)


def check(los, his, unit="samples", shapes=None):
    return decompose(los, his, shapes or [SHAPE] * len(los), unit=unit)


def test_an_uneven_split_keeps_its_real_edges_and_coordinates():
    los = [(0, 0, 0), (5, 0, 0), (0, 3, 0), (5, 3, 0)]
    his = [(5, 3, 8), (12, 3, 8), (5, 10, 8), (12, 10, 8)]
    d = check(los, his)
    assert d.dims == (2, 2, 1)
    assert d.coords.tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    assert [e.tolist() for e in d.edges] == [[0, 5, 12], [0, 3, 10], [0, 8]]
    ex, ey, ez = d.world_edges((1.0, 2.0, 3.0), (0.5, 1.0, 2.0))
    np.testing.assert_allclose(ex, [1.0, 3.5, 7.0])
    np.testing.assert_allclose(ey, [2.0, 5.0, 12.0])
    np.testing.assert_allclose(ez, [3.0, 19.0])


def test_every_point_has_one_owner_the_rank_whose_block_holds_it():
    """Decomposition.owners: by the real (uneven) edges in world units, whatever order the ranks come in;
    an inner edge belongs to the block above it, points outside the grid to the nearest block."""
    los = [(5, 3, 0), (0, 0, 0), (5, 0, 0), (0, 3, 0)]
    his = [(12, 10, 8), (5, 3, 8), (12, 3, 8), (5, 10, 8)]
    d = check(los, his)
    origin, spacing = (1.0, 2.0, 3.0), (0.5, 1.0, 2.0)               # x edges 1, 3.5, 7; y edges 2, 5, 12
    points = np.array([[1.2, 2.5, 4.0], [3.5, 2.5, 4.0], [3.4, 5.0, 4.0], [6.9, 11.9, 18.0],
                       [-9.0, -9.0, -9.0], [99.0, 3.0, 99.0], [2.0, 99.0, 0.0]])
    assert d.owners(points, origin, spacing).tolist() == [1, 2, 3, 0, 1, 2, 3]
    assert d.owners(np.zeros((0, 3)), origin, spacing).tolist() == []


def test_the_ranks_may_come_in_any_order():
    d = check([(6, 0, 0), (0, 0, 0)], [(12, 10, 8), (6, 10, 8)])
    assert d.dims == (2, 1, 1) and d.coords.tolist() == [[1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_block_extent_cells_tile_the_grid(size):
    shape = (33, 17, 20)
    dims = split_dims(shape, size)
    exts = [block_extent(r, dims, shape) for r in range(size)]
    d = decompose([e.owned_lo for e in exts], [e.owned_hi for e in exts], [shape] * size, unit="cells")
    assert d.dims == dims
    assert [tuple(c) for c in d.coords.tolist()] == [e.coords for e in exts]
    assert [int(e[-1]) for e in d.edges] == [n - 1 for n in shape]


@pytest.mark.parametrize("los, his, words", [
    ([(0, 0, 0), (4, 0, 0)], [(6, 10, 8), (12, 10, 8)],
     "ranks 0 and 1 overlap: rank 0 holds samples [0, 6) x [0, 10) x [0, 8), rank 1 holds [4, 12) x [0, 10) x [0, 8) "
     "(both hold [4, 6) x [0, 10) x [0, 8))"),
    ([(0, 0, 0), (0, 0, 0)], [(6, 10, 8), (6, 10, 8)], "ranks 0 and 1 overlap"),
    ([(0, 0, 0), (7, 0, 0)], [(6, 10, 8), (12, 10, 8)],
     "leave a gap: they hold 880 of the 960 samples of the grid of [0, 12) x [0, 10) x [0, 8) samples "
     "(global_shape (12, 10, 8)): e.g. samples [6, 7) x [0, 10) x [0, 8) is held by no rank"),
    ([(0, 0, 0), (0, 5, 0), (6, 5, 0)], [(12, 5, 8), (6, 10, 8), (12, 10, 8)],
     "not a Cartesian grid of blocks: rank 0 holds samples [0, 12) x [0, 5) x [0, 8), across the cut at x = 6 "
     "of rank 2 ([6, 12) x [5, 10) x [0, 8))"),
    ([(0, 0, 0), (6, 0, 0)], [(6, 10, 8), (13, 10, 8)], "rank 1 holds samples [6, 13) x [0, 10) x [0, 8): expected a "
     "non-empty box inside the grid"),
    ([(0, 0, 0), (6, 0, 0)], [(6, 10, 8), (6, 10, 8)], "rank 1 holds samples [6, 6) x [0, 10) x [0, 8): expected a "
     "non-empty box"),
], ids=["overlap", "duplicate", "gap", "not Cartesian", "outside", "empty"])
def test_boxes_that_do_not_tile_the_grid_are_an_input_error_naming_ranks_and_boxes(los, his, words):
    with pytest.raises(InputError) as e:
        check(los, his)
    assert words in str(e.value)


def test_a_grid_of_blocks_with_a_block_twice_or_a_block_missing():
    """Boxes that each are one block of the grid their edges make: a duplicate is an overlap, a
    missing block a gap, each named."""
    los = [(0, 0, 0), (6, 0, 0), (0, 5, 0), (6, 5, 0)]
    his = [(6, 5, 8), (12, 5, 8), (6, 10, 8), (12, 10, 8)]
    with pytest.raises(InputError, match=r"ranks 1 and 3 overlap: rank 1 holds samples \[6, 12\) x \[5, 10\)"):
        check(los[:1] + los[3:] + los[2:], his[:1] + his[3:] + his[2:])
    with pytest.raises(InputError, match=r"hold 720 of the 960 samples .* e\.g\. samples \[6, 12\) x \[0, 5\) "
                                         r"x \[0, 8\) is held by no rank"):
        check([los[0]] + los[2:], [his[0]] + his[2:])


def test_thousands_of_ranks():
    n = 16                                          # 16^3 = 4096 blocks of 4^3 cells
    c = np.stack(np.meshgrid(*(np.arange(n),) * 3, indexing="ij"), axis=-1).reshape(-1, 3)[:, ::-1]
    d = decompose(4 * c, 4 * c + 4, [(4 * n + 1,) * 3] * len(c), unit="cells")
    assert d.dims == (n, n, n) and np.array_equal(d.coords, c)
    bad = (4 * c).copy()
    bad[-1] = (0, 0, 0)
    with pytest.raises(InputError, match="ranks 0 and 4095 overlap"):
        decompose(bad, bad + 4, [(4 * n + 1,) * 3] * len(c), unit="cells")


def test_ranks_that_disagree_on_global_shape_are_named():
    with pytest.raises(InputError,
                       match=r"disagree on global_shape: rank 0 has \(12, 10, 8\), rank 1 has \(12, 10, 9\)"):
        check([(0, 0, 0), (6, 0, 0)], [(6, 10, 8), (12, 10, 8)], shapes=[SHAPE, (12, 10, 9)])


def test_cells_extend_to_n_minus_one():
    check([(0, 0, 0)], [(11, 9, 7)], unit="cells")
    with pytest.raises(InputError, match="leave a gap"):
        check([(0, 0, 0)], [(10, 9, 7)], unit="cells")


def test_the_real_edges_order_the_blocks_where_an_even_split_would_not():
    """Gray-Scott L = 32 on 2 ranks cuts its 31 cells at 16 (an even split: 15.5); a camera at x = 15.7
    is in block 0 (the block behind it is 1), not in block 1."""
    d = decompose([(0, 0, 0), (16, 0, 0)], [(16, 31, 31), (31, 31, 31)], [(32, 32, 32)] * 2, unit="cells")
    cam = torch.tensor([[15.7, -40.0, 15.0]], dtype=torch.float64)
    lo, hi = torch.zeros(3), torch.full((3,), 31.0)
    coords = torch.as_tensor(d.coords)
    real = visibility_order(cam, d.dims, lo, hi, coords, edges=tuple(torch.as_tensor(e) for e in d.world_edges(
        (0, 0, 0), (1, 1, 1))))
    even = visibility_order(cam, d.dims, lo, hi, coords)
    assert real[0, 0] < real[0, 1] and even[0, 0] > even[0, 1]     # block 0 is in front, an even split says 1
