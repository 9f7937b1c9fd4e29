"""Schedule rules, checked on the scheduled TIR (no GPU needed)."""

import pytest
import tvm
import tvm_ffi
from tvm import tirx

import rnncc
from rnncc import schedules
from rnncc.lowering import components as comp
from rnncc.lowering import sequence
from rnncc.schedules._rule import Rule
from rnncc.spec import Options, Problem
from rnncc.target import TargetSpec

CUDA = TargetSpec("cuda").tvm_target()
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
    assert result.rule == "cuda.elementwise"
    # one loop nest: blockIdx.x over threadIdx.x, each thread one (n, j) element
    assert thread_tags(result.func) == {"blockIdx.x", "threadIdx.x"}
    script = result.func.script()
    assert script.count('thread="blockIdx.x"') == 1


def test_unfused_step_is_several_kernels():
    step = comp.cell_step(rnncc.cells.get("lstm"), 3, 33, "float32", "combined", fused=False)
    result = schedules.schedule(step, CUDA, "elementwise")
    assert result.func.script().count('thread="blockIdx.x"') > 8


def test_cuda_gemm_rule_choice():
    t_len = tirx.Var("T", "int64")
    cases = [((1,), 512, 2048, "cuda.gemv"), ((64,), 512, 2048, "cuda.matmul"),
             ((t_len, 1), 256, 2048, "cuda.matmul"), ((1,), 1, 4, "cuda.gemm_simple")]
    for lead, k, o, rule in cases:
        result = schedules.schedule(comp.gemm(lead, k, o, "rows", "float32"), CUDA, "gemm")
        assert result.rule == rule, (lead, k, o, result.notes)
        assert {"blockIdx.x", "threadIdx.x"} <= thread_tags(result.func) | {"blockIdx.x"}


def test_cpu_gemm_is_parallel_and_vectorised():
    result = schedules.schedule(comp.gemm((3,), 64, 128, "cols", "float32"), LLVM, "gemm")
    assert result.rule == "cpu.gemm"
    kinds = {k for k, _ in loops(result.func)}
    assert int(tirx.ForKind.PARALLEL) in kinds and int(tirx.ForKind.VECTORIZED) in kinds


def test_failing_rule_falls_back_and_says_so(monkeypatch):
    def broken(func, target):
        raise RuntimeError("no luck")

    monkeypatch.setitem(schedules.RULES, ("llvm", "gemm"),
                        [Rule("test.broken", broken)] + schedules.RULES[("llvm", "gemm")])
    with pytest.warns(UserWarning, match="test.broken failed"):
        result = schedules.schedule(comp.gemm((2,), 3, 8, "cols", "float32"), LLVM, "gemm")
    assert result.rule == "cpu.gemm"
    assert result.notes == ["test.broken failed (RuntimeError: no luck)"]


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
