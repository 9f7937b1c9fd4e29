"""Schedule rules, checked on the scheduled TIR (no GPU needed)."""

import re
import warnings
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import s_tir, tirx

import rnncc
from helpers import (
    TOL,
    TOL_F32,
    TOL_TF32,
    check_against_reference,
    round_tf32,
    takes_means,
    truncate_tf32,
)
from rnncc import schedules
from rnncc.compiler.cuda_binary import kernel_bodies
from rnncc.lowering import components as comp
from rnncc.lowering import sequence
from rnncc.lowering.training import kept_parts
from rnncc.schedules._rule import Rule
from rnncc.spec import Options, Problem
from rnncc.target import TargetSpec

CUDA = TargetSpec("cuda").tvm_target()
AMPERE = TargetSpec("cuda", arch="sm_80").tvm_target()  # tensor cores, no warpgroup MMA
LLVM = TargetSpec("llvm").tvm_target()


def loops(func):
    """(kind, thread tag) of every loop of a PrimFunc."""
    found = []

    def visit(node):
        binding = node.thread_binding
        found.append((int(node.kind), binding.thread_tag if binding is not None else None))

    tvm_ffi.structural_walk(func.body, (tirx.For, visit))
    return found


def thread_tags(func):
    return {tag for _, tag in loops(func) if tag}


@pytest.mark.parametrize("cell", rnncc.cells.names())
def test_cuda_cell_step_is_one_coalesced_kernel(cell):
    step = comp.cell_step(rnncc.cells.get(cell), 3, 257, "float32", "combined", fused=True)
    result = schedules.schedule(step, CUDA, "elementwise")
    # one loop nest: blockIdx.x over threadIdx.x, each thread one (n, j) element; a step that
    # takes means over the units: a block a batch row, its threads over the units (a recurrent
    # product of a step value is a GEMM of its own)
    assert result.rule == ("cuda.row_means" if takes_means(cell) else "cuda.elementwise")
    assert thread_tags(result.func) == {"blockIdx.x", "threadIdx.x"}
    script = result.func.script()
    assert script.count('thread="blockIdx.x"') == 1


def _written(func) -> set:
    """The names of the buffers ``func`` stores to."""
    found = set()
    tvm_ffi.structural_walk(func.body, (tirx.BufferStore, lambda s: found.add(s.buffer.name)))
    return found


#: The rule of each component this process has checked, by its structure and its kernel's,
#: its parameters and the bound: one that recurs (both directions' products, the packings
#: every cell shares) is simulated once.
_CHECKED: dict = {}


def _simulated_against_cpu_build(func, role, rng, tol=1e-6) -> str:
    """Component ``func`` as the CUDA rules of ``role`` schedule it, on the NumPy interpreter
    of TIR, against the same component built for the CPU (whose modules the float64 suite
    checks), on random inputs (run-time sizes 5: T; ``lengths`` 1 to T, ``ends`` their sums,
    other integers 0 or 1), its outputs poisoned, within ``tol`` of the largest value; the
    rule that scheduled it. A product that takes the lengths may leave the rows past them
    unwritten: those are not compared."""
    from tir_sim import Simulator, lowered

    scheduled = schedules.schedule(func, CUDA, role)
    key = (tvm_ffi.structural_hash(func), tvm_ffi.structural_hash(scheduled.func),
           tuple(p.name for p in func.params), tol)
    if key in _CHECKED:
        return _CHECKED[key]
    args, named = [], {}
    for param in func.params:
        shape = [5 if isinstance(d, tirx.Var) else int(d) for d in param.ty.shape]
        dtype = str(param.ty.dtype)
        if "float" in dtype:
            value = rng.standard_normal(shape)
        elif param.name == "lengths":
            value = rng.integers(1, 6, shape)
        elif param.name == "ends":
            value = np.cumsum(named["lengths"])
        else:
            value = rng.integers(0, 2, shape)
        args.append(value.astype(dtype))
        named[param.name] = args[-1]
    outputs = [i for i, p in enumerate(func.params) if p.name in _written(func)]
    for i in outputs:
        args[i][...] = np.nan if "float" in str(args[i].dtype) else -7
    cpu = [tvm.runtime.tensor(a, tvm.cpu()) for a in args]
    tvm.compile(func, target="llvm")(*cpu)
    kernel = lowered(tvm.IRModule({"main": scheduled.func}))  # (a rule may rename them)
    Simulator(kernel, dict(zip((p.name for p in kernel.params), args))).run()
    for i in outputs:
        got, want = args[i], cpu[i].numpy()
        if role == "gemm" and "lengths" in named:  # [T, N, O]: the rows within the lengths
            within = np.arange(got.shape[0])[:, None] < named["lengths"][None, :]
            got, want = got[within], want[within]
        assert not np.isnan(got).any(), func.params[i].name
        scale = max(1.0, np.abs(want).max())
        assert np.abs(got - want).max() <= tol * scale, (scheduled.rule, func.params[i].name)
    _CHECKED[key] = scheduled.rule
    return scheduled.rule


@pytest.mark.parametrize("cell", rnncc.cells.names())
def test_cuda_cell_steps_match_the_cpu_build_on_the_simulator(cell, rng):
    """A cell's step and its derivative (training's, of the kept projections), unmasked and
    masked by lengths, as the CUDA elementwise rules schedule them."""
    found = rnncc.cells.get(cell)
    for func in [comp.cell_step(found, 3, 33, "float32", "combined", fused=True),
                 comp.cell_step(found, 3, 33, "float32", "combined", fused=True, masked=True,
                                selects=True),
                 comp.cell_step_backward(found, 3, 33, "float32", kept_parts(found),
                                         selects=True),
                 comp.cell_step_backward(found, 3, 33, "float32", kept_parts(found),
                                         masked=True, selects=True)]:
        _simulated_against_cpu_build(func, "elementwise", rng)


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("cell", rnncc.cells.names())
def test_cuda_sequence_components_match_the_cpu_build_on_the_simulator(cell, every, rng):
    """Every component of the non-persistent CUDA schedule (packing, the products, the cell
    step, the states' copies; with ``every``, both directions' reversals, by the samples'
    lengths too, and the products of the rows within them; training's kept parts, backward
    step, transposes and gradients: the slow run), as the CUDA rules schedule it, against
    its CPU build."""
    found = rnncc.cells.get(cell)
    problems = [Problem(found, 20, 33, 3)]
    if every:
        problems += [Problem(found, 20, 33, 3, directions=2),
                     Problem(found, 20, 33, 3, training=True),
                     Problem(found, 20, 33, 3, lengths=True, directions=2)]
    for problem in problems:
        lowered = sequence.build(problem, Options(persistent="off"), CUDA)
        for key, (func, role) in lowered.components.items():
            assert _simulated_against_cpu_build(func, role, rng) == lowered.rules[key], key


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_tensor_core_components_match_the_cpu_build_on_the_simulator(cell, dtype, rng):
    """The same in 16 bits and in TF32: at batch 3 (CUDA cores), 16 and 40 (tensor cores:
    each step's product by mma.sync, all steps' by Hopper's warpgroup MMA). The products round
    their operands (h to the weights' type, as cuDNN does; both to TF32), which the CPU build
    does not, hence the bound."""
    for size, batch in ((24, 3), (64, 16), (64, 40)):
        problem = Problem(rnncc.cells.get(cell), size, size, batch,
                          "float32" if dtype == "tf32" else dtype, allow_tf32=dtype == "tf32")
        lowered = sequence.build(problem, Options(persistent="off"), CUDA)
        for key, (func, role) in lowered.components.items():
            rule = _simulated_against_cpu_build(func, role, rng,
                                                tol=TOL_TF32 if dtype == "tf32" else TOL[dtype])
            assert rule == lowered.rules[key], key


@pytest.mark.parametrize("feed, dtype", [(feed, dtype) for feed in ("copy", "tma")
                                         for dtype in ("float16", "bfloat16", "tf32")]
                         + [("copy", "tf32x3")])
def test_products_of_all_steps_past_whole_tiles_match_the_cpu_build_on_the_simulator(
        dtype, feed, monkeypatch, rng):
    """The products of all steps whose K and O are not whole chunks and tiles (GRU 40 -> 50:
    K 40, O 150; LSTM 136 -> 34: K 136, O 136) on warpgroup MMA, fed by the warpgroups' copies or
    (allowed at any K here) by the TMA engine: zeros past K, B's last row past O, nothing
    stored past O; float32 split in three TF32 products (``tf32x3``, at batch 16: fewer rows
    are cuda.sgemm's) within 1e-6 of the CPU build's IEEE float32."""
    from rnncc.schedules import cuda_wgmma_gemm

    monkeypatch.setattr(cuda_wgmma_gemm, "TMA_CHUNKS", 1 if feed == "tma" else 10**6)
    split = dtype == "tf32x3"
    for cell, c, h in (("gru", 40, 50), ("lstm", 136, 34)):
        problem = Problem(rnncc.cells.get(cell), c, h, 16 if split else 3,
                          dtype if dtype in TOL else "float32", allow_tf32=dtype == "tf32")
        lowered = sequence.build(problem, Options(persistent="off"), CUDA)
        func, role = lowered.components["input_gemm"]
        found = cuda_wgmma_gemm.sizes(func, CUDA)
        assert found is not None and found.tails and found.op.split == split
        assert cuda_wgmma_gemm.tma_fed(found) == (feed == "tma")
        rule = _simulated_against_cpu_build(
            func, role, rng, tol=TOL_TF32 if dtype == "tf32" else TOL.get(dtype, 1e-6))
        assert rule == lowered.rules["input_gemm"] == "cuda.wgmma_gemm"


def _one_step_product_case(rows, k, o, parts, dtype, rng) -> SimpleNamespace:
    """One step's product of N ``rows`` by W [O, K] in ``dtype`` (``tf32``: float32 allowed
    TF32; ``tf32x3``: float32 split in three TF32 products), whole plus b or in ``parts``
    slices: its component, product, fresh operands, the arguments with C poisoned, and
    NumPy's product of the operands as read."""
    from rnncc.schedules import _mma, cuda_mma_gemm

    tf32, split = dtype == "tf32", dtype == "tf32x3"
    dtype = "float32" if tf32 or split else dtype
    func = (comp.gemm((rows,), k, o, "rows", dtype, dtype) if parts == 1
            else comp.gemm_parts(rows, k, o, parts, "rows", dtype, dtype))
    func = (func.with_attr(_mma.TF32_ATTR, True) if tf32
            else func.with_attr(_mma.TF32X3_ATTR, True) if split else func)
    h = rng.standard_normal((rows, k)).astype(dtype)
    w, b = rng.standard_normal((o, k)).astype(dtype), rng.standard_normal(o).astype(dtype)
    args = ([h, w, b, np.full((rows, o), np.nan, np.float32)] if parts == 1
            else [h, w, np.full((parts, rows, o), np.nan, np.float32)])
    as_read = (lambda x: truncate_tf32(x).astype(np.float64)) if tf32 else (
        lambda x: x.astype(np.float64))
    want = as_read(h) @ as_read(w).T + (b.astype(np.float64) if parts == 1 else 0)
    return SimpleNamespace(func=func, product=cuda_mma_gemm.product_of(func, CUDA), h=h, w=w,
                           args=args, want=want, parts=parts)


def _simulated_error(kernel, case) -> float:
    """The relative error of ``kernel`` run on the simulator with ``case``'s arguments (its
    slices summed) against ``case``'s NumPy product."""
    from tir_sim import Simulator

    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, case.args)}).run()
    got = case.args[-1].astype(np.float64)
    got = got.sum(0) if case.parts > 1 else got
    return np.abs(got - case.want).max() / np.abs(case.want).max()


