"""Loads of weights that stream from memory every step: 16 bytes a lane, past L1, and where the
weights are larger than L2 holds, with an L2 eviction policy that keeps a fixed part of them
resident from one step to the next.

A product that reads W [O, K] once a step, W larger than L2 (50 MiB on an H100/H200), reads it
all from HBM every step under L2's replacement: each step's reads evict what the next step
reads first. ``createpolicy.fractional.L2::evict_last.L2::evict_first`` marks a fraction of
the lines (the hardware chooses which) evict-last and the rest evict-first, so the evict-last
part stays in L2 while the rest streams through it. H200, 200 passes of a kernel
that reads all of W in 16-byte loads (``benchmarks/l2_policy.cu``, no other work), us a pass,
plain -> the best fraction: 40 MiB 7.89 -> 7.58 (0.7), 50 MiB 13.95 -> 9.39 (0.7), 64 MiB 18.99
-> 12.13 (0.5), 100 MiB 27.52 -> 21.60 (0.3): best where the kept part is about
:data:`KEEP_BYTES`; keeping 45-50 MiB was as slow as plain. 24 and 32 MiB: the same (L2 holds
them anyway).
"""

from __future__ import annotations

from tvm import tirx

#: Bytes of W kept in L2 from step to step, and the smallest W that is worth a policy.
KEEP_BYTES = 30 << 20
MIN_BYTES = 40 << 20

#: The device functions that load a lane's 4 floats of W (:func:`load`): past L1
#: (``ld.global.nc.L1::no_allocate``: W is read once a step, and through L1 it would evict what
#: every warp reads again, h), the same with the L2 policy that keeps the fraction ``keep`` of
#: W's lines, and through L1 with that policy (where h is small enough that W does not evict it).
STREAM, STREAM_KEEP, KEEP = "rnncc_ld_stream4", "rnncc_ld_stream4_keep", "rnncc_ld4_keep"
_POLICY = """  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.L2::evict_first.b64 %0, %1;"
      : "=l"(policy) : "f"(keep));
"""


def load(past_l1: bool, keep: float | None) -> tuple[str, str, tuple]:
    """The device function that loads a lane's 4 floats of W past L1 or through it (then with
    a policy: ``keep`` not None), with the L2 policy that keeps the fraction ``keep`` of W's
    lines or none: (its name, its source, its arguments after dst and src)."""
    name = {(True, False): STREAM, (True, True): STREAM_KEEP, (False, True): KEEP}[
        (past_l1, keep is not None)]
    l1 = ".L1::no_allocate" if past_l1 else ""
    param, setup, hint, operand, argument = (
        (", float keep", _POLICY, ".L2::cache_hint", ", %5", ', "l"(policy)') if keep is not None
        else ("", "", "", "", ""))
    source = f"""
__device__ __forceinline__ void {name}(float* dst, const float* src{param}) {{
{setup}  float4 v;
  asm("ld.global.nc{l1}{hint}.v4.f32 {{%0, %1, %2, %3}}, [%4]{operand};"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src){argument});
  dst[0] = v.x;
  dst[1] = v.y;
  dst[2] = v.z;
  dst[3] = v.w;
}}
"""
    return name, source, () if keep is None else (tirx.const(keep, "float32"),)


def keep_fraction(w_bytes: int, target) -> float | None:
    """The fraction of W's lines kept in L2 for W of ``w_bytes`` bytes read once a step
    (:data:`KEEP_BYTES` of them), or None where W is under :data:`MIN_BYTES` or ``target`` is
    not Hopper (sm_90: the 50 MiB of L2 these sizes are for; elsewhere not measured, and where
    L2 is larger, as on sm_100, the policy would evict what fits)."""
    if w_bytes < MIN_BYTES or str(target.attrs.get("arch", "")) not in ("sm_90", "sm_90a"):
        return None
    return min(1.0, round(KEEP_BYTES / w_bytes, 3))
