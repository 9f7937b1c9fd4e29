"""Stage: the row means a cell's step takes (``ops.mean``; the layer-normalised cells), a
round of the step each.

A mean is over the H units of a batch row, which several blocks share. Round r: every thread
evaluates the step of its pairs up to the r-th mean (the means before it read from ``mv``)
and publishes its argument as it publishes h (:func:`.exchange.publish_value`); after the
round's barrier each block loads the whole row's values (tagged words, or plain behind the
counter barrier), each thread summing the ones it loads a batch row, then the warps' sums
(shuffles) and the block's (shared memory) give the row's sum: ``mv[r*N + n]`` is its mean.
"""

from __future__ import annotations

import itertools
from functools import partial

from tvm.script import tirx as T

from .. import device
from . import cell as cell_stage
from . import exchange


@T.macro
def _accumulate(spec, racc, e, value):
    racc[e // spec.width] = racc[e // spec.width] + value


@T.macro
def _row_sums(spec, racc, red, mv, r, warp, lane, tx):
    """``mv[r*N + n]``: the mean over H of what the block's threads summed in ``racc``."""
    n_, warps = T.meta_var((spec.local_batch, spec.plan.warps))
    for n in T.unroll(n_):
        for m in T.unroll(5):
            racc[n] = racc[n] + device.shfl_xor(racc[n], T.shift_left(1, 4 - m))
        if lane == 0:
            red[warp * n_ + n] = racc[n]
    T.tvm_storage_sync("shared")
    if tx < n_:
        racc[0] = T.float32(0)
        for w in range(warps):
            racc[0] = racc[0] + red[w * n_ + tx]
        mv[r * n_ + tx] = racc[0] * T.float32(1.0 / spec.hidden)
    T.tvm_storage_sync("shared")


@T.macro
def _sum_value(spec, aw, tv, racc, red, mv, r, t, bx, tx, warp, lane):
    for n in T.unroll(spec.local_batch):
        racc[n] = T.float32(0)
    exchange.stage_value(spec, aw, tv, partial(_accumulate, spec, racc), t, bx, tx)
    _row_sums(spec, racc, red, mv, r, warp, lane, tx)


def rounds(spec, cell, g, b, t, bx, tx, warp, lane):
    """Step t's means, one round each (builds TIR: a Python loop over the rounds)."""
    for r in range(spec.means):
        cell_stage.argument(spec, cell, b.hs, b.gi, b.bh, b.st, b.pv, None,
                            partial(exchange.publish_value, spec, g.aw[r], t), bx, tx,
                            stop=r, mv=b.mv)
        exchange.value_barrier(spec, g.cnt, t, r, bx, tx)
        _sum_value(spec, g.aw[r], b.tv, b.racc, b.red, b.mv, r, t, bx, tx, warp, lane)


def reader(spec, mv, n, stop=None):
    """The ``ops.mean`` of a step evaluated for batch row ``n``: the k-th mean from ``mv``;
    with ``stop``, the value passed to that one instead (:class:`.cell._Reached`)."""
    calls = itertools.count()

    def mean(x):
        k = next(calls)
        if k == stop:
            raise cell_stage._Reached(x)
        return mv[k * spec.local_batch + n]
    return mean
