"""CUDA on Hopper (sm_90): one step of a layer in one kernel, the recurrent product on warpgroup
MMA (:mod:`.cuda_wgmma_gemm`'s kernel, fed by the TMA engine or by the warpgroups' copies) with
the cell as its epilogue, so that the gate sums never leave the chip:

    sums = h_{t-1} @ W_hh.T + b_hh                 [N, G*H]
    y[t], states_t, h_t = cell(xp[t], sums, states_{t-1})

A block's tile is a row tile of h (128 rows, 64 at N <= 64) by G gates x U units: its rows of
B are W_hh's rows g*H + j*U .. g*H + j*U + U - 1 of each gate g (column tile j; see
:attr:`.cuda_wgmma_gemm.Plan.unit`: the TMA engine copies a box a gate, or half of one where a
cluster's two blocks share an odd count), so that gate g of the tile's unit u is its column
g*U + u. A thread's sums are columns 8 n + 2 (t % 4) + {0, 1} of each 8-column tile n: with U
a multiple of 8, the G sums of each of its units are its own. The epilogue adds b_hh, reads
the units' input projections and previous states, evaluates the cell (the persistent kernel's
fast exponential and division) and writes y, the new states and h again in the operands' type
(the next step's A): neither the sums [N, G*H] in float32 nor a point-wise kernel of their own.

Swapped (:func:`swapped_plan`, as :mod:`.cuda_wgmma_gemm`'s swapped product): a tile is 64
rows of W_hh, the instructions' A, G gates of U units (rows g*U + u: W_hh's row g*H + t*U +
u; LSTM 16 units, rows past G*U and units past H not copied), by ``cols`` rows of h (B, a
multiple of 8: as few tiles as fill ONE_WAVE[0] blocks). A thread's sums are 2 rows of A,
one gate's, so the epilogue writes them to shared memory (the exchange, [64, cols + 4]
float32) and, past a barrier, each thread takes items of two units of one row of h
(consecutive threads, consecutive units: xp, the states and y are read and written as
rows), its G sums read back; the input projections and states loaded before the products as
above. H200, float16 LSTM 1024 N79, us a step: 10.7 (tiles of h's rows, a kernel each) ->
7.1 (cuDNN 8.9).

The kernel takes a step whose recurrent product the warpgroup MMA multiplies whole (halves, or
TF32 with h and the weights rounded as stored: not split float32), whose cell reads h only
through that product (no products of other values, no row means); in tiles of h's rows, with
K whole chunks (taking K past them, copies past K zeros, was slower as often as faster; H200,
float16, us a step, a kernel each -> one: LSTM 952 N79 19.0 -> 47.7, LSTM 600 N191 16.0 ->
36.0, bfloat16 LSTM 1200 N96 15.5 -> 18.7, LSTM 1000 N256 21.8 -> 23.9; but GRU 1000 N96
15.4 -> 11.5, LSTM 1000 N128 14.2 -> 13.7) where some U of 64, 32, 16, 8 divides H with G*U
<= 256 (:func:`plan_of`). The layer takes it (option ``fused_step``, on by default) where it
measured faster: swapped where :func:`swapped_faster`; else 16-bit operands, at most 16 sums
a thread, tiles 24 columns wide or more, cells of more than one gate. H200, us a step against
a kernel each (cuDNN in brackets), tiles of h's rows: float16 LSTM 512 N256 9.41 -> 8.35
(8.39), bfloat16 10.13 -> 8.32 (8.44), float16 LSTM 1024 N128 11.57 -> 10.04 (16.22), GRU
1024 N96 9.79 -> 8.70 (8.84).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tvm import tirx
from tvm.script import tirx as T

from rnncc.cells import Cell, ops
from rnncc.cells.autodiff import mean_levels, product_gates, trace, uses

from . import cuda_mma_gemm, cuda_wgmma_gemm
from ._common import buffer_parameters
from .cuda_wgmma_gemm import ONE_WAVE, Plan
from .persistent.stages.cell import FAST_FUNCTIONS

#: Units a tile (largest first): the first whose grid has ONE_WAVE[0] blocks or more, else
#: the one with the most blocks. Fewer, wider tiles were slower (H200, float16, us a step,
#: the first choice against the first unit with 60 blocks or more: LSTM 2048 N256 43.7 / 62.2,
#: N96 22.1 / 25.8, LSTM 1024 N256 14.9 / 20.6, N128 9.9 / 11.7).
UNITS = (64, 32, 16, 8)
MAX_COLUMNS = 256  # wgmma's widest n
#: The most gate sums a thread's epilogue may take (U / 2 units, G gates each) where the
#: planner chooses: the epilogue runs after the products on one block an SM (9 warps), so its
#: point-wise work and stores are latency-bound. H200, us a step (benchmarks/ab.py, T 100,
#: a kernel each -> one step's kernel taken everywhere it can be; its sums a thread): float16
#: LSTM 1024 N128 11.57 -> 10.04 (16), LSTM 512 N256 9.41 -> 8.34 (16), bfloat16 10.13 ->
#: 8.34 (16), float16 GRU 1024 N96 9.79 -> 8.73 (12), LSTM 1024 N256 15.54 -> 14.90 (32),
#: GRU 2048 N256 34.59 -> 32.00 (48); but LSTM 2048 N96 21.14 -> 22.21 (32), N256 42.45 ->
#: 44.14 (64), LSTM 4096 N256 148.9 -> 165.2 (128, an earlier run).
MAX_THREAD_SUMS = 16
#: And within that: tiles at least this wide (G*U), cells of more than one gate and 16-bit
#: operands: an RNN's 16 columns (float16 RNN-tanh 1024 N256 9.01 -> 9.72; one gate's cell
#: kernel is little work, its 32-column tiles were not measured) and TF32 (LSTM 1024 N96 14.41
#: -> 15.71, LSTM 2048 N256 65.60 -> 66.53) were slower.
MIN_COLUMNS = 24
#: Swapped (:func:`swapped_plan`): the most rows of h a tile (its items' registers: the
#: sums, and the input projections and states loaded before the products)
SWAPPED_MAX_COLUMNS = 128

#: Two float32 of a lane, loaded where the program puts the load (``volatile``, a memory
#: clobber, not the read-only path): ptxas otherwise moves the prologue's loads past the
#: products to their use in the epilogue (float16 LSTM 512 N256: all 16 loads of xp after the
#: last HGMMA, ``ld.global.nc`` in volatile assembly too), where nothing hides their latency.
LOAD2, LOAD2_SOURCE = "rnncc_ld2_early", """
__device__ __forceinline__ void rnncc_ld2_early(float* dst, const float* src) {
  float2 v;
  asm volatile("ld.global.v2.f32 {%0, %1}, [%2];"
               : "=f"(v.x), "=f"(v.y) : "l"(src) : "memory");
  dst[0] = v.x;
  dst[1] = v.y;
}
"""


def takes(cell: Cell) -> str | None:
    """Why ``cell``'s step cannot be an epilogue, or None: it must read h only through its
    one recurrent product and reduce nothing over the units."""
    if product_gates(trace(cell)):
        return f"cell {cell.name!r} takes recurrent products of other values than h"
    if mean_levels(cell):
        return f"cell {cell.name!r} takes means over the hidden units"
    return None


def plan_of(product: cuda_mma_gemm.Product | None, gates: int,
            unit: int | None = None, swapped: bool | None = None) -> Plan | None:
    """The plan of one step's ``product`` (h [N, H] by W_hh [G*H, H]) with the cell as its
    epilogue: ``swapped`` (:func:`swapped_plan`, of U = ``unit`` where given), or not, tiles
    of G x U columns (``unit``: that U; by default :data:`UNITS`' choice, where it is faster:
    :data:`MAX_THREAD_SUMS`, :data:`MIN_COLUMNS`); by default swapped where
    :func:`swapped_faster`; None where this kernel does not take it."""
    if swapped:
        return swapped_plan(product, gates, unit)
    if swapped is None and unit is None and swapped_faster(product, gates):
        chosen = swapped_plan(product, gates)
        if chosen is not None:
            return chosen
    if (product is None or product.rows is None or product.parts != 1 or product.op.split
            or not product.pipelined or product.form != "projection"
            or product.tails or product.columns % gates):
        return None
    hidden = product.columns // gates
    row_tiles = -(-product.rows // product.tile_rows)
    threads = product.tile_rows // 64 * cuda_wgmma_gemm.WARPGROUP
    tma = cuda_wgmma_gemm.tma_fed(product)
    cluster = 2 if tma and row_tiles % 2 == 0 else 1
    found = []
    for u in (unit,) if unit else UNITS:
        cols = gates * u
        box = u if gates % cluster == 0 else u // cluster
        if (cols > MAX_COLUMNS or hidden % u or u % 8
                or (not tma and cols * 8 % threads) or (tma and box % 8)):
            continue
        found.append((u, row_tiles * hidden // u))
    if not found:
        return None
    chosen = next((u for u, blocks in found if blocks >= ONE_WAVE[0]),
                  max(found, key=lambda f: f[1])[0])
    if unit is None and (gates * chosen // 2 > MAX_THREAD_SUMS or gates * chosen < MIN_COLUMNS
                         or gates == 1 or product.op.tf32):
        return None
    return Plan(product, gates * chosen, "tma" if tma else "copy", unit=chosen)


def swapped_faster(product: cuda_mma_gemm.Product | None, gates: int) -> bool:
    """Whether the planner takes the swapped plan (:func:`swapped_plan`) where there is one:
    16-bit operands, its tiles' rows all gates' (G*U = 64: LSTM), more than one gate.
    H200 layers, us a step (T 100): not swapped (a kernel each where this kernel did not take
    the step) -> swapped (a kernel each, swapped product) [cuDNN]: float16 LSTM 1024 N79
    10.73 -> 7.06 (8.15) [8.92], N128 10.13 -> 8.33 (9.78) [16.32], N256 14.14 -> 13.40
    (14.16) [14.17], LSTM 2048 N96 20.02 -> 18.06 (20.04) [17.64], LSTM 4096 N32 50.3 ->
    45.6 (50.4) [45.1], LSTM 600 N191 12.17 -> 9.64 (12.13) [9.75], LSTM 952 N79 10.68 ->
    9.65 (10.67) [9.42], LSTM 1000 N128 13.21 -> 12.01 (12.61) [11.42], LSTM 512 N256 8.05
    -> 8.06 [8.42]; bfloat16 LSTM 2048 N128 27.58 -> 20.91 (27.81) [21.03], LSTM 1000 N256
    20.27 -> 18.96 (20.31) [15.93], LSTM 1200 N96 12.46 -> 12.15 [11.19]. Not taken: GRU
    (20 units, 60 of 64 rows: float16 GRU 1024 N96 8.09 -> 7.33 (7.52), but bfloat16 GRU
    1024 N100 8.77 -> 10.10 (7.73), float16 GRU 2048 N128 21.19 -> 23.01 (21.37)), TF32
    (LSTM 1024 N128 13.04 -> 12.54, LSTM 600 N191 12.99 -> 10.65, but LSTM 952 N79 11.37 ->
    13.34, GRU 2048 N64 24.99 -> 29.22), over one wave (float16 LSTM 2048 N256 43.45 ->
    46.84)."""
    rows = cuda_wgmma_gemm.SWAPPED_ROWS
    return (product is not None and not product.op.tf32 and gates > 1 and rows % gates == 0
            and rows // gates % 2 == 0)


def swapped_plan(product: cuda_mma_gemm.Product | None, gates: int,
                 unit: int | None = None) -> Plan | None:
    """The swapped plan of one step's ``product`` (:class:`.cuda_wgmma_gemm.Plan`, the
    weights the instructions' A): a tile's 64 rows of W_hh the G gates of U units (the most
    even count with G*U <= 64: LSTM 16, GRU 20), its columns ``cols`` rows of h (a multiple
    of 8, at most SWAPPED_MAX_COLUMNS), the fewest tiles of h's rows whose grid has
    ONE_WAVE[0] blocks or more, else the most blocks; K whole (its tails zeros past it); or
    None where the product cannot be swapped (:func:`.cuda_wgmma_gemm.swappable`), H is
    odd or the grid is over one wave."""
    if (product is None or not cuda_wgmma_gemm.swappable(product) or product.parts != 1
            or product.form != "projection" or product.columns % gates):
        return None
    hidden, n = product.columns // gates, product.rows
    unit = unit or cuda_wgmma_gemm.SWAPPED_ROWS // gates // 2 * 2
    if unit == 0 or unit % 2 or gates * unit > cuda_wgmma_gemm.SWAPPED_ROWS or hidden % 2:
        return None
    tiles = -(-hidden // unit)
    counts = range(-(-n // SWAPPED_MAX_COLUMNS), -(-n // 8) + 1)
    count = next((c for c in counts if tiles * c >= ONE_WAVE[0]), counts[-1])
    if tiles * count > ONE_WAVE[1]:
        return None
    cols = -(-n // (8 * count)) * 8
    return Plan(product, cols, "copy", unit=unit, swapped=True, gates=gates)


@dataclass(frozen=True)
class Step:
    """One step's epilogue: ``cell`` on ``plan``'s product (h [N, K] by W_hh [G*H, K], a
    tile's columns or, swapped, its rows its gates' units); y in the weights' type, the
    states and the input projections float32, h again as the product's A (halves, or float32
    rounded to TF32); ``masked``: the step reads ``active`` [N] int32 (nonzero within the
    sample's length; past it y is zero and the states are kept)."""

    plan: Plan
    cell: Cell
    masked: bool = False

    @cached_property
    def hidden(self) -> int:
        return self.plan.gate_rows

    @cached_property
    def batch(self) -> int:
        return self.plan.product.rows

    def specs(self) -> dict:
        """The kernel's parameters (name: (shape, dtype)): h [N, K] and W_hh [G*H, K] (the
        product's A and B; K = H, or past it with zeros where the layer pads it), b_hh
        [G*H], xp [N, G*H], the cell's per-unit parameters [H] each, the previous states
        [N, H] each, ``active`` [N] where masked, y [N, H], the new states, h again [N, H]
        (its first H columns of the next step's A)."""
        g, h, n = self.cell.gates, self.hidden, self.batch
        (a, a_shape, a_dtype), (w, w_shape, w_dtype) = self.plan.product.specs[:2]
        specs = {a: (a_shape, a_dtype), w: (w_shape, w_dtype), "b_hh": ((g * h,), w_dtype),
                 "xp": ((n, g * h), "float32")}
        specs.update({f"param_{name}": ((h,), "float32") for name in self.cell.params})
        specs.update({f"{s}_prev": ((n, h), "float32") for s in self.cell.states})
        if self.masked:
            specs["active"] = ((n,), "int32")
        specs["y"] = ((n, h), w_dtype)
        specs.update({f"{s}_next": ((n, h), "float32") for s in self.cell.states})
        specs["h_operand"] = ((n, h), a_dtype)
        return specs

    @cached_property
    def read_states(self) -> tuple:
        """The states whose previous values the step reads: those the cell reads, or all
        where masked (a sample past its length keeps them)."""
        count = len(self.cell.states)
        if self.masked:
            return tuple(range(count))
        graph = trace(self.cell)
        first = 2 * self.cell.gates
        return tuple(k for k in range(count) if uses(graph, graph.inputs[first + k]))

    def parameters(self):
        """Inside the PrimFunc being built: its buffer parameters (:meth:`specs`)."""
        return buffer_parameters(self.specs())

    def _named(self, io) -> dict:
        return dict(zip(self.specs(), io))

    def _pairs(self, p: Plan, bi, bj, tx):
        """The thread's (row, unit) pairs: (q, row, unit, its sums' index of gate 0 and the
        sum's distance from one gate to the next), q counting them."""
        lane, u_count = tx % 32, p.unit
        first = bi * p.rows + tx // 32 * 16 + lane // 4
        q = 0
        for m in range(u_count // 8):
            for half in range(2):
                for v in range(2):
                    yield (q, first + half * 8, bj * u_count + m * 8 + lane % 4 * 2 + v,
                           m * 4 + half * 2 + v, u_count // 8 * 4)
                    q += 1

    def _swapped_pairs(self, p: Plan, bi, bj, tx):
        """Swapped (after the exchange): the thread's units two at a time, (m, row i of h,
        its first unit j, the tile's column c of i and unit u of j), m counting them: item
        m * 128 + tx of the tile's U/2 x ``cols`` (consecutive threads, consecutive units)."""
        half = p.unit // 2
        for m in range(self._passes(p)):
            v = m * p.threads + tx
            u, c = v % half * 2, v // half
            yield m, bj * p.cols + c, bi * p.unit + u, c, u

    def _passes(self, p: Plan) -> int:
        """Swapped: the thread's items of two units (:meth:`_swapped_pairs`)."""
        return -(-p.unit // 2 * p.cols // p.threads)

    def _inside(self, p: Plan, i, j, c):
        """Swapped: whether item (i, j, c) is within the tile, N and H."""
        return tirx.all(c < p.cols, i < self.batch, j < self.hidden)

    def registers(self, p: Plan):
        """Inside the root block: the thread's registers of its units' input projections
        ([G * units]) and previous states ([states * units]): U/2 units, or swapped two an
        item (:meth:`_swapped_pairs`), then also the tile's exchange in shared memory."""
        pairs = 2 * self._passes(p) if p.swapped else p.unit // 2
        regs = (T.sblock_alloc_buffer((self.cell.gates * pairs,), "float32", scope="local"),
                T.sblock_alloc_buffer((len(self.cell.states) * pairs,), "float32",
                                      scope="local"))
        if not p.swapped:
            return regs
        exchange = T.sblock_alloc_buffer((p.exchange_bytes // 4,), "float32",
                                         scope="shared.dyn")
        return (*regs, exchange)

    def prologue(self, p: Plan, io, regs, bi, bj, tx):
        """Before the products: the pairs' input projections and previous states loaded
        into ``regs``, two units at once (:data:`LOAD2`; their latency hidden behind the
        products), the states only where the step reads them (:meth:`read_states`)."""
        named, gi, st = self._named(io), regs[0], regs[1]
        h, pairs = self.hidden, p.unit // 2

        def load(dst, index, src):
            T.evaluate(T.cuda.func_call(LOAD2, T.address_of(dst[index]), T.address_of(src),
                                        source_code=LOAD2_SOURCE))

        if p.swapped:
            pairs = 2 * self._passes(p)
            for m, i, j, c, _ in self._swapped_pairs(p, bi, bj, tx):
                with T.If(self._inside(p, i, j, c)):
                    with T.Then():
                        for g in range(self.cell.gates):
                            load(gi, g * pairs + 2 * m, named["xp"][i, g * h + j])
                        for k in self.read_states:
                            load(st, k * pairs + 2 * m,
                                 named[f"{self.cell.states[k]}_prev"][i, j])
            return
        for q, i, j, _, _ in self._pairs(p, bi, bj, tx):
            if q % 2:  # the second unit of two, loaded with the first
                continue
            with T.If(i < self.batch):
                with T.Then():
                    for g in range(self.cell.gates):
                        load(gi, g * pairs + q, named["xp"][i, g * h + j])
                    for k in self.read_states:
                        load(st, k * pairs + q, named[f"{self.cell.states[k]}_prev"][i, j])

    def initial(self, p: Plan, io, bi, bj, tx):
        """The sums' first values, a function of the sum: its column's b_hh (swapped: its
        row's; rows past G*U or H read the last)."""
        b_hh, u_count, lane = self._named(io)["b_hh"], p.unit, tx % 32
        if p.swapped:
            last = self.cell.gates * self.hidden - 1

            def value(e):
                row = tx // 32 * 16 + lane // 4 + e // 2 % 2 * 8
                index = row // u_count * self.hidden + bi * u_count + row % u_count
                return T.Cast("float32", b_hh[tirx.min(index, last)])
            return value

        def value(e):
            column = e // 4 * 8 + lane % 4 * 2 + e % 2
            gate, unit = column // u_count, bj * u_count + column % u_count
            return T.Cast("float32", b_hh[gate * self.hidden + unit])
        return value

    def epilogue(self, p: Plan, io, acc, bi, bj, part, tx, regs):
        """The cell on each of the thread's units and rows within N (and H) (``part``: 0,
        the product is whole); swapped, the sums through the exchange first."""
        gi, st, g_count = regs[0], regs[1], self.cell.gates
        if not p.swapped:
            pairs = p.unit // 2
            for q, i, j, first, stride in self._pairs(p, bi, bj, tx):
                with T.If(i < self.batch):
                    with T.Then():
                        self._unit(p, io, gi, st, pairs, q, i, j,
                                   [acc[first + g * stride] for g in range(g_count)])
            return
        exchange, lane, width = regs[2], tx % 32, p.exchange_stride
        T.evaluate(T.tvm_storage_sync("shared"))  # TVM may lay the exchange over the stages
        for e in range(p.sums):
            row = tx // 32 * 16 + lane // 4 + e // 2 % 2 * 8
            T.buffer_store(exchange, acc[e], [row * width + e // 4 * 8 + lane % 4 * 2 + e % 2])
        T.evaluate(T.tvm_storage_sync("shared"))
        pairs = 2 * self._passes(p)
        for m, i, j, c, u in self._swapped_pairs(p, bi, bj, tx):
            with T.If(self._inside(p, i, j, c)):
                with T.Then():
                    for v in range(2):
                        self._unit(p, io, gi, st, pairs, 2 * m + v, i, j + v,
                                   [exchange[(g * p.unit + u + v) * width + c]
                                    for g in range(g_count)])

    def _unit(self, p: Plan, io, gi, st, pairs, q, i, j, gates_h):
        """The cell at row i of h and unit j, its ``q``-th in the registers, of sums
        ``gates_h`` (b_hh added): y, the new states and h again stored."""
        cell, named = self.cell, self._named(io)
        prev = [st[k * pairs + q] if k in self.read_states else T.float32(0)
                for k in range(len(cell.states))]
        gates_i = [gi[g * pairs + q] for g in range(cell.gates)]
        params = [named[f"param_{name}"][j] for name in cell.params]
        with ops.lowered_with(FAST_FUNCTIONS):
            new = [T.Bind(v) for v in cell.evaluate(gates_i, gates_h, prev, params)]
        out = new[0]
        if self.masked:
            live = named["active"][i] != 0
            out = T.Bind(T.if_then_else(live, new[0], T.float32(0)))
            new = [T.if_then_else(live, v, prev[k]) for k, v in enumerate(new)]
        T.buffer_store(named["y"], T.Cast(named["y"].dtype, out), [i, j])
        for s, value in zip(cell.states, new):
            T.buffer_store(named[f"{s}_next"], value, [i, j])
        T.buffer_store(named["h_operand"], p.product.op.round(out), [i, j])


def kernel(step: Step):
    """The PrimFunc: ``step``'s plan's product (:func:`plan_of`) with its epilogue."""
    return cuda_wgmma_gemm.kernel_of(step.plan, step)
