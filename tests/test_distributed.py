"""End to end on several ranks (CPU, gloo, ``mpiexec``): the distributed pipeline against one rank.

Each test launches ``mpiexec -n P python tests/mpi/dist_*.py`` (or ``python -m insitu``)
with a timeout; the workers check their results and print ``OK rank r of P``.
"""
import json
import re
import subprocess

import numpy as np
import pytest
from conftest import insitu, run_mpi

pytestmark = pytest.mark.mpi


def all_ok(out: subprocess.CompletedProcess, n: int) -> bool:
    return out.returncode == 0 and all(f"OK rank {r} of {n}" in out.stdout for r in range(n))


@pytest.mark.parametrize("ranks", [2, 4])
def test_render_and_composite_match_one_rank(ranks):
    """Same Gaussians through render_bands (torch rasterizer + compositing), P ranks vs one:
    gathered images within 1e-10 and every Gaussian's gradients within 1e-9 (relative), float64."""
    out = run_mpi(ranks, "dist_render.py")
    assert all_ok(out, ranks), out.stdout


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_loss_and_gradients_do_not_depend_on_the_number_of_ranks(ranks):
    """band_loss on P row bands (bands under 5 rows, an empty band on 5 ranks, images under 11
    rows): the ranks' losses sum to the one-rank loss and the gradients match within 1e-5;
    through render_bands on an uneven 3-rank (or 2-rank; 4 with an empty block) split ordered by
    the real block edges, the images equal the one-rank render where an even split's order would
    be wrong, and loss and every Gaussian's gradients match the one-rank values within 1e-5, for SH
    colours and for the lit model shaded per pixel after compositing; each Gaussian's footprint error
    sums and its footprint's sides (model.ply's fit) match the one-rank sums."""
    out = run_mpi(ranks, "dist_loss.py", timeout=240)
    assert all_ok(out, ranks), out.stdout
    for size in ("12 x 16", "13 x 14", "23 x 17", "40 x 33"):   # the squared error's scale sums over the ranks
        assert f"exchange {size}, l2, bands" in out.stdout, out.stdout
    if ranks == 5:                                          # 11 rows: bands of 3, 3, 3, 2 and an empty one
        assert "exchange 11 x 12, l1, bands [(0, 3), (3, 6), (6, 9), (9, 11), (11, 11)]" in out.stdout, out.stdout
    else:
        for model in ("sh", "lit"):                         # SH colours, and the lit model shaded per pixel
            assert f"render ({model}): images max abs diff" in out.stdout, out.stdout
        assert "footprints: max relative diff" in out.stdout, out.stdout
        assert "footprint sides: max relative diff" in out.stdout, out.stdout      # model.ply's fit


def test_ground_truth_matches_one_rank():
    """make_scene on 4 ranks (2 x 2 blocks) vs one rank: one ray per pixel agrees to the float16
    rounding of the bands; 2 x 2 supersampling within 1e-3 on >= 98% of the pixels."""
    out = run_mpi(4, "dist_scene.py")
    assert all_ok(out, 4), out.stdout
    assert "supersample 1, 4 ranks" in out.stdout and "supersample 2, 4 ranks" in out.stdout, out.stdout


def test_two_rank_training_matches_one_rank(tmp_path):
    """run_step on 2 ranks vs 1 rank (24 views at 48 x 48, 2000 Gaussians, 60 iterations, same seed):
    held-out PSNR within 0.5 dB, and training gained over the initial model on both; the initial
    models (seed colours from the ground truth) within 0.2 dB."""
    out = run_mpi(2, "dist_train.py", "train", str(tmp_path), timeout=180)
    assert all_ok(out, 2), out.stdout
    two = json.loads((tmp_path / "metrics_2.json").read_text())
    one = json.loads((tmp_path / "metrics_1.json").read_text())
    print(out.stdout)
    assert (two["ranks"], one["ranks"]) == (2, 1)
    assert two["iterations"] == one["iterations"] == 60
    assert all(n > 0 for n in two["per_rank"]), two["per_rank"]        # the surface crosses the cut plane
    assert two["gaussians_initial"] == one["gaussians_initial"]         # the same converted surface
    assert abs(one["gaussians_initial"] - 2000) < 3 * 2000 ** 0.5       # (each triangle's count rounded up or down)
    for m in (one, two):             # seeds coloured from the ground truth: the initial model is good already
        assert m["psnr"] > m["psnr_initial"] + 0.5, m
        assert m["psnr_initial"] > 18.0, m                          # the constant colour starts near 14 dB
    assert abs(two["psnr_initial"] - one["psnr_initial"]) < 0.2, (two["psnr_initial"], one["psnr_initial"])
    assert abs(two["psnr"] - one["psnr"]) < 0.5, (two["psnr"], one["psnr"])
    assert abs(two["ssim"] - one["ssim"]) < 0.02, (two["ssim"], one["ssim"])
    deferred_figures_match(tmp_path, two)


