"""Per-step outputs: the output folder, and the step writer that fills it.

Layout of an output directory::

    OUT/step_000120/model.ply       the model as standard 3DGS viewers draw it, reference 3DGS layout plus red green
                                    blue (any 3DGS viewer reads it, VTK tools see a coloured cloud)
    OUT/step_000120/model.spz       the same model compressed, in the step's frame (insitu.output.webmodel; SPZ's axes)
    OUT/step_000120/model.glb       model.spz's model as glTF with KHR_gaussian_splatting (output.glb;
                                    insitu.output.gltf): in the step's frame, its node placing it in world units,
                                    in glTF's axes (+Y up)
    OUT/step_000120/model.lit.spz   a lit model as trained, in the step's frame (base colours, normals as rotations):
                                    the report's viewer shades it; not a standard 3DGS model
    OUT/step_000120/cameras.json    the step's orbit cameras, for the viewer
    OUT/step_000120/views/*.png     held-out views, ground truth | render; *_fixed_light.png: in the standard
                                    files' fixed light, ground truth | model.spz | model.ply as their viewers draw them
    OUT/step_000120/metrics.json
    OUT/step_000120/config.yaml     the configuration the step was trained with
    OUT/metrics.csv                 one row per step
    OUT/report.html                 every step: 3D viewer, timestep slider, images, plots (insitu.output.report)

Every file is written atomically (:mod:`insitu.output.files`; the model: :mod:`insitu.output.ply`). Writing is
for one process (in a parallel run, rank 0; the functions here do not check the rank), except the
model: :meth:`StepWriter.write_model` is collective, every rank writing its own shard into the one
``model.ply`` at its offset.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from torch import Tensor

from insitu.config import (RUN_KEYS, Config, OutputConfig, config_differences, config_file_values, config_value,
                           from_dict, upgraded)
from insitu.errors import ConfigError
from insitu.output.files import atomic_write, flatten_metrics, plain, side_by_side, write_csv, write_json, write_png
from insitu.output.folder import (CHAIN_DIR, LOCK_NAME, STEP_DIR, STEP_TEMPORARY, OutputLock, lock_output,
                                  remove_orphans, step_dir, step_name)
from insitu.output.gltf import write_glb
from insitu.output.ply import write_ply
from insitu.output.report import STEP_FILES, cameras_json, write_report
from insitu.output.webmodel import STANDARD_SPZ_VERSION, write_spz
from insitu.surface.gaussians import Gaussians, drop_bands, gather_gaussians
from insitu.training.appearance import spz_blur
from insitu.volume import Frame

__all__ = ["STEP_DIR", "StepWriter", "claim_output", "prepare_output", "step_dir", "step_name", "write_report"]

# ---------------------------------------------------------------------------------------------
# The output folder, before a run

RESULT_FILES = ("metrics.csv", "report.html", "report.json")     # the run's own files at the top level


@dataclass
class Held:
    """What an output folder holds of a run's results (:func:`held`).

    done:    complete steps whose files are whole (:func:`step_whole`), in order.
    broken:  step -> why it is not whole (a file missing or of another size than its metrics.json records).
    foreign: step folders insitu did not write -> why (no metrics.json, or files insitu does not write).
    found:   every result: step folders, steps in the making (``.step_*.tmp``), metrics.csv, report.html.
    """

    done: list[int] = field(default_factory=list)
    broken: dict[int, str] = field(default_factory=dict)
    foreign: dict[Path, str] = field(default_factory=dict)
    found: list[Path] = field(default_factory=list)

    @property
    def steps(self) -> bool:
        """Whether the folder holds a step folder: only then does it hold results (a run that trained no step
        leaves metrics.csv and the report, which the next run writes again)."""
        return any(STEP_DIR.match(p.name) for p in self.found)


def held(out: Path) -> Held:
    """What the output folder ``out`` holds of a run's results."""
    h = Held()
    for p in out.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            h.found.append(p)
            strange = foreign_files(p)
            if strange is not None:
                h.foreign[p] = strange
                continue
            broken = step_whole(p)
            if broken is None:
                h.done.append(int(m.group(1)))
            else:
                h.broken[int(m.group(1))] = broken
        elif p.name in ("metrics.csv", "report.html") or STEP_TEMPORARY.match(p.name):
            h.found.append(p)
    h.done.sort()
    return h


