"""A shard of Gaussians: the trainable parameters one rank owns.

Parameters are stored pre-activation, as the reference 3DGS code and its .ply files do:

    means:          [N, 3]  world positions
    log_scales:     [N, 3]  log of the standard deviations along the local axes
    quats:          [N, 4]  rotation quaternions (w, x, y, z), not necessarily normalised
    opacity_logits: [N]     logit of the opacity
    sh0:            [N, 1, 3]  DC spherical-harmonic colour coefficients
    shN:            [N, K-1, 3] higher-order coefficients, K = (sh_degree + 1) ** 2
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

SH_C0 = 0.28209479177387814


def rgb_to_sh0(rgb: Tensor) -> Tensor:
    """[..., 3] colours in [0, 1] -> DC coefficients."""
    return (rgb - 0.5) / SH_C0


def sh0_to_rgb(sh0: Tensor) -> Tensor:
    return sh0 * SH_C0 + 0.5


@dataclass
class Gaussians:
    means: Tensor
    log_scales: Tensor
    quats: Tensor
    opacity_logits: Tensor
    sh0: Tensor
    shN: Tensor

    def __len__(self) -> int:
        return self.means.shape[0]

    @property
    def sh_degree(self) -> int:
        return int(round((self.shN.shape[1] + 1) ** 0.5)) - 1

    @property
    def scales(self) -> Tensor:
        return torch.exp(self.log_scales)

    @property
    def opacities(self) -> Tensor:
        return torch.sigmoid(self.opacity_logits)

    @property
    def sh(self) -> Tensor:
        """[N, K, 3] all SH coefficients."""
        return torch.cat([self.sh0, self.shN], dim=1)

    def names(self) -> list[str]:
        return [f.name for f in fields(self)]

    def tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.names()}

    def detach(self) -> "Gaussians":
        return Gaussians(**{k: v.detach().clone() for k, v in self.tensors().items()})

    def to(self, device) -> "Gaussians":
        return Gaussians(**{k: v.to(device) for k, v in self.tensors().items()})

    def select(self, mask: Tensor) -> "Gaussians":
        return Gaussians(**{k: v[mask] for k, v in self.tensors().items()})

    @staticmethod
    def cat(parts: list["Gaussians"]) -> "Gaussians":
        return Gaussians(**{k: torch.cat([getattr(p, k) for p in parts]) for k in parts[0].names()})

    @staticmethod
    def empty(sh_degree: int = 0, device=None) -> "Gaussians":
        K = (sh_degree + 1) ** 2
        z = lambda *s: torch.zeros(*s, device=device)  # noqa: E731
        return Gaussians(z(0, 3), z(0, 3), z(0, 4), z(0), z(0, 1, 3), z(0, K - 1, 3))
