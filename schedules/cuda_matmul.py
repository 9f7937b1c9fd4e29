"""CUDA: tiled matrix products (shared-memory tiles, register blocking), through dlight's
Matmul rule; it takes a run-time T in the rows (the input projection of all steps)."""

from tvm.s_tir import dlight

from ._rule import Rule

_MATMUL = dlight.gpu.Matmul()


def apply(func, target):
    return _MATMUL.apply(func, target, False)


RULE = Rule("cuda.matmul", apply)
