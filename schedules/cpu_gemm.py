"""CPU: the projections, blocked for the caches.

Expects rnncc's gemm component with weights in "cols" layout (W^T [K, O], outputs
contiguous), in one of two forms by the rows it multiplies:

- One row (one step's product at batch 1, a GEMV): a task takes a block of up to
  :data:`ROW_BLOCK` outputs and goes down K, adding x[k] * W^T[k, block] to the block's sums
  (in L1), so that it reads W^T in long runs along its rows.
- Several rows: a task takes a block of a vector's width of outputs (16) times W and tiles the
  rows by 4 (fewer where N holds fewer; a tile past N's last row is cut short): for each tile
  the k loop accumulates a [rows, 16 W] block in registers and the bias epilogue runs on the
  tile while it is hot. W gives the tile as many sums as :func:`accumulators` allows (half the
  vector registers). Where the product has :data:`MANY_ROWS` rows or more (the products of
  all steps, T*N rows, or one step's at a large batch), the task first copies its column
  block of W^T, [K, 16 W], into contiguous memory, which its tiles then read: the strided block
  is read once a task, not once a tile.

On this repository's CPU machine (AMD EPYC, Zen 4, AVX-512, 2 threads), one step's product,
us, before (tiles of a divisor of N rows, one vector wide where the rows were few) -> now,
the two alternated: 4 x 256 x 1024 25.3 -> 10.1, 2 x 256 x 1024 24.2 -> 5.9, 7 x 512 x 2048
631.9 -> 106.5, 31 x 256 x 1024 712.3 -> 88.1, 8 x 512 x 2048 173.5 -> 79.8, 16 x 512 x 2048
348.6 -> 159.0; 16 x 256 x 768 and 64 x 128 x 512 unchanged (torch.addmm, 4 x 256 x 1024:
about 70).

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
#: Rows a register tile takes (fewer where N holds fewer); the copied form's tile takes
#: TILE_ROWS // rows vectors of columns (its sums' chains of FMAs are independent: one row by
#: one vector left the FMAs' latency exposed).
TILE_ROWS = 4


def accumulators(target) -> int:
    """Vectors of 16 float32 sums a register tile of one step's product keeps: half the
    vector registers, 16 with AVX-512 (32 registers of 16 floats), else 4 (AVX2's 16 of 8,
    NEON's 32 of 4)."""
    from tvm.target import codegen

    return 16 if codegen.target_has_features("avx512f", target) else 4


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
    # a tile holds one step's rows: across two steps the epilogue's region of a tile is no
    # rectangle of [T, N] (it takes in rows the tile has not computed), and tiles of T*N rows
    # need a bound on each row where T is known at run time only (2-4x slower, T*1 x 256 x 1024;
    # at batch 1 and 2 the lowering gives this rule [T/S, 4] views of whole steps instead:
    # rnncc.lowering.sequence's step_tiles)
    per_tile = min(rows, TILE_ROWS)
    n_o, n_i = sch.split(n, [None, per_tile])
    vec = divisor(static_extent(sch, o), (16, 8, 4))
    # a tile of fewer rows takes more vectors of columns
    wide = divisor(static_extent(sch, o) // vec, (TILE_ROWS // per_tile, 2) if many else [
        d for d in (16, 8, 4, 2, 1) if d * per_tile <= accumulators(target)])
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
        sch.reorder(n_o, o_o, k, o_u, n_i, o_i)
        tile = sch.fuse(n_o, o_o)
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
