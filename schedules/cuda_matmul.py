"""CUDA: tiled matrix products (shared-memory tiles, register blocking), through dlight's
Matmul rule; it takes a run-time T in the rows (the input projection of all steps).

For float16 storage dlight tries tensor cores (wmma, float32 accumulation) first; where that
path refuses a component (it does for some shapes with the bias epilogue), this rule schedules
the same product on the CUDA cores instead of giving up, so large half GEMMs never reach the
one-thread-an-output fallback.
"""

from tvm.s_tir import dlight

from ._rule import Rule

_MATMUL = dlight.gpu.Matmul()
NO_TENSOR_CORES = "dlight.do_not_tensorize"


def apply(func, target):
    try:
        return _MATMUL.apply(func, target, False)
    except Exception:  # noqa: BLE001 - dlight's tensor-core path refused; retry without it
        if func.attrs is not None and NO_TENSOR_CORES in func.attrs:
            raise
        return _MATMUL.apply(func.with_attr(NO_TENSOR_CORES, True), target, False)


RULE = Rule("cuda.matmul", apply)
