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
def _sum_value(spec, aw, tv, racc, red, mv, r, t, bx, tx, warp, lane):
    for n in T.unroll(spec.local_batch):
        racc[n] = T.float32(0)
    exchange.stage_value(spec, aw, tv, partial(_accumulate, spec, racc), t, bx, tx)
    _row_sums(spec, racc, red, mv, r, warp, lane, tx)


def _arguments(spec, cell, b, level, publish, bx, tx):
    """Round ``level``: the pairs' step evaluated up to the means of that level (the means
    before it from ``mv``), each mean's argument handed to ``publish[k](value, row, j)``."""
    done = [k for lower in spec.levels[:spec.levels.index(level)] for k in lower]

    def body(it, n, j):
        u = j - spec.place(bx) * spec.plan.units
        calls, found = itertools.count(), {}

        def mean(x):
            k = next(calls)
            if k in done:
                return b.mv[k * spec.local_batch + n]
            if k in level:
                found[k] = x
            return T.float32(0)  # a later round's: what follows is not this round's

        sums = [cell_stage._sum(spec, b.hs, b.bh, it, n, u, g) for g in range(spec.gates)]
        with ops.lowered_with(cell_stage.FAST_FUNCTIONS), ops.reducing_with(mean, None):
            cell_stage.evaluate(spec, cell, b.gi, sums, b.st, b.pv, it)
        if sorted(found) != sorted(level):
            raise ValueError(f"cell {cell.name!r} took means {sorted(found)} of round {level}")
        for k in level:
            publish[k](found[k], spec.state_row(bx, n), j)
    cell_stage.each_pair(spec, bx, tx, body)


def rounds(spec, cell, g, b, t, bx, tx, warp, lane):
    """Step t's means, a round a level of them (``spec.levels``; builds TIR: a Python loop
    over the rounds)."""
    for r, level in enumerate(spec.levels):
        _arguments(spec, cell, b, level, {k: partial(exchange.publish_value, spec, g.aw[k], t)
                                          for k in level}, bx, tx)
        exchange.value_barrier(spec, g.cnt, t, r, bx, tx)
        for k in level:
            _sum_value(spec, g.aw[k], b.tv, b.racc, b.red, b.mv, k, t, bx, tx, warp, lane)


def reader(spec, mv, n):
    """The ``ops.mean`` of a step evaluated for batch row ``n``: the k-th mean from ``mv``."""
    calls = itertools.count()

    def mean(x):
        return mv[next(calls) * spec.local_batch + n]
    return mean
