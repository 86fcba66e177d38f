"""``insitu demo``: the Gray-Scott mini-app and the analysis, in situ, in one process per rank.

The simulation (:mod:`insitu_sims.gray_scott`) runs on every rank of the launch; every
``plotgap`` steps it hands its fields to an :class:`insitu.Adaptor`, which copies the
block and trains a splat model of the isosurface of V in the background while the
simulation goes on. The defaults fit the machine: on a CPU, a small grid, 96^2 images and
about a minute on 2 cores; with a CUDA GPU (gsplat), L = 128, 512^2 images, six timesteps
warm-started one from the other, about a minute and a half on one H200.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from insitu.config import Config, OutputConfig, TrainConfig, ViewConfig, memory_estimate
from insitu.errors import ConfigError, InputError, InsituError
from insitu.progress import summary

DEMO_DEFAULTS = {
    "input.var": "V", "input.iso": [0.3],
    "views.count": 48, "views.resolution": 96,
    "views.supersample": 2,             # the package's 4 x 4 costs the CPU's ray caster 30 s more for +0.6 dB
    "views.held_out": 4,                # the sets off the orbit: 12 views more for the CPU's ray caster
    "views.closeups": 0.0,              # close views cost the CPU's rasterizer their many more pixels per Gaussian
    "seeds.budget": 6000, "seeds.opacity": 0.8,
    "train.iterations": 600, "train.sh_increase_every": 200,
    "train.batch": 1,                    # the CPU's rasterizer pays per view: the package's 4 per step would
                                         # make each step 4 times as long (the GPU demo keeps 1 too, as measured)
    "train.sh_degree": 3,                # the lit model trains no SH: the degree is model.ply's fit
    "output.ply_fit_views": 16,          # one footprint render per view, on the CPU's rasterizer
    "output.ply_refine": 0.0,            # model.ply: the SH fit alone (trained as viewers draw it for a sixth of
                                         # the iterations would add 2 dB to it and 20 s to the demo; the report
                                         # draws the model)
    "train.densify.stop": 0,             # no growth: the seeds alone score 0.5 dB more at both steps, 20 s sooner
    "train.densify.reset_every": 0, "train.densify.max_gaussians": 20000, "train.eval_every": 100,
    "train.antialiased": False,          # at 96^2 the classic blur is 0.2 dB better
    "train.min_scale_px": 0.25,          # step 600's walls are a pixel thin: +0.3 dB there against the package's 0.5
    "train.lr_means": 1e-3,             # the means move 6x as fast as the package's: +1.35 / +0.8 dB at steps 300 /
                                         # 600 here, where on the GPU at 1024^2 it costs 1.4-2.2 dB
    "train.pixel_loss": "l1",            # the squared error grows step 300's model to the cap for -0.8 dB here
                                         # (L1 32.1 / 19.8 dB in 53 s, l2 31.3 / 19.8 in 65)
    "run.mode": "background", "run.queue": 1, "run.policy": "block",
    "series.warm_start": True, "series.warm_iterations": 300,
    "series.follow_iterations": False,   # the warm steps as measured (the GPU demo's 1000 hold 34.7-39.2 dB): the
                                         # package's rule would double a step's time here
    "series.cold_every": 0,              # the GPU demo's six steps as measured, all warm after the first (a
                                         # keyframe would train its sixth as long as its first)
    "output.images": 4,
}
# with a CUDA GPU: a grid, images and model sized for it (the simulation: GPU_SIMULATION)
DEMO_DEFAULTS_GPU = {
    **DEMO_DEFAULTS,
    "views.count": 96, "views.resolution": 512, "views.held_out": 16,
    "views.supersample": ViewConfig().supersample,
    "views.closeups": ViewConfig().closeups,    # the package's: what a user zooms to is trained (not on the CPU)
    "seeds.budget": 200_000,
    "train.iterations": 3000, "train.sh_degree": 3, "train.sh_increase_every": 300,
    "train.densify.start": 300, "train.densify.every": 100, "train.densify.stop": 2500,
    "train.densify.max_gaussians": 1_000_000, "train.eval_every": 250,
    "train.densify.grad_threshold": 1e-4,   # as measured on this demo; the package's 5e-5 is tuned on the
                                            # bonsai's squared error, not on this demo's L1
    "train.antialiased": TrainConfig().antialiased,
    "train.lr_means": TrainConfig().lr_means,   # the package's: the CPU demo's faster means cost the GPU's 1024^2
                                        # volumes 1.4-2.2 dB; not measured on the GPU demo
    "train.min_scale_px": 1.0,          # as measured on this demo (with the CPU demo's L1): the package's finer floor
                                        # is not measured on the GPU demo yet
    "series.warm_iterations": 1000,
    "output.ply_refine": OutputConfig().ply_refine,
}
# The simulation's own noise (0.1 by default) breaks the V = 0.3 surface at L = 32 into 166 pieces
# by step 600, 125 of them under 8 cells: a speckled picture. Without it the spots grow and divide
# (25 pieces at step 600), which is what the demo is meant to show. The grid is large enough that they
# still do by the last output: at L = 32 the spots' fronts meet themselves across the periodic faces
# after step 500, and by step 600 V has collapsed there into sheets a cell thick along the faces (3% of
# the cells over the iso value, against 14% at L = 36), which no 96^2 model draws (21 dB against 31).
CPU_SIMULATION = {"L": 36, "steps": 600, "plotgap": 300, "noise": 0.0}
GPU_SIMULATION = {"L": 128, "steps": 480, "plotgap": 80, "noise": 0.0}


def demo_defaults(gpu: bool) -> dict:
    """The demo's configuration defaults: for a CUDA GPU, or for a CPU."""
    return DEMO_DEFAULTS_GPU if gpu else DEMO_DEFAULTS


