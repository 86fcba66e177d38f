"""The files a step leaves for other tools: the standard SPZ in SPZ's own frame with a truthful antialiased
flag, read as Niantic's reference reader reads it (versions 2 and 3), and what the step folder holds
(``output.files``, ``output.every``, bytes written)."""
import gzip
import math
import struct

import numpy as np
import pytest
import torch

from insitu.output.webmodel import STANDARD_SPZ_VERSION, read_spz, spz_antialiased, to_rub, write_spz
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


def reference_decode(path) -> dict:
    """An ``.spz`` file as Niantic's reference reader decodes it into the PLY frame (``spz::loadSpz`` with
    ``to = RDF``, nianticlabs/spz src/cc/load-spz.cc and splat-types.h, transcribed): the same values
    PlayCanvas splat-transform writes into a ``.ply``. Rotations (x, y, z, w), SH [N, K-1, 3]."""
    raw = gzip.decompress(path.read_bytes())
    magic, version, n, degree, bits, flags, _ = struct.unpack_from("<IIIBBBB", raw)
    assert magic == 0x5053474E and version in (2, 3)
    k1 = (degree + 1) ** 2 - 1
    at = 16

    def take(count):
        nonlocal at
        at += count
        return np.frombuffer(raw, np.uint8, count, at - count)

    b = take(9 * n).reshape(n, 3, 3).astype(np.int64)
    fixed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    positions = np.where(fixed & 0x800000, fixed - (1 << 24), fixed) / 2.0 ** bits
    alphas = take(n) / 255.0
    colors = (take(3 * n).reshape(n, 3) / 255.0 - 0.5) / 0.15
    scales = take(3 * n).reshape(n, 3) / 16.0 - 10.0
    if version == 2:                                   # unpackQuaternionFirstThree
        xyz = take(3 * n).reshape(n, 3) / 127.5 - 1.0
        rot = np.concatenate([xyz, np.sqrt(np.maximum(0.0, 1.0 - (xyz ** 2).sum(1)))[:, None]], 1)
    else:                                              # unpackQuaternionSmallestThree
        rot = np.zeros((n, 4))
        for i, comp in enumerate(take(4 * n).view("<u4").astype(np.int64)):
            largest, squares = comp >> 30, 0.0
            for j in (3, 2, 1, 0):
                if j != largest:
                    rot[i, j] = math.sqrt(0.5) * (comp & 511) / 511 * (-1 if (comp >> 9) & 1 else 1)
                    squares += rot[i, j] ** 2
                    comp >>= 10
            rot[i, largest] = math.sqrt(max(0.0, 1.0 - squares))
    sh = (take(3 * k1 * n).reshape(n, k1, 3) - 128.0) / 128.0
    assert at == len(raw)
    x, y, z = 1.0, -1.0, -1.0                          # coordinateConverter(RUB, RDF): which axes agree
    flip_sh = np.array([y, z, x, x * y, y * z, 1, x * z, 1, y, x * y * z, y, z, x, z, x])[:k1]
    return {"version": version, "bits": bits, "positions": positions * [x, y, z], "scales": scales,
            "rotations": rot * [y * z, x * z, x * y, 1.0], "opacities": alphas, "colors": colors,
            "sh": sh * flip_sh[None, :, None]}