def foreign_files(folder: Path) -> str | None:
    """Why a step folder is not one insitu wrote (it has no metrics.json, or holds files insitu does not write
    in a step folder: :data:`insitu.output.report.STEP_FILES` and ``views/*.png``), or None."""
    if not (folder / "metrics.json").is_file():
        return "it has no metrics.json"
    strange = []
    for p in sorted(folder.rglob("*")):
        name = p.relative_to(folder).as_posix()
        ours = (name in STEP_FILES and p.is_file() and not p.is_symlink()) or (name == "views" and p.is_dir()) or (
            p.parent.name == "views" and p.parent.parent == folder and p.suffix == ".png" and p.is_file())
        if not ours:
            strange.append(name)
    if not strange:
        return None
    return f"it holds {', '.join(strange[:3])}{', ...' if len(strange) > 3 else ''}, which insitu does not write"


def step_whole(folder: Path) -> str | None:
    """Why a complete step folder's files are not whole (its metrics.json unreadable; a file it records,
    ``files``: name -> bytes, missing or of another size), or None. Steps written before ``files`` was recorded
    are checked by the model files' sizes they record (``model_bytes``, ``web_model_bytes``, ``lit_model_bytes``)."""
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError) as e:
        return f"its metrics.json cannot be read: {e}"
    if not isinstance(metrics, dict):
        return "its metrics.json holds no record"
    files = metrics.get(FILES)
    if not isinstance(files, dict):
        files = {name: metrics[key] for key, name in MODEL_FILES if key in metrics}
    for name, size in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, its metrics.json records {size}"
    return None


def check_output_path(out_root: str | Path) -> None:
    """Raise ConfigError when ``out_root`` cannot take a run's results; changes nothing.

    Refused: a file; a path under a file; a symbolic link (the folder or a parent) to nothing;
    a folder that cannot be written (or whose nearest existing parent cannot); a folder in which a
    name the run writes is taken by something else (``metrics.csv`` as a folder, ``viewer`` as a
    file, a ``step_XXXXXX`` file).
    """
    out = Path(out_root)
    base = out
    while not base.exists():
        if base.is_symlink():
            raise ConfigError(f"output.dir {out}: {base} is a symbolic link to {os.readlink(base)}, which does not "
                              "exist; create its target or give another --out")
        if base.parent == base:
            break
        base = base.parent
    if not base.is_dir():
        what = "is a file, expected a folder (give another --out)" if base == out else \
            f"{base} is a file, so the folder cannot be created"
        raise ConfigError(f"output.dir {out}: {what}")
    try:
        with tempfile.TemporaryFile(dir=base, prefix=".insitu-probe."):
            pass
    except OSError as e:
        raise ConfigError(f"output.dir {out}: cannot write in {base} ({e.strerror or e})") from None
    if base == out:
        _check_names(out)


def _check_names(out: Path) -> None:
    """The names the run writes in ``out`` must be free or of the kind it writes."""
    for p in out.iterdir():
        wrong = None
        if p.name in RESULT_FILES and (p.is_dir() or (p.exists() and not p.is_file())):
            wrong = "a folder" if p.is_dir() else "not a plain file"
            expected = "a file (the run writes it)"
        elif p.name == "viewer" and p.exists() and not p.is_dir():
            wrong, expected = "a file", "a folder (the report's viewer goes there)"
        elif STEP_DIR.match(p.name) and p.exists() and not p.is_dir():
            wrong, expected = "a file", "a step folder"
        elif p.name == LOCK_NAME and (p.is_symlink() or (p.exists() and not p.is_file())):
            wrong, expected = "not a plain file", "the folder's lock file"
        if wrong:
            raise ConfigError(f"output.dir {out}: {p} is {wrong}, expected {expected}; move it away or give "
                              "another --out")


