import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
WORKERS = Path(__file__).resolve().parent / "mpi"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker): runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_mpi(n: int, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpiexec -n n python tests/mpi/script args``; output in ``.stdout`` (stderr merged)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():                       # a system MPI (GPU machines)
        mpiexec = Path(shutil.which("mpiexec") or mpiexec)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run([str(mpiexec), "-n", str(n), sys.executable, str(WORKERS / script), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
