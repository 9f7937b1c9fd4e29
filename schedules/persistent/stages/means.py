"""Stage: the row means a cell's step takes (``ops.mean``; the layer-normalised cells), a
round of the step a level of them.

A mean is over the H units of a batch row, which several blocks share. The step's means come
in levels (:func:`rnncc.cells.autodiff.one_round_levels`: a mean, then what depends on it);
round r takes level r's: every thread evaluates the step of its pairs up to them (the means
before read from ``mv``) and publishes each one's argument as it publishes h
(:func:`.exchange.publish_value`); after the round's barrier each block loads the whole row's
values of all of the level's means at once (:func:`.exchange.stage_values`: tagged words, a
batch of loads of every array before any wait; or plain behind the counter barrier), each
thread summing the ones it loads a batch row, then the warps' sums (shuffles) and the block's
(shared memory) give the row's sums: ``mv[k*N + n]`` is mean k.

The sums are about a shift, a value of the row: the argument of the block's first unit
(``shift``; 0, or the last step's, in a block without units). A layer norm's variance
(``spec.variances``: mean k the variance about mean m) is taken in m's round, not the next:
in that round the step is evaluated with m as each unit's own argument x_j, so that k's
argument is v_j, the unit's values' squares about x_j; the block sums v_j and (x_j - c)^2
beside x_j - c, and var = mean_j(v_j) + mean_j((x_j - c)^2) - (m - c)^2 (c near the values:
as exact as a mean, then the squares about it; a mean of squares with c = 0 lost the
variance of values far from 0). A layer norm of one value a unit (LN-LSTM's of c) has
v_j = 0, neither exchanged nor summed. LN-LSTM's step takes 2 rounds so, LN-GRU's 1, each one
L2 round trip of loads (2-6 before: a mean's, then a variance's, each).

With the plan's ``mean_partials`` (where the tagged exchange's round takes more than a load a
thread, :func:`..knobs.block_sums`; a knob ``rnncc tune`` tries both ways), a block first sums
its own units (``pw``): it publishes, at its place in the row, its units' mean of each mean's
arguments and, for each variance about it, their squares about that block mean (their own
squares added); every block then sums the row's B values a mean, weighted by each block's
units, about its own block mean: H / U times fewer words a round.
"""

from __future__ import annotations

import functools
import itertools
from functools import partial

from tvm import tirx
from tvm.script import tirx as T

from rnncc.cells import ops

from .. import device
from . import cell as cell_stage
from . import exchange


@T.macro
def clear(spec, shift, tx):
    """Once, before the steps: the shifts 0 (where a block has no unit to take one from,
    :func:`_arguments`, its sums are about 0, or the last step's shift)."""
    size, threads = T.meta_var((spec.means * spec.local_batch, spec.plan.threads))
    for e in spec.spread(size):
        if e * threads + tx < size:
            shift[e * threads + tx] = T.float32(0)


def _add(racc, index, value):
    cell_stage.store(racc, racc[index] + value, index)


