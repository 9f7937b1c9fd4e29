"""The layer-normalised cells (a step that reduces over the hidden units, ``ops.mean``):
haste's definitions, initial values, and where they run. Their numbers through every schedule,
training included, come from the registry-wide tests."""

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc
from helpers import check_across_steps, check_repeats_exactly
from rnncc.cells import ops
from rnncc.errors import CellError, ConfigError


def _haste(kind, x, weights, hidden):
    """haste's LayerNormLSTM / LayerNormGRU forward in torch float64 (its gates stacked i, g,
    f, o and z, r, n), from its documented equations; ``weights`` in haste's names."""
    import torch
    import torch.nn.functional as F

    def norm(v, gain):
        return F.layer_norm(v, (v.shape[-1],), weight=gain)

    w = weights
    h = torch.zeros(x.shape[1], hidden, dtype=torch.float64)
    c = torch.zeros_like(h)
    ys = []
    for x_t in x:
        if kind == "lstm":
            v = norm(x_t @ w["kernel"], w["gamma"][0]) + norm(h @ w["recurrent_kernel"],
                                                               w["gamma"][1]) + w["bias"]
            i, g, f, o = v.chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(
                F.layer_norm(c, (hidden,), weight=w["gamma_h"], bias=w["beta_h"]))
        else:
            vx = (norm(x_t @ w["kernel"], w["gamma"][0]) + w["bias"]).chunk(3, 1)
            vh = (norm(h @ w["recurrent_kernel"], w["gamma"][1]) + w["recurrent_bias"]).chunk(3, 1)
            z, r = torch.sigmoid(vx[0] + vh[0]), torch.sigmoid(vx[1] + vh[1])
            h = z * h + (1 - z) * torch.tanh(vx[2] + r * vh[2])
        ys.append(h)
    return torch.stack(ys)


def _as_haste(kind, module):
    """haste's weights of ``module`` (rnncc.nn, layer 0): gates in haste's order."""
    import torch

    p = {k: v.detach().cpu().double() for k, v in module.named_parameters()}
    ours = "ifgo" if kind == "lstm" else "rzn"
    theirs = "igfo" if kind == "lstm" else "zrn"
    hidden = module.hidden_size

    def reorder(stacked):  # [G*H, ...] in our gate order to haste's
        blocks = stacked.split(hidden, 0)
        return torch.cat([blocks[ours.index(q)] for q in theirs], 0)

    def gates(name):
        return torch.cat([p[f"{name}_{q}_l0"] for q in theirs])

    w = {"kernel": reorder(p["weight_ih_l0"]).T, "recurrent_kernel": reorder(p["weight_hh_l0"]).T,
         "gamma": torch.stack([gates("gamma_ih"), gates("gamma_hh")])}
    if kind == "lstm":
        w.update(bias=gates("beta"), gamma_h=p["gamma_c_l0"], beta_h=p["beta_c_l0"])
    else:
        w.update(bias=gates("beta_ih"), recurrent_bias=gates("beta_hh"))
    return w


@pytest.mark.parametrize("kind", [pytest.param("lstm", marks=pytest.mark.slow), "gru"])
@pytest.mark.parametrize("device, hidden, batch, steps", [
    ("cpu", 33, 3, 9), pytest.param("cuda", 1024, 4, 20, marks=pytest.mark.gpu)])
