"""CUDA-only behaviour (run with --gpu on a GPU machine): PyTorch CUDA tensors in place and on
their stream, CUDA-graph capture, device errors, and a module built here run in a process that
has only TVM's runtime."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rnncc
from conftest import random_weights
from helpers import (
    TOL,
    TOL_F32,
    TOL_TF32,
    check_across_steps,
    check_against_reference,
    check_repeats_exactly,
    compiled,
    persistent_cells,
)
from rnncc import reference
from rnncc.errors import InputError

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_numpy_and_torch_cuda_agree(torch, rng):
    module = compiled("lstm", 16, 64, 4, "cuda")
    assert check_against_reference(module, rng, 30, True) < TOL_F32
    err = check_against_reference(module, rng, 30, True,
                                  to_array=lambda a: torch.tensor(a, device="cuda"))
    assert err < TOL_F32


def test_results_stay_on_device(torch, rng):
    module = compiled("gru", 8, 32, 2, "cuda")
    w = {k: torch.tensor(v, dtype=torch.float32, device="cuda")
         for k, v in random_weights(rng, 3, 8, 32).items()}
    y, h = module(torch.randn(5, 2, 8, device="cuda"), w)
    assert y.is_cuda and h.is_cuda and y.shape == (5, 2, 32) and h.shape == (1, 2, 32)


def test_runs_on_torch_stream_and_in_cuda_graph(torch, rng):
    module = compiled("lstm", 16, 64, 1, "cuda")
    w = {k: torch.tensor(v, dtype=torch.float32, device="cuda")
         for k, v in random_weights(rng, 4, 16, 64).items()}
    packed = module.pack(w)
    x = torch.randn(20, 1, 16, device="cuda")
    expect = module(x, packed)[0].clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module(x, packed)  # warm up on the side stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, _ = module(x, packed)
    x.copy_(x)  # same inputs
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expect)
    x2 = torch.randn(20, 1, 16, device="cuda")
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, module(x2, packed)[0])


def test_wrong_device_is_an_error(torch, rng):
    module = compiled("rnn_tanh", 4, 8, 1, "cuda")
    w = {k: torch.tensor(v, dtype=torch.float32) for k, v in random_weights(rng, 1, 4, 8).items()}
    with pytest.raises(InputError, match="x is on cpu, but this module runs on cuda"):
        module(torch.randn(3, 1, 4), w)
    with pytest.raises(InputError, match="weight_ih_l0 is on cpu, but this call runs on cuda:0"):
        module(torch.randn(3, 1, 4, device="cuda"), w)


@pytest.mark.parametrize("cell, c, h, n, dtype, tma", [
    ("gru", 12, 40, 3, "float32", False),
    ("lstm", 1024, 1024, 256, "float16", True)])
def test_module_built_here_loads_with_runtime_only(tmp_path, cell, c, h, n, dtype, tma):
    """A module exported here runs in a process with only TVM's runtime, against float64 from
    the same rounded inputs; float16 LSTM 1024 N256's products are fed by the TMA engine, whose
    tensor maps the runtime encodes at each launch."""
    from rnncc.runtime import metadata as md

    path = rnncc.compile(cell, c, h, n, target="cuda", dtype=dtype).export(tmp_path / "m.so")
    assert ("cp.async.bulk.tensor" in md.read_sections(str(path))[md.CUDA].decode()) == tma
    g = rnncc.cells.get(cell).gates
    code = textwrap.dedent(f"""
        import numpy as np, tvm, rnncc
        from rnncc import reference
        assert tvm.base._RUNTIME_ONLY
        m = rnncc.load({str(path)!r})
        rng = np.random.default_rng(1)
        w = {{k: rng.uniform(-.2, .2, s).astype({dtype!r}).astype("float64") for k, s in (
             ("weight_ih_l0", ({g * h}, {c})), ("weight_hh_l0", ({g * h}, {h})),
             ("bias_ih_l0", ({g * h},)), ("bias_hh_l0", ({g * h},)))}}
        x = rng.standard_normal((9, {n}, {c})).astype({dtype!r}).astype("float64")
        y = m(x.astype({dtype!r}), {{k: v.astype({dtype!r}) for k, v in w.items()}})[0]
        want = reference.run(rnncc.cells.get({cell!r}), x, w)[0]
        print("ERR", reference.relative_error(y.astype("float64"), want))
    """)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("ERR")[1]) < {"float32": TOL_F32, "float16": 2e-3}[dtype]


def test_reference_of_long_sequence_on_gpu(rng):
    module = compiled("lstm", 32, 257, 7, "cuda")
    w = random_weights(rng, 4, 32, 257)
    x = rng.standard_normal((2000, 7, 32))
    y, (h, c) = module(x.astype("float32"), {k: v.astype("float32") for k, v in w.items()})
    ref_y, ref_s = reference.run(rnncc.cells.get("lstm"), x, w)
    assert reference.relative_error(y, ref_y) < TOL_F32
    assert reference.relative_error(c, ref_s["c"]) < TOL_F32
    assert np.all(np.isfinite(y))


@pytest.mark.parametrize("sync", ["tagged", "barrier", "grid"])
def test_persistent_variants_match_reference_and_repeat_exactly(sync, rng):
    module = rnncc.compile("lstm", 32, 512, 4, target="cuda", knobs={"sync": sync})
    assert module.metadata["schedule"]["kind"] == "persistent"
    assert check_against_reference(module, rng, 100, True) < TOL_F32
    w = {k: v.astype("float32") for k, v in random_weights(rng, 4, 32, 512).items()}
    x = rng.standard_normal((100, 4, 32)).astype("float32")
    packed = module.pack(w)
    assert packed.entry == "persistent"
    first = module(x, packed)[0]
    for _ in range(20):  # a race would show as run-to-run differences
        np.testing.assert_array_equal(module(x, packed)[0], first)


@pytest.mark.parametrize("sync", ["tagged", "barrier"])
def test_float16_persistent_matches_reference_and_repeats_exactly(sync, rng):
    module = rnncc.compile("gru", 32, 512, 3, target="cuda", dtype="float16",
                           knobs={"sync": sync})
    assert module.metadata["schedule"]["kind"] == "persistent"
    for steps in (1, 100):
        assert check_against_reference(module, rng, steps, True) < TOL["float16"]
    w = {k: v.astype("float16") for k, v in random_weights(rng, 3, 32, 512).items()}
    x = rng.standard_normal((100, 3, 32)).astype("float16")
    packed = module.pack(w)
    first = module(x, packed)[0]
    assert first.dtype == np.float16
    for _ in range(20):
        np.testing.assert_array_equal(module(x, packed)[0], first)


@pytest.mark.parametrize("sync, dtype", [("tagged", "float16"), ("barrier", "float16"),
                                         ("grid", "float16"), ("tagged", "bfloat16"),
                                         ("barrier", "bfloat16")])
def test_half_tensor_cores_match_reference_and_repeat_exactly(sync, dtype, rng):
    """Products on tensor cores (mma.sync): batch 7 of the instruction's 8 rows, H = 1000 (K
    padded to 1024 with zeros), each exchange of h, float16 and bfloat16."""
    module = rnncc.compile("lstm", 33, 1000, 7, target="cuda", dtype=dtype,
                           knobs={"warps": 4, "mma": True, "sync": sync})
    assert module.metadata["schedule"]["persistent"]["plan"]["mma"]
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=100, entry="persistent")


@pytest.mark.parametrize("cell, hidden, batch, dtype, knobs", [
    ("lstm", 1024, 16, "float16", {"batch_groups": 1}), ("gru", 1024, 37, "bfloat16", {}),
    ("lstm", 1024, 64, "float16", {}), ("lstm", 512, 64, "bfloat16", {}),
    ("gru", 1000, 9, "float16", {"sync": "tagged", "max_blocks": 32}),
    ("lstm", 257, 40, "float16", {"batch_groups": 1, "sync": "grid", "mma": True})])
def test_tensor_core_tiles_of_batch_rows_match_reference(cell, hidden, batch, dtype, knobs,
                                                          rng):
    """Past 8 batch rows a group the tensor cores take tiles of 16 (a partial last one
    included): persistent by default up to 64 rows a group, against float64 at T = 1 and 100,
    lengths included, and the same bits run after run."""
    module = rnncc.compile(cell, 48, hidden, batch, target="cuda", dtype=dtype, knobs=knobs)
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["mma"] and batch // plan["batch_groups"] > 8
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=100, entry="persistent")
    lengths = compiled(cell, 48, hidden, batch, "cuda", dtype=dtype, lengths=True)
    assert lengths.metadata["schedule"]["persistent"]["plan"]["mma"]
    assert check_against_reference(lengths, rng, 30, True, lengths=True) < TOL[dtype]


@pytest.mark.parametrize("cell, c, h, n, dtype, mma", [
    ("gru", 40, 64, 128, "float16", False), ("lstm", 16, 100, 64, "bfloat16", False),
    ("lstm", 33, 200, 256, "float16", True), ("gru", 24, 320, 130, "bfloat16", True),
    ("lstm", 40, 768, 80, "float16", True)])
def test_half_layers_of_small_weights_in_batch_groups_match_reference(cell, c, h, n, dtype, mma,
                                                                      rng):
    """Layers of 16-bit weights of at most 4.5 MiB run persistently by default past 64 batch
    rows too, in batch groups: on the CUDA cores where K is one chunk of the tensor cores'
    (256 values; one row a group here), else on tensor cores through the barrier (5 groups
    of 26 rows at batch 130); against float64 at T = 1, 37 and 100, the same bits run after
    run."""
    module = rnncc.compile(cell, c, h, n, target="cuda", dtype=dtype)
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["mma"] == mma and plan["batch_groups"] > 1
    assert plan["sync"] == "barrier" or not mma
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=100, entry="persistent")


@pytest.mark.parametrize("cell, c, h, n, dtype, knobs, options", [
    ("lstm", 32, 32, 512, "float16", {}, {}), ("gru", 24, 24, 400, "float16", {}, {}),
    ("gru", 64, 64, 64, "float32", {}, {"lengths": True}), ("lstm", 20, 64, 1, "float32", {}, {}),
    ("gru", 40, 64, 256, "float32", {}, {"lengths": True}),
    ("gru_reset_before", 33, 33, 3, "float32", {}, {"lengths": True}),
    ("ln_lstm", 33, 33, 4, "float32", {}, {}),
    ("lstm", 16, 16, 64, "float16", {"mma": True, "max_blocks": 1}, {}),
    ("gru", 40, 48, 6, "bfloat16", {}, {"directions": 2, "lengths": True})])
def test_batch_groups_of_one_block_keep_h_within_it(cell, c, h, n, dtype, knobs, options, rng):
    """Small H, a batch group a block (tensor cores too, a cell that exchanges a value or
    means before h, both directions): h_t stays in the block's shared memory for the next
    step (``sync="local"``), K over groups of lanes; against float64 at T = 1, 37 and 100,
    lengths included, and the same bits run after run."""
    module = rnncc.compile(cell, c, h, n, target="cuda", dtype=dtype, knobs=knobs or None,
                           tuning="off", **options)
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["sync"] == "local"
    assert plan["blocks"] == plan["batch_groups"] * plan["directions"]
    lengths = options.get("lengths", False)
    check_across_steps(module, rng, lengths=lengths)
    if not lengths:
        check_repeats_exactly(module, rng, steps=100, entry="persistent")


@pytest.mark.parametrize("cell, c, h, n, dtype, groups", [
    ("gru", 24, 24, 400, "float16", True), ("lstm", 32, 32, 512, "float16", True),
    ("gru", 64, 64, 64, "float32", True), ("lstm", 20, 128, 7, "bfloat16", True),
    ("rnn_tanh", 3, 3, 5, "float32", True), ("gru", 24, 24, 400, "float16", False),
    ("lstm", 20, 33, 7, "float32", False)])
def test_small_k_on_cuda_cores_matches_reference(cell, c, h, n, dtype, groups, rng):
    """K under a 16-byte chunk of every lane (CUDA cores, planner: "Small K on the CUDA
    cores"): by default over groups of lanes, each group its own rows, the sums over the
    group's lanes only; with ``lane_groups=False`` in narrow chunks over all 32. Against
    float64 at T = 1, 37 and 100 and the same bits run after run."""
    module = rnncc.compile(cell, c, h, n, target="cuda", dtype=dtype, tuning="off",
                           knobs=None if groups else {"lane_groups": False})
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert (plan["lane_groups"] > 1) == groups and not plan["mma"]
    assert plan["lane_bytes"] == 16 if groups else plan["lane_bytes"] < 16
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=100, entry="persistent")


@pytest.mark.parametrize("cell, hidden, batch, dtype", [
    ("lstm", 2048, 32, "bfloat16"), ("gru", 2048, 64, "float16"), ("lstm", 1536, 64, "bfloat16")])
def test_h_staged_in_slices_matches_reference(cell, hidden, batch, dtype, rng):
    """Where h does not fit in shared memory next to the weights, it is staged in slices of
    K (planner: "Slices of K"; step 0 element by element from h_0, later steps copied, the
    next slice while the warps multiply one): against float64 at T = 1, 37 and 100, and the
    same bits run after run. The knob mma asks for the plan: at batch 64 a half layer of W_hh
    >= 16 MiB runs on the non-persistent schedule by default."""
    module = rnncc.compile(cell, 48, hidden, batch, target="cuda", dtype=dtype,
                           knobs={"mma": True})
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["mma"] and plan["k_slices"] > 1
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=30, repeats=5, entry="persistent")


@pytest.mark.parametrize("cell, c, h, n, dtype, options", [
    ("lstm", 1024, 1024, 128, "float16", {"lengths": True}),
    ("gru", 512, 1024, 100, "bfloat16", {"directions": 2, "lengths": True}),
    ("lstm", 512, 512, 256, "float16", {}),
    ("gru", 1024, 1024, 96, "float16", {"lengths": True}),
    (os.path.join(ROOT, "tests", "data", "coupled.py"), 512, 1024, 128, "float16", {}),
    ("lstm", 64, 1000, 79, "float16", {"directions": 2}),  # K past whole chunks
    ("lstm", 48, 200, 70, "bfloat16", {"lengths": True})])  # a last tile of 8 units of 16
def test_one_step_kernel_matches_reference(cell, c, h, n, dtype, options, rng):
    """cuda.wgmma_step (one step's recurrent product with the cell as its epilogue, one kernel
    a step) against float64 at T = 1 and 37: with lengths (y zero and the states kept past
    them), both directions, two row tiles, a user's cell; GRUs and the user's cell in tiles
    of h's rows (fed by the TMA engine at H 1024, by the warpgroups' copies at H 512), LSTMs
    in swapped tiles (W_hh the instructions' A), K past whole chunks, H past whole tiles."""
    module = rnncc.compile(cell, c, h, n, target="cuda", dtype=dtype, persistent="off",
                           **options)
    assert module.metadata["schedule"]["rules"]["step"] == "cuda.wgmma_step"
    for steps in (1, 37):
        assert check_against_reference(module, rng, steps, True,
                                        lengths=bool(options.get("lengths"))) < TOL[dtype]


def test_float16_persistent_ten_thousand_steps(rng):
    module = compiled("lstm", 64, 1024, 4, "cuda", dtype="float16")
    assert module.metadata["schedule"]["kind"] == "persistent"
    assert module.metadata["schedule"]["persistent"]["plan"]["mma"]  # on tensor cores
    assert check_against_reference(module, rng, 10000, True) < TOL["float16"]


def test_persistent_ten_thousand_steps(rng):
    module = compiled("gru", 64, 1024, 1, "cuda")
    assert module.metadata["schedule"]["kind"] == "persistent"
    assert check_against_reference(module, rng, 10000, True) < TOL_F32


def test_persistent_and_sequence_entries_agree(rng):
    module = compiled("lstm", 32, 257, 7, "cuda")
    w = {k: v.astype("float32") for k, v in random_weights(rng, 4, 32, 257).items()}
    x = rng.standard_normal((50, 7, 32)).astype("float32")
    y_p, _ = module(x, module.pack(w))
    y_s, _ = module(x, module.pack(w, entry="sequence"))
    np.testing.assert_allclose(y_p, y_s, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("knobs", [{}, {"sync": "barrier", "batch_groups": 1}])
def test_persistent_user_cell_whose_new_state_reads_the_previous_h(knobs, rng):
    """tests/data/coupled.py: c' reads the previous h, which the kernel's registers hold until
    h_t replaces it (c' read h_t before the kernel bound it first)."""
    module = rnncc.compile(os.path.join(ROOT, "tests", "data", "coupled.py"), 5, 33, 3,
                           target="cuda", knobs=knobs, persistent="on", tuning="off")
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, entry="persistent")


@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu"])
def test_tagged_exchange_survives_many_runs(cell, rng):
    """With plain volatile loads of the tagged words a plan of 9 blocks of 128 threads (H 33,
    h staged in two batches a thread; now one block, "local") deadlocked within 10 to 100
    runs of 37 steps on an H200: H 264 in one batch group, 33 blocks of 128 threads, h staged
    in batches of 8 words a thread."""
    module = rnncc.compile(cell, 5, 264, 7, target="cuda", dtype="float16",
                           knobs={"batch_groups": 1, "warps": 4, "sync": "tagged"})
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["sync"] == "tagged" and plan["blocks"] > 8 and plan["threads"] == 128
    w = {k: v.astype("float16") for k, v in random_weights(rng, 1, 5, 264).items()}
    packed = module.pack(w)
    x = rng.standard_normal((37, 7, 5)).astype("float16")
    first = module(x, packed)[0]
    for _ in range(200):
        np.testing.assert_array_equal(module(x, packed)[0], first)
    ref_y, _ = reference.run(rnncc.cells.get(cell), x, w, {})
    assert reference.relative_error(first.astype("float64"), ref_y) < TOL["float16"]


@pytest.mark.parametrize("cell, hidden, batch, layers", [
    ("lstm", 1024, 1, 1), ("gru", 512, 8, 2), ("lstm", 257, 6, 2)])
def test_overlapped_tagged_exchange_on_large_grids(cell, hidden, batch, layers, rng):
    """Overlapped input projections take the tagged exchange on grids past 32 blocks (LSTM
    1024: 128 blocks; GRU 512, 2 layers: 2 batch groups of 32 blocks a layer; LSTM 257: 3 of
    22, 2 rows each): within TOL of float64 and bit-identical over many runs."""
    module = rnncc.compile(cell, hidden, hidden, batch, target="cuda", layers=layers)
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["sync"] == "tagged" and plan["input_steps"] > 0 and plan["blocks"] > 32, plan
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=100, repeats=300)


