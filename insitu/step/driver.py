"""One driver for a sequence of timesteps: ``insitu run/replay/stream`` and the Adaptor train through it.

The rule it holds, in one place: every step is given the previous trained step's result (what the step's
time budget, ``series.step_seconds``, reads), and with ``series.warm_start`` it starts from that step's model and
trains ``min(series.warm_iterations, train.iterations)`` iterations, and with
``series.follow_iterations`` as many more, of those up to ``train.iterations``, as its start's share of new seeds
(:func:`follow_iterations`, once the step has seeded), or, with a
quality target looked at during training (``train.psnr_target``, ``train.ssim_target``, ``train.eval_every``),
up to ``train.iterations``: until the target is met or the time budget (``train.time_budget_s``) is spent, as a
cold step;
the first step, a step after :meth:`StepDriver.forget` (a step kept from an earlier run or one
that failed, as the caller decides) and a step after one whose training diverged (NaN or infinite
values: :class:`insitu.errors.TrainingDiverged`, raised on every rank alike) start cold and train
``train.iterations``, as does, once the step has its warm start, one that would make ``series.cold_every`` warm
starts in a row (a keyframe) or whose warm start is more than ``series.cold_above`` new seeds
(:func:`insitu.step.pipeline.compute_step`). A step's result becomes the next warm start once the caller has recorded it
(:meth:`StepDriver.trained`), after the ranks agree that the step succeeded everywhere. With
``input.nonfinite: outside``, a step's NaN/Inf samples are filled first (:func:`masked`), so that the
step trains on a finite field.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from insitu.config import Config
from insitu.errors import InputError, TrainingDiverged
from insitu.volume import fill_nonfinite, outside_value


class StepDriver:
    """Trains the timesteps given to :meth:`train`, one after the other, each warm-started as configured.

    cfg:     the validated configuration.
    comm:    an :class:`insitu.parallel.comm.Comm`; :meth:`train` is collective over it.
    writer:  the :class:`insitu.output.export.StepWriter` that writes each step (or None).
    process: the function that trains one step, ``process(block, cfg, comm, *, step, time, writer,
             warm, iterations) -> result``; defaults to :func:`insitu.step.pipeline.run_step`.
    """

    def __init__(self, cfg: Config, comm: Any, writer: Any = None, *, process: Callable[..., Any] | None = None):
        if process is None:
            from insitu.step.pipeline import run_step as process
        self.cfg, self.comm, self.writer, self.process = cfg, comm, writer, process
        self.previous: Any = None           # the last trained step's result: the next one's reference (warm start)
        self.restart: int | None = None     # a kept step's warm_chain, where its state was not restored (resume)

    def train(self, block, *, step: int, time: float) -> Any:
        """Train one step (collective); returns the process's result (give it to :meth:`trained`
        once every rank succeeded, so that it warm-starts the next step). A step whose training
        diverged (:class:`TrainingDiverged`, raised here) makes the next one start cold, from seeds: the
        model before it was trained with the settings that diverged and may hold what ran away."""
        if self.cfg.input.nonfinite == "outside":
            block = masked(block, self.cfg, self.comm)
        warm = self.previous            # with series.warm_start its start, else its time budget's reference only
        iterations = warm_iterations(self.cfg) if warm is not None and self.cfg.series.warm_start else None
        try:
            return self.process(block, self.cfg, self.comm, step=step, time=time, writer=self.writer,
                                warm=warm, iterations=iterations)
        except TrainingDiverged:
            self.forget()
            raise

    def trained(self, result: Any) -> None:
        """``result`` (of :meth:`train`) succeeded on every rank: the next step starts from it."""
        chain, self.previous, self.restart = self.restart, result, None
        every = self.cfg.series.cold_every
        if chain is not None and result.warm_chain == 0 and 0 < every and chain + 1 < every:
            result.warm_chain = chain + 1   # a restart after kept steps counts on as the uninterrupted chain (resume)

    def forget(self) -> None:
        """The next step starts cold (the previous one was kept from an earlier run, or failed)."""
        self.previous, self.restart = None, None

    def resume(self, state: Any = None, chain: int = 0) -> None:
        """Go on after a step kept from an earlier run (``--resume``): from ``state``, that step's result restored
        (:func:`insitu.run.chain.load_state`), as the uninterrupted run would have; without it, cold, the chain
        counting on from the kept step's ``chain`` (its ``warm_chain``), so that the series' cold steps
        (``series.cold_every``) stay where they are in the uninterrupted run, which the steps equal from there."""
        self.previous, self.restart = state, (None if state is not None else int(chain))


def warm_iterations(cfg: Config) -> int:
    """A warm-started step's iterations: ``series.warm_iterations`` (at most ``train.iterations``), or, with a
    quality target that training looks at (every ``train.eval_every`` iterations), ``train.iterations``: where
    the surface changed more than the warm iterations can follow, the step trains on until it meets the
    target (or its time budget ends it)."""
    tc = cfg.train
    if (tc.psnr_target is not None or tc.ssim_target is not None) and tc.eval_every > 0:
        return tc.iterations
    return min(cfg.series.warm_iterations, tc.iterations)


def follow_iterations(cfg: Config, iterations: int, new: int, total: int) -> int:
    """A warm step's iterations once its start is known: ``iterations`` (:func:`warm_iterations`) and, with
    ``series.follow_iterations``, the share ``new / total`` of the start's Gaussians that are new seeds of the
    way on to ``train.iterations``: new seeds need a cold step's training, and a warm step on a surface that
    moved as a whole (a pattern that drifts a cell between outputs) is as new as a cold one; an unchanged
    surface trains ``iterations``. ``new``, ``total``: the counts over every rank (the same everywhere)."""
    if not cfg.series.follow_iterations or total <= 0 or iterations >= cfg.train.iterations:
        return iterations
    share = min(max(new / total, 0.0), 1.0)
    return iterations + round(share * (cfg.train.iterations - iterations))


def training_budget(cfg: Config, previous: dict | None, spent: float) -> float | None:
    """A step's training budget in seconds (None: none): ``train.time_budget_s``, and for a step after the first with
    ``series.step_seconds`` what that leaves once the ``spent`` seconds of the step so far and what the previous
    step took after its training are taken off (its ``previous`` metrics: the final figures, the standard files'
    fit, their figures, writing), whichever is tighter. On ranks that differ, the caller takes the least."""
    budget = cfg.train.time_budget_s
    if previous is None or cfg.series.step_seconds is None:
        return budget
    left = max(cfg.series.step_seconds - spent - after_training(previous), 0.0)
    return left if budget is None else min(budget, left)


def after_training(metrics: dict) -> float:
    """The seconds a step (its ``metrics``) took after its training: its final figures, the standard files' fit
    and figures, and writing its files (on the writer's thread or not)."""
    return (metrics["total_seconds"] - metrics["seeds_seconds"] - metrics["ground_truth_seconds"]
            - metrics["train_seconds"] + metrics.get("model_write_seconds", 0.0) + metrics.get("export_seconds", 0.0))


def masked(block, cfg: Config, comm: Any):
    """``block`` with its NaN/Inf samples counted as outside the surface (``input.nonfinite: outside``):
    the field's set to :func:`insitu.volume.outside_value` of its finite samples' global range, the
    colour field's to its lowest finite value; collective over ``comm`` (the values are global, so
    the ranks' ghost layers agree). InputError when no sample of the field is finite."""
    mpi = getattr(comm, "mpi", None)

    def finite_range(array: np.ndarray) -> tuple[float, float]:
        ok = np.asarray(array)[np.isfinite(array)]
        lo, hi = (float(ok.min()), float(ok.max())) if ok.size else (np.inf, -np.inf)
        if mpi is not None and mpi.Get_size() > 1:
            from mpi4py import MPI

            lo, hi = mpi.allreduce(lo, op=MPI.MIN), mpi.allreduce(hi, op=MPI.MAX)
        return lo, hi

    lo, hi = finite_range(block.data)
    if not lo <= hi:
        raise InputError(f"{cfg.input.var}: every sample is NaN/Inf (input.nonfinite: outside masks them all): "
                         "no surface to extract")
    fields = dict(block.fields)
    if cfg.input.color_var in fields:
        clo, _ = finite_range(fields[cfg.input.color_var])
        fields[cfg.input.color_var] = fill_nonfinite(fields[cfg.input.color_var], clo if np.isfinite(clo) else 0.0)
    return replace(block, data=fill_nonfinite(block.data, outside_value(lo, hi, cfg.input.iso)), fields=fields)
