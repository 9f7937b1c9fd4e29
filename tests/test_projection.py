"""LSTM with projections (LSTMP, torch's ``proj_size``: h = W_hr h', P wide): modules against
the float64 reference (which matches torch's), rnncc.nn against torch.nn.LSTM(proj_size=P) in
float64 with the same weights (outputs and every gradient), a layer's training entries of
every cell that takes a projection against float64 autograd, and the errors."""

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc, random_weights
from helpers import TOL, TOL_F32
from rnncc import cells, reference
from rnncc.cells import autodiff
from rnncc.compiler.cuda_binary import persistent_kernels
from rnncc.errors import ConfigError, InputError

TARGETS = ["llvm", pytest.param("cuda", marks=pytest.mark.gpu)]


def _projects(cell) -> bool:
    """Whether ``cell``'s step reads h only through W_hh (a projection needs that)."""
    graph = autodiff.trace(cell)
    return not autodiff.uses(graph, graph.inputs[2 * cell.gates])


def _weights(rng, cell, c, h, p, directions):
    out = {}
    for suffix in ("", "_reverse")[:directions]:
        w = random_weights(rng, cell.gates, c, h, "float32", cell.params)
        w["weight_hh_l0"] = (w["weight_hh_l0"][:, :p] * np.sqrt(h / p)).astype("float32")
        w["weight_hr_l0"] = (rng.uniform(-1, 1, (p, h)) / np.sqrt(h)).astype("float32")
        out.update({k + suffix: v for k, v in w.items()})
    return out


def check_projection(module, rng, steps, initial=True, lengths=False, entry=None):
    """The worst relative error of ``module`` against float64 on fresh inputs (``entry``:
    packed for that one)."""
    cell = cells.get(module.cell)
    c, h, n, p, d = (module.input_size, module.hidden_size, module.batch, module.proj_size,
                     module.directions)
    w = _weights(rng, cell, c, h, p, d)
    x = rng.standard_normal((steps, n, c)).astype("float32")
    given = ({s: rng.standard_normal((d, n, p if k == 0 else h)).astype("float32")
              for k, s in enumerate(cell.states)} if initial else {})
    ln = None
    if lengths:
        ln = rng.integers(1, steps + 1, n)
        ln[0], ln[-1] = 1, steps
    ref_y, ref_states = reference.run_module(cell, x, w, d, 1, given, ln)
    y, finals = module(x, module.pack(w, entry=entry) if entry else w,
                       **{f"{s}0": v for s, v in given.items()},
                       **({"lengths": ln} if lengths else {}))
    finals = finals if isinstance(finals, tuple) else (finals,)
    assert y.shape == (steps, n, d * p)
    errors = [reference.relative_error(np.asarray(y), ref_y)]
    errors += [reference.relative_error(np.asarray(f), ref_states[s])
               for f, s in zip(finals, cell.states)]
    return max(errors)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("hidden, proj, batch, directions, lengths", [
    (3, 1, 1, 1, False), (33, 7, 7, 1, True), (9, 4, 3, 2, True), (257, 64, 1, 1, False),
    (512, 128, 64, 1, True)])
def test_module_matches_reference(hidden, proj, batch, directions, lengths, target, rng):
    """One layer, both directions, lengths or not, T = 1, 37 and 100, with and without
    initial states. On CUDA the layer (at batch 64 where a plan fits) runs the persistent
    kernel (W_hh W_hr folded), and its non-persistent entry is checked too (batch 64: the
    recurrent product in K slices)."""
    module = rnncc.compile("lstm", 5, hidden, batch, target=target, proj_size=proj,
                           directions=directions, lengths=lengths)
    assert module.proj_size == proj and "weight_hr_l0" in module.weight_names
    persistent = module.metadata["schedule"]["kind"] == "persistent"
    assert persistent == (target == "cuda") or batch > 16
    for entry in ("persistent", "sequence") if persistent else (None,):
        for steps, initial in ((1, True), (100, True), (37, False)):
            err = check_projection(module, rng, steps, initial, lengths, entry)
            assert err < TOL_F32, f"{entry} T={steps} initial={initial}: error {err:.3e}"


