"""One configuration for a run: a YAML file, overridden by command-line flags.

Every section is a small dataclass. ``load_config`` validates up front: unknown
keys, wrong types and out-of-range values fail with a message that says what was
expected and what came, before anything is computed or written. Each key's documentation is declared with
its field (``constrained``, ``documented``); ``examples/config.yaml`` and ``docs/configuration.md`` are
written from it (:func:`config_yaml`, :func:`config_reference`: ``python -m insitu.config``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from insitu.errors import ConfigError


# Constraints, declared with each field (``constrained(default, POSITIVE, ...)``) and checked by
# :func:`validate`: the value must be > 0 (None passes: "not set"), >= 0, in [0, 1], in (0, 1), or one of
# ``choices``; ``below``/``at_most``: an upper bound that the code consuming the value sets.
POSITIVE, NON_NEGATIVE, FRACTION, OPEN_FRACTION = "> 0", ">= 0", "in [0, 1]", "in (0, 1)"


def constrained(default: Any, *checks: str, doc: str, choices: tuple[str, ...] | None = None,
                below: tuple[float, str] | None = None, at_most: tuple[float, str] | None = None) -> Any:
    """A dataclass field with ``default`` whose value must pass ``checks`` (POSITIVE, NON_NEGATIVE,
    FRACTION, OPEN_FRACTION), with ``choices`` be one of them, and stay ``below`` (exclusive) or
    ``at_most`` (inclusive) a bound, given as (bound, what it rests on). ``doc``: what the key does, in
    the words of ``examples/config.yaml`` and ``docs/configuration.md`` (:func:`config_yaml`,
    :func:`config_reference`). A list default is copied for each instance."""
    metadata = {"checks": checks, "choices": choices, "below": below, "at_most": at_most, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def documented(default: Any, doc: str) -> Any:
    """A dataclass field with ``default``, unconstrained but for its type, and its ``doc``."""
    return constrained(default, doc=doc)


def subsection(cls: type) -> Any:
    """A dataclass field holding the keys of the dataclass ``cls`` one level down (``train.densify.start``),
    documented by its docstring and their fields as a section is."""
    return field(default_factory=cls)


TIMEOUT_S_MAX = 7 * 24 * 3600.0         # a week, longer than a batch job runs: the operating system's waits (poll,
                                        # a child process's) take at most 2**31 - 1 ms, 24.8 days, and the in situ
                                        # analysis waits up to 3 x run.timeout_s
TIMEOUT_S_LIMIT = (TIMEOUT_S_MAX, "seconds, a week: the system's waits end at 24.8 days, and the analysis waits up "
                                  "to 3 times this")


def field_choices(key: str) -> tuple[str, ...] | None:
    """The choices declared for the dotted key ``key`` (e.g. ``"run.backend"``), or None."""
    return config_keys()[key][0].metadata.get("choices")


@dataclass
class InputConfig:
    """The input: the field, its isosurfaces, and how files' samples and steps are read."""

    var: str = documented("U", "the field (a variable of the input) whose isosurfaces are trained (--var)")
    iso: list[float] = documented([0.25], "the iso values whose surfaces are trained, together as one model "
                                  "(--iso); insitu run, replay and stream need one given: 0.25 is the Gray-Scott "
                                  "demo's")
    color_var: str | None = documented(None, "a second field that colours the surface through views.colormap "
                                       "(--color-var); null: the surface is views.surface_color")
    dims: list[int] | None = documented(None, "raw files: the grid's size (x, y, z) in samples; null: read from "
                                        "the file's name (NAME_XxYxZ_DTYPE.raw)")
    dtype: str | None = documented(None, "raw files: the samples' numpy type (uint8, int16, float32, ...); null: "
                                   "read from the file's name")
    downsample: int = constrained(1, POSITIVE, doc="raw and .npy input: each k x k x k samples averaged into one "
                                  "before training (a box filter); 1: as read")
    steps: list[int] | None = documented(None, "replay and stream: train only these step numbers; null: every "
                                         "step that input.every takes")
    every: int = constrained(1, POSITIVE, doc="replay and stream: train every k-th step that arrives; 1: every one")
    timeout_s: float = constrained(60.0, POSITIVE, at_most=TIMEOUT_S_LIMIT, doc="stream: seconds without a new "
                                   "step after which the reader gives up")
    origin: list[float] | None = documented(None, "world coordinates (x, y, z) of sample (0, 0, 0), in the "
                                            "input's length unit; null: the file's, else 0")
    spacing: list[float] | None = documented(None, "replay and stream: world size (dx, dy, dz) of a cell; null: "
                                             "the file's, else 1 (insitu run: --spacing)")
    step_var: str | None = documented(None, "replay and stream: the variable or attribute that numbers the steps; "
                                      "null: step, Step or the openPMD iteration, else the ADIOS step index")
    time_var: str | None = documented(None, "replay and stream: the variable or attribute that gives each step's "
                                      "time; null: time or Time")
    nonfinite: str = constrained("error", choices=("error", "outside"), doc="NaN and infinite samples (and a "
                                 "sparse array's gaps): error refuses the step; outside takes them as outside the "
                                 "surface (a mask)")


@dataclass
class SeedConfig:
    """The Gaussians a step starts from: flat discs on the isosurface, coloured as the ground truth shows it."""

    budget: int = constrained(2_000_000, POSITIVE, doc="the most Gaussians a step starts with, over all ranks "
                              "(--budget)")
    thickness: float = constrained(0.1, POSITIVE, FRACTION, doc="each disc's thickness as a fraction of its "
                                   "in-plane size; its thin axis is its normal, which the lit colour model shades with")
    opacity: float = constrained(0.95, OPEN_FRACTION, doc="every seed's initial opacity (its logit is the "
                                 "parameter trained): nearly opaque, so that the discs together draw the surface "
                                 "opaque before any training")
    footprint: float = constrained(0.6, POSITIVE, doc="each seed's in-plane standard deviation as a multiple of the "
                                   "mean spacing of the seeds (the square root of the area each stands for): larger "
                                   "covers the surface more opaquely, smaller draws it sharper")
    fill: bool = documented(False, "with seeds.density 0: true converts the surface into seeds.budget seeds, false "
                            "takes one Gaussian per marching-cubes vertex (at most the budget); true with a "
                            "density above 0 is refused")
    density: float = constrained(4.0, NON_NEGATIVE, doc="Gaussians per pixel of surface area as an orbit view "
                                 "sees it, spread evenly over the isosurface (the surface converted into discs that "
                                 "draw it), at most seeds.budget; 0: seeds.fill decides")
    color_init: str = constrained("gt", choices=("gt", "constant"), doc="the sh colour model's seed colours: gt, "
                                  "the ground truth's mean colour where each Gaussian shows; constant, "
                                  "views.surface_color (the lit model's seeds take the ground truth's base colour "
                                  "at their centre)")
    color_views: int = constrained(16, POSITIVE, doc="gt seed colours: how many training views, spread over the "
                                   "orbit, they are read from (one render pass each)")


