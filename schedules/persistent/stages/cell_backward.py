"""Stage: the cell's derivative, on the (unit, batch) pairs of a thread (the backward kernel).

Thread ``tx`` of block ``bx`` takes its IT pairs (``KernelSpec.pair``) through the steps
backwards (loop step t is sequence step T - 1 - t). It keeps the gradients of their states
through the cell (``carry``; h's starts as dh_n, the others as theirs) in registers for the
whole sequence; at the start of each step it prefetches what the training forward kept of the
step (the parts of its projections, ``pre``, and the previous states) and dy; once dh's part
through the recurrence (dGH_{t+1} by W_hh) is in ``hs``, it computes the vector-Jacobian
product of the cell's step (:mod:`rnncc.cells.autodiff`): the gradients of the step's
projections, written to dGI (and dGH) and published (dGH's G values a pair) for the next
step's product, and those of the previous states, carried. A cell's per-unit parameters are
loaded once a pair; their gradients are summed over the steps in registers and written once, a
batch row each (the entry sums the rows). Past its sample's length a pair's step went through
unchanged in the forward: its projections' and parameters' gradients are zero and the states'
pass through (dy there is dropped: y was zero).

A step that takes a recurrent product of a value (``ops.recurrent``: p = W_g x + b_g) takes
its derivative in two rounds. First (:func:`argument`) the pairs' dh through the recurrence is
kept (``rec``) and the derivative evaluated up to the product: its value's gradient dP, stored
for W_g's gradient and published as gate g's part of the exchanged vector (the other gates'
zero), so that the next product gives W_g^T dP for the block's units. Then (:func:`apply`)
the rest of the derivative takes that as the gradient of x (the product's transposed), and
stores x for W_g's gradient.
"""

from __future__ import annotations

from tvm.script import tirx as T

from rnncc.cells import autodiff, ops

from .cell import FAST_FUNCTIONS, Reached, each_pair, store


def load_constants(spec, d_final, lengths, params, r, ln, bx, tx):
    """The final states' gradients (the first carries), the samples' lengths and the cell's
    per-unit parameters (``params``: their buffers [H]; their gradients' sums start at zero),
    once."""
    states = spec.states

    def body(it, n, j):
        for k in range(states):
            store(r.carry, T.Cast("float32", d_final[k][0, spec.batch_row(bx, n), j]),
                   it * states + k)
        for k, vector in enumerate(params):
            store(r.pv, T.Cast("float32", vector[j]), it * spec.params + k)
            store(r.dp, T.float32(0), it * spec.params + k)
        if spec.lengths:
            store(ln, lengths[spec.batch_row(bx, n)], it)
    each_pair(spec, bx, tx, body)


def prefetch(spec, parts, pre, s, dy, r, t, t_len, bx, tx):
    """Step T - 1 - t's kept parts (``parts`` P of them), previous states and dy."""
    h, states = spec.hidden, spec.states
    at = t_len - 1 - t

    def body(it, n, j):
        row = spec.batch_row(bx, n)
        for i in range(parts):
            store(r.pre, pre[at, row, i * h + j], it * parts + i)
        for k in range(states):
            store(r.sp, s[k][at, row, j], it * states + k)
        store(r.dy, T.Cast("float32", dy[at, row, j]), it)
    each_pair(spec, bx, tx, body)


def _vjp(spec, graph, kept, r, it, seeds, transposed=None, found=None):
    """The cell's derivative at pair ``it`` (:func:`rnncc.cells.autodiff.kept_vjp`);
    ``transposed(gate, dp)``: the transposed product of a step's product of a value."""
    parts, states, count = len(kept), spec.states, spec.params
    with ops.lowered_with(FAST_FUNCTIONS), ops.reducing_with(None, transposed):
        return autodiff.kept_vjp(
            graph, kept, lambda i: r.pre[it * parts + i],
            [r.sp[it * states + k] for k in range(states)], seeds,
            autodiff.PrimExprs("float32"), [r.pv[it * count + k] for k in range(count)],
            found)


def _live(spec, ln, it, at):
    """Whether step ``at`` is within pair ``it``'s sample's length (None: no lengths)."""
    return at < T.Cast("int64", ln[it]) if spec.lengths else None