@pytest.mark.skipif(not has_nvcc(), reason="the CUDA build needs nvcc")
@pytest.mark.slow  # 8-14 s a build; the GPU tests run the folded kernel
@pytest.mark.parametrize("directions", [1, 2])
def test_cuda_persistent_kernel_with_w_hh_w_hr_folded(directions):
    """Inference runs the persistent kernel on h' with W_hh W_hr packed as its matrix, both
    directions in one launch; training says why it does not."""
    module = rnncc.compile("peephole", 24, 40, 3, target="cuda", proj_size=12,
                           directions=directions)
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent"
    assert schedule["persistent"]["plan"]["directions"] == directions
    assert {"persistent_pack_w_hh", "persistent_forward", "pack_w_hr"} <= set(
        module.metadata["functions"])
    assert len(persistent_kernels(module.source("cuda"))) == 1
    other = rnncc.compile("lstm", 8, 16, 2, target="cuda", proj_size=4, training=True)
    assert ("training runs on the non-persistent schedule"
            in other.metadata["schedule"]["persistent"]["reason"])


@pytest.mark.slow
def test_cuda_build_of_a_product_in_slices():
    """At batch 64 the recurrent product (K = P) is left in K slices for the cell to add, and
    the projection (K = H) in slices for the projected state to add (no sum kernel)."""
    if not has_nvcc():
        pytest.skip("the CUDA build needs nvcc")
    module = rnncc.compile("lstm", 512, 512, 64, target="cuda", proj_size=128, tf32x3=False)
    rules = module.metadata["schedule"]["rules"]
    assert rules["recurrent_gemm_parts"] == rules["projection_gemm_parts"] == "cuda.sgemm"
    shapes = {a["name"]: a["shape"] for a in module.metadata["functions"]["forward"]}
    assert shapes["h_projected"][1:] == [64, 128] and shapes["h_projected"][0] > 1
    assert "zero_bias" not in shapes


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_storage(dtype, target, rng):
    """float16 and bfloat16 storage (float32 math; h' rounded to the storage type before its
    projection, as the input of a product is) against float64 from the same rounded inputs."""
    module = rnncc.compile("lstm", 5, 33, 3, target=target, dtype=dtype, proj_size=8,
                           lengths=True)
    cell = cells.get("lstm")
    w = {k: v.astype(dtype) for k, v in _weights(rng, cell, 5, 33, 8, 1).items()}
    x = rng.standard_normal((17, 3, 5)).astype(dtype)
    ln = np.array([17, 1, 9])
    y, (h, c) = module(x, w, lengths=ln)
    ref_y, ref = reference.run(cell, x.astype(np.float64), {
        k: v.astype(np.float64) for k, v in w.items()}, None, ln)
    for out, want in ((y, ref_y), (h, ref["h"]), (c, ref["c"])):
        assert reference.relative_error(np.asarray(out).astype(np.float64), want) < TOL[dtype]


@pytest.mark.parametrize("options", [{"fuse_pointwise": False}, {"gate_gemm": False}])
def test_schedule_options(options, rng):
    module = rnncc.compile("lstm", 4, 6, 3, target="llvm", proj_size=2, lengths=True,
                           **options)
    assert check_projection(module, rng, 9, lengths=True) < TOL_F32