@pytest.mark.parametrize("version", [2, 3])
def test_spz_reads_in_niantics_reader_as_the_model_is(tmp_path, version):
    """What the reference reader makes of our file, in the PLY frame, is the model within each field's
    quantisation: positions, scales, opacities, colours, every SH coefficient's sign and the rotations
    (version 2's within a few degrees, picking the nearest byte triple; version 3's within half a degree);
    read_spz reads both versions the same way."""
    g = random_gaussians(400, 3, seed=4)
    g = Gaussians(g.means, g.log_scales, g.quats, g.opacity_logits, g.sh0, g.shN.clamp(-0.99, 0.99))  # a byte's range
    path = write_spz(tmp_path / "m.spz", g, version=version)
    ref = reference_decode(path)
    assert ref["version"] == version
    np.testing.assert_allclose(ref["positions"], g.means.numpy(), atol=0.5 ** (ref["bits"] + 1) + 1e-6)
    np.testing.assert_allclose(ref["scales"], g.log_scales.numpy(), atol=1 / 32 + 1e-6)
    np.testing.assert_allclose(ref["opacities"], g.opacities.numpy(), atol=0.5 / 255 + 1e-6)
    reach = 127.5 / 255 / 0.15                                   # the DC range a byte holds
    np.testing.assert_allclose(ref["colors"], g.sh0[:, 0].numpy().clip(-reach, reach), atol=0.5 / 255 / 0.15 + 1e-6)
    np.testing.assert_allclose(ref["sh"], g.shN.numpy(), atol=0.5 / 128 + 1e-6)
    q = torch.nn.functional.normalize(g.quats, dim=1).numpy()[:, [1, 2, 3, 0]]
    r = ref["rotations"] / np.linalg.norm(ref["rotations"], axis=1, keepdims=True)
    angle = np.degrees(2 * np.arccos(np.clip(np.abs((r * q).sum(1)), 0, 1)))
    assert angle.max() < (7.0 if version == 2 else 0.5)
    back = read_spz(path)
    torch.testing.assert_close(back.quats, torch.as_tensor(ref["rotations"][:, [3, 0, 1, 2]], dtype=torch.float32))
    torch.testing.assert_close(back.shN, torch.as_tensor(ref["sh"], dtype=torch.float32))


def test_spz_version_2_rotations_take_the_nearest_byte_triple(tmp_path):
    """Version 2 stores x, y, z of the quaternion (w >= 0) in a byte each and readers derive w: rounding each
    byte alone errs by 1.1 degrees on average (12 at worst, where w is small); the nearest of the eight triples
    around the quaternion by 0.75 (under 7)."""
    n = 4000
    g = random_gaussians(n, 0, seed=6)
    path = write_spz(tmp_path / "m.spz", g, version=2)
    r = reference_decode(path)["rotations"]
    q = torch.nn.functional.normalize(g.quats, dim=1).numpy()[:, [1, 2, 3, 0]] * [1, -1, -1, 1]  # SPZ's frame
    q = np.where(q[:, 3:] < 0, -q, q)
    rounded = np.clip(np.rint(q[:, :3] * 127.5 + 127.5), 0, 255) / 127.5 - 1.0
    naive = np.concatenate([rounded, np.sqrt(np.maximum(0, 1 - (rounded ** 2).sum(1)))[:, None]], 1)
    q = q * [1, -1, -1, 1]                                                      # back into the PLY frame
    naive = naive * [1, -1, -1, 1]

    def degrees(a):
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        return np.degrees(2 * np.arccos(np.clip(np.abs((a * q).sum(1)), 0, 1)))

    assert degrees(r).mean() < 0.8 < 1.0 < degrees(naive).mean()
    assert np.all(degrees(r) <= degrees(naive) + 1e-9)


@pytest.mark.parametrize("damage, words", [
    (lambda data: data[:100], "EOFError"),                                     # truncated
    (lambda data: b"PLY" + data[3:], "BadGzipFile"),                           # not gzip
    (lambda data: data[:20] + bytes(200) + data[220:], "error: "),            # corrupt deflate data
])
def test_a_damaged_spz_is_a_value_error_naming_the_file(tmp_path, damage, words):
    path = write_spz(tmp_path / "m.spz", random_gaussians(300, 1), version=3)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError) as e:
        read_spz(path)
    text = str(e.value)
    assert text.startswith(f"{path}: not a readable spz file (a gzip stream): ") and words in text, text


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
    # the standard copy in the version every SPZ viewer reads right (F3D 4.0 misreads version 3's rotations and
    # SH); the lit one, drawn by the report's viewer, keeps version 3's finer rotations (its normals)
    assert reference_decode(d / "model.spz")["version"] == STANDARD_SPZ_VERSION == 2
    assert reference_decode(d / "model.lit.spz")["version"] == 3
    assert read_ply(d / "model.ply").sh_degree == 0 and spz_antialiased(d / "model.lit.spz")
    m = __import__("json").loads((d / "metrics.json").read_text())
    sizes = {name: (d / name).stat().st_size for name in ("model.ply", "model.spz", "model.lit.spz")}
    assert (m["model_bytes"], m["web_model_bytes"], m["lit_model_bytes"]) == tuple(sizes.values())
    assert m["bytes_written"] == sum(sizes.values())
