"""rnncc's TIR pipeline: TVM's default s_tir pipeline, plus cooperative launch for kernels that
synchronise the whole grid, and programmatic dependent launch for the others (sm_90 on).

A persistent kernel waits at a grid-wide barrier every step, which is only safe when every
block of the grid is resident at once: a cooperative launch guarantees that, and the driver
refuses one that cannot be (instead of the barrier hanging). TVM 0.27 takes the launch mode
from the device kernel's ``tirx.kernel_launch_params`` attribute, but does not carry a
PrimFunc attribute there, so the device-finalize step of this pipeline adds the tag to every
kernel that calls a grid barrier (TVM's ``T.cuda.grid_sync`` or rnncc's own flag barrier).
Every other kernel of an sm_90 build is tagged for programmatic dependent launch and waits for
the kernel ahead of it as its first act (:func:`dependent_launch`): a step's kernels launch
while the one before them drains.

CUDA builds also run with :data:`CONFIG`, which turns TVM's elimination of common
subexpressions off: it runs before the kernels are split from the host function, so an offset
that two kernels share (step t's h, ``h_ws[t % 2]``, read by the step's product and by its cell
step) became one host variable passed to both, and a kernel could no longer prove that its
16-byte loads of that buffer are aligned: each became four scalar loads (the step products of
LSTM 1024 at batch 256 read h so; H200, a step 114.0 -> 107.5 us). CUDA's compiler eliminates
common subexpressions itself.

CPU builds compute float32 tanh with :func:`accurate_tanh`: TVM's LLVM form, (1 - e^-2|x|) /
(1 + e^-2|x|), loses the relative precision of small arguments (1e-5 off at |x| = 5e-4, 14%
at 1e-7; a projected LSTMP output of -2.8e-4 came out 1.3e-5 off), then float32 exp, sigmoid
and tanh in arithmetic with :func:`arithmetic_exp`: LLVM called libm's scalar ``expf`` for each
lane of TVM's forms (this machine's EPYC, one thread, rnncc.nn.LSTM 128 at batch 64, T = 100:
510-712 -> 317-496 us a step, torch 214-278). These are the only places rnncc changes TVM's
pipeline.
"""

from __future__ import annotations

import tvm
import tvm_ffi

NAME = "rnncc"
COOPERATIVE = "tirx.use_cooperative_launch"
DYN_SHARED = "tirx.use_dyn_shared_memory"
#: The PassContext configuration of CUDA builds.
CONFIG = {"tirx.disable_cse_tir": True}


def _waits(func) -> str | None:
    """How ``func`` waits on other blocks: "grid" where it calls TVM's grid sync or one of
    rnncc's device functions that do (:data:`rnncc.schedules.persistent.device.
    COOPERATIVE_PREFIX`), "cluster" where it puts h into its cluster's blocks
    (:data:`~rnncc.schedules.persistent.device.CLUSTER_PUT`), else None."""
    from ..schedules.persistent.device import CLUSTER_PUT, COOPERATIVE_PREFIX

    grid_sync = tvm.ir.Op.get("tirx.cuda.grid_sync")
    func_call = tvm.ir.Op.get("tirx.cuda.func_call")
    found = set()

    def visit(call):
        if call.op.same_as(grid_sync):
            found.add("grid")
        elif call.op.same_as(func_call) and call.args:
            name = str(call.args[0].value)
            if name.startswith(COOPERATIVE_PREFIX):
                found.add("grid")
            elif name == CLUSTER_PUT:
                found.add("cluster")

    tvm_ffi.structural_walk(func.body, (tvm.ir.Call, visit))
    return "grid" if "grid" in found else "cluster" if found else None


