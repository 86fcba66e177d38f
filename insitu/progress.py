"""Progress display: a bar on a terminal, a plain line every tenth of the work in a log, a
line per finished phase of a step (:func:`note`) and a line per trained step (:func:`summary`)."""
from __future__ import annotations

import sys
import time as _time
from pathlib import Path


class LogProgress:
    """Progress for logs (stderr is not a terminal): a plain line after the first unit of work (its time
    tells how long the rest will take), then one every tenth of the work."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.info, self.t0 = total, desc, 0, {}, _time.perf_counter()
        self.next = 1

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self.next or self.done == self.total:
            extra = "".join(f", {k} {v}" for k, v in self.info.items())
            print(f"{self.desc}: {self.done}/{self.total}{extra} ({_time.perf_counter() - self.t0:.1f} s)",
                  file=sys.stderr, flush=True)
            tenth = max(self.total // 10, 1)
            self.next = (self.done // tenth + 1) * tenth

    def set_postfix(self, **info) -> None:
        self.info = info

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    """A progress bar on a terminal, plain lines in a log, nothing when disabled."""
    from tqdm.auto import tqdm

    if enabled and not sys.stderr.isatty():
        return LogProgress(total, desc)
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def note(message: str, enabled: bool) -> None:
    """One line on stderr saying what finished (a step's phases between the progress bars)."""
    if enabled:
        print(message, file=sys.stderr, flush=True)


def figure(value, spec: str = ".2f") -> str:
    """A figure as printed: ``n/a`` when it is absent (None) or not a number (NaN: e.g. the close-up
    views' PSNR when none of them sees the surface)."""
    if value is None or value != value:
        return "n/a"
    return format(value, spec)


def summary(metrics: dict, out: Path) -> str:
    """A trained step in one line, from its ``metrics`` (metrics.json's), its folder under ``out``; an absent
    figure reads ``n/a`` (:func:`figure`), the close-up views' are left out when neither set has one."""
    closer = {f"{n}x": figure(metrics.get(f"psnr_foreground_near{n}"), ".1f") for n in (2, 3)
              if f"psnr_foreground_near{n}" in metrics}
    if all(v == "n/a" for v in closer.values()):
        closer = {}
    return (f"step {metrics['step']}: surface PSNR {figure(metrics['psnr_foreground'])} dB, "
            f"SSIM {figure(metrics['ssim_foreground'], '.4f')}"
            + (f" ({' and '.join(closer)} closer: {' and '.join(closer.values())} dB)" if closer else "")
            + f", whole image {figure(metrics['psnr'])} dB, "
            f"{metrics['gaussians']} Gaussians, {metrics['iterations']} iterations"
            + (" (time budget)" if metrics.get("stopped_by") == "time budget" else "") + ", "
            f"GT {metrics['ground_truth_seconds']:.1f} s, train {metrics['train_seconds']:.1f} s "
            f"-> {out / ('step_%06d' % metrics['step'])}")
