"""Data types a module stores its tensors in, and the type it accumulates in."""

from __future__ import annotations

from .errors import ConfigError

#: Storage dtypes rnncc compiles (float16, bfloat16: half storage, float32 accumulation).
SUPPORTED = ("float32", "float16", "bfloat16")
#: Storage dtypes the design takes next.
PLANNED: tuple[str, ...] = ()


def check_dtype(dtype: str) -> str:
    """``dtype`` if rnncc compiles it, else a ConfigError that lists what is allowed."""
    if dtype in SUPPORTED:
        return dtype
    if dtype in PLANNED:
        raise ConfigError(
            f"dtype {dtype!r} is not supported yet; supported: {', '.join(SUPPORTED)}"
        )
    raise ConfigError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED)}")


def accum_dtype(dtype: str) -> str:
    """The dtype that matrix products and the cell's point-wise step are computed in."""
    return "float32" if dtype in ("float16", "bfloat16", "float32") else dtype


def projection_grad_dtype(dtype: str) -> str:
    """The dtype a training step's backward pass stores the gradients of the projections in
    (dGI, dGH [T, N, G*H]): the storage dtype where it is 16-bit (the tensor-core products that
    read them, dx and the weights' gradients, round their operands to it anyway; half the
    bytes; on CPUs too, so that both agree), else the accumulation dtype."""
    return dtype if dtype in ("float16", "bfloat16") else accum_dtype(dtype)


def round_tf32(value):
    """A float32 TIR expression ``value`` rounded to TF32 (10-bit mantissa), to nearest with
    ties away from zero as ``cvt.rna.tf32.f32`` does; infinities and NaNs as they are. The
    tensor cores' TF32 products read such values (they would otherwise drop the low bits)."""
    from tvm import tirx

    value = tirx.Cast("float32", value)
    bits = tirx.reinterpret("uint32", value)
    rounded = tirx.reinterpret("float32", (bits + tirx.const(0x1000, "uint32"))
                               & tirx.const(0xFFFFE000, "uint32"))
    special = (bits & tirx.const(0x7F800000, "uint32")) == tirx.const(0x7F800000, "uint32")
    return tirx.Select(special, value, rounded)