@tvm.transform.module_pass(opt_level=0, name="rnncc.CooperativeLaunch")
def cooperative_launch(mod, _ctx):
    """Tag kernels that use a grid barrier for cooperative launch, with one block a
    multiprocessor as their launch bounds' minimum (``__launch_bounds__(threads, 1)``; that
    bound alone for a persistent kernel of clusters, resident as clusters): such a kernel runs
    one block a multiprocessor, and without the bound ptxas may keep registers
    free for an occupancy it never has, spilling to do so (seen on a 512-thread LSTM kernel:
    40 registers and 12 bytes spilled, against 69 registers and none with it)."""
    from ..schedules._common import LAUNCH_BOUNDS

    updates = {}
    for gvar, func in mod.functions_items():
        params = func.attrs.get("tirx.kernel_launch_params") if func.attrs else None
        waits = None if params is None else _waits(func)
        if waits == "cluster":  # a persistent kernel of clusters
            updates[gvar] = func.with_attr(LAUNCH_BOUNDS, 1)
        if waits != "grid":
            continue
        tags = [str(p) for p in params]
        if COOPERATIVE in tags:
            continue
        at = tags.index(DYN_SHARED) if DYN_SHARED in tags else len(tags)
        tags.insert(at, COOPERATIVE)
        updates[gvar] = func.with_attr("tirx.kernel_launch_params", tags).with_attr(
            LAUNCH_BOUNDS, 1)
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


#: TVM's launch tag (its spelling) for programmatic dependent launch (sm_90 on): the driver
#: may launch a kernel before the one ahead of it in the stream has finished.
DEPENDENT = "tirx.use_programtic_dependent_launch"
DEPENDENT_WAIT = "rnncc_dependent_wait"
#: A dependent kernel's first act: wait until the kernel ahead of it has finished and its
#: writes are visible (at once where launched without the tag). No kernel lets the next one
#: launch early (``griddepcontrol.launch_dependents``): at their start, the cell steps' and
#: elementwise kernels' triggers made one step's products 10-30% slower (their blocks, placed
#: while the cell step ran, waited beside it), H200, 2026-11-29.
DEPENDENT_SOURCE = f"""
__device__ __forceinline__ void {DEPENDENT_WAIT}() {{
  asm volatile("griddepcontrol.wait;" ::: "memory");
}}
"""
#: The first architecture with programmatic dependent launch (``griddepcontrol``).
DEPENDENT_MIN_ARCH = 90


def _first_in_kernel(body, stmt):
    """``body`` with ``stmt`` first inside its leading thread bindings."""
    if isinstance(body, tvm.tirx.AttrStmt) and body.attr_key == "thread_extent":
        return tvm.tirx.AttrStmt(body.node, body.attr_key, body.value,
                                 _first_in_kernel(body.body, stmt))
    return tvm.tirx.SeqStmt([stmt, body])


@tvm.transform.module_pass(opt_level=0, name="rnncc.DependentLaunch")
def dependent_launch(mod, _ctx):
    """Tag the kernels that wait on no other block (all but the cooperative ones) for
    programmatic dependent launch where the architecture has it, each starting with
    :data:`DEPENDENT_WAIT`: the driver's launch of a step's kernel (the product, the cell step)
    then overlaps the end of the kernel before it. H200, T = 100, us a step, without / with:
    TF32 LSTM 512 N256 12.46 / 11.23, GRU 2048 N64 34.07 / 33.71, float16 LSTM 1024 N128 12.21
    / 11.70, float32 LSTM 1024 N64 33.87 / 32.86, LSTM 512/1024 N32 20.75 / 20.10 (1.00-1.11x
    on 13 layers, docs/benchmarks.md). A cooperative kernel is launched without the tag, after
    the kernel before it has finished."""
    from tvm.backend.cuda.op import cuda_func_call

    from ..schedules._common import sm_at_least

    updates = {}
    for gvar, func in mod.functions_items():
        params = func.attrs.get("tirx.kernel_launch_params") if func.attrs else None
        if params is None or not sm_at_least(func.attrs["target"], DEPENDENT_MIN_ARCH):
            continue
        tags = [str(p) for p in params]
        if DEPENDENT in tags or COOPERATIVE in tags:  # (cooperative_launch runs before)
            continue
        at = tags.index(DYN_SHARED) if DYN_SHARED in tags else len(tags)
        tags.insert(at, DEPENDENT)
        wait = tvm.tirx.Evaluate(cuda_func_call(DEPENDENT_WAIT, source_code=DEPENDENT_SOURCE))
        updates[gvar] = func.with_attr("tirx.kernel_launch_params", tags).with_body(
            _first_in_kernel(func.body, wait))
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


