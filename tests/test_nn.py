"""rnncc.nn against torch.nn (float64 on the CPU) and a float64 reference for user cells:
layers, directions, batch_first, packed and padded sequences of their own lengths, initial
states, unbatched input, any batch; the on-disk cache of compiled modules; clear errors."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rnncc  # noqa: E402
from rnncc import reference  # noqa: E402
from rnncc.errors import ConfigError, InputError  # noqa: E402

pack = torch.nn.utils.rnn.pack_padded_sequence
DATA = os.path.join(os.path.dirname(__file__), "data")
TOL = 1e-5
pytestmark = pytest.mark.usefixtures("module_cache")


def _torch_and_ours(kind, *args, **kwargs):
    """A torch module in float64, and rnncc's of the same weights in float32."""
    torch.manual_seed(len(args) + len(kwargs))
    theirs = getattr(torch.nn, kind)(*args, **kwargs)
    ours = rnncc.nn.from_torch(theirs)
    return theirs.double(), ours


def _close(ours, theirs):
    if isinstance(ours, torch.nn.utils.rnn.PackedSequence):  # a tuple too
        assert torch.equal(ours.batch_sizes, theirs.batch_sizes)
        assert (ours.sorted_indices is None and theirs.sorted_indices is None) or torch.equal(
            ours.sorted_indices, theirs.sorted_indices)
        ours, theirs = ours.data, theirs.data
    elif isinstance(ours, tuple):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _close(a, b)
        return
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    err = reference.relative_error(ours.numpy(), theirs.numpy())
    assert err < TOL, f"relative error {err:.3e}"


def _lengths(rng, batch, steps, sort=False):
    lengths = rng.integers(1, steps + 1, batch)
    lengths[0], lengths[-1] = steps, 1
    return torch.tensor(sorted(lengths, reverse=True) if sort else lengths)


@pytest.mark.parametrize("kind, kwargs", [
    ("LSTM", {}), ("GRU", {}), ("RNN", {}), ("RNN", {"nonlinearity": "relu"})])
@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, True), (3, False)])
def test_padded_matches_torch(kind, kwargs, layers, bidirectional, rng):
    theirs, ours = _torch_and_ours(kind, 6, 9, num_layers=layers, bidirectional=bidirectional,
                                   **kwargs)
    x = torch.randn(7, 3, 6)
    with torch.no_grad():
        _close(ours(x), theirs(x.double()))


