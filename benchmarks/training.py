"""One training step (forward and backward): rnncc.nn against cuDNN through torch.nn, T = 100,
C = H, IEEE float32 (TF32 off on both sides; and half-precision rows, the whole network in
float16 or bfloat16 on both sides), both captured in CUDA graphs, in one process;
microseconds a time step, and the peak memory a step adds. Run on a GPU machine from the
repository root:

    python3 benchmarks/training.py [--repeat 50] [--jobs 16] [--json out.json] [--profile]
                                   [--dtype bfloat16] [--config LSTM,2048,1,1,32,bfloat16 ...]
                                   [--packed]

``--config``: rows of your own instead of the table's (network, H, layers, directions, N,
dtype; no memory rows). ``--profile``: after each row, where each side's time goes: the
kernels of one step (by ``torch.profiler``), each kernel's times summed, the longest first.

The step is ``y, _ = net(x); y.backward(dy)`` with x requiring grad (so both sides compute the
gradients of the input and of every weight and bias). ``--packed``: each row also as a
PackedSequence (lengths spread from T to T/4 in a random order, its ``data`` the leaf that
requires grad), on both sides. Before timing, the two sides' gradients of one step (same
weights, same x and dy) are compared. The training modules compile first, ``--jobs`` at a time
in worker processes, into the on-disk cache the timed modules load from.
"""

import argparse
import datetime
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

#: (torch class, hidden size, layers, bidirectional, batch, dtype): the training issue's table.
CONFIGS = [("LSTM", 1024, 1, False, 1, "float32"), ("LSTM", 1024, 1, False, 4, "float32"),
           ("LSTM", 1024, 1, False, 64, "float32"), ("GRU", 1024, 1, False, 1, "float32"),
           ("GRU", 1024, 1, False, 4, "float32"), ("GRU", 1024, 1, False, 64, "float32"),
           ("LSTM", 512, 2, True, 64, "float32"), ("LSTM", 1024, 1, False, 64, "bfloat16"),
           ("GRU", 1024, 1, False, 64, "bfloat16"), ("LSTM", 1024, 1, False, 128, "bfloat16"),
           ("LSTM", 1024, 1, False, 64, "float16")]
#: (torch class, hidden size, batch, steps): the peak memory of a step.
MEMORY = [("LSTM", 1024, 64, 100), ("LSTM", 1024, 64, 1000)]
STEPS = 100


def _config(text: str) -> tuple:
    """A row from ``--config NETWORK,H,LAYERS,DIRECTIONS,N,DTYPE``."""
    parts = text.split(",")
    usage = (f"--config takes NETWORK,H,LAYERS,DIRECTIONS,N,DTYPE (e.g. LSTM,2048,1,1,32,bfloat16"
             f"; NETWORK LSTM or GRU, DIRECTIONS 1 or 2, DTYPE float32, float16 or "
             f"bfloat16), got {text!r}")
    if (len(parts) != 6 or parts[0] not in ("LSTM", "GRU") or parts[3] not in ("1", "2")
            or parts[5] not in ("float32", "float16", "bfloat16")
            or not all(p.isdigit() and int(p) > 0 for p in (parts[1], parts[2], parts[4]))):
        raise argparse.ArgumentTypeError(usage)
    kind, hidden, layers, directions, batch, dtype = parts
    return kind, int(hidden), int(layers), directions == "2", int(batch), dtype


def _jobs(arch, configs=CONFIGS, memory=MEMORY, packed=False):
    from rnncc.nn.network import bucket

    jobs = set()
    for kind, hidden, layers, bidirectional, batch, dtype in configs + [
            (k, h, 1, False, n, "float32") for k, h, n, _ in memory]:
        for layer in range(layers):
            width = hidden * (2 if bidirectional else 1) if layer else hidden
            for lengths in (False, True)[:1 + packed]:
                jobs.add((kind.lower(), width, hidden, bucket(batch), dtype, arch, lengths))
    return sorted(jobs)


