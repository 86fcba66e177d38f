"""The step's Triton kernels compiled ahead, on background threads, while the run reads and seeds.

A process compiles each Triton kernel on its first launch, and a first process on a machine (an
empty kernel cache: a new node, container or job allocation without a shared home) would pay for
every kernel of the step one after the other, in the middle of its phases. :func:`compile_ahead`
starts, from the run's start (the commands once their checks pass, the Adaptor once it is set up,
and every step at its start: a no-op for what has started), one background thread per group of
kernels: each runs the step's own functions (the ray caster; the image loss forward and backward;
the SH colours of ``model.ply``'s figures and one Adam update) once on a tiny input of the step's
shapes and flags, which compiles exactly the specialisations the step will launch (Triton
specialises on sizes' divisibility and on compile-time flags) and keeps them in the kernels'
in-process caches. Triton releases Python's lock while it optimises and assembles, so the groups
compile side by side and beside seeding. The step waits for a group just before its first use (:meth:`Ahead.wait`); a
group that fails is ignored there, and the kernel then compiles at its first launch as before.

A group's key is the shapes and flags that set its specialisations (:class:`KernelShapes`, :func:`kernel_groups`).
Before a step has data (at a run's start, and at the step's own start, before it seeds) they are the shapes a
step of the configuration will have (:meth:`KernelShapes.planned`); before training the step asks again with
those of the objects it built (:meth:`KernelShapes.of`), which starts nothing when they are the planned ones.

The groups needed only once training starts (:data:`IN_CHILD`: the loss's and the colours' and
Adam's, seconds after the ray caster) compile first in a child process (:meth:`Compiler.spawn`), on
its own interpreter, into the kernel cache on disk; their threads here wait for it and then load what
it compiled. In a first process on a machine they took 15–19 s beside the ray caster's compilation,
the seeding and the metrics' import, all competing for this process's lock, and training waited 4–5 s
for them. A child that fails or cannot start leaves its groups to compile here.

With a warm cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``) each group loads its
kernels from disk in milliseconds; on CPUs nothing starts.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from insitu.config import Config, from_dict
from insitu.groundtruth.caster import raycast_views
from insitu.groundtruth.views import orbit_views
from insitu.render.compositing import band_rows
from insitu.render.shading import MAX_SH_DEGREE, deferred_sh_gradients, sh_colors
from insitu.step.layouts import Layout, training_ranks
from insitu.step.seeding import model_sh_degree
from insitu.surface.gaussians import Gaussians
from insitu.training.appearance import refits_ply, standard_degree
from insitu.training.bandloss import HALF, KERNEL
from insitu.training.ssim import ssim_l1_loss, ssim_map
from insitu.training.trainer import Trainer
from insitu.volume import whole_block

if TYPE_CHECKING:
    from insitu.groundtruth.scene import Scene

try:                                    # Triton ships with CUDA builds of torch
    import triton
except ImportError:                     # pragma: no cover - CPU-only installs
    triton = None

_READY = threading.Lock()

# the groups a child process compiles first (Compiler.spawn): those first used once training starts
IN_CHILD = ("loss", "colours and adam")


@dataclass(frozen=True)
class KernelShapes:
    """The sizes that set the specialisations of a step's kernels (Triton specialises on sizes' divisibility),
    as the step's objects have them (:meth:`of`), or as a step of a configuration will (:meth:`planned`).

    width, height: the views' (:class:`insitu.groundtruth.views.Views`): the ray caster's and the loss's images.
    rows:          this rank's band of a training image's rows (the training scene's, as the layout prepared it).
    band_ranks:    the ranks a training render is composited over (the layout's ``train_comm``; on one, the
                   loss's SSIM is fused with its pixel term).
    sh_degree:     the SH degree of the model the step trains (its seeds': :func:`insitu.step.seeding.model_sh_degree`).
    """

    width: int
    height: int
    rows: tuple[int, int]
    band_ranks: int
    sh_degree: int

    @classmethod
    def of(cls, scene: Scene, layout: Layout, trainer: Trainer) -> KernelShapes:
        """The shapes of a step's objects: the scene it trains on, its layout and its trainer."""
        views = scene.views
        return cls(views.width, views.height, tuple(scene.rows), layout.train_comm.size, trainer.sh_degree_max)

    @classmethod
    def planned(cls, cfg: Config, train_size: int = 1, train_rank: int = 0) -> KernelShapes:
        """The shapes a step of ``cfg`` will have, before it has any object (a run's start, a step's before it
        seeds): ``train_size`` ranks composite a training render, this one is ``train_rank`` among them
        (:func:`insitu.step.layouts.training_ranks`). ``tests/test_compilation.py`` checks that a step's
        objects have them."""
        res = cfg.views.resolution
        return cls(res, res, band_rows(res, train_size)[train_rank], train_size, model_sh_degree(cfg))


@dataclass
class Ahead:
    """The groups of kernels being compiled: ``futures[name]`` ends when group ``name`` is compiled."""

    futures: dict[str, Future] = field(default_factory=dict)

    def wait(self, *names: str) -> None:
        """Wait for the groups ``names`` (all without names); their failures are ignored."""
        for name in names or tuple(self.futures):
            future = self.futures.get(name)
            if future is not None:
                future.exception()


class Compiler:
    """What a process compiles ahead: each group of kernels started once for its shapes and flags (its key), on
    a thread of its own; the child compiler processes; and, when the process ends, the children ended and the
    threads waited for (:meth:`wait_at_exit`). The process's own is :data:`COMPILER`."""

    def __init__(self) -> None:
        self.started: dict[tuple, Future] = {}      # by group key
        self.running: list[Future] = []             # every group started: waited for when the process ends
        self.children: list[subprocess.Popen] = []  # the compiler processes started: ended when this process ends
        self.killed: list[subprocess.Popen] = []    # those ended so (their groups then compile nowhere)
        self._lock = threading.Lock()               # compile_ahead's
        self._exit = threading.Lock()               # the lists' and the exit hook's
        self._hooked = False

    def compile_ahead(self, cfg: Config, comm, shapes: KernelShapes | None = None) -> Ahead:
        """Start compiling the Triton kernels of a step of ``cfg`` on this rank of ``comm`` (its device) for
        ``shapes`` (default: :meth:`KernelShapes.planned` for the training's ranks,
        :func:`insitu.step.layouts.training_ranks`); returns at once, and may be called before the step's data
        comes (at a run's start).

        Nothing starts off CUDA, without Triton, with ``run.compile_ahead`` off, or for a group
        this compiler has started before with the same key.
        """
        device = comm.device
        if shapes is None:
            shapes = KernelShapes.planned(cfg, *training_ranks(cfg, comm))
        if device.type != "cuda" or triton is None or not cfg.run.compile_ahead:
            return Ahead()
        ahead = Ahead()
        with self._lock:
            groups = kernel_groups(cfg, shapes)
            fresh = [name for name, (key, _) in groups.items() if key not in self.started]
            child = self.spawn(cfg, [n for n in fresh if n in IN_CHILD], device, shapes)
            for name, (key, job) in groups.items():
                if key not in self.started:
                    after = self.waiter(child) if child and name in IN_CHILD else None
                    self.started[key] = self.start(name, job, device, after=after)
                ahead.futures[name] = self.started[key]
        return ahead

    def start(self, name: str, job: Callable[[torch.device], None], device: torch.device, *,
              after: Callable[[], bool] | None = None) -> Future:
        """Run ``job(device)`` on a background thread (daemon) named for ``name``, once ``after()`` (when
        given: a child compiler's end, :meth:`waiter`) returns, unless it returns False; its future. A
        process that ends while such a thread still compiles waits for it first (:meth:`wait_at_exit`): the
        compiler's own state must not be torn down under a running compilation."""
        future: Future = Future()
        self._kept(self.running, future)

        def run() -> None:
            try:
                if after is not None and not after():   # the process ends: its kernels are not needed
                    future.set_result(None)
                    return
                if device.type == "cuda":
                    _triton_ready()
                    with torch.cuda.device(device):     # the thread's current device is the step's
                        job(device)
                        torch.cuda.synchronize(device)
                else:
                    job(device)
                future.set_result(None)
            except BaseException as e:                  # noqa: BLE001 - the kernel then compiles at its first launch
                future.set_exception(e)

        threading.Thread(target=run, name=f"insitu-compile-{name}", daemon=True).start()
        return future

    def spawn(self, cfg: Config, names: list[str], device: torch.device,
              shapes: KernelShapes) -> subprocess.Popen | None:
        """A child process (this Python with its flags, this ``insitu`` package, this environment: the same
        kernel cache) that runs the groups ``names`` of :func:`kernel_groups` on ``device`` (its own CUDA
        context on the same GPU), filling the kernel cache on disk, then exits (0 when every group ran);
        None when there is nothing to run there, ``run.compile_in_child`` is off, or it cannot start.
        It does not initialise MPI (an MPI rank's environment is passed on), writes nothing to this
        process's output, and ends when this process does however it ends (it reads its spec on its
        standard input, then waits for that pipe to close). None too where this process's program is not
        the Python that ``sys.executable`` names (a simulation that embeds Python)."""
        if not names or not cfg.run.compile_in_child or not _python_is_this_program():
            return None
        try:
            spec = json.dumps({"config": asdict(cfg), "groups": names, "device": str(device),
                               "shapes": asdict(shapes)})
        except (TypeError, ValueError):             # a setting JSON cannot hold: the groups compile here
            return None
        root = str(Path(__file__).resolve().parents[2])
        code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
                "try:\n    import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
                "except ImportError:\n    pass\n"
                "import os\nfrom insitu.step.compilation import child_main\n"
                "try:\n    code = child_main(sys.stdin)\nexcept BaseException:\n    code = 1\n"
                "os._exit(code)")                  # (no interpreter shutdown under the thread that reads stdin)
        try:
            child = subprocess.Popen([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code, root],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     text=True)
        except OSError:
            return None
        try:
            child.stdin.write(spec + "\n")
            child.stdin.flush()                     # kept open: the child ends when it closes
        except OSError:                             # (it died at once)
            child.kill()
            child.wait()
            return None
        self._kept(self.children, child)
        return child

    def waiter(self, child: subprocess.Popen) -> Callable[[], bool]:
        """For :meth:`start`'s ``after``: wait for the compiler process ``child`` to end; False when this
        compiler ended it (it ends itself), else True (its groups then load from the cache what it compiled,
        or compile here what it did not)."""
        def wait() -> bool:
            child.wait()
            if child.stdin is not None:
                child.stdin.close()
            return child not in self.killed
        return wait

    def wait_at_exit(self, seconds: float = 120.0) -> None:
        """End the child compilers, then wait (at most ``seconds`` in all) for the background compilations
        still running."""
        end = time.monotonic() + seconds
        for child in self.children:
            if child.poll() is None:
                self.killed.append(child)
                child.kill()
                try:
                    child.wait(timeout=max(end - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    return
        for future in list(self.running):
            try:
                future.exception(timeout=max(end - time.monotonic(), 0.0))
            except TimeoutError:
                return

    def _kept(self, kept: list, item) -> None:
        """Append ``item`` (a compiling thread's future, or a child compiler) to ``kept``, :attr:`running` or
        :attr:`children`, which :meth:`wait_at_exit` ends or waits for; registered at the first."""
        with self._exit:
            if not self._hooked:
                atexit.register(self.wait_at_exit)
                self._hooked = True
            kept.append(item)


COMPILER = Compiler()                   # this process's
compile_ahead = COMPILER.compile_ahead


def kernel_groups(cfg: Config, shapes: KernelShapes) -> dict[str, tuple[tuple, Callable[[torch.device], None]]]:
    """``{name: (key, job)}``: the step's groups of kernels for its ``shapes`` and the flags ``cfg`` sets;
    ``job(device)`` runs the step's functions once on a tiny input (on any device: off CUDA, their torch code),
    ``key`` is what sets the group's specialisations."""
    tc, refit = cfg.train, refits_ply(cfg)
    ply = _standard_files_degree(cfg, shapes.sh_degree)
    cast = (len(cfg.input.iso), cfg.views.colormap, bool(cfg.input.color_var), cfg.views.supersample)
    return {
        "ray caster": (("ray caster", shapes.width, shapes.height, *cast), partial(_ray_caster, cfg, shapes)),
        "loss": (("loss", shapes.width, shapes.height, shapes.rows, shapes.band_ranks, tc.ssim_weight > 0),
                 partial(_loss, shapes, tc.ssim_weight)),
        # one thread for both: SH training launches the SH kernels from Adam's job too, and two threads
        # that first launch one kernel at once would each build its in-process cache, one of them lost
        "colours and adam": (("colours and adam", tc.color_model, shapes.sh_degree, tc.sh_degree, ply, refit),
                             partial(_colours_and_adam, cfg, shapes.sh_degree, refit)),
    }


def _python_is_this_program() -> bool:
    """Whether ``sys.executable`` is the program this process runs (not so where a simulation embeds Python)."""
    try:
        return os.path.samefile("/proc/self/exe", sys.executable)
    except OSError:                             # no /proc (not Linux): judge by the name
        return bool(re.fullmatch(r"python[0-9.]*(\.exe)?", Path(sys.executable or "").name))


def child_main(stream, *, groups: Callable[..., dict] = kernel_groups) -> int:
    """A compiler process's work (:meth:`Compiler.spawn`): the groups of the spec (JSON) on the first line of
    ``stream``, each on a thread of its own, as :meth:`Compiler.start` runs them (``groups``: the step's,
    :func:`kernel_groups`); 0 when every group ran, else 1. Once that line is read, the rest of ``stream`` is
    waited for on a thread: when it ends (the parent closed it, or ended), so does this process, at once."""
    spec = json.loads(stream.readline())

    def orphaned() -> None:
        stream.read()
        os._exit(1)

    threading.Thread(target=orphaned, name="insitu-compile-parent", daemon=True).start()
    cfg = from_dict(spec["config"])
    device = torch.device(spec["device"])
    shapes = KernelShapes(**{**spec["shapes"], "rows": tuple(spec["shapes"]["rows"])})
    jobs = groups(cfg, shapes)
    futures = [COMPILER.start(name, jobs[name][1], device) for name in spec["groups"]]
    return int(any(f.exception() is not None for f in futures))


def _triton_ready() -> None:
    """Triton's one-time cost in a process, paid on one thread while the others wait instead of on
    every thread at once: the cache key of its own build, a hash of its compiler's library (some
    400 MB: 0.4 s on the GPU machine, 1.2 s on a 2-core host)."""
    with _READY:
        try:
            from triton.runtime.cache import triton_key
        except ImportError:                     # pragma: no cover - another Triton: each thread pays as it comes
            return
        triton_key()                            # (cached for the process)


def _ray_caster(cfg: Config, shapes: KernelShapes, device: torch.device) -> None:
    """One view of a 4^3 block at the step's resolution (its views are square): the step's iso count, colour
    field, colour map and rays per pixel."""
    data = np.linspace(0.0, 1.0, 64, dtype=np.float32).reshape(4, 4, 4)
    var = cfg.input.color_var
    block = whole_block(data, fields={var: data} if var else None)
    views = orbit_views(*block.global_box, 1, shapes.width)
    isos = np.linspace(0.3, 0.7, len(cfg.input.iso)).tolist()
    cast = raycast_views(block, views.viewmats, views.Ks, views.width, views.height, isos, views_per_call=1,
                         color_field=var, color_range=(0.0, 1.0) if var else None, colormap=cfg.views.colormap,
                         supersample=cfg.views.supersample, device=device, value_range=(0.0, 1.0))
    for _ in cast:
        pass


def _loss(shapes: KernelShapes, ssim_weight: float, device: torch.device) -> None:
    """The image loss's SSIM kernels, forward and backward, on this rank's band shape
    (:func:`insitu.training.bandloss.band_loss`: fused with L1 on one rank, the SSIM map of the band and its
    halo on several)."""
    width, height, (lo, hi) = shapes.width, shapes.height, shapes.rows
    if ssim_weight <= 0 or min(width, height) < KERNEL:
        return
    h = hi - lo if shapes.band_ranks == 1 else min(hi + HALF, height) - max(lo - HALF, 0)
    if h < KERNEL:
        return
    x = torch.zeros(1, h, width, 3, device=device, requires_grad=True)
    y = torch.zeros(1, h, width, 3, device=device)
    loss = ssim_l1_loss(x, y, ssim_weight=ssim_weight) if shapes.band_ranks == 1 else ssim_map(x, y).sum()
    loss.backward()


def _adam(cfg: Config, sh_degree: int, device: torch.device) -> None:
    """One update of a one-Gaussian trainer: the step's parameters and learning-rate layout, and
    for SH colours their gradient left factored (:meth:`insitu.training.trainer.Trainer.step`)."""
    k = (sh_degree + 1) ** 2
    z = lambda *shape: torch.zeros(*shape, device=device)    # noqa: E731
    one = Gaussians(means=z(1, 3), log_scales=z(1, 3), quats=torch.tensor([[1.0, 0, 0, 0]], device=device),
                    opacity_logits=z(1), sh0=z(1, 1, 3), shN=z(1, k - 1, 3))
    trainer = Trainer(one, cfg.train, extent=1.0, box=(z(3), z(3) + 1), max_gaussians=1, device=device)
    params = trainer.params
    for name in ("scales", "quats", "opacities"):
        params[name].grad = torch.zeros_like(params[name])
    with deferred_sh_gradients() as sh:
        if cfg.train.color_model == "sh":
            sh_colors(params["means"], params["colors"], z(1, 3) + 1, 0).sum().backward()
        else:
            params["means"].grad = torch.zeros_like(params["means"])
            params["colors"].grad = torch.zeros_like(params["colors"])
    trainer.adam.step(sh)


def _sh_colours(degree: int, train: bool, device: torch.device) -> None:
    """The SH colours of ``model.ply``'s figures (degree ``degree``), and with ``train`` their
    training forward and backward."""
    degree = min(degree, MAX_SH_DEGREE)
    means = torch.zeros(1, 3, device=device, requires_grad=train)
    coeffs = torch.zeros(1, (degree + 1) ** 2, 3, device=device, requires_grad=train)
    campos = torch.ones(1, 3, device=device)
    sh_colors(means.detach(), coeffs.detach(), campos, degree)      # inputs without gradients: the figures'
    if train:
        sh_colors(means, coeffs, campos, degree).sum().backward()


def _standard_files_degree(cfg: Config, sh_degree: int) -> int:
    """The SH degree whose colour kernels the standard files' model uses after a step whose model has SH degree
    ``sh_degree``: a lit model's :func:`insitu.training.appearance.standard_degree`, an SH model's
    ``train.sh_degree``."""
    return standard_degree(cfg, sh_degree) if cfg.train.color_model != "sh" else cfg.train.sh_degree


def _colours_and_adam(cfg: Config, sh_degree: int, refit: bool, device: torch.device, *,
                      sh_colours: Callable[[int, bool, torch.device], None] = _sh_colours,
                      adam: Callable[[Config, int, torch.device], None] = _adam) -> None:
    """The colours' kernels and Adam's of the step's model (``sh_degree``: its trained SH degree), the SH colours
    of a lit model's standard files for their figures (at their degree,
    :func:`insitu.training.appearance.standard_degree`), and with ``refit`` those of the standard files' SH model
    trained after the step (:func:`insitu.step.plyfit.refine_for_viewers`): SH colours with gradients and an SH
    trainer's Adam step at that degree (an SH model's: ``train.sh_degree``). ``sh_colours``, ``adam``: what runs
    each."""
    tc = cfg.train
    lit = tc.color_model != "sh"
    degree = _standard_files_degree(cfg, sh_degree)
    sh_colours(degree, not lit or refit, device)
    adam(cfg, sh_degree, device)
    if refit and lit:
        adam(replace(cfg, train=replace(tc, color_model="sh")), degree, device)
