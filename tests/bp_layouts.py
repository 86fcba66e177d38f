"""BP files in the layouts that real writers produce, written with the PyPI adios2 library itself
(its Python API, and its C API through ctypes for column-major arrays): the tests' inputs.

Each writer takes ``steps``, a list of dicts ``name -> value`` (one dict per ADIOS step), where a
value is a scalar (a single value), a numpy array (one global block, or a local array with
``local=...``), or a list of ``(start, block)`` pairs (several writer blocks of one global array
whose shape is ``shapes[name]``).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import adios2
import numpy as np


def write_bp(path: Path, steps: list[dict[str, Any]], *, engine: str = "BP5", attributes: dict | None = None,
             shapes: dict[str, tuple] | None = None, local: tuple[str, ...] = ()) -> Path:
    """A BP file with these ``steps`` (see the module docstring); ``attributes``: name -> value
    (:func:`attribute_value`), written once; ``local``: names written as local arrays."""
    ad = adios2.Adios()
    io = ad.declare_io("writer")
    io.set_engine(engine)
    with adios2.Stream(io, str(path), "w") as s:
        for name, value in (attributes or {}).items():
            s.write_attribute(name, attribute_value(value))
        for step in steps:
            s.begin_step()
            for name, value in step.items():
                if isinstance(value, list):
                    for start, block in value:
                        s.write(name, np.ascontiguousarray(block), list(shapes[name]), list(start), list(block.shape))
                elif isinstance(value, np.ndarray) and value.ndim:
                    shape = [] if name in local else list(value.shape)
                    start = [] if name in local else [0] * value.ndim
                    s.write(name, np.ascontiguousarray(value), shape, start, list(value.shape))
                else:
                    s.write(name, value)
            s.end_step()
    return path


def attribute_value(value: Any) -> Any:
    """An attribute's value as adios2 takes it: strings and lists of strings as they are, numpy arrays
    in their type, other numbers as float64 arrays."""
    if isinstance(value, (str, np.ndarray)) or (isinstance(value, list) and value and isinstance(value[0], str)):
        return value
    return np.atleast_1d(np.asarray(value, dtype=np.float64))


def write_column_major(path: Path, array_xyz: np.ndarray, name: str = "U", engine: str = "BP5") -> Path:
    """One step of a column-major (Fortran-ordered) writer: ``array_xyz[i, j, k]`` at x=i, y=j, z=k,
    written through ADIOS2's C API with column-major array ordering, as a Fortran code does."""
    lib = ctypes.CDLL(str(Path(adios2.__file__).parent / "libadios2_c.so"))
    p, size_t3 = ctypes.c_void_p, ctypes.c_size_t * 3
    lib.adios2_init_serial.restype = p
    lib.adios2_declare_io_order.restype = p
    lib.adios2_declare_io_order.argtypes = [p, ctypes.c_char_p, ctypes.c_int]
    lib.adios2_set_engine.argtypes = [p, ctypes.c_char_p]
    lib.adios2_define_variable.restype = p
    lib.adios2_define_variable.argtypes = [p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t, size_t3, size_t3,
                                           size_t3, ctypes.c_int]
    lib.adios2_open.restype = p
    lib.adios2_open.argtypes = [p, ctypes.c_char_p, ctypes.c_int]
    lib.adios2_begin_step.argtypes = [p, ctypes.c_int, ctypes.c_float, ctypes.POINTER(ctypes.c_int)]
    lib.adios2_put.argtypes = [p, p, p, ctypes.c_int]
    for f in ("adios2_end_step", "adios2_close", "adios2_finalize"):
        getattr(lib, f).argtypes = [p]
    data = np.asfortranarray(array_xyz, dtype=np.float64)
    adios = lib.adios2_init_serial()
    io = lib.adios2_declare_io_order(adios, b"writer", 1)            # adios2_arrayordering_columnmajor
    lib.adios2_set_engine(io, engine.encode())
    shape = size_t3(*data.shape)
    var = lib.adios2_define_variable(io, name.encode(), 2, 3, shape, size_t3(0, 0, 0), size_t3(*data.shape), 1)
    engine_ = lib.adios2_open(io, str(path).encode(), 1)            # adios2_mode_write
    status = ctypes.c_int()
    assert lib.adios2_begin_step(engine_, 0, -1.0, ctypes.byref(status)) == 0
    assert lib.adios2_put(engine_, var, data.ctypes.data, 5) == 0    # adios2_mode_sync
    assert lib.adios2_end_step(engine_) == 0
    assert lib.adios2_close(engine_) == 0
    lib.adios2_finalize(adios)
    return path


def full_range(dtype) -> np.ndarray:
    """A [6, 7, 8] field of ``dtype`` that holds its type's lowest and highest values (integers),
    or a wide spread of magnitudes (floats), and a ball-shaped surface in the middle."""
    dtype = np.dtype(dtype)
    z, y, x = np.mgrid[0:6, 0:7, 0:8]
    r = np.sqrt((x - 3.5) ** 2 + (y - 3) ** 2 + (z - 2.5) ** 2) / 6.0          # 0 .. ~0.9
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = float(info.min) / 2, float(info.max) / 2                   # halves: exact as floats
        out = (lo + (1.0 - r) * (hi - lo)).round().astype(dtype)
        out.flat[0], out.flat[1] = info.min, info.max
        return out
    out = ((1.0 - r) * 1e3).astype(dtype)
    out.flat[0], out.flat[1] = np.finfo(dtype).tiny, -1e30 if dtype.itemsize == 4 else -1e300
    return out
