"""Whole networks: rnncc.nn against cuDNN through torch.nn, T = 100, C = H, IEEE float32 (TF32
off on both sides), both captured in CUDA graphs, in one process; microseconds a time step
for all layers and directions together. Run on a GPU machine from the repository root:

    python3 benchmarks/networks.py [--repeat 50] [--jobs 16] [--json out.json] [--batch 64 ...]

Prints markdown tables with the GPU's name and the date: the networks of the networks issue at
batch 1, 4 and 64; packed sequences (lengths spread from T to T/4) at batch 4 and 64 against
the same batch padded; and the cost of serving any batch (a batch of 13 on the modules of its
bucket, 16, against modules compiled for 13). ``--batch``: those of the batches only (and
no row of any batch). The layer modules compile first, ``--jobs`` at a time in worker
processes, into the on-disk cache the timed modules then load from.
"""

import argparse
import datetime
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from rnncc.runtime.files import write_json

NETWORKS = [("LSTM", 512, 2, False), ("LSTM", 512, 4, False), ("LSTM", 512, 1, True),
            ("LSTM", 1024, 3, True), ("GRU", 512, 2, True)]
BATCHES = (1, 4, 64)
STEPS = 100
CELLS = {"LSTM": "lstm", "GRU": "gru"}


def _layer_jobs(batches=BATCHES):
    """(cell, C, H, batch, lengths, directions) of every layer module the tables of
    ``batches`` use (the row of any batch where they are all of them)."""
    from rnncc.nn.network import bucket

    jobs = set()
    for kind, hidden, layers, bidirectional in NETWORKS:
        dirs = 2 if bidirectional else 1
        widths = {hidden} | ({hidden * 2} if bidirectional and layers > 1 else set())
        for width in widths:
            for batch in batches:
                jobs.add((CELLS[kind], width, hidden, bucket(batch), False, dirs))
    jobs |= {("lstm", 512, 512, batch, True, 1) for batch in PACKED_BATCHES if batch in batches}
    if tuple(batches) == BATCHES:
        jobs |= {("lstm", 512, 512, 16, False, 1), ("lstm", 512, 512, 13, False, 1)}
    return sorted(jobs)


def _compile(job):
    from rnncc.compiler import cache

    cell, width, hidden, batch, lengths, dirs, arch = job
    cache.compiled(cell, width, hidden, batch, target="cuda", arch=arch, lengths=lengths,
                   directions=dirs)
    return job


def _us(ms):
    return ms * 1e3 / STEPS


def _pair(torch, kind, hidden, layers, bidirectional, batch, repeat):
    """(rnncc us/step, cuDNN us/step) on one network and batch, same weights and input."""
    import rnncc.nn
    from rnncc.bench import _graph_ms

    torch.manual_seed(0)
    theirs = getattr(torch.nn, kind)(hidden, hidden, num_layers=layers,
                                     bidirectional=bidirectional).cuda()
    ours = rnncc.nn.from_torch(theirs)
    x = torch.randn(STEPS, batch, hidden, device="cuda")
    with torch.no_grad():
        return (_us(_graph_ms(torch, lambda: ours(x), repeat)),
                _us(_graph_ms(torch, lambda: theirs(x), repeat)))


#: The batches of the packed rows: small (where packing costs more than it leaves out) and
#: large.
PACKED_BATCHES = (4, 64)


def _packed(torch, repeat, batch):
    """LSTM 512, 2 layers: padded and packed (lengths from T to T/4), us/step."""
    import rnncc.nn
    from rnncc.bench import _graph_ms

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(512, 512, num_layers=2).cuda()
    ours = rnncc.nn.from_torch(theirs)
    x = torch.randn(STEPS, batch, 512, device="cuda")
    lengths = torch.linspace(STEPS, STEPS // 4, batch).round().long()
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    with torch.no_grad():
        return {"rnncc padded": _us(_graph_ms(torch, lambda: ours(x), repeat)),
                "rnncc packed": _us(_graph_ms(torch, lambda: ours(packed), repeat)),
                "cuDNN padded": _us(_graph_ms(torch, lambda: theirs(x), repeat)),
                "cuDNN packed": _us(_graph_ms(torch, lambda: theirs(packed), repeat))}


def _any_batch(torch, repeat):
    """LSTM 512, 1 layer, batch 13: on the modules of its bucket (16) and on modules compiled
    for 13, us/step."""
    import rnncc.nn
    from rnncc.bench import _graph_ms
    from rnncc.nn import network

    torch.manual_seed(0)
    x = torch.randn(STEPS, 13, 512, device="cuda")
    out, default = {}, network.bucket
    for name, rows in (("bucket 16", default), ("exact 13", lambda n: n)):
        network.bucket = rows
        try:
            ours = rnncc.nn.LSTM(512, 512).cuda()
            with torch.no_grad():
                out[name] = _us(_graph_ms(torch, lambda m=ours: m(x), repeat))
        finally:
            network.bucket = default
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json")
    parser.add_argument("--batch", type=int, nargs="+", choices=BATCHES, default=list(BATCHES),
                        help="the batches of the tables (default all; the row of any batch "
                             "with all only)")
    args = parser.parse_args()
    batches = tuple(b for b in BATCHES if b in args.batch)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    jobs = [job + (arch,) for job in _layer_jobs(batches)]
    spawn = multiprocessing.get_context("spawn")  # this process has CUDA started: no fork
    with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        list(pool.map(_compile, jobs))
    rows = []
    for kind, hidden, layers, bidirectional in NETWORKS:
        for batch in batches:
            mine, cudnn = _pair(torch, kind, hidden, layers, bidirectional, batch, args.repeat)
            rows.append({"network": kind, "H": hidden, "layers": layers,
                         "bidirectional": bidirectional, "N": batch, "rnncc_us": mine,
                         "cudnn_us": cudnn})
    packed = {batch: _packed(torch, args.repeat, batch) for batch in PACKED_BATCHES
              if batch in batches}
    any_batch = _any_batch(torch, args.repeat) if batches == BATCHES else {}
    device = torch.cuda.get_device_name()
    print(f"{device}, {datetime.date.today()}, T={STEPS}, C=H, TF32 off, us per time step "
          "(all layers and directions)\n")
    print("| network | H | layers | directions | N | rnncc | cuDNN | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['network']} | {r['H']} | {r['layers']} | {2 if r['bidirectional'] else 1} "
              f"| {r['N']} | {r['rnncc_us']:.2f} | {r['cudnn_us']:.2f} | "
              f"{r['cudnn_us'] / r['rnncc_us']:.2f}x |")
    print()
    for batch, figures in packed.items():
        print(f"LSTM 512, 2 layers, N = {batch}, lengths from T to T/4:", ", ".join(
            f"{k} {v:.2f}" for k, v in figures.items()))
    if any_batch:
        print("LSTM 512, 1 layer, N = 13:", ", ".join(f"{k} {v:.2f}"
                                                       for k, v in any_batch.items()))
    if args.json:
        write_json(args.json, {"device": device, "rows": rows, "packed": packed,
                               "any_batch": any_batch})


if __name__ == "__main__":
    main()
