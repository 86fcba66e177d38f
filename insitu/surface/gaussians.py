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

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from insitu.parallel.agreement import agree_errors

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


def drop_bands(gaussians: Gaussians, sh_degree: int | None) -> Gaussians:
    """``gaussians`` with its SH bands above ``sh_degree`` left out (None: as it is); a model of a lower
    degree is returned as it is."""
    if sh_degree is None or sh_degree >= gaussians.sh_degree:
        return gaussians
    if sh_degree < 0:
        raise ValueError(f"sh_degree must be >= 0, got {sh_degree}")
    keep = (sh_degree + 1) ** 2 - 1
    return Gaussians(gaussians.means, gaussians.log_scales, gaussians.quats, gaussians.opacity_logits,
                     gaussians.sh0, gaussians.shN[:, :keep])


def check_gaussians(g: Gaussians) -> int:
    """Validate the shapes of ``g`` (TypeError, ValueError saying what was expected); returns N."""
    if not isinstance(g, Gaussians):
        raise TypeError(f"expected insitu.surface.gaussians.Gaussians, got {type(g).__name__}")
    n = g.means.shape[0] if g.means.ndim == 2 else -1
    k1 = g.shN.shape[1] if g.shN.ndim == 3 else -1
    expected = {
        "means": ((n, 3), "[N, 3]"), "log_scales": ((n, 3), "[N, 3]"), "quats": ((n, 4), "[N, 4]"),
        "opacity_logits": ((n,), "[N]"), "sh0": ((n, 1, 3), "[N, 1, 3]"), "shN": ((n, k1, 3), "[N, K-1, 3]"),
    }
    for name, (shape, text) in expected.items():
        got = tuple(getattr(g, name).shape)
        if n < 0 or got != shape:
            raise ValueError(f"Gaussians.{name} must have shape {text} (N = len(means)), got {list(got)}")
    if math.isqrt(k1 + 1) ** 2 != k1 + 1:
        raise ValueError(f"Gaussians.shN must hold K-1 coefficients with K = 1, 4, 9 or 16, got K = {k1 + 1}")
    return n


def numpy32(t: Tensor) -> np.ndarray:
    """``t`` (any shape, any device) as a float32 numpy array on the CPU."""
    return t.detach().to("cpu", torch.float32).numpy()


def gather_gaussians(local: Gaussians, mpi_comm: Any, *, everywhere: bool = False) -> Gaussians | None:
    """Collect every rank's shard on rank 0 as one model, in rank order (a collective).

    local:    this rank's Gaussians (any device; every rank must have the same SH degree)
    mpi_comm: an mpi4py communicator, or None for a single process.
    everywhere: every rank gets the merged model (an all-gather), not only rank 0.

    Returns the merged float32 Gaussians on the CPU on rank 0 (on every rank with ``everywhere``),
    None on the other ranks; with one rank (or no communicator) returns ``local`` unchanged. Arrays
    move with MPI Gatherv / Allgatherv (no pickling of the data). Mismatched shards raise ValueError
    on every rank, so none is left waiting.
    """
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        check_gaussians(local)
        return local
    rank = mpi_comm.Get_rank()
    error = None
    try:
        n = check_gaussians(local)
    except (TypeError, ValueError) as e:
        n, error = 0, f"rank {rank}: {e}"
    errors = [e for e in agree_errors(mpi_comm, error) if e is not None]
    if errors:
        raise ValueError("gather_gaussians: " + "; ".join(errors))
    shapes = mpi_comm.allgather((n, local.sh_degree))    # the same on every rank: raised on every rank
    degrees = [d for _, d in shapes]
    if len(set(degrees)) > 1:
        raise ValueError(f"gather_gaussians: ranks hold different SH degrees {degrees}")
    counts = [c for c, _ in shapes]
    merged = {}
    for name, t in local.tensors().items():
        width = math.prod(t.shape[1:])
        send = np.ascontiguousarray(numpy32(t).reshape(n, width))
        here = everywhere or rank == 0
        if width == 0:                      # SH degree 0 has no shN: nothing to move
            merged[name] = torch.zeros((sum(counts) if here else 0,) + tuple(t.shape[1:]))
            continue
        recv = np.empty((sum(counts), width), np.float32) if here else None
        if everywhere:
            mpi_comm.Allgatherv(send, (recv, [c * width for c in counts]))
        else:
            mpi_comm.Gatherv(send, (recv, [c * width for c in counts]) if here else None, root=0)
        if here:
            merged[name] = torch.from_numpy(recv).reshape((sum(counts),) + tuple(t.shape[1:]))
    return Gaussians(**merged) if everywhere or rank == 0 else None