def test_bidirectional_tagged_exchange_in_batch_groups_survives_many_runs():
    """LSTM 40 -> 132 at batch 33, both directions: 11 batch groups a direction of 6 blocks
    (22 units, 3 rows each), the tagged exchange. While a wait spun only in the lanes whose
    tag was behind, lanes fell behind their block (on an H200 the launch trapped in 20 of 21
    processes within 12 runs); the warp now waits as one. Run in a process of its own: a
    failure loses the CUDA context."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import rnncc
        sys.path.insert(0, "tests")
        from helpers import TOL, check_against_reference
        m = rnncc.compile("lstm", 40, 132, 33, target="cuda", directions=2, persistent="on",
                          tuning="off")
        plan = m.metadata["schedule"]["persistent"]["plan"]
        assert (plan["sync"], plan["batch_groups"], plan["units"]) == ("tagged", 11, 22), plan
        rng = np.random.default_rng(0)
        for steps in (37, 100):
            for r in range(6):
                err = check_against_reference(m, rng, steps, r % 2 == 0)
                assert err < TOL["float32"], (steps, err)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("cell, batch", [("lstm", 1), ("gru", 2), ("rnn_tanh", 4),
                                         ("lstm", 8)])
@pytest.mark.parametrize("persistent", ["auto", "off"])
def test_small_batch_input_projection_matches_reference(cell, batch, persistent, rng):
    """At batch 1-8 the input projections of all steps are one product of the T*N rows on
    cuda.sgemm (K in slices where the rows leave few tiles, chosen at run time from T); T
    around whole 128-row tiles checks the last tile's rows past T*N, in both entries."""
    module = compiled(cell, 24, 64, batch, "cuda", persistent=persistent)
    schedule = module.metadata["schedule"]
    assert schedule["rules"]["input_gemm"] == "cuda.sgemm"
    assert schedule["kind"] == ("persistent" if persistent == "auto" else "sequence")
    tile = 128 // batch
    for steps in (1, tile - 1, tile, tile + 1, 2 * tile + 3):
        err = check_against_reference(module, rng, steps, True)
        assert err < TOL_F32, f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("cell, input_size, hidden, batch, knobs", [
    ("gru", 1024, 1024, 4, None), ("lstm", 1024, 1024, 1, None), ("lstm", 33, 257, 3, 8),
    ("rnn_relu", 7, 3, 1, 8), ("lstm", 100, 64, 7, 5), ("rnn_tanh", 1, 33, 16, 64),
    ("lstm", 1536, 1536, 1, None), ("lstm", 1001, 1536, 3, 16),
    ("gru", 1030, 1024, 2, {"input_rows": 16, "batch_groups": 2}),
    ("lstm", 33, 257, 6, {"input_rows": 8, "batch_groups": 3})])