@dataclass
class ViewConfig:
    """The views: an orbit of cameras around the volume (every test_every-th held out), close-ups, the
    held-out sets off the orbit, and the ray-cast ground truth they are trained and scored against."""

    count: int = constrained(448, POSITIVE, doc="views on the orbit around the volume, the held-out ones "
                             "included (--views)")
    resolution: int = constrained(256, POSITIVE, doc="image width and height in pixels (--resolution); at least 6")
    fov_deg: float = constrained(40.0, POSITIVE, doc="the cameras' field of view in degrees, 1 to 170; the orbit "
                                 "stands where the volume's bounding sphere fills it")
    test_every: int = constrained(8, POSITIVE, doc="every k-th orbit view is held out for evaluation, not "
                                  "trained on; at least 2")
    closeups: float = constrained(0.25, NON_NEGATIVE, doc="training views closer than the orbit, looking at "
                                  "points on the surface, as a fraction of views.count; 0: none")
    closeup_factors: list[float] = documented([2.0, 3.0], "how many times closer than the orbit the close-up "
                                              "training views stand, each in [1, 100]")
    held_out: int = constrained(16, NON_NEGATIVE, doc="views in each held-out set off the orbit: 2x closer "
                                "(near2), 3x closer (near3) and between the orbit's views (off); 0: none")
    supersample: int = constrained(4, POSITIVE, doc="ground truth: s x s rays per pixel, 1 to 8; with fewer, a "
                                   "pixel's coverage of an outline or a rim is coarsely quantised, and differently "
                                   "in every view")
    march_step: float = constrained(0.25, POSITIVE, doc="ground truth: the rays' step in cells, at most 1; a "
                                    "coarser one misses where a ray grazes the surface, an error that differs "
                                    "between views")
    background: list[float] = documented([0.0, 0.0, 0.0], "RGB in [0, 1] behind the surface in the ground truth "
                                         "and the evaluation")
    surface_color: list[float] = documented([0.85, 0.8, 0.7], "RGB in [0, 1] of the surface when input.color_var "
                                            "is not set (shaded by the ground truth's light)")
    colormap: str = constrained("viridis", choices=("viridis", "gray"), doc="the colour map of input.color_var's "
                                "values")


@dataclass
class DensifyConfig:
    """Densification, as gsplat's DefaultStrategy: every `every` iterations after `start` until `stop`, the
    Gaussians whose screen-space gradient is high grow (copied or split) and the faint ones are pruned, and
    every `reset_every` iterations every opacity is reset."""

    start: int = constrained(500, NON_NEGATIVE, doc="the iteration after which densification (growth and pruning) "
                             "starts")
    stop: int = constrained(15000, NON_NEGATIVE, doc="the iteration after which densification stops (never in a "
                            "step's last iteration)")
    every: int = constrained(100, POSITIVE, doc="iterations between densifications")
    grad_threshold: float = constrained(5e-5, POSITIVE, doc="a Gaussian grows when its mean screen-space gradient "
                                        "exceeds this: copied when small, split in two when wider than 1% of the "
                                        "scene's extent; gsplat's 2e-4 barely grows the lit model")
    prune_opacity: float = constrained(0.005, NON_NEGATIVE, below=(0.5, "an opacity reset caps every opacity at "
                                       "twice it, and an opacity is below 1"), doc="densification removes the "
                                       "Gaussians fainter than this opacity, and an opacity reset caps every "
                                       "opacity at twice it; 0 only without resets (reset_every 0)")
    reset_every: int = constrained(3000, NON_NEGATIVE, doc="iterations between opacity resets, only in the first "
                                   "half of training (so none within the default 400 iterations); 0: none")
    max_gaussians: int = constrained(5_000_000, POSITIVE, doc="the most Gaussians densification grows the model "
                                     "to, over all ranks")


@dataclass
class TrainConfig:
    """The optimisation: loss, learning rates, densification and when a step stops."""

    iterations: int = constrained(400, POSITIVE, doc="optimiser steps per timestep, each of train.batch views "
                                  "(--iterations); the means' learning rate decays over them; a step starts from "
                                  "seeds that already draw the surface, so a short refinement is enough")
    batch: int = constrained(4, POSITIVE, doc="views per optimiser step (--batch); on a GPU a step's work on "
                             "every Gaussian (projection, colours, Adam) is shared by its views, so each view costs "
                             "less")
    color_model: str = constrained("lit", choices=("lit", "sh"), doc="lit: a base colour and a normal per "
                                   "Gaussian, shaded per view with the ground truth's light; sh: spherical "
                                   "harmonics colours")
    sh_degree: int = constrained(3, NON_NEGATIVE, doc="sh: the SH degree trained, reached one band every "
                                 "train.sh_increase_every iterations; lit: the degree of model.ply's SH fit of the "
                                 "headlight (output.ply_light headlight) unless output.sh_degree is set; 0 to 3")
    sh_increase_every: int = constrained(100, POSITIVE, doc="iterations between one SH band and the next")
    lr_means: float = constrained(1.6e-4, POSITIVE, doc="the means' (positions') learning rate at the start, "
                                  "times the scene's extent; it decays log-linearly to train.lr_means_final")
    lr_means_final: float = constrained(1.6e-6, NON_NEGATIVE, doc="the means' learning rate at the end, times the "
                                        "scene's extent; 0: a linear decay to 0")
    lr_scales: float = constrained(5e-3, POSITIVE, doc="learning rate of the Gaussians' log scales")
    lr_quats: float = constrained(3e-4, POSITIVE, doc="learning rate of the rotations (quaternions); below "
                                  "gsplat's 1e-3, as a disc's rotation is also its shading normal")
    lr_opacities: float = constrained(5e-2, POSITIVE, doc="learning rate of the opacities' logits")
    lr_sh0: float = constrained(2.5e-3, POSITIVE, doc="learning rate of the colours' first SH band (the base "
                                "colour)")
    lr_shN: float = constrained(1.25e-4, POSITIVE, doc="learning rate of the colours' higher SH bands")
    ssim_weight: float = constrained(0.2, FRACTION, doc="the loss: this weight times 1 - SSIM plus the rest times "
                                     "the pixel term (train.pixel_loss); 0: the pixel term alone")
    pixel_loss: str = constrained("l2", choices=("l1", "l2"), doc="the loss's pixel term: l2, the squared error "
                                  "that PSNR measures, scaled to L1's gradient size on the foreground; l1, the "
                                  "absolute error (a lower PSNR on the surface)")
    random_background: bool = documented(True, "a random background colour per view and iteration behind render "
                                         "and ground truth alike, so that the opacities learn the ground truth's "
                                         "alpha; false: views.background")
    min_scale_px: float = constrained(0.5, NON_NEGATIVE, doc="each Gaussian's in-plane standard deviations stay "
                                      "at least this many pixels of the nearest training view that sees it, so that "
                                      "closer views show no gaps that the training views' blur hid; 0: no floor; "
                                      "at most views.resolution / 6")
    psnr_target: float | None = constrained(None, POSITIVE, doc="stop a step's training early once the held-out "
                                            "PSNR on the surface's pixels reaches this many dB (--psnr-target); "
                                            "null: no target")
    ssim_target: float | None = constrained(None, FRACTION, doc="... and once the held-out SSIM on the surface's "
                                            "pixels reaches this (both, when both are set; --ssim-target); null: "
                                            "no target")
    eval_every: int = constrained(0, NON_NEGATIVE, doc="evaluate the held-out views every k iterations during "
                                  "training (for the targets and the report's curves); 0: only at the end")
    time_budget_s: float | None = constrained(None, POSITIVE, doc="stop a step's training once it has taken this "
                                              "many seconds (what metrics' train_seconds counts: its iterations and "
                                              "evaluations), looked at every 10 iterations, every rank stopping at "
                                              "the same one; cold and warm steps alike; metrics' stopped_by says "
                                              "what ended each step's training (iterations, target or time "
                                              "budget); null: no budget")
    seed: int = constrained(0, NON_NEGATIVE, doc="seed of the random draws (seeds, the views' order, the "
                            "backgrounds, the splits); below 2^32")
    eps2d: float = constrained(0.05, NON_NEGATIVE, doc="px^2 the rasterizer adds to every projected 2D covariance "
                               "(its pixel filter) in training, the evaluation and the report's viewer; standard "
                               "3DGS viewers, which draw model.ply, add 0.3")
    antialiased: bool = documented(True, "the blur scales each splat's opacity so that its footprint keeps its "
                                   "integral (gsplat's antialiased mode; Spark's blurAmount in the report's viewer); "
                                   "false: the classic blur")
    densify: DensifyConfig = subsection(DensifyConfig)


