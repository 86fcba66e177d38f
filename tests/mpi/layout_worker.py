"""Reader process for tests/test_bp_layouts.py: every rank reads its block of the first step of
each file in SPEC.json ({name: {"path", "var"?, "nonfinite"?}}) with BPSource and the world
communicator, and saves it as NAME.RANK.npy.

    mpiexec -n P python layout_worker.py SPEC.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # adios2 imports torch when installed: not needed
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from insitu.input.sources import BPSource  # noqa: E402


def main() -> int:
    comm = MPI.COMM_WORLD
    for name, case in json.loads(Path(sys.argv[1]).read_text()).items():
        with BPSource(case["path"], case.get("var", "U"), rank=comm.rank, size=comm.size, comm=comm,
                      nonfinite=case.get("nonfinite", "error")) as src:
            step = next(iter(src))
        np.save(f"{name}.{comm.rank}.npy", step.block.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
