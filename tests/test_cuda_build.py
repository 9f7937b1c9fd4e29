"""CUDA modules build on a machine without a GPU: host code, CUDA source, and a cubin from
nvcc inside the library, with the ptxas report in the metadata (no GPU needed, nor used)."""

import re

import numpy as np
import pytest

import rnncc
from conftest import has_nvcc, random_weights
from helpers import compiled
from rnncc.compiler.cuda_binary import (
    cooperative_kernels,
    kernel_bodies,
    library_device_code,
    parse_ptxas,
    persistent_kernels,
)
from rnncc.errors import BuildError
from rnncc.runtime import metadata as md

pytestmark = pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")


@pytest.mark.parametrize("cell", rnncc.cells.names())
def test_cuda_module_carries_cubin(cell, tmp_path):
    module = compiled(cell, 17, 33, 3, "cuda")
    path = module.export(tmp_path / f"{cell}.so")
    assert library_device_code(path) == [("cuda", "cubin")]
    meta = md.read_metadata(path)
    assert meta["target"] == {"kind": "cuda", "arch": "sm_90", "cpu": None}
    kernels = meta["ptxas"]
    assert any(k.startswith("forward_kernel") for k in kernels)
    for name, report in kernels.items():
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, name
    source = module.source("cuda")
    assert "__global__" in source and "forward_kernel" in source
    # nvcc without fast math: IEEE expf, except where the persistent kernel's cell calls the
    # fast forms by name
    bodies = kernel_bodies(source)
    assert any(name.startswith("forward_kernel") for name in bodies)
    persistent = persistent_kernels(source)
    assert len(persistent) == 1
    assert all("__expf" not in b and "__fdividef" not in b for name, b in bodies.items()
               if name not in persistent)
    # a batch group a block here (H 33, batch 3): it keeps h to itself, waits on no block,
    # and needs no cooperative launch
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "local"
    assert cooperative_kernels(source) == []
    # programmatic dependent launch (sm_90): every kernel but a cooperative one waits for the
    # kernel ahead of it first, and is launched with the tag
    for name, body in bodies.items():
        assert body.lstrip().startswith("rnncc_dependent_wait();"), name
    assert "griddepcontrol.launch_dependents" not in source
    with open(path, "rb") as f:
        assert b"tirx.use_programtic_dependent_launch" in f.read()


def test_a_cooperative_persistent_kernel_is_launched_without_a_wait():
    """Blocks that exchange h with each other (tagged words here) are one cooperative kernel:
    the one kernel that programmatic dependent launch does not let start early (it waits for
    no kernel ahead of it: every block must be resident at once), with the cell's fast
    exponential; every other kernel waits first."""
    module = rnncc.compile("lstm", 17, 33, 3, target="cuda", arch="sm_90", tuning="off",
                           knobs={"sync": "tagged", "max_blocks": 2})
    source = module.source("cuda")
    persistent = cooperative_kernels(source)
    assert len(persistent) == 1 and persistent == persistent_kernels(source)
    for name, body in kernel_bodies(source).items():
        waits = body.lstrip().startswith("rnncc_dependent_wait();")
        assert waits == (name not in persistent), name
        assert ("__expf" in body) == (name in persistent), name


@pytest.mark.parametrize("cell", ["lstm", pytest.param("gru", marks=pytest.mark.slow)])
def test_batch_one_past_on_chip_capacity_builds(cell):
    """H 4096 at batch 1 (the recurrent product streamed by cuda.small_batch_gemv) builds, and
    says why it is not persistent."""
    module = compiled(cell, 4096, 4096, 1, "cuda")
    meta = module.metadata["schedule"]
    assert (meta["kind"] == "sequence"
            and meta["rules"]["recurrent_gemm"] == "cuda.small_batch_gemv")
    assert "more than their registers and shared memory hold" in meta["persistent"]["reason"]


@pytest.mark.parametrize("cell, hidden, batch, step_threads", [("lstm", 512, 256, 256),
                                                                ("gru", 64, 64, 128)])