@pytest.mark.parametrize("feed", ["copy", pytest.param("tma", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32", "tf32x3"])
@pytest.mark.parametrize("rows, k, o, parts", [(70, 200, 150, 2), (45, 136, 136, 1),
                                               (135, 72, 130, 1), (64, 264, 300, 4),
                                               (70, 204, 150, 2), (45, 100, 136, 1)])
def test_one_step_products_past_whole_tiles_match_numpy_on_the_simulator(
        rows, k, o, parts, dtype, feed, monkeypatch, rng):
    """One step's product whose K or O is not whole chunks and tiles, whole or in slices of K
    (:func:`rnncc.schedules.slice_depth`: whole chunks but the last, which ends at K: 200 in
    128 and 72, 264 in 3 of 64 and 72), on warpgroup MMA, fed by copies or by the TMA
    engine (rows of K off 16 bytes, halves of K 204 and 100: copies of 8 bytes, never the
    TMA engine; float32 split never by it): zeros past K, B's last row past O, nothing stored
    past O or N; the slices' sum against NumPy's product of the same rounded operands (split
    float32: of the operands, within TOL_F32)."""
    from rnncc.schedules import _mma, cuda_wgmma_gemm

    monkeypatch.setattr(cuda_wgmma_gemm, "TMA_CHUNKS", 1 if feed == "tma" else 10**6)
    case = _one_step_product_case(rows, k, o, parts, dtype, rng)
    product, func, h, w = case.product, case.func, case.h, case.w
    dtype = h.dtype.name
    assert product is not None and product.tails and product.parts == parts
    rows_shape = cuda_wgmma_gemm.unswapped(product)  # tiles of N rows (swapped: below)
    cols = rows_shape.cols if rows_shape else cuda_wgmma_gemm.columns(product)
    kernel = cuda_wgmma_gemm.kernel(product, cols, swapped=False)
    plan = cuda_wgmma_gemm.Plan(product, cols)
    narrow = k * np.dtype(dtype).itemsize % 16 != 0
    assert plan.narrow == (narrow, narrow)
    assert plan.tma == (feed == "tma" and product.tile_rows == 128 and not narrow
                        and not product.op.split)
    assert _simulated_error(kernel, case) < TOL_F32
    if parts > 1 and dtype == "float32":  # the component itself, built for this CPU
        cpu = [tvm.runtime.tensor(x) for x in (h, w, np.full((parts, rows, o), np.nan,
                                                             np.float32))]
        tvm.compile(func.without_attr(_mma.TF32_ATTR).without_attr(_mma.TF32X3_ATTR),
                    target="llvm")(*cpu)
        exact = h.astype(np.float64) @ w.astype(np.float64).T
        got = cpu[-1].numpy().astype(np.float64).sum(0)
        assert np.abs(got - exact).max() / np.abs(exact).max() < TOL_F32


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_dx_of_an_input_size_off_whole_tiles_matches_the_cpu_build_on_the_simulator(dtype, rng):
    """A 16-bit training layer whose C is off whole tiles (GRU 13 -> 24, C padded to 16; 40
    -> 24): dx = dGI W_ih on warpgroup MMA past its edges, W_ih transposed first (k last in
    both operands; read as packed it fell to cuda.matmul), and x padded for the input
    projection of all steps; and dW_ih of C = 80 over x padded to a whole tile."""
    for c in (13, 40):
        problem = Problem(rnncc.cells.get("gru"), c, 24, 3, dtype, training=True)
        lowered = sequence.build(problem, Options(persistent="off"), CUDA)
        assert lowered.rules["input_gemm_backward"] == "cuda.wgmma_gemm"
        for key in ("transpose_w_ih", "input_gemm_backward", "input_gemm", "dx_cast") + (
                ("pad_x",) if c == 13 else ()):
            func, role = lowered.components[key]
            assert _simulated_against_cpu_build(func, role, rng, tol=TOL[dtype]) == (
                lowered.rules[key]), key
    # GRU 80 -> 128 (G*H 384): dW_ih over x padded to 128 columns, its first 80 copied out
    problem = Problem(rnncc.cells.get("gru"), 80, 128, 3, dtype, training=True)
    lowered = sequence.build(problem, Options(persistent="off"), CUDA)
    for key, rule in (("pad_x_grad", "cuda.elementwise"), ("weight_grad_ih", "cuda.wgmma_gemm"),
                      ("dweight_ih_copy", "cuda.elementwise")):
        func, role = lowered.components[key]
        assert _simulated_against_cpu_build(func, role, rng, tol=TOL[dtype]) == rule, key


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "tf32"])
def test_tma_fed_components_of_a_layer_match_the_cpu_build_on_the_simulator(dtype, rng):
    """The same where the TMA engine feeds the products: LSTM 1024 -> 2048 at batch 130, the
    products of all steps (16 chunks of K a block in 16 bits, 32 in TF32) and each step's (two
    row tiles: a cluster of two blocks; h in the weights' type as the cell step writes it)."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm

    problem = Problem(rnncc.cells.get("lstm"), 1024, 2048, 130,
                      "float32" if dtype == "tf32" else dtype, allow_tf32=dtype == "tf32")
    lowered = sequence.build(problem, Options(persistent="off"), CUDA)
    fed = []
    for key, (func, role) in lowered.components.items():
        found = cuda_mma_gemm.product_of(func, CUDA) if role == "gemm" else None
        if found is not None and cuda_wgmma_gemm.sizes(func, CUDA) is not None:
            fed.append((key, cuda_wgmma_gemm.tma_fed(found)))
        rule = _simulated_against_cpu_build(func, role, rng,
                                            tol=TOL_TF32 if dtype == "tf32" else TOL[dtype])
        assert rule == lowered.rules[key], key
    assert dict(fed) == {"input_gemm": True, "recurrent_gemm": True} or dict(fed) == {
        "input_gemm": True, "recurrent_gemm_parts": True}, fed


@pytest.mark.parametrize("training", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cuda_tf32x3_components_match_the_cpu_build_on_the_simulator(training, monkeypatch,
                                                                       rng):
    """The same with float32 split in three TF32 products (tf32x3) at batch 64, where the
    products of all steps and each step's (forward and, in training, backward, dx and the
    weights' gradients) run on tensor cores (cuda.wgmma_gemm those of all steps and dx,
    cuda.mma_gemm the others; its grid's policy lowered to take them at C = H = 128): within
    2e-6 of the largest value of the CPU build's IEEE float32 (a fifth of float32's bound, as
    on the GPU; dx's K 512 came to 1.15e-6 on some draws)."""
    from rnncc.schedules import cuda_mma_gemm

    monkeypatch.setattr(cuda_mma_gemm, "TARGET_BLOCKS", 8)
    monkeypatch.setattr(cuda_mma_gemm, "MIN_SLICE", 16)
    monkeypatch.setattr(cuda_mma_gemm, "SPLIT_GRADIENT_TILES", 1)
    monkeypatch.setattr(cuda_mma_gemm, "HALF_GRADIENT_MIN_TILES", 1)
    problem = Problem(rnncc.cells.get("lstm"), 128, 128, 64, training=training)
    lowered = sequence.build(problem, Options(persistent="off", tf32x3=True), CUDA)
    split = {key for key, rule in lowered.rules.items()
             if rule in ("cuda.mma_gemm", "cuda.wgmma_gemm")}
    assert {"input_gemm", "recurrent_gemm_parts"} <= split
    assert lowered.rules["input_gemm"] == "cuda.wgmma_gemm"
    backward = {"recurrent_gemm_backward_parts", "input_gemm_backward", "weight_grad_ih",
                "weight_grad_hh"}
    assert not training or backward <= split, lowered.rules
    for key, (func, role) in lowered.components.items():
        assert _simulated_against_cpu_build(func, role, rng, TOL_F32 / 5) == (
            lowered.rules[key]), key


@pytest.mark.parametrize("training", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cuda_tf32x3_components_past_whole_tiles_match_the_cpu_build_on_the_simulator(
        training, rng):
    """The same past whole tiles and chunks (LSTM 40 -> 52 at batch 40: K 40 and 52, O 208),
    with the policy as shipped: the products of all steps and each step's (a 64-row tile
    over half full) split on cuda.wgmma_gemm, in training too (its backward products stay
    the CUDA cores'), within 2e-6 as above."""
    problem = Problem(rnncc.cells.get("lstm"), 40, 52, 40, training=training)
    lowered = sequence.build(problem, Options(persistent="off", tf32x3=True), CUDA)
    rules = lowered.rules
    step = rules.get("recurrent_gemm_parts", rules["recurrent_gemm"])
    assert rules["input_gemm"] == step == "cuda.wgmma_gemm", rules
    for key, (func, role) in lowered.components.items():
        assert _simulated_against_cpu_build(func, role, rng, TOL_F32 / 5) == rules[key], key


def test_cuda_gradient_sums_match_the_cpu_build_on_the_simulator(rng, monkeypatch):
    """Training's sums over all steps' rows: the biases' (a column sum) and float32 weight
    gradients (O off whole tiles, and of one tile), over whole tiles of rows and part of
    one; M in 16 slices (the simulator's time)."""
    from rnncc.schedules import cuda_weight_grad

    monkeypatch.setattr(cuda_weight_grad, "MANY_SPLITS", cuda_weight_grad.MAX_SPLITS)
    rules = {_simulated_against_cpu_build(func, "reduction", rng) for func in (
        comp.column_sum(comp.i64(300), 132, "float32"), comp.column_sum(comp.i64(33), 20,
                                                                         "float32"),
        comp.weight_gradient(comp.i64(300), 132, 40, "float32", "float32"),
        comp.weight_gradient(comp.i64(64), 128, 64, "float32", "float32"))}
    assert rules == {"cuda.column_sum", "cuda.weight_grad"}


def test_unfused_step_is_several_kernels():
    step = comp.cell_step(rnncc.cells.get("lstm"), 3, 33, "float32", "combined", fused=False)
    result = schedules.schedule(step, CUDA, "elementwise")
    assert result.func.script().count('thread="blockIdx.x"') > 8


def test_an_entry_whose_parameters_differ_from_its_signature_is_refused():
    """The runtime passes an entry's arguments by position as its signature lists them: an
    entry built with two of them swapped (which TVM may not catch: same shapes) is an error
    as it is added, naming both orders."""
    builder = sequence._Builder(Problem(rnncc.cells.get("lstm"), 3, 4, 2), Options(), LLVM)
    sig = []
    x, y = (builder.param(sig, name, (4,), kind) for name, kind in (("x", "input"),
                                                                     ("y", "output")))
    with pytest.raises(AssertionError, match=r"swapped: parameters \['y', 'x'\] against the "
                                             r"signature's \['x', 'y'\]"):
        builder.add("swapped", tirx.PrimFunc([y, x], tirx.Evaluate(0)), list(sig))
    builder.add("in_order", tirx.PrimFunc([x, y], tirx.Evaluate(0)), sig)
    assert [p["name"] for p in builder.lowered.signatures["in_order"]] == ["x", "y"]


def test_cuda_gemm_rule_choice():
    t_len = tirx.Var("T", "int64")
    cases = [((1,), 512, 2048, "cuda.small_batch_gemv"), ((64,), 512, 2048, "cuda.sgemm"),
             ((1,), 1500, 6000, "cuda.small_batch_gemv"), ((4,), 650, 2600,
                                                         "cuda.small_batch_gemv"),
             ((64,), 320, 960, "cuda.sgemm"), ((32,), 1500, 6000, "cuda.sgemm"),
             ((t_len, 64), 512, 2048, "cuda.sgemm"), ((t_len, 64), 40, 2048, "cuda.sgemm"),
             ((64,), 33, 99, "cuda.matmul"), ((64,), 320, 962, "cuda.matmul"),
             ((t_len, 1), 256, 2048, "cuda.sgemm"), ((t_len, 16), 512, 2048, "cuda.sgemm"),
             ((t_len, 4), 512, 2048, "cuda.sgemm"),
             ((t_len, 3), 42, 2048, "cuda.matmul"), ((16,), 2048, 8192, "cuda.small_batch_gemv"),
             ((1,), 1, 4, "cuda.small_batch_gemv")]
    for lead, k, o, rule in cases:
        result = schedules.schedule(comp.gemm(lead, k, o, "rows", "float32"), CUDA, "gemm")
        assert result.rule == rule, (lead, k, o, result.notes)
        assert {"blockIdx.x", "threadIdx.x"} <= thread_tags(result.func) | {"blockIdx.x"}


def test_float16_step_products_on_tensor_cores():
    from rnncc.schedules import cuda_mma_gemv

    for batch, k, o in ((9, 96, 96), (64, 1024, 4096), (256, 2048, 8192), (33, 512, 1536)):
        result = schedules.schedule(comp.gemm((batch,), k, o, "rows", "float16", "float32"),
                                    CUDA, "gemm")
        assert result.rule == "cuda.mma_gemv", (batch, result.notes)
        assert '"m16n8k16"' in result.func.script()
    # (N, K, O): NT, KC and S warps a column group (K split among them where O alone leaves
    # under 128 blocks; the chunk of h and the split sums in 48 KiB)
    plans = {(64, 1024, 4096): (1, 256, 2), (64, 4096, 1024): (1, 256, 4),
             (64, 2048, 16384): (2, 256, 1), (100, 128, 128): (1, 64, 2),
             (256, 2048, 8192): (1, 64, 1), (128, 4096, 1024): (1, 64, 2)}
    found = {key: cuda_mma_gemv.plan(*key, "float32") for key in plans}
    assert {key: (p.n_tiles, p.chunk, p.k_split) for key, p in found.items()} == plans
    t_len = tirx.Var("T", "int64")
    declined = [((8,), 1024, 4096, "float16"),  # batch 8: persistent or small_batch_gemv
                ((257,), 1024, 4096, "float16"), ((64,), 1000, 4096, "float16"),  # K % 32
                ((64,), 1024, 4100, "float16"),  # O % 8
                ((64,), 1024, 4096, "float32"), ((t_len, 64), 1024, 4096, "float16")]
    for lead, k, o, dtype in declined:
        func = comp.gemm(lead, k, o, "rows", dtype, "float32")
        assert cuda_mma_gemv.apply(func, CUDA) is None, (lead, k, o, dtype)
    old_gpu = TargetSpec("cuda", arch="sm_75").tvm_target()
    assert cuda_mma_gemv.apply(comp.gemm((64,), 1024, 4096, "rows", "float16", "float32"),
                               old_gpu) is None


@pytest.mark.parametrize("operands", ["bfloat16", "tf32"])
@pytest.mark.parametrize("batch, depth, outputs, k_split", [(33, 256, 64, 8), (64, 128, 256, 4),
                                                            (9, 64, 8192, 1)])
def test_mma_gemv_splits_k_among_a_blocks_warps_on_the_simulator(batch, depth, outputs, k_split,
                                                                 operands, rng):
    """One step's product on tensor cores where O gives few blocks: S warps share a block's
    columns, each a 1/S of every chunk, their sums added through shared memory; on the NumPy
    interpreter of TIR against NumPy's product of the same rounded operands (bfloat16, or
    float32 rounded to TF32 where the component allows it, and the plan has enough blocks:
    else the IEEE rules take it)."""
    from rnncc.schedules import _mma, cuda_mma_gemv
    from tir_sim import Simulator

    dtype = "float32" if operands == "tf32" else operands
    func = comp.gemm((batch,), depth, outputs, "rows", dtype, "float32")
    if operands == "tf32":
        assert cuda_mma_gemv.apply(func, CUDA) is None  # IEEE unless the component allows it
        func = func.with_attr(_mma.TF32_ATTR, True)
        if outputs < 8 * cuda_mma_gemv.TF32_MIN_BLOCKS:  # too few blocks of 8 rows
            assert cuda_mma_gemv.apply(func, CUDA) is None
            return
    assert cuda_mma_gemv.plan(batch, depth, outputs, "float32", dtype).k_split == k_split
    kernel = cuda_mma_gemv.apply(func, CUDA).mod["main"]
    a = rng.standard_normal((batch, depth)).astype(np.float32)
    w, b = (rng.standard_normal(s).astype(dtype) for s in ((outputs, depth), outputs))
    out = np.full((batch, outputs), np.nan, np.float32)
    Simulator(kernel, dict(zip((p.name for p in kernel.params), (a, w, b, out)))).run()

    def rounded(x):
        return (round_tf32(x) if operands == "tf32" else x.astype(dtype)).astype(np.float64)

    want = rounded(a) @ rounded(w).T + b.astype(np.float64)
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


def test_large_tf32_step_products_at_batch_8_to_16_stream_on_tensor_cores():
    """TF32 products at batch 8-16 whose weights stream (48 MiB and more, O >= K) are
    cuda.mma_stream_gemv's where h [16, K] fits a block's shared memory, else IEEE
    cuda.small_batch_gemv's, as below batch 8; IEEE products are not this rule's. K is split
    between a block's warps where its parts are multiples of 128."""
    from rnncc.schedules import _mma, cuda_mma_stream_gemv

    def rule(batch, depth, outputs, tf32=True):
        func = comp.gemm((batch,), depth, outputs, "rows", "float32")
        return schedules.schedule(func.with_attr(_mma.TF32_ATTR, True) if tf32 else func,
                                  CUDA, "gemm").rule

    for batch, depth, outputs in ((16, 2048, 6144), (16, 2560, 7680), (16, 3584, 14336)):
        assert rule(batch, depth, outputs) == "cuda.mma_stream_gemv", (batch, depth, outputs)
    assert rule(16, 4096, 16384) == "cuda.small_batch_gemv"  # h past shared memory
    assert rule(8, 2048, 8192) == rule(12, 2048, 8192) == "cuda.mma_stream_gemv"
    assert rule(7, 2048, 8192) == "cuda.small_batch_gemv"
    assert rule(16, 2048, 6144, tf32=False) == "cuda.small_batch_gemv"  # IEEE
    assert rule(17, 2048, 8192) != "cuda.mma_stream_gemv"
    assert rule(16, 1024, 4096) == "cuda.mma_gemv"  # 16 MiB: not streamed
    assert cuda_mma_stream_gemv.plan(4, 2048, 8192) is None
    assert cuda_mma_stream_gemv.plan(16, 2048, 6144).k_split == cuda_mma_stream_gemv.K_SPLIT
    # O in 64-row blocks past 132 blocks: more warps a block, fewer blocks ahead each (the
    # fewest waves times warps; LSTM 2176's 8704 rows take two waves of 8 or one of 16)
    found = {shape: cuda_mma_stream_gemv.plan(16, *shape) for shape in (
        (2048, 8192), (3584, 10752), (2560, 10240), (3072, 9216), (2176, 8704))}
    assert {shape: (p.k_split, p.warps, p.ahead, shape[1] // p.rows)
            for shape, p in found.items()} == {
        (2048, 8192): (2, 8, 8, 128), (3584, 10752): (2, 12, 4, 112),
        (2560, 10240): (2, 10, 5, 128), (3072, 9216): (2, 9, 6, 128),
        (2176, 8704): (2, 8, 4, 136)}
    ampere = TargetSpec("cuda", arch="sm_80").tvm_target()  # 163 KiB of shared memory a block
    func = comp.gemm((16,), 2048, 8192, "rows", "float32").with_attr(_mma.TF32_ATTR, True)
    assert cuda_mma_stream_gemv.apply(func, ampere) is None


@pytest.mark.parametrize("batch, depth, outputs, rounded, keep, k_split, warps, ahead", [
    (12, 256, 128, "", False, 2, 8, 8), (16, 256, 64, "ab", True, 2, 8, 8),
    (9, 768, 192, "b", False, 2, 8, 8), (16, 128, 64, "", False, 1, 8, 8),
    (5, 512, 64, "", False, 4, 8, 8), (10, 384, 144, "", True, 2, 9, 6),
    (16, 192, 96, "b", False, 2, 12, 3)])
def test_mma_stream_gemv_matches_numpy_on_the_simulator(batch, depth, outputs, rounded, keep,
                                                        k_split, warps, ahead, rng):
    """cuda.mma_stream_gemv's kernel (small sizes, planned by hand) on the NumPy interpreter
    of TIR against NumPy's product of the operands rounded to TF32 (by the kernel, or before
    where ``rounded`` says the callers did), rows past N padded, the output poisoned; W
    loaded with the L2 policy that keeps part of it where ``keep`` (at full size W of 40 MiB
    and more on sm_90, GRU 2048's 48 MiB at batch 16); K in ``k_split``
    parts a block's warps share, their sums added at the end; ``warps`` a part (8 rows
    each), ``ahead`` blocks of 16 k loaded ahead."""
    from rnncc.schedules import _mma, _streaming, cuda_mma_stream_gemv
    from tir_sim import Simulator

    full = comp.gemm((16,), 2048, 6144, "rows", "float32").with_attr(_mma.TF32_ATTR, True)
    assert _streaming.STREAM_KEEP in cuda_mma_stream_gemv.apply(full, CUDA).mod.script()
    kernel = cuda_mma_stream_gemv.kernel(cuda_mma_stream_gemv.Plan(
        batch, depth, outputs, rounded, 0.5 if keep else None, k_split, warps, ahead))
    assert (_streaming.STREAM_KEEP in kernel.script()) == keep
    a = rng.standard_normal((batch, depth)).astype(np.float32)
    w, b = (rng.standard_normal(s).astype(np.float32) for s in ((outputs, depth), outputs))
    a, w = (round_tf32(x) if name in rounded else x for name, x in (("a", a), ("b", w)))
    out = np.full((batch, outputs), np.nan, np.float32)
    Simulator(kernel, dict(zip((p.name for p in kernel.params), (a, w, b, out)))).run()
    want = (round_tf32(a).astype(np.float64) @ round_tf32(w).astype(np.float64).T
            + b.astype(np.float64))
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


def test_small_batch_gemv_rows_a_warp():
    from rnncc.schedules.cuda_small_batch_gemv import rows_per_warp

    # (N, O): RW, a power of two up to N, 64 / N and 8, fewer where the grid would be small
    expected = {(2, 8192): 2, (3, 8192): 2, (4, 8192): 4, (8, 8192): 8, (16, 8192): 4,
                (8, 6144): 4, (16, 3072): 2, (4, 1024): 1, (7, 512): 1}
    assert {key: rows_per_warp(*key) for key in expected} == expected


def test_small_batch_gemv_takes_other_counts_of_warps_where_o_has_no_factor_of_8():
    """G*H with H odd: the most rows a warp whose blocks of 2 to 7 warps divide O into at least
    TARGET_BLOCKS (LSTM 4029 at batch 17: 2 rows, 6 warps, where 8 warps took one a block)."""
    from rnncc.schedules import cuda_small_batch_gemv
    from rnncc.schedules.cuda_small_batch_gemv import uneven_rows

    expected = {(17, 4 * 4029): (2, 6), (4, 4 * 3001): (2, 2), (8, 3 * 2731): (1, 3),
                (3, 1548): (2, 6), (1, 4): (1, 4), (2, 3): (1, 3)}
    assert {key: uneven_rows(*key) for key in expected} == expected
    script = cuda_small_batch_gemv.apply(comp.gemm((17,), 4029, 4 * 4029, "rows", "float32"),
                                         CUDA).mod.script()
    assert 'T.int64(6), thread="threadIdx.y"' in script


def test_small_batch_gemv_stages_h_in_shared_memory_past_128_kib():
    from rnncc.schedules import cuda_small_batch_gemv

    for batch, depth, outputs, staged in ((16, 4096, 16384, True), (16, 2048, 8192, False),
                                          (17, 2049, 1028, True), (31, 1058, 64, True),
                                          (31, 1057, 64, False), (4, 1024, 4096, False)):
        script = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows",
                                                       "float32"), CUDA).mod.script()
        assert ('scope="shared"' in script) == staged, (batch, depth, outputs)


def test_small_batch_gemv_streams_large_weights_past_l1_and_takes_large_tf32_products():
    """W loaded past L1 where h is at least 96 KiB and W at least 48 MiB (K a multiple of
    128); blocks of 4 warps from batch 16 where h is not staged; TF32 products at batch 16 and
    less with W of 48 MiB or more and O >= K are streamed, on tensor cores at batch 8-16 where h
    fits a block's shared memory (cuda.mma_stream_gemv), else by this IEEE rule (the other
    tensor-core rules decline them, whole or in slices), others the tensor cores' (the
    backward's dh: O < K)."""
    from rnncc.schedules import _streaming, cuda_small_batch_gemv

    for batch, depth, outputs, streamed in ((16, 2048, 8192, True), (12, 2048, 8192, True),
                                            (16, 2048, 6144, True), (8, 2048, 8192, False),
                                            (16, 1536, 6144, False), (16, 2000, 8000, False)):
        sch = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows",
                                                    "float32"), CUDA)
        assert (_streaming.STREAM in str(sch.trace)) == streamed, (batch, depth)
    before_volta = TargetSpec("cuda", arch="sm_61").tvm_target()  # no L1 eviction hints
    sch = cuda_small_batch_gemv.apply(comp.gemm((16,), 2048, 8192, "rows", "float32"),
                                      before_volta)
    assert _streaming.STREAM not in str(sch.trace)
    # 4-warp blocks from batch 16 where h is not staged, else 8
    for batch, depth, outputs, warps in ((16, 2048, 6144, 4), (16, 1536, 6144, 4),
                                         (12, 2048, 6144, 8), (24, 2048, 8192, 8),
                                         (4, 2048, 8192, 8)):
        script = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows",
                                                       "float32"), CUDA).mod.script()
        assert f'T.int64({warps}), thread="threadIdx.y"' in script, (batch, depth, outputs)
    for batch, depth, outputs, rule in ((16, 2048, 8192, "cuda.mma_stream_gemv"),
                                        (8, 2048, 8192, "cuda.mma_stream_gemv"),
                                        (7, 2048, 8192, "cuda.small_batch_gemv"),
                                        (16, 2560, 7680, "cuda.mma_stream_gemv"),
                                        (16, 4096, 16384, "cuda.small_batch_gemv"),
                                        (16, 1024, 4096, "cuda.mma_gemv"),
                                        (16, 1536, 6144, "cuda.mma_gemv"),
                                        (16, 8192, 2048, "cuda.mma_gemv"),
                                        (24, 2048, 8192, "cuda.mma_gemv")):
        func = comp.gemm((batch,), depth, outputs, "rows", "float32").with_attr(
            schedules.TF32_ATTR, True)
        assert schedules.schedule(func, CUDA, "gemm").rule == rule, (batch, depth, outputs)
        if rule != "cuda.mma_gemv":  # streamed: not in slices either
            assert schedules.product_parts(func, CUDA) == 1, (batch, depth, outputs)


def _matches_numpy_on_the_simulator(sch, batch, depth, outputs, rng):
    """One step's product h [N, K] x W [O, K] + b that ``sch`` schedules, on the NumPy
    interpreter of TIR against float64 on fresh inputs, the output poisoned."""
    from tir_sim import Simulator, lowered

    kernel = lowered(sch.mod)
    a = rng.standard_normal((batch, depth)).astype(np.float32)
    w = rng.standard_normal((outputs, depth)).astype(np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    out = np.full((batch, outputs), np.nan, np.float32)
    Simulator(kernel, dict(zip((p.name for p in kernel.params), (a, w, b, out)))).run()
    want = a.astype(np.float64) @ w.astype(np.float64).T + b
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("batch, depth, outputs, staged", [
    (4, 64, 4096, False), (2, 36, 2048, False), (8, 128, 8192, False), (3, 40, 96, False),
    (1, 1, 4, False),
    (19, 257, 1028, True), (17, 36, 64, True), (4, 200, 64, True), (1, 5, 8, True),
    (5, 256, 64, True), (16, 128, 64, False), (3, 36, 1548, False)])
def test_small_batch_gemv_matches_numpy_on_the_simulator(batch, depth, outputs, staged, rng,
                                                         monkeypatch):
    """Each step's product at small batch on the NumPy interpreter of TIR against float64: RW
    rows a warp from 1 to 8, 2 to 7 warps a block where O has no factor of 8, K not a
    multiple of 4 (scalar loads) or of 128 (the last chunk part past K), W loaded past L1
    where K is a multiple of 128, and h staged in shared memory (the thresholds lowered to 0
    for these small sizes); the output poisoned."""
    from rnncc.schedules import _streaming, cuda_small_batch_gemv

    if staged:
        monkeypatch.setattr(cuda_small_batch_gemv, "SHARED_H_MIN_BYTES", 0)
    monkeypatch.setattr(cuda_small_batch_gemv, "STREAM_MIN_H_BYTES", 0)
    monkeypatch.setattr(cuda_small_batch_gemv, "STREAM_MIN_W_BYTES", 0)
    sch = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows", "float32"),
                                      CUDA)
    assert ('scope="shared"' in sch.mod.script()) == staged
    assert (_streaming.STREAM in str(sch.trace)) == (depth % 128 == 0)
    _matches_numpy_on_the_simulator(sch, batch, depth, outputs, rng)


@pytest.mark.parametrize("batch, depth, outputs, split", [
    (4, 4096, 64, 4), (1, 4096, 16, 4), (3, 2200, 40, 4), (2, 2048, 64, 1), (4, 3072, 64, 4)])
def test_small_batch_gemv_splits_long_k_among_warps_on_the_simulator(batch, depth, outputs,
                                                                     split, rng):
    """Where the grid is small and K long (the backward's dh = dGH W_hh: O = H, K = G*H), S
    warps share each row's K, their sums added across them: on the NumPy interpreter of TIR
    against float64 (K past whole chunks masked), the output poisoned. At full size: LN-LSTM
    1024's dh at batch 4 (O 1024, K 4096) takes S = 4, not where h is staged (batch 16), nor
    the forward's products."""
    from rnncc.schedules import cuda_small_batch_gemv

    assert cuda_small_batch_gemv.k_split(1024, 4096, 1, 4) == 4
    assert cuda_small_batch_gemv.k_split(512, 2048, 1, 4) == 1  # 16 chunks
    assert cuda_small_batch_gemv.k_split(4096, 1024, 4, 4) == 1
    assert cuda_small_batch_gemv.k_split(16384, 4096, 1, 4) == 1
    staged = cuda_small_batch_gemv.apply(comp.gemm((16,), 4096, 1024, "rows", "float32"), CUDA)
    assert 'T.int64(32), thread="threadIdx.x"' in staged.mod.script()
    sch = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows", "float32"),
                                      CUDA)
    assert f'T.int64({32 * split}), thread="threadIdx.x"' in sch.mod.script()
    _matches_numpy_on_the_simulator(sch, batch, depth, outputs, rng)


