"""What ADIOS2 writers say about a field besides its samples: its step number, time and geometry.

Writers record these in different ways; each is read by the first of these that the step holds
(docs/input.md, "Where origin, spacing, step and time come from"):

- step number: ``input.step_var`` (a variable or attribute); a single-value variable ``step`` or
  ``Step``; the openPMD iteration (the ``/data/<N>/`` of the field's path, or variable-based
  encoding's attribute ``/data/snapshot``); else the ADIOS step index.
- time: ``input.time_var``; a single-value variable ``time`` or ``Time``; the openPMD iteration's
  ``time`` attribute; else the step number.
- origin and spacing, each (world x, y, z): ``input.origin`` / ``input.spacing``; Fides'
  ``Fides_Origin`` / ``Fides_Spacing``; the openPMD mesh's ``gridGlobalOffset`` (plus ``position``
  cells) / ``gridSpacing``, in the order its ``axisLabels`` and ``dataOrder`` give, in the file's
  length unit (``gridUnitSI`` metres); attributes ``origin`` / ``spacing``; the ``Origin`` /
  ``Spacing`` of a ``vtk.xml`` ImageData attribute; else index units (origin 0, spacing 1).

Everything here works on a :class:`StepMeta` (the names a step holds and readers of their values),
so that the reader and the metadata probe (:func:`insitu.input.bpfile.probe_bp`, in a child process)
number steps by the same rules.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from insitu.errors import SourceInputError
from insitu.volume import check_geometry

STEP_NAMES = ("step", "Step")
TIME_NAMES = ("time", "Time")


@dataclass
class StepMeta:
    """What one ADIOS step holds: ``variables`` (name -> ADIOS2's info: Type, Shape, SingleValue),
    ``attributes`` (name -> info: Type, Value), and readers of a single value and of an attribute."""

    variables: dict[str, dict]
    attributes: dict[str, dict]
    read_value: Callable[[str], Any]
    read_attribute: Callable[[str], Any]
    _cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, stream) -> "StepMeta":
        """The current step of an ``adios2.Stream``."""
        attributes = stream.available_attributes()
        return cls(stream.available_variables(), attributes, stream.read,
                   lambda name: _attribute(stream, name, attributes[name]))

    def attr(self, name: str) -> Any:
        """Attribute ``name``'s value (strings as str or list of str, numbers as a float64 array), or None."""
        if name not in self.attributes:
            return None
        if name not in self._cache:
            self._cache[name] = self.read_attribute(name)
        return self._cache[name]

    def scalar(self, name: str) -> Any:
        """A single-value variable's value, or None when the step has no such variable."""
        info = self.variables.get(name)
        if info is None or info.get("SingleValue") != "true":
            return None
        return self.read_value(name)


def _attribute(stream, name: str, info: dict) -> Any:
    """An attribute's value (``info``: ADIOS2's Type, Elements, Value of it): str or list of str for
    strings, else a float64 array. ADIOS2's Python reader cannot return some types (long double):
    those are parsed from its printed value."""
    if info.get("Type") == "string":
        value = stream.read_attribute_string(name)
        return value[0] if isinstance(value, list) and len(value) == 1 and info.get("Elements") == "1" else value
    try:
        return np.asarray(stream.read_attribute(name), dtype=np.float64).ravel()
    except (ValueError, TypeError):
        numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", str(info.get("Value", "")))
        return np.array([float(x) for x in numbers])


# ---- the field's variable ----------------------------------------------------------------------


def openpmd(meta: StepMeta) -> bool:
    """Whether the step is part of an openPMD series (its root attribute ``/openPMD``)."""
    return meta.attr("/openPMD") is not None


def _iteration_pattern(meta: StepMeta) -> str:
    """openPMD's base path as a regular expression, the iteration (``%T``) as group 1, which may be
    absent: variable-based encoding keeps ``/data/%T/`` as base path but writes ``/data/meshes/...``."""
    base = meta.attr("/basePath") or "/data/%T/"
    base = base if isinstance(base, str) else base[0]
    if not base.endswith("/"):
        base += "/"
    return re.escape(base).replace(re.escape("%T/"), r"(?:(\d+)/)?").replace(re.escape("%T"), r"(\d+)?")


def field_variable(meta: StepMeta, var: str) -> str | None:
    """The name under which this step holds the field ``var``: ``var`` itself, or in an openPMD
    series the mesh record ``var`` (e.g. ``rho``, ``E/x``) of the step's iteration
    (``/data/<N>/meshes/rho``); None when the step holds neither. SourceInputError when the step
    holds the record for several iterations (one ADIOS step per iteration is needed)."""
    if var in meta.variables:
        return var
    if not openpmd(meta):
        return None
    meshes = meta.attr("/meshesPath") or "meshes/"
    meshes = meshes if isinstance(meshes, str) else meshes[0]
    pattern = re.compile(_iteration_pattern(meta) + re.escape(meshes.rstrip("/") + "/" + var.lstrip("/")))
    found = sorted(name for name in meta.variables if pattern.fullmatch(name))
    if len(found) > 1:
        raise SourceInputError(f"mesh record {var!r}: this ADIOS step holds it for several openPMD iterations "
                               f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}); expected one "
                               f"iteration per step (give --var with the full name of one of them)")
    return found[0] if found else None