def prepare_output(out_root: str | Path, existing: str = "refuse", *, config: Config | None = None,
                   provenance: Mapping[str, Any] | None = None) -> list[int]:
    """Check that ``out_root`` can take this run's results before any work; returns the steps to keep.

    existing: what to do when the folder holds results (step folders, metrics.csv, report.html):
              "refuse" (raise ConfigError), "overwrite" (delete them; other files stay),
              "resume" (keep the complete steps, returned; remove partial ones).
    config, provenance: this run's configuration and what its steps come from (``StepWriter(provenance=)``);
              with "resume" every kept step must have been made with the same ones (the keys of
              ``config.RUN_KEYS`` aside), else ConfigError naming the keys that differ.
    Raises ConfigError for a path that cannot take the results (:func:`check_output_path`).
    Deletes only with "overwrite" or "resume", and only what is a result or a temporary file of a
    run: call it with the folder locked (:func:`claim_output`), so that no other run writes there.
    """
    out = Path(out_root)
    if existing not in ("refuse", "resume", "overwrite"):
        raise ValueError(f"existing: expected 'refuse', 'resume' or 'overwrite', got {existing!r}")
    check_output_path(out)
    if not out.is_dir():
        return []
    h = held(out)
    if not h.steps:                         # no step: no result (the run writes metrics.csv and the report again)
        for p in h.found:
            if STEP_TEMPORARY.match(p.name):    # what a killed run was writing
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        return []
    if existing == "refuse":
        done = h.done
        listed = ", ".join(map(str, done[:10])) + (", ..." if len(done) > 10 else "")
        raise ConfigError(f"output.dir {out}: holds the results of an earlier run"
                          + (f" (steps {listed})" if done else "")
                          + "; give --resume to keep its complete steps and train the others, --overwrite "
                            "to delete them, or another --out (in a config: output.existing)")
    if existing == "resume" and config is not None:
        _check_kept(out, h.done, config, provenance)
    removed = [p for p in h.found
               if not (existing == "resume" and (int(STEP_DIR.match(p.name).group(1)) in h.done
                                                 if STEP_DIR.match(p.name) else not p.name.startswith(".")))]
    strange = [(p, h.foreign[p]) for p in removed if p in h.foreign]
    if strange:
        (p, why), more = strange[0], len(strange) - 1
        raise ConfigError(f"output.dir {out}: {p.name} is not a step folder insitu wrote ({why}"
                          f"{f'; and {more} more such folder(s)' if more else ''}), and --{existing} deletes only "
                          "what insitu wrote; move it away, or give another --out")
    for step, why in sorted(h.broken.items()):
        if existing == "resume":
            print(f"insitu: warning: output.dir {out}: step {step} is not whole ({why}): it is trained again",
                  file=sys.stderr, flush=True)
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if existing == "overwrite":             # the earlier run's warm chain
        shutil.rmtree(out / CHAIN_DIR, ignore_errors=True)
    return [] if existing == "overwrite" else h.done


def claim_output(out_root: str | Path, existing: str = "refuse", *, config: Config | None = None,
                 provenance: Mapping[str, Any] | None = None, command: str = "") -> tuple[OutputLock, list[int]]:
    """Lock ``out_root`` for this run (:func:`insitu.output.folder.lock_output`), remove what a killed run was
    writing there, then :func:`prepare_output`; returns the lock (``release()`` it at the end of the
    run) and the steps to keep. For the process that writes the folder (rank 0)."""
    check_output_path(out_root)
    lock = lock_output(out_root, command)
    try:
        remove_orphans(Path(out_root))
        return lock, prepare_output(out_root, existing, config=config, provenance=provenance)
    except BaseException:
        lock.release()
        raise