def deferred_figures_match(tmp_path, two: dict) -> None:
    """The run again with one rank still importing the metrics: the ranks agreed to score the
    initial figures after training (no collective left waiting), the same figures."""
    later = json.loads((tmp_path / "metrics_2_deferred.json").read_text())
    assert abs(later["psnr_initial"] - two["psnr_initial"]) < 0.01, (later["psnr_initial"], two["psnr_initial"])
    assert abs(later["psnr"] - two["psnr"]) < 0.01, (later["psnr"], two["psnr"])


def test_a_time_budget_stops_every_rank_at_the_same_iteration(tmp_path):
    """train.time_budget_s 25 on 2 ranks whose clocks run at 1 and 2 seconds an iteration: both stop after 20
    iterations (rank 1's clock passed the budget at the look after 20; rank 0's alone would have gone to 30);
    a warm step from it records its warm start's counts, summed over the ranks, the same on both."""
    out = run_mpi(2, "dist_train.py", "budget", str(tmp_path), timeout=180)
    assert all_ok(out, 2), out.stdout
    m = json.loads((tmp_path / "metrics_2.json").read_text())
    assert m["per_rank"] == [[20, "time budget"], [20, "time budget"]], m["per_rank"]
    warm = json.loads((tmp_path / "metrics_2_warm.json").read_text())
    counts = [warm[k] for k in ("gaussians_stale", "gaussians_dropped", "gaussians_new", "gaussians_initial")]
    assert warm["per_rank"] == [counts, counts], warm["per_rank"]
    assert warm["gaussians_stale"] > 0 and warm["gaussians_new"] > 0, counts      # the surface moved a cell
    assert warm["gaussians_initial"] == m["gaussians"] - counts[0] - counts[1] + counts[2], (m["gaussians"], counts)


def test_replicas_take_the_step_of_one_rank_with_the_whole_batch():
    """run.layout: replicated, 2 ranks with one view each against one rank with both views:
    the same parameters within 1e-9 after 4 steps (float64), replicas bitwise identical after 8
    steps with densification and an opacity reset, as many Gaussians as one rank
    (tests/mpi/dist_replicated.py)."""
    out = run_mpi(2, "dist_replicated.py", timeout=180)
    assert all_ok(out, 2), out.stdout
    assert "exact: 2 replicas" in out.stdout and "densify: 2 replicas" in out.stdout, out.stdout


