"""Cells with per-unit parameters (the contract's ``params``: learned vectors [H], here the
built-in peephole LSTM's), through the non-persistent schedule, the module API and rnncc.nn
(forward and gradients), against float64 references; the persistent kernels' builds. (Every
cell's layer gradients against finite differences, a user's cell file with a parameter
included: tests/test_training.py; the persistent kernels on the TIR interpreter:
tests/test_stages.py.)"""

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc, random_weights
from helpers import TOL_F32, check_against_reference
from rnncc import cells, reference
from rnncc.errors import InputError

PEEPHOLE = "peephole"


@pytest.fixture(scope="module")
def peephole():
    return cells.get(PEEPHOLE)


@pytest.mark.parametrize("hidden, batch, directions, lengths", [
    (1, 1, 1, False), (33, 7, 1, True), (3, 3, 2, True), (257, 1, 2, False)])
def test_parameters_reach_the_step(peephole, hidden, batch, directions, lengths, rng):
    """Every size and direction, lengths or not, at T = 1, 37 and 5 (without initial
    states); all-zero peepholes are a plain LSTM's step, so nonzero ones must show."""
    module = rnncc.compile(PEEPHOLE, 5, hidden, batch, target="llvm", directions=directions,
                           lengths=lengths)
    assert module.params == ("w_ci", "w_cf", "w_co")
    for steps, initial in ((1, True), (37, True), (5, False)):
        assert check_against_reference(module, rng, steps, initial, lengths=lengths) < TOL_F32
    w = random_weights(rng, 4, 5, hidden, "float32", peephole.params)
    x = rng.standard_normal((4, batch, 5)).astype("float32")
    lstm = rnncc.compile("lstm", 5, hidden, batch, target="llvm", lengths=lengths)
    plain = {k: v for k, v in w.items() if k.startswith(("weight", "bias"))}
    if directions == 1:
        extra = {"lengths": np.full(batch, 4)} if lengths else {}
        zero = {**w, **{f"{p}_l0": np.zeros(hidden, "float32") for p in peephole.params}}
        np.testing.assert_allclose(module(x, zero, **extra)[0], lstm(x, plain, **extra)[0],
                                   rtol=1e-6, atol=1e-6)
        assert not np.allclose(module(x, w, **extra)[0], lstm(x, plain, **extra)[0])


def test_missing_or_misshapen_parameters_are_refused(peephole, rng):
    module = rnncc.compile(PEEPHOLE, 4, 6, 2, target="llvm")
    w = random_weights(rng, 4, 4, 6, "float32", peephole.params)
    x = np.zeros((3, 2, 4), "float32")
    with pytest.raises(InputError, match="missing weight 'w_cf_l0'; expected .*w_ci_l0, "
                                         "w_cf_l0, w_co_l0"):
        module(x, {k: v for k, v in w.items() if k != "w_cf_l0"})
    with pytest.raises(InputError, match="w_co_l0"):
        module(x, {**w, "w_co_l0": np.zeros(5, "float32")})


@pytest.mark.slow
def test_persistent_kernels_take_them_forward_and_backward(peephole):
    """The persistent kernels (one layer, both directions, the wavefront of layers, a
    training forward and the backward) load the parameters once a pair (their arithmetic: the
    TIR interpreter's tests in tests/test_stages.py; on the GPU, tests/test_training.py's
    finite differences of every cell)."""
    if not has_nvcc():
        pytest.skip("the CUDA build needs nvcc")
    module = rnncc.compile(PEEPHOLE, 16, 64, 4, target="cuda", training=True)
    schedule = module.metadata["schedule"]
    functions = module.metadata["functions"]
    assert schedule["kind"] == "persistent"
    assert {"persistent_train_forward", "persistent_backward"} <= set(functions), functions
    for options in ({"directions": 2}, {"layers": 2}):
        module = rnncc.compile(PEEPHOLE, 64, 64, 4, target="cuda", **options)
        assert module.metadata["schedule"]["kind"] == "persistent", options


