import csv
import json
import math
import os
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from insitu.config import Config
from insitu.output.export import StepWriter, step_dir, write_report
from insitu.output.files import append_csv, atomic_path, atomic_write, read_csv, side_by_side, write_json, write_png
from insitu.output.ply import ply_property_names, read_ply, write_ply
from insitu.surface.gaussians import gather_gaussians
from insitu.surface.gaussians import Gaussians
from conftest import plyfile_gaussians

from conftest import launch, run_mpi

ROOT = Path(__file__).resolve().parents[1]


def random_gaussians(n: int, sh_degree: int, seed: int = 0) -> Gaussians:
    g = torch.Generator().manual_seed(seed)
    k = (sh_degree + 1) ** 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return Gaussians(r(n, 3), r(n, 3), r(n, 4), r(n), r(n, 1, 3), r(n, k - 1, 3))


def assert_same(a: Gaussians, b: Gaussians) -> None:
    for name in a.names():
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        assert x.dtype == y.dtype == torch.float32, name
        assert torch.equal(x, y), name


def ply_header(path: Path) -> tuple[list[str], int]:
    data = path.read_bytes()
    end = data.index(b"end_header\n") + len(b"end_header\n")
    return data[:end].decode("ascii").splitlines(), end


# ----------------------------------------------------------------------------------- PLY


@pytest.mark.parametrize("sh_degree", [0, 3])
def test_ply_round_trip_is_exact(tmp_path, sh_degree):
    g = random_gaussians(57, sh_degree)
    path = write_ply(tmp_path / "model.ply", g)
    assert_same(g, read_ply(path))


@pytest.mark.parametrize("sh_degree", [0, 3])
def test_ply_header_is_the_reference_layout_without_normals_with_colours(tmp_path, sh_degree):
    n = 11
    path = write_ply(tmp_path / "model.ply", random_gaussians(n, sh_degree))
    lines, header_bytes = ply_header(path)
    n_rest = 3 * ((sh_degree + 1) ** 2 - 1)
    reference = (["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2"]
                 + [f"f_rest_{i}" for i in range(n_rest)]
                 + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])
    assert lines[:3] == ["ply", "format binary_little_endian 1.0", f"element vertex {n}"]
    assert lines[3:-1] == [f"property float {p}" for p in reference] + [f"property uchar {c}" for c in
                                                                         ("red", "green", "blue")]
    assert lines[-1] == "end_header"
    assert ply_property_names(sh_degree) == reference
    assert path.stat().st_size == header_bytes + n * (4 * len(reference) + 3)


def test_ply_sh_degree_leaves_out_the_higher_bands(tmp_path):
    g = random_gaussians(7, 3)
    low = read_ply(write_ply(tmp_path / "model.ply", g, sh_degree=1))
    assert low.sh_degree == 1
    assert torch.equal(low.shN, g.shN[:, :3]) and torch.equal(low.sh0, g.sh0) and torch.equal(low.quats, g.quats)
    assert read_ply(write_ply(tmp_path / "same.ply", g, sh_degree=3)).sh_degree == 3


