"""CUDA: register-tiled products on the CUDA cores for projections with many batch rows.

out[.., n, o] = sum_k a[.., n, k] * w[o, k] + b[o], with N (the batch, static) at least 32:
the recurrent projection at batch >= 32 ([N, H] x [G*H, H]^T a step) and the input projection
of all steps ([T, N, C] x [G*H, C]^T; T, when present, is a grid dimension, so a run-time T
needs no bounds checks). :mod:`.cuda_sgemm` comes first for float32 projections (of all steps
at any batch, of one step at batch >= 32) with O and K multiples of 4 (O of 128 where the
weights are columns); this rule takes those it declines, and the half types' that the
tensor-core rules decline.

A block computes a BN x BO tile of one step's output, TM x TO outputs a thread (8 x 4 by
default: 8 rows of a, read as two 16-byte vectors that a warp's threads mostly share, and 4
columns of w, one 16-byte vector); K goes in chunks of BK through shared memory, stored
k-major (a_s[k, n], w_s[k, o]) so that those register loads are vectors; the global reads run
along K, contiguous in both operands. One step's product has a small grid (LSTM 1024 at batch
64: 64 tiles), so it is split along K as well (split-K: S slices into an [S, N, O] workspace,
then a small kernel sums them and adds the bias), which gives each multiprocessor several
blocks to hide the global loads with. Sizes that do not divide into tiles are left to the next
rule. The tiles and slices were chosen by measurement (H200, batch 64, docs/benchmarks.md).

Software pipeline (the products of all steps; one step's split-K product measured slower with
it, H200): each K chunk's global reads go into registers first and are issued before the
products of the previous chunk, then stored to shared memory after them (TVM's
``software_pipeline_stage``/``order`` on the chunk loop), so the loads' latency overlaps the
FMAs (input projections 2-10% faster at batch 1-64). A thread copies a contiguous run of its
row (thread outermost in the copy's split), which keeps its register copy at 8 values.
"""

from dataclasses import astuple, dataclass

from tvm import s_tir

from ._common import gemm_blocks, static_extent, weights_are_rows
from ._rule import Rule

MIN_BATCH = 32
#: (BN, BO, TM, TO): a block's BN x BO outputs, TM x TO a thread; best first. The first that
#: divides the sizes is used (for a product of a few static steps, the first that also gives
#: TARGET_BLOCKS blocks: about one a multiprocessor on an H100/H200).
TILES = ((64, 64, 8, 4), (64, 32, 4, 4), (32, 32, 4, 4))
#: The products of all steps (T in the grid) at batch >= MIN_BATCH try 64 x 128 tiles (256
#: threads) first: 4-5% faster than 64 x 64 at batch 64 (H200, LSTM 1024, GRU 2048), and slower
#: on the few-block grids of one step's product.
ALL_STEPS_TILE = (64, 128, 8, 4)
TARGET_BLOCKS = 120
#: K chunk sizes, preferred first.
BK_CHOICES = (16, 8, 4)
#: Split-K of one step's product: at most MAX_SPLITS slices (a power of two), each at least
#: MIN_SLICE deep, the grid at most SPLIT_BLOCKS blocks.
MAX_SPLITS = 8
MIN_SLICE = 32
SPLIT_BLOCKS = 1024


@dataclass(frozen=True)
class Tiling:
    """A block computes bn x bo outputs, a thread tm x to of them; K goes in chunks of bk
    through shared memory, in ``splits`` slices (split-K, one step's product only)."""

    bn: int
    bo: int
    tm: int
    to: int
    bk: int
    splits: int = 1


