"""The pieces of a sequence as TE PrimFuncs, before scheduling.

Shapes use T steps (a run-time variable), N batch, C input, H hidden, G gates. Every PrimFunc
takes its inputs first and its outputs last; :mod:`rnncc.lowering.assemble` binds them to the
sequence's buffers. All index arithmetic is int64 (T * N * G * H can pass 2**31).

Layouts (chosen by the schedule, see :class:`Layout`):

- weights ``"rows"``: a projection's weight is [O, K] as PyTorch stores it (K contiguous);
  ``"cols"``: [K, O] (O contiguous, for vectorising over outputs on CPUs).
- gates ``"combined"``: a projection is one GEMM over all G gates, output [.., N, G*H];
  ``"per_gate"``: G GEMMs of H outputs each, output [G, .., N, H].
- flat rows: the input GEMM of all steps sees x [T, N, C] as [T*N, C] and xp [T, N, G*H] as
  [T*N, G*H], one run-time row dimension (views of the same memory; gates "combined").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import tvm
from tvm import te, tirx

from ..cells import Cell, ops
from ..dtypes import accum_dtype, round_tf32
from ..errors import CellError
from ..schedules import slice_depth
from .staged import Staged

#: A whole dimension in an index (see :class:`rnncc.lowering.assemble.Region`).
ALL = slice(None)


def i64(value) -> tirx.IntImm:
    """An int64 constant (rnncc's shapes are all int64)."""
    return tirx.IntImm("int64", int(value))


@dataclass(frozen=True)
class Layout:
    """Memory layout of the packed weights and of the gate projections."""

    weights: str = "rows"
    gates: str = "combined"
    flat_rows: bool = False

    def __post_init__(self):
        if self.weights not in ("rows", "cols"):
            raise ValueError(f"weights layout must be 'rows' or 'cols', got {self.weights!r}")
        if self.gates not in ("combined", "per_gate"):
            raise ValueError(f"gates layout must be 'combined' or 'per_gate', got {self.gates!r}")
        if self.flat_rows and self.gates != "combined":
            raise ValueError(f"flat rows need gates 'combined', got {self.gates!r}")

    @property
    def packs_as_given(self) -> bool:
        """True when a packed weight is PyTorch's [G*H, K] as it is (element for element)."""
        return self.gates == "combined" and self.weights == "rows"

    @property
    def matrix(self) -> Layout:
        """The layout of a plain matrix (no gates) in this one's orientation: W_hr's."""
        return Layout(self.weights)

    def gate_block(self, d: int, gate: int, gates: int, hidden: int) -> tuple:
        """The index, in W_hh packed this way (each direction's [G*H, H] stacked along the first
        dimension), of gate ``gate``'s block of direction ``d``: the [H, H] (rows) or its
        transpose (cols) that multiplies by that gate."""
        row = d * gates + gate
        if self.gates == "per_gate":
            return (row, ALL, ALL)
        if self.weights == "rows":
            return (slice(row * hidden, (row + 1) * hidden), ALL)
        return (slice(d * hidden, (d + 1) * hidden), slice(gate * hidden, (gate + 1) * hidden))

    def weight_shape(self, gates: int, hidden: int, k: int) -> tuple[int, ...]:
        """Shape of a packed [G*H, K] weight."""
        if self.gates == "combined":
            return (gates * hidden, k) if self.weights == "rows" else (k, gates * hidden)
        return (gates, hidden, k) if self.weights == "rows" else (gates, k, hidden)


def _dtype_of(expr) -> str:
    """dtype of a PrimExpr or of a TE tensor element."""
    return str(expr.dtype) if hasattr(expr, "dtype") else str(expr.ty.dtype)


def _cast(expr, dtype: str):
    return expr if _dtype_of(expr) == dtype else expr.astype(dtype)


def gemm(lead: tuple, k: int, o: int, weights: str, dtype: str,
         a_dtype: str | None = None, lengths: bool = False) -> tirx.PrimFunc:
    """``out[..., j] = sum_k a[..., k] * w[j, k] + b[j]`` for one projection.

    ``a`` is ``lead + (K,)`` (dtype ``a_dtype``, default ``dtype``), ``w`` [O, K] ("rows") or
    [K, O] ("cols") and ``b`` [O] in ``dtype``; ``out`` ``lead + (O,)``. Products, sums and
    ``out`` are in the accumulation dtype (``out`` is a workspace: half storage rounds only
    what the caller sees). Blocks: "gemm" (the reduction) and "gemm_bias" (the epilogue).

    ``lengths`` (``lead`` (T, N)): two more inputs after ``b``, ``lengths`` [N] int32
    (the samples' lengths) and ``ends`` [N] int32 (:func:`length_ends`): a schedule may then
    leave ``out``'s rows of steps past their sample's length unwritten (the steps that would
    read them are masked); the definition computes them all.
    """
    acc = accum_dtype(dtype)
    lead = tuple(i64(d) if isinstance(d, int) else d for d in lead)
    a = te.placeholder(lead + (i64(k),), a_dtype or dtype, "a")
    w_shape = (i64(o), i64(k)) if weights == "rows" else (i64(k), i64(o))
    w = te.placeholder(w_shape, dtype, "w")
    b = te.placeholder((i64(o),), dtype, "b")
    r = te.reduce_axis((i64(0), i64(k)), "k")

    def weight(j, kk):
        return w[j, kk] if weights == "rows" else w[kk, j]

    prod = te.compute(
        lead + (i64(o),),
        lambda *i: te.sum(_cast(a[i[:-1] + (r,)], acc) * _cast(weight(i[-1], r), acc),
                          axis=r),
        name="gemm",
    )
    out = te.compute(
        lead + (i64(o),),
        lambda *i: prod[i] + _cast(b[i[-1]], acc),
        name="gemm_bias",
    )
    given = ([te.placeholder((i64(int(lead[1])),), "int32", name) for name in ("lengths", "ends")]
             if lengths else [])
    return te.create_prim_func([a, w, b, *given, out])


def gemm_parts(batch: int, k: int, o: int, parts: int, weights: str, dtype: str,
               a_dtype: str | None = None) -> tirx.PrimFunc:
    """One step's product in S = ``parts`` slices of K, unsummed and without the bias:
    ``out[s, n, j] = sum over k of slice s of a[n, k] * w[j, k]``, ``a`` [N, K], ``w`` as
    :func:`gemm`'s, ``out`` [S, N, O] in the accumulation dtype; slice s is k from s * D on,
    D deep (:func:`rnncc.schedules.slice_depth`: K/S, or the last slice shorter, ending at K).
    Its reader adds the slices (in order) and the bias (:func:`parts_sum`), which saves the
    product's own sum kernel. Block "gemm_parts"."""
    acc = accum_dtype(dtype)
    a = te.placeholder((i64(batch), i64(k)), a_dtype or dtype, "a")
    w_shape = (i64(o), i64(k)) if weights == "rows" else (i64(k), i64(o))
    w = te.placeholder(w_shape, dtype, "w")
    depth = slice_depth(k, parts)
    r = te.reduce_axis((i64(0), i64(depth)), "k")

    def weight(j, kk):
        return w[j, kk] if weights == "rows" else w[kk, j]

    def total(s, n, j):
        at = s * depth + r
        if depth * parts == k:
            return te.sum(_cast(a[n, at], acc) * _cast(weight(j, at), acc), axis=r)
        inside = tirx.min(at, i64(k - 1))  # (TVM 0.27 drops a reduction's ``where``)
        value = _cast(a[n, inside], acc) * _cast(weight(j, inside), acc)
        return te.sum(tirx.Select(at < k, value, tirx.const(0, acc)), axis=r)

    out = te.compute((i64(parts), i64(batch), i64(o)), total, name="gemm_parts")
    return te.create_prim_func([a, w, out])


def parts_shape(parts: int, shape: tuple) -> tuple:
    """The shape of a one-step product's output ``shape`` [N, O] left in S = ``parts`` slices
    ([S, N, O]; ``shape`` itself where S is 1), S of the kind of ``shape``'s sizes (ints for
    a sequence's buffers, int64 constants for a component's)."""
    if parts == 1:
        return shape
    return ((parts if isinstance(shape[0], int) else i64(parts)),) + tuple(shape)


def parts_sum(t: te.Tensor, n, j):
    """``t[0, n, j] + t[1, n, j] + ...``: the slices of a :func:`gemm_parts` product, in
    order (the same sums, in the same order, as the product's own sum kernel would add);
    ``t[n, j]`` for a product read whole ([N, O])."""
    if len(t.shape) == 2:
        return t[n, j]
    total = t[0, n, j]
    for s in range(1, int(t.shape[0])):
        total = total + t[s, n, j]
    return total



def _select(condition, value, other):
    """``value`` where ``condition``, else ``other``, both computed either way: bound to
    variables first, so that TVM keeps a select (it makes a branch of a select of loads: a
    masked cell step of a branch an output computed the gates once an output, LSTM 256 at
    batch 256 on CUDA, 576 instructions with 30 MUFU where the unmasked step has 272 and 14);
    the step's outputs then share their computation."""
    dtype = _dtype_of(value)
    if dtype in ("float16", "bfloat16"):  # bound in float32: TVM widens 16-bit arithmetic
        # after the variables are typed (a round trip of the 16-bit value is exact)
        return _select(condition, value.astype("float32"), other.astype("float32")).astype(dtype)
    taken, kept = tirx.Var("taken", dtype), tirx.Var("kept", _dtype_of(other))
    return tirx.Let(taken, value, tirx.Let(kept, other, tirx.Select(condition, taken, kept)))


def cell_step(cell: Cell, batch: int, hidden: int, dtype: str, gates_layout: str,
              fused: bool, masked: bool = False, kept: tuple = (), rec_parts: int = 1,
              projected: bool = False, upto: int | None = None,
              recurrent_gates: int | None = None, h_copy: str | None = None,
              selects: bool = False) -> tirx.PrimFunc:
    """The cell's point-wise step for one time step.

    Inputs: the gate projections (biases included): "combined", ``gi`` then ``gh``, each
    [N, G*H]; "per_gate", ``gi0 .. gi{G-1}`` then ``gh0 .. gh{G-1}``, each [N, H]. Then the
    previous states, each [N, H]; ``masked``: then ``active`` [N] int32, nonzero where the step
    is within the sample's length. Outputs: ``y`` [N, H] (the new h; zero where not active),
    then the new states, each [N, H] (the previous ones where not active). ``y`` is in
    ``dtype``; the projections and the states are workspaces in the accumulation dtype.
    ``fused``: one kernel for the whole step; otherwise one kernel an operation (the unfused
    baseline). ``kept`` (fused, gates "combined"; the training forward): last, one output
    [N, H] (accumulation dtype) for each of its parts ``(g, "sum" | "gi" | "gh" | "product")``:
    gate g's ``gi[g] + gh[g]``, ``gi[g]`` or ``gh[g]``, or the step's g-th recurrent product
    (see :func:`rnncc.lowering.training.kept_parts`). ``rec_parts`` S > 1 ("combined"): ``gh``
    is the recurrent product's S slices [S, N, G*H] (:func:`gemm_parts`) and ``b_hh`` [G*H]
    follows it; the step adds them. A cell with ``params``: then one vector [H] each, before
    the states. Those vectors are in the accumulation dtype (a half layer's converted once
    before its steps: CUDA's conversions from 16 bits are inline assembly, which keeps nvcc
    from computing the values the outputs share once; a float16 LSTM step computed them once
    an output, 10.8 us at N 256, H 1024 on an H200 against 6.0 in float32). ``projected``
    (LSTMP: the cell reads h only through W_hh, and h is W_hr h' of its output): h is neither
    read nor written as a state here; ``y`` is the cell's h' (zero where not active) and the
    states are the others only.

    A step that takes recurrent products of its values (:func:`rnncc.cells.ops.recurrent`):
    the products, a GEMM each, come in after the projections, ``product<gate>`` [N, H] (their
    biases included) in the order the step takes them; with ``upto`` (a gate), only those the
    step takes before that gate's, and the output is that product's argument [N, H] alone
    (no ``active``; the accumulation dtype), what its GEMM multiplies. ``recurrent_gates``
    ("combined"): ``gh`` holds the first ones only, [N, that * H] (the step takes the others'
    products of other values). ``h_copy`` (fused): after the states (before the kept parts),
    h again [N, H], y's values, for the next step's recurrent product to read as its tensor
    cores take it: in ``dtype`` (a half one), or "tf32": float32 rounded to TF32.
    ``selects`` (``masked``, for CUDA): the outputs' values are bound to variables and
    selected (:func:`_select`), so that they share the gates' computation (TVM's CPU passes
    refuse such bindings: its common subexpressions and 16-bit legalisation).
    """
    from ..cells import autodiff

    acc = accum_dtype(dtype)
    g_count = cell.gates
    n_, h_ = i64(batch), i64(hidden)
    if gates_layout == "combined":
        gi = te.placeholder((n_, i64(g_count * hidden)), acc, "gi")
        width = i64(g_count * hidden)
        read = recurrent_gates or g_count
        gh = te.placeholder(parts_shape(rec_parts, (n_, i64(read * hidden))), acc, "gh")
        b_hh = te.placeholder((width,), acc, "b_hh") if rec_parts > 1 else None
        inputs = [gi, gh] + ([b_hh] if rec_parts > 1 else [])

        def read_i(g, n, j):
            return gi[n, g * hidden + j]

        def read_h(g, n, j):
            if g >= read:  # a gate whose product the step takes of another value
                return tirx.const(0, acc)
            if b_hh is None:
                return gh[n, g * hidden + j]
            return parts_sum(gh, n, g * hidden + j) + b_hh[g * hidden + j]
    else:
        if rec_parts > 1:
            raise ValueError("a recurrent product in parts needs the gates combined")
        gis = [te.placeholder((n_, h_), acc, f"gi{g}") for g in range(g_count)]
        ghs = [te.placeholder((n_, h_), acc, f"gh{g}") for g in range(g_count)]
        inputs = gis + ghs

        def read_i(g, n, j):
            return gis[g][n, j]

        def read_h(g, n, j):
            return ghs[g][n, j]

    order = autodiff.product_gates(autodiff.trace(cell), upto)
    products = {g: te.placeholder((n_, h_), acc, f"product{g}") for g in order}
    inputs += list(products.values())
    params = [te.placeholder((h_,), acc, f"param_{p}") for p in cell.params]
    inputs += params
    own = cell.states[1:] if projected else cell.states  # the states read and written here
    states = [te.placeholder((n_, h_), acc, f"{s}_prev") for s in own]
    active = te.placeholder((n_,), "int32", "active") if masked and upto is None else None
    skip = 1 if projected else 0  # the step's new states past h's, where h is not written

    def frozen(n, j, values):
        """y zero and the states kept where the step is past the sample's length."""
        if active is None:
            return values
        live = active[n] != 0
        chosen = _select if selects else tvm.tirx.if_then_else
        return ([chosen(live, values[0], tirx.const(0, dtype))]
                + [chosen(live, v, s[n, j]) for v, s in zip(values[1:], states)])

    if fused:
        def body(n, j):
            previous = [s[n, j] for s in states]
            if projected:  # h's value does not matter: the step does not read it
                previous = [tirx.const(0, acc)] + previous
            new = cell.evaluate([read_i(g, n, j) for g in range(g_count)],
                                [read_h(g, n, j) for g in range(g_count)],
                                previous, [_cast(p[j], acc) for p in params])
            _check_scalars(cell, new)
            parts = {"sum": lambda g: read_i(g, n, j) + read_h(g, n, j),
                     "gi": lambda g: read_i(g, n, j), "gh": lambda g: read_h(g, n, j),
                     "product": lambda k: products[order[k]][n, j]}
            def outputs():
                return frozen(n, j, [_cast(new[0], dtype)] + [_cast(v, acc) for v in new[skip:]])

            values, copied = outputs(), []
            if h_copy:  # h's copy binds variables of its own
                again = outputs()[0]
                if h_copy == "tf32":  # rounded once bound (round_tf32 reads its value twice)
                    bound = tirx.Var("h_copy", "float32")
                    again = tirx.Let(bound, again, round_tf32(bound))
                copied = [again]
            # the kept parts last: the training forward writes the sums over the projections
            # (in place), and each output's expression reads its inputs again (y's copy,
            # after them, read sums as projections: bfloat16 LSTM 1024 N128's y 2.5e-2 off)
            return values + copied + [parts[part](g) for g, part in kept]

        reduced = RowReductions((n_, h_), body, products)
        outs = (reduced.argument(upto, "argument") if upto is not None
                else te.compute((n_, h_), lambda n, j: reduced(n, j), name="cell"))
    else:
        if h_copy:
            raise ValueError("a copy of h for the next product needs the fused step")

        def gate(read, g):
            return Staged(te.compute((n_, h_), lambda n, j: read(g, n, j), name=f"gate{g}"))

        def param(vector):  # a per-unit parameter, the same for every batch row
            return Staged(te.compute((n_, h_), lambda n, j: _cast(vector[j], acc),
                                     name="param"))

        def product(g, x):
            if g == upto:
                raise _Reached(x)
            return Staged(te.compute((n_, h_), lambda n, j: products[g][n, j],
                                     name=f"product{g}"))

        previous = [Staged(_elementwise(s, acc, "state")) for s in states]
        if projected:  # h's value does not matter: the step does not read it
            previous = [Staged(te.compute((n_, h_), lambda n, j: tirx.const(0, acc),
                                          name="h_unread"))] + previous
        try:
            with ops.reducing_with(None, product):
                new = cell.evaluate(
                    [gate(read_i, g) for g in range(g_count)],
                    [gate(read_h, g) for g in range(g_count)],
                    previous,
                    [param(p) for p in params],
                )
        except _Reached as found:  # upto: the product's argument
            new = [found.value]
        if not all(isinstance(v, Staged) for v in new):
            raise CellError(
                f"cell {cell.name!r}: step must compute every state from its inputs with "
                "rnncc.cells.ops and arithmetic operators to be staged"
            )
        if upto is not None:
            outs = _elementwise(new[0].tensor, acc, "argument")
        elif active is not None:  # one kernel writes y and the states, where the step is active
            staged = [new[0].tensor] + [v.tensor for v in new[skip:]]
            outs = te.compute((n_, h_), lambda n, j: frozen(n, j, [
                _cast(staged[0][n, j], dtype)] + [_cast(v[n, j], acc) for v in staged[1:]]),
                name="out")
        else:
            outs = [_elementwise(new[0].tensor, dtype, "y")]
            outs += [_elementwise(v.tensor, acc, f"{s}_new") for s, v in zip(own, new[skip:])]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]  # y alone, projected
    extra = [active] if active is not None else []
    return te.create_prim_func([*inputs, *states, *extra, *outs])