@dataclass
class OutputConfig:
    """What a run writes."""

    dir: str = documented("out", "the output folder (--out)")
    images: int = constrained(4, NON_NEGATIVE, doc="held-out views written per step as ground truth and render "
                              "PNGs; 0: none")
    ply: bool = documented(True, "write each step's model.ply: the model as standard 3DGS viewers draw it (SH "
                           "colours; also red green blue, the band-0 colour, for VTK tools: ParaView, pyvista, F3D)")
    spz: bool = documented(True, "write each step's model.spz (Niantic's SPZ, in its own frame: x right, y up, "
                           "z back; gathered on rank 0): of a model trained antialiased (train.antialiased) the "
                           "trained Gaussians, in model.ply's colours, its header saying 'draw antialiased' (as "
                           "Spark draws by default: the viewers' 0.3 px^2 blur, each splat's opacity scaled to keep "
                           "its integral) and refit as so drawn (output.ply_refine); else model.ply's model")
    lit: bool = documented(True, "write each step's model.lit.spz (train.color_model lit): the model as trained, "
                           "its base colours and its normals (each rotation's local z axis) in the step's frame, "
                           "which the report's viewer shades with the headlight; not a standard 3DGS model")
    glb: bool = documented(False, "write each step's model.glb (glTF 2.0 binary with KHR_gaussian_splatting, for "
                           "glTF viewers: PlayCanvas, CesiumJS, Babylon.js, three.js; gathered on rank 0): "
                           "model.spz's Gaussians as float32, turned into glTF's axes (+Y up: the data's +Z), its "
                           "node placing them in world units; 60 bytes a Gaussian at SH degree 0, 3.7 times "
                           "model.spz's (docs/model.md)")
    sh_degree: int | None = constrained(None, NON_NEGATIVE, doc="the SH degree of model.ply and model.spz (0: one "
                                        "colour a Gaussian, 14 floats in model.ply instead of 59 at degree 3), "
                                        "the degree their model is fitted at when it is fitted for them, else the "
                                        "trained model's bands above it are left out; null: 0 for a lit model in "
                                        "the fixed light (output.ply_light; band 0 holds it), else the model's own "
                                        "(a lit model's headlight fit: train.sh_degree)")
    every: int = constrained(1, POSITIVE, doc="the model files (output.ply, output.spz, output.glb, output.lit) of "
                             "the steps whose number is a multiple of this; the other steps write their figures, "
                             "images and cameras, and neither fit the files' models nor score them (no ply_*, spz_* "
                             "figures)")
    ply_light: str = constrained("fixed", choices=("fixed", "headlight"), doc="the light a lit model's model.ply "
                                 "and model.spz are shaded with: fixed, a key and a fill light fixed in the data's "
                                 "frame, baked into each Gaussian's colour (the same from every side, which band 0 "
                                 "holds; their figures, ply_*, against a ground truth cast in that light); headlight, "
                                 "SH colours fitted to the headlight as the training views saw each Gaussian (what "
                                 "SH holds of a view-dependent light)")
    ply_views: int = constrained(64, POSITIVE, doc="output.ply_light fixed: the training views, spread over the "
                                 "orbit and the close-ups, whose ground truth is cast again in the fixed light for "
                                 "the refit (output.ply_refine); the held-out views are cast again for the figures "
                                 "(output.ply_metrics)")
    ply_fit_views: int = constrained(32, NON_NEGATIVE, doc="output.ply_light headlight: a lit model's SH fit for "
                                     "model.ply, each side of a Gaussian weighted as this many training views saw "
                                     "it; 0: both sides alike")
    ply_refine: float = constrained(0.125, NON_NEGATIVE, doc="model.ply's SH model trained as standard viewers "
                                    "draw it (train.eps2d 0.3) for this fraction of the step's iterations, when "
                                    "the trained model is drawn otherwise (lit colours, another blur), and "
                                    "model.spz's as the viewers that draw antialiased draw it; 0: the fit alone")
    ply_merge: float = constrained(2.0, NON_NEGATIVE, doc="model.ply's model (and model.spz's when it is that one) "
                                   "merged, before its refit, into one Gaussian per cube this many pixels wide at "
                                   "the orbit's distance (and per side of the surface): standard viewers draw every "
                                   "Gaussian at least 0.3 px^2 wide, too wide and too opaque where a trained model "
                                   "holds many to a pixel; fewer, wider ones draw nearer the trained model, in "
                                   "smaller files; 0: the trained model's Gaussians")
    ply_metrics: bool = documented(True, "ply_psnr, ply_ssim (model.ply), spz_psnr, spz_ssim (model.spz, where it "
                                   "holds the trained Gaussians and is written), their bound (bound_psnr, bound_ssim: "
                                   "the trained model's images blurred as viewers blur) and model.lit.spz: the whole "
                                   "model gathered on rank 0 and drawn there; false for models larger than one GPU or "
                                   "host")
    existing: str = constrained("refuse", choices=("refuse", "resume", "overwrite"), doc="an output folder that "
                                "holds results: refuse it; resume, keep its complete steps and train the others "
                                "(--resume); overwrite, delete them first (--overwrite)")

    def writes_models(self, step: int) -> bool:
        """Whether step ``step`` writes the model files: its number a multiple of ``every``."""
        return int(step) % self.every == 0


