"""CUDA: matrix-vector products (batch 1), through dlight's GEMV rule."""

from tvm.s_tir import dlight

from ._rule import Rule

_GEMV = dlight.gpu.GEMV()


def apply(func, target):
    return _GEMV.apply(func, target, False)


RULE = Rule("cuda.gemv", apply)