@pytest.mark.parametrize("cell", cells.names())
def test_every_cell_projects_or_says_why_not(cell, rng):
    """A cell whose step reads h only through W_hh takes a projection; one that reads h
    itself (GRU, the Elman RNNs) is refused, naming the cell."""
    c = cells.get(cell)
    if not _projects(c):
        with pytest.raises(ConfigError, match=f"cell '{cell}' reads h in its step"):
            rnncc.compile(cell, 4, 6, 2, target="llvm", proj_size=3)
        return
    module = rnncc.compile(cell, 4, 6, 2, target="llvm", proj_size=3)
    assert check_projection(module, rng, 11) < TOL_F32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layers, bidirectional, batch_first", [
    (1, False, False), (2, True, False), (3, False, True)])
def test_rnncc_nn_matches_torch(layers, bidirectional, batch_first, device, module_cache):
    """rnncc.nn.LSTM(proj_size=P) from torch.nn.LSTM(proj_size=P) (its state_dict), against
    torch in float64: padded with initial states, and packed with unequal lengths (unsorted,
    a length-1 sample)."""
    torch = pytest.importorskip("torch")
    import rnncc.nn

    torch.manual_seed(0)
    theirs = torch.nn.LSTM(5, 9, num_layers=layers, bidirectional=bidirectional, proj_size=4,
                           batch_first=batch_first)
    ours = rnncc.nn.from_torch(theirs).to(device)
    assert ours.proj_size == 4 and tuple(ours.weight_hr_l0.shape) == (4, 9)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    theirs = theirs.double()
    d = 2 if bidirectional else 1
    x = torch.randn((3, 6, 5) if batch_first else (6, 3, 5))
    h0, c0 = torch.randn(layers * d, 3, 4), torch.randn(layers * d, 3, 9)
    lengths = torch.tensor([6, 1, 4])
    with torch.no_grad():
        y, (h, c) = ours(x.to(device), (h0.to(device), c0.to(device)))
        ry, (rh, rc) = theirs(x.double(), (h0.double(), c0.double()))
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first,
                                                         enforce_sorted=False)
        py, (ph, pc) = ours(packed.to(device))
        rpy, (rph, rpc) = theirs(torch.nn.utils.rnn.pack_padded_sequence(
            x.double(), lengths, batch_first=batch_first, enforce_sorted=False))
    for a, b in ((y, ry), (h, rh), (c, rc), (py.data, rpy.data), (ph, rph), (pc, rpc)):
        assert a.shape == b.shape
        assert reference.relative_error(a.cpu().numpy(), b.numpy()) < TOL_F32


def test_errors_name_the_problem(rng):
    torch = pytest.importorskip("torch")
    import rnncc.nn

    with pytest.raises(ConfigError, match="proj_size=6 must be below hidden_size=6"):
        rnncc.compile("lstm", 4, 6, 2, target="llvm", proj_size=6)
    with pytest.raises(ConfigError, match="proj_size must be an int >= 0"):
        rnncc.compile("lstm", 4, 6, 2, target="llvm", proj_size=-1)
    with pytest.raises(ConfigError, match="cell 'gru' reads h"):
        rnncc.nn.GRU(4, 6, proj_size=2)
    module = rnncc.compile("lstm", 4, 6, 2, target="llvm", proj_size=2)
    w = _weights(rng, cells.get("lstm"), 4, 6, 2, 1)
    x = np.zeros((3, 2, 4), "float32")
    with pytest.raises(InputError, match="missing weight 'weight_hr_l0'"):
        module(x, {k: v for k, v in w.items() if k != "weight_hr_l0"})
    with pytest.raises(InputError, match="h0"):
        module(x, w, h0=np.zeros((1, 2, 6), "float32"))
    net = rnncc.nn.LSTM(4, 6, proj_size=2)
    with pytest.raises(InputError, match=r"hx's h has shape \[1, 2, 6\], expected \[1, 2, 2\]"):
        net(torch.zeros(3, 2, 4), (torch.zeros(1, 2, 6), torch.zeros(1, 2, 6)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, True)])
