"""Inputs that used to give a silently wrong result, files written and read while others
write them, damaged module files, and the command line's one error path."""

import glob
import os
import tempfile
import threading
import time

import numpy as np
import pytest

import rnncc
from conftest import random_weights
from helpers import TOL_F32, compiled
from rnncc import reference
from rnncc.cli.main import main
from rnncc.errors import ConfigError, InputError, ModuleFileError


def _torch():
    return pytest.importorskip("torch")


def test_negative_bit_tensors_are_resolved(rng):
    """``x._neg_view()`` is -x to torch; DLPack drops the bit, which gave the output of +x."""
    torch = _torch()
    module = compiled("gru", 3, 4, 2, "llvm")
    net = torch.nn.GRU(3, 4)
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        expect, _ = module(-x, net)
        y, _ = module(x._neg_view(), net)  # is -x
        weights = {k: v.detach() for k, v in net.state_dict().items()}
        weights["weight_hh_l0"] = (-weights["weight_hh_l0"])._neg_view()  # is +weight_hh
        again, _ = module(-x, weights)
    assert torch.equal(y, expect) and torch.equal(again, expect)


def test_cuda_tensors_are_taken_without_a_stream_synchronisation():
    """A CUDA torch tensor whose type has no C exchange API for DLPack is taken through
    ``__dlpack__(stream=-1)`` of a detached view: rnncc launches on the caller's current
    stream, and older torch's default made the legacy stream wait for it, which a CUDA graph
    capture refuses; torch's ``__dlpack__`` refuses a tensor that requires grad. Other
    families keep the protocol's default."""
    import numpy as np

    from rnncc.runtime.arrays import Family, to_tensor

    class Tensor:  # a CUDA tensor of no known exchange API, its data a host array here
        def __init__(self):
            raw = np.zeros(32, np.float32)  # 16 values at a 64-byte boundary
            start = -raw.ctypes.data % 64 // 4
            self.data, self.streams = raw[start:start + 16], []

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            self.streams.append(stream)
            return self.data.__dlpack__()

        def detach(self):  # torch's, a view without grad
            self.streams.append("detached")
            return self

    for name, streams in (("torch", ["detached", -1]), ("cupy", [None]), ("dlpack", [None])):
        value = Tensor()
        tensor = to_tensor("x", value, [16], "float32", Family(name, "cuda", 0))
        assert value.streams == streams and tuple(tensor.shape) == (16,)


def test_batch_first_torch_module_as_weights_is_refused():
    """Its flag would be ignored: with T == N a batch-first input gave wrong outputs."""
    torch = _torch()
    module = compiled("gru", 3, 4, 2, "llvm")
    with pytest.raises(InputError, match="with batch_first=True, but this module takes x as "
                                         r"\[T, N, C\]"):
        module(torch.randn(2, 2, 3), torch.nn.GRU(3, 4, batch_first=True))


def test_a_call_that_would_need_gradients_says_it_gets_none():
    torch = _torch()
    module = rnncc.compile("rnn_tanh", 3, 4, 2, target="llvm")
    net = torch.nn.RNN(3, 4)
    x = torch.randn(2, 2, 3, requires_grad=True)
    with pytest.warns(UserWarning, match="compute no gradients when called"):
        y, _ = module(x, net)
    assert y.grad_fn is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(x, net)  # said once a module
        with torch.no_grad():
            rnncc.compile("rnn_tanh", 3, 4, 2, target="llvm")(x, net)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_weights_are_a_copy(bidirectional):
    """``pack()`` copies every weight: an in-place change of a weight or a bias after it does
    not reach the packed weights (it reached the biases, which were aliased, and not the
    matrices); packing again takes the change."""
    torch = _torch()
    directions = 2 if bidirectional else 1
    module = compiled("lstm", 3, 5, 2, "llvm", directions=directions)
    weights = {k: v.detach().clone() for k, v in
               torch.nn.LSTM(3, 5, bidirectional=bidirectional).state_dict().items()}
    x = torch.randn(4, 2, 3)
    packed = module.pack(weights)
    expect, _ = module(x, packed)
    for name in weights:
        weights[name] += 1.0
        again, _ = module(x, packed)
        assert torch.equal(again, expect), f"an in-place change of {name} reached the pack"
    changed, _ = module(x, module.pack(weights))
    assert not torch.equal(changed, expect)


