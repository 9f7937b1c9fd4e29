"""The command line: compile, cells, inspect, bench, and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest

import rnncc
from rnncc.cli.main import main

DATA = os.path.join(os.path.dirname(__file__), "data")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cells(capsys):
    code, out, _ = run(capsys, "cells")
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert {"lstm", "gru", "rnn_relu", "peephole", "ln_lstm"} <= set(lines)
    assert "3 per-unit parameters" in lines["peephole"] and "reduces" not in lines["peephole"]
    assert lines["ln_lstm"].endswith("14 per-unit parameters; means over the hidden units "
                                     "(ops.mean): persistent in inference and a training "
                                     "forward, one layer a module")
    assert lines["gru_reset_before"].endswith("a recurrent product of a value of its step "
                                              "(ops.recurrent): persistent in inference and "
                                              "training, one layer a module")
    assert ";" not in lines["lstm"]


def test_compile_inspect_bench(capsys, tmp_path):
    path = str(tmp_path / "gru.so")
    code, out, err = run(capsys, "compile", "gru", "--input-size", "5", "--hidden-size", "9",
                         "--batch", "2", "--target", "llvm", "-o", path)
    assert code == 0, err
    assert "compiled gru C=5 H=9 N=2 float32 llvm: non-persistent schedule" in out
    assert path in out
    code, out, _ = run(capsys, "inspect", path)
    summary, body = out.split("\n", 1)
    assert code == 0 and json.loads(body)["cell"] == "gru"
    assert "persistent kernels are CUDA only" in summary
    code, out, _ = run(capsys, "inspect", path, "--source", "tir")
    assert code == 0 and "def forward" in out
    code, out, _ = run(capsys, "bench", path, "--steps", "5", "--repeat", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["rnncc"] > 0 and result["cudnn"] is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compile_half_storage_and_bench_it(dtype, capsys, tmp_path):
    path = str(tmp_path / "lstm16.so")
    code, out, err = run(capsys, "compile", "lstm", "-C", "3", "-H", "5", "-N", "2",
                         "--dtype", dtype, "--target", "llvm", "-o", path)
    assert code == 0, err
    assert f"compiled lstm C=3 H=5 N=2 {dtype} llvm" in out
    meta = json.loads(run(capsys, "inspect", path)[1].split("\n", 1)[1])
    assert meta["dtype"] == dtype
    assert {p["name"]: p["dtype"] for p in meta["functions"]["forward"]}["xp"] == "float32"
    code, out, _ = run(capsys, "bench", path, "--steps", "3", "--repeat", "2", "--json")
    assert code == 0 and json.loads(out)["rnncc"] > 0


@pytest.mark.parametrize("flags, summary, field, last_weight", [
    (["--lengths"], "float32 with lengths llvm", ("lengths", True), "bias_hh_l0"),
    (["--bidirectional", "--lengths"], "float32 bidirectional with lengths llvm",
     ("directions", 2), "bias_hh_l0_reverse"),
    (["--allow-tf32"], "float32 (TF32 allowed) llvm", ("allow_tf32", True), "bias_hh_l0")])
def test_compile_with_lengths_or_both_directions(capsys, tmp_path, flags, summary, field,
                                                  last_weight):
    path = str(tmp_path / "gru.so")
    code, out, err = run(capsys, "compile", "gru", "-C", "3", "-H", "4", "-N", "2", *flags,
                         "--target", "llvm", "-o", path)
    assert code == 0, err
    assert f"compiled gru C=3 H=4 N=2 {summary}" in out
    meta = json.loads(run(capsys, "inspect", path)[1].split("\n", 1)[1])
    assert meta[field[0]] == field[1]
    assert rnncc.load(path).weight_names[-1] == last_weight
    code, out, _ = run(capsys, "bench", path, "--steps", "3", "--repeat", "2", "--json")
    assert code == 0 and json.loads(out)["rnncc"] > 0


def test_compile_takes_the_tf32x3_option(capsys, tmp_path):
    """--tf32x3 is the schedule option tf32x3 (named in the module's metadata; on CPUs it
    changes nothing else)."""
    for flag, on in (("--tf32x3", True), ("--no-tf32x3", False)):
        path = str(tmp_path / f"{on}.so")
        code, _, err = run(capsys, "compile", "gru", "-C", "3", "-H", "4", "-N", "2", flag,
                           "--target", "llvm", "-o", path)
        assert code == 0, err
        meta = json.loads(run(capsys, "inspect", path)[1].split("\n", 1)[1])
        assert meta["schedule"]["options"]["tf32x3"] is on


def test_inspect_names_the_products_split_in_three_tf32_products():
    """rnncc inspect's summary line names a float32 module's products on tensor cores as three
    TF32 products (tf32x3: its tensor-core rules), TF32 where allowed, nothing otherwise."""
    from rnncc.cli.main import _tf32

    rules = {"input_gemm": "cuda.wgmma_gemm", "recurrent_gemm_parts": "cuda.mma_gemm",
             "cell_step": "cuda.elementwise"}
    meta = {"dtype": "float32", "schedule": {"rules": rules}}
    assert _tf32(meta) == " (input_gemm, recurrent_gemm_parts as three TF32 products: tf32x3)"
    assert _tf32({**meta, "allow_tf32": True}) == " (TF32 allowed)"
    assert _tf32({**meta, "dtype": "bfloat16"}) == ""
    assert _tf32({"dtype": "float32", "schedule": {"rules": {"input_gemm": "cuda.sgemm"}}}) == ""


def test_summary_names_products_on_a_generic_gemm_rule():
    """The summary line names the products that fell to a generic GEMM rule (off the other
    rules' sizes: float32 GRU 22 -> 897 at batch 91 on sm_90), and nothing where none did."""
    from rnncc.cli.main import _generic

    rules = {"input_gemm": "cuda.matmul", "recurrent_gemm": "cuda.gemm_simple",
             "cell_step": "cuda.elementwise"}
    assert _generic({"schedule": {"rules": rules}}).startswith(
        "; input_gemm, recurrent_gemm on a generic GEMM rule (several times slower")
    assert _generic({"schedule": {"rules": {"input_gemm": "cuda.sgemm"}}}) == ""
    from rnncc.lowering import sequence
    from rnncc.spec import Options, Problem
    from rnncc.target import TargetSpec

    problem = Problem(rnncc.cells.get("gru"), 22, 897, 91)
    built = sequence.build(problem, Options(persistent="off"), TargetSpec("cuda").tvm_target())
    assert "input_gemm, recurrent_gemm on a generic" in _generic({"schedule": {
        "rules": built.rules}})


def test_projection_and_per_unit_parameters(capsys, tmp_path):
    """--proj-size compiles an LSTMP module (W_hr among its weights) and a network file of
    such layers; bench takes a projection and a cell with per-unit parameters."""
    path = str(tmp_path / "lstmp.so")
    code, out, err = run(capsys, "compile", "lstm", "-C", "3", "-H", "6", "-N", "2", "-P", "2",
                         "--bidirectional", "--target", "llvm", "-o", path)
    assert code == 0, err
    assert "compiled lstm C=3 H=6 P=2 N=2 float32 bidirectional llvm" in out
    assert "weight_hr_l0_reverse" in rnncc.load(path).weight_names
    code, _, err = run(capsys, "compile", "lstm", "-C", "3", "-H", "6", "-N", "2", "-P", "2",
                       "-L", "2", "--target", "llvm", "-o", str(tmp_path / "lstmp.rnet"))
    assert code == 0, err
    assert rnncc.load(str(tmp_path / "lstmp.rnet")).stages[1].module.input_size == 2
    for argv in (["peephole", "-C", "3", "-H", "4", "-N", "2"],
                 ["cifg", "-C", "3", "-H", "4", "-N", "2", "--proj-size", "3"], [path]):
        code, out, err = run(capsys, "bench", *argv, "--target", "llvm", "--steps", "3",
                             "--repeat", "2", "--json")
        assert code == 0 and json.loads(out)["rnncc"] > 0, err
    code, _, err = run(capsys, "compile", "gru", "-C", "3", "-H", "6", "-N", "2", "-P", "2",
                       "--target", "llvm", "-o", str(tmp_path / "x.so"))
    assert code == 2 and err.startswith("rnncc: error: cell 'gru' reads h in its step")


def test_compile_cell_file_and_schedule_flags(capsys, tmp_path):
    path = str(tmp_path / "mgu.so")
    code, out, err = run(capsys, "compile", os.path.join(DATA, "mgu.py"), "-C", "3", "-H", "4",
                         "-N", "1", "--target", "llvm", "--no-fuse-pointwise",
                         "--no-input-gemm", "--no-fused-step", "-o", path)
    assert code == 0, err
    meta = json.loads(run(capsys, "inspect", path)[1].split("\n", 1)[1])
    assert meta["cell"] == "mgu"
    assert meta["schedule"]["options"] == {"input_gemm": False, "gate_gemm": True,
                                           "fuse_pointwise": False, "fused_step": False,
                                           "persistent": "auto", "tf32x3": True}


@pytest.mark.parametrize("argv, message", [
    (["compile", "nope", "-C", "1", "-H", "1", "-N", "1", "-o", "x.so"], "unknown cell 'nope'"),
    (["compile", "lstm", "-C", "0", "-H", "1", "-N", "1", "-o", "x.so"],
     "input_size must be a positive integer, got 0"),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "--dtype", "float8", "-o", "x.so"],
     "unknown dtype 'float8'"),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "--target", "rocm", "-o", "x.so"],
     "unknown target 'rocm'"),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "-o", "/nonexistent/dir/x.so"],
     "cannot write /nonexistent/dir/x.so: directory /nonexistent/dir does not exist"),
    (["compile", "lstm", "-C", "x", "-H", "1", "-N", "1", "-o", "x.so"], "invalid int value"),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "--target", "llvm", "--cpu",
      "notacpu", "-o", "x.so"], "unknown LLVM CPU 'notacpu' for "),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "--cpu", "skylake", "-o", "x.so"],
     "--cpu is for the llvm target, not 'cuda'"),
    (["compile", "lstm", "-H", "1", "-N", "1", "-o", "x.so"], "required"),
    (["inspect", "/nonexistent.so"], "cannot read module file"),
    (["bench", "lstm", "-C", "3"], "bench of a cell needs --hidden-size, --batch"),
    (["compile", "lstm", "-C", "1", "-H", "1", "-N", "1", "--dtype", "bfloat16",
      "--allow-tf32", "-o", "x.so"], "allow_tf32=True applies to float32"),
    (["frobnicate"], "invalid choice"),
])
def test_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rnncc: error: "), err
    assert message in lines[0]


def test_console_script_entry_point(tmp_path):
    """python -m rnncc.cli.main behaves as the installed `rnncc` script."""
    out = subprocess.run([sys.executable, "-m", "rnncc.cli.main", "compile", "lstm", "-C", "0",
                          "-H", "1", "-N", "1", "-o", str(tmp_path / "x.so")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
