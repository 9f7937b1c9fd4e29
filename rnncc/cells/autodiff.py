"""The derivative of a cell's step, derived from the step itself (reverse mode).

Training needs, for each element (n, j) of each step, the vector-Jacobian product of the cell's
step: given the gradients of the new states, those of the G input projections ``gi``, the G
recurrent projections ``gh`` and the previous states. rnncc derives it from the ``step`` the
cell file already has: :func:`trace` calls the step with :class:`Traced` values, which record
each arithmetic operation and each :mod:`rnncc.cells.ops` function into a small graph, and
:func:`vjp` walks that graph backwards. The graph is evaluated with PrimExprs (the backward
kernels) or with NumPy arrays (tests, against finite differences of the cell's reference).

Derivatives used: sigmoid' = s (1 - s), tanh' = 1 - t^2, exp' = e, relu' = [x > 0], rsqrt' =
-r^3 / 2, each from the function's own value, so that the forward value is computed once. A
row mean m = mean_j(x_j) (:func:`rnncc.cells.ops.mean`) is one value for the whole row, so its
adjoint sums over the row's units: dx_j = mean_j(dm_j), another row mean. A recurrent product
p = W_g x + b_g (:func:`rnncc.cells.ops.recurrent`, W_g gate g's rows of W_hh) gives dx = W_g^T
dp, a product by the transposed rows (and dW_g = dp^T x, db_g = dp, the training pass's).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CellError
from . import ops
from ._base import Cell
from .ops import UNARY, apply_unary

#: The order in which a step takes its means (a mean node's value).
_MEANS = itertools.count()


class Traced:
    """A value of a traced step: an input, a constant or one operation on others."""

    __slots__ = ("op", "args", "value", "of")

    def __init__(self, op: str, args: tuple = (), value=None, of=None):
        self.op, self.args, self.value = op, args, value
        self.of = of  # a layer norm's variance: (the mean it centres on, values a unit)

    @staticmethod
    def _of(other) -> Traced:
        if isinstance(other, Traced):
            return other
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Traced("const", value=float(other))
        raise CellError(f"a step combined a value with {type(other).__name__} {other!r}; use "
                        "numbers, the step's arguments and rnncc.cells.ops")

    def _binary(self, op, other, reflected=False):
        other = Traced._of(other)
        return Traced(op, (other, self) if reflected else (self, other))

    def __add__(self, other):
        return self._binary("add", other)

    def __radd__(self, other):
        return self._binary("add", other, True)

    def __sub__(self, other):
        return self._binary("sub", other)

    def __rsub__(self, other):
        return self._binary("sub", other, True)

    def __mul__(self, other):
        return self._binary("mul", other)

    def __rmul__(self, other):
        return self._binary("mul", other, True)

    def __truediv__(self, other):
        return self._binary("div", other)

    def __rtruediv__(self, other):
        return self._binary("div", other, True)

    def __neg__(self):
        return Traced("neg", (self,))

    def __rnncc_unary__(self, name: str) -> Traced:
        return Traced(name, (self,))

    def __rnncc_mean__(self) -> Traced:
        of = ops.variance_of()
        return Traced("mean", (self,), value=next(_MEANS),
                      of=of if of is not None and isinstance(of[0], Traced) else None)


@dataclass
class Graph:
    """A traced step: its inputs (the G values of ``gi``, the G of ``gh``, one a state, then
    one a parameter of the cell) and its outputs (one a new state)."""

    cell: Cell
    inputs: list
    outputs: list
    order: list = field(default_factory=list)  # every node, each after its arguments
    #: the step's recurrent products, in the order it takes them (value: (gate, k))
    products: list = field(default_factory=list)


def trace(cell: Cell) -> Graph:
    """The graph of ``cell``'s step."""
    g_count, s_count = cell.gates, len(cell.states)
    inputs = [Traced("input", value=i)
              for i in range(2 * g_count + s_count + len(cell.params))]
    first = 2 * g_count + s_count
    products: list = []

    def product(gate, x):
        if not isinstance(x, Traced):
            raise CellError(f"cell {cell.name!r}: ops.recurrent takes a value of the step, got "
                            f"{x!r}")
        products.append(Traced("product", (x,), value=(gate, len(products))))
        return products[-1]

    with ops.reducing_with(None, product):
        out = cell.evaluate(inputs[:g_count], inputs[g_count:2 * g_count],
                            inputs[2 * g_count:first], inputs[first:])
    outputs = [Traced._of(v) for v in out]
    return Graph(cell, inputs, outputs, trace_order(outputs), products)


def takes_means(cell: Cell) -> bool:
    """Whether ``cell``'s step takes row means (:func:`rnncc.cells.ops.mean`)."""
    return any(node.op == "mean" for node in trace(cell).order)


