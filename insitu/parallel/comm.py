"""Communication set-up from MPI, tensor collectives, and collective error handling.

One MPI process per GPU (or per CPU slot). :func:`init_comm` takes an MPI communicator
(``COMM_WORLD`` by default, or any sub-communicator of it), duplicates it, and builds a
``torch.distributed`` process group over the same processes in the same rank order:
rank 0 opens a TCP store on a free port and broadcasts ``host:port`` over MPI, then every
rank joins with NCCL (CUDA) or gloo (CPU). It works under ``mpiexec``/``mpirun``/``srun``
and in a plain single process; with one rank no ``torch.distributed`` is set up at all
and every collective is the identity.

Errors. A failure on one rank must never leave the others waiting in a collective:

- ``comm.agree(ok, message)`` at phase boundaries gathers every rank's failure (or None) over
  MPI (:func:`agree_errors`, the one agreement every stage uses); if any rank failed,
  every rank raises :class:`RankFailure` naming the failing ranks and their messages.
- ``with comm.phase("seeds"): ...`` catches an exception raised inside the block on any
  rank, agrees, and re-raises on every rank as
  ``RankFailure("phase 'seeds' failed on rank 1: ValueError: ...")``.
- A rank that dies outright (killed, out of memory) is caught by two watchdogs: the
  ``torch.distributed`` timeout (``timeout_s``) ends a torch collective that waits on it
  (gloo raises; NCCL tears the process down), and ``agree`` waits on its non-blocking
  MPI all-gather for at most ``watchdog_s`` (twice ``timeout_s`` by default, so a rank
  first stuck in a torch collective still reaches the agreement), after which it prints
  the reason and calls ``MPI_Abort`` (:meth:`Comm.abort`), which ends the whole job.
  Launchers (``mpiexec``, ``srun``) also end the job when a process exits abnormally.
- An exception that escapes to the top level on one rank (outside any phase) would leave
  the others waiting in their next collective, and ``MPI_Finalize`` may then never
  return; with more than one rank, :func:`init_comm` therefore installs a
  ``sys.excepthook`` that prints the traceback as usual and then aborts the job
  (what ``python -m mpi4py`` does); :func:`shutdown` removes it.
"""
from __future__ import annotations

import inspect
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
from torch import Tensor

from insitu.errors import AgreementTimeout, ConfigError, InputError, RankFailure, RankInputFailure
from insitu.parallel.agreement import agree_errors


@dataclass
class Traffic:
    """Bytes this rank moves through the tensor collectives of a :class:`Comm`.

    ``bytes`` counts what a ring algorithm receives on each rank: ``(P - 1) / P`` of the
    gathered output of an all-gather or of the input of a reduce-scatter, twice that for
    an all-reduce; for an all-to-all, the ``P - 1`` chunks received from the other ranks.
    ``calls`` counts the collectives.
    """

    bytes: int = 0
    calls: int = 0

    def add(self, nbytes: float) -> None:
        self.bytes += int(round(nbytes))
        self.calls += 1

    def reset(self) -> None:
        self.bytes = 0
        self.calls = 0