class _Reached(Exception):
    """The reduction :class:`RowReductions` looked for, and its argument."""

    def __init__(self, value):
        super().__init__()
        self.value = value


class RowReductions:
    """``body(n, j)``, a ``te.compute`` body over ``shape`` [N, H] that calls a cell's step (or
    its derivative), made to reduce over the row's units. The k-th :func:`rnncc.cells.ops.mean`
    the body takes is a stage [N, H] of its argument (the body itself evaluated at every element
    up to that mean, the means before it read from their stages), then its sum over the row (a
    stage [N]). Its recurrent products (:func:`rnncc.cells.ops.recurrent`, or a derivative's
    transposed ones) are ``products[gate]``, tensors [N, H] the caller computed (a GEMM of
    :meth:`argument`'s). Calling the object gives the body's value; a body that reduces nothing
    is unchanged."""

    def __init__(self, shape: tuple, body, products: dict | None = None):
        self.shape, self.body, self.products = shape, body, dict(products or {})
        self.sums: list = []

    def __call__(self, n, j):
        return self._evaluate(n, j)

    def argument(self, gate: int, name: str) -> te.Tensor:
        """A stage [N, H]: the argument of the body's recurrent product of ``gate`` (the body
        evaluated up to it; the products it reads before are in ``products``)."""
        return te.compute(self.shape, lambda a, b: self._argument(a, b, ("product", gate)),
                          name=name)

    def _evaluate(self, n, j, stop=None):
        shape, units = self.shape, int(self.shape[1])
        means = itertools.count()

        def mean(x):
            k = next(means)
            if stop == ("mean", k):
                raise _Reached(x)
            if k == len(self.sums):
                values = te.compute(shape, lambda a, b: self._argument(a, b, ("mean", k)),
                                    name=f"row_values{k}")
                r = te.reduce_axis((0, shape[1]), name=f"r{k}")
                self.sums.append(te.compute(shape[:1], lambda a: te.sum(values[a, r], axis=r),
                                            name=f"row_sum{k}"))
            return self.sums[k][n] * tirx.const(1.0 / units, _dtype_of(x))

        def product(gate, x):
            if stop == ("product", gate):
                raise _Reached(x)
            if gate not in self.products:
                raise CellError(f"a step took gate {gate}'s recurrent product before the "
                                "products it depends on were computed")
            return self.products[gate][n, j]

        with ops.reducing_with(mean, product):
            return self.body(n, j)

    def _argument(self, a, b, stop):
        try:
            self._evaluate(a, b, stop)
        except _Reached as found:
            return found.value
        raise CellError(f"a step took {stop[0]} {stop[1]} at one element and not at another")


