"""The report of an output directory: ``OUT/report.html`` with an interactive splat viewer, and ``insitu view``.

The page shows, for every ``step_XXXXXX`` folder, its model in a 3D viewer (orbit, zoom, and the
step's orbit cameras; the line under it: :func:`shown_model`), a timestep slider with a play button that switches
between the steps' models, the held-out images (ground truth | render, and in the standard files' light), plots
(uPlot, vendored like the viewer): the surface's held-out PSNR/SSIM over the iterations of each step, ending at the
step's final figures (:func:`training_curve`), and over the timesteps its PSNR/SSIM on the orbit and the close-up
sets, the standard files' beside their bound, the Gaussians, the iterations, the seconds per stage
(:func:`stage_seconds`) and the bytes written where recorded; then the metrics tables, one per group of columns
(:data:`TABLE_COLUMNS`), what each file of a step folder holds (:data:`FILE_NOTES`) and per step how far the
standard files are under their bound (:func:`standard_files_text`). Every part follows the page's width. It is rewritten after every step; served, the page polls
``report.json`` and shows new steps as a running simulation writes them.

The viewer is Spark (``@sparkjsdev/spark``, on three.js), vendored as built in ``insitu/output/viewer/vendor``
and copied next to the report (``OUT/viewer/``), so the page needs no network. It reads each
step's ``model.spz`` (:mod:`insitu.output.webmodel`) and the step's cameras (``cameras.json``), converted
once, here, from the project's convention (:mod:`insitu.groundtruth.views`: world-to-camera, OpenCV axes) to
three.js's (:func:`viewer_camera`). Browsers load ES modules and models only over HTTP, not from
``file://``: ``insitu view OUT`` serves the report on localhost (:func:`make_server`): the report's
own files only, under a random token that the URL it prints holds, so that other users of a shared
login node, who can reach the port too, cannot read them. Those users can open connections
without the token, so the server bounds what they hold: each connection is closed after
:data:`CONNECTION_TIMEOUT` without progress, at most :data:`MAX_CONNECTIONS` are served at once (fewer
under a low descriptor limit, :func:`connection_bound`), and at the bound the one idle the longest
makes room for a new one, so idle or half-sent connections cannot keep a request out.
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import html
import http.server
import json
import math
import os
import re
import resource
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from itertools import count
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import numpy as np

from insitu.config import config_file_values, from_dict, upgraded
from insitu.errors import ConfigError
from insitu.output.files import atomic_write, plain, read_csv, write_json
from insitu.output.folder import STEP_DIR
from insitu.render.lighting import FIXED_LIGHT_VIEW, HEADLIGHT
from insitu.render.rendering import STANDARD_EPS2D
from insitu.output.webmodel import spz_count
from insitu.training.appearance import spz_blur

VIEWER_SOURCE = Path(__file__).resolve().parent / "viewer"
VIEWER_DIR = "viewer"                 # the assets' folder inside OUT
_SKIP_ASSETS = {"update.sh"}


# ---------------------------------------------------------------------------------------------
# What the page says: the step folder's files, and the metrics table's headings


# the files of a step folder that the page's 3D view loads: the first that is there
VIEWER_MODELS = ("model.lit.spz", "model.spz")
VIEWER_NOTE = ("the 3D view above draws this file where there is no model.lit.spz: its colours as they are")
LIT_NOTE = ("the 3D view above draws this file: the base colours shaded by a light that the light sliders change")
# What each file of a step folder holds, in the order the page lists them; a file not named here is not
# linked. The wording says what a file is for, so that it holds while the formats change.
FILE_NOTES = {
    "model.ply": "the model for standard 3D Gaussian splatting viewers and tools (the 3DGS .ply layout), fitted "
                 "as they draw it; a lit model's is lit by a fixed key and fill light, so that it looks the same "
                 "in every viewer and from every side (its figures, model.ply in the table, are against a ground "
                 "truth lit so)",
    "model.spz": "the model for web splat viewers (the compressed SPZ format): of a model trained antialiased "
                 "(the default) every trained Gaussian, lit as model.ply and fitted as such viewers draw it, its "
                 "header saying 'draw antialiased' as Spark does by default (in viewers that draw every Gaussian "
                 "as opaque, model.ply looks better); else "
                 "model.ply's model; in SPZ's axes (x right, y up, z back) and the step's frame (cameras.json's "
                 "frame gives world units)",
    "model.lit.spz": "the lit model as trained (a base colour and a normal per Gaussian, in the step's frame): "
                     "not plain 3DGS, for viewers that relight it with the headlight, as this page does: the "
                     "closest to the ground truth",
    "views/*.png": "held-out views: ground truth | render; *_fixed_light.png: the same views in the standard files' "
                   "light (the fixed key and fill light of model.ply and model.spz): ground truth | model.spz | "
                   "model.ply as their viewers draw them (model.spz's where it holds another model), to compare "
                   "another viewer's picture with (cameras.json holds each view's camera)",
    "model.glb": "model.spz's Gaussians as glTF 2.0 (KHR_gaussian_splatting, +Y up, world units through its node; "
                 "output.glb): for glTF viewers; viewer/gltf.html draws it with PlayCanvas",
    "cameras.json": "the step's orbit cameras (the 3D view's camera list)",
    "metrics.json": "every figure of the step, with its evaluations during training",
    "config.yaml": "the configuration the step ran with",
}

# The metrics table: (group, ((metrics.csv column, heading, kind), ...)); kind: "dB", "ratio", "bytes" or ""
# (as written). Each group is a table of its own, its step column first, and holds at most MAX_GROUP columns, so
# that every table fits a phone's width and the tables flow side by side on a wide screen. Columns empty in every
# row are left out; a column named nowhere here is shown under "Other" with its own name, so that a new figure is
# never hidden. Every column a step writes has a heading here (tests/test_pipeline.py checks a step's row).
MAX_GROUP = 6
_ORBIT, _NEAR2, _NEAR3, _OFF = "orbit", "close-ups 2x", "close-ups 3x", "off the orbit"


def _files_group(title: str, suffix: str, kind: str) -> tuple[str, tuple]:
    """A group of the standard files' figures (``suffix``: the metric after the file's prefix), each file beside
    their bound."""
    return (title, tuple((f"{prefix}_{suffix}", heading, kind) for prefix, heading in
                         (("bound", "bound"), ("spz", "model.spz"), ("ply", "model.ply"))))


TABLE_COLUMNS = (
    ("Step", (("time", "simulation time", ""), ("status", "status", ""), ("reason", "reason", ""))),
    ("Surface PSNR (dB)", (("psnr_foreground", _ORBIT, "dB"), ("psnr_foreground_near2", _NEAR2, "dB"),
                           ("psnr_foreground_near3", _NEAR3, "dB"), ("psnr_foreground_off", _OFF, "dB"),
                           ("psnr_foreground_initial", "before training", "dB"))),
    ("Surface SSIM", (("ssim_foreground", _ORBIT, "ratio"), ("ssim_foreground_near2", _NEAR2, "ratio"),
                      ("ssim_foreground_near3", _NEAR3, "ratio"), ("ssim_foreground_off", _OFF, "ratio"))),
    _files_group("Standard files: surface PSNR, orbit (dB)", "psnr_foreground", "dB"),
    _files_group("Standard files: surface PSNR, close-ups 2x (dB)", "psnr_foreground_near2", "dB"),
    _files_group("Standard files: surface PSNR, close-ups 3x (dB)", "psnr_foreground_near3", "dB"),
    _files_group("Standard files: surface SSIM, orbit", "ssim_foreground", "ratio"),
    _files_group("Standard files: surface SSIM, close-ups 2x", "ssim_foreground_near2", "ratio"),
    _files_group("Standard files: surface SSIM, close-ups 3x", "ssim_foreground_near3", "ratio"),
    _files_group("Standard files: whole image PSNR, orbit (dB)", "psnr", "dB"),
    _files_group("Standard files: whole image SSIM, orbit", "ssim", "ratio"),
    ("Whole image PSNR (dB)", (("psnr", _ORBIT, "dB"), ("psnr_near2", _NEAR2, "dB"), ("psnr_near3", _NEAR3, "dB"),
                               ("psnr_off", _OFF, "dB"), ("psnr_initial", "before training", "dB"),
                               ("psnr_white", "on white", "dB"))),
    ("Whole image", (("ssim", "SSIM", "ratio"), ("lpips", "LPIPS", "ratio"))),
    ("Gaussians", (("gaussians_initial", "initial", ""), ("gaussians", "trained", ""),
                   ("ply_gaussians", "model.ply", ""))),
    ("Gaussians of a warm start", (("gaussians_stale", "gone: off the surface", ""),
                                   ("gaussians_dropped", "gone: faint or thinned", ""),
                                   ("gaussians_new", "new seeds", ""),
                                   ("gaussians_moved", "kept where the surface moved", ""))),
    ("Training", (("iterations", "iterations", ""), ("stopped_by", "stopped by", ""),
                  ("target_reached_at", "target met at", ""), ("sh_degree", "SH degree", ""),
                  ("color_model", "colours", ""))),
    ("Series", (("warm_chain", "warm starts in a row", ""), ("cold_restart", "started cold: new seeds", "ratio"))),
    ("Seconds", (("seeds_seconds", "seeds", ""), ("ground_truth_seconds", "ground truth", ""),
                 ("train_seconds", "training", ""), ("ply_fit_seconds", "files' fit", ""),
                 ("total_seconds", "total before writing", ""))),
    ("Seconds writing", (("model_write_seconds", "model.ply", ""), ("export_seconds", "the rest", ""),
                         ("writing_wait_seconds", "waited for by the next step", ""))),
    ("Seconds, within those above", (("color_init_seconds", "seed colours", ""), ("scene_seconds", "ray casting", ""),
                                     ("evaluation_seconds", "evaluation", ""),
                                     ("initial_evaluation_seconds", "first evaluation", ""))),
    ("Files", (("model_bytes", "model.ply", "bytes"), ("web_model_bytes", "model.spz", "bytes"),
               ("glb_model_bytes", "model.glb", "bytes"), ("lit_model_bytes", "model.lit.spz", "bytes"),
               ("bytes_written", "written", "bytes"))),
    ("Run", (("ranks", "ranks", ""), ("device", "device", ""), ("test_views", "held-out views", ""),
             ("eps2d", "blur (px\u00b2)", ""), ("antialiased", "antialiased", ""),
             ("peak_gpu_memory_gb", "peak GPU memory (GB)", ""))),
)


def _fmt(value: str, kind: str = "") -> str:
    """A metrics.csv cell as the table shows it (``kind``: see :data:`TABLE_COLUMNS`): yes and no for a truth
    value."""
    if value in ("True", "False"):
        return "yes" if value == "True" else "no"
    try:
        x = float(value)
    except ValueError:
        return value
    if math.isnan(x):                   # a figure no view gave (metrics.csv writes it empty)
        return "n/a"
    if not math.isfinite(x):
        return value
    if kind == "dB":
        return f"{x:.2f}"
    if kind == "ratio":
        return f"{x:.4f}"
    if kind == "bytes":
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(x) >= size:
                return f"{x / size:.3g} {unit}"
        return f"{x:.0f} B"
    if x.is_integer() and "." not in value and "e" not in value.lower():
        return value
    return f"{x:.4g}"



# ---------------------------------------------------------------------------------------------
# Cameras


def viewer_camera(viewmat, K, width: int, height: int, *, target=None) -> dict[str, Any]:
    """One camera of :mod:`insitu.groundtruth.views` as the viewer's (three.js) camera.

    viewmat: [4, 4] world-to-camera, OpenCV axes (+x right, +y down, +z forward).
    K:       [3, 3] pinhole intrinsics in pixels, principal point at the image centre.
    target:  [3] a world point the camera looks towards (default: the one at distance 1);
             it is moved onto the optical axis, so it is the camera's look-at point.

    Returns ``position`` [3], ``target`` [3] (look-at point), ``up`` [3] (unit, the image's
    upward direction in world coordinates), ``fov`` (vertical, degrees) and ``aspect``
    (width / height in three.js terms, ``W fy / (H fx)``). A three.js PerspectiveCamera with
    ``position``, ``up``, ``lookAt(target)``, ``fov`` and ``aspect`` maps every world point to the
    same pixel as ``K @ viewmat`` (tests/test_report.py checks it); three.js cameras look along
    their -z with +y up, i.e. OpenCV's axes with y and z flipped.
    """
    viewmat, K = np.asarray(viewmat, np.float64), np.asarray(K, np.float64)
    if viewmat.shape != (4, 4) or K.shape != (3, 3):
        raise ValueError(f"viewer_camera: expected viewmat [4, 4] and K [3, 3], got {list(viewmat.shape)} "
                         f"and {list(K.shape)}")
    if width <= 0 or height <= 0:
        raise ValueError(f"viewer_camera: expected a positive image size, got {width} x {height}")
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    if abs(cx - width / 2) > 1e-3 * width or abs(cy - height / 2) > 1e-3 * height:
        raise ValueError(f"viewer_camera: the viewer needs the principal point at the image centre "
                         f"({width / 2}, {height / 2}), got ({cx}, {cy})")
    R, t = viewmat[:3, :3], viewmat[:3, 3]
    position = -R.T @ t
    right, down, forward = R                  # rows: the camera's axes in world coordinates
    distance = 1.0 if target is None else float(np.dot(np.asarray(target, np.float64) - position, forward))
    if not distance > 0:
        raise ValueError("viewer_camera: the target lies behind the camera")
    fov = 2.0 * math.degrees(math.atan(0.5 * height / fy))
    return {"position": position.tolist(), "target": (position + distance * forward).tolist(),
            "up": (-down).tolist(), "fov": fov, "aspect": float(width * fy / (height * fx))}


def look_at_point(viewmats) -> np.ndarray | None:
    """[3] the point closest to every camera's optical axis (``viewmats: [N, 4, 4]``; for orbit
    views, the centre they look at); None when the axes are all parallel."""
    vm = np.asarray(viewmats, np.float64)
    R, t = vm[:, :3, :3], vm[:, :3, 3]
    origins = -np.einsum("nji,nj->ni", R, t)
    d = R[:, 2, :]                                            # forward axes
    P = np.eye(3)[None] - d[:, :, None] * d[:, None, :]      # projectors orthogonal to each axis
    A, b = P.sum(axis=0), np.einsum("nij,nj->i", P, origins)
    if np.linalg.cond(A) > 1e8:
        return None
    return np.linalg.solve(A, b)


def cameras_json(views, frame=None) -> dict[str, Any]:
    """The content of a step's ``cameras.json``: every orbit camera of ``views`` (:class:`insitu.groundtruth.views.Views`)
    for the viewer (looking at :func:`look_at_point`), with its viewmat and K as well, in the coordinates of
    ``frame`` (:class:`insitu.volume.Frame`, the step's, as its ``model.spz``), recorded as ``frame``
    (``origin``, ``scale``: world = origin + scale * x; default world units)."""
    vm, Ks = views.viewmats.detach().cpu().double().numpy(), views.Ks.detach().cpu().double().numpy()
    test = views.test.detach().cpu().numpy()
    centre = look_at_point(vm)
    if centre is None:                                        # one view, or parallel ones: 1 unit ahead
        centre = -vm[0, :3, :3].T @ vm[0, :3, 3] + vm[0, 2, :3]
    origin, scale = (frame.origin, frame.scale) if frame is not None else ((0.0, 0.0, 0.0), 1.0)
    return {"width": int(views.width), "height": int(views.height), "centre": [float(c) for c in centre],
            "frame": {"origin": [float(v) for v in origin], "scale": float(scale)},
            "views": [{"id": i, "name": f"view_{i:03d}", "test": bool(test[i]),
                       "camera": viewer_camera(vm[i], Ks[i], views.width, views.height, target=centre),
                       "viewmat": vm[i].tolist(), "K": Ks[i].tolist()} for i in range(len(vm))]}


# ---------------------------------------------------------------------------------------------
# Report


def copy_viewer(out_dir: str | Path) -> Path:
    """Copy the viewer's scripts and vendored libraries to ``out_dir/viewer`` (only what changed)."""
    dest = Path(out_dir) / VIEWER_DIR
    for src in sorted(VIEWER_SOURCE.rglob("*")):
        if not src.is_file() or src.name in _SKIP_ASSETS or "__pycache__" in src.parts:
            continue
        target = dest / src.relative_to(VIEWER_SOURCE)
        st = src.stat()
        with contextlib.suppress(FileNotFoundError):
            t = target.stat()
            if t.st_size == st.st_size and t.st_mtime_ns == st.st_mtime_ns:
                continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            shutil.copy2(src, tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return dest


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# the figures each step carries into the page (report.js: the step's line and the plots over the timesteps);
# every figure is in the table (metrics.csv)
SURFACE_FIGURES = ("psnr_foreground", "ssim_foreground", "psnr_foreground_initial", "psnr_foreground_near2", "ssim_foreground_near2",
                   "psnr_foreground_near3", "ssim_foreground_near3", "psnr_foreground_off", "ssim_foreground_off",
                   "ply_psnr_foreground", "ply_ssim_foreground", "spz_psnr_foreground", "spz_ssim_foreground",
                   "bound_psnr_foreground", "bound_ssim_foreground")
BYTES_WRITTEN = "bytes_written"         # the bytes a step wrote, where metrics.json records them (plotted if so)
HISTORY_FIGURES = ("psnr", "ssim", "psnr_foreground", "ssim_foreground")

# A step's seconds as the report stacks them: name -> metrics.json keys summed. What the phases before
# writing leave of total_seconds (the final evaluation, mostly) is its own part, so that a bar is the step.
STAGES = {"seeds": ("seeds_seconds",), "ground truth": ("ground_truth_seconds",), "training": ("train_seconds",),
          "model.ply fit": ("ply_fit_seconds",), "writing": ("model_write_seconds", "export_seconds")}
REST_STAGE = "final evaluation, other"


def training_curve(metrics: Mapping[str, Any]) -> list[dict[str, float | None]]:
    """The held-out figures over a step's iterations: its evaluations (``history``), ending at the step's
    final figures at its last iteration. The evaluations during training stop before the last iteration
    (the final one is the step's figure), so without it the curve would end short of the figure the page
    states; an evaluation at that same iteration is replaced by the final one."""
    rows = [{k: _number(h.get(k)) for k in ("iteration", *HISTORY_FIGURES)}
            for h in metrics.get("history") or [] if isinstance(h, Mapping)]
    rows = [r for r in rows if r["iteration"] is not None]
    last = _number(metrics.get("iterations"))
    final = {k: _number(metrics.get(k)) for k in HISTORY_FIGURES}
    if last is None or all(v is None for v in final.values()):
        return rows
    rows = [r for r in rows if r["iteration"] < last]
    return rows + [{"iteration": last, **final}]


def stage_seconds(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """A step's seconds per stage (:data:`STAGES`, then :data:`REST_STAGE`); None where none was recorded."""
    out: dict[str, float | None] = {}
    for name, keys in STAGES.items():
        values = [v for k in keys if (v := _number(metrics.get(k))) is not None]
        out[name] = sum(values) if values else None
    total = _number(metrics.get("total_seconds"))
    before = sum(v for name, v in out.items() if v is not None and name != "writing")
    out[REST_STAGE] = max(0.0, total - before) if total is not None else None
    return out


def viewer_blur(config: dict, metrics: Mapping[str, Any], *, lit: bool) -> dict[str, Any]:
    """The blur the report's viewer draws a step's model with: ``eps2d`` (px^2) and ``antialiased``.
    The lit model (``lit``: model.lit.spz) as it was trained (``metrics.json``'s ``eps2d``, ``antialiased``);
    model.spz as it was made to be drawn (:func:`insitu.training.appearance.spz_blur`, from ``config``, the
    step's ``config.yaml`` as read: the trained Gaussians as trained, model.ply's model refit for the viewers with
    their blur), as trained where the configuration is not one."""
    eps2d, antialiased = _number(metrics.get("eps2d", STANDARD_EPS2D)), bool(metrics.get("antialiased", False))
    if config and not lit and isinstance(eps2d, (int, float)):
        with contextlib.suppress(ValueError, TypeError, ConfigError):
            cfg = from_dict(upgraded(config))
            eps2d, antialiased = spz_blur(cfg, float(eps2d), antialiased, int(metrics.get("iterations") or 0))
    return {"eps2d": eps2d, "antialiased": antialiased}


def standard_files_text(metrics: Mapping[str, Any]) -> str | None:
    """What the page says of a step's standard files: their surface PSNR on the orbit (each in its viewers'
    drawing, against the ground truth in their light) beside their bound, by how much model.ply is under model.spz
    and why; None without model.ply's figure."""
    bound, spz, ply = (_number(metrics.get(f"{k}_psnr_foreground")) for k in ("bound", "spz", "ply"))
    if ply is None:
        return None
    text = "The standard files, surface PSNR on the held-out orbit views, in their light: "
    if bound is not None:
        text += (f"their bound {bound:.2f} dB (the trained model's image blurred by the 0.3 px\u00b2 every viewer of "
                 f"these files adds); ")
    if spz is None:
        return text + (f"model.ply (and model.spz, the same model) {ply:.2f} dB as viewers draw it"
                       + (f", {bound - ply:.2f} dB under the bound." if bound is not None else "."))
    return text + (f"model.spz {spz:.2f} dB as viewers that draw antialiased (Spark, SuperSplat) draw it"
                   + (f" ({bound - spz:.2f} dB under the bound)" if bound is not None else "")
                   + f"; model.ply {ply:.2f} dB as classic viewers (F3D, the reference 3DGS viewer) draw it, "
                   f"{spz - ply:.2f} dB under model.spz: a classic viewer adds the 0.3 px\u00b2 to every splat at "
                   "its full opacity, so a Gaussian under a pixel is drawn wider and as opaque; model.ply's are "
                   "merged per two orbit pixels and made fainter to offset that, which one opacity per Gaussian "
                   "does for one size on screen only. In a viewer that draws antialiased, open model.spz.")


def files_images_caption(metrics: Mapping[str, Any]) -> str:
    """The caption of a step's held-out views in the standard files' light: which drawing each part is."""
    if _number(metrics.get("spz_psnr_foreground")) is None:
        return ("The same views in the standard files' light: ground truth | model.ply (and model.spz, the same "
                "model) as viewers draw it")
    return ("The same views in the standard files' light: ground truth | model.spz as viewers that draw antialiased "
            "draw it | model.ply as classic viewers draw it")


def shown_model(d: Path) -> dict[str, Any] | None:
    """The file of step folder ``d`` that the page's 3D view draws (:data:`VIEWER_MODELS`: the first there), its
    Gaussians (its header's count) and bytes; None without one."""
    for name in VIEWER_MODELS:
        path = d / name
        if path.is_file():
            count = None
            with contextlib.suppress(OSError, ValueError, EOFError):
                count = spz_count(path)
            return {"file": name, "gaussians": count, "bytes": path.stat().st_size}
    return None


def step_summary(out: Path, step: int, d: Path) -> dict[str, Any]:
    """What the report shows of one step folder (missing files leave their entries empty)."""
    metrics: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, ValueError):
        metrics = json.loads((d / "metrics.json").read_text())
    if not isinstance(metrics, dict):
        metrics = {}
    config: dict = {}
    with contextlib.suppress(OSError, ConfigError):
        config = config_file_values(d / "config.yaml")
    background = [0.0, 0.0, 0.0]
    with contextlib.suppress(KeyError, TypeError, ValueError):
        background = [float(c) for c in config["views"]["background"]][:3]
    rel = quote(d.name)

    def link(name: str) -> str | None:
        return f"{rel}/{quote(name)}" if (d / name).is_file() else None

    return {
        "step": step, "dir": d.name, "time": _number(metrics.get("time")),
        "psnr": _number(metrics.get("psnr")), "ssim": _number(metrics.get("ssim")),
        **{key: _number(metrics.get(key)) for key in SURFACE_FIGURES},
        "gaussians": _number(metrics.get("gaussians")), "gaussians_initial": _number(metrics.get("gaussians_initial")),
        "ply_gaussians": _number(metrics.get("ply_gaussians")),
        "iterations": _number(metrics.get("iterations")),
        "history": training_curve(metrics), "stages": stage_seconds(metrics),
        # the viewer's model, in the step's frame (as its cameras): a lit one as trained, else model.spz
        "model": link("model.lit.spz") or link("model.spz"),
        "ply": link("model.ply"), "cameras": link("cameras.json"),
        "model_bytes": _number(metrics.get("model_bytes")), "web_model_bytes": _number(metrics.get("web_model_bytes")),
        "bytes_written": _number(metrics.get(BYTES_WRITTEN)),
        "background": background,
        "lighting": HEADLIGHT.as_dict() if link("model.lit.spz") else None,
        **viewer_blur(config, metrics, lit=link("model.lit.spz") is not None),
        "shown": shown_model(d), "files_text": standard_files_text(metrics),
        "files_caption": files_images_caption(metrics),
        **{key: [{"name": p.stem, "src": rel + "/" + quote(p.relative_to(d).as_posix())}
                 for p in sorted(d.rglob("*.png")) if p.stem.endswith(FIXED_LIGHT_VIEW) == lit]
           for key, lit in (("images", False), ("files_images", True))},
    }


def report_data(out_dir: str | Path, *, title: str = "insitu-gs",
                steps: Collection[int] | None = None) -> dict[str, Any]:
    """Everything the report page shows, as plain JSON (``OUT/report.json``).

    steps: only these steps' folders (default: every ``step_XXXXXX`` folder)."""
    out = Path(out_dir)
    wanted = None if steps is None else {int(s) for s in steps}
    steps = sorted((int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))
                   and (wanted is None or int(m.group(1)) in wanted))
    return {"title": title, "steps": [step_summary(out, s, d) for s, d in steps]}


_HEAD = """<!doctype html>
<html><head><meta charset='utf-8'><meta name='viewport' content='width=device-width, initial-scale=1'>
<title>{title}</title>
<link rel='stylesheet' href='viewer/report.css'>
<script type='importmap'>{{"imports": {{"three": "./viewer/vendor/three/three.module.min.js",
 "three/addons/": "./viewer/vendor/three/addons/",
 "@sparkjsdev/spark": "./viewer/vendor/spark/spark.module.min.js"}}}}</script>
</head><body>
<h1>{title}</h1>
<p id='file-note' class='note' hidden>This page was opened as a plain file: browsers load the 3D viewer and
the models only from a web server. Run <code>insitu view {out}</code> (on a cluster, on the login node) and open
the URL it prints (it holds a token that keeps other users out); through an SSH tunnel:
<code>ssh -L 8000:localhost:8000 LOGIN-NODE</code>, then the same URL on your machine. Plots, images and
tables below work without it.</p>
<div id='app'>
 <div id='viewer-panel'>
  <div id='viewer' tabindex='0'><div id='viewer-status'>3D viewer: loading...</div></div>
  <div class='controls'>
   <button id='play' type='button' title='play the timesteps'>&#9654;</button>
   <input id='slider' type='range' min='0' max='0' value='0' step='1' aria-label='timestep'>
   <span id='step-label'></span>
  </div>
  <div class='controls'>
   <label>camera <select id='camera'></select></label>
   <button id='reset' type='button' title='back to the selected orbit camera'>reset</button>
   <span id='model-info'></span>
  </div>
  <div class='controls' id='light' hidden>
   light
   <label>ambient <input id='light-ambient' type='range' min='0' max='1' step='0.01'></label>
   <label>diffuse <input id='light-diffuse' type='range' min='0' max='1.5' step='0.01'></label>
   <label>specular <input id='light-specular' type='range' min='0' max='1' step='0.01'></label>
   <label>shininess <input id='light-shininess' type='range' min='1' max='128' step='1'></label>
   <button id='light-reset' type='button' title="the ground truth's light, which the model was trained with">as trained</button>
  </div>
 </div>
 <div id='images-panel'><h3>Held-out views: ground truth | render</h3><div id='images' class='images'></div>
  <div id='files-images-panel' hidden><h3 id='files-caption'></h3><div id='files-images' class='images'></div></div>
  <p id='files-line'></p></div>
</div>
<div id='plots'></div>
"""


def _table(steps: list[dict[str, Any]], rows: dict[int, dict[str, str]]) -> list[str]:
    """The metrics tables: a table per group of :data:`TABLE_COLUMNS` (unknown columns: "Other", in tables of
    :data:`MAX_GROUP`), each a row per step of metrics.csv (or step folder) under the group's human headings, each
    heading's metrics.csv name as its tooltip."""
    e = html.escape
    known = {key for _, columns in TABLE_COLUMNS for key, _, _ in columns}
    raw = [k for k in dict.fromkeys(k for r in rows.values() for k in r) if k != "step"]

    def filled(key: str) -> bool:
        return any(r.get(key) not in (None, "") for r in rows.values())

    groups = [(group, [c for c in columns if filled(c[0])]) for group, columns in TABLE_COLUMNS]
    other = [(k, k, "") for k in raw if k not in known and filled(k)]
    groups += [("Other", other[i:i + MAX_GROUP]) for i in range(0, len(other), MAX_GROUP)]
    groups = [(group, columns) for group, columns in groups if columns]
    dirs = {s["step"]: s["dir"] for s in steps}
    parts = ["<h2>Metrics</h2><p><a href='metrics.csv'>metrics.csv</a> (one row per step, these columns under "
             "the names their headings show when pointed at), <a href='report.json'>report.json</a>. The standard "
             "files are scored in their own light against a ground truth lit so; their bound is the trained model's "
             "image in that light blurred by the 0.3 px\u00b2 every viewer of those files adds.</p>",
             "<div class='tables'>"]
    for group, columns in groups:
        parts.append("<table class='metrics'><caption>" + e(group) + "</caption><thead><tr><th class='step'>step</th>"
                     + "".join(f"<th title='{e(key)}'>{e(heading)}</th>" for key, heading, _ in columns)
                     + "</tr></thead><tbody>")
        for step in sorted(set(rows) | set(dirs)):
            row = rows.get(step, {})
            label = f"<a href='#{e(dirs[step])}'>{step}</a>" if step in dirs else str(step)
            parts.append(f"<tr><th class='step'>{label}</th>"
                         + "".join(f"<td>{e(_fmt(row.get(key) or '', kind))}</td>" for key, _, kind in columns)
                         + "</tr>")
        parts.append("</tbody></table>")
    parts.append("</div>")
    return parts


def _files() -> list[str]:
    """What each file of a step folder holds (:data:`FILE_NOTES`)."""
    e = html.escape
    items = "".join(f"<dt>{e(name)}</dt><dd>{e(note)}" + (f"; {e(VIEWER_NOTE)}" if name == "model.spz" else f"; {e(LIT_NOTE)}" if name == "model.lit.spz" else "")
                    + "</dd>" for name, note in FILE_NOTES.items())
    return [f"<h2>Files of a step folder</h2><dl id='files'>{items}</dl>"]


def write_report(out_dir: str | Path, *, title: str = "insitu-gs", steps: Collection[int] | None = None) -> Path:
    """Write ``out_dir/report.html`` and ``report.json`` (atomically) and the viewer's assets; returns the page.

    Links are relative, so the folder can be moved, copied or served as it is. steps: only
    these steps (default: every ``step_XXXXXX`` folder)."""
    out = Path(out_dir)
    copy_viewer(out)
    data = report_data(out, title=title, steps=steps)
    rows = {}
    for r in read_csv(out / "metrics.csv"):
        with contextlib.suppress(KeyError, ValueError):
            step = int(r["step"])
            if steps is None or step in steps or r.get("status") not in (None, "", "trained"):
                rows[step] = r                  # a skipped or failed step's row says why
    e = html.escape
    parts = [_HEAD.format(title=e(title), out=e(str(out)))]
    parts += _table(data["steps"], rows)
    parts += _files()
    for s in data["steps"]:
        parts.append(f"<section id='{e(s['dir'])}'><h2>Step {s['step']}</h2><p class='files'>")
        for name, note in FILE_NOTES.items():
            if (out / s["dir"] / name).is_file():
                parts.append(f"<a href='{quote(s['dir'])}/{quote(name)}' title='{e(note)}'>{e(name)}</a> ")
        parts.append("</p>")
        if s["files_text"]:
            parts.append(f"<p>{e(s['files_text'])}</p>")
        for key, caption in (("images", "Held-out views: ground truth | render"),
                             ("files_images", s["files_caption"])):
            if s[key]:
                parts.append(f"<h3>{e(caption)}</h3><div class='images'>")
                parts += [f"<a href='{image['src']}'><img src='{image['src']}' alt='{e(image['name'])}' "
                          f"title='{e(image['name'])}'></a>" for image in s[key]]
                parts.append("</div>")
        parts.append("</section>")
    payload = json.dumps(plain(data), allow_nan=False).replace("</", "<\\/")
    parts.append(f"<script id='insitu-data' type='application/json'>{payload}</script>")
    parts.append("<script src='viewer/vendor/uplot/uPlot.iife.min.js'></script>\n<script src='viewer/report.js'></script>\n"
                 "<script type='module' src='viewer/viewer.js'></script>")
    parts.append("</body></html>\n")
    write_json(out / "report.json", data)
    return atomic_write(out / "report.html", "\n".join(parts))


# ---------------------------------------------------------------------------------------------
# insitu view


TOP_FILES = ("report.html", "report.json", "metrics.csv")        # what the server serves at the top
STEP_FILES = ("model.ply", "model.spz", "model.lit.spz", "model.glb", "cameras.json", "metrics.json",  # a step's
              "config.yaml")                                                                 # files it serves
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")         # no dotfiles, no separators, no NUL
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".mjs": "text/javascript",
                 ".css": "text/css", ".json": "application/json", ".csv": "text/csv; charset=utf-8",
                 ".yaml": "text/plain; charset=utf-8", ".png": "image/png", ".wasm": "application/wasm",
                 ".spz": "application/octet-stream", ".ply": "application/octet-stream", ".glb": "model/gltf-binary"}
