"""The kinds of error the package raises, in one place (so no stage imports another for an exception).

- ``InputError``: the field, file or stream given as input cannot be used (a ``ValueError``;
  command lines report it as bad input, exit code 2).
- ``ConfigError``: a configuration value is unknown, of the wrong type or out of range (a ``ValueError``).
- ``TrainingDiverged``: a step's training reached NaN or infinite values (an InputError: the settings cannot
  train this input; the step is recorded as failed and no model is written).
- ``SurfaceTooSmall``: a step's isosurface is too small to train (an ``InputError``; the commands skip the step).
- ``SourceError`` / ``SourceInputError``: a timestep source failed / its content cannot be used.
- ``RankFailure`` / ``RankInputFailure``: raised on every rank when one or more ranks failed
  (on bad input only, for the latter); ``AgreementTimeout``: the other ranks did not join a
  cross-rank decision in time.
- ``InsituError``: an in situ step failed on at least one rank (raised by the Adaptor on every rank).
- ``Terminated``: SIGTERM, raised as Ctrl-C's ``KeyboardInterrupt`` (a subclass of it).
"""
from __future__ import annotations


class InputError(ValueError):
    """The field or file given as input cannot be used; the message says why."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


class TrainingDiverged(InputError):
    """A step's training diverged: the Gaussians' parameters (or the loss) became NaN or infinite.

    Raised the same on every rank of the step (the ranks agree on it), so the command lines report it
    in one line (exit 2) and a series records the step as failed and trains the next one cold."""


class SurfaceTooSmall(InputError):
    """A step's isosurface exists but is too small to train (it covers less than a pixel of a view)."""


class SourceError(InputError, RuntimeError):
    """A timestep source failed: the stream ended unexpectedly, no step arrived in time,
    or the input cannot be used. An ``InputError`` (so command lines report it as bad
    input, with its message) and a ``RuntimeError``."""


class SourceInputError(SourceError):
    """The file or stream content cannot be used (missing, not 3D, truncated, corrupt)."""


class RankFailure(RuntimeError):
    """Raised on every rank when one or more ranks failed.

    ranks:    the ranks that failed, in increasing order.
    messages: their messages, in the same order.
    """

    def __init__(self, text: str, ranks: list[int], messages: list[str]):
        super().__init__(text)
        self.ranks = ranks
        self.messages = messages


class RankInputFailure(RankFailure, InputError):
    """A :class:`RankFailure` in which every failing rank failed on bad input (an InputError)."""


class AgreementTimeout(RuntimeError):
    """The other ranks did not join a cross-rank decision in time (a rank skipped a call, hangs or died).

    The communicator it was raised on is left with a pending operation: do not use it again.
    """


class InsituError(RuntimeError):
    """A step failed on at least one rank; raised with the same message on every rank."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a batch job's time limit, ``scancel``, ``kill``): raised in the main thread as Ctrl-C raises
    ``KeyboardInterrupt`` (:func:`insitu.cli.main` installs the handler), so that both end a run alike: the step
    being written is finished, nothing half-written stays, the output folder's lock is released (exit 143)."""
