"""Cartesian block decomposition of a global grid, and the ghost layers of each block.

The global grid has ``global_shape = (nx, ny, nz)`` samples, hence ``n - 1`` cells per
axis. Cells (not samples) are split over a ``dims = (px, py, pz)`` grid of blocks, so
every cell belongs to exactly one rank and per-rank marching cubes gives a crack-free
surface. A rank holds the samples of its cells plus one ghost layer on each side (where
the domain goes on), which the ray caster needs for gradients.

Rank r sits at block coordinates ``coords = (cx, cy, cz)`` with x varying fastest:
``r = cx + px * (cy + py * cz)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from insitu.errors import InputError
from insitu.volume import Block

GHOST = 1


def split_dims(global_shape: tuple[int, int, int], size: int) -> tuple[int, int, int]:
    """Choose (px, py, pz) with px*py*pz == size that keeps blocks close to cubes."""
    if size <= 0:
        raise ValueError(f"size: expected >= 1 ranks, got {size}")
    cells = np.asarray(global_shape, dtype=np.float64) - 1
    best, best_cost = None, None
    for px in range(1, size + 1):
        if size % px:
            continue
        for py in range(1, size // px + 1):
            if (size // px) % py:
                continue
            pz = size // px // py
            dims = np.array([px, py, pz])
            if np.any(dims > cells):
                continue
            ext = cells / dims
            cost = (ext.max() / ext.min(), -px, -py)   # most cubic; ties: split x first
            if best_cost is None or cost < best_cost:
                best, best_cost = (px, py, pz), cost
    if best is None:
        raise InputError(f"cannot split a grid of {global_shape} samples over {size} ranks: "
                         "fewer cells than ranks along every split")
    return best


def rank_coords(rank: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    px, py, _ = dims
    return rank % px, (rank // px) % py, rank // (px * py)


def coords_rank(coords, dims) -> int:
    return int(coords[0] + dims[0] * (coords[1] + dims[1] * coords[2]))


@dataclass(frozen=True)
class Extent:
    """Index extents of one rank's block (all (x, y, z), global sample indices).

    owned_lo/owned_hi: the owned cells are ``owned_lo <= c < owned_hi``.
    start/count:       the samples held, ghost layers included (an ADIOS2 selection).
    """

    coords: tuple[int, int, int]
    owned_lo: tuple[int, int, int]
    owned_hi: tuple[int, int, int]
    start: tuple[int, int, int]
    count: tuple[int, int, int]


def block_extent(rank: int, dims: tuple[int, int, int], global_shape: tuple[int, int, int],
                 ghost: int = GHOST) -> Extent:
    """Extent of rank ``rank``'s block in a ``dims`` split of ``global_shape`` samples."""
    coords = rank_coords(rank, dims)
    lo, hi, start, count = [], [], [], []
    for c, p, n in zip(coords, dims, global_shape):
        cells = n - 1
        a = c * cells // p
        b = (c + 1) * cells // p
        s = max(a - ghost, 0)
        e = min(b + ghost, cells)          # last sample index held
        lo.append(a)
        hi.append(b)
        start.append(s)
        count.append(e - s + 1)
    return Extent(coords, tuple(lo), tuple(hi), tuple(start), tuple(count))


