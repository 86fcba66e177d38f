"""The benchmarks' entry (``python -m benchmarks``): a case's rows follow the one schema, land in the results
file and render in docs/performance.md; the committed results and the doc agree."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

from benchmarks import cases, docgen
from benchmarks.schema import FIELDS, VERSION, check_row


def row(**fields) -> dict:
    """A valid row with the entry's fields, ``fields`` over them."""
    return {"schema": VERSION, "commit": "abc1234", "machine": "box", "date": "2026-12-05T10:00:00Z",
            "case": "fidelity", "run": "r1", "command": "python -m benchmarks fidelity", "name": "bonsai",
            **fields}


def test_fidelity_tiny_rows_follow_the_schema_and_render(tmp_path):
    results, run_dir = tmp_path / "box.jsonl", tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "fidelity", "--tiny", "--machine", "box",
                        "--commit", "abc1234", "--run", "tiny1", "--run-dir", str(run_dir), "--results", str(results)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 1
    (got,) = rows
    assert check_row(got) is got
    assert {k: got[k] for k in ("schema", "commit", "machine", "case", "run", "name", "device")} == {
        "schema": VERSION, "commit": "abc1234", "machine": "box", "case": "fidelity", "run": "tiny1", "name": "tiny",
        "device": "cpu"}
    assert got["command"].startswith("python -m benchmarks fidelity --tiny")
    assert got["cmd"].startswith("insitu run ball.npy --iso ")
    assert "error" not in got
    # the figures are the step's own metrics.json, kept beside its log
    metrics = json.loads((run_dir / "tiny_metrics.json").read_text())
    assert got["psnr_foreground"] == metrics["psnr_foreground"] and got["seconds"] == metrics["total_seconds"]
    assert got["gaussians"] == metrics["gaussians"] and isinstance(got["gaussians"], int)
    assert (run_dir / "tiny.log").is_file() and (run_dir / "rows.jsonl").read_text() == results.read_text()
    doc = docgen.render(docgen.read_rows(tmp_path))
    assert "## Fidelity" in doc and "**box**" in doc
    assert got["psnr_foreground_initial"] == metrics["psnr_foreground_initial"]         # the seeds' own figure
    assert (f"| tiny | {got['psnr_foreground_initial']:.2f} | {got['psnr_foreground']:.2f} | {got['psnr']:.2f} |"
            in doc)
    assert f"`{got['command']}`" in doc and "commit `abc1234`" in doc


def test_a_case_without_its_volume_is_one_error_line_and_records_nothing(tmp_path):
    results = tmp_path / "box.jsonl"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "fidelity", "--only", "engine", "--device", "cpu",
                        "--data", str(tmp_path), "--results", str(results), "--run-dir", str(tmp_path / "run")],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"benchmarks: error: fidelity: case engine: no volume "
                                     f"{tmp_path / 'engine_256x256x128_uint8.raw'} (--data: the folder of "
                                     f"engine_256x256x128_uint8.raw)"]
    assert not results.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, message", [
    ({"psnr_fg": 30.0}, "unknown field(s) psnr_fg"),
    ({"name": None}, "field 'name' is missing"),
    ({"gaussians": 2.5}, "field 'gaussians' expected int, got float"),
    ({"psnr": "high"}, "field 'psnr' expected int or float"),
    ({"date": "yesterday"}, "date 'yesterday'"),
    ({"machine": "my box"}, "machine 'my box'"),
    ({"kernel_cache": "tepid"}, "kernel_cache 'tepid'"),
])
def test_a_row_off_the_schema_is_refused_naming_its_field(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_row(row(**change))


def test_the_doc_shows_each_name_from_its_latest_run_or_only_the_latest_run():
    rows = [row(run="old", date="2026-12-01", name="bonsai", psnr_foreground=30.0),
            row(run="old", date="2026-12-01", name="engine", psnr_foreground=40.0),
            row(run="new", date="2026-12-02T08:00:00Z", name="bonsai", psnr_foreground=31.0)]
    picked = docgen.chosen(rows, per_run=False)
    assert [(r["run"], r["name"]) for r in picked] == [("old", "engine"), ("new", "bonsai")]
    assert [(r["run"], r["name"]) for r in docgen.chosen(rows, per_run=True)] == [("new", "bonsai")]
    doc = docgen.render(rows)
    assert "| bonsai | 31.00 |" in doc and "| engine | 40.00 |" in doc and "30.00" not in doc


def test_every_case_has_the_interface():
    assert {"fidelity", "demo", "fidab", "coldstart", "speed", "scale"} <= set(cases.names())
    for name in cases.names():
        module = cases.load(name)
        assert (module.__doc__ or "").strip(), name
        unknown = [c for c in getattr(module, "COLUMNS", ()) if c not in FIELDS and not c.startswith("extra.")]
        assert not unknown, f"{name}: COLUMNS names no row field: {unknown}"
        assert getattr(module, "TABLE", "name") in ("name", "run"), name
    with pytest.raises(ValueError, match="unknown case 'nope': expected one of"):
        cases.load("nope")


def test_the_committed_results_follow_the_schema_and_the_doc_is_generated_from_them():
    rows = docgen.read_rows(ROOT / "benchmarks" / "results")
    assert rows
    assert (ROOT / "docs" / "performance.md").read_text() == docgen.render(rows), \
        "docs/performance.md is not what `python -m benchmarks doc` makes of benchmarks/results: run it"
