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


#: dlight's Matmul keeps a product off tensor cores when a static extent is at most this.
TENSOR_CORE_MIN_EXTENT = 64


def wants_flat_rows(dtype: str, depth: int, outputs: int) -> bool:
    """Whether the input projection of all steps (K ``depth``, O ``outputs``) should reach this
    rule with its rows as one dimension ([T*N, C], not [T, N, C]): dlight's tensor-core path
    takes a float16 product whose rows are one run-time dimension and whose K and O are over
    64, and no (T, N) lead (checked on the generated CUDA, TVM 0.27). float32 stays IEEE, on
    the CUDA cores."""
    return dtype == "float16" and min(depth, outputs) > TENSOR_CORE_MIN_EXTENT


RULE = Rule("cuda.matmul", apply)