def _elementwise(x: te.Tensor, dtype: str, name: str) -> te.Tensor:
    return te.compute(x.shape, lambda n, j: _cast(x[n, j], dtype), name=name)


def _check_scalars(cell: Cell, values) -> None:
    for value in values:
        if not tvm.ir.is_prim_expr(value) or not _dtype_of(value).startswith("float"):
            raise CellError(
                f"cell {cell.name!r}: step must return floating-point expressions, got "
                f"{type(value).__name__} {value!r}"
            )


def activity(batch: int, t_len) -> tirx.PrimFunc:
    """``active[t, n]`` = 1 where step t is within sample n's length (``lengths`` [N] int32),
    else 0, for the T = ``t_len`` steps of a call."""
    lengths = te.placeholder((i64(batch),), "int32", "lengths")
    active = te.compute((t_len, i64(batch)), lambda t, n: tvm.tirx.if_then_else(
        t < lengths[n].astype("int64"), tirx.const(1, "int32"), tirx.const(0, "int32")),
        name="active")
    return te.create_prim_func([lengths, active])


def length_ends(batch: int, t_len, width: int, dtype: str) -> tirx.PrimFunc:
    """``ends[n]`` = l[0] + ... + l[n], l[k] = ``lengths[k]`` within 0 .. T (``lengths`` [N]
    int32; T of ``x`` [T, N, C], read for its shape only): where sample n's rows end when the
    rows (t, n) within the samples' lengths are laid out sample after sample; ``ends[N - 1]``
    counts them. A length past T counts T, as the steps it runs: one that a call refuses but a
    CUDA graph's replay with new lengths may bring leaves the other samples' rows in place."""
    x = te.placeholder((t_len, i64(batch), i64(width)), dtype, "x")
    lengths = te.placeholder((i64(batch),), "int32", "lengths")
    k = te.reduce_axis((i64(0), i64(batch)), "k")
    steps = t_len.astype("int32")
    ends = te.compute((i64(batch),), lambda n: te.sum(tvm.tirx.if_then_else(
        k <= n, tvm.tirx.max(tvm.tirx.min(lengths[k], steps), 0), tirx.const(0, "int32")),
        axis=k), name="ends")
    return te.create_prim_func([x, lengths, ends])