@dataclass
class Comm:
    """The processes working together on one model.

    mpi:        a duplicate of the MPI communicator given to :func:`init_comm`.
    rank, size: this process's rank and the number of ranks (same as ``mpi``).
    local_rank: this process's index on its node (:func:`node_local_rank`); picks its GPU.
    device:     ``cuda:{local_rank % n_gpus}`` or ``cpu``; tensors given to the
                collectives must live there.
    group:      ``torch.distributed`` process group over the same ranks in the same
                order (None when ``size == 1``).
    timeout_s:  ``torch.distributed`` collective timeout.
    watchdog_s: how long :meth:`agree` waits for the other ranks before aborting the job.
    abort_on_timeout: False: :meth:`agree` raises :class:`AgreementTimeout` past ``watchdog_s``
                instead of aborting the job (the Adaptor: the simulation goes on; the communicator
                is not used again).
    traffic:    bytes moved by the tensor collectives (see :class:`Traffic`).
    """

    mpi: Any
    rank: int
    size: int
    local_rank: int
    device: torch.device
    group: object | None
    timeout_s: float = 300.0
    watchdog_s: float = 600.0
    abort_on_timeout: bool = True
    traffic: Traffic = field(default_factory=Traffic)
    _owns: str = field(default="", repr=False)     # "default", "group" or "" (what shutdown frees)
    _hooks: tuple | None = field(default=None, repr=False)   # (our excepthook, the one it replaced)

    def solo(self) -> "Comm":
        """This process alone, on the same device: a Comm of one rank (its collectives are the
        identity), for work every rank does by itself (``run.layout: replicated``)."""
        from mpi4py import MPI

        return Comm(mpi=MPI.COMM_SELF, rank=0, size=1, local_rank=self.local_rank, device=self.device, group=None,
                    timeout_s=self.timeout_s, watchdog_s=self.watchdog_s, abort_on_timeout=self.abort_on_timeout)

    # ---------------------------------------------------------------- error handling
    def agree(self, ok: bool, message: str = "", *, where: str = "check", input_error: bool = False) -> None:
        """Collective: raise :class:`RankFailure` on every rank if any rank passes ``ok=False``.

        ok:      whether this rank succeeded.
        message: why this rank failed (ignored when ``ok``).
        where:   what failed, for the error text (``"phase 'seeds'"``).
        input_error: the failure is bad input; when it is on every failing rank, the error
                 raised is a :class:`RankInputFailure` (an ``InputError`` too).

        Every rank must call it. The reports travel by :func:`agree_errors`, given at most
        ``watchdog_s`` seconds; past that the job is aborted (``abort_on_timeout``), or
        :class:`AgreementTimeout` raised.
        """
        failed = not ok
        try:
            reports = agree_errors(self.mpi if self.size > 1 else None, (message, input_error) if failed else None,
                                   seconds=self.watchdog_s, what=where)
        except AgreementTimeout:
            if self.abort_on_timeout:
                self.abort(f"{where}: no answer from the other ranks within {self.watchdog_s:g} s "
                           "(a rank died or hangs); aborting the job")
            raise
        ranks = [r for r, m in enumerate(reports) if m is not None]
        if not ranks:
            return
        messages = [reports[r][0] or "(no message)" for r in ranks]
        if len(ranks) == 1:
            text = f"{where} failed on rank {ranks[0]}: {messages[0]}"
        elif len(set(messages)) == 1:
            text = f"{where} failed on ranks {', '.join(map(str, ranks))}: {messages[0]}"
        else:
            text = (f"{where} failed on ranks {', '.join(map(str, ranks))}: "
                    + "; ".join(f"rank {r}: {m}" for r, m in zip(ranks, messages)))
        kind = RankInputFailure if all(reports[r][1] for r in ranks) else RankFailure
        raise kind(text, ranks, messages)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run a block on every rank; if it raises on any rank, raise on every rank.

        With one rank the exception itself is raised. With several, every rank raises a
        :class:`RankFailure` (:class:`RankInputFailure` when every failing rank had an
        ``InputError``).

        The exception of a failing rank is chained (``raise ... from``) on that rank.
        A :class:`RankFailure` raised inside (by a nested phase or ``agree``) is already
        collective and passes through unchanged, as does an :class:`AgreementTimeout` (the
        communicator cannot agree again).
        """
        where = f"phase {name!r}"
        try:
            yield
        except (RankFailure, AgreementTimeout):
            raise
        except Exception as exc:
            if self.size == 1:                  # nobody to tell: the error as it is
                raise
            try:
                self.agree(False, f"{type(exc).__name__}: {exc}", where=where,
                           input_error=isinstance(exc, InputError))
            except RankFailure as failure:
                raise failure from exc
        else:
            self.agree(True, where=where)

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` on this rank's stderr and end the whole job (``MPI_Abort``)."""
        print(f"insitu: rank {self.rank}/{self.size}: fatal: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.mpi.Abort(code)

    # ---------------------------------------------------------------- collectives
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (MPI)."""
        if self.size == 1:
            return [obj]
        return self.mpi.allgather(obj)

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ranks in place and return it (identity for one rank)."""
        if self.size > 1:
            import torch.distributed as dist

            self.traffic.add(2 * tensor.numel() * tensor.element_size() * (self.size - 1) / self.size)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Stack every rank's ``tensor`` (same shape and dtype on all ranks).

        tensor: [*S] on ``device``.  Returns [P, *S], entry ``r`` from rank ``r``.
        """
        if self.size == 1:
            return tensor.unsqueeze(0)
        flat = tensor.contiguous().view(-1)
        out = flat.new_empty(self.size * flat.numel())          # 1-D: gloo and NCCL both accept it
        self.traffic.add(out.numel() * out.element_size() * (self.size - 1) / self.size)
        _all_gather_single(out, flat, self.group)
        return out.view(self.size, *tensor.shape)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        """Sum over ranks and keep this rank's chunk.

        tensor: [P, *S] on ``device``.  Returns [*S]: ``sum over ranks q of tensor_q[rank]``.
        """
        if tensor.shape[0] != self.size:
            raise ValueError(f"reduce_scatter: expected a leading dimension of {self.size} (ranks), "
                             f"got shape {tuple(tensor.shape)}")
        if self.size == 1:
            return tensor[0]
        flat = tensor.contiguous().view(-1)
        out = flat.new_empty(flat.numel() // self.size)
        self.traffic.add(flat.numel() * flat.element_size() * (self.size - 1) / self.size)
        _reduce_scatter_single(out, flat, self.group)
        return out.view(tensor.shape[1:])


    def all_to_all(self, tensor: Tensor) -> Tensor:
        """Send chunk ``q`` to rank ``q``; receive every rank's chunk for this rank.

        tensor: [P, *S] on ``device``, entry ``q`` for rank ``q``.  Returns [P, *S]: entry ``q``
        is rank ``q``'s ``tensor[rank]`` (this rank's own chunk stays in place).
        """
        if tensor.shape[0] != self.size:
            raise ValueError(f"all_to_all: expected a leading dimension of {self.size} (ranks), "
                             f"got shape {tuple(tensor.shape)}")
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        flat = tensor.contiguous().view(-1)
        out = torch.empty_like(flat)
        self.traffic.add(flat.numel() * flat.element_size() * (self.size - 1) / self.size)
        dist.all_to_all_single(out, flat, group=self.group)
        return out.view(tensor.shape)


def _all_gather_single(out: Tensor, inp: Tensor, group) -> None:
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns); older torch
    # only has all_gather_into_tensor.
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: Tensor, inp: Tensor, group) -> None:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


# node-local rank set by the launcher: Open MPI's mpirun, MPICH/Intel MPI's Hydra, Cray PALS,
# srun (direct launch), torchrun. The MPI launchers come first: under Slurm they start their
# daemons with srun, so their processes inherit the daemon's SLURM_LOCALID (0 on every node).
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID",
                        "SLURM_LOCALID", "LOCAL_RANK")


def launcher_local_rank(environ=None) -> int | None:
    """This process's index on its node as the launcher numbered it (LOCAL_RANK_VARIABLES, first set), or None."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def node_local_rank(local_comm) -> int:
    """Local rank that picks this process's GPU. Collective over ``local_comm`` (the ranks on this node).

    The launcher's node-local rank when every rank of ``local_comm`` has one and no two are
    equal: it is the job's numbering, so a sub-communicator's ranks keep the GPU the launcher
    (and the simulation) gave their process. Otherwise the rank within ``local_comm``.
    """
    mine = launcher_local_rank()
    theirs = local_comm.allgather(mine)
    if None not in theirs and len(set(theirs)) == len(theirs):
        return mine
    return local_comm.Get_rank()


