"""Parallel ``write_ply`` against the gathered file: run as ``mpiexec -n P python ply_worker.py DIR``.

Every rank writes its shard into one model.ply at its offset; rank 0 also merges the shards
(gather_gaussians) and writes them with the one-process writer; the two files must be byte
for byte the same. Also: several 64 MiB-style chunks per rank (the chunk size made tiny),
rank 0's memory while rank 1 holds a large shard, model.glb alone gathered on rank 0, failures on every rank. Prints
``OK rank r of P``; exits non-zero on a mismatch.
"""
import sys
import tracemalloc
from pathlib import Path

import torch

import insitu.output.ply as ply
from insitu.config import OutputConfig
from insitu.errors import RankFailure
from insitu.output.export import StepWriter
from insitu.output.gltf import read_glb
from insitu.output.ply import read_ply, write_ply
from insitu.parallel.comm import init_comm, shutdown
from insitu.surface.gaussians import gather_gaussians
from insitu.surface.gaussians import Gaussians


def shard(rank, n, degree):
    g = torch.Generator().manual_seed(100 + rank)
    r = lambda *s: torch.randn(*s, generator=g)        # noqa: E731
    k = (degree + 1) ** 2
    return Gaussians(r(n, 3), r(n, 3), r(n, 4), r(n), r(n, 1, 3), r(n, k - 1, 3))


def fail(message):
    from mpi4py import MPI

    print(f"FAIL {message}", flush=True)
    MPI.COMM_WORLD.Abort(1)             # the other ranks may be waiting in a collective


def main(out: Path):
    comm = init_comm(device="cpu", timeout_s=60)
    P, rank = comm.size, comm.rank
    cases = [(0, [7 + 3 * q for q in range(P)]), (3, [0] + [5] * (P - 1)), (1, [0] * P)]  # empty shards too
    for chunk in (1 << 26, 200):                          # one chunk per rank; many (offsets advance)
        ply._PLY_CHUNK_BYTES = chunk
        for degree, sizes in cases:
            name = f"d{degree}_c{chunk}"
            mine = shard(rank, sizes[rank], degree)
            path = write_ply(out / f"{name}.ply", mine, comm=comm)
            merged = gather_gaussians(mine, comm.mpi)
            if rank == 0:
                ref = write_ply(out / f"{name}_gathered.ply", merged)
                if path.read_bytes() != ref.read_bytes():
                    fail(f"{name}: parallel file differs from the gathered one")
                back = read_ply(path)
                if len(back) != sum(sizes) or not all(torch.equal(getattr(back, k), getattr(merged, k))
                                                      for k in merged.names()):
                    fail(f"{name}: read back differs")
            comm.mpi.Barrier()
    ply._PLY_CHUNK_BYTES = 1 << 26

    # rank 0 holds 10 Gaussians, the others 20000 each (4.7 MB of records each): rank 0's
    # allocations while writing stay far below the others' shards
    big = shard(rank, 10 if rank == 0 else 20000, 3)
    tracemalloc.start()
    write_ply(out / "big.ply", big, comm=comm)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    size = (out / "big.ply").stat().st_size
    if rank == 0 and peak > 100_000:
        fail(f"rank 0 allocated {peak} bytes writing a {size}-byte file from a 10-Gaussian shard")

    # StepWriter.write_model: into the step's temporary folder, which write() on rank 0 renames; the same bytes
    writer = StepWriter(out / "run")
    p = writer.write_model(7, big, comm)
    if p.parent.name.startswith("step_") or p.read_bytes() != (out / "big.ply").read_bytes():
        fail(f"write_model wrote {p}")
    comm.mpi.Barrier()
    if rank == 0:
        writer.write(7, None, [], {"psnr": 1.0})
    comm.mpi.Barrier()
    final = out / "run" / "step_000007" / "model.ply"
    if not final.is_file() or final.read_bytes() != (out / "big.ply").read_bytes() or p.exists():
        fail(f"write() did not move {p} to {final}")

    # model.glb alone (output.glb; neither model.ply nor model.spz): every shard gathered on rank 0, in rank order
    writer = StepWriter(out / "glb", output=OutputConfig(ply=False, spz=False, glb=True))
    writer.write_model(8, big, comm)
    merged = gather_gaussians(big, comm.mpi)
    if rank == 0:
        writer.write(8, None, [], {"psnr": 1.0})
        names = sorted(p.name for p in (out / "glb" / "step_000008").iterdir())
        back = read_glb(out / "glb" / "step_000008" / "model.glb").gaussians
        if names != ["metrics.json", "model.glb"] or len(back) != len(merged) \
                or not torch.allclose(back.means, merged.means, atol=1e-5):
            fail(f"model.glb of the gathered shards: {names}, {len(back)} of {len(merged)} Gaussians")
    comm.mpi.Barrier()

    # failures: on every rank, the target untouched, no temporary file left
    before = (out / "big.ply").read_bytes()
    for case, args in [("no folder", (out / "missing" / "m.ply", big)),
                       ("bad shard", (out / "big.ply", shard(rank, 3, 0) if rank == P - 1 else big)),
                       ("degrees", (out / "big.ply", shard(rank, 3, rank % 2)))]:
        if case == "bad shard" and rank == P - 1:
            args[1].quats = args[1].quats[:, :3]
        try:
            write_ply(*args, comm=comm)
            fail(f"{case}: no error")
        except RankFailure as e:
            ok = (case == "no folder" and "phase 'model.ply: create' failed on rank 0" in str(e)) or \
                 (case == "bad shard" and f"failed on rank {P - 1}" in str(e) and "quats" in str(e))
            if not ok:
                fail(f"{case}: {e}")
        except ValueError as e:
            if case != "degrees" or "different SH degrees" not in str(e):
                fail(f"{case}: {e}")
    comm.mpi.Barrier()
    leftovers = [p.name for p in out.rglob("*.tmp")]
    if leftovers or (out / "big.ply").read_bytes() != before or (out / "missing").exists():
        fail(f"after failures: temporary files {leftovers}, or the target changed")
    shutdown(comm)
    print(f"OK rank {rank} of {P}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