def test_fused_input_projection_matches_reference_and_repeats_exactly(cell, input_size, hidden,
                                                                      batch, knobs, rng):
    """The persistent kernel computing its own input projections (by default at C >= 1024,
    N <= 4; forced with ``input_rows``, the int given here): odd C (one element a load),
    groups of rows of x that cross steps and pass T*N, one step, W_ih in slabs through
    W_hh's shared memory (LSTM H=1536, GRU 1024 in 2 batch groups), batch groups. Without
    tuning logs (GRU 1024 N=4's runs in 2 batch groups, unfused)."""
    if isinstance(knobs, int):
        knobs = {"input_rows": knobs}
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", tuning="off",
                           knobs=knobs)
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent" and schedule["persistent"]["plan"]["input_rows"]
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng)


@pytest.mark.parametrize("cell, input_size, hidden, batch, knobs", [
    ("gru", 1024, 1024, 4, None), ("lstm", 1024, 1024, 4, None),
    ("lstm", 1001, 257, 3, {"input_steps": 4, "sync": "tagged"}),
    ("rnn_tanh", 33, 64, 1, {"input_steps": 8, "sync": "grid"}),
    ("gru", 100, 129, 2, {"input_steps": 4, "sync": "barrier", "batch_groups": 2}),
    ("gru", 1028, 1024, 4, {"input_steps": 5}),
    ("rnn_relu", 7, 3, 4, {"input_steps": 1, "batch_groups": 1})])
def test_overlapped_input_projection_matches_reference_and_repeats_exactly(
        cell, input_size, hidden, batch, knobs, rng):
    """The fused input projection overlapped with the time loop (by default at C = 1024, N =
    4: eight steps a group; LSTM with a chunk of W_hh in shared memory; forced with
    ``input_steps``): every synchronisation variant, x copied
    asynchronously (C % 4 == 0) or staged one element a load (odd C), slabs of K that pass
    C, groups of steps that pass T (T = 1, 37, 100), batch groups, one step a group."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", tuning="off",
                           knobs=knobs, persistent="on")
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["input_steps"] == (knobs or {}).get("input_steps", 8)
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng)


@pytest.mark.parametrize("cell", persistent_cells())
@pytest.mark.parametrize("input_size, hidden, batch, knobs, dtype", [
    (33, 257, 6, {"batch_groups": 3}, "float32"),
    (7, 33, 4, {"batch_groups": 2, "sync": "barrier"}, "float32"),
    (1, 3, 7, {"batch_groups": 7}, "float32"),
    (16, 64, 40, {"batch_groups": 4}, "float32"),
    (40, 129, 4, {"batch_groups": 2, "sync": "grid"}, "float16")])
def test_batch_groups_match_reference_and_repeat_exactly(cell, input_size, hidden, batch, knobs,
                                                         dtype, rng):
    """The grid split into batch groups (each its own exchange of h, one packing of W_hh):
    every synchronisation variant, odd sizes, a batch over 16, one step."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           knobs=knobs, persistent="on")
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["batch_groups"] == knobs["batch_groups"]
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng)


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, options", [
    ("lstm", 72, 72, 3, "float32", {}), ("gru", 33, 106, 4, "float32", {"lengths": True}),
    ("lstm", 128, 128, 1, "float32", {}), ("lstm", 40, 128, 4, "float16", {"directions": 2}),
    ("rnn_tanh", 16, 256, 1, "float32", {}), ("lstm", 87, 87, 7, "float32", {"lengths": True}),
    ("gru", 1024, 128, 2, "float32", {}), ("lstm", 256, 256, 1, "float32", {}),
    ("gru", 250, 250, 3, "float32", {"lengths": True}), ("rnn_relu", 40, 500, 2, "float32", {}),
    ("lstm", 255, 255, 8, "float16", {}), ("lstm", 17, 241, 1, "bfloat16", {}),
    ("lstm", 96, 96, 16, "float32", {"lengths": True}), ("lstm", 33, 200, 16, "float16", {}),
    ("gru", 64, 130, 12, "float32", {}), ("lstm", 384, 384, 1, "float32", {}),
    ("gru", 77, 512, 3, "float32", {"lengths": True}), ("lstm", 288, 288, 12, "float32", {}),
    ("lstm", 40, 512, 2, "float16", {}), ("gru", 640, 640, 8, "float16", {"lengths": True})])