@pytest.mark.parametrize("half, bound", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_parameters_match_torch_from_the_same_rounded_weights(half, bound):
    """A module converted to float16 or bfloat16 (``.half()``, ``.bfloat16()``) runs modules
    of that storage dtype: y and the final states in it, within half precision of torch's
    float64 from the same rounded weights, input and states (2 layers, bidirectional)."""
    theirs, ours = _torch_and_ours("LSTM", 6, 9, num_layers=2, bidirectional=True)
    ours = ours.to(half)
    theirs.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x = torch.randn(7, 3, 6).to(half)
    with torch.no_grad():
        y, (h, c) = ours(x)
        ref_y, (ref_h, ref_c) = theirs(x.double())
    assert y.dtype == h.dtype == c.dtype == half
    for mine, ref in ((y, ref_y), (h, ref_h), (c, ref_c)):
        err = reference.relative_error(mine.double().numpy(), ref.numpy())
        assert err < bound, f"relative error {err:.3e}"


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("sort", [True, False])
def test_packed_matches_torch(kind, sort, rng):
    """A PackedSequence in (sorted or not, a sample of 1 step, one of all T) gives one out,
    laid out as torch's, with each sample's own final states, and initial states given."""
    theirs, ours = _torch_and_ours(kind, 5, 8, num_layers=2, bidirectional=True)
    x, lengths = torch.randn(6, 4, 5), _lengths(rng, 4, 6, sort)
    states = 2 if kind == "LSTM" else 1
    hx = tuple(torch.randn(4, 4, 8) for _ in range(states))
    hx = hx if states > 1 else hx[0]
    cast = (tuple(h.double() for h in hx) if states > 1 else hx.double())
    with torch.no_grad():
        mine = ours(pack(x, lengths, enforce_sorted=sort), hx)
        ref = theirs(pack(x.double(), lengths, enforce_sorted=sort), cast)
    _close(mine, ref)


def test_lengths_and_packed_under_inference_mode(rng):
    """Under torch.inference_mode (whose tensors keep no version for the runtime to see
    writes in place), lengths and a PackedSequence run as under no_grad, and bad lengths are
    refused every call."""
    theirs, ours = _torch_and_ours("GRU", 4, 5)
    x, lengths = torch.randn(6, 3, 4), _lengths(rng, 3, 6)
    ref, _ = theirs(pack(x.double(), lengths, enforce_sorted=False))
    with torch.inference_mode():
        mine, _ = ours(pack(x, lengths, enforce_sorted=False))
        _close(mine, ref)
        given = lengths.clone()
        ours(x, lengths=given)
        given[0] = 7
        with pytest.raises(InputError, match=r"from 1 to T = 6 .* got values from \d to 7"):
            ours(x, lengths=given)


def test_lengths_are_read_back_once_and_layouts_copied_once(monkeypatch, rng):
    """A PackedSequence's lengths are never read back to be checked (they are 1 to T by the
    making), given lengths once for a tensor however many layers and padded rows take them;
    the tables of a packed layout seen before are not copied to the device again (nor
    captured in a CUDA graph): a packed call of the same batch sizes is one more gather."""
    from rnncc.nn import modules
    from rnncc.runtime import module as runtime

    reads, copies = [], []
    check, to_device = runtime._check_lengths, modules._to_device
    monkeypatch.setattr(runtime, "_check_lengths", lambda *a: reads.append(a) or check(*a))
    monkeypatch.setattr(modules, "_to_device", lambda *a: copies.append(a) or to_device(*a))
    monkeypatch.setattr(modules, "_LAYOUTS", type(modules._LAYOUTS)())
    theirs, ours = _torch_and_ours("LSTM", 4, 5, num_layers=2, bidirectional=True)
    x, lengths = torch.randn(6, 3, 4), _lengths(rng, 3, 6)
    ref, _ = theirs(pack(x.double(), lengths, enforce_sorted=False))
    with torch.no_grad():
        for sort in (False, True, False):
            order = torch.argsort(lengths, descending=True) if sort else torch.arange(3)
            mine, _ = ours(pack(x[:, order], lengths[order], enforce_sorted=sort))
            _close(torch.nn.utils.rnn.pad_packed_sequence(mine)[0],
                   torch.nn.utils.rnn.pad_packed_sequence(ref)[0][:, order])
        assert not reads and len(copies) == 1
        ours(x, lengths=lengths)
        ours(x, lengths=lengths)
        assert len(reads) == 1
        lengths[0] = 7  # written in place: read again, and refused
        with pytest.raises(InputError, match=r"from 1 to T = 6 .* got values from \d to 7"):
            ours(x, lengths=lengths)


def test_layouts_a_cuda_graph_captures_are_kept_for_it(monkeypatch):
    """A layout's tables read by a captured graph are never freed (however many layouts come
    after it), and tables made during a capture, written only when the graph replays, are
    not given to other calls."""
    from rnncc.nn import modules

    monkeypatch.setattr(modules, "_LAYOUTS", type(modules._LAYOUTS)())
    monkeypatch.setattr(modules, "_CAPTURED", [])
    capturing = [False]
    monkeypatch.setattr(modules, "_capturing", lambda device: capturing[0])
    cpu = torch.device("cpu")

    def tables(*sizes):
        return modules._layout_tables(torch.tensor(sizes), cpu)

    seen = tables(3, 2, 1)
    capturing[0] = True
    assert tables(3, 2, 1) is seen and modules._CAPTURED == [seen]
    tables(3, 2, 1)
    new = tables(2, 2)
    assert len(modules._CAPTURED) == 2 and len(modules._LAYOUTS) == 1
    capturing[0] = False
    assert tables(2, 2) is not new
    for size in range(2, modules.LAYOUTS_KEPT + 3):
        tables(size)
    assert all(key[1] != torch.tensor([3, 2, 1]).numpy().tobytes() for key in modules._LAYOUTS)
    assert modules._CAPTURED[0] is seen
    _, _, _, _, (pad, source, lengths) = seen
    assert lengths.tolist() == [3, 2, 1] and pad.shape == source.shape == (9,)


def test_padded_with_lengths_and_batch_first(rng):
    """``lengths`` with a padded batch-first tensor: torch's packed results, padded with
    zeros past each length."""
    theirs, ours = _torch_and_ours("LSTM", 4, 5, num_layers=2, bidirectional=True,
                                   batch_first=True)
    x, lengths = torch.randn(3, 6, 4), _lengths(rng, 3, 6)
    with torch.no_grad():
        y, (h, c) = ours(x, lengths=lengths)
        ry, (rh, rc) = theirs(pack(x.double(), lengths, batch_first=True,
                                   enforce_sorted=False))
    ry, _ = torch.nn.utils.rnn.pad_packed_sequence(ry, batch_first=True, total_length=6)
    _close((y, h, c), (ry, rh, rc))


@pytest.mark.parametrize("hidden, batch, steps", [(1, 1, 1), (3, 7, 2), (33, 3, 1)])
def test_odd_sizes(hidden, batch, steps):
    theirs, ours = _torch_and_ours("GRU", 3, hidden, num_layers=2, bidirectional=True)
    x = torch.randn(steps, batch, 3)
    with torch.no_grad():
        _close(ours(x), theirs(x.double()))


def test_unbatched_input_and_states():
    theirs, ours = _torch_and_ours("LSTM", 3, 4, num_layers=2)
    x, hx = torch.randn(5, 3), (torch.randn(2, 4), torch.randn(2, 4))
    with torch.no_grad():
        mine = ours(x, hx)
        ref = theirs(x.double(), tuple(h.double() for h in hx))
    assert mine[0].shape == (5, 4) and mine[1][0].shape == (2, 4)
    _close(mine, ref)


def test_any_batch_from_one_module():
    """One module serves batch 1, 3, 7 and 13 (modules of batch 1, 4, 8, 16, compiled once
    each), with results as a module of the exact batch gives."""
    theirs, ours = _torch_and_ours("GRU", 4, 6)
    for batch in (1, 3, 7, 13, 3):
        x = torch.randn(4, batch, 4)
        with torch.no_grad():
            _close(ours(x), theirs(x.double()))


def test_user_cell_matches_its_reference(rng):
    """A cell file through rnncc.nn.Recurrent: 2 layers, both directions, lengths, against
    its own float64 reference run layer by layer."""
    path = os.path.join(DATA, "mgu.py")
    net = rnncc.nn.Recurrent(path, 4, 5, num_layers=2, bidirectional=True)
    assert "weight_hh_l1_reverse" in net.state_dict()
    x, lengths = torch.randn(6, 3, 4), _lengths(rng, 3, 6)
    with torch.no_grad():
        y, h = net(x, lengths=lengths)
    ref_y, ref_h = _network_reference(net, x.double().numpy(), lengths.numpy())
    assert reference.relative_error(y.numpy(), ref_y) < TOL
    assert reference.relative_error(h.numpy(), ref_h) < TOL


def _network_reference(net, x, lengths):
    """y and h_n of ``net`` in float64, from rnncc.reference.run a layer and direction."""
    steps, finals, layer_input = x.shape[0], [], x
    index = np.arange(steps)[:, None]
    rev = np.where(index < lengths, lengths - 1 - index, index)
    for layer in range(net.num_layers):
        outs = []
        for d in range(2 if net.bidirectional else 1):
            suffix = "_reverse" if d else ""
            w = {f"{name}_l0": getattr(net, f"{name}_l{layer}{suffix}").detach().double().numpy()
                 for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
            seq = layer_input if d == 0 else np.take_along_axis(layer_input, rev[..., None], 0)
            y, states = reference.run(net.cell, seq, w, lengths=lengths)
            outs.append(y if d == 0 else np.take_along_axis(y, rev[..., None], 0))
            finals.append(states["h"][0])
        layer_input = np.concatenate(outs, axis=2)
    return layer_input, np.stack(finals)


def test_eval_and_dropout():
    """Dropout acts between layers in training mode only; in eval the results are torch's."""
    theirs, ours = _torch_and_ours("LSTM", 3, 4, num_layers=3, dropout=0.5)
    x = torch.randn(4, 2, 3)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        _close(ours(x), theirs(x.double()))
        ours.train()
        assert not torch.allclose(ours(x)[0], ours(x)[0])  # fresh dropout masks
        ours.dropout = theirs.dropout = 1.0  # every output between layers dropped
        theirs.train()
        _close(ours(x), theirs(x.double()))


def test_weights_follow_load_state_dict_and_in_place_changes():
    theirs, ours = _torch_and_ours("GRU", 3, 4, num_layers=2)
    x = torch.randn(3, 2, 3)
    with torch.no_grad():
        ours(x)
        for p in theirs.parameters():
            p.mul_(0.5)
        ours.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()})
        _close(ours(x), theirs(x.double()))
        ours.weight_hh_l1.zero_()
        theirs.weight_hh_l1.zero_()
        _close(ours(x), theirs(x.double()))


