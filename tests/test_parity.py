"""Every registered cell against the float64 NumPy reference, on fresh random inputs.

On llvm always; on cuda with --gpu (the same checks on the GPU machine). Relative error
||out - ref|| / ||ref|| under 1e-5 for float32 and 2e-3 for float16 (half storage, float32
accumulation; the reference runs on the same half-rounded inputs), over y and every final state.
"""

import numpy as np
import pytest

import rnncc
from helpers import TOL, TOL_F32, check_against_reference, compiled

CELLS = rnncc.cells.names()
#: Every odd hidden size and batch in the default run, all their pairs with --slow
COVERING = {(1, 1), (3, 7), (33, 3), (257, 1), (257, 7)}
SIZES = [pytest.param(h, n, marks=[] if (h, n) in COVERING else [pytest.mark.slow])
         for h in (1, 3, 33, 257) for n in (1, 3, 7)]
TARGETS = ["llvm", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("hidden,batch", SIZES)
@pytest.mark.parametrize("cell", CELLS)
def test_matches_reference(cell, hidden, batch, target, rng):
    module = compiled(cell, 5, hidden, batch, target)
    for steps, initial in ((1, False), (1, True), (37, True), (37, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL_F32, f"T={steps} initial={initial}: relative error {err:.3e}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("dtype, hidden, batch", [
    ("float16", 1, 1), ("float16", 33, 7), ("float16", 257, 3), ("bfloat16", 33, 7),
    pytest.param("bfloat16", 1, 1, marks=pytest.mark.slow),
    pytest.param("bfloat16", 257, 3, marks=pytest.mark.slow)])
def test_half_storage_matches_reference(dtype, cell, hidden, batch, target, rng):
    """float16 and bfloat16 storage (float32 math) against float64 from the same rounded
    inputs (bfloat16 arrays: ml_dtypes; its other sizes with --slow)."""
    module = compiled(cell, 5, hidden, batch, target, dtype=dtype)
    for steps, initial in ((1, True), (37, True), (37, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL[dtype], f"T={steps} initial={initial}: relative error {err:.3e}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cell", CELLS)
def test_long_sequence(cell, target, rng):
    module = compiled(cell, 17, 33, 3, target)
    err = check_against_reference(module, rng, 1000, True)
    assert err < TOL_F32


OPTION_SETS = [dict(input_gemm=False), dict(gate_gemm=False), dict(fuse_pointwise=False),
               dict(input_gemm=False, gate_gemm=False, fuse_pointwise=False)]


def _variants():
    """(cell, options, target) for every cell and option set; on the CPU the options one at a
    time only for lstm and gru by default, the other cells' with --slow (the set with all three
    off still checks every cell in the default run)."""
    for cell in CELLS:
        for options in OPTION_SETS:
            name = f"{cell}-" + ",".join(f"no_{k}" for k in options)
            some = len(options) == 1 and cell not in ("lstm", "gru")
            yield pytest.param(cell, options, "llvm", id=f"{name}-llvm",
                               marks=[pytest.mark.slow] if some else [])
            yield pytest.param(cell, options, "cuda", id=f"{name}-cuda", marks=pytest.mark.gpu)


@pytest.mark.parametrize("cell, options, target", list(_variants()))
def test_schedule_variants(cell, options, target, rng):
    """cuDNN's optimisations switched off one by one compute the same function."""
    module = compiled(cell, 7, 33, 3, target, **options)
    assert module.metadata["schedule"]["options"] == {
        "input_gemm": True, "gate_gemm": True, "fuse_pointwise": True, "fused_step": True,
        "persistent": "auto", "tf32x3": True, **options}
    err = check_against_reference(module, rng, 9, True)
    assert err < TOL_F32


@pytest.mark.parametrize("target", TARGETS)
def test_same_inputs_same_outputs(target, rng):
    module = compiled("lstm", 5, 33, 3, target)
    x = rng.standard_normal((20, 3, 5)).astype("float32")
    from conftest import random_weights

    w = {k: v.astype("float32") for k, v in random_weights(rng, 4, 5, 33).items()}
    first = module(x, w)[0]
    for _ in range(5):
        np.testing.assert_array_equal(module(x, w)[0], first)


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cell", CELLS)
def test_pytorch_parity(cell, target, rng):
    """The torch.nn module with the same state_dict computes the same outputs."""
    torch = _torch()
    spec = rnncc.cells.get(cell).torch
    if spec is None:
        pytest.skip(f"{cell} has no torch.nn equivalent")
    device = "cuda" if target == "cuda" else "cpu"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = getattr(torch.nn, spec[0])(6, 33, **spec[1]).double()
    x = torch.tensor(rng.standard_normal((12, 3, 6)))
    states = [torch.tensor(rng.standard_normal((1, 3, 33))) for _ in rnncc.cells.get(cell).states]
    with torch.no_grad():
        y_ref, s_ref = ref(x, tuple(states) if len(states) > 1 else states[0])
    module = compiled(cell, 6, 33, 3, target)
    f32 = {k: v.float().to(device) for k, v in ref.state_dict().items()}
    init = {f"{s}0": v.float().to(device) for s, v in zip(rnncc.cells.get(cell).states, states)}
    y, s = module(x.float().to(device), f32, **init)
    assert isinstance(y, torch.Tensor) and y.device.type == device
    rel = (y.double().cpu() - y_ref).norm() / y_ref.norm()
    assert rel < TOL_F32
    s = s if isinstance(s, tuple) else (s,)
    s_ref = s_ref if isinstance(s_ref, tuple) else (s_ref,)
    for got, want in zip(s, s_ref):
        assert (got.double().cpu() - want).norm() / want.norm() < TOL_F32
