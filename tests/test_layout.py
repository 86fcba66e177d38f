"""The package's folders are the stages of the data flow, and imports run one way: from a stage to an earlier one.

Every module is parsed (no import runs): each ``import`` and ``from ... import``, function-level ones included,
relative ones resolved, is checked against the stage numbers below. A module may import its own stage or an
earlier one, never a later one; a new module needs a stage here.
"""
import ast
from pathlib import Path

import insitu

PACKAGE = Path(insitu.__file__).resolve().parent
LAST = 10
# First name under insitu (a top-level module or a sub-package) -> its stage, in data-flow order.
STAGES = {
    "config": 0, "errors": 0, "progress": 0, "volume": 0,   # what every stage uses (config checks geometry
                                                            # with volume.check_geometry)
    "parallel": 1, "input": 2, "surface": 3, "render": 4, "groundtruth": 5, "training": 6, "step": 7,
    "output": 8, "run": 9,
    "cli": LAST, "__main__": LAST,                          # the entry points
}


def module_parts(path: Path) -> tuple[str, ...]:
    """``insitu/step/pipeline.py`` -> ("step", "pipeline"); a package's ``__init__.py`` -> the package's."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


MODULES = {module_parts(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def stage(parts: tuple[str, ...]) -> int | None:
    """The stage of a module of the package; ``insitu`` itself (``from insitu import Adaptor``) is an entry point."""
    return LAST if not parts else STAGES.get(parts[0])


def imported(tree: ast.AST, parts: tuple[str, ...], is_package: bool) -> list[tuple[int, tuple[str, ...]]]:
    """(line, module under insitu) of every import of the package's modules in ``tree``, the module ``parts``."""
    here = parts if is_package else parts[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ("insitu", *here)[:len(here) + 2 - node.level]
            else:
                base = ()
            module = base + (tuple(node.module.split(".")) if node.module else ())
            names = []
            for alias in node.names:        # ``from insitu.step import pipeline``: the module pipeline
                name = module + (alias.name,)
                names.append(name if name[0] == "insitu" and name[1:] in MODULES else module)
        else:
            continue
        found += [(node.lineno, name[1:]) for name in names if name and name[0] == "insitu"]
    return found


def dotted(parts: tuple[str, ...]) -> str:
    return ".".join(("insitu", *parts))


def backward_imports(source: str, path: Path) -> list[str]:
    parts = module_parts(path)
    own = stage(parts)
    wrong = []
    for line, target in imported(ast.parse(source), parts, path.name == "__init__.py"):
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        if target not in MODULES:
            wrong.append(f"{where} imports {dotted(target)}, which is no module of the package")
        elif stage(target) > own:
            wrong.append(f"{where} (stage {own}) imports {dotted(target)} (stage {stage(target)})")
    return wrong


def test_every_module_has_a_stage():
    assert [".".join(parts) for parts in MODULES if parts and stage(parts) is None] == []


def test_no_module_imports_a_later_stage():
    wrong = [w for path in MODULES.values() for w in backward_imports(path.read_text(), path)]
    assert wrong == [], "\n".join(wrong)


def test_every_subpackage_says_what_its_stage_does():
    packages = [p for p in MODULES.values() if p.name == "__init__.py" and p.parent != PACKAGE]
    assert {p.parent.name for p in packages} == {name for name, s in STAGES.items() if 0 < s < LAST}
    assert [p.parent.name for p in packages if not ast.get_docstring(ast.parse(p.read_text()))] == []


def test_a_backward_import_inside_a_function_is_found():
    """The check itself: a relative import in a function body, from the input stage to the step stage."""
    source = "def f():\n    from ..step.pipeline import compute_step\n    from .. import config\n"
    path = PACKAGE / "input" / "sources.py"
    assert backward_imports(source, path) == [
        "insitu/input/sources.py:2 (stage 2) imports insitu.step.pipeline (stage 7)"]
