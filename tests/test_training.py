"""Training: the cells' derivatives, a layer's backward pass and gradients through rnncc.nn,
against float64 (finite differences of the cells' NumPy references, and torch's autograd on the
CPU in float64)."""

import os

import numpy as np
import pytest

import rnncc
from conftest import random_weights
from helpers import sequence_loss_grads
from rnncc import cells, reference
from rnncc.cells import autodiff
from rnncc.errors import ConfigError, InputError

torch = pytest.importorskip("torch")

DATA = os.path.join(os.path.dirname(__file__), "data")
#: Every built-in cell and the test suite's user cell files.
CELLS = cells.names() + [os.path.join(DATA, f) for f in ("mgu.py", "coupled.py",
                                                         "leaky.py")]
TORCH = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN,
         "rnn_relu": torch.nn.RNN}
#: Gradients in float32 against float64: relative error (the issue's bound is 1e-4).
TOL = 1e-4
pytestmark = pytest.mark.usefixtures("module_cache")


def _cell(name_or_path):
    from rnncc.compiler.driver import resolve_cell

    return resolve_cell(name_or_path)


def _err(out, ref) -> float:
    return reference.relative_error(np.asarray(out.detach() if hasattr(out, "detach") else out,
                                               np.float64), ref)


@pytest.mark.parametrize("cell", CELLS)
def test_cell_derivative_matches_finite_differences(cell, rng):
    """The derivative traced from a cell's step (NumPy backend) against central differences
    of the cell's own float64 reference (per-unit parameters and recurrent products of the
    step's values included)."""
    cell = _cell(cell)
    graph = autodiff.trace(cell)
    g, s = cell.gates, len(cell.states)
    values = [rng.standard_normal((3, 4)) for _ in range(2 * g + s + len(cell.params))]
    seeds = [rng.standard_normal((3, 4)) for _ in range(s)]
    w_hh, b_hh = rng.standard_normal((g * 4, 4)), rng.standard_normal(g * 4)
    grads = autodiff.vjp(graph, values, seeds, autodiff.NumPy(w_hh, b_hh))

    def recurrent(gate, x):
        return x @ w_hh[gate * 4:(gate + 1) * 4].T + b_hh[gate * 4:(gate + 1) * 4]

    def loss(vals):
        out = cell.reference_step(vals[:g], vals[g:2 * g], vals[2 * g:2 * g + s],
                                  vals[2 * g + s:], recurrent if graph.products else None)
        return sum(float((o * w).sum()) for o, w in zip(out, seeds))

    for i, grad in enumerate(grads):
        numeric = np.zeros_like(values[i])
        for idx in np.ndindex(values[i].shape):
            up, down = [v.copy() for v in values], [v.copy() for v in values]
            up[i][idx] += 1e-6
            down[i][idx] -= 1e-6
            numeric[idx] = (loss(up) - loss(down)) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7)


def test_summed_projections_are_found():
    """LSTM and the Elman RNNs use each gate's gi and gh only as their sum (one gradient buffer
    serves both, the sums are kept); GRU and the MGU test cell multiply gh_n by a gate first
    (their r and z, f are sums; n's gi and gh are kept apart)."""
    found = {name: all(autodiff.summed_gates(autodiff.trace(_cell(name))))
             for name in ("lstm", "rnn_tanh", "rnn_relu", "gru", os.path.join(DATA, "mgu.py"))}
    assert list(found.values()) == [True, True, True, False, False]
    assert autodiff.summed_gates(autodiff.trace(_cell("gru"))) == [True, True, False]
    from rnncc.lowering.training import kept_parts

    assert kept_parts(_cell("gru")) == ((0, "sum"), (1, "sum"), (2, "gi"), (2, "gh"))
    assert kept_parts(_cell("lstm")) == tuple((g, "sum") for g in range(4))


def test_a_step_with_foreign_values_is_refused():
    bad = cells.Cell("bad_values", 1, ("h",), lambda gi, gh, s: (gi[0] + "x",),
                     lambda gi, gh, s: (gi[0],))
    with pytest.raises(rnncc.errors.CellError, match="combined a value with str"):
        autodiff.trace(bad)