def test_rnncc_nn_gradients_match_torch(layers, bidirectional, device, module_cache):
    """Every gradient (input, initial states, each weight, W_hr's included) of
    rnncc.nn.LSTM(proj_size=P) against torch.nn.LSTM(proj_size=P)'s in float64, packed with
    unequal lengths (a length-1 sample), all final states in the loss."""
    torch = pytest.importorskip("torch")
    import rnncc.nn

    torch.manual_seed(1)
    theirs = torch.nn.LSTM(5, 9, num_layers=layers, bidirectional=bidirectional, proj_size=4)
    ours = rnncc.nn.from_torch(theirs).to(device)
    theirs = theirs.double()
    d = 2 if bidirectional else 1
    x, lengths = torch.randn(7, 3, 5), torch.tensor([7, 1, 5])
    h0, c0 = torch.randn(layers * d, 3, 4), torch.randn(layers * d, 3, 9)
    dy, dh, dc = torch.randn(7, 3, 4 * d), torch.randn(layers * d, 3, 4), torch.randn(
        layers * d, 3, 9)
    grads = []
    for net, dtype, where in ((ours, torch.float32, device), (theirs, torch.float64, "cpu")):
        leaves = [v.to(where, dtype, copy=True).requires_grad_() for v in (x, h0, c0)]
        packed = torch.nn.utils.rnn.pack_padded_sequence(leaves[0], lengths,
                                                         enforce_sorted=False)
        out, (h, c) = net(packed, tuple(leaves[1:]))
        y = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=7)[0]
        loss = sum((a * b.to(where, dtype)).sum() for a, b in ((y, dy), (h, dh), (c, dc)))
        loss.backward()
        grads.append([v.grad for v in leaves] + [p.grad for _, p in net.named_parameters()])
    for name, a, b in zip(["x", "h0", "c0", *dict(theirs.named_parameters())], *grads):
        assert reference.relative_error(a.cpu().numpy(), b.numpy()) < 1e-4, name


