"""Eager calls, no CUDA graph: rnncc.nn against torch.nn (cuDNN on a GPU), T = 100, C = H,
IEEE float32 (TF32 off on both sides), in one process; microseconds a call, the best of 5
loops of 200 calls queued and then one synchronize. A small network's eager call is bound by
the host (Python and torch's dispatch), not by its kernels: this measures that cost, which a
CUDA graph removes (benchmarks/networks.py measures the graphs). Run on a GPU machine from the
repository root:

    python3 benchmarks/eager.py [--device cpu] [--json out.json]

Prints a markdown table with the device's name and the date: padded input, and packed
(lengths spread from T to T/4, a PackedSequence made once before the timing).
"""

import argparse
import datetime
import time

from rnncc.runtime.files import write_json

#: (torch.nn class, H, layers, bidirectional, batch)
NETWORKS = [("LSTM", 256, 1, False, 1), ("LSTM", 512, 1, False, 4), ("LSTM", 512, 2, False, 4),
            ("GRU", 512, 2, True, 4), ("LSTM", 512, 2, False, 64)]
STEPS = 100


def _per_call(torch, device, fn, calls=200, loops=5) -> float:
    """us a call of ``fn``: the best of ``loops`` loops of ``calls`` calls and one
    synchronize."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    best = float("inf")
    for _ in range(loops):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _row(torch, device, kind, hidden, layers, bidirectional, batch, calls) -> dict:
    import rnncc.nn

    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(hidden, hidden, num_layers=layers,
                                     bidirectional=bidirectional).to(device)
    ours = rnncc.nn.from_torch(theirs)
    x = torch.randn(STEPS, batch, hidden, device=device)
    lengths = torch.linspace(STEPS, STEPS // 4, batch).round().long()
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    with torch.no_grad():
        for module in (ours, theirs):  # compiled or loaded, and warm
            module(x), module(packed)
        return {name: _per_call(torch, device, fn, calls) for name, fn in (
            ("rnncc padded", lambda: ours(x)), ("rnncc packed", lambda: ours(packed)),
            ("torch padded", lambda: theirs(x)), ("torch packed", lambda: theirs(packed)))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    rows = []
    for kind, hidden, layers, bidirectional, batch in NETWORKS:
        times = _row(torch, device, kind, hidden, layers, bidirectional, batch, args.calls)
        rows.append({"network": kind, "H": hidden, "layers": layers,
                     "bidirectional": bidirectional, "N": batch, **times})
    print(f"{name}, {datetime.date.today()}, eager, T={STEPS}, C=H, TF32 off, us per call\n")
    print("| network | H | layers | directions | N | rnncc padded | rnncc packed | "
          "torch padded | torch packed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['network']} | {r['H']} | {r['layers']} | {2 if r['bidirectional'] else 1} "
              f"| {r['N']} | {r['rnncc padded']:.0f} | {r['rnncc packed']:.0f} | "
              f"{r['torch padded']:.0f} | {r['torch packed']:.0f} |")
    if args.json:
        write_json(args.json, {"device": name, "rows": rows})


if __name__ == "__main__":
    main()
