"""The training views each optimiser step draws (:class:`ViewSampler`).

By default every epoch shows every training view once, in a shuffled order. With ``train.view_weight``
``w > 0`` an epoch after the first draws as many views with replacement, view ``i`` with probability

    p_i = (1 - w) / n + w * e_i / sum(e)

where ``e_i`` is the squared error of view ``i``'s image (its sum over pixels and channels, on the random
background it was drawn on) in the last epoch that drew it, averaged over that epoch's draws of it: the
views the model draws worst come up more often, and every view still at least ``1 - w`` times as often as
uniform drawing has it. Drawn with replacement, a view can come twice in one batch. A uniform
orbit gives every direction the same share of the steps, however hard the surface is to draw from it: the
engine's views within 25 degrees of a pole score 2.4 dB under the others even among the views it trains on
(BENCHMARKS.md, run 95). Weighted draws move quality towards such views at a cost to all the others (run 94):
the default is the shuffle.

The draws come from generators seeded by ``train.seed`` and, for weighted epochs, from errors summed over
every rank of the step and sent from rank 0: the same batches on every rank. (On a GPU the error sums add
in no fixed order, so two runs of weighted draws can differ in the sums' last bits, and then in a draw.)
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
        self.errors: np.ndarray | None = None       # [n] per training view, as :meth:`_folded` keeps them

    def record(self, ids: Tensor, errors: Tensor | None) -> None:
        """Note ``errors: [b]``, this rank's part of the squared error of each view ``ids: [b]`` it just trained on
        (:attr:`insitu.training.Trainer.image_errors`): its band's rows in sort-last, where every rank counts
        the draw (the folded errors are the images' over the number of ranks, alike for every view, which the
        probabilities do not see), the whole image in the replicated layout, where each rank records its own
        views. Nothing when the draws are uniform or ``errors`` is None. No wait for the device."""
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
        """Fold the epoch's recorded errors into :attr:`errors` (collective over ``comm``: one all-reduce and one
        broadcast of rank 0's result an epoch, so every rank draws from the same errors, bit for bit). Reading
        the sums waits for the device once an epoch, only when the draws are weighted."""
        sums = self._sums if self.comm is None else self.comm.all_reduce_sum(self._sums)
        sums = sums[:, self.train_ids].cpu().numpy()
        self._sums.zero_()
        errors = self._folded(sums)
        if self.comm is not None and self.comm.size > 1:
            errors = self.comm.mpi.bcast(errors, root=0)
        self.errors = errors

    def _folded(self, sums: np.ndarray) -> np.ndarray | None:
        """:attr:`errors` after an epoch whose ``sums: [2, n]`` (errors, draws) per training view were recorded:
        a view drawn takes the mean of its recorded errors, a view not drawn keeps its last, a view never drawn
        the mean of the others (None while no view was ever recorded)."""
        drawn = sums[1] > 0
        errors = np.full(len(self.train_ids), np.nan) if self.errors is None else self.errors.copy()
        errors[drawn] = sums[0][drawn] / sums[1][drawn]
        known = np.isfinite(errors)
        if not known.any():
            return self.errors
        errors[~known] = errors[known].mean()
        return errors

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
