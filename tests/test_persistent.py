"""The persistent kernel without a GPU: the planner's decisions, and the CUDA module it builds
(grid barrier or tagged exchange in the source, cooperative launch, no register spills)."""

import dataclasses

import pytest

import rnncc
from conftest import has_nvcc
from helpers import persistent_cells
from rnncc.errors import ConfigError
from rnncc.schedules.persistent import Unfit, fuse_input, gpu_for_arch, overlap_input, plan
from rnncc.schedules.persistent.planner import TAGGED_MAX_GROUP_LOAD

H100 = gpu_for_arch("sm_90")


@pytest.mark.parametrize("gates, hidden, batch", [
    (4, 256, 1), (4, 512, 4), (4, 1024, 1), (4, 1024, 4), (4, 1536, 1), (4, 1536, 4),
    (3, 512, 1), (3, 1024, 4), (1, 1024, 16), (4, 1, 1), (3, 33, 7), (4, 257, 16)])
def test_plans_that_fit(gates, hidden, batch):
    p = plan(gates, hidden, batch, "float32", H100, states=2)
    assert p.blocks <= H100.sms and p.blocks * p.units >= hidden > (p.blocks - 1) * p.units
    assert p.warps * p.warp_rows >= gates * p.units  # every row has a warp
    assert p.reg_chunks + p.smem_chunks == p.chunks == -(-hidden // (p.k_lanes * p.vec))
    assert p.global_chunks == 0 and p.streamed_bytes == 0
    assert p.smem_bytes <= H100.smem_per_block
    assert p.reg_estimate <= H100.max_regs_per_thread
    assert p.threads * p.items >= p.units * batch  # every (unit, batch) pair has a thread
    weights = p.blocks * p.warps * p.chunks * p.rows_per_warp * 32 * p.vec
    assert weights >= gates * hidden * hidden  # the packed layout holds all of W_hh
    assert p.sync == ("local" if p.blocks == 1 else "tagged" if p.blocks <= 32 else "barrier")


@pytest.mark.parametrize("gates, hidden, batch, groups, sync", [
    (4, 384, 48, 12, "barrier"), (3, 512, 64, 8, "barrier"), (3, 512, 16, 4, "barrier"),
    (4, 256, 64, 16, "tagged"), (3, 256, 64, 32, "tagged"), (4, 512, 4, 4, "tagged"),
    (4, 256, 128, 16, "barrier")])
def test_batch_groups_exchange_h_tagged_only_where_groups_poll_little(gates, hidden, batch,
                                                                      groups, sync):
    """In batch groups, the tagged exchange where a group's blocks times its batch rows are at
    most TAGGED_MAX_GROUP_LOAD (each block polls its group's words of h), else the counter
    barrier (the sizes measured, H200: docs/benchmarks.md)."""
    p = plan(gates, hidden, batch, "float32", H100, states=2, batch_groups=groups)
    assert p.batch_groups == groups and p.sync == sync
    load = p.blocks // groups * batch // groups
    assert (load <= TAGGED_MAX_GROUP_LOAD) == (sync == "tagged")


@pytest.mark.parametrize("cell, hidden, batch, directions, groups", [
    ("gru", 512, 8, 1, 8), ("lstm", 512, 5, 1, 5), ("lstm", 448, 3, 2, 3), ("gru", 768, 4, 1, 4),
    ("lstm", 768, 4, 1, 2), ("lstm", 256, 16, 2, 8), ("lstm", 1024, 4, 1, 1),
    ("lstm", 256, 4, 1, 4), ("gru", 1024, 4, 2, 1)])
def test_one_batch_row_a_group_where_its_weights_need_little_shared_memory(
        cell, hidden, batch, directions, groups):
    """One batch row a group (tagged exchange) where that plan's weights need at most
    ONE_ROW_SMEM_CHUNKS chunks of shared memory on groups of at least ONE_ROW_MIN_BLOCKS
    blocks; else the planner's groups (LSTM 768: 3 chunks; LSTM 256 both directions at batch
    16: groups of 4 blocks; LSTM 1024: the input projection fused); the batch_groups knob and
    a training module keep the planner's choice."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    problem = Problem(cells.get(cell), hidden, hidden, batch, directions=directions)
    p = knobs.plan_for(problem, H100, {}, 24)
    assert p.batch_groups == groups
    request = knobs._Request(problem, H100, {})
    planned = knobs.weights_on_chip(request, 24, True)  # the planner's groups
    try:
        one_row = request.weights(24, groups=batch)
    except Unfit:
        one_row = None
    chosen = (one_row is not None and one_row.smem_chunks <= knobs.ONE_ROW_SMEM_CHUNKS
              and one_row.group_blocks >= knobs.ONE_ROW_MIN_BLOCKS and one_row.sync == "tagged"
              and not (knobs.fuses_input(problem) and directions == 1))
    assert (p.batch_groups == batch) == (chosen or planned.batch_groups == batch)
    if chosen and planned.batch_groups < batch:
        assert p.smem_chunks > planned.smem_chunks == 0  # the trade: weights in shared memory
        given = knobs.plan_for(problem, H100, {"batch_groups": planned.batch_groups}, 24)
        assert given.batch_groups == planned.batch_groups
        if directions == 1:
            training = dataclasses.replace(problem, training=True)
            assert knobs.plan_for(training, H100, {}, 24).batch_groups == planned.batch_groups


@pytest.mark.parametrize("cell, hidden, batch, layers, sync", [
    ("lstm", 512, 4, 2, "tagged"), ("gru", 512, 8, 2, "tagged"), ("lstm", 256, 16, 2, "tagged"),
    ("lstm", 512, 8, 2, "barrier"), ("gru", 768, 4, 2, "barrier"), ("lstm", 384, 8, 4, "barrier"),
    ("lstm", 1024, 1, 1, "tagged"), ("gru", 1024, 1, 1, "tagged"), ("lstm", 1024, 2, 1, "barrier"),
    ("lstm", 1536, 1, 1, "barrier")])
def test_overlapped_projections_exchange_h_tagged_where_blocks_poll_little(cell, hidden, batch,
                                                                          layers, sync):
    """Where the input projection is overlapped with the time loop (its blocks load the tagged
    words relaxed), the tagged exchange where a grid's blocks of a batch group times its rows
    are at most TAGGED_OVERLAPPED_MAX_LOAD, on grids past TAGGED_MAX_BLOCKS too (LSTM 1024 at
    batch 1: 128 blocks), else the counter barrier, on small grids too (LSTM 384, 4 layers of
    32 blocks, batch 8); where the projection is fused before the loop (LSTM 1536, in slabs),
    the rule of the separate GEMM. A sync knob still decides."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.schedules.persistent.planner import TAGGED_OVERLAPPED_MAX_LOAD
    from rnncc.spec import Problem

    problem = Problem(cells.get(cell), hidden, hidden, batch, layers=layers)
    p = knobs.plan_for(problem, H100, {}, 24)
    load = p.group_blocks * batch // p.batch_groups
    assert p.fused and p.sync == sync and p.tagged_loads == "relaxed"
    if p.input_steps:
        assert (load <= TAGGED_OVERLAPPED_MAX_LOAD) == (sync == "tagged")
    else:
        assert p.group_blocks > 32
    other = {"tagged": "barrier", "barrier": "tagged"}[sync]
    assert knobs.plan_for(problem, H100, {"sync": other}, 24).sync == other


@pytest.mark.parametrize("gates, hidden, batch", [(4, 2048, 4), (3, 2048, 1), (4, 33, 7)])
def test_float16_plans_hold_twice_the_weights(gates, hidden, batch):
    """Half weights: 8 a 16-byte chunk, so a chunk of a row takes 4 registers, as in float32
    (H 33: K over 8 lanes, 4 groups of them a warp)."""
    p = plan(gates, hidden, batch, "float16", H100, states=2)
    assert p.vec == 8 and p.chunks == -(-hidden // (p.k_lanes * p.vec)) and p.lane_bytes == 16
    assert p.k_lanes == (32 if hidden > 128 else 8)
    assert (p.blocks * p.warps * p.chunks * p.rows_per_warp * 32 * p.vec
            >= gates * hidden * hidden)
    assert p.smem_bytes <= H100.smem_per_block and p.reg_estimate <= 255


def test_no_register_margin_fits_more():
    """GRU H=2048 float32 fits only with every register used (the driver then asks ptxas)."""
    with pytest.raises(Unfit):
        plan(3, 2048, 1, "float32", H100, states=1)
    p = plan(3, 2048, 1, "float32", H100, states=1, reg_margin=0)
    assert p.reg_margin == 0 and p.smem_chunks > 0 and p.smem_bytes <= H100.smem_per_block


@pytest.mark.parametrize("gates, hidden, batch, dtype", [
    (3, 2048, 4, "float32"), (3, 2816, 1, "float16"), (3, 1024, 3, "float32")])
def test_streaming_plans_keep_what_does_not_fit_in_l2(gates, hidden, batch, dtype):
    """Weights that registers and shared memory do not hold stay in global memory, read each
    step from L2; only asked for (the driver asks when nothing fits on-chip), at most half the
    L2, and the plan's chunks still cover W_hh."""
    gpu = H100 if hidden > 1024 else gpu_for_arch("sm_90", sms=16)
    with pytest.raises(Unfit):
        plan(gates, hidden, batch, dtype, gpu)
    p = plan(gates, hidden, batch, dtype, gpu, stream=True)
    assert p.global_chunks > 0 and p.reg_chunks + p.smem_chunks + p.global_chunks == p.chunks
    assert p.smem_bytes <= gpu.smem_per_block
    assert 0 < p.streamed_bytes <= gpu.l2_bytes // 2
    assert p.streamed_bytes == p.blocks * p.warps * p.rows_per_warp * 32 * 16 * p.global_chunks
    assert p.blocks * p.warps * p.chunks * p.rows_per_warp * 32 * p.vec >= gates * hidden ** 2
    fits = plan(4, 1024, 4, "float32", H100, states=2)  # streaming changes nothing that fits
    assert plan(4, 1024, 4, "float32", H100, states=2, stream=True) == fits


def test_large_weights_use_shared_memory():
    p = plan(4, 1536, 4, "float32", H100, states=2)
    assert p.smem_chunks > 0 and p.reg_chunks > 0


@pytest.mark.parametrize("gates, hidden, batch, dtype, match", [
    (3, 2048, 1, "float32", r"need 372 KiB on each of 132 multiprocessors"),
    (4, 2048, 4, "float32", "more than their registers and shared memory hold"),
    (4, 512, 32, "float32", "batch 32 is over the persistent kernel's 16"),
    (3, 2816, 1, "float16", r"need 352 KiB on each of 132 multiprocessors"),
    (3, 2816, 1, "bfloat16", r"need 352 KiB on each of 132 multiprocessors"),
    (4, 512, 1, "int8", "takes float32 or float16 or bfloat16, not int8"),
])
def test_plans_that_do_not_fit(gates, hidden, batch, dtype, match):
    with pytest.raises(Unfit, match=match):
        plan(gates, hidden, batch, dtype, H100)


def test_streaming_is_capped_at_half_the_l2():
    with pytest.raises(Unfit, match=r"or than those and half the L2 \(25 MiB\)"):
        plan(4, 2048, 4, "float32", H100, stream=True)


def test_fewer_multiprocessors_mean_unfit():
    small = gpu_for_arch("sm_90", sms=16)
    with pytest.raises(Unfit, match="of 16 multiprocessors"):
        plan(4, 1024, 1, "float32", small)


def _fake_builds(monkeypatch, spills):
    """The driver's builds recorded, not run: the plans it built, in order; ``spills(plan)``
    says whether ptxas would have reported spills."""
    from types import SimpleNamespace

    from rnncc.compiler import driver

    built = []

    def build(problem, opts, tspec, plan, why, notes, applied, backward=None):
        built.append(plan)
        return SimpleNamespace(plan=plan, why=why, notes=list(notes))

    monkeypatch.setattr(driver, "_build", build)
    monkeypatch.setattr(driver, "_persistent_spills",
                        lambda m: ["kernel"] if spills(m.plan) else [])
    return built


@pytest.mark.parametrize("limit", [160, 0])
def test_driver_builds_each_plan_that_spills_once(monkeypatch, limit):
    """After a spill the driver keeps more registers free until the plan changes (never
    building the same chunks twice), and after five plans that spill falls back, saying so."""
    from rnncc.compiler import driver

    built = _fake_builds(monkeypatch, lambda plan: plan.reg_estimate > limit)
    module = driver.compile_module("gru", 64, 2816, 1, dtype="float16", target="cuda",
                                   tuning="off")
    tried = [dataclasses.replace(p, reg_margin=0) for p in built if p is not None]
    assert len(tried) == len(set(tried))
    spilled = [p for p in tried if p.reg_estimate > limit]
    assert len([n for n in module.notes if "spilled" in n]) == len(spilled)
    if limit:
        assert module.plan.reg_estimate <= limit and module.plan.global_chunks > 0
    else:
        assert len(spilled) == 5 and module.plan is None and "spills registers" in module.why


def test_persistent_option_errors():
    with pytest.raises(ConfigError, match="CUDA only"):
        rnncc.compile("lstm", 3, 4, 1, target="llvm", persistent="on")
    with pytest.raises(ConfigError, match="unknown persistent knob"):
        rnncc.compile("lstm", 3, 4, 1, target="llvm", knobs={"vector": 2})
    with pytest.raises(ConfigError, match="persistent must be"):
        rnncc.compile("lstm", 3, 4, 1, target="llvm", persistent="maybe")


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc (the CUDA toolkit)")
class TestPersistentBuild:
    def test_unfit_falls_back_and_says_why(self):
        module = rnncc.compile("lstm", 64, 2048, 4, target="cuda", tuning="off")
        schedule = module.metadata["schedule"]
        assert schedule["kind"] == "sequence"
        assert "496 KiB" in schedule["persistent"]["reason"]
        assert "half the L2" in schedule["persistent"]["reason"]
        assert "persistent_forward" not in module.metadata["functions"]
        with pytest.raises(ConfigError, match="persistent=on, but"):
            rnncc.compile("lstm", 64, 2048, 4, target="cuda", persistent="on", tuning="off")

    def test_streaming_plan_when_nothing_fits_on_chip(self):
        from rnncc.cli.main import _summary
        from rnncc.compiler.cuda_binary import cooperative_kernels

        module = rnncc.compile("gru", 64, 2048, 4, target="cuda", tuning="off")
        schedule = module.metadata["schedule"]
        assert schedule["kind"] == "persistent"
        chosen = schedule["persistent"]["plan"]
        assert chosen["global_chunks"] > 0 and chosen["reg_margin"] > 0
        (name,) = cooperative_kernels(module.source("cuda"))
        assert module.metadata["ptxas"][name]["spill_stores"] == 0
        streamed = chosen["streamed_bytes"]
        assert 0 < streamed <= 25 * 2**20  # at most half the L2
        assert f"{streamed / 2**20:.1f} MiB of weights read from L2 a step" in _summary(
            module.metadata)
        first = chosen["reg_chunks"] + chosen["smem_chunks"]
        assert f"w[bx, tx // 32, {first} + gc, q, tx % 32, v]" in module.source("tir")

    @pytest.mark.slow
    def test_streamed_chunks_are_a_loop(self):
        """The streamed chunks are a loop, not unrolled: unrolled, this plan (8 blocks, 6 of 7
        chunks streamed, 254 registers) spilled once its launch bounds had a minimum, and
        before that failed on an H200 with "unspecified launch failure" in 15 of 22 fresh
        processes (30 of 30 passed as a loop). Its 8 blocks are one cluster."""
        from rnncc.compiler.cuda_binary import persistent_kernels

        module = rnncc.compile("lstm", 7, 777, 2, target="cuda", sms=8, tuning="off")
        schedule = module.metadata["schedule"]
        assert schedule["kind"] == "persistent", schedule["notes"]
        chosen = schedule["persistent"]["plan"]
        assert (chosen["blocks"], chosen["global_chunks"]) == (8, 6)
        assert not any("spilled" in note for note in schedule["notes"])
        (name,) = persistent_kernels(module.source("cuda"))
        assert module.metadata["ptxas"][name]["stack"] == 0
        assert "for gc in range(6):" in module.source("tir")

    def test_tight_plan_when_the_margin_does_not_fit(self):
        from rnncc.compiler.cuda_binary import cooperative_kernels

        module = rnncc.compile("gru", 64, 2048, 1, target="cuda", tuning="off")
        schedule = module.metadata["schedule"]
        assert schedule["kind"] == "persistent"
        assert schedule["persistent"]["plan"]["reg_margin"] == 0
        (name,) = cooperative_kernels(module.source("cuda"))
        assert module.metadata["ptxas"][name]["spill_stores"] == 0

    @pytest.mark.slow
    def test_small_plan_keeps_its_registers(self):
        """512 threads, few weights a thread: without a minimum of one block a multiprocessor
        in the launch bounds ptxas kept 40 registers and spilled (the driver then moved to a
        slower plan)."""
        module = rnncc.compile("lstm", 256, 256, 4, target="cuda",
                               knobs={"warps": 16, "batch_groups": 1})
        plan = module.metadata["schedule"]["persistent"]["plan"]
        assert (plan["threads"], plan["reg_margin"]) == (512, 24)  # the first plan, kept
        assert not any("spilled" in note for note in module.metadata["schedule"]["notes"])

    @pytest.mark.parametrize("sync", ["tagged", "barrier",
                                      pytest.param("grid", marks=pytest.mark.slow)])
    def test_kernel_builds_without_spills(self, sync, tmp_path):
        from rnncc.compiler.cuda_binary import cooperative_kernels, kernel_bodies

        module = rnncc.compile("lstm", 32, 1024, 1, target="cuda", knobs={"sync": sync})
        schedule = module.metadata["schedule"]
        assert schedule["kind"] == "persistent"
        assert schedule["persistent"]["plan"]["sync"] == sync
        kernels = {k: v for k, v in module.metadata["ptxas"].items()
                   if k.startswith("persistent")}
        assert kernels and all(v["spill_stores"] == 0 and v["spill_loads"] == 0
                               and v["stack"] == 0 for v in kernels.values())
        assert max(v["registers"] for v in kernels.values()) > 128  # weights in registers
        xp = next(p for p in module.metadata["functions"]["persistent_forward"]
                  if p["name"] == "xp")
        assert xp["shape"] == ["T", 1, 4096]  # the input projections of all steps
        source = module.source("cuda")
        expected = {"tagged": "rnncc_grid_load", "barrier": "rnncc_grid_barrier",
                    "grid": "this_grid().sync()"}[sync]
        assert expected in source
        (name,) = cooperative_kernels(source)  # one block a multiprocessor, as launched
        # four block barriers a step: after h's staging, on each side of the gate sums, after
        # the exchange; the counter barrier's arrival follows a fifth (the kernel's barriers are
        # TVM storage syncs, so TVM adds none of its own next to them; it added four a step to
        # the block-wide syncs of cta_sync)
        loop = kernel_bodies(source)[name].split("for (int64_t t = (int64_t)0; t < T; ++t)")[1]
        assert loop.count("__syncthreads()") == 4 + (sync == "barrier")
        threads = schedule["persistent"]["plan"]["threads"]
        assert f"__launch_bounds__({threads}, 1) {name}(" in source
        if sync == "tagged":  # tagged words are read with acquire loads, never plain volatile
            assert "ld.acquire.gpu.global.u64" in source
            assert "volatile const uint64_t" not in source
        if sync == "barrier":  # release on arrival, acquire while waiting: no full fences
            assert "red.release.gpu.global.add.u32" in source
            assert "ld.acquire.gpu.global.u32" in source and "__threadfence" not in source
        path = module.export(tmp_path / "lstm.so")
        with open(path, "rb") as f:
            assert b"tirx.use_cooperative_launch" in f.read()

    @pytest.mark.parametrize("knobs", [None, pytest.param({"input_rows": 0},
                                                         marks=pytest.mark.slow)])
    def test_fused_input_projection_by_default_at_wide_inputs(self, knobs):
        """C >= 1024, N <= 4: the kernel computes its own input projections (no input GEMM
        stage in the persistent entry, W_ih packed for it); ``input_rows=0`` turns it off."""
        from rnncc.compiler.cuda_binary import cooperative_kernels

        module = rnncc.compile("gru", 1024, 1024, 1, target="cuda", knobs=knobs,
                               tuning="off")
        schedule = module.metadata["schedule"]
        plan_ = schedule["persistent"]["plan"]
        functions = module.metadata["functions"]
        source = module.source("cuda")
        (name,) = cooperative_kernels(source)
        report = module.metadata["ptxas"][name]
        assert report["spill_stores"] == report["stack"] == 0
        if knobs is None:
            assert plan_["input_rows"] >= 8 and schedule["rules"]["persistent"].endswith("+input")
            w_ih = next(p for p in functions["persistent_forward"] if p["name"] == "w_ih")
            rl = -(-3 * plan_["units"] // 8)  # [B, KC, RL, 8, VEC]
            assert w_ih["shape"] == [plan_["blocks"], 256, rl, 8, 4]
            assert "persistent_pack_w_ih" in functions
            xp = next(p for p in functions["persistent_forward"] if p["name"] == "xp")
            assert xp["shape"] == ["T", 1, 3072]  # no chunks: no padded steps to compute
            assert f"{name}(float* __restrict__ b_hh_ptr, float* __restrict__ b_ih_ptr" in source
        else:
            assert plan_["input_rows"] == 0 and "persistent_pack_w_ih" not in functions

    @pytest.mark.parametrize("batch", [1, pytest.param(4, marks=pytest.mark.slow)])
    def test_fused_input_in_slabs_by_default_at_batch_1(self, batch):
        """LSTM 1536: W_ih in slabs through W_hh's shared memory, by default at N = 1 only
        (measured slower at N = 4); ``input_rows`` forces it."""
        from rnncc.compiler.cuda_binary import cooperative_kernels

        module = rnncc.compile("lstm", 1536, 1536, batch, target="cuda", tuning="off")
        plan_ = module.metadata["schedule"]["persistent"]["plan"]
        if batch == 1:
            assert (plan_["input_slab"], plan_["input_rows"]) == (192, 24)
            assert "for sl in range(2):" in module.source("tir")
            (name,) = cooperative_kernels(module.source("cuda"))
            report = module.metadata["ptxas"][name]
            assert report["spill_stores"] == report["stack"] == 0
        else:
            assert plan_["input_rows"] == 0

    @pytest.mark.parametrize("cell, input_size, hidden, batch, directions, knobs, steps", [
        ("gru", 1024, 1024, 4, 1, None, 8),
        pytest.param("lstm", 1001, 257, 3, 1, {"input_steps": 4, "sync": "tagged"}, 4,
                     marks=pytest.mark.slow),
        ("lstm", 512, 512, 4, 2, None, 4)])
    def test_overlapped_input_projection_builds(self, cell, input_size, hidden, batch,
                                                directions, knobs, steps):
        """The slab's products sit between publishing h (the arrival at the counter barrier,
        or the tagged stores) and waiting for the other blocks; x's slab copied with
        ``cp.async`` where C % 4 == 0 (GRU 1024 N=4 and both directions of LSTM 512 N=4, by
        default), else staged; no spills."""
        from rnncc.compiler.cuda_binary import cooperative_kernels, kernel_bodies

        module = rnncc.compile(cell, input_size, hidden, batch, target="cuda", knobs=knobs,
                               tuning="off", persistent="on", directions=directions,
                               lengths=directions > 1)
        schedule = module.metadata["schedule"]
        assert schedule["persistent"]["plan"]["input_steps"] == steps
        assert schedule["rules"]["persistent"].endswith("+input")
        source = module.source("cuda")
        (name,) = cooperative_kernels(source)
        report = module.metadata["ptxas"][name]
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0
        loop = kernel_bodies(source)[name].split("for (int64_t t = (int64_t)0; t < T; ++t)")[1]
        products = loop.index("pacc_ptr[")
        if input_size % 4 == 0:
            assert "cp.async.cg.shared.global" in source and "rnncc_cp_async(" in loop
        else:
            assert "cp.async" not in source
        if schedule["persistent"]["plan"]["sync"] == "barrier":
            assert loop.index("rnncc_grid_arrive(") < products < loop.index("rnncc_grid_barrier(")
        else:
            assert loop.index("rnncc_grid_store(") < products

    @pytest.mark.slow
    def test_narrow_inputs_keep_the_input_gemm(self):
        module = rnncc.compile("lstm", 256, 256, 4, target="cuda", tuning="off")
        assert module.metadata["schedule"]["persistent"]["plan"]["input_rows"] == 0
        with pytest.raises(ConfigError, match="input_rows must be an integer"):
            rnncc.compile("lstm", 256, 256, 4, target="cuda", knobs={"input_rows": -1})

    @pytest.mark.slow
    def test_batch_groups_build(self):
        """LSTM 256 N=4 runs as 4 groups of batch 1 by default; the groups share one packing
        of W_hh and have a counter each with the barrier."""
        from rnncc.cli.main import _summary
        from rnncc.compiler.cuda_binary import cooperative_kernels

        for sync in ("tagged", "barrier"):
            module = rnncc.compile("lstm", 256, 256, 4, target="cuda", tuning="off",
                                   knobs={"sync": sync})
            plan_ = module.metadata["schedule"]["persistent"]["plan"]
            assert (plan_["batch_groups"], plan_["sync"], plan_["input_rows"]) == (4, sync, 0)
            params = {p["name"]: p["shape"] for p in
                      module.metadata["functions"]["persistent_forward"]}
            assert params["w_hh"][0] == plan_["blocks"] // 4
            assert params["h_tagged" if sync == "tagged" else "counter"] == (
                [2, 4, 256] if sync == "tagged" else [4])
            (name,) = cooperative_kernels(module.source("cuda"))
            report = module.metadata["ptxas"][name]
            assert report["spill_stores"] == report["stack"] == 0
            assert "4 batch groups of 1" in _summary(module.metadata)

    def test_sequence_only_when_asked(self):
        module = rnncc.compile("lstm", 32, 256, 1, target="cuda", persistent="off")
        assert module.metadata["schedule"]["kind"] == "sequence"
        assert module.metadata["schedule"]["persistent"] == {"reason": "persistent=off"}

    def test_float16_tensor_core_kernel(self):
        """Products as mma.sync (16 a chunk of K), no butterfly over the lanes, five block
        barriers a step as on the CUDA cores with the counter barrier, no spills."""
        from rnncc.compiler.cuda_binary import cooperative_kernels, kernel_bodies

        module = rnncc.compile("lstm", 33, 1000, 7, target="cuda", dtype="float16",
                               knobs={"warps": 4, "mma": True, "sync": "barrier"})
        plan_ = module.metadata["schedule"]["persistent"]["plan"]
        assert plan_["mma"] and plan_["rows_per_warp"] == 8 and plan_["chunks"] == 4
        source = module.source("cuda")
        (name,) = cooperative_kernels(source)
        loop = kernel_bodies(source)[name].split("for (int64_t t = (int64_t)0; t < T; ++t)")[1]
        assert loop.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 16 * 4
        assert "rnncc_shfl_xor" not in loop
        assert loop.count("__syncthreads()") == 5
        report = module.metadata["ptxas"][name]
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0

    @pytest.mark.parametrize("sync", [pytest.param("tagged", marks=pytest.mark.slow), "barrier"])
    def test_float16_kernel_builds_without_spills(self, sync):
        from rnncc.compiler.cuda_binary import cooperative_kernels

        module = rnncc.compile("gru", 16, 512, 3, target="cuda", dtype="float16",
                               knobs={"sync": sync})
        plan = module.metadata["schedule"]["persistent"]["plan"]
        assert module.metadata["schedule"]["kind"] == "persistent" and plan["vec"] == 8
        source = module.source("cuda")
        (name,) = cooperative_kernels(source)
        report = module.metadata["ptxas"][name]
        assert report["spill_stores"] == report["stack"] == 0 and report["registers"] > 64
        assert f"{name}(half* __restrict__ b_hh_ptr" in source  # half weights and biases
        # K = 16 is past whole chunks: the warpgroup-MMA kernel, zeros copied past K
        assert module.metadata["schedule"]["rules"]["input_gemm"] == "cuda.wgmma_gemm"


def test_tensor_core_plans():
    """``plan(mma=True)``: float16 or bfloat16, 8 rows a warp (the warps follow from the units,
    at least 4), 2 to 64 batch rows a group (tiles of 16), at least MMA_MIN_CHUNKS chunks of K
    times the tiles; the registers of the CUDA cores' sums hold weight chunks instead, and h's
    16-bit fragments fit in shared memory next to them. Anything else is unfit, saying why."""
    from rnncc.schedules.persistent import planner

    cuda_cores = plan(4, 2048, 4, "float16", H100, states=2)
    mma = plan(4, 2048, 4, "float16", H100, states=2, mma=True)
    assert mma.mma and not cuda_cores.mma and mma.rows_per_warp == 8
    assert mma.warps * 8 >= 4 * mma.units > (mma.warps - 1) * 8
    assert mma.reg_chunks + mma.smem_chunks == mma.chunks == 8
    assert mma.smem_bytes == (mma.smem_chunks * mma.chunk_bytes
                              + planner.mma_staging_bytes(mma, 4)) <= H100.smem_per_block
    assert mma.reg_estimate <= 255 - mma.reg_margin
    assert plan(4, 2048, 4, "bfloat16", H100, states=2, mma=True) == mma
    for batch, tiles, chains, rows in ((1, 1, 4, 8), (8, 1, 4, 8), (9, 1, 4, 16),
                                       (32, 2, 2, 32), (37, 3, 1, 48), (64, 4, 1, 64)):
        assert (planner.mma_tiles(batch), planner.mma_chains(batch),
                planner.mma_staged_rows(batch)) == (tiles, chains, rows)
    wide = plan(4, 1024, 64, "float16", H100, states=2, mma=True, batch_groups=None)
    assert wide.mma and wide.batch_groups == 2 and wide.smem_chunks == 0
    assert plan(3, 1024, 37, "float16", H100, mma=True, batch_groups=1).mma  # a partial tile
    with pytest.raises(Unfit, match="float32 tensor-core products take at least 9 batch rows "
                                    "a group, got 4"):  # TF32: whole tiles
        plan(4, 1024, 4, "float32", H100, states=2, mma=True)
    tf32 = plan(4, 1024, 16, "float32", H100, states=2, mma=True)  # 4-byte vectors of 4 k
    assert tf32.mma and tf32.vec == 4 and tf32.chunks == 8
    assert planner.mma_staging_bytes(tf32, 16) == 4 * 16 * 1024 + 4 * tf32.warps * 8 * 16
    with pytest.raises(Unfit, match="batch 80 is over the persistent kernel's 64"):
        plan(4, 1024, 80, "float16", H100, states=2, mma=True, batch_groups=1)
    with pytest.raises(Unfit, match="at least 4 chunks of K times tiles of batch; K = 512 is 2"):
        plan(4, 512, 2, "float16", H100, states=2, mma=True)
    assert plan(4, 512, 32, "float16", H100, states=2, mma=True).mma  # 2 chunks, 2 tiles
    with pytest.raises(Unfit, match="at least 2 batch rows a group, got 1"):
        plan(4, 1024, 1, "float16", H100, states=2, mma=True)
    assert plan(4, 1024, 2, "float16", H100, states=2, mma=True, batch_groups=None
                ).batch_groups == 1  # never a group of one row
    assert all(plan(3, h, 4, "float16", H100, mma=True).warps >= planner.MMA_MIN_WARPS
               for h in (1024, 2048))
    with pytest.raises(Unfit, match="not float16 streamed"):
        plan(4, 2048, 4, "float16", H100, states=2, mma=True, stream=True)
    with pytest.raises(Unfit, match="more than their registers and shared memory hold"):
        plan(4, 2048, 64, "float16", H100, states=2, mma=True, batch_groups=1)


def test_mma_knob():
    """``mma``: None (where tensor cores apply), True (or the plan is unfit, saying why) or
    False; anything else is refused."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    for name in ("mma", "mean_partials"):
        with pytest.raises(ConfigError, match=f"{name} must be true or false, got 'yes'"):
            knobs.check_knobs({name: "yes"})
    lstm = Problem(cells.get("lstm"), 2048, 2048, 4, "float16")
    assert knobs.plan_for(lstm, H100, {}, 24).mma
    assert not knobs.plan_for(lstm, H100, {"mma": False}, 24).mma
    fp32 = Problem(cells.get("lstm"), 32, 1024, 16, "float32")
    with pytest.raises(Unfit, match=r"mma=True, but the tensor-core products do not apply: "
                                    r"float32 products run on them only in TF32 "):
        knobs.plan_for(fp32, H100, {"mma": True}, 24)
    tf32 = Problem(cells.get("lstm"), 32, 1024, 16, "float32", allow_tf32=True)
    assert not knobs.plan_for(tf32, H100, {}, 24).mma  # TF32 on tensor cores when asked for
    assert knobs.plan_for(tf32, H100, {"mma": True}, 24).mma
    with pytest.raises(Unfit, match=r"do not apply: they take the input projection as a "
                                    r"separate GEMM .* not input_rows=8 input_steps=None$"):
        knobs.plan_for(lstm, H100, {"mma": True, "input_rows": 8}, 24)
    small = Problem(cells.get("lstm"), 512, 512, 2, "float16")
    assert not knobs.plan_for(small, H100, {}, 24).mma  # too few chunks: the CUDA cores
    with pytest.raises(Unfit, match="do not apply: tensor-core products take at least 4"):
        knobs.plan_for(small, H100, {"mma": True}, 24)
    wide = Problem(cells.get("gru"), 1024, 1024, 64, "bfloat16")
    assert knobs.plan_for(wide, H100, {}, 24).mma  # past the CUDA cores' 16 batch rows


@pytest.mark.parametrize("cell, hidden, batch, options, mma", [
    ("lstm", 256, 256, {}, True), ("gru", 384, 256, {}, True), ("lstm", 192, 200, {}, True),
    ("lstm", 512, 256, {}, False),  # its step's product on cuda.wgmma_gemm
    ("lstm", 128, 255, {}, False), ("lstm", 256, 64, {}, False),  # H under 192, one group
    ("lstm", 256, 256, {"allow_tf32": False}, False),
    ("lstm", 256, 256, {"directions": 2}, False), ("lstm", 256, 256, {"training": True}, False),
    ("lstm", 256, 256, {"lengths": True}, False)])
def test_tf32_past_one_group_is_persistent_on_tensor_cores_where_steps_are_not(
        cell, hidden, batch, options, mma):
    """A TF32 layer (one direction, inference, no lengths) past one tensor-core batch group,
    H at least 192, whose non-persistent schedule would take each step's product on the CUDA
    cores, is planned with the knob mma=True (the persistent kernel on tensor cores, in batch
    groups); elsewhere its knobs stay as given."""
    from rnncc import cells
    from rnncc.compiler import driver
    from rnncc.spec import Options, Problem
    from rnncc.target import TargetSpec

    problem = Problem(cells.get(cell), hidden, hidden, batch, "float32",
                      **{"allow_tf32": True, **options})
    knobs = driver._tf32_tensor_cores(problem, Options(), TargetSpec("cuda"), None,
                                      {"sync": "barrier"})
    assert knobs == ({"sync": "barrier", "mma": True} if mma else {"sync": "barrier"})
    assert driver._tf32_tensor_cores(problem, Options(), TargetSpec("cuda"), None,
                                     {"mma": False}) == {"mma": False}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_layers_past_batch_64_are_persistent_only_with_small_weights(dtype):
    """A layer of 16-bit weights at batch 65 and more runs persistently by default, in batch
    groups, only in one direction with W_hh of at most 4.5 MiB (the non-persistent schedule's
    tensor-core products are as fast past it), unless knobs ask for a plan; float32 and a
    wavefront of layers are unaffected."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    small = Problem(cells.get("lstm"), 256, 256, 128, dtype)  # W_hh 0.5 MiB, K of one chunk
    found = knobs.plan_for(small, H100, {}, 24)
    assert not found.mma and found.batch_groups > 1
    wider = dataclasses.replace(small, input_size=768, hidden_size=768)  # 4.5 MiB
    found = knobs.plan_for(wider, H100, {}, 24)
    assert found.mma and 128 // found.batch_groups <= 64 and found.sync == "barrier"
    large = dataclasses.replace(small, input_size=800, hidden_size=800)  # 4.88 MiB
    with pytest.raises(Unfit, match=f"batch 128 in {dtype} is over 64 with W_hh of 4.88 MiB "
                                    r"\(over 4.5\), where the non-persistent"):
        knobs.plan_for(large, H100, {}, 24)
    assert knobs.plan_for(large, H100, {"batch_groups": 2}, 24).batch_groups == 2
    with pytest.raises(Unfit, match=f"batch 128 in {dtype} is over 64 in two directions"):
        knobs.plan_for(dataclasses.replace(small, directions=2), H100, {}, 24)
    with pytest.raises(Unfit, match=f"batch 128 in {dtype} is over 64 with a projection"):
        knobs.plan_for(dataclasses.replace(small, proj_size=64), H100, {}, 24)
    for other in (dataclasses.replace(large, dtype="float32"),
                  dataclasses.replace(large, layers=2)):
        try:
            knobs.plan_for(other, H100, {}, 24)
        except Unfit as err:  # its own reasons (on-chip room), not this rule's
            assert "is over 64" not in str(err)


@pytest.mark.parametrize("hidden, batch, mma", [(64, 64, False), (256, 64, False),
                                                (256, 17, False), (257, 64, True),
                                                (320, 48, True), (1024, 16, True)])
def test_half_layers_take_tensor_cores_past_one_chunk_of_k_through_the_barrier(hidden, batch,
                                                                              mma):
    """By default a layer of 16-bit weights whose K = H is one chunk of the tensor cores' (256
    values; no projection) runs on the CUDA cores where that plan fits on-chip; past it on
    tensor cores, exchanging h through the barrier; knobs that ask for tensor cores get them,
    through the barrier unless they set the exchange."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs, planner
    from rnncc.spec import Problem

    problem = Problem(cells.get("lstm"), 32, hidden, batch, "float16")
    found = knobs.plan_for(problem, H100, {}, 24)
    assert found.mma == mma
    if hidden == 256 and batch == 64:  # a projection: the tensor cores, as before (unmeasured)
        assert knobs.plan_for(dataclasses.replace(problem, hidden_size=512, proj_size=256),
                              H100, {}, 24).mma
    if mma:
        assert found.sync == "barrier"
    if hidden == 64:
        asked = knobs.plan_for(problem, H100, {"mma": True}, 24)
        assert asked.mma and asked.sync == "barrier"  # a grid the tagged words would take:
        assert planner.exchange(dataclasses.replace(asked, mma=False), batch) == "tagged"
        assert knobs.plan_for(problem, H100, {"mma": True, "sync": "tagged"}, 24).sync == "tagged"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_layers_of_large_weights_at_batch_64_are_not_persistent_by_default(dtype):
    """At batch 64 a layer of 16-bit weights whose W_hh is 16 MiB or more (LSTM 1536: 18 MiB)
    has no persistent plan by default, unless knobs ask; below (LSTM 1024), at batch 32,
    with two directions or two layers the rule does not apply."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    lstm = Problem(cells.get("lstm"), 1536, 1536, 64, dtype)
    with pytest.raises(Unfit, match=f"batch 64 in {dtype} with W_hh of 18.0 MiB"):
        knobs.plan_for(lstm, H100, {}, 24)
    assert knobs.plan_for(lstm, H100, {"mma": True}, 24).mma
    for other in (dataclasses.replace(lstm, hidden_size=1024, input_size=1024),
                  dataclasses.replace(lstm, batch=32),
                  dataclasses.replace(lstm, directions=2),
                  dataclasses.replace(lstm, layers=2)):
        try:
            knobs.plan_for(other, H100, {}, 24)
        except Unfit as err:  # its own reasons (on-chip room), not this rule's
            assert "W_hh of" not in str(err)


@pytest.mark.parametrize("gates, input_size, hidden, batch, rows", [
    (4, 1024, 1024, 1, None), (4, 1024, 1024, 4, None), (3, 33, 257, 3, None),
    (1, 7, 97, 1, None), (4, 100, 72, 7, 5), (3, 1024, 1024, 4, 200)])
def test_fused_input_plans(gates, input_size, hidden, batch, rows):
    """A fused input projection keeps the plan, takes whole groups of 4 rows of x (``rows``
    rounded up, capped by the accumulators) and stays within shared memory."""
    from rnncc.schedules.persistent import planner

    base = plan(gates, hidden, batch, "float32", H100)
    fused = fuse_input(base, gates, input_size, batch, H100, rows)
    assert fused is not None and fused.fused and not base.fused
    assert dataclasses.replace(fused, input_rows=0, input_chunks=0,
                               smem_bytes=base.smem_bytes) == base
    sn = fused.input_rows
    assert sn % planner.X_GROUPS == 0 and planner.FUSED_MIN_ROWS <= sn <= planner.FUSED_MAX_ROWS
    if rows:  # rounded up, within the accumulators (and shared memory: GRU 1024 N=4 takes 32)
        assert sn <= min(-(-rows // 4) * 4, 4 * (64 // planner.fused_row_split(base, gates)))
        assert sn == {5: 8, 200: 32}[rows]
    assert fused.input_chunks == -(-input_size // 4)
    assert base.smem_bytes <= fused.smem_bytes <= H100.smem_per_block


def test_fused_input_in_slabs_through_w_hh_shared_memory():
    """LSTM 1536: W_hh fills shared memory, so W_ih's rows go through its shared memory in
    even slabs of K chunks (before W_hh is loaded there); GRU 2048 leaves no room for x."""
    from rnncc.schedules.persistent import planner

    base = plan(4, 1536, 1, "float32", H100, states=2)
    assert base.smem_chunks > 0
    fused = fuse_input(base, 4, 1536, 1, H100)
    rl = planner.fused_row_split(base, 4)
    assert (fused.input_chunks, fused.input_slab) == (384, 192)  # 2 slabs
    assert fused.input_slab * rl * planner.ROW_GROUPS * 16 <= base.smem_chunks * base.chunk_bytes
    assert fused.input_rows >= planner.FUSED_MIN_ROWS
    assert fused.smem_bytes <= H100.smem_per_block
    narrow = fuse_input(base, 4, 16, 1, H100)  # a narrow input's rows fit next to W_hh
    assert narrow.fused and narrow.input_slab == 0
    tight = plan(3, 2048, 1, "float32", H100, reg_margin=0)
    assert tight.smem_chunks > 0 and fuse_input(tight, 3, 2048, 1, H100) is None
    streaming = plan(3, 2048, 4, "float32", H100, stream=True)
    assert streaming.global_chunks and fuse_input(streaming, 3, 16, 4, H100) is None


def test_overlap_steps():
    """S: the largest with S*N a multiple of 4 and at most 32 rows, else the smallest."""
    from rnncc.schedules.persistent.planner import overlap_steps

    steps = {1: 32, 2: 16, 3: 8, 4: 8, 5: 4, 7: 4, 8: 4, 12: 2, 16: 2, 32: 1, 33: 4}
    assert {n: overlap_steps(n) for n in steps} == steps


@pytest.mark.parametrize("input_size, steps, width", [(1024, None, 32), (1028, 5, 52),
                                                      (7, 1, 2)])
def test_overlapped_input_plans(input_size, steps, width):
    """GRU 1024 N=4: the plan of the recurrent products kept; W_ih resident, S*N rows of x a
    group, the K chunks cut into S slabs; within shared memory and the registers."""
    base = plan(3, 1024, 4, "float32", H100, states=1)
    over = overlap_input(base, 3, input_size, 4, H100, steps)
    assert over is not None and over.fused and over.input_slab == 0
    assert over.input_steps == (steps or 8) and over.input_rows == 4 * over.input_steps
    assert over.input_chunks == -(-input_size // 4) and over.input_width == width
    assert dataclasses.replace(over, input_rows=0, input_chunks=0, input_steps=0,
                               smem_bytes=base.smem_bytes, reg_estimate=base.reg_estimate) == base
    assert base.smem_bytes < over.smem_bytes <= H100.smem_per_block
    assert base.reg_estimate < over.reg_estimate <= 255 - over.reg_margin
    before = fuse_input(base, 3, input_size, 4, H100)  # the same projection before the loop
    assert before.input_steps == 0 and before.input_width == before.input_chunks


def test_overlapped_input_plans_that_do_not_fit():
    """None: S*N not a multiple of 4, float16, streamed weights, or accumulators that do not
    fit in the registers (LSTM 1024 N=4 with the default margin; without it they fit)."""
    gru = plan(3, 1024, 4, "float32", H100, states=1)
    assert overlap_input(gru, 3, 1024, 4, H100, 3).input_rows == 12
    assert overlap_input(plan(3, 1024, 1, "float32", H100), 3, 1024, 1, H100, 3) is None
    assert overlap_input(plan(3, 1024, 4, "float16", H100), 3, 1024, 4, H100) is None
    streaming = plan(3, 2048, 4, "float32", H100, stream=True)
    assert streaming.global_chunks and overlap_input(streaming, 3, 1024, 4, H100) is None
    lstm = plan(4, 1024, 4, "float32", H100, states=2)
    assert overlap_input(lstm, 4, 1024, 4, H100) is None
    assert overlap_input(dataclasses.replace(lstm, reg_margin=0), 4, 1024, 4, H100, 4)


def test_input_steps_knob():
    """Overlapped where it fits when neither input knob is given (C = 1024, N = 1-4), W_hh's
    chunks moved to shared memory for its registers where needed (LSTM N=4: one) unless
    ``reg_margin`` is given. ``input_steps=0`` keeps the projection
    before the loop, ``input_rows=0`` the separate GEMM; a forced S that does not fit is
    unfit, saying why; both knobs are refused."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    def planned(cell, batch, given=None):
        return knobs.plan_for(Problem(cells.get(cell), 1024, 1024, batch, "float32"), H100,
                              given or {}, 24)

    gru = planned("gru", 4)
    assert (gru.input_steps, gru.input_rows, gru.smem_chunks, gru.reg_margin) == (8, 32, 0, 24)
    assert planned("gru", 4, {"input_steps": 4}).input_steps == 4
    before = planned("gru", 4, {"input_steps": 0})
    assert before.input_steps == 0 and before.fused
    assert not planned("gru", 4, {"input_rows": 0}).fused
    lstm = planned("lstm", 4)
    assert (lstm.input_steps, lstm.smem_chunks, lstm.reg_margin) == (8, 1, 24 + 24)
    assert planned("lstm", 4, {"input_steps": 0}).smem_chunks == 0
    assert planned("lstm", 2).input_steps == 16 and planned("gru", 3).input_steps == 8
    assert planned("lstm", 1).input_steps == planned("gru", 1).input_steps == 32
    with pytest.raises(Unfit, match=r"input_steps=8, but"):  # no room made with reg_margin
        planned("lstm", 4, {"input_steps": 8, "reg_margin": 24})
    one = Problem(cells.get("gru"), 1024, 1024, 1, "float32")
    with pytest.raises(Unfit, match=r"input_steps=3, but .* this plan has N=1$"):
        knobs.plan_for(one, H100, {"input_steps": 3}, 24)
    with pytest.raises(ConfigError, match=r"input_rows=8 and input_steps=4: give input_rows"):
        knobs.check_knobs({"input_rows": 8, "input_steps": 4})
    with pytest.raises(ConfigError, match="input_steps must be an integer from 0 to 4096"):
        knobs.check_knobs({"input_steps": -1})
    assert knobs.check_knobs({"input_rows": 8, "input_steps": 0})


def test_overlapped_plan_that_spills_is_built_before_the_loop(monkeypatch):
    from rnncc.compiler import driver

    built = _fake_builds(monkeypatch, lambda plan: plan.input_steps)
    module = driver.compile_module("gru", 1024, 1024, 4, target="cuda", tuning="off")
    assert [p.input_steps for p in built] == [8, 0]
    assert module.plan.fused and module.plan.input_rows > 0
    assert any("overlapped (8 steps a group) spilled" in n for n in module.notes)


def test_overlapped_plan_that_spills_is_planned_with_more_registers_free(monkeypatch):
    """Both directions' input projections overlapped in 2 batch groups spill at the default
    margin: the driver plans the overlap again with 24 registers more kept free (a chunk more
    in shared memory) before it moves the projection before the loop."""
    from rnncc.compiler import driver

    def shape(built):
        return [(p.input_steps, p.reg_margin, p.smem_chunks, p.batch_groups) for p in built]

    built = _fake_builds(monkeypatch, lambda plan: plan.input_steps and plan.reg_margin < 48)
    module = driver.compile_module("gru", 384, 640, 6, directions=2, target="cuda",
                                   tuning="off")
    assert shape(built) == [(4, 24, 1, 2), (4, 48, 2, 2)] and module.plan is built[-1]
    assert any("reg_margin 24 spilled" in n and "with reg_margin 48" in n for n in module.notes)
    built = _fake_builds(monkeypatch, lambda plan: plan.input_steps)  # every overlap spills
    module = driver.compile_module("gru", 384, 640, 6, directions=2, target="cuda",
                                   tuning="off")
    assert shape(built) == [(4, 24, 1, 2), (4, 48, 2, 2), (0, 24, 0, 1)]
    built = _fake_builds(monkeypatch, lambda plan: plan.input_steps)  # a margin asked for
    driver.compile_module("gru", 384, 640, 6, directions=2, target="cuda", tuning="off",
                          knobs={"reg_margin": 24})
    assert shape(built) == [(4, 24, 1, 2), (0, 24, 0, 1)]


@pytest.mark.parametrize("gates, hidden, batch, groups", [
    (4, 256, 4, 4), (4, 512, 4, 4), (3, 512, 4, 4), (1, 33, 6, 6), (4, 257, 16, 8),
    (4, 1024, 4, 1), (3, 1024, 4, 1), (4, 256, 1, 1)])
def test_batch_groups_by_default_where_weights_fit_in_registers(gates, hidden, batch, groups):
    """The most groups whose plan keeps all weights in registers; each group is the plan of
    batch N/NG on SMs/NG multiprocessors. LSTM/GRU 1024 N=4 would need shared memory in 2
    groups (measured slower): one group."""
    p = plan(gates, hidden, batch, "float32", H100, states=2, batch_groups=None)
    assert p.batch_groups == groups and p.blocks == groups * p.group_blocks <= H100.sms
    one = plan(gates, hidden, batch // groups, "float32", H100, states=2,
               max_blocks=H100.sms // groups)
    assert dataclasses.replace(p, blocks=p.group_blocks, batch_groups=1) == one
    if groups > 1:
        assert p.smem_chunks == 0
    else:
        assert p == plan(gates, hidden, batch, "float32", H100, states=2)


def test_batch_group_errors():
    with pytest.raises(Unfit, match="batch_groups must divide batch 4, got 3"):
        plan(4, 256, 4, "float32", H100, batch_groups=3)
    with pytest.raises(Unfit, match="batch 32 is over the persistent kernel's 16"):
        plan(4, 256, 32, "float32", H100)
    with pytest.raises(Unfit, match="no split into batch groups of at most 16 fits"):
        plan(4, 1024, 64, "float32", H100, batch_groups=None)
    assert plan(4, 256, 32, "float32", H100, batch_groups=2).batch_groups == 2
    # past 16, the most groups that fit at all (here with a chunk in shared memory)
    wide = plan(4, 256, 64, "float32", H100, states=2, batch_groups=None)
    assert (wide.batch_groups, wide.smem_chunks) == (16, 1)
    with pytest.raises(Unfit, match=r"33 multiprocessors of H100/H200 SXM \(4 batch groups\)"):
        plan(4, 1024, 4, "float32", H100, batch_groups=4)
    with pytest.raises(ConfigError, match=r"divide the batch 4, got 3; allowed: \[1, 2, 4\]"):
        rnncc.compile("lstm", 256, 256, 4, target="cuda", knobs={"batch_groups": 3})


def test_batch_groups_kernel():
    """Block bx: the weights of block bx % (B/NG), batch rows from bx // (B/NG) * N/NG; the
    counter barrier counts the blocks of its group."""
    from rnncc.schedules.persistent.kernel import kernel

    lstm = rnncc.cells.get("lstm")
    p = plan(4, 256, 4, "float32", H100, states=2, batch_groups=2)
    bg = p.group_blocks
    text = kernel(lstm, 256, 4, dataclasses.replace(p, sync="tagged")).script()
    assert f'T.thread_binding({p.blocks}, thread="blockIdx.x")' in text
    assert f"= w[bx % {bg}, tx // 32, i, q, tx % 32, v]" in text
    assert f"hw[t % T.int64(2), bx // {bg} * 2 + T.min(" in text
    assert f"y[t, bx // {bg} * 2 + tx // {p.units}, " in text
    text = kernel(lstm, 256, 4, dataclasses.replace(p, sync="barrier")).script()
    assert 'cnt: T.Buffer((2,), "uint32")' in text
    assert f"T.address_of(cnt[bx // {bg}]), T.Cast(\"uint32\", (t + T.int64(1)) * T.int64({bg}))" \
        in text
    fused = fuse_input(p, 4, 64, 4, H100)  # each group projects its own rows of x
    text = kernel(lstm, 256, 4, fused, input_size=64).script()
    assert f"x[(m0 * T.int64({fused.input_rows}) + " in text
    assert f"T.Cast(\"int64\", bx // {bg} * 2) + (m0 * T.int64({fused.input_rows}) + " in text
    assert f"wi[bx % {bg}, " in text


def test_unroll_knob_unrolls_the_shared_memory_chunks():
    from rnncc.schedules.persistent.kernel import kernel

    p = plan(4, 1536, 4, "float32", H100, states=2)
    ks = p.smem_chunks
    assert ks > 1
    lstm = rnncc.cells.get("lstm")
    assert "for si in T.unroll(1):" in kernel(lstm, 1536, 4, p).script()
    assert f"for si in T.unroll({ks}):" in kernel(lstm, 1536, 4,
                                                  dataclasses.replace(p, unroll=ks)).script()


def test_knob_candidates_follow_the_driver():
    from rnncc.spec import Problem
    from rnncc.tuning.knob_search import candidates

    tight = candidates(Problem(rnncc.cells.get("gru"), 2048, 2048, 1), H100)
    assert tight and tight[0] == {} and {"unroll": 9} in tight  # planned with no margin
    assert candidates(Problem(rnncc.cells.get("lstm"), 2048, 2048, 4), H100) == []
    small = candidates(Problem(rnncc.cells.get("lstm"), 256, 256, 4), H100)
    assert {"batch_groups": 1} in small and {"batch_groups": 2} in small
    wider = candidates(Problem(rnncc.cells.get("lstm"), 320, 320, 1), H100)
    assert {"max_blocks": 8, "sync": "cluster"} in wider  # a wide cluster (16) by default
    half = candidates(Problem(rnncc.cells.get("lstm"), 2048, 2048, 4, "float16"), H100)
    assert {"mma": False} in half  # tensor cores by default, the CUDA cores tried too
    assert not any("reg_margin" in k and "batch_groups" in k for k in small)
    both = candidates(Problem(rnncc.cells.get("gru"), 384, 640, 6, directions=2), H100)
    assert {"batch_groups": 2, "reg_margin": 48} in both  # room for the overlap (spills: 24)
    stacked = candidates(Problem(rnncc.cells.get("lstm"), 512, 512, 4, layers=2), H100)
    assert {"sync": "barrier"} in stacked and {"sync": "grid"} not in stacked  # no grid sync
    assert {"mean_partials": True} not in small and {"lane_groups": False} not in small
    assert {"lane_groups": False} in candidates(Problem(rnncc.cells.get("gru"), 64, 64, 8), H100)
    assert {"mean_partials": True} in candidates(Problem(rnncc.cells.get("ln_gru"), 256, 256,
                                                         4), H100)


@pytest.mark.parametrize("cell", persistent_cells())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernel_cell_uses_fast_exponential(cell, dtype):
    """The per-step cell of every registered cell builds with the GPU's exponential and
    division for exp and sigmoid (its values are float32 for either storage dtype); tanh stays
    accurate, and outside the kernel the functions are TVM's again."""
    from tvm import tirx

    from rnncc.cells import ops
    from rnncc.schedules.persistent.kernel import kernel

    c = rnncc.cells.get(cell)
    uses = set()
    with ops.lowered_with({name: lambda x, name=name: uses.add(name) for name in ops.UNARY}):
        c.evaluate(*([tirx.Var(f"v{i}", "float32") for i in range(k)]
                     for k in (c.gates, c.gates, len(c.states), len(c.params))))
    text = kernel(c, 33, 3, plan(c.gates, 33, 3, dtype, H100, states=len(c.states)),
                  dtype=dtype).script()
    assert ("__expf" in text) == bool(uses & {"sigmoid", "exp"})
    assert ("__fdividef" in text) == ("sigmoid" in uses)
    assert ("T.tanh(" in text) == ("tanh" in uses)
    x = tirx.Var("x", "float32")
    assert "__expf" not in str(ops.sigmoid(x)) and "__expf" not in str(ops.exp(x))


def test_fast_forms_take_float32_only():
    from tvm import tirx

    from rnncc.cells import ops
    from rnncc.schedules.persistent.stages.cell import FAST_FUNCTIONS

    with ops.lowered_with(FAST_FUNCTIONS):
        assert "__fdividef" in str(ops.sigmoid(tirx.Var("x", "float32")))
        assert "__expf" not in str(ops.sigmoid(tirx.Var("x", "float64")))
    with pytest.raises(KeyError, match="no point-wise functions"):
        with ops.lowered_with({"softplus": abs}):
            pass


@pytest.mark.parametrize("cell, hidden, batch", [("lstm", 512, 1), ("gru", 512, 4),
                                                 ("lstm", 1024, 2), ("rnn_tanh", 64, 40)])
def test_bidirectional_plan_is_two_grids_of_half_the_gpu(cell, hidden, batch):
    """Two directions, their input projections a GEMM (``input_steps=0``): each direction's
    grid planned on half the multiprocessors (with the batch groups chosen,
    :func:`knobs.one_row_groups` included), the grid twice that, and streaming refused."""
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    gates = rnncc.cells.get(cell).gates
    both = knobs.plan_for(Problem(rnncc.cells.get(cell), hidden, hidden, batch, directions=2),
                          H100, {"input_steps": 0}, 24)
    half = dataclasses.replace(H100, sms=H100.sms // 2)
    one = plan(gates, hidden, batch, "float32", half, len(rnncc.cells.get(cell).states),
               batch_groups=both.batch_groups)
    assert both.directions == 2 and not both.fused
    assert (both.blocks, both.batch_groups, both.units) == (2 * one.blocks, one.batch_groups,
                                                             one.units)
    assert both.group_blocks == one.group_blocks and both.blocks <= H100.sms
    with pytest.raises(Unfit, match="a streaming plan runs one direction"):
        plan(gates, hidden, batch, "float32", H100, stream=True, directions=2)


@pytest.mark.parametrize("cell, hidden, batch, overlapped", [
    ("lstm", 512, 4, True), ("gru", 512, 1, True), ("lstm", 448, 6, True),
    ("gru", 640, 5, False), ("lstm", 256, 4, False), ("lstm", 512, 16, False),
    ("lstm", 1024, 4, False)])
def test_both_directions_overlap_their_input_projections_where_the_rule_says(
        cell, hidden, batch, overlapped):
    """float32, C >= BIDIR_OVERLAP_MIN_INPUT, N <= BIDIR_OVERLAP_MAX_BATCH: each direction's
    grid computes its input projections overlapped with the time loop, S*N rows a group the
    first of BIDIR_OVERLAP_ROWS that fits with S >= MIN_STEPS (none at batch 5 of one group,
    none where W_ih's rows do not fit: LSTM 1024), never before the loop unless input_rows
    asks; input_steps=0 (the driver's fallback where the kernel spills) gives the GEMM."""
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    problem = Problem(rnncc.cells.get(cell), hidden, hidden, batch, directions=2)
    found = knobs.plan_for(problem, H100, {}, 24)
    assert found.directions == 2 and bool(found.input_steps) == overlapped == found.fused
    if overlapped:
        assert found.input_steps >= knobs.MIN_STEPS
        assert found.input_rows in knobs.BIDIR_OVERLAP_ROWS
        assert found.input_rows == found.input_steps * batch // found.batch_groups
    gemm = knobs.plan_for(problem, H100, {"input_steps": 0}, 24)
    assert not gemm.fused and gemm.directions == 2
    before = knobs.plan_for(problem, H100, {"input_rows": 8}, 24)
    assert before.input_rows == 8 and before.input_steps == 0
    half = dataclasses.replace(problem, dtype="float16")
    assert not knobs.plan_for(half, H100, {}, 24).fused


@pytest.mark.parametrize("cell, input_size, hidden, groups", [
    ("lstm", 512, 512, 2), ("gru", 576, 576, 2), ("rnn_tanh", 384, 1216, 1)])
def test_both_directions_overlap_in_more_batch_groups_where_few_chunks_move(
        cell, input_size, hidden, groups):
    """Batch 8 of both directions overlaps no input projection in one batch group (S*N of
    BIDIR_OVERLAP_ROWS gives S < MIN_STEPS): in two it does, where those keep at most
    BIDIR_GROUPS_SMEM_CHUNKS chunks of W_hh in shared memory (RNN 1216's would move 4: one
    group and the GEMM); batch_groups given by the knobs are kept."""
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    problem = Problem(rnncc.cells.get(cell), input_size, hidden, 8, directions=2)
    found = knobs.plan_for(problem, H100, {}, 24)
    assert found.batch_groups == groups and bool(found.input_steps) == (groups > 1)
    if groups > 1:
        assert found.sync == "tagged" and found.input_rows == found.input_steps * 8 // groups
        assert found.smem_chunks <= knobs.BIDIR_GROUPS_SMEM_CHUNKS
    else:
        more = knobs.plan_for(problem, H100, {"batch_groups": 2}, 24)
        assert more.smem_chunks > knobs.BIDIR_GROUPS_SMEM_CHUNKS
    one = knobs.plan_for(problem, H100, {"batch_groups": 1}, 24)
    assert one.batch_groups == 1 and not one.input_steps


@pytest.mark.parametrize("gates, hidden, batch, dtype, parts, groups", [
    (4, 1024, 32, "bfloat16", 4, 2), (3, 1024, 32, "bfloat16", 4, 2),
    (4, 512, 64, "float16", 2, 8)])
def test_backward_plan_on_tensor_cores_splits_k(gates, hidden, batch, dtype, parts, groups):
    """16-bit weights: the backward pass's product on tensor cores, a block's few units (the
    rows of W_hh^T, K = G*H deep) with K split among KQ warps each, W_hh^T all in registers;
    the forward's plans take no split (the planner's split_k). Past what fits (LSTM 2048 at
    batch 64) none."""
    from rnncc.schedules.persistent import planner

    p = planner.backward(gates, hidden, batch, dtype, H100, 2, mma=True)
    assert p.mma and (p.k_parts, p.batch_groups, p.k_slices) == (parts, groups, 1)
    assert p.warps == p.row_groups * parts and p.smem_chunks == 0
    assert p.reg_chunks == p.warp_chunks == p.chunks // parts
    assert plan(4, hidden, batch, dtype, H100, 2, batch_groups=None, mma=True).k_parts == 1
    with pytest.raises(Unfit, match="need .* KiB on each"):
        planner.backward(4, 2048, 64, "bfloat16", H100, 2, mma=True)


@pytest.mark.parametrize("gates, hidden, batch, dtype", [
    (4, 128, 32, "float16"), (3, 64, 64, "float16"), (3, 256, 32, "bfloat16"),
    (4, 256, 64, "float16"), (4, 512, 16, "bfloat16")])
def test_backward_plan_on_tensor_cores_exchanges_through_the_barrier(gates, hidden, batch,
                                                                     dtype):
    """16-bit weights: the backward pass on tensor cores exchanges dGH through the barrier
    on any grid (where the exchange the planner picks for its grid is the tagged one: 2-8
    blocks in one group, or many small groups), so that it stages dGH as copies; on the CUDA
    cores the planner's pick stands."""
    from rnncc.schedules.persistent import planner

    p = planner.backward(gates, hidden, batch, dtype, H100, 2, mma=True)
    assert p.mma and p.sync == "barrier" and planner.publishes_staged_h(p, dtype)
    assert planner.exchange(dataclasses.replace(p, mma=False), batch) == "tagged"
    cores = planner.backward(gates, hidden, min(batch, 16), dtype, H100, 2)
    assert not cores.mma and cores.sync == planner.exchange(cores, min(batch, 16))


def test_forward_plan_stages_h_in_slices_of_k_where_it_does_not_fit_whole():
    """bfloat16 LSTM 2048 at batch 32: W_hh's chunks fill registers and most of shared memory,
    and h (32 x 2048 x 2 bytes) no longer fits beside them: h in slices, with the barrier (the
    slices copy h as published; with the knob sync="tagged", none), at batch 8 h whole; a cell that
    exchanges a value before h (the GRU that resets before its product) takes no slices."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    lstm = Problem(cells.get("lstm"), 2048, 2048, 32, "bfloat16")
    p = knobs.plan_for(lstm, H100, {}, 24)
    assert p.mma and p.k_slices > 1 and p.sync == "barrier" and p.smem_chunks > 0
    assert p.smem_bytes <= H100.smem_per_block
    assert knobs.plan_for(Problem(cells.get("lstm"), 2048, 2048, 8, "bfloat16"), H100, {},
                          24).k_slices == 1
    with pytest.raises(Unfit):
        knobs.plan_for(lstm, H100, {"sync": "tagged"}, 24)
    assert not knobs.one_product(cells.get("gru_reset_before"))
    assert knobs.one_product(cells.get("gru")) and knobs.one_product(cells.get("lstm"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_plan_stages_dgh_in_slices_of_k(dtype):
    """LSTM 1024 at batch 64 in 16 bits: a group's dGH (32 rows x 4096, 256 KiB) does not fit
    in shared memory; staged in the fewest slices of K that do (two slices at once, 4 x 64
    KiB), the weights in registers and the barriers (the slices are copies of the published
    dGH). float32 (CUDA cores, no published copy) and the forward's plans take no slices."""
    from rnncc.schedules.persistent import planner

    p = planner.backward(4, 1024, 64, dtype, H100, 2, mma=True)
    assert (p.batch_groups, p.k_parts, p.k_slices, p.smem_chunks) == (2, 4, 4, 0)
    assert p.sync == "barrier" and planner.publishes_staged_h(p, dtype)
    assert planner.mma_staging_bytes(p, 32) == 2 * 32 * 4096 * 2 // 4 + 4 * 8 * 8 * 32
    assert p.smem_bytes == planner.mma_staging_bytes(p, 32) <= H100.smem_per_block
    assert planner.backward(4, 1024, 16, dtype, H100, 2, mma=True).k_slices == 1  # fits whole
    assert plan(4, 1024, 64, dtype, H100, 2, batch_groups=None, mma=True).k_slices == 1
    with pytest.raises(Unfit, match="no split into batch groups of at most 16 fits"):
        planner.backward(4, 1024, 64, "float32", H100, 2)


@pytest.mark.parametrize("hidden, dtype, vec", [
    (32, "float16", 1), (24, "float16", 1), (56, "float16", 2), (128, "float16", 4),
    (200, "float16", 8), (257, "float16", 8), (33, "float32", 2), (64, "float32", 2),
    (100, "float32", 4), (1, "float32", 1), (3, "bfloat16", 1)])
def test_cuda_core_chunks_narrow_to_k_under_one_chunk_a_lane(hidden, dtype, vec):
    """``lane_groups=False``: where K is under one 16-byte chunk of every lane, a lane's chunk
    is the fewest elements that hold K in one (planner: "Narrow chunks"): its weights'
    registers and bytes shrink with it; tensor cores keep 16 bytes, and a narrow plan fuses no
    input projection."""
    from rnncc.schedules.persistent import planner

    elem = planner.ELEMENT_BYTES[dtype]
    p = plan(3, hidden, 2, dtype, H100, lane_groups=False)
    assert p.vec == vec == planner.narrow_vec(hidden, elem) and p.lane_bytes == vec * elem
    assert p.chunks == 1 if hidden <= 32 * 16 // elem else p.chunks > 1
    assert p.chunk_bytes == p.warps * p.rows_per_warp * 32 * vec * elem
    if vec * elem < 16:
        assert fuse_input(p, 3, 1024, 2, H100) is None
    if dtype != "float32" and hidden >= 64:
        mma = plan(3, hidden, 64, dtype, H100, mma=True)
        assert mma.vec == 8 and mma.lane_bytes == 16


@pytest.mark.parametrize("cell, hidden, batch, dtype", [
    ("lstm", 32, 512, "float16"), ("gru", 24, 400, "float16"), ("gru", 64, 64, "float32"),
    ("lstm", 64, 1, "float32"), ("lstm", 128, 256, "float16")])
def test_a_batch_group_of_one_block_exchanges_h_within_it(cell, hidden, batch, dtype):
    """Small H at any batch: a batch group is one block, which keeps h in its own shared
    memory ("local", counted in its plan); knobs may still ask for another exchange, and
    "local" on groups of more blocks is refused, naming what it takes."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs, planner
    from rnncc.spec import Problem

    problem = Problem(cells.get(cell), hidden, hidden, batch, dtype=dtype)
    p = knobs.plan_for(problem, H100, {}, 24)
    local = planner.local_bytes(p, batch // p.batch_groups)
    assert p.group_blocks == 1 and p.sync == "local" and local > 0
    assert not planner.publishes_staged_h(p, dtype)
    assert local == batch // p.batch_groups * p.chunks * p.k_lanes * p.vec * 4  # float32 h
    assert knobs.plan_for(problem, H100, {"sync": "tagged"}, 24).sync == "tagged"
    assert knobs.plan_for(problem, H100, {"sync": "local"}, 24).sync == "local"
    wide = Problem(cells.get(cell), 512, 512, 4, dtype=dtype)
    assert knobs.plan_for(wide, H100, {}, 24).sync != "local"
    with pytest.raises(Unfit, match="sync='local' keeps h in one block: it takes a batch "
                                    "group of one block"):
        knobs.plan_for(wide, H100, {"sync": "local", "batch_groups": 1}, 24)


def test_one_block_plans_count_the_local_exchange_in_shared_memory():
    """A tensor-core plan of one block a group stages h in 16 bits for whole tiles: the
    "local" exchange keeps as many bytes more; a backward plan of one block exchanges dGH so
    too."""
    from rnncc.schedules.persistent import planner

    p = plan(4, 16, 64, "float16", H100, mma=True, max_blocks=1)
    assert p.blocks == 1 and p.sync == "local"
    assert planner.local_bytes(p, 64) == 64 * 256 * 2
    assert p.smem_bytes == (planner.mma_staging_bytes(p, 64) + planner.local_bytes(p, 64)
                            + p.smem_chunks * p.chunk_bytes)
    back = planner.backward(3, 24, 4, "float32", H100, 1)
    assert back.group_blocks == 1 and back.sync == "local" and back.vec == 4



@pytest.mark.parametrize("gates, hidden, dtype, groups", [
    (3, 24, "float16", 8), (4, 32, "float16", 8), (3, 64, "float32", 2), (4, 128, "float16", 2),
    (1, 3, "float32", 32), (4, 256, "float16", 1), (3, 200, "float32", 1)])
def test_lane_groups_hold_k_in_16_byte_chunks_of_the_fewest_lanes(gates, hidden, dtype, groups):
    """By default: 16-byte chunks over KL = 32 / LG lanes, the fewest that hold K, each group
    of lanes its own RW rows (planner: "Lane groups"); none on tensor cores, none with
    ``lane_groups=False``, and no fused input projection with them."""
    from rnncc.schedules.persistent import planner

    p = plan(gates, hidden, 2, dtype, H100)
    elem = planner.ELEMENT_BYTES[dtype]
    assert (p.lane_groups, p.vec, p.lane_bytes) == (groups, 16 // elem, 16)
    assert p.k_lanes == 32 // groups and p.chunks == -(-hidden // (p.k_lanes * p.vec))
    assert p.warps * p.warp_rows >= gates * p.units > p.warps * (p.warp_rows - groups)
    if groups > 1:
        assert fuse_input(p, gates, 1024, 2, H100) is None
    assert plan(gates, hidden, 2, dtype, H100, lane_groups=False).lane_groups == 1
    if dtype == "float16" and hidden >= 64:
        assert plan(gates, hidden, 64, dtype, H100, mma=True).lane_groups == 1


@pytest.mark.parametrize("cell, hidden, batch, dtype", [
    ("lstm", 128, 67, "float32"), ("lstm", 128, 255, "float32"), ("gru", 256, 47, "float32"),
    ("lstm", 256, 37, "float32"), ("gru", 512, 67, "float16"), ("lstm", 256, 47, "float16")])
def test_batch_without_a_fitting_split_pads_to_the_nearest_that_fits(cell, hidden, batch, dtype):
    """Past 16 rows a batch runs in equal groups; one without a split that fits (a prime, or 255
    = 15 x 17) takes the plan of the smallest batch up to N/8 rows more that has one, its rows
    past N padding (planner: "Padded batch"); not in two directions, for training, or where the
    knobs fix the batch groups (those raise Unfit as before)."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.spec import Problem

    problem = Problem(cells.get(cell), hidden, hidden, batch, dtype)
    with pytest.raises(Unfit):
        knobs._plan_exact(problem, H100, {}, 24)
    p = knobs.plan_for(problem, H100, {}, 24)
    run = batch + p.pad
    assert 0 < p.pad <= max(batch // 8, knobs.PAD_MIN_ROWS) and run % p.batch_groups == 0
    for rows in range(batch + 1, run):  # the smallest that fits
        with pytest.raises(Unfit):
            knobs._plan_exact(dataclasses.replace(problem, batch=rows), H100, {}, 24)
    assert dataclasses.replace(p, pad=0) == knobs.plan_for(
        dataclasses.replace(problem, batch=run), H100, {}, 24)
    for other, given in [(dataclasses.replace(problem, directions=2), {}),
                         (dataclasses.replace(problem, training=True), {}),
                         (problem, {"batch_groups": 1})]:
        with pytest.raises(Unfit):
            knobs.plan_for(other, H100, given, 24)


@pytest.mark.parametrize("cell, hidden, batch, dtype, cluster", [
    ("lstm", 72, 3, "float32", 6), ("gru", 106, 4, "float32", 7),
    ("lstm", 128, 4, "float16", 8), ("lstm", 128, 1, "float32", 8),
    ("lstm", 200, 16, "float32", 8),  # 8 clusters of 8, not 16 groups of 8
    ("lstm", 256, 32, "float32", 0),  # 32 groups of 4: past CLUSTER_MAX_BLOCKS
    ("lstm", 256, 1, "float32", 16),  # the planner's 16 blocks, a wide cluster
    ("lstm", 256, 8, "float32", 8),  # 8 clusters of 8, not 4 wide ones
    ("gru", 250, 3, "float32", 16), ("lstm", 255, 8, "float16", 8),
    ("lstm", 320, 1, "float32", 16),  # 8 blocks would hold 160 KiB in shared memory
    ("lstm", 384, 8, "float16", 16),  # 4 wide clusters of 2 rows: 36 Ki more MACs a block
    ("lstm", 512, 8, "float16", 0),  # 4 wide clusters would take 64 Ki more a block
    ("lstm", 64, 1, "float32", 0),  # one block: "local"
    ("ln_lstm", 96, 2, "float32", 0),  # its step exchanges means before h
    ("lstm", 1024, 8, "float16", 0)])  # tensor cores, 64 blocks a group
def test_batch_groups_of_two_to_sixteen_blocks_exchange_h_within_clusters(cell, hidden, batch,
                                                                          dtype, cluster):
    """Where a batch group is 2 to 16 blocks (at most CLUSTER_MAX_BLOCKS in all), on the CUDA
    cores, for a step of one product of h, the group is a cluster of ``cluster`` blocks
    (planner: "A cluster a group"; more than 8 a non-portable size); elsewhere the sync knob
    "cluster" says why not."""
    from rnncc import cells
    from rnncc.schedules.persistent import knobs
    from rnncc.schedules.persistent.planner import CLUSTER_MAX_BLOCKS
    from rnncc.spec import Problem

    problem = Problem(cells.get(cell), hidden, hidden, batch, dtype)
    p = knobs.plan_for(problem, H100, {}, 24)
    assert (p.sync == "cluster") == bool(cluster)
    if cluster:
        assert p.group_blocks == cluster and p.blocks <= CLUSTER_MAX_BLOCKS and not p.mma
        assert knobs.plan_for(problem, H100, {"sync": "tagged"}, 24).sync == "tagged"
        assert knobs.plan_for(problem, gpu_for_arch("sm_80"), {}, 24).sync != "cluster"
        portable = knobs.plan_for(problem, dataclasses.replace(H100, wide_cluster=1), {}, 24)
        assert portable.sync != "cluster" or portable.group_blocks <= 8
    else:
        with pytest.raises(Unfit, match="cluster"):
            knobs.plan_for(problem, H100, {"sync": "cluster"}, 24)


def test_cluster_kernel_launches_as_clusters_not_cooperatively(tmp_path):
    """A persistent kernel whose batch groups are clusters waits on no block outside its
    cluster: launched with the cluster's dimension, not cooperatively, one block a
    multiprocessor in its launch bounds, h put by st.async and no tagged words."""
    from rnncc.compiler.cuda_binary import cooperative_kernels

    module = rnncc.compile("gru", 106, 106, 4, target="cuda", persistent="on", tuning="off")
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "cluster"
    source = module.source("cuda")
    assert not cooperative_kernels(source)
    assert "__launch_bounds__(256, 1) persistent_forward" in source
    assert "st.async.shared::cluster" in source and "ld.acquire.gpu" not in source
    with open(module.export(tmp_path / "gru.so"), "rb") as f:
        exported = f.read()
    assert b"clusterCtaIdx.x" in exported and b"tirx.use_cooperative_launch" not in exported