def test_state_dict_and_initialisation_as_torch():
    ours, theirs = rnncc.nn.LSTM(3, 5, 2, bidirectional=True), torch.nn.LSTM(3, 5, 2,
                                                                             bidirectional=True)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()}
    assert list(ours.state_dict()) == list(theirs.state_dict())
    bound = 1 / 5 ** 0.5
    assert all(p.abs().max() <= bound for p in ours.parameters())
    assert rnncc.nn.RNN(3, 4, 1, "relu").cell.name == "rnn_relu"


def test_outputs_require_grad_where_a_parameter_does():
    net = rnncc.nn.GRU(3, 4)
    y, h = net(torch.randn(2, 1, 3))
    assert y.requires_grad and h.requires_grad
    with torch.no_grad():
        assert not net(torch.randn(2, 1, 3))[0].requires_grad


def test_the_module_cache_keys_on_rnncc_source(monkeypatch):
    """Modules compiled by other code of the same version (a changed working tree) are not
    reused: the key holds a hash of rnncc's source."""
    from rnncc.compiler import cache

    before = cache._key("lstm", {"hidden_size": 3})
    assert len(cache._code_identity()) == 64
    monkeypatch.setattr(cache, "_code_identity", lambda: "other source")
    assert cache._key("lstm", {"hidden_size": 3}) != before