@pytest.mark.parametrize("target", ["llvm", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cell", CELLS)
def test_layer_gradients_match_finite_differences(cell, target, rng):
    """Module.train_forward / backward of every cell (built-in and user files), on random
    lengths, against central differences of the float64 reference sequence (on CUDA: the
    persistent training kernels, which these sizes fit)."""
    cell = _cell(cell)
    c, h, n, steps = 2, 3, 3, 4
    module = rnncc.compile(cell, c, h, n, target=target, training=True, lengths=True)
    k = 1 / np.sqrt(h)
    g = cell.gates
    weights = {"weight_ih_l0": rng.uniform(-k, k, (g * h, c)),
               "weight_hh_l0": rng.uniform(-k, k, (g * h, h)),
               "bias_ih_l0": rng.uniform(-k, k, g * h), "bias_hh_l0": rng.uniform(-k, k, g * h),
               **{f"{p}_l0": rng.uniform(-1, 1, h) for p in cell.params}}
    x = rng.standard_normal((steps, n, c)).astype(np.float32).astype(np.float64)
    weights = {k_: v.astype(np.float32).astype(np.float64) for k_, v in weights.items()}
    initial = {s: rng.standard_normal((1, n, h)).astype(np.float32).astype(np.float64)
               for s in cell.states}
    lengths = np.array([steps, 1, 3])
    dy = rng.standard_normal((steps, n, h))
    d_finals = {s: rng.standard_normal((1, n, h)) for s in cell.states}
    ref = sequence_loss_grads(cell, x, weights, initial, lengths, dy, d_finals)

    f32 = {k_: v.astype(np.float32) for k_, v in weights.items()}
    init32 = {f"{s}0": v.astype(np.float32) for s, v in initial.items()}
    y, _, kept = module.train_forward(x.astype(np.float32), f32, lengths=lengths, **init32)
    ref_y, _ = reference.run(cell, x, weights, initial, lengths)
    assert _err(y, ref_y) < 1e-5
    grads = module.backward(x.astype(np.float32), f32, kept, dy.astype(np.float32),
                            tuple(d_finals[s].astype(np.float32) for s in cell.states),
                            lengths=lengths)
    assert set(grads) == set(ref)
    for name, want in ref.items():
        assert _err(grads[name], want) < TOL, name


@pytest.mark.parametrize("cell", sorted(TORCH))
@pytest.mark.parametrize("c, h, n, steps", [(5, 1, 1, 1), (4, 33, 7, 9), (3, 3, 3, 20)])
def test_layer_gradients_match_torch_float64(cell, c, h, n, steps, rng):
    """A layer's gradients (input, initial states, every weight and bias) against torch's
    autograd in float64 on the CPU: odd sizes, T = 1, unequal lengths."""
    kw = {"nonlinearity": "relu"} if cell == "rnn_relu" else {}
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = TORCH[cell](c, h, **kw).double()
    module = rnncc.compile(cell, c, h, n, target="llvm", training=True, lengths=True)
    x = torch.randn(steps, n, c, dtype=torch.float64, requires_grad=True)
    states = [torch.randn(1, n, h, dtype=torch.float64, requires_grad=True)
              for _ in module.states]
    lengths = torch.as_tensor(rng.integers(1, steps + 1, n))
    lengths[0] = steps
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    y, finals = theirs(packed, tuple(states) if len(states) > 1 else states[0])
    y = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=steps)[0]
    finals = finals if isinstance(finals, tuple) else (finals,)
    dy, d_finals = torch.randn_like(y), [torch.randn_like(f) for f in finals]
    ((y * dy).sum() + sum((f * d).sum() for f, d in zip(finals, d_finals))).backward()

    weights = {k: v.float() for k, v in theirs.state_dict().items()}
    initial = {f"{s}0": v.detach().float() for s, v in zip(module.states, states)}
    ours_y, _, kept = module.train_forward(x.detach().float(), weights, lengths=lengths,
                                           **initial)
    assert _err(ours_y, y.detach().numpy()) < 1e-5
    grads = module.backward(x.detach().float(), weights, kept, dy.float(),
                            tuple(d.float() for d in d_finals), lengths=lengths)
    assert _err(grads["x"], x.grad.numpy()) < TOL
    for s, state in zip(module.states, states):
        assert _err(grads[f"{s}0"], state.grad.numpy()) < TOL, s
    for name, param in theirs.named_parameters():
        assert _err(grads[name], param.grad.numpy()) < TOL, name


@pytest.mark.parametrize("kind", ["LSTM", pytest.param("GRU", marks=pytest.mark.slow)])
def test_network_gradients_match_torch(kind, rng):
    """rnncc.nn, 2 layers bidirectional, a PackedSequence of unequal lengths (unsorted),
    initial states that require grad: every gradient against torch's in float64."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = getattr(torch.nn, kind)(5, 6, num_layers=2, bidirectional=True).double()
    ours = getattr(rnncc.nn, kind)(5, 6, num_layers=2, bidirectional=True)
    ours.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()})
    steps, n = 7, 3
    lengths = torch.tensor([4, 7, 1])
    x = torch.randn(steps, n, 5, dtype=torch.float64, requires_grad=True)
    count = 2 if kind == "LSTM" else 1
    hx = [torch.randn(4, n, 6, dtype=torch.float64, requires_grad=True) for _ in range(count)]
    results = []
    for net, dtype, inputs in ((theirs, torch.float64, (x, *hx)),
                               (ours, torch.float32, [t.detach().float().requires_grad_()
                                                      for t in (x, *hx)])):
        packed = torch.nn.utils.rnn.pack_padded_sequence(inputs[0], lengths,
                                                         enforce_sorted=False)
        y, finals = net(packed, tuple(inputs[1:]) if count > 1 else inputs[1])
        y = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=steps)[0]
        finals = finals if isinstance(finals, tuple) else (finals,)
        gen = torch.Generator().manual_seed(7)
        loss = (y * torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)).sum()
        for f in finals:
            loss = loss + (f * torch.randn(f.shape, generator=gen, dtype=torch.float64)
                           .to(dtype)).sum()
        loss.backward()
        results.append((y, [t.grad for t in inputs], {k: p.grad for k, p in
                                                      net.named_parameters()}))
    (y_ref, in_ref, p_ref), (y_ours, in_ours, p_ours) = results
    assert _err(y_ours, y_ref.detach().numpy()) < 1e-5
    for got, want in zip(in_ours, in_ref):
        assert _err(got, want.numpy()) < TOL
    assert set(p_ours) == set(p_ref)
    for name, want in p_ref.items():
        assert _err(p_ours[name], want.numpy()) < TOL, name


def test_network_gradients_batch_first_no_bias_dropout_zero_in_training_mode(rng):
    """batch_first, bias=False, dropout 0 in train mode, a batch off the buckets (5 of 8):
    gradients of the input and the weights as torch's."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = torch.nn.GRU(4, 5, num_layers=2, bias=False, batch_first=True).double().train()
    ours = rnncc.nn.from_torch(theirs.float()).train()
    theirs.double()
    x = torch.randn(5, 6, 4, dtype=torch.float64, requires_grad=True)
    mine = x.detach().float().requires_grad_()
    dy = torch.randn(5, 6, 5, dtype=torch.float64)
    (theirs(x)[0] * dy).sum().backward()
    (ours(mine)[0] * dy.float()).sum().backward()
    assert _err(mine.grad, x.grad.numpy()) < TOL
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert _err(q.grad, p.grad.numpy()) < TOL, name


def test_gradients_only_where_asked():
    """No grad mode or nothing that requires grad: the inference path (no grad_fn); the
    weights alone requiring grad: torch's gradients reach them, and dx is not computed."""
    net = rnncc.nn.GRU(3, 4)
    theirs = torch.nn.GRU(3, 4).double()
    theirs.load_state_dict(net.state_dict())
    x = torch.randn(2, 1, 3)
    with torch.no_grad():
        y, _ = net(x)
    assert y.grad_fn is None
    y, _ = net(x)
    y.sum().backward()
    theirs(x.double())[0].sum().backward()
    assert x.grad is None
    for (name, p), q in zip(theirs.named_parameters(), net.parameters()):
        assert _err(q.grad, p.grad.numpy()) < TOL, name
    module = rnncc.compile("gru", 3, 4, 1, target="llvm", training=True)
    y, _, kept = module.train_forward(x, theirs.float())
    grads = module.backward(x, theirs, kept, torch.ones_like(y), input_grad=False)
    assert "x" not in grads and "weight_hh_l0" in grads


def test_training_needs_one_layer_one_direction_and_the_entries():
    with pytest.raises(ConfigError, match="training=True compiles one layer of one direction"):
        rnncc.compile("lstm", 3, 4, 2, target="llvm", training=True, directions=2)
    with pytest.raises(ConfigError, match="training=True needs input_gemm"):
        rnncc.compile("lstm", 3, 4, 2, target="llvm", training=True, fuse_pointwise=False)
    module = rnncc.compile("rnn_tanh", 3, 4, 2, target="llvm")
    with pytest.raises(InputError, match="compiled without training entries"):
        module.train_forward(np.zeros((2, 2, 3), np.float32), torch.nn.RNN(3, 4))


def test_backward_checks_its_inputs(rng):
    module = rnncc.compile("lstm", 3, 4, 2, target="llvm", training=True)
    weights = torch.nn.LSTM(3, 4).state_dict()
    x = torch.randn(5, 2, 3)
    y, _, kept = module.train_forward(x, weights)
    with pytest.raises(InputError, match="finals_grad has 3 tensors; this cell has 2 states"):
        module.backward(x, weights, kept, torch.ones_like(y), (None, None, None))
    with pytest.raises(InputError, match="kept lacks c_steps"):
        module.backward(x, weights, {"h_steps": kept["h_steps"]}, torch.ones_like(y))
    with pytest.raises(InputError, match=r"dy has shape \[5, 2, 3\]"):
        module.backward(x, weights, kept, torch.ones(5, 2, 3))
    grads = module.backward(x, weights, kept)  # no gradients given: all zero
    assert all(float(abs(v).max()) == 0 for v in grads.values())


@pytest.mark.gpu
@pytest.mark.parametrize("kind, c, h, layers, bidirectional, n, steps", [
    ("LSTM", 64, 64, 1, False, 1, 100),
    ("LSTM", 33, 257, 1, False, 7, 30),
    ("GRU", 128, 128, 2, True, 3, 20),
    ("LSTM", 48, 32, 2, True, 13, 1),
    ("RNN", 16, 3, 1, False, 3, 1000),
    ("LSTM", 48, 64, 1, False, 40, 20),  # batch >= 32: the sums kept over the projections
    ("LSTM", 128, 128, 2, False, 37, 25),  # dx and the weights' gradients of whole tiles: only
    # the rows within the lengths (cuda.sgemm, cuda.weight_grad)
    ("LSTM", 64, 2048, 1, False, 4, 6),  # per-step kernels: dh = dGH W_hh with K = 8192
    # split among warps (cuda.small_batch_gemv)
    ("GRU", 161, 256, 2, True, 40, 20),  # C padded: dx's product of O = 164, its rows within
    # the lengths
])
def test_network_gradients_on_cuda_match_float64(kind, c, h, layers, bidirectional, n, steps,
                                                 rng):
    """On the GPU (IEEE float32): every gradient of rnncc.nn against torch's autograd in
    float64 on the CPU, with unequal lengths (unsorted) and initial states."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = getattr(torch.nn, kind)(c, h, num_layers=layers,
                                     bidirectional=bidirectional).double()
    ours = rnncc.nn.from_torch(theirs.float()).cuda()
    theirs.double()
    lengths = torch.as_tensor(rng.integers(1, steps + 1, n))
    lengths[n // 2] = steps
    rows = layers * (2 if bidirectional else 1)
    x = torch.randn(steps, n, c, dtype=torch.float64, requires_grad=True)
    hx = [torch.randn(rows, n, h, dtype=torch.float64, requires_grad=True)
          for _ in range(2 if kind == "LSTM" else 1)]
    grads = []
    for net, inputs in ((theirs, [x, *hx]),
                        (ours, [t.detach().float().cuda().requires_grad_() for t in (x, *hx)])):
        packed = torch.nn.utils.rnn.pack_padded_sequence(inputs[0], lengths,
                                                         enforce_sorted=False)
        y, finals = net(packed, tuple(inputs[1:]) if len(hx) > 1 else inputs[1])
        y = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=steps)[0]
        finals = finals if isinstance(finals, tuple) else (finals,)
        gen = torch.Generator().manual_seed(3)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64)
                    .to(t.dtype).to(t.device)).sum() for t in (y, *finals))
        loss.backward()
        grads.append([t.grad for t in inputs] + [p.grad for p in net.parameters()])
    for got, want in zip(grads[1], grads[0]):
        assert _err(got.cpu(), want.numpy()) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kind, c, h, n, split", [
    ("LSTM", 256, 1024, 64, ("input_gemm_backward", "weight_grad_hh")),
    ("LSTM", 1024, 1024, 256, ("input_gemm_backward", "weight_grad_ih", "weight_grad_hh")),
    ("GRU", 96, 512, 130, ())])  # C = 96 off whole tiles; dW_hh's 48 tiles too few to split
def test_float32_gradients_with_products_split_in_three_tf32_products(kind, c, h, n, split,
                                                                      rng):
    """Float32 at batch 64 and more (tf32x3, the default): the products of all steps and each
    step's, forward and backward, on tensor cores as three TF32 products each, and in LSTM
    1024 dx and the weight gradients of enough tiles too (the module's rules say so; at batch
    256 sums over 5120 rows); every gradient of rnncc.nn within float32's bound of torch's
    autograd in float64 on the CPU, 20 steps."""
    from rnncc.compiler import cache

    rules = cache.compiled(kind.lower(), c, h, n, training=True).metadata["schedule"]["rules"]
    assert {rules[k] for k in ("input_gemm", "recurrent_gemm_backward_parts", *split)} <= {
        "cuda.mma_gemm", "cuda.wgmma_gemm"}
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = getattr(torch.nn, kind)(c, h).double()
    ours = rnncc.nn.from_torch(theirs.float()).cuda()
    theirs.double()
    x = torch.randn(20, n, c, dtype=torch.float64, requires_grad=True)
    grads = []
    for net, inp in ((theirs, x), (ours, x.detach().float().cuda().requires_grad_())):
        y, finals = net(inp)
        finals = finals if isinstance(finals, tuple) else (finals,)
        gen = torch.Generator().manual_seed(3)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64)
                    .to(t.dtype).to(t.device)).sum() for t in (y, *finals))
        loss.backward()
        grads.append([inp.grad] + [p.grad for p in net.parameters()])
    for got, want in zip(grads[1], grads[0]):
        assert _err(got.cpu(), want.numpy()) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("c, h, n", [(128, 128, 40), (40, 40, 128), (1000, 1000, 7),
                                     (161, 64, 37), (60, 300, 9)])
@pytest.mark.parametrize("half, bound", [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_half_network_gradients_on_cuda_match_float64(half, bound, c, h, n, rng):
    """float16 / bfloat16 on the GPU, bidirectional with unequal lengths: every gradient
    within half precision of torch's float64 ones from the same rounded weights, inputs and
    loss. C = H = 128 at batch 40: no persistent kernel, the products of all steps and the
    weight gradients on tensor cores; C = H = 40 at batch 128 and 1000 at 7: K and O not
    whole tiles (the input projections of all steps past their edges; dx's product, its
    weights read MN-major, on another rule; the weight gradients past whole tiles); C = 161:
    x and W_ih padded to 168; H = 300: rows of h and of dW_hh [1200, 300] whole 8-byte
    copies only."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    steps = 20
    theirs = torch.nn.LSTM(c, h, bidirectional=True).to(half).double()
    ours = rnncc.nn.from_torch(theirs.to(half)).cuda()
    theirs.double()
    lengths = torch.as_tensor(rng.integers(1, steps + 1, n))
    lengths[0] = steps
    x = torch.randn(steps, n, c).to(half).double().requires_grad_()
    grads = []
    for net, inp in ((theirs, x), (ours, x.detach().to(half).cuda().requires_grad_())):
        packed = torch.nn.utils.rnn.pack_padded_sequence(inp, lengths, enforce_sorted=False)
        y, finals = net(packed)
        y = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=steps)[0]
        gen = torch.Generator().manual_seed(3)
        loss = sum((t * torch.randn(t.shape, generator=gen).to(half).to(t.device, t.dtype))
                   .sum() for t in (y, *finals))
        loss.backward()
        grads.append([inp.grad] + [p.grad for p in net.parameters()])
    for got, want in zip(grads[1], grads[0]):
        assert got.dtype == half
        assert _err(got.float().cpu(), want.numpy()) < bound


