"""CUDA: float16 and bfloat16 products of many rows on tensor cores (``mma.sync`` m16n8k16,
float32 sums), written out in TIR: the input projection of all steps, each step's recurrent
product at a large batch, a training step's dx = dGI W_ih, and its weight gradients; and float32
products in TF32 (m16n8k8) where the component allows it (:mod:`._mma`).

All forms are C[i, j] = sum_k A[i, k] B[j, k]:

- projection: out[.., n, o] = sum_k a[.., n, k] w[o, k] + b[o] (w [O, K], PyTorch's rows, or
  [K, O]): i the M rows of a (T*N, a flat run-time M, or one step's static N), j the O
  outputs; out float32;
- slices (rnncc's gemm_parts, one step's product): out[s, n, o] = the same sum over slice s of
  K, no bias; the reader adds the S slices (:func:`parts` chooses S to fill the GPU);
- gradient: dw[o, k] = sum_m g[m, o] a[m, k] over the M = T*N rows of all steps: i = o, j = k;
  dw in the weights' type.

The weights are float16 or bfloat16; an operand in float32 (h, a gradient, a kept state) is
rounded to the weights' type as it is staged, as cuDNN's half-precision RNNs compute. In TF32
both float32 operands are rounded to TF32 (as they are staged, or as a lane reads them); split
into three TF32 products (:data:`._mma.TF32X3`: projections and slices pipelined only, and
float32 weight gradients), both are read as they are and split as a lane reads them.

A block's 8 warps (4 where a one-step tile has 64 rows) compute a TILE-column tile of C, 2 x 4
(1 x 4) warps of 64 x 32 (4 x 4 instruction tiles, 64 sums a lane). K goes through shared
memory in chunks of BK (32 halves or 16 TF32 values: 64 bytes of a row). Two ways:

- pipelined, where both operands have k as their buffer's last index ("inner": a, w [O, K]):
  :data:`STAGES` chunks in flight, copied by ``cp.async`` (16 bytes a copy, no registers;
  an a in float32 under half weights goes through registers, rounded, stored a chunk after
  its load was issued), one barrier a chunk; staged [row][k], 64 bytes a row, so a lane's
  16-byte fragment reads (8 lanes a phase: rows g, g + 1) hit each bank once. Two blocks a
  multiprocessor (:data:`BLOCKS_PER_SM`); one where float32 is split into three TF32
  products (:func:`_products`: a chunk's sums of their own take the second block's
  registers).
- through registers, where an operand's k runs along its buffer's rows ("outer": w [K, O],
  both operands of a gradient): double-buffered (the next chunk's global loads issued before
  the current chunk's products, stored after them), the outer operand staged [k][row]. A
  gradient's two (both outer, half types) are staged with k-rows 16 bytes apart past the tile
  and read by ``ldmatrix.x4.trans``, two blocks a multiprocessor; otherwise each k-row is
  padded to an odd count of words so that a lane's scalar reads of its fragment hit 32 banks
  (a float32 gradient split in three TF32 products so).

Fragments (:mod:`._mma`): lane l (q = l % 4, g = l // 4) takes 16 bytes of a chunk's k from
q's quarter for its rows g and g + 8 of A and its row g of B, two k-steps' worth: 16
contiguous bytes of an inner operand (both operands read by ldmatrix take k in the
instruction's plain order instead). The sums land as the instruction leaves them: lane l
holds rows g and g + 8 of each instruction tile, columns 2q + {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.script import tirx as T

from . import _mma, cuda_small_batch_gemv
from ._common import (
    LAUNCH_BOUNDS,
    block_named,
    buffer_parameters,
    gemm_blocks,
    has_mma,
    static_extent,
    weights_are_rows,
)
from ._rule import Rule

TILE = 128  # columns (j) of C a block, and rows (i) of a tile of many rows
STEP_TILE = 64  # rows of a one-step tile where N is at most this
WARPS_J = 4  # warps along j (2 along i, 1 in a 64-row tile)
MT, NT = 4, 4  # instruction tiles a warp: 16-row tiles along i, 8-column tiles along j
THREADS = 256  # a block of the register-staged kernel
#: Chunks of K in flight in the pipelined kernel, and its blocks a multiprocessor (registers
#: capped at 128 a thread), and a gradient's (unbounded, ptxas gave it 130 registers at
#: T*N = 12800: one block a multiprocessor, bfloat16 LSTM 1024 N128's dW_ih 1677 us against
#: 867; a gradient of a run-time M spills 8 bytes at 128; dx with W_ih [K, O], 24). H200,
#: kernel alone, float16 [6400 x 1024] x [1024 x 4096]: 2 chunks of 128 bytes a row in 3
#: stages 255 us, 1 of 64 in 3 stages 200, in 4 191.
STAGES = 4
BLOCKS_PER_SM = 2
#: One step's product: its slices of K (gemm_parts): the fewest (a power of two up to
#: MAX_PARTS, each at least MIN_SLICE deep) that give TARGET_BLOCKS blocks, two a
#: multiprocessor. H200, float16 and TF32, batch 64-256, K 512-2048, O 2048-8192: that count
#: was the fastest or within 1% of it in 15 of 16 products (TF32 64 x 512 x 2048: 6.4 us
#: against 5.3 in 8 slices of 64; docs/benchmarks.md); against cuda.mma_gemv 1.3-3.5x faster.
#: The fewest batch rows this rule takes a step's product in (fewer: cuda.mma_gemv), by
#: operand (a tile of 64 rows then runs partly empty). H200 layers, us a step, cuda.mma_gemv
#: -> slices here: TF32 LSTM 2048 N32 90.2 -> 45.0, N16 57.1 -> 44.4, GRU 2048 N16 36.6 ->
#: 28.8, LSTM 1024 N32 15.8 -> 14.0; float16 LSTM 2048 N32 24.5 -> 21.1, but LSTM 4096 N16
#: 71.6 -> 82.5. Float32 split in three TF32 products (:data:`._mma.TF32X3`), against
#: cuda.sgemm's slices and cuda.small_batch_gemv: LSTM 1024 and 2048 N64 1.34-1.44x (the
#: layer, with the products of all steps), LSTM 2048 N16 0.72x (before its sums were added
#: a chunk at a time); at N32 (the products of all steps split either way) LSTM 1024 20.1 ->
#: 16.6, 2048 70.1 -> 52.8, 4096 249.9 -> 178.0, GRU 1024 16.1 -> 14.9, 2048 51.0 -> 39.6.
MIN_BATCH = {"tf32": 16, "half": 32, "tf32x3": 32}
#: The fewest batch rows N of the products of all steps (T*N rows) split in three TF32
#: products: fewer leave few tiles, which cuda.sgemm fills the GPU with by splitting K (H200,
#: LSTM 2048 with the step's product on the CUDA cores: N1 0.98x, N16 1.07x, both before the
#: sums were added a chunk at a time).
SPLIT_ALL_STEPS_BATCH = 16
#: The fewest tiles of a float32 weight gradient split in three TF32 products (one block a
#: multiprocessor, M not split): fewer stay with cuda.weight_grad, which splits M to fill the
#: GPU. H200, a training step of float32 LSTM 512 N64 (dW 2048 x 512: 64 tiles), us a step:
#: 23.7 on cuda.weight_grad, 27.4 split from 32 tiles.
SPLIT_GRADIENT_TILES = 128
#: The fewest tiles of a 16-bit weight gradient on this rule's tensor cores (a block a tile,
#: M not split; cuda.wgmma_gemm splits M instead): fewer stay with cuda.weight_grad, which
#: splits M over the GPU on the CUDA cores.
#: H200, float16 LSTM 128 at batch 256 (dW 512 x 128: 4 tiles, M = 25600): 162 us each on
#: tensor cores, a sixth of a training step.
HALF_GRADIENT_MIN_TILES = 8
#: In 64-row tiles up to STEP_TILE_PARTS slices: the backward pass's product dGH W_hh (O = H
#: columns, K = G*H deep) has few tiles. H200, bfloat16 LSTM 1024 N64, a training step, us a
#: step (the product's kernel alone 10.8 / 6.8 / 5.8): at most 8 slices 35.9, 16 32.4, 32
#: 31.9; GRU 32.5, 29.0, 29.1. At N128 (128-row tiles) 32 slices (then cuda.wgmma_gemm's)
#: lost: the product 8.5 -> 9.1 us, its reader 3.4 -> 5.0. With dGH in bfloat16 (copied,
#: not converted), 8 / 16 / 32: LSTM 22.9, 21.5, 22.3; GRU 21.0, 19.1, 19.4.
MAX_PARTS, STEP_TILE_PARTS, MIN_SLICE, TARGET_BLOCKS = 8, 16, 128, 256


def chunk_k(op: _mma.Operand) -> int:
    """BK: k a chunk, a lane's 16 bytes of each of the 4 lanes of a row."""
    return 4 * op.lane_k


