"""BP files as writers we did not write lay them out, written with the PyPI adios2 library itself
(tests/bp_layouts.py): BP4 and BP5, every numeric type, steps without the variable, Fides,
openPMD and VTK geometry, step variables and openPMD iterations, sparse, local, multi-block and
column-major arrays, compressed variables; read on one rank here and on two in
``test_layouts_read_the_same_on_two_ranks`` (tests/mpi/layout_worker.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, insitu, launch, one_error, sphere_field, subprocess_env

from bp_layouts import full_range, write_bp, write_column_major
from insitu.config import from_dict
from insitu.errors import InputError, SourceError, SourceInputError
from insitu.input.decomposition import cut_block
from insitu.input.sources import BPSource, SSTSource, sst_open_reason
from insitu.output.files import read_csv
from insitu.step.driver import masked
from insitu.volume import outside_value

WORKER = ROOT / "tests" / "mpi" / "layout_worker.py"


def read_all(path: Path, var: str = "U", **kw) -> tuple[BPSource, list]:
    src = BPSource(path, var, **kw)
    return src, list(src)


# ---- BP versions ------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["BP4", "BP5"])
def test_bp4_and_bp5_files_replay_with_their_own_engine(tmp_path, engine):
    fields = [sphere_field(10) + i for i in range(3)]
    path = write_bp(tmp_path / "f.bp", [{"U": f, "step": 10 * i, "time": 0.5 * i} for i, f in enumerate(fields)],
                    engine=engine)
    src, steps = read_all(path)
    assert src.engine == engine and src.numbers == [0, 10, 20]
    assert [(s.step, s.time) for s in steps] == [(0, 0.0), (10, 0.5), (20, 1.0)]
    for s, f in zip(steps, fields):
        np.testing.assert_array_equal(s.block.data, f)


def test_a_bp4_file_still_being_written_is_followed_to_its_end(tmp_path):
    """The writer adds each next step only once the reader holds the one before: the source waits for
    steps written after it opened the file, and ends where the writer closes it."""
    writer = subprocess.Popen([sys.executable, "-c", GROWING, str(tmp_path / "g.bp")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "0"           # the first step is in the file
        got = []
        with BPSource(tmp_path / "g.bp", "U", timeout_s=30) as src:
            for s in src:
                got.append((s.step, float(s.block.data[0, 0, 0])))
                if len(got) < 4:
                    writer.stdin.write("next\n")                 # only now is the next step written
                    writer.stdin.flush()
        assert got == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    finally:
        writer.kill()
        writer.wait()


GROWING = """
import sys
sys.modules["torch"] = None
import numpy as np
import adios2
ad = adios2.Adios(); io = ad.declare_io("w"); io.set_engine("BP4")
with adios2.Stream(io, sys.argv[1], "w") as s:
    for i in range(4):
        if i:
            sys.stdin.readline()
        s.begin_step(); s.write("U", np.full((4, 5, 6), float(i)), [4, 5, 6], [0, 0, 0], [4, 5, 6]); s.end_step()
        print(i, flush=True)
