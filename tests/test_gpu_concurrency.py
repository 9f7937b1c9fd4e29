"""Persistent modules at once (CUDA streams of one process, and processes) and what a faulted
kernel leaves behind (run with --gpu on a GPU machine)."""

import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest

import rnncc
from helpers import TOL_F32, compiled
from rnncc import reference

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
#: Four persistent layers whose grids (8 + 72 + 128 + 64 blocks on an H200's 132
#: multiprocessors, one block each) do not fit on the GPU together.
FOUR = [("lstm", 256, 256, 1), ("gru", 128, 384, 3), ("lstm", 512, 512, 4),
        ("rnn_tanh", 64, 1024, 2)]
TORCH_CELLS = {"lstm": ("LSTM", {}), "gru": ("GRU", {}), "rnn_tanh": ("RNN", {}),
               "rnn_relu": ("RNN", {"nonlinearity": "relu"})}
STEPS = 64


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return torch


def _theirs(torch, cell, input_size, hidden):
    kind, kwargs = TORCH_CELLS[cell]
    return getattr(torch.nn, kind)(input_size, hidden, **kwargs)


def _persistent(config, torch):
    """A persistent module of ``config``, its torch twin on CUDA and the packed weights."""
    cell, input_size, hidden, batch = config
    module = compiled(cell, input_size, hidden, batch, "cuda")
    assert module.metadata["schedule"]["kind"] == "persistent"
    theirs = _theirs(torch, cell, input_size, hidden).cuda()
    return module, theirs, module.pack(theirs.state_dict())


def _loop(torch, module, theirs, packed, config, calls, seed):
    """``calls`` calls on a stream of its own with fresh inputs, each compared with cuDNN on
    the same stream; the first and last inputs and outputs come back for a float64 check."""
    _, input_size, _, batch = config
    stream = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    errors, kept = [], []
    with torch.cuda.stream(stream), torch.no_grad():
        for i in range(calls):
            x = torch.randn(STEPS, batch, input_size, device="cuda", generator=gen)
            y, _ = module(x, packed)
            expect, _ = theirs(x)
            errors.append(torch.linalg.norm(y - expect) / torch.linalg.norm(expect))
            if i in (0, calls - 1):
                kept.append((x, y))
    stream.synchronize()
    return float(torch.stack(errors).max()), [(x.cpu(), y.cpu()) for x, y in kept]


def _run_at_once(torch, configs, calls):
    built = [_persistent(c, torch) for c in configs]
    with concurrent.futures.ThreadPoolExecutor(len(built)) as pool:
        futures = [pool.submit(_loop, torch, m, t, p, c, calls, seed)
                   for seed, ((m, t, p), c) in enumerate(zip(built, configs))]
        results = [f.result(timeout=600) for f in futures]
    for (worst, kept), (_, theirs, _), config in zip(results, built, configs):
        assert worst < TOL_F32, f"{config}: relative error {worst:.3e} against cuDNN"
        exact = copy.deepcopy(theirs).cpu().double()
        for x, y in kept:
            with torch.no_grad():
                expect, _ = exact(x.double())
            assert reference.relative_error(y.numpy(), expect.numpy()) < TOL_F32, config
    return built


@pytest.mark.parametrize("count", [2, 4])
def test_persistent_modules_on_streams_at_once(torch, count):
    """Two and four persistent modules looping 1000 calls each on streams of their own (the
    four grids together need more multiprocessors than the GPU has: their cooperative launches
    wait for each other, they do not deadlock), every output checked."""
    built = _run_at_once(torch, FOUR[-count:], 1000)
    if count == 4:
        blocks = sum(m.metadata["schedule"]["persistent"]["plan"]["blocks"] for m, _, _ in built)
        assert blocks > torch.cuda.get_device_properties(0).multi_processor_count


def test_two_grids_that_only_fit_one_at_a_time(torch):
    """Two LSTM 1024 grids of 128 blocks each on one GPU: they take turns, correctly."""
    configs = [("lstm", 1024, 1024, 4), ("lstm", 1024, 1024, 8)]
    built = _run_at_once(torch, configs, 300)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(2 * m.metadata["schedule"]["persistent"]["plan"]["blocks"] > sms
               for m, _, _ in built)