def mean_levels(cell: Cell) -> list[list[int]]:
    """The step's means (numbered in the order it takes them) in levels: a mean's level is one
    past the highest of the means its argument depends on, so the means of a level can be
    computed together (a layer norm's mean, then its variance; two layer norms side by
    side)."""
    return _levels(cell, variances=False)[0]


def one_round_levels(cell: Cell) -> tuple[list[list[int]], dict[int, tuple[int, bool]]]:
    """:func:`mean_levels`, but each layer norm's variance (:func:`rnncc.cells.ops.layer_norm`)
    in its mean's level, and {the variance's k: (its mean's k, whether a unit has one value)}:
    a lowering that has every unit's argument of the mean x_j, and that of the variance about
    x_j itself, v_j (the unit's values less x_j, squared; 0 where it has one value), has the
    variance about the mean m as mean_j(v_j + (x_j - m)^2), in the round of m (Chan et al.'s
    pairwise variance; the persistent kernel)."""
    return _levels(cell, variances=True)


def _levels(cell: Cell, variances: bool) -> tuple[list[list[int]], dict]:
    means = sorted((node for node in trace(cell).order if node.op == "mean"),
                   key=lambda node: node.value)
    index = {id(node): k for k, node in enumerate(means)}
    level: dict = {}

    def about(root, mean) -> int:
        """``root``'s level with ``mean`` taken a level lower (as its own argument)."""
        found: dict = {}
        for node in trace_order([root]):
            if node is mean:
                found[id(node)] = level[id(mean)] - 1
            elif node.op == "mean" or not node.args:
                found[id(node)] = level[id(node)]
            else:
                found[id(node)] = max(found[id(a)] for a in node.args)
        return found[id(root)]

    for node in trace_order(means):
        if variances and node.op == "mean" and node.of is not None:
            level[id(node)] = about(node.args[0], node.of[0]) + 1
        else:
            below = [level[id(a)] for a in node.args if id(a) in level]
            level[id(node)] = max(below, default=-1) + (1 if node.op == "mean" else 0)
    levels: list = []
    for node in means:
        k, at = index[id(node)], level[id(node)]
        levels += [[] for _ in range(at + 1 - len(levels))]
        levels[at].append(k)
    pairs = {index[id(node)]: (index[id(node.of[0])], node.of[1] == 1) for node in means
             if variances and node.of is not None and level[id(node)] == level[id(node.of[0])]}
    return levels, pairs


def trace_order(roots) -> list:
    """The nodes ``roots`` depend on, each after its arguments (depth first, without
    recursion)."""
    order, seen = [], set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in seen:
                continue
            if ready:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if id(a) not in seen)
    return order


def reduces(cell: Cell) -> bool:
    """Whether ``cell``'s step reduces over the hidden units: row means, or recurrent products
    of its values (:func:`rnncc.cells.ops.recurrent`); the persistent kernels take them one
    layer a module (means: not the backward kernel)."""
    return takes_means(cell) or bool(trace(cell).products)


def product_gates(graph: Graph, upto: int | None = None) -> list[int]:
    """The gates whose recurrent products a traced step takes (:func:`rnncc.cells.ops.
    recurrent`), in the order it takes them; with ``upto`` (one of them), those before it."""
    gates = [node.value[0] for node in graph.products]
    if upto is None:
        return gates
    if upto not in gates:
        raise CellError(f"cell {graph.cell.name!r} takes no recurrent product of gate {upto}")
    return gates[:gates.index(upto)]


def check_products(graph: Graph) -> None:
    """A step's recurrent products: each of a gate of the cell, one a gate, and a gate whose
    product the step takes of a value does not also use gh[g] (its gradient would go to two
    products of W_g)."""
    cell, gates = graph.cell, product_gates(graph)
    bad = [g for g in gates if not 0 <= g < cell.gates]
    if bad:
        raise CellError(f"cell {cell.name!r}: ops.recurrent of gate {bad[0]}; the cell has "
                        f"gates 0 to {cell.gates - 1}")
    twice = sorted({g for g in gates if gates.count(g) > 1})
    if twice:
        raise CellError(f"cell {cell.name!r} takes gate {twice[0]}'s recurrent product "
                        "(ops.recurrent) more than once; one a gate")
    both = [g for g in gates if uses(graph, graph.inputs[cell.gates + g])]
    if both:
        raise CellError(f"cell {cell.name!r} takes gate {both[0]}'s recurrent product of a value "
                        f"(ops.recurrent) and also uses gh[{both[0]}] (the product of h): a "
                        "gate's recurrent product is of h or of one value, not both")


