"""The GRU that resets before its recurrent product (a step that takes a gate's recurrent
product of one of its values, ``ops.recurrent``): Keras' equations, the errors of a cell that
takes such products wrongly, and where it runs. Its numbers through every schedule, training
included, come from the registry-wide tests."""

import pytest

import rnncc
from conftest import has_nvcc
from helpers import check_across_steps, check_repeats_exactly, compiled
from rnncc import cells
from rnncc.cells import ops
from rnncc.errors import CellError, ConfigError


def _keras(x, h0, lengths, w):
    """Keras' GRU with reset_after=False in torch float64, from its documented equations: its
    kernels [C, 3H] and [H, 3H] stack z, r, h; one bias [3H]. Samples stop at their lengths
    (their h held, their outputs zero)."""
    import torch

    kz, kr, kh = w["kernel"].chunk(3, 1)
    uz, ur, uh = w["recurrent_kernel"].chunk(3, 1)
    bz, br, bh = w["bias"].chunk(3)
    h, ys = h0, []
    for t, x_t in enumerate(x):
        z = torch.sigmoid(x_t @ kz + h @ uz + bz)
        r = torch.sigmoid(x_t @ kr + h @ ur + br)
        new = z * h + (1 - z) * torch.tanh(x_t @ kh + (r * h) @ uh + bh)
        live = (t < lengths)[:, None]
        h = torch.where(live, new, h)
        ys.append(torch.where(live, h, torch.zeros_like(h)))
    return torch.stack(ys), h


def _as_keras(p, hidden, suffix=""):
    """Keras' weights of a direction of a layer-0 module's parameters ``p`` (ours stack r, z,
    n; the two biases are Keras' one)."""
    import torch

    def reorder(stacked):
        r, z, n = stacked.split(hidden, 0)
        return torch.cat([z, r, n], 0)

    return {"kernel": reorder(p[f"weight_ih_l0{suffix}"]).T,
            "recurrent_kernel": reorder(p[f"weight_hh_l0{suffix}"]).T,
            "bias": reorder(p[f"bias_ih_l0{suffix}"] + p[f"bias_hh_l0{suffix}"])}


@pytest.mark.parametrize("device, hidden, batch, steps, dtype", [
    ("cpu", 33, 3, 7, "float32"), ("cpu", 1, 1, 1, "float32"),
    pytest.param("cuda", 257, 6, 37, "float32", marks=pytest.mark.gpu),
    pytest.param("cuda", 1024, 4, 100, "float32", marks=pytest.mark.gpu),
    pytest.param("cuda", 512, 64, 30, "float16", marks=pytest.mark.gpu),
    pytest.param("cuda", 256, 13, 30, "bfloat16", marks=pytest.mark.gpu)])
