"""The report (insitu.output.report), its web models (insitu.output.webmodel) and ``insitu view``, without a browser."""
import html
import json
import math
import threading
import urllib.request
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from insitu.groundtruth.views import look_at, orbit_views
from insitu.output.export import StepWriter
from insitu.output.ply import read_ply
from insitu.output.report import cameras_json, look_at_point, make_server, viewer_camera
from insitu.output.webmodel import encode_spz, fractional_bits, read_spz, write_spz
from insitu.render.lighting import HEADLIGHT
from insitu.surface.gaussians import Gaussians


def random_gaussians(n: int, degree: int, seed: int = 0, extent: float = 30.0) -> Gaussians:
    g = torch.Generator().manual_seed(seed)
    k1 = (degree + 1) ** 2 - 1
    return Gaussians(means=(torch.rand(n, 3, generator=g) - 0.5) * 2 * extent,
                     log_scales=torch.rand(n, 3, generator=g) * 4 - 3,
                     quats=torch.randn(n, 4, generator=g),
                     opacity_logits=torch.randn(n, generator=g) * 2,
                     sh0=torch.randn(n, 1, 3, generator=g),
                     shN=(torch.rand(n, k1, 3, generator=g) - 0.5) * 1.6)


# ---------------------------------------------------------------------------------------------- cameras


def three_pixels(cam: dict, points: np.ndarray, width: int, height: int) -> np.ndarray:
    """Pixel coordinates of ``points [M, 3]`` seen by a three.js PerspectiveCamera set from ``cam``
    the way viewer.js sets it (position, up, lookAt(target), fov, aspect), following three.js's
    Matrix4.lookAt and Matrix4.makePerspective."""
    eye, target, up = (np.asarray(cam[k], np.float64) for k in ("position", "target", "up"))
    z = eye - target
    z /= np.linalg.norm(z)
    x = np.cross(up, z)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    world = np.eye(4)
    world[:3, :3] = np.stack([x, y, z], axis=1)
    world[:3, 3] = eye
    view = np.linalg.inv(world)
    near, far = 0.1, 1000.0
    top = near * math.tan(math.radians(cam["fov"]) / 2)
    right = top * cam["aspect"]
    proj = np.array([[near / right, 0, 0, 0], [0, near / top, 0, 0],
                     [0, 0, -(far + near) / (far - near), -2 * far * near / (far - near)], [0, 0, -1, 0]])
    clip = (proj @ view @ np.c_[points, np.ones(len(points))].T).T
    ndc = clip[:, :3] / clip[:, 3:]
    return np.stack([(ndc[:, 0] + 1) / 2 * width, (1 - ndc[:, 1]) / 2 * height], axis=1)


def opencv_pixels(viewmat: np.ndarray, K: np.ndarray, points: np.ndarray) -> np.ndarray:
    cam = (viewmat[:3, :3] @ points.T).T + viewmat[:3, 3]
    uvw = (K @ cam.T).T
    return uvw[:, :2] / uvw[:, 2:]


@pytest.mark.parametrize("width,height,fx,fy", [(96, 96, 131.9, 131.9), (160, 90, 120.0, 100.0)])
def test_viewer_camera_maps_every_point_to_the_same_pixel(width, height, fx, fy):
    rng = np.random.default_rng(1)
    K = np.array([[fx, 0, width / 2], [0, fy, height / 2], [0, 0, 1]])
    for eye, up in [((40.0, -30.0, 25.0), (0, 0, 1)), ((3.0, 2.0, -50.0), (0, 1, 0)), ((0.0, 0.0, 60.0), (0, 0, 1))]:
        target = np.array([1.0, -2.0, 0.5])
        viewmat = look_at(np.array(eye), target, up)
        cam = viewer_camera(viewmat, K, width, height, target=target)
        np.testing.assert_allclose(cam["target"], target, atol=1e-9)       # on the axis: the look-at point
        points = target + rng.normal(scale=8.0, size=(50, 3))
        np.testing.assert_allclose(three_pixels(cam, points, width, height), opencv_pixels(viewmat, K, points),
                                   atol=1e-6)
        assert abs(np.linalg.norm(cam["up"]) - 1) < 1e-12