@dataclass
class RunConfig:
    """How and where a run runs, not what it trains: the device and the rasterizer, how the ranks share the
    work and wait for each other, the kernels compiled ahead, the progress shown, and the in situ adaptor's
    queue (insitu.Adaptor, the C and Fortran interface)."""

    device: str = constrained("auto", choices=("auto", "cpu", "cuda"), doc="the training device (--device): cuda, "
                              "one GPU per rank; cpu; or auto, cuda where there is one")
    backend: str = constrained("auto", choices=("auto", "gsplat", "torch"), doc="the rasterizer (--backend): "
                               "gsplat (CUDA), torch (the reference, any device), or auto (gsplat on a CUDA device "
                               "where it imports, else torch)")
    layout: str = constrained("sort-last", choices=("sort-last", "replicated"), doc="how ranks share training: "
                              "sort-last, each rank its block's Gaussians; replicated, each rank the whole model and "
                              "its own views (models that fit one device)")
    transfer: str = constrained("float32", choices=("float32", "bfloat16", "float16"), doc="the type the "
                                "composited colour bands travel between ranks in")
    threads: int = constrained(0, NON_NEGATIVE, at_most=(2**31 - 1, "torch takes a 32-bit count"), doc="torch CPU "
                               "threads per rank; 0: torch's default; in situ on CPU ranks, fewer leave cores to "
                               "the simulation")
    timeout_s: float = constrained(300.0, POSITIVE, at_most=TIMEOUT_S_LIMIT, doc="seconds a collective waits for "
                                   "the other ranks before the job ends with an error: a failed rank never hangs "
                                   "the rest")
    compile_ahead: bool = documented(True, "compile the step's Triton kernels on background threads from the "
                                     "run's start (CUDA)")
    compile_in_child: bool = documented(True, "... the loss's and Adam's first in a child process (its own "
                                        "interpreter, CUDA context and a core); false: on this process's threads "
                                        "(GPUs in exclusive-process mode)")
    progress: bool = documented(True, "show each step's progress (a bar on a terminal, else log lines); false: "
                                "--quiet")
    mode: str = constrained("background", choices=("background", "sync"), doc="the in situ adaptor: background, "
                            "each step trains on a worker thread while the simulation goes on; sync, execute() "
                            "returns once its step is trained")
    queue: int = constrained(1, POSITIVE, doc="in situ, background mode: how many steps may wait to be trained")
    policy: str = constrained("block", choices=("block", "discard"), doc="in situ, when the queue is full: "
                              "block, execute() waits for room (every step is trained); discard, the oldest waiting "
                              "step is dropped (the newest wins)")


@dataclass
class SeriesConfig:
    """What a series of steps computes beyond each step's own training (every command that trains several
    steps, and the in situ adaptor): warm starts."""

    warm_start: bool = documented(False, "a step starts from the previous trained step's model (kept where it is "
                                  "still on the surface, new seeds where it is not) instead of its surface converted "
                                  "afresh; off: on a Gray-Scott series (65% of a warm start new seeds) warm steps "
                                  "started at 21-22 dB against a conversion's 26-27 and ended 4-5 dB under cold "
                                  "steps (docs/log.md)")
    follow_iterations: bool = documented(False, "a warm step whose model starts as a share s of new seeds (surface "
                                         "that moved or is new) trains series.warm_iterations + s * "
                                         "(train.iterations - series.warm_iterations) iterations: an unchanged "
                                         "surface the warm iterations, a wholly new one a cold step's; false: "
                                         "series.warm_iterations alone (new surface is converted into seeds that "
                                         "draw it, as a cold step's are)")
    cold_above: float = constrained(0.85, FRACTION, doc="a warm start whose new seeds are more than this share of "
                                    "its Gaussians (a surface that moved almost wholly) is dropped and the step "
                                    "starts cold: it would train nearly a cold step's iterations from a start no "
                                    "better than fresh seeds, and ended 0.5-1.2 dB under cold (docs/log.md); 1: "
                                    "never")
    cold_every: int = constrained(5, NON_NEGATIVE, doc="every this many steps of a series, one starts cold (a "
                                  "keyframe): a chain of warm starts on a pattern that keeps changing character "
                                  "drifts under its cold steps, by about 0.6 dB after four warm steps and 1.1 dB "
                                  "after nine (docs/log.md), and a cold step ends the drift; 0: only the first "
                                  "step and the rules above start cold")
    warm_iterations: int = constrained(200, POSITIVE, doc="optimiser steps of a warm-started step (at most "
                                       "train.iterations); its new seeds need some; with a quality target "
                                       "(train.psnr_target, train.ssim_target) and train.eval_every, a warm step "
                                       "trains up to train.iterations instead, until the target or "
                                       "train.time_budget_s")
    step_seconds: float | None = constrained(None, POSITIVE, doc="a step's seconds (every step of a series "
                                             "but the first) from its data to its files written: its training stops (metrics' stopped_by: time "
                                             "budget) once it has left only what the previous step took after "
                                             "its training (figures, the standard files' fit, writing; with "
                                             "output.every, the latest step that wrote model files or not, as "
                                             "this one does), looked at "
                                             "every 10 iterations (at least 10 are trained, and a step whose "
                                             "budget is spent before training says so); with "
                                             "train.time_budget_s, the tighter of the two; null: no budget")


