"""CUDA: float16 and bfloat16 products of many rows on tensor cores (``mma.sync`` m16n8k16,
float32 sums), written out in TIR: the input projection of all steps, a training step's dx =
dGI W_ih, and its weight gradients; and a float32 projection in TF32 (m16n8k8) where the
component allows it (:mod:`._mma`).

Both forms are C[i, j] = sum_k A[i, k] B[j, k]:

- projection: out[.., n, o] = sum_k a[.., n, k] w[o, k] + b[o] (w [O, K], PyTorch's rows, or
  [K, O]): i the M rows of a (T*N or a flat run-time M), j the O outputs; out float32;
- gradient: dw[o, k] = sum_m g[m, o] a[m, k] over the M = T*N rows of all steps: i = o, j = k;
  dw in the weights' type.

The weights are float16 or bfloat16; an operand in float32 (a gradient, a kept state) is
rounded to the weights' type as it is staged, as cuDNN's half-precision RNNs compute. In TF32
both float32 operands are rounded to TF32 as they are staged.

A block of :data:`THREADS` threads computes a :data:`TILE` x TILE tile of C, its 8 warps 2 x 4
of 64 x 32 (4 x 4 instruction tiles, 64 sums a lane). K goes through shared memory in chunks
of BK (32 halves or 16 TF32 values: 64 bytes of a row), double-buffered (the next chunk's
global loads issued before the current chunk's products, stored after them; one barrier a
chunk). An operand whose k is its buffer's last index ("inner": a, w [O, K]) is staged as it
is read, [row][k]; one whose k runs along the buffer's rows ("outer": w [K, O], and both
operands of a gradient) as [k][row], each k-row padded to an odd count of words so that a
lane's scalar reads of its fragment hit 32 banks.

Fragments (:mod:`._mma`): lane l (q = l % 4, g = l // 4) takes 16 bytes of a chunk's k from
q's quarter for its rows g and g + 8 of A and its row g of B, two k-steps' worth: 16
contiguous bytes of an inner operand. The sums land as the instruction leaves them: lane l
holds rows g and g + 8 of each instruction tile, columns 2q + {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.script import tirx as T

from . import _mma
from ._common import (
    block_named,
    buffer_parameters,
    gemm_blocks,
    has_mma,
    static_extent,
    weights_are_rows,
)
from ._rule import Rule

TILE = 128  # rows (i) and columns (j) of C a block
THREADS = 256
WARPS_J = 4  # warps along j (2 along i)
MT, NT = 4, 4  # instruction tiles a warp: 16-row tiles along i, 8-column tiles along j


def chunk_k(op: _mma.Operand) -> int:
    """BK: k a chunk, a lane's 16 bytes of each of the 4 lanes of a row."""
    return 4 * op.lane_k


def fits(outputs: int, depth: int, op: _mma.Operand) -> bool:
    """Whether a projection of O ``outputs`` and K ``depth`` in ``op`` has this rule's
    sizes."""
    return outputs % TILE == 0 and depth % (2 * chunk_k(op)) == 0


@dataclass(frozen=True)
class Product:
    """A product this rule computes: ``form`` "projection" or "gradient"; ``specs`` the
    component's parameters (name, shape, dtype) with run-time sizes as None; ``inner``
    whether A and B each have k as their buffer's last index; J ``columns``; for a projection
    its K ``depth`` (a gradient's K, its rows M, is a run-time size); ``op`` the operands'
    type (the weights', or TF32)."""

    form: str
    specs: tuple
    inner: tuple
    columns: int
    depth: int
    op: _mma.Operand