@pytest.mark.parametrize("kind, h, n, dtype, mma", [
    ("gru", 64, 64, "float16", False), ("gru", 256, 32, "bfloat16", False),
    ("lstm", 257, 13, "float16", False), ("gru", 256, 64, "float16", False),
    ("lstm", 128, 128, "float16", True), ("gru", 128, 128, "bfloat16", True),
    ("lstm", 1024, 64, "bfloat16", True),
    ("gru", 64, 64, "float32", False)])
def test_half_backward_on_tensor_cores_only_on_enough_blocks(kind, h, n, dtype, mma):
    """A 16-bit training module's backward recurrence runs on tensor cores where their plan
    takes at least MMA_BACKWARD_MIN_BLOCKS blocks (at small K = G*H a block's 8 units leave
    few), else on the CUDA cores' plan (one block a batch group there); float32 on the CUDA
    cores."""
    from rnncc.compiler.driver import _backward_plan
    from rnncc.lowering.training import kept_parts
    from rnncc.schedules.persistent import planner
    from rnncc.spec import Options, Problem
    from rnncc.target import TargetSpec

    problem = Problem(cells.get(kind), h, h, n, dtype, training=True)
    plan, why = _backward_plan(problem, Options(), TargetSpec("cuda", arch="sm_90"), None,
                               planner.REG_MARGIN)
    assert why is None and plan.mma == mma
    if not mma and dtype != "float32":  # the tensor cores' plan would take few blocks
        tensor = planner.backward(problem.gates, h, n, dtype, planner.gpu_for_arch("sm_90"),
                                  len(problem.cell.states), len(kept_parts(problem.cell)),
                                  mma=True)
        assert tensor.blocks < planner.MMA_BACKWARD_MIN_BLOCKS


