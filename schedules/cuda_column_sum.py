"""CUDA: a bias's gradient, the column sums of its product's gradients over all T*N rows.

db[o] = sum_m g[m, o]: g [M, O] in float32 (the accumulation dtype) or the layer's 16-bit dtype
(a half layer's gradients), summed in float32 (M = T*N a run-time size), db [O] in the layer's
dtype. A block sums :data:`COLUMNS` adjacent columns with
:data:`COLUMNS` x :data:`LANES` threads: thread (lane, column) adds rows lane, lane + LANES, ...
of its column (a warp reads a row's 128 contiguous bytes), :data:`UNROLL` rows in flight in
independent sums; the lanes' sums meet in shared memory and the first lane adds them in order
(deterministic: no atomics). Columns past O do nothing.

Where the columns' blocks are few (O under 32 * :data:`SPLIT_BLOCKS` / 2), M is split in S
slices too (:attr:`Sums.splits`, blockIdx.y), each block's sums into an [S, O] workspace
that a second kernel adds in order: float16 LSTM 32's db_ih at batch 512 and T = 100 (O =
128, M = 51200) had 4 blocks, 53 us of a training step whose whole took 380 (H200).

The fallback rules ran these sums with one thread a column over all M rows on O / 1024 blocks:
LSTM 1024's at batch 64 (M = 6400, O = 4096) took 0.65 ms each (H100), as long as a third of
its weight gradient's product.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from ._common import block_named
from ._rule import Rule

#: Columns a block (a warp's width: its loads of a row coalesce).
COLUMNS = 32
#: Threads that share a column, each taking every LANES-th row.
LANES = 32
#: Rows a thread has in flight, each into its own sum.
UNROLL = 4
#: Slices of M: the most (a power of two, up to MAX_SPLITS) within SPLIT_BLOCKS blocks (two of
#: 1024 threads a multiprocessor of an H100/H200).
MAX_SPLITS = 64
SPLIT_BLOCKS = 264


@dataclass(frozen=True)
class Sums:
    """The column sums this rule computes: O ``outputs`` columns of ``g_dtype`` over a
    run-time M, into ``dtype``."""

    outputs: int
    dtype: str
    g_dtype: str = "float32"

    @property
    def blocks(self) -> int:
        """Blocks along O (:data:`COLUMNS` columns each)."""
        return -(-self.outputs // COLUMNS)

    @property
    def splits(self) -> int:
        """Slices of M, S (1: none)."""
        splits = 1
        while splits * 2 <= MAX_SPLITS and self.blocks * splits * 2 <= SPLIT_BLOCKS:
            splits *= 2
        return splits


def sizes(func) -> Sums | None:
    """The sums of rnncc's column_sum component ``func`` when this rule takes it, else None:
    g in float32 or a 16-bit float, O a constant."""
    sch = s_tir.Schedule(func)
    block = block_named(sch, "column_sum")
    if block is None or block_named(sch, "column_sum_out") is None:
        return None
    g, out = func.params[0], func.params[-1]
    if str(g.dtype) not in ("float32", "float16", "bfloat16") or len(out.shape) != 1:
        return None
    outputs = out.shape[0]
    if not isinstance(outputs, tirx.IntImm):
        return None
    return Sums(int(outputs), str(out.dtype), str(g.dtype))


def _parameters(sums: Sums, rows):
    """The component's parameters: g [M, O], db [O]."""
    g = T.match_buffer(T.arg("g_h", T.handle()), (rows, sums.outputs), sums.g_dtype)
    IRBuilder.name("g", g)
    db = T.match_buffer(T.arg("db_h", T.handle()), (sums.outputs,), sums.dtype)
    IRBuilder.name("db", db)
    return g, db


