"""block_from_local on a simulation's own split (slabs along z, uneven): the blocks equal
slices of the global array, ghosts included, and their owned cells tile the grid."""
import numpy as np
from mpi4py import MPI

from insitu.input.decomposition import block_from_local

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
nx, ny, nz = 7, 6, 11
g = np.random.default_rng(3).random((nz, ny, nx))
cuts = np.linspace(0, nz, size + 1).round().astype(int)        # the simulation's sample split
z0, z1 = cuts[rank], cuts[rank + 1]
b = block_from_local(g[z0:z1], (0, 0, z0), (nx, ny, nz), comm, spacing=(1, 1, 0.5))
s, (cx, cy, cz) = b.start, b.shape_xyz
np.testing.assert_array_equal(b.data, g[s[2]:s[2] + cz, s[1]:s[1] + cy, s[0]:s[0] + cx])
lo, hi = b.owned_lo, b.owned_hi
assert s[2] <= lo[2] - (1 if lo[2] > 0 else 0) and s[2] + cz - 1 >= min(hi[2] + 1, nz - 1), (s, b.shape_xyz, lo, hi)
owned = np.zeros(nz - 1, int)
for l, h in comm.allgather((lo[2], hi[2])):
    owned[l:h] += 1
assert (owned == 1).all(), owned
assert lo[:2] == (0, 0) and hi[:2] == (nx - 1, ny - 1)
print(f"rank {rank}: ok")
