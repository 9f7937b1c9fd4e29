"""The operand types of the tensor-core products (``mma.sync``, float32 sums): float16 and
bfloat16 (m16n8k16), and float32 rounded to TF32 (m16n8k8), the last only in a component
that allows it (:data:`TF32_ATTR`, set by the lowering for ``allow_tf32=True``); and float32
as three TF32 products (:data:`TF32X3`, "3xTF32"), where a rule that knows it takes it in a
component that allows it (:data:`TF32X3_ATTR`, the lowering's option ``tf32x3``): each
operand x is split into big = x rounded to TF32 and small = x - big (which the instruction
reads to TF32, dropping its low bits), and A B is A_small B_big + A_big B_small + A_big
B_big in float32 sums; what is left out (A_small B_small, small's dropped bits) is below
2^-21 of each product, so the sums' error is that of IEEE float32's FMAs (CUTLASS's
"3xTF32"; float64 references in tests/test_gpu.py).

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
#: The PrimFunc attribute by which a component allows its float32 products as three TF32
#: products (:data:`TF32X3`).
TF32X3_ATTR = "rnncc.tf32x3"
#: The PrimFunc attribute that names the operands ("a", "b" or "ab") of a TF32 product whose
#: values its callers have rounded to TF32 already (weights as they are packed, h as the cell
#: step writes it), which the rules then read as they are.
TF32_ROUNDED_ATTR = "rnncc.tf32_rounded"
_PTX = {"float16": "fp16", "bfloat16": "bf16", "float32": "tf32"}


@dataclass(frozen=True)
class Operand:
    """A product's operand type: ``dtype`` its storage ("float32": TF32 values); ``split``:
    float32 values as two TF32 values each, three products (3xTF32)."""

    dtype: str
    split: bool = False

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
        they are); split float32 as it is."""
        if self.split:
            return value  # split as a lane reads it
        return round_tf32(value) if self.tf32 else tirx.Cast(self.dtype, value)


#: float32 operands rounded to TF32.
TF32 = Operand("float32")
#: float32 operands as three TF32 products.
TF32X3 = Operand("float32", split=True)


def _has(func, attr: str) -> bool:
    return func is not None and func.attrs is not None and attr in func.attrs


def operand(weights_dtype: str, func=None, split: bool = False) -> Operand | None:
    """The operand type of a product with weights in ``weights_dtype``: a half type as it is;
    float32 as TF32 where ``func`` (the component) allows it, else as TF32X3 where it allows
    that and the caller (``split``) computes it; else None."""
    if weights_dtype in ("float16", "bfloat16"):
        return Operand(weights_dtype)
    if weights_dtype != "float32":
        return None
    if _has(func, TF32_ATTR):
        return TF32
    return TF32X3 if split and _has(func, TF32X3_ATTR) else None


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


def split_tf32(value):
    """The TF32 part ``big`` of a float32 TIR expression: ``value`` to nearest (ties away from
    zero) with the low 13 bits cleared, as :func:`rnncc.dtypes.round_tf32` without its care
    for infinities and NaNs (three instructions fewer a value, on the split's hot path);
    ``value - big`` is exact. NaNs stay NaN; an
    infinity's small part is NaN (inf - inf), so a product with one is NaN where IEEE
    float32's is infinite (the option says so)."""
    bits = tirx.reinterpret("uint32", value)
    return tirx.reinterpret("float32", (bits + tirx.const(0x1000, "uint32"))
                            & tirx.const(0xFFFFE000, "uint32"))


@T.macro
def split(values, small, count):
    """values[:count] (float32) -> their TF32 parts, in place, and small[:count] the rest."""
    for v in T.unroll(count):
        small[v] = values[v]
        values[v] = split_tf32(small[v])
        small[v] = small[v] - values[v]


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
