"""CUDA on Hopper (sm_90): the products of :mod:`.cuda_mma_gemm` (the input projection of all
steps, one step's product in slices of K, a training step's dx and weight gradients) on
warpgroup MMA, ``wgmma.mma_async``: the tensor cores read both operands from shared memory
through matrix descriptors, the sums stay in registers.

C[i, j] = sum_k A[i, k] B[j, k] as :mod:`.cuda_mma_gemm` names its forms: a projection (plus b,
M a run-time size or one step's N), slice s of K of one step's product (no bias), or a
weight's gradient (over a run-time M; in the weights' type). An operand whose k is its
buffer's last index is staged K-major as below; one whose k runs along its buffer's rows (both
of a gradient, weights [K, O]; 16-bit only) MN-major, and the instruction told so
(:class:`Plan`). H200, a bfloat16 LSTM 1024 training step at T*N = 6400: dW_ih 84 us and
dW_hh 81 (its h copied to bfloat16 first, 20; as float32 through registers 191), against
cuda.mma_gemm's ``ldmatrix.trans`` kernel's 210 and 220 with float32 dGI (cuDNN: 82 each);
dx with W_ih read as packed 95 us, against 162 plus a 26 us transposed copy.

A block computes a tile of C of ``tile_rows`` (128, or 64 where one step's N is at most 64) x
``cols`` columns (TILE = 128, or WIDE = 256 where :func:`columns` says): a warpgroup (4 warps,
128 threads) a 64-row part, one m64n<cols>k16 (halves) or m64n<cols>k8 (TF32) instruction a
32-byte step of k, cols / 2 float32 sums a thread. K goes through shared memory in chunks of
128 bytes a row (64 halves, 32 TF32 values), ``stages`` of them (up to :data:`STAGES`, as many
as fit: 4 in wide tiles) in one dynamic buffer, ``ahead`` = stages - 2 chunks copied ahead by
``cp.async`` (16 bytes a copy, 8 threads a row). Rows are staged with the 128-byte swizzle the
descriptors name: 16-byte piece p of row r lies at piece p ^ (r % 8) of its 128 bytes, so 8
threads copying a row write 8 different bank groups. TF32 operands are copied as float32
and read as they are stored: the tensor cores use a float32's upper 19 bits (they truncate,
as the simulator does). Their writers round them to nearest where that costs nothing (weights
as the layer packs them, h as its cell step writes it: :data:`._mma.TF32_ROUNDED_ATTR`); the
others (x among them) are truncated. Rounding those in place (each thread its pieces, once
their copies were waited for) cost a layer's step 2-7% (H200, TF32 LSTM 2048 N256 76.2 ->
71.3 us a step, LSTM 1024 N256 22.8 -> 21.4) for an error of 3.4e-4 of float64 instead of
4.5e-4 (TF32's bound: 5e-3). A float32 A under half weights (one step's h), whose type
changes, goes through registers instead: loaded ``ahead`` chunks ahead, stored rounded a
chunk later, as that chunk's first work. A chunk: the thread's copies of it are waited for,
the stores of the last loads made, all made visible to the tensor cores' (async) proxy, one
barrier; the copies (loads) of chunk c + ahead are issued into the stage that chunk c - 2 read
(its products are done: a warpgroup waits for all but its last group of products); 4
instructions are issued and committed as one group. The sums land as the instruction leaves
them: thread t of warp w of the warpgroup holds rows 16 w + t // 4 + {0, 8}, columns
8 n + 2 (t % 4) + {0, 1} of each 8-column tile n.

Where both operands are stored in the operands' type and a block's part of K is long
(:func:`tma_fed`: 16 chunks and more, tiles of 128 rows), the TMA engine copies them instead
(:mod:`._tma`): one producer thread in a warp after the warpgroups, up to 6 stages, a full and
an empty mbarrier a stage, the warpgroups waiting only for the data; one step's two row tiles
run as a cluster of two blocks that multicast the weights' tile. H200, float16 LSTM 2048 N256,
us a step: 46.3 -> 42.4 (cuDNN 37.9); N96 26.5 -> 21.1; TF32 LSTM 2048 N256 70.7 -> 64.5.

A projection (weights as rows) whose O or K is not whole tiles and chunks is taken too where
O is even and a row of K whole 16-byte copies, or 8-byte ones in 16 bits (:attr:`Plan.tail`,
:attr:`Plan.narrow`): the grid covers them, copies past K are zeros and columns past O are
not stored; of all steps, and one step's in slices of whole chunks but the last
(:func:`.slice_depth`). H200 layers, us a step: bfloat16 GRU 800 N128 39.0 -> 20.0, float16
LSTM 1000 N64 10.5 -> 6.8, TF32 LSTM 1500 N32 44.2 -> 33.3 (the input projection was dlight's
generic kernel); one step's: float16 LSTM 1000 N128 66.3 -> 13.9, LSTM 2000 N64 147.3 -> 16.2,
TF32 LSTM 1000 N128 40.0 -> 15.1 (cuda.tiled_gemm's, cuda.matmul's or cuda.sgemm's before).
A 16-bit weight gradient whose dW [O, K] is past whole tiles (O and K multiples of 4, pieces of
8 bytes where not of 8) is taken too: the pieces past O or K read their last, nothing is
stored past them (H200, a
float16 LSTM 1000 N128 training step, eager: 93.6 -> 39.7 us a step; cuda.weight_grad took
2.7 ms a gradient). Rows of K off 128 bytes cost the kernel: one step's float16 79 x 952 x
3808 in 4 slices 8.4 us, 79 x 1024 x 4096 7.2 (79 x 760 x 3040 7.7, 79 x 768 x 3072 6.2).

One step's product at few rows N (at most 256) is taken in swapped tiles where those fill
one wave or less (:func:`swapped`): W_hh is the instructions' A, 64 rows of O a tile, and h
B, its N rows in tiles of a multiple of 8 (not padded to 64 or 128), the sums stored
transposed (H200 layers, us a step: float16 LSTM 952 N79 18.9 -> 10.8, cuDNN 9.3).

The code needs the arch-specific sm_90a (rnncc builds sm_90's cubins for it).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from . import _tma, cuda_mma_gemm, cuda_weight_grad
from ._common import COMPACT_ATTR, has_wgmma, slice_depth
from ._rule import Rule

TILE = cuda_mma_gemm.TILE  # columns of C a block, and rows of a tile of many rows
SWAPPED_ROWS = 64  # rows of O a swapped tile (:class:`Plan`): one warpgroup's
#: float32 a row of a swapped fused step's exchange past its columns (:class:`Plan`): a
#: multiple of 4 keeps the exchange whole 1024 bytes (the stages' alignment, were TVM to lay
#: them after it)
EXCHANGE_PAD = 4
#: Bytes of k a slice of a swapped tile at least where its grid is two waves, and the most
#: rows N swapped (:func:`swapped`)
SWAPPED_DEEP, SWAPPED_MAX_ROWS = 2048, 256
ROW_BYTES = 128  # a staged row of a chunk: one swizzle row
SWIZZLE_ROWS = 8  # rows of the swizzle's period (1024 bytes): the descriptors' stride
STEP_BYTES = 32  # k of an instruction: 16 halves or 8 TF32 values
SWIZZLE_128B = 3  # TVM's code for the 128-byte swizzle in a matrix descriptor
WARPGROUP = 128
#: Chunks in shared memory (at most STAGES, as many as SHARED_BYTES holds), copied 2 fewer ahead
#: (chunk c - 1's products may still read theirs). H200, float16 [6400 x 1024] x [1024 x 4096],
#: 128 x 128 tiles, kernel alone: 4 stages 2 ahead 180 us, 5 and 3 172, 6 and 4 171 (cuBLAS 91).
#: Against cuda.mma_gemm (H100, kernel alone): that product 112 us against 190, TF32 420 against
#: 553 (cuBLAS 95, 173); one step's in slices, 256 x 1024 x 4096: 14.8 against 16.5, TF32 24.8
#: against 28.4; at N = 64 (64-row tiles, before one step's product took one wave's slices)
#: TF32 64 x 2048 x 8192 46.8 against 41.1.
STAGES = 5
#: Stages where the TMA engine copies (as many as fit, up to this). H200, float16 one-step
#: products, kernel alone, us, 4 stages against 7 (128 x 128 tiles): 256 x 1024 x 4096 in 2
#: slices 7.49 / 7.64, 128 x 2048 x 8192 11.2 / 12.4, 135 x 1024 x 4096 8.47 / 8.39.
TMA_STAGES = 6
#: The fewest chunks of K a block whose operands the TMA engine copies (fewer: the copying
#: kernel, whose first copies start sooner). H200, float16 one-step products, the kernel
#: alone, us, copying / TMA: 256 x 1024 x 4096 in 2 slices (8 chunks a block) 6.99 / 7.55;
#: 96 x 2048 x 8192 in 2 (16) 16.6 / 11.3; 256 x 2048 x 8192 (32) 22.4 / 17.6. Layers, us a
#: step, copying -> TMA: float16 LSTM 1024 N256 (8 chunks) 15.6 -> 16.0, LSTM 2048 N96 (16)
#: 26.4 -> 20.9.
TMA_CHUNKS = 16
SHARED_BYTES = 227 * 1024  # dynamic shared memory a block may have on sm_90
#: One step's product: its slices of K and tiles' width, one wave of blocks (one a
#: multiprocessor). Of the (S, width) whose grid has ONE_WAVE[0] to ONE_WAVE[1] blocks,
#: the fewest slices of WIDE columns (each at least WIDE_DEPTH deep where A is copied), else
#: the fewest of TILE columns. H100, kernel alone, TF32, us, that choice against the best of S
#: 1-8 x both widths (cuda.mma_gemm's count in wide tiles, before): 256 x 1024 x 4096 17.4
#: best (18.5), 256 x 1024 x 3072 16.7 best (23.7), 256 x 2048 x 8192 48.5 best, 256 x 2048 x
#: 6144 46.1 best (52.2), 128 x 1024 x 4096 11.3 best (13.5), 128 x 2048 x 8192 34.0 best
#: (38.8), 192 x 1024 x 4096 19.2 (17.1). Where A (h, float32) goes through registers under
#: half weights, wide tiles halve its share of each chunk: H200 layers, us a step, narrow ->
#: wide first: float16 LSTM 1024 N256 28.4 -> 26.2, N192 25.3 -> 21.6, N128 17.1 -> 18.8,
#: bfloat16 GRU 1024 N256 25.6 -> 22.5 (29.5 before), LSTM 2048 N128 47.2 -> 39.0. At N <= 64
#: (64-row tiles, one warpgroup a block), against cuda.mma_gemm's slices (two blocks a
#: multiprocessor, 1.5 waves), H200 layers, us a step: TF32 GRU 2048 N64 34.4 -> 26.4, LSTM
#: 2048 N64 42.1 -> 32.8, GRU 1024 N64 11.1 -> 8.8, LSTM 1024 N64 13.5 -> 10.4, GRU 2048 N32
#: 30.7 -> 27.9; float16 LSTM 2048 N64 (sequence) 15.2; but float32 split in three TF32
#: products (tf32x3) slower: LSTM 2048 N64 70.3 -> 70.8, N32 52.9 -> 58.0, GRU 2048 N64 56.6
#: -> 64.4 (it stays cuda.mma_gemm's there).
#: Elsewhere (a projection of all steps: many rows) tiles are WIDE where O allows. H200, 128
#: -> 256 columns: TF32 6400 x 1024 x 4096 356 -> 291, 6400 x 2048 x 8192 1402 -> 1073,
#: 1600 x 1024 x 4096 113 -> 86; bfloat16 6400 x 2048 x 8192 510 -> 387, float16 6400 x
#: 1024 x 4096 108 -> 110, 1600 x 512 x 2048 14.8 -> 12.7.
#: Where the TMA engine copies 16-bit operands, 128 columns first (H200, the kernel alone, us:
#: float16 256 x 2048 x 8192 whole in 128 columns 17.6, in 2 slices of 256 19.6; 192 x 2048 x
#: 8192 16.8 / 17.5; 256 x 2048 x 6144 16.2 / 16.7); TF32 keeps 256 first (256 x 2048 x 8192:
#: 2 slices of 256 31.7, whole in 128 34.5).
WIDE, WIDE_DEPTH, ONE_WAVE = 256, 1024, (96, 132)
#: A 16-bit weight gradient of few tiles splits its M (a run-time size) in S slices: the most
#: (a power of two up to GRADIENT_MAX_SPLITS) within GRADIENT_BLOCKS blocks whose [S, O, K]
#: float32 workspace takes at most GRADIENT_SLICE_BYTES; a second kernel adds them in order.
GRADIENT_MAX_SPLITS, GRADIENT_BLOCKS, GRADIENT_SLICE_BYTES = 32, 132, 8 << 20

#: 16 bytes of shared memory (4 float32) split in three TF32 products' two parts: the TF32 part
#: (``cvt.rna.tf32.f32``) in place, the rest (exact) 16 bytes at ``small``.
SPLIT_SOURCE = """
__device__ __forceinline__ void rnncc_split_tf32x4(void* shared, void* small) {
  float4* at = (float4*)shared;
  float4 v = *at;
  unsigned int r[4];
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[0]) : "f"(v.x));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[1]) : "f"(v.y));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[2]) : "f"(v.z));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r[3]) : "f"(v.w));
  float4 big = make_float4(__uint_as_float(r[0]), __uint_as_float(r[1]),
                           __uint_as_float(r[2]), __uint_as_float(r[3]));
  *at = big;
  *(float4*)small = make_float4(v.x - big.x, v.y - big.y, v.z - big.z, v.w - big.w);
}
"""


def sizes(func, target) -> cuda_mma_gemm.Product | None:
    """The product of component ``func`` where this rule takes it, on sm_90: one step's in
    the slices :func:`one_step` gives; else one that :func:`.cuda_mma_gemm.sizes` takes (an
    operand whose k runs along its buffer's rows in 16 bits only: TF32 is K-major), but for
    one step's product of split float32 in N <= 64 rows (:mod:`.cuda_mma_gemm`'s is faster
    there; past whole tiles :func:`one_step` says); float32 split into three TF32 products
    where pipelined (a weight gradient split: cuda.mma_gemm's alone); a 16-bit gradient of
    any count of tiles (few: M split, :func:`gradient_splits`); else None."""
    if not has_wgmma(target):
        return None
    found = cuda_mma_gemm.product_of(func, target)
    if found is None or (found.op.tf32 and not found.pipelined):
        return None
    if found.form != "gradient" and found.depth % Plan.chunk(found.op) and not found.tails:
        return None
    chosen = one_step(found)
    if chosen is not None:
        return found if found.parts == chosen.slices else None
    takes = (found.tails or (found.form == "gradient" and not found.op.split)  # few tiles: split
             or cuda_mma_gemm.takes(found))
    return found if takes and found.tile_rows >= TILE else None


class Shape(NamedTuple):
    """One step's product as a kernel: S ``slices`` of K, ``cols`` a tile, ``swapped`` or
    not (:class:`Plan`)."""

    slices: int
    cols: int
    swapped: bool = False


def one_step(product: cuda_mma_gemm.Product) -> Shape | None:
    """The :class:`Shape` of one step's ``product`` (any slices it is given): where tiles of
    its N rows can be as :data:`ONE_WAVE` says (128 columns first where the TMA engine can
    copy 16-bit operands; past whole tiles and chunks, :attr:`.cuda_mma_gemm.Product.tails`,
    which no other rule's slices take, where none gives one wave, the choice of the most
    blocks within one), the :func:`swapped` one where there is one, else that one; None
    where no choice gives one wave, or it is not one step's product, or one of split float32
    in N <= 64 rows but past whole tiles and chunks in over 32 (:func:`_split_in_small_tiles`).
    H200, the kernel alone, us, tiles of N rows -> swapped (``cols`` / S):
    float16 79 x 952 x 3808 7.76 -> 6.09 (80/2), 96 x 1000 x 3000 11.42 -> 6.07 (96/2),
    191 x 600 x 2400 8.51 -> 5.83 (96/1), 79 x 1024 x 4096 7.02 -> 4.04, 128 x 1024 x 4096
    6.24 -> 4.82, 256 x 1024 x 4096 8.09 -> 6.74 (128/1), 32 x 2000 x 8000 16.1 -> 8.18,
    64 x 2048 x 8192 7.90 -> 7.61; bfloat16 100 x 1024 x 4096 6.51 -> 5.27; TF32 79 x 952
    x 3808 10.52 -> 6.62, 128 x 1000 x 4000 8.15 -> 7.42; but float16 128 x 1000 x 4000
    7.55 -> 8.59. H200 layers, us a step (cuDNN): float16 LSTM 952 N79 18.9 -> 10.8 (9.3),
    GRU 1000 N96 15.3 -> 9.5 (9.7), LSTM 600 N191 16.1 -> 12.0 (9.4), LSTM 1024 N256 15.5
    -> 14.2 (14.1); bfloat16 LSTM 1200 N96 15.3 -> 12.5 (11.1); TF32 LSTM 952 N79 17.1 ->
    11.5 (14.6)."""
    if product.rows is None or (product.tile_rows < TILE and product.op.split
                                and not _split_in_small_tiles(product)):
        return None
    chosen = unswapped(product)
    return chosen and (swapped(product) or chosen)


def _split_in_small_tiles(product: cuda_mma_gemm.Product) -> bool:
    """Whether one step's ``product`` of split float32 in N <= 64 rows (a 64-row tile) is
    this rule's: past whole tiles and chunks (:mod:`.cuda_mma_gemm`'s are faster on whole
    ones, and take no other) where N fills over half the tile; cuda.sgemm's otherwise, whose
    time follows N. H200, float32 layers, us a step, cuda.sgemm -> this rule (cuDNN): LSTM
    1500 N32 37.3 -> 50.1 (65.2), GRU 1500 N32 35.6 -> 45.3 (54.0), GRU 600 N33 12.9 -> 13.0,
    LSTM 952 N40 25.2 -> 21.4 (32.4), GRU 3488 N45 258.1 -> 178.9 (202.4), LSTM 1000 N48 27.1
    -> 21.9, LSTM 1500 N60 55.6 -> 55.6, GRU 1000 N64 24.5 -> 21.2, LSTM 2000 N64 108.7 ->
    72.3 (112.2)."""
    return product.tails and 2 * product.rows > product.tile_rows


def unswapped(product: cuda_mma_gemm.Product) -> Shape | None:
    """:func:`one_step`'s :class:`Shape` in tiles of N rows (not swapped), or None."""
    depth, bk = product.k_total, Plan.chunk(product.op)
    row_tiles = -(-product.rows // product.tile_rows)
    counts = [s for s in range(1, cuda_mma_gemm.MAX_PARTS + 1)
              if s & (s - 1) == 0 and _slices_fit(depth, s, bk, product.tails)]
    if product.op.split:
        widths = ((TILE, 0),)
    elif _tma_operands(product) and not product.op.tf32:
        widths = ((TILE, 0), (WIDE, 0))
    else:
        widths = ((WIDE, WIDE_DEPTH if product.copied else 0), (TILE, 0))
    most = None  # past whole tiles: (blocks, S, width) of the most blocks within one wave
    for cols, deep in widths:
        for s in counts:
            blocks = row_tiles * -(-product.columns // cols) * s
            if not (product.tails or product.columns % cols == 0) or depth // s < deep:
                continue
            if ONE_WAVE[0] <= blocks <= ONE_WAVE[1]:
                return Shape(s, cols)
            if product.tails and blocks <= ONE_WAVE[1] and (most is None or blocks > most[0]):
                most = (blocks, s, cols)
    return Shape(*most[1:]) if most else None


def swappable(product: cuda_mma_gemm.Product) -> bool:
    """Whether one step's ``product`` may be taken in swapped tiles (:class:`Plan`): N at
    most SWAPPED_MAX_ROWS, pipelined, not split float32, both operands copied as stored, rows
    of K whole 16-byte copies."""
    return (product.rows is not None and product.rows <= SWAPPED_MAX_ROWS
            and not product.op.split and product.pipelined
            and all(product.specs[q][2] == product.op.dtype for q in (0, 1))
            and product.k_total * _bytes(product.op) % 16 == 0)


def swapped(product: cuda_mma_gemm.Product) -> Shape | None:
    """The swapped :class:`Shape` of one step's ``product`` (:class:`Plan`): h's N rows in the
    fewest tiles of at most TILE (``cols`` a multiple of 8), and the most slices S (a power
    of two, :func:`_slices_fit`) whose grid is one wave (ONE_WAVE[1] blocks), or two where a
    slice is at least SWAPPED_DEEP bytes of k; None where the whole product's tiles are over
    one wave (H200 layers, us a step, tiles of N rows -> swapped: float16 GRU 2048 N256
    34.8 -> 39.3, TF32 LSTM 2048 N256 66.7 -> 79.8), or both operands are not copied as
    stored, or float32 is split, or N is over SWAPPED_MAX_ROWS (not measured), or rows of K
    are not whole 16 bytes (copies of 8 bytes: float16 LSTM 1500 N64 14.4 -> 17.3)."""
    if not swappable(product):
        return None
    n, depth, bk = product.rows, product.k_total, Plan.chunk(product.op)
    col_tiles = -(-n // TILE)
    base = -(-product.columns // SWAPPED_ROWS) * col_tiles
    if base > ONE_WAVE[1]:
        return None
    most = 1
    for s in (2 ** e for e in range(1, cuda_mma_gemm.MAX_PARTS.bit_length())):
        if not _slices_fit(depth, s, bk, product.tails):
            continue
        deep = slice_depth(depth, s) * _bytes(product.op)
        if base * s <= ONE_WAVE[1] or (base * s <= 2 * ONE_WAVE[1] and deep >= SWAPPED_DEEP):
            most = s
    return Shape(most, -(-n // (8 * col_tiles)) * 8, True)


def _slices_fit(depth: int, s: int, bk: int, tails: bool) -> bool:
    """Whether K ``depth`` goes in S = ``s`` slices (:func:`.slice_depth`) of whole chunks of
    ``bk``, each at least MIN_SLICE deep where S > 1: K / S each, or past whole chunks and
    tiles (``tails``) the last one shorter but not empty."""
    deep = slice_depth(depth, s)
    if not tails and deep * s != depth:
        return False
    return deep % bk == 0 and (s - 1) * deep < depth and (
        s == 1 or deep >= cuda_mma_gemm.MIN_SLICE)


def parts(func, target) -> int:
    """The slices of K this rule splits the one-step product of gemm component ``func`` into,
    where it takes that product on this target (:func:`one_step`); else those of
    :func:`.cuda_mma_gemm.parts` (1 where neither slices it)."""
    found = cuda_mma_gemm.product_of(func, target)
    if found is None or found.rows is None:
        return 1
    chosen = one_step(found) if has_wgmma(target) and found.pipelined else None
    return chosen.slices if chosen else cuda_mma_gemm.slices(found)  # (1 past whole tiles)


def _tma_operands(product: cuda_mma_gemm.Product) -> bool:
    """Whether ``product``'s operands are ones the TMA engine can copy (:mod:`._tma`): both
    K-major and stored in the operands' type (16-bit, or TF32 read as stored), rows of K whole
    16 bytes (the tensor map's stride), in tiles of 128 rows; not split float32 (its parts are
    made in shared memory) nor a gradient."""
    return (product.form != "gradient" and product.pipelined and not product.op.split
            and product.copied and product.specs[1][2] == product.op.dtype
            and product.tile_rows == TILE and product.k_total * _bytes(product.op) % 16 == 0)


def tma_fed(product: cuda_mma_gemm.Product) -> bool:
    """Whether the TMA engine copies ``product``'s operands: where it can
    (:func:`_tma_operands`) and a block's part of K is at least TMA_CHUNKS chunks."""
    return _tma_operands(product) and -(-product.depth // Plan.chunk(product.op)) >= TMA_CHUNKS


def columns(product: cuda_mma_gemm.Product) -> int:
    """Columns of C a block: one step's product's by :func:`one_step`; a gradient's WIDE where
    that still gives ONE_WAVE[0] blocks; else WIDE where O is a multiple (TILE otherwise;
    always where float32 is split: :class:`Plan`'s small parts take the shared memory)."""
    if product.op.split:
        return TILE
    chosen = one_step(product)
    if chosen is not None:
        return chosen.cols
    if product.tails:  # WIDE unless its columns past O are over an eighth of O
        return WIDE if -(-product.columns // WIDE) * WIDE <= product.columns * 9 // 8 else TILE
    if product.columns % WIDE:
        return TILE
    if product.form == "gradient":
        tiles = -(-product.specs[2][1][0] // TILE) * (product.columns // WIDE)
        return WIDE if tiles >= ONE_WAVE[0] else TILE
    return WIDE if product.rows is None else TILE


def _bytes(op) -> int:
    """Bytes an element of operand type ``op``."""
    return 4 if op.tf32 else 2


class Plan:
    """A product's block, chunks and staging: tiles of C of ``tile_rows`` x ``cols`` columns
    (TILE or WIDE), the rows' elements those of :class:`.cuda_mma_gemm.Tile`. An operand is
    staged K-major (its rows of 128 bytes of k) where k is its buffer's last index, else
    MN-major ("outer": a gradient's g [M, O] and a [M, K], weights [K, O]; 16-bit only): a
    chunk's ``bk`` k-rows of 128 bytes (64 of its rows) an atom column, atom columns one after
    another, and the instructions told the operand is transposed."""

    def __init__(self, product: cuda_mma_gemm.Product, cols: int = TILE,
                 feed: str | None = None, persistent: int = 0, unit: int | None = None,
                 swapped: bool = False, gates: int | None = None):
        self.product = product
        #: swapped (one step's product, both operands copied as stored): the instructions'
        #: A is the weights, SWAPPED_ROWS of O a tile, and B h, ``cols`` (a multiple of 8) of
        #: its N rows, so that few rows N are not padded to 64 or 128; C's tile is then
        #: transposed, and so stored. ``which``: the component's operand that A and B are
        self.swapped = swapped
        self.which = (1, 0) if swapped else (0, 1)
        if swapped and (product.rows is None or product.op.split
                        or not all(product.specs[q][2] == product.op.dtype for q in (0, 1))
                        or (unit and (gates is None or gates * unit > SWAPPED_ROWS))):
            raise ValueError("a swapped tile is one step's product's, both operands copied as "
                             f"stored, not split float32, its G gates' U units at most "
                             f"{SWAPPED_ROWS} rows: {product.specs}, U {unit}, G {gates}")
        #: with ``unit`` U (one fused step, :mod:`.cuda_wgmma_step`): a tile's columns are its
        #: G = cols / U gates' U units each, B's rows g*H + t*U .. of each gate g (H: the
        #: product's columns / G), so that a thread holds each of its units' G sums; swapped,
        #: A's rows so (G ``gates`` given, G*U at most SWAPPED_ROWS, the rest of the 64 rows
        #: and units past H unused), the sums exchanged through shared memory
        self.unit = unit
        self.gates = gates if swapped else cols // unit if unit else None
        self.gate_rows = product.columns // self.gates if unit else None
        self.tile = cuda_mma_gemm.Tile(product)
        op = product.op
        self.cols = cols
        self.esize = _bytes(op)
        self.bk = self.chunk(op)
        self.steps = ROW_BYTES // STEP_BYTES  # instructions a chunk
        self.rows = SWAPPED_ROWS if swapped else product.tile_rows
        self.threads = self.rows // 64 * WARPGROUP
        self.a_bytes = self.rows * ROW_BYTES
        self.stage_bytes = self.a_bytes + cols * ROW_BYTES
        #: split float32: the small parts of a chunk's operands (their stage holds the TF32
        #: parts) in one of two twins after the stages (chunk c's products may still read
        #: theirs while chunk c + 1 is split)
        self.split = op.split
        self.twin_bytes = self.stage_bytes if self.split else 0
        #: a swapped fused step's float32 sums [SWAPPED_ROWS, ``exchange_stride``] in shared
        #: memory beside the stages (TVM lays it over them: its writes wait at a barrier for
        #: the last products), written as the instructions leave them, read by unit and row
        self.exchange_stride = cols + EXCHANGE_PAD
        self.exchange_bytes = SWAPPED_ROWS * self.exchange_stride * 4 if swapped and unit else 0
        self.stages = min(STAGES, (SHARED_BYTES - 2 * self.twin_bytes - self.exchange_bytes)
                          // self.stage_bytes)
        # chunk c - 1's products may still read their stage as chunk c + ahead is copied (but
        # where split: they are waited for before chunk c's barrier)
        self.ahead = self.stages - (1 if self.split else 2)
        self.smem_bytes = self.stages * self.stage_bytes + 2 * self.twin_bytes
        self.warpgroups = self.rows // 64
        #: fed by the TMA engine (:mod:`._tma`): as many stages as fit (up to TMA_STAGES), a
        #: producer warp after the warpgroups (``launched`` threads), and clusters of two
        #: blocks, the two row tiles of one step's product, where its row tiles are an even
        #: count; ``b_rows``: the rows of B's tile that a block of the cluster copies, in
        #: boxes of ``box`` rows (a gate's, or half of one where the blocks share an odd
        #: count of gates: :meth:`row_of`)
        self.tma = not swapped and tma_fed(product) if feed is None else feed == "tma"
        if self.tma and (swapped or not _tma_operands(product)):
            raise ValueError(f"the TMA engine cannot copy this product's operands: "
                             f"{product.specs[:2]} ({product.form}); feed 'copy' takes it")
        if persistent and not self.tma:
            raise ValueError("persistent tiles are the TMA-fed kernel's (feed 'tma')")
        #: persistent: a grid of at most that many blocks (one a multiprocessor: 132), each
        #: taking tiles bx, bx + grid, ... (its producer copying the next tile's chunks while
        #: its warpgroups store the last one's); 0: a block a tile
        self.persistent = persistent
        self.cluster, self.b_rows, self.launched = 1, cols, self.threads
        if self.tma:
            self.stages = min(TMA_STAGES, SHARED_BYTES // self.stage_bytes)
            self.smem_bytes = self.stages * self.stage_bytes
            rows = product.rows
            if rows is not None and -(-rows // self.rows) % 2 == 0 and not persistent:
                self.cluster = 2
            self.b_rows = cols // self.cluster
            self.launched = self.threads + 32
        self.box = self.b_rows
        if unit:
            self.box = unit if cols // unit % self.cluster == 0 else unit // self.cluster
        #: 16-byte pieces of a chunk of A and of B a thread copies (or loads); a swapped B
        #: of ``cols`` not a multiple of 16: its last ones not all a thread's
        self.pieces = [-(-width * 8 // self.threads) for width in (self.rows, cols)]
        self.per = 16 // self.esize  # elements a piece
        self.gradient = product.form == "gradient"
        #: whether operand A, B is staged MN-major
        self.outer = tuple(not product.inner[q] for q in self.which)
        #: rows of operand A, B a tile
        self.widths = (self.rows, cols)
        # a gradient's chunks of its run-time M, at least one (ptxas serialized the
        # warpgroup MMA of a loop that might run no time: "C7515 ... non wgmma instructions
        # defining accumulator registers"; a step's M is never 0, and zeros past it are added)
        #: (split in S slices, :func:`gradient_splits`: a slice's, every slice's the same,
        #: the last ones' past M zeros)
        self.chunks = (tirx.max(tirx.Cast("int32", tirx.floordiv(
            self.tile.m + (self.bk * product.parts - 1), self.bk * product.parts)), 1)
            if self.gradient else -(-product.depth // self.bk))
        #: K or O past whole chunks and tiles (:attr:`.cuda_mma_gemm.Product.tails`): copies
        #: past K zero-filled (by the TMA engine past its tensor maps), B's rows past O read
        #: its last, columns past O not stored
        self.tail = product.tails
        #: by operand: rows whole 8-byte copies only (16-bit, K = 4 mod 8, or a gradient's O
        #: or K so): each piece copied in two halves (``cp.async.ca`` of 8 bytes), never by
        #: the TMA engine
        extents = (product.specs[2][1] if self.gradient and product.edges
                   else (product.k_total,) * 2 if self.tail else (0, 0))
        self.narrow = tuple(e * self.esize % 16 != 0 for e in extents)
        #: the k from which the operands read zero (a gradient's M, a product's K past whole
        #: chunks), else None
        self.k_end = self.tile.m if self.gradient else product.k_total if self.tail else None
        #: tiles of A's rows and of B's
        self.i_tiles = (-(-self.gate_rows // unit) if swapped and unit
                        else -(-product.columns // self.rows) if swapped else self.tile.i_tiles)
        self.j_tiles = -(-(product.rows if swapped else product.columns) // cols)
        self.tiles = self.grid = product.parts * self.i_tiles * self.j_tiles
        self.rounds = 1  # tiles a block takes, at most
        if self.persistent:
            fewer = min if isinstance(self.tiles, int) else tirx.min
            self.grid = fewer(self.tiles, persistent)
            self.rounds = (self.tiles + persistent - 1) // persistent
        self.sums = cols // 2  # a thread's float32 sums
        self.kstep = kstep = STEP_BYTES // self.esize
        ptx = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}[op.dtype]
        shape = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{cols}k{kstep}").f32
        self.instruction = getattr(getattr(shape, ptx), ptx)
        #: scale-a, scale-b (and for halves: A's and B's transposition, 1 where MN-major)
        self.flags = (1, 1) if op.tf32 else (1, 1, *(int(outer) for outer in self.outer))

    def gradient_inside(self, i, j):
        """Whether a gradient's row i and columns j, j + 1 of dW are within it (True where it
        is whole tiles)."""
        if not self.product.edges:
            return True
        outputs, depth = self.product.specs[2][1]
        return tirx.all(i < outputs, j < depth)

    def k_first(self, part):
        """The first k of slice ``part``: of K (one step's product in slices), or of M (a
        gradient's, :func:`gradient_splits`)."""
        return part * self.chunks * self.bk if self.gradient else part * self.product.depth

    def tile_of(self, bx):
        """(slice, row tile, column tile) of block ``bx``: the column tiles fastest (the
        blocks that run together read one tile of A), but in clusters their row tiles (which
        read one tile of B)."""
        i_tiles, j_tiles = self.i_tiles, self.j_tiles
        if self.cluster > 1:
            return bx // (i_tiles * j_tiles), bx % i_tiles, bx // i_tiles % j_tiles
        return bx // (i_tiles * j_tiles), bx // j_tiles % i_tiles, bx % j_tiles

    def origin(self, io, op: int):
        """The address of operand ``op``'s first element (its tensor map's)."""
        return T.address_of(tirx.BufferLoad(io[op], [0] * len(io[op].shape)))

    @staticmethod
    def chunk(op) -> int:
        """k a chunk: 128 bytes of a row."""
        return ROW_BYTES // _bytes(op)

    def has(self, op: int, p_, tx):
        """Whether the thread has a ``p_``-th piece of operand ``op``: True where every thread
        has as many (all but a swapped B whose ``cols`` are not a multiple of 16)."""
        total = self.widths[op] * 8
        return True if total % self.threads == 0 else p_ * self.threads + tx < total

    def used(self, op: int, t, row):
        """Whether staged ``row`` of operand ``op``'s tile ``t`` (K-major) is copied: swapped,
        not rows of h past N, nor a fused step's rows of W_hh past its G*U or past H
        (:attr:`unit`), nor others' past O, whose sums are never stored; they would all read
        one row, every block the same (H200, the step alone, bfloat16 GRU 1024 N100, us: 4
        such rows of W_hh a tile, U 20, 7.9; 16, U 16, 12.5; a layer, bfloat16 GRU 600 N79,
        17 rows of h past N a tile: 7.56 -> 6.35 us a step). Every row of the others."""
        if not self.swapped:
            return True
        if op == 1:
            return t * self.cols + row < self.product.rows
        if not self.unit:
            return t * self.rows + row < self.product.columns
        return tirx.all(row < self.gates * self.unit,
                        t * self.unit + row % self.unit < self.gate_rows)

    def place(self, op: int, p_, tx):
        """(row, piece) of a chunk of operand ``op`` the thread's ``p_``-th piece is: a staged
        row (one of the operand's rows K-major, a k MN-major) and its 16 bytes (8 threads a
        row K-major, width / 8 MN-major)."""
        v = p_ * self.threads + tx
        across = self.widths[op] // self.per if self.outer[op] else 8
        return v // across, v % across

    def row_of(self, op: int, t, r):
        """The stored row of operand ``op`` (0: A, 1: B) that staged row ``r`` of its tile
        ``t`` is: the tile's rows in order, but the weights' with gates (:attr:`unit` U; B's,
        or swapped A's) gate r // U's unit t*U + r % U."""
        if op != (0 if self.swapped else 1) or not self.unit:
            return t * self.widths[op] + r
        return r // self.unit * self.gate_rows + t * self.unit + r % self.unit

    def at(self, op: int, row, piece, t, k0, v=0):
        """(i, k): element ``v`` of piece ``piece`` of staged ``row`` of a chunk of operand
        ``op`` from k = ``k0`` (of its tile ``t``)."""
        if self.outer[op]:
            return self.row_of(op, t, piece * self.per + v), k0 + row
        return self.row_of(op, t, row), k0 + piece * self.per + v

    def source(self, io, op: int, i, k):
        """Element (i, k) of operand ``op`` as it is stored; a gradient's k past M reads row
        M - 1 (and its i past O or K its last piece), a k past K the last piece of its row
        (16 bytes, as a copy of the piece would), B's rows past O its last (:func:`_copy`
        zero-fills past M or K, :meth:`value` reads zero there)."""
        if self.gradient:  # g [M, O], a [M, K]; past O or K (edges) their last piece
            if self.product.edges:
                extent = self.product.specs[2][1][op]
                per = self.per // 2 if self.narrow[op] else self.per  # elements a copy
                i = tirx.min(i, extent - per + i % per)
            return tirx.BufferLoad(io[op], [tirx.min(k, self.tile.m - 1), i])
        q = self.which[op]
        if self.tail:
            depth = self.product.k_total
            per = self.per // 2 if self.narrow[op] else self.per  # elements a copy
            k = tirx.min(k, depth - per + k % per)
        if q == 1 and (self.tail or self.swapped):
            i = tirx.min(i, self.product.columns - 1)
        return self.tile.source(io, q, i, k)

    def value(self, io, op: int, i, k):
        """:meth:`source`, zero at a gradient's k past M and past a product's K."""
        if self.k_end is not None:
            return tirx.if_then_else(k < self.k_end, self.source(io, op, i, k),
                                     tirx.const(0, io[op].dtype))
        return self.source(io, op, i, k)

    def _base(self, op: int, stage, twin):
        """The byte where operand ``op``'s rows start in ``stage``, or (``twin`` not None) in
        small-part twin ``twin``."""
        first = stage * self.stage_bytes if twin is None else (
            self.stages * self.stage_bytes + twin * self.twin_bytes)
        return first + (self.a_bytes if op else 0)

    def slot(self, op: int, stage, row, piece, twin=None):
        """Where piece ``piece`` of staged ``row`` of operand ``op`` (0: A, 1: B) in ``stage``
        (or in small-part twin ``twin``) is stored (an element of the buffer): swizzled
        within its 128 bytes (MN-major: in its atom column, ``bk`` k-rows of 128 bytes)."""
        base = self._base(op, stage, twin)
        if self.outer[op]:
            base, piece = base + piece // 8 * self.bk * ROW_BYTES, piece % 8
        return (base + row * ROW_BYTES + (piece ^ row % SWIZZLE_ROWS) * 16) // self.esize

    def step(self, op: int, stage, s, tx, twin=None):
        """The element where the rows of operand ``op`` that k-step ``s`` reads start (in
        ``stage``, or in small-part twin ``twin``): the thread's warpgroup's 64 rows of A
        (MN-major: its atom column), all rows of B."""
        base = self._base(op, stage, twin)
        if self.outer[op]:  # k-step s: k-rows 16 s to 16 s + 15
            first = tx // WARPGROUP * self.bk * ROW_BYTES if op == 0 else 0
            return (base + first + s * self.kstep * ROW_BYTES) // self.esize
        rows = tx // WARPGROUP * 64 * ROW_BYTES if op == 0 else 0
        return (base + rows + s * STEP_BYTES) // self.esize

    def offsets(self, op: int) -> tuple[int, int]:
        """The descriptor's (leading, stride) byte offsets of operand ``op``, in 16 bytes: from
        one core matrix to the next along k (K-major: none within a swizzled row) or along
        the rows (MN-major: the next atom column), and from 8 rows (K-major) or 8 k-rows
        (MN-major) to the next 8, 1024 bytes either way."""
        stride = SWIZZLE_ROWS * ROW_BYTES // 16
        return (self.bk * ROW_BYTES // 16 if self.outer[op] else 1), stride

    def copied(self, op: int) -> bool:
        """Whether operand ``op`` is copied as it is stored (else through registers,
        rounded): where it is stored in the operands' type (TF32: read as stored; weights
        always; a float32 h or kept state not)."""
        return self.product.specs[self.which[op]][2] == self.product.op.dtype


@T.macro
def _copy_piece(p, io, op, smem, stage, k0, t, p_, tx):
    """The thread's ``p_``-th piece of operand ``op``'s chunk from k = ``k0`` (of its tile
    ``t``) copied by ``cp.async`` into ``stage`` (:func:`_copy`)."""
    row, piece = T.meta_var(p.place(op, p_, tx))
    i, k = T.meta_var(p.at(op, row, piece, t, k0))
    if p.narrow[op]:  # two copies of 8 bytes (zeros past K, or a gradient's M)
        for h in T.unroll(2):
            i_h, k_h = T.meta_var(p.at(op, row, piece, t, k0, h * (p.per // 2)))
            T.ptx.cp.async_.ca.shared.global_(
                T.address_of(smem[p.slot(op, stage, row, piece) + h * (p.per // 2)]),
                T.address_of(p.source(io, op, i_h, k_h)), 8,
                T.Cast("uint32", T.if_then_else(T.Cast("int64", k_h) < p.k_end, 8, 0)))
    elif p.k_end is not None:
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(smem[p.slot(op, stage, row, piece)]),
            T.address_of(p.source(io, op, i, k)), 16,
            T.Cast("uint32", T.if_then_else(T.Cast("int64", k) < p.k_end, 16, 0)))
    else:
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(smem[p.slot(op, stage, row, piece)]),
            T.address_of(p.source(io, op, i, k)), 16)


@T.macro
def _copy(p, io, op, smem, stage, k0, t, tx):
    """Operand ``op``'s chunk from k = ``k0`` (of its tile ``t``) copied by
    ``cp.async`` into ``stage``: the thread's pieces (a gradient's k-rows past M zeros)."""
    for p_ in T.unroll(p.pieces[op]):
        if p.has(op, p_, tx) and p.used(op, t, p.place(op, p_, tx)[0]):
            _copy_piece(p, io, op, smem, stage, k0, t, p_, tx)


@T.macro
def _load(p, io, op, regs, k0, t, tx):
    """Operand ``op``'s pieces of the chunk from k = ``k0`` (of its tile ``t``) into
    ``regs``, as stored (float32)."""
    for p_ in T.unroll(p.pieces[op]):
        row, piece = T.meta_var(p.place(op, p_, tx))
        for h in T.unroll(p.per // 4):
            for v in T.vectorized(4):
                i, k = T.meta_var(p.at(op, row, piece, t, k0, h * 4 + v))
                regs[p_ * p.per + h * 4 + v] = p.value(io, op, i, k)


@T.macro
def _store(p, op, regs, smem, stage, tx):
    """Operand ``op``'s pieces in ``regs`` into ``stage``, rounded to the operands' type."""
    for p_ in T.unroll(p.pieces[op]):
        row, piece = T.meta_var(p.place(op, p_, tx))
        for v in T.vectorized(p.per):
            smem[p.slot(op, stage, row, piece) + v] = p.product.op.round(regs[p_ * p.per + v])


@T.macro
def _put(p, io, op, smem, stage, k0, t, tx):
    """Operand ``op``'s pieces of the chunk from k = ``k0`` read and stored rounded into
    ``stage`` at once (the chunks before the loop; not through ``regs``: TVM's CUDA code
    would reuse its first vector read of a register for the next ones in one scope)."""
    for p_ in T.unroll(p.pieces[op]):
        row, piece = T.meta_var(p.place(op, p_, tx))
        for h in T.unroll(p.per // 4):
            for v in T.vectorized(4):
                i, k = T.meta_var(p.at(op, row, piece, t, k0, h * 4 + v))
                smem[p.slot(op, stage, row, piece) + h * 4 + v] = p.product.op.round(
                    p.value(io, op, i, k))


@T.macro
def _fetch_operand(p, io, op, smem, regs, c, k0, t, tx):
    """Operand ``op``'s chunk ``c`` (of its tile ``t``): copies into its stage; else loads
    into ``regs``, or before the loop (``regs`` None) stored at once."""
    if p.copied(op):
        _copy(p, io, op, smem, c % p.stages, k0 + c * p.bk, t, tx)
    elif regs is None:
        _put(p, io, op, smem, c % p.stages, k0 + c * p.bk, t, tx)
    else:
        _load(p, io, op, regs, k0 + c * p.bk, t, tx)


@T.macro
def _fetch(p, io, smem, regs, c, k0, bi, bj, tx):
    """Chunk ``c`` of the block's part of K (from ``k0``), both operands (``regs`` None:
    before the loop)."""
    _fetch_operand(p, io, 0, smem, None if regs is None else regs[0], c, k0, bi, tx)
    _fetch_operand(p, io, 1, smem, None if regs is None else regs[1], c, k0, bj, tx)


@T.macro
def _stage(p, regs, smem, stage, tx):
    """The operands loaded into registers stored into ``stage``."""
    if not p.copied(0):
        _store(p, 0, regs[0], smem, stage, tx)
    if not p.copied(1):
        _store(p, 1, regs[1], smem, stage, tx)


@T.macro
def _split(p, op, smem, stage, twin, tx):
    """Split float32: the pieces of operand ``op`` the thread copied into ``stage`` split, the
    TF32 parts in place, the rest into small-part twin ``twin`` (a device function a piece:
    TVM's barrier planner would see one thread's reads and writes of different pieces as a
    race and put barriers between them)."""
    for p_ in T.unroll(p.pieces[op]):
        row, piece = T.meta_var(p.place(op, p_, tx))
        T.cuda.func_call("rnncc_split_tf32x4", T.address_of(smem[p.slot(op, stage, row, piece)]),
                         T.address_of(smem[p.slot(op, stage, row, piece, twin)]),
                         source_code=SPLIT_SOURCE)


@T.macro
def _describe(p, op, smem, desc, stage, s, tx, twin=None):
    """desc[op]: the matrix descriptor of operand ``op``'s rows for k-step ``s`` (in
    ``stage``, or small-part twin ``twin``): 128-byte swizzled rows, the offsets of
    :meth:`Plan.offsets`."""
    leading, stride = T.meta_var(p.offsets(op))
    T.cuda.wgmma.encode_matrix_descriptor(
        T.address_of(desc[op]), T.address_of(smem[p.step(op, stage, s, tx, twin)]),
        leading, stride, SWIZZLE_128B)


@T.macro
def _products(p, smem, acc, desc, stage, tx):
    """A chunk's products in ``stage``, issued as one group; then a wait for all but this
    group (the previous chunk's products are done)."""
    T.ptx.wgmma.fence.sync.aligned()
    for s in T.unroll(p.steps):
        _describe(p, 0, smem, desc, stage, s, tx)
        _describe(p, 1, smem, desc, stage, s, tx)
        p.instruction(*[acc[e] for e in range(p.sums)], desc[0], desc[1], T.bool(True),
                      *p.flags)
    T.ptx.wgmma.commit_group.sync.aligned()
    T.ptx.wgmma.wait_group.sync.aligned(1)


@T.macro
def _split_step(p, smem, sums, desc, stage, s, twin, tx, keep):
    """k-step ``s`` of split float32: A_small B_big, A_big B_small, A_big B_big into
    ``sums`` (the first added to them where ``keep``, else overwriting them)."""
    _describe(p, 0, smem, desc, stage, s, tx, twin)
    _describe(p, 1, smem, desc, stage, s, tx)
    p.instruction(*[sums[e] for e in range(p.sums)], desc[0], desc[1], T.bool(keep), *p.flags)
    _describe(p, 0, smem, desc, stage, s, tx)
    _describe(p, 1, smem, desc, stage, s, tx, twin)
    p.instruction(*[sums[e] for e in range(p.sums)], desc[0], desc[1], T.bool(True), *p.flags)
    _describe(p, 1, smem, desc, stage, s, tx)
    p.instruction(*[sums[e] for e in range(p.sums)], desc[0], desc[1], T.bool(True), *p.flags)


@T.macro
def _add(p, acc, sums):
    """acc += sums (a chunk's split products)."""
    for e in T.unroll(p.sums):
        acc[e] = acc[e] + sums[e]


@T.macro
def _split_products(p, smem, sums, desc, stage, twin, tx):
    """A chunk's products of split float32 in ``stage`` and small-part twin ``twin``, three
    a k-step (:func:`_split_step`), issued as one group into the chunk's own ``sums`` (its
    first instruction overwrites them; :func:`_chunk` adds them to the float32 sums)."""
    T.ptx.wgmma.fence.sync.aligned()
    _split_step(p, smem, sums, desc, stage, 0, twin, tx, False)
    for s in T.unroll(1, p.steps):
        _split_step(p, smem, sums, desc, stage, s, twin, tx, True)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro
def _chunk(p, io, smem, regs, acc, sums, desc, c, k0, bi, bj, tx):
    """Chunk ``c``: its copies waited for (and split), the stores of the last loads made, a
    barrier, the copies of chunk c + ahead issued, its products issued. Split float32
    (:func:`_split_products`): the chunk is split into twin c % 2 while chunk c - 1's
    products run; then they are waited for and their ``sums`` added to ``acc`` on the CUDA
    cores, before the barrier, so that past it no warpgroup's products read twin c - 1 % 2,
    which the next chunk's split overwrites (the tensor cores' float32 sums round toward
    zero: an error that over all of K grows with it, :func:`.cuda_mma_gemm._products`, over a
    chunk of 32 k a negligible one; reading sums a group may still write would make ptxas
    serialize every group, C7514)."""
    T.ptx.cp.async_.wait_group(p.ahead - 1)
    if p.split:
        _split(p, 0, smem, c % p.stages, c % 2, tx)
        _split(p, 1, smem, c % p.stages, c % 2, tx)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        if c >= 1:
            _add(p, acc, sums)
    if 1 <= c and c + p.ahead - 1 < p.chunks:
        _stage(p, regs, smem, (c + p.ahead - 1) % p.stages, tx)
    T.ptx.fence.proxy.async_.shared__cta()
    T.tvm_storage_sync("shared.dyn")
    if c + p.ahead < p.chunks:
        _fetch(p, io, smem, regs, c + p.ahead, k0, bi, bj, tx)
    T.ptx.cp.async_.commit_group()
    if p.split:
        _split_products(p, smem, sums, desc, c % p.stages, c % 2, tx)
    else:
        _products(p, smem, acc, desc, c % p.stages, tx)


@T.macro
def _epilogue(p, io, acc, bi, bj, part, tx, step_regs):
    """The tile's sums to C, rows below M: a projection's plus b, a slice's as they are
    (swapped: transposed, within N and O); a
    gradient's (every row) in its type, or split, its slice of M's into the workspace
    ``io``[3] (``step_regs``: a fused step's, None here)."""
    lane = T.meta_var(tx % 32)
    first = T.meta_var(bi * p.rows + tx // 32 * 16 + lane // 4)
    for n in T.unroll(p.cols // 8):
        for h in T.unroll(2):
            i = T.meta_var(first + h * 8)
            j = T.meta_var(bj * p.cols + n * 8 + lane % 4 * 2)
            if p.gradient:
                if p.gradient_inside(i, j):
                    if p.product.parts > 1:  # its slice of M's sums, as they are
                        for v in T.vectorized(2):
                            io[3][part, i, j + v] = acc[n * 4 + h * 2 + v]
                    else:
                        for v in T.vectorized(2):
                            io[2][i, j + v] = T.Cast(io[2].dtype, acc[n * 4 + h * 2 + v])
            elif p.swapped:  # A's row i is a column of C, B's row j + v a row of C
                for v in T.unroll(2):
                    if j + v < p.tile.m and i < p.product.columns:
                        if p.product.form == "projection":
                            T.buffer_store(io[3], acc[n * 4 + h * 2 + v] + T.Cast(
                                "float32", io[2][i]), p.tile.at(j + v) + [i])
                        else:
                            io[2][part, j + v, i] = acc[n * 4 + h * 2 + v]
            elif i < p.tile.m and (not p.tail or j < p.product.columns):
                for v in T.vectorized(2):
                    if p.product.form == "projection":
                        T.buffer_store(io[3], acc[n * 4 + h * 2 + v] + T.Cast(
                            "float32", io[2][j + v]), p.tile.at(i) + [j + v])
                    else:
                        io[2][part, i, j + v] = acc[n * 4 + h * 2 + v]


def gradient_splits(product: cuda_mma_gemm.Product, cols: int) -> int:
    """S, the slices of M of a 16-bit weight gradient in tiles ``cols`` wide (1: not split;
    nor is split float32, whose tiles are 128 blocks and more)."""
    if product.form != "gradient" or product.op.split or product.tails:
        return 1
    outputs, depth = product.specs[2][1]
    tiles = -(-outputs // TILE) * -(-depth // cols)
    splits = 1
    while (splits * 2 <= GRADIENT_MAX_SPLITS and tiles * splits * 2 <= GRADIENT_BLOCKS
           and splits * 2 * outputs * depth * 4 <= GRADIENT_SLICE_BYTES):
        splits *= 2
    return splits


def _with_slices(p: Plan, io):
    """The kernel's buffers: the component's, and a gradient split along M's [S, O, K] float32
    workspace (allocated in the PrimFunc being built)."""
    if not (p.gradient and p.product.parts > 1):
        return io
    slices = T.sblock_alloc_buffer((p.product.parts, *p.product.specs[2][1]), "float32")
    IRBuilder.name("slices", slices)
    return (*io, slices)


def kernel(product: cuda_mma_gemm.Product, cols: int | None = None, feed: str | None = None,
           persistent: int = 0, swapped: bool | None = None):
    """The PrimFunc, with the component's parameters (tiles ``cols`` columns wide, by default
    :func:`columns`, ``swapped`` or not: by default as :func:`one_step` says where ``cols``
    is not given): fed by the TMA engine where :func:`tma_fed`, else by the warpgroups'
    own copies; ``feed`` "tma" or "copy" chooses, and ``persistent`` (a count of blocks)
    makes the TMA-fed kernel's blocks loop over tiles (to compare them)."""
    if feed not in (None, "tma", "copy"):
        raise ValueError(f"feed is 'tma', 'copy' or None (the rule's choice), got {feed!r}")
    if cols is None and swapped is None:
        chosen = one_step(product)
        swapped = chosen is not None and chosen.swapped
    cols = TILE if product.op.split else cols or columns(product)
    splits = gradient_splits(product, cols)
    if splits > 1:
        product = dataclasses.replace(product, parts=splits)
    return kernel_of(Plan(product, cols, feed, persistent, swapped=bool(swapped)))


def kernel_of(p: Plan, step=None):
    """The PrimFunc of plan ``p``'s kernel, its feed as the plan says; ``step`` (one fused
    step: :class:`.cuda_wgmma_step.Step`) gives its parameters (A and B first, as the
    product's) and its epilogue in place of the product's own."""
    return _tma_kernel(p, step) if p.tma else _copying_kernel(p, step)


def _hooks(p: Plan, step):
    """(the kernel's parameters, its epilogue, the sums' first values (a function of the
    parameters, the row and column tiles and the thread; None: zero)): the product's, or
    ``step``'s."""
    if step is None:
        return p.tile.parameters, _epilogue, lambda io, bi, bj, tx: None
    return step.parameters, step.epilogue, partial(step.initial, p)


def _tma_kernel(p: Plan, step=None):
    """The kernel whose operands the TMA engine copies (:mod:`._tma`): the producer thread
    copies, the warpgroups wait for each chunk, multiply and give its stage back."""
    product, dtype = p.product, p.product.op.dtype
    depth = product.k_total
    parameters, epilogue, initial = _hooks(p, step)

    @T.prim_func(s_tir=True)
    def wgmma_gemm():
        T.func_attr({"tirx.noalias": True, COMPACT_ATTR: [spec[0] for spec in product.specs[:2]]})
        io = T.meta_var(parameters())
        with T.sblock("root"):
            step_regs = T.meta_var(step.registers(p) if step is not None else None)
            smem = T.sblock_alloc_buffer((p.smem_bytes // p.esize,), dtype,
                                         scope="shared.dyn", align=SWIZZLE_ROWS * ROW_BYTES)
            bar = T.sblock_alloc_buffer((2 * p.stages,), "uint64", scope="shared", align=8)
            acc = T.sblock_alloc_buffer((p.sums,), "float32", scope="local")
            desc = T.sblock_alloc_buffer((2,), "uint64", scope="local")
            map_a: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            map_b: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
            _tma.encode(map_a, p.origin(io, 0), depth, p.tile.m, p.bk, p.rows, dtype, p.esize)
            _tma.encode(map_b, p.origin(io, 1), depth, product.columns, p.bk, p.box, dtype,
                        p.esize)
            for bx in T.thread_binding(p.grid, thread="blockIdx.x"):
                for rank in T.thread_binding(p.cluster, thread="clusterCtaIdx.x"):
                    for tx in T.thread_binding(p.launched, thread="threadIdx.x"):
                        _tma.start(p, bar, tx)
                        if tx == p.threads:
                            for it in range(p.rounds):
                                if bx + it * p.grid < p.tiles:
                                    part, bi, bj = T.meta_var(p.tile_of(bx + it * p.grid))
                                    _tma.produce(p, (map_a, map_b), smem, bar,
                                                 part * product.depth, bi * p.rows, bj, rank,
                                                 it * p.chunks)
                        if tx < p.threads:
                            for it in range(p.rounds):
                                if bx + it * p.grid < p.tiles:
                                    part, bi, bj = T.meta_var(p.tile_of(bx + it * p.grid))
                                    if step is not None:
                                        step.prologue(p, io, step_regs, bi, bj, tx)
                                    _consume(p, smem, acc, desc, bar, it * p.chunks, tx,
                                             initial(io, bi, bj, tx))
                                    epilogue(p, io, acc, bi, bj, part, tx, step_regs)
                        _tma.finish(p)

    return wgmma_gemm


@T.macro
def _initial(p, acc, initial):
    """The sums' first values: zero, or ``initial(e)`` for sum e (a fused step's b_hh)."""
    for e in T.unroll(p.sums):
        if initial is None:
            acc[e] = T.float32(0)
        else:
            acc[e] = initial(e)


@T.macro
def _consume(p, smem, acc, desc, bar, first, tx, initial):
    """A tile's products into ``acc`` (from zero, or ``initial(e)`` for sum e): each chunk
    waited for, multiplied, its stage given back once the next chunk's products are issued
    (the last one's once all are done, where the block takes more tiles); chunk c is the
    block's ``first`` + c-th."""
    _initial(p, acc, initial)
    for c in range(p.chunks):
        _tma.wait(bar, (first + c) % p.stages, (first + c) // p.stages % 2)
        _products(p, smem, acc, desc, (first + c) % p.stages, tx)
        if c >= 1:
            _tma.release(p, bar, first + c - 1, tx)
    T.ptx.wgmma.wait_group.sync.aligned(0)
    if p.persistent > 0:
        _tma.release(p, bar, first + p.chunks - 1, tx)


def _copying_kernel(p: Plan, step=None):
    """The kernel whose warpgroups copy their operands (``cp.async``, or through registers
    where their type changes) and multiply."""
    product, dtype = p.product, p.product.op.dtype
    parameters, epilogue, initial = _hooks(p, step)

    @T.prim_func(s_tir=True)
    def wgmma_gemm():
        T.func_attr({"tirx.noalias": True})
        given = T.meta_var(parameters())
        with T.sblock("root"):
            io = T.meta_var(_with_slices(p, given))
            step_regs = T.meta_var(step.registers(p) if step is not None else None)
            smem = T.sblock_alloc_buffer((p.smem_bytes // p.esize,), dtype,
                                         scope="shared.dyn", align=SWIZZLE_ROWS * ROW_BYTES)
            ra = T.sblock_alloc_buffer((p.pieces[0] * p.per,), "float32", scope="local")
            rb = T.sblock_alloc_buffer((p.pieces[1] * p.per,), "float32", scope="local")
            acc = T.sblock_alloc_buffer((p.sums,), "float32", scope="local")
            sums = T.sblock_alloc_buffer((p.sums if p.split else 1,), "float32", scope="local")
            desc = T.sblock_alloc_buffer((2,), "uint64", scope="local")
            for bx in T.thread_binding(p.grid, thread="blockIdx.x"):
                for tx in T.thread_binding(p.threads, thread="threadIdx.x"):
                    part, bi, bj = T.meta_var(p.tile_of(bx))
                    k0 = T.meta_var(p.k_first(part))
                    regs = T.meta_var((ra, rb))
                    if step is not None:
                        step.prologue(p, io, step_regs, bi, bj, tx)
                    _initial(p, acc, initial(io, bi, bj, tx))
                    for c in T.unroll(p.ahead):
                        if c < p.chunks:
                            _fetch(p, io, smem, None, c, k0, bi, bj, tx)
                        T.ptx.cp.async_.commit_group()
                    for c in range(p.chunks):
                        _chunk(p, io, smem, regs, acc, sums, desc, c, k0, bi, bj, tx)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    if p.split:
                        _add(p, acc, sums)
                    epilogue(p, io, acc, bi, bj, part, tx, step_regs)
            if p.gradient and product.parts > 1:
                cuda_weight_grad.sum_slices(io[2], io[3], product.parts, True)

    return wgmma_gemm


def apply(func, target):
    found = sizes(func, target)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.wgmma_gemm", apply)