def _check_kept(out: Path, done: list[int], config: Config, provenance: Mapping[str, Any] | None) -> None:
    """ConfigError unless every kept step was made from ``provenance`` with ``config`` (``RUN_KEYS`` aside)."""
    by_difference: dict[str, list[int]] = {}
    for step in done:
        text = "; ".join(kept_differences(out / step_name(step), config, provenance))
        if text:
            by_difference.setdefault(text, []).append(step)
    if by_difference:
        lines = [f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:10]))}"
                 f"{', ...' if len(steps) > 10 else ''}: {text}" for text, steps in by_difference.items()]
        raise ConfigError(f"output.dir {out}: --resume would keep steps made from another input or configuration "
                          f"({'; '.join(lines)}); give the same input and settings, --overwrite, or another --out")


def kept_differences(folder: Path, config: Config, provenance: Mapping[str, Any] | None) -> list[str]:
    """How a complete step folder's input (``metrics.json``'s ``provenance``) and configuration (``config.yaml``)
    differ from this run's, as ``key (kept vs now)`` texts; [] when they agree (``RUN_KEYS`` aside)."""
    try:                                        # (written before keys moved: compared where they are now)
        kept = from_dict(upgraded(config_file_values(folder / "config.yaml")))
    except ConfigError as e:
        return [f"its configuration cannot be compared ({e})"]
    now, then = plain(config.to_dict()), plain(kept.to_dict())
    out = [f"{key} ({config_value(then, key)!r} kept vs {config_value(now, key)!r} now)"
           for key in config_differences(then, now) if key not in RUN_KEYS]
    if provenance is not None:
        try:
            recorded = json.loads((folder / "metrics.json").read_text()).get("provenance")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if not isinstance(recorded, dict):
            return out + ["its metrics.json does not record the input it was made from"]
        now_provenance = plain(dict(provenance))
        out += [f"{key} ({recorded.get(key)!r} kept vs {now_provenance.get(key)!r} now)"
                for key in sorted(set(recorded) | set(now_provenance), key=str)
                if key != "files" and recorded.get(key) != now_provenance.get(key)]
        # the files of the same input (another path says so already; steps written before the files were
        # recorded have the path alone)
        if "files" in recorded and recorded.get("input") == now_provenance.get("input"):
            out += files_differences(recorded["files"], now_provenance.get("files"))
    return out


def files_differences(kept: Any, now: Any, shown: int = 3) -> list[str]:
    """How the input files a step was made from (``provenance["files"]``: name -> ``{"bytes", "mtime_ns"}``)
    differ from those there now, one text per file that changed, came or went (``shown`` at most)."""
    kept, now = (v if isinstance(v, Mapping) else {} for v in (kept, now))
    changed = [name for name in sorted(set(kept) | set(now), key=str) if kept.get(name) != now.get(name)]
    texts = [f"{name} ({_file_text(kept.get(name))} kept vs {_file_text(now.get(name))} now)"
             for name in changed[:shown]]
    return texts + ([f"{len(changed) - shown} more file(s)"] if len(changed) > shown else [])


def _file_text(record: Any) -> str:
    """``1234 bytes modified 2025-06-01 12:00:00.123456789`` (local time) of a file's record, or ``absent``."""
    if not isinstance(record, Mapping):
        return "absent"
    try:
        ns = int(record["mtime_ns"])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns // 10**9)) + f".{ns % 10**9:09d}"
        return f"{int(record['bytes'])} bytes modified {when}"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return repr(dict(record))


_VIEW_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
FIELD_HASH = "field_hash"               # metrics.json: the step's field hash (StepWriter.field_hashes)
FILES = "files"                         # metrics.json: the bytes of each file of the step folder (but itself)
MODEL_FILES = (("model_bytes", "model.ply"), ("web_model_bytes", "model.spz"), ("glb_model_bytes", "model.glb"),
               ("lit_model_bytes", "model.lit.spz"))