def device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device``: the GPU's, or the machine's physical memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _pick_device(device, local_rank: int) -> tuple[torch.device | None, str]:
    """(device, error message)."""
    if isinstance(device, str) and device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        return None, f"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r} ({exc})"
    if dev.type == "cpu":
        return torch.device("cpu"), ""
    if dev.type != "cuda":
        return None, f"device: expected a CPU or CUDA device, got {device!r}"
    if not torch.cuda.is_available():
        return None, f"device: {device!r} asked for, but CUDA is not available on {socket.gethostname()}"
    n = torch.cuda.device_count()
    index = local_rank % n if dev.index is None else dev.index
    if index >= n:
        return None, f"device: {device!r} asked for, but {socket.gethostname()} has {n} CUDA device(s)"
    return torch.device("cuda", index), ""


def _shared_gpu(local_comm, dev: torch.device) -> str:
    """Why this rank's GPU is unusable for NCCL (another rank on the node has it), or "". Collective."""
    try:
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
    except Exception:                                             # noqa: BLE001 (no UUID: no check)
        uuid = None
    uuids = local_comm.allgather(uuid)
    others = [r for r, u in enumerate(uuids) if u is not None and u == uuid and r != local_comm.Get_rank()]
    if not others:
        return ""
    return (f"device: GPU {uuid} on {socket.gethostname()} is also used by node-local rank(s) {others}; "
            "NCCL needs one GPU per rank (srun --gpus-per-task=1, or as many visible GPUs as ranks per node)")


