"""Point-wise functions for a cell's step.

A cell's ``step`` is written once with these functions and Python's arithmetic operators. rnncc
calls it with TVM ``PrimExpr`` values (one element of each gate; the fused kernel and the
persistent kernel) and with staged tensors (one kernel per operation; the unfused baseline), so
a step must use these functions rather than ``tvm.tirx`` or NumPy ones directly.
"""

from __future__ import annotations

import contextlib

#: Implementations a schedule puts in place of TVM's for the expressions it builds (see
#: :func:`lowered_with`): name -> f(PrimExpr) -> PrimExpr, or None to keep TVM's.
_OVERRIDES: dict = {}


@contextlib.contextmanager
def lowered_with(functions: dict):
    """Within the block, a step called with PrimExprs builds the point-wise functions named in
    ``functions`` with those (e.g. a GPU's fast exponential); each may return None for an
    argument it does not take (then TVM's form is used)."""
    unknown = sorted(set(functions) - set(UNARY))
    if unknown:
        raise KeyError(f"no point-wise functions {unknown}; there are {UNARY}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(functions)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def dtype_of(x) -> str:
    """The dtype of a PrimExpr, as a string."""
    return str(x.dtype if hasattr(x, "dtype") else x.ty.dtype)


def _prim(name: str, x):
    from tvm import tirx

    override = _OVERRIDES.get(name)
    found = override(x) if override is not None else None
    if found is not None:
        return found
    if name == "sigmoid":
        return tirx.sigmoid(x)
    if name == "tanh":
        return tirx.tanh(x)
    if name == "exp":
        return tirx.exp(x)
    if name == "relu":
        return tirx.max(x, tirx.const(0, dtype_of(x)))
    raise KeyError(name)


#: The names of the point-wise functions a step can use.
UNARY = ("sigmoid", "tanh", "exp", "relu")


def apply_unary(name: str, x):
    """Apply the unary function ``name`` to a PrimExpr, or to anything that stages it."""
    staged = getattr(x, "__rnncc_unary__", None)
    if staged is not None:
        return staged(name)
    return _prim(name, x)


def sigmoid(x):
    """1 / (1 + exp(-x))."""
    return apply_unary("sigmoid", x)


def tanh(x):
    """Hyperbolic tangent."""
    return apply_unary("tanh", x)


def exp(x):
    """e ** x."""
    return apply_unary("exp", x)


def relu(x):
    """max(x, 0)."""
    return apply_unary("relu", x)
