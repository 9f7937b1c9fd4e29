"""Samples of their own lengths in one batch (modules compiled with ``lengths=True``): each
sample's final states are those of its own last step and its outputs past it are zero."""

import re

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc, random_weights
from helpers import TOL_F32, check_across_steps, check_against_reference, compiled
from rnncc import reference
from rnncc.errors import ConfigError, InputError


def _cells_and_options():
    """Every cell with the default schedule; the unfused and per-gate ones for lstm and gru,
    and for the other cells with --slow."""
    for cell in rnncc.cells.names():
        for options in ({}, {"fuse_pointwise": False}, {"gate_gemm": False}):
            slow = options and cell not in ("lstm", "gru")
            yield pytest.param(cell, options, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("cell, options", list(_cells_and_options()))
def test_lengths_match_reference(cell, options, rng):
    module = compiled(cell, 5, 9, 4, "llvm", lengths=True, **options)
    assert module.takes_lengths and module.metadata["lengths"]
    check_across_steps(module, rng, lengths=True)


def test_no_lengths_means_every_step(rng):
    """lengths=None runs all T steps, as a module without lengths does."""
    module = compiled("lstm", 5, 9, 3, "llvm", lengths=True)
    assert check_against_reference(module, rng, 11, True) < TOL_F32


def test_lengths_from_torch_and_lists(rng):
    torch = pytest.importorskip("torch")
    module = compiled("gru", 4, 6, 3, "llvm", lengths=True)
    w = {k: v.astype("float32") for k, v in random_weights(rng, 3, 4, 6).items()}
    x = rng.standard_normal((5, 3, 4)).astype("float32")
    ref_y, ref_h = reference.run(rnncc.cells.get("gru"), x, w, lengths=[5, 2, 1])
    for lengths in ([5, 2, 1], np.array([5, 2, 1], np.int64), torch.tensor([5, 2, 1])):
        y, h = module(x if not isinstance(lengths, torch.Tensor) else torch.tensor(x), w,
                      lengths=lengths)
        y, h = np.asarray(y), np.asarray(h)
        assert reference.relative_error(y, ref_y) < TOL_F32
        assert reference.relative_error(h, ref_h["h"]) < TOL_F32
        assert not y[2:, 2].any() and not y[5:, 0].any()  # zero past each length


@pytest.mark.parametrize("lengths, match", [
    ([0, 2, 3], r"lengths must be from 1 to T = 4 \(the steps of x\), got values from 0 to 3"),
    ([1, 5, 3], r"from 1 to T = 4 .* got values from 1 to 5"),
    ([1, 2], r"lengths has shape \[2\], expected \[3\]"),
    ([1.0, 2.0, 3.0], "lengths must be integers, got dtype float64"),
])
def test_bad_lengths_are_refused(lengths, match, rng):
    module = compiled("rnn_tanh", 2, 3, 3, "llvm", lengths=True)
    w = random_weights(rng, 1, 2, 3, "float32")
    with pytest.raises(InputError, match=match):
        module(np.zeros((4, 3, 2), "float32"), w, lengths=lengths)


def test_torch_lengths_are_checked_again_once_written_or_for_another_t(rng):
    """A torch tensor of lengths is read for the check once per version (a network's modules
    take it one after another): written in place, or with x of fewer steps, it is read again."""
    torch = pytest.importorskip("torch")
    module = compiled("rnn_tanh", 2, 3, 3, "llvm", lengths=True)
    w = random_weights(rng, 1, 2, 3, "float32")
    lengths = torch.tensor([1, 4, 3])
    module(torch.zeros((4, 3, 2)), w, lengths=lengths)
    module(torch.zeros((4, 3, 2)), w, lengths=lengths)
    with pytest.raises(InputError, match=r"from 1 to T = 3 .* got values from 1 to 4"):
        module(torch.zeros((3, 3, 2)), w, lengths=lengths)
    lengths[0] = 0
    with pytest.raises(InputError, match=r"from 1 to T = 4 .* got values from 0 to 4"):
        module(torch.zeros((4, 3, 2)), w, lengths=lengths)


def test_lengths_need_a_module_that_takes_them(rng):
    module = compiled("rnn_tanh", 2, 3, 3, "llvm")
    with pytest.raises(InputError, match="takes no lengths; compile it with lengths=True"):
        module(np.zeros((4, 3, 2), "float32"), random_weights(rng, 1, 2, 3, "float32"),
               lengths=[1, 2, 3])
    with pytest.raises(ConfigError, match="lengths must be True or False"):
        rnncc.compile("lstm", 2, 3, 1, target="llvm", lengths="yes")


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("cell, input_size, hidden, batch", [("lstm", 32, 1024, 3),
                                                             ("gru", 1024, 1024, 4)])
def test_cuda_module_with_lengths_builds(cell, input_size, hidden, batch):
    """Both entries take the lengths; the persistent kernel keeps each pair's length in a
    register (no load a step) and builds without spills."""
    from rnncc.compiler.cuda_binary import cooperative_kernels

    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", lengths=True,
                           tuning="off")
    functions = module.metadata["functions"]
    for entry in ("forward", "persistent_forward"):
        assert {"name": "lengths", "shape": [batch], "dtype": "int32", "kind": "input"} in (
            functions[entry])
    (name,) = cooperative_kernels(module.source("cuda"))
    report = module.metadata["ptxas"][name]
    assert report["spill_stores"] == report["stack"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_cuda_input_gemm_leaves_out_the_rows_past_the_lengths():
    """In IEEE float32 at batch 32 and more, both entries (persistent and not, both
    directions) compute ``ends`` from the lengths and run the input projection of all steps
    as cuda.sgemm over the rows within them (its tiles past them return at once); in float16
    (tensor cores) as before."""
    module = rnncc.compile("lstm", 40, 132, 33, target="cuda", lengths=True, directions=2,
                           tuning="off")
    functions, rules = module.metadata["functions"], module.metadata["schedule"]["rules"]
    for entry in ("forward", "persistent_forward"):
        assert {"name": "ends", "shape": [33], "dtype": "int32", "kind": "workspace"} in (
            functions[entry])
    assert rules["input_gemm_lengths"] == "cuda.sgemm" and "input_gemm" not in rules
    # the tiles past the last row within the lengths (ends[N - 1]) return at once
    assert "blockIdx.y) * (int64_t)128) < ((int64_t)ends_ptr[32]))" in module.source("cuda")
    half = rnncc.compile("lstm", 40, 132, 33, target="cuda", lengths=True, dtype="float16",
                         persistent="off", tuning="off")
    assert "ends" not in {p["name"] for p in half.metadata["functions"]["forward"]}
    assert "input_gemm" in half.metadata["schedule"]["rules"]


def test_cuda_masked_step_computes_the_gates_once_for_all_outputs():
    """The step with lengths (CUDA, not persistent) binds each output's value and kept state
    and selects between them, rather than a branch an output that computes the gates again in
    each (TVM makes a branch of a select that loads memory); so does its copy of h in TF32
    (a variable binds once: the copy has its own)."""
    module = rnncc.compile("lstm", 24, 40, 7, target="cuda", lengths=True, persistent="off",
                           tuning="off")
    source = module.source("cuda")
    step = next(body for body in source.split("__global__")
                if "active_ptr[" in body and "y_ptr[" in body)  # the kernel, not its declaration
    # y, h and c each a select of its bound value (the kept c and h bound too), no branches
    assert "condval" not in step and step.count("? taken") == 3 and step.count("kept") >= 2
    # in TF32 at batch 16 the step also writes h again, rounded, for the next step's product:
    # a select of its own, bound before it is rounded
    tf32 = rnncc.compile("lstm", 128, 256, 16, target="cuda", lengths=True, persistent="off",
                         allow_tf32=True, tuning="off")
    step = next(body for body in tf32.source("cuda").split("__global__")
                if "active_ptr[" in body and "y_ptr[" in body)
    assert "condval" not in step and step.count("? taken") == 4 and "h_copy" in step


@pytest.mark.slow
def test_cuda_masked_steps_of_training_compute_the_gates_outside_branches():
    """With lengths, the persistent kernels (inference, the training forward and backward)
    and the per-step cell derivative (the module's sequence entries) bind the cell's values
    before they select between them and the kept ones: no branch computes a gate's function
    (a branch an output computed them all again: the persistent backward of LSTM 256 at batch
    4 had 50 MUFU instructions against 10 without lengths, the step's derivative 44 against
    14)."""
    module = rnncc.compile("lstm", 24, 40, 7, target="cuda", lengths=True, training=True,
                           persistent="on", tuning="off")
    assert {"backward", "persistent_backward"} <= set(module.metadata["functions"])
    source = module.source("cuda")
    assert not re.findall(r"condval\w* = [^;]*(?:expf|tanhf|fdividef)", source)
    # at batch 7, dx is the product of all rows, in slices of K (dGI is zero past the lengths)
    assert "lengths" not in {p["name"] for p in module.metadata["functions"]["backward_input"]}


def test_length_ends_count_each_length_within_the_steps():
    """``ends`` (where each sample's rows end, laid out sample after sample) counts a length
    within 0 .. T: one past T (a CUDA graph's replay may bring it) as T, below 0 as 0."""
    import tvm
    from tvm import tirx

    from rnncc.lowering import components as comp

    func = comp.length_ends(5, tirx.Var("T", "int64"), 3, "float32")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    x = tvm.runtime.tensor(np.zeros((4, 5, 3), np.float32))  # T = 4
    lengths = tvm.runtime.tensor(np.array([30, 1, 0, -2, 4], np.int32))
    ends = tvm.runtime.tensor(np.full(5, -7, np.int32))
    lib["main"](x, lengths, ends)
    assert ends.numpy().tolist() == [4, 5, 5, 5, 9]


@pytest.mark.slow
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
def test_cuda_training_forward_leaves_out_the_rows_past_the_lengths():
    """The training forward (persistent and not) leaves them out too: the backward pass reads
    those rows only where it selects zeros (GPU: test_training's gradients at batch 40)."""
    module = rnncc.compile("lstm", 40, 132, 33, target="cuda", lengths=True, training=True,
                           tuning="off")
    for entry in ("forward", "train_forward", "persistent_forward", "persistent_train_forward",
                  "backward_input"):
        assert "ends" in {p["name"] for p in module.metadata["functions"][entry]}, entry
    assert module.metadata["schedule"]["rules"]["input_gemm_lengths"] == "cuda.sgemm"