def uses(graph: Graph, node) -> bool:
    """Whether any output of the step depends on ``node`` (an input)."""
    return any(node is arg for n in graph.order for arg in n.args) or any(
        node is out for out in graph.outputs)


def summed_gates(graph: Graph) -> list[bool]:
    """For each gate, whether the step uses its two projections only as their sum
    ``gi[g] + gh[g]`` (all of LSTM's; GRU's r and z, not n: ``r * gh_n``): then both have the
    same gradient, and the sum is all the derivative needs of them."""
    g_count = graph.cell.gates
    uses: dict = {}
    for node in graph.order:
        for arg in node.args:
            uses.setdefault(id(arg), []).append(node)
    found = []
    for g in range(g_count):
        of_i = uses.get(id(graph.inputs[g]), [])
        of_h = uses.get(id(graph.inputs[g_count + g]), [])
        found.append(len(of_i) == len(of_h) == 1 and of_i[0] is of_h[0] and of_i[0].op == "add")
    return found


class Backend:
    """How a graph's values are computed: ``const(c, like)``, ``unary(name, x)``,
    ``positive(x, a)`` (``a`` where x > 0, else zero), ``mean(x)`` (over the row's units),
    ``product(gate, x)`` and ``transposed(gate, a)`` (gate's rows of W_hh, times x, plus the
    bias; a times them transposed); arithmetic is Python's operators."""

    def const(self, value: float, like):
        raise NotImplementedError

    def unary(self, name: str, x):
        return apply_unary(name, x)

    def positive(self, x, a):
        raise NotImplementedError

    def mean(self, x):
        return ops.mean(x)

    def product(self, gate, x):
        raise NotImplementedError

    def transposed(self, gate, a):
        return ops.transposed_product(gate, a)