@dataclass
class Config:
    input: InputConfig = field(default_factory=InputConfig)
    seeds: SeedConfig = field(default_factory=SeedConfig)
    views: ViewConfig = field(default_factory=ViewConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    series: SeriesConfig = field(default_factory=SeriesConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_sections(cls: type | None = None, prefix: str = "") -> dict[str, type]:
    """Every section of a configuration and every section nested in one, dotted name -> its dataclass
    (``"train"``, ``"train.densify"``, ...), in the order of their fields."""
    out = {}
    for name, hint in typing.get_type_hints(cls or Config).items():
        if dataclasses.is_dataclass(hint):
            out[prefix + name] = hint
            out.update(config_sections(hint, f"{prefix}{name}."))
    return out


def config_keys() -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every key of a configuration, dotted (``"train.densify.start"``) -> (its dataclass field, its type)."""
    out = {}
    for section, cls in config_sections().items():
        hints = typing.get_type_hints(cls)
        out.update({f"{section}.{f.name}": (f, hints[f.name]) for f in dataclasses.fields(cls)
                    if not dataclasses.is_dataclass(hints[f.name])})
    return out


MARCH_STEP_MAX = 1.0                    # cells: a longer step skips whole cells of the field
SUPERSAMPLE_MAX = 8                     # 8 x 8 rays per pixel; more multiplies ray casting time for no visible gain
NESTING_MAX = 32                        # deeper YAML is not a configuration (and would exhaust the parser's stack)
RESOLUTION_MIN = 6                      # the held-out SSIM's 11 x 11 window reaches 5 pixels beyond each pixel
FOV_RANGE = (1.0, 170.0)                # degrees. At 1 the orbit stands 120 bounding radii away, where a float32 ray
                                        # position is exact to 1/16 cell of an 8192^3 grid (the march step: 1/4);
                                        # far narrower, the ground truth comes out wrong, then NaN. At 170 a pinhole
                                        # image stretches its edges 130 times its centre (1 / cos^2(fov / 2)), and
                                        # the surface at the centre covers a few pixels
CLOSEUP_MAX = 100.0                     # close-up cameras stand views.closeup_factors times closer than the orbit:
                                        # at 100 (the held-out sets: 2 and 3) they stand 7 cells from the surface of
                                        # a 256^3 grid at the default field of view, their pixels 1/50 of a cell
SCALE_PX_SIGMAS = 3                     # a Gaussian is drawn out to 3 standard deviations: a floor of
                                        # views.resolution / 6 pixels makes every one cover the whole image
# Keys that say how or where a run runs, not what it computes: a resumed run may change them (the kept
# steps are compared with the new run on every other key). The run section's keys but backend, layout and
# transfer, which change the trained numbers (another rasterizer, other batches per rank, rounded colours);
# which steps are read; where the results go.
RUN_KEYS = frozenset({"run.device", "run.threads", "run.timeout_s", "run.compile_ahead", "run.compile_in_child",
                      "run.progress", "run.mode", "run.queue", "run.policy",
                      "input.steps", "input.every", "input.timeout_s", "output.dir", "output.existing"})
# Keys that moved, old -> new: a configuration that names an old one is refused, saying where it went
# (:func:`moved_keys`), and :func:`upgraded` moves them in a step's config.yaml written before.
MOVED = {
    "train.densify_from": "train.densify.start", "train.densify_until": "train.densify.stop",
    "train.densify_every": "train.densify.every", "train.grad_threshold": "train.densify.grad_threshold",
    "train.prune_opacity": "train.densify.prune_opacity", "train.opacity_reset_every": "train.densify.reset_every",
    "train.max_gaussians": "train.densify.max_gaussians",
    "train.backend": "run.backend", "train.progress": "run.progress",
    **{f"parallel.{k}": f"run.{k}" for k in ("timeout_s", "device", "transfer", "threads", "compile_ahead",
                                             "compile_in_child", "layout")},
    "insitu.mode": "run.mode", "insitu.queue": "run.queue", "insitu.policy": "run.policy",
    "insitu.warm_start": "series.warm_start", "insitu.warm_iterations": "series.warm_iterations",
}
MOVED_SECTIONS = {"parallel": "run", "insitu": "run and series"}  # sections that are no more: where their keys went


INT_MAX = 2**63 - 1                     # an integer key's largest value: what numpy and torch hold


def _got(value: Any) -> str:
    """What came, in an error message: ``null`` for None, else the type and the value."""
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """Return ``value`` converted to ``hint`` where that is lossless, else raise ConfigError."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and args[0] is not str:
            value = [value]                     # a single iso value for a list of them
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {_got(value)}")
        return [_check_type(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {_got(value)}")
    if hint is int:
        out = None
        if isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif isinstance(value, float) and value.is_integer():
            out = int(value)
        if out is None:
            raise ConfigError(f"{name}: expected an integer, got {_got(value)}")
        if not -INT_MAX - 1 <= out <= INT_MAX:
            raise ConfigError(f"{name}: expected an integer of 64 bits (at most 2**63 - 1 = {INT_MAX}), got {value!r}")
        return out
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):              # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {_got(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: expected a string, got {_got(value)}")
    if dataclasses.is_dataclass(hint):          # a nested section (train.densify)
        return _section(name, hint, value)
    raise ConfigError(f"{name}: unsupported type {hint}")  # pragma: no cover


def same_value(key: str, a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same value of the dotted key ``key`` once typed as it holds them (``1`` and
    ``[1.0]`` for a list of numbers); values that the key cannot take are compared as they are."""
    hint = config_keys().get(key, (None, None))[1]
    try:
        return hint is not None and _check_type(key, a, hint) == _check_type(key, b, hint)
    except ConfigError:
        return a == b


def _section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {_got(values)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) {', '.join(map(str, unknown))}; "
                          f"expected some of {', '.join(sorted(known))}")
    out = cls()
    for key, value in values.items():
        setattr(out, key, _check_type(f"{name}.{key}", value, hints[key]))
    return out


def validate(cfg: Config) -> Config:
    """Check ranges and choices; returns ``cfg`` or raises ConfigError."""
    for key, (f, _) in config_keys().items():
        value = functools.reduce(getattr, key.split("."), cfg)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        choices, checks = f.metadata.get("choices"), f.metadata.get("checks", ())
        if choices and value not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
        if value is None:                       # "not set"
            continue
        if POSITIVE in checks and value <= 0:
            raise ConfigError(f"{key}: expected a value > 0, got {value!r}")
        if NON_NEGATIVE in checks and value < 0:
            raise ConfigError(f"{key}: expected a value >= 0, got {value!r}")
        if FRACTION in checks and not 0 <= value <= 1:
            low = "(" if POSITIVE in checks else "["
            raise ConfigError(f"{key}: expected a value in {low}0, 1], got {value!r}")
        if OPEN_FRACTION in checks and not 0 < value < 1:
            raise ConfigError(f"{key}: expected a value in (0, 1), got {value!r}")
        for op, limit in (("<", f.metadata.get("below")), ("<=", f.metadata.get("at_most"))):
            if limit is not None and not (value < limit[0] if op == "<" else value <= limit[0]):
                bound = f"{limit[0]:g}" if isinstance(limit[0], float) else limit[0]
                raise ConfigError(f"{key}: expected a value {op} {bound} ({limit[1]}), got {value!r}")
    if not cfg.input.iso:
        raise ConfigError("input.iso: expected at least one iso value, got an empty list")
    twice = sorted({v for v in cfg.input.iso if cfg.input.iso.count(v) > 1})
    if twice:
        raise ConfigError(f"input.iso: expected distinct iso values, got {', '.join(f'{v:g}' for v in twice)} more than "
                          f"once in {cfg.input.iso} (the same surface would be seeded twice)")
    _check_output_dir(cfg.output.dir)
    if cfg.views.resolution < RESOLUTION_MIN:
        raise ConfigError(f"views.resolution: expected at least {RESOLUTION_MIN} pixels (the held-out SSIM's 11 x 11 "
                          f"window reaches 5 pixels beyond each one), got {cfg.views.resolution}")
    if cfg.views.test_every < 2:
        raise ConfigError(f"views.test_every: expected at least 2 (every k-th view is held out for evaluation; "
                          f"{cfg.views.test_every} holds out every view and leaves none to train on)")
    if cfg.train.seed >= 2**32:
        raise ConfigError(f"train.seed: expected 0 <= seed < 2**32, got {cfg.train.seed}")
    if cfg.views.supersample > SUPERSAMPLE_MAX:
        raise ConfigError(f"views.supersample: expected 1..{SUPERSAMPLE_MAX} rays per pixel and axis, "
                          f"got {cfg.views.supersample} ({cfg.views.supersample ** 2} rays per pixel)")
    if cfg.seeds.fill and cfg.seeds.density > 0:
        raise ConfigError(f"seeds.fill: true starts at seeds.budget ({cfg.seeds.budget}) whatever the surface's size, "
                          f"and seeds.density={cfg.seeds.density:g} asks for that many Gaussians per pixel of it: "
                          f"set seeds.density=0 with seeds.fill=true, or leave seeds.fill false")
    densify = cfg.train.densify
    if densify.prune_opacity == 0 and densify.reset_every > 0:
        raise ConfigError(f"train.densify.prune_opacity: expected a value > 0 while train.densify.reset_every "
                          f"({densify.reset_every}) resets opacities to twice it (0 leaves every Gaussian "
                          f"transparent for good); to prune nothing, set train.densify.reset_every=0 too")
    if cfg.train.sh_degree > 3:
        raise ConfigError(f"train.sh_degree: expected 0..3, got {cfg.train.sh_degree}")
    if cfg.output.sh_degree is not None and cfg.output.sh_degree > 3:
        raise ConfigError(f"output.sh_degree: expected 0..3 or null, got {cfg.output.sh_degree}")
    if not cfg.views.closeup_factors or not all(1 <= f <= CLOSEUP_MAX for f in cfg.views.closeup_factors):
        raise ConfigError(f"views.closeup_factors: expected one or more factors in [1, {CLOSEUP_MAX:g}] (how many "
                          f"times closer than the orbit; closer still, a camera stands within a few cells of the "
                          f"surface and its pixels are hundredths of a cell), got {cfg.views.closeup_factors}")
    if cfg.views.march_step > MARCH_STEP_MAX:
        raise ConfigError(f"views.march_step: expected a step in (0, {MARCH_STEP_MAX:g}] cells (a longer one skips "
                          f"whole cells of the field), got {cfg.views.march_step:g}")
    lo, hi = FOV_RANGE
    if not lo <= cfg.views.fov_deg <= hi:
        raise ConfigError(f"views.fov_deg: expected a field of view in [{lo:g}, {hi:g}] degrees (narrower, the "
                          f"orbit stands so far away that float32 cannot place its rays; wider, the pinhole image "
                          f"stretches its edges and leaves the surface a few pixels), got {cfg.views.fov_deg:g}")
    widest = cfg.views.resolution / (2 * SCALE_PX_SIGMAS)
    if cfg.train.min_scale_px > widest:
        raise ConfigError(f"train.min_scale_px: expected at most views.resolution / {2 * SCALE_PX_SIGMAS} = "
                          f"{widest:g} pixels (a floor on each Gaussian's standard deviation, in pixels of the nearest "
                          f"view that sees it; at views.resolution / 6 each Gaussian's 3-sigma disc spans that whole "
                          f"image), got {cfg.train.min_scale_px:g}")
    for key in ("background", "surface_color"):
        v = getattr(cfg.views, key)
        if len(v) != 3 or not all(0.0 <= c <= 1.0 for c in v):
            raise ConfigError(f"views.{key}: expected 3 values in [0, 1], got {v!r}")
    if cfg.input.dtype is not None:
        import numpy as np

        try:
            kind = np.dtype(cfg.input.dtype).kind
        except TypeError:
            kind = None
        if kind is None or kind not in "uif":
            raise ConfigError(f"input.dtype: expected an integer or float type such as uint8, int16, float32, "
                              f"got {cfg.input.dtype!r}")
    from insitu.volume import check_geometry    # numpy: on first use, as above

    check_geometry(cfg.input.origin, cfg.input.spacing, names=("input.origin", "input.spacing"), error=ConfigError)
    if cfg.input.dims is not None and (len(cfg.input.dims) != 3 or min(cfg.input.dims) <= 0):
        raise ConfigError(f"input.dims: expected 3 positive integers (x, y, z), got {cfg.input.dims!r}")
    if cfg.views.count <= cfg.views.test_every and cfg.views.count < 2:
        raise ConfigError(f"views.count: expected at least 2 views (train and test), got {cfg.views.count}")
    return cfg


def _check_output_dir(name: str) -> None:
    """``output.dir`` must name a folder, in UTF-8 (the report names it, and HTML is UTF-8)."""
    if not name:
        raise ConfigError("output.dir: expected a folder name, got '' (an empty --out would write into the "
                          "current folder; give --out . for that)")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"output.dir {os.fsencode(name)!r}: the name is not UTF-8 text; give a folder name in "
                          "UTF-8 (the report names it)") from None


def check_backend(cfg: Config, device_type: str, gsplat_error: str | None) -> None:
    """ConfigError when ``run.backend`` cannot rasterize on the run's device (``device_type``: "cpu"
    or "cuda"); ``gsplat_error``: why gsplat does not import, or None."""
    if cfg.run.backend != "gsplat":
        return
    if device_type != "cuda":
        raise ConfigError(f"run.backend: gsplat needs a CUDA device, and this run trains on {device_type} "
                          f"(run.device {cfg.run.device!r}); use auto or torch")
    if gsplat_error is not None:
        raise ConfigError(f"run.backend: gsplat does not import ({gsplat_error}); install it, or use auto or torch")


def from_dict(values: dict[str, Any]) -> Config:
    """Build a validated Config from nested mappings (as read from YAML)."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(values).__name__}")
    moved = moved_keys(values)
    if moved:
        raise ConfigError(f"config: {'; '.join(f'{old} is now {new}' for old, new in moved)}")
    known = {f.name: f.type for f in dataclasses.fields(Config)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"config: unknown section(s) {', '.join(map(str, unknown))}; "
                          f"expected some of {', '.join(sorted(known))}")
    hints = typing.get_type_hints(Config)
    cfg = Config()
    for name, sub in values.items():
        setattr(cfg, name, _section(name, hints[name], sub))
    return validate(cfg)


def moved_keys(values: dict[str, Any]) -> list[tuple[str, str]]:
    """The keys of :data:`MOVED` that nested mappings of sections (as read from YAML) set, as (old key, where
    it is now); a section of :data:`MOVED_SECTIONS` that sets none of them, as (the section, where its keys
    went)."""
    out = [(old, new) for old, new in MOVED.items() if _holds(values, old)]
    return out + [(old, new) for old, new in MOVED_SECTIONS.items()
                  if old in values and not any(o.startswith(f"{old}.") for o, _ in out)]


def _holds(values: Any, dotted: str) -> bool:
    """Whether nested mappings ``values`` set the dotted key (to anything, null too)."""
    *path, name = dotted.split(".")
    for part in path:
        values = values.get(part) if isinstance(values, dict) else None
    return isinstance(values, dict) and name in values


def upgraded(values: dict[str, Any]) -> dict[str, Any]:
    """Nested mappings of sections with the keys of :data:`MOVED` moved to their new places (a step's
    ``config.yaml`` written before they moved); the rest as it was."""
    out = _merged({}, values)
    for old, new in MOVED.items():
        if _holds(out, old):
            *path, name = old.split(".")
            out = merge(out, {new: functools.reduce(dict.get, path, out).pop(name)})
    return {k: v for k, v in out.items() if not (k in MOVED_SECTIONS and v == {})}


def merge(base: dict[str, Any], dotted: dict[str, Any], *, keep_null: bool = False) -> dict[str, Any]:
    """Return ``base`` with ``{"train.iterations": 10}``-style overrides applied (``"train.densify.start"``
    one level further down). A value None is skipped (not given), or with ``keep_null`` set as null
    (``--set input.color_var=null``: validation then refuses it for a key that must have a value)."""
    out = _merged({}, base)
    for key, value in dotted.items():
        if value is None and not keep_null:
            continue
        *path, name = key.split(".")
        if not path or not all(path) or not name:
            raise ConfigError(f"override {key!r}: expected SECTION.KEY")
        node = out
        for i, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path[:i + 1])}: expected a mapping of keys, got {node!r}")
        node[name] = _merged({}, value) if isinstance(value, dict) else value
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the values of ``over`` over its own, nested mappings merged key by key (copies: neither
    is changed)."""
    out = {k: _merged({}, v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, dict):
            out[key] = _merged(out[key] if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                defaults: dict[str, Any] | None = None, *, keep_null: bool = False) -> Config:
    """Read a YAML file (optional), apply dotted overrides, validate.

    Precedence: ``overrides`` > the file > ``defaults`` (dotted, e.g. a command's own) > built-in defaults.
    An override None is skipped, or with ``keep_null`` sets its key to null (see :func:`merge`).
    """
    base = _merged(merge({}, defaults or {}), config_file_values(path))
    return from_dict(merge(base, overrides or {}, keep_null=keep_null))


def config_file_values(path: str | Path | None) -> dict[str, Any]:
    """The sections a YAML configuration file sets, as written (``{}`` without a file); a ConfigError when
    it cannot be one (see :func:`_read_config`) or is not a mapping of sections."""
    if path is None:
        return {}
    where = f"config file {_shown(path)}"
    values = _yaml(_read_config(path, where), where) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of sections, got {type(values).__name__}")
    return values


CONFIG_BYTES_MAX = 1 << 20              # a configuration is a few kB; the YAML parser takes seconds a MiB
FILE_KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
              stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _shown(path: str | Path) -> str:
    """``path`` as an error message names it: whole, or its start and length when longer than a file name
    can be (255 bytes), so that the message stays one line a terminal shows."""
    name = os.fspath(path)
    return name if len(name) <= 255 else f"{name[:60]}... ({len(name)} characters)"


def _read_config(path: str | Path, where: str) -> str:
    """The text of the configuration file ``path``, or a ConfigError (``where`` names it) saying why it cannot
    be one: absent, a name the system refuses, not a regular file (a folder, a FIFO, a device), unreadable,
    larger than CONFIG_BYTES_MAX, not UTF-8."""
    if os.fspath(path) == "":
        raise ConfigError("config file: expected a file name, got ''")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{where}: does not exist") from None
    except OSError as e:                        # a name too long, a component that is a file, a link loop
        raise ConfigError(f"{where}: cannot be opened ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{where}: is a directory, expected a YAML file")
    if not stat.S_ISREG(mode):                  # reading a device or a FIFO may never end
        kind = FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ConfigError(f"{where}: is {kind}, expected a YAML file (a regular file)")
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_BYTES_MAX + 1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror})") from None
    if len(data) > CONFIG_BYTES_MAX:
        raise ConfigError(f"{where}: holds {os.stat(path).st_size} bytes, expected a YAML configuration of at most "
                          f"{CONFIG_BYTES_MAX} bytes (1 MiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not a text file (byte {e.start} is not UTF-8); expected YAML") from None


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


class _AliasFound(yaml.YAMLError):
    """An alias (``*name``) in a configuration's YAML."""


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases: a few hundred bytes of nested aliases stand for billions
    of values (each level repeats the one below), which every walk of the document would expand."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasFound(f"*{event.anchor} on line {event.start_mark.line + 1}")
        return super().compose_node(parent, index)


def _check_repeated_keys(node: yaml.Node, where: str, path: str = "") -> None:
    """ConfigError when a mapping of the YAML document ``node`` (composed, not yet constructed) holds a key
    twice: YAML keeps the last one without a word, so a second ``train:`` section would drop the first."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_repeated_keys(item, where, path)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        line = key.start_mark.line + 1
        if isinstance(key, yaml.ScalarNode):
            name = (key.tag, key.value)
            if name in seen:
                what, fix = (f"key {path}{key.value}", "give it once") if path else (f"section {key.value}",
                                                                                   "merge them into one")
                raise ConfigError(f"{where}: {what} appears twice (lines {seen[name]} and {line}); YAML would keep "
                                  f"only the second: {fix}")
            seen[name] = line
            _check_repeated_keys(value, where, f"{path}{key.value}.")
        else:
            _check_repeated_keys(value, where, path)


def _yaml(text: str, where: str, path: str = "") -> Any:
    """``yaml.safe_load(text)`` with every failure (syntax, tags, binary, nesting, aliases, a key given twice) as a
    ConfigError; ``path``: the dotted key the text is the value of (``"train.densify."``), empty for a file."""
    if "\0" in text:
        raise ConfigError(f"{where}: not a text file (it holds NUL bytes); expected YAML")
    depth = level = 0                           # flow nesting, counted before the parser recurses into it
    for c in text:
        level += (c in "[{") - (c in "]}")
        depth = max(depth, level)
    if depth > NESTING_MAX:
        raise ConfigError(f"{where}: nested {depth} levels deep, expected at most {NESTING_MAX}")
    loader = _NoAliasLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_repeated_keys(node, where, path)
        value = loader.construct_document(node) if node is not None else None
    except _AliasFound as e:
        raise ConfigError(f"{where}: YAML aliases are not accepted in a configuration (found {e}); write the "
                          "values out") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (expected at most {NESTING_MAX} levels)") from None
    finally:
        loader.dispose()
    if _depth(value) > NESTING_MAX:
        raise ConfigError(f"{where}: nested {_depth(value)} levels deep, expected at most {NESTING_MAX}")
    return value


GAUSSIAN_BYTES = 4 * (3 * 59 + 11)     # float32 parameters (SH degree 3), two Adam moments, the 11 non-SH gradients
SH_VIEW_BYTES = 4 * (16 + 9 + 3 + 3 + 3 + 3)  # per Gaussian and view of a batch: the SH colours' basis, derivatives,
                                        # colour, value before the clamp and two gradients (insitu.render.shading)
SH_GRADIENT_BYTES = 4 * 48             # the SH coefficients' gradient, written out where replicas all-reduce it
RAY_BYTES = 300                         # ray casting, per ray marched at once (groundtruth.raycast)
CHUNK_RAYS = 1 << 22                    # rays marched at once


def memory_estimate(cfg: Config, ranks: int = 1) -> dict[str, int]:
    """Bytes one of ``ranks`` ranks needs at least, per part, for a step trained with ``cfg``.

    ground_truth: the rank's band of every view (float16 RGBA), and with ``run.layout:
                  replicated`` the whole views too;
    ray_casting:  one chunk of views ray cast and composited (float32 RGBA, several copies);
    rendering:    one batch of views rendered, composited and differentiated (float32);
    loss:         the SSIM kernels' planes for one batch (float32: 15 moments and 9 saved derivatives per
                  pixel of the rank's band and its halo, or of the whole views);
    pixel_term:   the squared error's temporaries (``train.pixel_loss`` l2: difference, its size, the
                  foreground's share, square, ground-truth alpha and mask, 13 float32 per pixel of the rank's
                  band or of the whole views);
    gaussians:    the rank's share of the initial Gaussians (all of them, replicated) with optimiser state, gradients
                  and the SH colours' per-view factors of a batch (the SH gradient stays factored, except in the
                  replicated layout); the budget is only reached with ``seeds.fill``, without it by the surface's
                  vertices.
    """
    vc, res = cfg.views, cfg.views.resolution
    pixels = res * res
    band = -(-res // ranks) * res
    chunk = max(1, CHUNK_RAYS // pixels)
    rays = min(chunk * pixels * vc.supersample ** 2, CHUNK_RAYS)
    replicated = cfg.run.layout == "replicated" and ranks > 1   # every rank the whole images and model
    return {
        "ground_truth": vc.count * (band + (pixels if replicated else 0)) * 4 * 2,
        "ray_casting": rays * RAY_BYTES + 4 * chunk * pixels * 4 * 4,
        "rendering": 8 * cfg.train.batch * pixels * 4 * 4,
        "loss": cfg.train.batch * (pixels if replicated or ranks == 1 else band + 10 * res) * (15 + 9) * 4,
        "pixel_term": (cfg.train.batch * (pixels if replicated else band) * 13 * 4
                       if cfg.train.pixel_loss == "l2" else 0),
        "gaussians": (cfg.seeds.budget // (1 if replicated else ranks) if cfg.seeds.fill else 0)
        * (GAUSSIAN_BYTES + cfg.train.batch * SH_VIEW_BYTES + (SH_GRADIENT_BYTES if replicated else 0)),
    }


def check_memory(cfg: Config, ranks: int, available: int, where: str = "this machine") -> None:
    """Raise ConfigError when ``cfg`` needs more than ``available`` bytes per rank (``memory_estimate``)."""
    parts = memory_estimate(cfg, ranks)
    need = sum(parts.values())
    if need > available:
        gib = 2.0 ** 30
        detail = ", ".join(f"{k.replace('_', ' ')} {v / gib:.3g} GiB" for k, v in parts.items() if v)
        raise ConfigError(f"views.resolution={cfg.views.resolution}, views.count={cfg.views.count}, "
                          f"views.supersample={cfg.views.supersample}, train.batch={cfg.train.batch}, "
                          f"seeds.budget={cfg.seeds.budget}{' with seeds.fill' if cfg.seeds.fill else ''} "
                          f"on {ranks} rank(s) need at least {need / gib:.3g} GiB per rank ({detail}); "
                          f"{where} has {available / gib:.3g} GiB")


def config_hash(cfg: Config) -> str:
    """A hash of the validated configuration: ranks that compare it know they run the same one."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def config_differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts (``Config.to_dict()``)."""
    out = []
    for key in sorted(set(a) | set(b), key=str):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}")
    return out