@pytest.mark.parametrize("batch, staged, streamed", [(4, False, False), (16, False, True),
                                                     (3, True, True)])
def test_small_batch_gemv_keeps_part_of_weights_past_l2_on_the_simulator(batch, staged,
                                                                          streamed, rng,
                                                                          monkeypatch):
    """W larger than L2 (the threshold lowered here) loaded with the L2 policy that keeps
    KEEP_BYTES of it, through L1 or past it: the fraction in the kernel, and the product on
    the NumPy interpreter of TIR against float64, the output poisoned. At full size: LSTM 2048
    (W 64 MiB) at batch 4 through L1, at 16 past it, at batch 8 (8 rows a warp) and off
    Hopper (L2 of another size) plain, LSTM 1536 (36 MiB) plain."""
    from rnncc.schedules import _streaming, cuda_small_batch_gemv

    def loads(batch, depth, arch="sm_90"):
        sch = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, 4 * depth, "rows",
                                                    "float32"),
                                          TargetSpec("cuda", arch=arch).tvm_target())
        return re.findall(r"rnncc_ld\w+", str(sch.trace))

    thousandths = round(1000 * _streaming.KEEP_BYTES / (4 * 2048 * 8192))  # 469
    assert loads(4, 2048) == [f"{_streaming.KEEP}_{thousandths}"]
    assert loads(16, 2048) == [f"{_streaming.STREAM_KEEP}_{thousandths}"]
    assert loads(8, 2048) == loads(4, 1536) == []
    assert loads(4, 2048, "sm_80") == loads(4, 2048, "sm_100a") == []  # not Hopper's L2
    assert loads(16, 2048, "sm_80") == [_streaming.STREAM]

    depth, outputs = 256, 1024
    monkeypatch.setattr(_streaming, "MIN_BYTES", 0)
    monkeypatch.setattr(cuda_small_batch_gemv, "SHARED_H_MIN_BYTES", 0 if staged else 1 << 30)
    if streamed:
        monkeypatch.setattr(cuda_small_batch_gemv, "STREAM_MIN_H_BYTES", 0)
        monkeypatch.setattr(cuda_small_batch_gemv, "STREAM_MIN_W_BYTES", 0)
    sch = cuda_small_batch_gemv.apply(comp.gemm((batch,), depth, outputs, "rows", "float32"),
                                      CUDA)
    function = _streaming.STREAM_KEEP if streamed else _streaming.KEEP
    assert f"{function}_1000" in str(sch.trace)  # all of this small W kept (a fraction of 1)
    _matches_numpy_on_the_simulator(sch, batch, depth, outputs, rng)


@pytest.mark.parametrize("rule", ["cuda.small_batch_gemv", "cuda.sgemm", "cuda.tiled_gemm",
                                  "cuda.matmul", "cuda.gemm_simple"])
def test_float32_gemm_rules_match_numpy_on_the_simulator(rule, rng):
    """Each IEEE float32 gemm rule, on every product here that it takes (one step's at batch
    3, 33 and 64, all steps' at T = 5), on the NumPy interpreter of TIR against float64, the
    output poisoned; each rule takes at least one."""
    from tir_sim import Simulator, lowered

    (found,) = [r for r in schedules.RULES[("cuda", "gemm")] if r.name == rule]
    t_len = tirx.Var("T", "int64")
    taken = 0
    for lead, depth, outputs, weights in [((3,), 40, 96, "rows"), ((33,), 36, 132, "rows"),
                                          ((64,), 64, 256, "rows"), ((t_len, 3), 20, 132, "rows"),
                                          ((t_len, 64), 64, 256, "rows"),
                                          ((33,), 44, 128, "cols")]:
        sch = found.apply(comp.gemm(lead, depth, outputs, weights, "float32"), CUDA)
        if sch is None:
            continue
        taken += 1
        shape = tuple(5 if isinstance(d, tirx.Var) else d for d in lead)
        kernel = lowered(sch.mod)
        a = rng.standard_normal(shape + (depth,)).astype(np.float32)
        w = rng.standard_normal((outputs, depth) if weights == "rows" else (depth, outputs))
        b = rng.standard_normal(outputs).astype(np.float32)
        out = np.full(shape + (outputs,), np.nan, np.float32)
        w = w.astype(np.float32)
        Simulator(kernel, dict(zip((p.name for p in kernel.params), (a, w, b, out)))).run()
        want = a.astype(np.float64) @ (w.T if weights == "rows" else w).astype(np.float64) + b
        assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32, (lead, depth, outputs)
    assert taken


def test_sgemm_takes_float32_projections_of_all_steps_and_of_large_batches():
    from rnncc.schedules import cuda_sgemm

    t_len = tirx.Var("T", "int64")
    taken = [((t_len, 64), 1024, 4096), ((t_len, 32), 16, 128), ((t_len, 33), 48, 384),
             ((t_len, 16), 1024, 4096), ((t_len, 3), 2048, 6144), ((t_len, 1), 16, 128),
             ((64,), 1024, 4096), ((33,), 48, 384), ((96,), 256, 1024)]
    for lead, k, o in taken:
        for weights in ("rows", "cols"):
            product = cuda_sgemm.sizes(comp.gemm(lead, k, o, weights, "float32"))
            assert product == cuda_sgemm.Product(lead[-1], k, o, len(lead) == 2,
                                                 weights == "rows"), lead
    odd = [((t_len, 64), 1024, 4000), ((64,), 1032, 4096), ((32,), 1500, 6000),
           ((t_len, 3), 20, 132)]  # O not whole tiles, K not whole pairs of chunks, or both
    for lead, k, o in odd:
        product = cuda_sgemm.sizes(comp.gemm(lead, k, o, "rows", "float32"))
        assert product == cuda_sgemm.Product(lead[-1], k, o, len(lead) == 2), lead
    declined = [((16,), 1024, 4096, "rows", "float32"),  # one step's, batch under 32
                ((t_len, 64), 1024, 4000, "cols", "float32"),  # O not whole tiles of columns
                ((64,), 1026, 4096, "rows", "float32"),  # rows of K not whole 16-byte vectors
                ((64,), 1024, 4098, "rows", "float32"),  # nor of O
                ((t_len * 64,), 1024, 4096, "rows", "float32"),  # flat rows
                ((64,), 1024, 4096, "rows", "float16")]
    for lead, k, o, weights, dtype in declined:
        assert cuda_sgemm.apply(comp.gemm(lead, k, o, weights, dtype), CUDA) is None, lead


@pytest.mark.parametrize("lead, depth, outputs, weights, ahead", [
    ((33,), 36, 132, "rows", 4), ((40,), 36, 260, "rows", 1), ((64,), 32, 256, "rows", 1),
    (("T", 3), 20, 132, "rows", 1), ((33,), 44, 128, "cols", 4), (("T", 3), 60, 128, "cols", 1),
    ((32,), 64, 128, "rows", 4), ((32,), 72, 132, "rows", 2), ((32,), 128, 128, "cols", 4)])
def test_sgemm_matches_numpy_on_the_simulator(lead, depth, outputs, weights, ahead, rng):
    """The SGEMM of one step's product and of all steps' (T = 5), on the NumPy interpreter of
    TIR against float64: O not whole tiles (the columns past O read its last row of w and are
    not written), K not whole pairs of chunks (a's vectors past K zeros, w's its last
    columns), both, and neither; at batch 32 and 33 with 4 or 2 chunks' loads in flight
    (:meth:`Tile.ahead`); the output poisoned. (Products of one kernel: the interpreter runs
    one grid.)"""
    from rnncc.schedules import cuda_sgemm
    from tir_sim import Simulator

    lead = tuple(tirx.Var("T", "int64") if d == "T" else d for d in lead)
    shape = tuple(5 if isinstance(d, tirx.Var) else d for d in lead)
    gemm = comp.gemm(lead, depth, outputs, weights, "float32")
    tile = cuda_sgemm.Tile(cuda_sgemm.sizes(gemm))
    assert tile.ahead(tile.chunks()) == ahead
    kernel = cuda_sgemm.apply(gemm, CUDA).mod["main"]
    a = rng.standard_normal(shape + (depth,)).astype(np.float32)
    w = rng.standard_normal((outputs, depth)).astype(np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    out = np.full(shape + (outputs,), np.nan, np.float32)
    given = w if weights == "rows" else np.ascontiguousarray(w.T)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, (a, given, b, out))}).run()
    want = a.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("steps, batch, depth, outputs, weights, wave", [
    pytest.param(5, 33, 128, 260, "rows", 4, marks=pytest.mark.slow),
    pytest.param(7, 40, 136, 256, "cols", 4, marks=pytest.mark.slow),
    pytest.param(3, 40, 136, 256, "rows", 4, marks=pytest.mark.slow), (7, 16, 128, 132, "rows", 2)])
def test_sgemm_of_all_steps_splits_the_tail_past_whole_waves_on_the_simulator(
        steps, batch, depth, outputs, weights, wave, rng, monkeypatch):
    """All steps' tiles past the last whole wave of blocks (ALL_STEPS_SPLIT_BLOCKS, made
    small here) in slices of K, summed in order with the bias by another kernel, the whole
    waves' tiles over all of K: 6 tiles in waves of 4 (a tail of 2 in 2 slices; again with
    weights as columns and K not whole pairs of chunks), 2 tiles (no whole wave: the tail
    alone), 2 in waves of 2 (no tail: one kernel); against float64, the output and the
    workspace poisoned. (The interpreter runs each kernel on its own grid.)"""
    from rnncc.schedules import cuda_sgemm
    from tir_sim import Simulator

    monkeypatch.setattr(cuda_sgemm, "ALL_STEPS_SPLIT_BLOCKS", wave)
    lead = (tirx.Var("T", "int64"), batch)
    product = cuda_sgemm.sizes(comp.gemm(lead, depth, outputs, weights, "float32"))
    tile = cuda_sgemm.Tile(product)
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(tile.t_len, tirx.const(steps, "int64"))
    tiles = -(-steps * batch // cuda_sgemm.TILE) * -(-outputs // cuda_sgemm.TILE)
    tail = tiles % wave
    assert int(analyzer.simplify(tile.tail())) == tail
    assert int(analyzer.simplify(tile.splits())) == (2 if tail else 1)
    kernel = cuda_sgemm.kernel(product)
    a = rng.standard_normal((steps, batch, depth)).astype(np.float32)
    w = rng.standard_normal((outputs, depth)).astype(np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    out = np.full((steps, batch, outputs), np.nan, np.float32)
    given = w if weights == "rows" else np.ascontiguousarray(w.T)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, (a, given, b, out))}).run()
    want = a.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("steps, lengths, depth, outputs, weights", [
    (7, [3, 7, 1, 5, 7, 2, 6, 1, 4] * 4 + [7], 40, 132, "rows"), (5, [5] * 40, 128, 256, "cols"),
    (9, [1, 9, 4], 32, 128, "rows"), (6, [1] * 33, 16, 128, "rows"),
    (4, [30, 1, 4, 2], 16, 128, "rows")])