def test_ply_values_are_pre_activation_in_reference_order(tmp_path):
    """Read the raw records independently of read_ply and check every column's meaning."""
    g = random_gaussians(5, 2, seed=3)
    path = write_ply(tmp_path / "model.ply", g)
    names = ply_property_names(2)
    _, header_bytes = ply_header(path)
    records = np.frombuffer(path.read_bytes()[header_bytes:], dtype=np.uint8).reshape(5, 4 * len(names) + 3)
    raw = records[:, : 4 * len(names)].copy().view("<f4")
    col = {name: torch.from_numpy(raw[:, i].copy()) for i, name in enumerate(names)}
    assert torch.equal(torch.stack([col["x"], col["y"], col["z"]], 1), g.means)
    rgb = np.clip(np.rint((g.sh0[:, 0].double().numpy() * 0.28209479177387814 + 0.5) * 255), 0, 255)
    assert np.array_equal(records[:, -3:], rgb.astype(np.uint8))     # red green blue: the band-0 colour
    assert torch.equal(torch.stack([col[f"scale_{i}"] for i in range(3)], 1), g.log_scales)
    assert torch.equal(torch.stack([col[f"rot_{i}"] for i in range(4)], 1), g.quats)    # w, x, y, z as stored
    assert torch.equal(col["opacity"], g.opacity_logits)
    for c in range(3):
        assert torch.equal(col[f"f_dc_{c}"], g.sh0[:, 0, c])
    k1 = g.shN.shape[1]                                     # 8 for degree 2
    for j in range(3 * k1):                                 # f_rest_j = shN[:, j % (K-1), j // (K-1)]
        assert torch.equal(col[f"f_rest_{j}"], g.shN[:, j % k1, j // k1]), j


@pytest.mark.parametrize("sh_degree", [0, 1, 3])
def test_plyfile_reads_what_write_ply_writes(tmp_path, sh_degree):
    """The reference reader (plyfile) as an oracle: same element, property order and values."""
    from plyfile import PlyData

    g = random_gaussians(23, sh_degree, seed=sh_degree)
    path = write_ply(tmp_path / "model.ply", g)
    ply = PlyData.read(str(path))
    assert [e.name for e in ply.elements] == ["vertex"] and ply["vertex"].count == 23
    assert [p.name for p in ply["vertex"].properties] == ply_property_names(sh_degree) + ["red", "green", "blue"]
    assert all(p.val_dtype in ("f4", "float32") for p in ply["vertex"].properties[:-3])
    assert all(p.val_dtype in ("u1", "uint8") for p in ply["vertex"].properties[-3:])
    assert_same(g, plyfile_gaussians(path))


@pytest.mark.parametrize("text", [False, True], ids=["binary", "ascii"])
def test_read_ply_reads_what_plyfile_writes(tmp_path, text):
    """A file written by plyfile in the reference layout (binary): read_ply gives its values;
    plyfile's ASCII form is refused with a message saying what is expected."""
    from plyfile import PlyData, PlyElement

    g = random_gaussians(9, 2, seed=4)
    names = ply_property_names(2)
    rows = np.frombuffer(read_raw_records(write_ply(tmp_path / "ours.ply", g)), np.uint8).reshape(9, -1)
    rows = rows[:, : 4 * len(names)].copy().view("<f4")
    records = np.empty(9, dtype=[(n, "<f4") for n in names])
    for i, n in enumerate(names):
        records[n] = rows[:, i]
    path = tmp_path / "theirs.ply"
    PlyData([PlyElement.describe(records, "vertex")], text=text, byte_order="<").write(str(path))
    if text:
        with pytest.raises(ValueError, match="binary_little_endian"):
            read_ply(path)
    else:
        assert_same(g, read_ply(path))


def test_ply_empty_and_float64_input(tmp_path):
    empty = Gaussians.empty(sh_degree=1)
    assert_same(empty, read_ply(write_ply(tmp_path / "empty.ply", empty)))
    g64 = Gaussians(**{k: v.double() for k, v in random_gaussians(4, 1).tensors().items()})
    back = read_ply(write_ply(tmp_path / "g64.ply", g64))
    assert torch.equal(back.means, g64.means.float())


def test_read_ply_ignores_extra_properties_and_checks_input(tmp_path):
    g = random_gaussians(3, 1)
    names = ply_property_names(1) + ["extra"]
    floats = np.frombuffer(read_raw_records(write_ply(tmp_path / "a.ply", g)), np.uint8).reshape(3, -1)
    rows = np.concatenate([floats[:, :-3].copy().view("<f4"), np.full((3, 1), 7.0, "<f4")], axis=1)
    header = "ply\nformat binary_little_endian 1.0\ncomment made elsewhere\nelement vertex 3\n"
    header += "".join(f"property float {n}\n" for n in names) + "end_header\n"
    (tmp_path / "extra.ply").write_bytes(header.encode() + rows.tobytes())
    assert_same(g, read_ply(tmp_path / "extra.ply"))

    (tmp_path / "ascii.ply").write_bytes(header.replace("binary_little_endian", "ascii").encode())
    with pytest.raises(ValueError, match="binary_little_endian"):
        read_ply(tmp_path / "ascii.ply")
    (tmp_path / "short.ply").write_bytes(header.encode() + rows.tobytes()[:-4])
    with pytest.raises(ValueError, match="truncated"):
        read_ply(tmp_path / "short.ply")
    no_opacity = header.replace("property float opacity\n", "")
    (tmp_path / "bad.ply").write_bytes(no_opacity.encode() + np.zeros((3, len(names) - 1), "<f4").tobytes())
    with pytest.raises(ValueError, match=r"missing 3DGS vertex properties \['opacity'\]"):
        read_ply(tmp_path / "bad.ply")


def read_raw_records(path: Path) -> bytes:
    _, header_bytes = ply_header(path)
    return path.read_bytes()[header_bytes:]


def test_write_ply_validates_shapes(tmp_path):
    g = random_gaussians(4, 1)
    g.quats = g.quats[:, :3]
    with pytest.raises(ValueError, match=r"Gaussians.quats must have shape \[N, 4\]"):
        write_ply(tmp_path / "x.ply", g)
    g = random_gaussians(4, 1)
    g.shN = torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="K = 1, 4, 9 or 16"):
        write_ply(tmp_path / "x.ply", g)
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------- atomic


def test_atomic_path_failure_leaves_nothing(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path
            tmp.write_bytes(b"half a fi")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_failure_keeps_existing_target(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("new, incomplete")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_write_replaces_on_success_with_normal_permissions(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    atomic_write(target, "new")
    assert target.read_text() == "new"
    atomic_write(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert list(tmp_path.iterdir()) == [target]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(TypeError, match="bytes or str"):
        atomic_write(target, 3)


def test_failed_png_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"\[H, W, 3\] or \[H, W, 4\]"):
        write_png(tmp_path / "x.png", np.zeros((4, 4, 2), np.float32))
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- images


def test_png_float_and_uint8(tmp_path):
    img = torch.zeros(6, 5, 3)
    img[0, 0] = torch.tensor([1.0, 0.5, 2.0])               # 2.0 is clipped
    write_png(tmp_path / "f.png", img)
    back = np.asarray(Image.open(tmp_path / "f.png"))
    assert back.shape == (6, 5, 3) and back.dtype == np.uint8
    assert back[0, 0].tolist() == [255, 128, 255] and back[1:].max() == 0
    rgba = np.random.default_rng(0).integers(0, 256, (3, 4, 4), dtype=np.uint8)
    write_png(tmp_path / "u.png", rgba)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "u.png")), rgba)


def test_side_by_side():
    gt = np.zeros((4, 3, 3), np.float32)
    pred = np.ones((4, 3, 3), np.float32)
    out = side_by_side(gt, pred, separator=2)
    assert out.shape == (4, 8, 3) and out.dtype == np.uint8
    assert (out[:, :3] == 0).all() and (out[:, 3:5] == 255).all() and (out[:, 5:] == 255).all()
    out = side_by_side(gt, pred, separator=1, separator_value=128)
    assert (out[:, 3] == 128).all()
    with pytest.raises(ValueError, match="images of one shape"):
        side_by_side(gt, pred[:2])
    three = side_by_side(gt, pred, np.full((4, 3, 3), 0.5, np.float32))      # GT | model.spz | model.ply
    assert three.shape == (4, 13, 3) and (three[:, 10:] == 128).all() and (three[:, 8:10] == 255).all()


# ----------------------------------------------------------------------------------- json, csv, report


def test_write_json_is_strict(tmp_path):
    path = write_json(tmp_path / "m.json", {"psnr": math.inf, "n": np.int64(3), "x": torch.tensor(0.5),
                                            "nested": {"a": [1.0, float("nan")]}, "p": Path("a/b")})
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"psnr": None, "n": 3, "x": 0.5, "nested": {"a": [1.0, None]}, "p": "a/b"}


