"""insitu.parallel.comm: single-process set-up and error agreement, multi-rank runs under mpiexec."""
import re
import sys

import pytest
import torch

from insitu.errors import ConfigError, RankFailure, RankInputFailure
from insitu.parallel.comm import init_comm, launcher_local_rank, node_local_rank, shutdown

from conftest import launch, run_mpi, subprocess_env


def test_single_process_comm_is_identity():
    comm = init_comm(device="cpu")
    assert (comm.rank, comm.size, comm.local_rank, comm.group) == (0, 1, 0, None)
    assert comm.device == torch.device("cpu")
    t = torch.arange(4.0)
    assert comm.all_reduce_sum(t) is t and torch.equal(t, torch.arange(4.0))
    assert comm.all_gather(t).shape == (1, 4)
    assert torch.equal(comm.reduce_scatter(t.view(1, 4)), t)
    assert torch.equal(comm.all_to_all(t.view(1, 4)), t.view(1, 4))
    assert comm.allgather_object({"a": 1}) == [{"a": 1}]
    assert comm.traffic.bytes == 0 and comm.traffic.calls == 0
    comm.agree(True)
    with pytest.raises(RankFailure, match=r"^check failed on rank 0: bad block$") as info:
        comm.agree(False, "bad block")
    assert info.value.ranks == [0] and info.value.messages == ["bad block"]
    with pytest.raises(RankInputFailure, match=r"^check failed on rank 0: no surface$"):
        comm.agree(False, "no surface", input_error=True)
    with pytest.raises(ValueError, match=r"^empty$"):      # one rank: the exception as it is
        with comm.phase("seeds"):
            raise ValueError("empty")
    with comm.phase("ok"):
        pass
    shutdown(comm)
    assert comm.mpi is None
    shutdown(comm)                     # twice is harmless


def test_init_comm_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="run.device: expected"):
        init_comm(device="tpu")
    with pytest.raises(ValueError, match="timeout_s"):
        init_comm(timeout_s=0)
    with pytest.raises(ValueError, match="threads: expected >= 0"):
        init_comm(threads=-2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="run.device: 'cuda' asked for, but CUDA is not available"):
            init_comm(device="cuda")


