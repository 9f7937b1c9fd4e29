"""Tuning logs: write, reload, apply (metadata names the log), refusal of corrupt or foreign
logs, and a MetaSchedule tune on llvm measured through an RPC tracker with two servers."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import rnncc
from rnncc.errors import ConfigError
from rnncc.tuning import log as logs

KEY = logs.LogKey("h200", "lstm", 16, 16, 2, "float32")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(logs.ENV, str(tmp_path))
    return tmp_path


def _write(root, key=KEY, knobs=None):
    return logs.write(str(root), key, {"knobs": knobs or {}, "components": []})


def test_round_trip_applies_knobs_and_names_log(root):
    path = _write(root, knobs={"sync": "barrier", "max_blocks": 4})
    found = logs.read(path, KEY)
    assert found.knobs == {"sync": "barrier", "max_blocks": 4}
    module = rnncc.compile("lstm", 16, 16, 2, gpu="h200")
    info = module.metadata["tuning"]
    assert info["log"] == path and info["match"] == "exact"
    plan = module.metadata["schedule"]["persistent"]["plan"]
    assert plan["sync"] == "barrier" and plan["blocks"] <= 4
    off = rnncc.compile("lstm", 16, 16, 2, gpu="h200", tuning="off")
    assert off.metadata["tuning"]["log"] is None
    assert off.metadata["schedule"]["persistent"]["plan"]["sync"] == "local"


def test_nearby_configuration_gives_its_knobs(root):
    """... but not those of the fused input projection (here it would not fit at all) nor the
    grid's cap (tuned for another H)."""
    _write(root, logs.LogKey("h200", "lstm", 32, 32, 2, "float32"),
           {"sync": "grid", "input_steps": 3, "max_blocks": 3})
    module = rnncc.compile("lstm", 16, 16, 2, gpu="h200")
    assert module.metadata["tuning"]["match"] == "nearby"
    assert module.metadata["tuning"]["applied"]["knobs"] == {"sync": "grid"}
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "grid"


def test_a_log_of_a_size_far_off_gives_no_knobs(root):
    """A nearby log passes its knobs on within a ratio of 2 of H: LSTM 64's, not LSTM 16's
    (a plan of 16 blocks exchanging tagged words does not fit one of 16 units)."""
    _write(root, logs.LogKey("h200", "lstm", 64, 64, 2, "float32"), {"sync": "barrier"})
    for size, log in ((33, True), (31, False)):
        info = rnncc.compile("lstm", size, size, 2, gpu="h200").metadata["tuning"]
        assert (info["log"] is not None) == log, size
        assert info.get("match", "nearby") == "nearby"


@pytest.mark.slow
def test_bidirectional_layers_take_their_own_log_else_one_directions(root):
    """A bidirectional layer's log (rnncc tune --bidirectional) is its own: a bidirectional
    module takes it and a one-direction module does not; without it, a bidirectional module
    takes its one direction's knobs as a nearby log's, and refuses that log given by path."""
    both = _write(root, logs.LogKey("h200", "lstm", 16, 16, 2, "float32", 2),
                  {"sync": "barrier"})
    one = _write(root, knobs={"sync": "grid"})
    assert both.endswith("_bidirectional") and logs.read(both).key.directions == 2
    for directions, path, sync in ((2, both, "barrier"), (1, one, "grid")):
        meta = rnncc.compile("lstm", 16, 16, 2, gpu="h200", directions=directions).metadata
        assert (meta["tuning"]["log"], meta["tuning"]["match"]) == (path, "exact")
        assert meta["schedule"]["persistent"]["plan"]["sync"] == sync
    shutil.rmtree(both)
    meta = rnncc.compile("lstm", 16, 16, 2, gpu="h200", directions=2).metadata
    assert (meta["tuning"]["log"], meta["tuning"]["match"]) == (one, "nearby")
    assert meta["schedule"]["persistent"]["plan"]["sync"] == "grid"
    with pytest.raises(ConfigError, match="not lstm C=16 H=16 N=2 float32 bidirectional"):
        rnncc.compile("lstm", 16, 16, 2, gpu="h200", directions=2, tuning=one)


def test_wavefronts_take_logs_of_as_many_layers(root):
    """A wavefront's log (rnncc tune --layers L) is for L layers: a wavefront of L layers
    takes it (exact, or another size's knobs), one layer or another count of layers does
    not."""
    two = _write(root, logs.LogKey("h200", "lstm", 16, 16, 2, "float32", layers=2),
                 {"sync": "barrier"})
    assert two.endswith("_l2") and logs.read(two).key.layers == 2
    for size, match in ((16, "exact"), (24, "nearby")):
        meta = rnncc.compile("lstm", size, size, 2, gpu="h200", layers=2).metadata
        assert (meta["tuning"]["log"], meta["tuning"]["match"]) == (two, match)
        assert meta["schedule"]["persistent"]["plan"]["sync"] == "barrier"
    for layers in (1, 3):
        info = rnncc.compile("lstm", 16, 16, 2, gpu="h200", layers=layers).metadata["tuning"]
        assert info["log"] is None, layers


