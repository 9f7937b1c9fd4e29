"""Stage: the CUDA-core products' sums over the 32 lanes of a warp, into shared memory.

A halving butterfly: each exchange of lanes (masks 16, 8, 4, ...) halves the values a lane
carries (a lane keeps one half and adds its partner's other half), so the RW*N sums cost about
RW*N shuffles instead of 5*RW*N; once a lane carries one value, the remaining exchanges add
whole. Afterwards lane l holds the sums ``first(l)`` .. ``first(l) + length - 1`` (index q*N +
n: row q, batch row n); the lanes with any of the non-halving mask bits set hold copies.
With lane groups (planner: "Lane groups") the sums run over each group's KL lanes only (the
masks under KL), and group g's lanes hold the sums of its rows.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .. import device

MASKS = (16, 8, 4, 2, 1)


def _masks(spec) -> tuple:
    """The masks of the exchanges: those of the lanes that share a row's K."""
    return tuple(m for m in MASKS if m < spec.plan.k_lanes)


def _halving(spec) -> tuple:
    """The masks of the exchanges that halve a lane's values (the sums are a power of two)."""
    return _masks(spec)[:spec.accumulators.bit_length() - 1]


@T.macro
def _halve(acc, lane, m, a, half):
    acc[a] = T.if_then_else(T.bitwise_and(lane, m) != 0, acc[a + half], acc[a]) + (
        device.shfl_xor(T.if_then_else(T.bitwise_and(lane, m) != 0, acc[a], acc[a + half]), m))


@T.macro
def _add(acc, m):
    acc[0] = acc[0] + device.shfl_xor(acc[0], m)


def butterfly(spec, acc, lane):
    """Sum the lanes' ``acc`` (builds TIR: a Python loop over the exchanges)."""
    values = spec.accumulators
    for m in _masks(spec):
        if values > 1:
            values //= 2
            for a in range(values):
                _halve(acc, lane, m, a, values)
        else:
            _add(acc, m)


def _first(spec, lane):
    """The index of the first sum that lane ``lane`` holds."""
    halving = _halving(spec)
    first = 0
    for s, m in enumerate(halving):
        term = T.if_then_else(tirx.NE(T.bitwise_and(lane, m), 0), spec.accumulators >> (s + 1), 0)
        first = term if s == 0 else first + term
    return first


@T.macro
def _store_sum(spec, hs, acc, warp, lane, free_bits, c, idx):
    rw, n_, kl = T.meta_var((spec.plan.rows_per_warp, spec.local_batch, spec.plan.k_lanes))
    if T.bitwise_and(lane, free_bits) == 0 and idx < rw * n_:
        hs[(warp * spec.plan.warp_rows + lane // kl * rw + idx // n_) * n_ + idx % n_] = acc[c]


def store_sums(spec, hs, acc, warp, lane):
    """The warp's sums into ``hs`` [Wn*LG*RW, N/NG] (row w*LG*RW + g*RW + q, g the lane's
    group; after a block barrier, since they take h_{t-1}'s place), each by the lanes that
    hold it."""
    halving = _halving(spec)
    free_bits = sum(m for m in _masks(spec) if m not in halving)
    for c in range(spec.accumulators >> len(halving)):
        _store_sum(spec, hs, acc, warp, lane, free_bits, c, _first(spec, lane) + c)