def init_comm(mpi_comm=None, *, device: str | torch.device = "auto", timeout_s: float = 300.0,
              watchdog_s: float | None = None, threads: int = 0, abort_on_timeout: bool = True) -> Comm:
    """Set up communication over the processes of ``mpi_comm``. Collective over ``mpi_comm``.

    mpi_comm:   an ``mpi4py.MPI.Comm`` (default ``COMM_WORLD``); it is duplicated, never
                used directly.
    device:     ``"auto"`` (CUDA if present, else CPU), ``"cpu"``, ``"cuda"`` (GPU
                ``local_rank % n_gpus`` of the visible ones, ``local_rank`` from
                :func:`node_local_rank`), ``"cuda:N"``, or a ``torch.device``. Two ranks of
                one node on the same GPU are an error (NCCL cannot run them).
    timeout_s:  ``torch.distributed`` collective timeout (also for joining the group).
    watchdog_s: limit for :meth:`Comm.agree` (default ``2 * timeout_s``).
    threads:    torch's CPU threads in this process (``torch.set_num_threads``); 0 leaves them.
    abort_on_timeout: see :class:`Comm`.

    A device that cannot be used (unknown, CUDA asked for but absent, a GPU shared by two ranks) is
    a ConfigError on every rank, naming the ranks where it is not the same on all.

    If ``torch.distributed`` is already initialised, its default group is reused when it
    spans exactly these processes in the same order with the right backend; otherwise
    a new group over these processes is created. The TCP store host is 127.0.0.1 when
    all ranks share a node, else rank 0's host name; ``INSITU_MASTER_ADDR`` overrides it. A name that
    does not resolve to an address of rank 0's node is a ConfigError on every rank (:func:`store_host`).
    """
    from mpi4py import MPI

    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s}")
    if watchdog_s is not None and watchdog_s <= 0:
        raise ValueError(f"watchdog_s: expected > 0 seconds or None, got {watchdog_s}")
    if threads < 0:
        raise ValueError(f"threads: expected >= 0 (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(int(threads))
    base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    mpi = base.Dup()
    rank, size = mpi.Get_rank(), mpi.Get_size()
    local = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = node_local_rank(local), local.Get_size()
    dev, error = _pick_device(device, local_rank)
    if not error and dev.type == "cuda" and local_size > 1:
        error = _shared_gpu(local, dev)
    error = f"run.{error}" if error else ""
    host = None
    if size > 1 and rank == 0:                  # where the others will look for the TCP store, checked at once
        host, host_error = store_host(single_node=local_size == size)
        error = "; ".join(filter(None, [error, host_error]))
    local.Free()
    comm = Comm(mpi, rank, size, local_rank, dev if dev is not None else torch.device("cpu"), None,
                timeout_s=float(timeout_s),
                watchdog_s=float(watchdog_s if watchdog_s is not None else 2 * timeout_s),
                abort_on_timeout=abort_on_timeout)
    try:
        comm.agree(not error, error, where="init_comm")
    except RankFailure as e:
        mpi.Free()
        text = "; ".join(dict.fromkeys(e.messages))
        raise ConfigError(text + (f" (on rank(s) {', '.join(map(str, e.ranks))} of {size})"
                                            if len(e.ranks) < size else "")) from None
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if size > 1:
            with comm.phase("init_comm: torch.distributed"):
                _init_group(comm, host=host)
    except RankFailure:
        mpi.Free()
        raise
    if size > 1:
        _install_abort_hook(comm)
    return comm


def _install_abort_hook(comm: Comm) -> None:
    previous = sys.excepthook

    def abort_on_exception(kind, value, traceback):
        previous(kind, value, traceback)
        if comm.mpi is not None:
            comm.abort(f"unhandled {kind.__name__}; ending the job so no rank waits for this one")

    sys.excepthook = abort_on_exception
    comm._hooks = (abort_on_exception, previous)


MASTER_ADDR = "INSITU_MASTER_ADDR"       # the variable that names rank 0's host for the TCP store (docs/cluster.md)


def store_host(*, single_node: bool, environ=None) -> tuple[str, str]:
    """The host that rank 0 opens the ``torch.distributed`` TCP store on, and why it cannot ("" when it can):
    ``INSITU_MASTER_ADDR`` (from ``environ``, default ``os.environ``), else 127.0.0.1 when every rank runs on this
    node, else this host's name. The name must resolve to an address of this host (rank 0 listens there, the
    others connect to it); checked now, since torch would wait ``run.timeout_s`` for a name that does not resolve
    and then fail in a hundred lines."""
    environ = os.environ if environ is None else environ
    given = environ.get(MASTER_ADDR, "").strip()
    here = socket.gethostname()
    host = given or ("127.0.0.1" if single_node else here)
    what = f"{MASTER_ADDR}={given}" if given else f"this host's name {host} (the default without {MASTER_ADDR})"
    expected = (f"expected a name or address of rank 0's node ({here}) that the other ranks can reach; set "
                f"{MASTER_ADDR} to one (docs/cluster.md)")
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        return host, f"{what}: the name does not resolve ({reason}); {expected}"
    addresses = list(dict.fromkeys(address[0] for *_, address in found))
    for family, *_, address in found:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))     # only an address of this host can be bound
            except OSError:
                continue
        return host, ""
    return host, f"{what}: resolves to {', '.join(addresses)}, not an address of this node; {expected}"


