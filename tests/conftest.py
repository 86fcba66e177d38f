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


def shared_volume(name: str) -> Path:
    """``name`` in ``../shared/data`` (the real CT volumes beside the checkout, which CI has too), or the test
    skipped with where it looked: a checkout elsewhere (a worktree, a copy) has no such folder beside it."""
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"needs {path}: the shared CT volumes are not beside this checkout")
    return path


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker): runs on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def mpiexec() -> str:
    """The environment's mpiexec (the one beside Python), else the system's (GPU machines)."""
    exe = Path(sys.executable).parent / "mpiexec"
    if not exe.exists():
        exe = Path(shutil.which("mpiexec") or exe)
    return str(exe)


def subprocess_env(threads: int = 1) -> dict:
    """The environment for a child process of a test: the repository first on ``PYTHONPATH``
    (what is already there kept: on the GPU machine, gsplat's folder), ``threads`` OpenMP threads,
    and Open MPI allowed to run as root."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads),
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run_mpi(n: int, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpiexec -n n python tests/mpi/script args``; output in ``.stdout`` (stderr merged)."""
    return subprocess.run([mpiexec(), "-n", str(n), sys.executable, str(WORKERS / script), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(),
                          timeout=timeout, cwd=ROOT)


def plyfile_gaussians(path):
    """A 3DGS ``model.ply`` read with plyfile, the reference PLY reader (an oracle for ``read_ply``):
    the Gaussians in the reference layout's meaning (f_rest_j = shN[:, j % (K - 1), j // (K - 1)])."""
    import numpy as np
    import torch
    from plyfile import PlyData

    from insitu.surface.gaussians import Gaussians

    v = PlyData.read(str(path))["vertex"]
    names = [p.name for p in v.properties]
    def col(*keys):
        return torch.from_numpy(np.stack([np.asarray(v[k], dtype=np.float32) for k in keys], axis=1))

    n_rest = sum(k.startswith("f_rest_") for k in names)
    k1 = n_rest // 3
    n = v.count
    shn = col(*[f"f_rest_{j}" for j in range(n_rest)]) if n_rest else torch.zeros(n, 0)
    return Gaussians(means=col("x", "y", "z"), quats=col("rot_0", "rot_1", "rot_2", "rot_3"),
                     log_scales=col("scale_0", "scale_1", "scale_2"), opacity_logits=col("opacity")[:, 0],
                     sh0=col("f_dc_0", "f_dc_1", "f_dc_2")[:, None, :],
                     shN=shn.reshape(n, 3, k1).transpose(1, 2).contiguous())