def _torch_peephole(torch, x, w, layers, lengths):
    """The peephole network in float64 torch (autograd), layer by layer, both directions,
    each sample's reverse direction from its own last step."""
    def layer(seq, p, reverse):
        steps, n, _ = seq.shape
        h_, c_ = seq.new_zeros(n, p["weight_hh"].shape[1]), seq.new_zeros(
            n, p["weight_hh"].shape[1])
        out = [None] * steps
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        for t in order:
            live = (t < lengths)[:, None].to(seq.dtype)
            g = seq[t] @ p["weight_ih"].T + p["bias_ih"] + h_ @ p["weight_hh"].T + p["bias_hh"]
            gi, gf, gg, go = g.chunk(4, dim=1)
            i = torch.sigmoid(gi + p["w_ci"] * c_)
            f = torch.sigmoid(gf + p["w_cf"] * c_)
            c_new = f * c_ + i * torch.tanh(gg)
            h_new = torch.sigmoid(go + p["w_co"] * c_new) * torch.tanh(c_new)
            h_, c_ = live * h_new + (1 - live) * h_, live * c_new + (1 - live) * c_
            out[t] = live * h_new
        return torch.stack(out)

    def reverse(seq):  # each sample's steps reversed within its length
        steps = seq.shape[0]
        t = torch.arange(steps)[:, None]
        index = torch.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)
        return seq.gather(0, index[:, :, None].expand(-1, -1, seq.shape[2]))

    for k in range(layers):
        own = [{n.split("_l")[0]: v for n, v in w.items()
                if n.endswith(f"_l{k}{suffix}")} for suffix in ("", "_reverse")]
        x = torch.cat([layer(x, own[0], False), reverse(layer(reverse(x), own[1], False))],
                      dim=2)
    return x


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rnncc_nn_creates_runs_and_trains_the_parameters(peephole, device, module_cache):
    """``rnncc.nn.Recurrent("peephole", ...)``: the parameters ``<name>_l{k}[_reverse]`` [H]
    next to torch's; 2 layers, bidirectional, unequal lengths: outputs under no_grad against
    the float64 reference, and every gradient (input and parameters) against float64 torch
    autograd of the same network written out (on CUDA: the persistent kernels)."""
    torch = pytest.importorskip("torch")
    import rnncc.nn

    net = rnncc.nn.Recurrent(PEEPHOLE, 5, 7, num_layers=2, bidirectional=True).to(device)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert shapes["w_ci_l1_reverse"] == (7,) and shapes["weight_ih_l1"] == (28, 14)
    x = torch.randn(6, 3, 5)
    with torch.no_grad():
        y, (h, c) = net(x.to(device))
    y, c = y.cpu(), c.cpu()
    state = {k: v.double().cpu().numpy() for k, v in net.state_dict().items()}
    want = x.double().numpy()
    for layer in range(2):
        own = {k.replace(f"_l{layer}", "_l0"): v for k, v in state.items()
               if f"_l{layer}" in k}
        want, finals = reference.run_bidirectional(peephole, want, own)
    assert reference.relative_error(y.numpy(), want) < TOL_F32
    assert reference.relative_error(c[2:].numpy(), finals["c"]) < TOL_F32

    lengths = torch.tensor([6, 2, 4])
    mine = x.clone().to(device).requires_grad_()
    packed = torch.nn.utils.rnn.pack_padded_sequence(mine, lengths, enforce_sorted=False)
    out = torch.nn.utils.rnn.pad_packed_sequence(net(packed)[0], total_length=6)[0].cpu()
    dy = torch.randn(out.shape)
    (out * dy).sum().backward()
    w64 = {n: p.detach().double().cpu().requires_grad_() for n, p in net.named_parameters()}
    theirs = x.double().requires_grad_()
    ref = _torch_peephole(torch, theirs, w64, 2, lengths)
    (ref * dy.double()).sum().backward()
    assert reference.relative_error(out.detach().numpy(), ref.detach().numpy()) < TOL_F32
    assert reference.relative_error(mine.grad.cpu().numpy(), theirs.grad.numpy()) < 1e-4
    for name, p in net.named_parameters():
        assert reference.relative_error(p.grad.cpu().numpy(), w64[name].grad.numpy()) < 1e-4, (
            name)


@pytest.mark.slow
def test_half_parameters_train(peephole, module_cache):
    """A bfloat16 network of peephole LSTMs (bidirectional, unequal lengths) on the CPU: its
    parameters, converted to float32 before the steps forward and backward, give every
    gradient within bfloat16's bound of float64 torch autograd from the same rounded
    weights and input."""
    torch = pytest.importorskip("torch")
    import rnncc.nn

    net = rnncc.nn.Recurrent(PEEPHOLE, 5, 7, bidirectional=True).to(torch.bfloat16)
    lengths = torch.tensor([6, 2, 4])
    x = torch.randn(6, 3, 5).to(torch.bfloat16)
    mine = x.clone().requires_grad_()
    packed = torch.nn.utils.rnn.pack_padded_sequence(mine, lengths, enforce_sorted=False)
    out = torch.nn.utils.rnn.pad_packed_sequence(net(packed)[0], total_length=6)[0]
    assert out.dtype == torch.bfloat16
    dy = torch.randn(out.shape).to(torch.bfloat16)
    (out.float() * dy.float()).sum().backward()
    w64 = {n: p.detach().double().requires_grad_() for n, p in net.named_parameters()}
    theirs = x.double().requires_grad_()
    ref = _torch_peephole(torch, theirs, w64, 1, lengths)
    (ref * dy.double()).sum().backward()
    assert reference.relative_error(mine.grad.double().numpy(), theirs.grad.numpy()) < 5e-2
    for name, p in net.named_parameters():
        assert reference.relative_error(p.grad.double().numpy(), w64[name].grad.numpy()) < (
            5e-2), name