def test_cluster_exchange_matches_reference_and_repeats_exactly(cell, input_size, hidden, batch,
                                                                dtype, options, rng):
    """Batch groups of 2 to 16 blocks as thread-block clusters, h put into each other's shared
    memory (planner: "A cluster a group"): odd sizes, lengths, both directions, half weights,
    a fused input projection (C 1024), groups the planner narrows to a cluster (H 241-500),
    batches it splits into fewer groups that are clusters (12, 16), and clusters of more than
    8 blocks, a non-portable size (H 384-640)."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           persistent="on", tuning="off", **options)
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "cluster"
    check_across_steps(module, rng, lengths=options.get("lengths", False))
    check_repeats_exactly(module, rng)


def test_cluster_exchange_ten_thousand_steps(rng):
    """The slots' barriers of the cluster exchange phase after phase over a long sequence."""
    module = rnncc.compile("gru", 106, 106, 4, target="cuda", persistent="on", tuning="off")
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "cluster"
    assert check_against_reference(module, rng, 10000, True) < TOL_F32


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, lengths", [
    ("lstm", 42, 128, 67, "float32", False), ("lstm", 42, 128, 255, "float32", True),
    ("gru", 256, 256, 47, "float32", False), ("gru", 96, 512, 67, "float16", True),
    ("lstm", 33, 256, 47, "float16", False)])
def test_padded_batch_matches_reference_and_repeats_exactly(cell, input_size, hidden, batch,
                                                            dtype, lengths, rng):
    """A batch without a split into equal groups that fits runs persistently on a few rows
    more (planner: "Padded batch"): on the CUDA cores and tensor cores, with lengths."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           persistent="on", tuning="off", lengths=lengths)
    assert module.metadata["schedule"]["persistent"]["plan"]["pad"] > 0
    check_across_steps(module, rng, lengths=lengths)
    check_repeats_exactly(module, rng)


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, sms", [
    ("gru", 33, 1024, 3, "float32", 16), ("lstm", 7, 777, 2, "float32", 8),
    ("rnn_tanh", 40, 1500, 1, "float32", 8), ("gru", 64, 2048, 4, "float32", None)])
def test_streaming_plan_matches_reference_and_repeats_exactly(cell, input_size, hidden, batch,
                                                               dtype, sms, rng):
    """Plans for fewer multiprocessors (or GRU 2048 N=4, as compiled for the H100/H200) keep
    part of the weights in global memory, read from L2 each step."""
    module = compiled(cell, input_size, hidden, batch, "cuda", dtype=dtype, sms=sms)
    schedule = module.metadata["schedule"]
    assert schedule["kind"] == "persistent"
    assert schedule["persistent"]["plan"]["global_chunks"] > 0
    check_across_steps(module, rng)
    check_repeats_exactly(module, rng, steps=50, repeats=5, pack=False)


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 80, 33, 3), ("gru", 65, 33, 7), ("rnn_relu", 200, 65, 1)])
@pytest.mark.parametrize("persistent", ["auto", "off"])
def test_float16_input_projection_on_tensor_cores(cell, input_size, hidden, batch, persistent,
                                                  rng):
    """float16: the input GEMM of all steps sees [T*N, C] rows and runs on tensor cores (odd
    T*N, C and G*H padded by dlight's rule; on sm_90 LSTM 80 -> 33's, K and O past whole
    tiles, on warpgroup MMA), in both entries."""
    module = compiled(cell, input_size, hidden, batch, "cuda", dtype="float16",
                      persistent=persistent)
    schedule = module.metadata["schedule"]
    assert schedule["layout"]["flat_rows"]
    assert any(mma in module.source("cuda") for mma in ("mma_sync", "wgmma.mma_async"))
    assert schedule["kind"] == ("persistent" if persistent == "auto" else "sequence")
    check_across_steps(module, rng)


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 32, 64, 32), ("gru", 16, 512, 64)])
def test_tiled_gemm_matches_reference(cell, input_size, hidden, batch, rng):
    """float16 input projections of all steps at batch 32 and 64 (float32's: cuda.sgemm)."""
    module = compiled(cell, input_size, hidden, batch, "cuda", dtype="float16")
    rules = module.metadata["schedule"]["rules"]
    assert rules["input_gemm"] == "cuda.tiled_gemm"
    assert rules["recurrent_gemm"] == "cuda.mma_gemv"
    for steps, initial in ((1, True), (37, True), (5, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL["float16"], f"T={steps}: relative error {err:.3e}"


def on_this_gpu(rule: str) -> str:
    """The rule expected on this GPU: cuda.wgmma_gemm's products are cuda.mma_gemm's before
    sm_90."""
    import tvm

    hopper = tvm.cuda().compute_version == "9.0"
    return "cuda.mma_gemm" if rule == "cuda.wgmma_gemm" and not hopper else rule


def within_at_two_lengths(module, rng, bound, lengths=False):
    """``module`` within ``bound`` of float64 at T = 1 from given initial states and at T = 37
    from zeros (:func:`check_against_reference`; ``lengths``: the samples' own)."""
    for steps, initial in ((1, True), (37, False)):
        err = check_against_reference(module, rng, steps, initial, lengths=lengths)
        assert err < bound, f"T={steps}: relative error {err:.3e}"


def step_product_rule(rules: dict) -> str:
    """The rule of each step's recurrent product: of its slices of K where it is left in
    them."""
    return rules.get("recurrent_gemm_parts", rules["recurrent_gemm"])


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype", [
    ("lstm", 128, 64, 33, "float16"), ("gru", 256, 128, 64, "bfloat16"),
    ("rnn_tanh", 64, 128, 9, "bfloat16"), ("gru", 416, 416, 98, "bfloat16"),
    ("lstm", 136, 64, 33, "float16")])
def test_half_products_of_all_steps_on_tensor_cores_match_reference(cell, input_size, hidden,
                                                                    batch, dtype, rng):
    """float16 / bfloat16: the input projection of all steps on cuda.wgmma_gemm (sm_90;
    flat rows in float16, T x N in bfloat16; a partial last row tile; K and O past whole
    chunks and tiles in the last two) and each step's on cuda.mma_gemv."""
    module = compiled(cell, input_size, hidden, batch, "cuda", dtype=dtype, persistent="off",
                      fused_step=False)
    rules = module.metadata["schedule"]["rules"]
    assert (rules["input_gemm"], rules["recurrent_gemm"]) == (
        on_this_gpu("cuda.wgmma_gemm"), "cuda.mma_gemv")
    within_at_two_lengths(module, rng, TOL[dtype])


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, options", [
    ("lstm", 161, 256, 40, "float32", {"persistent": "off", "lengths": True}),
    ("gru", 13, 512, 4, "float32", {}),  # persistent, the input GEMM before the kernel
    ("lstm", 257, 1024, 64, "float16", {}),
    ("gru", 39, 128, 9, "bfloat16", {"directions": 2, "lengths": True}),
    ("rnn_tanh", 161, 64, 3, "float32", {"persistent": "off", "allow_tf32": True})])
def test_input_sizes_off_whole_copies_match_reference(cell, input_size, hidden, batch, dtype,
                                                      options, rng):
    """C whose rows are not whole 16-byte copies: x copied with zeros past C and W_ih packed
    so for the input projection of all steps (both schedules, both directions, lengths,
    TF32), within the dtype's bound of float64 (TF32's: past float32's)."""
    module = rnncc.compile(cell, input_size, hidden, batch, dtype=dtype, target="cuda",
                           tuning="off", **options)
    rules = module.metadata["schedule"]["rules"]
    product = rules["input_gemm_lengths" if "input_gemm_lengths" in rules else "input_gemm"]
    assert rules["pad_x"] == "cuda.elementwise" and product != "cuda.matmul"
    bound = TOL_TF32 if options.get("allow_tf32") else TOL[dtype]
    within_at_two_lengths(module, rng, bound, options.get("lengths", False))


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, options", [
    ("lstm", 96, 1000, 128, "float16", {}),
    ("gru", 64, 600, 79, "bfloat16", {"lengths": True}),
    ("lstm", 64, 1000, 64, "float32", {"allow_tf32": True}),
    ("rnn_tanh", 32, 952, 79, "float16", {"directions": 2}),
    ("gru", 64, 300, 96, "bfloat16", {}),  # rows of h 600 bytes: copies of 8
    ("lstm", 64, 1024, 256, "float16", {}),  # swapped, whole (b added): N in two tiles of 128
    ("gru", 48, 1024, 37, "bfloat16", {"lengths": True}),  # swapped, tiles of 40 rows of h
    ("lstm", 32, 600, 191, "float16", {"directions": 2}),  # swapped, two tiles of 96
    ("rnn_tanh", 64, 1024, 100, "float32", {"allow_tf32": True})])  # swapped, TF32