@pytest.mark.parametrize("tensor_spills", [False, True])
def test_a_spilling_cuda_core_backward_falls_back_to_the_tensor_cores(monkeypatch,
                                                                      tensor_spills):
    """Where the CUDA cores' backward plans (taken over the tensor cores' of few blocks)
    spill with every margin tried, the tensor cores' plan is built, not none; where those
    spill too, none (ptxas's report stubbed: every CUDA-core plan spills, and every
    tensor-core one with ``tensor_spills``)."""
    from types import SimpleNamespace

    from rnncc.compiler import driver
    from rnncc.schedules.persistent.planner import MMA_BACKWARD_MIN_BLOCKS

    built = []

    def build(problem, opts, tspec, plan, why, notes, applied, backward=None):
        built.append(backward[0])
        return SimpleNamespace(notes=notes)

    monkeypatch.setattr(driver, "_build", build)
    monkeypatch.setattr(driver, "_persistent_spills", lambda module: (
        [] if built[-1] is None or (built[-1].mma and not tensor_spills)
        else ["persistent_backward"]))
    module = driver.compile_module("gru", 64, 64, 64, dtype="float16", arch="sm_90",
                                   training=True, tuning="off")
    assert not any(plan.mma for plan in built[:4])
    assert built[4].mma and built[4].blocks < MMA_BACKWARD_MIN_BLOCKS
    assert any("tensor cores' few blocks" in note for note in module.notes)
    assert len(built) == (9 if tensor_spills else 5)  # then every margin again, and none
    assert (built[-1] is None) == tensor_spills


