"""CUDA modules' forward entries as rnncc lowers them (every stage's kernel and the loop over the
steps, as TVM's passes before the device code leave them), run on the TIR simulator
(:mod:`tir_sim`) against float64: how a layer's kernels are wired (which slot of h a step's
product reads, its slices of K, the cell step's or one-step kernel's outputs, lengths, both
directions) checked without a GPU, for schedules whose numbers are otherwise checked only on
the GPU machine."""

import numpy as np
import pytest
import tvm

import rnncc
from helpers import TOL
from rnncc import reference
from rnncc.lowering import sequence
from rnncc.spec import Options, Problem
from rnncc.target import TargetSpec

CUDA = TargetSpec("cuda").tvm_target()
STEPS = 3

#: (cell, C, H, N, dtype, options, (stage, the rule that must schedule it))
CASES = [
    # the one-step kernel in swapped tiles, K padded 200 -> 256, a last tile of 8 units of 16
    ("lstm", 48, 200, 70, "bfloat16", {"lengths": True}, ("step", "cuda.wgmma_step")),
    # each step's product in slices of K (swapped tiles), their sum in the cell step
    ("gru", 96, 200, 37, "bfloat16", {"lengths": True},
     ("recurrent_gemm_parts", "cuda.wgmma_gemm")),
    ("lstm", 16, 48, 9, "float16", {"directions": 2},
     ("recurrent_gemm", "cuda.small_batch_gemv")),
    # a step's product of another value than h (the reset gate's r * h), a row mean, and
    # per-unit parameters, each a stage of its own
    ("gru_reset_before", 16, 48, 9, "float16", {}, ("product_gemm", "cuda.small_batch_gemv")),
    ("ln_lstm", 16, 40, 9, "float16", {"lengths": True},
     ("recurrent_gemm", "cuda.small_batch_gemv")),
    ("peephole", 16, 48, 9, "float16", {}, ("recurrent_gemm", "cuda.small_batch_gemv")),
    # IEEE float32 as three TF32 products past whole tiles (K 40 and 52, O 208), each step's
    # in a 64-row tile over half full
    ("lstm", 40, 52, 40, "float32", {}, ("recurrent_gemm", "cuda.wgmma_gemm")),
    # a GPU test's layer: K padded 1000 -> 1024, two tiles of 40 rows of h
    pytest.param("lstm", 64, 1000, 79, "float16", {"directions": 2},
                 ("step", "cuda.wgmma_step"), marks=pytest.mark.slow),
    # the one-step kernel in tiles of h's rows, fed by the TMA engine
    pytest.param("gru", 64, 1024, 100, "bfloat16", {"directions": 2, "lengths": True},
                 ("step", "cuda.wgmma_step"), marks=pytest.mark.slow),
]


def _inputs(built, problem, rng):
    """(the forward entry's inputs by name, torch's weights by name): torch's uniform weights
    packed by the module's own packing entries (on the simulator), x, initial states and
    lengths 1 to STEPS as the entry takes them."""
    from tir_sim import Simulator, lowered

    k = 1.0 / np.sqrt(problem.hidden_size)
    named, given = {}, {}
    for entry, signature in built.signatures.items():
        if not entry.startswith("pack"):
            continue
        args = {}
        for spec in signature:
            if spec["kind"] == "input":
                if spec["name"] not in named:
                    named[spec["name"]] = rng.uniform(-k, k, spec["shape"]).astype(spec["dtype"])
                args[spec["name"]] = named[spec["name"]]
            else:
                args[spec["name"]] = np.full(spec["shape"], np.nan, spec["dtype"])
        Simulator(lowered(tvm.IRModule({"main": built.mod[entry]})), args).run()
        given.update({spec["name"]: args[spec["name"]] for spec in signature
                      if spec["kind"] == "output"})
    for spec in built.signatures["forward"]:
        if spec["kind"] != "input" or spec["name"] in given:
            continue
        shape = [STEPS if d == "T" else d for d in spec["shape"]]
        if spec["name"] == "lengths":
            value = rng.integers(1, STEPS + 1, shape)
        elif spec["name"] in ("b_ih", "b_hh"):  # one direction's, as given
            value = rng.uniform(-k, k, shape)
            named[spec["name"].replace("b_", "bias_") + "_l0"] = value.astype(spec["dtype"])
        elif spec["name"].startswith("p_"):  # a cell's per-unit parameter, one direction's
            value = rng.uniform(-1, 1, shape)
            named[spec["name"][2:] + "_l0"] = value.astype(spec["dtype"])
        else:
            value = rng.standard_normal(shape)
        given[spec["name"]] = value.astype(spec["dtype"])
    return given, named


@pytest.mark.parametrize("cell, c, h, n, dtype, options, rule", CASES)
def test_cuda_forward_entry_matches_float64_on_the_simulator(cell, c, h, n, dtype, options,
                                                            rule, rng):
    """The forward entry of a CUDA module not on the persistent kernel, every output and
    workspace poisoned, T = 3: y and the final states within the dtype's bound of float64 on
    the same rounded inputs (lengths random, a sample's outputs past its length zero), the
    weights packed by the module's packing entries (W_hh with K padded past H where the step
    is the one-step kernel in swapped tiles)."""
    from tir_sim import Simulator, lowered

    problem = Problem(rnncc.cells.get(cell), c, h, n, dtype, **options)
    built = sequence.build(problem, Options(persistent="off"), CUDA)
    assert built.rules[rule[0]] == rule[1], built.rules
    signature = built.signatures["forward"]
    given, named = _inputs(built, problem, rng)
    args = dict(given)
    for spec in signature:
        if spec["kind"] != "input":
            shape = [STEPS if d == "T" else d for d in spec["shape"]]
            poison = np.nan if "float" in spec["dtype"] else -7
            args[spec["name"]] = np.full(shape, poison, spec["dtype"])
    Simulator(lowered(tvm.IRModule({"main": built.mod["forward"]})), args).run()
    initial = {s: given[f"{s}0"] for s in problem.cell.states}
    want_y, want = reference.run_module(problem.cell, given["x"], named, problem.directions,
                                        initial=initial, lengths=given.get("lengths"))
    for name, got, value in [("y", args["y"], want_y),
                             *[(s, args[f"{s}_n"], want[s]) for s in problem.cell.states]]:
        err = np.abs(got.astype(np.float64) - value).max() / np.abs(value).max()
        assert err < TOL[dtype], (name, err)