@pytest.mark.parametrize("cell", [c for c in cells.names() if _projects(cells.get(c))])
@pytest.mark.parametrize("lengths", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_layer_gradients_of_every_projecting_cell(cell, lengths, rng):
    """Module.train_forward / backward with a projection against float64 autograd of the
    layer written out in torch from the cell's NumPy reference's equations: the reference's
    y, and central differences of its loss for each weight (a few elements each)."""
    c = cells.get(cell)
    h, p, n, steps = 5, 2, 3, 4
    module = rnncc.compile(cell, 3, h, n, target="llvm", proj_size=p, training=True,
                           lengths=lengths)
    w = {k: v.astype(np.float64) for k, v in _weights(rng, c, 3, h, p, 1).items()}
    x = rng.standard_normal((steps, n, 3))
    initial = {s: rng.standard_normal((1, n, p if k == 0 else h))
               for k, s in enumerate(c.states)}
    ln = np.array([steps, 1, 3]) if lengths else None
    dy = rng.standard_normal((steps, n, p))
    d_final = {s: rng.standard_normal(v.shape) for s, v in initial.items()}

    def loss(weights, given):
        y, finals = reference.run(c, x, weights, given, ln)
        return float((y * dy).sum() + sum((finals[s] * d_final[s]).sum() for s in c.states))

    f32 = {k: v.astype(np.float32) for k, v in w.items()}
    extra = {"lengths": ln} if lengths else {}
    y, _, kept = module.train_forward(x.astype(np.float32), f32, **extra, **{
        f"{s}0": v.astype(np.float32) for s, v in initial.items()})
    assert reference.relative_error(y, reference.run(c, x, w, initial, ln)[0]) < TOL_F32
    grads = module.backward(x.astype(np.float32), f32, kept, dy.astype(np.float32), tuple(
        d_final[s].astype(np.float32) for s in c.states), **extra)
    for name, value in [*w.items(), *((f"{s}0", v) for s, v in initial.items())]:
        numeric = np.zeros_like(value)
        for idx in list(np.ndindex(value.shape))[:6]:
            up = {k: v.copy() for k, v in (w if name in w else initial).items()}
            down = {k: v.copy() for k, v in up.items()}
            key = name if name in w else name[:-1]
            up[key][idx] += 1e-6
            down[key][idx] -= 1e-6
            args = ((up, initial), (down, initial)) if name in w else ((w, up), (w, down))
            numeric[idx] = (loss(*args[0]) - loss(*args[1])) / 2e-6
        picked = tuple(np.array(list(np.ndindex(value.shape))[:6]).T)
        assert reference.relative_error(grads[name][picked], numeric[picked]) < 1e-4, name


@pytest.mark.gpu
def test_cuda_training_of_a_projected_layer_with_its_products_in_slices(rng):
    """Batch 40 on CUDA: the training forward's projection left in slices of K for the
    projected state to add (cuda.sgemm): y against float64, every gradient against the CPU
    build's (itself checked against central differences above); outputs poisoned."""
    c, h, p, n, steps = cells.get("lstm"), 256, 64, 40, 9
    cuda = rnncc.compile("lstm", 48, h, n, target="cuda", proj_size=p, training=True)
    assert cuda.metadata["schedule"]["rules"]["projection_gemm_parts"] == "cuda.sgemm"
    cpu = rnncc.compile("lstm", 48, h, n, target="llvm", proj_size=p, training=True)
    w = {k: v.astype(np.float64) for k, v in _weights(rng, c, 48, h, p, 1).items()}
    x = rng.standard_normal((steps, n, 48))
    initial = {"h": rng.standard_normal((1, n, p)), "c": rng.standard_normal((1, n, h))}
    f32 = {k: v.astype(np.float32) for k, v in w.items()}
    given = {f"{s}0": v.astype(np.float32) for s, v in initial.items()}
    dy = rng.standard_normal((steps, n, p)).astype(np.float32)
    d_final = tuple(rng.standard_normal(v.shape).astype(np.float32) for v in initial.values())
    grads = []
    for module in (cuda, cpu):
        y, _, kept = module.train_forward(x.astype(np.float32), f32, **given)
        assert reference.relative_error(y, reference.run(c, x, w, initial)[0]) < TOL_F32
        grads.append(module.backward(x.astype(np.float32), f32, kept, dy, d_final))
    for name, value in grads[1].items():
        assert reference.relative_error(grads[0][name], value) < 1e-5, name


def test_network_file_of_projected_layers(tmp_path, rng):
    """``compile_network(..., proj_size=P)``: 2 bidirectional layers (the second takes 2*P
    inputs) against the float64 reference layer by layer, written to a network file and
    loaded back (``rnncc.load``) with the same results."""
    net = rnncc.compile_network("lstm", 5, 9, 3, layers=2, directions=2, target="llvm",
                                proj_size=4, lengths=True)
    assert [s.module.input_size for s in net.stages] == [5, 8]
    weights, x = {}, rng.standard_normal((6, 3, 5)).astype("float32")
    lengths = np.array([6, 1, 4])
    want = x.astype(np.float64)
    for layer, width in enumerate((5, 8)):
        own = _weights(rng, cells.get("lstm"), width, 9, 4, 2)
        weights.update({k.replace("_l0", f"_l{layer}"): v for k, v in own.items()})
        want, finals = reference.run_bidirectional(cells.get("lstm"), want, own, None, lengths)
    y, (h, c) = net(x, weights, lengths=lengths)
    assert y.shape == (6, 3, 8) and h.shape == (4, 3, 4) and c.shape == (4, 3, 9)
    assert reference.relative_error(y, want) < TOL_F32
    assert reference.relative_error(h[2:], finals["h"]) < TOL_F32
    path = net.export(str(tmp_path / "lstmp.rnet"))
    again = rnncc.load(path)
    np.testing.assert_array_equal(again(x, weights, lengths=lengths)[0], y)
