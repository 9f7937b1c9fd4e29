"""The persistent-kernel table: rnncc (persistent where it fits, else the fallback), rnncc's
non-persistent schedule, and cuDNN through PyTorch, each CUDA-graph captured, T = 100, C = H:
float32 with TF32 off on both sides, and float16 (half storage; rnncc accumulates in float32).
Run on a GPU machine from the repository root:

    python3 benchmarks/persistent.py [--repeat 100] [--dtype float16] [--json out.json]
                                     [--jobs 8]

Prints a markdown table with the GPU's name and the date, as in docs/benchmarks.md. The modules
are compiled first, ``--jobs`` at a time in worker processes, then timed one by one.
"""

import argparse
import datetime
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

import rnncc
from rnncc.bench import time_gpu
from rnncc.runtime.files import write_json

CONFIGS = [("lstm", h, n, "float32") for h in (256, 512, 1024, 1536) for n in (1, 4)] + [
    ("gru", h, n, "float32") for h in (512, 1024, 2048) for n in (1, 4)] + [
    ("lstm", 2048, 4, "float16"), ("gru", 2816, 1, "float16")]


def _compile(job):
    (cell, hidden, batch, dtype), folder = job
    path = os.path.join(folder, f"{cell}_{hidden}_{batch}_{dtype}.so")
    return rnncc.compile(cell, hidden, hidden, batch, target="cuda", dtype=dtype).export(path)


def _time(args, configs, paths):
    rows, device = [], None
    for (cell, hidden, batch, dtype), path in zip(configs, paths):
        module = rnncc.load(path)
        best = time_gpu(module, args.steps, args.repeat)
        device = best.get("device")
        if best["entry"] == "persistent":
            seq = time_gpu(module, args.steps, args.repeat, cudnn=False, entry="sequence")["rnncc"]
        else:
            seq = best["rnncc"]
        plan = module.metadata["schedule"]["persistent"].get("plan")
        per = 1e3 / args.steps
        streaming = best["entry"] == "persistent" and plan["global_chunks"] > 0
        rows.append({"cell": cell, "H": hidden, "N": batch, "dtype": dtype,
                     "schedule": best["entry"] + (" (streaming)" if streaming else ""),
                     "plan": f"B={plan['blocks']} {plan['sync']}" if plan else "-",
                     "rnncc_us": best["rnncc"] * per, "sequence_us": seq * per,
                     "cudnn_us": best["cudnn"] * per})
    return rows, device


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dtype", choices=("float32", "float16"), help="only these rows")
    parser.add_argument("--json")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="modules compiled at once")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if not args.dtype or c[3] == args.dtype]
    with tempfile.TemporaryDirectory() as folder:
        with ProcessPoolExecutor(args.jobs) as pool:
            paths = list(pool.map(_compile, [(c, folder) for c in configs]))
        rows, device = _time(args, configs, paths)
    print(f"{device}, {datetime.date.today().isoformat()}, T={args.steps}, TF32 off\n")
    print("| cell | H | N | dtype | schedule | plan | rnncc us/step | non-persistent us/step "
          "| cuDNN us/step | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['cell']} | {r['H']} | {r['N']} | {r['dtype']} | {r['schedule']} "
              f"| {r['plan']} "
              f"| {r['rnncc_us']:.2f} | {r['sequence_us']:.2f} | {r['cudnn_us']:.2f} "
              f"| {r['cudnn_us'] / r['rnncc_us']:.2f}x |")
    if args.json:
        write_json(args.json, {"device": device, "rows": rows})


if __name__ == "__main__":
    main()
