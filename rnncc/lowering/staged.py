"""Evaluate a cell's step one operation a stage: the unfused point-wise baseline.

Calling ``cell.step`` with :class:`Staged` values instead of scalars turns every arithmetic
operation and every :mod:`rnncc.cells.ops` function into its own ``te.compute`` over [N, H],
each of which becomes its own kernel: the point-wise work as a framework without fusion runs it.
"""

from __future__ import annotations

from tvm import te, tirx

from ..cells.ops import _prim


class Staged:
    """A [N, H] TE tensor that stages each operation applied to it."""

    def __init__(self, tensor: te.Tensor):
        self.tensor = tensor

    def _at(self, n, j):
        return self.tensor[n, j]

    def _stage(self, fn, name: str) -> Staged:
        return Staged(te.compute(self.tensor.shape, fn, name=name))

    def _binary(self, other, op, name: str, reflected: bool = False) -> Staged:
        if isinstance(other, Staged):
            other_at = other._at
        else:
            value = tirx.const(other, self.tensor.dtype)

            def other_at(n, j):
                return value

        if reflected:
            return self._stage(lambda n, j: op(other_at(n, j), self._at(n, j)), name)
        return self._stage(lambda n, j: op(self._at(n, j), other_at(n, j)), name)

    def __add__(self, other):
        return self._binary(other, lambda a, b: a + b, "add")

    def __radd__(self, other):
        return self._binary(other, lambda a, b: a + b, "add", reflected=True)

    def __sub__(self, other):
        return self._binary(other, lambda a, b: a - b, "sub")

    def __rsub__(self, other):
        return self._binary(other, lambda a, b: a - b, "sub", reflected=True)

    def __mul__(self, other):
        return self._binary(other, lambda a, b: a * b, "mul")

    def __rmul__(self, other):
        return self._binary(other, lambda a, b: a * b, "mul", reflected=True)

    def __truediv__(self, other):
        return self._binary(other, lambda a, b: a / b, "div")

    def __rtruediv__(self, other):
        return self._binary(other, lambda a, b: a / b, "div", reflected=True)

    def __neg__(self):
        return self._stage(lambda n, j: -self._at(n, j), "neg")

    def __rnncc_unary__(self, name: str) -> Staged:
        return self._stage(lambda n, j: _prim(name, self._at(n, j)), name)

    def __rnncc_mean__(self) -> Staged:
        rows, units = self.tensor.shape
        k = te.reduce_axis((0, units), name="k")
        total = te.compute((rows,), lambda n: te.sum(self.tensor[n, k], axis=k), name="row_sum")
        scale = tirx.const(1.0 / int(units), self.tensor.dtype)
        return self._stage(lambda n, j: total[n] * scale, "mean")
