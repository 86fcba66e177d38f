"""Input files that lie: a BP file whose declared shape is huge beside its few blocks, a BP file with
a flipped bit in its metadata, a raw file whose name gives a type that does not exist. Each ends in
one ``insitu: error:`` line and exit 2 (on every rank), or reads as asked."""
from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, insitu, launch, one_error, sphere_field

import insitu.input.sources as sources
from bp_layouts import write_bp
from insitu.errors import InputError, SourceInputError
from insitu.input.bpfile import probe_bp
from insitu.input.decomposition import block_extent, split_dims
from insitu.input.sources import BPSource, RawSource, first_uncovered, largest_block
from insitu.volume import parse_raw_name, read_raw

HUGE = 100_000          # samples per axis declared: 10^15 samples, more memory than any machine has


def sparse_file(path: Path, n: int, blocks=((0, 0, 0),), size: int = 16) -> Path:
    """A BP5 file of one step whose variable U is declared (n, n, n) and holds only ``size``^3 blocks."""
    block = np.arange(size ** 3, dtype=np.float32).reshape(size, size, size)
    return write_bp(path, [{"U": [(start, block) for start in blocks]}], shapes={"U": (n, n, n)})


# ---- coverage from the blocks' boxes --------------------------------------------------------------

def test_first_uncovered_is_the_first_sample_no_box_holds():
    rng = np.random.default_rng(3)
    shape = (7, 6, 5)
    for _ in range(200):
        boxes = []
        for _ in range(rng.integers(0, 6)):
            lo = [int(rng.integers(0, n)) for n in shape]
            boxes.append((tuple(lo), tuple(int(rng.integers(l + 1, n + 1)) for l, n in zip(lo, shape))))
        if rng.random() < 0.3:              # and cases that cover the grid, with overlaps
            boxes += [((0, 0, 0), (4, 6, 5)), ((3, 0, 0), (7, 6, 5))]
        covered = np.zeros(shape, bool)
        for lo, hi in boxes:
            covered[tuple(slice(l, h) for l, h in zip(lo, hi))] = True
        want = tuple(int(i) for i in np.argwhere(~covered)[0]) if not covered.all() else None
        assert first_uncovered(boxes, shape) == want, boxes


def test_largest_block_is_the_largest_rank_selection():
    for shape, size in [((12, 12, 12), 2), ((13, 7, 29), 6), ((5, 9, 33), 5), ((40, 41, 42), 12)]:
        dims = split_dims(shape, size)
        counts = [block_extent(r, dims, shape).count for r in range(size)]
        assert largest_block(dims, shape) == max(counts, key=np.prod)
        assert np.prod(largest_block(dims, shape)) == max(np.prod(c) for c in counts)


def test_a_huge_sparse_array_is_skipped_without_a_mask_of_its_shape(tmp_path, monkeypatch):
    # 2000^3 declared, one 16^3 block: a mask of the shape would be 8 GB; the boxes say it all
    path = sparse_file(tmp_path / "huge.bp", 2000)
    monkeypatch.setattr(sources, "memory_share", lambda comm=None: (1 << 62, "as much as asked"))
    tracemalloc.start()
    try:
        src = BPSource(path, "U")
        steps = list(src)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert steps == [] and len(src.skipped) == 1
    assert "is a sparse array: its blocks do not cover its global shape (2000, 2000, 2000) (sample (0, 0, 16)" \
        in src.skipped[0][1]
    assert peak < 64 << 20, peak


def test_a_sparse_array_of_several_blocks_reads_nan_where_no_block_lies(tmp_path):
    path = sparse_file(tmp_path / "two.bp", 12, blocks=((0, 0, 0), (6, 6, 6)), size=6)
    block = np.arange(6 ** 3, dtype=np.float32).reshape(6, 6, 6)
    for rank in (0, 1):
        data = list(BPSource(path, "U", nonfinite="outside", rank=rank, size=2))[0].block.data
        want = np.full((12, 12, 12), np.nan, np.float32)
        want[:6, :6, :6] = want[6:, 6:, 6:] = block
        ext = block_extent(rank, split_dims((12, 12, 12), 2), (12, 12, 12))
        (x0, y0, z0), (nx, ny, nz) = ext.start, ext.count
        np.testing.assert_array_equal(data, want[z0:z0 + nz, y0:y0 + ny, x0:x0 + nx])


def test_a_block_outside_its_declared_shape_is_a_corrupt_file(tmp_path):
    # ADIOS2 writes it as asked; reading it would place samples outside the array
    path = write_bp(tmp_path / "out.bp", [{"U": [((6, 0, 0), np.ones((4, 4, 4), np.float32))]}],
                    shapes={"U": (8, 8, 8)})
    with pytest.raises(SourceInputError, match=r"out\.bp: truncated or corrupt BP file: block 0 of variable 'U' at "
                                               r"step 0 \(start \[6, 0, 0\], count \[4, 4, 4\]\) lies outside its "
                                               r"declared shape \(8, 8, 8\)"):
        list(BPSource(path, "U", nonfinite="outside"))


