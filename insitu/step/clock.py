"""The step's phase clock: the wall-clock seconds of its phases, for metrics.json's ``*_seconds``."""
from __future__ import annotations

import time as _time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PhaseClock:
    """Wall-clock seconds of a step's phases, for metrics.json's ``*_seconds``.

    device:  the step's device. On CUDA a phase ends (:meth:`lap`) once the device has done the
             work queued so far, so that the kernels a phase queued count to it.
    seconds: phase name -> seconds, of the phases ended so far (in order).
    spans:   name -> the seconds of each span timed inside a phase (:meth:`span`), in order.
    timer:   the clock read, in seconds (``time.perf_counter``; a test's fake clock).
    """

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)
    spans: dict[str, list[float]] = field(default_factory=dict)
    timer: Callable[[], float] = _time.perf_counter
    started: float | None = None                # default: when the clock is made
    mark: float = field(init=False)             # when the current phase began

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.timer()
        self.mark = self.started

    def _now(self, sync: bool) -> float:
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.timer()

    def lap(self, name: str, *, sync: bool = True) -> float:
        """End the current phase as ``name`` (after the device's queued work when ``sync``) and
        begin the next; returns the phase's seconds."""
        now = self._now(sync)
        self.seconds[name] = now - self.mark
        self.mark = now
        return self.seconds[name]

    def elapsed(self, *, sync: bool = False) -> float:
        """Seconds since the current phase began (after the device's queued work when ``sync``)."""
        return self._now(sync) - self.mark

    def total(self) -> float:
        """Seconds since the clock started (not waiting for the device)."""
        return self.timer() - self.started

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as one more span ``name``, from when the device has done the work queued
        before it (that is the current phase's); the block ends by reading its results from the
        device, so its end does not wait."""
        start = self._now(True)
        yield
        self.spans.setdefault(name, []).append(self.timer() - start)