def test_tf32_modules_take_tf32_logs_else_float32_knobs(root):
    """A module that allows TF32 takes its own ("tf32") log; without one, the float32 log's
    knobs (not its component records, which schedule IEEE components); a float32 module never
    takes a TF32 log, and a TF32 module refuses a float32 log given by path."""
    ieee = _write(root, knobs={"sync": "barrier"})
    info = rnncc.compile("lstm", 16, 16, 2, gpu="h200", allow_tf32=True).metadata["tuning"]
    assert (info["log"], info["precision"]) == (ieee, "float32 log")
    assert info["applied"] == {"knobs": {"sync": "barrier"}, "components": []}
    own = _write(root, logs.LogKey("h200", "lstm", 16, 16, 2, "tf32"), {"sync": "grid"})
    assert own.endswith("lstm_c16_h16_n2_tf32")
    module = rnncc.compile("lstm", 16, 16, 2, gpu="h200", allow_tf32=True)
    assert (module.metadata["tuning"]["log"], module.metadata["tuning"]["match"]) == (
        own, "exact")
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "grid"
    assert rnncc.compile("lstm", 16, 16, 2, gpu="h200").metadata["tuning"]["log"] == ieee
    with pytest.raises(ConfigError, match=r"is for lstm C=16 H=16 N=2 float32 on h200, not "
                                          r"lstm C=16 H=16 N=2 tf32 on h200"):
        rnncc.compile("lstm", 16, 16, 2, gpu="h200", allow_tf32=True, tuning=ieee)


def test_a_gpu_kind_without_logs_takes_its_siblings(root):
    """An H100 takes the H200's log where it has none of its own (same architecture and
    size), and says so; its own log comes first; a kind with no sibling takes none."""
    from rnncc.cli.main import _tuning_line
    from rnncc.spec import Problem
    from rnncc.target import TargetSpec
    from rnncc.tuning.apply import for_compile

    theirs = _write(root, knobs={"sync": "barrier"})
    module = rnncc.compile("lstm", 16, 16, 2, gpu="h100")
    info = module.metadata["tuning"]
    assert (info["log"], info["device"]) == (theirs, "h200")
    assert info["for_device"] == "h100, which has no log of its own"
    assert _tuning_line(module.metadata).endswith(
        "; the h200 log, for h100, which has no log of its own)")  # rnncc inspect's line
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "barrier"
    own = _write(root, logs.LogKey("h100", "lstm", 16, 16, 2, "float32"), {"sync": "grid"})
    problem, cuda = Problem(rnncc.cells.get("lstm"), 16, 16, 2), TargetSpec("cuda")
    found = for_compile(problem, cuda, "h100", "auto")
    assert found.info["log"] == own and "for_device" not in found.info
    assert found.knobs == {"sync": "grid"}
    assert for_compile(problem, cuda, "a100", "auto").info["log"] is None


def test_no_gpu_kind_means_no_log(root):
    _write(root)
    module = rnncc.compile("lstm", 16, 16, 2)
    assert module.metadata["tuning"]["log"] is None
    assert "gpu" in module.metadata["tuning"]["reason"]


def _edit(path, **changes):
    record_path = os.path.join(path, logs.RECORD)
    with open(record_path) as f:
        record = json.load(f)
    record.update(changes)
    with open(record_path, "w") as f:
        json.dump(record, f)


@pytest.mark.parametrize("damage, message, compiles", [
    (lambda p: open(os.path.join(p, logs.RECORD), "w").write("{not json"), "not JSON", True),
    (lambda p: _edit(p, tvm_version="0.19.0"), "TVM 0.19.0", False),
    (lambda p: _edit(p, format=99), "format 99", False),
    (lambda p: _edit(p, knobs={"sync": "sideways"}), "sync must be", True),
    (lambda p: _edit(p, components=["recurrent_gemm"]), "no MetaSchedule database", False),
    (lambda p: open(os.path.join(p, logs.WORKLOADS), "w").write("[1, 2]\n"), "come together",
     False),
])
def test_corrupt_or_foreign_log_is_refused(root, damage, message, compiles):
    """Each damage refused by the log reader, and by compile: named where the log is given
    (``tuning=path``); with a warning, the module built without it, where the log is found
    (the build only for two kinds of damage: each is a compile)."""
    path = _write(root)
    damage(path)
    with pytest.raises(logs.LogError, match=message):
        logs.read(path, KEY)
    with pytest.raises(ConfigError, match=message):
        rnncc.compile("lstm", 16, 16, 2, tuning=path)
    if not compiles:
        return
    with pytest.warns(UserWarning, match=message):
        module = rnncc.compile("lstm", 16, 16, 2, gpu="h200")
    assert module.metadata["tuning"]["log"] is None
    assert module.metadata["tuning"]["refused"] == path


