"""Persistent-weight CUDA kernels: the recurrent weights stay on-chip for the whole sequence.

``planner`` decides from the cell, the sizes, the dtype and the GPU whether the weights fit in
the registers and shared memory of one block a multiprocessor, and picks the grid and the
split (``knobs``: the same under tuning knobs, with the input projection and the products
decided in turn); ``kernel`` composes the kernel that loops over time from the stages in
``stages`` (cooperative, unless each batch group is one block). The input projection of all
steps runs first, as one GEMM (the non-persistent schedule's stage), or inside the kernel:
before its time loop, or overlapped with it (planner: "Fused input projection").
"""

from . import knobs
from .planner import GPU, Plan, Unfit, fuse_input, gpu_for_arch, overlap_input, plan

__all__ = ["GPU", "Plan", "Unfit", "fuse_input", "gpu_for_arch", "knobs", "overlap_input", "plan"]