def _init_group(comm: Comm, *, host: str | None) -> None:
    """The torch.distributed group over ``comm``'s ranks; ``host``: the TCP store's (rank 0's :func:`store_host`)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    backend = "nccl" if comm.device.type == "cuda" else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise RuntimeError("NCCL is not available in this torch build")
    timeout = timedelta(seconds=comm.timeout_s)
    mpi = comm.mpi

    initialised = mpi.allgather(dist.is_initialized())
    if any(initialised) and not all(initialised):
        raise RuntimeError("torch.distributed is initialised on ranks "
                           f"{[r for r, i in enumerate(initialised) if i]} only; expected all or none")
    if all(initialised):
        world_ranks = mpi.allgather(dist.get_rank())
        same = (dist.get_world_size() == comm.size and world_ranks == list(range(comm.size))
                and backend in str(dist.get_backend()))
        if all(mpi.allgather(same)):
            comm.group = dist.group.WORLD
            return
        kwargs: dict[str, Any] = {}
        if "sort_ranks" in inspect.signature(dist.new_group).parameters:
            kwargs["sort_ranks"] = False
        elif world_ranks != sorted(world_ranks):
            raise RuntimeError("this torch needs the MPI ranks in the same order as the torch.distributed "
                               f"ranks to build a group; got torch ranks {world_ranks}")
        comm.group = dist.new_group(ranks=world_ranks, timeout=timeout, backend=backend,
                                    use_local_synchronization=True, **kwargs)
        comm._owns = "group"
        return
    # rank 0 always broadcasts, an address or why it has none, so no rank waits in vain
    store, address = None, None
    if comm.rank == 0:
        try:
            store = dist.TCPStore(host, 0, comm.size, True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port, "")
        except Exception as exc:                                   # noqa: BLE001 (sent to all ranks)
            address = (host, 0, f"rank 0 could not open a TCP store on {host}: {type(exc).__name__}: {exc}")
    host, port, error = mpi.bcast(address, root=0)
    if error:
        raise RuntimeError(error)
    if store is None:
        store = dist.TCPStore(host, port, comm.size, False, timeout=timeout)
    kwargs = {"device_id": comm.device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size,
                            timeout=timeout, **kwargs)
    comm.group = dist.group.WORLD
    comm._owns = "default"


def remove_abort_hook(comm: Comm) -> None:
    """Put back the ``sys.excepthook`` that :func:`init_comm` replaced (when it is still the one in place)."""
    if comm._hooks is not None:
        ours, previous = comm._hooks
        if sys.excepthook is ours:
            sys.excepthook = previous
        comm._hooks = None


def shutdown(comm: Comm) -> None:
    """Free what :func:`init_comm` created (process group it made, MPI duplicate). Collective."""
    if comm.mpi is None:
        return
    remove_abort_hook(comm)
    if comm._owns:
        import torch.distributed as dist

        if dist.is_initialized():
            if comm._owns == "default":
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(comm.group)
    comm.group = None
    comm._owns = ""
    comm.mpi.Free()
    comm.mpi = None