def test_one_step_products_past_whole_tiles_match_reference(cell, input_size, hidden, batch,
                                                            dtype, options, rng):
    """Not persistent, 16-bit or TF32, a kernel each: each step's product on warpgroup MMA,
    whose K or O is off whole chunks and tiles (H 1000, 600, 952, 300; in slices of K whose
    last is shorter), or in swapped tiles (W_hh as the instructions' A, h's N rows as B, not
    padded to 64 or 128), within the dtype's bound of float64; T 1 and 37, lengths, both
    directions."""
    module = rnncc.compile(cell, input_size, hidden, batch, dtype=dtype, target="cuda",
                           tuning="off", persistent="off", fused_step=False, **options)
    assert step_product_rule(module.metadata["schedule"]["rules"]) == "cuda.wgmma_gemm"
    bound = TOL_TF32 if options.get("allow_tf32") else TOL[dtype]
    within_at_two_lengths(module, rng, bound, options.get("lengths", False))


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("rnn_tanh", 64, 1008, 178), ("gru", 80, 720, 48)])
def test_one_step_sgemm_in_uneven_slices_matches_reference(cell, input_size, hidden, batch,
                                                           rng):
    """IEEE float32, not persistent: each step's product on cuda.sgemm in slices of K whose
    last is partly past K (1008 and 720: odd counts of 16-value pairs), summed by its second
    kernel, within float32's bound of float64; T 1 and 37, with lengths."""
    for lengths in (False, True):
        module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", tuning="off",
                               persistent="off", tf32x3=False, lengths=lengths)
        rules = module.metadata["schedule"]["rules"]
        assert rules["recurrent_gemm"] == "cuda.sgemm"
        within_at_two_lengths(module, rng, TOL_F32, lengths)


@pytest.mark.parametrize("cell, input_size, hidden, batch, step_rule", [
    ("lstm", 64, 256, 16, "cuda.mma_gemv"), ("gru", 96, 512, 64, "cuda.mma_gemv"),
    ("rnn_tanh", 32, 1024, 9, "cuda.mma_gemv"), ("gru", 128, 1024, 130, "cuda.wgmma_gemm"),
    ("gru", 96, 128, 64, "cuda.sgemm"),  # 48 blocks of 8 rows at most: IEEE
    ("lstm", 64, 1024, 16, "cuda.wgmma_gemm"), ("lstm", 64, 2048, 7, "cuda.small_batch_gemv"),
    ("lstm", 64, 2048, 12, "cuda.mma_stream_gemv"),
    ("gru", 64, 2048, 16, "cuda.mma_stream_gemv"),
    ("lstm", 64, 2560, 9, "cuda.mma_stream_gemv")])  # 10 warps a part, 128 blocks
def test_tf32_products_match_reference(cell, input_size, hidden, batch, step_rule, rng):
    """allow_tf32=True: the products of all steps (cuda.wgmma_gemm on sm_90) and each step's
    (cuda.mma_gemv where its grid is large enough, slices of K from batch 16 where they fill
    the GPU: one wave of 64-row tiles, 48 rows empty; weights of 48 MiB and more at batch
    8-16 streamed, cuda.mma_stream_gemv) in TF32, but such weights below batch 8 (IEEE:
    cuda.small_batch_gemv), within TF32's bound of float64 and past float32's (the
    operands of the products of all steps are rounded: TF32 ran), a
    partial last tile of batch rows; the same module without allow_tf32 stays within
    float32's."""
    module = compiled(cell, input_size, hidden, batch, "cuda", persistent="off",
                      allow_tf32=True, fused_step=False)
    rules = module.metadata["schedule"]["rules"]
    assert module.allow_tf32
    assert (rules["input_gemm"], step_product_rule(rules)) == (
        on_this_gpu("cuda.wgmma_gemm"), on_this_gpu(step_rule))
    for steps, initial in ((1, True), (37, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert TOL_F32 < err < TOL_TF32, f"T={steps}: relative error {err:.3e}"
    ieee = compiled(cell, input_size, hidden, batch, "cuda", persistent="off")
    assert check_against_reference(ieee, rng, 37, False) < TOL_F32


@pytest.mark.parametrize("cell, input_size, hidden, batch, rules", [
    ("lstm", 256, 512, 256, ("cuda.wgmma_gemm",) * 2),
    ("gru", 96, 1024, 130, ("cuda.wgmma_gemm",) * 2),
    ("rnn_tanh", 64, 1024, 67, ("cuda.wgmma_gemm",) * 2),  # a partial last tile of batch rows
    ("lstm", 64, 1024, 16, ("cuda.wgmma_gemm", "cuda.small_batch_gemv")),
    ("gru", 64, 1024, 33, ("cuda.wgmma_gemm", "cuda.mma_gemm")),  # one tile, 31 rows past N
    ("lstm", 100, 1000, 45, ("cuda.wgmma_gemm",) * 2),  # O 4000 past whole tiles
    ("gru", 200, 1500, 96, ("cuda.wgmma_gemm",) * 2),  # K 1500 past whole chunks
    ("gru", 40, 257, 64, ("cuda.matmul",) * 2)])  # O off whole tiles
def test_tf32x3_products_match_reference_as_ieee_float32(cell, input_size, hidden, batch,
                                                          rules, rng):
    """tf32x3=True: the products of all steps, and each step's from batch 32, as three TF32
    products on cuda.wgmma_gemm (cuda.mma_gemm before sm_90 and a step's to batch 64 of whole
    tiles; K or O past them on cuda.wgmma_gemm only, K a multiple of 4), within a
    fifth of float32's bound of float64 (IEEE float32's FMAs give about 5e-7 at these sizes);
    the step's at batch 16 and O off whole tiles on the CUDA cores; lengths keep the products
    of all steps there."""
    module = compiled(cell, input_size, hidden, batch, "cuda", persistent="off", tf32x3=True)
    found = module.metadata["schedule"]["rules"]
    assert not module.allow_tf32
    assert (found["input_gemm"], step_product_rule(found)) == tuple(map(on_this_gpu, rules))
    within_at_two_lengths(module, rng, TOL_F32 / 5)
    lengths = rnncc.compile(cell, input_size, hidden, batch, target="cuda", persistent="off",
                            tuning="off", lengths=True, tf32x3=True)
    assert lengths.metadata["schedule"]["rules"]["input_gemm_lengths"] != "cuda.mma_gemm"
    assert check_against_reference(lengths, rng, 37, False, lengths=True) < TOL_F32


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 128, 256, 16), ("gru", 40, 257, 37)])
def test_tf32_products_with_lengths_match_reference(cell, input_size, hidden, batch, rng):
    """allow_tf32=True with lengths, not persistent: the masked step keeps the states of
    finished samples and writes its TF32-rounded copy of h for the next step's product, within
    TF32's bound of float64 and past float32's (the products ran in TF32)."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", allow_tf32=True,
                           persistent="off", tuning="off", lengths=True)
    assert module.allow_tf32
    for steps, initial in ((1, True), (37, False), (100, True)):
        err = check_against_reference(module, rng, steps, initial, lengths=True)
        assert TOL_F32 < err < TOL_TF32, f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 64, 256, 32), ("gru", 48, 512, 9), ("lstm", 33, 512, 40), ("rnn_tanh", 16, 257, 24),
    ("gru", 40, 333, 17), ("lstm", 64, 1024, 16)])
def test_tf32_persistent_kernel_matches_reference(cell, input_size, hidden, batch, rng):
    """allow_tf32=True and the knob mma=True: the persistent kernel's products on tensor cores
    in TF32 (m16n8k8, whole tiles of 16 batch rows, a partial last one; batch groups; padded
    rows; weights in registers and shared memory), within TF32's bound of float64 and past
    float32's; the same bits run to run. Without the knob, the CUDA cores' float32 plan."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", allow_tf32=True,
                           knobs={"mma": True})
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["mma"], module.metadata["schedule"]
    for steps, initial in ((1, True), (23, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert TOL_F32 < err < TOL_TF32, f"T={steps}: relative error {err:.3e}"
    check_repeats_exactly(module, rng, steps=17, repeats=3)


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 40, 256, 200), ("gru", 96, 384, 130)])
def test_tf32_past_one_group_is_persistent_on_tensor_cores(cell, input_size, hidden, batch,
                                                          rng):
    """allow_tf32=True past batch 64 where the step's product would be on the CUDA cores:
    the persistent kernel on tensor cores in batch groups by default, within TF32's bound of
    float64; the same bits run to run."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", allow_tf32=True)
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["mma"] and plan["batch_groups"] > 1, module.metadata["schedule"]
    for steps, initial in ((1, True), (23, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL_TF32, f"T={steps}: relative error {err:.3e}"
    check_repeats_exactly(module, rng, steps=17, repeats=3)


def test_nn_tf32_where_allowed(torch, rng):
    """rnncc.nn with allow_tf32=True: a 2-layer GRU at batch 40 (bucket 64) within TF32's
    bound of torch's float64; its modules say TF32 is allowed."""
    theirs = torch.nn.GRU(64, 128, num_layers=2)
    ours = rnncc.nn.from_torch(theirs, allow_tf32=True).cuda()
    x = torch.randn(21, 40, 64)
    with torch.no_grad():
        mine = [t.double().cpu().numpy() for t in ours(x.cuda())]
        expect = [t.numpy() for t in theirs.double()(x.double())]
    for a, b in zip(mine, expect):
        assert reference.relative_error(a, b) < TOL_TF32
    network = next(iter(ours._networks.values()))
    assert all(n.allow_tf32 for n in network._compiled.values())