def test_gru_reset_before_is_keras_reset_after_false_and_trains(device, hidden, batch, steps,
                                                                  dtype):
    """rnncc.nn against Keras' equations in float64 (from the same rounded inputs), two
    directions, unsorted lengths with a length-1 sample: outputs, final states and the
    gradients of the input, the initial state and every weight and bias (torch's autograd
    through the equations). On CUDA both recurrences run on the persistent kernels (float16
    at batch 64: the backward's on tensor cores)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    bound, grad_bound = {"float32": (1e-5, 1e-4), "float16": (2e-3, 2e-2),
                         "bfloat16": (1e-2, 5e-2)}[dtype]
    module = rnncc.nn.Recurrent("gru_reset_before", 5, hidden, bidirectional=True).to(
        device, kind)
    x = torch.randn(steps, batch, 5, device=device, dtype=kind, requires_grad=True)
    h0 = torch.randn(2, batch, hidden, device=device, dtype=kind, requires_grad=True)
    lengths = torch.tensor([steps, 1, max(1, steps - 2)] + [steps - 1] * (batch - 3))[:batch]
    y, h_n = module(x, h0, lengths=lengths)
    dy, dh = torch.randn_like(y), torch.randn_like(h_n)
    (y * dy).sum().add((h_n * dh).sum()).backward()

    p = {k: v.detach().cpu().double().requires_grad_() for k, v in module.named_parameters()}
    x64, h64 = (v.detach().cpu().double().requires_grad_() for v in (x, h0))
    forward, h_f = _keras(x64, h64[0], lengths, _as_keras(p, hidden))
    t = torch.arange(steps)[:, None]  # each sample's own steps reversed (the rest in place)
    own = torch.where(t < lengths, lengths - 1 - t, t)
    columns = torch.arange(batch)[None, :]
    back, h_b = _keras(x64[own, columns], h64[1], lengths, _as_keras(p, hidden, "_reverse"))
    back = back[own, columns]
    ref, ref_n = torch.cat([forward, back], 2), torch.stack([h_f, h_b])
    (ref * dy.cpu().double()).sum().add((ref_n * dh.cpu().double()).sum()).backward()

    def err(a, b):
        return float((a.detach().cpu().double() - b.detach()).norm() / b.detach().norm())

    assert err(y, ref) < bound and err(h_n, ref_n) < bound
    assert err(x.grad, x64.grad) < grad_bound and err(h0.grad, h64.grad) < grad_bound
    for name, param in module.named_parameters():
        assert err(param.grad, p[name].grad) < grad_bound, name


def _cell(name, step):
    return cells.Cell(name, 3, ("h",), step, lambda gi, gh, s, recurrent: s)


@pytest.mark.parametrize("step, message", [
    (lambda gi, gh, s: (ops.recurrent(3, s[0]),), "ops.recurrent of gate 3; the cell has gates "
                                                  "0 to 2"),
    (lambda gi, gh, s: (ops.recurrent(1, s[0]) + ops.recurrent(1, gi[0]),),
     "takes gate 1's recurrent product .ops.recurrent. more than once"),
    (lambda gi, gh, s: (ops.recurrent(0, s[0]) + gh[0],),
     "takes gate 0's recurrent product of a value .ops.recurrent. and also uses gh.0."),
    (lambda gi, gh, s: (ops.recurrent(0, 1.0),), "takes one value of the step for x"),
    (lambda gi, gh, s: (ops.recurrent("n", s[0]),), "gate is the gate's index, an int; got 'n'"),
])
def test_a_step_that_takes_products_wrongly_is_refused(step, message):
    with pytest.raises(CellError, match=message):
        cells.register(_cell("bad_products", step))
    assert "bad_products" not in cells.names()


@pytest.mark.slow
@pytest.mark.skipif(not has_nvcc(), reason="nvcc not found")
def test_persistent_kernels_take_a_product_in_training():
    """A training module of a cell with a product of a value: the forward and the backward
    recurrence on persistent kernels."""
    module = rnncc.compile("gru_reset_before", 8, 16, 2, target="cuda", persistent="on",
                           training=True)
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent"
    functions = module.metadata["functions"]
    assert {"persistent_train_forward", "persistent_backward"} <= set(functions)
    assert "plan" in schedule["persistent_backward"]


def test_persistent_kernel_takes_a_product_one_layer_a_module_and_says_why():
    with pytest.raises(ConfigError, match="cell 'gru_reset_before' takes 1 recurrent "
                                          "product.s. of values of its step .ops.recurrent.; "
                                          "the persistent kernel takes one, one layer a module"):
        rnncc.compile("gru_reset_before", 8, 8, 1, target="cuda", layers=2)


def test_persistent_kernel_refuses_means_beside_a_product_and_says_why():
    cell = _cell("means_and_product", lambda gi, gh, s: (
        ops.tanh(gi[0] + ops.recurrent(2, s[0]) + ops.mean(gh[0])),))
    with pytest.raises(ConfigError, match="cell 'means_and_product' takes means and a "
                                          "recurrent product of a value; the persistent "
                                          "kernel takes one or the other"):
        rnncc.compile(cell, 8, 8, 1, persistent="on")


@pytest.mark.skipif(not has_nvcc(), reason="nvcc not found")
def test_cuda_product_is_a_gemm_between_two_point_wise_kernels():
    """The step's value that the product takes (a point-wise kernel up to it), the product (a
    GEMM of the GEMM rules, by the gate's rows of W_hh, forward; by them transposed, backward)
    and the rest of the step."""
    module = compiled("gru_reset_before", 24, 256, 3, "cuda", training=True)
    rules = module.metadata["schedule"]["rules"]
    assert rules["product_argument2"] == rules["cell_step"] == "cuda.elementwise"
    assert rules["product_backward2"] == rules["cell_backward"] == "cuda.elementwise"
    gemms = {rules[key] for key in ("recurrent_gemm", "recurrent_gemm_backward")}
    assert {rules["product_gemm"], rules["product_gemm_backward"]} <= gemms


@pytest.mark.gpu
@pytest.mark.parametrize("input_size, hidden, batch, knobs", [
    (33, 257, 6, None), (1024, 1024, 1, None), (1024, 1024, 4, None),
    (7, 33, 4, {"batch_groups": 2, "sync": "barrier"}), (16, 64, 3, {"sync": "grid"}),
    (1028, 1024, 4, {"input_steps": 5})])
def test_persistent_kernel_takes_the_product_and_repeats_exactly(input_size, hidden, batch,
                                                                  knobs, rng):
    """On the GPU: the persistent kernel of the GRU that resets before its product (the value
    r * h exchanged tagged, or plain behind a second round of the counter barrier or the grid
    sync), against float64 with lengths, T = 1, 37 and 100, the same outputs run after run."""
    module = rnncc.compile("gru_reset_before", input_size, hidden, batch, target="cuda",
                           tuning="off", knobs=knobs, persistent="on", lengths=True)
    assert module.metadata["schedule"]["kind"] == "persistent"
    check_across_steps(module, rng, lengths=True)
    check_repeats_exactly(module, rng)