@T.macro
def _lane_sum(first, span, count, g, part, lane, column):
    """A lane's sum of its rows of ``column`` among the ``count`` from ``first`` into
    ``part``[0], UNROLL sums in flight; ``span``: rows of every block's range (the last one's
    perhaps fewer), so that every block takes the same rounds."""
    acc = T.alloc_buffer((UNROLL,), "float32", scope="local")
    for u in T.unroll(UNROLL):
        acc[u] = T.float32(0)
    for i in range(T.ceildiv(span, LANES * UNROLL)):
        for u in T.unroll(UNROLL):
            r = T.meta_var((i * UNROLL + u) * LANES + lane)
            if r < count:
                acc[u] = acc[u] + T.Cast("float32", g[first + r, column])
    part[0] = acc[0]
    for u in T.unroll(1, UNROLL):
        part[0] = part[0] + acc[u]


@T.macro
def _block_sum(sums, first, span, count, g, store, bx, lane, tx):
    """Block ``bx``'s columns over the ``count`` rows from ``first`` (of a ``span``): the
    lanes' sums, then the first lane adds them in order and ``store``s each column's."""
    shared = T.alloc_buffer((LANES * (COLUMNS + 1),), "float32", scope="shared")
    part = T.alloc_buffer((1,), "float32", scope="local")
    column = T.meta_var(bx * COLUMNS + tx)
    part[0] = T.float32(0)
    if column < sums.outputs:
        _lane_sum(first, span, count, g, part, lane, column)
    shared[lane * (COLUMNS + 1) + tx] = part[0]
    T.tvm_storage_sync("shared")
    if lane == 0:
        for k in T.unroll(1, LANES):
            part[0] = part[0] + shared[k * (COLUMNS + 1) + tx]
        if column < sums.outputs:
            store(column, part[0])


def _into(buffer, *lead):
    """A store of a column's float32 sum into ``buffer``[*lead, column], in its type."""
    def store(column, value):
        T.buffer_store(buffer, T.Cast(buffer.dtype, value), [*lead, column])
    return store


@T.macro
def _sum_slices(sums, partial, db):
    """The second kernel of split sums: each column's slices added in order."""
    for bx in T.thread_binding(T.ceildiv(sums.outputs, 256), thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            if bx * 256 + tx < sums.outputs:
                total = T.alloc_buffer((1,), "float32", scope="local")
                total[0] = partial[0, bx * 256 + tx]
                for z in range(1, sums.splits):
                    total[0] = total[0] + partial[z, bx * 256 + tx]
                db[bx * 256 + tx] = T.Cast(sums.dtype, total[0])


def kernel(sums: Sums):
    """The kernel(s) as a PrimFunc with the component's parameters (g, db)."""
    rows = tirx.Var("M", "int64")

    @T.prim_func(s_tir=True)
    def column_sum():
        T.func_attr({"tirx.noalias": True})
        g, db = T.meta_var(_parameters(sums, rows))
        with T.sblock("root"):
            if sums.splits == 1:
                for bx in T.thread_binding(sums.blocks, thread="blockIdx.x"):
                    for lane in T.thread_binding(LANES, thread="threadIdx.y"):
                        for tx in T.thread_binding(COLUMNS, thread="threadIdx.x"):
                            _block_sum(sums, 0, rows, rows, g, _into(db), bx, lane, tx)
            else:
                partial = T.sblock_alloc_buffer((sums.splits, sums.outputs), "float32")
                span = T.meta_var(T.ceildiv(rows, sums.splits))
                for bz in T.thread_binding(sums.splits, thread="blockIdx.y"):
                    for bx in T.thread_binding(sums.blocks, thread="blockIdx.x"):
                        for lane in T.thread_binding(LANES, thread="threadIdx.y"):
                            for tx in T.thread_binding(COLUMNS, thread="threadIdx.x"):
                                first = T.meta_var(bz * span)
                                count = T.meta_var(T.bind(T.min(span, rows - first)))
                                _block_sum(sums, first, span, count, g, _into(partial, bz), bx,
                                           lane, tx)
                _sum_slices(sums, partial, db)

    return column_sum


def apply(func, target):
    found = sizes(func)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.column_sum", apply)
