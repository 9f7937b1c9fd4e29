"""The input projection of all steps alone: the component as `rnncc compile` schedules and
builds it (nvcc, as deployed modules; TVM alone would use NVRTC with other ptxas options and
fast math, which gave this rule's kernels 141 registers instead of 128 and other speeds)
against cuBLAS (`torch.addmm`), both CUDA-graph captured, T = 100, C = H, TF32 off; outputs
checked against float64 first. Run on a GPU machine from the repository root:

    python3 benchmarks/input_projection.py [--variants] [--half-batch-256]

Prints one line a configuration, in microseconds a step (docs/benchmarks.md has the table).
``--variants``: where cuda.wgmma_gemm takes the product, its kernel fed both ways, by its
warps' copies ("copy") and by the TMA engine ("tma"), and the TMA-fed one with a block a
multiprocessor looping over tiles ("tma-persistent"), each a line. ``--half-batch-256``: the
float16 and bfloat16 layers at batch 256 instead (where the half types lose to cuDNN).
"""

import argparse

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
from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm
from rnncc.spec import Options, Problem

STEPS = 100
CONFIGS = [("lstm", 256, 4, "float32"), ("lstm", 1024, 1, "float32"),
           ("lstm", 1024, 4, "float32"), ("lstm", 1536, 4, "float32"),
           ("gru", 1024, 4, "float32"), ("gru", 2048, 4, "float32"),
           ("lstm", 2048, 4, "float16"), ("gru", 2816, 1, "float16"),
           ("lstm", 256, 64, "float32"), ("lstm", 1024, 64, "float32"),
           ("lstm", 1536, 64, "float32"), ("gru", 2048, 64, "float32")]
HALF_256 = [("lstm", 1024, 256, "float16"), ("lstm", 2048, 256, "float16"),
            ("gru", 2048, 256, "float16"), ("lstm", 2048, 256, "bfloat16"),
            ("lstm", 4096, 256, "float16")]
#: a variant's cuda.wgmma_gemm kernel arguments: feed, blocks looping over tiles (0: none)
VARIANTS = {"copy": ("copy", 0), "tma": ("tma", 0), "tma-persistent": ("tma", 132)}


def _kernel(func, target, variant):
    """(rule, PrimFunc) of ``func``: as scheduled, or cuda.wgmma_gemm's ``variant``."""
    if variant is None:
        scheduled = schedules.schedule(func, target, "gemm")
        return scheduled.rule, scheduled.func
    feed, blocks = VARIANTS[variant]
    product = cuda_mma_gemm.product_of(func, target)
    return f"cuda.wgmma_gemm[{variant}]", cuda_wgmma_gemm.kernel(product, feed=feed,
                                                                  persistent=blocks)


def measure(target, cell, hidden, batch, dtype, variant=None):
    """(rule, rnncc us/step, relative error, cuBLAS us/step) for one configuration
    (``variant``: one of :data:`VARIANTS` of cuda.wgmma_gemm's kernel)."""
    problem = Problem(cells.get(cell), hidden, hidden, batch, dtype)
    layout = sequence.layout_for(target, Options(), problem)  # as rnncc compile lays xp out
    rows = problem.gates * hidden
    lead = (tirx.Var("M", "int64"),) if layout.flat_rows else (tirx.Var("T", "int64"), batch)
    func = comp.gemm(lead, hidden, rows, "rows", dtype)
    rule, kernel = _kernel(func, target, variant)
    with nvcc_callback(target.attrs["arch"], {}):
        mod = tvm.compile(tvm.IRModule({"main": kernel}), target=target,
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
    return rule, ours, err, cublas * 1e3 / STEPS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--half-batch-256", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for cell, hidden, batch, dtype in HALF_256 if args.half_batch_256 else CONFIGS:
        rule = measure_line(target, cell, hidden, batch, dtype, None)
        if args.variants and rule == "cuda.wgmma_gemm":
            for variant in VARIANTS:
                try:
                    measure_line(target, cell, hidden, batch, dtype, variant)
                except ValueError as err:  # a feed that cannot take the product
                    print(f"{cell} {hidden} N={batch} {dtype}: {variant}: {err}")


def measure_line(target, cell, hidden, batch, dtype, variant) -> str:
    """:func:`measure`'s line printed; the rule."""
    rule, ours, err, cublas = measure(target, cell, hidden, batch, dtype, variant)
    print(f"{cell} {hidden} N={batch} {dtype}: {rule} {ours:.2f} us/step "
          f"(relative error {err:.1e}), cuBLAS {cublas:.2f} us/step", flush=True)
    return rule


if __name__ == "__main__":
    main()
