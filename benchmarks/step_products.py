"""One step's recurrent product alone, by every CUDA gemm rule that takes it: out[n, o] =
sum_k h[n, k] W[o, k] + b[o], h [N, K], W [O, K] (the products the non-persistent schedule
runs once a step). Built where the compiler is (no GPU needed: nvcc, as deployed modules),
into one small archive; timed where the GPU is (each kernel checked against float64 first,
then ``time_evaluator``, the best of its repeats; cuBLAS's ``torch.addmm`` on the same
inputs, CUDA-graph captured, the median). The GPU machine's time is what this saves: a
rule's kernels for a dozen shapes are about 40 KB compressed and take seconds there.

    python3 benchmarks/step_products.py build kernels.tar.xz 16,2048,8192 4,1024,4096,tf32 \\
        [--rules cuda.small_batch_gemv cuda.mma_gemm] [--h weights] [--feeds]
    python3 benchmarks/step_products.py run kernels.tar.xz [--json out.json]

A shape is N,K,O with an optional fourth field, the weights' dtype (float32, float16,
bfloat16) or ``tf32`` (float32 products the rules may round to TF32). ``--rules``: only
these (by name); a rule that does not take a shape is left out of it, and said so. ``--h
weights``: h in the weights' type (as a 16-bit layer's cell step writes it for the tensor
cores), else float32. ``--feeds``: cuda.wgmma_gemm's kernel both ways, its operands copied by
its warps ("[copy]") and by the TMA engine ("[tma]", where it can copy them).
"""

import argparse
import datetime
import json
import os
import tarfile
import tempfile

import numpy as np


def _shape(text: str) -> dict:
    fields = text.split(",")
    if len(fields) not in (3, 4) or not all(f.isdigit() for f in fields[:3]):
        raise SystemExit(f"a shape is N,K,O[,dtype|tf32], got {text!r}")
    kind = fields[3] if len(fields) == 4 else "float32"
    if kind not in ("float32", "float16", "bfloat16", "tf32"):
        raise SystemExit(f"the fourth field is float32, float16, bfloat16 or tf32, got {kind!r}")
    n, k, o = (int(f) for f in fields[:3])
    return {"n": n, "k": k, "o": o, "kind": kind}


def _variants(rule, func, target, feeds: bool) -> list:
    """(label, IRModule) of the kernels of ``rule`` for ``func``: its own; with ``feeds``,
    cuda.wgmma_gemm's with each feed it can take."""
    import tvm

    from rnncc.schedules import cuda_mma_gemm, cuda_wgmma_gemm

    sch = rule.apply(func, target)
    if sch is None or not feeds or rule.name != "cuda.wgmma_gemm":
        return [] if sch is None else [(rule.name, sch.mod)]
    product, found = cuda_mma_gemm.product_of(func, target), []
    for feed in ("copy", "tma"):
        try:
            kernel = cuda_wgmma_gemm.kernel(product, feed=feed)
        except ValueError as err:
            print(f"{rule.name}: {err}")
            continue
        found.append((f"{rule.name}[{feed}]", tvm.IRModule({"main": kernel})))
    return found


def build(archive: str, shapes: list, rules: list, h: str = "float32",
          feeds: bool = False) -> None:
    import tvm

    from rnncc import schedules
    from rnncc.compiler import pipeline
    from rnncc.compiler.cuda_binary import nvcc_callback, pack_imports_with_cubin
    from rnncc.lowering import components as comp
    from rnncc.target import TargetSpec

    target = TargetSpec("cuda").tvm_target()
    folder, index = tempfile.mkdtemp(prefix="rnncc_products_"), []
    for shape in shapes:
        dtype = "float32" if shape["kind"] == "tf32" else shape["kind"]
        h_dtype = dtype if h == "weights" else "float32"
        func = comp.gemm((shape["n"],), shape["k"], shape["o"], "rows", dtype, h_dtype)
        if shape["kind"] == "tf32":
            func = func.with_attr(schedules.TF32_ATTR, True)
        for rule in schedules.RULES[("cuda", "gemm")]:
            if rules and rule.name not in rules:
                continue
            variants = _variants(rule, func, target, feeds)
            if not variants:
                print(f"{rule.name} does not take {shape}")
            for label, mod in variants:
                name = f"{shape['n']}_{shape['k']}_{shape['o']}_{shape['kind']}_{label}.so"
                reports = {}
                with (nvcc_callback("sm_90", reports),
                      tvm.transform.PassContext(config=pipeline.CONFIG)):
                    tvm.compile(mod, target=target,
                                tir_pipeline=pipeline.register()).export_library(
                                    os.path.join(folder, name),
                                    fpack_imports=pack_imports_with_cubin("sm_90", reports))
                index.append({**shape, "rule": label, "file": name, "ptxas": reports,
                              "h_dtype": h_dtype})
                print(f"built {name}", flush=True)
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(index, f)
    with tarfile.open(archive + ".tmp", "w:xz") as tar:
        for entry in os.listdir(folder):
            tar.add(os.path.join(folder, entry), arcname=entry)
    os.replace(archive + ".tmp", archive)