def _accumulate(spec, racc, slot, e, value, width=None):
    """``value`` of element e into sum ``slot`` of its batch row (rows of ``width`` elements:
    H's exchange width unless given). The row is known once the staging's loops unroll where
    the block's threads divide a row; elsewhere each row's sum takes the value or 0 (an index
    the compiler cannot see would put ``racc`` on the stack)."""
    n_, width = spec.local_batch, width or spec.width
    if not isinstance(value, tirx.Var):  # loaded once (the barrier's exchange: a load a use)
        value = T.bind(value)
    if n_ == 1 or width % spec.plan.threads == 0:
        _add(racc, slot * n_ + (0 if n_ == 1 else e // width), value)
        return
    for n in range(n_):
        _add(racc, slot * n_ + n, T.if_then_else(e // width == n, value, T.float32(0)))


def _accumulate_shifted(spec, racc, shift, k, slot, squares, e, value):
    """Mean k's argument ``value`` of element e about the row's ``shift``, into sum ``slot``,
    its square into each of ``squares`` (the slots of k's variances); 0 past H."""
    shifted = T.bind(T.if_then_else(e % spec.width < spec.hidden,
                                    value - shift[k * spec.local_batch + e // spec.width],
                                    T.float32(0)))
    _accumulate(spec, racc, slot, e, shifted)
    for other in squares:
        _accumulate(spec, racc, other, e, shifted * shifted)


def _units_of(spec, b):
    """The hidden units of block place ``b`` of a grid (0 past H)."""
    units = spec.plan.units
    return T.max(T.min(T.int32(units), T.int32(spec.hidden) - b * units), 0)


def _accumulate_block(spec, racc, shift, k, slot, squares, e, value):
    """Block b's mean ``value`` of mean k (element e = n*B + b of its row) about the row's
    ``shift``, weighted by the block's units, into sum ``slot``; the weighted square into
    each of ``squares`` (k's variances')."""
    blocks = spec.plan.group_blocks
    weight = T.Cast("float32", _units_of(spec, e % blocks))
    # the word loaded once; not the difference: TVM 0.27's simplifier failed on its bind
    # (IntImm of float32, LN-GRU H 257 at N 6)
    if not isinstance(value, tirx.Var):
        value = T.bind(value)
    shifted = value - shift[k * spec.local_batch + e // blocks]
    _accumulate(spec, racc, slot, e, weight * shifted, blocks)
    for other in squares:
        _accumulate(spec, racc, other, e, weight * shifted * shifted, blocks)


def _publish_partials(spec, g, b, level, t, bx, tx):
    """Round ``level`` with ``mean_partials``: each block's mean of its units' arguments of
    each of the level's means and, for each variance about it, the sum of its units' squares
    about that block mean (their own squares added), published as one value a block (place b
    of the row) instead of one a unit; the block's mean is also the round's shift of its
    sums (:func:`_sum_level`). From ``b.pw``, the arguments :func:`_arguments` stored."""
    n_, threads = spec.local_batch, spec.plan.threads
    about = spec.centres
    T.tvm_storage_sync("shared")
    count = T.bind(_units_of(spec, spec.place(bx)))
    for first in range(0, n_, threads):
        n = T.bind(first + tx)
        with T.If(n < n_):
            with T.Then():
                for k in level:
                    if k not in about:
                        _publish_block_sums(spec, g, b, level, k, [
                            v for v in level if about.get(v) == k], n, count, t, bx)


def _publish_block_sums(spec, g, b, level, k, variances, n, count, t, bx):
    """Batch row n's block mean of mean k and the squares of ``variances`` about it."""
    n_, units = spec.local_batch, spec.plan.units
    slots = {q: s for s, q in enumerate(level)}
    row, place = spec.state_row(bx, n), spec.place(bx)

    def arg(q, u):
        return b.pw[(slots[q] * n_ + n) * units + u]

    def total(terms, first=0):
        return functools.reduce(lambda a, x: a + x, [T.if_then_else(
            u < count, terms(u), T.float32(0)) for u in range(first, units)])

    c = T.bind(arg(k, 0))
    if units == 1:  # the block mean is the one argument
        shifted = mean = T.float32(0)
    else:  # about c (unit 0's term is 0), then over the units
        shifted = T.bind(total(lambda u: arg(k, u) - c, first=1))
        mean = T.bind(shifted / T.Cast("float32", T.max(count, 1)))
    published = T.bind(T.if_then_else(count > 0, c + mean, T.float32(0)))
    cell_stage.store(b.shift, published, k * n_ + n)
    exchange.publish_value(spec, g.aw[k], t, published, row, place)
    for v in variances:
        squares = total(lambda u, v=v: arg(v, u) + (arg(k, u) - c) * (arg(k, u) - c))
        exchange.publish_value(spec, g.aw[v], t, T.max(squares - shifted * mean,
                                                       T.float32(0)), row, place)


def _warp_sums(spec, racc, red, slots, warp, lane):
    """Each warp's sums (``slots`` of them a batch row, S in all) into ``red``, by halving
    across the lanes: each of the 5 exchanges a lane keeps half of its values (the upper half
    where its lane bit is set) and adds its partner's of that half, so that S sums take about
    S exchanges (P - 1, S rounded up to a power of two P; at least 31) rather than 5 S. Lane
    l ends with the totals of sums l * P / 32 + i (P >= 32), or of sum l * P / 32 (P < 32,
    with its neighbours); one lane writes each."""
    size = slots * spec.local_batch
    padded = 1 << max(size - 1, 0).bit_length()
    values = [racc[s] for s in range(size)] + [T.float32(0)] * (padded - size)
    for m in range(5):
        mask = 16 >> m
        if len(values) == 1:
            values = [T.bind(values[0] + device.shfl_xor(values[0], mask))]
            continue
        half = len(values) // 2
        upper = T.bind(T.bitwise_and(lane, mask) != 0)
        values = [T.bind(T.if_then_else(upper, values[i + half], values[i]) + device.shfl_xor(
            T.if_then_else(upper, values[i], values[i + half]), mask)) for i in range(half)]
    if padded >= 32:  # lane l: sums l * P / 32 + i
        for i, value in enumerate(values):
            index = lane * len(values) + i
            with T.If(index < size):
                with T.Then():
                    cell_stage.store(red, value, warp * size + index)
    else:  # lanes of a run of 32 / P: sum l * P / 32
        run = 32 // padded
        index = lane // run
        with T.If(T.And(lane % run == 0, index < size)):
            with T.Then():
                cell_stage.store(red, values[0], warp * size + index)
    T.tvm_storage_sync("shared")


@T.macro
def _block_sum(spec, red, slots, slot, n, out):
    """``out[0]``: the block's sum ``slot`` of batch row n (``red``: the warps')."""
    out[0] = T.float32(0)
    for w in range(spec.plan.warps):
        out[0] = out[0] + red[(w * slots + slot) * spec.local_batch + n]


@T.macro
def _finish_mean(spec, red, mv, shift, racc, slots, slot, k, tx):
    """Mean k of each batch row: its shift plus the mean of its arguments about it."""
    n_, threads = T.meta_var((spec.local_batch, spec.plan.threads))
    for e in spec.spread(n_):
        if e * threads + tx < n_:
            _block_sum(spec, red, slots, slot, e * threads + tx, racc)
            mv[k * n_ + e * threads + tx] = shift[k * n_ + e * threads + tx] + racc[0] * (
                T.float32(1.0 / spec.hidden))


@T.macro
def _finish_variance(spec, red, mv, racc, slots, slot, about, k, tx):
    """Variance k of each batch row, about the mean of sum ``about``: the mean of the units'
    squares about their own arguments and about the shift, less the square of the mean's
    distance from the shift (0 at least)."""
    n_, threads, h = T.meta_var((spec.local_batch, spec.plan.threads, spec.hidden))
    for e in spec.spread(n_):
        if e * threads + tx < n_:
            _block_sum(spec, red, slots, about, e * threads + tx, racc)
            racc[1] = racc[0] * T.float32(1.0 / h)
            _block_sum(spec, red, slots, slot, e * threads + tx, racc)
            mv[k * n_ + e * threads + tx] = T.max(
                racc[0] * T.float32(1.0 / h) - racc[1] * racc[1], T.float32(0))


def _sum_level(spec, g, b, level, t, bx, tx, warp, lane):
    """Round ``level``'s means and variances from one staging of their arguments
    (:func:`.exchange.stage_values`): each mean's about its shift, its variances' squares of
    the same, and the units' own squares where a variance has them."""
    about, alone = spec.centres, spec.alone
    slots = {k: s for s, k in enumerate(level)}
    for s in range(len(level) * spec.local_batch):
        cell_stage.store(b.racc, T.float32(0), s)
    arrays, stores = [], []
    partials = spec.plan.mean_partials
    for k in level:
        if k not in about:
            squares = [slots[v] for v in level if about.get(v) == k]
            arrays.append(g.aw[k])
            stores.append(partial(_accumulate_block if partials else _accumulate_shifted,
                                  spec, b.racc, b.shift, k, slots[k], squares))
        elif partials or k not in alone:
            arrays.append(g.aw[k])
            stores.append(partial(_accumulate, spec, b.racc, slots[k],
                                  width=spec.plan.group_blocks if partials else None))
    exchange.stage_values(spec, arrays, b.tv, stores, t, bx, tx,
                          spec.plan.group_blocks if partials else None)
    _warp_sums(spec, b.racc, b.red, len(level), warp, lane)
    for k in level:
        if k in about:
            _finish_variance(spec, b.red, b.mv, b.racc, len(level), slots[k], slots[about[k]],
                             k, tx)
    for k in level:
        if k not in about:
            _finish_mean(spec, b.red, b.mv, b.shift, b.racc, len(level), slots[k], k, tx)
    T.tvm_storage_sync("shared")


def _arguments(spec, cell, b, level, publish, bx, tx):
    """Round ``level``: the pairs' step evaluated up to the means of that level (the means
    before it from ``mv``; a mean whose variance is of this level: the unit's own argument),
    each mean's argument handed to ``publish[k](value, row, j)``."""
    done = [k for lower in spec.levels[:spec.levels.index(level)] for k in lower]
    centres = {m for k, m in spec.centres.items() if k in level}
    centred = spec.centres  # variances: no shift

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
        if spec.plan.mean_partials:  # summed over the block's units first
            for s, k in enumerate(level):
                cell_stage.store(b.pw, found[k], (s * spec.local_batch + n) * spec.plan.units
                                 + u)
            return
        for k in publish:
            publish[k](found[k], spec.state_row(bx, n), j)
        with T.If(u == 0):  # the block's first unit's argument: the shift of its sums
            with T.Then():
                for k in level:
                    if k not in centred:
                        cell_stage.store(b.shift, found[k], k * spec.local_batch + n)
    cell_stage.each_pair(spec, bx, tx, body)


def rounds(spec, cell, g, b, t, bx, tx, warp, lane):
    """Step t's means, a round a level of them (``spec.levels``; builds TIR: a Python loop
    over the rounds)."""
    for r, level in enumerate(spec.levels):
        _arguments(spec, cell, b, level, {k: partial(exchange.publish_value, spec, g.aw[k], t)
                                          for k in level if k not in spec.alone}, bx, tx)
        if spec.plan.mean_partials:
            _publish_partials(spec, g, b, level, t, bx, tx)
        exchange.value_barrier(spec, g.cnt, t, r, bx, tx)
        _sum_level(spec, g, b, level, t, bx, tx, warp, lane)


def reader(spec, mv, n):
    """The ``ops.mean`` of a step evaluated for batch row ``n``: the k-th mean from ``mv``."""
    calls = itertools.count()

    def mean(x):
        return mv[next(calls) * spec.local_batch + n]
    return mean