def test_viewer_camera_rejects_what_it_cannot_map():
    K = np.array([[100.0, 0, 40], [0, 100.0, 48], [0, 0, 1]])
    with pytest.raises(ValueError, match="principal point at the image centre"):
        viewer_camera(np.eye(4), K, 96, 96)
    with pytest.raises(ValueError, match=r"viewmat \[4, 4\] and K \[3, 3\]"):
        viewer_camera(np.eye(3), K, 96, 96)
    with pytest.raises(ValueError, match="behind the camera"):
        viewer_camera(np.eye(4), np.array([[100.0, 0, 48], [0, 100.0, 48], [0, 0, 1]]), 96, 96,
                      target=[0, 0, -5])


def test_cameras_json_looks_at_the_orbit_centre():
    views = orbit_views([0, 0, 0], [32, 20, 10], 24, 64)
    np.testing.assert_allclose(look_at_point(views.viewmats.double().numpy()), [16, 10, 5], atol=1e-4)
    cams = cameras_json(views)
    assert cams["width"] == cams["height"] == 64 and len(cams["views"]) == 24
    assert [v["test"] for v in cams["views"]] == views.test.tolist()
    for v in cams["views"]:
        np.testing.assert_allclose(v["camera"]["target"], [16, 10, 5], atol=1e-3)
        np.testing.assert_allclose(v["camera"]["fov"], 40.0)
    json.dumps(cams, allow_nan=False)


# ---------------------------------------------------------------------------------------------- spz


@pytest.mark.parametrize("degree", [0, 1, 3])
def test_spz_round_trip_within_its_quantization(tmp_path, degree):
    g = random_gaussians(500, degree)
    path = write_spz(tmp_path / "m.spz", g)
    r = read_spz(path)
    assert len(r) == 500 and r.sh_degree == degree
    bits = fractional_bits(g.means.numpy())
    assert torch.allclose(r.means, g.means, atol=0.5 / (1 << bits) + 1e-6)
    assert torch.allclose(r.log_scales, g.log_scales, atol=1 / 32 + 1e-6)
    assert torch.allclose(r.opacities, g.opacities, atol=0.5 / 255 + 1e-6)
    reach = 127.5 / 255 / 0.15                                  # the DC range a byte holds
    assert torch.allclose(r.sh0, g.sh0.clamp(-reach, reach), atol=0.5 / 255 / 0.15 + 1e-6)
    assert torch.allclose(r.shN, g.shN.clamp(-1, 127 / 128), atol=0.5 / 128 + 1e-6)
    q = g.quats / g.quats.norm(dim=1, keepdim=True)
    angle = 2 * torch.acos((r.quats * q).sum(dim=1).abs().clamp(max=1))
    assert angle.max() < math.radians(0.5)                      # 9 bits for each of the smallest three
    raw = path.read_bytes()
    assert len(raw) < 500 * (20 + 9 * ((degree + 1) ** 2 - 1)) + 64    # compressed below its raw size
    assert encode_spz(g) == raw                                 # deterministic (no time stamp)