def test_compiled_modules_are_kept_on_disk(monkeypatch):
    """A second process (here: the in-process memory of modules cleared, and compiling made
    to fail) loads the modules from the disk cache."""
    from rnncc.compiler import cache, driver

    theirs, ours = _torch_and_ours("RNN", 2, 3)
    x = torch.randn(3, 2, 2)
    with torch.no_grad():
        first = ours(x)[0]
    cache._loaded.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(driver, "compile_module", refuse)
    again = rnncc.nn.from_torch(theirs.float())  # a new module: no modules of its own yet
    with torch.no_grad():
        assert torch.equal(again(x)[0], first)


@pytest.mark.parametrize("make, call, match", [
    (lambda: rnncc.nn.LSTM(3, 4, proj_size=4), None, "proj_size=4 must be below hidden_size"),
    (lambda: rnncc.nn.RNN(3, 4, nonlinearity="sigmoid"), None, "nonlinearity must be"),
    (lambda: rnncc.nn.GRU(3, 0), None, "hidden_size must be an integer >= 1, got 0"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 1, 5)),
     "input has 5 features .* input_size is 3"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 1, 3), torch.zeros(2, 1, 4)),
     r"hx's h has shape \[2, 1, 4\], expected \[1, 1, 4\]"),
    (lambda: rnncc.nn.LSTM(3, 4), lambda m: m(torch.randn(2, 1, 3), torch.zeros(1, 1, 4)),
     r"hx must be a tuple of 2 tensors \(h, c\), got 1"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 2, 3), lengths=[3, 1]),
     r"lengths must be from 1 to T = 2"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 2, 3), lengths=[0, 1]),
     r"lengths must be from 1 to T = 2 .* from 0 to 1"),
    (lambda: rnncc.nn.GRU(3, 4).double(), lambda m: m(torch.randn(2, 1, 3).double()),
     "rnncc runs float32, float16 or bfloat16 parameters, got torch.float64"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 1, 3).double()),
     "input is torch.float64, but the parameters are torch.float32"),
    (lambda: rnncc.nn.GRU(3, 4), lambda m: m(torch.randn(2, 1, 1, 3)), "input must be 3-D"),
    (lambda: rnncc.nn.GRU(3, 4, allow_tf32="yes"), None, "allow_tf32 must be True or False"),
    (lambda: rnncc.nn.GRU(3, 4, tf32x3=1), None, "tf32x3 must be True or False, got 1"),
])
def test_errors(make, call, match):
    error = (ConfigError, InputError)
    with torch.no_grad():
        if call is None:
            with pytest.raises(error, match=match):
                make()
        else:
            module = make()
            with pytest.raises(error, match=match):
                call(module)