def test_log_for_another_configuration_is_refused(root):
    path = _write(root)
    with pytest.raises(ConfigError, match="is for lstm C=16 H=16 N=2"):
        rnncc.compile("lstm", 16, 16, 3, gpu="h200", tuning=path)


def test_corrupt_database_line_is_refused(root):
    path = _write(root)
    for name, text in ((logs.WORKLOADS, '["abc", "def"]\n'), (logs.RECORDS, "[5, []]\n")):
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    with pytest.raises(logs.LogError, match="does not name one of the 1 workloads"):
        logs.read(path, KEY)


def test_shipped_logs_are_valid():
    base = logs.shipped_root()
    found = [os.path.join(base, d, c) for d in os.listdir(base)
             if os.path.isdir(os.path.join(base, d)) and not d.startswith("_")
             for c in os.listdir(os.path.join(base, d))]
    assert found
    for path in found:
        logs.read(path)


def test_knobs_are_checked():
    with pytest.raises(ConfigError, match="warps must be one of"):
        rnncc.compile("lstm", 16, 16, 2, knobs={"warps": 5})
    with pytest.raises(ConfigError, match="unknown persistent knob"):
        rnncc.compile("lstm", 16, 16, 2, knobs={"vector": 2})
    with pytest.raises(ConfigError, match="unroll must be an integer from 1"):
        rnncc.compile("lstm", 16, 16, 2, knobs={"unroll": 0})


def test_cuda_tune_needs_a_gpu(tmp_path):
    from rnncc.runtime import tvm_runtime

    if tvm_runtime.cuda_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        rnncc.tuning.tune("lstm", 8, 8, 1, log_dir=str(tmp_path))


def test_a_tf32_tune_has_its_own_key(tmp_path):
    """rnncc tune --allow-tf32 tunes the module that allows TF32 under a "tf32" log on CUDA;
    on a CPU, where TF32 changes no kernel, under float32's; TF32 is float32's only."""
    from rnncc.tuning import tuner

    session = tuner._session("gru", 8, 8, 2, "float32", "llvm", None, None, str(tmp_path), 5,
                             0.0, print, allow_tf32=True)
    assert session.problem.allow_tf32 and session.key.dtype == "float32"
    assert logs.precision(session.problem, "cuda") == "tf32"
    with pytest.raises(ConfigError, match="allow_tf32=True applies to float32"):
        tuner._session("gru", 8, 8, 2, "float16", "llvm", None, None, str(tmp_path), 5, 0.0,
                       print, allow_tf32=True)


def test_bidirectional_and_wavefront_tunes_have_their_own_keys(tmp_path, monkeypatch):
    """rnncc tune --bidirectional tunes the bidirectional layer, --layers L the wavefront of
    L layers (on CUDA only: refused elsewhere before anything is measured), each under a key
    of its own."""
    from rnncc.tuning import tuner

    session = tuner._session("gru", 8, 8, 2, "float32", "llvm", None, None,
                             str(tmp_path / "bi"), 5, 0.0, print, directions=2)
    assert session.problem.directions == 2 and session.key.directions == 2
    assert session.key.name == "gru_c8_h8_n2_float32_bidirectional"
    assert session.compiled(tuning="off").directions == 2
    with pytest.raises(ConfigError, match="wavefront of 3 layers runs only on the cuda"):
        tuner._session("gru", 8, 8, 2, "float32", "llvm", None, None, str(tmp_path / "l3"), 5,
                       0.0, print, layers=3)
    assert not (tmp_path / "l3").exists()
    monkeypatch.setattr(tuner, "local_gpu", lambda: ("h200", "NVIDIA H200", 132))
    session = tuner._session("gru", 8, 8, 2, "float32", "cuda", None, None,
                             str(tmp_path / "l3"), 5, 0.0, print, layers=3)
    assert session.problem.layers == 3 and session.key.name == "gru_c8_h8_n2_float32_l3"
    with pytest.raises(ConfigError, match="input size is their hidden size"):
        tuner._session("gru", 4, 8, 2, "float32", "cuda", None, None, str(tmp_path), 5, 0.0,
                       print, layers=3)