def _pick_tile(batch, rows, steps):
    tiles = TILES if steps is not None else (ALL_STEPS_TILE, *TILES)
    fits = [t for t in tiles if batch % t[0] == 0 and rows % t[1] == 0]
    for tile in fits:
        if steps in (None, 1) or (batch // tile[0]) * (rows // tile[1]) * steps >= TARGET_BLOCKS:
            return tile
    return fits[-1] if fits else None


def _sizes(sch, gemm):
    """(lead loops, o, k, rows a step, O, K)."""
    *lead, o, k = sch.get_loops(gemm)
    batch, rows, depth = (static_extent(sch, x) for x in (lead[-1], o, k))
    return lead, o, k, batch, rows, depth


def plan(func) -> Tiling | None:
    """The tiling for rnncc's gemm component ``func``, or None when it does not tile."""
    sch = s_tir.Schedule(func)
    blocks = gemm_blocks(sch)
    if blocks is None:
        return None
    if len(sch.get_loops(blocks[0])) not in (3, 4) or not weights_are_rows(sch, blocks[0]):
        return None
    lead, _, _, batch, rows, depth = _sizes(sch, blocks[0])
    if None in (batch, rows, depth):
        return None
    # the steps a launch covers (unknown: T is a run-time size, and large; one step: split-K
    # makes its grid)
    steps = 1 if len(lead) == 1 else static_extent(sch, lead[0])
    return _tiling(batch, rows, depth, steps, len(lead) == 1)


def _tiling(batch: int, rows: int, depth: int, steps, one_step: bool) -> Tiling | None:
    """The planned tiling of a product of ``batch`` x ``rows`` outputs a step over ``depth``
    (``steps`` of them, None when a run-time count; ``one_step``: no step loop, so split-K
    makes its grid), or None."""
    if batch < MIN_BATCH:
        return None
    bk = next((c for c in BK_CHOICES if depth % c == 0), None)
    tile = _pick_tile(batch, rows, steps)
    if bk is None or tile is None:
        return None
    bn, bo, tm, to = tile
    splits = _splits(depth, bk, (batch // bn) * (rows // bo)) if one_step else 1
    return Tiling(bn, bo, tm, to, bk, splits)


def _misfits(tiling: Tiling, batch, rows, depth, one_step: bool) -> list[str]:
    """What keeps ``tiling`` from scheduling a product of ``batch`` x ``rows`` outputs a
    step over ``depth``; empty when it fits."""
    t = tiling
    out = []
    if None in (batch, rows, depth):
        out.append("the rows a step, the outputs and K must be static")
        return out
    if batch % t.bn or rows % t.bo:
        out.append(f"{t.bn} x {t.bo} tiles must divide the {batch} x {rows} outputs of a step")
    if t.bn % t.tm or t.bo % t.to or t.tm % 4 or t.to % 4:
        out.append(f"{t.tm} x {t.to} a thread must divide the tile and be multiples of 4")
    elif (t.bn // t.tm) * (t.bo // t.to) > 1024:
        out.append("more than 1024 threads a block")
    if t.splits < 1 or depth % (t.bk * t.splits):
        out.append(f"{t.splits} slices of whole {t.bk}-deep chunks must divide K = {depth}")
    if t.splits > 1 and not one_step:
        out.append("split-K is for one step's product only")
    return out


def apply(func, target):
    tiling = plan(func)
    return None if tiling is None else schedule(func, tiling)


def schedule(func, tiling: Tiling) -> s_tir.Schedule:
    """``func`` (rnncc's gemm component, weights "rows") scheduled with ``tiling``; a
    ValueError says why when the tiling does not fit its sizes."""
    bn, bo, tm, to, bk, splits = astuple(tiling)
    sch = s_tir.Schedule(func)
    gemm, bias = gemm_blocks(sch)
    lead, o, k, batch, rows, depth = _sizes(sch, gemm)
    misfits = _misfits(tiling, batch, rows, depth, len(lead) == 1)
    if misfits:
        raise ValueError(f"{tiling} does not fit this product ({batch} x {rows} outputs a "
                         f"step, K = {depth}): {'; '.join(misfits)}")
    pipeline = len(lead) == 2  # the products of all steps (see the module docstring)
    main = gemm
    if splits > 1:
        # split-K: S blocks a tile, each a slice of K, into a [S, N, O] buffer; then one
        # small kernel sums the slices and adds the bias
        k_s, k = sch.split(k, [splits, None])
        main = sch.rfactor(k_s, factor_axis=0)
        n_loop, o_loop, k_s, k = sch.get_loops(main)
        lead = [k_s, n_loop]
        o = o_loop
    ty, tx = bn // tm, bo // to
    n_o, n_t, n_i = sch.split(lead[-1], [None, ty, tm])
    o_o, o_t, o_i = sch.split(o, [None, tx, to])
    k_o, k_i = sch.split(k, [None, bk])
    outer = [lead[0]] if len(lead) == 2 else []
    sch.reorder(*outer, n_o, o_o, n_t, o_t, k_o, k_i, n_i, o_i)
    if outer:
        sch.bind(outer[0], "blockIdx.z")
    sch.bind(n_o, "blockIdx.y")
    sch.bind(o_o, "blockIdx.x")
    thread = sch.fuse(n_t, o_t)
    sch.bind(thread, "threadIdx.x")
    threads = ty * tx

    def stage(index):
        """Operand ``index`` (0: a, 1: w) into shared memory k-major (16-byte global reads
        along K), then a thread's values of a chunk row into registers, 4 at a time."""
        shared = sch.cache_read(main, index, "shared")
        sch.compute_at(shared, k_o)
        sch.transform_layout(shared, ("write", 0), lambda *i: (i[-1], *i[:-1]))
        copies = [shared]
        if pipeline:
            copies.insert(0, sch.cache_read(shared, 0, "local"))
            sch.compute_at(copies[0], k_o)
        for block in copies:
            fused = sch.fuse(*_below(sch, block, k_o))  # (rows of the tile, BK)
            t, _, v = sch.split(fused, [threads, None, 4])
            sch.bind(t, "threadIdx.x")
            sch.vectorize(v)
        local = sch.cache_read(main, index, "local")
        sch.compute_at(local, k_i)
        _, vec = sch.split(sch.fuse(*_below(sch, local, k_i)), [None, 4])
        sch.vectorize(vec)

    stage(0)
    stage(1)
    sch.unroll(k_i)
    if pipeline:
        sch.annotate(k_o, "software_pipeline_stage", [0, 0, 0, 0, 1])
        sch.annotate(k_o, "software_pipeline_order", [0, 3, 1, 4, 2])
    if splits == 1:
        sch.set_scope(gemm, 0, "local")
        sch.decompose_reduction(gemm, k_o)
        sch.reverse_compute_at(bias, thread)
        return sch
    partial = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(partial, thread)
    sch.decompose_reduction(main, k_o)
    n_loop, o_loop, k_s = sch.get_loops(gemm)
    b_x, t_x = sch.split(sch.fuse(n_loop, o_loop), [None, 256])
    sch.bind(b_x, "blockIdx.x")
    sch.bind(t_x, "threadIdx.x")
    sch.set_scope(gemm, 0, "local")
    sch.reverse_compute_at(bias, t_x)
    return sch


def _below(sch, block, loop):
    """The block's loops inside ``loop``."""
    loops = sch.get_loops(block)
    at = next(i for i, x in enumerate(loops) if sch.get_sref(x).same_as(sch.get_sref(loop)))
    return loops[at + 1:]


def _splits(depth: int, bk: int, blocks: int) -> int:
    """Slices of K for a step of ``blocks`` tiles: the most (a power of two, up to MAX_SPLITS)
    that keep each slice a whole number of chunks and MIN_SLICE deep, and the grid within
    SPLIT_BLOCKS."""
    splits = 1
    while (splits * 2 <= MAX_SPLITS and blocks * splits * 2 <= SPLIT_BLOCKS
           and depth % (splits * 2 * bk) == 0 and depth // (splits * 2) >= MIN_SLICE):
        splits *= 2
    return splits


RULE = Rule("cuda.tiled_gemm", apply)
