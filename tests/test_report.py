"""The report (insitu.output.report), its web models (insitu.output.webmodel) and ``insitu view``, without a browser."""
import json
import math
import threading
import urllib.request

import numpy as np
import pytest
import torch

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
        d = writer.write(step, random_gaussians(50, 1, seed=step), [("view_000", gt, gt)], metrics, None,
                         cameras=views)
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
    assert s["stages"] == {"seeds": 0.1, "ground truth": 0.2, "training": 3.0, "export": m["export_seconds"]}
    assert s["images"] == [{"name": "view_000", "src": "step_000300/views/view_000.png"}]
    page = (out / "report.html").read_text()
    inline = page.split("<script id='insitu-data' type='application/json'>")[1].split("</script>")[0]
    assert json.loads(inline) == data
    for asset in ("viewer/report.js", "viewer/viewer.js", "viewer/report.css",
                  "viewer/vendor/spark/spark.module.min.js", "viewer/vendor/three/three.module.min.js"):
        assert asset in page or asset.startswith("viewer/vendor"), asset
        assert (out / asset).is_file(), asset
    for licence in ("viewer/vendor/spark/LICENSE", "viewer/vendor/three/LICENSE"):
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
    assert GPU_SIMULATION["steps"] // GPU_SIMULATION["plotgap"] >= 4 and gpu["insitu.warm_start"]
    assert CPU_SIMULATION["steps"] // CPU_SIMULATION["plotgap"] == 2
    from insitu.config import TrainConfig
    assert cfg.train.lr_means == demo_defaults(gpu=False)["train.lr_means"] > TrainConfig().lr_means
    assert gpu["train.lr_means"] == TrainConfig().lr_means      # the CPU demo's faster means are not the GPU's
