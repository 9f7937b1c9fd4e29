"""Cell types: the registry, the built-in cells and loading a user's cell file.

Every module in this package whose name does not start with ``_`` (other than :mod:`ops` and
:mod:`autodiff`) is a cell file and is imported when the package is, so a new built-in cell is
one new file here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

from ..errors import CellError, ConfigError
from . import ops
from ._base import Cell, check, register, registry, unregister

__all__ = ["Cell", "ops", "check", "register", "unregister", "registry", "get", "names",
           "load_file"]


def _import_builtins() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name in ("ops", "autodiff"):
            continue
        importlib.import_module(f"{__name__}.{info.name}")


def names() -> list[str]:
    """Names of the registered cells, built-in first."""
    return list(registry())


def get(name_or_cell) -> Cell:
    """The registered cell of that name (a Cell passes through)."""
    if isinstance(name_or_cell, Cell):
        return name_or_cell
    cells = registry()
    if name_or_cell not in cells:
        raise ConfigError(
            f"unknown cell {name_or_cell!r}; registered cells: {', '.join(cells)} "
            "(or give the path of a cell file)"
        )
    return cells[name_or_cell]


def load_file(path: str) -> list[Cell]:
    """Run a cell file (which calls :func:`register`) and return the cells it registered."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"cell file {path!r} does not exist")
    stem = os.path.splitext(os.path.basename(path))[0]
    mod_name = f"rnncc_user_cell_{stem}_{abs(hash(path)) % 10**8}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import cell file {path!r}: not a Python file")
    before = registry()
    for name, cell in before.items():  # loading the same file again replaces its cells
        if cell.source == path:
            unregister(name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except CellError:
        raise
    except Exception as err:
        raise CellError(
            f"cell file {path!r} failed to import: {type(err).__name__}: {err}") from err
    added = [c for n, c in registry().items() if before.get(n) is not c]
    if not added:
        raise CellError(
            f"cell file {path!r} registered no cell; it must call rnncc.cells.register(Cell(...))"
        )
    for cell in added:
        object.__setattr__(cell, "source", path)
    return added


_import_builtins()