CONNECTION_TIMEOUT = 10.0     # seconds a connection may send or take nothing before it is closed: an idle
                              # one, a request without its blank line, a client that stopped reading
MAX_CONNECTIONS = 64          # connections served at once, a thread each (a browser opens about six)
ACCEPT_BACKOFF = 0.1          # seconds to wait after accept() found no descriptor left, instead of spinning
_FD_RESERVE = 64              # descriptors left to the rest of the process (streams, listening socket, libraries)
_FDS_PER_CONNECTION = 2       # its socket and, while it answers, the file it sends


def served_name(parts: Sequence[str]) -> bool:
    """Whether a path inside the output folder (its components) is one of the report's files:
    ``report.html``, ``report.json``, ``metrics.csv``; anything under ``viewer/``; a step folder's
    outputs (``step_XXXXXX/model.ply`` ... and ``step_XXXXXX/views/*.png``). No component may be
    empty, ``.``/``..``, start with a dot (dotfiles, temporary folders) or hold anything but
    letters, digits, ``_``, ``.`` and ``-``."""
    if not parts or not all(_PLAIN_NAME.match(p) for p in parts):
        return False
    if len(parts) == 1:
        return parts[0] in TOP_FILES
    if parts[0] == "viewer":
        return True
    if not STEP_DIR.match(parts[0]):
        return False
    return (len(parts) == 2 and parts[1] in STEP_FILES) or (len(parts) == 3 and parts[1] == "views"
                                                             and parts[2].endswith(".png"))