def openpmd_iteration(meta: StepMeta, name: str) -> int | None:
    """The openPMD iteration of the step that holds variable ``name``: from its path, else from
    variable-based encoding's ``snapshot`` attribute; None outside openPMD."""
    if not openpmd(meta):
        return None
    m = re.match(_iteration_pattern(meta), name)
    if m and m.groups() and m.group(1) is not None:
        return int(m.group(1))
    snapshot = meta.attr(_iteration_prefix(meta, name) + "snapshot")
    if snapshot is not None and len(snapshot) == 1:
        return int(snapshot[0])
    return None


def _iteration_prefix(meta: StepMeta, name: str) -> str:
    """The path of the openPMD iteration that holds ``name`` (``/data/100/``; variable-based: ``/data/``)."""
    m = re.match(_iteration_pattern(meta), name)
    return m.group(0) if m else (meta.attr("/basePath") or "/data").rstrip("/") + "/"


# ---- step numbers and times ---------------------------------------------------------------------


def number_record(meta: StepMeta, name: str | None, step_var: str | None) -> dict:
    """What the step says about its number, as plain data (JSON, for the probe): the value of
    ``step_var`` (``["variable"|"attribute", ADIOS type, value]``, ``["missing"]``), of the first
    conventional variable present, and the openPMD iteration of the field ``name``."""
    out: dict[str, Any] = {}
    if step_var is not None:
        out["explicit"] = _named_value(meta, step_var)
    for conventional in STEP_NAMES:
        value = meta.scalar(conventional)
        if value is not None:
            out["variable"] = [conventional, meta.variables[conventional].get("Type", ""), _plain(value)]
            break
    if name is not None:
        iteration = openpmd_iteration(meta, name)
        if iteration is not None:
            out["openpmd"] = iteration
    return out


def _named_value(meta: StepMeta, name: str) -> list:
    """``[kind, ADIOS type, value]`` of a single-value variable or an attribute ``name``, or ``["missing"]``."""
    value = meta.scalar(name)
    if value is not None:
        return ["variable", meta.variables[name].get("Type", ""), _plain(value)]
    value = meta.attr(name)
    if value is not None:
        return ["attribute", meta.attributes[name].get("Type", ""), _plain(value)]
    if name in meta.variables:
        return ["array", meta.variables[name].get("Type", ""), None]
    return ["missing"]


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    value = np.asarray(value)
    return value.item() if value.size == 1 else value.tolist()


def step_number(record: dict, index: int, where: str, step_var: str | None = None) -> tuple[int, str]:
    """(step number, what gave it) from a :func:`number_record` of ADIOS step ``index``.
    SourceInputError unless the number is an integer >= 0; ``where`` names the file."""
    if step_var is not None:
        kind, *rest = record.get("explicit", ["missing"])
        if kind == "missing":
            raise SourceInputError(f"{where}: input.step_var={step_var!r}: no variable or attribute of that name at "
                                   f"ADIOS step index {index}")
        if kind == "array":
            raise SourceInputError(f"{where}: input.step_var={step_var!r} is an array at ADIOS step index {index}; "
                                   "expected a single value")
        return _integer(rest[1], rest[0], f"{where}: {kind} {step_var!r} at ADIOS step index {index}"), \
            f"{kind} {step_var!r}"
    if "variable" in record:
        name, kind, value = record["variable"]
        return _integer(value, kind, f"{where}: variable {name!r} at ADIOS step index {index}"), f"variable {name!r}"
    if "openpmd" in record:
        return int(record["openpmd"]), "the openPMD iteration"
    return int(index), "the ADIOS step index"


def _integer(value: Any, kind: str, where: str) -> int:
    """``value`` as a step number: SourceInputError unless it is one integer >= 0."""
    if kind == "string" or isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str)
                                                                                      for v in value)):
        raise SourceInputError(f"{where} is a string ({value!r}); expected an integer step number")
    v = np.asarray(value, dtype=np.float64).ravel()
    if v.size != 1 or not np.isfinite(v[0]) or v[0] != np.floor(v[0]):
        raise SourceInputError(f"{where} is {value!r}; expected an integer step number")
    if v[0] < 0:
        raise SourceInputError(f"{where} is {int(v[0])}; expected a step number >= 0 (the outputs are named by it)")
    return int(v[0])


