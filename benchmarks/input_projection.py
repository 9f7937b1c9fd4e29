"""The input projection of all steps alone: the component as `rnncc compile` schedules and
builds it (nvcc, as deployed modules; TVM alone would use NVRTC with other ptxas options and
fast math, which gave this rule's kernels 141 registers instead of 128 and other speeds)
against cuBLAS (`torch.addmm`), both CUDA-graph captured, T = 100, C = H, TF32 off; outputs
checked against float64 first. Run on a GPU machine from the repository root:

    python3 benchmarks/input_projection.py

Prints one line a configuration, in microseconds a step (docs/benchmarks.md has the table).
"""

import torch
import tvm
import tvm_ffi
from tvm import tirx

from rnncc import cells, schedules
from rnncc.bench import _graph_ms
from rnncc.compiler import pipeline
from rnncc.compiler.cuda_binary import nvcc_callback
from rnncc.lowering import components as comp
from rnncc.lowering import sequence
from rnncc.spec import Options, Problem

STEPS = 100
CONFIGS = [("lstm", 256, 4, "float32"), ("lstm", 1024, 1, "float32"),
           ("lstm", 1024, 4, "float32"), ("lstm", 1536, 4, "float32"),
           ("gru", 1024, 4, "float32"), ("gru", 2048, 4, "float32"),
           ("lstm", 2048, 4, "float16"), ("gru", 2816, 1, "float16"),
           ("lstm", 256, 64, "float32"), ("lstm", 1024, 64, "float32"),
           ("lstm", 1536, 64, "float32"), ("gru", 2048, 64, "float32")]


def measure(target, cell, hidden, batch, dtype):
    """(rule, rnncc us/step, relative error, cuBLAS us/step) for one configuration."""
    problem = Problem(cells.get(cell), hidden, hidden, batch, dtype)
    layout = sequence.layout_for(target, Options(), problem)  # as rnncc compile lays xp out
    rows = problem.gates * hidden
    lead = (tirx.Var("M", "int64"),) if layout.flat_rows else (tirx.Var("T", "int64"), batch)
    func = comp.gemm(lead, hidden, rows, "rows", dtype)
    scheduled = schedules.schedule(func, target, "gemm")
    with nvcc_callback(target.attrs["arch"], {}):
        mod = tvm.compile(tvm.IRModule({"main": scheduled.func}), target=target,
                          tir_pipeline=pipeline.register()).mod
    tdt = getattr(torch, dtype)
    a = torch.randn(STEPS, batch, hidden, device="cuda").to(tdt)
    w = (torch.randn(rows, hidden, device="cuda") / hidden ** 0.5).to(tdt)
    b = torch.randn(rows, device="cuda").to(tdt)
    out = torch.empty(STEPS, batch, rows, device="cuda")  # the accumulation dtype
    if layout.flat_rows:  # the component's shapes: [T*N, C] -> [T*N, G*H]
        a_arg, out_arg = a.view(-1, hidden), out.view(-1, rows)
    else:
        a_arg, out_arg = a, out
    args = [tvm_ffi.from_dlpack(x) for x in (a_arg, w, b, out_arg)]
    device = tvm_ffi.device("cuda:0")

    def call():
        with tvm_ffi.use_raw_stream(device, torch.cuda.current_stream().cuda_stream):
            mod["main"](*args)

    out.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    ref = a.double() @ w.double().T + b.double()
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    ours = _graph_ms(torch, call, 100) * 1e3 / STEPS
    cublas = _graph_ms(torch, lambda: torch.addmm(b, a.reshape(-1, hidden), w.T), 100)
    return scheduled.rule, ours, err, cublas * 1e3 / STEPS


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for cell, hidden, batch, dtype in CONFIGS:
        rule, ours, err, cublas = measure(target, cell, hidden, batch, dtype)
        print(f"{cell} {hidden} N={batch} {dtype}: {rule} {ours:.2f} us/step "
              f"(relative error {err:.1e}), cuBLAS {cublas:.2f} us/step", flush=True)


if __name__ == "__main__":
    main()