def copy(count: int, batch: int, hidden: int, dtype: str, out_dtype: str,
         tf32: bool = False) -> tirx.PrimFunc:
    """``out_i = in_i`` for ``count`` [N, H] tensors, in one kernel (state copies between the
    caller's ``dtype`` and the workspaces' ``out_dtype``, or back; ``tf32``: rounded to TF32,
    float32 out)."""
    shape = (i64(batch), i64(hidden))
    ins = [te.placeholder(shape, dtype, f"in{i}") for i in range(count)]
    outs = te.compute(shape, lambda n, j: [
        round_tf32(x[n, j]) if tf32 else _cast(x[n, j], out_dtype) for x in ins], name="copy")
    return te.create_prim_func([*ins, *(outs if count > 1 else [outs])])


def projected_state(batch: int, width: int, dtype: str, masked: bool,
                    parts: int = 1) -> tirx.PrimFunc:
    """A step's output and new h from its projection (LSTMP): inputs ``hr`` [N, P] (W_hr h',
    accumulation dtype; ``parts`` S > 1: its slices of K [S, N, P], added here), ``h_prev``
    [N, P] (accumulation dtype) and, ``masked``, ``active`` [N] int32; outputs ``y`` [N, P] in
    ``dtype`` (zero where not active) and ``h_next`` [N, P] (``h_prev`` where not active)."""
    acc = accum_dtype(dtype)
    shape = (i64(batch), i64(width))
    hr = te.placeholder(parts_shape(parts, shape), acc, "hr")
    h_prev = te.placeholder(shape, acc, "h_prev")
    active = te.placeholder((i64(batch),), "int32", "active") if masked else None

    def body(n, j):
        value = parts_sum(hr, n, j)
        if active is None:
            return [_cast(value, dtype), value]
        live = active[n] != 0
        return [tvm.tirx.if_then_else(live, _cast(value, dtype), tirx.const(0, dtype)),
                tvm.tirx.if_then_else(live, value, h_prev[n, j])]

    y, h_next = te.compute(shape, body, name="projected_state")
    return te.create_prim_func([hr, h_prev, *([active] if masked else []), y, h_next])


