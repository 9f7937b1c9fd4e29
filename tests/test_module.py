"""The module API: export and load, runtime-only loading, packing, arrays in and out, and
the errors a caller gets for bad arguments."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import rnncc
from conftest import random_weights
from helpers import TOL_F32, check_against_reference, compiled
from rnncc import reference
from rnncc.errors import ConfigError, InputError, ModuleFileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def lstm():
    return compiled("lstm", 5, 7, 3)


@pytest.fixture
def inputs(rng):
    w = {k: v.astype("float32") for k, v in random_weights(rng, 4, 5, 7).items()}
    return rng.standard_normal((4, 3, 5)).astype("float32"), w


def test_metadata(lstm):
    meta = lstm.metadata
    assert (meta["cell"], meta["input_size"], meta["hidden_size"], meta["batch"]) == (
        "lstm", 5, 7, 3)
    assert meta["dtype"] == "float32" and meta["target"]["kind"] == "llvm"
    assert meta["rnncc_version"] == rnncc.__version__ and meta["tvm_version"].startswith("0.27")
    assert set(meta["schedule"]["rules"]) >= {"input_gemm", "recurrent_gemm", "cell_step"}
    assert [p["name"] for p in meta["functions"]["forward"]][:1] == ["x"]


def test_export_load_roundtrip(lstm, inputs, tmp_path):
    x, w = inputs
    path = lstm.export(tmp_path / "lstm.so")
    loaded = rnncc.load(path)
    os.remove(path)  # the loaded module keeps its own copy
    assert loaded.metadata == lstm.metadata
    y1, (h1, c1) = lstm(x, w)
    y2, (h2, c2) = loaded(x, w)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(c1, c2)


def test_load_with_runtime_only_tvm(lstm, tmp_path):
    """A module file loads and runs with TVM's runtime library alone (no compiler)."""
    path = lstm.export(tmp_path / "lstm.so")
    code = textwrap.dedent(f"""
        import sys, numpy as np
        import tvm
        assert tvm.base._RUNTIME_ONLY
        import rnncc
        from rnncc import reference
        m = rnncc.load({str(path)!r})
        rng = np.random.default_rng(0)
        u = lambda *shape: rng.uniform(-.3, .3, shape)
        w = {{"weight_ih_l0": u(28, 5), "weight_hh_l0": u(28, 7),
             "bias_ih_l0": u(28), "bias_hh_l0": u(28)}}
        x = rng.standard_normal((6, 3, 5))
        y, (h, c) = m(x.astype("float32"), {{k: v.astype("float32") for k, v in w.items()}})
        ry, _ = reference.run(rnncc.cells.get("lstm"), x, w)
        assert not {{"tvm.s_tir", "rnncc.lowering", "rnncc.compiler"}} & set(sys.modules)
        print("ERR", reference.relative_error(y, ry))
    """)
    path_env = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", "PYTHONPATH": path_env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split("ERR")[1]) < TOL_F32


def test_a_compile_on_first_use_frees_what_the_callers_frames_held(empty_compile_cache,
                                                                    no_cyclic_gc):
    """What the caller's frames hold is freed when they return, with Python's cyclic
    collector off, after a module compiled on first use (the disk cache rnncc.nn uses):
    TVMScript's parser keeps the stack it inspects in a reference cycle, which kept a torch
    training step's autograd graph alive (a CUDA graph capture then failed)."""
    import weakref

    from rnncc.compiler import cache

    class Held:
        pass

    def caller():
        held = Held()
        cache.compiled("lstm", 4, 5, 2, target="llvm")
        return weakref.ref(held)

    assert caller()() is None


def test_packed_weights_reused(lstm, inputs):
    x, w = inputs
    packed = lstm.pack(w)
    np.testing.assert_array_equal(lstm(x, packed)[0], lstm(x, w)[0])
    other = compiled("lstm", 5, 7, 1)
    with pytest.raises(InputError, match="packed for lstm C=5 H=7 N=3"):
        other(x[:, :1], packed)


