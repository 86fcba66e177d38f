"""The light of the ground truth: a two-sided headlight with Blinn-Phong shading.

The light sits at the eye, so the half vector is the view direction and the shading of a
surface point depends on one number, ``cos = |n . v|`` (the unit normal against the unit
direction to the camera, either side of the surface facing it):

    intensity = ambient + diffuse * cos + specular * cos ** shininess
    colour    = clamp(base * intensity, 0, 1)

The ray caster shades its hits with it (:mod:`insitu.groundtruth`, whose Triton kernel writes
these numbers out), and the lit colour model of the Gaussians (:mod:`insitu.training.appearance`) shades
each Gaussian with it, per camera, from its own normal and base colour. The report's viewer
draws the lit model with the same numbers (a lit step's ``lighting`` in ``report.json``).
"""
from __future__ import annotations

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

    def as_dict(self) -> dict:
        return asdict(self)


HEADLIGHT = Headlight()
