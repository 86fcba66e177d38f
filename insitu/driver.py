"""One driver for a sequence of timesteps: ``insitu run/replay/stream`` and the Adaptor train through it.

The rule it holds, in one place: with ``insitu.warm_start``, a step starts from the previous
trained step's model and trains ``min(insitu.warm_iterations, train.iterations)`` iterations;
the first step, and a step after :meth:`StepDriver.forget` (a step kept from an earlier run or one
that failed, as the caller decides), start cold and train ``train.iterations``. A step's result
becomes the next warm start once the caller has recorded it (:meth:`StepDriver.trained`), after
the ranks agree that the step succeeded everywhere.
"""
from __future__ import annotations

from typing import Any, Callable

from .config import Config


class StepDriver:
    """Trains the timesteps given to :meth:`train`, one after the other, each warm-started as configured.

    cfg:     the validated configuration.
    comm:    an :class:`insitu.parallel.Comm`; :meth:`train` is collective over it.
    writer:  the :class:`insitu.export.StepWriter` that writes each step (or None).
    process: the function that trains one step, ``process(block, cfg, comm, *, step, time, writer,
             warm, iterations) -> result``; defaults to :func:`insitu.pipeline.run_step`.
    """

    def __init__(self, cfg: Config, comm: Any, writer: Any = None, *, process: Callable[..., Any] | None = None):
        if process is None:
            from .pipeline import run_step as process
        self.cfg, self.comm, self.writer, self.process = cfg, comm, writer, process
        self.previous: Any = None           # the last trained step's result, the next one's warm start

    def train(self, block, *, step: int, time: float) -> Any:
        """Train one step (collective); returns the process's result (give it to :meth:`trained`
        once every rank succeeded, so that it warm-starts the next step)."""
        warm = self.previous if self.cfg.insitu.warm_start else None
        iterations = min(self.cfg.insitu.warm_iterations, self.cfg.train.iterations) if warm is not None else None
        return self.process(block, self.cfg, self.comm, step=step, time=time, writer=self.writer,
                            warm=warm, iterations=iterations)

    def trained(self, result: Any) -> None:
        """``result`` (of :meth:`train`) succeeded on every rank: the next step starts from it."""
        self.previous = result

    def forget(self) -> None:
        """The next step starts cold (the previous one was kept from an earlier run, or failed)."""
        self.previous = None
