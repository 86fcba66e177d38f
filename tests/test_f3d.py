"""A real third-party viewer: F3D (PyPI ``f3d``) renders a small trained step's ``model.ply`` and ``model.spz``
offscreen (EGL, Mesa on the CPU) from one of the step's held-out cameras, as its README's command line would
(``--point-sprites-type=gaussian``, sorted blending, direct colouring, sprites sized by the Gaussians), and each
image must match the project's own render of the same file (:func:`insitu.render.rendering.rasterize`, torch
backend) on the surface's pixels. Rendered at four times the training resolution: F3D adds no pixel filter
(standard viewers add 0.3 px^2), which darkens splats of a pixel or less.

F3D draws an ``.spz`` as the file holds it, in SPZ's frame (x right, y up, z back: its own, y up), so the
camera is turned with the file (180 degrees about x) to see what the project's camera sees. F3D 4.0 reads
SPZ version 2 right and misreads version 3 (rotations as (x, y, z, w) where it wants (w, x, y, z), the SH
bands a byte per Gaussian early: under 15 dB here), which is why ``model.spz`` is version 2.

Skipped, with the reason, only when the ``f3d`` package (the ``test`` extra) is missing."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import sphere_field, tiny_config

HERE = Path(__file__).resolve().parent
OPTIONS = {"model.coloring": "direct", "model.point_sprites.type": "gaussian",
           "model.point_sprites.size": 1.0, "model.point_sprites.absolute_size": True,
           "render.effect.blending.mode": "sort"}
MARGIN_DB = 24.0          # F3D against the project's render of model.ply, surface pixels: measured 31.8 dB here
SPZ_MARGIN_DB = 21.0      # ... of model.spz: 24.2 dB here (28 from the half-transparent seeds before the conversion;
                          # F3D draws its splats classic, the file holds them refit for antialiased viewers)
SPZ_TURN = torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0]))   # SPZ's frame from the model's, and back


def f3d_missing() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import f3d"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"the f3d package does not import ({r.stderr.strip().splitlines()[-1:]})"


def f3d_image(model: Path, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int, background, tmp: Path):
    """F3D's render of ``model`` from the camera ``viewmat`` (world to camera, OpenCV axes) with intrinsics ``K``."""
    R, t = viewmat[:3, :3].double().numpy(), viewmat[:3, 3].double().numpy()
    centre = -R.T @ t
    spec = {"width": width, "height": height, "position": centre.tolist(), "focal_point": (centre + R[2]).tolist(),
            "view_up": (-R[1]).tolist(), "view_angle": math.degrees(2 * math.atan(height / 2 / float(K[1, 1]))),
            "background": [float(c) for c in background], "options": OPTIONS}
    out = tmp / "f3d.npy"
    r = subprocess.run([sys.executable, str(HERE / "f3d_render.py"), str(model), str(out), json.dumps(spec)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out).astype(np.float64) / 255.0


def surface_psnr(model, viewmat, K, width, height, background, image) -> float:
    """PSNR of ``image`` against the project's render of ``model`` on the pixels the surface covers."""
    from insitu.render.rendering import rasterize

    rgb, alpha, _ = rasterize(model.means, model.quats, model.scales, model.opacities, model.sh, viewmat[None],
                              K[None], width, height, sh_degree=model.sh_degree, backend="torch")
    ours = (rgb[0] + (1 - alpha[0]) * torch.tensor(background[:3])).clamp(0, 1).double().numpy()
    surface = alpha[0, ..., 0].numpy() > 0.5
    return float(-10 * np.log10(((image - ours) ** 2)[surface].mean()))


@pytest.fixture(scope="module")
def step(comm, tmp_path_factory):
    """A small trained step's folder (two spheres of different sizes, one above the other: turned upside down, the
    model is another picture), one held-out camera (at 4x the training resolution) and the background."""
    reason = f3d_missing()
    if reason:
        pytest.skip(reason)
    from insitu.output.export import StepWriter
    from insitu.step.pipeline import compute_step, write_step
    from insitu.volume import whole_block

    out = tmp_path_factory.mktemp("f3d")
    cfg = tiny_config(iso=0.0, views=12, resolution=32, budget=800, iterations=30)
    pair = np.minimum(sphere_field(20, centre=(9.5, 9.5, 7.5)) - 5.0, sphere_field(20, centre=(9.5, 9.5, 14.5)) - 3.0)
    result = compute_step(whole_block(pair), cfg, comm, step=1)
    cameras = result.cameras
    write_step(result, StepWriter(out), cfg, comm)
    view = int(cameras.test.nonzero()[0])
    K = cameras.Ks[view].clone()
    K[:2] *= 4
    return {"dir": out / "step_000001", "viewmat": cameras.viewmats[view], "K": K,
            "size": (4 * cameras.width, 4 * cameras.height), "background": list(cfg.views.background)}


def test_f3d_draws_model_ply_as_the_project_does(step, tmp_path):
    from insitu.output.ply import read_ply, write_ply

    path = step["dir"] / "model.ply"
    model = read_ply(path)
    V, K, size, background = step["viewmat"], step["K"], step["size"], step["background"]
    image = f3d_image(path, V, K, *size, background, tmp_path)
    score = surface_psnr(model, V, K, *size, background, image)
    print(f"F3D vs the project's render of model.ply: {score:.2f} dB on the surface")
    assert score >= MARGIN_DB
    # the test can fail: the model turned by 180 degrees about x (the SPZ mistake) is far off (14 dB)
    turned = model.__class__(model.means * torch.tensor([1.0, -1.0, -1.0]) + 2 * model.means.mean(0) *
                             torch.tensor([0.0, 1.0, 1.0]), model.log_scales,
                             model.quats * torch.tensor([1.0, 1.0, -1.0, -1.0]), model.opacity_logits, model.sh0,
                             model.shN[:, :0])
    write_ply(tmp_path / "turned.ply", turned)
    wrong = f3d_image(tmp_path / "turned.ply", V, K, *size, background, tmp_path)
    assert surface_psnr(model, V, K, *size, background, wrong) < MARGIN_DB - 4


def test_f3d_draws_model_spz_as_the_project_does(step, tmp_path):
    """F3D's render of model.spz, from the project's camera turned into SPZ's frame, against the project's
    render of the file as read_spz reads it (turned back into the model's frame) from the camera itself."""
    from insitu.output.webmodel import read_spz, to_rub, write_spz

    path = step["dir"] / "model.spz"
    model = read_spz(path)
    V, K, size, background = step["viewmat"], step["K"], step["size"], step["background"]
    image = f3d_image(path, V @ SPZ_TURN, K, *size, background, tmp_path)
    score = surface_psnr(model, V, K, *size, background, image)
    print(f"F3D vs the project's render of model.spz: {score:.2f} dB on the surface")
    assert score >= SPZ_MARGIN_DB
    # the test can fail: a file that holds the model unturned (not in SPZ's frame) is drawn far off (7 dB)
    write_spz(tmp_path / "unturned.spz", to_rub(model), version=2)
    wrong = f3d_image(tmp_path / "unturned.spz", V @ SPZ_TURN, K, *size, background, tmp_path)
    assert surface_psnr(model, V, K, *size, background, wrong) < SPZ_MARGIN_DB - 4


@pytest.mark.parametrize("name,up", [("model.ply", "+Z"), ("model.spz", "-Z")])
def test_the_readme_up_axis_stands_the_data_upright_in_f3d(name, up, tmp_path):
    """The README's F3D lines: ``--up=+Z`` for model.ply (world units, the data's axes) and ``--up=-Z`` for
    model.spz (SPZ's axes: the data turned 180 degrees about x) show the data's +z upwards with F3D's own camera: a
    column of Gaussians from red (z = 0) to blue (z = 10) stands blue on top, and a green blob at +x is on the
    right. ``-Y`` (what the README once said for model.spz) lays it down."""
    reason = f3d_missing()
    if reason:
        pytest.skip(reason)
    from insitu.output.ply import write_ply
    from insitu.output.webmodel import STANDARD_SPZ_VERSION, write_spz
    from insitu.surface.gaussians import Gaussians, rgb_to_sh0

    z = torch.linspace(0, 10, 40)
    means = torch.cat([torch.stack([torch.zeros(40), torch.zeros(40), z], 1), torch.tensor([[5.0, 0.0, 0.0]])])
    colours = torch.cat([torch.stack([1 - z / 10, torch.zeros(40), z / 10], 1), torch.tensor([[0.0, 1.0, 0.0]])])
    n = len(means)
    model = Gaussians(means, torch.full((n, 3), -0.7), torch.tensor([[1.0, 0, 0, 0]]).repeat(n, 1),
                      torch.full((n,), 4.0), rgb_to_sh0(colours)[:, None], torch.zeros(n, 0, 3))
    path = tmp_path / name
    write_ply(path, model) if name == "model.ply" else write_spz(path, model, version=STANDARD_SPZ_VERSION)

    def where(up: str) -> dict[str, np.ndarray]:
        spec = {"width": 160, "height": 160, "background": [0.2, 0.2, 0.2],
                "options": {**OPTIONS, "scene.up_direction": up}}
        out = tmp_path / "f3d.npy"
        r = subprocess.run([sys.executable, str(HERE / "f3d_render.py"), str(path), str(out), json.dumps(spec)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        image = np.load(out).astype(np.float64) / 255
        found = {c: np.argwhere(image[..., k] - image.mean(-1) > 0.25) for k, c in enumerate("rgb")}
        return {c: rows.mean(0) if len(rows) else np.full(2, np.nan) for c, rows in found.items()}   # (row, col)

    upright = where(up)
    assert upright["b"][0] < upright["r"][0] - 40 and upright["g"][1] > upright["r"][1] + 20, upright
    if name == "model.spz":
        lying = where("-Y")                         # seen end on: blue in front of red, not above it
        assert not lying["b"][0] < lying["r"][0] - 40, lying
