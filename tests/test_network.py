"""Whole networks as one callable and one file (rnncc.compile_network, Network.export,
rnncc.load, rnncc compile --layers): numbers against float64, the stages the planner picks,
the file, and the errors."""

import json
import os
import types
import warnings

import numpy as np
import pytest

import rnncc
from helpers import TOL_F32
from rnncc import reference
from rnncc.cli.main import main
from rnncc.compiler.network import compile_network
from rnncc.errors import ConfigError, InputError, ModuleFileError
from rnncc.runtime.network import Network, Stage

DATA = os.path.join(os.path.dirname(__file__), "data")
CELLS = sorted(rnncc.cells.registry()) + [os.path.join(DATA, "mgu.py")]


def random_network_weights(rng, net, dtype="float32"):
    """Fresh weights of every layer and direction by torch's names, uniform as torch's (a
    cell's per-unit parameters too)."""
    g, h, k = net.metadata["gates"], net.hidden_size, 1.0 / np.sqrt(net.hidden_size)
    out = {}
    for name in net.weight_names:
        layer = int(name.split("_l")[1].split("_")[0])
        width = net.input_size if layer == 0 else net.directions * h
        shape = {"weight_ih": (g * h, width), "weight_hh": (g * h, h)}.get(
            name.split("_l")[0], (g * h,) if name.startswith("bias") else (h,))
        out[name] = rng.uniform(-k, k, shape).astype(dtype)
    return out