"""


@pytest.mark.parametrize("name, cut, message", [
    ("data.0", 100, r"truncated or corrupt BP4 file \(ADIOS step index 2: the data written at byte \d+ is not whole"),
    ("md.0", 10, r"truncated or corrupt BP4 file \(md.0 has \d+ bytes; the metadata of ADIOS step index 2 needs"),
    ("md.idx", 10, r"truncated or corrupt BP4 file \(md.idx ends inside a step record"),
])
def test_a_truncated_bp4_file_gives_a_clear_error_instead_of_hanging(tmp_path, name, cut, message):
    path = write_bp(tmp_path / "t.bp", [{"U": sphere_field(10) + i} for i in range(3)], engine="BP4")
    os.truncate(path / name, (path / name).stat().st_size - cut)
    with pytest.raises(SourceInputError, match=message):
        BPSource(path, "U")


def test_a_bp3_file_is_refused_naming_the_tool_that_converts_it(tmp_path):
    path = write_bp(tmp_path / "old.bp", [{"U": sphere_field(10)}], engine="BP3")
    assert path.is_file() and (tmp_path / "old.bp.dir").is_dir()
    for given in (path, tmp_path / "old.bp.dir"):
        with pytest.raises(SourceInputError, match=r"old.bp: an ADIOS2 BP3 file .*it reads BP4 and BP5\. Convert it "
                                                   r"with ADIOS2's own tool: adios2_reorganize .*old.bp .*old-bp5.bp "
                                                   r"BPFile \"\" BP5 \"\""):
            BPSource(given, "U")


# ---- numeric types ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                                   "float32", "float64"])
@pytest.mark.parametrize("engine", ["BP4", "BP5"])
def test_every_numeric_type_reads_with_its_full_range(tmp_path, dtype, engine):
    a = full_range(dtype)
    path = write_bp(tmp_path / "t.bp", [{"U": a, "V": a}, {"U": a}], engine=engine)
    for rank in range(2):
        steps = list(BPSource(path, "U", rank=rank, size=2, color_var="V" if rank == 0 else None))
        assert len(steps) == (2 if rank else 1)
        b = steps[0].block
        assert b.data.dtype == a.dtype
        np.testing.assert_array_equal(b.data, cut_block(a, rank, 2).data)


def test_a_uint8_volume_with_values_above_127_trains_from_the_command_line(tmp_path):
    a = np.clip(255 - sphere_field(12) * 40, 0, 255).astype(np.uint8)          # 255 in the middle
    path = write_bp(tmp_path / "ct.bp", [{"U": a}, {"U": a}])
    r = insitu("replay", path, "--var", "U", "--iso", "200", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "done: 2 step(s) trained" in r.stdout


# ---- steps without the variable --------------------------------------------------------------

def test_a_step_without_the_variable_is_skipped_and_the_replay_goes_on(tmp_path):
    path = write_bp(tmp_path / "s.bp", [{"U": sphere_field(12), "step": 0}, {"W": sphere_field(12), "step": 1},
                                        {"U": sphere_field(12), "step": 2}])
    src, steps = read_all(path)
    assert [s.step for s in steps] == [0, 2]
    assert src.skipped == [(1, "no variable 'U' at step 1; variables present: W, step")]
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "done: 2 step(s) trained, 1 skipped (step 1: no variable 'U' at step 1" in r.stdout
    rows = {row["step"]: row for row in read_csv(tmp_path / "out" / "metrics.csv")}
    assert (rows["0"]["status"], rows["2"]["status"], rows["1"]["status"]) == ("trained", "trained", "skipped")
    assert rows["1"]["reason"] == "no variable 'U' at step 1; variables present: W, step"


def test_a_file_whose_steps_all_lack_the_variable_is_refused_listing_the_variables_before_anything_is_written(
        tmp_path):
    path = write_bp(tmp_path / "s.bp", [{"W": sphere_field(12), "step": n} for n in (0, 1)])
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path)
    assert one_error(r) == f"insitu: error: {path}: no variable 'U' in any of its 2 step(s); variables present: W, step"
    assert not (tmp_path / "out").exists() and "insitu replay:" not in r.stdout


def test_every_counts_the_steps_that_hold_the_variable(tmp_path):
    steps = [{"U" if n % 3 else "W": sphere_field(10), "step": n} for n in range(7)]     # W at 0, 3, 6
    src, got = read_all(write_bp(tmp_path / "s.bp", steps), every=2)
    assert [s.step for s in got] == [1, 4] and [n for n, _ in src.skipped] == [0, 3, 6]


# ---- geometry -------------------------------------------------------------------------------------

def test_fides_attributes_give_origin_and_spacing(tmp_path):
    path = write_bp(tmp_path / "f.bp", [{"U": sphere_field(10)}], attributes={
        "Fides_Data_Model": "uniform", "Fides_Origin": [1, 2, 3], "Fides_Spacing": [0.1, 0.2, 0.3],
        "Fides_Dimension_Variable": "U", "origin": [9, 9, 9]})        # Fides comes first
    b = read_all(path)[1][0].block
    assert b.origin == (1.0, 2.0, 3.0) and b.spacing == (0.1, 0.2, 0.3)


def test_vtk_style_attributes_and_the_vtk_xml_schema_give_origin_and_spacing(tmp_path, capsys):
    xml = ('\n<?xml version="1.0"?>\n<VTKFile type="ImageData"><ImageData WholeExtent="0 9 0 9 0 9" '
           'Origin="0 1 2" Spacing="0.5 0.5 2"><Piece Extent="0 9 0 9 0 9"/></ImageData></VTKFile>')
    b = read_all(write_bp(tmp_path / "v.bp", [{"U": sphere_field(10)}], attributes={"vtk.xml": xml}))[1][0].block
    assert b.origin == (0.0, 1.0, 2.0) and b.spacing == (0.5, 0.5, 2.0)
    b = read_all(write_bp(tmp_path / "a.bp", [{"U": sphere_field(10)}], attributes={"spacing": [2, 3, 4]}))[1][0].block
    assert b.origin == (0.0, 0.0, 0.0) and b.spacing == (2.0, 3.0, 4.0)
    assert "warning: " + str(tmp_path / "a.bp") + ": no origin for 'U' in the file" in capsys.readouterr().err


def test_without_geometry_the_model_is_in_index_units_with_a_warning(tmp_path, capsys):
    b = read_all(write_bp(tmp_path / "n.bp", [{"U": sphere_field(10)}]))[1][0].block
    assert b.origin == (0.0, 0.0, 0.0) and b.spacing == (1.0, 1.0, 1.0)
    assert "insitu: warning: " in capsys.readouterr().err


def test_configured_origin_and_spacing_override_the_file(tmp_path):
    path = write_bp(tmp_path / "f.bp", [{"U": sphere_field(10)}], attributes={"Fides_Origin": [1, 2, 3],
                                                                   "Fides_Spacing": [0.1, 0.2, 0.3]})
    b = read_all(path, origin=[5, 6, 7])[1][0].block
    assert b.origin == (5.0, 6.0, 7.0) and b.spacing == (0.1, 0.2, 0.3)
    b = read_all(path, spacing=[1, 1, 2])[1][0].block
    assert b.origin == (1.0, 2.0, 3.0) and b.spacing == (1.0, 1.0, 2.0)


def openpmd_attributes(prefix: str, labels=("z", "y", "x"), order: str = "C") -> dict:
    return {"/openPMD": "1.1.0", "/basePath": "/data/%T/", "/meshesPath": "meshes/",
            f"{prefix}/rho/axisLabels": list(labels), f"{prefix}/rho/dataOrder": order,
            f"{prefix}/rho/geometry": "cartesian", f"{prefix}/rho/gridSpacing": [0.5, 0.25, 2.0],
            f"{prefix}/rho/gridGlobalOffset": [1.0, 2.0, 3.0], f"{prefix}/rho/gridUnitSI": 1e-6,
            f"{prefix}/rho/position": [0.5, 0.5, 0.5]}


def test_openpmd_group_based_iterations_give_steps_times_and_geometry(tmp_path):
    # one ADIOS step per iteration, the mesh under /data/<iteration>/meshes/, as openPMD-api writes it
    a = sphere_field(10)
    attrs = {}
    for it in (100, 200, 300):
        attrs.update(openpmd_attributes(f"/data/{it}/meshes"))
        attrs[f"/data/{it}/time"] = it * 0.5
    path = write_bp(tmp_path / "g.bp", [{f"/data/{it}/meshes/rho": a + it} for it in (100, 200, 300)],
                    attributes=attrs, engine="BP4")
    src, steps = read_all(path, "rho")
    assert src.numbers == [100, 200, 300] and src.numbering == "the openPMD iteration"
    assert [(s.step, s.time) for s in steps] == [(100, 50.0), (200, 100.0), (300, 150.0)]
    b = steps[0].block
    # axisLabels z, y, x: gridSpacing (dz, dy, dx); origin = offset + position * spacing
    assert b.spacing == (2.0, 0.25, 0.5) and b.origin == (3.0 + 1.0, 2.0 + 0.125, 1.0 + 0.25)
    np.testing.assert_array_equal(b.data, a + 100)


@pytest.mark.parametrize("base", ["/data", "/data/%T/"])      # openPMD-api writes either (files, SST streams)
def test_openpmd_variable_based_iteration_comes_from_the_snapshot_attribute(tmp_path, base):
    # variable-based encoding: one variable /data/meshes/rho for all iterations, the iteration in /data/snapshot
    a = sphere_field(10)
    attrs = {**openpmd_attributes("/data/meshes"), "/basePath": base, "/data/snapshot": np.array([300], np.uint64),
             "/data/time": 150.0, "/data/meshes/rho/axisLabels": ""}     # labels left empty: the array's order
    src, steps = read_all(write_bp(tmp_path / "v.bp", [{"/data/meshes/rho": a}], attributes=attrs), "rho")
    assert [(s.step, s.time) for s in steps] == [(300, 150.0)] and src.numbers == [300]
    np.testing.assert_array_equal(steps[0].block.data, a)


def test_openpmd_x_y_z_labels_in_c_order_put_the_axes_where_they_belong(tmp_path):
    # the file's array is [x, y, z] (x slowest): read as [z, y, x], spacing and origin following
    rng = np.random.default_rng(4)
    a_xyz = rng.random((4, 5, 6))
    path = write_bp(tmp_path / "o.bp", [{"/data/7/meshes/rho": a_xyz}],
                    attributes=openpmd_attributes("/data/7/meshes", labels=("x", "y", "z")))
    for rank, size in ((0, 1), (1, 2)):
        b = read_all(path, "rho", rank=rank, size=size)[1][0].block
        assert b.global_shape == (4, 5, 6)
        np.testing.assert_array_equal(b.data, cut_block(a_xyz.transpose(2, 1, 0), rank, size).data)
        assert b.spacing == (0.5, 0.25, 2.0) and b.origin == (1.25, 2.125, 4.0)


def test_openpmd_fortran_data_order_lists_the_axes_fastest_first(tmp_path):
    a = sphere_field(10)
    attrs = openpmd_attributes("/data/7/meshes", labels=("x", "y", "z"), order="F")
    b = read_all(write_bp(tmp_path / "f.bp", [{"/data/7/meshes/rho": a}], attributes=attrs), "rho")[1][0].block
    assert b.spacing == (0.5, 0.25, 2.0)                   # F: gridSpacing (dx, dy, dz), the array [z, y, x]
    np.testing.assert_array_equal(b.data, a)


def test_a_file_per_iteration_series_keeps_its_iteration_numbers(tmp_path):
    # openPMD file-based encoding: one file per iteration, each a single ADIOS step
    a = sphere_field(10)
    numbers = []
    for it in (100, 200):
        path = write_bp(tmp_path / f"f_{it}.bp", [{f"/data/{it}/meshes/rho": a}],
                        attributes=openpmd_attributes(f"/data/{it}/meshes"))
        numbers += [s.step for s in read_all(path, "rho")[1]]
    assert numbers == [100, 200]


def test_a_Step_variable_numbers_the_steps_and_step_var_time_var_name_others(tmp_path):
    path = write_bp(tmp_path / "s.bp", [{"U": sphere_field(10), "Step": 5 * n, "cycle": 1000 + n, "t_phys": 0.25 * n}
                                        for n in range(3)])
    src, steps = read_all(path)
    assert [s.step for s in steps] == [0, 5, 10] and src.numbering == "variable 'Step'"
    src, steps = read_all(path, step_var="cycle", time_var="t_phys")
    assert [(s.step, s.time) for s in steps] == [(1000, 0.0), (1001, 0.25), (1002, 0.5)] == \
        [(n, t) for n, t in zip(src.numbers, (0.0, 0.25, 0.5))]
    with pytest.raises(SourceInputError, match=r"input.step_var='nope': no variable or attribute of that name at "
                                                r"ADIOS step index 0"):
        BPSource(path, "U", step_var="nope")
    with pytest.raises(SourceInputError, match=r"input.time_var='U' is an array of shape \(10, 10, 10\) at step 0; "
                                                r"expected a single value \(the step's time\)"):
        read_all(path, time_var="U")


# ---- array layouts ----------------------------------------------------------------------------

def test_several_writer_blocks_per_step_read_as_one_array(tmp_path):
    a = np.random.default_rng(5).random((8, 6, 10))
    blocks = [((z, y, x), a[z:z + 4, y:y + 3, x:x + 5]) for z in (0, 4) for y in (0, 3) for x in (0, 5)]
    path = write_bp(tmp_path / "m.bp", [{"U": blocks}], shapes={"U": a.shape}, engine="BP4")
    for rank in range(3):
        b = read_all(path, rank=rank, size=3)[1][0].block
        np.testing.assert_array_equal(b.data, cut_block(a, rank, 3).data)


def test_column_major_arrays_read_in_the_right_orientation(tmp_path):
    a_xyz = np.random.default_rng(6).random((4, 5, 6))        # Fortran U(nx, ny, nz)
    path = write_column_major(tmp_path / "f.bp", a_xyz)
    b = read_all(path)[1][0].block
    assert b.global_shape == (4, 5, 6)
    np.testing.assert_array_equal(b.data, a_xyz.transpose(2, 1, 0))      # data[k, j, i] = U(i, j, k)


def test_a_sparse_array_is_skipped_unless_its_gaps_are_masked(tmp_path):
    a = sphere_field(8, dtype=np.float64)
    path = write_bp(tmp_path / "sp.bp", [{"U": [((0, 0, 0), a[:4])], "step": 0}], shapes={"U": a.shape})
    src, steps = read_all(path)
    assert steps == [] and "is a sparse array: its blocks do not cover its global shape (8, 8, 8)" in src.skipped[0][1]
    assert "input.nonfinite=outside" in src.skipped[0][1]
    b = read_all(path, nonfinite="outside")[1][0].block
    assert np.isnan(b.data[4:]).all() and np.array_equal(b.data[:4], a[:4])
    a8 = np.full((8, 8, 8), 200, np.uint8)                    # (u)int8: ADIOS2 does not say where blocks lie
    path = write_bp(tmp_path / "sp8.bp", [{"U": [((0, 0, 0), a8[:4])]}], shapes={"U": a8.shape})
    src, steps = read_all(path, nonfinite="outside")
    assert steps == [] and "its blocks hold 256 of its 512 samples" in src.skipped[0][1]


def test_a_local_array_of_one_block_reads_and_of_several_is_refused(tmp_path):
    a = np.random.default_rng(7).random((4, 5, 6))
    b = read_all(write_bp(tmp_path / "l1.bp", [{"U": a}], local=("U",)), rank=1, size=2)[1][0].block
    np.testing.assert_array_equal(b.data, cut_block(a, 1, 2).data)
    src, steps = read_all(write_bp(tmp_path / "l2.bp", [{"U": [((), a), ((), a)]}], shapes={"U": ()}))
    assert steps == [] and "is a local array of 2 blocks at step 0" in src.skipped[0][1]


def test_a_compressed_variable_names_the_operator_this_adios2_lacks(tmp_path):
    import adios2
    path = tmp_path / "c.bp"
    ad = adios2.Adios()
    io = ad.declare_io("w")
    op = ad.define_operator("none", "null")
    a = sphere_field(6, dtype=np.float64)
    with adios2.Stream(io, str(path), "w") as s:
        s.begin_step()
        v = io.define_variable("U", a, list(a.shape), [0, 0, 0], list(a.shape))
        v.add_operation(op, {})
        s.write(v, a)
        s.end_step()
    raw = bytearray((path / "data.0").read_bytes())
    assert raw[0] == 0x7F                                    # the null operator's header ...
    raw[0] = 0x01                                            # ... made bzip2's, which the PyPI library lacks
    (path / "data.0").write_bytes(bytes(raw))
    with pytest.raises(SourceInputError, match=r"variable 'U' at step 0 is compressed with the bzip2 operator, which "
                                               r"this ADIOS2 \(.*\) was built without .*docs/input.md, 'An ADIOS2 built from "
                                               r"source'"):
        list(BPSource(path, "U"))


def test_a_source_built_adios2_reads_compressed_variables(tmp_path):
    """Runs where INSITU_TEST_ADIOS2 names the Python folder of an ADIOS2 built with operators
    (docs/input.md, 'An ADIOS2 built from source'): that ADIOS2 compresses a field, insitu replays it."""
    where = os.environ.get("INSITU_TEST_ADIOS2")
    if not where:
        pytest.skip("no ADIOS2 built with compression operators: set INSITU_TEST_ADIOS2 to the folder that holds "
                    "its Python package (e.g. INSTALL/lib/python3.11/site-packages) to run this test")
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([where, str(ROOT)])}
    check = launch([sys.executable, "-c", SOURCE_BUILT, tmp_path / "z.bp"], env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    found = json.loads(check.stdout.splitlines()[-1])
    assert found["file"].startswith(str(Path(where).resolve())), found
    r = insitu("replay", tmp_path / "z.bp", "--var", "U", "--iso", "3", *TINY, "--out", tmp_path / "out",
               cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and "done: 1 step(s) trained" in r.stdout, r.stderr


SOURCE_BUILT = """
import json, sys
import numpy as np
import adios2
from pathlib import Path
ad = adios2.Adios()
for op in ("bzip2", "blosc", "zfp", "sz"):
    try:
        o = ad.define_operator("c-" + op, op)
        break
    except Exception:
        o = None
