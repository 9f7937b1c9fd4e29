"""Stacked layers as a wavefront (``layers=L``): one persistent launch, one grid a layer, layer
l > 0 reading layer l - 1's outputs as they are written. Planning and refusals here; the
kernels' numbers on the GPU machine (``--gpu``)."""

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc
from helpers import check_across_steps, check_repeats_exactly, compiled, persistent_cells
from rnncc import reference
from rnncc.errors import ConfigError, InputError
from rnncc.schedules.persistent import knobs, planner
from rnncc.spec import Problem

H200 = planner.gpu_for_arch("sm_90")


def _plan(cell, hidden, batch, layers):
    problem = Problem(rnncc.cells.get(cell), hidden, hidden, batch, layers=layers)
    return knobs.plan_for(problem, H200, {}, planner.REG_MARGIN)


@pytest.mark.parametrize("layers", [2, 3, 4])
def test_each_layer_is_planned_on_its_share_of_the_gpu(layers):
    plan = _plan("lstm", 512, 1, layers)
    alone = _plan("lstm", 512, 1, 1)
    assert plan.layers == layers and plan.blocks <= H200.sms
    assert plan.blocks // layers <= H200.sms // layers
    assert plan.input_steps == 4 and plan.input_rows == 4  # the layer above waits least
    assert plan.blocks == layers * plan.group_blocks * plan.batch_groups
    assert alone.layers == 1 and alone.blocks <= H200.sms


def test_tagged_loads_are_relaxed_where_the_blocks_read_their_own_projections():
    assert _plan("lstm", 512, 1, 2).tagged_loads == "relaxed"
    assert _plan("lstm", 512, 1, 1).tagged_loads == "acquire"  # the separate GEMM's xp


def test_wavefront_steps_keep_the_groups_small():
    assert planner.wavefront_steps(1) == [4]
    assert planner.wavefront_steps(4) == [4, 3, 2, 1]
    assert planner.wavefront_steps(16)[:2] == [2, 1]
    assert all(s * 3 % 4 == 0 for s in planner.wavefront_steps(3))


