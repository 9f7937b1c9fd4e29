"""CUDA: a training step's weight gradients, float32 sums over all T*N rows, as a tiled SGEMM
(:mod:`.cuda_sgemm`'s tile and chunk products, its operands read along the rows).

dw[o, k] = sum_m g[m, o] * a[m, k] over the M = T*N rows of all steps (T a run-time size): g
[M, O] the gradients of a projection's outputs, a [M, K] its inputs (dW_hh: dGH and h_{t-1};
dW_ih: dGI and x). A block computes a 128 x 128 tile of dw [O, K] with 256 threads, 8 x 8
outputs a thread as :mod:`.cuda_sgemm` lays them out; M goes in chunks of :data:`BK` rows
through shared memory, double-buffered (the next chunk's 16-byte global loads issued before the
current chunk's products, stored after them; one barrier a chunk). Both operands are read
along M, so a chunk's rows are already k-major: a warp loads and stores one row of 128 floats,
16 bytes a thread, with no transposition. Rows past M read as zeros.

Where the tiles alone leave the GPU short of blocks (O x K = 2048 x 512: 64 tiles, LSTM 512),
M is split in S slices (blockIdx.z, S fixed by the tiles: the most, up to
:data:`MAX_SPLITS`, within :data:`SPLIT_BLOCKS` blocks), each into an [S, O, K] workspace
that a second kernel sums in order (deterministic, unlike atomics).

O and K need not be whole tiles, nor the operands float32: a tile's columns past O or K read
zeros and are not written (16-byte loads and stores where a row is whole 4-vectors, single
elements where it is not), and 16-bit operands (float16, bfloat16: a half layer whose sizes
the tensor-core rules refuse, K under 64 among them, or whose tiles are too few for them,
:data:`.cuda_mma_gemm.HALF_GRADIENT_MIN_TILES`) are read 8 bytes a 4-vector and widened to
float32 as they go to shared memory; dw is written in its own type. A gradient of few
tiles splits M further than :data:`MAX_SPLITS`, up to :data:`MANY_SPLITS`, while its slices
take at most :data:`SLICE_BYTES`: dlight's Matmul, which took these before, spent 2.6 ms on
float16 LSTM 32's dW_ih at batch 512 and T = 100 (one output tile, M = 51200; H200), where
cuDNN's whole training step took 0.5 ms.

Given the samples' lengths (rnncc's weight_gradient component with ``batch``: a layer that
takes them), the sum visits only the rows m = t*N + n with t < lengths[n]: M is their count,
``ends[N - 1]``, laid out sample after sample as :mod:`.cuda_sgemm` lays them out, and each
warp locates its row of a chunk (:func:`.cuda_sgemm._locate`, a bisection of ``ends``) before
it loads it.

dlight's Matmul, which took these products before, ran LSTM 1024's at batch 64 (T*N = 6400)
at 2.9 ms each (about 18 TFLOP/s, H100), cuDNN's 1.2 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ._common import block_named, buffer_parameters, static_extent
from ._rule import Rule
from .cuda_sgemm import PAD, TILE, _locate, products, thread_col, thread_row

#: Rows of M a chunk through shared memory (a warp stages one).
BK = 8
#: Threads a block: 8 x 8 outputs each of a 128 x 128 tile.
THREADS = 256
#: Slices of M: at most MAX_SPLITS (a power of two), the grid at most SPLIT_BLOCKS blocks (two
#: of 256 threads a multiprocessor of an H100/H200); past MAX_SPLITS, up to MANY_SPLITS while
#: the slices' workspace takes at most SLICE_BYTES (a gradient of few tiles).
MAX_SPLITS = 16
MANY_SPLITS = 256
SLICE_BYTES = 8 << 20
SPLIT_BLOCKS = 264
#: The operands' and dw's types this rule takes (sums in float32).
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Gradient:
    """A weight gradient this rule computes: O ``outputs`` x K ``depth``, summed over a
    run-time M; with ``batch`` N, over the rows within the samples' lengths only; g, a and dw
    in ``g_dtype``, ``a_dtype`` and ``dw_dtype``."""

    outputs: int
    depth: int
    batch: int | None = None
    g_dtype: str = "float32"
    a_dtype: str = "float32"
    dw_dtype: str = "float32"

    @property
    def tiles(self) -> tuple:
        """(tiles along O, tiles along K), the last of each perhaps partial."""
        return -(-self.outputs // TILE), -(-self.depth // TILE)

    @property
    def splits(self) -> int:
        tiles = self.tiles[0] * self.tiles[1]
        slice_bytes = self.outputs * self.depth * 4
        splits = 1
        while tiles * splits * 2 <= SPLIT_BLOCKS and (
                splits * 2 <= MAX_SPLITS
                or splits * 2 <= MANY_SPLITS and splits * 2 * slice_bytes <= SLICE_BYTES):
            splits *= 2
        return splits


def sizes(func) -> Gradient | None:
    """The gradient of rnncc's weight_gradient component ``func`` when this rule takes it, else
    None: static O and K, operands and dw in :data:`DTYPES`, sums in float32."""
    sch = s_tir.Schedule(func)
    block = block_named(sch, "weight_grad")
    if block is None or block_named(sch, "weight_grad_out") is None:
        return None
    lengths = [p.name for p in func.params[2:4]] == ["lengths", "ends"]
    dtypes = [str(p.dtype) for p in func.params]
    if lengths and dtypes[2:4] != ["int32", "int32"]:
        return None
    g_dtype, a_dtype, dw_dtype = dtypes[0], dtypes[1], dtypes[-1]
    if {g_dtype, a_dtype, dw_dtype} - set(DTYPES):  # and so the sums in float32
        return None
    o_loop, k_loop, _ = sch.get_loops(block)
    outputs, depth = static_extent(sch, o_loop), static_extent(sch, k_loop)
    if None in (outputs, depth):
        return None
    batch = int(func.params[2].shape[0]) if lengths else None
    return Gradient(outputs, depth, batch, g_dtype, a_dtype, dw_dtype)


class _Tile:
    """A gradient's tile arithmetic, in :func:`.cuda_sgemm.products`' terms: operand "a" is
    g (the tile's rows, O), "w" is a (its columns, K)."""

    stride = {"a": TILE + PAD, "w": TILE + PAD}
    half = {"a": TILE // 2, "w": TILE // 2}
    ty = staticmethod(thread_row)
    tq = staticmethod(thread_col)

    def __init__(self, gradient: Gradient):
        self.gradient = gradient
        self.rows = tirx.Var("M", "int64")
        self.splits = gradient.splits
        self.batch = gradient.batch
        self.t_len = self.rows // self.batch if self.batch else None
        self.lengths = self.ends = None  # with lengths: their buffers (:func:`_parameters`)

    def count(self):
        """The rows summed: M, or with lengths those within the samples' lengths."""
        if self.batch is None:
            return self.rows
        return tirx.Cast("int64", self.ends[self.batch - 1])

    def pairs(self):
        """Chunk pairs a slice: every slice the same count, the last one's past the rows read
        zeros."""
        return (self.count() + (2 * BK * self.splits - 1)) // (2 * BK * self.splits)


def _lanes(vector: bool):
    """A loop over a thread's 4 columns: one 4-vector, or (rows not whole 4-vectors) single
    elements."""
    return T.vectorized(4) if vector else T.unroll(4)


def _summed(splits: int, unrolled: bool):
    """The loop over the slices past the first (``unrolled`` or not)."""
    return T.unroll(1, splits) if unrolled else T.serial(1, splits)


def _within(*pairs):
    """Whether each index lies under its extent ((index, extent, whole) pairs; ``whole``: the
    extent is whole tiles, nothing to check): True, or the condition."""
    conds = [index < extent for index, extent, whole in pairs if not whole]
    return tirx.all(*conds) if conds else True


def _parameters(t: _Tile):
    """The component's parameters: g [M, O], a [M, K], dw [O, K]; with lengths, ``lengths``
    and ``ends`` [N] int32 between a and dw (kept in ``t``)."""
    gr = t.gradient
    o_, k_ = gr.outputs, gr.depth
    specs = {"g": ((t.rows, o_), gr.g_dtype), "a": ((t.rows, k_), gr.a_dtype)}
    if t.batch is not None:
        specs.update({"lengths": ((t.batch,), "int32"), "ends": ((t.batch,), "int32")})
    g, a, *given, dw = buffer_parameters({**specs, "dw": ((o_, k_), gr.dw_dtype)})
    if given:
        t.lengths, t.ends = given
    return g, a, dw


@T.macro
def _columns(x, regs, inside, row, col, width):
    """Columns ``col`` .. + 3 of row ``row`` of ``x`` [M, width] into float32 ``regs``: zeros
    where not ``inside`` or past ``width`` (a row that is not whole tiles)."""
    if width % TILE == 0:
        for v in T.vectorized(4):
            regs[v] = T.if_then_else(inside, T.Cast("float32", x[row, col + v]),
                                     T.float32(0))
    elif width % 4 == 0:
        for v in T.vectorized(4):
            regs[v] = T.if_then_else(tirx.all(inside, col < width),
                                     T.Cast("float32", x[row, T.min(col, width - 4) + v]),
                                     T.float32(0))
    else:
        for v in T.unroll(4):
            regs[v] = T.if_then_else(tirx.all(inside, col + v < width),
                                     T.Cast("float32", x[row, T.min(col + v, width - 1)]),
                                     T.float32(0))


@T.macro
def _load(t, g, a, gr, ar, row, bo, bk, tx, where):
    """Row ``row`` + tx // 32 of the chunk: 4 columns of each operand into registers (zeros
    past the rows); with lengths, the row of step ``where[0]`` of sample ``where[1]``."""
    m = T.meta_var(row + tx // 32)
    o_, k_ = T.meta_var((t.gradient.outputs, t.gradient.depth))
    if t.batch is None:
        _columns(g, gr, m < t.rows, T.min(m, t.rows - 1), bo * TILE + tx % 32 * 4, o_)
        _columns(a, ar, m < t.rows, T.min(m, t.rows - 1), bk * TILE + tx % 32 * 4, k_)
    else:
        where[0] = 0
        where[1] = 0
        if m < t.count():
            _locate(t, T.Cast("int32", m), where)
        src = T.meta_var(T.Cast("int64", where[0]) * t.batch + T.Cast("int64", where[1]))
        _columns(g, gr, m < t.count(), src, bo * TILE + tx % 32 * 4, o_)
        _columns(a, ar, m < t.count(), src, bk * TILE + tx % 32 * 4, k_)


@T.macro
def _store(t, gr, ar, g_s, a_s, tx):
    """The registers of a chunk to shared memory, as they are (already k-major)."""
    for v in T.vectorized(4):
        g_s[tx // 32 * t.stride["a"] + tx % 32 * 4 + v] = gr[v]
    for v in T.vectorized(4):
        a_s[tx // 32 * t.stride["w"] + tx % 32 * 4 + v] = ar[v]


@T.macro
def _tile(t, io, slices, bz, bo, bk, tx):
    """A block's tile over its slice of M: chunk pairs double-buffered as in
    :mod:`.cuda_sgemm`; then the tile to dw (in its type), or to its slice's part of
    ``slices``; where O or K is not whole tiles, only what lies within them."""
    g, a, dw = T.meta_var(io)
    o_, k_ = T.meta_var((t.gradient.outputs, t.gradient.depth))
    g_s0 = T.alloc_buffer((BK * t.stride["a"],), "float32", scope="shared")
    g_s1 = T.alloc_buffer((BK * t.stride["a"],), "float32", scope="shared")
    a_s0 = T.alloc_buffer((BK * t.stride["w"],), "float32", scope="shared")
    a_s1 = T.alloc_buffer((BK * t.stride["w"],), "float32", scope="shared")
    acc = T.alloc_buffer((64,), "float32", scope="local")
    gf = T.alloc_buffer((8,), "float32", scope="local")
    af = T.alloc_buffer((8,), "float32", scope="local")
    gr = T.alloc_buffer((4,), "float32", scope="local")
    ar = T.alloc_buffer((4,), "float32", scope="local")
    where = T.alloc_buffer((2,), "int32", scope="local")  # with lengths: a row's (t, n)
    pairs = T.meta_var(T.bind(t.pairs()))
    first = T.meta_var(T.bind(bz * pairs * (2 * BK)))  # the slice's first row
    for e in T.unroll(64):
        acc[e] = T.float32(0)
    _load(t, g, a, gr, ar, first, bo, bk, tx, where)
    _store(t, gr, ar, g_s0, a_s0, tx)
    T.tvm_storage_sync("shared")
    for c in range(pairs):
        _load(t, g, a, gr, ar, first + (c * 2 + 1) * BK, bo, bk, tx, where)
        products(t, g_s0, a_s0, gf, af, acc, tx)
        _store(t, gr, ar, g_s1, a_s1, tx)
        T.tvm_storage_sync("shared")
        _load(t, g, a, gr, ar, first + T.min(c * 2 + 2, pairs * 2 - 1) * BK, bo, bk, tx,
              where)
        products(t, g_s1, a_s1, gf, af, acc, tx)
        _store(t, gr, ar, g_s0, a_s0, tx)
        T.tvm_storage_sync("shared")
    for r in T.unroll(8):
        for h in T.unroll(2):
            for v in _lanes(k_ % 4 == 0):
                o = T.meta_var(bo * TILE + r // 4 * t.half["a"] + t.ty(tx) * 4 + r % 4)
                k0 = T.meta_var(bk * TILE + h * t.half["w"] + t.tq(tx) * 4)
                if _within((o, o_, o_ % TILE == 0), (k0 + v, k_, k_ % TILE == 0)):
                    if slices is None:
                        dw[o, k0 + v] = T.Cast(dw.dtype, acc[r * 8 + h * 4 + v])
                    else:
                        slices[bz, o, k0 + v] = acc[r * 8 + h * 4 + v]


@T.macro
def sum_slices(dw, slices, splits, unrolled):
    """The second kernel of a weight gradient split along M (this rule's, and
    :mod:`.cuda_wgmma_gemm`'s): dw [O, K] = its ``splits`` slices [S, O, K] (float32) summed in
    order (the loop ``unrolled`` or not), in dw's type; 4 a thread (1 where K is not whole
    4-vectors)."""
    o_, k_ = T.meta_var((int(dw.shape[0]), int(dw.shape[1])))
    vec = T.meta_var(4 if k_ % 4 == 0 else 1)
    items = T.meta_var(o_ * k_ // vec)
    for bx in T.thread_binding(-(-items // 256), thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            if items % 256 == 0 or bx * 256 + tx < items:
                s = T.alloc_buffer((vec,), "float32", scope="local")
                e = T.meta_var((bx * 256 + tx) * vec)
                for v in T.vectorized(vec):
                    s[v] = slices[0, e // k_, e % k_ + v]
                for z in _summed(splits, unrolled):
                    for v in T.vectorized(vec):
                        s[v] = s[v] + slices[z, e // k_, e % k_ + v]
                for v in T.vectorized(vec):
                    dw[e // k_, e % k_ + v] = T.Cast(dw.dtype, s[v])


def kernel(gradient: Gradient):
    """The kernel(s) as a PrimFunc with the component's parameters (g, a, dw)."""
    t = _Tile(gradient)
    o_tiles, k_tiles = gradient.tiles

    @T.prim_func(s_tir=True)
    def weight_grad():
        T.func_attr({"tirx.noalias": True})
        io = T.meta_var(_parameters(t))
        with T.sblock("root"):
            if t.splits == 1:
                for bo in T.thread_binding(o_tiles, thread="blockIdx.y"):
                    for bk in T.thread_binding(k_tiles, thread="blockIdx.x"):
                        for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                            _tile(t, io, None, 0, bo, bk, tx)
            else:
                slices = T.sblock_alloc_buffer((t.splits, gradient.outputs, gradient.depth),
                                               "float32")
                for bz in T.thread_binding(t.splits, thread="blockIdx.z"):
                    for bo in T.thread_binding(o_tiles, thread="blockIdx.y"):
                        for bk in T.thread_binding(k_tiles, thread="blockIdx.x"):
                            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                                _tile(t, io, slices, bz, bo, bk, tx)
                sum_slices(io[2], slices, t.splits, t.splits <= MAX_SPLITS)

    return weight_grad


def apply(func, target):
    found = sizes(func)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.weight_grad", apply)