assert o is not None, "this ADIOS2 has none of bzip2, blosc, zfp, sz"
io = ad.declare_io("w")
z, y, x = np.mgrid[0:12, 0:12, 0:12]
a = np.sqrt((x - 5.5) ** 2 + (y - 5.5) ** 2 + (z - 5.5) ** 2)
with adios2.Stream(io, sys.argv[1], "w") as s:
    s.begin_step()
    v = io.define_variable("U", a, [12, 12, 12], [0, 0, 0], [12, 12, 12])
    v.add_operation(o, {"accuracy": "0.001"} if op in ("zfp", "sz") else {})
    s.write(v, a)
    s.end_step()
print(json.dumps({"file": str(Path(adios2.__file__).resolve()), "operator": op, "mpi": adios2.is_built_with_mpi}))
"""


# ---- NaN masks --------------------------------------------------------------------------------

def test_nonfinite_outside_fills_the_mask_below_every_iso_value_and_closes_the_surface(tmp_path):
    a = sphere_field(12, dtype=np.float64)                        # inside: r < 4 (field = -r + 10 > 6 around the centre)
    field = 10.0 - a
    field[:, :, 8:] = np.nan                        # a mask that cuts the ball
    cfg = from_dict({"input": {"iso": [6.0, 7.0], "nonfinite": "outside"}})
    block = masked(cut_block(field, 0, 1), cfg, None)
    fill = outside_value(np.nanmin(field), np.nanmax(field), [6.0, 7.0])
    assert np.isfinite(block.data).all() and fill < 6.0
    np.testing.assert_array_equal(block.data[:, :, 8:], fill)
    inside = block.data[:, :, 7]                    # the last unmasked plane: where the surface closes
    assert (inside[inside > 6.0] - 6.0 <= 6.0 - fill).all()     # the crossing is within half a cell of the sample
    with pytest.raises(InputError, match=r"contains \d+ NaN/Inf value\(s\).*give input.nonfinite=outside"):
        from insitu.volume import check_field
        check_field(field, "U")
    with pytest.raises(InputError, match="every sample is NaN/Inf"):
        masked(cut_block(np.full((4, 4, 4), np.nan), 0, 1), cfg, None)


def test_a_nan_masked_field_trains_with_nonfinite_outside_and_is_refused_without(tmp_path):
    field = (10.0 - sphere_field(12, dtype=np.float64))
    field[:, :, 9:] = np.nan
    path = write_bp(tmp_path / "n.bp", [{"U": field}])
    r = insitu("replay", path, "--var", "U", "--iso", "7", *TINY, "--out", "out", cwd=tmp_path)
    assert "NaN/Inf value(s)" in one_error(r) and "input.nonfinite=outside" in r.stderr
    r = insitu("replay", path, "--var", "U", "--iso", "7", *TINY, "--set", "input.nonfinite=outside",
               "--out", "out2", cwd=tmp_path)
    assert r.returncode == 0 and "done: 1 step(s) trained" in r.stdout, r.stderr


# ---- SST ----------------------------------------------------------------------------------------

def test_sst_transport_mismatch_is_named_with_the_setting_that_works():
    said = ("Warning:  Preferred DataPlane \"mpi\" not found.\nThe writer is using the mpi DataPlane for SST data "
            "transport, but the reader has failed to load this transport.  Communication cannot occur.  See the SST "
            "DataTransport engine parameter to force a match.")
    reason = sst_open_reason(said)
    assert "the writer sends its data over the 'mpi' transport (DataTransport)" in reason
    assert "set the writer's DataTransport=WAN" in reason and "RendezvousReaderCount" in reason
    assert sst_open_reason("nothing said") is None


def test_sst_a_file_that_is_not_a_contact_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.sst").write_text("not a contact file\n")
    with pytest.raises(SourceError, match="the contact file is not an SST contact file"):
        SSTSource("other", "U", timeout_s=3)


# ---- two ranks ----------------------------------------------------------------------------------

@pytest.mark.mpi
def test_layouts_read_the_same_on_two_ranks(tmp_path):
    a = np.random.default_rng(8).random((8, 6, 10))
    u8 = full_range("uint8")
    cases = {
        "bp4_blocks.bp": (write_bp(tmp_path / "bp4_blocks.bp", [{"U": [((z, 0, 0), a[z:z + 4]) for z in (0, 4)]}],
                                   shapes={"U": a.shape}, engine="BP4"), a, {}),
        "uint8.bp": (write_bp(tmp_path / "uint8.bp", [{"U": u8}]), u8, {}),
        "column_major.bp": (write_column_major(tmp_path / "column_major.bp", a.transpose(2, 1, 0)), a, {}),
        "openpmd_xyz.bp": (write_bp(tmp_path / "openpmd_xyz.bp", [{"/data/3/meshes/rho": a.transpose(2, 1, 0)}],
                                    attributes=openpmd_attributes("/data/3/meshes", labels=("x", "y", "z"))), a,
                           {"var": "rho"}),
        "sparse.bp": (write_bp(tmp_path / "sparse.bp", [{"U": [((0, 0, 0), a[:4])]}], shapes={"U": a.shape}),
                      np.concatenate([a[:4], np.full_like(a[4:], np.nan)]), {"nonfinite": "outside"}),
    }
    spec = {name: {"path": str(path), **kw} for name, (path, _, kw) in cases.items()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = launch([sys.executable, WORKER, "spec.json"], ranks=2, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for name, (_, want, _) in cases.items():
        for rank in (0, 1):
            got = np.load(tmp_path / f"{name}.{rank}.npy")
            np.testing.assert_array_equal(got, cut_block(want, rank, 2).data, err_msg=f"{name} rank {rank}")


@pytest.mark.mpi
def test_a_step_without_the_variable_is_skipped_on_two_ranks_too(tmp_path):
    path = write_bp(tmp_path / "s.bp", [{"U": sphere_field(12), "step": 0}, {"W": sphere_field(12), "step": 1}])
    r = insitu("replay", path, "--var", "U", "--iso", "3", *TINY, "--out", "out", cwd=tmp_path, ranks=2, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "done: 1 step(s) trained, 1 skipped (step 1: no variable 'U' at step 1" in r.stdout
    rows = {row["step"]: row["status"] for row in read_csv(tmp_path / "out" / "metrics.csv")}
    assert rows == {"0": "trained", "1": "skipped"}


def test_insitu_run_takes_spacing_from_its_flag_and_refuses_the_bp_key(tmp_path):
    np.save(tmp_path / "ball.npy", sphere_field(12))
    r = insitu("run", tmp_path / "ball.npy", "--iso", "3", *TINY, "--set", "input.spacing=[1, 2, 3]", "--out", "out",
               cwd=tmp_path)
    assert "input.spacing=[1.0, 2.0, 3.0]: sets the spacing of a BP file or SST stream" in one_error(r)
    assert "insitu run takes --spacing DX DY DZ" in r.stderr and not (tmp_path / "out").exists()