def _compile(job):
    from rnncc.compiler import cache

    cell, width, hidden, batch, dtype, arch, lengths = job
    cache.compiled(cell, width, hidden, batch, dtype=dtype, target="cuda", arch=arch,
                   training=True, lengths=lengths)
    return job


def _nets(torch, kind, hidden, layers, bidirectional, dtype="float32"):
    import rnncc.nn

    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(hidden, hidden, num_layers=layers,
                                     bidirectional=bidirectional).cuda().to(getattr(torch, dtype))
    return rnncc.nn.from_torch(theirs), theirs


def _step(net, x, dy):
    def step():
        y, _ = net(x)
        y.backward(dy)
    return step


def _inputs(torch, hidden, batch, steps, bidirectional, dtype="float32"):
    dt = getattr(torch, dtype)
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=dt, requires_grad=True)
    return x, torch.randn(steps, batch, hidden * (2 if bidirectional else 1), device="cuda",
                          dtype=dt)


def _packed_inputs(torch, x, dy):
    """(a PackedSequence of x [T, N, C] whose data is a leaf that requires grad, the packed
    dy): lengths from T to T/4, in a random order."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    steps, batch = x.shape[:2]
    lengths = torch.linspace(steps, steps // 4, batch).round().long()[torch.randperm(batch)]
    seq = pack_padded_sequence(x.detach(), lengths, enforce_sorted=False)
    leaf = seq.data.clone().requires_grad_()
    return (PackedSequence(leaf, seq.batch_sizes, seq.sorted_indices, seq.unsorted_indices),
            pack_padded_sequence(dy, lengths, enforce_sorted=False).data)


def _packed_step(net, seq, dy):
    def step():
        y, _ = net(seq)
        y.data.backward(dy)
    return step


def _gradients(net, x, step):
    net.zero_grad(set_to_none=True)
    x.grad = None
    step()
    return [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]


def _difference(mine, ref) -> float:
    return max(float((a - b).float().norm() / b.float().norm()) for a, b in zip(mine, ref))


def _peak_mib(torch, net, x, step):
    """The memory one step adds to what is allocated before it (MiB), gradients included."""
    net.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def _profile(torch, step, top=12):
    """Lines naming the kernels of one ``step`` by their summed time (us), the longest first."""
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            count, total = kernels.get(event.name, (0, 0.0))
            kernels[event.name] = (count + 1, total + event.device_time)
    whole = sum(total for _, total in kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[:top]
    return [f"  {total:9.1f} us {total / whole:6.1%}  x{count:<4d} {name[:90]}"
            for name, (count, total) in ranked] + [f"  {whole:9.1f} us in all"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json")
    parser.add_argument("--dtype", choices=sorted({c[-1] for c in CONFIGS}),
                        help="only the rows of this dtype (the memory rows are float32)")
    parser.add_argument("--profile", action="store_true",
                        help="print each side's kernels of one step, by their summed time")
    parser.add_argument("--config", type=_config, action="append",
                        help="a row of your own, NETWORK,H,LAYERS,DIRECTIONS,N,DTYPE (repeat it "
                             "for more), instead of the table's")
    parser.add_argument("--packed", action="store_true",
                        help="each row also with a PackedSequence (lengths from T to T/4)")
    args = parser.parse_args()
    configs = args.config or [c for c in CONFIGS if args.dtype in (None, c[-1])]
    measured = MEMORY if not args.config and args.dtype in (None, "float32") else []
    import torch

    from rnncc.bench import _graph_ms

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    major, minor = torch.cuda.get_device_capability()
    spawn = multiprocessing.get_context("spawn")  # this process has CUDA started: no fork
    with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        list(pool.map(_compile, _jobs(f"sm_{major}{minor}", configs, measured,
                                      args.packed)))
    rows, memory = [], []
    for kind, hidden, layers, bidirectional, batch, dtype in configs:
        ours, theirs = _nets(torch, kind, hidden, layers, bidirectional, dtype)
        x, dy = _inputs(torch, hidden, batch, STEPS, bidirectional, dtype)
        steps = {"rnncc": _step(ours, x, dy), "cudnn": _step(theirs, x, dy)}
        mine, ref = (_gradients(net, x, steps[k]) for net, k in ((ours, "rnncc"),
                                                                 (theirs, "cudnn")))
        row = {"network": kind, "H": hidden, "layers": layers, "bidirectional": bidirectional,
               "N": batch, "dtype": dtype, "max_rel_diff": _difference(mine, ref)}
        title = (f"{kind} {hidden} x{layers}{' bidirectional' if bidirectional else ''} "
                 f"N={batch} {dtype}")
        for name, net in (("rnncc", ours), ("cudnn", theirs)):
            net.zero_grad(set_to_none=True)
            row[f"{name}_us"] = _graph_ms(torch, steps[name], args.repeat) * 1e3 / STEPS
            if args.profile:
                print(f"{title}, {name}:", *_profile(torch, steps[name]), sep="\n")
        if args.packed:
            seq, dy_packed = _packed_inputs(torch, x, dy)
            packed = {k: _packed_step(net, seq, dy_packed) for k, net in (("rnncc", ours),
                                                                         ("cudnn", theirs))}
            mine, ref = (_gradients(net, seq.data, packed[k]) for net, k in ((ours, "rnncc"),
                                                                             (theirs, "cudnn")))
            row["packed_max_rel_diff"] = _difference(mine, ref)
            for name, net in (("rnncc", ours), ("cudnn", theirs)):
                net.zero_grad(set_to_none=True)
                row[f"{name}_packed_us"] = _graph_ms(torch, packed[name], args.repeat) * 1e3 / STEPS
                if args.profile:
                    print(f"{title}, {name} packed:", *_profile(torch, packed[name]), sep="\n")
        rows.append(row)
    for kind, hidden, batch, steps in measured:
        ours, theirs = _nets(torch, kind, hidden, 1, False)
        x, dy = _inputs(torch, hidden, batch, steps, False)
        memory.append({"network": kind, "H": hidden, "N": batch, "T": steps, **{
            f"{name}_mib": _peak_mib(torch, net, x, _step(net, x, dy))
            for name, net in (("rnncc", ours), ("cudnn", theirs))}})
    device = torch.cuda.get_device_name()
    print(f"{device}, {datetime.date.today()}, T={STEPS}, C=H, TF32 off, us per time step "
          "of a training step (forward and backward, all layers and directions)\n")
    print("| network | H | layers | directions | N | dtype | rnncc | cuDNN | speed-up | "
          "grads vs cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['network']} | {r['H']} | {r['layers']} | {2 if r['bidirectional'] else 1} "
              f"| {r['N']} | {r['dtype']} | {r['rnncc_us']:.1f} | {r['cudnn_us']:.1f} | "
              f"{r['cudnn_us'] / r['rnncc_us']:.2f}x | {r['max_rel_diff']:.1e} |")
    if args.packed:
        print("\n| network | H | layers | directions | N | dtype | rnncc packed | cuDNN packed | "
              "speed-up | grads vs cuDNN |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows if args.packed else []:
        print(f"| {r['network']} | {r['H']} | {r['layers']} | {2 if r['bidirectional'] else 1} "
              f"| {r['N']} | {r['dtype']} | {r['rnncc_packed_us']:.1f} | "
              f"{r['cudnn_packed_us']:.1f} | {r['cudnn_packed_us'] / r['rnncc_packed_us']:.2f}x | "
              f"{r['packed_max_rel_diff']:.1e} |")
    if memory:
        print("\n| network | H | N | T | rnncc peak MiB | cuDNN peak MiB | ratio |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in memory:
        print(f"| {r['network']} | {r['H']} | {r['N']} | {r['T']} | {r['rnncc_mib']:.0f} | "
              f"{r['cudnn_mib']:.0f} | {r['rnncc_mib'] / r['cudnn_mib']:.2f} |")
    if args.json:
        write_json(args.json, {"device": device, "rows": rows, "memory": memory})


if __name__ == "__main__":
    main()
