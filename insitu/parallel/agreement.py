"""Cross-rank agreement: how the ranks take one decision together, so that a failure on one
rank never leaves the others waiting in a collective.

:func:`agree_errors` is the one agreement on errors that every stage uses (``Comm.agree`` and
``Comm.phase``, the sources, the Adaptor, the commands, the gather of a model): every rank gives
its error or None and every rank gets them all, then each raises the same error. Given
``seconds``, it waits at most that long (:func:`allgather_within`) and raises
:class:`insitu.errors.AgreementTimeout` past it. :func:`compare_configs` agrees on the configuration.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from insitu.config import config_differences, config_hash, config_value
from insitu.errors import AgreementTimeout, ConfigError


def allgather_within(mpi, obj: Any, seconds: float, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, like ``mpi.allgather``, but waiting at most
    ``seconds`` for the other ranks; past that, raise :class:`AgreementTimeout` naming ``what``."""
    from mpi4py import MPI      # on first use: importing it initialises MPI (not for `insitu view`, `--help`)

    size = mpi.Get_size()
    if size == 1:
        return [obj]

    def late() -> None:
        raise AgreementTimeout(f"{what}: the other ranks did not answer within {seconds:g} s "
                               "(run.timeout_s): a rank skipped this call, hangs or died")

    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    counts = np.empty(size, dtype=np.int64)
    _wait(mpi.Iallgather(np.array([data.size], dtype=np.int64), counts), seconds, late)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    buf = np.empty(int(counts.sum()), dtype=np.uint8)
    _wait(mpi.Iallgatherv(data, [buf, counts, displs, MPI.BYTE]), seconds, late)
    return [pickle.loads(buf[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def agree_errors(mpi, error: Any, *, seconds: float | None = None, what: str = "agreeing on errors") -> list[Any]:
    """The cross-rank agreement on errors that every stage uses: every rank's ``error`` (None where
    the rank succeeded, else its message or any picklable report), in rank order, on every rank,
    so that all ranks take the same decision and none is left waiting in a later collective.

    mpi:     an mpi4py communicator (every rank of it calls), or None for one process.
    seconds: wait at most this long for the other ranks, then raise :class:`AgreementTimeout`
             naming ``what`` (:func:`allgather_within`); None waits as long as it takes.
    """
    if mpi is None or mpi.Get_size() == 1:
        return [error]
    if seconds is None:
        return mpi.allgather(error)
    return allgather_within(mpi, error, seconds, what)


def first_error(errors: list[Any]) -> tuple[int, Any] | None:
    """(rank, error) of the first rank in ``errors`` (of :func:`agree_errors`) that failed, or None."""
    return next(((r, e) for r, e in enumerate(errors) if e is not None), None)


def compare_configs(mpi, cfg, seconds: float, extra: dict[str, Any] | None = None) -> None:
    """Collective: raise ConfigError on every rank unless every rank holds the same validated ``cfg``
    (and the same ``extra``, e.g. the command and its input); the error names the keys that differ."""
    mine = (config_hash(cfg), extra or {})
    gathered = allgather_within(mpi, mine, seconds, "comparing the configurations of the ranks")
    if all(g == gathered[0] for g in gathered):
        return
    dicts = allgather_within(mpi, {**cfg.to_dict(), **(extra or {})}, seconds, "comparing configurations")
    lines = []
    for r, d in enumerate(dicts[1:], start=1):
        keys = config_differences(dicts[0], d)
        if keys:
            lines.append(f"rank {r} differs from rank 0 in " + ", ".join(
                f"{k} ({config_value(dicts[0], k)!r} vs {config_value(d, k)!r})" for k in keys))
    raise ConfigError("the ranks run different configurations (every rank must be given the same one):\n  "
                      + "\n  ".join(lines))


def _wait(request, seconds: float, on_timeout) -> None:
    """Poll an MPI request until it completes; call ``on_timeout`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:
            on_timeout()
            request.Wait()          # on_timeout aborts; never reached in practice
            return
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
