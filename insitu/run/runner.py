"""Drive the pipeline over a source of timesteps: the body of every CLI command."""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import stat
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from insitu.config import FILE_KINDS, Config, check_backend, check_memory
from insitu.errors import ConfigError, InputError, RankFailure, SurfaceTooSmall, Terminated
from insitu.parallel.agreement import agree_errors, first_error
from insitu.progress import summary
from insitu.run.demo import check_demo, run_demo
from insitu.volume import check_geometry

if TYPE_CHECKING:
    from insitu.run.chain import Chain


def say(comm, text: str) -> None:
    if comm is None or comm.rank == 0:
        print(text, flush=True)


def train_steps(steps, cfg: Config, comm, writer, out: Path, *, done: frozenset[int] = frozenset(),
                failed: list[tuple[int, str]] | None = None, skipped: list[tuple[int, str]] | None = None,
                kept: dict[int, str | None] | None = None, chain: Chain | None = None) -> int:
    """Train every step a source yields (warm-starting from the previous one when configured).

    done:    steps already complete in the output folder (``--resume``): not trained again.
    failed:  a step whose input is unusable (no surface, NaN, ...; the same verdict on every rank)
             is appended here as (step, message) and the next step is trained; without a list,
             the failure is raised.
    skipped: likewise, a step whose surface is too small to train (:class:`insitu.errors.SurfaceTooSmall`).
    kept:    the field hashes the kept steps (``done``) record (None: none recorded); a kept step whose
             field's hash (:func:`field_hash`) differs now is a ConfigError, on every rank.
    chain:   a series' warm chain in the output folder (:class:`insitu.run.chain.Chain`): each trained step's state
             saved, and the last kept step's restored before the next step trains.
    Every step's field hash goes to ``writer.field_hashes`` (its metrics.json records it). With the writer's
    ``overlap``, a step's files are written while the next step seeds and casts its ground truth; the last
    step's before this returns.
    """
    from insitu.step.driver import StepDriver  # torch and the analysis: imported when a command trains,
                                                # so that `--help` and refused input answer at once
    driver, trained = StepDriver(cfg, comm, writer), 0
    kept_before = None                          # the kept step just before (--resume)
    items = iter(steps)
    while True:
        with comm.phase("read step"):          # a failed read on one rank ends every rank
            item = next(items, None)
        ended = comm.mpi.allgather(item is None)
        if all(ended):
            break
        if any(ended):
            raise InputError(f"the source ended on rank(s) {[r for r, e in enumerate(ended) if e]} "
                             "but not on the others")
        digest = field_hash(item.block, comm.mpi)
        if item.step in done:
            recorded = (kept or {}).get(item.step)
            if recorded is not None and recorded != digest:
                raise ConfigError(f"output.dir {out}: --resume would keep step {item.step}, made from other values of "
                                  f"its field than the input holds now (field hash {recorded} kept vs {digest} now); "
                                  "give the input it was made from, --overwrite, or another --out")
            say(comm, f"step {item.step}: complete in {out}, kept (--resume)")
            driver.forget()
            kept_before = item.step
            continue
        if kept_before is not None and chain is not None:   # the warm chain as it was (collective)
            say(comm, chain.resume(driver, comm, kept_before))
        kept_before = None
        if writer is not None:
            writer.field_hashes[item.step] = digest
        try:
            result = driver.train(item.block, step=item.step, time=item.time)
        except InputError as e:                 # agreed on every rank: this step is skipped
            into = skipped if isinstance(e, SurfaceTooSmall) else failed
            if into is None:
                raise
            into.append((item.step, str(e)))
            driver.forget()
            continue
        driver.trained(result)
        if chain is not None:
            chain.save(result)                  # what a resumed run goes on from
        trained += 1
        say(comm, summary(result.metrics, out))
    if writer is not None:
        with comm.phase("export"):              # the last step's files (written beside the steps after it)
            writer.wait()
    return trained