@pytest.mark.gpu
@pytest.mark.parametrize("kind, h, n, half, parts, slices", [
    ("LSTM", 1024, 32, torch.bfloat16, 4, 1),  # K = 4096 split among 4 warps, dGH copied
    ("GRU", 1024, 64, torch.bfloat16, 4, 1),  # 2 groups of 32 rows: 2 tiles a group
    ("LSTM", 1024, 64, torch.bfloat16, 4, 4),  # dGH staged in 4 slices of K
    ("LSTM", 1024, 64, torch.float16, 4, 4),
    ("LSTM", 128, 128, torch.float16, 2, 1),
    ("GRU", 257, 13, torch.float16, 4, 1),
    ("GRU", 64, 64, torch.float16, 0, 1),  # the CUDA cores: tensor cores on 2 blocks only
    ("LSTM", 257, 13, torch.float16, 0, 1),
])
def test_half_gradients_through_the_persistent_backward_kernel(kind, h, n, half, parts, slices,
                                                               rng):
    """16-bit layers whose backward recurrence is the persistent kernel, on tensor cores (its
    plan says so, K split among ``parts`` warps, dGH staged in ``slices`` slices of K) or on
    the CUDA cores (``parts`` 0): every gradient within half precision of torch's float64
    ones from the same rounded weights, inputs and loss, over 30 steps."""
    from rnncc.compiler import cache

    module = cache.compiled(kind.lower(), h, h, n, dtype=str(half).replace("torch.", ""),
                            training=True)
    plan = module.metadata["schedule"]["persistent_backward"]["plan"]
    assert plan["mma"] == (parts > 0)
    assert not plan["mma"] or (plan["k_parts"], plan["k_slices"]) == (parts, slices)
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = getattr(torch.nn, kind)(h, h).to(half)
    ours = rnncc.nn.from_torch(theirs).cuda()
    theirs.double()
    x = torch.randn(30, n, h).to(half).double().requires_grad_()
    grads = []
    for net, inp in ((theirs, x), (ours, x.detach().to(half).cuda().requires_grad_())):
        y, finals = net(inp)
        gen = torch.Generator().manual_seed(3)
        finals = finals if isinstance(finals, tuple) else (finals,)
        loss = sum((t * torch.randn(t.shape, generator=gen).to(half).to(t.device, t.dtype))
                   .sum() for t in (y, *finals))
        loss.backward()
        grads.append([inp.grad] + [p.grad for p in net.parameters()])
    for got, want in zip(grads[1], grads[0]):
        assert _err(got.float().cpu(), want.numpy()) < (5e-2 if half == torch.bfloat16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("h", [256, 1024])
def test_half_training_forward_matches_float64_past_batch_64(kind, h, rng):
    """bfloat16 at batch 128: at H 256 the persistent kernel in batch groups; at H 1024 (W_hh
    past 4.5 MiB) the non-persistent schedule, whose training forward's steps write the kept
    sums over the input projections and a bfloat16 copy of h for the next product. y with
    gradients wanted as close to torch's float64 (same rounded weights and inputs) as
    without, both within bfloat16 rounding, over 60 steps (the copy once read the sums as
    projections: LSTM 1024's y drifted to 2.5e-2 off by step 10)."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    theirs = getattr(torch.nn, kind)(256, h).to(torch.bfloat16)
    ours = rnncc.nn.from_torch(theirs).cuda()
    x = torch.randn(60, 128, 256).to(torch.bfloat16)
    want = theirs.double()(x.double())[0].detach().numpy()
    with torch.no_grad():
        inference = ours(x.cuda())[0]
    training = ours(x.cuda().requires_grad_())[0]
    for y in (inference, training):
        assert _err(y.float().cpu(), want) < 5e-3


def test_double_backward_says_it_is_not_supported():
    net = rnncc.nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3, requires_grad=True)
    y, _ = net(x)
    with pytest.raises(InputError, match="cannot be differentiated again"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("kind, consumed", [("LSTM", ["pre"]), ("GRU", [])])
def test_a_second_backward_through_overwritten_sums_is_refused(kind, consumed):
    """Where every gate is kept as its sum (LSTM), the backward pass writes the projections'
    gradients over the kept sums (Module.consumed): a second backward through the same graph
    (retain_graph=True) is refused by torch's in-place check, not computed from what was
    overwritten; GRU keeps n's gi and gh apart, so its sums stay and it gives the same
    gradients twice."""
    net = getattr(rnncc.nn, kind)(3, 4)
    x = torch.randn(5, 2, 3, requires_grad=True)
    y, _ = net(x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    module = rnncc.compile(kind.lower(), 3, 4, 2, target="llvm", training=True)
    assert module.consumed == consumed
    if consumed:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    else:
        y.sum().backward()
        torch.testing.assert_close(x.grad, 2 * first)


@pytest.mark.parametrize("cell, hidden, batch, shared", [("gru", 16, 4, True),
                                                         ("lstm", 3, 7, False)])
def test_y_is_kept_in_the_states_of_every_step_where_they_agree(cell, hidden, batch, shared,
                                                                rng):
    """Without lengths (torch tensors, float32), a training forward's y is h_steps from its
    step 1 on, one buffer (less memory kept for the backward pass), where that view is
    64-byte aligned (N*H a multiple of 16); either way y is the call's y, and with lengths
    (zeros past a sample's end) it is a tensor of its own."""
    module = rnncc.compile(cell, 5, hidden, batch, target="llvm", training=True, lengths=True)
    module.poison = True
    weights = {k: torch.from_numpy(v).float() for k, v in random_weights(
        rng, cells.get(cell).gates, 5, hidden).items()}
    x = torch.from_numpy(rng.standard_normal((6, batch, 5))).float()
    y, _, kept = module.train_forward(x, weights)
    assert (y.data_ptr() == kept["h_steps"][1].data_ptr()) == shared
    torch.testing.assert_close(y, module(x, weights)[0], rtol=0, atol=0)
    torch.testing.assert_close(kept["h_steps"][1:], y, rtol=0, atol=0)
    full = torch.full((batch,), 6, dtype=torch.int32)
    y_own, _, kept_own = module.train_forward(x, weights, lengths=full)
    assert y_own.data_ptr() != kept_own["h_steps"][1].data_ptr()
    torch.testing.assert_close(y_own, y, rtol=0, atol=0)


def test_y_modified_in_place_in_training_is_refused():
    """A training forward's y shares the memory the backward pass reads (as cuDNN's, whose
    backward refuses an output changed in place): changing it in place says so at once."""
    net = rnncc.nn.GRU(5, 16)
    y, _ = net(torch.randn(7, 4, 5, requires_grad=True))
    with pytest.raises(RuntimeError, match="modified inplace"):
        y.add_(1.0)


@pytest.mark.parametrize("name", ["weight_hh_l0", "bias_ih_l0"])
def test_a_weight_changed_in_place_before_backward_is_refused(name):
    """The training forward may use the weights' own memory (no packed copy, on CUDA): a
    weight changed in place between the forward and the backward pass (an optimizer step too
    early) is refused by torch's in-place check, as torch.nn.LSTM's, not differentiated with
    the new values."""
    net = rnncc.nn.LSTM(3, 4)
    x = torch.randn(5, 2, 3, requires_grad=True)
    y, _ = net(x)
    with torch.no_grad():
        getattr(net, name).add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_compiled_module_trains():
    """torch.compile of an rnncc.nn module: a call that needs gradients runs rnncc's part
    eagerly and gives torch's gradients."""
    net = rnncc.nn.GRU(3, 4)
    theirs = torch.nn.GRU(3, 4).double()
    theirs.load_state_dict(net.state_dict())
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    mine = x.detach().float().requires_grad_()
    torch.compile(net)(mine)[0].sum().backward()
    theirs(x)[0].sum().backward()
    assert _err(mine.grad, x.grad.numpy()) < TOL
    assert _err(net.weight_hh_l0.grad, theirs.weight_hh_l0.grad.numpy()) < TOL


@pytest.mark.parametrize("half, bound", [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_autocast_trains_in_half_precision(half, bound, rng):
    """Under torch.autocast(float16 or bfloat16) a float32 module runs modules of that dtype
    (outputs in it, as torch's under autocast) and its float32 parameters get float32
    gradients, within half precision of torch's float64 ones from the same half-rounded
    weights and input."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    ours = rnncc.nn.LSTM(8, 16, num_layers=2)
    theirs = torch.nn.LSTM(8, 16, num_layers=2).double()
    theirs.load_state_dict({k: v.to(half).double() for k, v in ours.state_dict().items()})
    x = torch.randn(6, 3, 8).to(half).float().requires_grad_()
    ref = x.detach().double().requires_grad_()
    with torch.autocast("cpu", dtype=half):
        y, (h, c) = ours(x)
    assert y.dtype == h.dtype == half
    y.float().sum().backward()
    theirs(ref)[0].sum().backward()
    assert ours.weight_hh_l1.grad.dtype == torch.float32
    assert _err(x.grad, ref.grad.numpy()) < bound
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert _err(q.grad, p.grad.numpy()) < bound, name


def test_autocast_to_another_dtype_runs_float32_and_says_so(monkeypatch):
    net = rnncc.nn.GRU(3, 4)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda kind: torch.float64)
    with pytest.warns(UserWarning, match="autocast to torch.float64 is not supported"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = net(torch.randn(2, 1, 3))
    assert y.dtype == torch.float32


@pytest.mark.parametrize("kind", ["LSTM", pytest.param("GRU", marks=pytest.mark.slow)])
def test_a_training_run_follows_torch(kind):
    """Adam on a 2-layer network with a linear head, 15 steps from the same weights and
    batches: the loss curves of rnncc.nn and torch.nn agree to float32 noise."""
    torch.manual_seed(0)
    theirs = torch.nn.ModuleDict({"rnn": getattr(torch.nn, kind)(6, 12, num_layers=2),
                                  "head": torch.nn.Linear(12, 5)})
    ours = torch.nn.ModuleDict({"rnn": rnncc.nn.from_torch(theirs["rnn"]),
                                "head": torch.nn.Linear(12, 5)})
    ours["head"].load_state_dict(theirs["head"].state_dict())
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(9, 4, 6, generator=gen), torch.randint(0, 5, (9, 4), generator=gen))
            for _ in range(15)]
    curves = []
    for model in (theirs, ours):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for x, target in data:
            logits = model["head"](model["rnn"](x)[0])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        curves.append(np.array(losses))
    assert curves[0][-1] < curves[0][0]  # it learns
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-4)


@pytest.mark.gpu
def test_training_packs_the_weights_without_a_copy_on_cuda():
    """On CUDA the packed weights are PyTorch's as they are: pack(copy=False) (what training
    uses) lends the given memory, pack() copies."""
    module = rnncc.compile("lstm", 8, 16, 2, target="cuda", training=True)
    weights = {name: torch.randn(shape, device="cuda") for name, shape in (
        ("weight_ih_l0", (64, 8)), ("weight_hh_l0", (64, 16)), ("bias_ih_l0", (64,)),
        ("bias_hh_l0", (64,)))}
    lent = module.pack(weights, entry="sequence", copy=False)
    copied = module.pack(weights, entry="sequence")
    for packed, given in (("w_ih", "weight_ih_l0"), ("w_hh", "weight_hh_l0"),
                          ("b_ih", "bias_ih_l0")):
        assert lent.tensors[packed].data_ptr() == weights[given].data_ptr()
        assert copied.tensors[packed].data_ptr() != weights[given].data_ptr()


FIRST_STEP = """
import gc, sys
import torch
import rnncc.nn
gc.disable()
net = rnncc.nn.GRU(4, 6)
x = torch.randn(3, 2, 4, requires_grad=True)
y = net(x * 2)[0]  # x * 2: the caller's frame holds a tensor of the graph
y.sum().backward()
del y
gc.set_debug(gc.DEBUG_SAVEALL)
gc.collect()
print(sum(isinstance(o, torch.Tensor) for o in gc.garbage))
"""


def test_a_first_training_step_leaves_no_autograd_graph_in_reference_cycles(tmp_path):
    """The first training step of a process, which compiles its modules and, in a second
    process, loads them from the disk cache: what runs the first time (imports, TVMScript's
    parser) keeps the caller's frames in reference cycles; rnncc collects them, or the step's
    autograd graph lives on to Python's next collection (its AccumulateGrad nodes, of the
    default stream, make a CUDA graph capture of the next step fail)."""
    import subprocess
    import sys

    env = {**os.environ, "RNNCC_CACHE_DIR": str(tmp_path)}
    for run in ("compiled", "loaded"):
        out = subprocess.run([sys.executable, "-c", FIRST_STEP], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["0"], (run, out.stdout)


CAPTURED_STEP = """
import torch
import rnncc.nn
net = rnncc.nn.LSTM(8, 16).cuda()
x = torch.randn(5, 3, 8, device="cuda", requires_grad=True)
net(x * 2)[0].sum().backward()  # compiles or loads the modules, on the default stream
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    net(x * 2)[0].sum().backward()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    net(x * 2)[0].sum().backward()
graph.replay()
torch.cuda.synchronize()
print("captured")
"""


@pytest.mark.gpu
def test_a_training_step_is_captured_after_a_first_one_that_loaded_its_modules(tmp_path):
    """On the GPU, in a process that compiles the modules and in one that loads them from the
    disk cache: an eager training step, then one captured in a CUDA graph (the capture refused
    a step while the first one's AccumulateGrad nodes, of the default stream, lived on in
    reference cycles; H200, before 0b474e1, the second process)."""
    import subprocess
    import sys

    env = {**os.environ, "RNNCC_CACHE_DIR": str(tmp_path)}
    for run in ("compiled", "loaded"):
        out = subprocess.run([sys.executable, "-c", CAPTURED_STEP], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and out.stdout.split() == ["captured"], (run, out.stderr)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", [True, False])
def test_a_training_step_runs_in_a_cuda_graph(exchange, monkeypatch, empty_compile_cache,
                                             no_cyclic_gc):
    """A whole training step (forward, backward, optimizer) captured in a CUDA graph and
    replayed: the same parameters as the same steps run eagerly (a bidirectional network: the
    reverse direction on a stream of its own, in the capture too); also with rnncc taking
    torch's tensors through ``__dlpack__`` as where torch.Tensor has no C exchange API for
    DLPack (it must not make the legacy stream wait: the capture refuses that). A first
    eager step on the default stream compiles the modules, with Python's cyclic collector
    off: nothing of the compile may keep that step's autograd graph alive (its AccumulateGrad
    nodes, of the default stream, which the capture then refuses)."""
    if not exchange:
        monkeypatch.setattr("rnncc.runtime.arrays.EXCHANGE_API", "no_such_attribute")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    nets = [rnncc.nn.GRU(16, 32, num_layers=2, bidirectional=True).cuda() for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
    xs = [torch.randn(12, 5, 16, device="cuda") for _ in range(4)]
    static_x = xs[0].clone()

    def step(net, opt, x):
        opt.zero_grad(set_to_none=False)
        y, _ = net(x)
        y.square().mean().backward()
        opt.step()

    saved = {k: v.clone() for k, v in nets[1].state_dict().items()}
    step(nets[1], opts[1], static_x)  # compiles the modules; its update undone
    nets[1].load_state_dict(saved)
    for x in xs:  # eager
        step(nets[0], opts[0], x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (grads allocated), then undo its update
        step(nets[1], opts[1], static_x)
        nets[1].load_state_dict(saved)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(nets[1], opts[1], static_x)
    nets[1].load_state_dict(saved)  # the capture does not run the step
    for x in xs:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert _err(b.detach().cpu(), a.detach().cpu().double().numpy()) < 1e-5, name
