"""CUDA: float32 projections with many rows, as a tiled SGEMM written out in TIR (the classic
double-buffered register-blocked kernel): the input projection of all steps, and each step's
recurrent projection at a large batch.

out[.., n, o] = sum_k a[.., n, k] * w[o, k] + b[o] for N static batch rows (at least
:data:`MIN_BATCH` for one step's product), O outputs, K deep; the rows M are the T*N rows of
all steps (T a run-time size) or one step's N. A block computes a tile of M x O, 128 columns by
128 rows (all steps, 256 threads) or by 64 rows (one step, 128 threads: a batch of 64 in one
tile), 8 x 8 outputs a thread (rows ty*4 + i and M/2 + ty*4 + i of the tile, columns tq*4 + j
and 64 + tq*4 + j, i, j < 4, for the thread's place (ty, tq) in a (M/8) x 16 grid whose warps
cover 4 x 8 patches: each operand's 16-byte register loads are shared by a warp's threads, 64
FMAs a thread for 4 of them; warps of 2 x 16 or 8 x 4 and BK = 16 were slower in whole
sequences, H200, docs/benchmarks.md). K goes in chunks of :data:`BK` through shared memory
stored k-major, double-buffered: the next chunk's global loads (16-byte vectors) are issued
before the current chunk's products and stored to the other buffer after them, so one barrier a
chunk suffices and the loads' latency hides behind the FMAs. The k-major rows are padded by
:data:`PAD` floats, which keeps the transposed stores free of bank conflicts. Rows past M read
row M - 1 (no branch in the loop) and are not written.

One step's grid alone is small (LSTM 1024 at batch 64: 32 tiles for 132 multiprocessors), so
its K is split in slices (:attr:`Product.splits`; blockIdx.z), each written to an [S, N, O]
workspace, and a second kernel sums the slices in order and adds the bias (deterministic,
unlike atomics). Slices of 128 to 256 deep measured best (H200, batch 64: LSTM 1024 and 1536,
GRU 2048 8 slices, GRU 1024 16; 4 or 32 were slower), whence :data:`SPLIT_BLOCKS`.

Why not a schedule of the component's loops (:mod:`.cuda_tiled_gemm` does that): TVM's buffer
compaction gave no layout that was both double-buffered and free of bank conflicts from the
schedules tried (docs/benchmarks.md, "Batch 64"); that rule takes the sizes this one does not
(and float16) and the chunked projections of small batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir

from ._common import gemm_blocks, prim_func_from_text, static_extent, weights_are_rows
from ._rule import Rule

#: Fewest batch rows one step's product this rule takes. The products of all steps (T*N rows)
#: it takes at any batch; at batch 1, 2, 4 and 8 they reach it in chunks of steps, which
#: :mod:`.cuda_tiled_gemm` takes instead. (dlight's Matmul, which took the others, ran LSTM
#: 4096's at batch 16 at about 12 TFLOP/s on an H200.)
MIN_BATCH = 32
#: Columns (of O) a block's tile, and rows (of M) a tile of the products of all steps.
TILE = 128
#: Rows a tile of one step's product (the batch: 64 rows at batch 64 in one tile).
STEP_TILE = 64
#: K a chunk through shared memory (a multiple of 8: a thread stages whole 16-byte vectors).
BK = 8
#: Threads along the rows of a warp's 8-row patch of the tile (the rest, 32 / WARP_ROWS, along its
#: columns).
WARP_ROWS = 4
#: Floats padding each k-row of the shared tiles (bank-conflict-free transposed stores).
PAD = 4
#: Split-K of one step's product: at most MAX_SPLITS slices (a power of two), each at least
#: MIN_SLICE deep, the grid at most SPLIT_BLOCKS blocks (about three of 128 threads a
#: multiprocessor of an H200; 512 made LSTM 1024 take 16 slices, 16% slower).
MAX_SPLITS = 16
MIN_SLICE = 64
SPLIT_BLOCKS = 384


@dataclass(frozen=True)
class Product:
    """A product this rule computes: N ``batch`` rows a step, K ``depth``, O ``outputs``; of
    all steps (a run-time T) or of one step."""

    batch: int
    depth: int
    outputs: int
    all_steps: bool

    @property
    def tile_rows(self) -> int:
        return TILE if self.all_steps else STEP_TILE

    @property
    def threads(self) -> int:
        """Threads a block: 8 x 8 outputs each."""
        return self.tile_rows * TILE // 64

    @property
    def splits(self) -> int:
        """Slices of K (one step's product, whose grid alone is small), each summed into the
        output by a second kernel."""
        if self.all_steps:
            return 1
        tiles = -(-self.batch // self.tile_rows) * (self.outputs // TILE)
        splits = 1
        while (splits * 2 <= MAX_SPLITS and tiles * splits * 2 <= SPLIT_BLOCKS
               and self.depth % (splits * 4 * BK) == 0
               and self.depth // (splits * 2) >= MIN_SLICE):
            splits *= 2
        return splits


def sizes(func) -> Product | None:
    """The product of rnncc's gemm component ``func`` when this rule takes it, else None: in
    float32, weights as rows [O, K], N >= MIN_BATCH for one step's, O a multiple of
    :data:`TILE` and K of 2 * :data:`BK` (chunks go in pairs, one a buffer); lead (T, N) or
    (N,)."""
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None or len(sch.get_loops(blocks[0])) not in (3, 4):
        return None
    if any(str(buf.dtype) != "float32" for buf in func.params):
        return None
    if not weights_are_rows(sch, blocks[0]):
        return None
    *_, n_loop, o_loop, k_loop = sch.get_loops(blocks[0])
    batch, outputs, depth = (static_extent(sch, x) for x in (n_loop, o_loop, k_loop))
    all_steps = len(sch.get_loops(blocks[0])) == 4
    if None in (batch, outputs, depth) or (batch < MIN_BATCH and not all_steps):
        return None
    if outputs % TILE or depth % (2 * BK):
        return None
    return Product(batch, depth, outputs, all_steps)


def source(product: Product, name: str = "sgemm") -> str:
    """TVMScript text of the kernel(s) for ``product``."""
    n_, k_, o_ = product.batch, product.depth, product.outputs
    tile_m, threads, splits = product.tile_rows, product.threads, product.splits
    strides = {"a": tile_m + PAD, "w": TILE + PAD}  # floats a k-row of a shared tile
    halves = {"a": tile_m // 2, "w": TILE // 2}
    # elements of an operand a thread stages a chunk, and threads a row of a chunk
    per = {"a": tile_m * BK // threads, "w": TILE * BK // threads}
    lanes = {op: BK // per[op] for op in "aw"}
    chunks = k_ // BK // splits
    w_rows, w_cols = WARP_ROWS, 32 // WARP_ROWS
    # the thread's place (ty, tq) in the (tile_m / 8) x 16 grid: warp w covers rows
    # (w // (16/WC)) * WR .. + WR - 1 and columns (w % (16/WC)) * WC .. + WC - 1 (WR x WC = 32)
    ty = f"(tx // 32 // {16 // w_cols} * {w_rows} + tx % 32 // {w_cols})"
    tq = f"(tx // 32 % {16 // w_cols} * {w_cols} + tx % {w_cols})"
    if product.all_steps:
        lead, rows = "T_len, ", f"T_len * {n_}"

        def at(m: str) -> str:
            return f"({m}) // {n_}, ({m}) % {n_}"
    else:
        lead, rows = "", str(n_)

        def at(m: str) -> str:
            return m
    lines = [
        "@T.prim_func(s_tir=True)",
        f"def {name}(a_h: T.handle, w_h: T.handle, b_h: T.handle, out_h: T.handle):",
        '    T.func_attr({"tirx.noalias": True})',
    ]
    if product.all_steps:
        lines += ["    T_len = T.int64()"]
    lines += [
        f'    a = T.match_buffer(a_h, ({lead}{n_}, {k_}), "float32")',
        f'    w = T.match_buffer(w_h, ({o_}, {k_}), "float32")',
        f'    b = T.match_buffer(b_h, ({o_},), "float32")',
        f'    out = T.match_buffer(out_h, ({lead}{n_}, {o_}), "float32")',
        '    with T.sblock("root"):',
    ]
    # two buffers an operand (not one of two halves: TVM's barrier insertion cannot tell the
    # halves apart, and adds a second barrier a chunk)
    lines += [f'        {op}_s{j} = T.sblock_alloc_buffer(({BK * strides[op]},), "float32", '
              'scope="shared")' for op in "aw" for j in range(2)]
    if splits > 1:
        lines += [f'        slices = T.sblock_alloc_buffer(({splits}, {n_}, {o_}), "float32")']
    lines += [
        '        acc = T.sblock_alloc_buffer((64,), "float32", scope="local")',
        '        af = T.sblock_alloc_buffer((8,), "float32", scope="local")',
        '        wf = T.sblock_alloc_buffer((8,), "float32", scope="local")',
        f'        ar = T.sblock_alloc_buffer(({per["a"]},), "float32", scope="local")',
        f'        wr = T.sblock_alloc_buffer(({per["w"]},), "float32", scope="local")',
    ]
    i = " " * 16
    if splits > 1:
        lines += [f'        for bz in T.thread_binding({splits}, thread="blockIdx.z"):']
        i += "    "
    lines += [
        f'{i[:-8]}for by in T.thread_binding(({rows} + {tile_m - 1}) // {tile_m}, '
        'thread="blockIdx.y"):',
        f'{i[:-4]}for bx in T.thread_binding({o_ // TILE}, thread="blockIdx.x"):',
        f'{i}for tx in T.thread_binding({threads}, thread="threadIdx.x"):',
    ]
    i += "    "
    slice0 = f"bz * {k_ // splits} + " if splits > 1 else ""
    # the row of a and of w a thread stages, and its columns in a chunk: 16-byte vectors p
    # at p * 4 * lanes + (tx % lanes) * 4 (interleaved, so that each vector's transposed
    # stores from a warp's threads hit all 32 banks)
    row = {"a": f"T.min(by * {tile_m} + tx // {lanes['a']}, {rows} - 1)",
           "w": f"bx * {TILE} + tx // {lanes['w']}"}

    def col(op: str, p: int) -> str:
        return f"{p * 4 * lanes[op]} + tx % {lanes[op]} * 4"

    # a thread's vectors of both operands interleaved (with separate loops the all-steps
    # kernel took 130 registers, one block a multiprocessor instead of two)
    vectors = [[op for op in "aw" if p < per[op] // 4] for p in range(max(per.values()) // 4)]

    def load(ind: str, k0: str) -> list[str]:
        out = []
        for p, ops in enumerate(vectors):
            src = {"a": f"a[{at(row['a'])}, ", "w": f"w[{row['w']}, "}
            for op in ops:
                out += [f"{ind}for v in T.vectorized(4):",
                        f"{ind}    {op}r[{p * 4} + v] = {src[op]}{slice0}{k0} + {col(op, p)} + v]"]
        return out

    def store(ind: str, buf: int) -> list[str]:
        out = []
        for p, ops in enumerate(vectors):
            out += [f"{ind}for v in T.unroll(4):"]
            out += [f"{ind}    {op}_s{buf}[({col(op, p)} + v) * {strides[op]} + tx // {lanes[op]}]"
                    f" = {op}r[{p * 4} + v]" for op in ops]
        return out

    def products(ind: str, buf: int) -> list[str]:
        return [
            f"{ind}for kk in T.unroll({BK}):",
            f"{ind}    for h in T.unroll(2):",
            f"{ind}        for v in T.vectorized(4):",
            f"{ind}            af[h * 4 + v] = a_s{buf}[kk * {strides['a']} + h * {halves['a']} "
            f"+ {ty} * 4 + v]",
            f"{ind}        for v in T.vectorized(4):",
            f"{ind}            wf[h * 4 + v] = w_s{buf}[kk * {strides['w']} + h * {halves['w']} "
            f"+ {tq} * 4 + v]",
            f"{ind}    for r in T.unroll(8):",
            f"{ind}        for q in T.unroll(8):",
            f"{ind}            acc[r * 8 + q] = acc[r * 8 + q] + af[r] * wf[q]",
        ]

    lines += [f"{i}for e in T.unroll(64):", f"{i}    acc[e] = T.float32(0)"]
    lines += load(i, "0") + store(i, 0) + [f"{i}T.tvm_storage_sync('shared')"]
    # chunk c's products from buffer c % 2; chunk c + 1 (the last chunk again at the end,
    # stored where nothing reads it) loaded before them and stored after
    lines += [f"{i}for c in range({chunks // 2}):"]
    for j in range(2):
        lines += load(i + "    ", f"T.min(c * 2 + {j + 1}, {chunks - 1}) * {BK}")
        lines += products(i + "    ", j) + store(i + "    ", 1 - j)
        lines += [f"{i}    T.tvm_storage_sync('shared')"]
    m = f"by * {tile_m} + r // 4 * {halves['a']} + {ty} * 4 + r % 4"
    o = f"bx * {TILE} + h * {halves['w']} + {tq} * 4 + v"
    value = f"acc[r * 8 + h * 4 + v] + b[{o}]"
    dest = f"out[{at(m)}, {o}]"
    if splits > 1:
        value, dest = "acc[r * 8 + h * 4 + v]", f"slices[bz, {m}, {o}]"
    lines += [
        f"{i}for r in T.unroll(8):",
        f"{i}    with T.If({m} < {rows}):",
        f"{i}        with T.Then():",
        f"{i}            for h in T.unroll(2):",
        f"{i}                for v in T.vectorized(4):",
        f"{i}                    {dest} = {value}",
    ]
    if splits > 1:
        lines += _sum_slices(n_, o_, splits)
    return "\n".join(lines) + "\n"


def _sum_slices(n_: int, o_: int, splits: int) -> list[str]:
    """The second kernel of a split product: out = the slices summed in order, plus b; 4
    outputs a thread."""
    quads = n_ * o_ // 4
    i = " " * 16
    e = "(bx * 256 + tx) * 4"
    return [
        '        s = T.sblock_alloc_buffer((4,), "float32", scope="local")',
        f'        for bx in T.thread_binding({-(-quads // 256)}, thread="blockIdx.x"):',
        '            for tx in T.thread_binding(256, thread="threadIdx.x"):',
        f"{i}with T.If(bx * 256 + tx < {quads}):",
        f"{i}    with T.Then():",
        f"{i}        for v in T.vectorized(4):",
        f"{i}            s[v] = slices[0, {e} // {o_}, {e} % {o_} + v]",
        f"{i}        for z in T.unroll(1, {splits}):",
        f"{i}            for v in T.vectorized(4):",
        f"{i}                s[v] = s[v] + slices[z, {e} // {o_}, {e} % {o_} + v]",
        f"{i}        for v in T.vectorized(4):",
        f"{i}            out[{e} // {o_}, {e} % {o_} + v] = s[v] + b[{e} % {o_} + v]",
    ]


def kernel(product: Product):
    """The kernel(s) as a PrimFunc with the gemm component's parameters (a, w, b, out)."""
    return prim_func_from_text(source(product))


def apply(func, target):
    found = sizes(func)
    return None if found is None else s_tir.Schedule(kernel(found))


RULE = Rule("cuda.sgemm", apply)
