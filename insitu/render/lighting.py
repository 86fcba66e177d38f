"""The lights: the ground truth's two-sided headlight, and the fixed light baked into the standard files.

:class:`Headlight` (Blinn-Phong, the light at the eye): the half vector is the view direction and the
shading of a surface point depends on one number, ``cos = |n . v|`` (the unit normal against the unit
direction to the camera, either side of the surface facing it):

    intensity = ambient + diffuse * cos + specular * cos ** shininess
    colour    = clamp(base * intensity, 0, 1)

The ray caster shades its hits with it (:mod:`insitu.groundtruth`, whose Triton kernel takes these
numbers as arguments: :meth:`Headlight.terms`), and the lit colour model of the Gaussians
(:mod:`insitu.training.appearance`) shades each Gaussian with it, per camera, from its own normal and base
colour. The report's viewer draws the lit model with the same numbers (a lit step's ``lighting`` in
``report.json``).

:class:`FixedLight` (diffuse, two lights fixed in the data's frame): the shading of a surface point depends
on its normal alone, not on the camera,

    intensity = ambient + key * |n . k| + fill * |n . f|

so one colour per Gaussian (SH band 0) holds it exactly from every side, which no SH degree does for the
headlight. The standard files (``model.ply``, ``model.spz``) of a lit model carry the trained model shaded
with it, and their figures are scored against a ground truth cast with it (:mod:`insitu.step.plyfit`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:                       # torch only for the annotations: the report server need not load it
    from torch import Tensor


@dataclass(frozen=True)
class Headlight:
    """Coefficients of the headlight's Blinn-Phong shading."""

    ambient: float = 0.15
    diffuse: float = 0.75
    specular: float = 0.25
    shininess: int = 32

    def intensity(self, cos: Tensor) -> Tensor:
        """``[...]`` light intensity for ``cos: [...]`` = |n . v| in [0, 1]."""
        return self.ambient + self.diffuse * cos + self.specular * cos.pow(self.shininess)

    def shade(self, normals: Tensor, views: Tensor) -> Tensor:
        """``[...]`` intensity at unit ``normals: [..., 3]`` seen along unit ``views: [..., 3]`` (towards the
        camera; broadcast together)."""
        return self.intensity((normals * views).sum(-1).abs().clamp(max=1.0))

    def terms(self) -> tuple[float, ...]:
        """The light as the ray-casting kernel takes it (:mod:`insitu.groundtruth.triton_caster`), 11 numbers
        ``ambient, diffuse, specular, kx, ky, kz, key, fx, fy, fz, fill`` of the intensity

            ambient + diffuse * |n . v| + specular * |n . v| ** 32 + key * |n . k| + fill * |n . f|

        (the headlight: ``key = fill = 0``; the kernel computes the shininess 32 alone)."""
        if self.shininess != 32:
            raise ValueError(f"Headlight.terms: the ray-casting kernel computes cos ** 32, got shininess "
                             f"{self.shininess}")
        return (self.ambient, self.diffuse, self.specular) + (0.0,) * 8

    def as_dict(self) -> dict:
        return asdict(self)


def _unit(name: str, v) -> tuple[float, float, float]:
    """``v`` (3 numbers) normalised; ValueError naming ``name`` otherwise."""
    try:
        values = [float(c) for c in v]
    except (TypeError, ValueError):
        values = []
    n = math.sqrt(sum(c * c for c in values)) if len(values) == 3 else 0.0
    if not (n > 0 and math.isfinite(n)):
        raise ValueError(f"FixedLight.{name}: expected a direction of 3 finite numbers, not all 0, got {v!r}")
    return tuple(c / n for c in values)


@dataclass(frozen=True)
class FixedLight:
    """A key and a fill light at infinity, fixed in the data's frame, both two-sided and diffuse (a surface is
    lit alike from either side, as the headlight lights it), over an ambient term.

    key_from, fill_from: directions from the surface towards each light (normalised here), in the data's
    frame, whose +z is up in the step's views (:func:`insitu.groundtruth.views.look_at`). The key comes from
    above (53 degrees up, from +x +y), the fill from the other side, low (18 degrees up, from -x), at right
    angles to the key: every face of a box aligned with the axes gets its own shade (x 0.62, y 0.52, z 0.73
    times the base colour), the brightest normal 0.81 (no colour saturates), and only the normals at right
    angles to both lights, along their cross product, get the ambient term alone (0.25; the headlight's rims
    0.15). Averaged over all normals the intensity is ``ambient + (key + fill) / 2``, 0.625: the surface's
    mean colour in the ground truth is the headlight's within 6% (the bonsai's 1% above, the engine's 6% below),
    so that the two lights' figures compare (PSNR counts an error in proportion to the colours: the same
    light 20% brighter scores about 1.6 dB less for the same shapes).
    """

    ambient: float = 0.25
    key: float = 0.5
    fill: float = 0.25
    key_from: tuple[float, float, float] = (1.0, 2.0, 3.0)
    fill_from: tuple[float, float, float] = (-3.0, 0.0, 1.0)

    def __post_init__(self):
        for name in ("ambient", "key", "fill"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"FixedLight.{name}: expected a finite number >= 0, got {value!r}")
        object.__setattr__(self, "key_from", _unit("key_from", self.key_from))
        object.__setattr__(self, "fill_from", _unit("fill_from", self.fill_from))

    def intensity(self, normals: Tensor) -> Tensor:
        """``[...]`` light intensity at unit ``normals: [..., 3]`` (either side alike)."""
        k = normals.new_tensor(self.key_from)
        f = normals.new_tensor(self.fill_from)
        return self.ambient + self.key * (normals @ k).abs() + self.fill * (normals @ f).abs()

    def shade(self, normals: Tensor, views: Tensor) -> Tensor:
        """:meth:`intensity` (the view directions do not change it; as :meth:`Headlight.shade`)."""
        return self.intensity(normals)

    def terms(self) -> tuple[float, ...]:
        """The light as the ray-casting kernel takes it (:meth:`Headlight.terms`: ``diffuse = specular = 0``)."""
        return (self.ambient, 0.0, 0.0, *self.key_from, self.key, *self.fill_from, self.fill)

    def as_dict(self) -> dict:
        return asdict(self)


Light = Headlight | FixedLight

HEADLIGHT = Headlight()
FIXED_LIGHT = FixedLight()
FIXED_LIGHT_VIEW = "_fixed_light"     # a held-out view's image in that light: views/view_008_fixed_light.png