#: Below it, float32 tanh is its odd series x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835),
#: whose first term left out (1382 x^11 / 155925) is under 1e-8 of tanh there; above it, TVM's
#: form is within 2e-7.
TANH_SERIES_BELOW = 0.25
_TANH_TERMS = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835)
_TANH = tvm.ir.Op.get("tirx.tanh")


def _const(value, lanes: int, dtype: str = "float32"):
    """A constant of ``dtype``, broadcast to ``lanes`` lanes where there are several."""
    scalar = tvm.tirx.const(value, dtype)
    return scalar if lanes == 1 else tvm.tirx.Broadcast(scalar, lanes)


def _float32_lanes(call) -> int:
    """The lanes of a float32 call's value, or 0 for another dtype."""
    dtype = tvm.DataType(str(call.ty.dtype))
    return dtype.lanes if dtype.bits == 32 and dtype.type_code == tvm.DataTypeCode.FLOAT else 0


def _accurate_tanh(call):
    """A float32 ``tanh(x)`` (scalar or vector) as ``let v = x in select(|v| < 0.25,
    series(v), tanh(v))``: x bound once, a new variable at every occurrence; other calls as
    they are."""
    if not call.op.same_as(_TANH):
        return call
    lanes = _float32_lanes(call)
    if not lanes:
        return call
    v = tvm.tirx.Var("tanh_x", str(call.ty.dtype))
    x2, poly = v * v, _const(_TANH_TERMS[-1], lanes)
    for term in reversed(_TANH_TERMS[:-1]):
        poly = poly * x2 + _const(term, lanes)
    near_zero = tvm.tirx.abs(v) < _const(TANH_SERIES_BELOW, lanes)
    return tvm.tirx.Let(v, call.args[0], tvm.tirx.Select(near_zero, v * poly, tvm.tirx.tanh(v)))


def _map_calls(mod, rewrite):
    """``mod`` with every PrimFunc's calls mapped by ``rewrite`` (a call -> its replacement)."""
    updates = {gvar: func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.Call, rewrite)))
               for gvar, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


@tvm.transform.module_pass(opt_level=0, name="rnncc.AccurateTanh")
def accurate_tanh(mod, _ctx):
    """Every PrimFunc's float32 tanh accurate near zero (CPU builds; after TVM's passes that
    copy or vectorize loop bodies, which refuse a variable bound in two places)."""
    return _map_calls(mod, _accurate_tanh)


#: float32 e^x in arithmetic (Cephes' expf): x clamped to the floats' range, x = n ln 2 + r
#: with |r| <= ln 2 / 2 (ln 2 in two parts, exact products), e^r by its polynomial, 2^n as
#: 2^(n >> 1) 2^(n - (n >> 1)) from exponent bits (n from -150, where e^x rounds to 0, to 128);
#: within 2 ulp of e^x.
_EXP_RANGE = (-103.97207708399179, 88.72283905206835)
_LN2_PARTS = (0.693359375, -2.12194440e-4)
_EXP_TERMS = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
              1.6666665459e-1, 5.0000001201e-1)
_EXP, _SIGMOID = tvm.ir.Op.get("tirx.exp"), tvm.ir.Op.get("tirx.sigmoid")


