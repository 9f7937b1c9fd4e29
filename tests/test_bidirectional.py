"""Bidirectional layer modules (``directions=2``): both directions in one module, the reverse
one from each sample's own last step, laid out as torch's ``bidirectional=True``."""

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc, random_weights
from helpers import TOL_F32, check_across_steps, check_against_reference, compiled
from rnncc import reference
from rnncc.errors import ConfigError, InputError


@pytest.mark.parametrize("cell, lengths", [
    pytest.param(c, ln, marks=[] if ln or c in ("lstm", "gru") else [pytest.mark.slow])
    for c in rnncc.cells.names() for ln in (False, True)])
def test_bidirectional_matches_reference(cell, lengths, rng):
    """Every registered cell, T = 1, 37 and 100, with and without initial states, with lengths
    (a sample of 1 step, one of all T); without them only LSTM and GRU by default."""
    module = compiled(cell, 5, 9, 3, "llvm", lengths=lengths, directions=2)
    assert module.directions == 2 and module.metadata["directions"] == 2
    check_across_steps(module, rng, lengths=lengths)


@pytest.mark.parametrize("options", [{"fuse_pointwise": False}, {"gate_gemm": False},
                                     {"input_gemm": False}])
@pytest.mark.parametrize("hidden, batch", [(1, 1), (33, 7)])
def test_bidirectional_every_schedule_option(options, hidden, batch, rng):
    module = compiled("lstm", 3, hidden, batch, "llvm", lengths=True, directions=2, **options)
    for steps in (1, 6):
        assert check_against_reference(module, rng, steps, True, lengths=True) < TOL_F32


def test_bidirectional_takes_a_torch_module_as_it_is(rng):
    """A one-layer bidirectional torch module's state_dict names the weights; h0 and c0 are
    [2, N, H] as torch's; y and the final states match torch's."""
    torch = pytest.importorskip("torch")
    theirs = torch.nn.LSTM(4, 6, bidirectional=True).double()
    module = compiled("lstm", 4, 6, 3, "llvm", lengths=True, directions=2)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    hx = (torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64))
    lengths = torch.tensor([2, 5, 1])
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    with torch.no_grad():
        ref, (h_ref, c_ref) = theirs(packed, hx)
    ref = torch.nn.utils.rnn.pad_packed_sequence(ref, total_length=5)[0]
    y, (h, c) = module(x.float(), theirs.float(), h0=hx[0].float(), c0=hx[1].float(),
                       lengths=lengths)
    for ours, want in ((y, ref), (h, h_ref), (c, c_ref)):
        assert reference.relative_error(ours.numpy(), want.numpy()) < TOL_F32


def test_bidirectional_weights_are_checked(rng):
    module = compiled("gru", 2, 3, 1, "llvm", directions=2)
    forward = random_weights(rng, 3, 2, 3, "float32")
    with pytest.raises(InputError, match="missing weight 'weight_ih_l0_reverse'"):
        module(np.zeros((2, 1, 2), "float32"), forward)
    both = {**forward, **{k + "_reverse": v for k, v in forward.items()}}
    del both["bias_hh_l0_reverse"], both["bias_ih_l0_reverse"]
    with pytest.raises(InputError, match="biases of all directions or of none"):
        module(np.zeros((2, 1, 2), "float32"), both)
    with pytest.raises(InputError, match=r"h0 has shape \[1, 1, 3\], expected \[2, 1, 3\]"):
        module(np.zeros((2, 1, 2), "float32"), {**forward, **{
            k + "_reverse": v for k, v in forward.items()}}, h0=np.zeros((1, 1, 3), "float32"))
    with pytest.raises(ConfigError, match="directions must be 1 or 2"):
        rnncc.compile("gru", 2, 3, 1, target="llvm", directions=3)


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("cell, hidden, batch", [("lstm", 512, 1), ("gru", 256, 4)])
def test_cuda_bidirectional_runs_both_directions_in_one_launch(cell, hidden, batch):
    """One persistent kernel for both directions: twice one direction's grid, one barrier
    counter a direction (and batch group), no spills."""
    from rnncc.compiler.cuda_binary import cooperative_kernels
    from rnncc.schedules.persistent import gpu_for_arch, knobs
    from rnncc.spec import Problem

    module = rnncc.compile(cell, hidden, hidden, batch, target="cuda", lengths=True,
                           directions=2, tuning="off")
    plan = module.metadata["schedule"]["persistent"]["plan"]
    # the planner's groups: one direction's alone may narrow to clusters, two directions' not
    one = knobs.plan_for(Problem(rnncc.cells.get(cell), hidden, hidden, batch), gpu_for_arch(
        "sm_90"), {"sync": "tagged"}, 24)
    assert plan["directions"] == 2 and plan["blocks"] == 2 * one.blocks
    (name,) = cooperative_kernels(module.source("cuda"))
    report = module.metadata["ptxas"][name]
    assert report["spill_stores"] == report["stack"] == 0
