"""The step's Triton kernels compiled ahead on background threads (insitu.step.compilation)."""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import sphere_field

from insitu.config import Config, from_dict
from insitu.parallel.comm import init_comm, shutdown
from insitu.step.compilation import Ahead, Compiler, KernelShapes, compile_ahead, kernel_groups
from insitu.step.layouts import training_ranks
from insitu.step.pipeline import Collaborators, compute_step
from insitu.volume import whole_block


def small_config(color_model: str = "lit", **views) -> Config:
    cfg = Config()
    cfg.input.iso = [5.0]
    cfg.views.count, cfg.views.resolution, cfg.views.held_out = 10, 32, 2
    for k, v in views.items():
        setattr(cfg.views, k, v)
    cfg.seeds.budget = 200
    cfg.run.progress = False
    t = cfg.train
    t.iterations, t.color_model, t.sh_degree = 10, color_model, 1
    t.densify.start, t.densify.reset_every = 10**6, 0
    return cfg


@pytest.mark.parametrize("color_model, eps2d, antialiased, refine, refit", [
    ("lit", 0.05, True, 0.125, True), ("lit", 0.05, True, 0, False), ("sh", 0.05, False, 0.125, True),
    ("sh", 0.3, False, 0.125, False), ("sh", 0.3, True, 0.125, True)])
def test_the_colours_group_holds_model_ply_trained_as_viewers_draw_it(color_model, eps2d, antialiased, refine, refit):
    """When model.ply's SH model is trained after the step (output.ply_refine, a model that viewers draw
    otherwise), the colours' group also runs the SH colours with gradients and an SH trainer's Adam step, at the
    standard files' degree (a lit model's: 0, the fixed light in band 0)."""
    calls = []
    cfg = small_config(color_model)
    cfg.train.eps2d, cfg.train.antialiased, cfg.output.ply_refine, cfg.train.sh_degree = eps2d, antialiased, refine, 3
    key, job = kernel_groups(cfg, KernelShapes.planned(cfg))["colours and adam"]
    job(torch.device("cpu"), sh_colours=lambda degree, train, device: calls.append(("sh", degree, train)),
        adam=lambda cfg, degree, device: calls.append(("adam", cfg.train.color_model, degree)))
    trains_sh = color_model == "sh" or refit
    ply = 0 if color_model == "lit" else 3          # a lit model's standard files: the fixed light in band 0
    expected = [("sh", ply, trains_sh), ("adam", color_model, 0 if color_model == "lit" else 3)]
    if refit and color_model == "lit":
        expected.append(("adam", "sh", ply))
    assert calls == expected and key[-1] is refit


def test_nothing_starts_off_cuda_and_waiting_for_nothing_returns():
    comm = init_comm(device="cpu")
    try:
        ahead = compile_ahead(small_config(), comm)
    finally:
        shutdown(comm)
    assert ahead.futures == {}
    ahead.wait()
    ahead.wait("ray caster")
    Ahead().wait()