def test_states_not_given_are_read_from_zeros_made_once(lstm, inputs, rng, monkeypatch):
    """Initial states not given are zeros that the module only reads: made once for a device,
    shape and dtype (not a fill a call), never written by a call, and the results are those
    of zeros given."""
    from rnncc.runtime import arrays

    monkeypatch.setattr(arrays, "_ZEROS", {})  # not other tests' (torch's bfloat16 among them)
    x, w = inputs
    h0 = rng.standard_normal((1, 3, 7)).astype("float32")
    first = lstm(x, w)
    made = dict(arrays._ZEROS)
    lstm(x, w, h0=h0, c0=h0)  # other calls between
    again = lstm(x, w)
    assert dict(arrays._ZEROS) == made and made
    for zeros, _ in made.values():
        assert not np.asarray(zeros.numpy()).any()
    given = lstm(x, w, h0=np.zeros_like(h0), c0=np.zeros_like(h0))
    for a, b, c in zip([first[0], *first[1]], [again[0], *again[1]], [given[0], *given[1]]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_state_dict_and_module_accepted(rng):
    torch = pytest.importorskip("torch")
    ref = torch.nn.GRU(5, 7)
    module = compiled("gru", 5, 7, 3)
    x = torch.randn(4, 3, 5)
    y1, _ = module(x, ref.state_dict())
    y2, _ = module(x, ref)
    assert torch.equal(y1, y2)


def test_biases_may_be_absent_together(inputs, rng):
    x, w = inputs
    module = compiled("lstm", 5, 7, 3)
    no_bias = {k: v for k, v in w.items() if k.startswith("weight")}
    zero_bias = {**no_bias, "bias_ih_l0": np.zeros(28, "float32"),
                 "bias_hh_l0": np.zeros(28, "float32")}
    np.testing.assert_array_equal(module(x, no_bias)[0], module(x, zero_bias)[0])


def test_output_kinds_follow_input(lstm, inputs):
    torch = pytest.importorskip("torch")
    x, w = inputs
    y_np, (h_np, _) = lstm(x, w)
    assert isinstance(y_np, np.ndarray) and h_np.shape == (1, 3, 7)
    y_t, (h_t, c_t) = lstm(torch.tensor(x), {k: torch.tensor(v) for k, v in w.items()})
    assert isinstance(y_t, torch.Tensor) and y_t.shape == (4, 3, 7)
    np.testing.assert_array_equal(y_t.numpy(), y_np)


class _FakeCudaTensor:
    """Something that says, through DLPack, that it lives on cuda:0."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be converted")


@pytest.mark.parametrize("make, match", [
    (lambda x, w: (x[0], w, {}), r"x has shape \[3, 5\], expected \[T, 3, 5\]"),
    (lambda x, w: (x[:, :2], w, {}), r"x has shape \[4, 2, 5\], expected \[T, 3, 5\]"),
    (lambda x, w: (x.astype("float64"), w, {}), "x has dtype float64, expected float32"),
    (lambda x, w: (x[:, :, ::-1].copy()[:, :, ::1][:, :, :4], w, {}), "x has shape"),
    (lambda x, w: (np.asfortranarray(x), w, {}), "x is not C-contiguous"),
    (lambda x, w: (x[:0], w, {}), "0 time steps"),
    (lambda x, w: (x.tolist(), w, {}), "x must be a NumPy array or a DLPack tensor"),
    (lambda x, w: (_FakeCudaTensor(), w, {}), "x is on cuda:0, but this module runs on cpu"),
    (lambda x, w: (x, {k: v for k, v in w.items() if k != "weight_hh_l0"}, {}),
     "missing weight 'weight_hh_l0'"),
    (lambda x, w: (x, {k: v for k, v in w.items() if k != "bias_hh_l0"}, {}),
     "missing weight 'bias_hh_l0'"),
    (lambda x, w: (x, {**w, "weight_ih_l1": w["weight_ih_l0"]}, {}),
     r"unexpected weights \['weight_ih_l1'\]"),
    (lambda x, w: (x, {**w, "weight_hh_l0": w["weight_hh_l0"][:, :6].copy()}, {}),
     r"weight_hh_l0 has shape \[28, 6\], expected \[28, 7\]"),
    (lambda x, w: (x, {**w, "bias_ih_l0": w["bias_ih_l0"].astype("float16")}, {}),
     "bias_ih_l0 has dtype float16"),
    (lambda x, w: (x, [1, 2], {}), "weights must be a mapping"),
    (lambda x, w: (x, w, {"h0": np.zeros((1, 3, 6), "float32")}),
     r"h0 has shape \[1, 3, 6\], expected \[1, 3, 7\]"),
    (lambda x, w: (x, w, {"m0": np.zeros((1, 3, 7), "float32")}),
     "m0 is not an initial state of cell 'lstm'"),
])
def test_bad_arguments(lstm, inputs, make, match):
    x, w = inputs
    args = make(x, w)
    with pytest.raises(InputError, match=match):
        lstm(args[0], args[1], **args[2])


def test_gru_has_no_c0(inputs):
    module = compiled("gru", 5, 7, 3)
    x, _ = inputs
    with pytest.raises(InputError, match="c0 is not an initial state of cell 'gru'"):
        module(x, {}, c0=np.zeros((1, 3, 7), "float32"))


def test_torch_misaligned_and_noncontiguous(lstm, inputs):
    torch = pytest.importorskip("torch")
    x, w = inputs
    tx = torch.from_numpy(x)
    big = torch.zeros(4 * 3 * 5 + 1)
    shifted = big[1:].view(4, 3, 5)
    shifted.copy_(tx)
    with pytest.warns(UserWarning, match="64-byte aligned"):
        y, _ = lstm(shifted, w)
    np.testing.assert_array_equal(y.numpy(), lstm(x, w)[0])
    with pytest.raises(InputError, match="x is not contiguous"):
        lstm(tx.transpose(0, 1).contiguous().transpose(0, 1), w)


def test_load_errors(tmp_path):
    with pytest.raises(ModuleFileError, match="does not exist"):
        rnncc.load(tmp_path / "missing.so")
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an elf")
    with pytest.raises(ModuleFileError, match="not a 64-bit little-endian ELF"):
        rnncc.load(junk)


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_size=0), "input_size must be a positive integer, got 0"),
    (dict(hidden_size=-3), "hidden_size must be a positive integer"),
    (dict(batch=2.5), "batch must be a positive integer"),
    (dict(dtype="int7"), "unknown dtype 'int7'; supported: float32, float16, bfloat16"),
    (dict(target="opencl"), "unknown target 'opencl'; allowed: cuda, llvm"),
    (dict(target="cuda", arch="sm90"), "unknown CUDA architecture 'sm90'"),
    (dict(fuse_everything=True), r"unknown schedule option\(s\) \['fuse_everything'\]"),
    (dict(dtype="float16", allow_tf32=True), "allow_tf32=True applies to float32 .* got dtype "
     "'float16'"),
    (dict(allow_tf32=1), "allow_tf32 must be True or False, got 1"),
])
def test_bad_configurations(kwargs, match):
    args = dict(input_size=3, hidden_size=4, batch=1, target="llvm")
    with pytest.raises(ConfigError, match=match):
        rnncc.compile("lstm", **{**args, **kwargs})


def test_reference_helper_sanity(rng):
    """The reference runs T steps: one step by hand for an RNN."""
    w = random_weights(rng, 1, 2, 3)
    x = rng.standard_normal((1, 1, 2))
    y, _ = reference.run(rnncc.cells.get("rnn_tanh"), x, w)
    expect = np.tanh(x[0] @ w["weight_ih_l0"].T + w["bias_ih_l0"] + w["bias_hh_l0"])
    np.testing.assert_allclose(y[0], expect)
    assert check_against_reference(compiled("rnn_tanh", 2, 3, 1), rng, 3, True) < TOL_F32


@pytest.mark.parametrize("cell, batch, directions", [
    ("lstm", 1, 1), ("gru", 2, 1), ("rnn_tanh", 1, 1), ("lstm", 1, 2), ("gru", 2, 2)])
def test_cpu_input_projection_in_tiles_of_whole_steps(cell, batch, directions, rng):
    """A CPU module at batch 1 or 2 computes the input projections of all steps (of each
    direction) in register tiles of whole steps and then the last T mod (4 / N) steps on
    their own: every T from 1 (no whole tile) to 9 matches float64."""
    module = rnncc.compile(cell, 20, 33, batch, directions=directions, target="llvm")
    rules = module.metadata["schedule"]["rules"]
    assert rules["input_gemm_tiles"] == rules["input_gemm_rest"] == "cpu.gemm"
    for steps in range(1, 10):
        err = check_against_reference(module, rng, steps, steps % 2 == 0)
        assert err < TOL_F32, f"T={steps}: relative error {err:.3e}"
