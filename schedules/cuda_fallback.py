"""CUDA: fits any component. Spatial loops to blocks and threads, reductions serial per thread
(dlight's Fallback rule). Correct everywhere, fast nowhere in particular."""

from tvm.s_tir import dlight

from ._rule import Rule

_FALLBACK = dlight.gpu.Fallback()


def apply(func, target):
    return _FALLBACK.apply(func, target, False)


RULE = Rule("cuda.fallback", apply)
