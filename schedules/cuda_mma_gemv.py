"""CUDA: one step's recurrent projection with float16 or bfloat16 weights, on tensor cores;
with float32 weights in TF32 where the component allows it (:mod:`._mma`).

out[n, o] = sum_k h[n, k] * W[o, k] + b[o], W and b float16 (or bfloat16), h float32 or the
weights' type [N, K], out float32. h is rounded to the weights' type for the product (as
cuDNN's half-precision RNNs and rnncc's persistent kernel keep it); the sums are float32. In
TF32 h and W are float32, both rounded to TF32 as they are read. ``mma.sync`` m16n8k16
(m16n8k8 in TF32): the batch is the instruction's M (MT = ceil(N/16) tiles, rows past N
zero), 8 output rows of W its N, 16 k (8) a step.

A block of W warps (:data:`WARPS`) owns W / S * NT * 8 output rows (NT n-tiles a warp, S warps
a column group). K goes through shared memory in chunks of KC: the block stages h[:, chunk]
there in the operands' type, row-major with rows padded to 64 bytes past a multiple of 128 (a
warp's 16-byte reads then hit each bank once a phase), and each warp multiplies its 1/S of the
chunk by its rows of W, read straight from global memory (L2: a step's weights, read once a
step, fit there up to 4096 hidden units of an LSTM in 16 bits; an iteration's weights loaded
during the previous one's products); a group's first warp adds the others' sums at the end.
S > 1 where O alone gives few blocks: training's dh = dG W_hh (O = H, K = G*H; LSTM 1024
bfloat16 at batch 64: 55 us a step with S = 1 and 4 warps a block, H100).

Fragments (:mod:`._mma`): of a block of 4 * E k from k0 (E = 8 halves, 4 TF32 values: 16
bytes), lane l (q = l % 4, g = l // 4) reads W[row g][k0 + E*q .. +E] and h[g], h[g+8] at the
same k, two k-steps' worth. The sums land as the instruction leaves them: lane l holds batch
rows g and g + 8 of output rows 2q + {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tvm import s_tir, tirx
from tvm.script import tirx as T

from . import _mma, cuda_small_batch_gemv
from ._common import has_mma, step_product
from ._rule import Rule

#: Warps a block: 8, else 4 where no plan of 8 fits (few outputs and a shallow K).
WARPS = (8, 4)
#: Fewest and most batch rows: below, a persistent plan or cuda.small_batch_gemv; the sums of
#: MT * NT tiles a lane (4 each, at most :data:`MAX_SUMS`) stay in registers.
MIN_BATCH, MAX_BATCH, MAX_SUMS = 9, 256, 64
#: Fewest blocks the grid should have (about one a multiprocessor): NT = 2 where O gives that
#: many without splitting K, else the fewest warps sharing a block's columns that give them.
TARGET_BLOCKS = 128
#: TF32: the fewest blocks a plan must have, else the IEEE rules take the product. Each block
#: stages all of h, so few blocks of a large batch leave the GPU half idle behind little
#: reuse (H200, us a step, T 100, TF32 against IEEE: GRU 512 at batch 256, 24 blocks, 56.2
#: against 30.8; LSTM 2048 at batch 256, 128 blocks, 329 against 512).
TF32_MIN_BLOCKS = 96
#: Static shared memory of a block: the staged chunk of h and the split sums.
SMEM_BYTES = 48 * 1024


@dataclass(frozen=True)
class Plan:
    """N batch rows, K deep, O outputs, h's dtype; NT n-tiles a warp, KC k a chunk; the
    operands' type ("float32": TF32); S warps that share a block's columns, each a 1/S of
    every chunk's K."""

    batch: int
    depth: int
    outputs: int
    a_dtype: str
    n_tiles: int
    chunk: int
    operands: str = "float16"
    k_split: int = 1
    warps: int = WARPS[0]

    @property
    def op(self) -> _mma.Operand:
        return _mma.Operand(self.operands)

    @property
    def block_k(self) -> int:
        """k of a lane-quad's 16 bytes each: a block of two k-steps."""
        return 4 * self.op.lane_k

    @property
    def m_tiles(self) -> int:
        return -(-self.batch // 16)

    @property
    def columns(self) -> int:
        """Output rows of W a block."""
        return self.warps // self.k_split * self.n_tiles * 8

    @property
    def stride(self) -> int:
        """Elements from one staged row of h to the next: 64 bytes past a multiple of 128, so
        that the 8 lanes of a phase of a 16-byte load (rows g and g + 1, 64 bytes each) hit
        the 32 banks once."""
        size = 16 // self.op.lane_k
        return self.chunk + (64 - self.chunk * size % 128) % 128 // size

    @property
    def sums(self) -> int:
        """Sums a lane holds."""
        return self.m_tiles * self.n_tiles * 4

    def split_bytes(self) -> int:
        """Shared memory for the partial sums of the warps past the first of each column
        group."""
        return (self.warps - self.warps // self.k_split) * 32 * self.sums * 4


def plan(batch: int, depth: int, outputs: int, a_dtype: str, operands: str = "float16"
         ) -> Plan | None:
    """The plan for a product, or None where this rule does not take it (see the limits).

    A step's projection with few outputs (dh = dG W_hh in training: O = H, K = G*H) leaves
    few blocks of 8 columns a warp; there S warps share a block's columns and split each
    chunk's K, their sums added through shared memory at the end (S the fewest for
    :data:`TARGET_BLOCKS` blocks whose chunk and sums fit, else the most that fit). TF32
    takes only plans of :data:`TF32_MIN_BLOCKS` blocks or more."""
    block = 4 * _mma.Operand(operands).lane_k
    if not MIN_BATCH <= batch <= MAX_BATCH or depth % block or outputs % 8:
        return None
    rows = -(-batch // 16) * 16
    for warps in WARPS:
        n_tiles = 2 if (outputs % (warps * 16) == 0 and outputs // (warps * 16) >= TARGET_BLOCKS
                        and rows // 16 * 2 * 4 <= MAX_SUMS) else 1
        splits = [s for s in (1, 2, 4, 8)
                  if s <= warps and outputs % (warps // s * n_tiles * 8) == 0]
        enough = [s for s in splits if outputs // (warps // s * n_tiles * 8) >= TARGET_BLOCKS]
        order = enough[:1] + sorted(set(splits) - set(enough[:1]), reverse=True)
        for k_split in order:
            trial = Plan(batch, depth, outputs, a_dtype, n_tiles, block, operands, k_split,
                         warps)
            chunk = next((c for c in (256, 128, 64, 32, 16)
                          if depth % c == 0 and c % (block * k_split) == 0
                          and rows * replace(trial, chunk=c).stride * (16 // trial.op.lane_k)
                          + trial.split_bytes() <= SMEM_BYTES), None)
            if chunk is None:
                continue
            if operands == "float32" and outputs // trial.columns < TF32_MIN_BLOCKS:
                return None  # (4-warp plans of more blocks: not measured in TF32 yet)
            return replace(trial, chunk=chunk)
    return None


def kernel(p: Plan):
    """The PrimFunc, with the gemm component's parameters (a, w, b, gemm_bias)."""
    n_, k_, o_, mt, nt, kc = p.batch, p.depth, p.outputs, p.m_tiles, p.n_tiles, p.chunk
    threads, rows, stride = p.warps * 32, mt * 16, p.stride
    ks_, groups, sums = p.k_split, p.warps // p.k_split, p.sums
    op, e_, dtype = p.op, p.op.lane_k, p.operands
    iters = kc // ks_ // p.block_k  # blocks of 4 * E k a warp's part of a chunk

    @T.macro
    def zero_padding(hs, tx):
        """Once: the staged rows past N are zeros (the staging never writes them)."""
        for e in T.serial((rows - n_) * kc // threads + 1):
            if e * threads + tx < (rows - n_) * kc:
                hs[(n_ + (e * threads + tx) // kc) * stride + (e * threads + tx) % kc] = (
                    tirx.const(0, dtype))

    @T.macro
    def stage(a, hs, c, tx):
        """h[:N, chunk c] into shared memory, in the operands' type."""
        for e in T.serial(-(-(n_ * kc // 4) // threads)):
            if (e * threads + tx) * 4 < n_ * kc:
                for v in T.vectorized(4):
                    hs[(e * threads + tx) * 4 // kc * stride + (e * threads + tx) * 4 % kc + v] = (
                        op.round(a[(e * threads + tx) * 4 // kc,
                                   c * kc + (e * threads + tx) * 4 % kc + v]))

    @T.macro
    def load_w(w, wf, c, kk, col0, part, lane):
        """The lane's weights of iteration ``kk`` of chunk c into half kk % 2 of ``wf``."""
        g, q = T.meta_var((lane // 4, lane % 4))
        for j in T.unroll(nt):
            for v in T.vectorized(e_):
                wf[(kk % 2 * nt + j) * e_ + v] = op.round(
                    w[col0 + j * 8 + g, c * kc + part * (kc // ks_) + kk * p.block_k + q * e_
                      + v])

    @T.macro
    def products(w, hs, acc, frags, c, col0, part, lane):
        """The warp's products of its part of chunk c: a block of 4 * E k an iteration, two
        k-steps; the weights of the next iteration loaded before this one's products (the
        first one's before the chunk is staged)."""
        wf, hab, af, wb = T.meta_var(frags)
        g, q = T.meta_var((lane // 4, lane % 4))
        for kk in T.unroll(iters):
            k0 = T.meta_var(part * (kc // ks_) + kk * p.block_k + q * e_)
            if kk + 1 < iters:
                load_w(w, wf, c, kk + 1, col0, part, lane)
            for m in T.unroll(mt):
                for r in T.unroll(2):  # batch rows g, g + 8
                    for v in T.vectorized(e_):
                        hab[r * e_ + v] = hs[(m * 16 + r * 8 + g) * stride + k0 + v]
                for s in T.unroll(2):
                    _mma.a_fragment(op, af, hab, s)
                    for j in T.unroll(nt):
                        _mma.b_fragment(op, wb, wf, (kk % 2 * nt + j) * e_, s)
                        _mma.mma(op, af, wb, acc, (m * nt + j) * 4)

    @T.macro
    def add_parts(acc, split, group, part, lane):
        """The column group's first warp adds the other warps' sums (via shared memory, one
        word a lane a sum: no bank conflicts)."""
        if part > 0:
            for e in T.unroll(sums):
                split[(((part - 1) * groups + group) * sums + e) * 32 + lane] = acc[e]
        T.tvm_storage_sync("shared")
        if part == 0:
            for z in T.unroll(1, ks_):
                for e in T.unroll(sums):
                    acc[e] = acc[e] + split[(((z - 1) * groups + group) * sums + e) * 32 + lane]

    @T.macro
    def store(b, out, acc, col0, lane):
        """Lane l's sums: batch rows g and g + 8 of each m-tile, output rows 2q + {0, 1} of
        each n-tile, plus the bias."""
        g, q = T.meta_var((lane // 4, lane % 4))
        for m in T.unroll(mt):
            for j in T.unroll(nt):
                for h in T.unroll(2):
                    if m * 16 + h * 8 + g < n_:
                        for v in T.unroll(2):
                            out[m * 16 + h * 8 + g, col0 + j * 8 + q * 2 + v] = (
                                acc[(m * nt + j) * 4 + h * 2 + v]
                                + T.Cast("float32", b[col0 + j * 8 + q * 2 + v]))

    @T.prim_func(s_tir=True)
    def mma_gemv(a: T.Buffer((n_, k_), p.a_dtype), w: T.Buffer((o_, k_), dtype),
                 b: T.Buffer((o_,), dtype), gemm_bias: T.Buffer((n_, o_), "float32")):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):
            hs = T.sblock_alloc_buffer((rows * stride,), dtype, scope="shared")
            split = T.sblock_alloc_buffer((max(1, p.split_bytes() // 4),), "float32",
                                          scope="shared")
            acc = T.sblock_alloc_buffer((sums,), "float32", scope="local")
            wf = T.sblock_alloc_buffer((2 * nt * e_,), dtype, scope="local")
            hab = T.sblock_alloc_buffer((2 * e_,), dtype, scope="local")
            af = T.sblock_alloc_buffer((4 * op.per_register,), dtype, scope="local")
            wb = T.sblock_alloc_buffer((e_ // 2,), dtype, scope="local")
            for bx in T.thread_binding(o_ // p.columns, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    group, part = T.meta_var((tx // 32 // ks_, tx // 32 % ks_))
                    col0 = T.meta_var(bx * p.columns + group * nt * 8)
                    for i in T.unroll(sums):
                        acc[i] = T.float32(0)
                    if rows > n_:
                        zero_padding(hs, tx)
                    for c in T.serial(k_ // kc):
                        load_w(w, wf, c, 0, col0, part, tx % 32)
                        stage(a, hs, c, tx)
                        T.tvm_storage_sync("shared")
                        products(w, hs, acc, (wf, hab, af, wb), c, col0, part, tx % 32)
                        T.tvm_storage_sync("shared")
                    if ks_ > 1:
                        add_parts(acc, split, group, part, tx % 32)
                    if part == 0:
                        store(b, gemm_bias, acc, col0, tx % 32)

    return mma_gemv


def apply(func, target):
    product = step_product(func)
    if product is None or not has_mma(target):
        return None  # one step's product [N, K] x [O, K] only
    a_dtype, w_dtype, batch, outputs, depth = product
    op = _mma.operand(w_dtype, func)
    if op is None or a_dtype not in (w_dtype, "float32"):
        return None
    if op.tf32 and cuda_small_batch_gemv.takes_tf32(batch, depth, outputs):
        return None
    found = plan(batch, depth, outputs, a_dtype, op.dtype)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.mma_gemv", apply)