def fits(outputs: int, depth: int, op: _mma.Operand) -> bool:
    """Whether a projection of O ``outputs`` and K ``depth`` in ``op`` has this rule's
    sizes."""
    return outputs % TILE == 0 and depth % (2 * chunk_k(op)) == 0


def fits_with_tails(outputs: int, depth: int, op: _mma.Operand) -> bool:
    """Whether a product that does not :func:`fits` can be computed in whole tiles past its
    edges (:mod:`.cuda_wgmma_gemm`'s kernels, both operands K-major: zeros
    copied past K, columns past O computed and not stored): O even (a thread stores pairs
    of columns) and each row of K a whole count of 16-byte copies (of 8-byte ones in 16 bits:
    H 1500)."""
    return outputs % 2 == 0 and depth % 4 == 0


@dataclass(frozen=True)
class Product:
    """A product this rule computes: ``form`` "projection", "slices" or "gradient"; ``specs``
    the component's parameters (name, shape, dtype) with run-time sizes as None; ``inner``
    whether A and B each have k as their buffer's last index; J ``columns``; for a projection
    its K ``depth`` (of a slice: K / S; a gradient's K, its rows M, is a run-time size);
    ``op`` the operands' type (the weights', or TF32); S ``parts`` (slices)."""

    form: str
    specs: tuple
    inner: tuple
    columns: int
    depth: int
    op: _mma.Operand
    parts: int = 1
    #: the operands ("a", "b") that hold TF32 values already (:data:`._mma.TF32_ROUNDED_ATTR`)
    rounded: str = ""

    @property
    def edges(self) -> bool:
        """Whether a gradient's dW [O, K] is not whole tiles (:mod:`.cuda_wgmma_gemm`'s
        kernels compute past them and do not store there)."""
        if self.form != "gradient":
            return False
        outputs, depth = self.specs[2][1]
        return bool(outputs % TILE or depth % TILE)

    @property
    def k_total(self) -> int:
        """K of a projection or of all its slices (A's last size)."""
        return self.specs[0][1][-1]

    @property
    def tails(self) -> bool:
        """Whether O or K is past whole tiles and chunks (:func:`fits_with_tails`), or its
        slices are not K / S each (:func:`.slice_depth`: the last one shorter)."""
        return self.form != "gradient" and (not fits(self.columns, self.k_total, self.op)
                                            or self.depth * self.parts != self.k_total)

    def rounds(self, operand: int) -> bool:
        """Whether operand 0 (A) or 1 (B) is rounded to the operands' TF32 here (not split
        into two: :data:`._mma.TF32X3`)."""
        return self.op.tf32 and not self.op.split and "ab"[operand] not in self.rounded

    @property
    def pipelined(self) -> bool:
        return all(self.inner)

    @property
    def rows(self) -> int | None:
        """One step's static M, else None."""
        shape = self.specs[0][1]
        return shape[0] if self.form != "gradient" and None not in shape else None

    @property
    def tile_rows(self) -> int:
        rows = self.rows
        return STEP_TILE if rows is not None and rows <= STEP_TILE else TILE

    @property
    def threads(self) -> int:
        """Threads a block: 2 x 4 warps (1 x 4 in a 64-row tile) pipelined."""
        return self.tile_rows // 16 * 32 if self.pipelined else THREADS

    @property
    def copied(self) -> bool:
        """Whether A is copied as it is (cp.async): stored in the operands' type."""
        return self.specs[0][2] == self.op.dtype


