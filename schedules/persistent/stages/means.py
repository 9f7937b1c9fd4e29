"""Stage: the row means a cell's step takes (``ops.mean``; the layer-normalised cells), a
round of the step a level of them.

A mean is over the H units of a batch row, which several blocks share. The step's means come
in levels (:func:`rnncc.cells.autodiff.mean_levels`: a mean, then what depends on it, as a
layer norm's variance on its mean); round r takes level r's: every thread evaluates the step
of its pairs up to them (the means before read from ``mv``) and publishes each one's argument
as it publishes h (:func:`.exchange.publish_value`); after the round's barrier each block
loads the whole row's values of each (tagged words, or plain behind the counter barrier), each
thread summing the ones it loads a batch row, then the warps' sums (shuffles) and the block's
(shared memory) give the row's sum: ``mv[k*N + n]`` is mean k.

A layer norm's variance (``spec.variances``: mean k the variance about mean m) is taken in
m's round, not the next: in that round the step is evaluated with m as each unit's own
argument x_j, so that k's argument is v_j, the unit's values' squares about x_j; after the
barrier, the block sums v_j, then loads the x_j again (no new exchange) and adds (x_j - m)^2:
var = mean_j(v_j + (x_j - m)^2), the variance about m (Chan et al.'s pairwise form, as
stable as the two rounds it replaces). A layer norm of one value a unit (LN-LSTM's of c) has
v_j = 0, neither exchanged nor summed. LN-LSTM's step takes 2 rounds so, LN-GRU's 1 (4 and 2
before).
"""

from __future__ import annotations

import itertools
from functools import partial

from tvm.script import tirx as T

from rnncc.cells import ops

from .. import device
from . import cell as cell_stage
from . import exchange


@T.macro
def _accumulate(spec, racc, e, value):
    racc[e // spec.width] = racc[e // spec.width] + value


@T.macro
def _row_sums(spec, racc, red, mv, r, warp, lane, tx):
    """``mv[r*N + n]``: the mean over H of what the block's threads summed in ``racc``."""
    n_, warps, threads = T.meta_var((spec.local_batch, spec.plan.warps, spec.plan.threads))
    for n in T.unroll(n_):
        for m in T.unroll(5):
            racc[n] = racc[n] + device.shfl_xor(racc[n], T.shift_left(1, 4 - m))
        if lane == 0:
            red[warp * n_ + n] = racc[n]
    T.tvm_storage_sync("shared")
    for e in spec.spread(n_):
        if e * threads + tx < n_:
            racc[0] = T.float32(0)
            for w in range(warps):
                racc[0] = racc[0] + red[w * n_ + e * threads + tx]
            mv[r * n_ + e * threads + tx] = racc[0] * T.float32(1.0 / spec.hidden)
    T.tvm_storage_sync("shared")


@T.macro
def _accumulate_squares(spec, racc, mv, m, e, value):
    """Add (value - mean m)^2 for a unit of the row (not the exchange's padding)."""
    n = T.meta_var(e // spec.width)
    racc[n] = racc[n] + T.if_then_else(
        e % spec.width < spec.hidden,
        (value - mv[m * spec.local_batch + n]) * (value - mv[m * spec.local_batch + n]),
        T.float32(0))


@T.macro
def _sum_value(spec, aw, tv, racc, red, mv, r, t, bx, tx, warp, lane):
    for n in T.unroll(spec.local_batch):
        racc[n] = T.float32(0)
    exchange.stage_value(spec, aw, tv, partial(_accumulate, spec, racc), t, bx, tx)
    _row_sums(spec, racc, red, mv, r, warp, lane, tx)


@T.macro
def _sum_variance(spec, aw, aw_mean, tv, racc, red, mv, r, m, t, bx, tx, warp, lane):
    """``mv[r*N + n]``: the variance about mean m (in ``mv`` already) from the units' squares
    about their own arguments (``aw``; None: they are 0) and those arguments again
    (``aw_mean``)."""
    for n in T.unroll(spec.local_batch):
        racc[n] = T.float32(0)
    if aw is not None:
        exchange.stage_value(spec, aw, tv, partial(_accumulate, spec, racc), t, bx, tx)
    exchange.stage_value(spec, aw_mean, tv, partial(_accumulate_squares, spec, racc, mv, m), t,
                         bx, tx)
    _row_sums(spec, racc, red, mv, r, warp, lane, tx)


def _arguments(spec, cell, b, level, publish, bx, tx):
    """Round ``level``: the pairs' step evaluated up to the means of that level (the means
    before it from ``mv``; a mean whose variance is of this level: the unit's own argument),
    each mean's argument handed to ``publish[k](value, row, j)``."""
    done = [k for lower in spec.levels[:spec.levels.index(level)] for k in lower]
    centres = {m for k, m, _ in spec.variances if k in level}

    def body(it, n, j):
        u = j - spec.place(bx) * spec.plan.units
        calls, found = itertools.count(), {}

        def mean(x):
            k = next(calls)
            if k in done:
                return b.mv[k * spec.local_batch + n]
            if k in level:
                found[k] = x
                if k in centres:  # its variance's argument about x itself
                    return x
            return T.float32(0)  # a later round's: what follows is not this round's

        sums = [cell_stage._sum(spec, b.hs, b.bh, it, n, u, g) for g in range(spec.gates)]
        with ops.lowered_with(cell_stage.FAST_FUNCTIONS), ops.reducing_with(mean, None):
            cell_stage.evaluate(spec, cell, b.gi, sums, b.st, b.pv, it)
        if sorted(found) != sorted(level):
            raise ValueError(f"cell {cell.name!r} took means {sorted(found)} of round {level}")
        for k in publish:
            publish[k](found[k], spec.state_row(bx, n), j)
    cell_stage.each_pair(spec, bx, tx, body)


def rounds(spec, cell, g, b, t, bx, tx, warp, lane):
    """Step t's means, a round a level of them (``spec.levels``; builds TIR: a Python loop
    over the rounds)."""
    about = {k: m for k, m, _ in spec.variances}
    zero = {k for k, _, alone in spec.variances if alone}  # a unit's own squares: 0
    for r, level in enumerate(spec.levels):
        _arguments(spec, cell, b, level, {k: partial(exchange.publish_value, spec, g.aw[k], t)
                                          for k in level if k not in zero}, bx, tx)
        exchange.value_barrier(spec, g.cnt, t, r, bx, tx)
        for k in level:  # the means first: the variances take theirs
            if k not in about:
                _sum_value(spec, g.aw[k], b.tv, b.racc, b.red, b.mv, k, t, bx, tx, warp, lane)
        for k in level:
            if k in about:
                _sum_variance(spec, None if k in zero else g.aw[k], g.aw[about[k]], b.tv,
                              b.racc, b.red, b.mv, k, about[k], t, bx, tx, warp, lane)


def reader(spec, mv, n):
    """The ``ops.mean`` of a step evaluated for batch row ``n``: the k-th mean from ``mv``."""
    calls = itertools.count()

    def mean(x):
        return mv[next(calls) * spec.local_batch + n]
    return mean
