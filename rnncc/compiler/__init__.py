"""The compiler driver: a cell and its sizes to a module file (see :func:`compile_module`), and
a whole network's modules (see :func:`compile_network`)."""

from .driver import compile_module, resolve_cell
from .network import compile_network

__all__ = ["compile_module", "compile_network", "resolve_cell"]