def _simulation():
    """The Gray-Scott mini-app: from an installed package, or from the source tree."""
    try:
        from insitu_sims import gray_scott
    except ImportError:
        sims = Path(__file__).resolve().parents[2] / "sims"
        if not (sims / "insitu_sims" / "gray_scott.py").is_file():
            raise
        sys.path.insert(0, str(sims))
        from insitu_sims import gray_scott
    return gray_scott


def check_demo_args(args: argparse.Namespace) -> None:
    """ConfigError for ``--L``, ``--steps`` or ``--plotgap`` out of range on any number of ranks."""
    least = {"L": (_simulation().L_MIN, "the simulation's initial cube of V is L // 4 cells each way from the "
                                        "centre: below that there is none, and V = 0 has no surface"),
             "steps": (1, "the analysis trains on the simulation's steps"),
             "plotgap": (1, "the analysis trains every this many steps")}
    for name, (low, why) in least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConfigError(f"--{name} {value}: expected an integer >= {low} ({why})")


def demo_settings(args: argparse.Namespace, device_type: str):
    """The simulation's settings for a demo training on ``device_type`` ("cpu" or "cuda"): the flags given,
    the defaults for the device otherwise."""
    gs = _simulation()
    sim = GPU_SIMULATION if device_type == "cuda" else CPU_SIMULATION
    L, steps, plotgap = (sim[k] if getattr(args, k) is None else getattr(args, k) for k in ("L", "steps", "plotgap"))
    return gs.GrayScottSettings(L=L, steps=steps, plotgap=plotgap, noise=sim["noise"], engine="none").validate()


def check_demo(args: argparse.Namespace, cfg: Config, ranks: int, device_type: str, available: int) -> None:
    """ConfigError when the demo's grid cannot run on ``ranks`` ranks: too small for every rank's block to own
    a cell (marching cubes, the analysis's decomposition), or too large for the ``available`` bytes of this
    machine's memory with the simulation, the analysis's copies of its block and, on the CPU, the step."""
    gs = _simulation()
    s = demo_settings(args, device_type)
    dims = gs.grid_dims(ranks)
    least = max(gs.L_MIN, max(dims) + 1)     # the last block along an axis holds the last sample: one more
    if s.L < least:
        raise ConfigError(f"--L {s.L}: expected at least {least} on {ranks} ranks (the simulation splits the grid "
                          f"{' x '.join(map(str, dims))} over them, and every rank's block must own a cell for "
                          "marching cubes)")
    block = 1
    for n in gs.largest_block(s.L, ranks):
        block *= n + 3                          # a ghost layer below; above, the cells' closing layer and a ghost
    waiting = cfg.run.queue + 2 if cfg.run.mode == "background" else 1   # queued, training, being copied
    parts = {"the simulation": gs.memory_bytes(s, ranks),
             "the analysis's copies of its block": waiting * 8 * block + 4 * block,   # float64, and float32 trained
             "the training step": sum(memory_estimate(cfg, ranks).values()) if device_type == "cpu" else 0}
    need = sum(parts.values())
    if need > available:
        gib = 2.0 ** 30
        detail = ", ".join(f"{k} {v / gib:.3g} GiB" for k, v in parts.items() if v)
        raise ConfigError(f"--L {s.L}: the demo needs {need / gib:.3g} GiB per rank on {ranks} rank(s) ({detail}); "
                          f"this machine has {available / gib:.3g} GiB")


def run_demo(args: argparse.Namespace, cfg, comm, writer) -> int:
    """Run the simulation with the adaptor attached; returns the number of steps trained."""
    from insitu.run.adaptor import Adaptor      # torch and the analysis: only when the demo runs

    gs = _simulation()
    settings = demo_settings(args, comm.device.type)
    L, steps, plotgap = settings.L, settings.steps, settings.plotgap
    if comm.rank == 0:
        print(f"demo: Gray-Scott L={L}, {steps} steps on {comm.size} rank(s); training on V = "
              f"{cfg.input.iso} every {plotgap} steps ({cfg.run.mode}) on {comm.device}; "
              f"outputs in {cfg.output.dir}", flush=True)
    t0 = time.perf_counter()

    adaptor = Adaptor(comm.mpi, cfg, provenance=writer.provenance)
    try:
        with adaptor:
            def consumer(step, t, fields, global_shape, start):
                try:
                    adaptor.execute(step, t, fields, global_shape, start)
                except InsituError:         # a step failed (e.g. V has no surface yet): the adaptor said
                    pass                    # so, metrics.csv records it, and the simulation goes on
                if comm.rank == 0:
                    print(f"demo: simulation step {step} handed to the analysis "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)

            stats = gs.run(settings, comm.mpi, consumer=consumer)
            if comm.rank == 0:
                print(f"demo: simulation done, {stats.steps_per_s:.1f} steps/s; finishing the analysis", flush=True)
    except InsituError:                         # the last step's failure, raised by finalize()
        pass
    if not adaptor.stats.trained:
        failed = [s for s in adaptor.status.values() if s.status == "failed"]
        reason = f" ({' '.join(failed[0].reason.split())})" if failed else ""
        raise InputError(f"the demo trained no step{reason}; a larger --L or --steps, or another --iso, gives V a "
                         "surface to train on")
    if comm.rank == 0:
        for record in adaptor.stats.trained:
            print("demo: " + summary(record.metrics, Path(cfg.output.dir)), flush=True)
        out = Path(cfg.output.dir)
        print(f"demo: the report is {out / 'report.html'}; to look at it, run\n"
              f"    insitu view {out}\n"
              "and open the URL it prints (on a remote machine, through an SSH tunnel: "
              "ssh -L 8000:localhost:8000 HOST)", flush=True)
    return len(adaptor.stats.trained)