def test_a_lost_cuda_context_is_one_clear_error(monkeypatch):
    """A call that fails and leaves the CUDA context lost (a persistent kernel's trapped wait)
    raises DeviceError saying so, keeps the call's memory (TVM aborts the process freeing
    memory of a lost context) and the device's packed weights, and later calls on that
    device say so at once; other errors and other devices are untouched."""
    from rnncc.runtime import faults
    from rnncc.runtime.arrays import Family

    kept = []
    monkeypatch.setattr(faults, "_lost", {})
    monkeypatch.setattr(faults, "_keep_forever", kept.append)
    monkeypatch.setattr(faults, "_context_lost", lambda kind, index: index == 0)
    gpu0, gpu1 = Family("numpy", "cuda", 0), Family("numpy", "cuda", 1)

    class Packed:
        device = "cuda:0"

    packed = Packed()
    faults.track(packed)
    with pytest.raises(InputError), faults.guard(gpu0, "a call"):
        raise InputError("a bad shape")
    with pytest.raises(ValueError, match="other device"), faults.guard(gpu1, "a call"):
        raise ValueError("other device")
    assert not kept
    with pytest.raises(rnncc.DeviceError, match=r"a call failed on cuda:0 and the CUDA context "
                       r"of this process is lost \(unspecified launch failure\).*restart it"):
        with faults.guard(gpu0, "a call"):
            raise RuntimeError("unspecified launch failure\nmore")
    assert isinstance(kept[0], RuntimeError) and kept[1] is packed
    with pytest.raises(rnncc.DeviceError, match="was lost earlier"):
        with faults.guard(gpu0, "the next call"):
            raise AssertionError("not reached")
    with faults.guard(gpu1, "a call on another GPU"):
        pass


def test_export_while_others_export_and_load(tmp_path):
    """Two writers exporting different modules to one path and a reader loading it: every
    load gets one whole module (a plain copy gave half of one, and 'not an ELF')."""
    modules = [compiled("gru", 3, 4, 2, "llvm"), compiled("lstm", 5, 6, 1, "llvm")]
    path = str(tmp_path / "shared.so")
    modules[0].export(path)
    errors, loads = [], []

    def write(module):
        for _ in range(25):
            module.export(path)

    def read():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(loads) < 60:
            try:
                m = rnncc.load(path)
                loads.append((m.cell, m.input_size))
            except Exception as err:  # noqa: BLE001 - collected, asserted below
                errors.append(err)

    threads = [threading.Thread(target=write, args=(m,)) for m in modules]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and loads
    assert set(loads) <= {("gru", 3), ("lstm", 5)}
    assert not glob.glob(str(tmp_path / ".rnncc_*"))  # no temporary file left


