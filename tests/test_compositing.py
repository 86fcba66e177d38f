"""insitu.render.compositing: visibility order, bands, one-rank identity; P-rank runs vs the serial composite."""

import pytest
import torch

from insitu.input.decomposition import rank_coords
from insitu.parallel.comm import init_comm, shutdown
from insitu.render.compositing import band_rows, composite, composite_full, gather_bands, visibility_order

from conftest import run_mpi


def coords_of(dims):
    return torch.tensor([rank_coords(r, dims) for r in range(dims[0] * dims[1] * dims[2])])


def test_visibility_order_hand_worked_2x2x1():
    dims = (2, 2, 1)
    coords = coords_of(dims)                       # r0 (0,0,0), r1 (1,0,0), r2 (0,1,0), r3 (1,1,0)
    lo, hi = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([2.0, 2.0, 1.0])
    cams = torch.tensor([[-5.0, 0.5, 0.5],         # outside, -x, level with row y=0: block index (-5, 0, 0)
                         [3.0, 3.0, 0.5],          # outside the +x+y corner: (3, 3, 0)
                         [1.5, 0.2, 0.5],          # inside block r1: (1, 0, 0)
                         [0.5, 1.5, 10.0]])        # above block r2: (0, 1, 10)
    keys = visibility_order(cams, dims, lo, hi, coords)
    assert keys.tolist() == [[5, 6, 6, 7], [6, 5, 5, 4], [1, 0, 2, 1], [11, 12, 10, 11]]
    # nearer along the axis first: from -x, the x=0 column (r0, r2) before the x=1 column (r1, r3)
    assert keys[0, 0] < keys[0, 1] and keys[0, 2] < keys[0, 3]


