"""CUDA: the float32 input projection of all steps at a large batch, as a 128 x 128 tiled
SGEMM written out in TIR (the classic double-buffered register-blocked kernel).

out[t, n, o] = sum_k a[t, n, k] * w[o, k] + b[o] for the M = T*N rows of all steps (N static, at
least :data:`MIN_BATCH`; T a run-time size) and O outputs, K deep. A block computes a 128 x 128
tile of M x O with 256 threads, 8 x 8 outputs a thread (rows ty*4 + i and 64 + ty*4 + i,
columns tq*4 + j and 64 + tq*4 + j, i, j < 4, for the thread's place (ty, tq) in a 16 x 16
grid whose warps cover 4 x 8 patches: each operand's 16-byte register loads are shared by a
warp's threads, 64 FMAs a thread for 4 of them; warps of 2 x 16 or 8 x 4 and BK = 16 were
slower in whole sequences, H200, docs/benchmarks.md). K goes
in chunks of :data:`BK` through shared memory stored k-major, double-buffered: the next
chunk's global loads (16 bytes a thread an operand) are issued before the current chunk's
products and stored to the other buffer after them, so one barrier a chunk suffices and the
loads' latency hides behind the FMAs. The k-major rows are padded by :data:`PAD` floats, which
keeps the transposed stores free of bank conflicts. Rows past M read row M - 1 (no branch in
the loop) and are not written.

Why not a schedule of the component's loops (:mod:`.cuda_tiled_gemm` does that): TVM's buffer
compaction gave no layout that was both double-buffered and free of bank conflicts from the
schedules tried (docs/benchmarks.md, "Batch 64"); that rule stays for one step's split-K
product and for chunked projections, and takes sizes this one does not.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.script import tirx as T
from tvm.script.parser.core.entry import parse

from ._common import gemm_blocks, static_extent, weights_are_rows
from ._rule import Rule

#: Fewest batch rows a step this rule takes (below, the chunked projections of
#: :mod:`.cuda_tiled_gemm` tile a chunk's rows).
MIN_BATCH = 32
#: Rows of M and of O a block's tile.
TILE = 128
#: K a chunk through shared memory (a multiple of 8: a thread stages whole 16-byte vectors).
BK = 8
#: Threads a block (16 x 16, 8 x 8 outputs each).
THREADS = 256
#: Threads along the rows of a warp's 8-row patch of the tile (the rest, 32 / WARP_ROWS, along its
#: columns).
WARP_ROWS = 4
#: Floats padding each k-row of the shared tiles (bank-conflict-free transposed stores).
PAD = 4


def sizes(func) -> tuple[int, int, int] | None:
    """(N, K, O) of rnncc's gemm component ``func`` when this rule takes it, else None: the
    product of all steps (lead (T, N)) in float32, weights as rows [O, K], N >= MIN_BATCH,
    O a multiple of :data:`TILE` and K of 2 * :data:`BK` (chunks go in pairs, one a buffer)."""
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None or len(sch.get_loops(blocks[0])) != 4:
        return None
    if any(str(buf.dtype) != "float32" for buf in func.params):
        return None
    if not weights_are_rows(sch, blocks[0]):
        return None
    _, n_loop, o_loop, k_loop = sch.get_loops(blocks[0])
    batch, outputs, depth = (static_extent(sch, x) for x in (n_loop, o_loop, k_loop))
    if None in (batch, outputs, depth) or batch < MIN_BATCH:
        return None
    if outputs % TILE or depth % (2 * BK):
        return None
    return batch, depth, outputs


def source(batch: int, depth: int, outputs: int, name: str = "sgemm") -> str:
    """TVMScript text of the kernel for N ``batch``, K ``depth`` and O ``outputs``."""
    n_, k_, o_ = batch, depth, outputs
    stride = TILE + PAD  # floats a k-row of a shared tile
    half = TILE // 2
    per = TILE * BK // THREADS  # elements of each operand a thread stages a chunk
    lanes = BK // per  # threads a row of a chunk
    chunks = k_ // BK
    w_rows, w_cols = WARP_ROWS, 32 // WARP_ROWS
    # the thread's place (ty, tq) in the 16 x 16 grid: warp w covers rows (w // (16/WC)) * WR
    # .. + WR - 1 and columns (w % (16/WC)) * WC .. + WC - 1 (WR x WC = 32 threads)
    ty = f"(tx // 32 // {16 // w_cols} * {w_rows} + tx % 32 // {w_cols})"
    tq = f"(tx // 32 % {16 // w_cols} * {w_cols} + tx % {w_cols})"
    lines = [
        "@T.prim_func(s_tir=True)",
        f"def {name}(a_h: T.handle, w_h: T.handle, b_h: T.handle, out_h: T.handle):",
        '    T.func_attr({"tirx.noalias": True})',
        "    T_len = T.int64()",
        f'    a = T.match_buffer(a_h, (T_len, {n_}, {k_}), "float32")',
        f'    w = T.match_buffer(w_h, ({o_}, {k_}), "float32")',
        f'    b = T.match_buffer(b_h, ({o_},), "float32")',
        f'    out = T.match_buffer(out_h, (T_len, {n_}, {o_}), "float32")',
        '    with T.sblock("root"):',
    ]
    # two buffers an operand (not one of two halves: TVM's barrier insertion cannot tell the
    # halves apart, and adds a second barrier a chunk)
    lines += [f'        {op}_s{j} = T.sblock_alloc_buffer(({BK * stride},), "float32", '
              'scope="shared")' for op in "aw" for j in range(2)]
    lines += [
        '        acc = T.sblock_alloc_buffer((64,), "float32", scope="local")',
        '        af = T.sblock_alloc_buffer((8,), "float32", scope="local")',
        '        wf = T.sblock_alloc_buffer((8,), "float32", scope="local")',
        f'        ar = T.sblock_alloc_buffer(({per},), "float32", scope="local")',
        f'        wr = T.sblock_alloc_buffer(({per},), "float32", scope="local")',
        f'        for by in T.thread_binding((T_len * {n_} + {TILE - 1}) // {TILE}, '
        'thread="blockIdx.y"):',
        f'            for bx in T.thread_binding({o_ // TILE}, thread="blockIdx.x"):',
        f'                for tx in T.thread_binding({THREADS}, thread="threadIdx.x"):',
    ]
    i = " " * 20
    rows = f"T_len * {n_}"
    # the row of a and of w a thread stages, and its columns in a chunk: 16-byte vectors p
    # at p * 4 * lanes + (tx % lanes) * 4 (interleaved, so that each vector's transposed
    # stores from a warp's threads hit all 32 banks)
    m_ld = f"T.min(by * {TILE} + tx // {lanes}, {rows} - 1)"
    o_ld = f"bx * {TILE} + tx // {lanes}"
    col = f"p * {4 * lanes} + tx % {lanes} * 4"

    def load(ind: str, k0: str) -> list[str]:
        return [
            f"{ind}for p in T.unroll({per // 4}):",
            f"{ind}    for v in T.vectorized(4):",
            f"{ind}        ar[p * 4 + v] = a[{m_ld} // {n_}, {m_ld} % {n_}, {k0} + {col} + v]",
            f"{ind}    for v in T.vectorized(4):",
            f"{ind}        wr[p * 4 + v] = w[{o_ld}, {k0} + {col} + v]",
        ]

    def store(ind: str, buf: int) -> list[str]:
        at = f"({col} + v) * {stride} + tx // {lanes}"
        return [
            f"{ind}for p in T.unroll({per // 4}):",
            f"{ind}    for v in T.unroll(4):",
            f"{ind}        a_s{buf}[{at}] = ar[p * 4 + v]",
            f"{ind}        w_s{buf}[{at}] = wr[p * 4 + v]",
        ]

    def products(ind: str, buf: int) -> list[str]:
        return [
            f"{ind}for kk in T.unroll({BK}):",
            f"{ind}    for h in T.unroll(2):",
            f"{ind}        for v in T.vectorized(4):",
            f"{ind}            af[h * 4 + v] = a_s{buf}[kk * {stride} + h * {half} "
            f"+ {ty} * 4 + v]",
            f"{ind}        for v in T.vectorized(4):",
            f"{ind}            wf[h * 4 + v] = w_s{buf}[kk * {stride} + h * {half} "
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
    m = f"by * {TILE} + r // 4 * {half} + {ty} * 4 + r % 4"
    o = f"bx * {TILE} + h * {half} + {tq} * 4 + v"
    lines += [
        f"{i}for r in T.unroll(8):",
        f"{i}    with T.If({m} < {rows}):",
        f"{i}        with T.Then():",
        f"{i}            for h in T.unroll(2):",
        f"{i}                for v in T.vectorized(4):",
        f"{i}                    out[({m}) // {n_}, ({m}) % {n_}, {o}] = "
        f"acc[r * 8 + h * 4 + v] + b[{o}]",
    ]
    return "\n".join(lines) + "\n"


def kernel(batch: int, depth: int, outputs: int):
    """The kernel as a PrimFunc with the gemm component's parameters (a, w, b, out)."""
    return parse(source(batch, depth, outputs), extra_vars={"T": T})


def apply(func, target):
    found = sizes(func)
    return None if found is None else s_tir.Schedule(kernel(*found))


RULE = Rule("cuda.sgemm", apply)