def pack_weight(gates: int, hidden: int, k: int, layout: Layout, dtype: str,
                tf32: bool = False, padded: int | None = None) -> tirx.PrimFunc:
    """A PyTorch weight [G*H, K] into the layout's packed shape (``tf32``: its values
    rounded to TF32, what the layer's TF32 products take). ``padded`` K' > K (combined rows
    only): packed [G*H, K'], zeros past K (the input projection's rows in whole copies,
    :func:`rnncc.lowering.sequence.padded_input_size`)."""
    given = te.placeholder((i64(gates * hidden), i64(k)), dtype, "w")
    w = (te.compute(given.shape, lambda o, kk: round_tf32(given[o, kk]), name="rounded")
         if tf32 else given)
    if padded is not None and padded != k:
        if layout.gates != "combined" or layout.weights != "rows":
            raise ValueError(f"a weight packed with K padded takes combined rows, not {layout}")
        return te.create_prim_func([given, _padded_columns(w, padded, dtype, "pack")])
    shape = tuple(i64(d) for d in layout.weight_shape(gates, hidden, k))
    if layout.gates == "combined":
        if layout.weights == "rows":
            packed = te.compute(shape, lambda o, kk: w[o, kk], name="pack")
        else:
            packed = te.compute(shape, lambda kk, o: w[o, kk], name="pack")
    elif layout.weights == "rows":
        packed = te.compute(shape, lambda g, o, kk: w[g * hidden + o, kk], name="pack")
    else:
        packed = te.compute(shape, lambda g, kk, o: w[g * hidden + o, kk], name="pack")
    return te.create_prim_func([given, packed])


def _padded_columns(a: te.Tensor, padded: int, dtype: str, name: str) -> te.Tensor:
    """``a`` [..., W] as [..., W'] (W' = ``padded``), zeros past W."""
    width = a.shape[-1]

    def value(*i):
        f = i[-1]
        return tvm.tirx.if_then_else(f < width, a[i[:-1] + (tvm.tirx.min(f, width - 1),)],
                                     tirx.const(0, dtype))
    return te.compute(tuple(a.shape[:-1]) + (i64(padded),), value, name=name)


def padded_steps(batch: int, width: int, padded: int, dtype: str, t_len) -> tirx.PrimFunc:
    """``out[t, n, f] = a[t, n, f]`` for f < F (``width``), zero up to F' (``padded``): a
    [T, N, F], out [T, N, F'] (x for an input projection whose K is padded)."""
    a = te.placeholder((t_len, i64(batch), i64(width)), dtype, "a")
    return te.create_prim_func([a, _padded_columns(a, padded, dtype, "padded")])


def reverse_steps(batch: int, width: int, dtype: str, t_len, lengths: bool) -> tirx.PrimFunc:
    """Each sample's steps reversed: ``out[t, n] = a[len[n] - 1 - t, n]`` for t < len[n] and
    ``a[t, n]`` past it (``lengths`` [N] int32, else len = T), a and out [T, N, F] (F =
    ``width``). Its own inverse: the reverse direction of a bidirectional layer runs on it."""
    a = te.placeholder((t_len, i64(batch), i64(width)), dtype, "a")
    given = te.placeholder((i64(batch),), "int32", "lengths") if lengths else None

    def value(t, n, f):
        length = given[n].astype("int64") if lengths else t_len
        return a[tvm.tirx.if_then_else(t < length, length - 1 - t, t), n, f]

    out = te.compute((t_len, i64(batch), i64(width)), value, name="reversed")
    return te.create_prim_func([a, *([given] if lengths else []), out])


def copy_steps(batch: int, width: int, dtype: str, t_len,
               out_dtype: str | None = None) -> tirx.PrimFunc:
    """``out[t, n, f] = a[t, n, f]`` (cast to ``out_dtype``, default ``dtype``), a and out
    [T, N, F] (F = ``width``): a layer's outputs out of the wavefront's stacked ones, dx out of
    its accumulation-dtype workspace."""
    a = te.placeholder((t_len, i64(batch), i64(width)), dtype, "a")
    out = te.compute((t_len, i64(batch), i64(width)),
                     lambda t, n, f: _cast(a[t, n, f], out_dtype or dtype), name="copied")
    return te.create_prim_func([a, out])


def cast(width: int, dtype: str, out_dtype: str) -> tirx.PrimFunc:
    """``out = in`` for a vector [W] of ``dtype``, in ``out_dtype``."""
    src = te.placeholder((i64(width),), dtype, "in")
    return te.create_prim_func([src, te.compute(src.shape, lambda j: _cast(src[j], out_dtype),
                                                name="cast")])


def concat(count: int, width: int, dtype: str) -> tirx.PrimFunc:
    """``count`` vectors [W] one after another in one [count*W] (the directions' biases)."""
    ins = [te.placeholder((i64(width),), dtype, f"in{i}") for i in range(count)]
    out = te.compute((i64(count * width),), lambda e: _pick(ins, e, width), name="concat")
    return te.create_prim_func([*ins, out])


def _pick(ins, e, width):
    """ins[e // W][e % W], as a chain of selects (each index clamped into its vector)."""
    value = ins[-1][tvm.tirx.max(e - (len(ins) - 1) * width, i64(0))]
    for i in range(len(ins) - 2, -1, -1):
        value = tvm.tirx.if_then_else(e < (i + 1) * width, ins[i][tvm.tirx.min(
            tvm.tirx.max(e - i * width, i64(0)), i64(width - 1))], value)
    return value


