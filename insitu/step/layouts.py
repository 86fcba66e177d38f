"""How the ranks share a step's training (``run.layout``): one object, chosen once per step.

:class:`SortLast` (the default): each rank trains the Gaussians of its own block; every render is
composited across the ranks (:mod:`insitu.render.compositing`) and each rank's loss is its band's term.
:class:`Replicated` (data parallelism, for models that fit one device): the ranks gather the whole
model and the whole images, each trains the whole model on views of its own, alone, and the
trainer averages the gradients over the ranks; rank 0 alone evaluates, and at the end each rank
keeps the Gaussians in its block.

A layout holds every operation in which the two differ (:class:`Layout`); the step
(:func:`insitu.step.pipeline.compute_step`) calls them and never asks which layout it has. Every
method is called on every rank of ``comm`` (some are collective).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from insitu.config import Config
from insitu.errors import InputError
from insitu.groundtruth.scene import Scene, view_groups
from insitu.input.decomposition import Decomposition
from insitu.parallel.comm import Comm
from insitu.render.compositing import gather_bands
from insitu.surface.gaussians import Gaussians, gather_gaussians
from insitu.volume import Block

Evaluation = Callable[[Comm], tuple[Any, list]]     # work(comm) -> (figures, images), collective over comm


class Layout(Protocol):
    """The operations in which the layouts differ.

    comm:       every rank of the step.
    block:      this rank's block.
    train_comm: what the trainer's renders composite over (``comm``, or this rank alone).
    replicas:   the ranks the trainer averages its gradients over (None: no averaging).
    bounds:     ``(lo [3], hi [3])`` world box the trained means stay in (a margin is added).
    """

    comm: Comm
    block: Block
    train_comm: Comm
    replicas: Comm | None
    bounds: tuple[np.ndarray, np.ndarray]

    def prepare(self, shard: Gaussians, scene: Scene) -> tuple[Gaussians, Scene]:
        """The model this rank trains and the scene it trains and evaluates on, from its seeded
        shard and its band of the ground truth; collective."""
        ...

    def rows(self, flags: Tensor) -> Tensor:
        """``flags: [N]`` over this rank's seeded shard as flags over the model it trains (:meth:`prepare`'s
        rows); collective."""
        ...

    def images(self, scene: Scene) -> Scene:
        """The scene this rank trains and evaluates on from its band of the ground truth ``scene`` (the
        scene of :meth:`prepare`, or another one of the same step: other views, another light); collective."""
        ...

    def max_gaussians(self, cap: int, share: float, count: int) -> int:
        """The trainer's densification cap, from the global ``cap``, this rank's ``share`` of the
        surface area and the ``count`` of its seeded shard."""
        ...

    def batch(self, ids: Tensor, background: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's views of a step's batch ``ids: [B]`` (the same on every rank) and their
        backgrounds (``[B, 3]`` or one ``[3]``)."""
        ...

    def whole(self, count: int) -> int:
        """The whole model's Gaussians from the trainer's ``count``; collective."""
        ...

    def loss(self, loss: Tensor) -> float:
        """The whole images' loss from the trainer's ``loss`` (0-dim, :meth:`insitu.training.trainer.Trainer.step`);
        collective."""
        ...

    def evaluate(self, work: Evaluation) -> tuple[Any, list]:
        """``work(comm) -> (figures, images)`` run as this layout evaluates: returns the figures on
        every rank, the images on rank 0; collective."""
        ...

    def shard(self, model: Gaussians) -> tuple[Gaussians, int]:
        """This rank's shard of the trained ``model`` (what it writes and warm-starts from) and the
        whole model's Gaussians; collective."""
        ...


def _replicated(cfg: Config, comm: Comm) -> bool:
    return cfg.run.layout == "replicated" and comm.size > 1


def training_ranks(cfg: Config, comm: Comm) -> tuple[int, int]:
    """``(size, rank)`` of the ranks a training render is composited over, this rank's place among
    them: every rank (sort-last) or this one alone (replicated, several ranks)."""
    return (1, 0) if _replicated(cfg, comm) else (comm.size, comm.rank)


def choose_layout(cfg: Config, comm: Comm, block: Block, decomposition: Decomposition) -> Layout:
    """The layout ``cfg.run.layout`` names (one rank: sort-last, which is then the whole model)."""
    if _replicated(cfg, comm):
        return Replicated(comm, block, decomposition, per_rank=cfg.train.batch)
    return SortLast(comm, block)