def sizes(func, target) -> Product | None:
    """The product of rnncc's gemm (all steps) or weight_gradient component ``func`` when this
    rule takes it, else None: weights float16 or bfloat16 (or a projection's float32 where
    the component allows TF32) on sm_80 or later; a projection with a run-time row count and
    sizes that :func:`fits`; a gradient with O and K multiples of TILE."""
    if not has_mma(target):
        return None
    specs = tuple((str(p.name), tuple(static(d) for d in p.shape), str(p.dtype))
                  for p in func.params)
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is not None and block_named(sch, "gemm_rows") is None:
        (_, a_shape, a_dtype), (_, _, w_dtype) = specs[:2]
        op = _mma.operand(w_dtype, func)
        if op is None or a_dtype not in (w_dtype, "float32") or None not in a_shape:
            return None  # one step's product: cuda.mma_gemv
        _, outputs, depth = (static_extent(sch, x) for x in sch.get_loops(blocks[0])[-3:])
        if not fits(outputs, depth, op):
            return None
        rows = weights_are_rows(sch, blocks[0])
        return Product("projection", specs, (True, rows), outputs, depth, op)
    if block_named(sch, "weight_grad") is not None:
        (_, _, g_dtype), (_, _, a_dtype), (_, dw_shape, dw_dtype) = specs
        op = _mma.operand(dw_dtype)  # a half type: a TF32 gradient is not written
        if op is None or g_dtype != "float32" or a_dtype not in ("float32", dw_dtype):
            return None
        if dw_shape[0] % TILE or dw_shape[1] % TILE:
            return None
        return Product("gradient", specs, (False, False), dw_shape[1], 0, op)
    return None


def static(dim):
    """A dimension's size, or None where it is a run-time size."""
    return int(dim) if isinstance(dim, tirx.IntImm | int) else None