def test_layer_norm_cells_are_haste_without_the_projections_biases(kind, device, hidden, batch,
                                                                    steps):
    """ln_lstm / ln_gru with bias=False against haste's equations in float64 (its gate order),
    the parameters made random (not their initial ones): y and x's gradient (through every
    step's dh; the weights' gradients: test_training, test_projection)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = rnncc.nn.Recurrent(f"ln_{kind}", 5, hidden, bias=False)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1.0, 1.0)
    module = module.to(device)
    x = torch.randn(steps, batch, 5, device=device, requires_grad=True)
    y, _ = module(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = _haste(kind, x64, _as_haste(kind, module), hidden)
    ref.backward(dy.cpu().double())

    def err(a, b):
        return float((a.detach().cpu().double() - b.detach()).norm() / b.detach().norm())

    assert err(y, ref) < 1e-5 and err(x.grad, x64.grad) < 1e-4


@pytest.mark.parametrize("cell", ["ln_lstm", "ln_gru"])
def test_initial_gains_one_and_biases_as_haste(cell):
    module = rnncc.nn.Recurrent(cell, 4, 6, num_layers=2, bidirectional=True)
    for name, p in module.named_parameters():
        base = name.rsplit("_l", 1)[0]
        if base.startswith(("gamma", "beta")):
            expected = 1.0 if base.startswith("gamma") or base == "beta_f" else 0.0
            assert bool((p == expected).all()), name
        else:  # the weights and the projections' biases as torch's
            assert 0 < float(p.detach().abs().max()) <= 1 / np.sqrt(6), name


@pytest.mark.slow
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_persistent_kernel_takes_means_in_the_training_forward_not_the_backward():
    """A training module of a cell with means: the forward on the persistent kernel, the
    backward on per-step kernels, and its metadata says why."""
    module = rnncc.compile("ln_lstm", 8, 16, 2, target="cuda", persistent="on", training=True)
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent"
    assert "persistent_train_forward" in module.metadata["functions"]
    assert "takes means over the hidden units (ops.mean): the persistent backward kernel " \
           "does not take them" in schedule["persistent_backward"]["reason"]


def test_persistent_kernel_takes_means_one_layer_a_module_and_says_why():
    with pytest.raises(ConfigError, match="cell 'ln_lstm' takes means over the hidden units "
                                          ".ops.mean.; the persistent kernel takes them one "
                                          "layer a module; run its layers as modules of one"):
        rnncc.compile("ln_lstm", 8, 8, 2, target="cuda", layers=2)


def test_a_layer_norms_variance_is_taken_in_its_means_round():
    """The persistent kernel's rounds (:func:`one_round_levels`): a layer norm's variance in
    its mean's level, flagged where a unit normalises one value (LN-LSTM's c); a variance
    written out by hand (a mean of squares about a mean) is a level of its own."""
    from rnncc.cells._base import Cell
    from rnncc.cells.autodiff import mean_levels, one_round_levels

    assert one_round_levels(rnncc.cells.get("ln_lstm")) == (
        [[0, 1, 2, 3], [4, 5]], {1: (0, False), 3: (2, False), 5: (4, True)})
    assert mean_levels(rnncc.cells.get("ln_lstm")) == [[0, 2], [1, 3], [4], [5]]
    assert one_round_levels(rnncc.cells.get("ln_gru")) == (
        [[0, 1, 2, 3]], {1: (0, False), 3: (2, False)})
    assert one_round_levels(rnncc.cells.get("lstm")) == ([], {})

    def step(gi, gh, state):
        v = gi[0] + gh[0]
        mu = ops.mean(v)
        return (v - mu) * ops.rsqrt(ops.mean((v - mu) * (v - mu)) + 1e-5),

    by_hand = Cell(name="by_hand", gates=1, states=("h",), step=step,
                   reference=lambda *a: None, params=())
    assert one_round_levels(by_hand) == ([[0], [1]], {})


@pytest.mark.parametrize("cell, hidden, batch, knobs, partials", [
    ("ln_gru", 512, 1, {}, True), ("ln_lstm", 320, 1, {}, True), ("ln_lstm", 1024, 1, {}, True),
    ("ln_gru", 512, 4, {}, True),  # 4 batch groups of one row each, 512 words a round
    ("ln_lstm", 256, 1, {}, False),  # 256 words: one load a thread of 8 warps
    ("ln_gru", 256, 8, {}, False),  # 8 groups of one row
    ("ln_gru", 1024, 8, {}, False),  # behind the counter barrier
    ("ln_gru", 512, 1, {"mean_partials": False}, False), ("lstm", 1024, 1, {}, False),
    ("ln_gru", 256, 1, {"mean_partials": True}, True)])
def test_a_step_exchanges_its_means_as_block_sums_where_a_round_takes_many_loads(
        cell, hidden, batch, knobs, partials):
    """The planner's default for ``mean_partials`` (:func:`block_sums`): on with the tagged
    exchange where a batch group's round is more words than the block's threads, off where it
    is one load a thread, behind the barrier and for cells without means; a knob decides."""
    from rnncc.schedules.persistent.knobs import plan_for
    from rnncc.schedules.persistent.planner import REG_MARGIN, gpu_for_arch
    from rnncc.spec import Problem

    found = plan_for(Problem(rnncc.cells.get(cell), hidden, hidden, batch),
                     gpu_for_arch("sm_90", 132), knobs, REG_MARGIN)
    assert found.mean_partials is partials
    words = batch // found.batch_groups * hidden
    if not knobs and cell != "lstm":
        assert partials is (found.sync == "tagged" and words > found.threads)


@pytest.mark.slow
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_a_plan_that_spills_with_its_units_means_is_built_with_the_blocks_sums():
    """LN-GRU 1024 at batch 16 behind the counter barrier spills (ptxas) with the means
    exchanged as its units' values; the driver builds it with them as each block's sums, no
    spill, and says so; a knob that fixes them is kept (then the sequence schedule)."""
    from rnncc.compiler.cuda_binary import cooperative_kernels

    module = rnncc.compile("ln_gru", 1024, 1024, 16, target="cuda", arch="sm_90",
                           tuning="off")
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent"
    assert schedule["persistent"]["plan"]["mean_partials"] is True
    assert any("planned with them as each block's sums" in n for n in schedule["notes"])
    ptxas = module.metadata["ptxas"]
    kernels = cooperative_kernels(module.source("cuda"))
    assert kernels and not any(ptxas[k]["stack"] or ptxas[k]["spill_stores"] for k in kernels)
    kept = rnncc.compile("ln_gru", 1024, 1024, 16, target="cuda", arch="sm_90", tuning="off",
                         knobs={"mean_partials": False})
    assert kept.metadata["schedule"]["kind"] == "sequence"


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_layers_of_a_step_that_reduces_run_one_after_another():
    """No wavefront of layers that take means: a persistent kernel a layer."""
    net = rnncc.compile_network("ln_gru", 16, 16, 2, layers=2, target="cuda")
    assert [s.kind for s in net.stages] == ["layer", "layer"]
    assert all(s.module.metadata["schedule"]["kind"] == "persistent" for s in net.stages)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["ln_lstm", "ln_gru"])
@pytest.mark.parametrize("input_size, hidden, batch, knobs", [
    (33, 257, 6, None), (1024, 1024, 1, None), (1024, 1024, 4, None),
    (7, 33, 4, {"batch_groups": 2, "sync": "barrier"}), (16, 64, 3, {"sync": "grid"}),
    (1028, 1024, 4, {"input_steps": 5}), (64, 1024, 4, {"mma": True, "dtype": "float16"}),
    (1024, 1024, 1, {"mean_partials": False}), (33, 257, 6, {"mean_partials": True}),
    (512, 512, 8, {"mean_partials": True})])
def test_persistent_kernel_takes_means_and_repeats_exactly(cell, input_size, hidden, batch,
                                                           knobs, rng):
    """On the GPU: the persistent kernel of the layer-normalised cells (a level of means a
    round, a layer norm's variance in its mean's: the arguments exchanged tagged, or plain
    behind a round of the counter barrier or the grid sync, and summed over the row by every
    block), against float64 with lengths, T = 1, 37 and 100, the same outputs run after
    run."""
    knobs = dict(knobs or {})
    dtype = knobs.pop("dtype", "float32")
    if knobs.get("mma") and cell == "ln_gru":
        pytest.skip("tensor cores take 8 rows a warp: GRU's 3 gates of a block's units do "
                    "not make them at this size (ln_lstm's do)")
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           tuning="off", knobs=knobs, persistent="on", lengths=True)
    assert module.metadata["schedule"]["kind"] == "persistent"
    check_across_steps(module, rng, lengths=True)
    check_repeats_exactly(module, rng)


def test_reductions_given_what_they_do_not_take():
    from tvm import tirx

    v = tirx.Var("v", "float32")
    with pytest.raises(CellError, match="does not reduce over the hidden units"):
        ops.mean(v)
    with pytest.raises(CellError, match="takes one value of the step .* got a list of 2"):
        ops.mean([v, v])
    for bad in ([], v):
        with pytest.raises(CellError, match="layer_norm takes a non-empty list"):
            ops.layer_norm(bad)
