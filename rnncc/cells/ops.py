"""Point-wise functions for a cell's step.

A cell's ``step`` is written once with these functions and Python's arithmetic operators. rnncc
calls it with TVM ``PrimExpr`` values (one element of each gate; the fused kernel and the
persistent kernel) and with staged tensors (one kernel per operation; the unfused baseline), so
a step must use these functions rather than ``tvm.tirx`` or NumPy ones directly.

Besides point-wise functions a step may reduce over the hidden units of its batch row
(:func:`mean`, and :func:`layer_norm` built on it) and take a gate's recurrent product of one of
its values instead of h (:func:`recurrent`): the lowering computes the reduced value for every
unit of the row first, as a stage of its own (:func:`reducing_with`).
"""

from __future__ import annotations

import contextlib

from ..errors import CellError

#: How the lowering that calls a step with PrimExprs computes :func:`mean`, innermost last
#: (see :func:`reducing_with`).
_MEANS: list = []

#: How it computes :func:`recurrent` (and the derivative's :func:`transposed_product`), or None
#: where it does not, innermost last: ``f(gate, x)``, the product the lowering computed for
#: that gate (a GEMM of x's values, the caller's).
_PRODUCTS: list = []

#: While :func:`layer_norm` takes its variance: (the mean, as :func:`mean` returned it, that
#: the variance centres on, how many values a unit it normalises), innermost last
#: (:func:`variance_of`).
_VARIANCES: list = []

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


@contextlib.contextmanager
def reducing_with(mean, product=None):
    """Within the block, :func:`mean` of a PrimExpr is ``mean(x)``: the lowering's row mean of
    the element's expression x (a value the same for every unit of the row); :func:`recurrent`
    and :func:`transposed_product` are ``product(gate, x)`` (None: this lowering takes no
    products; each lowering computes either, never both, so one function serves)."""
    _MEANS.append(mean)
    _PRODUCTS.append(product)
    try:
        yield
    finally:
        _MEANS.pop()
        _PRODUCTS.pop()


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
    if name == "rsqrt":
        return tirx.rsqrt(x)
    raise KeyError(name)


#: The names of the point-wise functions a step can use.
UNARY = ("sigmoid", "tanh", "exp", "relu", "rsqrt")


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


def rsqrt(x):
    """1 / sqrt(x)."""
    return apply_unary("rsqrt", x)


def mean(x):
    """The mean of x over the H hidden units of the batch row, within the step: one value for
    every unit of the row. A reduction: the cell then runs where its lowering reduces (the
    non-persistent schedules, forward and training; the persistent kernel in inference, a
    round of the step a mean), not in the persistent backward kernel."""
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, (list, tuple)):
        raise CellError(f"rnncc.cells.ops.mean takes one value of the step (it averages over "
                        f"the hidden units), got a {type(x).__name__} of {len(x)}; for several "
                        "values together average them first, or use ops.layer_norm")
    staged = getattr(x, "__rnncc_mean__", None)
    if staged is not None:
        return staged()
    if not _MEANS or _MEANS[-1] is None:
        raise CellError("rnncc.cells.ops.mean: this lowering of the step does not reduce over "
                        "the hidden units (the persistent backward kernel does not)")
    return _MEANS[-1](x)


def recurrent(gate: int, x):
    """Gate ``gate``'s recurrent product of ``x`` in place of h: ``gh[gate]`` with x for h,
    W_hh's rows of the gate times x over the H units of the batch row, plus b_hh's (the GRU
    that resets before its product takes ``recurrent(2, r * h)``). A step that takes it does
    not use ``gh[gate]``, and takes one such product a gate. Like :func:`mean` a reduction
    over the row, where its lowering takes it (the non-persistent schedules; the persistent
    kernel in inference, one such product a step)."""
    if isinstance(gate, bool) or not isinstance(gate, int):
        raise CellError(f"rnncc.cells.ops.recurrent(gate, x): gate is the gate's index, an "
                        f"int; got {gate!r}")
    if isinstance(x, (int, float, list, tuple)):
        raise CellError(f"rnncc.cells.ops.recurrent(gate, x) takes one value of the step for x "
                        f"(it multiplies the row's H values by W_hh), got {x!r}")
    return _product(gate, x)


def transposed_product(gate: int, x):
    """For a step's derivative (not for cells): x over the row's units times W_hh's rows of
    ``gate``, transposed (no bias): the gradient of :func:`recurrent`'s argument from that of
    its value."""
    return _product(gate, x)


def _product(gate, x):
    if not _PRODUCTS or _PRODUCTS[-1] is None:
        raise CellError("rnncc.cells.ops.recurrent: this lowering of the step takes no recurrent "
                        "products of its values (the persistent backward kernel does not)")
    return _PRODUCTS[-1](gate, x)


def layer_norm(values, eps: float = 1e-5):
    """``values`` (a list of a step's values, one a gate say) less their mean, over their
    standard deviation: normalised together over the len(values) * H values of the batch row,
    as ``torch.nn.functional.layer_norm`` without gain and bias (biased variance, ``eps``
    added to it). Returns the list normalised."""
    if not isinstance(values, (list, tuple)) or not values:
        raise CellError("rnncc.cells.ops.layer_norm takes a non-empty list of a step's values "
                        f"(normalised together), got {values!r}")
    values = list(values)
    k = float(len(values))
    mu = mean(sum(values[1:], start=values[0]) / k)
    centred = [v - mu for v in values]
    squares = [v * v for v in centred]
    _VARIANCES.append((mu, len(values)))
    try:
        variance = mean(sum(squares[1:], start=squares[0]) / k)
    finally:
        _VARIANCES.pop()
    scale = rsqrt(variance + eps)
    return [v * scale for v in centred]


def variance_of():
    """Within :func:`layer_norm`'s :func:`mean` of its squares, (the mean its values are
    centred on, what :func:`mean` returned for it; how many values a unit): a lowering may
    compute that variance from the same values as the mean (the persistent kernel: in the same
    round); else None."""
    return _VARIANCES[-1] if _VARIANCES else None