@dataclass(frozen=True)
class Decomposition:
    """The ranks' boxes, checked to tile the grid as a Cartesian grid of blocks.

    dims:   (px, py, pz) blocks along each axis.
    coords: [P, 3] block index (x, y, z) of each rank.
    edges:  per axis the ``d + 1`` boundaries of the blocks, in index units (cells or samples,
            as given to :func:`decompose`), from 0 to the grid's extent; uneven splits keep
            their real boundaries.
    """

    dims: tuple[int, int, int]
    coords: np.ndarray
    edges: tuple[np.ndarray, np.ndarray, np.ndarray]

    def world_edges(self, origin, spacing) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The edges in world units: ``origin + spacing * edge`` per axis (cells: edges lie on samples)."""
        return tuple(float(o) + float(s) * e.astype(np.float64) for o, s, e in zip(origin, spacing, self.edges))

    def owners(self, points: np.ndarray, origin, spacing) -> np.ndarray:
        """[N] the rank whose block holds each of ``points: [N, 3]`` (world x, y, z).

        A point on an inner edge belongs to the block above it; points outside the grid belong to
        the nearest block along each axis, so every point has exactly one owner.
        """
        points = np.asarray(points, dtype=np.float64).reshape(-1, 3)
        index = np.stack([np.clip(np.searchsorted(e, points[:, a], side="right") - 1, 0, d - 1)
                          for a, (e, d) in enumerate(zip(self.world_edges(origin, spacing), self.dims))], axis=1)
        rank_of = np.empty(self.dims, dtype=np.int64)
        rank_of[tuple(np.asarray(self.coords).T)] = np.arange(len(self.coords))
        return rank_of[tuple(index.T)]


def _box(lo, hi) -> str:
    return " x ".join(f"[{int(a)}, {int(b)})" for a, b in zip(lo, hi))


def decompose(los, his, global_shapes, *, unit: str = "cells") -> Decomposition:
    """Check that the ranks' boxes tile the grid as a Cartesian grid of blocks; their layout.

    los, his:      [P, 3] each rank's box ``lo <= index < hi`` (x, y, z), of cells or of samples.
    global_shapes: [P, 3] the global shape (nx, ny, nz) in samples each rank was given.
    unit:          ``"cells"`` (the grid has ``n - 1`` cells per axis) or ``"samples"`` (``n``).

    Raises InputError, naming the ranks and their boxes, when the ranks disagree on the global
    shape, a box is empty or leaves the grid, two boxes overlap, the boxes leave a gap, or they
    tile the grid but not as a Cartesian grid of blocks. Every rank that calls it with the same
    (all-gathered) boxes gets the same verdict.
    """
    if unit not in ("cells", "samples"):
        raise ValueError(f"unit: expected 'cells' or 'samples', got {unit!r}")
    los, his = np.asarray(los, dtype=np.int64), np.asarray(his, dtype=np.int64)
    shapes = np.asarray(global_shapes, dtype=np.int64)
    P = len(los)
    if P == 0 or los.shape != (P, 3) or his.shape != (P, 3) or shapes.shape != (P, 3):
        raise ValueError(f"los, his, global_shapes: expected [P, 3] each, got {los.shape}, {his.shape}, {shapes.shape}")
    differ = np.flatnonzero(np.any(shapes != shapes[0], axis=1))
    if len(differ):
        r = int(differ[0])
        raise InputError(f"the ranks disagree on global_shape: rank 0 has {tuple(map(int, shapes[0]))}, "
                         f"rank {r} has {tuple(map(int, shapes[r]))}")
    extent = shapes[0] - (1 if unit == "cells" else 0)
    grid = f"the grid of {_box((0, 0, 0), extent)} {unit} (global_shape {tuple(map(int, shapes[0]))})"
    for r in range(P):
        if np.any(his[r] <= los[r]) or np.any(los[r] < 0) or np.any(his[r] > extent):
            raise InputError(f"rank {r} holds {unit} {_box(los[r], his[r])}: expected a non-empty box inside {grid}")
    edges = tuple(np.unique(np.concatenate([los[:, a], [extent[a]]])) for a in range(3))
    coords = np.stack([np.searchsorted(edges[a], los[:, a]) for a in range(3)], axis=1)
    dims = tuple(len(e) - 1 for e in edges)
    aligned = all(np.array_equal(his[:, a], edges[a][coords[:, a] + 1]) for a in range(3))
    covered = int(np.prod(his - los, axis=1).sum())
    total = int(np.prod(extent))
    if aligned:         # every box is one block of the grid its edges make: O(P log P) checks
        index = np.ravel_multi_index(coords.T, dims)
        order = np.argsort(index, kind="stable")
        same = np.flatnonzero(index[order][1:] == index[order][:-1])
        if len(same):
            a, b = sorted(int(order[i]) for i in (same[0], same[0] + 1))
            _overlap(a, b, los, his, unit)
        if covered == total:
            return Decomposition(dims, coords, edges)
    else:
        chunk = max(1, (1 << 22) // P)          # pairwise, in chunks: only on the way to an error
        for c in range(0, P, chunk):
            lo_i = np.maximum(los[c:c + chunk, None, :], los[None, :, :])
            hi_i = np.minimum(his[c:c + chunk, None, :], his[None, :, :])
            overlap = np.all(hi_i > lo_i, axis=2)
            overlap[np.arange(len(overlap)), np.arange(c, c + len(overlap))] = False
            if overlap.any():
                i, j = (int(v) for v in np.argwhere(overlap)[0])
                _overlap(min(c + i, j), max(c + i, j), los, his, unit)
    if covered < total:
        raise InputError(f"the ranks' boxes leave a gap: they hold {covered} of the {total} {unit} of {grid}"
                         f"{_gap(los, his, extent, unit)}")
    for a in range(3):
        nxt = edges[a][coords[:, a] + 1]
        bad = np.flatnonzero(his[:, a] != nxt)
        if len(bad):
            r = int(bad[0])
            cut = int(nxt[r])
            other = int(np.flatnonzero(los[:, a] == cut)[0])
            raise InputError(f"the ranks' boxes are not a Cartesian grid of blocks: rank {r} holds {unit} "
                             f"{_box(los[r], his[r])}, across the cut at {'xyz'[a]} = {cut} of rank {other} "
                             f"({_box(los[other], his[other])})")
    raise AssertionError("unreachable: no overlap, no gap, aligned")


def _overlap(a: int, b: int, los, his, unit) -> None:
    lo, hi = np.maximum(los[a], los[b]), np.minimum(his[a], his[b])
    raise InputError(f"ranks {a} and {b} overlap: rank {a} holds {unit} {_box(los[a], his[a])}, rank {b} "
                     f"holds {_box(los[b], his[b])} (both hold {_box(lo, hi)})")


def _gap(los, his, extent, unit) -> str:
    """': e.g. [a, b) x ... is held by no rank', for the first uncovered box of the grid the boxes' edges make."""
    edges = [np.unique(np.concatenate([los[:, a], his[:, a], [0, extent[a]]])) for a in range(3)]
    if np.prod([len(e) - 1 for e in edges]) > 1 << 22:
        return ""
    count = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
    for lo, hi in zip(los, his):
        sl = tuple(slice(np.searchsorted(e, l), np.searchsorted(e, h)) for e, l, h in zip(edges, lo, hi))
        count[sl] += 1
    ijk = np.argwhere(count == 0)[0]
    lo = [e[i] for e, i in zip(edges, ijk)]
    hi = [e[i + 1] for e, i in zip(edges, ijk)]
    return f": e.g. {unit} {_box(lo, hi)} is held by no rank"


