"""CPU: the projections, blocked for the caches.

Expects rnncc's gemm component with weights in "cols" layout (W^T [K, O], outputs
contiguous), in one of two forms by the rows it multiplies:

- One row (one step's product at batch 1, a GEMV): a task takes a block of up to
  :data:`ROW_BLOCK` outputs and goes down K, adding x[k] * W^T[k, block] to the block's sums
  (in L1), so that it reads W^T in long runs along its rows.
- Several rows: a task takes a block of a vector's width of outputs (16) and tiles the rows
  by a divisor of N (up to 4); for each tile the k loop accumulates a [rows, 16] block in
  registers and the bias epilogue runs on the tile while it is hot. Where the product has
  :data:`MANY_ROWS` rows or more (the products of all steps, T*N rows, or one step's at a large
  batch), the task first copies its column block of W^T, [K, 16], into contiguous memory, which
  its tiles then read: the strided block is read once a task, not once a tile. There, where N
  holds fewer than :data:`TILE_ROWS` rows, the block is that many times wider ([1, 64] tiles
  at batch 1, [2, 32] at batch 2; the products of all steps at batch 1, [100, 1] x 256 x 1024
  on one thread of this machine, 2.1-2.3 ms -> 1.2 ms, torch.addmm 0.7-0.8 ms).

Before, every product took the second form without the copy. On this repository's CPU machine
(AMD EPYC, Zen 3, 2 cores), us a product: 400 x 256 x 1024 (LSTM 256's input projection of 100
steps at batch 4) 5437 -> 3600, the same at batch 1 5051 -> 2395; rnncc.nn.LSTM, T = 100, us a
step: H = 256 batch 1 167 -> 77, H = 512 batch 1 498 -> 239, H = 64 batch 1 15.5 -> 7.5; batch
4 and 64 within noise; GRU 256 batch 16 328 -> 289. (One task for a whole row of W^T, 1024 to
4096 outputs, was faster still there at batch 1, 1 x 256 x 1024 26 against 40 us on two
threads, but gives up the parallelism of a larger CPU: not taken. On one thread the rule's 18
us is about the bandwidth of streaming W^T's 1 MB from L3.)
"""

from tvm import s_tir

from ._common import divisor, gemm_blocks, static_extent
from ._rule import Rule

#: Outputs a task of the one-row form sums at once (at most 1 KB of sums, in L1), most first.
ROW_BLOCK = (256, 128, 64, 32, 16, 8, 4)
#: Rows from which a task copies its column block of W^T first.
MANY_ROWS = 32
#: Rows a register tile of the copied form aims at: where N (a divisor of it) holds fewer, the
#: tile takes TILE_ROWS // rows vectors of columns instead of one (its sums' chains of FMAs
#: are independent: one row by one vector left the FMAs' latency exposed).
TILE_ROWS = 4


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None:
        return None
    gemm, bias = blocks
    loops = sch.get_loops(gemm)
    if len(loops) < 3:
        return None
    outer, n, o, k = loops[:-3], loops[-3], loops[-2], loops[-1]
    rows = static_extent(sch, n)
    if rows is None:
        return None
    if rows == 1 and not outer:
        return _one_row(sch, gemm, bias, o, k)
    many = bool(outer) or rows >= MANY_ROWS
    per_tile = divisor(rows, (4, 3, 2))
    n_o, n_i = sch.split(n, [None, per_tile])
    vec = divisor(static_extent(sch, o), (16, 8, 4))
    # a tile of fewer rows takes more vectors of columns (TILE_ROWS // rows of them)
    wide = divisor(static_extent(sch, o) // vec, (TILE_ROWS // per_tile, 2)) if many else 1
    o_o, o_u, o_i = sch.split(o, [None, wide, vec])
    if many:  # a column block a task, its slab of W^T copied first, then every row tile
        sch.reorder(o_o, *outer, n_o, k, n_i, o_u, o_i)
        tile = o_o
        slab = sch.cache_read(gemm, 1, "local")
        sch.compute_at(slab, tile)
        copy = sch.get_loops(slab)[1:]  # none where the slab is one element (K = 1, O = 1)
        if copy:
            _, lanes = sch.split(copy[-1], [None, divisor(vec, (8, 4))])
            sch.vectorize(lanes)
        epilogue_at = n_o
    else:
        sch.reorder(*outer, n_o, o_o, k, n_i, o_i)
        tile = sch.fuse(*outer, n_o, o_o)
        epilogue_at = tile
    sch.parallel(tile)
    sch.unroll(n_i)
    sch.unroll(o_u)
    if vec > 1:
        sch.vectorize(o_i)
    sch.decompose_reduction(gemm, k)
    sch.reverse_compute_at(bias, epilogue_at)
    if vec > 1:
        sch.vectorize(sch.get_loops(bias)[-1])
    return sch


def _one_row(sch, gemm, bias, o, k):
    """The one-row form: a task a block of outputs, down K along W^T's rows."""
    block = divisor(static_extent(sch, o), ROW_BLOCK)
    vec = divisor(block, (8, 4))
    o_o, o_m, o_v = sch.split(o, [None, block // vec, vec])
    sch.reorder(o_o, k, o_m, o_v)
    sch.parallel(o_o)
    sch.set_scope(gemm, 0, "local")
    if vec > 1:
        sch.vectorize(o_v)
    sch.decompose_reduction(gemm, k)
    sch.reverse_compute_at(bias, o_o)
    if vec > 1:
        _, lanes = sch.split(sch.get_loops(bias)[-1], [None, vec])
        sch.vectorize(lanes)
    return sch


RULE = Rule("cpu.gemm", apply)