def _vector_exp(x, lanes: int):
    """e^x of a float32 PrimExpr of ``lanes`` lanes in arithmetic that LLVM vectorises; NaN
    stays NaN. Its subexpressions (x among them) recur in the tree, unbound: a variable bound
    there met TVM's rebinding of the variables around it, and LLVM merges the repeats."""
    tirx = tvm.tirx
    dtype, ints = ("float32", "int32") if lanes == 1 else (f"float32x{lanes}", f"int32x{lanes}")
    clamped = tirx.max(tirx.min(x, _const(_EXP_RANGE[1], lanes)), _const(_EXP_RANGE[0], lanes))
    n = tirx.floor(clamped * _const(1.4426950408889634, lanes) + _const(0.5, lanes))
    r = clamped - n * _const(_LN2_PARTS[0], lanes) - n * _const(_LN2_PARTS[1], lanes)
    poly = _const(_EXP_TERMS[0], lanes)
    for term in _EXP_TERMS[1:]:
        poly = poly * r + _const(term, lanes)
    whole = tirx.Cast(ints, n)
    half = tirx.shift_right(whole, _const(1, lanes, "int32"))

    def power_of_two(exponent):  # 2^exponent, exponent within -126 .. 127
        biased = exponent + _const(127, lanes, "int32")
        return tirx.reinterpret(dtype, tirx.shift_left(biased, _const(23, lanes, "int32")))

    value = ((poly * r * r + r + _const(1.0, lanes)) * power_of_two(half)
             * power_of_two(whole - half))
    # NaN by its bits: LLVM may take x != x for false (TVM's CPU builds allow fast math)
    bits = tirx.reinterpret(ints, x)
    nan = tirx.bitwise_and(bits, _const(0x7FFFFFFF, lanes, "int32")) > _const(0x7F800000, lanes,
                                                                                "int32")
    return tirx.Select(nan, x, value)


def _arithmetic_exp(call):
    """A float32 ``exp``, ``sigmoid`` or ``tanh`` call (scalar or vector) in arithmetic on
    :func:`_vector_exp`; other calls as they are."""
    if not any(call.op.same_as(op) for op in (_EXP, _SIGMOID, _TANH)):
        return call
    lanes = _float32_lanes(call)
    if not lanes:
        return call
    x, one = call.args[0], _const(1.0, lanes)
    if call.op.same_as(_EXP):
        return _vector_exp(x, lanes)
    if call.op.same_as(_SIGMOID):
        return one / (one + _vector_exp(-x, lanes))
    # sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), TVM's LLVM form
    e = _vector_exp(tvm.tirx.abs(x) * _const(-2.0, lanes), lanes)
    magnitude = (one - e) / (one + e)
    return tvm.tirx.Select(x < _const(0.0, lanes), -magnitude, magnitude)


@tvm.transform.module_pass(opt_level=0, name="rnncc.ArithmeticExp")
def arithmetic_exp(mod, _ctx):
    """Every PrimFunc's float32 exp, sigmoid and tanh in arithmetic (CPU builds, after
    :func:`accurate_tanh`): LLVM calls libm's scalar expf for each lane of TVM's forms."""
    return _map_calls(mod, _arithmetic_exp)


def _cpu_factory():
    import tvm.s_tir.pipeline  # noqa: F401 - registers the s_tir pipeline

    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")
    return (tvm.ir.transform.Sequential([pipeline, accurate_tanh, arithmetic_exp]),
            finalize_host, finalize_device)


def _factory():
    import tvm.s_tir.pipeline  # noqa: F401 - registers the s_tir pipeline

    pipeline, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("s_tir")

    def finalize():
        return tvm.ir.transform.Sequential([finalize_device(), cooperative_launch,
                                              dependent_launch])

    return pipeline, finalize_host, finalize


def register(kind: str = "cuda") -> str:
    """Register the pipeline of a target kind, "cuda" or "llvm" (idempotent), and return its
    name for ``tvm.compile``."""
    from tvm.tirx.compilation_pipeline import PIPELINE_MAP, register_tir_pipeline

    name, factory = (NAME, _factory) if kind == "cuda" else (NAME + "_cpu", _cpu_factory)
    if name not in PIPELINE_MAP:
        register_tir_pipeline(name, factory)
    return name