@pytest.mark.parametrize("cell, input_size, hidden, batch, rule", [
    ("lstm", 64, 256, 9, "cuda.mma_gemv"), ("gru", 48, 512, 33, "cuda.mma_gemv"),
    ("rnn_tanh", 32, 128, 100, "cuda.mma_gemv"), ("lstm", 40, 1024, 64, "cuda.wgmma_gemm"),
    ("rnn_relu", 16, 96, 17, "cuda.mma_gemv"), ("gru", 32, 256, 200, "cuda.mma_gemv"),
    ("lstm", 48, 512, 250, "cuda.wgmma_gemm"), ("lstm", 40, 1024, 33, "cuda.wgmma_gemm")])
def test_tensor_core_step_product_matches_reference(cell, input_size, hidden, batch, rule, rng):
    """Each step's recurrent projection in float16 on tensor cores: cuda.mma_gemv (batch rows
    past N in the last 16-row tile, chunks of K of 32 to 256, one and two 8-row tiles a warp)
    and, at batch 32 and more where its slices fill the GPU, cuda.wgmma_gemm on sm_90 (one
    wave of slices of K; a partial last tile of 64 rows, at batch 33 31 of them empty, past
    64 of 128 rows), cuda.mma_gemm before it; not the one-step kernel (cuda.wgmma_step, its
    own test), which takes the product into the cell's kernel."""
    module = compiled(cell, input_size, hidden, batch, "cuda", dtype="float16",
                      persistent="off", fused_step=False)
    assert step_product_rule(module.metadata["schedule"]["rules"]) == on_this_gpu(rule)
    for steps, initial in ((1, True), (29, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL["float16"], f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("cell, input_size, hidden, batch, rows_per_warp", [
    ("lstm", 64, 2048, 4, 4), ("lstm", 32, 1024, 16, 4), ("gru", 96, 1024, 3, 2),
    ("lstm", 16, 2048, 8, 8), ("gru", 64, 2048, 24, 2), ("rnn_tanh", 32, 512, 7, 1),
    ("gru", 16, 256, 2, 1), ("lstm", 64, 2048, 1, 1), ("gru", 33, 96, 1, 1),
    ("rnn_tanh", 16, 2049, 17, 1), ("gru", 48, 1100, 31, 1), ("lstm", 64, 2048, 16, 4)])
def test_small_batch_gemv_matches_reference(cell, input_size, hidden, batch, rows_per_warp,
                                            rng):
    """Each step's recurrent projection at batch 1-31, RW rows a warp (1, 2, 4 and 8: the
    grid's size decides), odd batches included; h staged in shared memory a chunk of K at a
    time where it is over 128 KiB (K 2049: the last chunk part past K, one warp a block); W
    loaded past L1 in 4-warp blocks (LSTM 2048 at batch 16)."""
    from rnncc.schedules import cuda_small_batch_gemv

    module = compiled(cell, input_size, hidden, batch, "cuda", persistent="off")
    assert module.metadata["schedule"]["rules"]["recurrent_gemm"] == "cuda.small_batch_gemv"
    gates = rnncc.cells.get(cell).gates
    assert cuda_small_batch_gemv.rows_per_warp(batch, gates * hidden) == rows_per_warp
    for steps, initial in ((1, True), (23, False)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL_F32, f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("cell, input_size, hidden, batch", [
    ("lstm", 32, 256, 32), ("gru", 48, 128, 64), ("rnn_tanh", 16, 128, 33),
    ("rnn_relu", 160, 256, 96), ("lstm", 32, 32, 40), ("lstm", 36, 1000, 33),
    ("gru", 100, 700, 40), ("lstm", 24, 40, 32), ("gru", 64, 64, 96), ("rnn_tanh", 16, 64, 64),
    ("gru", 32, 320, 64)])
def test_sgemm_matches_reference(cell, input_size, hidden, batch, rng):
    """The SGEMM of all steps' input projections, with T*N rows that fill no 128-row tile
    (T = 1), part of the last (T = 37) or whole tiles (T = 100 at N = 32 or 64); and of each
    step's recurrent projection, in 64-row tiles (N = 96: one and a half) and 1 to 8 slices
    of K (hidden 32, 128, 256, 700, 1000); odd sizes: O not whole tiles of 128 (4000, 2100), K
    not whole pairs of chunks of 8 (36, 100, 700, 1000); IEEE float32 on the CUDA cores
    (tf32x3 off)."""
    module = compiled(cell, input_size, hidden, batch, "cuda", persistent="off", tf32x3=False)
    rules = module.metadata["schedule"]["rules"]
    assert rules["input_gemm"] == rules["recurrent_gemm"] == "cuda.sgemm"
    for steps, initial in ((1, True), (37, False), (100, True)):
        err = check_against_reference(module, rng, steps, initial)
        assert err < TOL_F32, f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("batch, depth, outputs, weights", [
    (1, 4096, 1024, "rows"), (3, 256, 128, "rows"), (64, 1024, 512, "rows"),
    (1, 4096, 1024, "cols"), (64, 1024, 512, "cols"), (64, 512, 2048, "rows")])
def test_sgemm_of_all_steps_matches_reference_split_or_not(torch, batch, depth, outputs,
                                                           weights, rng):
    """The SGEMM of all steps with the slices of K of its tail (the tiles past the last whole
    wave of blocks) chosen at run time: T = 1 and 7 (no whole wave: the most slices), 100
    (fewer, or none at batch 64 and O = 512; at O = 2048 three whole waves and a tail of 8
    tiles in 8 slices) and 2000 (at batch 64 and O = 512 15 whole waves and a tail of 40 tiles
    in 4 slices), the output poisoned, against float64; weights as PyTorch's rows [O, K] or as
    columns [K, O] (dx = dGI W_ih)."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from rnncc.lowering import components as comp
    from rnncc.schedules import cuda_sgemm
    from rnncc.target import TargetSpec

    gemm = comp.gemm((tirx.Var("T", "int64"), batch), depth, outputs, weights, "float32")
    func = cuda_sgemm.kernel(cuda_sgemm.sizes(gemm)).with_attr("global_symbol", "g")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=TargetSpec("cuda").tvm_target())
    w, b = rng.standard_normal((outputs, depth)), rng.standard_normal(outputs)
    for steps in (1, 7, 100, 2000):
        a = rng.standard_normal((steps, batch, depth))
        out = torch.full((steps, batch, outputs), float("nan"), device="cuda")
        given = w if weights == "rows" else np.ascontiguousarray(w.T)
        args = [torch.tensor(v, dtype=torch.float32, device="cuda") for v in (a, given, b)]
        lib["g"](*(tvm_ffi.from_dlpack(t) for t in (*args, out)))
        torch.cuda.synchronize()
        err = reference.relative_error(out.cpu().double().numpy(), a @ w.T + b)
        assert err < TOL_F32, f"T={steps}: relative error {err:.3e}"


@pytest.mark.parametrize("outputs, depth, dtypes", [
    (4096, 1024, ("float32",) * 3), (512, 256, ("float32",) * 3), (99, 33, ("float32",) * 3),
    (128, 32, ("float16",) * 3), (600, 200, ("bfloat16", "float32", "bfloat16"))])
def test_weight_grad_matches_reference(torch, outputs, depth, dtypes, rng):
    """A weight's gradient dw = g^T a over M = 1, 7, 100 and 3001 rows (whole chunks, part of
    one, slices with nothing past M), unsplit and split along M (in 256 slices at 128 x 32),
    O and K off whole tiles, 16-bit operands and dw (g, a, dw in ``dtypes``; where the
    tensor-core rules refuse them), dw poisoned, against float64 of the rounded operands."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from rnncc import schedules
    from rnncc.lowering import components as comp
    from rnncc.target import TargetSpec

    g_dtype, a_dtype, dw_dtype = (getattr(torch, d) for d in dtypes)
    torch.manual_seed(int(rng.integers(1 << 30)))
    target = TargetSpec("cuda").tvm_target()
    scheduled = schedules.schedule(comp.weight_gradient(tirx.Var("M", "int64"), outputs, depth,
                                                        *dtypes[::-1]), target, "reduction")
    assert scheduled.rule == "cuda.weight_grad"
    lib = tvm.compile(tvm.IRModule({"main": scheduled.func.with_attr("global_symbol", "g")}),
                      target=target)
    for rows in (1, 7, 100, 3001):
        g = torch.randn(rows, outputs, dtype=torch.float64).to(g_dtype).cuda()
        a = torch.randn(rows, depth, dtype=torch.float64).to(a_dtype).cuda()
        dw = torch.full((outputs, depth), float("nan"), dtype=dw_dtype, device="cuda")
        lib["g"](*(tvm_ffi.from_dlpack(t) for t in (g, a, dw)))
        torch.cuda.synchronize()
        want = g.cpu().double().T @ a.cpu().double()
        err = reference.relative_error(dw.cpu().double().numpy(), want.numpy())
        bound = TOL_F32 if dtypes[2] == "float32" else 1e-2
        assert err < bound, f"M={rows}: relative error {err:.3e}"


@pytest.mark.parametrize("outputs, depth, a_dtype", [
    (4096, 1024, "bfloat16"), (4096, 1024, "float32"), (1024, 128, "float16"),
    (512, 128, "float16"), (512, 128, "float32"), (256, 512, "bfloat16")])
def test_half_weight_grad_on_tensor_cores_matches_reference(torch, outputs, depth, a_dtype, rng):
    """A half layer's weight gradient dw = g^T a, g in the weights' type (as a half training
    step writes dGI), a in it (x) or float32 (the kept h), on tensor cores (cuda.wgmma_gemm
    with both operands MN-major on Hopper, cuda.mma_gemm before) over M = 1, 7, 100 and 3001
    rows (chunks partly past M; on Hopper, few tiles split M in 16 or 32 slices, most of them
    past M at small M), dw poisoned, against float64 of the rounded operands."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from rnncc import schedules
    from rnncc.lowering import components as comp
    from rnncc.schedules.cuda_mma_gemm import HALF_GRADIENT_MIN_TILES
    from rnncc.target import TargetSpec

    dtype = "float16" if a_dtype == "float16" else "bfloat16"
    half = getattr(torch, dtype)
    torch.manual_seed(int(rng.integers(1 << 30)))
    target = TargetSpec("cuda").tvm_target()
    scheduled = schedules.schedule(comp.weight_gradient(tirx.Var("M", "int64"), outputs, depth,
                                                        dtype, a_dtype, dtype), target,
                                   "reduction")
    want = on_this_gpu("cuda.wgmma_gemm")
    if want == "cuda.mma_gemm" and outputs * depth < HALF_GRADIENT_MIN_TILES * 128 * 128:
        want = "cuda.weight_grad"  # few tiles split on the CUDA cores before Hopper
    assert scheduled.rule == want
    lib = tvm.compile(tvm.IRModule({"main": scheduled.func.with_attr("global_symbol", "g")}),
                      target=target)
    for rows in (1, 7, 100, 3001):
        g = torch.randn(rows, outputs).to(half).cuda()
        a = torch.randn(rows, depth).to(getattr(torch, a_dtype)).cuda()
        dw = torch.full((outputs, depth), float("nan"), dtype=half, device="cuda")
        lib["g"](*(tvm_ffi.from_dlpack(t) for t in (g, a, dw)))
        torch.cuda.synchronize()
        want = g.double().cpu().numpy().T @ a.to(half).double().cpu().numpy()
        err = reference.relative_error(dw.cpu().double().numpy(), want)
        assert err < 2.0 ** -(8 if dtype == "bfloat16" else 10), f"M={rows}: {err:.3e}"


@pytest.mark.parametrize("outputs, dtype, g_dtype", [
    (4096, "float32", "float32"), (33, "float32", "float32"), (132, "float16", "float32"),
    (4096, "bfloat16", "bfloat16")])
def test_column_sum_matches_reference(torch, outputs, dtype, g_dtype, rng):
    """A bias's gradient db = sum of g's rows over M = 1, 7, 100 and 3001 rows (fewer rows than
    lanes, part of an unrolled round, many rounds; M in 2, 64, 32 and 2 slices, most of them
    empty at small M), db poisoned, against float64; nothing written past O; g in float32
    or, as a half training step writes it, in the layer's dtype."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    from rnncc import schedules
    from rnncc.lowering import components as comp
    from rnncc.target import TargetSpec

    target = TargetSpec("cuda").tvm_target()
    scheduled = schedules.schedule(comp.column_sum(tirx.Var("M", "int64"), outputs, dtype,
                                                   g_dtype), target, "reduction")
    assert scheduled.rule == "cuda.column_sum"
    lib = tvm.compile(tvm.IRModule({"main": scheduled.func.with_attr("global_symbol", "cs")}),
                      target=target)
    for rows in (1, 7, 100, 3001):
        g = rng.standard_normal((rows, outputs))
        poisoned = torch.full((outputs + 64,), float("nan"), dtype=getattr(torch, dtype),
                              device="cuda")
        db = poisoned[:outputs]
        arg = torch.tensor(g, dtype=getattr(torch, g_dtype), device="cuda")
        lib["cs"](tvm_ffi.from_dlpack(arg), tvm_ffi.from_dlpack(db))
        torch.cuda.synchronize()
        assert poisoned[outputs:].isnan().all()
        err = reference.relative_error(db.cpu().double().numpy(),
                                       arg.cpu().double().numpy().sum(axis=0))
        bound = {"float32": TOL_F32, "float16": 2e-3, "bfloat16": 8e-3}[dtype]
        assert err < bound, f"M={rows}: {err:.3e}"


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, knobs, persistent", [
    ("lstm", 32, 257, 7, "float32", {"sync": "tagged"}, "on"),
    ("gru", 1024, 1024, 4, "float32", None, "on"),  # overlapped input projection
    ("lstm", 33, 1000, 7, "float16", {"warps": 4, "mma": True, "sync": "barrier"}, "on"),
    ("rnn_tanh", 16, 64, 40, "float32", {"batch_groups": 4, "sync": "grid"}, "on"),
    ("lstm", 24, 64, 5, "float32", None, "off"),
    ("gru", 24, 64, 5, "float16", None, "off"),
    ("lstm", 40, 132, 33, "float32", None, "off"),  # the input GEMM of the rows within them
    ("gru", 512, 512, 64, "float32", None, "on")])