def test_visibility_order_with_uneven_edges():
    dims = (2, 1, 1)
    coords = coords_of(dims)
    cam = torch.tensor([[1.2, 0.5, 0.5]])
    lo, hi = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([3.0, 1.0, 1.0])
    assert visibility_order(cam, dims, lo, hi, coords).tolist() == [[0, 1]]        # even split: x in [0, 1.5)
    edges = (torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert visibility_order(cam, dims, lo, hi, coords, edges=edges).tolist() == [[1, 0]]
    far = torch.tensor([[-7.0, 0.5, 0.5], [9.0, 0.5, 0.5]])
    assert visibility_order(far, dims, lo, hi, coords, edges=edges).tolist() == [[1, 2], [2, 1]]
    with pytest.raises(ValueError, match=r"edges\[0\]: expected 3 increasing"):
        visibility_order(cam, dims, lo, hi, coords, edges=(torch.tensor([0.0, 3.0]),) + edges[1:])


def test_visibility_order_is_front_to_back_along_every_ray():
    """Along any ray from the camera, the blocks it crosses have strictly increasing keys."""
    dims = (3, 2, 2)
    coords = coords_of(dims)
    lo, hi = torch.tensor([-1.0, 0.0, 2.0]), torch.tensor([2.0, 4.0, 3.0])
    size = (hi - lo) / torch.tensor(dims, dtype=torch.float32)
    blo = lo + coords * size
    bhi = blo + size
    g = torch.Generator().manual_seed(0)
    cams = lo + (hi - lo) * (torch.rand(40, 3, generator=g) * 3 - 1)      # inside and outside the box
    keys = visibility_order(cams, dims, lo, hi, coords)
    targets = lo + (hi - lo) * torch.rand(40, 200, 3, generator=g)        # rays through the box
    dirs = torch.nn.functional.normalize(targets - cams[:, None, :], dim=-1)
    inv = 1 / dirs[:, :, None, :]                                         # [B, R, 1, 3]
    t0 = (blo - cams[:, None, None, :]) * inv
    t1 = (bhi - cams[:, None, None, :]) * inv
    enter = torch.minimum(t0, t1).amax(-1).clamp(min=0)                  # [B, R, P]
    leave = torch.maximum(t0, t1).amin(-1)
    hit = leave > enter + 1e-6
    checked = 0
    for b in range(cams.shape[0]):
        for r in range(dirs.shape[1]):
            blocks = torch.nonzero(hit[b, r]).flatten()
            ordered = blocks[torch.argsort(enter[b, r, blocks])]
            k = keys[b, ordered]
            assert torch.all(k[1:] > k[:-1]), (cams[b], dirs[b, r], ordered, k)
            checked += len(blocks) > 1
    assert checked > 4000


def test_band_rows():
    assert band_rows(8, 2) == [(0, 4), (4, 8)]
    assert band_rows(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert band_rows(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert band_rows(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="height >= 1"):
        band_rows(0, 2)


def test_one_rank_is_identity_with_gradients():
    comm = init_comm(device="cpu")
    rgb = torch.rand(2, 5, 4, 3, requires_grad=True)
    alpha = torch.rand(2, 5, 4, 1, requires_grad=True)
    order = torch.zeros(2, 1)
    out = composite(rgb, alpha, order, comm)
    assert torch.equal(out, torch.cat([rgb, alpha], -1))
    out[..., 3].sum().backward()
    assert torch.equal(alpha.grad, torch.ones_like(alpha)) and torch.equal(rgb.grad, torch.zeros_like(rgb))
    full = composite_full(rgb, alpha, order, comm)
    assert not full.requires_grad and torch.equal(gather_bands(full, comm), full)
    assert comm.traffic.calls == 0
    shutdown(comm)


def test_composite_validates_inputs():
    comm = init_comm(device="cpu")
    rgb, alpha, order = torch.rand(2, 5, 4, 3), torch.rand(2, 5, 4, 1), torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"rgb: expected shape \[B, H, W, D\] \(D >= 1 channels\), got \(2, 5, 4\)"):
        composite(rgb[..., 0], alpha, order, comm)
    with pytest.raises(ValueError, match=r"alpha: expected shape \(2, 5, 4, 1\)"):
        composite(rgb, alpha[:, :4], order, comm)
    with pytest.raises(ValueError, match=r"order: expected shape \[B, P\] = \[2, 1\], got \(2, 2\)"):
        composite(rgb, alpha, torch.zeros(2, 2), comm)
    with pytest.raises(ValueError, match="same floating dtype"):
        composite(rgb, alpha.double(), order, comm)
    with pytest.raises(ValueError, match="transfer_dtype"):
        composite_full(rgb, alpha, order, comm, transfer_dtype=torch.int8)
    shutdown(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_composite_across_ranks_matches_serial(ranks):
    """P ranks vs the serial composite in float64: bands, gradients (1e-10), bytes, gradcheck (P=2)."""
    out = run_mpi(ranks, "composite_worker.py")
    assert out.returncode == 0, out.stdout
    assert all(f"OK rank {r} of {ranks}" in out.stdout for r in range(ranks)), out.stdout


@pytest.mark.gpu
@pytest.mark.mpi
def test_composite_across_two_gpus_nccl_matches_serial():
    """The same checks with NCCL, one GPU per rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (one per rank)")
    out = run_mpi(2, "composite_worker.py", "cuda", timeout=300)
    assert out.returncode == 0, out.stdout
    assert all(f"OK rank {r} of 2" in out.stdout for r in range(2)), out.stdout


def test_over_a_background_and_its_gradients():
    """``over``: rgb + (1 - alpha) * background, one background or one per image, with the
    gradients of the plain expression (float64 gradcheck); shapes checked up front."""
    from insitu.render.compositing import over

    g = torch.Generator().manual_seed(2)
    rgb = torch.rand(2, 5, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    alpha = torch.rand(2, 5, 4, 1, generator=g, dtype=torch.float64, requires_grad=True)
    for bg in (torch.rand(3, generator=g, dtype=torch.float64), torch.rand(2, 3, generator=g, dtype=torch.float64)):
        want = rgb + (1 - alpha) * bg.reshape(-1, 1, 1, 3)
        torch.testing.assert_close(over(rgb, alpha, bg), want)
        assert torch.autograd.gradcheck(lambda c, a: over(c, a, bg), (rgb, alpha))
    with pytest.raises(ValueError, match=r"background: expected \[3\] or \[2, 3\], got \(4,\)"):
        over(rgb, alpha, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="rgb, alpha: expected"):
        over(rgb, alpha[..., 0], torch.zeros(3, dtype=torch.float64))
