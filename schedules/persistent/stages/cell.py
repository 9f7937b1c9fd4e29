"""Stage: the cell, on the (unit, batch) pairs of a thread (planner: "Work split").

Thread ``tx`` of block ``bx`` applies the cell to its IT pairs (``KernelSpec.pair``): it
keeps their b_hh and states in registers (``bh``, ``st``) for the whole sequence, prefetches
their input projections (``gi``) at the start of each step, and, once the gate sums are in
``hs``, computes the new states, writes y and hands h_t to the exchange. Python loops over the
pairs, gates and states, so every index into the register arrays is a constant.

The cell builds sigmoid and exp with the GPU's exponential and division (:data:`FAST_FUNCTIONS`).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from rnncc.cells import ops


def _fast_exp(x):
    """e ** x by the GPU's exponential unit (``__expf``: CUDA gives at most 2 + |1.16 x| ulp),
    for float32; None (TVM's ``expf``) otherwise."""
    if ops.dtype_of(x) != "float32":
        return None
    return tirx.call_pure_extern("float32", "__expf", x)


def _fast_sigmoid(x):
    """1 / (1 + e ** -x) with :func:`_fast_exp` and ``__fdividef`` (2 ulp; 0 once the
    denominator passes 2 ** 126, where the exact quotient is below float32's normal range)."""
    if ops.dtype_of(x) != "float32":
        return None
    one = tirx.const(1.0, "float32")
    return tirx.call_pure_extern("float32", "__fdividef", one, one + _fast_exp(tirx.const(
        0.0, "float32") - x))


#: The cell's point-wise functions as the kernel builds them: the per-step cell sits on the
#: critical path of every step, and IEEE ``expf`` with an IEEE division cost about twice the
#: cycles (measured on an H200: 800 -> 410 cycles a step for an LSTM cell), for errors far below
#: the float32 tolerance of the outputs. ``tanh`` keeps CUDA's accurate ``tanhf``: its fast form
#: (``tanh.approx.f32``, 2 ** -11 relative) gave output errors of 5e-6, too near the 1e-5 bound.
FAST_FUNCTIONS = {"exp": _fast_exp, "sigmoid": _fast_sigmoid}


def store(buffer, value, *indices):
    """``buffer[indices] = value``, where the indices are Python values and PrimExprs."""
    T.buffer_store(buffer, value, list(indices))


def each_pair(spec, bx, tx, body):
    """``body(it, n, j)`` under the guard of every pair of thread ``tx`` of block ``bx``."""
    for it in range(spec.plan.items):
        valid, n, j = spec.pair(it, bx, tx)
        with T.If(valid):
            with T.Then():
                body(it, n, j)


def given_row(spec, bx, n, write):
    """``write(row)`` for block ``bx``'s batch row n (``row``: the caller's), where the plan
    pads the batch only if the row is one of the caller's."""
    given, row = spec.given(bx, n)
    if given is None:
        write(row)
        return
    with T.If(given):
        with T.Then():
            write(row)


def load_constants(spec, b_hh, s, lengths, bh, st, ln, bx, tx, params=(), pv=None):
    """The pairs' b_hh, initial states (``s``: the states' buffers), their units' per-unit
    parameters of the cell (``params``, into ``pv``) and, where the kernel takes them, their
    samples' lengths into registers, once."""
    g_count, states = spec.gates, spec.states

    def body(it, n, j):
        for g in range(g_count):
            store(bh, T.Cast("float32", b_hh[spec.gate_column(bx, g, j)]), it * g_count + g)
        for k, vector in enumerate(params):
            store(pv, T.Cast("float32", vector[spec.output_column(bx, j)]),
                  it * spec.params + k)
        for k in range(states):
            store(st, s[k][0, spec.state_row(bx, n), j], it * states + k)
        if spec.lengths:
            given, row = spec.given(bx, n)
            store(ln, lengths[row] if given is None else T.if_then_else(
                given, lengths[row], T.int32(0)), it)
    each_pair(spec, bx, tx, body)


def _length(spec, ln, it):
    return ln[it] if spec.lengths else None


def prefetch(spec, xp, gi, ln, t, t_len, bx, tx, first=None):
    """Loop step t's input projections of the pairs (their sequence step: the reverse
    direction's runs back), plus, at step 0, ``first``'s
    (``spec.first``); zeros for a padded batch's rows past N."""

    def body(it, n, j):
        at = spec.step(bx, t, t_len, _length(spec, ln, it))
        given, row = spec.given(bx, n)
        for g in range(spec.gates):
            column = spec.gate_column(bx, g, j)
            value = xp[at, row, column]
            if given is not None:
                value = T.if_then_else(given, value, T.float32(0))
            if spec.first:
                value = value + T.if_then_else(t == 0, first[row, column], T.float32(0))
            store(gi, value, it * spec.gates + g)
    each_pair(spec, bx, tx, body)


class Reached(Exception):
    """The step reached its recurrent product (:func:`argument`; or, in its derivative, that
    product's transposed), of this value."""

    def __init__(self, value):
        super().__init__()
        self.value = value


def _sum(spec, hs, bh, it, n, u, g):
    """Gate g's recurrent sum of pair ``it`` from ``hs``, b_hh added."""
    return hs[(g * spec.plan.units + u) * spec.local_batch + n] + bh[it * spec.gates + g]


def argument(spec, cell, hs, gi, bh, st, pv, gs, publish, bx, tx):
    """A step that takes a recurrent product of one of its values (``spec.product``), first
    round: the pairs' gate sums of h (``hs``, b_hh added) kept in ``gs``, and the value the
    product multiplies, the step evaluated up to it, handed to ``publish(value, row, j)`` (the
    exchange of that value)."""
    g_count = spec.gates

    def taken(gate, x):
        raise Reached(x)

    def body(it, n, j):
        u = j - spec.place(bx) * spec.plan.units
        for g in range(g_count):
            store(gs, _sum(spec, hs, bh, it, n, u, g), it * g_count + g)
        try:
            with ops.lowered_with(FAST_FUNCTIONS), ops.reducing_with(None, taken):
                evaluate(spec, cell, gi, [gs[it * g_count + g] for g in range(g_count)], st,
                         pv, it)
        except Reached as found:
            publish(found.value, spec.state_row(bx, n), j)
            return
        raise ValueError(f"cell {cell.name!r} took no recurrent product")
    each_pair(spec, bx, tx, body)


def evaluate(spec, cell, gi, sums, st, pv, it):
    """``cell``'s step on pair ``it``: its input projections, the recurrent ``sums`` (b_hh
    added), its states and per-unit parameters."""
    g_count, states = spec.gates, spec.states
    return cell.evaluate([gi[it * g_count + g] for g in range(g_count)], sums,
                         [st[it * states + k] for k in range(states)],
                         [pv[it * spec.params + k] for k in range(spec.params)])


def apply(spec, cell, y, hs, gi, bh, st, ln, publish, t, t_len, bx, tx, keep=None, pv=None,
          gs=None, mv=None, below=None):
    """``cell`` (an :class:`rnncc.cells.Cell`) on the pairs: the new states from the gate sums
    in ``hs`` ([Wn*RW, N/NG], row g*U + u), b_hh and the input projections; h_t to y[t] and to
    ``publish(h_t, row, j)`` (the exchange); the states stay in registers. With lengths
    (``ln``), past its sample's length a pair keeps its states (and publishes them) and writes
    zero to y. y[t] is the pair's sequence step (the reverse direction's runs back).
    ``keep(gates_i, gates_h, products, new, step, row, j)``: a training forward's
    (:mod:`.history`).
    ``pv``: the pairs' per-unit parameters of the cell (:func:`load_constants`). ``gs``: the
    second round of a step that takes a recurrent product of a value (:func:`argument`): the
    sums of h are there, ``hs`` holds those of the value (the product: its gate's, b_hh
    added). ``mv``: the step's row means (:mod:`.means`). With layers (a wavefront), y is the
    last layer's [T, N, H] and ``below`` [T, N, (L-1)*H] the others' (the next one's x)."""
    from .means import reader

    g_count, states, units = spec.gates, spec.states, spec.plan.units

    def body(it, n, j):
        u = j - spec.place(bx) * units
        gates_i = [gi[it * g_count + g] for g in range(g_count)]
        gates_h = [_sum(spec, hs, bh, it, n, u, g) if gs is None else gs[it * g_count + g]
                   for g in range(g_count)]

        def product(gate, x):
            return _sum(spec, hs, bh, it, n, u, gate)

        with ops.lowered_with(FAST_FUNCTIONS), ops.reducing_with(
                reader(spec, mv, n) if mv is not None else None,
                product if gs is not None else None):
            new = cell.evaluate(gates_i, gates_h, [st[it * states + k] for k in range(states)],
                                [pv[it * spec.params + k] for k in range(spec.params)])
        live = t < T.Cast("int64", ln[it]) if spec.lengths else None
        if live is not None:
            # the values bound before the selects: a select of an expression is a branch of
            # it, and the outputs share the gates (each computed them again: LSTM 256 at batch
            # 4, 20 MUFU instructions in the kernel against 10 without lengths)
            values = [T.Bind(v) for v in new]
            new = [T.if_then_else(live, v, st[it * states + k]) for k, v in enumerate(values)]
        # every new state bound, once, before the stores: a new state that reads a previous one
        # stored before it (a user's c' from h) reads the previous value, and no store
        # computes it again (the exchange's device functions clobber memory, after which an
        # unbound h was the cell again from shared memory: with the cluster exchange once
        # for each block it puts h into)
        new = [T.Bind(v) for v in new]
        out = new[0] if live is None else T.if_then_else(live, values[0], T.float32(0))
        _store_y(spec, y, below, T.Cast(spec.dtype, out),
                 spec.step(bx, t, t_len, _length(spec, ln, it)), bx, n, j)
        publish(new[0], spec.state_row(bx, n), j)
        if keep is not None:
            taken = [] if gs is None else [_sum(spec, hs, bh, it, n, u, spec.product)]
            keep(gates_i, gates_h, taken, new, spec.step(bx, t, t_len, _length(spec, ln, it)),
                 spec.batch_row(bx, n), j)
        for k in range(states):
            store(st, new[k], it * states + k)
    each_pair(spec, bx, tx, body)


def _store_y(spec, y, below, value, step, bx, n, j):
    """y[step, row] of block ``bx``'s batch row n, unit j: in a wavefront the last layer's into
    ``y``, the others' into ``below`` (a branch uniform over the block); nothing for a padded
    batch's rows past N."""
    if spec.layers == 1:
        given_row(spec, bx, n, lambda row: store(y, value, step, row, spec.output_column(bx, j)))
        return
    row = spec.batch_row(bx, n)
    with T.If(spec.layer(bx) == spec.layers - 1):
        with T.Then():
            store(y, value, step, row, j)
        with T.Else():
            store(below, value, step, row, spec.output_column(bx, j))


def store_final_states(spec, s, finals, st, t_len, bx, tx):
    """The final states: with ``finals`` (``spec.finals``: [grids, N, H] each), all of them,
    in the kernel's dtype (a padded batch's first N rows); else those other than h into their
    workspaces ``s``, slot T % 2 (h_T is where the last step published it)."""
    if finals is None and spec.states == 1:
        return

    def body(it, n, j):
        for k in range(0 if finals is not None else 1, spec.states):
            value = st[it * spec.states + k]
            if finals is not None:
                final = T.Cast(spec.dtype, value)
                given_row(spec, bx, n, lambda row, k=k, final=final: store(
                    finals[k], final, spec.grid(bx), row, j))
            else:
                store(s[k], value, t_len % 2, spec.state_row(bx, n), j)
    each_pair(spec, bx, tx, body)