def sizes(func, target) -> Product | None:
    """The product of rnncc's gemm (all steps; one step's in N >= MIN_BATCH rows where its
    tiles alone fill the GPU), gemm_parts or weight_gradient component ``func`` when this rule
    takes it, else None: weights float16 or bfloat16 (or float32 where the component allows
    TF32) on sm_80 or later; a projection with sizes that :func:`fits`; a gradient with O and
    K multiples of TILE."""
    found = product_of(func, target)
    return found if found is not None and takes(found) else None


def takes(found: Product) -> bool:
    """Whether this rule's grid takes ``found`` (:func:`product_of`'s): every product of all
    steps, a gradient of at least :data:`HALF_GRADIENT_MIN_TILES` tiles; one step's whole
    where its tiles give TARGET_BLOCKS, in slices where they are :func:`slices`' count (not
    another rule's)."""
    if found.tails or found.edges:  # cuda.wgmma_gemm's kernels compute past the edges
        return False
    if found.form == "gradient":  # few tiles: cuda.weight_grad splits M to fill the GPU
        dw_shape = found.specs[2][1]
        return (dw_shape[0] // TILE) * (dw_shape[1] // TILE) >= HALF_GRADIENT_MIN_TILES
    if found.rows is None:  # all steps
        return True
    if found.form == "projection":
        return _tiles(found) >= TARGET_BLOCKS
    return slices(found) == found.parts


def parts(func, target) -> int:
    """The slices of K this rule splits the one-step product of gemm component ``func`` into,
    for a reader that adds them itself (rnncc's gemm_parts component in as many slices); 1
    where it does not take the product, where its grid is large enough whole, or where even
    its slices give under a quarter of TARGET_BLOCKS blocks (small products stay with
    cuda.mma_gemv)."""
    found = product_of(func, target)
    return 1 if found is None or found.rows is None else slices(found)


def _tiles(product: Product) -> int:
    """Tiles of C of one step's ``product`` (of each slice)."""
    return -(-product.rows // product.tile_rows) * (product.columns // TILE)


def slices(product: Product) -> int:
    """The slices of K of one step's ``product``: the fewest that give TARGET_BLOCKS blocks
    (a power of two up to MAX_PARTS, STEP_TILE_PARTS in 64-row tiles, each whole chunks and
    at least MIN_SLICE deep), else the most allowed; 1 where those give under a quarter of
    TARGET_BLOCKS, or where it is past whole tiles and chunks (:attr:`Product.tails`)."""
    if product.tails:
        return 1
    tiles = _tiles(product)
    bk = chunk_k(product.op)
    depth = product.depth * product.parts
    most = STEP_TILE_PARTS if product.tile_rows == STEP_TILE else MAX_PARTS
    choices = [c for c in range(1, most + 1) if c & (c - 1) == 0
               and depth % (c * bk) == 0 and (c == 1 or depth // c >= MIN_SLICE)]
    count = next((c for c in choices if tiles * c >= TARGET_BLOCKS), choices[-1])
    return count if tiles * count >= TARGET_BLOCKS // 4 else 1


def product_of(func, target) -> Product | None:
    """The product :func:`sizes` describes, whatever its grid (:func:`kernel` computes it
    at any size; the grid's conditions choose where it is worth it); also a product with
    weights as rows past whole tiles and chunks (:func:`fits_with_tails`: of all steps, or one
    step's whole or in slices of :func:`.slice_depth`), which only :mod:`.cuda_wgmma_gemm`
    takes."""
    if not has_mma(target):
        return None
    specs = tuple((str(p.name), tuple(static(d) for d in p.shape), str(p.dtype))
                  for p in func.params)
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    sliced = block_named(sch, "gemm_parts")
    if blocks is not None or sliced is not None:
        (_, a_shape, a_dtype), (_, _, w_dtype) = specs[:2]
        op = _mma.operand(w_dtype, func, split=True)
        if op is None or a_dtype not in (w_dtype, "float32"):
            return None
        if op.split and len(specs) != (4 if sliced is None else 3):
            return None  # split products only without the samples' lengths
        block = blocks[0] if sliced is None else sliced
        *_, outputs, depth = (static_extent(sch, x) for x in sch.get_loops(block))
        rows = weights_are_rows(sch, block)
        if op.split and not rows:
            return None  # split products pipelined only
        fewest = MIN_BATCH["tf32x3" if op.split else "tf32" if op.tf32 else "half"]
        if None not in a_shape and (a_shape[0] < fewest or not rows):
            return None  # one step's product: pipelined only
        if op.split and len(a_shape) == 3 and a_shape[1] < SPLIT_ALL_STEPS_BATCH:
            return None  # all steps' product of few rows: cuda.sgemm splits K to fill the GPU
        count = 1 if sliced is None else specs[2][1][0]
        if op is _mma.TF32 and None not in a_shape and cuda_small_batch_gemv.takes_tf32(
                a_shape[0], depth * count, outputs):
            return None
        k_total = a_shape[-1]
        if not fits(outputs, k_total, op) or depth % chunk_k(op) or depth * count != k_total:
            if not (rows and fits_with_tails(outputs, k_total, op)):
                return None  # past the edges: weights as rows only (cuda.wgmma_gemm's)
        form = "projection" if sliced is None else "slices"
        return Product(form, specs, (True, rows), outputs, depth, op, count, _mma.rounded(func))
    if block_named(sch, "weight_grad") is not None:
        if len(specs) != 3:  # the sum over the rows within the samples' lengths only
            return None
        (_, _, g_dtype), (_, _, a_dtype), (_, dw_shape, dw_dtype) = specs
        op = _mma.operand(dw_dtype, func, split=True)  # a half type, or float32 split
        if op is _mma.TF32:
            return None  # a TF32 gradient is not written
        if op is None or g_dtype not in ("float32", dw_dtype) or a_dtype not in (
                "float32", dw_dtype):
            return None
        if dw_shape[0] % 4 or dw_shape[1] % 4 or (
                op.split and (dw_shape[0] % TILE or dw_shape[1] % TILE)):
            return None  # 16-bit past whole tiles: cuda.wgmma_gemm's (8-byte pieces at least)
        if op.split and (dw_shape[0] // TILE) * (dw_shape[1] // TILE) < SPLIT_GRADIENT_TILES:
            return None  # cuda.weight_grad splits M to fill the GPU
        return Product("gradient", specs, (False, False), dw_shape[1], 0, op)
    return None


def static(dim):
    """A dimension's size, or None where it is a run-time size."""
    return int(dim) if isinstance(dim, tirx.IntImm | int) else None


class Tile:
    """A product's tile arithmetic: where each operand's elements are, how a chunk is staged,
    the rows M (a run-time size, or one step's N) and the grid."""

    def __init__(self, product: Product):
        self.product = product
        op = product.op
        self.bk = bk = chunk_k(op)
        self.tile_rows, self.threads = product.tile_rows, product.threads
        #: 4-element vectors of an operand a thread stages a chunk through registers
        self.vectors = [self.tile_rows * bk // 4 // self.threads, TILE * bk // 4 // self.threads]
        #: 16-byte copies of an operand a thread issues a chunk (pipelined)
        self.copies = [self.tile_rows * 4 // self.threads, TILE * 4 // self.threads]
        #: whether both operands are outer and read by ``ldmatrix.trans`` (a gradient; 16-bit
        #: operands only)
        self.transposed = not any(product.inner) and not op.tf32
        #: elements from one k-row of an outer operand's staged chunk to the next: 16 bytes
        #: past the row, so that ldmatrix's 8 rows of 16 bytes hit 32 banks; else an odd
        #: count of words
        self.outer_stride = TILE + (8 if self.transposed else 1 if op.tf32 else 2)
        self.rows = tirx.Var("M", "int64")
        self.batch = None
        if product.form == "gradient":
            self.runtime = self.m = self.rows
            self.i_tiles = -(-product.specs[2][1][0] // TILE)
            self.chunk_pairs = (self.m + (2 * bk - 1)) // (2 * bk)
        else:
            a_shape = product.specs[0][1]
            if product.rows is not None:
                self.runtime, self.m = None, product.rows
            elif len(a_shape) == 3:  # T (N rows a step) the one run-time size
                self.runtime, self.batch = tirx.Var("T_len", "int64"), a_shape[1]
                self.m = self.runtime * self.batch
            else:  # flat rows
                self.runtime = self.m = self.rows
            self.i_tiles = (self.m + (self.tile_rows - 1)) // self.tile_rows
            self.chunk_pairs = product.depth // (2 * bk)
        self.chunks = product.depth // bk
        self.j_tiles = product.columns // TILE
        #: elements of an operand's staged chunk
        self.stage = [rows * bk if inner else bk * self.outer_stride
                      for rows, inner in zip((self.tile_rows, TILE), product.inner)]

    def parameters(self):
        """Inside the PrimFunc being built: the component's parameters, run-time sizes as this
        tile's variable."""
        return buffer_parameters({
            name: (tuple(self.runtime if d is None else d for d in shape), dtype)
            for name, shape, dtype in self.product.specs})

    def at(self, m):
        """The leading indices of row m of a projection's a or out."""
        return [m // self.batch, m % self.batch] if self.batch else [m]

    def source(self, io, op: int, i, k):
        """Element (i, k) of operand ``op`` (0: A, 1: B) of a projection as it is stored;
        rows of A past M read row M - 1 (never stored)."""
        if op == 0:
            return tirx.BufferLoad(io[0], [*self.at(tirx.min(i, self.m - 1)), k])
        return tirx.BufferLoad(io[1], [i, k] if self.product.inner[1] else [k, i])

    def element(self, io, op: int, i, k):
        """Element (i, k) of operand ``op`` in the operands' type; a gradient's k past M reads
        zeros."""
        kind = self.product.op
        if self.product.form != "gradient":
            return kind.round(self.source(io, op, i, k))
        value = tirx.BufferLoad(io[op], [tirx.min(k, self.m - 1), i])  # g [M, O], a [M, K]
        return tirx.if_then_else(k < self.m, kind.round(value), tirx.const(0, kind.dtype))

    def stage_place(self, op: int, p_, tx):
        """(row, k) in a chunk of operand ``op`` of the thread's vector ``p_`` (4 elements along
        k for an inner operand, along the rows for an outer one)."""
        f = p_ * self.threads + tx
        if self.product.inner[op]:
            return f // (self.bk // 4), f % (self.bk // 4) * 4
        return f % (TILE // 4) * 4, f // (TILE // 4)

    def slot(self, op: int, row, k):
        """Where element (row, k) of a chunk of operand ``op`` is in its stage."""
        return row * self.bk + k if self.product.inner[op] else k * self.outer_stride + row


@T.macro
def _copy(t, io, op, shared, base, k0, first, tx):
    """Operand ``op``'s chunk from k = ``k0`` (its rows from ``first``) copied by
    ``cp.async`` to ``shared`` from ``base``: 16 bytes a copy, 4 lanes a row."""
    per = T.meta_var(t.bk // 4)
    for p_ in T.unroll(t.copies[op]):
        row = T.meta_var((p_ * t.threads + tx) // 4)
        k = T.meta_var((p_ * t.threads + tx) % 4 * per)
        T.ptx.cp.async_.cg.shared.global_(
            T.address_of(shared[base + t.slot(op, row, k)]),
            T.address_of(t.source(io, op, first + row, k0 + k)), 16)


@T.macro
def _load(t, io, op, regs, k0, first, tx):
    """Operand ``op``'s global reads of the chunk from k = ``k0`` (its rows from ``first``):
    the thread's vectors into ``regs``, in the operands' type."""
    for p_ in T.unroll(t.vectors[op]):
        row, k = T.meta_var(t.stage_place(op, p_, tx))
        for v in T.vectorized(4):
            if t.product.inner[op]:
                regs[p_ * 4 + v] = t.element(io, op, first + row, k0 + k + v)
            else:
                regs[p_ * 4 + v] = t.element(io, op, first + row + v, k0 + k)


@T.macro
def _store(t, op, regs, shared, base, tx):
    """Operand ``op``'s registers of a chunk to shared memory from ``base``: an inner
    operand's vectors as they are (16 bytes at most), an outer one's read by ldmatrix too (its
    k-rows 16-byte aligned), else element by element (its k-rows are not vector-aligned)."""
    for p_ in T.unroll(t.vectors[op]):
        row, k = T.meta_var(t.stage_place(op, p_, tx))
        if t.product.inner[op] or t.transposed:
            for v in T.vectorized(4):
                shared[base + t.slot(op, row, k + v) if t.product.inner[op]
                       else base + t.slot(op, row + v, k)] = regs[p_ * 4 + v]
        else:
            for v in T.unroll(4):
                shared[base + t.slot(op, row + v, k)] = regs[p_ * 4 + v]


@T.macro
def _chunk(t, io, regs, k0, bi, bj, tx):
    """Both operands' global reads of the chunk from k = ``k0``."""
    _load(t, io, 0, regs[0], k0, bi * TILE, tx)
    _load(t, io, 1, regs[1], k0, bj * TILE, tx)


@T.macro
def _stage(t, regs, shared, tx):
    """Both operands' registers to shared memory."""
    _store(t, 0, regs[0], shared[0], 0, tx)
    _store(t, 1, regs[1], shared[1], 0, tx)


@T.macro
def _fetch(t, io, regs, shared, c, k0, bi, bj, tx):
    """The pipelined kernel's loads of chunk ``c`` (from k = ``k0``) into its stage: B's, and
    A's where it is stored in the operands' type, by ``cp.async``; a float32 A's into
    registers (:func:`_store` puts them in the stage once the stage is free)."""
    st = T.meta_var(c % STAGES)
    if t.product.copied:
        _copy(t, io, 0, shared[0], st * t.stage[0], k0, bi * t.tile_rows, tx)
    else:
        _load(t, io, 0, regs, k0, bi * t.tile_rows, tx)
    _copy(t, io, 1, shared[1], st * t.stage[1], k0, bj * TILE, tx)


@T.macro
def _fragment(t, op, shared, out, offset, row, q):
    """out[offset ..] = the lane's 16 bytes of ``row`` of operand ``op``'s chunk in ``shared``
    (a stage: (buffer, base)), its k from q's quarter: one load of an inner one, scalar reads
    of an outer one (the same row of consecutive k-rows); a pipelined TF32 operand, copied
    as it is stored, rounded here."""
    e = T.meta_var(t.product.op.lane_k)
    buf, base = T.meta_var(shared)
    if t.product.inner[op]:
        for v in T.vectorized(e):
            out[offset + v] = buf[base + t.slot(op, row, q * e + v)]
    else:
        for v in T.unroll(e):
            out[offset + v] = buf[base + t.slot(op, row, q * e + v)]
    if t.product.pipelined and t.product.rounds(op):
        for v in T.unroll(e):
            out[offset + v] = t.product.op.round(out[offset + v])


@T.macro
def _products_transposed(t, shared, frags, acc, lane, i0, j0):
    """:func:`_products` where both operands are staged [k][row] (a gradient): each k-step's
    fragments by ``ldmatrix.x4.trans``, the instruction's plain order of k. B's: two 8-column
    tiles a load (their k 0-7 and 8-15 each: b0, b1); A's: a 16-row tile a load (rows 0-7 and
    8-15 of k 0-7, then of k 8-15: a0 to a3). Lane l gives the address of row l % 8 of
    matrix l // 8."""
    bf, af = T.meta_var(frags)
    kind = T.meta_var(t.product.op)
    (sa, base_a), (sb, base_b) = T.meta_var(shared)
    for s in T.unroll(2):
        for n2 in T.unroll(NT // 2):
            T.evaluate(T.ptx_legacy.ldmatrix(
                True, 4, ".b16", bf.data, n2 * 8, sb.access_ptr("r"), base_b + t.slot(
                    1, j0 + (n2 * 2 + lane // 16) * 8, s * 16 + lane // 8 % 2 * 8 + lane % 8),
                dtype=kind.dtype))
        for m in T.unroll(MT):
            T.evaluate(T.ptx_legacy.ldmatrix(
                True, 4, ".b16", af.data, 0, sa.access_ptr("r"), base_a + t.slot(
                    0, i0 + m * 16 + lane // 8 % 2 * 8, s * 16 + lane // 16 * 8 + lane % 8),
                dtype=kind.dtype))
            for n in T.unroll(NT):
                _mma.mma(kind, af, bf, acc, (m * NT + n) * 4, n * 4)


@T.macro
def _products(t, shared, frags, acc, tx):
    """A chunk's products: the warp's 64 x 32 of C, 2 k-steps (4 x 4 instructions each).
    Split operands (their small parts and the chunk's sums in the second half of ``frags``):
    three instructions each, into the chunk's own sums, which are then added to ``acc`` on
    the CUDA cores: the tensor cores' float32 sums drop the bits past their last (rounding
    toward zero), which over all of K would leave an error that grows with K (H200, LSTM 2048:
    1.3e-5, 20x IEEE float32's), over one chunk a negligible one."""
    bf, ha, af, wb = T.meta_var(frags[:4])
    bs, hs, as_, ws, sums = T.meta_var(frags[4:] if t.product.op.split else (*frags[:4], acc))
    kind = T.meta_var(t.product.op)
    g, q = T.meta_var((tx % 32 // 4, tx % 4))
    i0 = T.meta_var(tx // 32 // WARPS_J * (MT * 16))
    j0 = T.meta_var(tx // 32 % WARPS_J * (NT * 8))
    if t.transposed:
        _products_transposed(t, shared, (bf, af), acc, tx % 32, i0, j0)
    else:
        for n in T.unroll(NT):
            _fragment(t, 1, shared[1], bf, n * kind.lane_k, j0 + n * 8 + g, q)
        if kind.split:
            _mma.split(bf, bs, NT * kind.lane_k)
        for m in T.unroll(MT):
            _fragment(t, 0, shared[0], ha, 0, i0 + m * 16 + g, q)
            _fragment(t, 0, shared[0], ha, kind.lane_k, i0 + m * 16 + 8 + g, q)
            if kind.split:
                _mma.split(ha, hs, 2 * kind.lane_k)
            for s in T.unroll(2):
                _mma.a_fragment(kind, af, ha, s)
                if kind.split:
                    _mma.a_fragment(kind, as_, hs, s)
                for n in T.unroll(NT):
                    _mma.b_fragment(kind, wb, bf, n * kind.lane_k, s)
                    if kind.split:
                        _mma.b_fragment(kind, ws, bs, n * kind.lane_k, s)
                        _mma.mma(kind, as_, wb, sums, (m * NT + n) * 4)
                        _mma.mma(kind, af, ws, sums, (m * NT + n) * 4)
                    _mma.mma(kind, af, wb, sums, (m * NT + n) * 4)
        if kind.split:
            for e in T.unroll(MT * NT * 4):
                acc[e] = acc[e] + sums[e]
                sums[e] = T.float32(0)


@T.macro
def _epilogue(t, io, acc, bi, bj, part, tx):
    """The tile's sums to C: a projection's rows below M plus b, a slice's rows below M as
    they are, a gradient's in its type."""
    g, q = T.meta_var((tx % 32 // 4, tx % 4))
    i0 = T.meta_var(bi * t.tile_rows + tx // 32 // WARPS_J * (MT * 16))
    j0 = T.meta_var(bj * TILE + tx // 32 % WARPS_J * (NT * 8))
    form = T.meta_var(t.product.form)
    for m in T.unroll(MT):
        for n in T.unroll(NT):
            for h in T.unroll(2):
                i = T.meta_var(i0 + m * 16 + h * 8 + g)
                if form == "projection":
                    if i < t.m:
                        for v in T.vectorized(2):
                            T.buffer_store(io[3], acc[(m * NT + n) * 4 + h * 2 + v] + T.Cast(
                                "float32", io[2][j0 + n * 8 + q * 2 + v]),
                                t.at(i) + [j0 + n * 8 + q * 2 + v])
                elif form == "slices":
                    if i < t.m:
                        for v in T.vectorized(2):
                            io[2][part, i, j0 + n * 8 + q * 2 + v] = acc[
                                (m * NT + n) * 4 + h * 2 + v]
                else:
                    for v in T.vectorized(2):
                        T.buffer_store(io[2], T.Cast(t.product.op.dtype,
                                                     acc[(m * NT + n) * 4 + h * 2 + v]),
                                       [i, j0 + n * 8 + q * 2 + v])


def _split_sizes(op: _mma.Operand) -> tuple:
    """The registers of split operands' small parts (B's, A's rows, A's and B's fragments)
    and of a chunk's sums; one each (unused) where ``op`` is not split."""
    if not op.split:
        return (1,) * 5
    return NT * op.lane_k, 2 * op.lane_k, 4, op.lane_k // 2, MT * NT * 4


def _registers_kernel(product: Product):
    """The PrimFunc staging both operands through registers, double-buffered."""
    t = Tile(product)
    op = product.op
    dtype = op.dtype
    small = _split_sizes(op)

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
            ra = T.sblock_alloc_buffer((t.vectors[0] * 4,), dtype, scope="local")
            rb = T.sblock_alloc_buffer((t.vectors[1] * 4,), dtype, scope="local")
            acc = T.sblock_alloc_buffer((MT * NT * 4,), "float32", scope="local")
            bf = T.sblock_alloc_buffer((NT * op.lane_k,), dtype, scope="local")
            ha = T.sblock_alloc_buffer((2 * op.lane_k,), dtype, scope="local")
            af = T.sblock_alloc_buffer((4 * op.per_register,), dtype, scope="local")
            wb = T.sblock_alloc_buffer((op.lane_k // 2,), dtype, scope="local")
            bs = T.sblock_alloc_buffer((small[0],), dtype, scope="local")
            hs = T.sblock_alloc_buffer((small[1],), dtype, scope="local")
            as_ = T.sblock_alloc_buffer((small[2],), dtype, scope="local")
            ws = T.sblock_alloc_buffer((small[3],), dtype, scope="local")
            tc = T.sblock_alloc_buffer((small[4],), "float32", scope="local")
            for bx in T.thread_binding(t.i_tiles * t.j_tiles, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    T.attr(0, LAUNCH_BOUNDS, BLOCKS_PER_SM if t.transposed else 1)
                    bi, bj = T.meta_var((bx // t.j_tiles, bx % t.j_tiles))
                    regs = T.meta_var((ra, rb))
                    frags = T.meta_var((bf, ha, af, wb, bs, hs, as_, ws, tc))
                    for e in T.unroll(MT * NT * 4):
                        acc[e] = T.float32(0)
                    if op.split:
                        for e in T.unroll(small[4]):
                            tc[e] = T.float32(0)
                    _chunk(t, io, regs, 0, bi, bj, tx)
                    _stage(t, regs, (a0, b0), tx)
                    T.tvm_storage_sync("shared")
                    for c in range(t.chunk_pairs):
                        _chunk(t, io, regs, (c * 2 + 1) * t.bk, bi, bj, tx)
                        _products(t, ((a0, 0), (b0, 0)), frags, acc, tx)
                        _stage(t, regs, (a1, b1), tx)
                        T.tvm_storage_sync("shared")
                        _chunk(t, io, regs, T.min(c * 2 + 2, t.chunk_pairs * 2 - 1) * t.bk,
                               bi, bj, tx)
                        _products(t, ((a1, 0), (b1, 0)), frags, acc, tx)
                        _stage(t, regs, (a0, b0), tx)
                        T.tvm_storage_sync("shared")
                    _epilogue(t, io, acc, bi, bj, 0, tx)

    return mma_gemm


def _pipelined_kernel(product: Product):
    """The PrimFunc copying chunks ahead by ``cp.async``, :data:`STAGES` in flight."""
    t = Tile(product)
    op = product.op
    dtype = op.dtype
    ahead = STAGES - 1
    grid = product.parts * t.i_tiles * t.j_tiles
    small = _split_sizes(op)
    blocks = 1 if op.split else BLOCKS_PER_SM  # a chunk's sums take the second block's registers

    @T.prim_func(s_tir=True)
    def mma_gemm():
        T.func_attr({"tirx.noalias": True})
        io = T.meta_var(t.parameters())
        with T.sblock("root"):
            sa = T.sblock_alloc_buffer((STAGES * t.stage[0],), dtype, scope="shared.dyn")
            sb = T.sblock_alloc_buffer((STAGES * t.stage[1],), dtype, scope="shared.dyn")
            ra = T.sblock_alloc_buffer((t.vectors[0] * 4,), dtype, scope="local")
            acc = T.sblock_alloc_buffer((MT * NT * 4,), "float32", scope="local")
            bf = T.sblock_alloc_buffer((NT * op.lane_k,), dtype, scope="local")
            ha = T.sblock_alloc_buffer((2 * op.lane_k,), dtype, scope="local")
            af = T.sblock_alloc_buffer((4 * op.per_register,), dtype, scope="local")
            wb = T.sblock_alloc_buffer((op.lane_k // 2,), dtype, scope="local")
            bs = T.sblock_alloc_buffer((small[0],), dtype, scope="local")
            hs = T.sblock_alloc_buffer((small[1],), dtype, scope="local")
            as_ = T.sblock_alloc_buffer((small[2],), dtype, scope="local")
            ws = T.sblock_alloc_buffer((small[3],), dtype, scope="local")
            tc = T.sblock_alloc_buffer((small[4],), "float32", scope="local")
            for bx in T.thread_binding(grid, thread="blockIdx.x"):
                for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
                    T.attr(0, LAUNCH_BOUNDS, blocks)
                    part = T.meta_var(bx // (t.i_tiles * t.j_tiles))
                    bi = T.meta_var(bx // t.j_tiles % t.i_tiles)
                    bj = T.meta_var(bx % t.j_tiles)
                    k0 = T.meta_var(part * product.depth)
                    frags = T.meta_var((bf, ha, af, wb, bs, hs, as_, ws, tc))
                    for e in T.unroll(MT * NT * 4):
                        acc[e] = T.float32(0)
                    if op.split:
                        for e in T.unroll(small[4]):
                            tc[e] = T.float32(0)
                    for c in T.unroll(ahead):
                        if c < t.chunks:
                            _fetch(t, io, ra, (sa, sb), c, k0 + c * t.bk, bi, bj, tx)
                            if not product.copied:
                                _store(t, 0, ra, sa, c * t.stage[0], tx)
                        T.ptx.cp.async_.commit_group()
                    for c in range(t.chunks):
                        T.ptx.cp.async_.wait_group(ahead - 1)
                        T.tvm_storage_sync("shared.dyn")
                        if c + ahead < t.chunks:
                            _fetch(t, io, ra, (sa, sb), c + ahead, k0 + (c + ahead) * t.bk,
                                   bi, bj, tx)
                        T.ptx.cp.async_.commit_group()
                        _products(t, ((sa, c % STAGES * t.stage[0]),
                                      (sb, c % STAGES * t.stage[1])), frags, acc, tx)
                        if not product.copied and c + ahead < t.chunks:
                            _store(t, 0, ra, sa, (c + ahead) % STAGES * t.stage[0], tx)
                    _epilogue(t, io, acc, bi, bj, part, tx)

    return mma_gemm


def kernel(product: Product):
    """The PrimFunc, with the component's parameters."""
    return _pipelined_kernel(product) if product.pipelined else _registers_kernel(product)


def apply(func, target):
    found = sizes(func, target)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.mma_gemm", apply)