def test_step_products_read_h_by_vectors(cell, hidden, batch, step_threads):
    """The step's product (cuda.sgemm) reads h, step t's ``h_ws[t % 2]`` (an offset that two
    kernels share), by 16-byte loads: TVM's elimination of common subexpressions made the offset
    a host variable, and each load four scalar ones, so rnncc builds CUDA without it. Tiles of
    256 threads (all steps'; one step's at batch 256, whose grid has enough of them) are
    launched two a multiprocessor, one step's of 128 threads (batch 64) as ptxas likes."""
    module = compiled(cell, 64, hidden, batch, "cuda", persistent="off", tf32x3=False)
    rules = module.metadata["schedule"]["rules"]
    assert "cuda.sgemm" == rules["input_gemm"] == rules.get("recurrent_gemm_parts",
                                                             rules["recurrent_gemm"])
    source = module.source("cuda")
    assert "make_float4(h_ws_ptr[" not in source and "*(float4*)(h_ws_ptr + " in source
    bodies = kernel_bodies(source)
    (step,) = [name for name, body in bodies.items() if "h_ws_ptr + " in body
               and "w_hh_ptr" in body]
    bounds = "256, 2" if step_threads == 256 else "128"
    assert f"__launch_bounds__({bounds}) {step}(" in source
    (all_steps,) = [name for name, body in bodies.items() if "x_ptr" in body
                    and "w_ih_ptr" in body and "b_ih_ptr" in body]
    assert f"__launch_bounds__(256, 2) {all_steps}(" in source


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_half_training_products_on_tensor_cores(dtype):
    """A half-precision training module's products over all T*N rows on Hopper: dx = dGI W_ih
    and both weight gradients on warpgroup MMA with the operands read along their rows
    MN-major (the instructions' transposition flags; no transposed copy of W_ih), dGI in the
    layer's dtype (no copy of the step's sums), h in it for dW_hh, no spills and no
    serialized warpgroup MMA."""
    module = compiled("lstm", 256, 256, 64, "cuda", dtype=dtype, training=True,
                      persistent="off")
    rules = module.metadata["schedule"]["rules"]
    assert "transpose_w_ih" not in rules and "pre_step" not in rules  # dGI in its own buffer
    assert rules["input_gemm_backward"] == rules["weight_grad_ih"] == rules[
        "weight_grad_hh"] == "cuda.wgmma_gemm"
    # dW_hh reads h copied to the half type first; LSTM's db_hh is db_ih (dGH is dGI)
    assert rules["h_half"] == rules["bias_grad_hh"] == "cuda.elementwise"
    assert rules["bias_grad_ih"] == "cuda.column_sum"
    source = module.source("cuda")
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    flags = {name: re.findall(rf"m64n\d+k16_f32_{short}_{short}_1_1_(\d)_(\d)\(", body)
             for name, body in kernel_bodies(source).items() if "wgmma" in body}
    gradients = [name for name, found in flags.items() if set(found) == {("1", "1")}]
    dx = [name for name, found in flags.items() if set(found) == {("0", "1")}]
    assert len(gradients) == 2 and len(dx) == 1, flags
    for name in gradients + dx:  # and no warpgroup MMA serialized (a gradient's loop once)
        report = module.metadata["ptxas"][name]
        assert report["spill_stores"] == report["stack"] == 0, report
        assert not report.get("wgmma_serialized"), report


@pytest.mark.parametrize("options, launches", [
    ({"layers": 2}, 3),  # the buffers readied, the progress counters zeroed, the kernel
    ({"proj_size": 4, "directions": 2, "lengths": True}, None)])
def test_persistent_entries_ready_every_grid_at_once(options, launches):
    """A persistent entry readies the states' workspaces and the tagged words of all its
    grids in one kernel, and its kernel writes y and the final states (with a projection,
    whose h' starts at zero, the final h comes from a GEMM after it): a wavefront of two
    layers launches three kernels."""
    module = compiled("lstm", 9, 9, 4, "cuda", **options)
    assert module.metadata["schedule"]["kind"] == "persistent"
    kernels = {name for name in kernel_bodies(module.source("cuda"))
               if name.startswith("persistent_forward")}
    assert launches is None or len(kernels) == launches, sorted(kernels)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_half_persistent_kernel_with_its_input_projection_builds(dtype):
    """A 16-bit layer whose persistent kernel computes its input projections (knobs
    ``input_rows``, as ``rnncc tune`` tries): 8 halves of x a 16-byte vector, staged as float32
    in vectors of 4 (TVM writes 8 float32 lanes as a ulonglong4 of 8 floats, which nvcc
    refused: the tune of float16 LSTM 512 N8 skipped the knob)."""
    module = rnncc.compile("lstm", 512, 512, 8, target="cuda", dtype=dtype, tuning="off",
                           knobs={"input_rows": 32})
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["input_rows"] > 0 and plan["vec"] == 8