@pytest.mark.gpu
def test_replicas_on_two_gpus_take_the_step_of_one_gpu_with_the_whole_batch():
    """The same on two GPUs (NCCL all-reduce, one GPU per rank)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (two ranks on one GPU are refused)")
    out = run_mpi(2, "dist_replicated.py", "cuda", timeout=300)
    assert all_ok(out, 2), out.stdout
    assert "exact: 2 replicas" in out.stdout and "densify: 2 replicas" in out.stdout, out.stdout


def test_replicated_training_matches_one_rank(tmp_path):
    """run_step with run.layout: replicated on 2 ranks vs 1 rank taking both views of a step at once
    (the dist_train set-up, 60 steps): PSNR within 0.2 dB and SSIM within 0.005 of it, training gained;
    at the end each rank holds the Gaussians in its block, all of them once, and a warm-started second
    step starts from them (better than the cold start's initial model)."""
    out = run_mpi(2, "dist_train.py", "replicated", str(tmp_path), timeout=180)
    assert all_ok(out, 2), out.stdout
    two = json.loads((tmp_path / "metrics_2.json").read_text())
    one = json.loads((tmp_path / "metrics_1.json").read_text())
    print(out.stdout)
    assert two["iterations"] == one["iterations"] == 60
    assert all(n > 0 for n in two["per_rank"]) and sum(two["per_rank"]) == two["gaussians"], two
    assert two["psnr"] > two["psnr_initial"] + 0.2, two
    assert abs(two["psnr"] - one["psnr"]) < 0.2, (two["psnr"], one["psnr"])
    assert abs(two["ssim"] - one["ssim"]) < 0.005, (two["ssim"], one["ssim"])
    # model.ply holds the lit model's SH fit, trained as viewers draw it (the blur 0.3 against the model's 0.05),
    # drawn whole on rank 0: under the model's figure, and as on one rank
    assert two["color_model"] == "lit" and two["ply_psnr"] < two["psnr"], two
    assert abs(two["ply_psnr"] - one["ply_psnr"]) < 0.3, (two["ply_psnr"], one["ply_psnr"])
    deferred_figures_match(tmp_path, two)
    warm = json.loads((tmp_path / "metrics_2_warm.json").read_text())            # warm from the ranks' shards
    assert warm["iterations"] == 30 and sum(warm["per_rank"]) == warm["gaussians"], warm
    assert warm["psnr_initial"] > two["psnr_initial"] + 0.2, (warm["psnr_initial"], two["psnr_initial"])
    for r in (0, 1):                # 21 on the orbit (24, every 8th a test view) and 6 close-ups (views.closeups 0.25)
        assert re.search(rf"rank {r}: InputError: .*more than the 27 training views", out.stdout), out.stdout


def test_ranks_without_surface_take_part(tmp_path):
    """A sphere inside rank 0's block only, 4 ranks: the three empty ranks train with 0 Gaussians,
    every rank finishes, the PSNR is finite and above the initial one."""
    out = run_mpi(4, "dist_train.py", "corner", str(tmp_path), timeout=180)
    assert all_ok(out, 4), out.stdout
    m = json.loads((tmp_path / "metrics_4.json").read_text())
    assert m["per_rank"][1:] == [0, 0, 0] and m["per_rank"][0] == m["gaussians"] > 0, m["per_rank"]
    assert np.isfinite(m["psnr"]) and m["psnr"] > m["psnr_initial"], m


def caught(stdout: str, case: str) -> dict[int, tuple[float, str]]:
    """rank -> (seconds, message) of the ``[case] rank r caught RankFailure after S s: MESSAGE`` reports
    (mpiexec may interleave the ranks' output within a line)."""
    pattern = (rf"\[{case}\] rank (\d+) caught RankFailure after ([\d.]+) s: "
               r"(.+?)(?=\[\w+\] rank \d+ caught|OK rank|insitu: |\n|$)")
    return {int(r): (float(s), m) for r, s, m in re.findall(pattern, stdout)}


def collective_timeout(out) -> float:
    """The ``run.timeout_s`` the failing job ran with (its rank 0 prints it): a rank left waiting in a
    collective would end only then."""
    return float(re.search(r"run\.timeout_s ([\d.]+)", out.stdout)[1])


@pytest.fixture(scope="module")
def failures():
    """One 2-rank job with two failing steps (see tests/mpi/dist_train.py, MODE fail)."""
    return run_mpi(2, "dist_train.py", "fail", timeout=90)


def test_nan_on_one_rank_ends_every_rank(failures):
    """Rank 1's block holds a NaN: both ranks raise the same RankFailure naming rank 1 and the NaN,
    at once (the input check agrees at the phase boundary)."""
    reports = caught(failures.stdout, "nan")
    assert sorted(reports) == [0, 1], failures.stdout
    for seconds, message in reports.values():
        assert "phase 'input check' failed on rank 1" in message and "NaN" in message, message
        assert seconds < collective_timeout(failures), (seconds, message)     # not a collective timing out


def test_missing_colour_field_on_one_rank_ends_every_rank(failures):
    """cfg.input.color_var names a field rank 1 lacks: rank 1 fails inside the ground-truth stage.
    Both ranks must end with a RankFailure that names the missing field before the torch collective's
    timeout (``run.timeout_s``; the agreement watchdog's is longer), and the job must exit cleanly."""
    reports = caught(failures.stdout, "color")
    assert all_ok(failures, 2) and sorted(reports) == [0, 1], failures.stdout
    for seconds, message in reports.values():
        assert "failed on rank 1" in message and "colour field 'c' not given" in message, message
        assert seconds < collective_timeout(failures), (seconds, message)


CLASSIC = ("--set", "train.color_model=sh", "--set", "train.eps2d=0.3", "--set", "train.antialiased=false")


@pytest.mark.parametrize("settings", [(), CLASSIC], ids=["defaults", "drawn_as_viewers_draw"])
def test_cli_run_on_two_ranks_writes_one_merged_model(tmp_path, settings):
    """``mpiexec -n 2 python -m insitu run NAME_XxYxZ_uint8.raw``: one model.ply holding every
    rank's Gaussians (as many as metrics.json's "gaussians"), metrics.json says 2 ranks. A model trained as
    standard viewers draw it (SH colours, 0.3 px^2, classic: model.ply is the trained model) too: its figures
    come from the model gathered once (it ended rank 1 with a traceback), within 1 dB of the trained model's."""
    from insitu.output.ply import read_ply

    z, y, x = np.meshgrid(np.arange(22.0), np.arange(20.0), np.arange(24.0), indexing="ij")
    r = np.sqrt(((x - 11.5) / 9) ** 2 + ((y - 9.5) / 7) ** 2 + ((z - 10.5) / 8) ** 2)
    raw = tmp_path / "ball_24x20x22_uint8.raw"
    np.clip(255 * (1.2 - r), 0, 255).astype(np.uint8).tofile(raw)
    out_dir = tmp_path / "out"
    out = insitu("run", raw, "--iso", "100", "--views", "8", "--resolution", "24",
                 "--iterations", "10", "--budget", "300", "--device", "cpu", "--backend", "torch", "--quiet",
                 "--out", out_dir, "--set", "views.supersample=1", "--set", "output.images=1", *settings,
                 cwd=tmp_path, ranks=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step 0: surface PSNR" in out.stdout and out.stdout.count("done: 1 step(s) trained") == 1, out.stdout
    step = out_dir / "step_000000"
    metrics = json.loads((step / "metrics.json").read_text())
    model = read_ply(step / "model.ply")
    assert metrics["ranks"] == 2 and len(model) == metrics["ply_gaussians"] > 0, (metrics["ply_gaussians"], len(model))
    if settings:
        assert metrics["ply_gaussians"] == metrics["gaussians"]
        assert abs(metrics["ply_psnr_foreground"] - metrics["psnr_foreground"]) < 1.0, metrics
    assert sorted(p.name for p in out_dir.glob("step_*/model.ply")) == ["model.ply"]
    # the merged model spans both blocks (cut at x = 11.5), inside the ball's bounds
    xs = model.means[:, 0].numpy()
    assert xs.min() < 11.5 < xs.max() and xs.min() > 0 and xs.max() < 23, (xs.min(), xs.max())
    assert (step / "views" / "view_000.png").is_file()


def test_a_surface_on_the_boundary_between_the_ranks_blocks_is_seeded_once(tmp_path):
    """f = x index with iso 7 on a 16^3 grid: two ranks cut it at the plane of samples x = 7, where
    the surface lies; they seed it as one rank does (it used to vanish: 0 seeds, then a traceback)."""
    z, y, x = np.mgrid[0:16, 0:16, 0:16].astype(np.float32)
    field = tmp_path / "plane.npy"
    np.save(field, x)
    counts = []
    for ranks in (1, 2):
        out_dir = tmp_path / f"out{ranks}"
        out = insitu("run", field, "--iso", "7", "--views", "8", "--resolution", "24",
                     "--iterations", "5", "--budget", "1000", "--device", "cpu", "--backend", "torch", "--quiet",
                     "--out", out_dir, "--set", "views.supersample=1", "--set", "output.images=1",
                     "--set", "seeds.density=0",                    # one Gaussian per vertex
                     cwd=tmp_path, ranks=ranks if ranks > 1 else 0)    # one rank: a plain process
        assert out.returncode == 0, out.stdout + out.stderr
        counts.append(json.loads((out_dir / "step_000000" / "metrics.json").read_text())["gaussians_initial"])
    assert counts[0] == counts[1] >= 256, counts
