"""What benchmark cases share: launching ``insitu``, and reading its metrics files into rows."""
from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.schema import CASE, NUMBER

# metrics.json key -> row field, where the names differ
_RENAMED = {"total_seconds": "seconds"}
_FIGURES = tuple(k for k, (types, _) in CASE.items() if types in (NUMBER, int) and k not in ("step", "ranks"))


def insitu_argv(*args: str) -> list[str]:
    """The argv of ``python -m insitu ARGS`` with this interpreter."""
    return [sys.executable, "-m", "insitu", *map(str, args)]


def run_logged(argv: list[str], log: Path, *, timeout: float | None = None, env: dict | None = None,
               cwd: Path | None = None) -> int:
    """Run ``argv``, its stdout and stderr into ``log``; its exit status, 124 when it ran past ``timeout``.

    ``env`` adds to (does not replace) this process's environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write("$ " + " ".join(map(str, argv)) + "\n")
        f.flush()
        try:
            return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nbenchmarks: killed after {timeout} s\n")
            return 124


def tail(log: Path, lines: int = 1) -> str:
    """The last ``lines`` non-empty lines of ``log``, joined by ' | ' (for a row's ``error``)."""
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def _number(v: str):
    """A metrics.csv cell as an int or a float where it is one, else the text."""
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def metrics_row(metrics: dict, name: str, **fields) -> dict:
    """A row from an ``insitu`` metrics.json (or a metrics.csv row): the schema's figures it holds,
    ``seconds`` from ``total_seconds``, ``ranks`` and ``device``; then ``fields`` (which win)."""
    row: dict = {"name": name}
    for key, value in metrics.items():
        field = _RENAMED.get(key, key)
        if value in (None, "") or field not in _FIGURES:
            continue
        value = float(value) if isinstance(value, str) else value
        row[field] = int(value) if CASE[field][0] is int else float(value)
    if metrics.get("ranks") not in (None, ""):
        row["ranks"] = int(float(metrics["ranks"]))
    if metrics.get("device"):
        row["device"] = str(metrics["device"])
    if metrics.get("step") not in (None, "") and "step" not in fields:
        row["step"] = int(float(metrics["step"]))
    return row | fields


def csv_rows(path: Path) -> list[dict]:
    """The rows of an ``insitu`` metrics.csv, numbers as float, empty cells as None."""
    with path.open(newline="") as f:
        return [{k: (None if v == "" else _number(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def synthetic_volume(path: Path, n: int = 16) -> tuple[Path, float]:
    """A ``n``^3 float32 field of a ball (1 inside, falling to 0 outside) saved as ``path`` (.npy); its iso."""
    import numpy as np

    x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    r = np.sqrt(x[:, None, None] ** 2 + x[None, :, None] ** 2 + x[None, None, :] ** 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.clip(1.5 - 2.0 * r, 0.0, 1.0).astype(np.float32))
    return path, 0.5


def kernel_cache(device: str, folder: Path | None = None) -> tuple[dict, str | None]:
    """The environment for a process's Triton kernel cache, and whether that cache is 'cold' or 'warm'.

    ``folder``: the cache to use (``TRITON_CACHE_DIR``); default the one the process would use anyway
    ($TRITON_CACHE_DIR, else ~/.triton/cache). Cold: the folder is missing or empty, as on a freshly started
    machine; warm: an earlier process left kernels in it. On the CPU nothing compiles: ({}, None)."""
    if device != "cuda":
        return {}, None
    folder = folder or Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    state = "warm" if folder.is_dir() and any(folder.iterdir()) else "cold"
    return {"TRITON_CACHE_DIR": str(folder)}, state


def read_metrics(out: Path, step: int = 0) -> dict | None:
    """``OUT/step_NNNNNN/metrics.json`` of an ``insitu run``, or None when it wrote none."""
    path = out / f"step_{step:06d}" / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else None


def mpi_argv(ranks: int, argv: list[str]) -> list[str]:
    """``argv`` on ``ranks`` MPI ranks: ``$MPIRUN -n RANKS ARGV``; ``argv`` itself for one rank.

    $MPIRUN defaults to Open MPI's mpirun with the GPU machine's flags (root allowed, no binding, the
    environment that keeps NCCL off NVLink multicast passed on) where mpirun is Open MPI's, else the mpiexec
    beside Python (a virtual environment's), else the one on ``PATH``."""
    if ranks == 1:
        return list(argv)
    launcher = os.environ.get("MPIRUN")
    if not launcher:
        version = ""
        if shutil.which("mpirun"):
            version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
        if "Open MPI" in version:
            launcher = ("mpirun --allow-run-as-root --bind-to none -x PYTHONPATH -x PYTHONUNBUFFERED "
                        "-x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS")
        else:
            beside = Path(sys.executable).parent / "mpiexec"
            launcher = shlex.quote(str(beside)) if beside.exists() else "mpiexec"
    return [*shlex.split(launcher), "-n", str(ranks), *argv]


def evict_page_cache(*folders: str | Path) -> dict:
    """Drop every file under Python's library folders, ``PYTHONPATH``'s and ``folders`` from the page cache
    (``posix_fadvise(DONTNEED)``; files no process maps), so that the next process reads its libraries from
    the disk as a first process on a freshly started machine does. The files and GB asked, the seconds."""
    import site
    import sysconfig
    import time

    t = time.perf_counter()
    roots = {sysconfig.get_paths()["stdlib"], *site.getsitepackages(), site.getusersitepackages(),
             *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
             *(str(Path(f).resolve()) for f in folders)}
    files = size = 0
    for root in sorted(r for r in roots if os.path.isdir(r)):
        for folder, _, names in os.walk(root):
            for name in names:
                try:
                    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    size += os.fstat(fd).st_size
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    files += 1
                finally:
                    os.close(fd)
    return {"files": files, "gb": round(size / 2**30, 2), "seconds": round(time.perf_counter() - t, 2)}
