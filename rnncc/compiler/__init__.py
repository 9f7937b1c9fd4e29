"""The compiler driver: a cell and its sizes to a module file (see :func:`compile_module`)."""

from .driver import compile_module, resolve_cell

__all__ = ["compile_module", "resolve_cell"]
