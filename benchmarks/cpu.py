"""CPU modules (the llvm target): rnncc.nn against torch.nn on this machine's CPU, T = 100,
C = H, float32, torch on as many threads as the machine has CPUs and rnncc on as many as it
has cores (TVM_NUM_THREADS overrides); microseconds a time step
(the best of ``--loops`` loops of ``--calls`` calls), and rnncc's relative error against torch
in float64 first. Run from the repository root on any machine:

    python3 benchmarks/cpu.py [--calls 3] [--loops 7] [--json out.json]

Prints a markdown table with the CPU's name and the date. The modules compile on first use
into the on-disk cache (``RNNCC_CACHE_DIR``).
"""

import argparse
import datetime
import os
import platform
import time

from rnncc.runtime.files import write_json

#: (torch.nn class, H, batch)
LAYERS = [("LSTM", 64, 1), ("LSTM", 256, 1), ("LSTM", 512, 1), ("LSTM", 256, 4),
          ("GRU", 256, 16), ("LSTM", 128, 64)]
STEPS = 100


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _per_step(fn, calls: int, loops: int) -> float:
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6 / STEPS


def _row(torch, kind, hidden, batch, calls, loops) -> dict:
    import rnncc.nn

    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(hidden, hidden)
    ours = rnncc.nn.from_torch(theirs)
    x = torch.randn(STEPS, batch, hidden)
    with torch.no_grad():
        y = ours(x)[0].double()
        ref = theirs.double()(x.double())[0]
        theirs.float()
        error = ((y - ref).abs().max() / ref.abs().max()).item()
        return {"network": kind, "H": hidden, "N": batch, "error": error,
                "rnncc_us": _per_step(lambda: ours(x), calls, loops),
                "torch_us": _per_step(lambda: theirs(x), calls, loops)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    rows = [_row(torch, kind, hidden, batch, args.calls, args.loops)
            for kind, hidden, batch in LAYERS]
    import tvm

    name, threads = _cpu_name(), tvm.get_global_func("runtime.NumThreads")()
    print(f"{name}, {os.cpu_count()} cores, {datetime.date.today()}, T={STEPS}, C=H, float32, "
          f"rnncc on {threads} threads, torch on {torch.get_num_threads()}, us per time step\n")
    print("| network | H | N | rnncc | torch | speed-up | rnncc's error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['network']} | {r['H']} | {r['N']} | {r['rnncc_us']:.1f} | "
              f"{r['torch_us']:.1f} | {r['torch_us'] / r['rnncc_us']:.2f}x | "
              f"{r['error']:.1e} |")
    if args.json:
        write_json(args.json, {"device": name, "cores": os.cpu_count(), "rnncc_threads": threads,
                               "torch_threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