def _damaged(tmp_path, how):
    good = compiled("gru", 3, 4, 2, "llvm").path
    data = open(good, "rb").read()
    if how == "truncated":
        data = data[:len(data) // 3]
    elif how == "header only":
        data = data[:80]
    elif how == "section table":
        data = data[:0x28] + (len(data) - 8).to_bytes(8, "little") + data[0x30:]
    path = tmp_path / f"{how.replace(' ', '_')}.so"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("how", ["truncated", "header only", "section table"])
def test_damaged_module_files_are_one_clear_error(how, tmp_path, capsys):
    path = _damaged(tmp_path, how)
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rnncc_module_*")))
    with pytest.raises(ModuleFileError, match=repr(path).replace("\\", "\\\\")):
        rnncc.load(path)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rnncc_module_*"))) == before
    for command in (["inspect", path], ["bench", path, "--steps", "2"]):
        code = main(command)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("rnncc: error: ") and err.count("\n") == 1
        assert "Traceback" not in err


def test_metadata_without_its_fields_is_refused(monkeypatch):
    """A module whose metadata lacks a field gave KeyError: 'cell' from rnncc inspect."""
    import json

    from rnncc.runtime import metadata as md

    meta = md.read_metadata(compiled("gru", 3, 4, 2, "llvm").path)
    del meta["cell"], meta["functions"]
    monkeypatch.setattr(md, "read_sections", lambda path, shown=None: {
        md.META: json.dumps(meta).encode()})
    with pytest.raises(ModuleFileError, match="'odd.so': its rnncc metadata lacks cell, "
                                              "functions"):
        md.read_metadata("odd.so")


def test_cli_has_one_error_path(capsys, monkeypatch):
    """Whatever goes wrong inside a command is one line on stderr, never a traceback."""
    import rnncc.cli.main as cli

    def broken(args):
        raise ValueError("something unexpected\nsecond line")

    monkeypatch.setattr(cli, "_cmd_cells", broken)
    code = main(["cells"])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1
    assert err.startswith("rnncc: internal error: ValueError: second line")
    monkeypatch.setenv("RNNCC_DEBUG", "1")
    with pytest.raises(ValueError):
        main(["cells"])


def test_bench_of_a_cuda_module_without_a_gpu_for_torch(monkeypatch):
    torch = _torch()
    from rnncc import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a GPU that PyTorch can use"):
        bench.time_gpu(object(), 10)


@pytest.mark.parametrize("extra, match", [
    (["--log-dir", "/proc/rnncc_cannot"], "cannot write tuning logs under '/proc/rnncc_cannot'"),
    (["--rpc", "garbage"], "--rpc must be HOST:PORT:KEY"),
])
def test_tune_refuses_bad_destinations_before_measuring(extra, match, capsys, tmp_path,
                                                        monkeypatch):
    """Refused before anything compiles or is timed (the log folder was found unwritable
    after the whole budget, the tracker address after the default's timing run)."""
    from rnncc.compiler import driver

    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the refusal")

    monkeypatch.setattr(driver, "compile_module", refuse)
    code = main(["tune", "rnn_tanh", "-C", "2", "-H", "3", "-N", "1", "--target", "llvm",
                 "--work-dir", str(tmp_path), *extra])
    err = capsys.readouterr().err
    assert code == 2 and match in err


def test_json_files_are_whole_or_untouched(tmp_path):
    """A JSON file rnncc or its benchmarks write (a build refusal, --json) is replaced whole:
    a value that fails half way leaves the previous file as it was and no temporary file."""
    import json

    from rnncc.runtime.files import write_json

    path = tmp_path / "rows.json"
    write_json(path, {"rows": [1, 2]})
    with pytest.raises(TypeError):
        write_json(path, {"rows": [3], "bad": object()})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert os.listdir(tmp_path) == ["rows.json"]


def test_cpu_tanh_keeps_the_relative_precision_of_outputs_near_zero(rng):
    """A tanh RNN whose outputs are near zero (weights 1e-4 of torch's scale, h below 1e-4):
    TVM's LLVM tanh, (1 - e^-2|x|) / (1 + e^-2|x|), put y 1.5e-4 off (relative); rnncc's CPU
    builds compute tanh so that they are as close to float64 as outputs anywhere else."""
    module = compiled("rnn_tanh", 5, 7, 3)
    weights = {k: (1e-4 * v).astype("float32") for k, v in
               random_weights(rng, 1, 5, 7).items()}
    x = rng.standard_normal((6, 3, 5)).astype("float32")
    y, h_n = module(x, weights)
    ref_y, ref_states = reference.run(rnncc.cells.get("rnn_tanh"), x, weights, {}, None)
    assert reference.relative_error(np.asarray(y), ref_y) < TOL_F32
    assert reference.relative_error(np.asarray(h_n), ref_states["h"]) < TOL_F32


@pytest.mark.parametrize("lanes", [1, 16])
def test_cpu_exp_sigmoid_and_tanh_in_arithmetic_match_float64(lanes):
    """CPU builds compute float32 exp, sigmoid and tanh in arithmetic that vectorises (LLVM
    called libm's scalar expf for each lane): within 2e-7 of float64 (relative, where the
    value is a normal float) from -100 to 100, NaN kept, the limits at +-inf, and no call of
    expf left in a layer's module."""
    import tvm
    from tvm import te

    from rnncc.compiler import pipeline

    functions = {"exp": (te.exp, np.exp), "sigmoid": (te.sigmoid, lambda v: 1 / (1 + np.exp(-v))),
                 "tanh": (te.tanh, np.tanh)}
    x = np.concatenate([np.linspace(-100, 100, 4001), np.linspace(-1, 1, 2001),
                        [0.0, -0.0, 1e-30, -3e-8, 88.7, -87.5, np.nan, np.inf, -np.inf]])
    x = np.resize(x, -(-len(x) // 16) * 16).astype("float32")
    limits = {"exp": (np.inf, 0.0), "sigmoid": (1.0, 0.0), "tanh": (1.0, -1.0)}
    for name, (op, ref) in functions.items():
        a = te.placeholder(x.shape, "float32", name="a")
        b = te.compute(x.shape, lambda i: op(a[i]), name="b")  # noqa: B023 - used at once
        sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
        _, inner = sch.split(sch.get_loops(sch.get_sblock("b"))[0], [None, lanes])
        if lanes > 1:
            sch.vectorize(inner)
        lib = tvm.compile(sch.mod, target={"kind": "llvm"}, tir_pipeline=pipeline.register("llvm"))
        out = tvm.runtime.tensor(np.zeros_like(x))
        lib["main"](tvm.runtime.tensor(x), out)
        got, want = out.numpy().astype(np.float64), ref(x.astype(np.float64))
        normal = np.isfinite(x) & (np.abs(want) > 1.2e-38) & (np.abs(want) < 3.4e38)
        err = np.abs(got[normal] - want[normal]) / np.abs(want[normal])
        assert err.max() < 2e-7, f"{name}: {err.max():.2e} at {x[normal][err.argmax()]}"
        assert np.isnan(got[np.isnan(x)]).all()
        high, low = limits[name]
        assert got[x == np.inf][0] == high and abs(got[x == -np.inf][0] - low) < 1e-44
    module = compiled("lstm", 5, 7, 3)
    with open(module.path, "rb") as f:
        assert b"expf" not in f.read()
