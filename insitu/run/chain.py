"""A series' warm chain on disk: what the next step starts from, kept beside the steps so that ``--resume`` goes
on as the uninterrupted run would have (:class:`Chain`, for the commands).

After each trained step of a series (``series.warm_start``) every rank saves its part of the step's result, what
the next step is warm-started from (:class:`insitu.step.pipeline.StepResult`: its shard of the trained Gaussians
at full precision, the SH degree reached, the frame, the growth, the surface offsets, the chain's length, the
metrics its time budget reads), in ``OUT/.warm_start/step_XXXXXX.rank<R>of<P>.pt``; the last two steps' are kept
(a run killed after a step's state but before its folder was renamed into place resumes from the one before).
The model files cannot serve: ``model.lit.spz`` is quantised, ``model.ply`` is the model refit for viewers.

A resumed run restores the last kept step's state when every rank finds its part, written by the run that wrote
that step folder (rank 0's records the step's ``train_seconds``, which its metrics.json records too) on as many
ranks; the next step then starts as it would have in the uninterrupted run, bit for bit. Otherwise it starts cold
and the chain counts on from the kept step's ``warm_chain`` (:meth:`insitu.step.driver.StepDriver.resume`).
"""
from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from insitu.output.files import atomic_write, plain
from insitu.output.folder import CHAIN_DIR, step_name
from insitu.surface.gaussians import Gaussians
from insitu.volume import Frame

KEEP = 2                                 # the states of the last this many steps trained, per rank


def state_path(out: str | Path, step: int, rank: int, size: int) -> Path:
    """``OUT/.warm_start/step_000120.rank0of2.pt``: rank ``rank``'s state of step 120, on ``size`` ranks."""
    return Path(out) / CHAIN_DIR / f"{step_name(step)}.rank{rank}of{size}.pt"


def save_state(out: str | Path, result, rank: int, size: int) -> Path:
    """Save this rank's part of a trained step's ``result`` (a :class:`insitu.step.pipeline.StepResult`) as the warm
    chain's state (atomically; an OSError names the file), and remove this rank's states of steps before the last
    :data:`KEEP`."""
    path = state_path(out, result.step, rank, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": int(result.step), "time": float(result.time), "sh_degree": int(result.sh_degree),
             "gaussians": {k: v.detach().to("cpu") for k, v in result.gaussians.tensors().items()},
             "frame": [list(result.frame.origin), float(result.frame.scale)], "growth": float(result.growth),
             "offsets": None if result.offsets is None else result.offsets.detach().to("cpu"),
             "tails": [[bool(k), plain(v)] for k, v in result.tails.items()], "warm_chain": int(result.warm_chain),
             "metrics": plain(result.metrics)}
    data = io.BytesIO()                      # (torch.save's own file errors are RuntimeErrors that name nothing)
    torch.save(state, data)
    atomic_write(path, data.getbuffer())
    mine = re.compile(rf"^step_(\d{{6,}})\.rank{rank}of{size}\.pt$")
    steps = sorted((int(m.group(1)), p) for p in path.parent.iterdir() if (m := mine.match(p.name)))
    for _, old in steps[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def load_state(out: str | Path, step: int, rank: int, size: int, device: torch.device | str = "cpu"):
    """This rank's part of step ``step``'s saved state as a :class:`insitu.step.pipeline.StepResult` (its
    Gaussians on ``device``), or why it cannot be restored (a str): none saved on ``size`` ranks, unreadable, or
    (rank 0) not the state of the step folder there now (its metrics.json's ``train_seconds`` differ)."""
    from insitu.step.pipeline import StepResult

    path = state_path(out, step, rank, size)
    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob(f"{step_name(step)}.rank*.pt")) if path.parent.is_dir() else []
        if others:
            return f"its state was saved on another number of ranks than {size}: {others[0]}"
        return f"no state of it is saved in {CHAIN_DIR} (written by an earlier insitu, or removed)"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        gaussians = Gaussians(**{k: v.to(device) for k, v in state["gaussians"].items()})
        frame = Frame(tuple(float(v) for v in state["frame"][0]), float(state["frame"][1]))
        offsets = state["offsets"].to(device) if state["offsets"] is not None else None
    except Exception as e:                       # noqa: BLE001 - any damage: the chain restarts, saying why
        return f"its saved state {path.name} cannot be read ({type(e).__name__}: {e})"
    if rank == 0:
        try:
            recorded = json.loads((Path(out) / step_name(step) / "metrics.json").read_text()).get("train_seconds")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded != state["metrics"].get("train_seconds"):
            return f"its saved state {path.name} is another run's than its folder's"
    return StepResult(gaussians, state["metrics"], sh_degree=state["sh_degree"], step=state["step"],
                      time=state["time"], frame=frame, growth=state["growth"], offsets=offsets,
                      tails={k: v for k, v in state["tails"]}, warm_chain=state["warm_chain"])


def kept_chain(out: str | Path, step: int) -> int:
    """The warm starts in a row that end with kept step ``step`` (its metrics.json's ``warm_chain``; 0 where it
    records none)."""
    try:
        chain = json.loads((Path(out) / step_name(step) / "metrics.json").read_text()).get("warm_chain")
    except (OSError, ValueError, AttributeError):
        return 0
    return chain if isinstance(chain, int) and not isinstance(chain, bool) and chain >= 0 else 0


@dataclass
class Chain:
    """A command's warm chain in its output folder ``out``, this rank's part (``rank`` of ``size``).

    unsaved: a step's state could not be saved (said once; a full disk: the step's own files end the run).
    """

    out: Path
    rank: int
    size: int
    unsaved: bool = False

    def save(self, result) -> None:
        """Save a trained step's ``result`` (:func:`save_state`); an OSError is a warning, once."""
        try:
            save_state(self.out, result, self.rank, self.size)
        except OSError as e:
            if not self.unsaved:
                print(f"insitu: warning: {e}: a run resumed after step {result.step} starts the next step cold",
                      file=sys.stderr, flush=True)
            self.unsaved = True

    def resume(self, driver, comm, step: int) -> str:
        """Before the first step trained after kept ones, the last kept one ``step``: its state restored as
        ``driver``'s warm start on every rank, or on none (then the next step starts cold, the chain counting on:
        :meth:`insitu.step.driver.StepDriver.resume`); returns what to say. Collective over ``comm``."""
        state = load_state(self.out, step, self.rank, self.size, comm.device)
        mine = state if isinstance(state, str) else (len(state.gaussians), state.metrics.get("gaussians"))
        answers = comm.mpi.allgather(mine) if comm.size > 1 else [mine]
        why = next((f"rank {r}: {a}" if comm.size > 1 else a for r, a in enumerate(answers) if isinstance(a, str)),
                   None)
        if why is None and sum(n for n, _ in answers) != answers[0][1]:      # (rank 0's record: the same verdict)
            why = f"its ranks' saved parts hold {sum(n for n, _ in answers)} Gaussians, the step {answers[0][1]}"
        if why is None:
            driver.resume(state)
            return f"step {step} (kept, --resume): its model restored as the next step's warm start"
        chain = kept_chain(self.out, step) if comm.rank == 0 else None
        driver.resume(None, comm.mpi.bcast(chain, root=0) if comm.size > 1 else chain)
        differ = ("the steps up to the series' next cold one differ" if driver.cfg.series.cold_every > 0 else
                  "the later steps differ (series.cold_every 0: no cold step to meet it again)")
        return (f"insitu: warning: step {step} (kept, --resume): its model cannot be restored as the next step's warm "
                f"start ({why}): the next step starts cold, and {differ} from an uninterrupted run's")