def test_lengths_match_reference(cell, input_size, hidden, batch, dtype, knobs, persistent, rng):
    """Samples of their own lengths (the first 1 step, the last all T): persistent (each
    exchange, tensor cores, the overlapped projection, batch groups) and not; float32 at
    batch 32 and more, the input GEMM of only the rows within the lengths (cuda.sgemm)."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           knobs=knobs, persistent=persistent, tuning="off", lengths=True)
    assert module.metadata["schedule"]["kind"] == ("persistent" if persistent == "on"
                                                   else "sequence")
    check_across_steps(module, rng, lengths=True)


@pytest.mark.parametrize("cell, input_size, hidden, batch, dtype, knobs, persistent", [
    ("lstm", 512, 512, 1, "float32", None, "on"),  # input projections overlapped by default
    ("lstm", 448, 448, 6, "float32", None, "on"),  # ... in 2 batch groups, 12 rows a group
    ("gru", 33, 257, 7, "float32", {"sync": "barrier"}, "on"),
    ("rnn_tanh", 16, 64, 40, "float32", {"batch_groups": 4, "sync": "grid"}, "on"),
    ("gru", 512, 512, 4, "float32", None, "on"),  # batch groups by default
    ("lstm", 1024, 1024, 4, "float16", {"mma": True}, "on"),
    ("lstm", 1024, 1024, 2, "float32", None, "on"),
    ("lstm", 24, 64, 5, "float16", None, "off"),
    ("gru", 24, 128, 64, "float16", None, "on")])  # CUDA cores: K is one chunk
@pytest.mark.parametrize("lengths", [False, True])
def test_bidirectional_matches_reference(cell, input_size, hidden, batch, dtype, knobs,
                                         persistent, lengths, rng):
    """Both directions in one persistent launch (each exchange, batch groups, tensor cores,
    input projections overlapped or a GEMM) and in the non-persistent schedule; the reverse
    direction from each sample's own last step; every run bit for bit the first."""
    module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", dtype=dtype,
                           knobs=knobs, persistent=persistent, tuning="off", lengths=lengths,
                           directions=2)
    assert module.metadata["schedule"]["kind"] == ("persistent" if persistent == "on"
                                                   else "sequence")
    check_across_steps(module, rng, lengths=lengths)
    if not lengths:
        check_repeats_exactly(module, rng, repeats=10)