def network_reference(cell, net, x, weights, initial, lengths):
    """y and the final states (name to [L*D, N, H]) in float64, a layer and direction at a
    time from rnncc.reference.run (the reverse direction on each sample's steps reversed)."""
    steps, batch = x.shape[:2]
    ln = np.full(batch, steps) if lengths is None else np.asarray(lengths)
    index = np.arange(steps)[:, None]
    rev = np.where(index < ln, ln - 1 - index, index)[..., None]
    finals = {s: [] for s in cell.states}
    for layer in range(net.layers):
        outs = []
        for d in range(net.directions):
            suffix = "_reverse" if d else ""
            w = {f"{n}_l0": weights[f"{n}_l{layer}{suffix}"]
                 for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", *cell.params)}
            row = layer * net.directions + d
            seq = x if d == 0 else np.take_along_axis(x, rev, 0)
            y, states = reference.run(cell, seq, w, {s: v[row:row + 1]
                                                     for s, v in initial.items()}, ln)
            outs.append(y if d == 0 else np.take_along_axis(y, rev, 0))
            for s in cell.states:
                finals[s].append(states[s])
        x = np.concatenate(outs, axis=2)
    return x, {s: np.concatenate(v) for s, v in finals.items()}


def check_network(net, rng, steps, lengths=None, initial=True, to_array=np.asarray):
    """The worst relative error of ``net`` against float64 on fresh inputs."""
    cell = rnncc.compiler.resolve_cell(net.cell if net.cell in rnncc.cells.registry()
                                       else os.path.join(DATA, f"{net.cell}.py"))
    n, h = net.batch, net.hidden_size
    weights = random_network_weights(rng, net)
    x = rng.standard_normal((steps, n, net.input_size)).astype("float32")
    states = ({s: rng.standard_normal((net.layers * net.directions, n, h)).astype("float32")
               for s in cell.states} if initial else {})
    ref_y, ref_states = network_reference(cell, net, x, weights, states, lengths)
    extra = {} if lengths is None else {"lengths": to_array(lengths)}
    y, finals = net(to_array(x), {k: to_array(v) for k, v in weights.items()},
                    **{f"{s}0": to_array(v) for s, v in states.items()}, **extra)
    finals = finals if isinstance(finals, tuple) else (finals,)
    host = [np.asarray(a.cpu().numpy() if hasattr(a, "cpu") else a) for a in (y, *finals)]
    assert host[0].shape == (steps, n, net.directions * h)
    errors = [reference.relative_error(host[0], ref_y)]
    errors += [reference.relative_error(a, ref_states[s]) for a, s in zip(host[1:], cell.states)]
    return max(errors)


@pytest.mark.parametrize("cell", CELLS)
def test_every_cell_as_a_bidirectional_stack(cell, rng):
    """Two bidirectional layers of odd sizes, with lengths (one sample of length 1, one of
    all T) and initial states, against float64 at T = 1 and 23."""
    net = rnncc.compile_network(cell, 5, 3, 3, layers=2, directions=2, target="llvm",
                                lengths=True)
    assert [s.kind for s in net.stages] == ["layer", "layer"]
    for steps in (1, 23):
        lengths = rng.integers(1, steps + 1, 3)
        lengths[0], lengths[-1] = 1, steps
        assert check_network(net, rng, steps, lengths) < TOL_F32


@pytest.mark.parametrize("layers, directions, input_size, hidden, batch", [
    (3, 1, 4, 1, 1), (1, 2, 7, 33, 7), (4, 1, 33, 33, 2)])
def test_sizes_and_array_kinds(layers, directions, input_size, hidden, batch, rng):
    """Stacks of 1-4 layers, hidden 1 and 33, batch 1 to 7, without initial states, from
    NumPy and from torch tensors."""
    net = rnncc.compile_network("gru", input_size, hidden, batch, layers=layers,
                                directions=directions, target="llvm")
    assert check_network(net, rng, 17, initial=False) < TOL_F32
    torch = pytest.importorskip("torch")
    assert check_network(net, rng, 9, to_array=torch.tensor) < TOL_F32


def test_matches_torch_and_takes_its_module(rng):
    """A torch.nn.LSTM's state_dict, or the module itself, against torch in float64; packed
    weights are copies and give the same numbers."""
    torch = pytest.importorskip("torch")
    theirs = torch.nn.LSTM(6, 8, num_layers=3, bidirectional=True)
    net = rnncc.compile_network("lstm", 6, 8, 4, layers=3, directions=2, target="llvm")
    x = torch.randn(11, 4, 6)
    want, (want_h, want_c) = theirs.double()(x.double())
    theirs.float()
    for weights in (theirs.state_dict(), theirs, net.pack(net.pack(theirs))):
        with torch.no_grad():
            y, (h, c) = net(x, weights)
        for a, b in ((y, want), (h, want_h), (c, want_c)):
            assert reference.relative_error(a.double().numpy(), b.detach().numpy()) < TOL_F32
    with pytest.raises(InputError, match="batch_first=True"):
        net(x, torch.nn.LSTM(6, 8, num_layers=3, bidirectional=True, batch_first=True))


def test_export_and_load(tmp_path, rng):
    """The file holds each module once; the loaded network gives the same numbers bit for
    bit, and is written whole (no temporary left)."""
    net = rnncc.compile_network("lstm", 3, 4, 2, layers=3, target="llvm", lengths=True)
    path = str(tmp_path / "net.rnet")
    assert net.export(path) == path
    assert os.listdir(tmp_path) == ["net.rnet"]
    loaded = rnncc.load(path)
    assert isinstance(loaded, rnncc.Network)
    assert (loaded.layers, loaded.directions, loaded.batch, loaded.takes_lengths) == (3, 1, 2,
                                                                                     True)
    assert loaded.weight_names == net.weight_names
    assert len({s.module.path for s in loaded.stages}) == 2  # layers 1, 2: one module
    weights = random_network_weights(rng, net)
    x = rng.standard_normal((13, 2, 3)).astype("float32")
    lengths = np.array([13, 2])
    for a, b in zip(net(x, weights, lengths=lengths)[1], loaded(x, weights, lengths=lengths)[1]):
        np.testing.assert_array_equal(a, b)
    os.remove(path)  # the loaded network keeps its own copies
    assert check_network(loaded, rng, 5, lengths=np.array([5, 1])) < TOL_F32


def test_damaged_network_files(tmp_path):
    import zipfile

    path = tmp_path / "bad.rnet"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("network.json", json.dumps({"format": 1, "kind": "network",
                                                     "stages": [{"kind": "layer",
                                                                 "module": "m.so"}]}))
    with pytest.raises(ModuleFileError, match="stage module m.so is missing"):
        rnncc.load(str(path))
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ModuleFileError, match="not a readable rnncc network file"):
        rnncc.load(str(path))