class PrimExprs(Backend):
    """Values as TVM PrimExprs of one dtype (the backward kernels)."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def const(self, value, like):
        from tvm import tirx

        return tirx.const(value, self.dtype)

    def positive(self, x, a):
        from tvm import tirx

        return tirx.if_then_else(x > self.const(0.0, x), a, self.const(0.0, x))


class NumPy(Backend):
    """Values as NumPy arrays (float64 in the tests), [N, H] each; a step's recurrent products
    take ``w_hh`` [G*H, H] and ``b_hh`` [G*H]."""

    def __init__(self, w_hh=None, b_hh=None):
        self.w_hh, self.b_hh = w_hh, b_hh

    def _rows(self, gate):
        h = self.w_hh.shape[1]
        return self.w_hh[gate * h:(gate + 1) * h], self.b_hh[gate * h:(gate + 1) * h]

    def product(self, gate, x):
        w, b = self._rows(gate)
        return x @ w.T + b

    def transposed(self, gate, a):
        return a @ self._rows(gate)[0]

    def const(self, value, like):
        import numpy as np

        return np.full_like(like, value)

    def unary(self, name, x):
        import numpy as np

        return {"sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "tanh": np.tanh, "exp": np.exp,
                "relu": lambda v: np.maximum(v, 0.0), "rsqrt": lambda v: 1.0 / np.sqrt(v)}[name](x)

    def mean(self, x):
        import numpy as np

        return np.broadcast_to(np.mean(x, axis=-1, keepdims=True), np.shape(x)).copy()

    def positive(self, x, a):
        import numpy as np

        return np.where(x > 0, a, 0.0)


def forward(graph: Graph, values: Sequence, backend: Backend, products=None) -> dict:
    """Every node's value (by id) from the inputs' ``values``; the recurrent products' from
    ``products`` (one a product, in the step's order) where given, else the backend's."""
    like = values[0]
    out = {}
    for node in graph.order:
        args = [out[id(a)] for a in node.args]
        if node.op == "input":
            out[id(node)] = values[node.value]
        elif node.op == "const":
            out[id(node)] = backend.const(node.value, like)
        elif node.op == "add":
            out[id(node)] = args[0] + args[1]
        elif node.op == "sub":
            out[id(node)] = args[0] - args[1]
        elif node.op == "mul":
            out[id(node)] = args[0] * args[1]
        elif node.op == "div":
            out[id(node)] = args[0] / args[1]
        elif node.op == "neg":
            out[id(node)] = -args[0]
        elif node.op in UNARY:
            out[id(node)] = backend.unary(node.op, args[0])
        elif node.op == "mean":
            out[id(node)] = backend.mean(args[0])
        elif node.op == "product":
            gate, k = node.value
            out[id(node)] = (products[k] if products is not None
                             else backend.product(gate, args[0]))
        else:
            raise CellError(f"cell {graph.cell.name!r}: no derivative for operation {node.op!r}")
    return out


def vjp(graph: Graph, values: Sequence, seeds: Sequence, backend: Backend, products=None,
        found: dict | None = None) -> list:
    """The gradients of the graph's inputs (G of ``gi``, G of ``gh``, then the states), given
    the inputs' ``values`` and the gradients ``seeds`` of its outputs (one a new state);
    ``products`` as :func:`forward`'s. ``found``, a dict: then ``found[k]`` is the value of the
    argument x of the step's k-th recurrent product (W_g's gradient is dp^T x)."""
    value = forward(graph, values, backend, products)
    adjoint: dict = {}

    def add(node, grad):
        if node.op == "const":
            return
        key = id(node)
        adjoint[key] = grad if key not in adjoint else adjoint[key] + grad

    for node, seed in zip(graph.outputs, seeds):
        add(node, seed)
    for node in reversed(graph.order):
        a = adjoint.get(id(node))
        if a is None or node.op in ("input", "const"):
            continue
        args, out = node.args, value[id(node)]
        if node.op == "add":
            add(args[0], a)
            add(args[1], a)
        elif node.op == "sub":
            add(args[0], a)
            add(args[1], -a)
        elif node.op == "mul":
            add(args[0], a * value[id(args[1])])
            add(args[1], a * value[id(args[0])])
        elif node.op == "div":
            add(args[0], a / value[id(args[1])])
            add(args[1], -(a * out) / value[id(args[1])])
        elif node.op == "neg":
            add(args[0], -a)
        elif node.op == "sigmoid":
            add(args[0], a * (out * (backend.const(1.0, out) - out)))
        elif node.op == "tanh":
            add(args[0], a * (backend.const(1.0, out) - out * out))
        elif node.op == "exp":
            add(args[0], a * out)
        elif node.op == "relu":
            add(args[0], backend.positive(out, a))
        elif node.op == "rsqrt":
            add(args[0], a * (out * out * out) * backend.const(-0.5, out))
        elif node.op == "mean":
            add(args[0], backend.mean(a))
        elif node.op == "product":
            gate, k = node.value
            if found is not None:
                found[k] = value[id(args[0])]
            add(args[0], backend.transposed(gate, a))
    like = values[0]
    return [adjoint.get(id(node), backend.const(0.0, like)) for node in graph.inputs]


def kept_vjp(graph: Graph, kept: Sequence, part, states: Sequence, seeds: Sequence,
             backend: Backend, params: Sequence = (), found: dict | None = None
             ) -> tuple[list, list, list]:
    """The step's VJP from what a training forward kept of its projections: ``kept`` its parts
    in order, ``(g, "sum")`` (gi[g] + gh[g], for a gate used only as that sum) or ``(g, "gi")``
    and, unless the step takes the gate's product of a value, ``(g, "gh")``; then
    ``(k, "product")``, the value of the
    step's k-th recurrent product; ``part(i)`` the value of part i; ``states`` the previous
    states' values, ``seeds`` the new states' gradients, ``params`` the values of the cell's
    per-unit parameters; ``found`` as :func:`vjp`'s. Returns (the projections' gradients: G of
    gi, then, where some gate is kept apart or the step takes a recurrent product, G of gh;
    where none is, gi's equal gh's; the previous states' gradients; the parameters' gradients
    at this element)."""
    g_count, s_count = graph.cell.gates, len(graph.cell.states)
    if len(params) != len(graph.cell.params):
        raise CellError(f"cell {graph.cell.name!r}: {len(params)} parameter values for its "
                        f"params {graph.cell.params}")
    slot = {p: i for i, p in enumerate(kept)}
    if (sorted(g for g, which in kept if which in ("sum", "gi")) != list(range(g_count))
            or sorted(k for k, which in kept if which == "product")
            != list(range(len(graph.products)))):
        raise CellError(f"cell {graph.cell.name!r}: kept parts {tuple(kept)} do not cover its "
                        f"{g_count} gates")
    zero = backend.const(0.0, part(0))
    # a gate kept as a sum stands in for gi, with gh zero
    values = ([part(slot[(g, "gi")] if (g, "gi") in slot else slot[(g, "sum")])
               for g in range(g_count)]
              + [part(slot[(g, "gh")]) if (g, "gh") in slot else zero for g in range(g_count)]
              + list(states) + list(params))
    products = [part(slot[(k, "product")]) for k in range(len(graph.products))]
    grads = vjp(graph, values, seeds, backend, products, found)
    both = any(which in ("gh", "product") for _, which in kept)
    first = 2 * g_count + s_count
    return grads[:2 * g_count if both else g_count], grads[2 * g_count:first], grads[first:]
