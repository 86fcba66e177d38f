"""Shared by the worker scripts: report a failed check and end the whole job."""
import time

from mpi4py import MPI


def fail(text: str) -> None:
    """Print ``FAIL rank r: text`` and abort the job (the other ranks may wait in a collective)."""
    print(f"FAIL rank {MPI.COMM_WORLD.Get_rank()}: {text}", flush=True)
    time.sleep(0.5)                 # let mpiexec forward the report before the abort
    MPI.COMM_WORLD.Abort(1)
