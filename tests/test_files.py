"""The files a step leaves for other tools: the standard SPZ in SPZ's own frame with a truthful antialiased
flag, and what the step folder holds (``output.files``, ``output.every``, bytes written)."""
import gzip
import struct

import numpy as np
import pytest
import torch

from insitu.output.webmodel import read_spz, spz_antialiased, to_rub, write_spz
from insitu.render.rendering import rasterize
from insitu.surface.gaussians import Gaussians


def random_gaussians(n: int, sh_degree: int, seed: int = 0) -> Gaussians:
    g = torch.Generator().manual_seed(seed)
    k = (sh_degree + 1) ** 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return Gaussians(r(n, 3) * 2, r(n, 3) * 0.3 - 1.5, r(n, 4), r(n) + 2, r(n, 1, 3), r(n, k - 1, 3) * 0.3)


def look_at(eye, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)) -> torch.Tensor:
    """A world-to-camera matrix (OpenCV axes: x right, y down, z forward)."""
    eye, target, up = (torch.tensor(v, dtype=torch.float32) for v in (eye, target, up))
    z = torch.nn.functional.normalize(target - eye, dim=0)
    x = torch.nn.functional.normalize(torch.linalg.cross(z, up), dim=0)
    y = torch.linalg.cross(z, x)
    m = torch.eye(4)
    m[:3, :3] = torch.stack([x, y, z])
    m[:3, 3] = -m[:3, :3] @ eye
    return m


def draw(g: Gaussians, viewmat: torch.Tensor) -> torch.Tensor:
    K = torch.tensor([[40.0, 0, 32], [0, 40.0, 32], [0, 0, 1]])
    rgb, _, _ = rasterize(g.means, g.quats, g.scales, g.opacities, g.sh, viewmat[None], K[None], 64, 64,
                          sh_degree=g.sh_degree, backend="torch")
    return rgb[0]


def test_to_rub_is_the_turn_about_x_colours_and_all():
    """The model turned into SPZ's frame, seen by the camera turned with it, draws the same image (SH
    colours of degree 3 included: each coefficient's sign); and it differs from the unturned model's."""
    g = random_gaussians(200, 3)
    turn = torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0]))
    for eye in ((6.0, 1.0, 2.0), (-2.0, 5.0, -3.0)):
        v = look_at(eye)
        torch.testing.assert_close(draw(to_rub(g), v @ turn), draw(g, v), atol=2e-5, rtol=0)
        assert (draw(g, v @ turn) - draw(g, v)).abs().max() > 0.1
    back = to_rub(to_rub(g))
    for name in g.names():
        assert torch.equal(getattr(back, name), getattr(g, name)), name


@pytest.mark.parametrize("antialiased", [False, True])
def test_spz_holds_spz_frame_and_the_antialiased_flag(tmp_path, antialiased):
    g = random_gaussians(50, 1, seed=2)
    path = write_spz(tmp_path / "model.spz", g, antialiased=antialiased)
    raw = gzip.decompress(path.read_bytes())
    magic, version, n, degree, bits, flags, _ = struct.unpack_from("<IIIBBBB", raw)
    assert (n, degree, flags) == (50, 1, int(antialiased)) and spz_antialiased(path) is antialiased
    fixed = np.frombuffer(raw, np.uint8, 9 * n, 16).reshape(n, 3, 3).astype(np.int32)
    fixed = fixed[..., 0] | (fixed[..., 1] << 8) | (fixed[..., 2] << 16)
    stored = np.where(fixed >= 1 << 23, fixed - (1 << 24), fixed) / float(1 << bits)
    np.testing.assert_allclose(stored, g.means.numpy() * [1, -1, -1], atol=2.0 ** -bits)   # y, z negated
    back = read_spz(path)                                     # ... and turned back on reading
    np.testing.assert_allclose(back.means.numpy(), g.means.numpy(), atol=2.0 ** -bits)
    v = look_at((5.0, 2.0, 3.0))
    assert (draw(back, v) - draw(g, v)).abs().mean() < 0.02


def test_output_settings_choose_the_model_files_and_their_steps(tmp_path):
    """output.ply / spz / lit say which model files a step writes, output.every for which steps, output.sh_degree
    at which degree; metrics.json records each file's bytes and the step folder's."""
    from insitu.config import OutputConfig
    from insitu.output.export import StepWriter
    from insitu.output.ply import read_ply

    g = random_gaussians(30, 2, seed=5)
    writer = StepWriter(tmp_path / "a", output=OutputConfig(ply=False, every=2, sh_degree=1))
    for step in (1, 2):
        writer.write_model(step, g)
        writer.write(step, g, [], {"psnr": 20.0})
    assert sorted(p.name for p in (tmp_path / "a" / "step_000001").iterdir()) == ["metrics.json"]
    assert sorted(p.name for p in (tmp_path / "a" / "step_000002").iterdir()) == ["metrics.json", "model.spz"]
    assert read_spz(tmp_path / "a" / "step_000002" / "model.spz").sh_degree == 1
    lit = Gaussians(g.means, g.log_scales, g.quats, g.opacity_logits, g.sh0, g.shN[:, :0])
    writer = StepWriter(tmp_path / "b", output=OutputConfig(sh_degree=0))
    writer.write_model(4, g)                                  # the standard model, then the lit one as trained
    d = writer.write(4, lit, [], {"color_model": "lit", "antialiased": True})
    assert sorted(p.name for p in d.iterdir()) == ["metrics.json", "model.lit.spz", "model.ply", "model.spz"]
    assert read_ply(d / "model.ply").sh_degree == 0 and spz_antialiased(d / "model.lit.spz")
    m = __import__("json").loads((d / "metrics.json").read_text())
    sizes = {name: (d / name).stat().st_size for name in ("model.ply", "model.spz", "model.lit.spz")}
    assert (m["model_bytes"], m["web_model_bytes"], m["lit_model_bytes"]) == tuple(sizes.values())
    assert m["bytes_written"] == sum(sizes.values())
