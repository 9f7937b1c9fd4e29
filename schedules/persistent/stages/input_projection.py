"""Stage: the fused input projection (planner: "Fused input projection", "Overlapped").

The block computes the input projections of its own rows, R = G*U rows of W_ih (packed [B, KC,
RL, 8, VEC]), by groups of SN rows m = t*N + n of x (its batch group's). A group's product over
one width of K chunks (``Plan.input_width``: all of them, a slab through W_hh's shared memory,
or a slab of the overlapped projection): its columns of x are staged in shared memory (float32,
zero past C and past T*N, rows padded by 16 bytes so the 4 x groups' loads hit different
banks); warp w multiplies its range of the chunks, lane (x group xg, row group rg; which is
the faster in the lane's index: :attr:`Geometry.x_fastest`) rows r = rg*RL + q of W_ih by rows
m = 4*s + xg of x, into its accumulators ``pacc``. Then the warps'
sums go through shared memory ([Wn, SN, 8*RL + 1], padded: a stride of SN floats made 16-way
bank conflicts, 1.7x slower on an H200), and thread i adds them up for outputs (n, r) =
divmod(i, R) and writes xp[t, n, g*H + j] = sum + b_ih[g*H + j] (in slabs through W_hh's shared
memory, later slabs add to it).

:func:`before_loop` computes every group, or, overlapped, group 0 only. Overlapped, step t
copies slab t % S of group t // S + 1's x (:func:`start_copies`: ``cp.async`` where C keeps
16-byte vectors aligned, else staged in :func:`in_loop`) and, between publishing h_t and
waiting for the other blocks (:func:`in_loop`), adds that slab's products; after the group's
last slab it writes the group's xp. With layers (planner: "Layers as a wavefront"), layer
l > 0's x is layer l - 1's y, and each group waits for its steps (:mod:`.wavefront`). With
two directions (planner: "Directions") the reverse grid's loop step t is the sequence's step
T - 1 - t (with lengths, each sample's length - 1 - t): its rows of x are read, and its xp
written, at that step, where the cell reads them. The macros take the projection's buffers as
``io`` (:func:`rnncc.schedules.persistent.buffers.projection`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

from tvm import tirx
from tvm.script import tirx as T

from .. import device, planner
from ..planner import ROW_GROUPS, X_GROUPS
from . import wavefront

#: K chunks a warp of the fused input projection takes an iteration (unrolled; rounded down to a
#: divisor of its chunks). H200, us a step, 1 -> 4: LSTM 1024 N=4 3.86 -> 3.75, GRU 1024 N=4
#: 3.50 -> 3.40, N=1 within 0.02; 8 and all of them no better.
FUSED_UNROLL = 4


@dataclass(frozen=True)
class Geometry:
    """The projection's sizes, from the plan: RL rows of W_ih a lane, SN/4 rows of x a lane,
    R = G*U rows of the block, KSL chunks a width, a staged row of x (``xstride`` floats) and of
    the warps' sums (``sum_stride``), CW chunks a warp (``warp_chunks``) unrolled by
    ``unroll``, and whether x's slabs come by asynchronous copies (``copies``)."""

    rl: int
    snl: int
    rows: int
    width: int
    xstride: int
    sum_stride: int
    warp_chunks: int
    unroll: int
    copies: bool

    @property
    def x_fastest(self) -> bool:
        """Lane l takes x group l % 4 and row group l // 4 where the lane loads more vectors of
        W_ih than of x a chunk (RL > SN/4), else x group l // 8 and row group l % 8. With the
        row groups fastest each quarter of the warp (8 lanes) loads the same 8 vectors of
        W_ih, and ncu counted 4 shared-memory wavefronts for each such 16-byte load (x's
        loads, one vector a quarter: 2); with the x groups fastest a quarter loads 2 vectors
        of W_ih and all 4 of x. H200, us a step, rows / x groups fastest: LSTM 512, 2 layers,
        batch 1 (RL 8, SN/4 1) 2.24 / 2.05, 4 layers 2.74 / 2.55, GRU 512 2 layers 2.13 /
        2.05; LSTM 1024 batch 4 (RL 4, SN/4 8) 3.39 / 3.48."""
        return self.rl > self.snl

    @property
    def staged(self) -> bool:
        """Overlapped, x's slabs are staged in the step (no asynchronous copies)."""
        return not self.copies