def test_what_does_not_fit_or_is_not_a_stack_is_refused():
    with pytest.raises(ConfigError, match="input size is their hidden size"):
        Problem(rnncc.cells.get("gru"), 8, 16, 1, layers=2)
    with pytest.raises(ConfigError, match="unidirectional"):
        Problem(rnncc.cells.get("gru"), 16, 16, 1, directions=2, layers=2)
    with pytest.raises(ConfigError, match="layers must be a positive integer"):
        Problem(rnncc.cells.get("gru"), 16, 16, 1, layers=0)
    with pytest.raises(ConfigError, match="cuda target"):
        rnncc.compile("lstm", 16, 16, 1, target="llvm", layers=2)
    with pytest.raises(ConfigError, match="layers as modules of one layer each"):
        rnncc.compile("lstm", 1024, 1024, 1, arch="sm_90", layers=2, tuning="off")
    with pytest.raises(planner.Unfit, match="one direction"):
        planner.plan(4, 64, 1, "float32", H200, directions=2, layers=2)
    problem = Problem(rnncc.cells.get("lstm"), 64, 64, 1, layers=2)
    with pytest.raises(planner.Unfit, match="wavefront's layers run steps apart"):
        knobs.plan_for(problem, H200, {"sync": "grid"}, planner.REG_MARGIN)
    with pytest.raises(ConfigError, match="wavefront's layers run steps apart"):
        rnncc.compile("lstm", 64, 64, 1, arch="sm_90", layers=2, knobs={"sync": "grid"})


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc")
def test_a_wavefront_module_takes_every_layers_weights_and_states():
    module = rnncc.compile("gru", 24, 24, 3, arch="sm_90", layers=3, lengths=True,
                           tuning="off", knobs={"sync": "tagged"})
    assert module.layers == 3 and module.metadata["layers"] == 3
    assert module.weight_names == tuple(f"{w}_l{k}" for k in range(3) for w in (
        "weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    shapes = {p["name"]: p["shape"] for p in module.metadata["functions"]["persistent_forward"]}
    assert shapes["h0"] == shapes["h_n"] == [3, 3, 24] and shapes["y"] == ["T", 3, 24]
    assert "forward" not in module.metadata["functions"]  # no fallback: the wavefront only
    assert "+wavefront" in module.metadata["schedule"]["rules"]["persistent"]
    # the layers read input projections they wrote: relaxed loads of the tagged words, whose
    # acquire would have invalidated L1 every step (the progress counters stay acquire loads;
    # a layer of one block would keep h to itself, sync="local", without the knob)
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "tagged"
    source = module.source("cuda")
    assert "ld.relaxed.gpu.global.u64" in source and "ld.acquire.gpu.global.u64" not in source
    weights = {name: np.zeros((72, 24) if "weight" in name else 72, "float32")
               for name in module.weight_names}
    with pytest.raises(InputError, match="missing weight 'weight_hh_l2'"):
        module.pack({k: v for k, v in weights.items() if k != "weight_hh_l2"})
    with pytest.raises(InputError, match="unexpected weights.*3 unidirectional layers"):
        module.pack({**weights, "weight_ih_l3": weights["weight_ih_l0"]})
    with pytest.raises(InputError, match="biases of all layers or of none"):
        module.pack({k: v for k, v in weights.items() if not k.endswith("_l1")
                     or "weight" in k})


@pytest.mark.gpu
@pytest.mark.parametrize("cell", persistent_cells())
@pytest.mark.parametrize("hidden, batch, layers, lengths", [
    (33, 3, 2, False), (64, 5, 3, True), (1, 1, 2, True)])
def test_wavefront_matches_reference(cell, hidden, batch, layers, lengths, rng):
    """Every registered cell, odd sizes, T = 1, 37 and 100, lengths (a sample of 1 step, one of
    all T), against the float64 reference of the layers one after another; and bit for bit the
    same on repeated runs (a race between the layers' blocks would show)."""
    module = compiled(cell, hidden, hidden, batch, "cuda", layers=layers, lengths=lengths)
    assert module.metadata["schedule"]["kind"] == "persistent"
    check_across_steps(module, rng, lengths=lengths)
    check_repeats_exactly(module, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_wavefront_of_four_lstm_512_layers_matches_torch(batch, rng):
    """The benchmarks' size: 4 LSTM 512 layers against torch's float64 and cuDNN (TF32 off)
    with the same weights and initial states (at batch 16 a layer's share of the GPU does not
    hold its input projection: refused)."""
    torch = pytest.importorskip("torch")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    theirs = torch.nn.LSTM(512, 512, num_layers=4)
    module = compiled("lstm", 512, 512, batch, "cuda", layers=4)
    x = torch.randn(61, batch, 512)
    hx = (torch.randn(4, batch, 512), torch.randn(4, batch, 512))
    y, (h, c) = module(x.cuda(), theirs.cuda().state_dict(), h0=hx[0].cuda(), c0=hx[1].cuda())
    with torch.no_grad():
        expect = [theirs.double().cpu()(x.double(), tuple(s.double() for s in hx)),
                  theirs.float().cuda()(x.cuda(), tuple(s.cuda() for s in hx))]
    for want_y, (want_h, want_c) in expect:
        for ours, want in ((y, want_y), (h, want_h), (c, want_c)):
            assert reference.relative_error(ours.double().cpu().numpy(),
                                            want.double().cpu().numpy()) < 1e-5
    if batch == 8:
        with pytest.raises(ConfigError, match="does not fit"):
            compiled("lstm", 512, 512, 16, "cuda", layers=4)


@pytest.mark.gpu
@pytest.mark.parametrize("input_size", [512, 40])
def test_nn_runs_stacked_layers_as_a_wavefront(input_size, rng):
    """rnncc.nn takes the wavefront for the layers of input size H (all of them, or those above
    the first), with packed lengths, against torch's float64; in training, with dropout 1,
    the layers run in turn on the wavefront's fallback module, as torch's."""
    torch = pytest.importorskip("torch")
    theirs = torch.nn.LSTM(input_size, 512, num_layers=3)
    ours = rnncc.nn.from_torch(theirs).cuda()
    x = torch.randn(29, 3, input_size)
    lengths = torch.tensor(rng.integers(1, 30, 3))
    lengths[0], lengths[-1] = 29, 1
    data = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    with torch.no_grad():
        mine, (h, c) = ours(data.to("cuda"))
        want, (want_h, want_c) = theirs.double()(data.to(torch.float64))
    (network,) = ours._networks.values()
    (compiled,) = network._compiled.values()
    wave = compiled.stages[-1]
    assert wave.kind == "layers" and wave.count == wave.module.layers == 3 - (input_size != 512)
    for a, b in ((mine.data, want.data), (h, want_h), (c, want_c)):
        assert reference.relative_error(a.double().cpu().numpy(), b.numpy()) < 1e-5
    ours.dropout = theirs.dropout = 1.0  # training: dropout acts, the layers run in turn
    ours.train(), theirs.train()
    with torch.no_grad():
        mine, (h, c) = ours(data.to("cuda"))
        want, (want_h, want_c) = theirs(data.to(torch.float64))
    for a, b in ((mine.data, want.data), (h, want_h), (c, want_c)):
        assert reference.relative_error(a.double().cpu().numpy(), b.numpy()) < 1e-5