def config_value(values: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key (``"views.count"``) of nested dicts (``Config.to_dict()``); None when absent."""
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``SECTION.KEY=VALUE`` (VALUE as YAML; ``train.densify.start=...`` for a nested section's key) from
    the command line."""
    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.iterations=500")
    value = _yaml(raw, f"--set {text!r}", f"{key.strip()}.")
    if isinstance(value, str):                  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    return key.strip(), value


# ------------------------------------------------------------------------------ the configuration's documentation

YAML_COMMENT_COLUMN = 41                # examples/config.yaml: where a key's comment starts
DOC_WIDTH = 118                         # ... and the column its lines wrap before
TYPE_WORDS = {int: ("integer", "integers"), float: ("number", "numbers"), str: ("text", "texts"),
              bool: ("true or false", "true or false")}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _yaml_value(value: Any) -> str:
    """``value`` on one line of YAML (flow style), as a configuration file writes it."""
    return yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1).splitlines()[0]


def config_yaml() -> str:
    """The text of ``examples/config.yaml``: every key of every section with its default, its doc as a comment."""
    lines = ["# insitu-gs configuration: every key with its default. Flags on the command line",
             "# override the file; `--set SECTION.KEY=VALUE` overrides any key. Written by",
             "# `python -m insitu.config` from insitu/config.py; docs/configuration.md lists the values each takes."]
    for section, cls in typing.get_type_hints(Config).items():
        lines += ["", f"{section}:", *_yaml_keys(cls, "  ")]
    return "\n".join(lines) + "\n"


