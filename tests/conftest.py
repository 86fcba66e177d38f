import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
WORKERS = Path(__file__).resolve().parent / "mpi"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# the command line's settings for a tiny step (one process on a CPU: a few seconds)
TINY = ["--views", "8", "--resolution", "16", "--iterations", "2", "--budget", "100", "--quiet",
        "--set", "views.supersample=1"]


def pytest_configure(config):
    """One torch thread in this process (children get one each too: :func:`subprocess_env`). The steps here are
    small, and with a second OpenMP thread on a 2-core machine, next to the pipeline's own background threads
    (kernels compiled ahead, the metrics' import) and to other processes, every op waits for the thread that is
    not running: the suite is several times slower."""
    import torch

    torch.set_num_threads(1)


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


# ------------------------------------------------------------------------------------------ fields and settings

def sphere_field(n: int = 16, centre: tuple[float, float, float] | None = None, dtype=np.float32) -> np.ndarray:
    """[n, n, n] distance to ``centre`` (default the grid's centre) in cells: iso r is a sphere of radius r.
    Computed in float64 for a float64 field, else in float32 (then cast to ``dtype``)."""
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    z, y, x = np.mgrid[0:n, 0:n, 0:n].astype(work)
    cx, cy, cz = centre if centre is not None else ((n - 1) / 2,) * 3
    return np.sqrt((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2).astype(dtype, copy=False)


def uint8_ball(n: int = 12) -> np.ndarray:
    """A uint8 ball: 250 in the middle, falling off by 20 a cell with the distance from the centre."""
    return np.clip(250 - 20 * sphere_field(n), 0, 255).astype(np.uint8)


def followed_iterations(metrics: dict, warm: int, cold: int) -> int:
    """A warm step's iterations by series.follow_iterations, from its metrics: ``warm`` (series.warm_iterations)
    and the share of its start that was new seeds of the way on to ``cold`` (train.iterations)."""
    return warm + round(metrics["gaussians_new"] / metrics["gaussians_initial"] * (cold - warm))


def tiny_config(*, iso: float = 5.0, views: int = 10, resolution: int = 32, held_out: int = 2, budget: int = 200,
                images: int = 2, densify: dict | None = None, **train):
    """A small step for one CPU process: ``views`` orbit views of ``resolution``^2 pixels, one ray each,
    ``held_out`` views of each held-out set, ``budget`` seeds, ``images`` held-out images written; training
    (``train``: TrainConfig fields, 10 iterations unless given) one view per step on the torch rasterizer,
    quiet, without densification or opacity resets unless asked for (``densify``: DensifyConfig fields, e.g.
    ``densify=dict(start=2, every=4, stop=9)``); a series warm-starts (``series.warm_start``, ``follow_iterations``: off
    by default), as the tests of warm starts need."""
    from insitu.config import Config, DensifyConfig

    cfg = Config()
    cfg.input.iso = [iso]
    cfg.views.count, cfg.views.resolution, cfg.views.supersample, cfg.views.held_out = views, resolution, 1, held_out
    cfg.seeds.budget = budget
    cfg.output.images = images
    cfg.run.backend, cfg.run.progress = "torch", False
    cfg.series.warm_start, cfg.series.follow_iterations = True, True
    t = cfg.train
    t.iterations, t.batch = 10, 1
    t.densify = DensifyConfig(**{"start": 10**6, "reset_every": 0, **(densify or {})})
    for k, v in train.items():
        if not hasattr(t, k) or k == "densify":
            raise TypeError(f"tiny_config: the train section has no setting {k!r}")
        setattr(t, k, v)
    return cfg


def ticking_clock(seconds: float):
    """Collaborators of a step (:class:`insitu.step.pipeline.Collaborators`) whose clock is fake: it stands still
    but for ``seconds`` added by every optimiser step (a trainer that ticks it), so that a time budget ends the
    step at an iteration known beforehand, however long the iterations take here."""
    from insitu.step.pipeline import Collaborators
    from insitu.training.trainer import Trainer

    now = [0.0]

    class Ticking(Trainer):
        def step(self, *args, **kwargs):
            now[0] += seconds
            return super().step(*args, **kwargs)

    return Collaborators(trainer=Ticking, clock=lambda: now[0])


@pytest.fixture(scope="module")
def comm():
    """A one-process communicator on the CPU (gloo), for the module's tests."""
    from insitu.parallel.comm import init_comm, shutdown

    c = init_comm(device="cpu")
    yield c
    shutdown(c)


@pytest.fixture(scope="session")
def bonsai():
    """The bonsai (256^3 uint8, iso 40) from ../shared/data, box-filtered to 32^3; skipped where absent."""
    from insitu.volume import downsample, read_raw

    volume = downsample(read_raw(shared_volume("bonsai_256x256x256_uint8.raw")), 8)
    assert volume.shape == (32, 32, 32)
    return volume


def read_all(path: Path, var: str) -> tuple[list[int], list[float], np.ndarray]:
    """Every step of a BP file the mini-apps wrote: step numbers, times, ``var`` as [n_steps, nz, ny, nx]."""
    import adios2

    with adios2.FileReader(str(path)) as f:
        n = f.num_steps()
        steps = np.atleast_1d(f.read("step", step_selection=[0, n])).tolist()
        times = np.atleast_1d(f.read("time", step_selection=[0, n])).tolist()
        data = f.read(var, step_selection=[0, n])
    return steps, times, data.reshape(n, -1, *data.shape[1:])


def bp_with_steps(path: Path, numbers: list) -> Path:
    """A BP file whose ADIOS steps carry these ``step`` values (any type) and a ball field."""
    import adios2

    with adios2.Stream(str(path), "w") as s:
        for n in numbers:
            s.begin_step()
            s.write("U", sphere_field(12), [12, 12, 12], [0, 0, 0], [12, 12, 12])
            s.write("step", n)
            s.end_step()
    return path


# ------------------------------------------------------------------------------------------ child processes

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


def arg(a) -> str | bytes:
    """A command-line argument: bytes as they are (names that are not UTF-8), anything else as text."""
    return a if isinstance(a, bytes) else str(a)


def launch(cmd: list, *, ranks: int = 0, mpmd: list | None = None, prefix: list | None = None, cwd=ROOT,
           env: dict | None = None, timeout: float = 120, merge: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` and wait for it: under ``mpiexec -n ranks`` when ``ranks`` > 0; with ``mpmd`` (a second
    command) as ``mpiexec -n 1 CMD : -n 1 MPMD``; ``prefix`` (a command that runs it) in front. ``env``: the whole
    environment (default :func:`subprocess_env`). Output in ``.stdout`` and ``.stderr`` (``merge``: stderr in
    ``.stdout``). Past ``timeout`` seconds the whole job (mpiexec and every rank) is killed and the test fails
    with the output so far: a hang is a failure, never a stuck suite."""
    cmd = [arg(c) for c in cmd]
    if mpmd is not None:
        cmd = [mpiexec(), "-n", "1", *cmd, ":", "-n", "1", *map(arg, mpmd)]
    elif ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    cmd = [*map(arg, prefix or []), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            text=True, errors="replace", env=subprocess_env() if env is None else env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not end within {timeout:g} s:\n{out}\n{err or ''}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_mpi(n: int, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpiexec -n n python tests/mpi/script args``; output in ``.stdout`` (stderr merged)."""
    return launch([sys.executable, WORKERS / script, *args], ranks=n, timeout=timeout, merge=True)


def insitu(*args, cwd: Path, ranks: int = 0, timeout: float = 120, mpmd: list | None = None,
           prefix: list | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m insitu ARGS`` (under ``mpiexec -n ranks``; ``mpmd``: a second program's ARGS for rank 1;
    ``prefix``: a command that runs it; ``env``: variables added to :func:`subprocess_env`'s). One process on
    its own is forked from :class:`Forkserver`'s, which has imported the libraries it would import first."""
    python = [sys.executable, "-m", "insitu"]
    env = {**subprocess_env(), **(env or {})}
    if not ranks and mpmd is None and prefix is None:
        return Forkserver.run(list(args), cwd=cwd, env=env, timeout=timeout)
    return launch([*python, *args], ranks=ranks, mpmd=None if mpmd is None else [*python, *mpmd], prefix=prefix,
                  cwd=cwd, env=env, timeout=timeout)


class Forkserver:
    """A Python that has imported what every ``python -m insitu`` imports first (torch, torchmetrics, scipy:
    about 2.5 s of CPU, most of a small run's), and forks a fresh process per run. The child takes the
    run's folder, environment and output files, a session of its own and /dev/null as stdin, then runs the
    ``insitu`` module as ``python -m`` does and exits as that would: code, output and traceback are the
    command's. Nothing else is imported before the fork (no MPI, no thread), and no run sees another's state."""

    CODE = r"""
import gc, json, os, runpy, sys
import numpy, PIL.Image, scipy.spatial, torch, torchmetrics.functional, yaml
assert not torch.cuda.is_initialized()     # a child could not use CUDA initialised before the fork
gc.freeze()             # what is imported stays: no child collects it (or copies its pages to look)
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.chdir(run["cwd"])
        os.environ.clear()
        os.environ.update(run["env"])
        sys.path[1:1] = [p for p in run["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(run[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.argv = ["insitu", *run["args"]]
        runpy.run_module("insitu", run_name="__main__", alter_sys=True)
        sys.exit(0)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
    proc: subprocess.Popen | None = None
    pending = b""

    @classmethod
    def line(cls, timeout: float) -> str | None:
        """The server's next line, or None after ``timeout`` seconds."""
        import select

        fd, deadline = cls.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in cls.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the fork server ended (exit {cls.proc.wait()})")
            cls.pending += chunk
        line, cls.pending = cls.pending.split(b"\n", 1)
        return line.decode()

    @classmethod
    def run(cls, args: list, *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, "-c", cls.CODE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=subprocess_env(), cwd=ROOT)
            cls.pending = b""
        with tempfile.TemporaryDirectory() as tmp:
            files = {name: os.path.join(tmp, name) for name in ("stdout", "stderr")}
            request = {"args": [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args],
                       "cwd": str(cwd), "env": env, **files}
            cls.proc.stdin.write((json.dumps(request) + "\n").encode())
            cls.proc.stdin.flush()
            pid = cls.line(120)
            if pid is None:
                raise RuntimeError("the fork server did not start the run within 120 s")
            pid = int(pid)
            code = cls.line(timeout)
            if code is None:
                os.killpg(pid, signal.SIGKILL)
                cls.line(60)
            # (errors="replace": a library may echo a corrupt file's bytes, as ADIOS2 does)
            out, err = (Path(files[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        if code is None:
            pytest.fail(f"insitu {' '.join(map(str, args))} did not end within {timeout:g} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(["insitu", *args], int(code), out, err)

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            cls.proc.wait(timeout=60)


def pytest_unconfigure(config):
    Forkserver.stop()


def one_error(r: subprocess.CompletedProcess) -> str:
    """The run exited 2 with one ``insitu: error:`` line and no traceback; returns the line."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("insitu: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------ models

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