class Tile:
    """A product's tile arithmetic: where each operand's elements are, how a chunk is staged,
    the rows M (a run-time size) and the grid."""

    def __init__(self, product: Product):
        self.product = product
        op = product.op
        self.bk = bk = chunk_k(op)
        #: 4-element vectors of an operand a thread stages a chunk
        self.vectors = TILE * bk // 4 // THREADS
        #: elements from one k-row of an outer operand's staged chunk to the next: an odd
        #: count of words
        self.outer_stride = TILE + (1 if op.tf32 else 2)
        self.rows = tirx.Var("M", "int64")
        if product.form == "projection":
            a_shape = product.specs[0][1]
            # the one run-time size: T (N rows a step) or the rows themselves (flat rows)
            self.runtime = tirx.Var("T_len", "int64") if len(a_shape) == 3 else self.rows
            self.batch = a_shape[1] if len(a_shape) == 3 else None
            self.m = self.runtime * self.batch if self.batch else self.rows
            self.i_tiles = (self.m + (TILE - 1)) // TILE
            self.chunk_pairs = product.depth // (2 * bk)
        else:
            self.runtime = self.m = self.rows
            self.i_tiles = product.specs[2][1][0] // TILE
            self.chunk_pairs = (self.m + (2 * bk - 1)) // (2 * bk)
        self.j_tiles = product.columns // TILE
        self.stage = [TILE * bk if inner else bk * self.outer_stride for inner in product.inner]

    def parameters(self):
        """Inside the PrimFunc being built: the component's parameters, run-time sizes as this
        tile's variable."""
        return buffer_parameters({
            name: (tuple(self.runtime if d is None else d for d in shape), dtype)
            for name, shape, dtype in self.product.specs})

    def at(self, m):
        """The leading indices of row m of a projection's a or out."""
        return [m // self.batch, m % self.batch] if self.batch else [m]

    def element(self, io, op: int, i, k):
        """Element (i, k) of operand ``op`` (0: A, 1: B) in the operands' type; rows of A past
        a projection's M read row M - 1 (never stored), a gradient's k past M read zeros."""
        p, kind = self.product, self.product.op
        if p.form == "projection":
            a, w = io[0], io[1]
            if op == 0:
                return kind.round(tirx.BufferLoad(a, [*self.at(tirx.min(i, self.m - 1)), k]))
            return kind.round(tirx.BufferLoad(w, [i, k] if p.inner[1] else [k, i]))
        value = tirx.BufferLoad(io[op], [tirx.min(k, self.m - 1), i])  # g [M, O], a [M, K]
        return tirx.if_then_else(k < self.m, kind.round(value), tirx.const(0, kind.dtype))

    def stage_place(self, op: int, p_, tx):
        """(row, k) in a chunk of operand ``op`` of the thread's vector ``p_`` (4 elements along
        k for an inner operand, along the rows for an outer one)."""
        f = p_ * THREADS + tx
        if self.product.inner[op]:
            return f // (self.bk // 4), f % (self.bk // 4) * 4
        return f % (TILE // 4) * 4, f // (TILE // 4)

    def slot(self, op: int, row, k):
        """Where element (row, k) of a chunk of operand ``op`` is in its shared buffer."""
        return row * self.bk + k if self.product.inner[op] else k * self.outer_stride + row


@T.macro
def _load(t, io, op, regs, k0, base, tx):
    """Operand ``op``'s global reads of the chunk from k = ``k0`` (its rows from ``base``):
    the thread's vectors into ``regs``, in the operands' type."""
    for p_ in T.unroll(t.vectors):
        row, k = T.meta_var(t.stage_place(op, p_, tx))
        for v in T.vectorized(4):
            if t.product.inner[op]:
                regs[p_ * 4 + v] = t.element(io, op, base + row, k0 + k + v)
            else:
                regs[p_ * 4 + v] = t.element(io, op, base + row + v, k0 + k)


@T.macro
def _store(t, op, regs, shared, tx):
    """Operand ``op``'s registers of a chunk to shared memory: an inner operand's vectors as
    they are (16 bytes at most), an outer one's element by element (its k-rows are not
    vector-aligned)."""
    for p_ in T.unroll(t.vectors):
        row, k = T.meta_var(t.stage_place(op, p_, tx))
        if t.product.inner[op]:
            for v in T.vectorized(4):
                shared[t.slot(op, row, k + v)] = regs[p_ * 4 + v]
        else:
            for v in T.unroll(4):
                shared[t.slot(op, row + v, k)] = regs[p_ * 4 + v]


@T.macro
def _chunk(t, io, regs, k0, bi, bj, tx):
    """Both operands' global reads of the chunk from k = ``k0``."""
    _load(t, io, 0, regs[0], k0, bi * TILE, tx)
    _load(t, io, 1, regs[1], k0, bj * TILE, tx)


@T.macro
def _stage(t, regs, shared, tx):
    """Both operands' registers to shared memory."""
    _store(t, 0, regs[0], shared[0], tx)
    _store(t, 1, regs[1], shared[1], tx)


@T.macro
def _fragment(t, op, shared, out, offset, row, q):
    """out[offset ..] = the lane's 16 bytes of ``row`` of operand ``op``'s chunk (its k from
    q's quarter): one load of an inner one, scalar reads of an outer one (the same row of
    consecutive k-rows)."""
    e = T.meta_var(t.product.op.lane_k)
    if t.product.inner[op]:
        for v in T.vectorized(e):
            out[offset + v] = shared[t.slot(op, row, q * e + v)]
    else:
        for v in T.unroll(e):
            out[offset + v] = shared[t.slot(op, row, q * e + v)]


@T.macro
def _products(t, shared, frags, acc, tx):
    """A chunk's products: the warp's 64 x 32 of C, 2 k-steps (4 x 4 instructions each)."""
    bf, ha, af, wb = T.meta_var(frags)
    kind = T.meta_var(t.product.op)
    g, q = T.meta_var((tx % 32 // 4, tx % 4))
    i0 = T.meta_var(tx // 32 // WARPS_J * (MT * 16))
    j0 = T.meta_var(tx // 32 % WARPS_J * (NT * 8))
    for n in T.unroll(NT):
        _fragment(t, 1, shared[1], bf, n * kind.lane_k, j0 + n * 8 + g, q)
    for m in T.unroll(MT):
        _fragment(t, 0, shared[0], ha, 0, i0 + m * 16 + g, q)
        _fragment(t, 0, shared[0], ha, kind.lane_k, i0 + m * 16 + 8 + g, q)
        for s in T.unroll(2):
            _mma.a_fragment(kind, af, ha, s)
            for n in T.unroll(NT):
                _mma.b_fragment(kind, wb, bf, n * kind.lane_k, s)
                _mma.mma(kind, af, wb, acc, (m * NT + n) * 4)


@T.macro
def _epilogue(t, io, acc, bi, bj, tx):
    """The tile's sums to C: a projection's rows below M plus b, a gradient's in its type."""
    g, q = T.meta_var((tx % 32 // 4, tx % 4))
    i0 = T.meta_var(bi * TILE + tx // 32 // WARPS_J * (MT * 16))
    j0 = T.meta_var(bj * TILE + tx // 32 % WARPS_J * (NT * 8))
    for m in T.unroll(MT):
        for n in T.unroll(NT):
            for h in T.unroll(2):
                i = T.meta_var(i0 + m * 16 + h * 8 + g)
                if t.product.form == "projection":
                    if i < t.m:
                        for v in T.vectorized(2):
                            T.buffer_store(io[3], acc[(m * NT + n) * 4 + h * 2 + v] + T.Cast(
                                "float32", io[2][j0 + n * 8 + q * 2 + v]),
                                t.at(i) + [j0 + n * 8 + q * 2 + v])
                else:
                    for v in T.vectorized(2):
                        T.buffer_store(io[2], T.Cast(t.product.op.dtype,
                                                     acc[(m * NT + n) * 4 + h * 2 + v]),
                                       [i, j0 + n * 8 + q * 2 + v])


def kernel(product: Product):
    """The PrimFunc, with the component's parameters."""
    t = Tile(product)
    op = product.op
    dtype = op.dtype

    @T.prim_func(s_tir=True)
    def mma_gemm():
        T.func_attr({"tirx.noalias": True})
        io = T.meta_var(t.parameters())
        with T.sblock("root"):
            # two buffers an operand and chunk pairs unrolled (as cuda.sgemm: TVM's barrier
            # insertion cannot tell the halves of one buffer apart)
            a0 = T.sblock_alloc_buffer((t.stage[0],), dtype, scope="shared")
            a1 = T.sblock_alloc_buffer((t.stage[0],), dtype, scope="shared")
            b0 = T.sblock_alloc_buffer((t.stage[1],), dtype, scope="shared")
            b1 = T.sblock_alloc_buffer((t.stage[1],), dtype, scope="shared")
            ra = T.sblock_alloc_buffer((t.vectors * 4,), dtype, scope="local")
            rb = T.sblock_alloc_buffer((t.vectors * 4,), dtype, scope="local")
            acc = T.sblock_alloc_buffer((MT * NT * 4,), "float32", scope="local")
            bf = T.sblock_alloc_buffer((NT * op.lane_k,), dtype, scope="local")
            ha = T.sblock_alloc_buffer((2 * op.lane_k,), dtype, scope="local")
            af = T.sblock_alloc_buffer((4 * op.per_register,), dtype, scope="local")
            wb = T.sblock_alloc_buffer((op.lane_k // 2,), dtype, scope="local")
            for bx in T.thread_binding(t.i_tiles * t.j_tiles, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    bi, bj = T.meta_var((bx // t.j_tiles, bx % t.j_tiles))
                    regs, frags = T.meta_var(((ra, rb), (bf, ha, af, wb)))
                    for e in T.unroll(MT * NT * 4):
                        acc[e] = T.float32(0)
                    _chunk(t, io, regs, 0, bi, bj, tx)
                    _stage(t, regs, (a0, b0), tx)
                    T.tvm_storage_sync("shared")
                    for c in range(t.chunk_pairs):
                        _chunk(t, io, regs, (c * 2 + 1) * t.bk, bi, bj, tx)
                        _products(t, (a0, b0), frags, acc, tx)
                        _stage(t, regs, (a1, b1), tx)
                        T.tvm_storage_sync("shared")
                        _chunk(t, io, regs, T.min(c * 2 + 2, t.chunk_pairs * 2 - 1) * t.bk,
                               bi, bj, tx)
                        _products(t, (a1, b1), frags, acc, tx)
                        _stage(t, regs, (a0, b0), tx)
                        T.tvm_storage_sync("shared")
                    _epilogue(t, io, acc, bi, bj, tx)

    return mma_gemm


def apply(func, target):
    found = sizes(func, target)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.mma_gemm", apply)
