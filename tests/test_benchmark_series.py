"""The series benchmark case (benchmarks/cases/series.py) at its --tiny size: a heat series written through
ADIOS2 by 2 ranks, replayed with the package's defaults (every step converted cold), once more with a variant's
overrides (warm starts), its fifth step cold, and streamed through SST; rows that follow the schema."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

schema = pytest.importorskip("benchmarks.schema", reason="the benchmarks' entry (benchmarks/__main__.py, schema.py)")


def test_series_tiny_replays_warm_against_cold_and_streams(tmp_path):
    results, run_dir = tmp_path / "box.jsonl", tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "series", "--tiny", "--only", "heat", "--stream", "heat",
                        "--sim-ranks", "2", "--variant",
                        "fewer=series.warm_start=true,series.warm_iterations=1,series.cold_above=1",
                        "--machine", "box", "--commit", "abc1234",
                        "--run", "tiny1", "--run-dir", str(run_dir),
                        "--results", str(results)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert all(schema.check_row(row) is row for row in rows)
    assert not [row["error"] for row in rows if "error" in row]
    by_name = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append(row)
    assert sorted(by_name) == ["heat", "heat_cold", "heat_fewer", "heat_stream"]
    fewer = by_name["heat_fewer"]               # the same file replayed once more with the variant's overrides
    assert [row["step"] for row in fewer] == [10, 20, 30, 40, 50]
    assert fewer[0]["cmd"].endswith("--set series.warm_start=true --set series.warm_iterations=1 "
                                    "--set series.cold_above=1")
    assert fewer[1]["iterations"] == 1
    warm, (cold,), streamed = by_name["heat"], by_name["heat_cold"], by_name["heat_stream"]
    assert [row["step"] for row in warm] == [row["step"] for row in streamed] == [10, 20, 30, 40, 50]
    assert cold["step"] == 50 and cold["cmd"].endswith("--steps 50 --set series.warm_start=false")
    assert warm[0]["cmd"].startswith("insitu replay heat.bp --var T --iso 0.5 ")
    assert streamed[0]["cmd"].startswith("insitu stream heat_sst --var T --iso 0.5 ")
    for row in warm:
        assert {"psnr_foreground", "psnr_foreground_near2", "psnr_foreground_near3", "psnr_foreground_off",
                "ply_psnr_foreground", "gaussians", "iterations", "seeds_seconds", "train_seconds", "seconds",
                "model_bytes"} <= set(row)
        assert row["extra"]["gaussians_initial"] > 0
    # the warm step that has a cold reference carries it; the figures are the replays' metrics.csv's
    last = warm[-1]["extra"]
    assert last["cold_psnr_foreground"] == cold["psnr_foreground"]
    assert last["below_cold_db"] == round(cold["psnr_foreground"] - warm[-1]["psnr_foreground"], 3)
    assert last["gaussians_over_cold"] == round(warm[-1]["gaussians"] / cold["gaussians"], 3)
    assert "cold_psnr_foreground" not in warm[0].get("extra", {})
    for row in warm + streamed:                 # what the series cost the simulation, from its own last line
        assert 0 <= row["extra"]["sim_output_seconds"] <= row["extra"]["sim_seconds"], row["extra"]
    assert {row["extra"]["sst_policy"] for row in streamed} == {"Block"}
    assert warm[0]["iterations"] == cold["iterations"] == 2
    for name in ("heat_sim.log", "heat.log", "heat_metrics.csv", "heat_cold_metrics.csv", "heat_stream.log",
                 "heat_stream_sim.log", "heat_stream_metrics.csv"):
        assert (run_dir / name).is_file(), name
    assert not list(run_dir.glob("*.bp"))                  # the series' files are not kept without --keep
    assert "-n 2 " in (run_dir / "heat_sim.log").read_text().splitlines()[0]     # the mini-app on 2 ranks


def test_a_negative_cadence_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks", "series", "--tiny", "--cold-every", "-1",
                        "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cold-every: expected an integer >= 0 (0: no cold steps), got '-1'" in r.stderr
    assert not (tmp_path / "run").exists()