def cut_block(array: np.ndarray, rank: int, size: int, origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0),
              fields: dict[str, np.ndarray] | None = None) -> Block:
    """This rank's Block of a global [nz, ny, nx] array that every rank can see (file, test)."""
    nz, ny, nx = array.shape
    gshape = (nx, ny, nz)
    ext = block_extent(rank, split_dims(gshape, size), gshape)
    sl = tuple(slice(s, s + c) for s, c in zip(reversed(ext.start), reversed(ext.count)))
    return Block(np.ascontiguousarray(array[sl]), ext.start, gshape, ext.owned_lo, ext.owned_hi,
                 tuple(map(float, origin)), tuple(map(float, spacing)),
                 {k: np.ascontiguousarray(v[sl]) for k, v in (fields or {}).items()})


def block_from_local(local: np.ndarray, start: tuple[int, int, int], global_shape: tuple[int, int, int],
                     mpi_comm, origin=(0.0, 0.0, 0.0), spacing=(1.0, 1.0, 1.0)) -> Block:
    """A Block from a simulation's own decomposition, ghost layers filled by halo exchange.

    local:        [nz, ny, nx] samples this rank owns in the simulation (no ghosts);
                  together the ranks' arrays tile the global grid without overlap.
    start:        global index (x, y, z) of ``local[0, 0, 0]``.
    global_shape: (nx, ny, nz) of the whole grid.

    Every rank must call this (it exchanges with its face neighbours). A rank owns the
    cells whose lower corner sample it holds; it receives the samples it is missing on
    the upper side (to close its cells) and one more layer on each side for gradients.
    The ranks' sample boxes are checked first (:func:`decompose`): a gap, an overlap, a
    non-Cartesian layout or a different ``global_shape`` is an InputError on every rank.
    """

    local = np.ascontiguousarray(local)
    nz, ny, nx = local.shape
    count = (nx, ny, nz)
    gx = tuple(int(g) for g in global_shape)
    hi_full = [s + c for s, c in zip(start, count)]
    owned_lo = tuple(int(s) for s in start)
    owned_hi = tuple(min(h, g - 1) for h, g in zip(hi_full, gx))
    g_lo = [GHOST if s > 0 else 0 for s in start]
    g_hi = [min(GHOST + 1, g - h) for h, g in zip(hi_full, gx)]   # close the cells, then ghost
    g_hi = [max(v, 0) for v in g_hi]
    new_start = tuple(s - gl for s, gl in zip(start, g_lo))
    new_count = [c + gl + gh for c, gl, gh in zip(count, g_lo, g_hi)]
    # gather the neighbours' boxes: everyone sends the boxes others need from it, via Alltoallv
    # on the global index space (simple and general: works for any tiling, not only grids).
    boxes = mpi_comm.allgather((tuple(start), count, tuple(new_start), tuple(new_count), gx))
    decompose([b[0] for b in boxes], [np.add(b[0], b[1]) for b in boxes], [b[4] for b in boxes], unit="samples")
    data = np.zeros(tuple(reversed(new_count)), dtype=local.dtype)
    data[g_lo[2]:g_lo[2] + nz, g_lo[1]:g_lo[1] + ny, g_lo[0]:g_lo[0] + nx] = local     # own samples
    me = mpi_comm.Get_rank()
    send = []
    for r, (_, _, ns, nc, _) in enumerate(boxes):
        lo = [max(a, b) for a, b in zip(ns, start)]
        hi = [min(a + c, b + d) for a, b, c, d in zip(ns, start, nc, count)]
        if r == me or any(h <= l for l, h in zip(lo, hi)):
            send.append(None)
            continue
        sl = tuple(slice(l - s, h - s) for l, h, s in zip(reversed(lo), reversed(hi), reversed(start)))
        send.append((lo, hi, np.ascontiguousarray(local[sl])))
    recv = mpi_comm.alltoall(send)
    for item in recv:
        if item is None:
            continue
        lo, hi, arr = item
        sl = tuple(slice(l - s, h - s) for l, h, s in zip(reversed(lo), reversed(hi), reversed(new_start)))
        data[sl] = arr
    return Block(data, new_start, gx, owned_lo, owned_hi, tuple(map(float, origin)), tuple(map(float, spacing)))
