"""CUDA: matrix-vector products (batch 1), through dlight's GEMV rule: those
:mod:`.cuda_small_batch_gemv` declines (K not a multiple of 32).

dlight stages the vector through shared memory in vectors of up to 8 elements (32 bytes of
float32, at K a multiple of 4096); CUDA has no such type, and TVM 0.27's code generator fails
on the store ("Check failed: !type_name.empty()", LSTM 4096 at batch 1). Such loops are split
here into vectors of 16 bytes.
"""

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight

from ._rule import Rule

_GEMV = dlight.gpu.GEMV()
#: The widest vector CUDA loads and stores (float4).
MAX_VECTOR_BYTES = 16


def apply(func, target):
    sch = _GEMV.apply(func, target, False)
    if sch is None:
        return None
    names = []
    tvm_ffi.structural_walk(sch.mod["main"].body,
                            (s_tir.SBlock, lambda block: names.append(block.name_hint)))
    for name in [n for n in dict.fromkeys(names) if names.count(n) == 1]:  # twice: not a load
        block = sch.get_sblock(name)
        loops, writes = sch.get_loops(block), sch.get(block).writes
        if not loops or len(writes) != 1:
            continue
        loop = sch.get(loops[-1])
        lanes = MAX_VECTOR_BYTES * 8 // tvm_ffi.dtype(writes[0].source.dtype).bits
        if (loop.kind == tirx.ForKind.VECTORIZED and hasattr(loop.extent, "value")
                and int(loop.extent.value) > lanes):
            sch.vectorize(sch.split(loops[-1], [None, lanes])[1])
    return sch


RULE = Rule("cuda.gemv", apply)
