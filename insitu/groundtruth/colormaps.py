"""Colour maps of the ground truth's colour field: control colours, linearly interpolated.

Both ray casters read :data:`COLORMAPS`; :func:`apply_colormap` is the torch reference's mapping
(the Triton kernel interpolates the same control colours in registers).
"""
from __future__ import annotations

import torch
from torch import Tensor

# Colour maps: (positions in [0, 1], RGB control colours), linearly interpolated.
# viridis: entries 0, 16, ..., 240, 255 of the 256-entry table of van der Walt & Smith (CC0).
_VIRIDIS_INDEX = (0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 255)
_VIRIDIS_RGB = (
    (0.267004, 0.004874, 0.329415), (0.282327, 0.094955, 0.417331), (0.278826, 0.175490, 0.483397),
    (0.258965, 0.251537, 0.524736), (0.229739, 0.322361, 0.545706), (0.199430, 0.387607, 0.554642),
    (0.172719, 0.448791, 0.557885), (0.149039, 0.508051, 0.557250), (0.127568, 0.566949, 0.550556),
    (0.120638, 0.625828, 0.533488), (0.157851, 0.683765, 0.501686), (0.246070, 0.738910, 0.452024),
    (0.369214, 0.788888, 0.382914), (0.515992, 0.831158, 0.294279), (0.678489, 0.863742, 0.189503),
    (0.845561, 0.887322, 0.099702), (0.993248, 0.906157, 0.143936),
)
COLORMAPS: dict[str, tuple[tuple[float, ...], tuple[tuple[float, float, float], ...]]] = {
    "viridis": (tuple(i / 255 for i in _VIRIDIS_INDEX), _VIRIDIS_RGB),
    "gray": ((0.0, 1.0), ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))),
}


def colormap_tensors(name: str, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Colour map ``name`` as float32 tensors on ``device``: positions ``[K]`` and control colours ``[K, 3]``."""
    if name not in COLORMAPS:
        raise ValueError(f"colormap: expected one of {sorted(COLORMAPS)}, got {name!r}")
    positions, colours = COLORMAPS[name]
    return (torch.tensor(positions, dtype=torch.float32, device=device),
            torch.tensor(colours, dtype=torch.float32, device=device))


def apply_colormap(values: Tensor, name: str = "viridis") -> Tensor:
    """Map ``values: [...]`` in [0, 1] (clamped) to colours ``[..., 3]`` through colour map ``name``."""
    pos, rgb = colormap_tensors(name, values.device)
    v = values.to(torch.float32).clamp(0.0, 1.0)
    seg = torch.bucketize(v, pos[1:-1], right=True)             # segment 0 .. P-2
    w = ((v - pos[seg]) / (pos[seg + 1] - pos[seg])).unsqueeze(-1)
    return rgb[seg] + w * (rgb[seg + 1] - rgb[seg])