def test_a_work_directory_keeps_one_configurations_measurements(tmp_path, monkeypatch):
    """A tune resumes from its work directory's measurements: another configuration's there
    would pass for its own, so a work directory stamped with one is refused to the others."""
    from rnncc.tuning import tuner

    def session(batch, work_dir=str(tmp_path)):
        return tuner._session("gru", 8, 8, batch, "float32", "llvm", None, None, work_dir, 5,
                              0.0, print)

    assert session(2).work_dir == str(tmp_path)
    assert session(2).work_dir == str(tmp_path)  # the same configuration resumes
    with pytest.raises(ConfigError, match=r"keeps the measurements of gru_c8_h8_n2_float32 "
                                          r"on .*, not of gru_c8_h8_n3_float32"):
        session(3)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a work directory's stamp"):
        session(2, work_dir=str(tmp_path / "odd"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert session(3, work_dir=None).work_dir != session(2, work_dir=None).work_dir


@pytest.mark.parametrize("directions, layers", [(2, 1), (1, 2)])
def test_knob_search_builds_the_tuned_module(directions, layers, tmp_path):
    """A bidirectional or a wavefront tune's knob search builds its candidates as such."""
    from rnncc.tuning import knob_search

    key = logs.LogKey("h200", "lstm", 16, 16, 2, "float32", directions, layers)
    spec = {**key.config(), "arch": "sm_90", "sms": 132}
    path, why = knob_search._build((spec, {"sync": "barrier"}, str(tmp_path / "cand.so")))
    assert why is None
    module = rnncc.load(path)
    assert (module.directions, module.layers) == (directions, layers)
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "barrier"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_servers(port, count, timeout=60):
    from tvm.s_tir.meta_schedule.runner import RPCConfig

    config = RPCConfig(tracker_host="127.0.0.1", tracker_port=port, tracker_key="ci")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if config.count_num_servers(allow_missing=True) >= count:
                return
        except Exception:  # noqa: BLE001 - the tracker is still starting
            pass
        time.sleep(1)
    raise AssertionError(f"{count} RPC servers did not register within {timeout} s")


@pytest.mark.slow
def test_rpc_tune_on_llvm_writes_a_log_that_compile_applies(tmp_path, monkeypatch):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                               "127.0.0.1", "--port", str(port), "--port-end",
                               str(port + 1), "--silent"])]
    try:
        time.sleep(3)
        for _ in range(2):
            server = _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server",
                                           "--tracker", f"127.0.0.1:{port}", "--key", "ci",
                                           "--port", str(server), "--port-end",
                                           str(server + 1), "--silent"]))
        _wait_for_servers(port, 2)
        summary = rnncc.tuning.tune("rnn_tanh", 8, 8, 2, target="llvm", trials=4,
                                    time_budget=240, log_dir=str(tmp_path / "logs"),
                                    work_dir=str(tmp_path / "work"), steps=8,
                                    rpc=f"127.0.0.1:{port}:ci", progress=lambda line: None)
    finally:
        for proc in procs:
            proc.kill()
    found = logs.read(summary["log"])
    assert found.record["search"]["rpc"] is True
    assert found.record["search"]["meta_schedule_trials"] >= 1
    assert summary["tuned_ms"] <= summary["default_ms"]
    module = rnncc.compile("rnn_tanh", 8, 8, 2, target="llvm", tuning=summary["log"])
    assert module.metadata["tuning"]["log"] == summary["log"]
    if found.record["components"]:
        assert module.metadata["schedule"]["rules"]["recurrent_gemm"] == "meta_schedule"


@pytest.mark.parametrize("knobs", [{"batch_groups": 3}, {"input_steps": 7}, {"mma": True}])
def test_log_knobs_that_do_not_fit_are_refused(root, knobs):
    """Knobs of the right type and a wrong value for this configuration would leave the
    module without its persistent kernel: the log is refused, with a warning, and the module
    is planned without it."""
    path = _write(root, knobs=knobs)
    with pytest.warns(UserWarning, match=f"knobs of tuning log {path} do not fit"):
        module = rnncc.compile("lstm", 16, 16, 2, gpu="h200")
    assert module.metadata["schedule"]["kind"] == "persistent"
    assert module.metadata["tuning"]["log"] is None
    assert module.metadata["tuning"]["refused"] == path


def test_refused_or_damaged_logs_fall_back_to_the_next(root):
    """A damaged exact log falls back to the nearest good one; a damaged nearby log is
    skipped with a warning."""
    exact = _write(root)
    _edit(exact, format=99)
    damaged = _write(root, logs.LogKey("h200", "lstm", 16, 17, 2, "float32"))
    _edit(damaged, format=99)
    good = _write(root, logs.LogKey("h200", "lstm", 16, 20, 2, "float32"), {"sync": "grid"})
    with pytest.warns(UserWarning) as said:
        module = rnncc.compile("lstm", 16, 16, 2, gpu="h200")
    messages = " ".join(str(w.message) for w in said)
    assert "compiling without it" in messages and "a nearby size's log skipped" in messages
    info = module.metadata["tuning"]
    assert (info["log"], info["match"], info["refused"]) == (good, "nearby", exact)
    assert module.metadata["schedule"]["persistent"]["plan"]["sync"] == "grid"