# ---- selections that cannot fit -------------------------------------------------------------------

def test_a_selection_that_cannot_fit_is_refused_before_it_is_read(tmp_path):
    path = sparse_file(tmp_path / "huge.bp", HUGE)
    for nonfinite in ("error", "outside"):
        with pytest.raises(SourceInputError) as info:
            list(BPSource(path, "U", nonfinite=nonfinite))
        text = str(info.value)
        assert (f"step 0: variable 'U' (declared shape ({HUGE}, {HUGE}, {HUGE}), 4-byte samples) needs at least "
                in text), text
        need = HUGE ** 3 * (4 + 4 + (8 if nonfinite == "outside" else 0))   # read, float32, NaN-filled float64
        assert f"on one rank ({need} bytes for its {HUGE} x {HUGE} x {HUGE} samples" in text, text
        assert "more than a rank's" in text and "run on more ranks" in text


def test_insitu_replay_refuses_a_huge_declared_shape_with_one_line(tmp_path):
    path = sparse_file(tmp_path / "huge.bp", HUGE)
    r = insitu("replay", path, "--var", "U", "--iso", "100", *TINY, "--out", "out", cwd=tmp_path)
    line = one_error(r)
    assert f"huge.bp: step 0: variable 'U' (declared shape ({HUGE}, {HUGE}, {HUGE}), 4-byte samples)" in line
    assert "more than a rank's" in line
    assert not list((tmp_path / "out").glob("step_*"))


@pytest.mark.mpi
def test_a_huge_declared_shape_is_refused_on_two_ranks_alike(tmp_path):
    path = sparse_file(tmp_path / "huge.bp", HUGE)
    r = insitu("replay", path, "--var", "U", "--iso", "100", *TINY, "--set", "input.nonfinite=outside",
               "--out", "out", cwd=tmp_path, ranks=2, timeout=240)
    line = one_error(r)
    # every rank checks the largest rank's selection: the same verdict in the same words, said once
    assert line.count("needs at least") == 1, line
    assert "per rank on 2 ranks" in line and "the largest rank's" in line and "NaN-filled copy" in line


# ---- corrupt metadata -----------------------------------------------------------------------------

def flipped(tmp_path: Path, name: str, where, bit: int) -> Path:
    """A one-step BP5 file with one bit of its mmd.0 flipped at ``where(mmd.0's bytes)``."""
    path = write_bp(tmp_path / name, [{"U": sphere_field(12), "step": 0}])
    raw = bytearray((path / "mmd.0").read_bytes())
    raw[where(bytes(raw))] ^= bit
    (path / "mmd.0").write_bytes(raw)
    return path


def test_a_flipped_bit_in_the_metadata_is_a_corrupt_file_not_a_decoding_error(tmp_path):
    # in a type name of mmd.0: the probe's ADIOS2 prints bytes that are not UTF-8 as it fails
    path = flipped(tmp_path, "flip.bp", lambda raw: raw.index(b"integer") + 1, 0x80)
    with pytest.raises(SourceInputError, match="flip.bp: truncated or corrupt BP file"):
        probe_bp(path, 60, var="U")
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert "flip.bp: truncated or corrupt BP file" in one_error(r)


@pytest.mark.parametrize("offset, bit", [(-34, 0x01), (-20, 0x80)])
def test_a_flipped_bit_in_a_block_index_ends_in_one_line_not_a_crash(tmp_path, offset, bit):
    # bits of the block index before the second record's names: ADIOS2 crashed reading the blocks or
    # the data there (the probe now asks the same in its child process)
    path = flipped(tmp_path, "flip.bp", lambda raw: raw.index(b"MetaArrayMM4", 0x100) + offset, bit)
    r = launch([sys.executable, "-c", READ, path])
    assert r.returncode in (0, 2), r.stdout + r.stderr
    if r.returncode == 2:
        assert r.stderr.startswith("insitu: error: ") and len(r.stderr.splitlines()) == 1, r.stderr


