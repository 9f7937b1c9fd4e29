"""CPU: element-wise components, parallel over chunks and vectorised within them.

``SERIAL`` leaves a function as TE wrote it (plain loops): it fits everything, and is the
fallback of every CPU role.
"""

from tvm import s_tir, tirx

from ._common import divisor, is_spatial, loop_nests, static_extent
from ._rule import Rule

#: Below this many elements a nest runs on one core.
PARALLEL_MIN = 4096


def apply(func, target):
    sch = s_tir.Schedule(func)
    nests = loop_nests(sch)
    if not nests or any(not is_spatial(sch, b) for _, blocks in nests for b in blocks):
        return None
    for loops, blocks in nests:
        if not loops:
            continue
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        total = static_extent(sch, fused)
        vec = 1 if any(_bfloat16_constant(sch, b) for b in blocks) else divisor(
            total, (16, 8, 4))
        if vec > 1:
            outer, inner = sch.split(fused, [None, vec])
            sch.vectorize(inner)
        else:
            outer = fused
        if total is None or total >= PARALLEL_MIN:
            sch.parallel(outer)
    return sch


def _bfloat16_constant(sch, block) -> bool:
    """True where the block stores a constant into a bfloat16 buffer: TVM's LLVM backend
    cannot store a vector of bfloat16 constants (it lowers bfloat16 to uint16 storage, but not
    such a vector)."""
    body = sch.get(block).body
    return (isinstance(body, tirx.BufferStore) and str(body.buffer.dtype) == "bfloat16"
            and isinstance(body.value, (tirx.FloatImm, tirx.IntImm)))


RULE = Rule("cpu.elementwise", apply)


def _serial(func, target):
    return s_tir.Schedule(func)


SERIAL = Rule("cpu.serial", _serial)
