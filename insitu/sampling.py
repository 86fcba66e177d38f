"""The training views each optimiser step draws (:class:`ViewSampler`).

By default every epoch shows every training view once, in a shuffled order. With ``train.view_weight``
``w > 0`` an epoch after the first draws as many views with replacement, view ``i`` with probability

    p_i = (1 - w) / n + w * e_i / sum(e)

where ``e_i`` is the squared error of view ``i``'s whole image the last time training drew it (its sum over
pixels and channels, on the random background it was drawn on): the views the model draws worst come up
more often, and every view still at least ``1 - w`` times as often as uniform drawing has it. A uniform
orbit gives every direction the same share of the steps, however hard the surface is to draw from it: the
engine's views within 25 degrees of a pole score 2.4 dB under the others even among the views it trains on
(BENCHMARKS.md, run 95). Weighted draws move quality towards such views at a cost to all the others (run 94):
the default is the shuffle.

The draws come from generators seeded by ``train.seed`` and, for weighted epochs, from errors summed over
every rank of the step and sent from rank 0: the same batches on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from .errors import InputError
from .scene import Scene


class ViewSampler:
    """Endless training batches ``(ids [B], background [B, 3] or [3])`` on the device: the training views
    of ``scene`` drawn per epoch (an epoch's last partial batch is dropped), a random background per view
    when ``tc.random_background`` (else the evaluation's).

    tc:   the training settings: ``batch`` (B, at most the number of training views), ``seed``,
          ``random_background`` and ``view_weight`` (w; module docstring).
    comm: every rank of the step (a :class:`insitu.parallel.Comm`), over which :meth:`record`'s errors are
          summed once an epoch (collective: every rank iterates alike); None: this process alone.
    """

    def __init__(self, scene: Scene, tc, comm=None):
        self.train_ids = scene.views.train_ids
        n = len(self.train_ids)
        if n == 0:
            raise InputError("no training views: views.count and views.test_every leave every view held out")
        if not 0.0 <= tc.view_weight <= 1.0:
            raise ValueError(f"view_weight: expected a number in [0, 1], got {tc.view_weight!r}")
        self.batch = min(tc.batch, n)
        self.weight = float(tc.view_weight)
        self.comm = comm
        self.background = scene.background
        self.random_background = tc.random_background
        self.generator = torch.Generator().manual_seed(tc.seed)
        self.bg_generator = torch.Generator().manual_seed(tc.seed + 1)
        device = self.train_ids.device
        self._sums = torch.zeros(2, len(scene.views), dtype=torch.float64, device=device)   # error, draws
        self.errors: np.ndarray | None = None       # [n] per training view, the latest (weighted epochs)

    def record(self, ids: Tensor, errors: Tensor | None) -> None:
        """Note this rank's ``errors: [b]`` (its band's part of each image's squared error) of the views
        ``ids: [b]`` it just trained on; nothing when the draws are uniform or ``errors`` is None."""
        if self.weight == 0 or errors is None:
            return
        ids = ids.to(self._sums.device)
        self._sums[0].index_add_(0, ids, errors.detach().to(self._sums))
        self._sums[1].index_add_(0, ids, torch.ones_like(ids, dtype=self._sums.dtype))

    def probabilities(self) -> np.ndarray | None:
        """``[n]`` the next epoch's probability of each training view (None: uniform, a shuffle)."""
        if self.weight == 0 or self.errors is None:
            return None
        total = float(self.errors.sum())
        if not np.isfinite(total) or total <= 0:
            return None
        n = len(self.errors)
        p = (1.0 - self.weight) / n + self.weight * self.errors / total
        return p / p.sum()

    def _update(self) -> None:
        """Fold the epoch's recorded errors into :attr:`errors` (collective over ``comm``: one all-reduce
        and one broadcast an epoch; views not drawn keep their last error, views never drawn take the
        mean of the others)."""
        sums = self._sums if self.comm is None else self.comm.all_reduce_sum(self._sums)
        sums = sums[:, self.train_ids].cpu().numpy()
        self._sums.zero_()
        drawn = sums[1] > 0
        errors = np.full(len(self.train_ids), np.nan) if self.errors is None else self.errors.copy()
        errors[drawn] = sums[0][drawn] / sums[1][drawn]
        known = np.isfinite(errors)
        if not known.any():
            return
        errors[~known] = errors[known].mean()
        if self.comm is not None and self.comm.size > 1:
            errors = self.comm.mpi.bcast(errors, root=0)    # the same draws on every rank, bit for bit
        self.errors = errors

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n, B, device = len(self.train_ids), self.batch, self.train_ids.device
        while True:
            if self.weight > 0:
                self._update()
            p = self.probabilities()
            if p is None:
                order = torch.randperm(n, generator=self.generator)
            else:
                order = torch.multinomial(torch.from_numpy(p), n, replacement=True, generator=self.generator)
            epoch = self.train_ids[order.to(device)]
            bgs = torch.rand(n, 3, generator=self.bg_generator).to(device) if self.random_background else None
            for i in range(0, n - B + 1, B):
                yield epoch[i:i + B], (bgs[i:i + B] if bgs is not None else self.background)