def test_append_csv_with_changing_columns(tmp_path):
    path = tmp_path / "metrics.csv"
    append_csv(path, {"step": 0, "psnr": 20.5})
    append_csv(path, {"step": 1, "psnr": 21.0})
    assert path.read_text() == "step,psnr\n0,20.5\n1,21.0\n"
    append_csv(path, {"step": 2, "lpips": 0.1, "psnr": 22.0})       # new column, other order
    append_csv(path, {"step": 3})                                     # missing columns
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "psnr", "lpips"], ["0", "20.5", ""], ["1", "21.0", ""], ["2", "22.0", "0.1"],
                    ["3", "", ""]]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]
    with pytest.raises(ValueError, match="non-empty mapping"):
        append_csv(path, {})


def test_step_dir(tmp_path):
    d = step_dir(tmp_path / "out", 120)
    assert d == tmp_path / "out" / "step_000120" and d.is_dir()
    assert step_dir(tmp_path / "out", 120) == d
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="non-negative integer"):
            step_dir(tmp_path, bad)


def test_step_writer_and_report(tmp_path):
    out = tmp_path / "out"
    writer = StepWriter(out)
    g = random_gaussians(20, 1)
    gt = torch.rand(8, 10, 3)
    views = [("view_000", gt, gt * 0.5), ("view_008", gt, gt)]
    cfg = Config()
    metrics0 = {"psnr": math.inf, "ssim": 1.0, "lpips": "unavailable", "gaussians": 20,
                "history": [{"iteration": 10, "psnr": 15.0}], "timing": {"train": 1.5}}
    d0 = writer.write(0, g, views, metrics0, cfg)
    d5 = writer.write(5, None, [("view_001", gt, gt)], {"psnr": 25.0, "ssim": 0.9, "new": 1}, {"a": 1})

    assert d0 == out / "step_000000" and d5 == out / "step_000005"
    assert sorted(p.name for p in d0.iterdir()) == ["config.yaml", "metrics.json", "model.ply", "model.spz", "views"]
    assert_same(g, read_ply(d0 / "model.ply"))
    png = np.asarray(Image.open(d0 / "views" / "view_000.png"))
    assert png.shape == (8, 2 * 10 + 2, 3)
    assert yaml.safe_load((d0 / "config.yaml").read_text()) == cfg.to_dict()
    m = json.loads((d0 / "metrics.json").read_text())
    assert m["step"] == 0 and m["psnr"] is None and m["history"] == [{"iteration": 10, "psnr": 15.0}]
    assert not (d5 / "model.ply").exists()
    assert m["bytes_written"] == sum(p.stat().st_size for p in d0.rglob("*") if p.is_file() and p.name != "metrics.json") \
        and m["web_model_bytes"] == (d0 / "model.spz").stat().st_size

    rows = read_csv(out / "metrics.csv")
    assert [(r["step"], r["status"]) for r in rows] == [("0", "trained"), ("5", "trained")]
    assert rows[0]["psnr"] == "inf" and rows[0]["timing.train"] == "1.5" and "history" not in rows[0]
    assert rows[1]["new"] == "1" and rows[0]["new"] == ""

    report = (out / "report.html").read_text()
    assert "Step 0" in report and "Step 5" in report
    links = re.findall(r"<img src='([^']+)'", report)
    assert links == ["step_000000/views/view_000.png", "step_000000/views/view_008.png",
                     "step_000005/views/view_001.png"]
    assert all((out / link).is_file() for link in links)
    # the tables: every column, a new one too (last, under Other), empty where a step has none
    rows5 = re.findall(r"<tr><th class='step'><a href='#step_000005'>5</a></th>(.*?)</tr>", report)
    cells = [cell for row in rows5 for cell in re.findall(r"<td[^>]*>([^<]*)</td>", row)]
    assert cells[0] == "trained" and "25.00" in cells and "0.9000" in cells and cells[-1] == "1", cells
    assert "unavailable" in report and ">inf</td>" in report
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "report.html", "report.json", "step_000000",
                                                     "step_000005", "viewer"]

    with pytest.raises(ValueError, match="plain file names"):
        writer.write(6, None, [("../escape", gt, gt)], {"psnr": 1.0})