def _yaml_keys(cls: type, indent: str) -> list[str]:
    """The lines of ``cls``'s keys in examples/config.yaml, at ``indent``: a nested section as its own block."""
    import textwrap

    def commented(key: str, doc: str) -> list[str]:
        text = textwrap.wrap(doc, DOC_WIDTH - YAML_COMMENT_COLUMN - 2, break_on_hyphens=False)
        return [f"{key.ljust(YAML_COMMENT_COLUMN - 1)} # {text[0]}",
                *(f"{'':{YAML_COMMENT_COLUMN}}# {t}" for t in text[1:])]

    lines = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            lines += commented(f"{indent}{f.name}:", " ".join(hint.__doc__.split()))
            lines += _yaml_keys(hint, indent + "  ")
        else:
            lines += commented(f"{indent}{f.name}: {_yaml_value(_default(f))}", f.metadata["doc"])
    return lines


def _allowed(f: dataclasses.Field, hint: Any) -> str:
    """The values ``f`` (a field of type ``hint``) takes, in words, from its type and declared constraints."""
    args = typing.get_args(hint)
    optional = type(None) in args
    kind = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(kind) is list:
        word = f"list of {TYPE_WORDS[typing.get_args(kind)[0]][1]}"
    else:
        word = TYPE_WORDS[kind][0]
    meta = f.metadata
    if meta.get("choices"):
        *rest, last = [f"`{c}`" for c in meta["choices"]]
        word = f"{', '.join(rest)} or {last}"
    checks = meta.get("checks", ())
    parts = [word + "".join(f" {c}" for c in (POSITIVE, NON_NEGATIVE, OPEN_FRACTION) if c in checks
                            and not (c == POSITIVE and FRACTION in checks))]
    if FRACTION in checks:
        parts[0] += f" in {'(' if POSITIVE in checks else '['}0, 1]"
    for op, limit in (("<", meta.get("below")), ("<=", meta.get("at_most"))):
        if limit is not None:
            bound = f"{limit[0]:g}" if isinstance(limit[0], float) else limit[0]
            parts.append(f"{op} {bound} ({limit[1]})")
    if optional:
        parts.append("or null")
    return ", ".join(parts)


