"""The cell contract and the registry of cells.

A cell is the element-wise part of one time step, after the two projections. With G gates, H
hidden units and batch N, rnncc computes for every step t

    gi = x_t @ W_ih.T + b_ih        [N, G*H]   (for all T steps at once, one GEMM)
    gh = h_{t-1} @ W_hh.T + b_hh    [N, G*H]   (one GEMM over all gates per step)

and hands the cell, for one element (n, j), the G values gi[n, g*H + j] and gh[n, g*H + j] and
the previous states at (n, j). The cell returns the new states; the first state is h, which is
the step's output and the next step's recurrent input. Weights follow PyTorch's convention:
``weight_ih_l0`` [G*H, C], ``weight_hh_l0`` [G*H, H], ``bias_ih_l0`` and ``bias_hh_l0`` [G*H],
gates stacked in the cell's documented order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import CellError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
#: Prefixes of the weights every cell has (a parameter's weight is ``<name>_l0``).
_RESERVED = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


@dataclass(frozen=True)
class Cell:
    """One registered cell type.

    Attributes
    ----------
    name:
        Identifier used by the API and the command line (lower case, digits, underscores).
    gates:
        G, the number of gate blocks stacked in the weights.
    states:
        Names of the recurrent states, h first (``("h",)`` or ``("h", "c")``).
    step:
        ``step(gi, gh, state) -> new_state``: ``gi`` and ``gh`` are sequences of G scalars (the
        input and recurrent projections of each gate, biases included), ``state`` a sequence of
        the previous states; returns a tuple of the new states, in the order of ``states``.
        Written with :mod:`rnncc.cells.ops` and arithmetic operators. A cell with ``params``
        takes them too: ``step(gi, gh, state, params)``, one scalar each (the unit's).
    reference:
        The same step in NumPy, on float64 arrays of shape [N, H] (an independent check of
        ``step``, not derived from it); with ``params``, ``reference(gi, gh, state, params)``,
        each param an array [H]. A step that takes a recurrent product of one of its values
        (:func:`rnncc.cells.ops.recurrent`) has a reference that takes ``recurrent=f`` too,
        ``f(g, x)`` = x @ W_hh[g*H:(g+1)*H].T + b_hh[g*H:(g+1)*H] for x [N, H].
    params:
        Names of the cell's learned per-unit parameters beyond W_ih, W_hh and the biases, each
        a vector [H] (peephole weights, say); a module takes them as ``<name>_l0`` weights.
    initial:
        Initial values of parameters in ``rnncc.nn`` modules, name to number (a gain's 1.0);
        the others start uniform in [-1/sqrt(H), 1/sqrt(H)] as the weights do.
    torch:
        ``(class name, kwargs)`` of the equivalent ``torch.nn`` module, e.g. ``("LSTM", {})``,
        or None. Used by the parity tests and by ``rnncc bench`` for the cuDNN comparison.
    doc:
        One line for ``rnncc cells``.
    """

    name: str
    gates: int
    states: tuple[str, ...]
    step: Callable
    reference: Callable
    torch: tuple[str, dict] | None = None
    doc: str = ""
    params: tuple[str, ...] = ()
    initial: dict = field(default_factory=dict, compare=False)
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise CellError(
                f"cell name {self.name!r} is not allowed: use lower case letters, digits and _"
            )
        if not isinstance(self.gates, int) or self.gates < 1:
            raise CellError(f"cell {self.name!r}: gates must be a positive int, got {self.gates!r}")
        if not self.states or self.states[0] != "h":
            raise CellError(
                f"cell {self.name!r}: states must start with 'h', got {tuple(self.states)!r}"
            )
        if len(set(self.states)) != len(self.states):
            raise CellError(f"cell {self.name!r}: state names repeat: {tuple(self.states)!r}")
        if not callable(self.step) or not callable(self.reference):
            raise CellError(f"cell {self.name!r}: step and reference must be callables")
        params = tuple(self.params)
        bad = [p for p in params if not isinstance(p, str) or not _NAME.match(p)
               or p.startswith(_RESERVED)]
        if bad or len(set(params)) != len(params):
            raise CellError(
                f"cell {self.name!r}: params must be distinct names of lower case letters, "
                f"digits and _, not starting with {' or '.join(_RESERVED)}; got {params!r}")
        object.__setattr__(self, "params", params)
        unknown = sorted(set(self.initial) - set(params))
        if unknown or not all(isinstance(v, (int, float)) for v in self.initial.values()):
            raise CellError(f"cell {self.name!r}: initial takes numbers for its params "
                            f"{params}; got {dict(self.initial)!r}")

    def evaluate(self, gi: Sequence, gh: Sequence, state: Sequence,
                 params: Sequence = ()) -> tuple:
        """Call ``step`` (with the unit's ``params`` where the cell has them) and check that it
        returned one value per state."""
        if len(params) != len(self.params):
            raise CellError(f"cell {self.name!r}: {len(params)} parameter values for its "
                            f"params {self.params}")
        args = (list(gi), list(gh), list(state)) + ((list(params),) if self.params else ())
        out = self.step(*args)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        if len(out) != len(self.states):
            raise CellError(
                f"cell {self.name!r}: step returned {len(out)} values, expected one per state "
                f"{self.states}"
            )
        return tuple(out)

    def reference_step(self, gi: Sequence, gh: Sequence, state: Sequence,
                       params: Sequence = (), recurrent: Callable | None = None) -> tuple:
        """Call ``reference`` (with ``params``, arrays [H], where the cell has them; with
        ``recurrent=``, where the step takes recurrent products of its values)."""
        args = (gi, gh, state) + ((params,) if self.params else ())
        return self.reference(*args, **({"recurrent": recurrent} if recurrent else {}))


_REGISTRY: dict[str, Cell] = {}


def register(cell: Cell, *, replace: bool = False) -> Cell:
    """Add ``cell`` to the registry (API, command line and test suite) and return it."""
    if not isinstance(cell, Cell):
        raise CellError(f"register() takes an rnncc Cell, got {type(cell).__name__}")
    old = _REGISTRY.get(cell.name)
    if old is not None and old is not cell and not replace:
        raise CellError(
            f"a cell named {cell.name!r} is already registered"
            + (f" (from {old.source})" if old.source else "")
            + "; pick another name or pass replace=True"
        )
    check(cell)
    _REGISTRY[cell.name] = cell
    return cell


def check(cell: Cell) -> None:
    """A parameter the step never uses, or a recurrent product it cannot take, is a mistake in
    the cell file: say which (:func:`register` checks; so does a compile of a cell that is
    not registered)."""
    from .autodiff import check_products, trace, uses

    graph = trace(cell)
    check_products(graph)
    first = 2 * cell.gates + len(cell.states)
    unused = [p for p, node in zip(cell.params, graph.inputs[first:]) if not uses(graph, node)]
    if unused:
        raise CellError(f"cell {cell.name!r} declares parameter(s) {', '.join(unused)} that "
                        "its step never uses")


def unregister(name: str) -> None:
    """Remove a cell from the registry (no error if it is absent)."""
    _REGISTRY.pop(name, None)


def registry() -> dict[str, Cell]:
    """A copy of the registry, name to cell, in registration order."""
    return dict(_REGISTRY)