def run(archive: str, json_path: str | None) -> None:
    import torch
    import tvm

    from rnncc.bench import _graph_ms
    from rnncc.runtime.files import write_json

    folder = tempfile.mkdtemp(prefix="rnncc_products_")
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    with open(os.path.join(folder, "index.json")) as f:
        index = json.load(f)
    dev, rows, cublas = tvm.cuda(0), [], {}
    for entry in index:
        n, k, o, kind = entry["n"], entry["k"], entry["o"], entry["kind"]
        dtype = "float32" if kind == "tf32" else kind
        rng = np.random.default_rng(0)
        h = torch.tensor(rng.standard_normal((n, k))).to(
            getattr(torch, entry.get("h_dtype", "float32")))
        w = torch.tensor(rng.uniform(-0.05, 0.05, (o, k))).to(getattr(torch, dtype))
        b = torch.tensor(rng.uniform(-0.05, 0.05, o)).to(getattr(torch, dtype))
        w64, b64 = w.double().numpy(), b.double().numpy()
        want = h.double().numpy() @ w64.T + b64
        lib = tvm.runtime.load_module(os.path.join(folder, entry["file"]))
        args = [tvm.runtime.from_dlpack(h.cuda()), tvm.runtime.from_dlpack(w.cuda()),
                tvm.runtime.from_dlpack(b.cuda()),
                tvm.runtime.tensor(np.full((n, o), np.nan, "float32"), dev)]
        lib["main"](*args)
        error = float(np.abs(args[3].numpy() - want).max() / np.abs(want).max())
        timer = lib.time_evaluator("main", dev, number=50, repeat=5)
        us = min(timer(*args).results) * 1e6
        key = (n, k, o, kind)
        if key not in cublas:  # CUDA-graph captured: no launch overhead, as time_evaluator's
            torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
            a, wc, bc = h.cuda().to(w.dtype), w.cuda(), b.cuda()
            cublas[key] = _graph_ms(torch, lambda a=a, wc=wc, bc=bc: torch.addmm(bc, a, wc.T),
                                    200) * 1e3
        rows.append({**{x: entry[x] for x in ("n", "k", "o", "kind", "rule")}, "us": us,
                     "error": error, "cublas_us": cublas[key],
                     "tb_per_s": o * k * w.element_size() / us / 1e6})
    device = torch.cuda.get_device_name()
    print(f"{device}, {datetime.date.today()}, one step's product alone, us\n")
    print("| N | K | O | dtype | rule | us | TB/s of W | error | cuBLAS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['n']} | {r['k']} | {r['o']} | {r['kind']} | {r['rule']} | {r['us']:.2f} | "
              f"{r['tb_per_s']:.2f} | {r['error']:.1e} | {r['cublas_us']:.2f} |")
    if json_path:
        write_json(json_path, {"device": device, "date": str(datetime.date.today()),
                               "rows": rows})


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("build")
    made.add_argument("archive")
    made.add_argument("shapes", nargs="+", type=_shape)
    made.add_argument("--rules", nargs="+", default=[])
    made.add_argument("--h", choices=("float32", "weights"), default="float32")
    made.add_argument("--feeds", action="store_true")
    timed = sub.add_parser("run")
    timed.add_argument("archive")
    timed.add_argument("--json")
    args = parser.parse_args()
    if args.command == "build":
        build(args.archive, args.shapes, args.rules, args.h, args.feeds)
    else:
        run(args.archive, args.json)


if __name__ == "__main__":
    main()