@pytest.mark.parametrize("color_model", ["lit", "sh"])
@pytest.mark.parametrize("size, rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_every_group_runs_the_steps_own_functions_on_a_tiny_input(color_model, size, rank):
    """Off CUDA the same jobs run the functions' torch code: their arguments are ones the functions take."""
    cfg = small_config(color_model, colormap="gray")
    cfg.input.color_var = "c"
    cfg.input.iso = [4.0, 6.0]
    groups = kernel_groups(cfg, KernelShapes.planned(cfg, size, rank))
    assert set(groups) == {"ray caster", "loss", "colours and adam"}
    for name, (key, job) in groups.items():
        job(torch.device("cpu"))


def test_the_keys_follow_what_sets_the_specialisations():
    a, b = small_config(), small_config(resolution=64)
    ka = {n: k for n, (k, _) in kernel_groups(a, KernelShapes.planned(a)).items()}
    kb = {n: k for n, (k, _) in kernel_groups(b, KernelShapes.planned(b)).items()}
    assert ka["ray caster"] != kb["ray caster"] and ka["loss"] != kb["loss"]
    assert ka["colours and adam"] == kb["colours and adam"]
    two = {n: k for n, (k, _) in kernel_groups(a, KernelShapes.planned(a, 2, 1)).items()}
    assert two["loss"] != ka["loss"]
    sh = {n: k for n, (k, _) in kernel_groups(small_config("sh"), KernelShapes.planned(small_config("sh"))).items()}
    assert sh["colours and adam"] != ka["colours and adam"]


@pytest.mark.parametrize("color_model", ["lit", "sh"])
def test_the_planned_shapes_are_those_of_the_objects_a_step_builds(color_model):
    """The shapes compiled for at a run's start and a step's (before it has seeds or views) are those of the
    objects the step trains with, on which it waits for its kernels before training; a warm start's too."""
    asked = []

    def recorded(cfg, comm, shapes=None):
        asked.append(shapes)
        return Ahead()

    cfg = small_config(color_model)
    cfg.train.iterations, cfg.train.sh_degree, cfg.views.resolution = 2, 2, 24
    comm = init_comm(device="cpu")
    try:
        first = compute_step(whole_block(sphere_field()), cfg, comm, using=Collaborators(compile_ahead=recorded))
        compute_step(whole_block(sphere_field() - 0.5), cfg, comm, warm=first,
                     using=Collaborators(compile_ahead=recorded))
        planned = KernelShapes.planned(cfg, *training_ranks(cfg, comm))
    finally:
        shutdown(comm)
    assert asked == [None, planned, None, planned]
    assert planned == KernelShapes(24, 24, (0, 24), 1, 0 if color_model == "lit" else 2)


def test_a_group_runs_on_its_own_thread_and_its_failure_is_left_to_the_first_launch():
    seen = []

    def fine(device):
        seen.append((threading.current_thread().name, device))

    def broken(device):
        raise RuntimeError("no compiler here")

    compiler = Compiler()
    ahead = Ahead({"fine": compiler.start("fine", fine, torch.device("cpu")),
                   "broken": compiler.start("broken", broken, torch.device("cpu"))})
    ahead.wait()                                            # no exception: the failure is ignored here
    assert seen == [("insitu-compile-fine", torch.device("cpu"))]
    assert isinstance(ahead.futures["broken"].exception(), RuntimeError)


def test_a_process_that_ends_waits_for_the_compilations_still_running():
    done = threading.Event()

    def slow(device):
        done.wait(0.3)
        seen.append("finished")

    seen = []
    compiler = Compiler()
    future = compiler.start("slow", slow, torch.device("cpu"))
    assert not future.done()
    compiler.wait_at_exit()
    assert future.done() and seen == ["finished"]
    late = compiler.start("late", lambda device: threading.Event().wait(5.0), torch.device("cpu"))
    compiler.wait_at_exit(seconds=0.2)                      # bounded: it gives up on a hung compilation
    assert not late.done()


def test_a_config_goes_to_the_child_compiler_and_comes_back_the_same():
    """The child compiler rebuilds the step's settings from their plain form (JSON's)."""
    import dataclasses
    import json

    cfg = small_config("sh", colormap="gray")
    cfg.input.color_var, cfg.input.iso, cfg.views.closeup_factors = "c", [4.0, 6.0], [2.0, 3.0]
    for c in (Config(), cfg):
        assert from_dict(json.loads(json.dumps(dataclasses.asdict(c)))) == c


def test_the_child_compiler_runs_the_groups_it_is_given_and_says_when_one_fails(monkeypatch):
    """Off CUDA the child runs the groups' torch code: it exits 0 when every group it was given ran, 1
    when one failed or is unknown; nothing starts without groups, with run.compile_in_child off, or
    from a program that is not the Python sys.executable names (a simulation that embeds Python)."""
    import json
    import sys

    from insitu.step.compilation import child_main

    compiler, cpu = Compiler(), torch.device("cpu")
    cfg = small_config()
    shapes, two = KernelShapes.planned(cfg), KernelShapes.planned(cfg, 2, 1)
    assert compiler.spawn(cfg, [], cpu, shapes) is None
    child = compiler.spawn(cfg, ["loss", "colours and adam"], cpu, two)
    unknown = compiler.spawn(cfg, ["loss", "no such group"], cpu, shapes)
    assert child.wait(timeout=120) == 0 and unknown.wait(timeout=120) == 1
    assert compiler.children == [child, unknown]
    cfg.run.compile_in_child = False
    assert compiler.spawn(cfg, ["loss"], cpu, shapes) is None
    cfg.run.compile_in_child = True
    monkeypatch.setattr(sys, "executable", "/opt/sim/bin/my_simulation")
    assert compiler.spawn(cfg, ["loss"], cpu, shapes) is None

    class Spec:                                 # the first line, then a pipe that stays open
        def readline(self):
            return json.dumps({"config": {}, "groups": ["fine", "broken"], "device": "cpu",
                               "shapes": {"width": 8, "height": 8, "rows": [0, 8], "band_ranks": 1, "sh_degree": 0}})

        def read(self):
            threading.Event().wait()

    def broken(device):
        raise RuntimeError("no compiler here")

    groups = []
    assert child_main(Spec(), groups=lambda cfg, shapes: groups.append(shapes) or {"fine": (1, lambda d: None),
                                                                                 "broken": (2, broken)}) == 1
    assert groups == [KernelShapes(8, 8, (0, 8), 1, 0)]


def test_a_child_compiler_ends_when_its_parent_does():
    """Once the pipe its spec came on closes (the parent ended, however), the child ends at once, even
    in the middle of a group (of 60 s here: a child that finished it would outlast the launcher's timeout)."""
    import sys

    from conftest import launch

    script = """
import io, json, sys, time
from insitu.step import compilation
slow = lambda cfg, shapes: {"slow": (1, lambda device: time.sleep(60))}
spec = json.dumps({"config": {}, "groups": ["slow"], "device": "cpu",
                   "shapes": {"width": 8, "height": 8, "rows": [0, 8], "band_ranks": 1, "sh_degree": 0}})
sys.exit(compilation.child_main(io.StringIO(spec + "\\n"), groups=slow))    # the rest of the stream: ended at once
"""
    out = launch([sys.executable, "-c", script], timeout=40)
    assert out.returncode == 1, out.stderr


def test_a_group_left_to_a_child_runs_here_after_it_unless_this_process_ended_it():
    """A group's thread waits for its child compiler, then runs its job (what the child compiled then
    loads from the cache; what it did not, compiles here, as when it fails); a child that this process
    ends as it exits leaves its groups' jobs unrun."""
    import subprocess
    import sys

    compiler = Compiler()
    seen = []
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    done = compiler.start("after a failed child", lambda device: seen.append("ran"), torch.device("cpu"),
                          after=compiler.waiter(failed))
    assert done.exception(timeout=60) is None and seen == ["ran"]
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    compiler.children.append(slow)                  # as Compiler.spawn keeps the children it starts
    ended = compiler.start("after an ended child", lambda device: seen.append("ran again"), torch.device("cpu"),
                           after=compiler.waiter(slow))
    assert not ended.done()
    compiler.wait_at_exit()
    assert slow.returncode is not None and ended.done() and ended.exception() is None and seen == ["ran"]


@pytest.mark.gpu
@pytest.mark.parametrize("color_model", ["lit", "sh"])
def test_after_compile_ahead_the_step_compiles_no_kernel_itself(color_model, monkeypatch):
    """With the kernels' in-process caches emptied, the background threads compile (or load) every
    Triton kernel the step launches: none reaches the compiler on the step's own thread."""
    from triton.runtime.jit import JITFunction

    from insitu.groundtruth import triton_caster
    from insitu.render import shading
    from insitu.training import adam, ssim

    for fn in (triton_caster._raycast_kernel, ssim._moments_cols, ssim._ssim_rows, ssim._spread_cols,
               ssim._spread_rows, adam._adam_kernel, shading._sh_forward, shading._sh_backward):
        fn.device_caches.clear()
    compiler = Compiler()                       # nothing started: every group compiles
    compiled = []
    do_compile = JITFunction._do_compile

    keys = []

    def spy(self, *a, **k):
        compiled.append((self.fn.__name__, threading.current_thread().name))
        keys.append(a[0] if a else k.get("key"))        # the specialisation (sizes' divisibility, flags)
        return do_compile(self, *a, **k)

    monkeypatch.setattr(JITFunction, "_do_compile", spy)
    comm = init_comm(device="cuda")
    try:
        cfg = small_config(color_model)
        ahead = compiler.compile_ahead(cfg, comm)
        assert set(ahead.futures) == {"ray caster", "loss", "colours and adam"}
        ahead.wait()
        assert all(f.exception() is None for f in ahead.futures.values())
        assert compiler.children[-1].returncode == 0            # the loss's and Adam's groups compiled there
        before = len(compiled)
        assert {name for name, _ in compiled} >= {"_raycast_kernel", "_moments_cols", "_ssim_rows", "_spread_cols",
                                                  "_spread_rows", "_adam_kernel", "_sh_forward"}
        assert "MainThread" not in {thread for _, thread in compiled}     # (backward passes: autograd's thread)
        compute_step(whole_block(sphere_field()), cfg, comm, using=Collaborators(compile_ahead=compiler.compile_ahead))
        mine = [f"{name} on {thread}: {key}" for (name, thread), key in zip(compiled[before:], keys[before:])]
        ahead_keys = [f"{name}: {key}" for (name, _), key in zip(compiled[:before], keys[:before])]
        assert mine == [], "the step compiled:\n" + "\n".join(mine) + "\nahead:\n" + "\n".join(ahead_keys)
    finally:
        shutdown(comm)


def test_a_command_asks_for_the_compilers_files_without_importing_triton(tmp_path, monkeypatch):
    """prefetch_compiler finds Triton's compiler library and assembler where Triton's package is, without
    importing it, and asks the system to read them ahead."""
    import importlib
    import os
    import sys

    from insitu.run.runner import prefetch_compiler

    package = tmp_path / "triton"
    (package / "_C").mkdir(parents=True)
    (package / "backends" / "nvidia" / "bin").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "_C" / "libtriton.so").write_bytes(b"\0" * 4096)
    (package / "backends" / "nvidia" / "bin" / "ptxas").write_bytes(b"\0" * 4096)
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: asked.append(advice))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert prefetch_compiler() == [str(package / "_C" / "libtriton.so"),
                                   str(package / "backends" / "nvidia" / "bin" / "ptxas")]
    assert asked == [os.POSIX_FADV_WILLNEED] * 2 and "triton" not in sys.modules