def pack_persistent(gates: int, hidden: int, plan, dtype: str, transposed: bool = False,
                    folded: int = 0) -> tirx.PrimFunc:
    """W_hh [G*H, H] into the persistent kernel's layout [B, Wn, KI, RW, 32, VEC] (B: the
    blocks of one batch group, which all groups share): block b,
    warp w, chunk i, row q of the warp, lane l, element v holds W_hh[g*H + j, k] with
    r = w*RW + q, g = r // U, j = b*U + r % U and k = (i*32 + l)*VEC + v (zero outside); with
    lane groups (``plan.lane_groups`` LG, KL = 32 / LG lanes a group) r = w*LG*RW + (l //
    KL)*RW + q and k = (i*KL + l % KL)*VEC + v.
    A plan on tensor cores (``plan.mma``, RW = 8) keeps the shape and holds the mma's B
    fragments instead: with e = q*VEC + v, its f = e // 4 (of the chunk's 2*VEC k-steps) and
    c = e % 4, row r = w*RW + l // 4 and k = i*32*VEC + f*16 + (l % 4)*2 + c % 2 + 8*(c // 2);
    float32 (TF32) rounded to TF32. With K split among KQ warps (``plan.k_parts``) warp w holds
    the rows of w % (Wn/KQ) and the KI/KQ chunks of part w // (Wn/KQ): [B, Wn, KI/KQ, ...].
    ``transposed``: W_hh^T [H, G*H] for the backward kernel, one row a unit (j = b*U + r,
    k < G*H), from the same W_hh. ``folded`` P (a projection, LSTMP): from W_hh [G*H, P] and
    W_hr [P, H] (the function's first two parameters), the product W_hh W_hr [G*H, H] (summed
    in the accumulation dtype), which multiplies the cell's h' as W_hh does h = W_hr h'."""
    if folded:
        given = te.placeholder((i64(gates * hidden), i64(folded)), dtype, "w_hh")
        w_hr = te.placeholder((i64(folded), i64(hidden)), dtype, "w_hr")
        p, acc = te.reduce_axis((i64(0), i64(folded)), "p"), accum_dtype(dtype)
        w = te.compute((i64(gates * hidden), i64(hidden)), lambda r, k: te.sum(
            _cast(given[r, p], acc) * _cast(w_hr[p, k], acc), axis=p), name="folded")
        if dtype != acc:
            w = _elementwise(w, dtype, "folded_rounded")
        inputs = [given, w_hr]
    else:
        w = te.placeholder((i64(gates * hidden), i64(hidden)), dtype, "w")
        inputs = [w]
    u, rw, vec = plan.units, plan.rows_per_warp, plan.vec
    shape = tuple(i64(d) for d in plan.packed_shape)
    if transposed:
        def at(row, k):
            return w[k, row]
        rows, depth = 1, gates * hidden
    else:
        def at(row, k):
            return w[row, k]
        rows, depth = gates, hidden

    def value(b, wp, i, q, lane, v):
        if plan.mma:
            e = q * vec + v
            c = e % 4
            if plan.k_parts > 1:  # warp wp: row group wp % RG, part wp // RG of K
                wp, i = wp % plan.row_groups, wp // plan.row_groups * plan.warp_chunks + i
            k = i * (32 * vec) + e // 4 * 16 + lane % 4 * 2 + c % 2 + c // 2 * 8
            w_ = _block_row(at, rows, hidden, depth, u, b, wp * rw + lane // 4, k, dtype)
            return round_tf32(w_) if dtype == "float32" else w_
        kl = plan.k_lanes  # lane groups: lane g*KL + kl holds rows g*RW + q of the warp's
        return _block_row(at, rows, hidden, depth, u, b, wp * plan.warp_rows + lane // kl * rw + q,
                          (i * kl + lane % kl) * vec + v, dtype)

    return te.create_prim_func([*inputs, te.compute(shape, value, name="pack")])


def pack_fused_input(gates: int, hidden: int, depth: int, shape: tuple, plan,
                     dtype: str) -> tirx.PrimFunc:
    """W_ih [G*H, C] into a fused input projection's layout ``shape`` [B, KC, RL, 8, VEC]
    (:func:`rnncc.schedules.persistent.buffers.input_weight_shape`): block b, chunk c, row q,
    row group rg, element v holds W_ih[g*H + j, c*VEC + v] with r = rg*RL + q, g = r // U and
    j = b*U + r % U (zero outside)."""
    w = te.placeholder((i64(gates * hidden), i64(depth)), dtype, "w")
    _, _, rl, _, vec = shape

    def value(b, c, q, rg, v):
        return _block_row(lambda row, k: w[row, k], gates, hidden, depth, plan.units, b,
                          rg * rl + q, c * vec + v, dtype)

    return te.create_prim_func([w, te.compute(tuple(i64(d) for d in shape), value,
                                              name="pack")])


def _block_row(at, gates, hidden, depth, units, b, r, k, dtype):
    """W[g*H + j, k] (``at(g*H + j, k)``) for row r of block b (g = r // U, j = b*U + r % U),
    zero outside."""
    j = b * units + r % units
    valid = tvm.tirx.all(r < gates * units, j < hidden, k < depth)
    row = (r // units) * hidden + tvm.tirx.min(j, hidden - 1)
    return tvm.tirx.if_then_else(valid, at(row, tvm.tirx.min(k, depth - 1)),
                                 tirx.const(0, dtype))


def init_persistent(count: int, grids: int, batch: int, hidden: int, dtype: str, ws_dtype: str,
                    words: int, empty_tag: int, zero_h: bool = False,
                    rows: int = 0) -> tirx.PrimFunc:
    """The persistent kernel's buffers before its launch, all G = ``grids`` grids (directions
    or layers) in one kernel. Inputs: the ``count`` initial states [G, N, H] (``dtype``; with
    ``zero_h``, all but h, whose workspace starts at zero: a projection's h'). Outputs: their
    workspaces [2, G*N, H] (``ws_dtype``, grid g's sample n at row g*N + n; both slots hold
    the initial state: the kernel reads slot 0 and writes slot 1 before it reads it), then
    ``words`` tagged words [2, G*N, H] uint64 (the step in the high word, h's float32 value in
    the low word): slot 0 holds h before step 0 as step 0, slot 1 no step yet. ``rows``: a
    grid's rows of the workspaces where the kernel pads the batch past N (zeros past N;
    planner: "Padded batch")."""
    shape = (i64(grids), i64(batch), i64(hidden))
    given = [te.placeholder(shape, dtype, f"s{k}_initial") for k in range(zero_h, count)]
    rows = max(rows, batch)

    def initial(s, row, j):
        n = row % rows
        if rows == batch:
            return s[row // rows, n, j]
        return tvm.tirx.if_then_else(n < batch, s[row // rows, tvm.tirx.min(n, batch - 1), j],
                                     tirx.const(0, dtype))

    def body(slot, row, j):
        read = [initial(s, row, j) for s in given]
        states = [tirx.const(0, ws_dtype)] * zero_h + [_cast(v, ws_dtype) for v in read]
        # a zero h's bits as a constant: CUDA's reinterpret of a constant takes its address
        bits = tirx.const(0, "uint64") if zero_h else tirx.Cast("uint64", tvm.tirx.reinterpret(
            "uint32", _cast(states[0], "float32")))
        word = tvm.tirx.if_then_else(slot == 0, bits, tirx.const(empty_tag << 32, "uint64"))
        return states + [word] * words

    outs = te.compute((i64(2), i64(grids * rows), i64(hidden)), body, name="initial")
    return te.create_prim_func([*given, *(outs if count + words > 1 else [outs])])


# -- training: the backward pass (rnncc.lowering.training) -----------------------------------


def cell_step_backward(cell: Cell, batch: int, hidden: int, dtype: str, kept: tuple,
                       masked: bool = False, rec_parts: int = 1, projected: bool = False,
                       upto: int | None = None, grad_dtype: str | None = None,
                       selects: bool = False) -> tirx.PrimFunc:
    """The vector-Jacobian product of the cell's step for one time step, derived from the step
    (:mod:`rnncc.cells.autodiff`).

    Inputs: ``pre`` [N, P*H], what the training forward kept of the step's projections (biases
    included), its P ``kept`` parts ``(g, "sum" | "gi" | "gh")`` one after another; the
    previous states [N, H] each; ``dy`` [N, H] (the gradient of the step's output, in
    ``dtype``); ``dh_rec`` [N, H] (the gradient of the new h through the next step's recurrent
    product); ``carry`` [N, H] a state (the gradients of the new states through the next step's
    cell); ``masked``: then ``active`` [N] int32. Outputs: ``dgi0 .. dgi{G-1}`` and, unless
    every gate is kept as a sum (then the gradients of gi and gh are the same), ``dgh0 ..
    dgh{G-1}`` [N, H]; then the gradients of the previous states through this step's cell
    [N, H] each. Where a step is past its sample's length the states went through unchanged:
    the gradients of the projections are zero and those of the states pass through. All but
    ``dy`` in the accumulation dtype, and the projections' gradients in ``grad_dtype`` where
    given (:func:`rnncc.dtypes.projection_grad_dtype`). ``rec_parts`` S > 1: ``dh_rec`` is
    [S, N, H], the recurrent product's slices (:func:`gemm_parts`), added here. A cell with
    ``params``: then the inputs go on with its parameters [H] each (the accumulation dtype, as
    :func:`cell_step`'s: a half layer's converted before the steps) and the sums of their
    gradients over the steps so far [N, H] each, and the outputs with those sums plus this
    step's.
    ``projected`` (LSTMP: h = W_hr h', the cell reads h only through W_hh): h is neither read
    nor carried here: ``dy``, ``dh_rec`` and h's carry give way to ``dh_cell`` [N, H] (the
    gradient of the cell's h', :func:`projection_backward` then a product by W_hr), and the
    states, their carries and the outputs are the others' only.

    A step that takes recurrent products of its values (:func:`rnncc.cells.ops.recurrent`;
    ``kept`` has their values, ``(k, "product")``): the gradient of a product p = W_g x + b_g
    gives x's, dx = W_g^T dp, a GEMM of the caller's: ``dproduct<gate>`` [N, H] each follow the
    parameters, in the reverse of the order the step takes the products; the outputs end with
    each product's argument x [N, H] (in the step's order: W_g's gradient takes dp^T x). With
    ``upto`` (a gate), only the products after it are given, and the output is dp of that
    gate's [N, H] alone (zero where not active): what its GEMM and W_g's gradient take.
    ``selects`` (``masked``, for CUDA): as :func:`cell_step`'s (a masked LSTM 256 step at batch
    4 had 752 instructions with 44 MUFU where the unmasked one has 280 and 14).
    """
    from ..cells import autodiff

    acc = accum_dtype(dtype)
    shape = (i64(batch), i64(hidden))
    own = cell.states[1:] if projected else cell.states  # the states read and carried here
    pre = te.placeholder((i64(batch), i64(len(kept) * hidden)), acc, "pre")
    states = [te.placeholder(shape, acc, f"{s}_prev") for s in own]
    if projected:
        dh_cell = te.placeholder(shape, acc, "dh_cell")
        seeds = [dh_cell]
    else:
        dy = te.placeholder(shape, dtype, "dy")
        dh_rec = te.placeholder(parts_shape(rec_parts, shape), acc, "dh_rec")
        seeds = [dy, dh_rec]
    carry = [te.placeholder(shape, acc, f"d{s}_carry") for s in own]
    active = te.placeholder((i64(batch),), "int32", "active") if masked else None
    params = [te.placeholder((i64(hidden),), acc, f"param_{p}") for p in cell.params]
    graph = autodiff.trace(cell)
    after = autodiff.product_gates(graph)[::-1]
    after = after[:after.index(upto)] if upto is not None else after
    given = {g: te.placeholder(shape, acc, f"dproduct{g}") for g in after}
    summed = ([te.placeholder(shape, acc, f"d{p}_sum") for p in cell.params]
              if upto is None else [])
    backend = autodiff.PrimExprs(acc)

    def body(n, j):
        found = {}
        values = [s[n, j] for s in states]
        if projected:  # h's value does not matter: the step does not read it
            d_h, values, others = dh_cell[n, j], [tirx.const(0, acc)] + values, carry
        else:
            d_h, others = _cast(dy[n, j], acc) + parts_sum(dh_rec, n, j) + carry[0][n, j], carry[1:]
        projections, previous, of_params = autodiff.kept_vjp(
            graph, kept, lambda i: pre[n, i * hidden + j], values,
            [d_h] + [c[n, j] for c in others], backend, [_cast(p[j], acc) for p in params],
            found)
        zero = tirx.const(0, acc)
        arguments = [found.get(k, zero) for k in range(len(graph.products))]
        previous = previous[1:] if projected else previous
        if active is not None:
            live = active[n] != 0
            passed = ([] if projected else [parts_sum(dh_rec, n, j) + carry[0][n, j]]) + [
                c[n, j] for c in others]
            chosen = _select if selects else tvm.tirx.if_then_else
            projections = [chosen(live, v, zero) for v in projections]
            previous = [chosen(live, v, p) for v, p in zip(previous, passed)]
            of_params = [chosen(live, v, zero) for v in of_params]
        projections = [_cast(v, grad_dtype or acc) for v in projections]
        return (projections + previous + [s[n, j] + v for s, v in zip(summed, of_params)]
                + arguments)

    reduced = RowReductions(shape, body, given)
    if upto is None:
        outs = te.compute(shape, lambda n, j: reduced(n, j), name="cell_backward")
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    else:
        adjoint = reduced.argument(upto, "adjoint")
        outs = [te.compute(shape, lambda n, j: adjoint[n, j] if active is None else
                           tvm.tirx.if_then_else(active[n] != 0, adjoint[n, j],
                                                 tirx.const(0, acc)), name="dproduct")]
    extra = [active] if masked else []
    return te.create_prim_func([pre, *states, *seeds, *carry, *extra, *params,
                                *given.values(), *summed, *outs])


def projection_backward(batch: int, width: int, dtype: str, masked: bool,
                        rec_parts: int = 1) -> tirx.PrimFunc:
    """A step's projected h (LSTMP) backwards: inputs ``dy`` [N, P] (``dtype``), ``dh_rec``
    [N, P] (through the next step's recurrent product; [S, N, P] slices where ``rec_parts``
    S > 1), ``carry`` [N, P] (h's gradient passed through later steps past the sample's
    length) and, ``masked``, ``active`` [N] int32; outputs ``dhp`` [N, P], the gradient of
    this step's W_hr h' (zero past the length), and the next carry (zero within the length:
    the step's cell does not read h; else dh_rec + carry, dy dropped as y was zero)."""
    acc = accum_dtype(dtype)
    shape = (i64(batch), i64(width))
    dy = te.placeholder(shape, dtype, "dy")
    dh_rec = te.placeholder(parts_shape(rec_parts, shape), acc, "dh_rec")
    carry = te.placeholder(shape, acc, "carry")
    active = te.placeholder((i64(batch),), "int32", "active") if masked else None

    def body(n, j):
        through = parts_sum(dh_rec, n, j) + carry[n, j]
        zero = tirx.const(0, acc)
        if active is None:
            return [_cast(dy[n, j], acc) + through, zero]
        live = active[n] != 0
        return [tvm.tirx.if_then_else(live, _cast(dy[n, j], acc) + through, zero),
                tvm.tirx.if_then_else(live, zero, through)]

    dhp, nxt = te.compute(shape, body, name="projection_backward")
    return te.create_prim_func([dy, dh_rec, carry, *([active] if masked else []), dhp, nxt])


def initial_state_grads(count: int, batch: int, hidden: int, dtype: str, rec_parts: int = 1
                        ) -> tirx.PrimFunc:
    """The gradients of the initial states, in ``dtype``, from the first step's: ``carry``
    [N, H] a state (through the cell) and ``dh_rec`` [N, H] (through the recurrent product,
    added to h's; [S, N, H] slices where ``rec_parts`` S > 1)."""
    acc = accum_dtype(dtype)
    shape = (i64(batch), i64(hidden))
    carry = [te.placeholder(shape, acc, f"carry{i}") for i in range(count)]
    dh_rec = te.placeholder(parts_shape(rec_parts, shape), acc, "dh_rec")
    outs = te.compute(shape, lambda n, j: [_cast(carry[0][n, j] + parts_sum(dh_rec, n, j),
                                                 dtype)]
                      + [_cast(c[n, j], dtype) for c in carry[1:]], name="initial_grads")
    return te.create_prim_func([*carry, dh_rec, *(outs if count > 1 else [outs])])


def transpose(rows: int, cols: int, dtype: str) -> tirx.PrimFunc:
    """``out[j, i] = a[i, j]``, a [R, C] and out [C, R] (a packed weight in the other
    orientation, for the backward products)."""
    a = te.placeholder((i64(rows), i64(cols)), dtype, "a")
    out = te.compute((i64(cols), i64(rows)), lambda j, i: a[i, j], name="transposed")
    return te.create_prim_func([a, out])


def zeros(shape: tuple, dtype: str) -> tirx.PrimFunc:
    """Zeros of ``dtype`` in ``shape``: the persistent kernel's uint32 counters (a barrier's, one
    a batch group; a wavefront's progress), a bias of zeros for the products that have none, a
    gradient before the first step adds to it, dx before the rows within the samples' lengths
    are written (``shape`` with a run-time T)."""
    out = te.compute(tuple(d if isinstance(d, tirx.Var) else i64(d) for d in shape),
                     lambda *i: tirx.const(0, dtype), name="zeros")
    return te.create_prim_func([out])


def weight_gradient(rows, outputs: int, depth: int, dtype: str, a_dtype: str,
                    g_dtype: str | None = None, batch: int | None = None) -> tirx.PrimFunc:
    """``dw[o, k] = sum_m g[m, o] * a[m, k]`` over the M = ``rows`` (a run-time T*N) rows of
    all steps: a weight's gradient from its product's gradients ``g`` [M, O] (``g_dtype``,
    default the accumulation dtype) and the product's inputs ``a`` [M, K] (``a_dtype``); ``dw``
    [O, K] in ``dtype``. Blocks "weight_grad" (the reduction, in the accumulation dtype) and
    "weight_grad_out" (the cast).

    ``batch`` N given: the sum is over the rows m = t*N + n within the samples' lengths (t <
    lengths[n]) only, which come after ``a`` with ``ends`` [N] int32 (:func:`length_ends`),
    so that a schedule may visit only those rows, laid out sample after sample."""
    acc = accum_dtype(dtype)
    g = te.placeholder((rows, i64(outputs)), g_dtype or acc, "g")
    a = te.placeholder((rows, i64(depth)), a_dtype, "a")
    r = te.reduce_axis((i64(0), rows), "m")
    given = ([te.placeholder((i64(batch),), "int32", name) for name in ("lengths", "ends")]
             if batch is not None else [])

    def term(o, k):
        product = _cast(g[r, o], acc) * _cast(a[r, k], acc)
        if batch is None:
            return product
        n_ = i64(batch)
        inside = tvm.tirx.floordiv(r, n_) < given[0][tvm.tirx.floormod(r, n_)].astype("int64")
        return tvm.tirx.if_then_else(inside, product, tirx.const(0, acc))

    prod = te.compute((i64(outputs), i64(depth)),
                      lambda o, k: te.sum(term(o, k), axis=r), name="weight_grad")
    out = te.compute(prod.shape, lambda o, k: _cast(prod[o, k], dtype), name="weight_grad_out")
    return te.create_prim_func([g, a, *given, out])


def column_sum(rows, outputs: int, dtype: str, g_dtype: str | None = None) -> tirx.PrimFunc:
    """``db[o] = sum_m g[m, o]`` over the M = ``rows`` rows of all steps (a bias's gradient);
    ``g`` in ``g_dtype`` (default the accumulation dtype, which the sum is in), ``db`` [O] in
    ``dtype``."""
    acc = accum_dtype(dtype)
    g = te.placeholder((rows, i64(outputs)), g_dtype or acc, "g")
    r = te.reduce_axis((i64(0), rows), "m")
    total = te.compute((i64(outputs),), lambda o: te.sum(_cast(g[r, o], acc), axis=r),
                       name="column_sum")
    out = te.compute(total.shape, lambda o: _cast(total[o], dtype), name="column_sum_out")
    return te.create_prim_func([g, out])
