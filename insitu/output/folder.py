"""An output folder: the names a run writes there, and the lock that keeps it to one run at a time.

Names: ``step_XXXXXX`` (a complete step), ``.step_XXXXXX.*.tmp`` (a step being written, renamed
into place when complete) and ``.NAME.<12 hex digits>.tmp`` (a file being written atomically,
:func:`insitu.output.files.atomic_path`). Both kinds of temporary name are the run's own: left behind,
they are what a killed run was writing, and the next run that holds the lock removes them.

The lock, ``OUT/.insitu.lock``, is held (``fcntl.flock``) by the process that writes the folder
(rank 0 of a parallel run) from before it looks at the folder's results to the end of the run;
the file says which process holds it (PID, host, command, start time), so that a second run is
refused with those. The kernel drops the lock when its process ends, however it ends: a killed
run never leaves the folder locked. Within one process the lock is shared (``insitu demo`` runs
the Adaptor inside the command, both on the same folder).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np

from insitu.errors import ConfigError

STEP_DIR = re.compile(r"^step_(\d{6,})$")
STEP_TEMPORARY = re.compile(r"^\.step_\d{6,}\..*\.(tmp|old)$")
FILE_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
LOCK_NAME = ".insitu.lock"


def step_name(step: int) -> str:
    """``step_000120`` for step 120."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return f"step_{int(step):06d}"


def step_dir(out_root: str | Path, step: int) -> Path:
    """``out_root/step_000120`` for step 120, created."""
    d = Path(out_root) / step_name(step)
    d.mkdir(parents=True, exist_ok=True)
    return d


def remove_orphans(out: Path) -> list[Path]:
    """Remove the temporary files a killed run left in ``out`` and in ``out/viewer`` (``FILE_TEMPORARY``
    names); returns them. Only for the holder of the folder's lock: nobody else writes there."""
    removed = []
    for folder in (out, out / "viewer"):
        if not folder.is_dir():
            continue
        paths = folder.rglob(".*.tmp") if folder.name == "viewer" else folder.glob(".*.tmp")
        for p in paths:
            if FILE_TEMPORARY.match(p.name) and p.is_file() and not p.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------
# The lock


_HELD: dict[str, "OutputLock"] = {}        # this process's locks, by the folder's real path
_HELD_GUARD = threading.Lock()


class OutputLock:
    """This process's hold on an output folder (:func:`lock_output`); :meth:`release` when the run ends.

    out:     the folder.
    created: the folders :func:`lock_output` created for it (removed again by :meth:`release` when
             the run left nothing in them).
    """

    def __init__(self, out: Path, fd: int, key: str, created: list[Path]):
        self.out, self._fd, self._key, self.created = out, fd, key, created
        self._holders = 1

    def release(self) -> None:
        """Drop this hold; the last one removes the lock file and unlocks. Removes the folders the
        lock created when they are empty (a run refused after taking the lock leaves nothing)."""
        with _HELD_GUARD:
            if self._fd < 0:
                return
            self._holders -= 1
            if self._holders:
                return
            _HELD.pop(self._key, None)
            fd, self._fd = self._fd, -1
        path = self.out / LOCK_NAME
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:    # still ours: nobody took it over
                path.unlink()
        os.close(fd)
        for d in reversed(self.created):
            with contextlib.suppress(OSError):
                d.rmdir()

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output(out: str | Path, command: str = "") -> OutputLock:
    """Lock the output folder ``out`` for this run, creating it (and its parents) when missing.

    command: what this run is, for the message another run gets (e.g. ``"insitu replay m16.bp"``).
    Raises ConfigError when another process holds the folder, naming its PID, host, command and
    start time. A folder already locked by this process is shared (the holds are counted).
    """
    out = Path(out)
    key = os.path.realpath(out)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None:
            held._holders += 1
            return held
    created = _make_folders(out)
    try:
        fd = _take(out / LOCK_NAME, out)
    except BaseException:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    lock = OutputLock(out, fd, key, created)
    with _HELD_GUARD:
        _HELD[key] = lock
    return lock


def _make_folders(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; returns those this call created, outermost first."""
    missing = []
    p = out
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    created = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
                created.append(d)
            except FileExistsError:
                pass
    except OSError as e:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise ConfigError(f"output.dir {out}: cannot create {e.filename or out} ({e.strerror or e})") from None
    return created


def _take(path: Path, out: Path) -> int:
    """Open and lock ``path``; returns the file descriptor, or raises ConfigError naming the holder."""
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ConfigError(f"output.dir {out}: cannot open its lock file {path} ({e.strerror or e}); "
                              "it must be a plain file") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise ConfigError(f"output.dir {out}: in use by another run ({holder}); wait for it to end, "
                              "or give another --out") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise ConfigError(f"output.dir {out}: cannot lock {path} ({e.strerror or e})") from None
            _check_unlockable(fd, path, out)           # a file system without locks: the holder's word
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:                      # its holder just released it: take the new one
            same = False
        if same:
            return fd
        os.close(fd)
    raise ConfigError(f"output.dir {out}: its lock file {path} keeps changing; is another run starting there?")


def _read_holder(fd: int) -> dict:
    for _ in range(20):                                # the holder writes its details just after locking
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            if isinstance(info, dict):
                return info
        time.sleep(0.01)
    return {}


def _describe(info: dict) -> str:
    """``PID 123 on host h, insitu replay ..., since ...`` from a lock file's record."""
    if not info:
        return "its PID and host are not recorded"
    text = f"PID {info.get('pid', '?')} on {info.get('host', '?')}"
    if info.get("command"):
        text += f", {info['command']}"
    if info.get("since"):
        text += f", since {info['since']}"
    return text


def _check_unlockable(fd: int, path: Path, out: Path) -> None:
    """Where the file system cannot lock: refuse when the recorded holder may still run (a live PID on
    this host, or any other host), take the file over otherwise."""
    info = _read_holder(fd)
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int):
        return
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
    os.close(fd)
    raise ConfigError(f"output.dir {out}: in use by another run ({_describe(info)}; this file system cannot "
                      f"lock files, so if that run has ended, remove {path}); or give another --out")