def test_sgemm_of_all_steps_with_lengths_writes_only_their_rows_on_the_simulator(
        steps, lengths, depth, outputs, weights, rng):
    """All steps' SGEMM that takes the samples' lengths: the rows (t, n) with t < lengths[n],
    laid out sample after sample (each tile's rows located by bisection of ``ends``), match
    float64; the rows past a sample's length stay as poisoned (unwritten), the tiles past
    the last row do nothing. Unsorted lengths with 1 and T among them, O not whole tiles and
    K not whole pairs of chunks (33 + 4 tiles' worth of rows: some tiles span several
    samples); all samples full, weights as columns; batch 3; every sample of length 1; a
    length past T (which a CUDA graph's replay may bring; ``ends`` counts it as T): its rows
    up to T, the other samples' in place, nothing written past T."""
    from rnncc.schedules import cuda_sgemm
    from tir_sim import Simulator

    batch = len(lengths)
    func = comp.gemm((tirx.Var("T", "int64"), batch), depth, outputs, weights, "float32",
                     lengths=True)
    product = cuda_sgemm.sizes(func)
    assert product.lengths and product.all_steps
    kernel = cuda_sgemm.apply(func, CUDA).mod["main"]
    a = rng.standard_normal((steps, batch, depth)).astype(np.float32)
    w = rng.standard_normal((outputs, depth)).astype(np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    out = np.full((steps, batch, outputs), np.nan, np.float32)
    given = w if weights == "rows" else np.ascontiguousarray(w.T)
    lens = np.array(lengths, np.int32)
    ends = np.cumsum(np.clip(lens, 0, steps)).astype(np.int32)  # as comp.length_ends
    args = (a, given, b, lens, ends, out)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    want = a.astype(np.float64) @ w.T.astype(np.float64) + b
    inside = np.arange(steps)[:, None] < lens[None, :]  # [T, N] (rows past T: none)
    assert np.abs(out[inside] - want[inside]).max() / np.abs(want).max() < TOL_F32
    assert np.isnan(out[~inside]).all()


@pytest.mark.parametrize("batch, depth, outputs, splits, rows", [
    (64, 1024, 4096, 8, 64), (64, 1536, 6144, 8, 64), (64, 1024, 3072, 16, 64),
    (64, 2048, 6144, 8, 64), (64, 4096, 1024, 32, 64), (64, 8192, 2048, 32, 64),
    (64, 2048, 8192, 8, 64), (32, 2048, 8192, 8, 64), (64, 4096, 16384, 4, 64),
    (96, 256, 1024, 8, 64), (33, 128, 128, 4, 64), (40, 32, 128, 1, 64), (32, 1500, 6000, 8, 64),
    (64, 1000, 4000, 8, 64), (33, 116, 132, 4, 64), (256, 1024, 4096, 4, 128),
    (128, 1024, 4096, 8, 128), (192, 1024, 3072, 4, 64), (200, 512, 2048, 8, 128),
    (256, 4096, 16384, 1, 128), (256, 256, 1024, 8, 128), (256, 512, 1536, 16, 128),
    (64, 256, 4096, 8, 64), (64, 1024, 256, 32, 64), (64, 768, 3072, 16, 64),
    (178, 1008, 1008, 16, 64), (64, 1008, 4032, 8, 64)])
def test_sgemm_splits_one_step_along_k(batch, depth, outputs, splits, rows):
    """One step's product: 64-row tiles of 128 threads, or from batch 128 tiles of 128 rows
    (256 threads, two a multiprocessor) where they pad no more rows (192: three of 64, not two
    of 128) and their grid has WIDE_STEP_BLOCKS blocks (LSTM 256 at batch 256: 64 blocks, so
    64 rows; GRU 512: 192); K in slices (the four standard batch-64 sizes as measured best,
    H200; a training step's dh of LSTM 1024 and 2048) of whole pairs of chunks, at least
    MIN_SLICE deep, the grid within SPLIT_BLOCKS, or DEEP_SPLIT_BLOCKS where slices of 64-row
    tiles would be deeper than DEEP_SLICE (LSTM 2048 at batch 32 and 64: 8 of 256, not 4 of
    512), down to SHALLOW_SLICE deep where slices of MIN_SLICE leave fewer than FEW_BLOCKS
    blocks (LSTMP 1024/256 at batch 64: W_hh's product in 8 slices of 32, W_hr's in 32; LSTM
    768: 16 of 48; LSTM 256 at batch 256: 8 of 32, 128 blocks, so 128 rows); K of whole
    pairs that no count divides so (1008: 63 pairs) in slices whose last is partly past K
    (tanh RNN 1008 at batch 178, LSTM 1008 at 64); the slices go to a workspace that a second
    kernel sums in order with the bias."""
    from rnncc.schedules import cuda_sgemm

    product = cuda_sgemm.sizes(comp.gemm((batch,), depth, outputs, "rows", "float32"))
    assert product.splits == splits and product.tile_rows == rows
    tiles = -(-batch // rows) * -(-outputs // cuda_sgemm.TILE)
    assert splits == 1 or tiles * splits <= cuda_sgemm.SPLIT_BLOCKS or (
        rows == 64 and tiles * splits <= cuda_sgemm.DEEP_SPLIT_BLOCKS
        and product.slice_chunks(splits // 2) * cuda_sgemm.BK > cuda_sgemm.DEEP_SLICE)
    deep = product.slice_chunks(splits) * cuda_sgemm.BK
    assert deep * splits == depth or (not product.whole and 0 <= deep * splits - depth
                                      < splits * 2 * cuda_sgemm.BK)
    most = max(s for s in product.split_choices()
               if s == 1 or tiles * s <= cuda_sgemm.SPLIT_BLOCKS)
    assert splits == 1 or deep >= cuda_sgemm.MIN_SLICE or (
        deep >= cuda_sgemm.SHALLOW_SLICE and tiles * most < cuda_sgemm.FEW_BLOCKS)
    func = cuda_sgemm.kernel(product).with_attr("global_symbol", "step")
    source = tvm.compile(tvm.IRModule({"main": func}), target=CUDA).mod.imports[0]
    bodies = kernel_bodies(source.inspect_source())
    assert len(bodies) == (2 if splits > 1 else 1)
    bounds = "256, 2" if rows == 128 else "128"
    assert f"__launch_bounds__({bounds}) step_kernel(" in source.inspect_source()
    if splits > 1:
        assert "blockIdx.z" in bodies["step_kernel"]
        (total,) = [body for name, body in bodies.items() if name != "step_kernel"]
        assert total.count("slices_ptr[") == splits and "b_ptr" in total


@pytest.mark.parametrize("batch, depth, outputs", [(33, 144, 132), (40, 80, 256)])
def test_sgemm_of_one_step_in_uneven_slices_matches_numpy_on_the_simulator(
        batch, depth, outputs, rng):
    """One step's product whose K is whole pairs of chunks that no count of slices divides
    (9 and 5 pairs): 2 slices, the last partly past K (its loads there zeros), summed in
    order with the bias by the second kernel; against float64, the output and the slices'
    workspace poisoned. (The interpreter runs each kernel on its own grid.)"""
    from rnncc.schedules import cuda_sgemm
    from tir_sim import Simulator

    product = cuda_sgemm.sizes(comp.gemm((batch,), depth, outputs, "rows", "float32"))
    assert product.splits == 2 and not product.whole
    assert product.slice_chunks(2) * cuda_sgemm.BK * 2 > depth
    kernel = cuda_sgemm.kernel(product)
    a = rng.standard_normal((batch, depth)).astype(np.float32)
    w = rng.standard_normal((outputs, depth)).astype(np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    out = np.full((batch, outputs), np.nan, np.float32)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, (a, w, b, out))}).run()
    want = a.astype(np.float64) @ w.T.astype(np.float64) + b
    assert np.abs(out - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("lead, pairs, weights", [
    pytest.param(("T", 64), "64", "rows", id="all_steps"),
    pytest.param((64,), "8", "rows", id="step"),
    pytest.param(("T", 64), "64", "cols", id="all_steps_cols", marks=pytest.mark.slow)])
def test_sgemm_is_double_buffered_with_one_barrier_a_chunk(lead, pairs, weights):
    """Two shared tiles an operand (k-major, rows padded), 16-byte loads, one barrier a chunk
    (TVM's barrier insertion adds none of its own), and registers for two blocks of 256
    threads (all steps, launch bounds that say so) or four of 128 (one step) a
    multiprocessor, no spills (ptxas, via nvcc) but at most 16 bytes of the kernel with a
    run-time count of slices (all steps' tail: so of chunks; the whole tiles' kernels, with
    all slices and without, have none). K = 1024: 64 pairs of chunks, or 8 in each of one
    step's 8 slices."""
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import cuda_sgemm

    lead = tuple(tirx.Var("T", "int64") if d == "T" else d for d in lead)
    gemm = comp.gemm(lead, 1024, 4096, weights, "float32")
    result = schedules.schedule(gemm, CUDA, "gemm")
    assert result.rule == "cuda.sgemm"
    product = cuda_sgemm.sizes(gemm)
    func = result.func.with_attr("global_symbol", "sgemm")
    source = tvm.compile(tvm.IRModule({"main": func}), target=CUDA).mod.imports[0]
    source = source.inspect_source()
    bodies = kernel_bodies(source)
    _, report = compile_cubin(source, "sm_90")
    tiles = ["sgemm_kernel"] + (["sgemm_kernel_1", "sgemm_kernel_2"] if product.all_steps
                                 else [])
    for name, chunk_pairs in zip(tiles, [pairs, pairs, None]):
        body = bodies[name]
        shared = re.findall(r"__shared__ alignas\(\d+\) float (\w+)_ptr\[(\d+)\]", body)
        sizes = {op: (cuda_sgemm.BK - 1) * (tile + cuda_sgemm.PAD) + tile
                 for op, tile in (("a", product.tile_rows), ("w", cuda_sgemm.TILE))}
        assert sorted(shared) == [(f"{op}_s{j}", str(sizes[op])) for op in "aw"
                                  for j in range(2)]
        loop = body.split(f"for (int c = 0; c < {chunk_pairs or ''}")[1]
        assert loop.count("__syncthreads()") == 2  # one a chunk
        assert body.count("__syncthreads()") == 3  # and one after the first chunk's stores
        assert loop.count("*(float4*)(af_ptr") == 2 * 2 * cuda_sgemm.BK
        assert loop.count("*(float4*)(ar_ptr") == 2 and "make_" not in loop  # whole vectors
        kernel = report[name]
        spills = 16 if chunk_pairs is None else 0
        assert kernel["spill_stores"] <= spills and kernel["spill_loads"] <= spills
        blocks = 2 if product.all_steps else 4
        bounds = "256, 2" if product.all_steps else "128"
        assert f"__launch_bounds__({bounds}) {name}(" in source
        assert kernel["registers"] <= 65536 // (blocks * product.threads)


def test_sgemm_of_one_step_at_batch_32_keeps_four_chunks_loads_in_flight():
    """At batch 32 (half a tile of rows) one step's product (LSTM 1024's: 8 slices of 16
    chunks) issues four chunks' loads before its first barrier, into register sets that ptxas
    keeps without spills within three blocks of 128 threads a multiprocessor, then goes
    through its chunks in groups of four (a loop), one barrier a chunk."""
    from rnncc.compiler.cuda_binary import compile_cubin

    gemm = comp.gemm((32,), 1024, 4096, "rows", "float32")
    result = schedules.schedule(gemm, CUDA, "gemm")
    assert result.rule == "cuda.sgemm"
    func = result.func.with_attr("global_symbol", "sgemm")
    source = tvm.compile(tvm.IRModule({"main": func}), target=CUDA).mod.imports[0]
    body = kernel_bodies(source.inspect_source())["sgemm_kernel"]
    first = body.split("__syncthreads()")[0]
    assert [f"(ar_ptr + {4 * j})" in first for j in range(5)] == [True] * 4 + [False]
    assert re.findall(r"for \(int (\w+) = 0; \w+ < (\d+)", body) == [("g", "4")]
    assert body.split("for (int g = 0;")[1].count("__syncthreads()") == 4
    _, report = compile_cubin(source.inspect_source(), "sm_90")
    kernel = report["sgemm_kernel"]
    assert kernel["spill_stores"] == kernel["spill_loads"] == 0
    assert kernel["registers"] <= 65536 // (3 * 128)


@pytest.mark.parametrize("batch, depth, outputs, choices", [
    (1, 4096, 1024, (1, 2, 4, 8, 16)), (64, 1024, 4096, (1, 2, 4, 8, 16)),
    (33, 48, 384, (1,)), (3, 256, 128, (1, 2, 4))])
def test_sgemm_of_all_steps_splits_k_where_t_leaves_few_tiles(batch, depth, outputs, choices):
    """The products of all steps (dx of a training step: [T*N, G*H] x [G*H, C]) choose their
    slices of K at run time for their tail, the tiles past the last whole wave of
    ALL_STEPS_SPLIT_BLOCKS (all of them where T*N leaves fewer): none where there is no tail,
    else the most slices (whole pairs of chunks, at least MIN_SLICE deep) that keep the
    tail's grid within a wave, summed in order with the bias by a fourth kernel (the first:
    every tile whole; the second: the whole waves' tiles, the third: the tail's slices); a
    product that K does not divide in two has the one kernel."""
    from rnncc.schedules import cuda_sgemm

    t_len = tirx.Var("T", "int64")
    product = cuda_sgemm.sizes(comp.gemm((t_len, batch), depth, outputs, "rows", "float32"))
    assert product.split_choices() == choices and product.splits == 1
    tile = cuda_sgemm.Tile(product)
    wave = cuda_sgemm.ALL_STEPS_SPLIT_BLOCKS
    for steps in (1, 7, 100, 1000, 2000):
        analyzer = tvm.sym.Analyzer()
        analyzer.bind(tile.t_len, tirx.const(steps, "int64"))
        count = analyzer.simplify(tile.splits())
        tiles = -(-steps * batch // product.tile_rows) * (outputs // cuda_sgemm.TILE)
        tail = tiles % wave
        assert int(analyzer.simplify(tile.tail())) == tail
        assert int(analyzer.simplify(tile.full())) == tiles - tail
        fits = [s for s in choices if s == 1 or 0 < tail * s <= wave]
        assert int(count) == max(fits), steps
    func = cuda_sgemm.kernel(product).with_attr("global_symbol", "g")
    bodies = kernel_bodies(tvm.compile(tvm.IRModule({"main": func}), target=CUDA)
                           .mod.imports[0].inspect_source())
    assert len(bodies) == (1 if choices == (1,) else 4)
    if len(bodies) == 4:
        assert "slices_ptr" not in bodies["g_kernel"] + bodies["g_kernel_1"]
        assert "blockIdx.y" in bodies["g_kernel_2"] and "slices_ptr" in bodies["g_kernel_2"]
        assert "slices_ptr" in bodies["g_kernel_3"] and "b_ptr" in bodies["g_kernel_3"]


@pytest.mark.parametrize("outputs, depth, splits", [(4096, 1024, 1), (2048, 512, 4),
                                                   (384, 128, 32), (1024, 256, 16)])
def test_weight_grad_tiles_the_gradient_and_splits_m_where_tiles_are_few(outputs, depth,
                                                                         splits):
    """A weight's gradient over the T*N rows of all steps: 128 x 128 tiles of dw, M in
    double-buffered chunks (one barrier a chunk, 16-byte loads and stores, registers for two
    blocks of 256 threads, no spills), sliced along M into a workspace summed by a second
    kernel where the tiles alone fill too few blocks (past 16 slices only while they take at
    most 8 MiB); float64 and the biases' column sums go to the next rule."""
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import cuda_weight_grad

    m = tirx.Var("M", "int64")
    result = schedules.schedule(comp.weight_gradient(m, outputs, depth, "float32", "float32"),
                                CUDA, "reduction")
    assert result.rule == "cuda.weight_grad"
    assert cuda_weight_grad.Gradient(outputs, depth).splits == splits
    source = tvm.compile(tvm.IRModule({"main": result.func.with_attr("global_symbol", "wg")}),
                         target=CUDA).mod.imports[0].inspect_source()
    bodies = kernel_bodies(source)
    assert len(bodies) == (1 if splits == 1 else 2)
    body = bodies["wg_kernel"]
    assert ("blockIdx.z" in body) == (splits > 1)
    loop = body.split("for (int64_t c = (int64_t)0; c < ")[1]
    assert loop.count("__syncthreads()") == 2 and body.count("__syncthreads()") == 3
    assert loop.count("condval_") and loop.count("*(float4*)(g_ptr") == 2
    _, report = compile_cubin(source, "sm_90")
    kernel = report["wg_kernel"]
    assert kernel["spill_stores"] == kernel["spill_loads"] == kernel["stack"] == 0
    assert kernel["registers"] <= 65536 // (2 * cuda_weight_grad.THREADS)
    assert cuda_weight_grad.apply(comp.weight_gradient(m, outputs, depth, "float64",
                                                       "float64"), CUDA) is None
    assert cuda_weight_grad.apply(comp.column_sum(m, outputs, "float32"), CUDA) is None


@pytest.mark.parametrize("steps, lengths, outputs, depth", [
    (7, [3, 7, 1, 5, 7, 2, 6, 1, 4], 128, 128),
    pytest.param(5, [5] * 3, 128, 128, marks=pytest.mark.slow),
    pytest.param(6, [1] * 5, 128, 128, marks=pytest.mark.slow), (4, [30, 1, 4, 2], 128, 128)])
def test_weight_grad_with_lengths_sums_only_their_rows_on_the_simulator(steps, lengths, outputs,
                                                                       depth, rng, monkeypatch):
    """A weight's gradient given the samples' lengths sums only the rows m = t*N + n with
    t < lengths[n] (located by bisection of ``ends``, M sliced over blocks): it matches
    float64 over those rows, while every other row of both operands holds NaN (never read).
    Unsorted lengths with 1 and T among them; all samples full; every sample of length 1; a
    length past T (counted as T). M in 16 slices (the simulator's time)."""
    from rnncc.schedules import cuda_weight_grad
    from tir_sim import Simulator

    monkeypatch.setattr(cuda_weight_grad, "MANY_SPLITS", cuda_weight_grad.MAX_SPLITS)

    batch = len(lengths)
    func = comp.weight_gradient(tirx.Var("M", "int64"), outputs, depth, "float32", "float32",
                                batch=batch)
    assert cuda_weight_grad.sizes(func).batch == batch
    kernel = cuda_weight_grad.apply(func, CUDA).mod["main"]
    lens = np.array(lengths, np.int32)
    inside = (np.arange(steps)[:, None] < lens[None, :]).reshape(-1)  # rows t*N + n
    g = rng.standard_normal((steps * batch, outputs)).astype(np.float32)
    a = rng.standard_normal((steps * batch, depth)).astype(np.float32)
    g[~inside], a[~inside] = np.nan, np.nan
    ends = np.cumsum(np.clip(lens, 0, steps)).astype(np.int32)  # as comp.length_ends
    dw = np.full((outputs, depth), np.nan, np.float32)
    args = (g, a, lens, ends, dw)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    want = g[inside].astype(np.float64).T @ a[inside].astype(np.float64)
    assert np.abs(dw - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("outputs, depth, rows, dtypes, lengths, splits", [
    (99, 33, 37, ("float32",) * 3, None, 16),
    pytest.param(128, 32, 50, ("float16",) * 3, None, 256, marks=pytest.mark.slow),
    (130, 12, 0, ("float16", "float32", "float16"), [3, 7, 1, 5], 16),
    pytest.param(260, 257, 19, ("float32", "float16", "float32"), None, 16,
                 marks=pytest.mark.slow)])
def test_weight_grad_of_any_size_and_16_bit_operands_on_the_simulator(
        outputs, depth, rows, dtypes, lengths, splits, rng, monkeypatch):
    """O and K off whole tiles (past a tile's last column, and rows that are not whole
    4-vectors), 16-bit operands widened as they are staged, dw in its own type, M split in
    256 slices where the tiles are few (elsewhere 16 here, the simulator's time), the samples'
    lengths: against float64 of the rounded operands, dw poisoned, M's rows past the sum (or
    past the lengths) NaN."""
    from rnncc.schedules import cuda_weight_grad
    from tir_sim import Simulator

    if splits <= cuda_weight_grad.MAX_SPLITS:
        monkeypatch.setattr(cuda_weight_grad, "MANY_SPLITS", cuda_weight_grad.MAX_SPLITS)

    g_dtype, a_dtype, dw_dtype = dtypes
    batch = len(lengths) if lengths else None
    func = comp.weight_gradient(tirx.Var("M", "int64"), outputs, depth, dw_dtype, a_dtype,
                                g_dtype, batch)
    found = cuda_weight_grad.sizes(func)
    assert (found.outputs, found.depth, found.g_dtype, found.a_dtype) == (outputs, depth,
                                                                          g_dtype, a_dtype)
    assert found.splits == splits
    kernel = cuda_weight_grad.apply(func, CUDA).mod["main"]
    if lengths:
        steps = max(lengths)
        lens = np.array(lengths, np.int32)
        inside = (np.arange(steps)[:, None] < lens[None, :]).reshape(-1)
        rows = steps * batch
    else:
        inside = np.ones(rows, bool)
    g = rng.standard_normal((rows, outputs)).astype(g_dtype)
    a = rng.standard_normal((rows, depth)).astype(a_dtype)
    g[~inside], a[~inside] = np.nan, np.nan
    dw = np.full((outputs, depth), np.nan, dw_dtype)
    given = (lens, np.cumsum(lens).astype(np.int32)) if lengths else ()
    args = (g, a, *given, dw)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    want = g[inside].astype(np.float64).T @ a[inside].astype(np.float64)
    tol = TOL_F32 if dw_dtype == "float32" else 2e-3
    assert np.abs(dw.astype(np.float64) - want).max() / np.abs(want).max() < tol


@pytest.mark.parametrize("arch, tensor_cores, few", [
    ("sm_80", "cuda.mma_gemm", "cuda.weight_grad"),
    ("sm_90", "cuda.wgmma_gemm", "cuda.wgmma_gemm")])
def test_half_weight_gradients_of_few_tiles_split_m_on_the_cuda_cores(arch, tensor_cores,
                                                                     few):
    """Before sm_90, a 16-bit weight gradient of under 8 tiles (a block a tile on tensor
    cores, M not split: float16 LSTM 128's 512 x 128, 4 tiles) goes to cuda.weight_grad,
    which splits M over the GPU; from 8 tiles on, tensor cores (but dW past whole tiles). On
    sm_90 warpgroup MMA takes them all, splitting M where the tiles are few."""
    from rnncc.target import TargetSpec

    target = TargetSpec("cuda", arch=arch).tvm_target()
    m = tirx.Var("M", "int64")
    for (outputs, depth), rule in (((512, 128), few), ((384, 128), few),
                                   ((1024, 128), tensor_cores), ((1024, 256), tensor_cores),
                                   ((4000, 1000), few), ((6000, 1500), few)):  # past tiles
        for dtype in ("float16", "bfloat16"):
            func = comp.weight_gradient(m, outputs, depth, dtype, dtype, dtype)
            assert schedules.schedule(func, target, "reduction").rule == rule


@pytest.mark.parametrize("outputs, depth, rows, splits", [
    (512, 128, 300, 32), (256, 512, 1500, 16), (200, 72, 300, 32), (204, 76, 300, 32),
    pytest.param(1000, 1096, 40, 1, marks=pytest.mark.slow)])
def test_wgmma_gradient_of_few_tiles_splits_m_on_the_simulator(outputs, depth, rows, splits,
                                                                rng):
    """A half weight gradient of few tiles on warpgroup MMA splits M in slices (each slice
    the same count of chunks, those past M zeros) into a float32 workspace that a second
    kernel adds in order; dW past whole tiles (200 x 72, 1000 x 1096: the pieces past O or K
    read their last, nothing stored there; 204 x 76: rows of 8-byte copies), split or not:
    against float64 of the rounded operands, dw poisoned; no spills."""
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm
    from tir_sim import Simulator

    func = comp.weight_gradient(tirx.Var("M", "int64"), outputs, depth, "float16", "float16",
                                "float16")
    product = cuda_mma_gemm.product_of(func, CUDA)
    cols = cuda_wgmma_gemm.columns(product)
    assert cuda_wgmma_gemm.gradient_splits(product, cols) == splits
    assert cuda_wgmma_gemm.Plan(product, cols).narrow == (outputs % 8 != 0, depth % 8 != 0)
    kernel = cuda_wgmma_gemm.kernel(product)
    g = rng.standard_normal((rows, outputs)).astype("float16")
    a = rng.standard_normal((rows, depth)).astype("float16")
    args = [g, a, np.full((outputs, depth), np.nan, "float16")]
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    want = g.astype(np.float64).T @ a.astype(np.float64)
    assert np.abs(args[-1].astype(np.float64) - want).max() / np.abs(want).max() < 2.0 ** -11
    source = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "wg")}),
                         target=CUDA).mod.imports[0].inspect_source()
    _, report = compile_cubin(source, "sm_90a")
    assert all(k["spill_stores"] == k["stack"] == 0 for k in report.values()), report


def test_tf32_rounding_to_nearest_ties_away(rng):
    """``rnncc.dtypes.round_tf32`` built for this CPU: normal floats to the nearest value of 10
    mantissa bits, ties away from zero (computed here from frexp), the largest float to
    infinity, zeros, infinities and NaNs as they are."""
    from tvm import te

    from rnncc.dtypes import round_tf32

    x = te.placeholder((64,), "float32", "x")
    func = te.create_prim_func([x, te.compute((64,), lambda i: round_tf32(x[i]), name="r")])
    lib = tvm.compile(func, target="llvm")
    ties = np.float32(1 + 2.0 ** -11) * np.array([1, -1, 3, -1024], np.float32)
    near = np.nextafter(ties, np.float32(0))  # just below a tie: rounded down in magnitude
    values = np.concatenate([rng.standard_normal(48).astype(np.float32) * 100, ties, near,
                             np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -7.5]),
                             [np.finfo(np.float32).max]])
    out = tvm.runtime.tensor(np.zeros(64, np.float32))
    lib(tvm.runtime.tensor(values), out)
    got = out.numpy()
    finite = np.isfinite(values)
    finite[-1] = False  # the largest float: rounded up, past the largest TF32 value
    m, e = np.frexp(values[finite].astype(np.float64))
    scaled = m * 2.0 ** 11
    want = np.ldexp(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), e - 11)
    np.testing.assert_array_equal(got[finite], want.astype(np.float32))
    assert got[-1] == np.inf and np.isnan(got[np.isnan(values)]).all()
    assert np.array_equal(got[np.isinf(values)], values[np.isinf(values)])
    assert np.signbit(got[np.argwhere(values == 0)[1]])  # -0 stays -0


def test_tf32_products_only_where_allowed():
    """allow_tf32=True on an sm_80 GPU: the float32 products of all steps (cuda.mma_gemm) and
    each step's at 9 to 256 batch rows (cuda.mma_gemv) on tensor cores in TF32 (m16n8k8, no
    spills); without it, and on the CPU, the same components stay IEEE float32."""
    from conftest import has_nvcc
    from rnncc.compiler.cuda_binary import compile_cubin

    problem = Problem(rnncc.cells.get("lstm"), 128, 1024, 64, "float32", allow_tf32=True)
    tf32 = sequence.build(problem, Options(persistent="off"), AMPERE)
    ieee = sequence.build(replace(problem, allow_tf32=False),
                          Options(persistent="off", tf32x3=False), AMPERE)
    keys = ("input_gemm", "recurrent_gemm")
    assert [tf32.rules[k] for k in keys] == ["cuda.mma_gemm", "cuda.mma_gemv"]
    assert "mma" not in " ".join(ieee.rules[k] for k in keys)
    cpu = TargetSpec("llvm").tvm_target()
    assert sequence.build(problem, Options(), cpu).rules == sequence.build(
        replace(problem, allow_tf32=False), Options(), cpu).rules
    source = tvm.compile(tf32.mod, target=AMPERE).mod.imports[0].inspect_source()
    assert source.count("m16n8k8") >= 2 and ".tf32.tf32" in source
    if has_nvcc():
        _, report = compile_cubin(source, "sm_80")
        assert not any(k["spill_stores"] or k["stack"] for k in report.values()), report


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_mma_gemm_takes_the_half_products_of_all_steps_and_the_weight_gradients(dtype):
    """Half-precision training at batch 64 (no persistent kernel) on an sm_80 GPU: the input
    projection of all steps, dx and both weight gradients on tensor cores (cuda.mma_gemm, no
    spills; the projections of rows, and one step's slices, copied ahead by cp.async), each
    step's products on cuda.mma_gemv or in slices on cuda.mma_gemm; float32, sizes off its
    tiles, one step's product whole and GPUs before sm_80 go to the next rule."""
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import cuda_mma_gemm

    problem = Problem(rnncc.cells.get("lstm"), 128, 256, 64, dtype, training=True)
    rules = sequence.build(problem, Options(), AMPERE).rules
    tensor_cores = {"input_gemm": "cuda.mma_gemm", "input_gemm_backward": "cuda.mma_gemm",
                    "weight_grad_ih": "cuda.mma_gemm", "weight_grad_hh": "cuda.mma_gemm",
                    "recurrent_gemm": "cuda.mma_gemv", "recurrent_gemm_backward": "cuda.mma_gemv"}
    assert {key: rules[key] for key in tensor_cores} == tensor_cores
    t_len, m = tirx.Var("T", "int64"), tirx.Var("M", "int64")
    # (component, pipelined, bytes ptxas may spill): a gradient's kernel, held to 128 registers
    # (two blocks a multiprocessor), spills 8 where M is free (none in a module: M = T*N)
    for func, pipelined, spill in (
            (comp.gemm((t_len, 64), 1024, 4096, "cols", dtype, "float32"), False, 0),
            (comp.weight_gradient(m, 4096, 1024, dtype, "float32"), False, 8),
            (comp.gemm((t_len, 64), 1024, 4096, "rows", dtype, dtype), True, 0),
            (comp.gemm_parts(64, 1024, 4096, 8, "rows", dtype, "float32"), True, 0)):
        source = tvm.compile(tvm.IRModule({"main": cuda_mma_gemm.apply(func, CUDA).mod[
            "main"].with_attr("global_symbol", "mg")}), target=CUDA).mod.imports[0]
        _, report = compile_cubin(source.inspect_source(), "sm_90")
        assert max(report["mg_kernel"]["spill_stores"], report["mg_kernel"]["stack"]) <= spill
        assert ("cp.async.cg.shared.global" in source.inspect_source()) == pipelined
    declined = [comp.gemm((t_len, 64), 1024, 4096, "rows", "float32", "float32"),
                comp.gemm((t_len, 64), 1024, 4000, "rows", dtype, dtype),  # O % 128
                comp.gemm((t_len, 64), 1056, 4096, "rows", dtype, dtype),  # K % 64
                comp.gemm((64,), 1024, 4096, "rows", dtype, "float32"),  # one step
                comp.weight_gradient(m, 4096, 1000, dtype, "float32"),
                comp.weight_gradient(m, 4096, 1024, "float32", "float32")]
    for func in declined:
        assert cuda_mma_gemm.apply(func, CUDA) is None
    old_gpu = TargetSpec("cuda", arch="sm_75").tvm_target()
    assert cuda_mma_gemm.apply(comp.weight_gradient(m, 128, 128, dtype, dtype), old_gpu) is None


