"""CUDA: a cell's step that reduces over the hidden units (``ops.mean``; the layer-normalised
cells), forward or backward: one thread block a batch row, one kernel the whole step.

The lowering (:func:`rnncc.lowering.components.row_means`) gives each mean a stage of its
values [N, H] and a sum over the row [N], then the step's outputs [N, H] in one loop nest. Here
the values are computed where the sums read them (inlined), every sum runs in the block of its
row, its units spread over the block's threads and summed across them into shared memory, and
the outputs follow,
thread i of the block taking units i, i + threads, ... of the row. Each thread reads a sum
into a register once (:func:`_in_registers`).
"""

from tvm import s_tir

from ._common import is_spatial, loop_nests, static_extent
from ._rule import Rule

#: Threads a row, at most: LN-LSTM 1024 on an H100, batch 1 / 4 / 64: 13.8 / 13.2 / 40.2 us a
#: step with 1024, 17.7 / 17.2 / 54.2 with 256 (the rows' blocks are few; more threads each
#: spread a row's sums and outputs wider).
THREADS = 1024


def apply(func, target):
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    names = [sch.get(b).name_hint for b in blocks]
    sums = [b for b, name in zip(blocks, names) if name.startswith("row_sum")]
    if not sums or any(not is_spatial(sch, b) for b in blocks if b not in sums):
        return None
    for block, name in zip(blocks, names):
        if name.startswith("row_values"):
            sch.compute_inline(block)
    nests = loop_nests(sch)
    loops, outputs = nests[-1]
    if len(loops) != 2 or len(nests) != len(sums) + 1 or any(b in sums for b in outputs):
        return None
    hidden = static_extent(sch, loops[1])
    if hidden is None:
        return None
    # one unit a row: one thread a block (the sums have no loop over units to spread)
    threads = 1 if hidden == 1 else min(THREADS, max(32, -(-hidden // 32) * 32))
    row, unit = loops
    sch.bind(row, "blockIdx.x")
    _, lane = sch.split(unit, [None, threads])
    sch.bind(lane, "threadIdx.x")
    for block in reversed(sums):
        sch.compute_at(block, row)
        sch.set_scope(block, 0, "shared")
        if hidden > 1:
            _, lane = sch.split(sch.get_loops(block)[-1], [None, threads])
            sch.bind(lane, "threadIdx.x")
    for block in sums:
        _in_registers(sch, block)
    return sch


def _in_registers(sch, block) -> None:
    """Each thread reads the sum of ``block`` from shared memory into a register once, where
    the later stages take it. Read from shared memory in every stage (after the barriers
    between them), its value was a new one each time to the compiler, which evaluated again
    all that depends on it: LN-LSTM 1024's derivative took 2432 SASS instructions a thread
    (111 MUFU), 1072 (17 MUFU) so, on one multiprocessor a batch row."""
    consumers = list(sch.get_consumers(block))
    if not consumers:
        return
    written = sch.get(block).writes[0].source
    index = next(i for i, region in enumerate(sch.get(consumers[0]).reads)
                 if region.source.same_as(written))
    sch.cache_read(consumers[0], index, "local", consumer_blocks=consumers)


RULE = Rule("cuda.row_means", apply)