def test_errors_name_what_was_given(rng):
    net = rnncc.compile_network("gru", 3, 2, 2, layers=2, directions=2, target="llvm")
    weights = random_network_weights(rng, net)
    x = rng.standard_normal((4, 2, 3)).astype("float32")
    cases = [
        ({**weights, "weight_ih_l2": weights["weight_ih_l1"]}, {}, r"unexpected weights "
         r"\['weight_ih_l2'\]: this network has 2 layers of 2 directions"),
        ({k: v for k, v in weights.items() if k != "weight_hh_l1_reverse"}, {},
         "missing weight 'weight_hh_l1_reverse'"),
        ({k: v for k, v in weights.items() if k != "bias_ih_l1"}, {},
         "pass the biases of all layers and directions or of none"),
        (weights, {"h0": np.zeros((2, 2, 2), "float32")}, r"h0 has shape \[2, 2, 2\], "
         r"expected \[4, 2, 2\]"),
        (weights, {"c0": np.zeros((4, 2, 2), "float32")}, "c0 is not an initial state"),
        (weights, {"lengths": [4, 4]}, "takes no lengths"),
    ]
    for given, kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            net(x, given, **kwargs)
    with pytest.raises(InputError, match=r"x has shape \[4, 3, 3\], expected \[T, 2, 3\]"):
        net(np.zeros((4, 3, 3), "float32"), weights)
    with pytest.raises(InputError, match="packed for lstm"):
        other = rnncc.compile_network("lstm", 3, 2, 2, target="llvm")
        net(x, other.pack(random_network_weights(rng, other)))
    no_bias = {k: v for k, v in weights.items() if k.startswith("weight_")}
    assert net(x, no_bias)[0].shape == (4, 2, 4)  # no biases at all: zero biases
    with pytest.raises(ConfigError, match="directions must be 1 or 2"):
        rnncc.compile_network("gru", 3, 2, 2, directions=3, target="llvm")


# -- the planner's stages (fake modules: no compiles) -------------------------------------

def _fake_build(refuse_wave=False, persistent=True, calls=None):
    def build(cell, width, hidden, batch, *, directions, layers, **kw):
        if calls is not None:
            calls.append((width, directions, layers))
        if layers > 1 and refuse_wave:
            raise ConfigError("does not fit")
        kind = "persistent" if persistent or directions == 1 else "sequence"
        meta = {"target": {"kind": kw["target"], "arch": None}, "schedule": {"kind": kind},
                "rnncc_version": "x", "tvm_version": "y"}
        return types.SimpleNamespace(metadata=meta, width=width, directions=directions,
                                     layers=layers)
    return build


@pytest.mark.parametrize("input_size, layers, directions, options, expect", [
    (512, 3, 1, {}, [("layers", 0, 3, 512, 1, 3)]),
    (40, 3, 1, {}, [("layer", 0, 1, 40, 1, 1), ("layers", 1, 2, 512, 1, 2)]),
    (40, 2, 1, {}, [("layer", 0, 1, 40, 1, 1), ("layer", 1, 1, 512, 1, 1)]),
    (512, 2, 1, {"refuse_wave": True}, [("layer", 0, 1, 512, 1, 1), ("layer", 1, 1, 512, 1, 1)]),
    (512, 2, 2, {}, [("layer", 0, 1, 512, 2, 1), ("layer", 1, 1, 1024, 2, 1)]),
    (512, 2, 2, {"persistent": False}, [("split", 0, 1, 512, 1, 1),
                                         ("split", 1, 1, 1024, 1, 1)]),
])
def test_stages_on_cuda(input_size, layers, directions, options, expect):
    """Stacked unidirectional layers of input H as one wavefront (the first alone where C !=
    H, all in turn where it does not fit); a bidirectional layer on a two-direction module,
    or on a one-direction module a direction where the two-direction one is not persistent."""
    net = compile_network("lstm", input_size, 512, 4, layers=layers, directions=directions,
                          build=_fake_build(**options))
    got = [(s.kind, s.first, s.count, s.module.width, s.module.directions, s.module.layers)
           for s in net.stages]
    assert got == expect
    for stage in net.stages:
        assert (stage.fallback is not None) == (stage.kind == "layers")
        if stage.fallback is not None:
            assert (stage.fallback.width, stage.fallback.layers) == (512, 1)


def test_no_wavefront_on_the_cpu():
    calls = []
    net = compile_network("lstm", 8, 8, 2, layers=3, target="llvm", build=_fake_build(
        calls=calls))
    assert [s.kind for s in net.stages] == ["layer"] * 3
    assert calls == [(8, 1, 1)]  # one module for all three layers