@functools.cache
def geometry(spec) -> Geometry:
    """The projection's :class:`Geometry` for ``spec`` (a KernelSpec with a fused plan)."""
    p = spec.plan
    width = p.input_width
    cw = -(-width // p.warps)
    rl = planner.fused_row_split(p, spec.gates)
    return Geometry(rl=rl, snl=p.input_rows // X_GROUPS, rows=spec.gates * p.units,
                    width=width, xstride=width * p.vec + 4, sum_stride=rl * ROW_GROUPS + 1,
                    warp_chunks=cw,
                    unroll=max(d for d in range(1, min(FUSED_UNROLL, cw) + 1) if cw % d == 0),
                    copies=p.input_steps > 0 and spec.input_size % p.vec == 0)


def _w_ih_value(spec, io, first, e, v, bx):
    """Element v of W_ih's chunk for the block's item e (of chunk ``first`` + e // (RL*8)),
    zero past KC (the last slab's chunks)."""
    kc, rl = spec.plan.input_chunks, geometry(spec).rl
    chunk = e // (rl * ROW_GROUPS) if first is None else first + e // (rl * ROW_GROUPS)
    blk, q, rg = spec.weights_of(bx), e // ROW_GROUPS % rl, e % ROW_GROUPS
    if kc % (spec.plan.input_slab or kc) == 0:
        return io.wi[blk, chunk, q, rg, v]
    return T.if_then_else(chunk < kc, io.wi[blk, T.min(chunk, kc - 1), q, rg, v],
                          T.Cast(io.wi.dtype, 0))


@T.macro
def copy_w_ih(spec, io, first, bx, tx):
    """W_ih's rows into shared memory: all KC chunks, or a slab's from chunk ``first``."""
    p, geo = T.meta_var((spec.plan, geometry(spec)))
    chunks = T.meta_var(p.input_slab or p.input_chunks)
    total = T.meta_var(chunks * geo.rl * ROW_GROUPS * p.vec)
    for e in spec.spread(total // p.vec):
        for v in T.vectorized(p.vec):
            if (e * p.threads + tx) * p.vec < total:
                io.w_ih[(e * p.threads + tx) * p.vec + v] = _w_ih_value(
                    spec, io, first, e * p.threads + tx, v, bx)


def _x_slot(spec, e, step, m0, sl):
    """(r, k, col, m) of item e of group ``m0``'s rows of x, ``step`` elements an item: row r
    of the group (row m of x), column k of the width (column col of x; ``sl`` the slab, or
    None)."""
    geo = geometry(spec)
    per_row = geo.width * spec.plan.vec // step
    r, k = e // per_row, e % per_row * step
    col = k if sl is None else sl * (geo.width * spec.plan.vec) + k
    return r, k, col, m0 * spec.plan.input_rows + r


def _float32_lanes(count: int) -> tuple[int, int]:
    """``count`` float32 values as (parts, lanes) of vectors of at most 16 bytes (a half
    layer's 16-byte vector of 8 x values is 32 bytes staged as float32, which TVM's CUDA code
    writes as a ulonglong4 built from 8 floats: nvcc refuses it)."""
    return (count // 4, 4) if count > 4 else (1, count)


def _x_step(spec) -> int:
    """Elements of x a staged item: 16-byte vectors where C keeps them aligned, else one."""
    return spec.plan.vec if spec.input_size % spec.plan.vec == 0 else 1


@T.macro
def _each_x_slot(spec, body, step, tx):
    """``body(e)`` for every item e of a group's rows of x, ``step`` elements an item."""
    p = T.meta_var(spec.plan)
    slots = T.meta_var(p.input_rows * (geometry(spec).width * p.vec // step))
    for e in spec.spread(slots, unroll=True):
        if slots % p.threads != 0:
            if e * p.threads + tx < slots:
                body(e * p.threads + tx)
        else:
            body(e * p.threads + tx)


def _sequence_step(spec, io, t, t_len, row, bx):
    """The sequence step of the block's loop step t for batch row ``row`` (of all groups): t,
    or in the reverse direction T - 1 - t, with lengths the sample's length - 1 - t
    (:meth:`~.spec.KernelSpec.step`: the step the cell reads the projection of)."""
    if spec.directions == 1:
        return t
    return spec.step(bx, t, t_len, io.lengths[row] if spec.lengths else None)


def _x_exists(spec, col, m, t_len, given):
    """Whether column ``col`` of row m of the block's rows of x (T*N/NG) exists: in C, in T, and
    where the plan pads the batch, a row of the caller's (``given``)."""
    return tirx.all(col < spec.input_size, m < t_len * spec.local_batch,
                    *([] if given is None else [given]))


def _x_value(spec, io, t, row, col, bx):
    """x[t, row, col] as float32: the layer's input, or with layers, layer l - 1's output for
    layer l > 0 (read past L1: other blocks wrote it during the launch)."""
    given = T.Cast("float32", io.x[t, row, col])
    if spec.layers == 1:
        return given
    below = device.load_past_l1(T.address_of(
        io.below[t, row, (spec.layer(bx) - 1) * spec.hidden + col]))
    return T.if_then_else(spec.layer(bx) == 0, given, below)


@T.macro
def _stage_x_item(spec, io, m0, sl, t_len, bx, e):
    n_, step, xstride = T.meta_var((spec.local_batch, _x_step(spec), geometry(spec).xstride))
    r, k, col, m = T.meta_var(_x_slot(spec, e, step, m0, sl))
    given, row = T.meta_var(spec.given(bx, m % n_))
    parts, lanes = T.meta_var(_float32_lanes(step))
    if _x_exists(spec, col, m, t_len, given):
        for h in T.unroll(parts):
            for v in T.vectorized(lanes):
                io.x_staged[r * xstride + k + h * lanes + v] = _x_value(
                    spec, io, _sequence_step(spec, io, m // n_, t_len, row, bx), row,
                    col + h * lanes + v, bx)
    else:
        for h in T.unroll(parts):
            for v in T.vectorized(lanes):
                io.x_staged[r * xstride + k + h * lanes + v] = T.float32(0)


@T.macro
def _copy_x_item(spec, io, m0, sl, t_len, bx, e):
    n_, vec, c = T.meta_var((spec.local_batch, spec.plan.vec, spec.input_size))
    r, k, col, m = T.meta_var(_x_slot(spec, e, vec, m0, sl))
    last = T.meta_var(T.min(m, t_len * n_ - 1))
    to = T.meta_var(T.address_of(io.xsl[r * geometry(spec).xstride + k]))
    given, row = T.meta_var(spec.given(bx, last % n_))
    first = T.meta_var(T.min(col, c - vec))
    t = T.meta_var(_sequence_step(spec, io, last // n_, t_len, row, bx))
    size = T.meta_var(T.if_then_else(_x_exists(spec, col, m, t_len, given), 16, 0))
    if spec.layers == 1:
        device.copy_async(to, T.address_of(io.x[t, row, first]), size)
    else:  # layer l > 0: layer l - 1's outputs (asynchronous copies read past L1)
        if spec.layer(bx) == 0:
            device.copy_async(to, T.address_of(io.x[t, row, first]), size)
        else:
            device.copy_async(to, T.address_of(
                io.below[t, row, (spec.layer(bx) - 1) * spec.hidden + first]), size)


@T.macro
def copy_x(spec, io, m0, sl, t_len, bx, tx):
    """Start the copies of slab ``sl`` of group ``m0``'s rows of x into ``xsl``."""
    _each_x_slot(spec, partial(_copy_x_item, spec, io, m0, sl, t_len, bx), spec.plan.vec, tx)


@T.macro
def stage_x(spec, io, m0, sl, t_len, bx, tx):
    """Stage group ``m0``'s rows of x (the columns of slab ``sl``; None: from 0), by
    asynchronous copies where the geometry says so (complete after :func:`wait_copies`)."""
    if geometry(spec).copies:
        copy_x(spec, io, m0, sl, t_len, bx, tx)
    else:
        _each_x_slot(spec, partial(_stage_x_item, spec, io, m0, sl, t_len, bx), _x_step(spec),
                     tx)


@T.macro
def wait_copies(spec):
    """The thread's copies of x are complete (a block barrier must follow)."""
    if geometry(spec).copies:
        device.wait_copies()


@T.macro
def zero(spec, io):
    """The lane's accumulators start from zero."""
    for a in T.unroll(geometry(spec).rl * geometry(spec).snl):
        io.pacc[a] = T.float32(0)


def x_group(geo, lane):
    """The lane's group of rows of x (:attr:`Geometry.x_fastest`)."""
    return lane % X_GROUPS if geo.x_fastest else lane // ROW_GROUPS


def row_group(geo, lane):
    """The lane's group of rows of W_ih (:attr:`Geometry.x_fastest`)."""
    return lane // X_GROUPS if geo.x_fastest else lane % ROW_GROUPS


def _chunk_bounds(spec, chunk, sl):
    """(whether to check, the condition) that the warp's ``chunk`` exists: within the width
    where the warps' ranges pass it, and, overlapped, within KC where the last slab passes
    it."""
    p, geo = spec.plan, geometry(spec)
    bounds = [chunk < geo.width] if geo.width % p.warps else []
    if sl is not None and geo.width * p.input_steps > p.input_chunks:
        bounds.append(sl * geo.width + chunk < p.input_chunks)
    if len(bounds) == 2:
        return True, tirx.And(*bounds)
    return bool(bounds), bounds[0] if bounds else None


@T.macro
def _chunk_products(spec, io, sl, lane, chunk):
    """The lane's products of one K chunk: its SN/4 rows of x by its RL rows of W_ih."""
    p, geo = T.meta_var((spec.plan, geometry(spec)))
    vec, rl, snl = T.meta_var((p.vec, geo.rl, geo.snl))
    wchunk = T.meta_var(chunk if sl is None else sl * geo.width + chunk)
    parts, lanes = T.meta_var(_float32_lanes(vec))
    for s in T.unroll(snl):
        for h in T.unroll(parts):
            for v in T.vectorized(lanes):
                io.xv[s * vec + h * lanes + v] = io.x_staged[
                    (s * X_GROUPS + x_group(geo, lane)) * geo.xstride + chunk * vec
                    + h * lanes + v]
    for q in T.unroll(rl):
        for v in T.vectorized(vec):
            io.wq[q * vec + v] = io.w_ih[((wchunk * rl + q) * ROW_GROUPS + row_group(geo, lane))
                                         * vec + v]
    for q in T.unroll(rl):
        for s in T.unroll(snl):
            for v in T.unroll(vec):
                io.pacc[q * snl + s] = io.pacc[q * snl + s] + T.Cast(
                    "float32", io.wq[q * vec + v]) * io.xv[s * vec + v]


@T.macro
def products(spec, io, sl, warp, lane):
    """Add the warp's chunks of the staged columns to the lane's accumulators: W_ih's chunks
    from chunk ``sl`` * width (overlapped), else those of the staged width."""
    geo = T.meta_var(geometry(spec))
    for co in range(geo.warp_chunks // geo.unroll):
        for cu in T.unroll(geo.unroll):
            chunk = T.meta_var(warp * geo.warp_chunks + co * geo.unroll + cu)
            checked, exists = T.meta_var(_chunk_bounds(spec, chunk, sl))
            if checked:
                if exists:
                    _chunk_products(spec, io, sl, lane, chunk)
            else:
                _chunk_products(spec, io, sl, lane, chunk)


def _output_start(spec, io, at, row, out, accumulate):
    start = T.Cast("float32", io.b_ih[out])
    if accumulate is None:
        return start
    return T.if_then_else(tirx.EQ(accumulate, 0), start, io.xp[at, row, out])


@T.macro
def _write_output(spec, io, m0, accumulate, t_len, bx, o):
    """Output o = (n, r) of group ``m0``: xp = b_ih (or, ``accumulate`` after the first slab,
    xp) plus the warps' sums."""
    p, geo, n_ = T.meta_var((spec.plan, geometry(spec), spec.local_batch))
    n, row = T.meta_var((o // geo.rows, o % geo.rows))
    mm = T.meta_var(m0 * p.input_rows + n)
    j = T.meta_var(spec.place(bx) * p.units + row % p.units)
    out = T.meta_var(spec.gate_column(bx, row // p.units, j))
    given, b_row = T.meta_var(spec.given(bx, mm % n_))
    at = T.meta_var(_sequence_step(spec, io, mm // n_, t_len, b_row, bx))
    io.xs[0] = _output_start(spec, io, at, b_row, out, accumulate)
    for w in T.unroll(p.warps):
        io.xs[0] = io.xs[0] + io.hs[(w * p.input_rows + n) * geo.sum_stride + row]
    if spec.padded:
        if given:  # a padded batch's rows past N have none
            io.xp[at, b_row, out] = io.xs[0]
    else:
        io.xp[at, b_row, out] = io.xs[0]


@T.macro
def write(spec, io, m0, accumulate, t_len, warp, lane, bx, tx):
    """The lanes' sums where x was, then group ``m0``'s xp (``accumulate``: the slab, whose
    first writes b_ih plus the sums and the rest add to xp; None: not in slabs)."""
    p, geo = T.meta_var((spec.plan, geometry(spec)))
    for q in T.unroll(geo.rl):
        for s in T.unroll(geo.snl):
            io.hs[(warp * p.input_rows + s * X_GROUPS + x_group(geo, lane)) * geo.sum_stride
                  + row_group(geo, lane) * geo.rl + q] = io.pacc[q * geo.snl + s]
    T.tvm_storage_sync("shared.dyn")
    outs = T.meta_var(geo.rows * p.input_rows)
    for e in spec.spread(outs, unroll=True):
        o = T.meta_var(e * p.threads + tx)
        n, row = T.meta_var((o // geo.rows, o % geo.rows))
        mm = T.meta_var(m0 * p.input_rows + n)
        j = T.meta_var(spec.place(bx) * p.units + row % p.units)
        if outs % p.threads != 0:
            if j < spec.hidden and mm < t_len * spec.local_batch and o < outs:
                _write_output(spec, io, m0, accumulate, t_len, bx, o)
        else:
            if j < spec.hidden and mm < t_len * spec.local_batch:
                _write_output(spec, io, m0, accumulate, t_len, bx, o)


@T.macro
def finish(spec, io, m0, t_len, warp, lane, bx, tx):
    """Write group ``m0``'s xp from the accumulators, which start again from zero."""
    write(spec, io, m0, None, t_len, warp, lane, bx, tx)
    T.tvm_storage_sync("shared.dyn")
    zero(spec, io)


@T.macro
def _group_products(spec, io, m0, sl, t_len, warp, lane, bx, tx):
    """One group of x (columns of slab ``sl``, None: all) by the resident or slab W_ih."""
    stage_x(spec, io, m0, sl, t_len, bx, tx)
    T.tvm_storage_sync("shared.dyn")
    zero(spec, io)
    products(spec, io, None, warp, lane)
    T.tvm_storage_sync("shared.dyn")
    write(spec, io, m0, sl, t_len, warp, lane, bx, tx)
    # the next group's rows go where these sums were; the time loop reads xp
    T.tvm_storage_sync("shared.dyn")


@T.macro
def before_loop(spec, io, t_len, warp, lane, bx, tx):
    """Every group (slab by slab of W_ih through W_hh's shared memory, where it goes there),
    or, overlapped, group 0 only. A slab's W_ih rows go to shared memory ordered by the first
    group's block barrier; the last group's keeps the next slab from overwriting rows still
    read."""
    p = T.meta_var(spec.plan)
    groups = T.meta_var((t_len * spec.local_batch + (p.input_rows - 1)) // p.input_rows)
    if p.input_steps > 0:
        copy_w_ih(spec, io, None, bx, tx)
        zero(spec, io)
        if spec.layers > 1:
            wavefront.wait_for_steps(spec, io.prog, p.input_steps, t_len, bx, tx)
        for sl in range(p.input_steps):
            stage_x(spec, io, T.int64(0), sl, t_len, bx, tx)
            wait_copies(spec)
            T.tvm_storage_sync("shared.dyn")
            products(spec, io, sl, warp, lane)
            T.tvm_storage_sync("shared.dyn")  # the next slab's x, or the sums, go where this was
        finish(spec, io, T.int64(0), t_len, warp, lane, bx, tx)
    elif p.input_slab > 0:
        for sl in range(-(-p.input_chunks // geometry(spec).width)):
            copy_w_ih(spec, io, sl * geometry(spec).width, bx, tx)
            for m0 in range(groups):
                _group_products(spec, io, m0, sl, t_len, warp, lane, bx, tx)
    else:
        copy_w_ih(spec, io, None, bx, tx)
        for m0 in range(groups):
            _group_products(spec, io, m0, None, t_len, warp, lane, bx, tx)


def _has_slab(spec, t, t_len):
    """Step t has a slab to compute: group t // S + 1 has steps."""
    s = spec.plan.input_steps
    return (t // s + 1) * s < t_len


@T.macro
def _wait_for_group(spec, io, t, t_len, bx, tx):
    """With layers, at the first slab of group t // S + 1: layer l - 1 has written its
    steps."""
    s = T.meta_var(spec.plan.input_steps)
    if spec.layers > 1:
        if t % s == 0:
            wavefront.wait_for_steps(spec, io.prog, (t // s + 2) * s, t_len, bx, tx)

@T.macro
def start_copies(spec, io, t, t_len, bx, tx):
    """Overlapped, at the start of step t: the copies of its slab's x (if asynchronous)."""
    s = T.meta_var(spec.plan.input_steps)
    if geometry(spec).copies:
        if _has_slab(spec, t, t_len):
            _wait_for_group(spec, io, t, t_len, bx, tx)
            copy_x(spec, io, t // s + 1, t % s, t_len, bx, tx)



@T.macro
def in_loop(spec, io, t, t_len, warp, lane, bx, tx):
    """Overlapped, in step t, after a block barrier that follows :func:`wait_copies`: slab
    t % S of group t // S + 1 (if it has steps), and after its last slab that group's xp. The
    staging of h_{t+1} comes after a block barrier."""
    s = T.meta_var(spec.plan.input_steps)
    if _has_slab(spec, t, t_len):
        if geometry(spec).staged:
            _wait_for_group(spec, io, t, t_len, bx, tx)
            stage_x(spec, io, t // s + 1, t % s, t_len, bx, tx)
            T.tvm_storage_sync("shared.dyn")
        products(spec, io, t % s, warp, lane)
        if t % s == s - 1:
            T.tvm_storage_sync("shared.dyn")
            finish(spec, io, t // s + 1, t_len, warp, lane, bx, tx)