def step_time(meta: StepMeta, name: str, number: int, where: str, time_var: str | None = None) -> float:
    """The simulation time of the step (the first of: ``time_var``, variable ``time``/``Time``, the
    openPMD iteration's ``time`` attribute, the step number)."""
    if time_var is not None:
        kind, *rest = _named_value(meta, time_var)
        if kind == "missing":
            raise SourceInputError(f"{where}: input.time_var={time_var!r}: no single-value variable or attribute of "
                                   f"that name at step {number}")
        if kind == "array":
            shape = meta.variables[time_var].get("Shape", "")
            raise SourceInputError(f"{where}: input.time_var={time_var!r} is an array"
                                   f"{f' of shape ({shape})' if shape else ''} at step {number}; expected a single "
                                   "value (the step's time): name a single-value variable or attribute")
        return _real(rest[1], f"{where}: {kind} {time_var!r} at step {number}")
    for conventional in TIME_NAMES:
        value = meta.scalar(conventional)
        if value is not None:
            return _real(_plain(value), f"{where}: variable {conventional!r} at step {number}")
    if openpmd(meta):
        value = meta.attr(_iteration_prefix(meta, name) + "time")
        if value is not None and len(value) == 1:
            return float(value[0])
    return float(number)


def _real(value: Any, where: str) -> float:
    try:
        v = np.asarray(value, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        v = np.array([])
    if v.size != 1 or not np.isfinite(v[0]):
        raise SourceInputError(f"{where} is {value!r}; expected one finite number (the step's time)")
    return float(v[0])


# ---- geometry --------------------------------------------------------------------------------------


@dataclass
class Geometry:
    """Where a field's samples lie: world (x, y, z) of sample 0 and of one cell; ``axes``: the file's
    array dimension that holds z, y and x (C order, slowest first); ``source``: where the origin and
    the spacing came from; ``unit``: the length unit, when the file states one."""

    origin: tuple[float, float, float] = (0.0, 0.0, 0.0)
    spacing: tuple[float, float, float] = (1.0, 1.0, 1.0)
    axes: tuple[int, int, int] = (0, 1, 2)
    source: dict[str, str] = field(default_factory=dict)
    unit: str | None = None

    @property
    def index_units(self) -> list[str]:
        """The quantities that no convention gave (left at origin 0, spacing 1)."""
        return [k for k in ("origin", "spacing") if k not in self.source]


def geometry(meta: StepMeta, name: str, where: str, origin: Sequence[float] | None = None,
             spacing: Sequence[float] | None = None, shape: Sequence[int] | None = None) -> Geometry:
    """The geometry of variable ``name`` in this step: ``origin`` / ``spacing`` (from the configuration)
    when given, else from the conventions in the module docstring. SourceInputError when the file's
    attributes say something unusable (not 3 values, a mesh that is not Cartesian) or what float32
    coordinates cannot hold (:func:`insitu.volume.check_geometry`, over the whole grid with ``shape``:
    the variable's, in the file's dimension order)."""
    g = Geometry()
    mesh = _openpmd_mesh(meta, name, where)
    if mesh is not None:
        g.axes, g.unit = mesh["axes"], mesh.get("unit")
    found = {"origin": [], "spacing": []}
    if origin is not None:
        found["origin"].append((_xyz(origin, "input.origin"), "input.origin"))
    if spacing is not None:
        found["spacing"].append((_xyz(spacing, "input.spacing"), "input.spacing"))
    for key, attr in (("origin", "Fides_Origin"), ("spacing", "Fides_Spacing")):
        if meta.attr(attr) is not None:
            found[key].append((_xyz(meta.attr(attr), f"{where}: attribute {attr}"), f"attribute {attr}"))
    if mesh is not None:
        for key in ("origin", "spacing"):
            if key in mesh:
                found[key].append((mesh[key], f"the openPMD mesh {mesh['path']}"))
    for key in ("origin", "spacing"):
        if meta.attr(key) is not None:
            found[key].append((_xyz(meta.attr(key), f"{where}: attribute {key}"), f"attribute {key}"))
    for key, value in _vtk_image(meta, where).items():
        found[key].append((value, "the vtk.xml attribute"))
    if found["origin"]:
        g.origin, g.source["origin"] = found["origin"][0]
    if found["spacing"]:
        g.spacing, g.source["spacing"] = found["spacing"][0]
    names = tuple(_named(key, g.source.get(key)) for key in ("origin", "spacing"))
    xyz = None if shape is None else tuple(int(shape[a]) for a in g.axes)[::-1]
    check_geometry(g.origin, g.spacing, xyz, names=names, where=where, error=SourceInputError)
    return g


def _named(key: str, source: str | None) -> str:
    """How a message names the origin or spacing that ``source`` gave (``Geometry.source``)."""
    if source is None:
        return f"{key} (index units)"
    return source if source.startswith(("attribute ", "input.")) else f"{key} (from {source})"


def _xyz(value: Any, where: str) -> tuple[float, float, float]:
    try:
        v = tuple(float(x) for x in np.asarray(value, dtype=np.float64).ravel())
    except (TypeError, ValueError):
        v = ()
    if len(v) != 3 or not all(np.isfinite(v)):
        shown = _plain(value) if not isinstance(value, (str, list)) else value
        raise SourceInputError(f"{where}: expected 3 values (x, y, z), all finite, got {shown!r}")
    return v  # type: ignore[return-value]


def _openpmd_mesh(meta: StepMeta, name: str, where: str) -> dict | None:
    """An openPMD mesh record's geometry for variable ``name`` (a scalar mesh or a component of one):
    ``axes``, and ``origin``/``spacing`` (x, y, z) when its attributes give them, ``unit``, ``path``."""
    if not openpmd(meta):
        return None
    path = next((p for p in (name, name.rsplit("/", 1)[0]) if meta.attr(p + "/gridSpacing") is not None), None)
    if path is None:
        return None
    geometry_kind = meta.attr(path + "/geometry") or "cartesian"
    if geometry_kind != "cartesian":
        raise SourceInputError(f"{where}: the openPMD mesh {path} has geometry {geometry_kind!r}; insitu reads "
                               "Cartesian meshes")
    order = meta.attr(path + "/dataOrder") or "C"
    labels = meta.attr(path + "/axisLabels")
    labels = [labels] if isinstance(labels, str) else list(labels or ["z", "y", "x"])
    flip = (lambda v: list(v)[::-1]) if order == "F" else list        # F: attributes listed fastest first
    labels = [str(x).lower() for x in flip(labels)]
    # labels that do not name x, y and z (none, or empty as some streams write them): the array's own order
    axes = tuple(labels.index(a) for a in ("z", "y", "x")) if sorted(labels) == ["x", "y", "z"] else (0, 1, 2)
    out: dict[str, Any] = {"axes": axes, "path": path}
    spacing = meta.attr(path + "/gridSpacing")
    offset = meta.attr(path + "/gridGlobalOffset")
    position = meta.attr(name + "/position")
    if len(spacing) != 3 or (offset is not None and len(offset) != 3):
        raise SourceInputError(f"{where}: the openPMD mesh {path}: gridSpacing {list(spacing)} and gridGlobalOffset "
                               f"{None if offset is None else list(offset)}: expected 3 values each")
    spacing = np.asarray(flip(spacing), dtype=np.float64)
    offset = np.zeros(3) if offset is None else np.asarray(flip(offset), dtype=np.float64)
    position = np.zeros(3) if position is None or len(position) != 3 else np.asarray(flip(position), np.float64)
    lo = offset + position * spacing                                  # per file axis
    out["spacing"] = tuple(float(spacing[axes[i]]) for i in (2, 1, 0))
    out["origin"] = tuple(float(lo[axes[i]]) for i in (2, 1, 0))
    unit = meta.attr(path + "/gridUnitSI")
    if unit is not None and len(unit):
        if np.ptp(unit) > 0:
            raise SourceInputError(f"{where}: the openPMD mesh {path} has gridUnitSI {list(unit)}: different units "
                                   "per axis; give input.origin and input.spacing in one unit")
        out["unit"] = f"{float(unit[0]):g} m (gridUnitSI)"
    return out


def _vtk_image(meta: StepMeta, where: str) -> dict[str, tuple[float, float, float]]:
    """``Origin`` and ``Spacing`` (x, y, z) of the ImageData in a ``vtk.xml`` attribute (ADIOS2's VTX
    schema), those it gives."""
    text = meta.attr("vtk.xml")
    if not isinstance(text, str):
        return {}
    try:
        image = ElementTree.fromstring(text.strip()).find("ImageData")
    except ElementTree.ParseError:
        return {}
    out = {}
    for key, attr in (("origin", "Origin"), ("spacing", "Spacing")):
        if image is not None and image.get(attr) is not None:
            out[key] = _xyz(image.get(attr).split(), f"{where}: attribute vtk.xml, ImageData {attr}")
    return out