def test_lengths_on_the_device_and_in_a_cuda_graph(torch, rng):
    """torch lengths on the GPU: no copy to the host is needed to run (the check is skipped
    while a CUDA graph is captured), and the replay follows new lengths in place; a call
    without lengths (all T) is captured too."""
    module = rnncc.compile("lstm", 16, 64, 3, target="cuda", lengths=True, tuning="off")
    w = {k: torch.tensor(v, dtype=torch.float32, device="cuda")
         for k, v in random_weights(rng, 4, 16, 64).items()}
    packed = module.pack(w)
    x = torch.randn(9, 3, 16, device="cuda")
    lengths = torch.tensor([9, 4, 1], device="cuda")
    expect = module(x, packed, lengths=lengths)[0].clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module(x, packed, lengths=lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, _ = module(x, packed, lengths=lengths)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expect)
    lengths.copy_(torch.tensor([2, 9, 5]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, module(x, packed, lengths=lengths)[0])
    assert not y[2:, 0].any() and not y[5:, 2].any()
    with pytest.raises(InputError, match="lengths is on cpu, but this call runs on cuda:0"):
        module(x, packed, lengths=torch.tensor([1, 2, 3]))
    with torch.cuda.stream(stream):  # no lengths: all T, made on the device in the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, _ = module(x, packed)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, module(x, packed, lengths=torch.full_like(lengths, 9))[0])


@pytest.mark.parametrize("kind, layers, bidirectional, batch_first, packed", [
    ("LSTM", 1, False, False, False), ("LSTM", 3, True, True, True),
    ("GRU", 2, True, False, True), ("RNN", 4, False, True, False)])
def test_nn_matches_torch_on_the_gpu(torch, kind, layers, bidirectional, batch_first, packed,
                                     rng):
    """rnncc.nn on CUDA against torch's float64 on the CPU and cuDNN (TF32 off) with the same
    weights: stacked layers, both directions, batch-first, packed sequences of their own
    lengths (unsorted, one of 1 step, one of all T), odd sizes, the persistent kernel."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    theirs = getattr(torch.nn, kind)(33, 257, num_layers=layers, bidirectional=bidirectional,
                                     batch_first=batch_first)
    ours = rnncc.nn.from_torch(theirs).cuda()
    x = torch.randn(7, 37, 33) if batch_first else torch.randn(37, 7, 33)
    lengths = torch.tensor(rng.integers(1, 38, 7))
    lengths[0], lengths[-1] = 37, 1
    pack = torch.nn.utils.rnn.pack_padded_sequence

    def run(module, data, device, dtype):
        data = data.to(device, dtype)
        if packed:
            data = pack(data, lengths, batch_first=batch_first, enforce_sorted=False)
        with torch.no_grad():
            out, finals = module.to(device, dtype)(data)
        out = out.data if packed else out
        finals = finals if isinstance(finals, tuple) else (finals,)
        return [t.double().cpu().numpy() for t in (out, *finals)]

    mine = run(ours, x, "cuda", torch.float32)
    for expect in (run(theirs, x, "cpu", torch.float64),
                   run(theirs, x, "cuda", torch.float32)):
        for a, b in zip(mine, expect):
            assert reference.relative_error(a, b) < TOL_F32


def test_nn_bidirectional_past_one_launch_runs_each_direction_persistently(torch, rng):
    """LSTM 512 at batch 64: both directions' batch groups do not fit in one launch, one
    direction's do; each direction then runs its own persistent module (the reverse one on
    reversed steps, on the side stream), with packed lengths, against cuDNN and torch's
    float64, and replayed from a CUDA graph as it ran eagerly."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    theirs = torch.nn.LSTM(512, 512, num_layers=2, bidirectional=True)
    ours = rnncc.nn.from_torch(theirs).cuda()
    x = torch.randn(23, 64, 512)
    lengths = torch.tensor(rng.integers(1, 24, 64))
    lengths[0], lengths[-1] = 23, 1
    pack = torch.nn.utils.rnn.pack_padded_sequence

    def run(module, device, dtype):
        with torch.no_grad():
            out, finals = module.to(device, dtype)(pack(x.to(device, dtype), lengths,
                                                        enforce_sorted=False))
        return [t.double().cpu().numpy() for t in (out.data, *finals)]

    mine = run(ours, "cuda", torch.float32)
    (network,) = ours._networks.values()
    (compiled,) = network._compiled.values()
    assert {s.kind for s in compiled.stages} == {"split"}
    assert {s.module.metadata["schedule"]["kind"] for s in compiled.stages} == {"persistent"}
    seq = pack(x.cuda(), lengths, enforce_sorted=False)
    with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream()):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = ours(seq)
        out.data.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert np.array_equal(out.data.double().cpu().numpy(), mine[0])
    for expect in (run(theirs, "cpu", torch.float64), run(theirs, "cuda", torch.float32)):
        for a, b in zip(mine, expect):
            assert reference.relative_error(a, b) < TOL_F32


@pytest.mark.parametrize("packed", [False, True])
def test_nn_in_a_cuda_graph(torch, packed):
    """A 2-layer bidirectional GRU captured in a CUDA graph after a warm-up call, on a tensor
    or a PackedSequence (made before the capture): replays follow new inputs in place."""
    net = rnncc.nn.GRU(16, 64, num_layers=2, bidirectional=True).cuda()
    x = torch.randn(20, 3, 16, device="cuda")
    seq = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([20, 5, 11]),
                                                  enforce_sorted=False) if packed else x

    def data(out):
        return out.data if packed else out

    with torch.no_grad():
        net(seq)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            net(seq)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y, h = net(seq)
        data(seq).copy_(torch.randn_like(data(seq)))
        graph.replay()
        torch.cuda.synchronize()
        expect, expect_h = net(seq)
    assert torch.equal(data(y), data(expect)) and torch.equal(h, expect_h)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_batch_one_past_on_chip_capacity(cell, rng):
    """H 4096 at batch 1 (non-persistent: each step's product streamed by
    cuda.small_batch_gemv) against float64."""
    module = compiled(cell, 4096, 4096, 1, "cuda")
    assert check_against_reference(module, rng, 6, True) < TOL_F32



@pytest.mark.parametrize("dtype, directions, layers", [
    ("float16", 1, 1), ("bfloat16", 1, 1), ("float32", 2, 1), ("float32", 1, 2)])
def test_tune_measures_candidates_in_half_types_both_directions_and_wavefronts(
        dtype, directions, layers, tmp_path):
    """rnncc tune's knob search checks each candidate against float64 and times it in the
    module's dtype (bfloat16 outputs had no NumPy type: every candidate was refused); those
    of a bidirectional layer against both directions' reference, a wavefront's against its
    layers'. The budget is room, not a target (the search ends with its candidates): with
    120 s, beside 14 other test workers, only the default was built in time (H200)."""
    import json

    from rnncc.tuning import tuner

    summary = tuner.tune("lstm", 64 if layers > 1 else 16, 64, 2, dtype=dtype, trials=0,
                         time_budget=400, steps=5, log_dir=str(tmp_path / "logs"),
                         work_dir=str(tmp_path / "work"), directions=directions, layers=layers,
                         progress=lambda line: None)
    assert summary["log"].endswith(f"_{dtype}" + ("_bidirectional" if directions == 2 else "")
                                   + (f"_l{layers}" if layers > 1 else ""))
    with open(tmp_path / "work" / "persistent" / "results.jsonl") as f:
        results = [json.loads(line) for line in f]
    assert len([r for r in results if r["ms"] is not None]) >= 2, results
    assert summary["tuned_ms"] <= summary["default_ms"]