def test_from_torch_takes_only_recurrent_modules():
    with pytest.raises(ConfigError, match="takes a torch.nn.LSTM, GRU or RNN, got Linear"):
        rnncc.nn.from_torch(torch.nn.Linear(2, 3))
    assert rnncc.nn.from_torch(torch.nn.LSTM(3, 4, proj_size=2)).proj_size == 2
    ours = rnncc.nn.from_torch(torch.nn.GRU(3, 4), allow_tf32=True)
    assert ours.allow_tf32 and "allow_tf32=True" in repr(ours)
    # TF32 reaches float32 modules only: the half types' products are already on tensor cores
    assert ours._layout.module_options("float32") == {"allow_tf32": True}
    assert ours._layout.module_options("bfloat16") == {}
    ours = rnncc.nn.from_torch(torch.nn.LSTM(3, 4), tf32x3=False)
    assert not ours.tf32x3 and "tf32x3=False" in repr(ours)
    assert ours._layout.module_options("float32") == {"tf32x3": False}
    assert ours._layout.module_options("float16") == {}
    assert rnncc.nn.LSTM(3, 4)._layout.module_options("float32") == {}  # on by default


def test_import_leaves_torch_dynamo_out():
    """``import rnncc.nn`` does not import torch._dynamo (about 2 s): the training run's graph
    break under torch.compile is made on first use."""
    import subprocess
    import sys

    code = "import sys, rnncc.nn; print('torch._dynamo' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert found.stdout.strip() == "False"


@pytest.mark.parametrize("lengths", [False, True])
def test_torch_compile_takes_the_network_whole(lengths, rng):
    """``torch.compile(..., fullgraph=True)``: no graph break (the network is one custom op,
    ``torch.ops.rnncc.network``, with its shapes), results equal to eager."""
    net = rnncc.nn.LSTM(4, 5, num_layers=2, bidirectional=True)
    x = torch.randn(6, 3, 4)
    extra = {"lengths": _lengths(rng, 3, 6)} if lengths else {}
    with torch.no_grad():
        eager = net(x, **extra)
        compiled = torch.compile(net, fullgraph=True)(x, **extra)
    assert torch.equal(compiled[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], eager[1]))
