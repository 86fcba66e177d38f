"""The Gray-Scott mini-app: physics against a plain numpy model, the same field for any
number of ranks, and its BP5 and BP4 output replayed by BPSource on 1 and 2 ranks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import adios2
import numpy as np
import pytest
from mpi4py import MPI
from conftest import launch, read_all

ROOT = Path(__file__).resolve().parents[1]
SIM = ROOT / "sims" / "insitu_sims" / "gray_scott.py"
WORKER = ROOT / "tests" / "mpi" / "source_worker.py"
sys.path.insert(0, str(ROOT / "sims"))

from insitu_sims.gray_scott import GrayScott, GrayScottSettings, parse_args, run  # noqa: E402


def numpy_reference(s: GrayScottSettings, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The tutorial's model on one periodic array with np.roll (no noise)."""
    L, d = s.L, min(6, s.L // 4)
    u, v = np.ones((L, L, L)), np.zeros((L, L, L))
    c = slice(L // 2 - d, L // 2 + d)
    u[c, c, c], v[c, c, c] = 0.25, 0.33

    def lap(a):
        return sum(np.roll(a, sh, ax) for ax in range(3) for sh in (-1, 1)) / 6.0 - a

    for _ in range(steps):
        uvv = u * v * v
        u, v = (u + s.dt * (s.Du * lap(u) - uvv + s.F * (1 - u)),
                v + s.dt * (s.Dv * lap(v) + uvv - (s.F + s.k) * v))
    return u, v


def test_one_rank_matches_a_plain_numpy_model():
    s = GrayScottSettings(L=12, noise=0.0, engine="none")
    sim = GrayScott(s, MPI.COMM_SELF)
    assert sim.u.shape == (12, 12, 12) and sim.start == (0, 0, 0) and sim.global_shape == (12, 12, 12)
    u0, v0 = numpy_reference(s, 0)
    np.testing.assert_array_equal(sim.u, u0)
    np.testing.assert_array_equal(sim.v, v0)
    for _ in range(25):
        sim.step()
    u, v = numpy_reference(s, 25)
    np.testing.assert_allclose(sim.u, u, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sim.v, v, rtol=0, atol=1e-12)
    assert sim.time == 25.0
    assert not np.allclose(sim.v, v0)           # the pattern evolved


def test_noise_depends_on_the_seed_and_is_uniform():
    fields = []
    for seed in (0, 0, 1):
        sim = GrayScott(GrayScottSettings(L=16, seed=seed, noise=0.1, engine="none"), MPI.COMM_SELF)
        sim.step()
        fields.append(sim.u)
    np.testing.assert_array_equal(fields[0], fields[1])
    assert not np.array_equal(fields[0], fields[2])
    r = GrayScott(GrayScottSettings(L=16, engine="none"), MPI.COMM_SELF)._noise(np.empty((16, 16, 16)))
    assert -1 < r.min() < -0.99 and 0.99 < r.max() < 1 and abs(r.mean()) < 0.02 and abs(r.std() - 3 ** -0.5) < 0.01


def test_run_calls_the_consumer_every_plotgap_steps():
    calls = []

    def consumer(step, time, fields, global_shape, start):
        calls.append((step, time, sorted(fields), fields["U"].shape, global_shape, start))

    stats = run(GrayScottSettings(L=10, steps=25, plotgap=10, engine="none"), MPI.COMM_SELF, consumer)
    assert [c[:2] for c in calls] == [(10, 10.0), (20, 20.0), (25, 25.0)]
    assert all(c[2:] == (["U", "V"], (10, 10, 10), (10, 10, 10), (0, 0, 0)) for c in calls)
    assert stats.steps == 25 and stats.outputs == 3 and stats.steps_per_s > 0


def test_settings_are_checked_up_front(capsys):
    with pytest.raises(ValueError, match="engine: expected one of BP5, BP4, SST, none, got 'HDF5'"):
        GrayScottSettings(engine="HDF5").validate()
    with pytest.raises(ValueError, match="plotgap: expected >= 1, got 0"):
        GrayScottSettings(plotgap=0).validate()
    with pytest.raises(SystemExit):
        parse_args(["--L", "1"])
    assert "L: expected an integer >= 4 (the initial cube of V is L // 4 cells each way from the centre), got 1" \
        in capsys.readouterr().err
    s = parse_args(["--L", "20", "--engine", "SST", "--sst-readers", "2", "--sst-policy", "Discard"])
    assert (s.L, s.engine, s.sst_readers, s.sst_policy) == (20, "SST", 2, "Discard")


@pytest.fixture(scope="module")
def bp_runs(tmp_path_factory) -> Path:
    """The same run written by 1 rank and by 2 ranks (gathered to rank 0), and by 2 ranks through BP4."""
    tmp = tmp_path_factory.mktemp("gs")
    args = ["--L", "18", "--steps", "30", "--plotgap", "10", "--noise", "0.1", "--seed", "7", "--engine", "BP5"]
    one = launch([sys.executable, SIM, *args, "--output", "one.bp"], cwd=tmp, timeout=60)
    assert one.returncode == 0, one.stderr
    assert "ranks=1 steps=30 engine=BP5" in one.stdout and "steps/s" in one.stdout
    two = launch([sys.executable, SIM, *args, "--output", "two.bp"], ranks=2, cwd=tmp, timeout=60)
    assert two.returncode == 0, two.stderr
    assert "ranks=2" in two.stdout
    bp4 = launch([sys.executable, SIM, *args[:-1], "BP4", "--output", "two4.bp"], ranks=2, cwd=tmp, timeout=60)
    assert bp4.returncode == 0 and "engine=BP4" in bp4.stdout, bp4.stderr
    return tmp


@pytest.mark.mpi
def test_one_and_two_ranks_give_the_same_global_field(bp_runs):
    s1, t1, u1 = read_all(bp_runs / "one.bp", "U")
    s2, t2, u2 = read_all(bp_runs / "two.bp", "U")
    _, _, v1 = read_all(bp_runs / "one.bp", "V")
    _, _, v2 = read_all(bp_runs / "two.bp", "V")
    assert s1 == s2 == [10, 20, 30] and t1 == t2 == [10.0, 20.0, 30.0]
    assert u1.shape == (3, 18, 18, 18)
    np.testing.assert_allclose(u1, u2, rtol=0, atol=1e-12)
    np.testing.assert_allclose(v1, v2, rtol=0, atol=1e-12)
    assert v1[-1].max() > 0.1 and not np.allclose(u1[0], u1[-1])
    with adios2.FileReader(str(bp_runs / "two.bp")) as f:
        assert list(f.read_attribute("origin")) == [0.0, 0.0, 0.0]
        assert list(f.read_attribute("spacing")) == [1.0, 1.0, 1.0]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", ["two.bp", "two4.bp"], ids=["BP5", "BP4"])
def test_bp_output_replays_block_by_block(bp_runs, ranks, name):
    cmd = [sys.executable, WORKER, "bp", name, "U", "one.bp", "--out", f"replay{ranks}"]
    proc = launch(cmd, ranks=ranks if ranks > 1 else 0, cwd=bp_runs, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for r in range(ranks)
             for line in (bp_runs / f"replay{ranks}.{r}.jsonl").read_text().splitlines()]
    for r in range(ranks):
        mine = [x for x in lines if x["rank"] == r]
        assert [x["step"] for x in mine[:-1]] == [10, 20, 30], mine
        assert mine[-1] == {"rank": r, "end": "clean", "dropped": 0}
        assert all(x["equal"] and x["global"] == [18, 18, 18] and x["time"] == x["step"] for x in mine[:-1])
    if ranks == 2:    # 17 cells split 8 | 9 along x; each block has one ghost layer towards the other
        blocks = sorted((x["start"], x["count"], x["owned"]) for x in lines if "step" in x and x["step"] == 10)
        assert blocks == [([0, 0, 0], [10, 18, 18], [[0, 0, 0], [8, 17, 17]]),
                          ([7, 0, 0], [11, 18, 18], [[8, 0, 0], [17, 17, 17]])]


def _outputs_off_the_faces(L: int) -> list[tuple[int, float, float]]:
    """(step, share of cells over the demo's iso value, share of them within two cells of a face) at every output
    of the CPU demo's simulation on an ``L^3`` grid."""
    from insitu.run.demo import CPU_SIMULATION, DEMO_DEFAULTS

    iso = DEMO_DEFAULTS["input.iso"][0]
    sim = GrayScott(GrayScottSettings(L=L, noise=CPU_SIMULATION["noise"], steps=CPU_SIMULATION["steps"],
                                      engine="none"), MPI.COMM_SELF)
    rim = np.ones((L, L, L), bool)
    rim[2:-2, 2:-2, 2:-2] = False
    out = []
    while sim.step_count < CPU_SIMULATION["steps"]:
        sim.step()
        if sim.step_count % CPU_SIMULATION["plotgap"] == 0:
            inside = sim.v > iso
            out.append((sim.step_count, float(inside.mean()), float((inside & rim).sum() / max(1, inside.sum()))))
    return out


def test_cpu_demo_grid_holds_its_pattern_to_the_last_output():
    """The CPU demo shows spots that grow and divide: at every output its V pattern stays clear of the periodic
    faces. On a grid too small for its steps (L = 32) the fronts meet across the faces and V collapses into
    sheets a cell thick along them, which a 96^2 model cannot draw."""
    from insitu.run.demo import CPU_SIMULATION

    demo = _outputs_off_the_faces(CPU_SIMULATION["L"])
    assert len(demo) == 2 and all(rim == 0 and share > 0.05 for _, share, rim in demo), demo
    small = _outputs_off_the_faces(32)
    assert small[-1][2] > 0.5 and small[-1][1] < 0.05, small
