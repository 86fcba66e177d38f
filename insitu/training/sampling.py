"""The training views each optimiser step draws (:class:`ViewSampler`).

Every epoch shows every training view once, in a shuffled order. The draws come from generators seeded by
``train.seed``: the same batches on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from insitu.errors import InputError
from insitu.groundtruth.scene import Scene


class ViewSampler:
    """Endless training batches ``(ids [B], background [B, 3] or [3])`` on the device: the training views
    of ``scene`` shuffled per epoch (an epoch's last partial batch is dropped), a random background per view
    when ``tc.random_background`` (else the evaluation's).

    tc:   the training settings: ``batch`` (B, at most the number of training views), ``seed`` and
          ``random_background``.
    """

    def __init__(self, scene: Scene, tc):
        self.train_ids = scene.views.train_ids
        n = len(self.train_ids)
        if n == 0:
            raise InputError("no training views: views.count and views.test_every leave every view held out")
        self.batch = min(tc.batch, n)
        self.background = scene.background
        self.random_background = tc.random_background
        self.generator = torch.Generator().manual_seed(tc.seed)
        self.bg_generator = torch.Generator().manual_seed(tc.seed + 1)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n, B, device = len(self.train_ids), self.batch, self.train_ids.device
        while True:
            order = torch.randperm(n, generator=self.generator)
            epoch = self.train_ids[order.to(device)]
            bgs = torch.rand(n, 3, generator=self.bg_generator).to(device) if self.random_background else None
            for i in range(0, n - B + 1, B):
                yield epoch[i:i + B], (bgs[i:i + B] if bgs is not None else self.background)