@pytest.mark.parametrize("batch, k, o, dtype, parts", [
    (64, 1024, 4096, "float16", 8), (256, 2048, 8192, "float16", 2), (256, 512, 2048, "tf32", 4),
    (64, 512, 1536, "tf32", 1), (63, 1024, 4096, "float16", 8), (256, 1024, 16384, "bfloat16", 1),
    (256, 1024, 4096, "float32", 1), (32, 2048, 8192, "bfloat16", 4),
    (31, 2048, 8192, "float16", 1), (16, 1024, 4096, "tf32", 8), (24, 2048, 8192, "tf32", 4),
    (16, 2048, 8192, "tf32", 1), (15, 2048, 8192, "tf32", 1),
    (64, 4096, 1024, "bfloat16", 16), (64, 3072, 1024, "float16", 16),
    (64, 8192, 1024, "bfloat16", 16)])
def test_mma_gemm_slices_one_step_products_to_fill_the_gpu(batch, k, o, dtype, parts):
    """One step's product of 32 rows and more on tensor cores (16 in TF32): K in the fewest
    slices that give 256 blocks (two a multiprocessor), up to 8 (16 in a 64-row tile: the
    backward pass's dGH W_hh, O = H), each at least 128 deep; none where the
    tiles alone give them (the whole product is then this rule's), or where even the slices
    give under 64 blocks, or under those rows (cuda.mma_gemv's); IEEE float32 is not this
    rule's, nor TF32 at batch 16 with 48 MiB of weights (cuda.small_batch_gemv's); slices of
    another count (a reader's choice for another rule) are not taken."""
    from rnncc.schedules import _mma, cuda_mma_gemm

    tf32 = dtype == "tf32"
    dtype = "float32" if tf32 else dtype

    def allowed(func):
        return func.with_attr(_mma.TF32_ATTR, True) if tf32 else func

    whole = allowed(comp.gemm((batch,), k, o, "rows", dtype, "float32"))
    assert cuda_mma_gemm.parts(whole, CUDA) == parts
    fewest = cuda_mma_gemm.MIN_BATCH["tf32" if tf32 else "half"]
    takes_whole = parts == 1 and batch >= fewest and o // 128 * -(-batch // 128) >= 256
    assert (cuda_mma_gemm.apply(whole, CUDA) is not None) == takes_whole
    for count in (2, 4, 8, 16, 32):
        sliced = allowed(comp.gemm_parts(batch, k, o, count, "rows", dtype, "float32"))
        assert (cuda_mma_gemm.apply(sliced, CUDA) is not None) == (count == parts)


def _product_case(form, dtype, k, rng, m_rows=70, truncated=False, h_copied=False):
    """(component, arguments with a poisoned output, float64 expected output) of a product
    the tensor-core GEMM rules take, in ``form``: "rows" (a projection of T*N = 135 rows, a of
    the weights' type, w [O, K]), "cols" (float32 a, w [K, O]), "flat" (135 flat rows), "step"
    (one step's N = 135 float32 rows; ``h_copied``: in the weights' type), "slices" (64 rows
    in 2 slices of K; ``h_copied``: 135 rows in the weights' type),
    "gradient" (over M = ``m_rows`` rows, g and a float32), "gradient_half" (g and a in
    ``dtype``); O = 256; ``dtype`` "tf32": float32 allowed TF32 (both sides rounded to it),
    "tf32x3": float32 allowed three TF32 products (nothing rounded). The expected output is of
    the rounded operands (a slice form's summed; TF32 ``truncated``: of the operands as the
    tensor cores read them unrounded)."""
    from rnncc.schedules import _mma

    tf32, split = dtype == "tf32", dtype == "tf32x3"
    dtype = "float32" if tf32 or split else dtype

    def rounded(x):
        if tf32:
            return (truncate_tf32(x) if truncated else round_tf32(x)).astype(np.float64)
        return x.astype(dtype).astype(np.float64)

    steps, n, o = 3, 45, 256
    m = tirx.Var("M", "int64")
    if form.startswith("gradient"):
        given = dtype if form == "gradient_half" else "float32"
        func = comp.weight_gradient(m, o, k, dtype, given, given)
        g, a = (rng.standard_normal(s).astype(given) for s in ((m_rows, o), (m_rows, k)))
        func = func.with_attr(_mma.TF32X3_ATTR, True) if split else func
        return func, [g, a, np.full((o, k), np.nan, dtype)], rounded(g).T @ rounded(a)
    if form in ("step", "slices"):
        rows = steps * n if form == "step" or h_copied else 64
        h_dtype = dtype if h_copied else "float32"
        func = (comp.gemm((rows,), k, o, "rows", dtype, h_dtype) if form == "step"
                else comp.gemm_parts(rows, k, o, 2, "rows", dtype, h_dtype))
        h = rng.standard_normal((rows, k)).astype(h_dtype)
        w, b = rng.standard_normal((o, k)).astype(dtype), rng.standard_normal(o).astype(dtype)
        want = rounded(h) @ rounded(w).T + (b.astype(np.float64) if form == "step" else 0)
        args = ([h, w, b, np.full((rows, o), np.nan, np.float32)] if form == "step"
                else [h, w, np.full((2, rows, o), np.nan, np.float32)])
    else:
        lead = (m,) if form == "flat" else (tirx.Var("T", "int64"), n)
        a_dtype = "float32" if form == "cols" else dtype
        func = comp.gemm(lead, k, o, "cols" if form == "cols" else "rows", dtype, a_dtype)
        a = rng.standard_normal((steps * n, k) if form == "flat" else (steps, n, k))
        w, b = rng.standard_normal((o, k)), rng.standard_normal(o)
        args = [a.astype(a_dtype), (w.T if form == "cols" else w).astype(dtype), b.astype(dtype),
                np.full(a.shape[:-1] + (o,), np.nan, np.float32)]
        want = rounded(args[0]) @ rounded(w.astype(dtype)).T + args[2].astype(np.float64)
    if split:
        return func.with_attr(_mma.TF32X3_ATTR, True), args, want
    return (func.with_attr(_mma.TF32_ATTR, True) if tf32 else func), args, want


@pytest.mark.parametrize("form", [
    "flat", *(pytest.param(f, marks=pytest.mark.slow) for f in ("rows", "step", "slices",
                                                                  "gradient"))])
def test_mma_gemm_splits_float32_into_three_tf32_products_on_the_simulator(form, monkeypatch,
                                                                          rng):
    """cuda.mma_gemm with float32 allowed as three TF32 products (rnncc.tf32x3: the option
    tf32x3): on the NumPy interpreter (whose TF32 products drop the operands' low bits and
    round their sums toward zero, as the tensor cores do), within a fifth of float32's bound
    of the float64 product of the operands as they are (K = 512; IEEE float32's FMAs about
    5e-7; the three products summed over all of K on the tensor cores 4.5e-6); one TF32
    product a term misses float32's bound 10x over. Components that it cannot split (w [K,
    O]) or that give lengths stay with the other rules. A weight gradient (over M = 70 rows,
    the last chunk pair partly past M) of any tiles here (the rule's policy lowered)."""
    from rnncc.schedules import _mma, cuda_mma_gemm
    from tir_sim import Simulator

    monkeypatch.setattr(cuda_mma_gemm, "SPLIT_GRADIENT_TILES", 1)
    func, args, want = _product_case(form, "tf32x3", 512, rng)
    product = cuda_mma_gemm.product_of(func, CUDA)
    assert product.op is _mma.TF32X3
    for op, bound in ((_mma.TF32X3, TOL_F32 / 5), (_mma.TF32, None)):
        kernel = cuda_mma_gemm.kernel(replace(product, op=op))
        run = [x.copy() for x in args]
        Simulator(kernel, {p.name: x for p, x in zip(kernel.params, run)}).run()
        got = run[-1].astype(np.float64)
        got = got.sum(0) if form == "slices" else got
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < bound if bound else error > 10 * TOL_F32, (op, error)
    assert cuda_mma_gemm.product_of(_product_case("cols", "tf32x3", 256, rng)[0], CUDA) is None
    given = comp.gemm((tirx.Var("T", "int64"), 45), 256, 256, "rows", "float32", lengths=True)
    assert cuda_mma_gemm.product_of(given.with_attr(_mma.TF32X3_ATTR, True), CUDA) is None


def test_the_tf32x3_option_puts_float32_products_of_many_rows_on_tensor_cores():
    """Options(tf32x3=True): an IEEE float32 layer's products of all steps and its step's
    slices at batch 256 go to cuda.wgmma_gemm on sm_90, cuda.mma_gemm on sm_80; without the
    option to the CUDA cores' rules, and at batch 8 both (cuda.sgemm splits the few rows'
    K); at batch 16 the step's product stays there, at 32 it splits (cuda.mma_gemm's slices
    to batch 64)."""
    problem = Problem(rnncc.cells.get("lstm"), 512, 1024, 256, "float32")
    for target, rule in ((CUDA, "cuda.wgmma_gemm"), (AMPERE, "cuda.mma_gemm")):
        rules = sequence.build(problem, Options(persistent="off", tf32x3=True), target).rules
        assert rules["input_gemm"] == rules["recurrent_gemm_parts"] == rule
    rules = sequence.build(problem, Options(persistent="off", tf32x3=False), CUDA).rules
    assert rules["input_gemm"] == "cuda.sgemm"
    small = replace(problem, batch=8)
    rules = sequence.build(small, Options(persistent="off", tf32x3=True), CUDA).rules
    assert (rules["input_gemm"], rules["recurrent_gemm"]) == (
        "cuda.sgemm", "cuda.small_batch_gemv")
    rules = sequence.build(replace(problem, batch=16), Options(persistent="off", tf32x3=True),
                           CUDA).rules
    assert (rules["input_gemm"], rules["recurrent_gemm"]) == (
        "cuda.wgmma_gemm", "cuda.small_batch_gemv")
    rules = sequence.build(replace(problem, batch=32), Options(persistent="off", tf32x3=True),
                           CUDA).rules
    assert rules["recurrent_gemm_parts"] == "cuda.mma_gemm"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_simulator_runs_mma_on_the_warps_a_condition_holds(dtype):
    """tests/tir_sim.py: an ``mma.sync`` under a condition that holds for one warp of two adds
    into that warp's sums only (the simulator once wrote every warp's)."""
    from tvm.script import tirx as T

    from rnncc.schedules import _mma
    from tir_sim import Simulator

    op = _mma.Operand(dtype)
    one = T.float16(1) if dtype == "float16" else T.float32(1)

    @T.prim_func(s_tir=True)
    def kernel(out: T.Buffer((64, 4), "float32")):
        with T.sblock("root"):
            af = T.sblock_alloc_buffer((8,), dtype, scope="local")
            wb = T.sblock_alloc_buffer((4,), dtype, scope="local")
            acc = T.sblock_alloc_buffer((4,), "float32", scope="local")
            for tx in T.thread_binding(64, thread="threadIdx.x"):
                for i in T.unroll(8):
                    af[i] = one
                for i in T.unroll(4):
                    wb[i] = one
                for i in T.unroll(4):
                    acc[i] = T.float32(1)
                if tx < 32:
                    _mma.mma(op, af, wb, acc, 0)
                for i in T.unroll(4):
                    out[tx, i] = acc[i]

    out = np.full((64, 4), np.nan, np.float32)
    Simulator(kernel, {"out": out}).run()
    depth = 16 if dtype == "float16" else 8  # k of one instruction
    assert (out[:32] == 1 + depth).all() and (out[32:] == 1).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32"])
@pytest.mark.parametrize("form", ["rows", pytest.param("cols", marks=pytest.mark.slow), "flat",
                                  pytest.param("gradient", marks=pytest.mark.slow),
                                  "gradient_half", "step", "slices"])
def test_mma_gemm_matches_numpy_on_the_simulator(form, dtype, rng):
    """cuda.mma_gemm's kernel on the NumPy interpreter of TIR (tests/tir_sim.py): a
    projection of T*N = 135 rows (two row tiles, the second partial) with weights [O, K] and
    a of the weights' type (pipelined), [K, O] and float32 a (through registers), flat rows;
    one step's product of N = 135 float32 rows (h), and one of 64 rows (a 64-row tile) in 2
    slices of K; a gradient over M = 70 rows (the last chunk pair partly past M) of float32 g
    and a, and of both in the weights' type (a half training step's, before sm_90); against
    NumPy's product of the same rounded operands (float32 rounded to TF32 where the component
    allows it: projections only). The kernel at these sizes, whatever the grid's policy."""
    from rnncc.schedules import cuda_mma_gemm
    from tir_sim import Simulator

    if dtype == "tf32" and form.startswith("gradient"):
        pytest.skip("the weight gradients stay IEEE float32 with allow_tf32")
    func, args, want = _product_case(form, dtype, 128, rng)
    kernel = cuda_mma_gemm.kernel(cuda_mma_gemm.product_of(func, CUDA))
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    got = args[-1].astype(np.float64)
    got = got.sum(0) if form == "slices" else got
    bound = TOL_F32 if not form.startswith("gradient") else 2.0 ** -(
        8 if dtype == "bfloat16" else 11)
    assert np.abs(got - want).max() / np.abs(want).max() < bound


@pytest.mark.parametrize("batch, k, o, dtype, parts, cols", [
    (256, 1024, 4096, "tf32", 2, 128), (128, 1024, 4096, "tf32", 4, 128),
    (256, 2048, 6144, "tf32", 2, 256), (512, 1024, 4096, "tf32", 1, 128),
    (256, 1024, 3072, "float16", 4, 256), (256, 2048, 8192, "bfloat16", 2, 256),
    (128, 1024, 4096, "float16", 8, 256), (100, 1024, 1024, "float16", 0, 0),
    (128, 4096, 1024, "bfloat16", 0, 0), (64, 2048, 6144, "tf32", 2, 128),
    (33, 1024, 4096, "float16", 8, 256), (16, 1024, 4096, "tf32", 4, 128)])
def test_wgmma_gemm_slices_one_step_products_in_one_wave(batch, k, o, dtype, parts, cols):
    """On sm_90 one step's product in tiles of N rows goes in the fewest slices of K whose
    grid is one wave (96 to 132 blocks; tiles of 64 rows at batch 64 and less), in tiles 256
    wide where each slice is at least 1024 deep or h goes through registers (float32 under
    half weights), else 128 wide; where no count gives one wave (100 x 1024 x 1024: 64 blocks
    at most: ``parts`` 0), the slices are cuda.mma_gemm's. Where its tiles are swapped instead
    (:func:`cuda_wgmma_gemm.swapped`), theirs. cuda.wgmma_gemm takes the chosen count only;
    on sm_80 the count is cuda.mma_gemm's."""
    from rnncc import schedules
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_gemm

    tf32 = dtype == "tf32"
    dtype = "float32" if tf32 else dtype

    def product(count):
        func = (comp.gemm((batch,), k, o, "rows", dtype, "float32") if count == 1
                else comp.gemm_parts(batch, k, o, count, "rows", dtype, "float32"))
        return func.with_attr(_mma.TF32_ATTR, True) if tf32 else func

    found = cuda_mma_gemm.product_of(product(1), CUDA)
    rows_shape = cuda_wgmma_gemm.unswapped(found)
    assert (rows_shape.slices, rows_shape.cols) == (parts, cols) if parts else rows_shape is None
    chosen = cuda_wgmma_gemm.one_step(found)
    assert chosen == (rows_shape and (cuda_wgmma_gemm.swapped(found) or rows_shape))
    parts = chosen.slices if chosen else schedules.cuda_mma_gemm.parts(product(1), CUDA)
    assert schedules.product_parts(product(1), CUDA) == parts
    assert schedules.product_parts(product(1), AMPERE) == cuda_mma_gemm.parts(product(1), AMPERE)
    for count in (1, 2, 4, 8, 16, 32):
        assert (cuda_wgmma_gemm.sizes(product(count), CUDA) is not None) == (count == parts)
    if chosen:
        assert cuda_wgmma_gemm.columns(cuda_mma_gemm.product_of(product(parts), CUDA)) == (
            chosen.cols)


@pytest.mark.parametrize("cell, size, batch, step_rule", [
    ("lstm", 1500, 32, "cuda.sgemm"), ("gru", 1500, 33, "cuda.wgmma_gemm"),
    ("lstm", 1000, 128, "cuda.wgmma_gemm"), ("gru", 1024, 48, "cuda.mma_gemm")])
def test_split_float32_past_whole_tiles_is_on_warpgroup_mma(cell, size, batch, step_rule):
    """IEEE float32 (tf32x3) whose K or O is past whole tiles and chunks (H 1500, 1000) has
    its products on cuda.wgmma_gemm as three TF32 products (they were on the CUDA cores):
    all steps', and each step's from N 33 (in 64-row tiles to N 64: over half of one; N 32
    stays cuda.sgemm's); whole tiles keep cuda.mma_gemm's step at N <= 64."""
    lowered = sequence.build(Problem(rnncc.cells.get(cell), size, size, batch),
                             Options(persistent="off"), CUDA)
    rules = lowered.rules
    assert rules["input_gemm"] == "cuda.wgmma_gemm"
    assert rules.get("recurrent_gemm_parts", rules["recurrent_gemm"]) == step_rule, rules


@pytest.mark.parametrize("rows, k, o, parts, cols, dtype", [
    (33, 200, 150, 2, 40, "float16"), (45, 136, 136, 1, 48, "bfloat16"),
    (40, 128, 128, 1, 24, "float16"), (17, 96, 70, 1, 24, "tf32"),
    (150, 256, 130, 2, 80, "float16")])
def test_swapped_tiles_match_numpy_on_the_simulator(rows, k, o, parts, cols, dtype, rng):
    """One step's product in swapped tiles (W as the instructions' A, 64 rows of O; h as B,
    ``cols`` of its N rows: 24, not a multiple of 16, leaves the last copies to some threads
    only), whole (plus b) or in slices, K and O past whole chunks and tiles, N in one tile or
    two: the transposed sums stored within N and O; against NumPy's product of the same
    rounded operands."""
    from rnncc.schedules import cuda_wgmma_gemm

    case = _one_step_product_case(rows, k, o, parts, dtype, rng)
    kernel = cuda_wgmma_gemm.kernel(case.product, cols, swapped=True)
    assert _simulated_error(kernel, case) < TOL_F32


@pytest.mark.parametrize("rows, k, o, dtype, shape", [
    (79, 952, 3808, "float16", (2, 80)), (191, 600, 2400, "float16", (1, 96)),
    (37, 1024, 3072, "bfloat16", (2, 40)), (64, 2048, 8192, "float16", (2, 64)),
    (256, 1024, 4096, "float16", (1, 128)), (79, 952, 3808, "tf32", (2, 80)),
    (256, 2048, 8192, "float16", None), (64, 1500, 6000, "float16", None),
    (300, 1024, 4096, "float16", None), (79, 1024, 4096, "tf32x3", None)])