def test_a_wavefront_that_cannot_run_falls_back(rng):
    """A wavefront stage whose module cannot run on the device runs its layers on the
    fallback module, and says so once."""
    real = rnncc.compile_network("rnn_tanh", 6, 6, 3, layers=2, target="llvm")
    one = real.stages[0].module

    class Unfit:
        directions, layers = 1, 2
        device_kind = "cpu"

        def entry_for(self, family):
            raise InputError("this module runs only as its persistent kernel, and the grid "
                             "does not fit")

    net = Network(real.metadata, [Stage("layers", 0, 2, Unfit(), one)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_network(net, rng, 12) < TOL_F32
        assert check_network(net, rng, 3) < TOL_F32
    said = [str(w.message) for w in caught if "one after another" in str(w.message)]
    assert len(said) == 1 and "does not fit" in said[0]


# -- the command line ---------------------------------------------------------------------

def test_cli_compiles_a_network_file(capsys, tmp_path, rng):
    path = str(tmp_path / "gru.rnet")
    code = main(["compile", "gru", "-C", "5", "-H", "3", "-N", "2", "--layers", "2",
                 "--bidirectional", "--lengths", "--target", "llvm", "-o", path])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "compiled gru network C=5 H=3 L=2 bidirectional N=2 float32 with lengths llvm" in out
    assert "  layer 1: gru C=6 H=3 N=2 float32 bidirectional with lengths llvm" in out
    code = main(["inspect", path])
    out, _ = capsys.readouterr()
    summary, *_ = out.split("\n", 1)
    assert code == 0 and summary.startswith("gru network C=5 H=3 L=2 bidirectional")
    manifest = json.loads(out[out.index("{"):])
    assert [s["kind"] for s in manifest["stages"]] == ["layer", "layer"]
    net = rnncc.load(path)
    assert check_network(net, rng, 6, lengths=np.array([6, 1])) < TOL_F32
    code = main(["bench", path, "--steps", "3", "--repeat", "2", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out)["rnncc"] > 0
    code = main(["inspect", path, "--source", "tir"])
    _, err = capsys.readouterr()
    assert code == 2 and "network file of several layer modules" in err
    code = main(["compile", "gru", "-C", "5", "-H", "3", "-N", "2", "--layers", "0",
                 "--target", "llvm", "-o", path])
    _, err = capsys.readouterr()
    assert code == 2 and "--layers must be at least 1, got 0" in err


@pytest.mark.gpu
@pytest.mark.parametrize("cell, input_size, layers, directions, batch", [
    ("lstm", 40, 3, 1, 4), ("gru", 256, 2, 1, 1), ("rnn_relu", 33, 2, 2, 3)])
def test_networks_on_the_gpu(cell, input_size, layers, directions, batch, rng, tmp_path):
    """CUDA networks (a wavefront stage above a first layer of another width, a wavefront of
    all layers, bidirectional layers) against float64 with lengths, from torch tensors and
    NumPy; exported, loaded, and captured in a CUDA graph that replays new inputs."""
    torch = pytest.importorskip("torch")
    net = rnncc.compile_network(cell, input_size, 256, batch, layers=layers,
                                directions=directions, lengths=True)
    if directions == 1:
        assert net.stages[-1].kind == "layers"
    lengths = rng.integers(1, 31, batch)
    lengths[0] = 30
    assert check_network(net, rng, 30, lengths, to_array=lambda a: torch.tensor(a).cuda()
                         ) < TOL_F32
    assert check_network(net, rng, 7, np.full(batch, 7)) < TOL_F32
    loaded = rnncc.load(net.export(str(tmp_path / "net.rnet")))
    weights = {k: torch.tensor(v).cuda() for k, v in random_network_weights(rng, net).items()}
    packed = loaded.pack(weights)
    x = torch.randn(30, batch, input_size, device="cuda")
    ln = torch.tensor(lengths, device="cuda")
    loaded(x, packed, lengths=ln)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, _ = loaded(x, packed, lengths=ln)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want, _ = net(x, weights, lengths=ln)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_refused_builds_are_kept_on_disk(monkeypatch, tmp_path):
    """A build that spills with every plan is kept as a refusal: the next process gets the
    BuildError at once, without building; a damaged record is dropped and built again."""
    from rnncc.compiler import cache, driver

    monkeypatch.setenv(cache.ENV, str(tmp_path))
    calls = []

    def spills(*args, **kwargs):
        calls.append(kwargs["layers"])
        raise driver.Spilled("lstm ... runs only as the persistent wavefront kernel, and its "
                             "kernel spills registers with every plan that fits")

    monkeypatch.setattr(driver, "compile_module", spills)
    for _ in range(2):
        cache._loaded.clear()
        with pytest.raises(rnncc.BuildError, match="spills registers") as err:
            cache.compiled("lstm", 8, 8, 2, target="llvm", layers=2)
    assert calls == [2] and "a refusal kept in" in str(err.value)
    (record,) = tmp_path.glob("*.refused.json")
    record.write_text("{not json")
    with pytest.raises(rnncc.BuildError):
        cache.compiled("lstm", 8, 8, 2, target="llvm", layers=2)
    assert calls == [2, 2]