def test_report_lists_steps_without_csv(tmp_path):
    step_dir(tmp_path, 3)
    step_dir(tmp_path, 12)
    (tmp_path / "not_a_step").mkdir()
    report = write_report(tmp_path).read_text()
    assert report.index("Step 3") < report.index("Step 12")
    assert "not_a_step" not in report


# ----------------------------------------------------------------------------------- gather


def test_gather_single_process_returns_local():
    from mpi4py import MPI

    g = random_gaussians(5, 0)
    assert gather_gaussians(g, None) is g
    assert gather_gaussians(g, MPI.COMM_SELF) is g


GATHER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from mpi4py import MPI
    sys.path.insert(0, {root!r})
    from insitu.surface.gaussians import gather_gaussians
    from insitu.surface.gaussians import Gaussians

    def shard(rank, n, degree):
        g = torch.Generator().manual_seed(rank)
        r = lambda *s: torch.randn(*s, generator=g)
        k = (degree + 1) ** 2
        return Gaussians(r(n, 3), r(n, 3), r(n, 4), r(n), r(n, 1, 3), r(n, k - 1, 3))

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    for degree, sizes in ((0, [7, 4]), (3, [0, 5])):   # an empty shard too
        merged = gather_gaussians(shard(rank, sizes[rank], degree), comm)
        if rank == 0:
            expected = Gaussians.cat([shard(r, sizes[r], degree) for r in range(size)])
            for name in expected.names():
                assert torch.equal(getattr(merged, name), getattr(expected, name)), name
            print("merged", degree, len(merged), flush=True)
        else:
            assert merged is None
    try:
        gather_gaussians(shard(rank, 3, rank), comm)     # ranks disagree on the SH degree
        outcome = "merged"
    except ValueError as e:
        outcome = "raised" if "different SH degrees" in str(e) else repr(e)
    outcomes = comm.gather(outcome, root=0)               # one line from rank 0: rank output interleaves
    if rank == 0:
        print("mismatch:", outcomes, flush=True)
    """
)


@pytest.mark.mpi
def test_gather_gaussians_two_ranks(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(GATHER_SCRIPT.format(root=str(ROOT)))
    proc = launch([sys.executable, script], ranks=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "merged 0 11" in proc.stdout and "merged 3 5" in proc.stdout
    assert "mismatch: ['raised', 'raised']" in proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_parallel_write_ply_is_the_gathered_file(ranks, tmp_path):
    """Every rank writes its shard at its offset (tests/mpi/ply_worker.py): byte for byte the file of
    the gathered model, read back by read_ply; rank 0 allocates far less than the others' shards;
    failures raise on every rank and leave the target and no temporary file."""
    out = run_mpi(ranks, "ply_worker.py", str(tmp_path), timeout=180)
    assert out.returncode == 0, out.stdout
    assert all(f"OK rank {r} of {ranks}" in out.stdout for r in range(ranks)), out.stdout


# ----------------------------------------------------------------------------------- the output folder


def test_the_report_module_does_not_import_the_step_writer():
    code = "import sys, insitu.output.report; print('insitu.output.export' in sys.modules)"
    r = launch([sys.executable, "-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_a_failed_write_names_the_file_and_the_error_code_and_leaves_nothing(tmp_path):
    import errno

    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device \(ENOSPC\): '.*/model\.ply'$") as info:
        with atomic_path(tmp_path / "model.ply") as tmp:
            tmp.write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "model.ply")
    assert list(tmp_path.iterdir()) == []


def test_an_mpi_io_error_stack_becomes_the_one_line_error_it_stands_for(tmp_path):
    from mpi4py import MPI

    from insitu.output.ply import mpi_io_error

    class Stack(Exception):
        def __init__(self, kind, text):
            super().__init__(text)
            self.kind = kind

        def Get_error_class(self):
            return self.kind

    romio = Stack(MPI.ERR_IO, "Other I/O error , error stack:\ninternal_File_write_at_c(8659): MPI_File_write_at_c("
                              "...) failed\nADIOI_GEN_WRITECONTIG(80).....: Other I/O error No space left on device")
    assert str(mpi_io_error(romio, tmp_path / "model.ply")) == \
        f"[Errno 28] No space left on device (ENOSPC): '{tmp_path / 'model.ply'}'"
    assert mpi_io_error(Stack(MPI.ERR_NO_SPACE, "x\ny"), tmp_path / "m").errno == 28
    assert "(EIO)" in str(mpi_io_error(Stack(MPI.ERR_IO, "something\nelse"), tmp_path / "m"))


def test_the_lock_is_shared_within_a_process_and_removes_the_folders_it_made(tmp_path):
    from insitu.output.folder import LOCK_NAME, lock_output

    out = tmp_path / "a" / "b" / "out"
    first = lock_output(out, "insitu demo")
    again = lock_output(out, "insitu Adaptor")           # the Adaptor inside `insitu demo`
    assert again is first and json.loads((out / LOCK_NAME).read_text())["command"] == "insitu demo"
    again.release()
    assert (out / LOCK_NAME).exists()
    first.release()
    assert not (tmp_path / "a").exists()                 # the run left nothing: the folders go with the lock


def test_a_lock_whose_process_ended_is_taken_over(tmp_path):
    from insitu.output.folder import LOCK_NAME, lock_output

    out = tmp_path / "out"
    out.mkdir()
    code = (f"import os; from insitu.output.folder import lock_output; lock_output({str(out)!r}, 'killed run'); "
            "os._exit(9)")                                 # no release: as a killed run
    r = launch([sys.executable, "-c", code])
    assert r.returncode == 9 and "killed run" in (out / LOCK_NAME).read_text()
    with lock_output(out, "next run"):
        info = json.loads((out / LOCK_NAME).read_text())
        assert info["command"] == "next run" and info["pid"] == os.getpid()
    assert not (out / LOCK_NAME).exists() and out.is_dir()  # a folder it did not make stays


def test_resume_rebuilds_the_kept_steps_rows_from_their_metrics(tmp_path):
    out = tmp_path / "out"
    StepWriter(out).write(4, None, [], {"psnr": 21.5, "gaussians": 30, "history": [{"iteration": 0}]})
    (out / "metrics.csv").unlink()
    (out / "report.html").unlink()
    writer = StepWriter(out, done=[4])
    assert writer.rows[4] == {"step": 4, "status": "trained", "psnr": 21.5, "gaussians": 30, "bytes_written": 0,
                              "export_seconds": writer.rows[4]["export_seconds"]}
    writer.publish()
    assert [(r["step"], r["status"], r["psnr"]) for r in read_csv(out / "metrics.csv")] == [("4", "trained", "21.5")]
    assert "Step 4" in (out / "report.html").read_text()