def test_launcher_local_rank_prefers_the_mpi_launchers():
    assert launcher_local_rank({}) is None
    assert launcher_local_rank({"SLURM_LOCALID": "3", "LOCAL_RANK": "1"}) == 3
    # mpirun inside a Slurm job: its processes inherit the daemon's SLURM_LOCALID=0
    assert launcher_local_rank({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == 2
    assert launcher_local_rank({"MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"}) == 1
    assert launcher_local_rank({"LOCAL_RANK": "", "SLURM_LOCALID": "x"}) is None


class _NodeComm:
    """What node_local_rank uses of an mpi4py communicator: the other ranks' launcher ranks."""

    def __init__(self, rank, theirs):
        self.rank, self.theirs = rank, theirs

    def allgather(self, mine):
        return self.theirs

    def Get_rank(self):
        return self.rank


def test_node_local_rank_falls_back_to_the_node_split(monkeypatch):
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert node_local_rank(_NodeComm(1, [4, 5])) == 5           # a sub-communicator keeps the job's numbering
    assert node_local_rank(_NodeComm(1, [0, 5, 5])) == 1        # duplicates (inherited variables): the split
    assert node_local_rank(_NodeComm(0, [5, None])) == 0        # not every rank knows: the split


def test_reduce_scatter_checks_leading_dimension():
    comm = init_comm(device="cpu")
    with pytest.raises(ValueError, match=r"leading dimension of 1"):
        comm.reduce_scatter(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"all_to_all: expected a leading dimension of 1"):
        comm.all_to_all(torch.zeros(2, 3))
    shutdown(comm)


@pytest.mark.mpi
def test_comm_four_ranks_collectives_subcommunicators_reuse():
    out = run_mpi(4, "comm_worker.py")
    assert out.returncode == 0, out.stdout
    assert all(f"OK rank {r} of 4" in out.stdout for r in range(4)), out.stdout


@pytest.mark.mpi
def test_phase_failure_reraised_on_every_rank():
    out = run_mpi(2, "phase_worker.py", "raise", timeout=60)
    assert out.returncode == 0, out.stdout
    for r in range(2):
        assert (f"rank {r} caught: phase 'seeds' failed on rank 1: "
                "ValueError: no isosurface crossing in block") in out.stdout, out.stdout
        assert f"rank {r} done" in out.stdout, out.stdout


@pytest.mark.mpi
def test_phase_failure_uncaught_ends_every_rank():
    out = run_mpi(2, "phase_worker.py", "uncaught", timeout=60)
    assert out.returncode != 0
    for r in range(2):
        assert (f"[rank{r}]: insitu.errors.RankFailure: phase 'seeds' failed on rank 1: "
                "ValueError: no isosurface crossing in block") in out.stdout, out.stdout


@pytest.mark.mpi
def test_phase_failure_while_others_wait_in_torch_collective():
    out = run_mpi(2, "phase_worker.py", "collective", timeout=60)
    assert out.returncode == 0, out.stdout
    for r in range(2):      # the ranks' lines may arrive interleaved: match each message, not each line
        caught = re.search(f"rank {r} caught: (phase 'seeds' failed on ranks 0, 1: .*?"
                           r"rank 1: ValueError: no isosurface crossing in block)", out.stdout)
        assert caught, out.stdout


@pytest.mark.mpi
def test_agree_watchdog_aborts_when_a_rank_hangs():
    """Rank 0's watchdog aborts the job while rank 1 sleeps for 50 s: the abort ends the sleeping rank too
    (it never wakes). Now and then (5 of 40 runs of this test's job in a loop on the CPU machine) the
    launcher, MPICH 5.0.2's mpiexec, lets the sleeping rank run on after the abort, and the job then
    ends only when that rank wakes; so the abort must end it in one of two tries, each with the abort's
    message."""
    for _ in range(2):
        out = run_mpi(2, "phase_worker.py", "hang", timeout=90)
        assert out.returncode != 0
        assert ("insitu: rank 0/2: fatal: phase 'seeds': no answer from the other ranks within 2 s"
                in out.stdout), out.stdout
        if "rank 1 woke" not in out.stdout:
            break
    assert "rank 1 woke" not in out.stdout, out.stdout


@pytest.mark.mpi
def test_rank_dying_outright_ends_the_job():
    out = run_mpi(2, "phase_worker.py", "die", timeout=60)
    assert out.returncode != 0, out.stdout


@pytest.mark.mpi
def test_unhandled_exception_outside_a_phase_ends_the_job():
    """Rank 0 would wait in its collective for good: the job must end within the launcher's timeout."""
    out = run_mpi(2, "phase_worker.py", "stray", timeout=60)
    assert out.returncode != 0
    assert "KeyError: 'stray failure'" in out.stdout, out.stdout
    assert "insitu: rank 1/2: fatal: unhandled KeyError; ending the job" in out.stdout, out.stdout


def test_threads_sets_torchs_cpu_threads_in_the_process():
    code = ("import torch; from insitu.parallel.comm import init_comm; n = torch.get_num_threads(); "
            "init_comm(device='cpu', threads=1); a = torch.get_num_threads(); "
            "init_comm(device='cpu'); print(n, a, torch.get_num_threads())")
    out = launch([sys.executable, "-c", code], env=subprocess_env(threads=2))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1", "1"]          # set to 1; 0 (the default) leaves it


@pytest.mark.parametrize("environ, single_node, words", [
    ({"INSITU_MASTER_ADDR": "no.such.host.invalid"}, True,
     "INSITU_MASTER_ADDR=no.such.host.invalid: the name does not resolve ("),
    ({"INSITU_MASTER_ADDR": "192.0.2.1"}, False,           # (TEST-NET-1: never an address of this host)
     "INSITU_MASTER_ADDR=192.0.2.1: resolves to 192.0.2.1, not an address of this node; expected a name or address "
     "of rank 0's node"),
])
def test_a_store_host_that_cannot_work_is_named_at_once(environ, single_node, words):
    from insitu.parallel.comm import store_host

    host, error = store_host(single_node=single_node, environ=environ)
    assert host == environ["INSITU_MASTER_ADDR"] and words in error and "docs/cluster.md" in error


def test_the_store_host_is_the_loopback_on_one_node_and_the_variable_when_set():
    from insitu.parallel.comm import store_host

    assert store_host(single_node=True, environ={}) == ("127.0.0.1", "")
    assert store_host(single_node=False, environ={"INSITU_MASTER_ADDR": " 127.0.0.1 "}) == ("127.0.0.1", "")


@pytest.mark.mpi
def test_a_bad_master_addr_is_one_line_exit_2_before_any_wait(tmp_path):
    """A name that does not resolve: refused on every rank at start-up, not after run.timeout_s (300 s here)."""
    import time

    import numpy as np
    from conftest import TINY, insitu, one_error

    np.save(tmp_path / "ball.npy", np.zeros((8, 8, 8), np.float32))
    t = time.monotonic()
    r = insitu("run", "ball.npy", "--iso", "0.5", *TINY, "--out", "out", cwd=tmp_path, ranks=2, timeout=60,
               env={"INSITU_MASTER_ADDR": "no.such.host.invalid"})
    assert time.monotonic() - t < 40
    line = one_error(r)
    assert "INSITU_MASTER_ADDR=no.such.host.invalid: the name does not resolve" in line, line
    assert not (tmp_path / "out").exists()