READ = """
import sys
from insitu.errors import InputError
from insitu.input.sources import BPSource
try:
    list(BPSource(sys.argv[1], "U", timeout_s=10))
except InputError as e:
    print(f"insitu: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


# ---- raw names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("odd_2x2x2_uint7.raw", "uint7"), ("x_2x2x2_float8.raw", "float8"),
                                         ("y_2x2x2_int1.raw", "int1")])
def test_a_raw_name_with_an_unknown_type_is_named_and_overridden_by_dtype(tmp_path, name, dtype):
    path = tmp_path / name
    np.arange(8, dtype=np.uint8).tofile(path)
    for call in (lambda: parse_raw_name(path), lambda: read_raw(path), lambda: read_raw(path, dims=(2, 2, 2))):
        with pytest.raises(InputError) as info:
            call()
        text = str(info.value)
        assert text.startswith(f"{name}: the type in the file name, {dtype!r}, is not one insitu reads"), text
        assert "uint8, int16" in text and "float32, float64" in text and "--dtype" in text
    want = np.arange(8, dtype=np.uint8).reshape(2, 2, 2)
    np.testing.assert_array_equal(read_raw(path, dtype="uint8"), want)                 # the name's dims
    np.testing.assert_array_equal(read_raw(path, dims=(2, 2, 2), dtype="uint8"), want)
    np.testing.assert_array_equal(read_raw(path, dims=(4, 2, 1), dtype="uint8"), want.reshape(1, 2, 4))


def test_insitu_run_names_the_raw_type_and_takes_dims_and_dtype_over_the_name(tmp_path):
    sphere_field(12, dtype=np.uint8).tofile(tmp_path / "odd_12x12x12_uint7.raw")
    r = insitu("run", "odd_12x12x12_uint7.raw", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert "odd_12x12x12_uint7.raw: the type in the file name, 'uint7', is not one insitu reads" in one_error(r)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("step_*"))
    r = insitu("run", "odd_12x12x12_uint7.raw", "--dims", "12", "12", "12", "--dtype", "uint8", "--iso", "3", *TINY,
               "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "step_000000" / "model.ply").is_file()
    assert list(RawSource(tmp_path / "odd_12x12x12_uint7.raw", dtype="uint8"))[0].block.data.shape == (12, 12, 12)


def test_insitu_run_of_an_npz_archive_names_its_arrays_not_raw_file_rules(tmp_path):
    np.savez(tmp_path / "x.npz", density=sphere_field(8), mask=np.ones(3))
    line = one_error(insitu("run", "x.npz", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path))
    assert line == ("insitu: error: x.npz: a NumPy .npz archive (holding density, mask); insitu run reads one array "
                    "from a .npy file or a raw file: save the field with numpy.save('density.npy', "
                    "numpy.load('x.npz')['density'])"), line
    assert "raw" not in line.split(";")[0] and not (tmp_path / "out").exists()


# ---- a variable whose type changes between steps --------------------------------------------------

RETYPED = """
import sys
sys.modules["torch"] = None
import numpy as np, adios2
from conftest import sphere_field
engine, types = sys.argv[2], sys.argv[3].split(",")
io = adios2.Adios().declare_io("w")
io.set_engine(engine)
with adios2.Stream(io, sys.argv[1], "w") as s:
    for i, t in enumerate(types):
        if i and t != types[i - 1]:
            s.io.remove_variable("U")       # and defined again, of the new type, by write
        s.begin_step()
        s.write("U", sphere_field(20).astype(t), [20] * 3, [0] * 3, [20] * 3)
        s.end_step()
"""


def retyped(path: Path, types: str, engine: str = "BP5") -> Path:
    """A BP file whose variable U (20^3) is of the given types (``f8,f4``: float64 at step 0, float32 at step 1)."""
    r = launch([sys.executable, "-c", RETYPED, path, engine, types], cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.parametrize("types, declared, holds", [
    ("f8,f4", "double, 8 bytes a sample", "4 bytes a sample"),           # the last step: ADIOS2 would hang
    ("f8,f4,f4", "double, 8 bytes a sample", "4 bytes a sample"),        # a step before another
    ("f4,f8", "float, 4 bytes a sample", "8 bytes a sample"),            # ADIOS2 would read half of each value
    ("u1,f4,u1", "uint8_t, 1 byte a sample", "4 bytes a sample"),
])
def test_a_bp5_variable_whose_type_changes_is_named_at_its_step_after_the_steps_before(tmp_path, types, declared,
                                                                                       holds):
    # a BP5 file keeps the type a variable was first written with: only its data's size tells
    path = retyped(tmp_path / "t.bp", types)
    got = []
    with pytest.raises(SourceInputError) as info:
        for step in BPSource(path, "U"):
            got.append(step.step)
    assert got == [0]
    assert str(info.value).startswith(f"{path}: step 1: variable 'U' is declared {declared} (the type it was first "
                                      f"written with: a BP5 file keeps that one), but the step's data holds {holds} "
                                      "for its 8000 samples: its type changed between steps ("), info.value
    assert str(info.value).endswith("write it with one type in every step (or the new type under another name)")


def test_a_bp4_variable_whose_type_changes_is_refused_before_any_step(tmp_path):
    path = retyped(tmp_path / "t4.bp", "f8,f4", engine="BP4")
    # (ADIOS2 reads a BP4 file's metadata when it opens it: it fails there)
    with pytest.raises(SourceInputError, match=r"t4.bp: variable 'U' changes its type between steps, which ADIOS2 "
                                               r"cannot read; write it with one type in every step"):
        BPSource(path, "U")


def test_replay_of_a_type_change_ends_in_one_line_and_keeps_the_steps_before(tmp_path):
    path = retyped(tmp_path / "dt.bp", "f8,f4")
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path, timeout=120)
    line = one_error(r)
    assert "dt.bp: step 1: variable 'U' is declared double" in line and "its type changed between steps" in line
    assert "step 0: surface PSNR" in r.stdout
    out = tmp_path / "out"
    assert (out / "step_000000" / "metrics.json").is_file() and not list(out.glob(".step_*"))
    assert not (out / ".insitu.lock").exists()