def load_npy(path: Path) -> np.ndarray:
    """A ``.npy`` array, memory-mapped (each rank copies only its block); InputError when unusable."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a .npy file")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
    except (ValueError, EOFError, OSError) as e:
        raise InputError(f"{path}: not a readable .npy file ({e})") from None
    if dtype.hasobject or dtype.kind not in "uif":
        raise InputError(f"{path}: expected an array of integers or floats, got dtype {dtype}")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:       # e.g. fewer bytes than the header announces
        raise InputError(f"{path}: not a readable .npy file of shape {shape} {dtype} ({e})") from None


def npz_text(path: Path) -> str:
    """The error of ``insitu run`` given a NumPy ``.npz`` archive: it reads one array, so name the arrays inside
    and how to save one of them (a raw file's naming rules would only mislead)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            names = list(archive.files)
    except (OSError, ValueError, EOFError):     # damaged or not a zip: its arrays are not listed
        names = []
    first = names[0] if names else "NAME"
    held = f" (holding {', '.join(names[:10])}{', ...' if len(names) > 10 else ''})" if names else ""
    return (f"{path}: a NumPy .npz archive{held}; insitu run reads one array from a .npy file or a raw file: "
            f"save the field with numpy.save('{first}.npy', numpy.load('{path.name}')['{first}'])")


def volume_source(args: argparse.Namespace, cfg: Config, rank: int, size: int):
    """The single-step source of ``insitu run``: a raw file or a .npy array, cut for this rank."""
    from insitu.input.sources import ArraySource, RawSource  # as StepDriver above: torch on first use

    path, spacing = Path(args.input), tuple(args.spacing)
    if cfg.input.spacing is not None:
        raise ConfigError(f"input.spacing={cfg.input.spacing}: sets the spacing of a BP file or SST stream (insitu "
                          "replay, stream); insitu run takes --spacing DX DY DZ")
    origin = tuple(cfg.input.origin or (0.0, 0.0, 0.0))
    if path.suffix == ".npy":
        return ArraySource(load_npy(path), rank=rank, size=size, origin=origin, spacing=spacing,
                           downsample=cfg.input.downsample, name=path.name, nonfinite=cfg.input.nonfinite)
    return RawSource(path, rank=rank, size=size, dims=cfg.input.dims, dtype=cfg.input.dtype,
                     downsample=cfg.input.downsample, origin=origin, spacing=spacing, nonfinite=cfg.input.nonfinite)


SAMPLES = 1 << 20                           # the field's samples that field_hash and the iso suggestion read, at most


def global_sample(block, mpi, limit: int = SAMPLES) -> np.ndarray | None:
    """The whole field's samples on a regular grid, every ``k``-th along each axis (``k`` the least that keeps
    them within ``limit``), as ``[nz, ny, nx]`` on rank 0 (None on the others): the same for any number of
    ranks. Each rank gives its part of the grid (the samples of its owned cells, and the field's last samples
    for the last block): collective over ``mpi`` (None: one process)."""
    stride = max(1, math.ceil((math.prod(block.global_shape) / limit) ** (1 / 3)))
    axes = []                                   # x, y, z: the grid's global indices in this rank's part
    for lo, hi, n in zip(block.owned_lo, block.owned_hi, block.global_shape):
        axes.append(np.arange(-(-lo // stride) * stride, hi + 1 if hi == n - 1 else hi, stride))
    part = block.data[np.ix_(*(a - s for a, s in zip(axes[::-1], block.start[::-1])))]
    here = tuple(int(a[0]) // stride if len(a) else 0 for a in axes[::-1])
    parts = [(here, part)] if mpi is None or mpi.Get_size() == 1 else mpi.gather((here, part), root=0)
    if parts is None:
        return None
    shape = tuple(-(-n // stride) for n in block.global_shape[::-1])
    whole = np.empty(shape, np.result_type(*(p.dtype for _, p in parts)))
    for (z, y, x), p in parts:
        whole[z:z + p.shape[0], y:y + p.shape[1], x:x + p.shape[2]] = p
    return whole


def field_hash(block, mpi) -> str:
    """A hash of the whole field (the same on every rank, for any number of ranks; collective): BLAKE2b of its
    dtype, shape and :func:`global_sample` (every sample of a field of up to ``SAMPLES``, else a regular grid of
    them), recorded with each step (metrics.json's ``field_hash``) so that ``--resume`` tells a kept step made
    from other values. A large field is sampled, so that the gather and the hash take milliseconds."""
    whole = global_sample(block, mpi)
    digest = None
    if whole is not None:
        h = hashlib.blake2b(digest_size=12)
        h.update(f"{whole.dtype.str} {tuple(block.global_shape)} {whole.shape}".encode())
        h.update(whole.data)                    # (np.empty above: C-contiguous)
        digest = h.hexdigest()
    return digest if mpi is None or mpi.Get_size() == 1 else mpi.bcast(digest, root=0)


def suggested_iso(block, mpi) -> tuple[float, float, float | None]:
    """The field's finite range and, to suggest an iso value, the threshold that splits its histogram best
    (Otsu's, of :func:`global_sample`), or None when it makes no surface; the same on every rank (collective)."""
    from skimage.filters import threshold_otsu

    whole = global_sample(block, mpi)
    answer = None
    if whole is not None:
        finite = whole[np.isfinite(whole)].astype(np.float64)
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (math.nan, math.nan)
        otsu = float(threshold_otsu(finite)) if finite.size and lo < hi else None
        answer = (lo, hi, otsu if otsu is not None and lo < otsu <= hi else None)
    return answer if mpi is None or mpi.Get_size() == 1 else mpi.bcast(answer, root=0)


def missing_iso(args: argparse.Namespace, cfg: Config, comm) -> str:
    """The error of a command given no iso value: give ``--iso``, with the field's range and a value to try
    (of the volume, or of the BP file's first step; a stream's steps are not read for it). Collective."""
    text = (f"no iso value given: give --iso V (or input.iso in a --config file), the value "
            f"{'' if args.command == 'run' else f'of {cfg.input.var} '}whose isosurface is trained")
    if args.command == "stream":
        return text + "; a stream's field is not read before its iso value is known"
    if args.command == "run":
        with comm.phase("read input"):
            source = volume_source(args, cfg, comm.rank, comm.size)
        first = next(iter(source), None)
    else:
        from insitu.input.sources import open_source

        with open_source(args.command, args.input, cfg, comm.rank, comm.size, comm=comm.mpi) as source:
            first = next(iter(source), None)
    if first is None:
        return text
    lo, hi, otsu = suggested_iso(first.block, comm.mpi)
    what = Path(args.input).name if args.command == "run" else f"{cfg.input.var} (step {first.step})"
    if not lo < hi:
        return text + f"; {what} is constant ({lo:.6g}): it has no isosurface"
    return (text + f"; {what} ranges over [{lo:.6g}, {hi:.6g}]"
            + (f", and its histogram splits best at {otsu:.4g} (Otsu's threshold): try --iso {otsu:.4g}"
               if otsu is not None else ""))


def field_range(block, cfg: Config, comm) -> tuple[float, float]:
    """The field's range over every rank's block (its finite samples' with ``input.nonfinite: outside``; NaN where
    a sample is NaN otherwise); collective."""
    from mpi4py import MPI

    data = block.data
    if data.dtype.kind == "f" and cfg.input.nonfinite == "outside":      # NaN/Inf let through: the finite range
        finite = np.isfinite(data)
        here = (float(np.min(data, where=finite, initial=np.inf)), float(np.max(data, where=finite, initial=-np.inf)))
    else:
        here = (float(data.min()), float(data.max()))
    return comm.mpi.allreduce(here[0], op=MPI.MIN), comm.mpi.allreduce(here[1], op=MPI.MAX)


def check_iso_range(block, cfg: Config, comm, what: str) -> None:
    """InputError, on every rank, when an iso value is outside the field's range ``(min, max]`` (no surface: a
    sample equal to an iso value counts as above it), so that a volume without one is refused before the output
    folder is claimed; ``what`` names the input. Collective (the range over every rank's block)."""
    lo, hi = field_range(block, cfg, comm)
    for v in cfg.input.iso:
        if lo <= hi and not lo < v <= hi:
            raise InputError(f"{what}: iso value {v:.10g} is outside the field's range ({lo:.10g}, {hi:.10g}]: no "
                             "surface to extract (a sample equal to the iso value counts as above it)")


def check_steps_iso(source, args: argparse.Namespace, cfg: Config, comm) -> None:
    """InputError when no step of a BP file that holds the field (of those asked for) has a surface at every iso
    value, from the field's ranges ADIOS2's statistics record (``source.ranges``, the same on every rank; nothing
    is refused where a step's range is not recorded, or lies within rounding of the value). NaN samples make
    those statistics wrong, so before refusing, the first of the steps is read: its range must be the one its
    statistics record. Collective."""
    ranges = getattr(source, "ranges", None)
    if not ranges or any(r is None for r in ranges.values()):
        return

    def near(a: float, b: float, lo: float, hi: float) -> bool:    # the statistics keep 7 digits
        return abs(a - b) <= 1e-6 * max(abs(lo), abs(hi))

    def outside(v: float, lo: float, hi: float) -> bool:
        return (v <= lo and not near(v, lo, lo, hi)) or (v > hi and not near(v, hi, lo, hi))

    if not all(any(outside(v, *r) for v in cfg.input.iso) for r in ranges.values()):
        return
    from insitu.input.sources import open_source

    first = next(iter(ranges))
    one = replace(cfg, input=replace(cfg.input, steps=[first], every=1))
    with open_source(args.command, args.input, one, comm.rank, comm.size, comm=comm.mpi) as steps:
        item = next(iter(steps), None)
    if item is None:
        return
    lo, hi = field_range(item.block, cfg, comm)
    if not (near(lo, ranges[first][0], lo, hi) and near(hi, ranges[first][1], lo, hi)):
        return                                  # (NaN samples: each step says what is wrong with it)
    shown = ", ".join(f"[{lo:.6g}, {hi:.6g}] at step {n}" for n, (lo, hi) in list(ranges.items())[:3])
    more = f", ... ({len(ranges)} steps)" if len(ranges) > 3 else ""
    iso = ", ".join(f"{v:g}" for v in cfg.input.iso)
    raise InputError(f"{args.input}: no step has a surface at iso {iso}: {cfg.input.var} ranges over {shown}{more}; "
                     "an iso value must lie within a step's (min, max] (--iso)")


def plan_text(args: argparse.Namespace, cfg: Config, comm, shape: tuple[int, ...] | None = None) -> str:
    """What the command is about to do, in one line, before the slow parts (ground truth, training)."""
    vc, tc = cfg.views, cfg.train
    what = Path(args.input).name if getattr(args, "input", None) else "?"
    if shape is not None:
        what += f" ({'x'.join(map(str, shape[::-1]))} samples)"
    elif args.command != "run":
        what += f", variable {cfg.input.var}"
    per_step = "" if args.command == "run" else " per timestep" + (
        f" ({min(cfg.series.warm_iterations, tc.iterations)}"
        f"{' and more by the share of new surface' if cfg.series.follow_iterations else ''}"
        " when warm-started from the one before)"
        if cfg.series.warm_start else "")
    return (f"insitu {args.command}: {what}, iso {', '.join(f'{v:g}' for v in cfg.input.iso)}: {vc.count} views of "
            f"{vc.resolution}x{vc.resolution} px, {tc.iterations} iterations of {tc.batch} view(s){per_step}, "
            f"on {comm.size} rank(s) ({comm.device.type}); outputs in {cfg.output.dir}")


def input_files(path: str | Path) -> dict[str, dict[str, int]]:
    """Size and modification time (ns) of an input file, or of the files in an input folder (a BP file's
    data and metadata), by name: recorded with every step and compared on ``--resume``. {} when absent."""
    path = Path(path)
    out = {}
    try:
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        for p in files:
            st = p.stat()
            out[p.name] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    except OSError:                             # unreadable: the source says so, with what it expected
        pass
    return out


def run_provenance(args: argparse.Namespace) -> dict:
    """What a command's steps come from: recorded in every step's metrics.json, and compared with the
    kept steps' on ``--resume`` (with the configuration): the command, its input's path and, for a file
    or a BP folder, its files' sizes and modification times."""
    provenance = {"command": args.command}
    if getattr(args, "input", None) is not None:
        provenance["input"] = os.path.abspath(args.input)
        if args.command in ("run", "replay"):
            provenance["files"] = input_files(args.input)
    if args.command == "run":
        provenance["spacing"] = [float(v) for v in args.spacing]
    if args.command == "demo":
        provenance.update({k: getattr(args, k) for k in ("L", "steps", "plotgap")})
    return provenance


def check_input(args: argparse.Namespace, cfg: Config, comm) -> None:
    """What a command's input can be refused for before any work: ``--spacing`` or ``input.origin`` that
    float32 coordinates cannot hold (:func:`insitu.volume.check_geometry`), a colour field asked of a
    one-field input, a path that is neither a file nor a folder (a FIFO, a device), a demo's grid too small
    for the ranks or too large for the machine's memory."""
    if args.command == "demo":                  # the simulation's memory is the host's, whatever trains
        import torch

        from insitu.parallel.comm import device_memory

        check_demo(args, cfg, comm.size, comm.device.type, device_memory(torch.device("cpu")))
    if args.command == "run":
        if Path(args.input).suffix.lower() == ".npz" and Path(args.input).is_file():
            raise InputError(npz_text(Path(args.input)))
        check_geometry(cfg.input.origin, args.spacing, names=("input.origin", "--spacing"), error=ConfigError)
        if cfg.input.color_var is not None:
            raise ConfigError(f"input.color_var {cfg.input.color_var!r}: a {Path(args.input).suffix or 'raw'} file "
                              "holds one field, so there is no colour field in it; a colour field needs a BP or "
                              "SST input (insitu replay, stream) that holds that variable")
    if args.command in ("run", "replay"):
        path = Path(args.input)
        try:
            mode = path.stat().st_mode
        except OSError:
            return                              # missing: the source says so, with what it expected
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = FILE_KINDS.get(stat.S_IFMT(mode), "not a file")
            expected = "a .npy or raw volume file" if args.command == "run" else "a BP file (folder)"
            raise InputError(f"{path}: is {kind}, expected {expected}")


def prefetch_compiler() -> list[str]:
    """Ask the operating system to read Triton's compiler library and assembler into its page cache now,
    in the background (``posix_fadvise(WILLNEED)``), without importing Triton; the files asked (none where
    Triton or the call is missing). The first compilation of a process hashes the whole library (some
    400 MB): 1.8 s from a freshly started machine's disk against 0.4 s once read,
    and the ray caster's compilation waits for it; asked at a command's start, the reading overlaps
    torch's import."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.origin is None or not hasattr(os, "posix_fadvise"):
        return []
    root = Path(spec.origin).parent
    asked = []
    for path in (root / "_C" / "libtriton.so", root / "backends" / "nvidia" / "bin" / "ptxas"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            asked.append(str(path))
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def run_command(args: argparse.Namespace, cfg: Config) -> int:
    prefetch_compiler()                         # read while torch imports (a no-op without Triton)
    # torch and MPI on first use (see train_steps)
    from insitu.output.export import StepWriter, claim_output
    from insitu.parallel.agreement import compare_configs
    from insitu.parallel.comm import device_memory, init_comm, shutdown
    from insitu.render.rendering import gsplat_import_error
    from insitu.run.chain import Chain
    from insitu.step.compilation import compile_ahead

    try:
        comm = init_comm(device=cfg.run.device, timeout_s=cfg.run.timeout_s, threads=cfg.run.threads)
    except ConfigError as e:                    # e.g. run.device cuda without CUDA: on every rank alike
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"insitu: error: {e}", file=sys.stderr, flush=True)
        return 2
    out = Path(cfg.output.dir)
    provenance = run_provenance(args)
    lock, writer, source = None, None, None
    try:
        compare_configs(comm.mpi, cfg, cfg.run.timeout_s,
                        {"command": args.command, "input": str(getattr(args, "input", ""))})
        # before any work: sizes that cannot fit, a rasterizer the device lacks, input refused as it is
        _agreed(comm, lambda: (check_memory(cfg, comm.size, device_memory(comm.device), f"device {comm.device}"),
                               check_backend(cfg, comm.device.type, gsplat_import_error()),
                               check_input(args, cfg, comm)))
        if not getattr(args, "iso_given", True):    # the configuration's default is for Gray-Scott's U, not this field
            raise ConfigError(missing_iso(args, cfg, comm))
        # the input read (a volume) or its steps probed (a BP file) before the folder is claimed: an iso value
        # outside the field's range, a variable in none of the steps, refused before anything is written
        if args.command == "run":
            with comm.phase("read input"):
                source = volume_source(args, cfg, comm.rank, comm.size)
            volume = next(iter(source))
            check_iso_range(volume.block, cfg, comm, Path(args.input).name)
        elif args.command == "replay":
            from insitu.input.sources import open_source

            source = open_source(args.command, args.input, cfg, comm.rank, comm.size, comm=comm.mpi)
            check_steps_iso(source, args, cfg, comm)
        # ... and a folder that cannot take the results, or that another run writes (rank 0 writes)
        command = f"insitu {args.command}" + (f" {args.input}" if getattr(args, "input", None) else "")
        claimed = _agreed(comm, lambda: claim_output(out, cfg.output.existing, config=cfg, provenance=provenance,
                                                     command=command) if comm.rank == 0 else None)
        lock, done = claimed if claimed is not None else (None, None)
        done = comm.mpi.bcast(done, root=0)
        compile_ahead(cfg, comm)                # the GPU kernels compile while the input is read
        writer = StepWriter(out, output=cfg.output, done=done, provenance=provenance, overlap=True)
        if comm.rank == 0 and done:
            writer.publish()                    # metrics.csv and the report of the kept steps, rebuilt
        kept = comm.mpi.bcast({s: writer.kept_field_hash(s) for s in done} if comm.rank == 0 else None, root=0)
        failed: list[tuple[int, str]] = []
        skipped: list[tuple[int, str]] = []     # steps the source could not use (no such variable, ...) or too small
        undelivered = 0                         # a stream's steps that never reached its reader (SSTSource)
        if args.command == "demo":
            n = run_demo(args, cfg, comm, writer)
        elif args.command == "run":
            say(comm, plan_text(args, cfg, comm, source.array.shape))
            try:
                n = train_steps([volume], cfg, comm, writer, out, done=frozenset(done), failed=failed,
                                skipped=skipped, kept=kept)
            finally:
                if comm.rank == 0 and skipped:
                    writer.record_all("skipped", skipped)
            if skipped and n == 0 and not done:     # the one volume: its own reason, in one line
                raise InputError(skipped[0][1])
        else:
            from insitu.input.sources import open_source

            say(comm, plan_text(args, cfg, comm))
            if source is None:                  # a stream: opened once the folder is claimed (it waits for the writer)
                source = open_source(args.command, args.input, cfg, comm.rank, comm.size, comm=comm.mpi)
            chain = Chain(out, comm.rank, comm.size) if cfg.series.warm_start else None
            with source:
                try:
                    n = train_steps(source, cfg, comm, writer, out, done=frozenset(done), failed=failed,
                                    skipped=skipped, kept=kept, chain=chain)
                finally:
                    skipped = sorted(skipped + [s for s in getattr(source, "skipped", []) if s[0] not in done])
                    if comm.rank == 0 and skipped:
                        writer.record_all("skipped", skipped)
                missing = sorted(set(cfg.input.steps or ()) - set(getattr(source, "seen", ())))
                undelivered = getattr(source, "undelivered", 0)
            if missing:
                seen = list(getattr(source, "seen", []))
                say(comm, f"insitu: warning: step(s) {', '.join(map(str, missing))} asked for (--steps) are not in "
                          f"{args.input}; its steps: {_steps_text(seen)}")
                if n == 0 and not failed and not skipped and not done:
                    raise InputError(f"{args.input}: none of the steps asked for (--steps "
                                     f"{' '.join(map(str, cfg.input.steps))}) is in it; its steps: {_steps_text(seen)}")
        if comm.rank == 0 and failed:           # in metrics.csv, with the reason, even when no step trained
            writer.record_all("failed", failed)
        if skipped and n == 0 and not done:
            raise InputError(untrained_text(failed, skipped))
        if failed and n == 0 and not done:
            raise InputError(failed[0][1] if len(failed) == 1 else
                             "no step could be trained:\n" + "\n".join(f"  step {s}: {m}" for s, m in failed))
        if n == 0 and not done:
            raise InputError("no step was trained: the source delivered none")
        text = f"done: {n} step(s) trained"
        if done:
            text += f", {len(done)} kept from the earlier run (--resume)"
        if failed:
            text += f", {len(failed)} failed (" + "; ".join(f"step {s}: {m.splitlines()[0]}" for s, m in failed) + ")"
        if skipped:
            text += f", {len(skipped)} skipped ({_reasons(skipped)})"
        if undelivered:
            text += (f", {undelivered} of the stream's steps never arrived (its writer discarded them, SST "
                     "QueueFullPolicy=Discard, while steps trained, or wrote them before this reader joined)")
        say(comm, f"{text}; outputs in {out} (report: {out / 'report.html'})")
        return 0
    except (InputError, ConfigError, RankFailure) as e:     # the same on every rank: rank 0 says it
        if comm.rank == 0:
            print(f"insitu: error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, (InputError, ConfigError)) else 1
    except OSError as e:                    # disk full...: in a parallel run, agreed (a RankFailure)
        print(f"insitu: error: {e}", file=sys.stderr, flush=True)
        if comm.size > 1:
            _finish(writer, lock)
            comm.mpi.Abort(1)
        return 1
    except KeyboardInterrupt as e:          # Ctrl-C, SIGTERM (Terminated): what is finished stays
        return _interrupted(e, comm, writer, lock, out)
    except Exception:                       # unexpected: never leave the other ranks waiting
        traceback.print_exc()
        sys.stderr.flush()
        if comm.size > 1:
            _finish(writer, lock)
            comm.mpi.Abort(1)
        return 1
    finally:
        if source is not None:
            source.close()
        _finish(writer, lock)
        shutdown(comm)


def _finish(writer, lock) -> None:
    """The end of a run, however it ends: the step being written finished (the writer's thread), what no job will
    complete removed, then the output folder's lock released; a failed write said in one line."""
    if writer is not None:
        error = writer.close()
        if error is not None:
            print(f"insitu: error: {error}", file=sys.stderr, flush=True)
    if lock is not None:
        lock.release()


def _interrupted(e: KeyboardInterrupt, comm, writer, lock, out: Path) -> int:
    """End a run that Ctrl-C (SIGINT) or SIGTERM (:class:`insitu.errors.Terminated`) interrupted: exit 130 or 143.
    Rank 0 finishes the step being written (:func:`_finish`: a step reported as written is kept, no ``.tmp`` stays,
    the lock is released) and says what the folder holds; in a parallel run it then ends every rank
    (``MPI_Abort``: a rank may wait in a collective that the interrupted ranks never join), and the other ranks wait
    for that (up to ``run.timeout_s``) instead of ending first, which would make the MPI launcher kill rank 0 while it
    writes."""
    terminated = isinstance(e, Terminated)
    code, name = (143, "SIGTERM") if terminated else (130, "SIGINT")
    if comm.rank == 0:
        _finish(writer, lock)
        kept = writer.trained if writer is not None else []
        text = ("" if writer is None else           # (before the folder was claimed: nothing of this run's in it)
                f"; {len(kept)} step(s) complete in {out} ({_steps_text(kept)}): give --resume to train the others"
                if kept else f"; no step complete in {out}")
        print(f"insitu: interrupted ({name}){text}", file=sys.stderr, flush=True)
        if comm.size > 1:
            sys.stdout.flush()
            comm.mpi.Abort(code)
    elif comm.size > 1:
        import time

        time.sleep(comm.timeout_s)
        os._exit(code)
    return code


def _agreed(comm, check):
    """``check()`` on every rank; a ConfigError or InputError on any rank is raised on every rank (exit 2)."""
    error, value = None, None
    try:
        value = check()
    except (ConfigError, InputError) as e:
        error = (isinstance(e, InputError), str(e))
    first = first_error(agree_errors(comm.mpi if comm.size > 1 else None, error))
    if first is not None:
        is_input, text = first[1]
        raise (InputError if is_input else ConfigError)(text)
    return value


def untrained_text(failed: list[tuple[int, str]], skipped: list[tuple[int, str]]) -> str:
    """The error of a run that trained no step: how many steps were skipped and failed, and why."""
    text = f"no step could be trained: {len(skipped)} step(s) skipped ({_reasons(skipped)})"
    return text + (f", {len(failed)} failed ({_reasons(failed)})" if failed else "")


def _reasons(steps: list[tuple[int, str]], shown: int = 3) -> str:
    """``step S: reason; ...`` for the first ``shown`` (step, reason) pairs."""
    text = "; ".join(f"step {s}: {m.splitlines()[0]}" for s, m in steps[:shown])
    return text + ("; ..." if len(steps) > shown else "")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "") if steps else "none"