def report_file(root: Path, parts: Sequence[str]) -> Path | None:
    """The file to serve for a request's path ``parts`` (decoded components, after the token) inside
    ``root`` (the output folder, resolved), or None. The path must name one of the report's files
    (:func:`served_name`), and so must the path it resolves to (symbolic links followed) inside
    ``root``: a link that leads out of the folder, or onto a name that is not served, is not
    followed. Only regular files are served (no listings)."""
    if not served_name(parts):
        return None
    try:
        real = root.joinpath(*parts).resolve(strict=True)
        inside = real.relative_to(root)
        if not served_name(inside.parts) or not stat.S_ISREG(real.stat().st_mode):
            return None
    except (OSError, ValueError, RuntimeError):       # missing, outside the folder, a loop of links
        return None
    return real


def connection_bound(limit: int = MAX_CONNECTIONS) -> int:
    """How many connections a server of this process may hold at once: ``limit``, or fewer where the
    descriptor limit (``ulimit -n``, ``RLIMIT_NOFILE``) leaves less room, so that the connections never
    use up the descriptors and accept() keeps working (the connections past the bound wait in the
    kernel's queue, which holds no descriptor of the process). At least 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, (soft - _FD_RESERVE) // _FDS_PER_CONNECTION))


class _ReportHandler(http.server.BaseHTTPRequestHandler):
    """GET/HEAD of the report's files under ``/TOKEN/`` (:func:`report_file`); anything else is 404,
    a wrong token included. ``root``, ``token`` and ``timeout`` (of every read and write on the
    connection, see ``StreamRequestHandler``) are set per server (:func:`make_server`)."""

    root: Path
    token: str
    server: ReportServer
    server_version = "insitu-view"
    sys_version = ""

    def parse_request(self) -> bool:
        whole = super().parse_request()
        if whole:                                     # its request line and headers are in: no longer idle
            self.server.answering(self.connection)
        return whole

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        parts = self._parts()
        if parts == []:                                  # /TOKEN or /TOKEN/: the report
            self.send_response(302)
            self.send_header("Location", f"/{self.token}/report.html")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = report_file(self.root, parts) if parts is not None else None
        try:
            f = open(path, "rb") if path is not None else None
        except OSError:
            f = None
        if f is None:
            self.send_error(404, "Not found")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPES.get(path.suffix.lower(), "application/octet-stream"))
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if body:
                shutil.copyfileobj(f, self.wfile)

    def _parts(self) -> list[str] | None:
        """The request's decoded path components after a correct token; None when the token is wrong
        or missing, or the path cannot be decoded."""
        try:
            raw = urlsplit(self.path).path
            parts = [unquote(p, errors="strict") for p in raw.split("/")[1:]]
        except (UnicodeDecodeError, ValueError):
            return None
        if not parts or not hmac.compare_digest(parts[0].encode("utf-8", "surrogateescape"), self.token.encode()):
            return None
        rest = parts[1:]
        return [] if rest in ([], [""]) else rest

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-cache")      # a running simulation rewrites the report
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the token stays in this server's URLs
        super().end_headers()

    def log_message(self, format: str, *args) -> None:      # quiet: one line per request is noise
        pass


class ReportServer(http.server.ThreadingHTTPServer):
    """The server of :func:`make_server`: ``token``, :meth:`url` of the report, and at most
    ``max_connections`` connections (a thread each) at once. A connection is idle from its accept
    until its request line and headers are in, then answering. At the bound, a new connection closes
    the one idle the longest (a client that opened connections and sent nothing, or half a request,
    loses them first); when all are answering, it waits for one to end, up to ``connection_timeout``
    (every answer's writes time out too), and is dropped after that."""

    daemon_threads = True
    request_queue_size = 256    # a burst of connections waits in the kernel's queue, not in SYN retries
    token: str

    def __init__(self, address, handler, *, max_connections: int, connection_timeout: float) -> None:
        self.max_connections = max_connections
        self.connection_timeout = connection_timeout
        self._changed = threading.Condition()          # (reentrant) guards the two below; notified when one closes
        self._open: set[socket.socket] = set()         # accepted, not yet closed
        self._idle: dict[socket.socket, int] = {}      # the open ones still reading their request: order of accept
        self._accepts = count()
        super().__init__(address, handler)

    def url(self, name: str = "report.html") -> str:
        """``http://localhost:PORT/TOKEN/name``: what a browser opens."""
        return f"http://localhost:{self.server_address[1]}/{self.token}/{name}"

    def answering(self, connection: socket.socket) -> None:
        """``connection``'s request is whole (its handler answers): it is no longer one to close for room."""
        with self._changed:
            self._idle.pop(connection, None)

    def _close_idlest(self) -> None:
        """Shut down the connection idle the longest, if any (under the lock): its thread reads the end
        of the stream, ends and closes it (:meth:`shutdown_request`)."""
        if self._idle:
            connection = min(self._idle, key=self._idle.__getitem__)
            del self._idle[connection]
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # no descriptor left (files of the process besides the bounded connections, or the
                # system's): free one and wait, or the loop would spin on a socket that stays readable
                with self._changed:
                    self._close_idlest()
                time.sleep(ACCEPT_BACKOFF)
            raise                        # socketserver skips a failed accept

    def process_request(self, request, client_address) -> None:
        """Start ``request``'s thread once fewer than ``max_connections`` are open (see the class)."""
        with self._changed:
            deadline = time.monotonic() + self.connection_timeout
            while len(self._open) >= self.max_connections:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.shutdown_request(request)
                    return
                self._close_idlest()
                self._changed.wait(left)
            self._open.add(request)
            self._idle[request] = next(self._accepts)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        # closed under the lock, so that _close_idlest never shuts down a descriptor already reused
        with self._changed:
            super().shutdown_request(request)
            self._open.discard(request)
            self._idle.pop(request, None)
            self._changed.notify_all()

    def server_close(self) -> None:
        """Stop listening and end every connection (their threads, which server_close joins, end too)."""
        with self._changed:
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._idle.clear()
        super().server_close()

    def handle_error(self, request, client_address) -> None:
        """One line for a request that failed (a client that went away is not an error)."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            print(f"insitu view: a request failed ({type(error).__name__}: {error})", file=sys.stderr, flush=True)


def make_server(out_dir: str | Path, port: int = 8000, host: str = "127.0.0.1", *,
                timeout: float = CONNECTION_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> ReportServer:
    """A server of ``out_dir``'s report on ``host:port`` (port 0: any free port), not yet serving.

    It serves the report's files only (:func:`report_file`), under a random token:
    ``server.url()`` is the report's address, ``server.token`` the token. A connection that sends or
    takes nothing for ``timeout`` seconds is closed; at most ``max_connections`` are served at once
    (fewer under a low descriptor limit: :func:`connection_bound`), see :class:`ReportServer`."""
    out = Path(out_dir)
    if not (out / "report.html").is_file():
        raise FileNotFoundError(f"{out}: no report.html here (expected the --out folder of an insitu run)")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ValueError(f"max_connections must be an integer >= 1, got {max_connections!r}")
    token = secrets.token_urlsafe(24)
    handler = type("Handler", (_ReportHandler,), {"root": out.resolve(), "token": token, "timeout": timeout})
    server = ReportServer((host, port), handler, max_connections=connection_bound(max_connections),
                          connection_timeout=float(timeout))
    server.token = token
    return server


def serve(out_dir: str | Path, port: int = 8000) -> int:
    """``insitu view OUT``: serve ``OUT``'s report on localhost until interrupted; prints its URL."""
    out = Path(out_dir)
    try:
        server = make_server(out, port)
    except (FileNotFoundError, ValueError) as e:
        print(f"insitu view: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"insitu view: error: cannot listen on port {port} ({e.strerror}); try --port 0 for a free one",
              file=sys.stderr)
        return 2
    port = server.server_address[1]
    url = server.url()
    print(f"serving {out} at {url}\n"
          f"from another machine: ssh -L {port}:localhost:{port} {socket.gethostname()}, then open {url}\n"
          "the URL holds a random token: only who has it can read the report. Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