@dataclass
class SortLast:
    """Each rank trains its block's Gaussians, composited sort-last with the other ranks' renders.

    comm:  every rank of the step.
    block: this rank's block (its box bounds the trained means).
    """

    comm: Comm
    block: Block
    replicas = None                             # no gradients to average

    @property
    def train_comm(self) -> Comm:
        return self.comm

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self.block.box

    def prepare(self, shard: Gaussians, scene: Scene) -> tuple[Gaussians, Scene]:
        return shard, scene

    def rows(self, flags: Tensor) -> Tensor:
        return flags

    def images(self, scene: Scene) -> Scene:
        return scene

    def max_gaussians(self, cap: int, share: float, count: int) -> int:
        return max(int(cap * share), count)         # the rank's share of the cap, never below its seeds

    def batch(self, ids: Tensor, background: Tensor) -> tuple[Tensor, Tensor]:
        return ids, background

    def whole(self, count: int) -> int:
        return self.comm.mpi.allreduce(count)

    def loss(self, loss: Tensor) -> float:
        return self.comm.mpi.allreduce(float(loss))  # the ranks' band terms sum to the loss

    def evaluate(self, work: Evaluation) -> tuple[Any, list]:
        return work(self.comm)

    def shard(self, model: Gaussians) -> tuple[Gaussians, int]:
        return model, self.comm.mpi.allreduce(len(model))


@dataclass
class Replicated:
    """Each rank trains the whole model on its own ``per_rank`` views of every step's
    ``per_rank x P`` (``run.layout: replicated``).

    comm:          every rank of the step (more than one).
    block:         this rank's block.
    decomposition: the ranks' blocks: at the end each rank keeps the Gaussians in its own.
    per_rank:      views per rank and step (``train.batch``).
    """

    comm: Comm
    block: Block
    decomposition: Decomposition
    per_rank: int
    train_comm: Comm = field(init=False)        # this rank alone: its renders composite over nothing
    replicas: Comm = field(init=False)          # every rank: the gradients averaged over them
    bounds: tuple[np.ndarray, np.ndarray] = field(init=False)   # the whole domain

    def __post_init__(self) -> None:
        self.train_comm, self.replicas, self.bounds = self.comm.solo(), self.comm, self.block.global_box

    def prepare(self, shard: Gaussians, scene: Scene) -> tuple[Gaussians, Scene]:
        """The whole model (every rank's shard, in rank order) and a Scene of the whole images of
        every view, on every rank."""
        train = len(scene.views.train_ids)
        if self.per_rank * self.comm.size > train:      # the same verdict on every rank
            raise InputError(f"run.layout=replicated: train.batch x ranks = {self.per_rank} x {self.comm.size} "
                             f"views per step, more than the {train} training views")
        model = gather_gaussians(shard.to("cpu"), self.comm.mpi, everywhere=True).to(self.comm.device)
        return model, self.images(scene)

    def images(self, scene: Scene) -> Scene:
        """A Scene of the whole images of every view of ``scene``, on every rank."""
        views = scene.views
        gt = torch.empty(len(views), views.height, views.width, 4, dtype=scene.gt.dtype, device=scene.gt.device)
        for group in view_groups(list(range(len(views))), views.width, views.height):
            gt[group] = gather_bands(scene.gt[group], self.comm)
        order = torch.zeros(len(views), 1, device=scene.order.device)     # one layer: nothing to composite
        return Scene(views, order, gt, (0, views.height), scene.background)

    def rows(self, flags: Tensor) -> Tensor:
        """Every rank's flags, in rank order (as :meth:`prepare` gathers the shards)."""
        parts = self.comm.mpi.allgather(flags.detach().to("cpu").numpy())
        return torch.from_numpy(np.concatenate(parts)).to(flags.device)

    def max_gaussians(self, cap: int, share: float, count: int) -> int:
        return cap                                  # every rank holds the whole model

    def batch(self, ids: Tensor, background: Tensor) -> tuple[Tensor, Tensor]:
        r, B = self.comm.rank, self.per_rank
        return ids[r * B:(r + 1) * B], (background[r * B:(r + 1) * B] if background.ndim == 2 else background)

    def whole(self, count: int) -> int:
        return count

    def loss(self, loss: Tensor) -> float:
        return self.comm.mpi.allreduce(float(loss)) / self.comm.size    # every replica's loss is a whole one

    def evaluate(self, work: Evaluation) -> tuple[Any, list]:
        """``work`` on rank 0 alone (every rank holds the same model and images), inside a phase, so
        that a failure there ends every rank instead of leaving them waiting for its figures."""
        figures, images = None, []
        with self.comm.phase("evaluation"):
            if self.comm.rank == 0:
                figures, images = work(self.train_comm)
        return self.comm.mpi.bcast(figures, root=0), images

    def shard(self, model: Gaussians) -> tuple[Gaussians, int]:
        """The Gaussians whose means lie in this rank's block; replicas that drifted apart (they would
        lose or repeat Gaussians) are an error on every rank."""
        owner = self.decomposition.owners(model.means.detach().cpu().numpy(), self.block.origin, self.block.spacing)
        shard = model.select(torch.as_tensor(owner == self.comm.rank, device=model.means.device))
        total = self.comm.mpi.allreduce(len(shard))
        self.comm.agree(total == len(model), f"replicated layout: the ranks kept {total} Gaussians of this rank's "
                                             f"model of {len(model)}", where="phase 'shards'")
        return shard, total