def test_one_step_products_swap_their_tiles_where_few_rows_fill_one_wave(rows, k, o, dtype,
                                                                          shape):
    """One step's product of both operands copied as stored swaps its tiles (W_hh as the
    instructions' A, 64 rows of O a tile; h's N rows as B, in the fewest tiles of at most 128,
    a multiple of 8 each) where those tiles are one wave or less: the most slices of K whose
    grid is one wave, or two where a slice is 2048 bytes deep or more; not where the whole
    product's tiles are over one wave (256 x 2048 x 8192), nor rows of K of 8-byte copies
    (K 1500), nor N over 256, nor split float32."""
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_gemm

    weights = "float16" if dtype == "float16" else "bfloat16" if dtype == "bfloat16" else (
        "float32")
    func = comp.gemm_parts(rows, k, o, 2, "rows", weights, weights)
    func = func.with_attr(_mma.TF32_ATTR if dtype == "tf32" else _mma.TF32X3_ATTR, True) if (
        weights == "float32") else func
    found = cuda_mma_gemm.product_of(func, CUDA)
    got = cuda_wgmma_gemm.swapped(found)
    assert got == (shape and cuda_wgmma_gemm.Shape(*shape, True))
    if shape:
        plan = cuda_wgmma_gemm.Plan(found, shape[1], swapped=True)
        assert (plan.which, plan.rows, plan.threads, plan.tma) == ((1, 0), 64, 128, False)
        assert plan.grid == -(-o // 64) * -(-rows // shape[1]) * found.parts


@pytest.mark.parametrize("cols", [128, pytest.param(256, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32", "tf32x3"])
@pytest.mark.parametrize("form", ["rows", pytest.param("cols", marks=pytest.mark.slow), "flat",
                                  "step", "slices", pytest.param("gradient",
                                                                 marks=pytest.mark.slow),
                                  "gradient_half"])
def test_wgmma_gemm_matches_numpy_on_the_simulator(form, dtype, cols, rng):
    """cuda.wgmma_gemm's kernel on the NumPy interpreter of TIR (warpgroup MMA through matrix
    descriptors of 128-byte swizzled rows): a projection of T*N = 135 rows (two row tiles, the
    second partial) of a in the weights' type, flat rows; w [K, O] (MN-major, transposed in
    the instruction) under float32 a; one step's product of N = 135 float32 rows (h, rounded
    through registers) and one of 64 rows (a one-warpgroup tile) in 2 slices of K; K of 6
    chunks (12 in TF32: both operands copied and read as stored) so that chunks are copied
    ahead in the loop; a weight gradient (both operands MN-major) over M = 300 rows (5 chunks,
    the last partly past M: zero-filled copies or zeros through registers) of float32 or
    half g and a; against NumPy's product of the same rounded operands (TF32: truncated, as
    the tensor cores and the simulator read them; rounded to nearest, 1e-4 off, would fail
    float32's bound). Float32 split in three TF32 products
    (tf32x3; tiles of 128 columns, the small parts in twins past the stages, a chunk's sums
    added on the CUDA cores) within a fifth of float32's bound of the operands as they are
    (the simulator rounds the tensor cores' sums toward zero, as they do)."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm
    from tir_sim import Simulator

    if dtype.startswith("tf32") and form in ("cols", "gradient", "gradient_half"):
        pytest.skip("MN-major operands are 16-bit only (TF32 weights [K, O] go elsewhere)")
    if dtype == "tf32x3" and cols != 128:
        pytest.skip("split float32's tiles are 128 columns wide")
    k = 768 if form == "slices" else 512 if form.startswith("gradient") else 384
    func, args, want = _product_case(form, dtype, k, rng, m_rows=300, truncated=True)
    kernel = cuda_wgmma_gemm.kernel(cuda_mma_gemm.product_of(func, CUDA), cols)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    got = args[-1].astype(np.float64)
    got = got.sum(0) if form == "slices" else got
    bound = (TOL_F32 / 5 if dtype == "tf32x3" else TOL_F32) if not form.startswith(
        "gradient") else 2.0 ** -(8 if dtype == "bfloat16" else 11)
    assert np.abs(got - want).max() / np.abs(want).max() < bound


@pytest.mark.parametrize("cols", [128, pytest.param(256, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "tf32"])
@pytest.mark.parametrize("form", ["rows", "flat", "step", "slices"])
def test_wgmma_gemm_fed_by_the_tma_engine_matches_numpy_on_the_simulator(form, dtype, cols,
                                                                          rng):
    """cuda.wgmma_gemm's kernel whose operands the TMA engine copies (both stored in the
    operands' type, a block's K at least 16 chunks: 1024 halves, 512 TF32 values, 16 chunks
    through 4 or 6 stages, so that stages are reused), on the NumPy interpreter (the copies
    of tensor-map boxes made when their barrier is waited for, 128-byte swizzled, zeros past
    the tensor's rows): a projection of T*N = 135 rows (the second row tile partial), flat
    rows, one step's N = 135 rows in the weights' type (two row tiles: a cluster of two
    blocks, each multicasting half of the weights' tile) and its 2 slices of K; against
    NumPy's product of the same operands (TF32: truncated, as the tensor cores read them)."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm
    from tir_sim import Simulator

    k = (512 if dtype == "tf32" else 1024) * (2 if form == "slices" else 1)
    func, args, want = _product_case(form, dtype, k, rng, truncated=True, h_copied=True)
    product = cuda_mma_gemm.product_of(func, CUDA)
    plan = cuda_wgmma_gemm.Plan(product, cols)
    assert plan.tma and plan.cluster == (2 if form in ("step", "slices") else 1)
    assert plan.chunks > plan.stages
    kernel = cuda_wgmma_gemm.kernel(product, cols)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    got = args[-1].astype(np.float64)
    got = got.sum(0) if form == "slices" else got
    assert np.abs(got - want).max() / np.abs(want).max() < TOL_F32


@pytest.mark.parametrize("batch, k, o, dtype, tma, cluster", [
    (256, 2048, 8192, "float16", True, 2), (96, 2048, 8192, "bfloat16", True, 1),
    (256, 1024, 4096, "float16", False, 1), (256, 512, 2048, "float16", False, 1),
    (256, 2048, 8192, "tf32", True, 2), (64, 2048, 8192, "float16", False, 1)])
def test_wgmma_gemm_takes_the_tma_engine_where_a_block_has_enough_of_k(batch, k, o, dtype, tma,
                                                                       cluster):
    """One step's product (h in the weights' type) is fed by the TMA engine where a block's
    part of K is at least 16 chunks (fewer: the copying kernel, which starts sooner), in
    tiles of 128 rows (not 64-row tiles); in clusters of two blocks where its row tiles are
    an even count; halves prefer 128 columns a tile, as the slices allow (2048 x 8192 at N256:
    whole, 128 blocks)."""
    from rnncc import schedules
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_gemm

    tf32 = dtype == "tf32"
    dtype = "float32" if tf32 else dtype

    def product(count):
        func = (comp.gemm((batch,), k, o, "rows", dtype, dtype) if count == 1
                else comp.gemm_parts(batch, k, o, count, "rows", dtype, dtype))
        return func.with_attr(_mma.TF32_ATTR, True) if tf32 else func

    # in tiles of N rows (swapped tiles are never TMA-fed)
    rows_shape = cuda_wgmma_gemm.unswapped(cuda_mma_gemm.product_of(product(1), CUDA))
    parts = rows_shape.slices if rows_shape else schedules.product_parts(product(1), CUDA)
    found = cuda_mma_gemm.product_of(product(parts), CUDA)
    plan = cuda_wgmma_gemm.Plan(found, rows_shape.cols if rows_shape else
                                cuda_wgmma_gemm.columns(found))
    assert (plan.tma, plan.cluster) == (tma, cluster)
    if batch == 256 and k == 2048 and not tf32:
        assert (parts, plan.cols) == (1, 128)


@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "tf32"])
def test_tma_fed_kernel_with_persistent_tiles_matches_numpy_on_the_simulator(dtype, blocks,
                                                                           rng):
    """The TMA-fed kernel whose blocks loop over tiles (``persistent``: 1 block taking all 4
    tiles of a projection of 135 rows by 256 columns, or 3 blocks, the first taking 2): the
    chunks' stages and phases run on from tile to tile, the last chunk's stage given back
    before the next tile's copies reuse it; against NumPy's product of the same operands."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm
    from tir_sim import Simulator

    func, args, want = _product_case("flat", dtype, 512 if dtype == "tf32" else 1024, rng,
                                     truncated=True)
    kernel = cuda_wgmma_gemm.kernel(cuda_mma_gemm.product_of(func, CUDA), 128, "tma", blocks)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    got = args[-1].astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < TOL_F32


def test_wgmma_gemm_feed_can_be_chosen_to_compare_them():
    """``kernel(..., feed=...)``: "copy" gives the copying kernel of a product the TMA engine
    would take, "tma" the engine's kernel of one it would not (8 chunks a block); a product
    whose operands it cannot copy (float32 h under float16 weights) or another feed is an
    error naming it."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm

    def product(k, h_dtype="float16"):
        return cuda_mma_gemm.product_of(comp.gemm((256,), k, 4096, "rows", "float16",
                                                  h_dtype), CUDA)

    def fed(kernel):
        return "tensormap" in kernel.script()

    assert fed(cuda_wgmma_gemm.kernel(product(2048), swapped=False))
    assert not fed(cuda_wgmma_gemm.kernel(product(2048), feed="copy", swapped=False))
    assert not fed(cuda_wgmma_gemm.kernel(product(512), swapped=False))
    assert fed(cuda_wgmma_gemm.kernel(product(512), feed="tma", swapped=False))
    assert not fed(cuda_wgmma_gemm.kernel(product(2048)))  # swapped: copied
    with pytest.raises(ValueError, match="cannot copy"):
        cuda_wgmma_gemm.kernel(product(2048, "float32"), feed="tma")
    with pytest.raises(ValueError, match="'tma', 'copy' or None"):
        cuda_wgmma_gemm.kernel(product(2048), feed="bulk")


def test_a_tma_fed_stage_refuses_a_strided_region():
    """A stage whose kernel reads an operand through a tensor map (compact rows) given a
    strided region of a sequence buffer is an error naming the stage, not a wrong result."""
    from rnncc.lowering import assemble
    from rnncc.lowering.components import ALL, i64
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm

    func = comp.gemm((256,), 2048, 8192, "rows", "float16", "float16")
    kernel = cuda_wgmma_gemm.kernel(cuda_mma_gemm.product_of(func, CUDA))
    big = [tirx.decl_buffer(shape, dtype, name) for shape, dtype, name in (
        ((i64(256), i64(4096)), "float16", "h2"), ((i64(8192), i64(2048)), "float16", "w"),
        ((i64(8192),), "float16", "b"), ((i64(256), i64(8192)), "float32", "out"))]
    regions = [assemble.Region(big[0], (ALL, slice(0, 2048))),
               *(assemble.Region(b, (ALL,) * len(b.shape)) for b in big[1:])]
    with pytest.raises(ValueError, match="strided region of h2"):
        assemble.stage_block(assemble.Stage("recurrent_gemm", kernel, regions, 1))


@pytest.mark.parametrize("form, given", [("slices", "ab"), ("rows", "b"), ("rows", "")])
def test_tf32_operands_their_writers_rounded_are_read_as_they_are(form, given, rng):
    """A TF32 product whose callers rounded operands already (rnncc.tf32_rounded: the layer's
    packed weights "b", h as its cell step writes it "a"), on the simulator (which truncates,
    as the tensor cores do), those operands given rounded: cuda.mma_gemm rounds the others in
    place (NumPy's product of the rounded operands); cuda.wgmma_gemm reads every operand as
    stored, the others truncated (NumPy's product of those), and has no rounding code."""
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_gemm
    from tir_sim import Simulator

    func, args, rounded = _product_case(form, "tf32", 768 if form == "slices" else 384, rng)
    for index, operand in enumerate("ab"):
        if operand in given:
            args[index] = round_tf32(args[index]).astype(np.float32)
    product = cuda_mma_gemm.product_of(func.with_attr(_mma.TF32_ROUNDED_ATTR, given), CUDA)
    assert product.rounded == given
    a, w = (truncate_tf32(x).astype(np.float64) for x in args[:2])
    truncated = a @ w.T + (args[2].astype(np.float64) if form == "rows" else 0)
    for kernel, want in ((cuda_wgmma_gemm.kernel(product, 256), truncated),
                         (cuda_mma_gemm.kernel(product), rounded)):
        run = [x.copy() for x in args]
        Simulator(kernel, {p.name: x for p, x in zip(kernel.params, run)}).run()
        got = run[-1].astype(np.float64)
        got = got.sum(0) if form == "slices" else got
        assert np.abs(got - want).max() / np.abs(want).max() < TOL_F32
    assert "rnncc_round" not in cuda_wgmma_gemm.kernel(product, 256).script()


def test_wgmma_gemm_takes_the_tensor_core_projections_on_hopper():
    """On sm_90 (built as sm_90a) cuda.wgmma_gemm takes the input projection of all steps
    (halves, TF32) and each step's slices of K (but split float32's at batch 64 and less, and
    all of them on sm_80: cuda.mma_gemm's); w [K, O] in 16 bits is read MN-major (TF32
    is not); K off its 128-byte chunks goes to the next rule, but in a projection of all steps
    whose weights are rows (tails: K a whole count of 8-byte copies, O even) and one step's
    in swapped tiles (whole, K 1056 at N 64), and so do IEEE
    float32 products unless split in three TF32 products (tf32x3, on by default)."""
    from rnncc.schedules import _mma, cuda_wgmma_gemm

    def rules(dtype, batch, target, tf32=False, **options):
        problem = Problem(rnncc.cells.get("lstm"), 512, 1024, batch, dtype, allow_tf32=tf32)
        found = sequence.build(problem, Options(persistent="off", fused_step=False, **options),
                               target).rules
        return found["input_gemm"], found.get("recurrent_gemm_parts", found["recurrent_gemm"])

    wgmma, mma = "cuda.wgmma_gemm", "cuda.mma_gemm"
    assert rules("float16", 256, CUDA) == (wgmma, wgmma)
    assert rules("float32", 256, CUDA, tf32=True) == (wgmma, wgmma)
    assert rules("bfloat16", 64, CUDA) == (wgmma, wgmma)
    assert rules("float32", 64, CUDA) == (wgmma, mma)  # split in three TF32 products
    assert rules("float16", 256, AMPERE) == (mma, mma)
    assert rules("float32", 256, CUDA) == (wgmma, wgmma)  # split in three TF32 products
    assert rules("float32", 256, CUDA, tf32x3=False)[0] == "cuda.sgemm"
    t_len = tirx.Var("T", "int64")
    assert cuda_wgmma_gemm.apply(comp.gemm((t_len, 64), 1024, 4096, "cols", "float16",
                                           "float16"), CUDA) is not None
    assert cuda_wgmma_gemm.apply(comp.gemm((t_len, 64), 1056, 4104, "rows", "float16",
                                           "float16"), CUDA) is not None
    assert cuda_wgmma_gemm.apply(comp.gemm((t_len, 64), 1060, 4096, "rows", "float16",
                                           "float16"), CUDA) is not None  # copies of 8 bytes
    for func in (comp.gemm((t_len, 64), 1024, 4096, "cols", "float32", "float32").with_attr(
            _mma.TF32_ATTR, True),
                 comp.gemm((t_len, 64), 1058, 4096, "rows", "float16", "float16"),
                 comp.gemm((t_len, 64), 1056, 4099, "rows", "float16", "float16"),
                 comp.gemm((t_len, 64), 1056, 4096, "cols", "float16", "float16")):
        assert cuda_wgmma_gemm.apply(func, CUDA) is None
    one_step = comp.gemm((64,), 1056, 4096, "rows", "float16", "float16")  # swapped, whole
    assert cuda_wgmma_gemm.apply(one_step, CUDA) is not None


@pytest.mark.parametrize("form", [
    "slices of h", pytest.param("projection", marks=pytest.mark.slow),
    pytest.param("TF32 slices", marks=pytest.mark.slow),
    pytest.param("narrow slices of h", marks=pytest.mark.slow)])
def test_wgmma_gemm_kernels_compile_without_spills(form):
    """cuda.wgmma_gemm's kernels (one step's float32 h under float16 weights in slices: copies
    and registers, in tiles 256 and 128 wide, one barrier a chunk; a bfloat16 projection of all
    steps, wide tiles, and TF32 slices of one step in tiles of its rows, a cluster of two
    blocks -- the rule takes these swapped since the seventy-eighth session, the kernel asked
    for: fed by the TMA engine, mbarriers and no block barrier past the start) issue wgmma and
    compile without spills."""
    from conftest import has_nvcc
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_gemm

    func = {"slices of h": lambda: comp.gemm_parts(256, 1024, 4096, 4, "rows", "float16",
                                                   "float32"),
            "projection": lambda: comp.gemm((tirx.Var("T", "int64"), 64), 1024, 4096, "rows",
                                            "bfloat16", "bfloat16"),
            "TF32 slices": lambda: comp.gemm_parts(256, 1024, 4096, 2, "rows", "float32",
                                                   "float32").with_attr(_mma.TF32_ATTR, True),
            "narrow slices of h": lambda: comp.gemm_parts(256, 512, 2048, 4, "rows",
                                                          "float16", "float32"),
            }[form]()
    main = (cuda_wgmma_gemm.kernel(cuda_mma_gemm.product_of(func, CUDA), swapped=False)
            if form == "TF32 slices" else cuda_wgmma_gemm.apply(func, CUDA).mod["main"])
    source = tvm.compile(tvm.IRModule({"main": main.with_attr("global_symbol", "wg")}),
                         target=CUDA).mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in source
    body = kernel_bodies(source)["wg_kernel"]
    if form in ("projection", "TF32 slices"):
        assert "cp.async.bulk.tensor.2d" in source and body.count("rnncc_tma_wait(") == 2
        assert body.count("__syncthreads()") == (1 if form == "projection" else 0)
        assert ("rnncc_cluster_sync()" in body) == (form == "TF32 slices")
    else:
        assert body.count("__syncthreads()") == 1
    if has_nvcc():
        _, report = compile_cubin(source, "sm_90")
        assert report["wg_kernel"]["spill_stores"] == report["wg_kernel"]["stack"] == 0


@pytest.mark.parametrize("outputs, dtype, splits", [(8448, "float32", 1), (4096, "float32", 2),
                                                   (4, "float32", 64), (132, "float16", 32)])
def test_column_sum_spreads_the_columns_over_blocks_and_the_rows_over_lanes(outputs, dtype,
                                                                            splits):
    """A bias's gradient over the T*N rows of all steps: 32 columns a block (a warp reads a
    row's contiguous floats), rows over 32 lanes, 4 in flight a thread, the lanes' sums added in
    shared memory (no atomics), columns past O guarded; where the columns' blocks are few, M
    in slices too, each block's sums into a workspace that a second kernel adds in order; no
    spills; weight gradients and other shapes go to the other rules."""
    from rnncc.compiler.cuda_binary import compile_cubin
    from rnncc.schedules import cuda_column_sum

    m = tirx.Var("M", "int64")
    func = comp.column_sum(m, outputs, dtype)
    assert cuda_column_sum.sizes(func).splits == splits
    result = schedules.schedule(func, CUDA, "reduction")
    assert result.rule == "cuda.column_sum"
    source = tvm.compile(tvm.IRModule({"main": result.func.with_attr("global_symbol", "cs")}),
                         target=CUDA).mod.imports[0].inspect_source()
    bodies = kernel_bodies(source)
    body = bodies["cs_kernel"]
    assert "__launch_bounds__(1024)" in source and "atomic" not in body
    assert body.count("__syncthreads()") == 1 and body.count("g_ptr[") == 4
    assert len(bodies) == (1 if splits == 1 else 2)
    if splits == 1:
        assert body.count("< M)") == 4  # rows past M
        assert body.count("if (") == 5 + (2 if outputs % 32 else 0)  # and columns past O
    else:  # rows past the slice's (the last slice's past M); the slices summed in order
        assert body.count("< (M - ") == 4
        assert "blockIdx.y" in body and "db_ptr" not in body and "partial_ptr" in body
        assert "db_ptr" in bodies["cs_kernel_1"] and "partial_ptr" in bodies["cs_kernel_1"]
    _, report = compile_cubin(source, "sm_90")
    kernel = report["cs_kernel"]
    assert kernel["spill_stores"] == kernel["spill_loads"] == kernel["stack"] == 0
    assert cuda_column_sum.apply(comp.weight_gradient(m, 128, 128, "float32", "float32"),
                                 CUDA) is None
    g = tirx.decl_buffer((m, outputs), "float16", "g")
    assert cuda_column_sum.sizes(tvm.tirx.PrimFunc([g], tvm.tirx.Evaluate(0))) is None


def test_a_stages_scratch_buffers_are_parameters_the_caller_allocates():
    """A split product's slices (and any stage's own global buffer of a static size) become
    trailing parameters of the entry, signed as workspaces: TVM's own workspace pool, where a
    thread other than Python's main one (torch's autograd) allocated, is freed only as the
    process exits, after CUDA has shut down (the process then aborted)."""
    from rnncc.lowering.assemble import Region, Stage, scratch_signature, sequence_function

    m = tirx.Var("M", "int64")
    scheduled = schedules.schedule(comp.weight_gradient(m, 256, 128, "float32", "float32"),
                                   CUDA, "reduction")
    assert scheduled.rule == "cuda.weight_grad"
    g, a = tirx.decl_buffer((m, 256), "float32", "g"), tirx.decl_buffer((m, 128), "float32", "a")
    dw = tirx.decl_buffer((256, 128), "float32", "dw")
    stage = Stage("weight_grad_hh", scheduled.func, [Region(b, (slice(None),) * 2)
                                                     for b in (g, a, dw)], 1)
    func = sequence_function("grads", [g, a, dw], [stage], None, None, [])
    assert len(func.params) == 4
    assert scratch_signature(func, 3) == [{"name": "scratch_0_slices", "shape": [64, 256, 128],
                                           "dtype": "float32", "kind": "workspace"}]
    script = func.script()
    assert 'slices: T.Buffer((64, 256, 128), "float32"' in script  # a parameter
    assert "alloc_buffer(" not in script and "alloc_local((64,)" in script  # not allocated


@pytest.mark.parametrize("lead", [(64,), ("T", 96)], ids=["step", "all_steps"])
def test_tiled_gemm_stages_k_major_tiles(lead):
    """Both operands go through shared memory k-major and 4 values at a time into registers;
    a run-time T is a grid dimension (no bounds checks on it); one step's small grid is split
    along K (blockIdx.z: the slices, summed with the bias by a second kernel)."""
    from rnncc.schedules import cuda_tiled_gemm

    lead = tuple(tirx.Var("T", "int64") if d == "T" else d for d in lead)
    func = comp.gemm(lead, 256, 1024, "rows", "float32")
    sch = cuda_tiled_gemm.apply(func, CUDA)
    assert sch is not None
    scheduled = sch.mod["main"]
    tags = thread_tags(scheduled)
    assert {"blockIdx.x", "blockIdx.y", "threadIdx.x"} <= tags
    assert "blockIdx.z" in tags
    scopes = {}
    for line in scheduled.script().splitlines():
        if "T.sblock_alloc_buffer(" in line:
            name = line.split("=")[0].strip()
            dims = [int(d) for d in re.findall(r"T.int64\((\d+)\)", line)]
            scope = re.search(r'scope="([\w.]+)"', line)
            scopes[name] = (scope.group(1) if scope else "global", dims)
    # k-major shared copies (K first), register tiles, the accumulators in registers
    assert scopes["a_shared"][0] == "shared" and scopes["a_shared"][1][0] == 256
    assert scopes["w_shared"] == ("shared", [256, 1024])
    assert scopes["a_shared_local"][0] == scopes["w_shared_local"][0] == "local"
    assert scopes["gemm_local"][0] == "local"
    if len(lead) == 1:  # 16 tiles of 64 x 64: K = 256 in eight slices of 32
        assert scopes["gemm_rf"] == ("global", [8, 64, 1024])
    else:
        assert "gemm_rf" not in scopes
    vectorized = [kind for kind, _ in loops(scheduled) if kind == int(tirx.ForKind.VECTORIZED)]
    script = scheduled.script()
    if len(lead) == 1:  # one step's split-K product: no software pipeline
        assert len(vectorized) == 4  # per operand: global to shared, shared to registers
        assert "software_pipeline" not in script
    else:
        # per operand: global to registers, registers to shared memory, shared to registers
        assert len(vectorized) == 6
        # the next chunk's global loads are issued before the products of this one (software
        # pipeline: loads, products, then the stores to shared memory)
        assert '"software_pipeline_order": [0, 3, 1, 4, 2]' in script
        assert '"software_pipeline_stage": [0, 0, 0, 0, 1]' in script
        code = tvm.compile(tvm.IRModule({"main": scheduled}), target=CUDA).mod.imports[0]
        body = code.inspect_source().split("for (int64_t k_0")[1]
        assert body.index("a_ptr") < body.index("gemm_local_ptr") < body.index("a_shared_ptr[")


def test_split_k_slices():
    from rnncc.schedules.cuda_tiled_gemm import _splits

    assert _splits(1024, 16, 64) == 8    # LSTM 1024, batch 64: 64 tiles -> 512 blocks
    assert _splits(2048, 16, 96) == 8    # GRU 2048: 96 tiles -> 768 blocks
    assert _splits(256, 16, 16) == 8     # LSTM 256: slices of 32
    assert _splits(128, 16, 16) == 4     # slices stay 32 deep
    assert _splits(1024, 16, 300) == 2   # the grid stays within 1024 blocks
    assert _splits(1024, 16, 600) == 1   # enough blocks already
    assert _splits(48, 16, 8) == 1       # too shallow to split


def test_tiled_gemm_plans():
    """8 x 4 a thread in 64 x 64 tiles where they divide (64 x 128 for the products of all
    steps at batch >= 32, chunks of small batches excepted); one step's product split-K."""
    from rnncc.schedules.cuda_tiled_gemm import Tiling, plan

    t_len = tirx.Var("T", "int64")
    cases = [((64,), 1024, 4096, Tiling(64, 64, 8, 4, 16, 8)),    # LSTM 1024 recurrent
             ((t_len, 64), 1024, 4096, Tiling(64, 128, 8, 4, 16)),  # its input projection
             ((t_len, 64), 1024, 192, Tiling(64, 64, 8, 4, 16)),   # 128 does not divide 192
             ((64,), 2048, 6144, Tiling(64, 64, 8, 4, 16, 8)),    # GRU 2048: 768 blocks
             ((96,), 64, 64, Tiling(32, 32, 4, 4, 16, 2)),        # 96 rows: 32-row tiles
             ((32,), 40, 160, Tiling(32, 32, 4, 4, 8))]           # K = 40: chunks of 8
    for lead, k, o, tiling in cases:
        assert plan(comp.gemm(lead, k, o, "rows", "float32")) == tiling, (lead, k, o)


def test_tiled_gemm_refuses_a_tiling_that_does_not_fit():
    """A hand-given (or tuned) tiling is checked against the sizes, with the reasons named."""
    from rnncc.schedules.cuda_tiled_gemm import Tiling, schedule

    t_len = tirx.Var("T", "int64")
    cases = [((64,), 256, 1024, Tiling(64, 48, 8, 4, 16), "tiles must divide the 64 x 1024"),
             ((64,), 256, 1024, Tiling(64, 64, 6, 4, 16), "multiples of 4"),
             ((64,), 256, 1024, Tiling(64, 64, 8, 4, 16, 32), "slices of whole 16-deep"),
             ((t_len, 64), 256, 1024, Tiling(64, 64, 8, 4, 16, 2), "one step's product"),
             ((128,), 256, 1024, Tiling(128, 256, 4, 4, 16), "more than 1024 threads")]
    for lead, k, o, tiling, reason in cases:
        with pytest.raises(ValueError, match=reason):
            schedule(comp.gemm(lead, k, o, "rows", "float32"), tiling)
    schedule(comp.gemm((64,), 256, 1024, "rows", "float32"), Tiling(32, 32, 4, 4, 8, 4))


def test_tiled_gemm_declines_what_does_not_tile():
    from rnncc.schedules import cuda_tiled_gemm

    for lead, k, o in [((16,), 256, 1024), ((64,), 33, 1024), ((64,), 256, 99), ((48,), 64, 64)]:
        assert cuda_tiled_gemm.apply(comp.gemm(lead, k, o, "rows", "float32"), CUDA) is None
    assert cuda_tiled_gemm.apply(comp.gemm((64,), 256, 1024, "cols", "float32"), CUDA) is None


def test_recurrent_products_in_parts_add_up_in_their_readers(rng):
    """Where cuda.sgemm splits one step's product anyway, the sequence leaves it in its S
    slices of K (comp.gemm_parts) for the cell step, its derivative, the initial states'
    gradients and LSTMP's projected state to add (with the bias): its own sum kernel is saved.
    Those components, built for this CPU, give what the summed product gives."""
    problem = Problem(rnncc.cells.get("lstm"), 256, 256, 64, training=True)
    rules = sequence.build(problem, Options(), CUDA).rules
    assert rules["recurrent_gemm_parts"] == rules["recurrent_gemm_backward_parts"] == "cuda.sgemm"
    from rnncc.schedules import cuda_sgemm

    assert cuda_sgemm.parts(comp.gemm((64,), 256, 1024, "rows", "float32", "float32")) == 8
    n, h, parts, cell = 5, 8, 4, rnncc.cells.get("lstm")

    def run(func, *arrays):
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        tvm.compile(func, target="llvm")(*tensors)
        return [t.numpy() for t in tensors]

    a, w = rng.standard_normal((n, 4 * h)).astype("float32"), rng.standard_normal(
        (h, 4 * h)).astype("float32")
    sliced = run(comp.gemm_parts(n, 4 * h, h, parts, "rows", "float32"), a, w,
                 np.full((parts, n, h), np.nan, "float32"))[-1]
    np.testing.assert_allclose(sliced.sum(0), a @ w.T, rtol=1e-5, atol=1e-5)
    gi, b = (rng.standard_normal(s).astype("float32") for s in ((n, 4 * h), 4 * h))
    gh_parts = rng.standard_normal((parts, n, 4 * h)).astype("float32")
    states = [rng.standard_normal((n, h)).astype("float32") for _ in range(2)]
    outs = [np.full((n, h), np.nan, "float32") for _ in range(3)]
    whole = run(comp.cell_step(cell, n, h, "float32", "combined", True), gi,
                gh_parts.sum(0) + b, *states, *outs)[-3:]
    split = run(comp.cell_step(cell, n, h, "float32", "combined", True, rec_parts=parts), gi,
                gh_parts, b, *states, *outs)[-3:]
    for x, y in zip(split, whole):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    kept = ((0, "sum"), (1, "sum"), (2, "sum"), (3, "sum"))
    dh_parts = rng.standard_normal((parts, n, h)).astype("float32")
    ins = [rng.standard_normal((n, 4 * h)).astype("float32"), *states,
           rng.standard_normal((n, h)).astype("float32")]
    carry = [rng.standard_normal((n, h)).astype("float32") for _ in range(2)]
    grads = [np.full((n, h), np.nan, "float32") for _ in range(6)]
    whole = run(comp.cell_step_backward(cell, n, h, "float32", kept), *ins, dh_parts.sum(0),
                *carry, *grads)[-6:]
    split = run(comp.cell_step_backward(cell, n, h, "float32", kept, rec_parts=parts), *ins,
                dh_parts, *carry, *grads)[-6:]
    for x, y in zip(split, whole):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    initial = [np.full((n, h), np.nan, "float32") for _ in range(2)]
    whole = run(comp.initial_state_grads(2, n, h, "float32"), *carry, dh_parts.sum(0),
                *initial)[-2:]
    split = run(comp.initial_state_grads(2, n, h, "float32", parts), *carry, dh_parts,
                *initial)[-2:]
    for x, y in zip(split, whole):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    active = np.array([1, 0, 1, 1, 0], "int32")  # LSTMP's projected state, lengths masked
    for masked in (False, True):
        given = [states[0], *([active] if masked else [])]
        outs = [np.full((n, h), np.nan, "float32") for _ in range(2)]
        whole = run(comp.projected_state(n, h, "float32", masked), dh_parts.sum(0), *given,
                    *outs)[-2:]
        split = run(comp.projected_state(n, h, "float32", masked, parts), dh_parts, *given,
                    *outs)[-2:]
        for x, y in zip(split, whole):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lead, k, o, slab", [
    ((1,), 64, 128, False), ((3,), 64, 128, False), ((1,), 5, 12, False), ((40,), 16, 48, True),
    (("T", 3), 7, 132, True), (("T", 1), 64, 128, True), (("T", 2), 16, 96, True),
    ((6, 3), 7, 132, True), ((5, 5), 16, 32, True), ((7, 2), 16, 32, True), ((37,), 16, 64, True),
    ((5,), 7, 132, False), ((2,), 16, 256, False)])
def test_cpu_gemm_forms_match_numpy(lead, k, o, slab, rng):
    """Each form of cpu.gemm (one row; row tiles, cut short past N; row tiles on a copied
    column block of W^T where the rows are many) is parallel and vectorised, and gives x W^T +
    b."""
    t_len = tirx.Var("T", "int64")
    shape = tuple(5 if d == "T" else d for d in lead)
    result = schedules.schedule(comp.gemm(tuple(t_len if d == "T" else d for d in lead), k, o,
                                          "cols", "float32"), LLVM, "gemm")
    assert result.rule == "cpu.gemm"
    kinds = {kind for kind, _ in loops(result.func)}
    assert int(tirx.ForKind.PARALLEL) in kinds and int(tirx.ForKind.VECTORIZED) in kinds
    assert ("w_local" in result.func.script()) == slab
    lib = tvm.compile(tvm.IRModule({"main": result.func}), target=LLVM)
    a = rng.standard_normal(shape + (k,)).astype("float32")
    w = rng.standard_normal((k, o)).astype("float32")
    b = rng.standard_normal(o).astype("float32")
    args = [tvm.runtime.tensor(v) for v in (a, w, b, np.full(shape + (o,), np.nan, "float32"))]
    lib["main"](*args)
    ref = a.astype("float64") @ w.astype("float64") + b
    np.testing.assert_allclose(args[3].numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("o", [1, 3])
def test_cpu_gemm_of_all_steps_takes_depth_one(o, rng):
    """K = 1 (an RNN's input projection of one feature): the copied column block of W^T is
    one element wide where O is 1 or 3, and cpu.gemm takes it (it once failed and fell back)."""
    t_len, steps = tirx.Var("T", "int64"), 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = schedules.schedule(comp.gemm((t_len, 2), 1, o, "cols", "float32"), LLVM,
                                    "gemm")
    assert result.rule == "cpu.gemm"
    lib = tvm.compile(tvm.IRModule({"main": result.func}), target=LLVM)
    a, w, b = (rng.standard_normal(shape).astype("float32")
               for shape in ((steps, 2, 1), (1, o), (o,)))
    args = [tvm.runtime.tensor(v) for v in (a, w, b, np.full((steps, 2, o), np.nan, "float32"))]
    lib["main"](*args)
    np.testing.assert_allclose(args[3].numpy(), a.astype("float64") @ w + b, rtol=1e-5,
                               atol=1e-6)


def test_failing_rule_falls_back_and_says_so(monkeypatch):
    def broken(func, target):
        raise RuntimeError("no luck")

    monkeypatch.setitem(schedules.RULES, ("llvm", "gemm"),
                        [Rule("test.broken", broken)] + schedules.RULES[("llvm", "gemm")])
    with pytest.warns(UserWarning, match="test.broken failed"):
        result = schedules.schedule(comp.gemm((2,), 3, 8, "cols", "float32"), LLVM, "gemm")
    assert result.rule == "cpu.gemm"
    assert result.notes == ["test.broken failed (RuntimeError: no luck)"]


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_input_projections_of_small_batches_on_the_sgemm(batch):
    """CUDA float32 at batch 1 to 8: xp is [T, N, G*H] and the input GEMM of all steps runs
    on cuda.sgemm's tiles of 128 of the T*N rows (10-40% faster than chunks of steps in
    64-row tiles, H200). Module files written before keep their "T/S" dimensions (ceil(T/S)
    chunks of S steps), which the runtime still reads."""
    from rnncc.runtime.metadata import concrete_dim

    lowered = sequence.build(Problem(rnncc.cells.get("lstm"), 64, 128, batch), Options(), CUDA)
    xp = next(p for p in lowered.signatures["forward"] if p["name"] == "xp")
    assert xp["shape"] == ["T", batch, 512]
    assert lowered.rules["input_gemm"] == "cuda.sgemm"
    assert [concrete_dim("T/16", t) for t in (1, 16, 17, 100)] == [1, 1, 2, 7]
    assert concrete_dim("T", 100) == 100 and concrete_dim(4, 100) == 4


def test_float16_input_projection_sees_flat_rows():
    """float16 on CUDA with C and G*H over 64: the input GEMM of all steps sees x and xp as
    [T*N, C] and [T*N, G*H] views, and dlight's rule puts it on tensor cores; smaller
    products, float32 and CPUs keep [T, N, C]."""
    lstm = rnncc.cells.get("lstm")
    problem = Problem(lstm, 80, 33, 3, "float16")
    layout = sequence.layout_for(CUDA, Options(), problem)
    assert layout.flat_rows
    for problem, options, target in [(Problem(lstm, 64, 33, 3, "float16"), Options(), CUDA),
                                     (Problem(lstm, 80, 16, 3, "float16"), Options(), CUDA),
                                     (Problem(lstm, 80, 33, 3), Options(), CUDA),
                                     (Problem(lstm, 80, 33, 3, "float16"), Options(), LLVM),
                                     (Problem(lstm, 80, 33, 3, "float16"),
                                      Options(gate_gemm=False), CUDA)]:
        assert not sequence.layout_for(target, options, problem).flat_rows


@pytest.mark.slow
def test_float16_input_projection_on_flat_rows_builds_on_tensor_cores():
    """The module of such a layer: its input GEMM on [T*N, C] rows on tensor cores (on sm_90
    warpgroup MMA, K 80 and O 132 past whole tiles), while the caller still sees xp [T, N,
    G*H] (a build of about 75 s on 2 cores)."""
    module = rnncc.compile("lstm", 80, 33, 3, target="cuda", dtype="float16")
    schedule = module.metadata["schedule"]
    assert schedule["layout"]["flat_rows"]
    assert schedule["rules"]["input_gemm"] == "cuda.wgmma_gemm"
    xp = next(p for p in module.metadata["functions"]["forward"] if p["name"] == "xp")
    assert xp["shape"] == ["T", 3, 132]  # the caller's view is unchanged
    source = module.source("cuda")
    assert "wgmma.mma_async" in source and "x_rows" not in module.metadata["functions"]["forward"]


def test_flat_row_views_compute_the_sequence(monkeypatch, rng):
    """The views float16 gets on CUDA (x as [T*N, C], xp as [T*N, G*H] on their memory),
    forced on the CPU: the numbers against float64, T = 1 and 6."""
    real = sequence.layout_for
    monkeypatch.setattr(sequence, "layout_for", lambda target, options, problem: replace(
        real(target, options, problem), flat_rows=True))
    module = rnncc.compile("gru", 5, 7, 3, target="llvm", tuning="off")
    assert module.metadata["schedule"]["layout"]["flat_rows"]
    for steps in (1, 6):
        assert check_against_reference(module, rng, steps, True) < TOL_F32


@pytest.mark.parametrize("cell, directions", [("gru", 2), pytest.param(
    "lstm", 1, marks=pytest.mark.slow)])
def test_half_products_read_h_in_16_bits(cell, directions, monkeypatch, rng):
    """A half-precision layer on CUDA: one step's recurrent product reads h in float16 from
    ``h_operand`` [2, N, H], which the fused cell step writes with y's values, not the float32
    state; float32, a projection (LSTMP) and CPUs read the state. The same wiring forced on
    the CPU (lengths; both directions for the GRU; T 1 and 37) against float64."""
    lstm = rnncc.cells.get("lstm")

    def workspaces(problem, target):
        lowered = sequence.build(problem, Options(), target)
        return lowered, {e["name"]: e for e in lowered.signatures["forward"]}

    lowered, names = workspaces(Problem(lstm, 64, 64, 128, "float16"), CUDA)
    assert names["h_operand"]["dtype"] == "float16" and names["h_operand"]["shape"] == [
        2, 128, 64]
    product, _ = lowered.components["recurrent_gemm"]
    assert product.params[0].dtype == "float16"
    for problem, target in [(Problem(lstm, 64, 64, 128), CUDA),
                            (Problem(lstm, 64, 64, 128, "bfloat16", proj_size=16), CUDA),
                            (Problem(lstm, 64, 64, 128, "float16"), LLVM)]:
        lowered, names = workspaces(problem, target)
        assert "h_operand" not in names
        assert lowered.components["recurrent_gemm"][0].params[0].dtype == "float32"
    monkeypatch.setattr(sequence, "h_for_products",
                        lambda target, problem, options: problem.dtype)
    module = rnncc.compile(cell, 5, 9, 3, target="llvm", dtype="float16", lengths=True,
                           directions=directions, tuning="off")
    shape = [(2, 3, 9), (2, 2, 3, 9)][directions - 1]
    assert {"name": "h_operand", "shape": list(shape), "dtype": "float16",
            "kind": "workspace"} in module.metadata["functions"]["forward"]
    for steps in (1, 37):
        err = check_against_reference(module, rng, steps, True, lengths=True)
        assert err < TOL["float16"], f"T={steps}: relative error {err:.3e}"


def test_tf32_layers_round_weights_and_h_once(monkeypatch, rng):
    """allow_tf32 on CUDA: the packed weights are rounded to TF32 as they are packed (not the
    given ones used as they are) and the cell step writes h rounded (``h_operand``), so one
    step's product reads both as they are ("ab") and the input projection its weights ("b");
    IEEE float32 does none of it. The same wiring forced on the CPU (both directions,
    lengths): within TF32's bound of float64 and past float32's."""
    lstm = rnncc.cells.get("lstm")
    tf32 = sequence.build(Problem(lstm, 64, 64, 128, allow_tf32=True), Options(), CUDA)
    ieee = sequence.build(Problem(lstm, 64, 64, 128), Options(), CUDA)
    names = {e["name"]: e for e in tf32.signatures["forward"]}
    assert names["h_operand"]["dtype"] == "float32"
    assert "h_operand" not in [e["name"] for e in ieee.signatures["forward"]]
    assert [e.get("same_as") for e in tf32.signatures["pack_w_hh"]] == [None, None]
    assert ieee.signatures["pack_w_hh"][-1]["same_as"] == "weight_hh_l0"
    for key, given in (("recurrent_gemm", "ab"), ("input_gemm", "b")):
        assert tf32.components[key][0].attrs[schedules.TF32_ROUNDED_ATTR] == given
        assert schedules.TF32_ROUNDED_ATTR not in (ieee.components[key][0].attrs or {})
    monkeypatch.setattr(sequence, "h_for_products",
                        lambda target, problem, options: "tf32" if problem.allow_tf32 else None)
    module = rnncc.compile("gru", 5, 33, 3, target="llvm", allow_tf32=True, lengths=True,
                           directions=2, tuning="off")
    for steps in (1, 37):
        err = check_against_reference(module, rng, steps, True, lengths=True)
        assert TOL_F32 < err < TOL_TF32, f"T={steps}: relative error {err:.3e}"


def _cells_slow_but(*kept):
    """The registry's cells, all but ``kept`` marked slow (a fast representative set)."""
    return [c if c in kept else pytest.param(c, marks=pytest.mark.slow)
            for c in rnncc.cells.names()]


@pytest.mark.parametrize("cell", _cells_slow_but("lstm", "peephole"))
def test_half_cell_steps_read_no_16_bit_values(cell):
    """A half layer's cell step reads only float32 (b_hh and the per-unit parameters
    converted before the steps): a conversion from 16 bits is inline assembly in CUDA, which
    keeps nvcc from computing the values its outputs share once. Its outputs: y and h_operand
    in float16, the states in float32 (its own kernel: not one step's, which takes LSTM 512
    N256)."""
    problem = Problem(rnncc.cells.get(cell), 512, 512, 256, "float16")  # h in slices of K
    lowered = sequence.build(problem, Options(fused_step=False), CUDA)
    step, _ = lowered.components["cell_step"]
    states = len(problem.cell.states)
    dtypes = [str(buffer.dtype) for buffer in step.params]
    # ..., y, the new states, h_operand
    assert dtypes[-states - 2:] == ["float16"] + ["float32"] * states + ["float16"]
    assert set(dtypes[:-states - 2]) == {"float32"}
    names = [e["name"] for e in lowered.signatures["forward"]]
    sliced = "b_hh" in [buffer.name for buffer in step.params]  # it adds gh's slices and b_hh
    assert ("b_hh_float32" in names) == sliced and (sliced or cell != "lstm")


def test_training_step_copies_h_before_the_sums_it_writes_over_the_projections(rng):
    """The training forward's fused step writes each gate's sum gi + gh over gi (the kept
    sums take the input projections' memory) and, for a half layer's next product, a copy of
    h: on the TIR interpreter, with the sums' output aliasing gi, the copy equals y (written
    after the sums, it read gi + gh as gi: bfloat16 LSTM 1024 N128's training forward drifted
    to 2.5e-2 off by step 10). One gate (rnn_tanh), so that the sums' buffer is gi whole."""
    from tir_sim import Simulator

    cell = rnncc.cells.get("rnn_tanh")
    func = comp.cell_step(cell, 4, 64, "float16", "combined", True, kept=kept_parts(cell),
                          h_copy="float16")
    kernel = tvm.s_tir.transform.ConvertBlocksToOpaque()(tvm.IRModule({
        "main": schedules.schedule(func, CUDA, "elementwise").func}))["main"]
    gi, gh, h_prev = (rng.standard_normal((4, 64)).astype(np.float32) for _ in range(3))
    want = np.tanh(gi.astype(np.float64) + gh)
    y, h_new, copy = (np.full((4, 64), np.nan, dt) for dt in (np.float16, np.float32,
                                                               np.float16))
    sums = gi.copy()  # gi's memory, as the training forward passes it for both
    Simulator(kernel, dict(zip((p.name for p in kernel.params),
                               (sums, gh, h_prev, y, h_new, copy, sums)))).run()
    np.testing.assert_allclose(sums, gi + gh, rtol=1e-6)
    np.testing.assert_allclose(y.astype(np.float64), want, atol=1e-3)
    np.testing.assert_array_equal(copy, y)


@pytest.mark.parametrize("cell", _cells_slow_but("peephole"))
def test_half_cell_step_derivatives_read_float32_parameters(cell):
    """The training backward's derivative of a half layer's step reads the cell's per-unit
    parameters in float32 (converted before the steps, as the forward step does: a float16
    peephole LSTM's derivative computed 180 exponentials an element with them in float16, 5
    without); of its inputs only dy, the caller's gradient, is in the layer's dtype, and of
    its outputs the projections' gradients (dGI, and dGH where a gate is not kept as its
    sum: the G gates' each, as the products read them)."""
    problem = Problem(rnncc.cells.get(cell), 64, 64, 40, "bfloat16", training=True)
    lowered = sequence.build(problem, Options(persistent="off"), CUDA)
    step, _ = lowered.components["cell_backward"]
    halves = [b.name for b in step.params if str(b.dtype) != "float32"]
    summed = all(part == "sum" for _, part in kept_parts(problem.cell))
    grads = problem.gates * (1 if summed else 2)
    assert halves == ["dy"] + [f"cell_backward.v{g}" for g in range(grads)]
    assert all(str(b.dtype) == "bfloat16" for b in step.params if b.name in halves)
    names = [e["name"] for e in lowered.signatures["backward"]]
    assert all(f"p_{name}_float32" in names for name in problem.cell.params)


def test_sequence_records_rules_and_layout():
    problem = Problem(rnncc.cells.get("gru"), 5, 7, 1)
    lowered = sequence.build(problem, Options(gate_gemm=False), CUDA)
    assert lowered.layout.gates == "per_gate" and lowered.layout.weights == "rows"
    assert lowered.rules["cell_step"] == "cuda.elementwise"
    forward = lowered.mod["forward"]
    names = [p["name"] for p in lowered.signatures["forward"]]
    assert names == ["x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "y", "h_n", "xp", "hp", "h_ws"]
    assert len(forward.params) == len(names)
    assert isinstance(lowered.mod, tvm.IRModule)


def test_tiled_gemm_index_arithmetic_on_the_cpu(rng):
    """The tiled rule's loop structure (tiles, k-major staging, split-K's slices and their
    sum), built without its GPU thread bindings and memory scopes and run on the CPU, computes
    the product exactly as NumPy does (the GPU tests check the real kernels)."""
    import numpy as np

    from rnncc.schedules import cuda_tiled_gemm

    class Unbound(s_tir.Schedule):
        def bind(self, loop, thread):
            pass

        def cache_read(self, block, index, scope, consumer_blocks=None):
            return super().cache_read(block, index, "global", consumer_blocks)

        def cache_write(self, block, index, scope, consumer_blocks=None):
            return super().cache_write(block, index, "global", consumer_blocks)

        def set_scope(self, block, index, scope):
            pass

    class Namespace:
        Schedule = Unbound

    for lead, k, o in [((64,), 1024, 256), ((3, 32), 64, 96)]:
        func = comp.gemm(lead, k, o, "rows", "float32")
        original = cuda_tiled_gemm.s_tir
        cuda_tiled_gemm.s_tir = Namespace
        try:
            sch = cuda_tiled_gemm.apply(func, CUDA)
        finally:
            cuda_tiled_gemm.s_tir = original
        assert ("gemm_rf" in sch.mod.script()) == (len(lead) == 1)
        lib = tvm.compile(sch.mod, target="llvm")
        a = rng.standard_normal((*lead, k)).astype("float32")
        w = rng.standard_normal((o, k)).astype("float32")
        b = rng.standard_normal(o).astype("float32")
        out = tvm.runtime.empty((*lead, o), "float32", tvm.cpu())
        lib["main"](*(tvm.runtime.tensor(x) for x in (a, w, b)), out)
        ref = a.astype("float64") @ w.T.astype("float64") + b
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch, hidden", [(1, 1), (3, 33), (2, 1500)])
@pytest.mark.parametrize("backward", [False, True])
def test_cuda_step_that_reduces_is_one_kernel_a_batch_row(batch, hidden, backward):
    """A layer-normalised cell's step, forward and derivative: one kernel, a block a batch row
    (blockIdx.x over N), each sum spread over the block's threads (cross-thread: a
    threadIdx.x loop inside it) into shared memory; one thread a row where H = 1."""
    cell = rnncc.cells.get("ln_lstm")
    step = (comp.cell_step_backward(cell, batch, hidden, "float32", kept_parts(cell))
            if backward else comp.cell_step(cell, batch, hidden, "float32", "combined", True))
    result = schedules.schedule(step, CUDA, "elementwise")
    assert result.rule == "cuda.row_means", result.notes
    script = result.func.script()
    assert script.count('thread="blockIdx.x"') == 1
    assert f'T.thread_binding(T.int64({batch}), thread="blockIdx.x")' in script
    sums = len(re.findall(r'T.sblock\("row_sum\d+"\)', script))
    shared = re.findall(r"row_sum\d+_shared = T.sblock_alloc_buffer\(\(T.int64\((\d+)\),\), "
                        r'scope="shared"\)', script)
    assert sums >= 2 and len(shared) == sums and "row_values" not in script
    threads = re.findall(r'T.thread_binding\(T.int64\((\d+)\), thread="threadIdx.x"\)', script)
    if hidden == 1:  # the outputs' loop only, one thread
        assert threads == ["1"]
    else:  # every sum, and the outputs
        assert threads == [str(min(1024, -(-hidden // 32) * 32))] * (sums + 1)


def _step_case(cell, n, h, dtype, masked, rng, unit=None, swapped=False):
    """(kernel, its arguments with poisoned outputs, float64 expected outputs by name) of one
    step's kernel (cuda.wgmma_step) of ``cell`` at batch ``n``, hidden ``h``, operands
    ``dtype`` ("tf32": float32 allowed TF32, h and the weights rounded as stored), in
    ``swapped`` tiles or not; ``masked``: random samples past their lengths."""
    from rnncc.schedules import _mma, cuda_mma_gemm, cuda_wgmma_step

    g, tf32 = cell.gates, dtype == "tf32"
    stored = "float32" if tf32 else dtype
    func = comp.gemm((n,), h, g * h, "rows", stored, stored)
    if tf32:
        func = func.with_attr(_mma.TF32_ATTR, True).with_attr(_mma.TF32_ROUNDED_ATTR, "ab")
    plan = cuda_wgmma_step.plan_of(cuda_mma_gemm.product_of(func, CUDA), g, unit, swapped)
    step = cuda_wgmma_step.Step(plan, cell, masked)

    def rounded(x):
        return round_tf32(x) if tf32 else x.astype(dtype)

    h_prev = rounded(rng.standard_normal((n, h)) * 0.5)
    w = rounded(rng.uniform(-0.1, 0.1, (g * h, h)))
    b = rounded(rng.uniform(-0.2, 0.2, g * h))
    xp = rng.standard_normal((n, g * h)).astype(np.float32)
    params = [rng.uniform(-0.5, 0.5, h).astype(np.float32) for _ in cell.params]
    prev = [rng.standard_normal((n, h)).astype(np.float32) for _ in cell.states]
    active = (rng.random(n) < 0.7).astype(np.int32)
    sums = h_prev.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
    new = cell.reference_step([xp[:, i * h:(i + 1) * h].astype(np.float64) for i in range(g)],
                              [sums[:, i * h:(i + 1) * h] for i in range(g)],
                              [s.astype(np.float64) for s in prev],
                              [p.astype(np.float64) for p in params])
    live = active[:, None] != 0 if masked else np.ones((n, 1), bool)
    want = {"y": np.where(live, new[0], 0)}  # in the kernel's outputs' order
    want.update({f"{s}_next": np.where(live, v, p) for s, v, p in zip(cell.states, new, prev)})
    want["h_operand"] = want["y"]
    given = [h_prev, w, b, xp, *params, *prev] + ([active] if masked else [])
    outputs = [np.full((n, h), np.nan, stored), *[np.full((n, h), np.nan, np.float32)
                                                  for _ in cell.states],
               np.full((n, h), np.nan, stored)]
    return cuda_wgmma_step.kernel(step), plan, given + outputs, want


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("cell", rnncc.cells.names())
def test_one_step_kernel_matches_the_cell_on_the_simulator(cell, swapped, rng):
    """cuda.wgmma_step, one step's recurrent product with the cell as its epilogue: every
    registered cell whose step can be one (the others say why not), bfloat16 operands copied
    by the warpgroups, N = 70, samples past their lengths (y zero, the states kept): y, the
    new states and h again against the float64 step of the same operands. In tiles of h's
    rows: a row tile of 128 rows (58 past N), H = 128 in 32-unit tiles; ``swapped``: tiles
    of 64 rows of W_hh (G gates of U units, rows past G*U unused: GRU 20 units, 4 rows),
    h's rows as the instructions' B (10 tiles of 8 rows, 2 past N), H = 136 (K past whole
    chunks, a last tile of fewer units than U)."""
    from rnncc.schedules import cuda_wgmma_step
    from tir_sim import Simulator

    cell = rnncc.cells.get(cell)
    why = cuda_wgmma_step.takes(cell)
    if why is not None:
        assert cell.name in why
        return
    if swapped:
        kernel, plan, args, want = _step_case(cell, 70, 136, "bfloat16", True, rng,
                                              swapped=True)
        unit = 64 // cell.gates // 2 * 2
        assert (plan.swapped, plan.unit, plan.cols) == (True, unit, 8)
        assert plan.tail and 136 % unit and plan.i_tiles == -(-136 // unit)
    else:
        kernel, plan, args, want = _step_case(cell, 70, 128, "bfloat16", True, rng, unit=32)
        assert not plan.tma and plan.cols == cell.gates * 32
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    got = dict(zip(want, args[-len(want):]))
    for name, value in want.items():
        bound = 8e-3 if name in ("y", "h_operand") else 1e-5
        err = np.abs(got[name].astype(np.float64) - value).max() / np.abs(value).max()
        assert err < bound, (name, err)


@pytest.mark.parametrize("cell, dtype, n, h, unit, tma, cluster, box", [
    pytest.param("lstm", "float16", 135, 1024, 16, True, 2, 16, marks=pytest.mark.slow),
    pytest.param("gru", "float16", 135, 1024, 16, True, 2, 8, marks=pytest.mark.slow),
    ("lstm", "tf32", 100, 512, 8, True, 1, 8),
    ("lstm", "float16", 40, 128, 8, False, 1, 8)])
def test_one_step_kernel_fed_by_the_tma_engine_on_the_simulator(cell, dtype, n, h, unit, tma,
                                                                cluster, box, rng):
    """The same step fed by the TMA engine (a block's K 16 chunks: halves of H 1024, TF32 of
    H 512), N = 135 as a cluster of two row tiles, each block copying half of the tile's
    boxes of W_hh (LSTM: two of its four gates'; GRU: three halves of its three gates') and
    multicasting them; and, copied by the warpgroups, 64-row tiles (N <= 64)."""
    from tir_sim import Simulator

    kernel, plan, args, want = _step_case(rnncc.cells.get(cell), n, h, dtype, False, rng, unit)
    assert (plan.tma, plan.cluster, plan.unit, plan.box) == (tma, cluster, unit, box)
    Simulator(kernel, {p.name: x for p, x in zip(kernel.params, args)}).run()
    for name, got in zip(want, args[-len(want):]):
        bound = TOL_F32 if name in ("h_next", "c_next") else 2e-3
        err = np.abs(got.astype(np.float64) - want[name]).max() / np.abs(want[name]).max()
        assert err < bound, (name, err)


@pytest.mark.slow  # 250 s on CI's 2 cores (layers lowered for every case)
def test_one_step_kernel_where_it_is_faster():
    """The layer's step is one kernel (no sums workspace hp) where the warpgroup MMA takes
    its product: in swapped tiles where every row of W_hh's tiles is a gate's (LSTM: 4 x 16
    units), 16-bit, within one wave (float16 LSTM 1024 N79 in 2 tiles of 40 rows of h, N256
    of 128; LSTM 1000 N128, K past whole chunks); else in tiles of h's rows where a thread's
    epilogue is short (16-bit operands, at most 16 sums a thread, tiles at least 24 columns
    wide, more than one gate, K whole chunks): bfloat16 GRU 512 -> 1024 N100 bidirectional
    with lengths; not LSTM 2048 N256 (swapped: two waves; else 64 sums a thread), GRU 1000
    (K past whole chunks), TF32, an RNN (one gate), a cell with means, IEEE float32, Ampere,
    nor with fused_step off."""
    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_step

    def plan(cell, n, h, dtype):
        g = rnncc.cells.get(cell).gates
        func = comp.gemm((n,), h, g * h, "rows", dtype, dtype)
        return cuda_wgmma_step.plan_of(cuda_mma_gemm.product_of(func, CUDA), g)

    for cell, n, dtype, want in [("lstm", 79, "float16", (True, 16, 40, 128)),
                                 ("lstm", 256, "bfloat16", (True, 16, 128, 128)),
                                 ("gru", 96, "float16", (False, 8, 24, 128))]:
        found = plan(cell, n, 1024, dtype)
        assert (found.swapped, found.unit, found.cols, found.grid) == want

    def step(cell, c, h, n, dtype, target=CUDA, options=None, **given):
        problem = Problem(rnncc.cells.get(cell), c, h, n, dtype, **given)
        lowered = sequence.build(problem, Options(persistent="off", **(options or {})), target)
        names = [s["name"] for s in lowered.signatures["forward"]]
        assert ("hp" in names) == (lowered.rules.get("step") is None)
        return lowered.rules.get("step")

    fused = "cuda.wgmma_step"
    assert step("lstm", 1024, 1024, 128, "float16") == fused
    assert step("lstm", 1000, 1000, 128, "float16") == fused  # swapped: K past whole chunks
    assert step("gru", 1000, 1000, 128, "float16") is None  # not swapped: K past whole chunks
    assert step("gru", 512, 1024, 100, "bfloat16", directions=2, lengths=True) == fused
    assert step("lstm", 1024, 1024, 128, "float16", options={"fused_step": False}) is None
    assert step("lstm", 2048, 2048, 256, "float16") is None  # swapped over one wave
    assert step("lstm", 1024, 1024, 96, "float32", allow_tf32=True) is None
    assert step("rnn_tanh", 1024, 1024, 256, "float16") is None
    assert step("rnn_relu", 2048, 2048, 256, "float16") is None  # 32 columns: one gate
    assert step("ln_lstm", 1024, 1024, 128, "float16") is None
    assert step("lstm", 1024, 1024, 128, "float32") is None
    assert step("lstm", 1024, 1024, 128, "float16", target=AMPERE) is None


def _recurrent_k(cell, h, n, dtype, **given):
    """(K of W_hh as the non-persistent CUDA entry takes it packed, of h's copy) of a layer
    (C 64), checking that the packing entry writes that shape and that a stage zeroes the
    copy where K is padded."""
    problem = Problem(rnncc.cells.get(cell), 64, h, n, dtype, **given)
    lowered = sequence.build(problem, Options(persistent="off"), CUDA)
    sig = {s["name"]: s["shape"] for s in lowered.signatures["forward"]}
    assert lowered.signatures["pack_w_hh"][-1]["shape"][1:] == sig["w_hh"][1:]
    assert ("zero_h_operand" in lowered.rules) == (sig["w_hh"][1] != h)
    return sig["w_hh"][1], sig["h_operand"][-1]


@pytest.mark.slow
def test_recurrent_k_padded_to_whole_rows_where_the_step_is_swapped():
    """An inference layer whose step is the one-step kernel in swapped tiles takes W_hh
    packed [G*H, R'] and h's copy [2, N, R'] (R' = H rounded up to 128-byte rows, zeros past
    H, the copy's set by a stage each call): float16 LSTM 200 N70 (256), bfloat16 in both
    directions; not where H is whole rows (256), nor where the step is not that kernel (GRU,
    TF32: K past whole chunks)."""
    assert _recurrent_k("lstm", 200, 70, "float16") == (256, 256)
    assert _recurrent_k("lstm", 200, 70, "bfloat16", directions=2) == (256, 256)
    assert _recurrent_k("lstm", 256, 70, "float16") == (256, 256)
    assert _recurrent_k("gru", 200, 70, "float16") == (200, 200)
    assert _recurrent_k("lstm", 200, 70, "float32", allow_tf32=True) == (200, 200)


@pytest.mark.slow
def test_recurrent_k_not_padded_in_a_training_module():
    """A training module's W_hh stays [G*H, H] (its backward reads it as packed)."""
    assert _recurrent_k("lstm", 200, 70, "float16", training=True) == (200, 200)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_padding_of_x_and_w_ih_leaves_zeros_past_c(dtype, rng):
    """The copies that pad an input projection's K (:func:`sequence.padded_input_size`): x
    [T, N, 13] into [T, N, 16] and W_ih [G*H, 13] packed [G*H, 16], zeros past C, on the CPU
    and as CUDA's rule schedules them (the simulator, outputs poisoned)."""
    t_len = tirx.Var("T", "int64")
    funcs = [comp.padded_steps(3, 13, 16, dtype, t_len),
             comp.pack_weight(4, 5, 13, comp.Layout("rows"), dtype, padded=16)]
    for func, shape in zip(funcs, [(5, 3, 13), (20, 13)]):
        assert _simulated_against_cpu_build(func, "elementwise", rng) == "cuda.elementwise"
        given = rng.standard_normal(shape).astype(dtype)
        out = tvm.runtime.tensor(np.full(shape[:-1] + (16,), np.nan, dtype), tvm.cpu())
        tvm.compile(func, target="llvm")(tvm.runtime.tensor(given, tvm.cpu()), out)
        np.testing.assert_array_equal(out.numpy(), np.pad(given, [(0, 0)] * (len(shape) - 1)
                                                          + [(0, 3)]))
    with pytest.raises(ValueError, match="combined rows"):
        comp.pack_weight(4, 5, 13, comp.Layout("cols"), dtype, padded=16)
    gru = rnncc.cells.get("gru")
    assert sequence.padded_input_size(CUDA, Options(), Problem(gru, 13, 5, 3, "float16")) == 16
    assert sequence.padded_input_size(CUDA, Options(), Problem(gru, 12, 5, 3)) == 12
    assert sequence.padded_input_size(TargetSpec("llvm").tvm_target(), Options(),
                                      Problem(gru, 13, 5, 3)) == 13
