"""CUDA: float32 projections with many rows, as a tiled SGEMM written out in TIR (the classic
double-buffered register-blocked kernel): the input projection of all steps, and each step's
recurrent projection at a large batch.

out[.., n, o] = sum_k a[.., n, k] * w[o, k] + b[o] (w [O, K], PyTorch's rows; or w[k, o], w [K, O]:
a training step's dx = dGI W_ih reads W_ih [G*H, C] as it is) for N static batch rows (at least
:data:`MIN_BATCH` for one step's product), O outputs, K deep; the rows M are the T*N rows of all
steps (T a run-time size) or one step's N. A block computes a tile of M x O, 128 columns by 128
rows (all steps, and one step's from batch 128 where they pad no more rows: 256 threads, launched
two a multiprocessor, which caps ptxas at 128 registers) or by 64 rows (one step, 128 threads: a
batch of 64 in one tile), 8 x 8 outputs a thread (rows ty*4 + i and M/2 + ty*4 + i of the tile,
columns tq*4 + j and 64 + tq*4 + j, i, j < 4, for the thread's place (ty, tq) in a (M/8) x 16 grid
whose warps cover 4 x 8 patches: each operand's 16-byte register loads are shared by a warp's
threads, 64 FMAs a thread for 4 of them; warps of 2 x 16 or 8 x 4 and BK = 16 were slower in whole
sequences, H200, docs/benchmarks.md; so were tiles of 256 rows, 16 x 8 outputs a thread in one
block of 256 threads a multiprocessor, as cuDNN's SIMT SGEMM tiles them at batch 256: 0.75-0.97x of
these on 22 products alone, all steps' and one step's). K goes in chunks of :data:`BK` through
shared memory stored k-major, double-buffered: the next chunk's global loads (16-byte vectors) are
issued before the current chunk's products and stored to the other buffer after them, so one
barrier a chunk suffices and the loads' latency hides behind the FMAs. The k-major rows are padded
by :data:`PAD` floats, which keeps the transposed stores free of bank conflicts. Rows past M read
row M - 1 (no branch in the loop) and are not written; so are the columns past O where O is not
whole tiles (weights as rows). Where K is not whole pairs of chunks, a's loads past K give zeros (a
branch a 16-byte vector, in such kernels only) and w's read its last columns. Those odd sizes (LSTM
1500 at batch 32: O 6000, K 1500) went to dlight's Matmul before, about 2x slower than cuDNN.

One step's grid alone is small (LSTM 1024 at batch 64: 32 tiles for 132 multiprocessors), so
its K is split in slices (:attr:`Product.splits`; blockIdx.z), each written to an [S, N, O]
workspace, and a second kernel sums the slices in order and adds the bias (deterministic,
unlike atomics). The sequence's recurrent products go further (:func:`parts`): they are
built as rnncc's gemm_parts component, the slices are the output, and the cell step (or its
derivative) adds them and the bias as it reads them, which saves the sum kernel's launch and
round trip (LSTM 1024 at batch 64, H100: inference 38.5 -> 36.2 us a step, a training step
111.8 -> 106.6). Slices of 128 to 256 deep measured best (H200, batch 64: LSTM 1024 and 1536,
GRU 2048 8 slices, GRU 1024 16; 4 or 32 were slower), whence :data:`SPLIT_BLOCKS`. The
products of all steps split K the same way where T*N rows leave their grid small (a training
step's dx at batch 1: [T*N, G*H] x [G*H, C], 8 tiles at T = 100 and C = 1024), the count chosen
at run time from T: the host launches the unsplit kernel, or the split one and the sum.
Where T*N rows make more tiles than a wave of blocks (two a multiprocessor), only the tiles
past the last whole wave are split so (the tail): with the whole waves' tiles in one grid, the
tail's slices fill the last wave's blocks instead of leaving most of the GPU idle while a few
tiles finish (H200, LSTM 512 at batch 64, T = 100: 800 tiles, 3.03 waves; the projection took
363 us, 309 with 784 tiles at batch 62; with the tail of 8 tiles in 8 slices 326 us; LSTM 1024
at batch 32, 800 tiles K = 1024 deep, 692 -> 582).

Given the samples' lengths (rnncc's gemm component with ``lengths``: a layer that takes them,
in inference and in training), all steps' product computes only the rows (t, n) with
t < lengths[n], laid out sample after sample: a tile's row m is step m - ends[n - 1] of the
sample n that :func:`_locate` finds by bisection of ``ends`` (the running sums of the
lengths, each within 0 .. T), each thread's a row located once and each row it writes at the
end; the grid is T*N rows of tiles, those past the last row return at once, and nothing
splits K (H200, LSTM 512, 2 layers, batch 64, lengths spread from T to T/4 as a
PackedSequence: 18.98 -> 16.72 us a step, padded 17.76).

The kernel is composed of stages (``@T.macro``) that close over a :class:`Tile`, the
product's tile arithmetic: ``_load`` (a chunk's global reads into registers), ``_store`` (to
shared memory, transposed), ``products`` (a chunk's FMAs), ``_tile`` (a block's whole tile, its
chunks double-buffered, and its epilogue), ``_locate`` (a row's step and sample, with
lengths), ``_grid`` and ``_sum_slices`` (one step's),
``_whole_tiles``, ``_tail_tiles`` and ``_sum_tail`` (all steps' split tail).

Why not a schedule of the component's loops (:mod:`.cuda_tiled_gemm` does that): TVM's buffer
compaction gave no layout that was both double-buffered and free of bank conflicts from the
schedules tried (docs/benchmarks.md, "Batch 64"); that rule takes the sizes this one does not
(and float16).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from tvm import s_tir, tirx
from tvm.script import tirx as T

from ._common import (
    LAUNCH_BOUNDS,
    block_named,
    buffer_parameters,
    float32_parameters,
    gemm_blocks,
    static_extent,
    weights_are_rows,
)
from ._rule import Rule

#: Fewest batch rows one step's product this rule takes. The products of all steps (T*N rows)
#: it takes at any batch (dlight's Matmul, which took them before, ran LSTM 4096's at batch 16
#: at about 12 TFLOP/s on an H200; :mod:`.cuda_tiled_gemm`'s 64 x 64 tiles, which took those of
#: batch 1, 2, 4 and 8 in chunks of steps, ran 10-40% slower than this rule, H200).
MIN_BATCH = 32
#: Columns (of O) a block's tile, and rows (of M) a tile of the products of all steps.
TILE = 128
#: Rows a tile of one step's product (the batch: 64 rows at batch 64 in one tile).
STEP_TILE = 64
#: K a chunk through shared memory (a multiple of 8: a thread stages whole 16-byte vectors).
BK = 8
#: Chunks of one step's product whose loads are in flight at once (:meth:`Tile.ahead`), at
#: batch AHEAD_BATCH at most. H200, layers at batch 32 (T = 100, us a step): LSTM 1024 24.74
#: -> 23.50, LSTM 1500 49.43 -> 44.50, GRU 1024 20.12 -> 19.08, GRU 2048 65.84 -> 59.06, LSTMP
#: 1024/256 24.53 -> 20.97; at batch 33 1.02x; at 40 to 64 0.94-1.00x (LSTM 1024 at 64 0.96x,
#: LSTM 1500 at 48 0.94x), so not there.
AHEAD = 4
AHEAD_BATCH = 33
#: Threads along the rows of a warp's 8-row patch of the tile (the rest, 32 / WARP_ROWS, along its
#: columns).
WARP_ROWS = 4
#: Floats padding each k-row of the shared tiles (bank-conflict-free transposed stores).
PAD = 4
#: Blocks a multiprocessor must hold, by threads a block (ptxas keeps a thread's registers within
#: 65536 / (blocks * threads)): two of 256 (at 137 registers it held one, H200: LSTM 1024's
#: projection of all steps at batch 256 4956 -> 4644 us at T = 100); 128-thread tiles as ptxas
#: likes (143 registers, three blocks; four, at 128 registers, were slower).
MIN_BLOCKS = {256: 2}
#: One step's product in tiles of TILE rows (256 threads) from this batch on, where they pad no
#: more rows than STEP_TILE ones (N mod 128 = 0 or over 64) and their grid, slices included,
#: has at least WIDE_STEP_BLOCKS blocks (about one a multiprocessor: LSTM 256 at batch 256 had
#: 64 in slices 64 deep, and took 15.2 -> 16.8 us a step in them, H200; in slices 32 deep
#: (SHALLOW_SLICE) 128, 14.54 -> 14.40; LSTM 512's 256 took 37.3 -> 33.9).
WIDE_STEP_BATCH = 128
WIDE_STEP_BLOCKS = 128
#: Split-K of one step's product: at most MAX_SPLITS slices (a power of two), each at least
#: MIN_SLICE deep, the grid at most SPLIT_BLOCKS blocks (about three of 128 threads a
#: multiprocessor of an H200; 512 made LSTM 1024 take 16 slices, 16% slower). 32 slices
#: serve the deep products of few tiles, a training step's dh = dGH W_hh ([N, G*H] x [G*H, H]:
#: LSTM 1024's 8 tiles, K = 4096).
MAX_SPLITS = 32
MIN_SLICE = 64
SPLIT_BLOCKS = 384
#: Slices down to SHALLOW_SLICE deep where those of MIN_SLICE leave the grid fewer than
#: FEW_BLOCKS blocks (two a multiprocessor of an H100/H200): a block of few chunks is as long
#: as its latencies (ncu, LSTMP 1024/256 at batch 64: W_hr's product of 32 blocks and W_hh's of
#: 128 both about 11 us at base clocks, issuing 0.35 a cycle a scheduler, one warp each).
#: H200 layers, T = 100: LSTMP 1024/256 at batch 64 32.18 -> 30.66 us (cuDNN 37.03), LSTMP
#: 768/192 31.04 -> 24.54 (30.31), GRU 768 at batch 56 20.53 -> 18.70, LSTM 768 at 64 24.26 ->
#: 23.39; 1.00x where the grid was already full.
SHALLOW_SLICE = 32
FEW_BLOCKS = 264
#: Where those slices of a 64-row tiles' grid would be deeper than DEEP_SLICE, twice as many
#: while the grid stays within DEEP_SPLIT_BLOCKS (four of 128 threads a multiprocessor). H200,
#: kernel alone: LSTM 2048 at batch 64 (64 x 2048 x 8192) 4 slices of 512 68.5 us, 8 of 256
#: 63.1 (cuBLAS 58.8), at 32 71.1 and 55.5; LSTM 4096 at 64 (64 x 4096 x 16384) 2 of 2048
#: 254.9, 4 of 1024 235.6 (189.5); LSTM 2048's dh in training (64 x 8192 x 2048) 16 of 512
#: 69.0, 32 of 256 63.4 (74.1). Layers: LSTM 2048 at batch 64 122.7 -> 116.2 us a step, at 32
#: 97.3 -> 82.3, LSTM 4096 at 64 457.6 -> 438.3.
DEEP_SLICE = 256
DEEP_SPLIT_BLOCKS = 528
#: The products of all steps split K too where T*N leaves their grid small (dx of a training
#: step at batch 1: [T*N, G*H] x [G*H, C], 8 tiles at T = 100 and C = 1024), into at most
#: ALL_STEPS_MAX_SPLITS slices, as many as keep the grid within two blocks of 256 threads a
#: multiprocessor of an H100/H200 (a wave); where they fill waves, the tiles past the last
#: whole one (the tail) so.
ALL_STEPS_MAX_SPLITS = 16
ALL_STEPS_SPLIT_BLOCKS = 264


@dataclass(frozen=True)
class Product:
    """A product this rule computes: N ``batch`` rows a step, K ``depth``, O ``outputs``; of
    all steps (a run-time T) or of one step."""

    batch: int
    depth: int
    outputs: int
    all_steps: bool
    w_rows: bool = True
    #: One step's product whose slices are the output ([S, N, O], no bias): their reader sums
    #: them (rnncc's gemm_parts component).
    unsummed: bool = False
    #: All steps' product that takes the samples' lengths (rnncc's gemm component with
    #: ``lengths``): only the rows within them, laid out sample after sample (:class:`Tile`).
    lengths: bool = False

    @property
    def tile_rows(self) -> int:
        """Rows a tile: :data:`TILE` for all steps and for one step's where
        :data:`WIDE_STEP_BATCH` and :data:`WIDE_STEP_BLOCKS` allow, else :data:`STEP_TILE`."""
        if self.all_steps:
            return TILE
        rest = self.batch % TILE
        wide = self.batch >= WIDE_STEP_BATCH and (rest == 0 or rest > STEP_TILE)
        blocks = self._tiles(TILE) * self._splits(TILE)
        return TILE if wide and blocks >= WIDE_STEP_BLOCKS else STEP_TILE

    def _tiles(self, rows: int) -> int:
        """Tiles of one step's grid in tiles of ``rows`` rows."""
        return -(-self.batch // rows) * self.tiles_across

    def _splits(self, rows: int) -> int:
        """One step's slices in tiles of ``rows`` rows: the most of :meth:`split_choices`
        within :data:`SPLIT_BLOCKS` blocks (of slices down to :data:`SHALLOW_SLICE` deep
        where those of :data:`MIN_SLICE` leave fewer than :data:`FEW_BLOCKS`), more for deep
        slices of 64-row tiles (:data:`DEEP_SLICE`)."""
        tiles, choices = self._tiles(rows), self.split_choices()
        count = max(s for s in choices if s == 1 or tiles * s <= SPLIT_BLOCKS)
        if tiles * count < FEW_BLOCKS:
            choices = self.split_choices(SHALLOW_SLICE)
            count = max(s for s in choices if s == 1 or tiles * s <= SPLIT_BLOCKS)
        while (rows == STEP_TILE and self.slice_chunks(count) * BK > DEEP_SLICE
               and count * 2 in choices and tiles * count * 2 <= DEEP_SPLIT_BLOCKS):
            count *= 2
        return count

    @property
    def step_blocks(self) -> int:
        """Blocks of one step's grid: its tiles times its slices."""
        return self._tiles(self.tile_rows) * self.splits

    @property
    def whole(self) -> bool:
        """Whether each slice of K is whole pairs of chunks within K (else the loads past K
        give zeros): one step's slices where :attr:`splits` divide K so."""
        return self._even(1 if self.all_steps else self.splits)

    def _even(self, splits: int) -> bool:
        """Whether ``splits`` slices of K are whole pairs of chunks each."""
        return self.depth % (splits * 2 * BK) == 0

    def slice_chunks(self, splits: int) -> int:
        """Chunks of K a slice of ``splits``: K / S / BK where S slices of whole pairs of
        chunks make K, else K / S rounded up to whole pairs."""
        if self._even(splits):
            return self.depth // BK // splits
        return -(-self.depth // (splits * 2 * BK)) * 2

    @property
    def tiles_across(self) -> int:
        """Tiles along O (the last one partial where O is not whole tiles)."""
        return -(-self.outputs // TILE)

    @property
    def threads(self) -> int:
        """Threads a block: 8 x 8 outputs each."""
        return self.tile_rows * TILE // 64

    @property
    def min_blocks(self) -> int | None:
        """Blocks a multiprocessor must hold (:data:`MIN_BLOCKS`; None: as ptxas likes)."""
        return MIN_BLOCKS.get(self.threads)

    @property
    def splits(self) -> int:
        """Slices of K of one step's product (whose grid alone is small), each summed into the
        output by a second kernel (:meth:`_splits`). The products of all steps choose theirs at
        run time."""
        return 1 if self.all_steps else self._splits(self.tile_rows)

    def split_choices(self, shallowest: int = MIN_SLICE) -> tuple[int, ...]:
        """The slice counts K divides into: powers of two up to :data:`MAX_SPLITS` (all steps:
        :data:`ALL_STEPS_MAX_SPLITS`), each slice whole pairs of chunks and at least
        ``shallowest`` deep: S slices that make K where K is whole pairs, else any count whose
        last slice is not all past K (the loads past K give zeros); so too for one step's
        product of whole pairs that no count S > 1 makes (K = 1008, 63 pairs: a tanh RNN 1008
        at batch 178 ran in 24 blocks for 132 multiprocessors, 0.42x cuDNN)."""
        most = ALL_STEPS_MAX_SPLITS if self.all_steps else MAX_SPLITS
        counts = [2 ** i for i in range(most.bit_length()) if 2 ** i <= most]

        def even(s):
            return self._even(s) and (s == 1 or self.slice_chunks(s) * BK >= shallowest)

        def uneven(s):
            deep = self.slice_chunks(s) * BK
            return s == 1 or (deep >= shallowest and (s - 1) * deep < self.depth)

        paired = self._even(1)
        fits = (even if paired and (self.all_steps or any(even(s) for s in counts[1:]))
                else uneven)
        return tuple(s for s in counts if fits(s))


def sizes(func) -> Product | None:
    """The product of rnncc's gemm component ``func`` when this rule takes it, else None: in
    float32, weights as rows [O, K] or columns [K, O], N >= MIN_BATCH for one step's, O and K
    multiples of 4 (rows of 16-byte vectors), O whole tiles of :data:`TILE` where the weights
    are columns; lead (T, N) or (N,)."""
    sch = s_tir.Schedule(func)
    lengths = [p.name for p in func.params[3:5]] == ["lengths", "ends"]
    if any(str(p.dtype) != "float32" for i, p in enumerate(func.params)
           if not (lengths and i in (3, 4))):
        return None
    parts = block_named(sch, "gemm_parts")
    if parts is not None:
        return _parts_sizes(sch, parts)
    blocks = gemm_blocks(sch)
    if blocks is None or len(sch.get_loops(blocks[0])) not in (3, 4):
        return None
    w_rows = weights_are_rows(sch, blocks[0])
    *_, n_loop, o_loop, k_loop = sch.get_loops(blocks[0])
    batch, outputs, depth = (static_extent(sch, x) for x in (n_loop, o_loop, k_loop))
    all_steps = len(sch.get_loops(blocks[0])) == 4
    if None in (batch, outputs, depth) or (batch < MIN_BATCH and not all_steps):
        return None
    if outputs % 4 or depth % 4 or (not w_rows and outputs % TILE):
        return None
    return Product(batch, depth, outputs, all_steps, w_rows, lengths=lengths)


def _parts_sizes(sch, block) -> Product | None:
    """The product of a gemm_parts component ([S, N, O] slices of K): taken where this rule
    would split the whole product into the same S slices."""
    count, batch, outputs, depth = (static_extent(sch, x) for x in sch.get_loops(block))
    if None in (count, batch, outputs, depth) or batch < MIN_BATCH or outputs % 4:
        return None
    product = Product(batch, depth * count, outputs, False, weights_are_rows(sch, block), True)
    if (not product.whole or count == 1 or product.splits != count
            or (not product.w_rows and outputs % TILE)):
        return None
    return product


def parts(func) -> int:
    """The slices of K this rule splits the one-step product of gemm component ``func`` into
    (1 where it does not take it, does not split it, or K is not whole pairs of chunks): a
    reader that adds them itself takes the product as rnncc's gemm_parts component in as many
    slices."""
    found = sizes(func)
    if found is None or found.all_steps or not found.whole:
        return 1
    return found.splits


def thread_row(tx):
    """A thread's row group (of 4 rows a half tile) in the 16 x 16 grid of a 128-column tile:
    warp w covers row groups (w // (16/WC)) * WR .. + WR - 1 (WR x WC = 32 threads)."""
    cols = 32 // WARP_ROWS
    return tx // 32 // (16 // cols) * WARP_ROWS + tx % 32 // cols


def thread_col(tx):
    """A thread's column group (of 4 columns a half tile): (w % (16/WC)) * WC .. + WC - 1."""
    cols = 32 // WARP_ROWS
    return tx // 32 % (16 // cols) * cols + tx % cols


class Tile:
    """A product's tile arithmetic: the thread layout of the tile, the staging of K chunks
    through shared memory, and the rows M (T*N, a run-time size, or N)."""

    def __init__(self, product: Product):
        self.product = product
        self.batch = product.batch
        self.m, self.threads = product.tile_rows, product.threads
        self.t_len = tirx.Var("T_len", "int64") if product.all_steps else None
        self.rows = self.t_len * product.batch if product.all_steps else product.batch
        self.lengths = self.ends = None  # with lengths: their buffers (:func:`_parameters`)
        self.stride = {"a": self.m + PAD, "w": TILE + PAD}  # floats a k-row of a shared tile
        self.half = {"a": self.m // 2, "w": TILE // 2}
        # 16-byte vectors of an operand a thread stages a chunk, and threads a row of a chunk
        per = {"a": self.m * BK // self.threads, "w": TILE * BK // self.threads}
        self.vectors = {op: per[op] // 4 for op in "aw"}
        self.lanes = {op: BK // per[op] for op in "aw"}
        self.most = max(self.vectors.values())

    ty = staticmethod(thread_row)
    tq = staticmethod(thread_col)

    def col(self, op: str, p, tx):
        """The K column (in a chunk) of a thread's vector p of ``op``: interleaved, p * 4 *
        lanes + (tx % lanes) * 4, so that a warp's transposed stores hit all 32 banks."""
        return p * 4 * self.lanes[op] + tx % self.lanes[op] * 4

    def count(self):
        """The rows M: T*N (or N), or with lengths those within the samples' lengths."""
        if self.product.lengths:
            return tirx.Cast("int64", self.ends[self.product.batch - 1])
        return self.rows

    def row(self, op: str, by, bx, tx):
        """The row of ``op`` a thread stages: of a (rows past M read row M - 1), or of w (rows
        past O read row O - 1)."""
        if op == "a":
            return tirx.min(by * self.m + tx // self.lanes["a"], self.count() - 1)
        row = bx * TILE + tx // self.lanes["w"]
        outputs = self.product.outputs
        return row if outputs % TILE == 0 else tirx.min(row, outputs - 1)

    def inside(self, p, k0, tx):
        """Whether the thread's vector p of a in the chunk from K column ``k0`` on lies before
        K (True where K is whole pairs of chunks). Past K, a's vectors are zeros and w's
        read its last columns (finite: their products are zeros)."""
        if self.product.whole:
            return True
        return k0 + self.col("a", p, tx) < self.product.depth

    def _w_k(self, k):
        """Column k of w (its first of 4 where w is rows), or the last one's where k is past
        K."""
        if self.product.whole:
            return k
        return tirx.min(k, self.product.depth - (4 if self.product.w_rows else 1))

    def w_load(self, w, p, v, k0, bx, tx):
        """Element v of the thread's vector p of w in the chunk from K column ``k0`` on: 4
        consecutive k of a row of w [O, K] (transposed when stored), or 4 consecutive o of a
        row of w [K, O] (stored as they are: a warp reads 512 contiguous bytes)."""
        if self.product.w_rows:
            return tirx.BufferLoad(w, [self.row("w", None, bx, tx),
                                       self._w_k(k0 + self.col("w", p, tx)) + v])
        f = (p * self.threads + tx) * 4
        return tirx.BufferLoad(w, [self._w_k(k0 + f // TILE), bx * TILE + f % TILE + v])

    def w_slot(self, p, v, tx):
        """Where element v of the thread's vector p of w goes in a k-major shared tile."""
        if self.product.w_rows:
            return (self.col("w", p, tx) + v) * self.stride["w"] + tx // self.lanes["w"]
        f = (p * self.threads + tx) * 4
        return f // TILE * self.stride["w"] + f % TILE + v

    def at(self, m, where=None):
        """The leading indices of row m of a or out: (t, n) for all steps, else (n,); with
        lengths, those :func:`_locate` wrote to ``where``."""
        if self.product.lengths:
            return [where[0], where[1]]
        n_ = self.product.batch
        return [m // n_, m % n_] if self.product.all_steps else [m]

    @staticmethod
    def load(buffer, lead: list, k):
        """``buffer[*lead, k]``."""
        return tirx.BufferLoad(buffer, [*lead, k])

    def tiles(self):
        """Tiles of M x O (of T*N rows: a run-time count for all steps)."""
        return (self.rows + (self.m - 1)) // self.m * self.product.tiles_across

    def full(self):
        """All steps: the tiles of whole waves of :data:`ALL_STEPS_SPLIT_BLOCKS` blocks, which
        take K whole; the rest (:meth:`tail`) are split."""
        return self.tiles() // ALL_STEPS_SPLIT_BLOCKS * ALL_STEPS_SPLIT_BLOCKS

    def tail(self):
        """All steps: the tiles past the last whole wave (all of them where they make none)."""
        return self.tiles() % ALL_STEPS_SPLIT_BLOCKS

    def splits(self, of=lambda s: s):
        """Slices of K (``of(S)`` for S slices): one step's as :attr:`Product.splits` plans
        them; the tail's of all steps chosen at run time from the tiles of T*N rows, the most
        of :meth:`Product.split_choices` whose tail grid stays within
        :data:`ALL_STEPS_SPLIT_BLOCKS` (one where there is no tail; a choice among constants:
        nothing divides by a run-time S)."""
        p = self.product
        if not p.all_steps or p.lengths or len(p.split_choices()) == 1:
            return of(p.splits)
        tail = self.tail()
        value = tirx.const(of(1), "int32")
        for s in p.split_choices()[1:]:
            value = tirx.Select(tirx.all(tail > 0, tail * s <= ALL_STEPS_SPLIT_BLOCKS),
                                tirx.const(of(s), "int32"), value)
        return value

    def slice_at(self, bz, m, o):
        """The indices of slice bz's sum at row m, column o: [bz, m, o] in the output slices of
        a product left unsummed, else in the flat workspace that the sum kernel reads."""
        if self.product.unsummed:
            return [bz, m, o]
        return [(bz * self.rows + m) * self.product.outputs + o]

    def tail_at(self, slot, i, m, o):
        """The index of a slice's sum at row m, column o of tile i in the flat workspace that
        the tail's sum kernel reads, [S, tail, tile rows, TILE]: slot s * tail + j for slice s
        of the tail's j-th tile."""
        across = self.product.tiles_across
        return [slot * (self.m * TILE) + (m - i // across * self.m) * TILE + o
                - i % across * TILE]

    def column_inside(self, o):
        """Whether column ``o`` (the first of 4) is before O (True where O is whole tiles)."""
        return True if self.product.outputs % TILE == 0 else o < self.product.outputs

    def chunks(self):
        """K chunks a slice."""
        return self.splits(self.product.slice_chunks)

    def ahead(self, chunks) -> int:
        """Chunks whose loads are in flight at once over ``chunks`` chunks (a register set
        each): 1 (the next), or :data:`AHEAD` (2 where that does not divide the even count)
        for one step's product of at most half a tile of rows (:data:`AHEAD_BATCH`) in tiles
        of 128 threads whose grid is at most :data:`SPLIT_BLOCKS` (four warps a block and a
        few blocks a multiprocessor hide too little of a chunk's loads; the registers allow
        three blocks)."""
        p = self.product
        if (p.all_steps or self.threads != 128 or not isinstance(chunks, int)
                or p.batch > AHEAD_BATCH or p.step_blocks > SPLIT_BLOCKS):
            return 1
        return AHEAD if chunks % AHEAD == 0 else 2


def _parameters(t: Tile):
    """The gemm component's parameters: a [.., N, K], w [O, K] (or [K, O]), b [O], out [.., N,
    O]; with lengths, ``lengths`` and ``ends`` [N] int32 between b and out (kept in ``t``)."""
    p = t.product
    if p.lengths:
        a, w, b, t.lengths, t.ends, out = buffer_parameters({
            "a": ((t.t_len, p.batch, p.depth), "float32"),
            "w": (((p.outputs, p.depth) if p.w_rows else (p.depth, p.outputs)), "float32"),
            "b": ((p.outputs,), "float32"), "lengths": ((p.batch,), "int32"),
            "ends": ((p.batch,), "int32"), "out": ((t.t_len, p.batch, p.outputs), "float32")})
        return a, w, b, out
    lead = (t.t_len,) if p.all_steps else ()
    w_shape = (p.outputs, p.depth) if p.w_rows else (p.depth, p.outputs)
    if p.unsummed:  # a, w, the slices [S, N, O]
        a, w, out = float32_parameters({"a": (p.batch, p.depth), "w": w_shape,
                                        "out": (p.splits, p.batch, p.outputs)})
        return a, w, None, out
    return float32_parameters({"a": lead + (p.batch, p.depth), "w": w_shape,
                               "b": (p.outputs,), "out": lead + (p.batch, p.outputs)})


@T.macro
def _locate(t, m, where):
    """With lengths: ``where`` = (t, n), the step and sample of row m < :meth:`Tile.count`
    of the rows within the samples' lengths, laid out sample after sample (sample n's from
    ends[n - 1] on; ``ends`` counts each length within 0 .. T, :func:`rnncc.lowering.
    components.length_ends`, and so does t here): n = how many samples end at or before m,
    found by bisection. ``t``: ``batch`` N, ``t_len`` T, and the ``ends`` and ``lengths``
    buffers (a stage :mod:`.cuda_weight_grad` shares)."""
    steps = T.meta_var((t.batch - 1).bit_length())
    where[1] = 0
    for j in T.unroll(steps):
        if where[1] + (1 << (steps - 1 - j)) <= t.batch:
            if t.ends[where[1] + (1 << (steps - 1 - j)) - 1] <= m:
                where[1] = where[1] + (1 << (steps - 1 - j))
    where[0] = m - t.ends[where[1]] + T.max(T.min(t.lengths[where[1]],
                                                  T.Cast("int32", t.t_len)), 0)


@T.macro
def _load(t, a, w, ar, wr, k0, by, bx, tx, src, at):
    """A chunk's global reads, from K column ``k0`` on, into registers (16-byte vectors of
    both operands interleaved: with separate loops the all-steps kernel took 130 registers,
    one block a multiprocessor instead of two), register set ``at`` of ``ar`` and ``wr``
    (:meth:`Tile.ahead`); with lengths, a's row at ``src`` (t, n)."""
    for p in T.unroll(t.most):
        if p < t.vectors["a"]:
            if t.inside(p, k0, tx):
                for v in T.vectorized(4):
                    ar[(at * t.vectors["a"] + p) * 4 + v] = t.load(
                        a, t.at(t.row("a", by, bx, tx), src), k0 + t.col("a", p, tx) + v)
            else:
                for v in T.vectorized(4):
                    ar[(at * t.vectors["a"] + p) * 4 + v] = T.float32(0)
        if p < t.vectors["w"]:
            for v in T.vectorized(4):
                wr[(at * t.vectors["w"] + p) * 4 + v] = t.w_load(w, p, v, k0, bx, tx)


@T.macro
def _store(t, ar, wr, a_s, w_s, tx, at):
    """Register set ``at`` (a chunk) to shared memory, k-major (transposed)."""
    for p in T.unroll(t.most):
        for v in T.unroll(4):
            if p < t.vectors["a"]:
                a_s[(t.col("a", p, tx) + v) * t.stride["a"] + tx // t.lanes["a"]] = ar[
                    (at * t.vectors["a"] + p) * 4 + v]
            if p < t.vectors["w"]:
                w_s[t.w_slot(p, v, tx)] = wr[(at * t.vectors["w"] + p) * 4 + v]


@T.macro
def products(t, a_s, w_s, af, wf, acc, tx):
    """A chunk's products: 8 x 8 outputs a thread, its operands as 16-byte shared loads from
    k-major tiles (``t``: ``stride`` and ``half`` by operand, ``ty`` and ``tq``; a stage
    :mod:`.cuda_weight_grad` shares)."""
    for kk in T.unroll(BK):
        for h in T.unroll(2):
            for v in T.vectorized(4):
                af[h * 4 + v] = a_s[kk * t.stride["a"] + h * t.half["a"] + t.ty(tx) * 4 + v]
            for v in T.vectorized(4):
                wf[h * 4 + v] = w_s[kk * t.stride["w"] + h * t.half["w"] + t.tq(tx) * 4 + v]
        for r in T.unroll(8):
            for q in T.unroll(8):
                acc[r * 8 + q] = acc[r * 8 + q] + af[r] * wf[q]


class Into:
    """Where a tile's sums go instead of out (plus b): ``slices`` at ``at(m, o)`` for the tile's
    row m and column o."""

    def __init__(self, slices, at):
        self.slices, self.at = slices, at


@T.macro
def _chunks(t, a, w, ar, wr, shared, acc, af, wf, chunks, first, by, bx, tx, src):
    """The products of ``chunks`` chunks of K from column ``first`` on, double-buffered in
    shared memory (``shared``: a's and w's two buffers), chunk c's products from buffer c % 2,
    chunk c + 1's loads issued before them and stored after (the last chunk again at the end,
    stored where nothing reads it)."""
    a_s0, a_s1, w_s0, w_s1 = T.meta_var(shared)
    _load(t, a, w, ar, wr, first, by, bx, tx, src, 0)
    _store(t, ar, wr, a_s0, w_s0, tx, 0)
    T.tvm_storage_sync("shared")
    for c in range(chunks // 2):
        _load(t, a, w, ar, wr, first + T.min(c * 2 + 1, chunks - 1) * BK, by, bx, tx, src, 0)
        products(t, a_s0, w_s0, af, wf, acc, tx)
        _store(t, ar, wr, a_s1, w_s1, tx, 0)
        T.tvm_storage_sync("shared")
        _load(t, a, w, ar, wr, first + T.min(c * 2 + 2, chunks - 1) * BK, by, bx, tx, src, 0)
        products(t, a_s1, w_s1, af, wf, acc, tx)
        _store(t, ar, wr, a_s0, w_s0, tx, 0)
        T.tvm_storage_sync("shared")


@T.macro
def _chunk_ahead(t, a, w, ar, wr, s_now, s_next, acc, af, wf, chunks, first, c, at, by, bx, tx,
                 src):
    """Chunk c of :func:`_chunks_ahead` (register set ``at``): its products from ``s_now``,
    then chunk c + 1 stored from its set to ``s_next`` and chunk c + 1 + A loaded into it."""
    ahead = T.meta_var(t.ahead(chunks))
    a_now, w_now = T.meta_var(s_now)
    a_next, w_next = T.meta_var(s_next)
    products(t, a_now, w_now, af, wf, acc, tx)
    if c + 1 < chunks:
        _store(t, ar, wr, a_next, w_next, tx, (at + 1) % ahead)
        if c + 1 + ahead < chunks:
            _load(t, a, w, ar, wr, first + (c + 1 + ahead) * BK, by, bx, tx, src,
                  (at + 1) % ahead)
        T.tvm_storage_sync("shared")


@T.macro
def _chunks_ahead(t, a, w, ar, wr, shared, acc, af, wf, chunks, first, by, bx, tx, src):
    """:func:`_chunks` with the loads of A = :meth:`Tile.ahead` chunks in flight: chunk k
    staged from register set k % A, which then loads chunk k + A; a loop over groups of A
    chunks (A even, dividing the count), each group unrolled (static sets and buffers)."""
    a_s0, a_s1, w_s0, w_s1 = T.meta_var(shared)
    ahead = T.meta_var(t.ahead(chunks))
    for c in T.unroll(ahead):
        _load(t, a, w, ar, wr, first + c * BK, by, bx, tx, src, c)
    _store(t, ar, wr, a_s0, w_s0, tx, 0)
    if ahead < chunks:
        _load(t, a, w, ar, wr, first + ahead * BK, by, bx, tx, src, 0)
    T.tvm_storage_sync("shared")
    for g in range(chunks // ahead):
        for j in T.unroll(ahead):
            if j % 2 == 0:
                _chunk_ahead(t, a, w, ar, wr, (a_s0, w_s0), (a_s1, w_s1), acc, af, wf, chunks,
                             first, g * ahead + j, j, by, bx, tx, src)
            else:
                _chunk_ahead(t, a, w, ar, wr, (a_s1, w_s1), (a_s0, w_s0), acc, af, wf, chunks,
                             first, g * ahead + j, j, by, bx, tx, src)


@T.macro
def _tile(t, io, chunks, first, into, by, bx, tx):
    """A block's tile over ``chunks`` chunks of K from column ``first`` on (:func:`_chunks`,
    or :func:`_chunks_ahead` where :meth:`Tile.ahead` says), then the tile plus b to out, or
    (:class:`Into`) without b to a slice. With lengths, the step and sample of the row a
    thread stages are located once, and those of each row it writes (:func:`_locate`)."""
    a, w, b, out = T.meta_var(io)
    # two buffers an operand (not one of two halves: TVM's barrier insertion cannot tell the
    # halves apart, and adds a second barrier a chunk)
    a_s0 = T.alloc_buffer((BK * t.stride["a"],), "float32", scope="shared")
    a_s1 = T.alloc_buffer((BK * t.stride["a"],), "float32", scope="shared")
    w_s0 = T.alloc_buffer((BK * t.stride["w"],), "float32", scope="shared")
    w_s1 = T.alloc_buffer((BK * t.stride["w"],), "float32", scope="shared")
    acc = T.alloc_buffer((64,), "float32", scope="local")
    af = T.alloc_buffer((8,), "float32", scope="local")
    wf = T.alloc_buffer((8,), "float32", scope="local")
    sets = T.meta_var(t.ahead(chunks))
    ar = T.alloc_buffer((sets * t.vectors["a"] * 4,), "float32", scope="local")
    wr = T.alloc_buffer((sets * t.vectors["w"] * 4,), "float32", scope="local")
    src = T.alloc_buffer((2,), "int32", scope="local")  # with lengths: (t, n) of a's row
    dst = T.alloc_buffer((2,), "int32", scope="local")  # and of a row of out
    for e in T.unroll(64):
        acc[e] = T.float32(0)
    if t.product.lengths:
        _locate(t, T.Cast("int32", t.row("a", by, bx, tx)), src)
    if sets > 1:
        _chunks_ahead(t, a, w, ar, wr, (a_s0, a_s1, w_s0, w_s1), acc, af, wf, chunks, first,
                      by, bx, tx, src)
    else:
        _chunks(t, a, w, ar, wr, (a_s0, a_s1, w_s0, w_s1), acc, af, wf, chunks, first, by, bx,
                tx, src)
    for r in T.unroll(8):
        m = T.meta_var(by * t.m + r // 4 * t.half["a"] + t.ty(tx) * 4 + r % 4)
        if m < t.count():
            if t.product.lengths:
                _locate(t, T.Cast("int32", m), dst)
            for h in T.unroll(2):
                if t.column_inside(bx * TILE + h * t.half["w"] + t.tq(tx) * 4):
                    for v in T.vectorized(4):
                        o = T.meta_var(bx * TILE + h * t.half["w"] + t.tq(tx) * 4 + v)
                        if into is None:
                            T.buffer_store(out, acc[r * 8 + h * 4 + v] + b[o],
                                           t.at(m, dst) + [o])
                        else:
                            T.buffer_store(into.slices, acc[r * 8 + h * 4 + v], into.at(m, o))


@T.macro
def _bounded_tile(t, io, chunks, first, into, by, bx, tx):
    """:func:`_tile` in a kernel whose launch bounds name :attr:`Product.min_blocks`; with
    lengths, in the blocks whose rows start within :meth:`Tile.count` (the grid is T*N rows
    of tiles)."""
    if t.product.min_blocks is None:
        _tile(t, io, chunks, first, into, by, bx, tx)
    else:
        with T.attr(0, LAUNCH_BOUNDS, t.product.min_blocks):
            if t.product.lengths:
                if by * t.m < t.count():
                    _tile(t, io, chunks, first, into, by, bx, tx)
            else:
                _tile(t, io, chunks, first, into, by, bx, tx)


@T.macro
def _grid(t, io, splits, slices):
    """The tiles of M x O (and one step's slices of K, blockIdx.z, where ``slices`` is
    given)."""
    if slices is None:
        for by in T.thread_binding((t.rows + (t.m - 1)) // t.m, thread="blockIdx.y"):
            for bx in T.thread_binding(t.product.tiles_across, thread="blockIdx.x"):
                for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
                    _bounded_tile(t, io, t.product.slice_chunks(1), 0, None, by, bx, tx)
    else:
        for bz in T.thread_binding(splits, thread="blockIdx.z"):
            for by in T.thread_binding((t.rows + (t.m - 1)) // t.m, thread="blockIdx.y"):
                for bx in T.thread_binding(t.product.tiles_across, thread="blockIdx.x"):
                    for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
                        _bounded_tile(t, io, t.chunks(), bz * t.chunks() * BK,
                                      Into(slices, partial(t.slice_at, bz)), by, bx, tx)


@T.macro
def _whole_tiles(t, io, count):
    """All steps' first ``count`` tiles (the whole waves' where the tail is split) over the
    whole of K, one a block in order (along O first)."""
    for z in T.thread_binding(count, thread="blockIdx.x"):
        for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
            _bounded_tile(t, io, t.product.slice_chunks(1), 0, None, z // t.product.tiles_across,
                          T.Cast("int32", z % t.product.tiles_across), tx)


@T.macro
def _tail_tiles(t, io, splits, slices):
    """All steps' tail (:meth:`Tile.tail`): its tile j (blockIdx.x) in ``splits`` slices of K
    (blockIdx.y), into ``slices`` as :meth:`Tile.tail_at` lays them out."""
    for s in T.thread_binding(splits, thread="blockIdx.y"):
        for j in T.thread_binding(t.tail(), thread="blockIdx.x"):
            for tx in T.thread_binding(t.threads, thread="threadIdx.x"):
                i = T.meta_var(t.full() + j)
                _bounded_tile(t, io, t.chunks(), s * t.chunks() * BK, Into(slices, partial(
                    t.tail_at, s * t.tail() + j, i)), i // t.product.tiles_across,
                    T.Cast("int32", i % t.product.tiles_across), tx)


@T.macro
def _sum_slices(t, io, splits, slices):
    """The second kernel of one step's split product: out = the slices summed in order, plus
    b; 4 outputs a thread."""
    a, w, b, out = T.meta_var(io)
    o_ = T.meta_var(t.product.outputs)
    quads = T.meta_var(t.rows * o_ // 4)
    for bx in T.thread_binding((quads + 255) // 256, thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            s = T.alloc_buffer((4,), "float32", scope="local")
            e = T.meta_var((bx * 256 + tx) * 4)
            if bx * 256 + tx < quads:
                for v in T.vectorized(4):
                    s[v] = slices[e + v]
                for z in T.unroll(1, splits):
                    for v in T.vectorized(4):
                        s[v] = s[v] + slices[z * t.rows * o_ + e + v]
                for v in T.vectorized(4):
                    T.buffer_store(out, s[v] + b[e % o_ + v], t.at(e // o_) + [e % o_ + v])


@T.macro
def _sum_tail(t, io, splits, slices):
    """The second kernel of all steps' split tail: each of its tiles' elements inside M x O =
    its slices summed in order, plus b; 4 outputs a thread."""
    a, w, b, out = T.meta_var(io)
    area, across = T.meta_var((t.m * TILE, t.product.tiles_across))
    quads = T.meta_var(t.tail() * area // 4)
    for bx in T.thread_binding((quads + 255) // 256, thread="blockIdx.x"):
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            s = T.alloc_buffer((4,), "float32", scope="local")
            e = T.meta_var((bx * 256 + tx) * 4)
            i = T.meta_var(t.full() + e // area)
            m = T.meta_var(i // across * t.m + e % area // TILE)
            o = T.meta_var(i % across * TILE + e % TILE)
            if bx * 256 + tx < quads and m < t.rows and t.column_inside(o):
                for v in T.vectorized(4):
                    s[v] = slices[e + v]
                for z in T.serial(1, splits):
                    for v in T.vectorized(4):
                        s[v] = s[v] + slices[z * t.tail() * area + e + v]
                for v in T.vectorized(4):
                    T.buffer_store(out, s[v] + b[o + v], t.at(m) + [o + v])


def kernel(product: Product):
    """The kernel(s) as a PrimFunc with the gemm component's parameters (a, w, b, out; a
    gemm_parts component's a, w, slices). One step's split product: the tiles into slices,
    then their sum (none where the slices are the output). All steps': the tiles whole where
    the run-time split of the tail is 1, else the tail in slices and their sum (the host
    chooses)."""
    t = Tile(product)
    splits = t.splits()
    static = isinstance(splits, int)
    # all steps: S slices of the tail's tiles only where S * tail <= ALL_STEPS_SPLIT_BLOCKS
    slice_floats = (splits * product.batch * product.outputs if static else
                    ALL_STEPS_SPLIT_BLOCKS * TILE * TILE)

    @T.prim_func(s_tir=True)
    def sgemm():
        T.func_attr({"tirx.noalias": True})
        io = T.meta_var(_parameters(t))
        with T.sblock("root"):
            if product.unsummed:
                _grid(t, io, splits, io[3])
            elif static and splits == 1:
                _grid(t, io, 1, None)
            else:
                slices = T.sblock_alloc_buffer((slice_floats,), "float32")
                if static:
                    _grid(t, io, splits, slices)
                    _sum_slices(t, io, splits, slices)
                elif splits == 1:
                    _grid(t, io, 1, None)
                else:
                    if t.full() > 0:
                        _whole_tiles(t, io, t.full())
                    _tail_tiles(t, io, splits, slices)
                    _sum_tail(t, io, splits, slices)

    return sgemm


def apply(func, target):
    found = sizes(func)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.sgemm", apply)