class StepWriter:
    """Writes each step's outputs under ``out_root`` (see the module docstring), atomically.

    Only one process may write to ``out_root``: in a parallel run, every rank calls
    :meth:`write_model` with its shard (a collective: the ranks write one ``model.ply``
    together), then rank 0 alone calls :meth:`write` with ``gaussians=None`` for the rest.

    A step is written into a hidden temporary folder that is renamed to ``step_XXXXXX`` once
    complete, so a step's outputs appear together or not at all. ``metrics.csv`` holds one row
    per step with its ``status`` (trained, skipped, failed) and, unless trained, the ``reason``;
    the report lists this writer's trained steps. The folder is created by the first write.

    output: the ``output`` section of the run's configuration (:class:`insitu.config.OutputConfig`; default
            its defaults): which model files a step writes (``ply``, ``spz``, ``glb``, ``lit``), at which SH degree
            (``sh_degree``) and for which steps (``every``).
    done:   steps already complete in ``out_root`` that this run keeps (``prepare_output`` with
            ``resume``): their rows of ``metrics.csv`` are rebuilt from their ``metrics.json`` (a run
            killed while writing the CSV leaves it behind the step folders), and the report lists them
            too; :meth:`publish` writes both at once.
    provenance: what the steps come from (e.g. ``{"command": "replay", "input": "/abs/m16.bp"}``), written
            into each step's ``metrics.json`` so that a resumed run can compare it with its own.

    overlap: a series' steps hand what rank 0 writes (:meth:`write`) to a thread of the writer's own
            (:meth:`later`) and go on: the next step seeds and casts its ground truth while they are written, and
            waits for them (:meth:`wait`) before it trains (:func:`insitu.step.pipeline.run_step`).

    ``field_hashes``: step -> a hash of the step's field (given before the step is written), recorded as
    ``field_hash`` in its ``metrics.json`` (not in ``metrics.csv``); :meth:`kept_field_hash` reads a kept
    step's, so that a resumed run can tell whether it was made from the same values.
    """

    def __init__(self, out_root: str | Path, *, output: OutputConfig | None = None, done: Collection[int] = (),
                 provenance: Mapping[str, Any] | None = None, overlap: bool = False) -> None:
        self.out_root = Path(out_root)
        self.output = output if output is not None else OutputConfig()
        self.overlap = overlap                  # a step's files written on a thread of their own (:meth:`later`)
        self._writing: Future | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._standard: dict[int, tuple[Gaussians, bool]] = {}  # step -> model.spz's, antialiased (write_model's)
        self.provenance = plain(dict(provenance)) if provenance is not None else None
        self._lock = threading.Lock()           # rows come from a training thread and the caller's
        self.rows: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, Path] = {}     # step -> its temporary folder, until write() renames it
        self.field_hashes: dict[int, str] = {}
        for step in sorted({int(s) for s in done}):
            self.rows[step] = {"step": step, "status": "trained", **self._kept_row(step)}

    def _kept_row(self, step: int) -> dict[str, Any]:
        """A kept step's row of metrics.csv, from its metrics.json (what the row was made from)."""
        try:
            metrics = json.loads((self.out_root / step_name(step) / "metrics.json").read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(metrics, dict):
            return {}
        return flatten_metrics({k: v for k, v in metrics.items() if k not in ("step", "provenance", FIELD_HASH, FILES)})

    def kept_field_hash(self, step: int) -> str | None:
        """The ``field_hash`` a complete step folder's ``metrics.json`` records, or None (none recorded)."""
        try:
            value = json.loads((self.out_root / step_name(step) / "metrics.json").read_text()).get(FIELD_HASH)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def publish(self) -> None:
        """Write ``metrics.csv`` and the report from the rows held now (a resumed run: the kept steps)."""
        with self._lock:
            self.out_root.mkdir(parents=True, exist_ok=True)
            write_csv(self.csv_path, list(self.rows.values()))
            write_report(self.out_root, steps=self.trained)

    @property
    def csv_path(self) -> Path:
        return self.out_root / "metrics.csv"

    def writes_models(self, step: int) -> bool:
        """Whether step ``step`` writes model files: its number a multiple of ``output.every``."""
        return self.output.writes_models(step)

    def write_model(self, step: int, gaussians: Gaussians, comm: Any = None, *,
                    frame: Frame | None = None, spz: Gaussians | None = None,
                    spz_whole: Gaussians | None = None) -> Path | None:
        """Write the step's standard model files from ``gaussians``, the model as standard viewers draw it:
        ``model.ply`` in world units into its folder in the making (``output.ply``; returns its path, else
        None), and for ``model.spz`` and ``model.glb`` (``output.spz``, ``output.glb``) the whole model gathered on
        rank 0 in ``frame``, which :meth:`write` writes (SPZ's fixed-point positions and byte scales cannot hold a
        grid in metres; model.glb's node places it in world units). Nothing
        when the step writes no model files (:meth:`writes_models`). Collective when ``comm`` spans several ranks;
        :meth:`write` on rank 0 completes the step.

        gaussians: this rank's shard (any device); the file holds every rank's shard in rank
                   order (:func:`write_ply` with ``comm``).
        comm:      an :class:`insitu.parallel.comm.Comm`, or None for one process.
        frame:     the coordinates ``gaussians`` are in (:class:`insitu.volume.Frame`; default world units).
        spz:       this rank's shard of model.spz's model where it is not model.ply's: the trained Gaussians,
                   drawn antialiased (the header's flag; :func:`insitu.training.appearance.spz_trained`).
        spz_whole: with ``spz``, that model already gathered on rank 0 (None on the other ranks): written as it is.
        """
        out = self.output
        if not self.writes_models(step) or not (out.ply or out.spz or out.glb):
            return None
        several = comm is not None and comm.size > 1
        if out.spz or out.glb:
            merged = spz_whole if spz is not None \
                else gather_gaussians(gaussians.to("cpu"), comm.mpi if several else None)
            if merged is not None:
                self._standard[int(step)] = (drop_bands(merged, out.sh_degree), spz is not None)
        if not out.ply:
            return None
        if several:
            with comm.phase("export: step folder"):
                folder = str(self._folder(step)) if comm.rank == 0 else None
            folder = Path(comm.mpi.bcast(folder, root=0))
        else:
            folder = self._folder(step)
        try:
            world = frame.gaussians_to_world(gaussians) if frame else gaussians
            return write_ply(folder / "model.ply", world, comm=comm if several else None, sh_degree=out.sh_degree)
        except BaseException:                   # disk full...: no step folder in the making stays behind
            if not several or comm.rank == 0:
                shutil.rmtree(self._pending.pop(int(step)), ignore_errors=True)
            raise

    def later(self, job: Callable[[], Any]) -> None:
        """Run ``job`` (a step's :meth:`write`) on the writer's own thread and return at once; one job at a time:
        the one before is waited for first (:meth:`wait`)."""
        self.wait()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="insitu-step-writer")
        self._writing = self._thread.submit(job)

    def wait(self) -> Any:
        """Wait for the job :meth:`later` runs, if any, and raise its error here; returns what it returned (None
        without a job)."""
        writing, self._writing = self._writing, None
        return None if writing is None else writing.result()

    def close(self) -> BaseException | None:
        """End the writer, however the run ends (an error, Ctrl-C, SIGTERM): the step that :meth:`later` writes is
        written to its end (a step reported as written is kept), then the folders of steps in the making that no
        job will complete are removed, and the thread ends. Returns the written step's error, if any, instead of
        raising it (the caller may be handling another). For the process that writes the folder (rank 0)."""
        error = None
        try:
            self.wait()
        except Exception as e:                  # (a second Ctrl-C while it waits is raised)
            error = e
        for step in list(self._pending):
            shutil.rmtree(self._pending.pop(step), ignore_errors=True)
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        return error

    def _folder(self, step: int) -> Path:
        """The step's temporary folder (made on first use; :meth:`write` renames it into place)."""
        if int(step) not in self._pending:
            final = self.out_root / step_name(step)
            self.out_root.mkdir(parents=True, exist_ok=True)
            self._pending[int(step)] = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp",
                                                             dir=self.out_root))
        return self._pending[int(step)]

    @property
    def trained(self) -> list[int]:
        """Steps written (or kept) by this writer."""
        return sorted(s for s, r in self.rows.items() if r.get("status") == "trained")

    def write(
        self,
        step: int,
        gaussians: Gaussians | None,
        views: Sequence[tuple[str | Tensor | np.ndarray, ...]],
        metrics: Mapping[str, Any],
        config: Any = None,
        *,
        cameras: Any = None,
        frame: Frame | None = None,
    ) -> Path:
        """Write one step; returns its folder.

        gaussians: the merged model as trained (None: none on this rank): a lit one (metrics ``color_model``
                   ``lit``) as ``model.lit.spz`` (``output.lit``), in the frame; an SH one as model.ply (world
                   units), model.spz and model.glb when :meth:`write_model` did not write them;
        views:     (name, gt [H, W, 3], pred [H, W, 3], ...) per image, written side by side as views/<name>.png
                   (GT | render; the standard files' light: GT | model.spz | model.ply);
        metrics:   values for metrics.json and one row of metrics.csv (nested dicts get dotted columns);
        config:    the configuration used (a dataclass with ``to_dict()``, a dataclass or a dict), as config.yaml.
        cameras:   the step's views (:class:`insitu.groundtruth.views.Views`), as cameras.json for the report's viewer.
        frame:     the coordinates that ``gaussians`` and ``cameras`` are in (:class:`insitu.volume.Frame`;
                   default world units). model.ply is written in world units; model.spz, model.lit.spz
                   and cameras.json, which the report's viewer reads, stay in the frame (a grid in metres would
                   not survive spz's fixed-point positions and byte scales, nor the viewer's float16), and
                   cameras.json records it (``frame``: world = origin + scale * x); model.glb holds its Gaussians
                   in the frame and the frame in its node (:mod:`insitu.output.gltf`).

        model.spz's header (and model.glb's ``extras``) says the model is drawn antialiased when it is the model
        trained so: the trained Gaussians :meth:`write_model` was given as ``spz``, or, without :meth:`write_model`,
        ``gaussians`` not refit as standard viewers draw them. ``model_bytes``, ``web_model_bytes``,
        ``glb_model_bytes`` and ``lit_model_bytes`` (the files
        written), ``bytes_written`` (every file of the step folder but metrics.json) and ``export_seconds``
        (writing the models, images and cameras) join the metrics; metrics.json also records each of those files'
        bytes (``files``: relative name -> bytes), which ``--resume`` checks (:func:`step_whole`).
        """
        for name, *images in views:
            if not isinstance(name, str) or not _VIEW_NAME.match(name):
                raise ValueError(f"view names must be plain file names ([A-Za-z0-9_.-]+), got {name!r}")
            if not images:
                raise ValueError(f"view {name}: expected its images (ground truth, render...), got none")
        final = self.out_root / step_name(step)
        t0 = time.perf_counter()
        d = self._folder(step)
        metrics = dict(metrics)
        try:
            if views:
                (d / "views").mkdir(exist_ok=True)
            images = [partial(write_png, d / "views" / f"{name}.png", side_by_side(*pictures))
                      for name, *pictures in views]
            self._write_models(step, d, gaussians, metrics, config, frame, also=images)
            if cameras is not None:
                write_json(d / "cameras.json", cameras_json(cameras, frame))
            if config is not None:
                cfg = config.to_dict() if hasattr(config, "to_dict") else config
                atomic_write(d / "config.yaml", yaml.safe_dump(plain(cfg), sort_keys=False))
            files = {p.relative_to(d).as_posix(): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}
            metrics["bytes_written"] = sum(files.values())
            metrics["export_seconds"] = round(time.perf_counter() - t0, 3)
            hashed = {FIELD_HASH: self.field_hashes[int(step)]} if int(step) in self.field_hashes else {}
            write_json(d / "metrics.json", {"step": int(step), **plain(metrics), **hashed, FILES: files,
                                            **({"provenance": self.provenance} if self.provenance is not None else {})})
            d.chmod(0o755)
            if final.exists():                      # the same step again (overwrite): the old one goes
                old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.old")
                os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(d, final)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        finally:
            self._pending.pop(int(step), None)
            self._standard.pop(int(step), None)
        # a figure that is not a number (no held-out view saw the surface) is absent, as in metrics.json
        row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in flatten_metrics(metrics).items()}
        self._row({int(step): {"status": "trained", **row}})
        return final

    def _write_models(self, step: int, d: Path, gaussians: Gaussians | None, metrics: dict, config: Any,
                      frame: Frame | None, *, also: Sequence[Callable[[], Any]] = ()) -> None:
        """The model files of :meth:`write` into the step's folder ``d``, and the jobs ``also`` (its images)
        beside them; their sizes into ``metrics``."""
        out = self.output
        jobs = list(also)                       # encoded side by side: numpy, torch, zlib and Pillow leave the GIL
        if not self.writes_models(step):
            run_side_by_side(jobs)
            return
        lit = metrics.get("color_model") == "lit"
        standard, antialiased = self._standard.pop(int(step), (None, False))
        if gaussians is not None and not lit and not (d / "model.ply").exists() and standard is None:
            world = frame.gaussians_to_world(gaussians) if frame else gaussians    # no write_model: this model
            if out.ply:
                write_ply(d / "model.ply", world, sh_degree=out.sh_degree)
            if out.spz or out.glb:
                standard, antialiased = drop_bands(gaussians, out.sh_degree), _drawn_antialiased(config, metrics)
        if standard is not None and out.spz:
            jobs.append(partial(write_spz, d / "model.spz", standard, antialiased=antialiased,
                                version=STANDARD_SPZ_VERSION))
        if standard is not None and out.glb:
            jobs.append(partial(write_glb, d / "model.glb", standard, frame=frame, antialiased=antialiased))
        if gaussians is not None and lit and out.lit:
            jobs.append(partial(write_spz, d / "model.lit.spz", gaussians,
                                antialiased=bool(metrics.get("antialiased", False))))
        run_side_by_side(jobs)
        for key, name in MODEL_FILES:
            if (d / name).is_file():
                metrics[key] = (d / name).stat().st_size

    def record(self, step: int, status: str, reason: str) -> None:
        """A step that was not trained: ``status`` "skipped" or "failed", and why (one row of metrics.csv)."""
        self.record_all(status, [(step, reason)])

    def record_all(self, status: str, steps: Sequence[tuple[int, str]]) -> None:
        """:meth:`record` for several ``(step, reason)`` at once: metrics.csv and the report written once."""
        if status not in ("skipped", "failed"):
            raise ValueError(f"status: expected 'skipped' or 'failed', got {status!r}")
        for step, _ in steps:
            step_name(step)                         # a valid step number
        rows = {int(step): {"status": status, "reason": " ".join(str(reason).split())} for step, reason in steps
                if self.rows.get(int(step), {}).get("status") != "trained"}
        if not rows:
            return                                  # a step trained earlier in this run stays trained
        self.out_root.mkdir(parents=True, exist_ok=True)
        self._row(rows)

    def _row(self, rows: Mapping[int, Mapping[str, Any]]) -> None:
        with self._lock:
            for step, row in rows.items():
                self.rows[int(step)] = {"step": int(step), **row}
            write_csv(self.csv_path, list(self.rows.values()))
            write_report(self.out_root, steps=self.trained)


def run_side_by_side(jobs: Sequence[Callable[[], Any]]) -> None:
    """Run ``jobs`` in threads, as many at once as there are jobs and cores; the first failure is raised once all
    have ended (no file of the step is left half written behind the caller's back)."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1), thread_name_prefix="insitu-write") as pool:
        futures = [pool.submit(job) for job in jobs]
    for done in futures:
        done.result()


def _drawn_antialiased(config: Any, metrics: Mapping[str, Any]) -> bool:
    """Whether the standard model (model.ply's, model.spz's) is drawn with the antialiased blur
    (:func:`insitu.training.appearance.spz_blur`); without the configuration, the metrics' ``antialiased``
    (the model as trained)."""
    trained = bool(metrics.get("antialiased", False))
    if not isinstance(config, Config):
        return trained
    return spz_blur(config, float(metrics.get("eps2d") or 0.0), trained, int(metrics.get("iterations") or 0))[1]