PROCESS = textwrap.dedent("""
    import json, sys, torch, rnncc
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    worst = 0.0
    gen = torch.Generator(device="cuda").manual_seed(int(sys.argv[1]))
    mods = []
    for path, cell, kind, kwargs in json.loads(sys.argv[2]):
        m = rnncc.load(path)
        theirs = getattr(torch.nn, kind)(m.input_size, m.hidden_size, **kwargs).cuda()
        mods.append((m, theirs, m.pack(theirs.state_dict())))
    with torch.no_grad():
        for i in range(1000):
            for m, theirs, packed in mods:
                x = torch.randn(64, m.batch, m.input_size, device="cuda", generator=gen)
                y, _ = m(x, packed)
                expect, _ = theirs(x)
                err = float(torch.linalg.norm(y - expect) / torch.linalg.norm(expect))
                worst = max(worst, err)
    print("WORST", worst, [packed.entry for _, _, packed in mods])
""")


def test_persistent_modules_in_two_processes_at_once(torch, tmp_path):
    """Two processes, two persistent modules each, 1000 calls of each with fresh inputs, at
    once on one GPU: no hang, every output as cuDNN's."""
    specs = []
    for i, (cell, input_size, hidden, batch) in enumerate(FOUR):
        path = compiled(cell, input_size, hidden, batch, "cuda").export(tmp_path / f"{i}.so")
        specs.append([str(path), cell, *TORCH_CELLS[cell]])
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(seed),
                               json.dumps(specs[2 * seed:2 * seed + 2])], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        worst, entries = out.split("WORST")[1].split(" [")
        assert float(worst) < TOL_F32
        assert "sequence" not in entries


FAULT = textwrap.dedent("""
    import sys, numpy as np, torch, rnncc
    from rnncc.schedules.persistent import device
    # Every wait on another block gives up at once: the kernel traps on its first wait.
    limit = f"{device.WAIT_LIMIT_CYCLES}LL"
    device.BARRIER_SOURCE = device.BARRIER_SOURCE.replace(limit, "0LL")
    device.WAIT_LIMIT_CYCLES = 0  # the tagged waits' sources are made where a kernel calls them
    m = rnncc.compile("lstm", 64, 256, 1, target="cuda", tuning="off")
    assert m.metadata["schedule"]["kind"] == "persistent"
    w = {k: v.numpy() for k, v in torch.nn.LSTM(64, 256).state_dict().items()}
    x = np.random.default_rng(0).standard_normal((50, 1, 64)).astype("float32")
    packed = m.pack(w)  # TVM memory on the GPU, made before the fault
    if sys.argv[1] == "torch":
        wc = {k: torch.from_numpy(v).cuda() for k, v in w.items()}
        m(torch.from_numpy(x).cuda(), wc)
        try:
            torch.cuda.synchronize()
        except Exception as err:
            print("TORCH", type(err).__name__)
    for attempt in ("first", "second"):
        try:
            m(x, packed)
        except rnncc.DeviceError as err:
            print(attempt.upper(), err)
    del packed
    print("EXIT")
""")


@pytest.mark.parametrize("seen_by", ["rnncc", "torch"])
def test_a_trapped_wait_is_reported_and_the_process_lives(seen_by):
    """A persistent kernel whose waits trap at once (as one that waits past its limit):
    the call says the CUDA context is lost, later calls say so at once, and the process
    frees what it can and exits normally (TVM aborted it freeing the call's GPU memory); the
    same where torch saw the fault first."""
    out = subprocess.run([sys.executable, "-c", FAULT, seen_by], env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "CUDA context of this process is lost" in lines["FIRST"]
    assert "restart it" in lines["FIRST"]
    assert "was lost earlier" in lines["SECOND"]
    assert out.stdout.rstrip().endswith("EXIT")
    if seen_by == "torch":
        assert "TORCH" in lines
    assert issubclass(rnncc.DeviceError, RuntimeError)