def config_reference() -> str:
    """The text of ``docs/configuration.md``: a table per section of every key's default, values and meaning."""
    import textwrap

    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    intro = ("Every key of a configuration, section by section: its default, the values it takes and what it does. "
             "A YAML file (`--config FILE`; `examples/config.yaml` holds every key with its default) sets any of "
             "them, `--set SECTION.KEY=VALUE` one on the command line (`--set train.densify.start=300` for a key of "
             "a nested section), and some have a flag of their own (named in their row). Every value is checked "
             "before anything is computed.",
             "Written by `python -m insitu.config` from `insitu/config.py`, where each key's text is declared with "
             "its field; `tests/test_config.py` checks that this file and `examples/config.yaml` are current.")
    lines = ["# Configuration"]
    for paragraph in intro:
        lines += ["", *textwrap.wrap(paragraph, DOC_WIDTH, break_on_hyphens=False)]
    for section, cls in config_sections().items():
        hints = typing.get_type_hints(cls)
        heading = "###" if "." in section else "##"
        lines += ["", f"{heading} {section}", "", *textwrap.wrap(" ".join(cls.__doc__.split()), DOC_WIDTH), "",
                  "| key | default | values | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{section}.{f.name}` | `{cell(_yaml_value(_default(f)))}` | {cell(_allowed(f, hints[f.name]))} "
                  f"| {cell(f.metadata['doc'])} |" for f in dataclasses.fields(cls)
                  if not dataclasses.is_dataclass(hints[f.name])]
    return "\n".join(lines) + "\n"


GENERATED = {"examples/config.yaml": config_yaml, "docs/configuration.md": config_reference}


def write_generated(root: str | Path) -> None:
    """Write the files of :data:`GENERATED` under the checkout ``root``."""
    for name, text in GENERATED.items():
        Path(root, name).write_text(text(), encoding="utf-8")


if __name__ == "__main__":              # python -m insitu.config [ROOT]: rewrite them after changing a key
    import sys

    write_generated(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