def test_spz_bits_follow_the_extent_and_reject_bad_input(tmp_path):
    assert fractional_bits(np.array([[255.0, 0, 0]])) == 14 and fractional_bits(np.array([[31.0, 0, 0]])) == 17
    g = random_gaussians(10, 0, extent=200.0)
    assert torch.allclose(read_spz(write_spz(tmp_path / "a.spz", g)).means, g.means, atol=1e-4)
    bad = random_gaussians(3, 0)
    bad.means[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        encode_spz(bad)
    (tmp_path / "x.spz").write_bytes(b"\x1f\x8b" + b"0" * 10)
    with pytest.raises(Exception):
        read_spz(tmp_path / "x.spz")


# ---------------------------------------------------------------------------------------------- report


def test_report_holds_every_step_with_its_model_cameras_and_figures(tmp_path):
    out = tmp_path / "out"
    writer = StepWriter(out)
    views = orbit_views([0, 0, 0], [8, 8, 8], 16, 12)
    gt = torch.rand(12, 12, 3)
    for step in (0, 300):
        metrics = {"step": step, "psnr": 20.0 + step / 100, "ssim": 0.8, "gaussians": 50, "seeds_seconds": 0.1,
                   "ground_truth_seconds": 0.2, "train_seconds": 3.0, "psnr_foreground": 15.0 + step / 100,
                   "ssim_foreground": 0.7, "psnr_foreground_near2": 14.0, "color_model": "sh" if step else "lit",
                   "history": [{"iteration": 0, "psnr": 10.0, "ssim": 0.3}, {"iteration": 100, "psnr": 20.0,
                                                                            "ssim": 0.8, "psnr_foreground": 16.0}]}
        d = writer.write(step, random_gaussians(50, 1, seed=step),
                         [("view_000", gt, gt), ("view_000_fixed_light", gt, gt, gt)], metrics, None, cameras=views)
        models = ["model.ply", "model.spz"] if step else ["model.lit.spz"]        # a lit model: not a standard one
        assert sorted(p.name for p in d.iterdir()) == sorted(["cameras.json", "metrics.json", *models, "views"])
    m = json.loads((out / "step_000300" / "metrics.json").read_text())
    assert m["web_model_bytes"] == (out / "step_000300" / "model.spz").stat().st_size
    assert m["model_bytes"] == (out / "step_000300" / "model.ply").stat().st_size > m["web_model_bytes"]
    assert len(read_ply(out / "step_000300" / "model.ply")) == len(read_spz(out / "step_000300" / "model.spz"))

    data = json.loads((out / "report.json").read_text())
    assert [s["step"] for s in data["steps"]] == [0, 300]
    s = data["steps"][1]
    assert s["model"] == "step_000300/model.spz" and s["cameras"] == "step_000300/cameras.json"
    assert s["psnr"] == 23.0 and s["history"][1] == {"iteration": 100.0, "psnr": 20.0, "ssim": 0.8,
                                                     "psnr_foreground": 16.0, "ssim_foreground": None}
    assert s["psnr_foreground"] == 18.0 and s["ssim_foreground"] == 0.7 and s["psnr_foreground_near2"] == 14.0
    assert s["psnr_foreground_near3"] is None                      # not measured: empty
    # a lit model's step carries the headlight the viewer shades it with; an SH model's none
    assert data["steps"][0]["lighting"] == HEADLIGHT.as_dict() and s["lighting"] is None
    assert s["stages"] == {"seeds": 0.1, "ground truth": 0.2, "training": 3.0, "model.ply fit": None,
                           "writing": m["export_seconds"], "final evaluation, other": None}
    assert s["images"] == [{"name": "view_000", "src": "step_000300/views/view_000.png"}]
    assert s["files_images"] == [{"name": "view_000_fixed_light", "src": "step_000300/views/view_000_fixed_light.png"}]
    assert Image.open(out / "step_000300" / "views" / "view_000_fixed_light.png").size == (3 * 12 + 2 * 2, 12)
    # the viewer's line says what it draws, of one file: its name, its Gaussians, its bytes
    assert s["shown"] == {"file": "model.spz", "gaussians": 50, "bytes": m["web_model_bytes"]}
    assert data["steps"][0]["shown"]["file"] == "model.lit.spz" and data["steps"][0]["shown"]["gaussians"] == 50
    page = (out / "report.html").read_text()
    inline = page.split("<script id='insitu-data' type='application/json'>")[1].split("</script>")[0]
    assert json.loads(inline) == data
    for asset in ("viewer/report.js", "viewer/viewer.js", "viewer/report.css", "viewer/vendor/uplot/uPlot.iife.min.js",
                  "viewer/vendor/spark/spark.module.min.js", "viewer/vendor/three/three.module.min.js"):
        assert asset in page or asset.startswith("viewer/vendor"), asset
        assert (out / asset).is_file(), asset
    for licence in ("viewer/vendor/spark/LICENSE", "viewer/vendor/three/LICENSE", "viewer/vendor/uplot/LICENSE"):
        assert "MIT" in (out / licence).read_text() or "Permission is hereby granted" in (out / licence).read_text()
    assert "insitu view" in page                                   # what to do when opened as a file
    assert not (out / "viewer" / "vendor" / "update.sh").exists()


def test_insitu_view_serves_the_folder(tmp_path):
    out = tmp_path / "out"
    StepWriter(out).write(0, random_gaussians(20, 1), [], {"psnr": 20.0}, None)
    with pytest.raises(FileNotFoundError, match="no report.html"):
        make_server(tmp_path)
    server = make_server(out, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = server.url("").replace("localhost", "127.0.0.1")
        with urllib.request.urlopen(base + "report.html") as r:
            assert r.status == 200 and b"insitu-data" in r.read()
        with urllib.request.urlopen(base + "viewer/viewer.js") as r:
            assert r.headers["Content-Type"].startswith("text/javascript")     # module scripts need it
        with urllib.request.urlopen(base + "step_000000/model.spz") as r:
            assert r.read() == (out / "step_000000" / "model.spz").read_bytes()
    finally:
        server.shutdown()
        server.server_close()


def test_insitu_view_command_line(tmp_path):
    import sys

    from conftest import ROOT, launch

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    r = launch([sys.executable, "-m", "insitu", "view", "--help"], env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and "--port" in r.stdout and "SSH" in r.stdout, r.stderr
    r = launch([sys.executable, "-m", "insitu", "view", tmp_path], env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "no report.html" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_demo_defaults_fit_the_device():
    from insitu.cli import build_parser, config_from_args
    from insitu.run.demo import CPU_SIMULATION, GPU_SIMULATION, demo_defaults

    cfg = config_from_args(build_parser().parse_args(["demo", "--device", "cpu"]))
    assert cfg.views.resolution == demo_defaults(gpu=False)["views.resolution"] and cfg.train.eval_every > 0
    gpu = demo_defaults(gpu=True)
    assert gpu["views.resolution"] >= 512 and GPU_SIMULATION["L"] >= 128
    assert GPU_SIMULATION["steps"] // GPU_SIMULATION["plotgap"] >= 4 and gpu["series.warm_start"]
    assert CPU_SIMULATION["steps"] // CPU_SIMULATION["plotgap"] == 2
    from insitu.config import TrainConfig
    assert cfg.train.lr_means == demo_defaults(gpu=False)["train.lr_means"] > TrainConfig().lr_means
    assert gpu["train.lr_means"] == TrainConfig().lr_means      # the CPU demo's faster means are not the GPU's


# ---------------------------------------------------------------------------------------------- the page's figures


def step_metrics(step: int, k: int, *, iterations: int = 300, bytes_written: bool = True) -> dict:
    """metrics.json of the ``k``-th step of a made-up run: evaluations every 100 iterations before the last (as
    training leaves them), final figures above the last evaluation, slow training, bytes written."""
    final = 31.17 + 0.5 * k
    m = {"step": step, "time": step * 0.5, "psnr_foreground": final, "ssim_foreground": 0.93 - 0.01 * k,
         "psnr_foreground_near2": final - 2.0, "ssim_foreground_near2": 0.85, "psnr_near2": final + 4.0,
         "psnr_foreground_near3": final - 3.0, "ssim_foreground_near3": 0.8 + 0.01 * k,
         "psnr_foreground_off": final - 1.0, "ssim_foreground_off": 0.9, "ply_psnr_foreground": final - 1.5,
         "spz_psnr_foreground": final - 1.2, "bound_psnr_foreground": final - 1.0, "antialiased": k == 0,
         "psnr": final + 6.0, "ssim": 0.97, "lpips": None, "iterations": iterations, "gaussians_initial": 4000,
         "gaussians": 5000 + 1000 * k, "ply_gaussians": 1500 + 300 * k, "color_model": "lit", "seeds_seconds": 0.5,
         "ground_truth_seconds": 2.0 + k,
         "train_seconds": 100.0 + 10 * k, "ply_fit_seconds": 3.0, "total_seconds": 110.0 + 11 * k,
         "model_write_seconds": 0.25, "export_seconds": 0.75, "model_bytes": 3_200_000, "web_model_bytes": 223_000,
         "history": [{"iteration": i, "psnr": 20.0 + i / 50, "ssim": 0.5 + i / 1000, "psnr_foreground": 15.0 + i / 20,
                      "ssim_foreground": 0.6 + i / 1000, "gaussians": 4000, "seconds": i / 10}
                     for i in range(0, iterations, 100)]}
    if bytes_written:
        m["bytes_written"] = 3_500_000 + 10_000 * k
    return m


def made_up_run(out, metrics: dict[int, dict], others: dict[int, dict] = {}):
    """An output folder of step folders holding only ``metrics.json`` (step -> metrics), metrics.csv with their
    rows and ``others`` (step -> a row of a step without a folder), and the report written from them."""
    from insitu.output.files import flatten_metrics, write_csv
    from insitu.output.folder import step_name
    from insitu.output.report import write_report

    for step, m in metrics.items():
        (out / step_name(step)).mkdir(parents=True)
        (out / step_name(step) / "metrics.json").write_text(json.dumps(m))
    rows = {step: {"step": step, "status": "trained", **flatten_metrics(m)} for step, m in metrics.items()}
    rows.update({step: {"step": step, **row} for step, row in others.items()})
    write_csv(out / "metrics.csv", [rows[s] for s in sorted(rows)])
    return write_report(out, steps=sorted(metrics))


def test_training_curve_ends_at_the_final_figures():
    from insitu.output.report import training_curve

    m = step_metrics(0, 0)                                      # evaluations at 0, 100, 200; 300 iterations
    curve = training_curve(m)
    assert [r["iteration"] for r in curve] == [0, 100, 200, 300]
    assert curve[-1] == {"iteration": 300, "psnr": m["psnr"], "ssim": m["ssim"], "psnr_foreground": 31.17,
                         "ssim_foreground": m["ssim_foreground"]}
    assert curve[:3] == [{k: h[k] for k in curve[0]} for h in m["history"]]
    short = step_metrics(0, 0, iterations=200)                  # a warm step: one evaluation, before training
    short["history"] = short["history"][:1]
    assert [(r["iteration"], r["psnr_foreground"]) for r in training_curve(short)] == [(0, 15.0), (200, 31.17)]
    reached = step_metrics(0, 0)                                # stopped at its target: evaluated there
    reached["iterations"] = 100
    assert [(r["iteration"], r["psnr_foreground"]) for r in training_curve(reached)] == [(0, 15.0), (100, 31.17)]
    for key in ("iterations", "psnr_foreground"):               # nothing to end at: the evaluations as they are
        m = step_metrics(0, 0)
        del m[key]
        if key == "psnr_foreground":
            for k in ("psnr", "ssim", "ssim_foreground"):
                del m[k]
        assert [r["iteration"] for r in training_curve(m)] == [0, 100, 200]


def test_stage_seconds_make_up_the_step():
    from insitu.output.report import REST_STAGE, stage_seconds

    m = step_metrics(0, 1)
    stages = stage_seconds(m)
    assert stages["writing"] == 1.0 and stages["training"] == 110.0 and stages["model.ply fit"] == 3.0
    assert stages[REST_STAGE] == pytest.approx(121.0 - 0.5 - 3.0 - 110.0 - 3.0)
    assert sum(stages.values()) == pytest.approx(m["total_seconds"] + 1.0)     # the bar: the step, written
    assert stage_seconds({"train_seconds": 2.0}) == {"seeds": None, "ground truth": None, "training": 2.0,
                                                     "model.ply fit": None, "writing": None, REST_STAGE: None}


class _Tables(HTMLParser):
    """The metrics tables of a report page: (caption, rows), each row a list of (text, attributes) per cell, the
    heading row first."""

    def __init__(self):
        super().__init__()
        self.tables, self.inside, self.cell, self.caption = [], False, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("class") == "metrics":
            self.inside = True
            self.tables.append(["", []])
        elif self.inside and tag == "caption":
            self.caption = ""
        elif self.inside and tag == "tr":
            self.tables[-1][1].append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ["", dict(attrs)]

    def handle_data(self, data):
        if self.caption is not None:
            self.caption += data
        elif self.cell is not None:
            self.cell[0] += data

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif tag == "caption" and self.caption is not None:
            self.tables[-1][0], self.caption = self.caption, None
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.tables[-1][1][-1].append(tuple(self.cell))
            self.cell = None


def test_metrics_tables_have_grouped_human_headings(tmp_path):
    """A table per group of columns, each small enough for a phone (its step column and at most MAX_GROUP more),
    every known column under its human heading (its metrics.csv name as the tooltip), truth values as yes and no,
    the standard files' figures beside their bound, an unknown column under Other by its name; the skipped step too,
    with why."""
    from insitu.output.report import FILE_NOTES, MAX_GROUP, TABLE_COLUMNS, VIEWER_MODELS, VIEWER_NOTE

    out = tmp_path / "out"
    metrics = {0: step_metrics(0, 0), 5: step_metrics(5, 1)}
    metrics[5]["frobnications"] = 7                             # a figure the table does not know yet
    page = made_up_run(out, metrics, {10: {"status": "skipped", "reason": "no surface at iso 0.3"}}).read_text()
    parsed = _Tables()
    parsed.feed(page)
    tables = parsed.tables
    captions = [caption for caption, _ in tables]
    assert captions == [group for group, columns in TABLE_COLUMNS
                        if any(key in metrics[0] or key in ("status", "reason") for key, _, _ in columns)] + ["Other"]
    assert all(len(rows[0]) <= MAX_GROUP + 1 and rows[0][0][0] == "step" for _, rows in tables)
    headings = [cell for _, rows in tables for cell in rows[0][1:]]
    raw, shown = [a["title"] for _, a in headings], [text for text, _ in headings]
    assert "lpips" not in raw                                   # empty in every row: left out
    assert raw[-1] == shown[-1] == "frobnications"              # an unknown column: under Other, by its name
    known = {key: heading for _, columns in TABLE_COLUMNS for key, heading, _ in columns}
    assert all(known[k] == t for k, t in zip(raw[:-1], shown[:-1])), list(zip(raw, shown))
    assert not set(shown[:-1]) & {k for k in raw if "_" in k}   # no raw names for the known columns
    surface = dict(tables)["Surface PSNR (dB)"][0]
    assert [t for t, _ in surface] == ["step", "orbit", "close-ups 2x", "close-ups 3x", "off the orbit"]
    files = dict(tables)["Standard files: surface PSNR, orbit (dB)"]
    assert [t for t, _ in files[0]] == ["step", "bound", "model.spz", "model.ply"]       # each beside their bound
    cells = {}
    for _, rows in tables:
        keys = [a.get("title") for _, a in rows[0]]
        for row in rows[1:]:
            assert [t for t, _ in row][0] in ("0", "5", "10")   # every step in every table, the skipped one too
            cells.setdefault(row[0][0], {}).update(zip(keys[1:], (t for t, _ in row[1:])))
    assert cells["10"]["status"] == "skipped" and cells["10"]["reason"] == "no surface at iso 0.3"
    assert cells["0"]["psnr_foreground"] == "31.17" and cells["5"]["psnr_foreground"] == "31.67"
    assert cells["0"]["bound_psnr_foreground"] == "30.17" and cells["0"]["spz_psnr_foreground"] == "29.97"
    assert cells["0"]["ssim_foreground"] == "0.9300" and cells["0"]["bytes_written"] == "3.5 MB"
    assert cells["0"]["model_bytes"] == "3.2 MB" and cells["0"]["web_model_bytes"] == "223 kB"
    assert cells["0"]["antialiased"] == "yes" and cells["5"]["antialiased"] == "no"      # not Python's True
    assert cells["0"]["train_seconds"] == "100" and cells["5"]["frobnications"] == "7" and cells["0"]["frobnications"] == ""
    # what each file holds, said once; the step's links carry it too
    for name, note in FILE_NOTES.items():
        assert f"<dt>{html.escape(name)}</dt><dd>{html.escape(note)}" in page, name
    assert html.escape(VIEWER_NOTE) in page and all(name in FILE_NOTES for name in VIEWER_MODELS)
    assert page.count(f"title='{html.escape(FILE_NOTES['metrics.json'])}'>metrics.json</a>") == 2


def test_the_page_says_how_far_each_standard_file_is_under_its_bound_and_model_ply_under_model_spz():
    from insitu.output.report import standard_files_text

    m = step_metrics(0, 0)
    text = standard_files_text(m)
    assert "their bound 30.17 dB" in text and "model.spz 29.97 dB" in text and "(0.20 dB under the bound)" in text
    assert "model.ply 29.67 dB" in text and "0.30 dB under model.spz: a classic viewer adds the 0.3 px\u00b2" in text
    del m["spz_psnr_foreground"]                                # model.spz holds model.ply's model
    assert "model.ply (and model.spz, the same model) 29.67 dB as viewers draw it, 0.50 dB under the bound." \
        in standard_files_text(m)
    del m["ply_psnr_foreground"]
    assert standard_files_text(m) is None


def test_viewer_draws_model_spz_with_the_blur_it_was_made_for(tmp_path):
    """The report's viewer draws a step's model.spz with the blur it was made for: refit as viewers draw it
    (output.ply_refine), with theirs, 0.3 px^2: antialiased for a model trained antialiased (eps2d 0.1; the trained
    Gaussians themselves, its header saying antialiased), classic for one trained with a classic blur (model.ply's
    model, its header saying so); without the refit (ply_refine 0), or without the step's configuration, as
    trained; a lit model's model.lit.spz always as trained."""
    from insitu.config import Config
    from insitu.output.webmodel import spz_antialiased

    views = orbit_views([0, 0, 0], [8, 8, 8], 8, 12)
    cases = {1: ("sh", 0.125, False), 2: ("sh", 0.0, False), 3: ("lit", 0.125, True), 4: ("sh", None, False),
             5: ("sh", 0.125, True), 6: ("sh", None, True)}
    for step, (colors, refine, antialiased) in cases.items():
        out = tmp_path / f"out{step}"
        cfg = None
        if refine is not None:
            cfg = Config()
            cfg.train.color_model, cfg.train.eps2d, cfg.train.antialiased = colors, 0.1, antialiased
            cfg.output.ply_refine = refine
        metrics = {"step": step, "psnr": 20.0, "eps2d": 0.1, "antialiased": antialiased, "iterations": 400,
                   "color_model": colors}
        StepWriter(out).write(step, random_gaussians(40, 1 if colors == "sh" else 0, seed=step), [], metrics, cfg,
                              cameras=views)
        s = json.loads((out / "report.json").read_text())["steps"][0]
        refit = colors == "sh" and bool(refine)
        assert (s["eps2d"], s["antialiased"]) == ((0.3 if refit else 0.1), antialiased), (step, s)
        if colors == "sh":
            assert spz_antialiased(out / f"step_{step:06d}" / "model.spz") is antialiased
        else:
            assert s["model"].endswith("model.lit.spz")
