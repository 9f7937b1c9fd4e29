"""rnncc's scheduling layer: one schedule rule a file.

A rule has the contract ``apply(func, target) -> tvm.s_tir.Schedule | None``: None means the
rule does not fit that PrimFunc. For each component role ("gemm", "elementwise", "reduction":
the sums over all steps of the backward pass) and target
kind ("cuda", "llvm") rules are tried in order; the last one of each list always fits, so a
component that no better rule takes still compiles, and :func:`schedule` reports which rule
scheduled it and why earlier ones did not.

The persistent whole-sequence kernel (:mod:`rnncc.schedules.persistent`) is not a rule on one
component: it replaces the assembled sequence where its planner says it fits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from . import (
    cpu_elementwise,
    cpu_gemm,
    cuda_column_sum,
    cuda_elementwise,
    cuda_fallback,
    cuda_gemm_simple,
    cuda_matmul,
    cuda_mma_gemm,
    cuda_mma_gemv,
    cuda_mma_stream_gemv,
    cuda_row_means,
    cuda_sgemm,
    cuda_small_batch_gemv,
    cuda_tiled_gemm,
    cuda_weight_grad,
    cuda_wgmma_gemm,
    tuned,
)
from . import cuda_wgmma_step as cuda_wgmma_step  # the lowering's: one step as one kernel
from ._common import has_mma as has_mma  # the lowering's: whether tensor cores take products
from ._common import has_wgmma as has_wgmma  # and whether they take 16-bit operands MN-major
from ._common import slice_depth as slice_depth  # the lowering's: one step's slices of K
from ._mma import TF32 as TF32  # the lowering's: which products may run in TF32
from ._mma import TF32_ATTR as TF32_ATTR
from ._mma import TF32_ROUNDED_ATTR as TF32_ROUNDED_ATTR
from ._mma import TF32X3_ATTR as TF32X3_ATTR
from ._rule import Rule
from ._script import install as _install_fast_macros

_install_fast_macros()

#: Rules by (target kind, role), best first; the last of each list fits every component.
RULES: dict[tuple[str, str], list[Rule]] = {
    ("cuda", "gemm"): [cuda_wgmma_gemm.RULE, cuda_mma_gemm.RULE, cuda_mma_stream_gemv.RULE,
                       cuda_mma_gemv.RULE, cuda_small_batch_gemv.RULE, cuda_sgemm.RULE,
                       cuda_tiled_gemm.RULE, cuda_matmul.RULE, cuda_gemm_simple.RULE],
    ("cuda", "elementwise"): [cuda_elementwise.RULE, cuda_row_means.RULE, cuda_fallback.RULE],
    ("cuda", "reduction"): [cuda_wgmma_gemm.RULE, cuda_mma_gemm.RULE, cuda_weight_grad.RULE,
                           cuda_column_sum.RULE, cuda_matmul.RULE, cuda_fallback.RULE],
    ("llvm", "gemm"): [cpu_gemm.RULE, cpu_elementwise.SERIAL],
    ("llvm", "elementwise"): [cpu_elementwise.RULE, cpu_elementwise.SERIAL],
    ("llvm", "reduction"): [cpu_elementwise.SERIAL],
}

#: The rules whose products run on tensor cores (the others' on the CUDA cores), and the fused
#: step's (:mod:`.cuda_wgmma_step`).
TENSOR_CORE_RULES = frozenset(rule.name for rule in (
    cuda_wgmma_gemm.RULE, cuda_mma_gemm.RULE, cuda_mma_stream_gemv.RULE, cuda_mma_gemv.RULE)) | {
    "cuda.wgmma_step"}


def product_parts(func, target) -> int:
    """The slices of K that the tensor-core rules split the one-step product of gemm component
    ``func`` into on ``target``, for a reader that adds them itself (rnncc's gemm_parts
    component in as many slices); 1 where they take it whole or not at all."""
    return cuda_wgmma_gemm.parts(func, target)


@dataclass
class Scheduled:
    """A scheduled component, the rule that scheduled it and what the rules before it said."""

    func: object
    rule: str
    notes: list[str] = field(default_factory=list)


def schedule(func, target, role: str, database=None) -> Scheduled:
    """Schedule ``func`` (a component PrimFunc) for ``target`` with the first rule that fits.

    ``database``: a MetaSchedule database (a tuning log's); its record for the component, if it
    has one, comes before every rule. A rule that raises is skipped with a warning naming it;
    the fallback rules never raise.
    """
    kind = target.kind.name
    if (kind, role) not in RULES:
        raise ValueError(f"no schedule rules for target {kind!r} and role {role!r}")
    notes = []
    rules = RULES[(kind, role)]
    if database is not None:
        rules = [tuned.rule(database), *rules]
    for rule in rules:
        try:
            sch = rule.apply(func, target)
        except Exception as err:  # noqa: BLE001 - a failing rule falls back, and says so
            note = f"{rule.name} failed ({type(err).__name__}: {str(err).splitlines()[-1]})"
            warnings.warn(f"rnncc: schedule rule {note}; trying the next rule", stacklevel=2)
            notes.append(note)
            continue
        if sch is None:
            if database is None or rule is not rules[0]:  # no record is not news
                notes.append(f"{rule.name} does not apply")
            continue
        return Scheduled(sch.mod["main"], rule.name, notes)
    raise RuntimeError(f"no rule scheduled the component ({'; '.join(notes)})")