def test_cuda_module_for_other_arch_and_variants(tmp_path):
    module = compiled("gru", 8, 64, 1, "cuda", input_gemm=False, gate_gemm=False,
                      fuse_pointwise=False)
    assert module.metadata["schedule"]["options"] == {
        "input_gemm": False, "gate_gemm": False, "fuse_pointwise": False, "fused_step": True,
        "persistent": "auto", "tf32x3": True}
    sm80 = rnncc.compile("lstm", 8, 64, 1, target="cuda", arch="sm_80")
    path = sm80.export(tmp_path / "sm80.so")
    assert md.read_metadata(path)["target"]["arch"] == "sm_80"
    assert "griddepcontrol" not in sm80.source("cuda")  # sm_90 on
    with open(path, "rb") as f:
        assert b"tirx.use_programtic_dependent_launch" not in f.read()


def test_cuda_module_cannot_run_without_gpu(tmp_path):
    from rnncc.runtime.tvm_runtime import cuda_available

    if cuda_available():
        pytest.skip("this machine has a GPU")
    module = compiled("lstm", 17, 33, 3, "cuda")
    w = {k: v.astype("float32") for k, v in random_weights(np.random.default_rng(0), 4, 17,
                                                           33).items()}
    with pytest.raises(rnncc.ModuleFileError, match="no usable CUDA device"):
        module(np.zeros((2, 3, 17), "float32"), w)


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    with pytest.raises(BuildError, match="needs nvcc"):
        rnncc.compile("rnn_tanh", 3, 5, 1, target="cuda")


def test_parse_ptxas():
    report = """ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to non wgmma instructions defining accumulator registers of a wgmma between \
start and end of the pipeline stage in the function 'k2'
ptxas info    : Compiling entry function 'k2' for 'sm_90a'"""
    assert parse_ptxas(report) == {
        "k1": {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 255, "smem": 1024},
        "k2": {"wgmma_serialized": True}}


def test_the_pack_entries_say_where_a_packed_weight_is_the_given_one():
    """CUDA's packed weights are PyTorch's [G*H, K] as they are: the pack entries name the
    given weight (pack(copy=False) then lends its memory); the CPU's are transposed, and so
    is CUDA's W_ih where C is padded (17 float32 values: 20)."""
    for target, size, same in (("cuda", 16, (True, True)), ("llvm", 16, (False, False)),
                               ("cuda", 17, (False, True))):
        module = compiled("lstm", size, 33, 3, target)
        for which, given in zip(("ih", "hh"), same):
            out = module._signature(f"pack_w_{which}")[-1]
            assert out.get("same_as") == (f"weight_{which}_l0" if given else None), target
    assert out["shape"] == [132, 33] and module._signature("pack_w_ih")[-1]["shape"] == [132, 20]


@pytest.mark.parametrize("dtype, size, padded, batch", [
    pytest.param("float32", 161, 164, 40, marks=pytest.mark.slow), ("float16", 13, 16, 3),
    pytest.param("bfloat16", 257, 264, 64, marks=pytest.mark.slow)])
def test_an_input_size_off_whole_copies_is_padded_for_the_products(dtype, size, padded, batch):
    """C whose rows are not whole 16-byte copies (speech features: 13, 161, 257): W_ih is
    packed [G*H, C'] with zeros past C and x copied so before the input projection of all
    steps, which then takes a GEMM rule of its own, not dlight's generic one; so does dx's
    product in training (a float32 layer's: the 16-bit layers' C' is off whole tiles)."""
    module = rnncc.compile("gru", size, 64, batch, dtype=dtype, target="cuda", tuning="off",
                           training=True)
    rules = module.metadata["schedule"]["rules"]
    assert rules["pad_x"] == "cuda.elementwise" and rules["input_gemm"] != "cuda.matmul"
    if dtype == "float32":
        assert rules["input_gemm_backward"] != "cuda.matmul"
    assert module._signature("pack_w_ih")[-1]["shape"] == [192, padded]
    for entry in ("forward", "train_forward"):
        assert [p["shape"] for p in module._signature(entry) if p["name"] == "x_padded"] == [
            ["T", batch, padded]]
    dx = {p["name"]: p["shape"] for p in module._signature("backward_input")}
    assert dx["dx"] == ["T", batch, size] and dx["dx_acc"] == ["T", batch, padded]