def argument(spec, graph, kept, gate, dprod, hs, r, ln, publish, t, t_len, bx, tx):
    """First round of a step that takes gate ``gate``'s recurrent product of a value: dh's
    recurrent part (in ``hs``, as :func:`apply` takes it) kept in ``rec``; the gradient dP of
    the product's value (zero past the sample's length) to ``dprod`` [T,N,H] and handed to
    ``publish(value, row, column)`` at gate ``gate``'s column, zeros at the other gates'."""
    gates, states, units, h = graph.cell.gates, spec.states, spec.plan.units, spec.hidden
    at = t_len - 1 - t

    def reached(g, dp):
        raise Reached(dp)

    def body(it, n, j):
        u = j - spec.place(bx) * units
        store(r.rec, hs[u * spec.local_batch + n], it)
        carry = [r.carry[it * states + k] for k in range(states)]
        try:
            _vjp(spec, graph, kept, r, it, [r.dy[it] + r.rec[it] + carry[0]] + carry[1:],
                 reached)
        except Reached as found:
            live = _live(spec, ln, it, at)
            dp = T.Bind(found.value if live is None else
                        T.if_then_else(live, found.value, T.float32(0)))
            row = spec.batch_row(bx, n)
            store(dprod, dp, at, row, j)
            for g in range(gates):
                publish(dp if g == gate else T.float32(0), spec.state_row(bx, n), g * h + j)
            return
        raise ValueError(f"cell {graph.cell.name!r} took no recurrent product")
    each_pair(spec, bx, tx, body)


def apply(spec, graph, kept, dgi, dgh, hs, r, ln, publish, t, t_len, bx, tx, parg=None):
    """The cell's derivative on the pairs (``graph``: the cell's traced step; ``kept``: the
    parts of ``pre``, :func:`rnncc.lowering.training.kept_parts`), dh's recurrent part from
    ``hs`` ([U, N/NG], row u); dGI[T-1-t] (and dGH, where ``dgh`` is another buffer) written,
    dGH's values handed to ``publish(value, row, column)``, the carries replaced and the
    per-unit parameters' gradients added to their sums. ``parg`` [T,N,H]: the second round of
    a step that takes a recurrent product of a value (:func:`argument`): dh's recurrent part
    is in ``rec``, ``hs`` holds the product's transposed, and its argument goes to ``parg``."""
    gates, states, units, h = graph.cell.gates, spec.states, spec.plan.units, spec.hidden
    summed, count = dgh.same_as(dgi), spec.params
    at = t_len - 1 - t

    def body(it, n, j):
        u = j - spec.place(bx) * units
        carry = [r.carry[it * states + k] for k in range(states)]
        rec = hs[u * spec.local_batch + n] if parg is None else r.rec[it]
        seeds = [r.dy[it] + rec + carry[0]] + carry[1:]
        found = {}
        projections, previous, of_params = _vjp(
            spec, graph, kept, r, it, seeds, None if parg is None else (
                lambda g, dp: hs[u * spec.local_batch + n]), found)
        # bound before any select: a select of an expression is a branch of it, and the
        # values share their terms (the gates' functions)
        projections = [T.Bind(v) for v in projections]
        previous = [T.Bind(v) for v in previous]
        of_params = [T.Bind(v) for v in of_params]
        if spec.lengths:
            live = _live(spec, ln, it, at)
            projections = [T.Bind(T.if_then_else(live, v, T.float32(0))) for v in projections]
            of_params = [T.Bind(T.if_then_else(live, v, T.float32(0))) for v in of_params]
            passed = [rec + carry[0]] + carry[1:]
            previous = [T.Bind(T.if_then_else(live, v, p)) for v, p in zip(previous, passed)]
        row = spec.batch_row(bx, n)
        if parg is not None:
            store(parg, found[0], at, row, j)
        for g in range(gates):
            store(dgi, T.Cast(dgi.dtype, projections[g]), at, row, g * h + j)
            if not summed:
                store(dgh, T.Cast(dgh.dtype, projections[gates + g]), at, row, g * h + j)
            publish(projections[g if summed else gates + g], spec.state_row(bx, n), g * h + j)
        for k in range(states):
            store(r.carry, previous[k], it * states + k)
        for k in range(count):
            store(r.dp, r.dp[it * count + k] + of_params[k], it * count + k)
    each_pair(spec, bx, tx, body)


def store_initial(spec, d_initial, dps, hs, r, bx, tx):
    """The initial states' gradients: the carries, h's plus its part through the first step's
    recurrent product (in ``hs``); and the per-unit parameters' gradients summed over the
    steps, to ``dps`` [params, N, H] (None without them)."""
    states, units = spec.states, spec.plan.units

    def body(it, n, j):
        u = j - spec.place(bx) * units
        for k in range(states):
            value = r.carry[it * states + k]
            if k == 0:
                value = value + hs[u * spec.local_batch + n]
            store(d_initial[k], T.Cast(spec.dtype, value), 0, spec.batch_row(bx, n), j)
        for k in range(spec.params):
            store(dps, r.dp[it * spec.params + k], k, spec.batch_row(bx, n), j)
    each_pair(spec, bx, tx, body)
