"""CPU: element-wise components, parallel over chunks and vectorised within them.

``SERIAL`` leaves a function as TE wrote it (plain loops): it fits everything, and is the
fallback of every CPU role.
"""

from tvm import s_tir, tirx

from rnncc.cells.ops import dtype_of

from ._common import divisor, is_spatial, loop_nests, static_extent
from ._rule import Rule

#: Below this many elements a nest runs on one core.
PARALLEL_MIN = 4096
#: Below this |x| the CPU's tanh is its series (:func:`tanh`).
TANH_SERIES_BELOW = 0.25


def tanh(x):
    """tanh of a float32 PrimExpr, accurate to a few ulps everywhere (None for other dtypes:
    TVM's form stays). TVM's LLVM tanh is (1 - e^-2|x|) / (1 + e^-2|x|), whose relative error
    grows as |x| shrinks (1e-5 at |x| = 5e-4, against 3e-8 for NumPy's float32): an LSTM's h =
    o * tanh(c) of a small c came out so. Below :data:`TANH_SERIES_BELOW` it is the series
    x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835) (the next term is under 1e-8 of it)."""
    if dtype_of(x) != "float32":
        return None

    def c(v):
        return tirx.const(v, "float32")

    x2 = x * x
    series = x * (c(1) + x2 * (c(-1 / 3) + x2 * (c(2 / 15) + x2 * (c(-17 / 315)
                                                                  + x2 * c(62 / 2835)))))
    e = tirx.exp(c(-2) * tirx.abs(x))
    ratio = (c(1) - e) / (c(1) + e)
    return tirx.Select(tirx.abs(x) < c(TANH_SERIES_BELOW), series,
                       tirx.Select(x < c(0), -ratio, ratio))


#: The point-wise functions CPU modules compute in rnncc's form (:func:`rnncc.cells.ops.
#: lowered_with`), not TVM's.
FUNCTIONS = {"tanh": tanh}


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
