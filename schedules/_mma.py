"""The operand types of the tensor-core products (``mma.sync``, float32 sums): float16 and
bfloat16 (m16n8k16), and float32 rounded to TF32 (m16n8k8), the last only in a component
that allows it (:data:`TF32_ATTR`, set by the lowering for ``allow_tf32=True``).

Fragments. The GEMM rules give a lane 16 contiguous bytes of an operand's row for two k-steps
(the persistent kernel's stage has an order of its own, :mod:`.persistent.stages.tensor_cores`):
:attr:`Operand.lane_k` elements (8 halves, 4 TF32 values), from ``lane_k * q`` (q = lane %
4) of a block of ``4 * lane_k`` k. k-step s takes the elements ``s * lane_k / 2`` onwards,
which the instruction reads as its k = 2q + {0, 1} and 8 + 2q + {0, 1} (halves) or q and q + 4
(TF32): A and B share that order of k, so the sums are those of the plain order.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from rnncc.dtypes import round_tf32

#: The PrimFunc attribute by which a component allows its float32 products in TF32.
TF32_ATTR = "rnncc.tf32"
#: The PrimFunc attribute that names the operands ("a", "b" or "ab") of a TF32 product whose
#: values its callers have rounded to TF32 already (weights as they are packed, h as the cell
#: step writes it), which the rules then read as they are.
TF32_ROUNDED_ATTR = "rnncc.tf32_rounded"
_PTX = {"float16": "fp16", "bfloat16": "bf16", "float32": "tf32"}


@dataclass(frozen=True)
class Operand:
    """A product's operand type: ``dtype`` its storage ("float32": TF32 values)."""

    dtype: str

    @property
    def ptx(self) -> str:
        return _PTX[self.dtype]

    @property
    def tf32(self) -> bool:
        return self.dtype == "float32"

    @property
    def shape(self) -> str:
        return "m16n8k8" if self.tf32 else "m16n8k16"

    @property
    def lane_k(self) -> int:
        """Elements of a row in a lane's 16 bytes: two k-steps' worth."""
        return 4 if self.tf32 else 8

    @property
    def per_register(self) -> int:
        return 1 if self.tf32 else 2

    def round(self, value):
        """``value`` in this type: a half cast, or float32 rounded to TF32's 10-bit mantissa
        (to nearest, ties away from zero, as ``cvt.rna.tf32.f32``; infinities and NaNs as
        they are)."""
        return round_tf32(value) if self.tf32 else tirx.Cast(self.dtype, value)


#: float32 operands rounded to TF32.
TF32 = Operand("float32")


def operand(weights_dtype: str, func=None) -> Operand | None:
    """The operand type of a product with weights in ``weights_dtype``: a half type as it is;
    float32 as TF32 where ``func`` (the component) allows it; else None."""
    if weights_dtype in ("float16", "bfloat16"):
        return Operand(weights_dtype)
    allowed = func is not None and func.attrs is not None and TF32_ATTR in func.attrs
    return TF32 if weights_dtype == "float32" and allowed else None


@T.macro
def a_fragment(op, af, rows, s):
    """The A registers of k-step ``s`` (0 or 1) from ``rows`` (a lane's 16 bytes of its batch
    rows g and g + 8, ``lane_k`` elements each, row g first)."""
    e, p = T.meta_var((op.lane_k, op.per_register))
    for h in T.unroll(2):  # k low (2q + {0, 1} / q), then high (8 + 2q + {0, 1} / q + 4)
        for r in T.unroll(2):  # rows g, g + 8
            for v in T.vectorized(p):
                af[(h * 2 + r) * p + v] = rows[r * e + s * (e // 2) + h * p + v]


@T.macro
def b_fragment(op, wb, row, offset, s):
    """The B registers of k-step ``s`` from a lane's 16 bytes of its output row in ``row``
    (from ``offset``)."""
    for v in T.vectorized(op.lane_k // 2):
        wb[v] = row[offset + s * (op.lane_k // 2) + v]


@T.macro
def mma(op, af, wb, acc, offset, b_offset=0):
    """acc[offset:offset + 4] += A B (B from ``wb[b_offset]``): one instruction, float32
    sums."""
    T.evaluate(T.ptx_legacy.mma(op.shape, "row", "col", op.ptx, op.ptx, "fp32", af.data, 0,
                                wb.data, b_offset, acc.data, offset, False, dtype="float32"))


def rounded(func) -> str:
    """The operands of component ``func``'s TF32 product already rounded, "", "a", "b" or
    "ab" (:data:`TF32_ROUNDED_ATTR`)."""
    return str(func.attrs[TF32_ROUNDED_ATTR]) if (
        func.attrs is not None and TF32_ROUNDED_ATTR in func.attrs) else ""
