"""CPU modules' threads: TVM's pool sized to the physical cores this process may use, unless
the user says (``rnncc.runtime.threads``), and the modules' results on several threads."""

import json
import os
import subprocess
import sys

import pytest

from rnncc.runtime import threads

SIBLINGS = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"


def _machine(monkeypatch, cpus, siblings, quota=None):
    """This process on ``cpus`` whose topology names ``siblings`` (cpu -> its list, or none),
    under a cgroup v2 ``quota`` ("max 100000", "150000 100000") or none."""
    files = {SIBLINGS.format(cpu): text for cpu, text in siblings.items()}
    if quota is not None:
        files["/sys/fs/cgroup/cpu.max"] = quota
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(threads, "_read", files.get)


def test_cores_are_the_affinitys_physical_cores_under_the_quota(monkeypatch):
    _machine(monkeypatch, [0, 1, 2, 3], {0: "0,2", 2: "0,2", 1: "1,3", 3: "1,3"})
    assert threads.cores() == 2  # two hardware threads a core
    _machine(monkeypatch, [0, 1], {0: "0", 1: "1"})
    assert threads.cores() == 2  # one a core: TVM's default took 1
    _machine(monkeypatch, [4, 5, 6], {})
    assert threads.cores() == 3  # no topology: a CPU a core
    _machine(monkeypatch, range(8), {}, quota="150000 100000")
    assert threads.cores() == 2
    _machine(monkeypatch, range(8), {}, quota="20000 100000")
    assert threads.cores() == 1
    _machine(monkeypatch, range(8), {}, quota="max 100000")
    assert threads.cores() == 8


def test_the_users_thread_count_is_kept(monkeypatch):
    _machine(monkeypatch, [0, 1, 2], {})
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads.configure()
    assert os.environ["TVM_NUM_THREADS"] == "3"
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    threads.configure()
    assert os.environ["TVM_NUM_THREADS"] == "1"
    monkeypatch.delenv("TVM_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads.configure()
    assert "TVM_NUM_THREADS" not in os.environ


_RUN = """
import json, sys
import numpy as np
import rnncc
from rnncc import reference
cell, hidden, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(hidden * 100 + batch)
module = rnncc.compile(cell, hidden, hidden, batch, target="llvm")
g, k = module.metadata["gates"], 1 / np.sqrt(hidden)
w = {"weight_ih_l0": rng.uniform(-k, k, (g * hidden, hidden)),
     "weight_hh_l0": rng.uniform(-k, k, (g * hidden, hidden)),
     "bias_ih_l0": rng.uniform(-k, k, g * hidden), "bias_hh_l0": rng.uniform(-k, k, g * hidden)}
x = rng.standard_normal((7, batch, hidden))
y, _ = module(x.astype("float32"), {n: v.astype("float32") for n, v in w.items()})
ref, _ = reference.run(rnncc.cells.get(cell), x, w)
import tvm
from rnncc.runtime import threads
print(json.dumps({"error": reference.relative_error(y, ref), "cores": threads.cores(),
                  "threads": tvm.get_global_func("runtime.NumThreads")()}))
"""


@pytest.mark.parametrize("cell, hidden, batch, given", [("lstm", 257, 1, "2"),
                                                        ("gru", 96, 64, None)])
def test_modules_match_reference_on_their_threads(cell, hidden, batch, given, tmp_path):
    """A CPU module agrees with float64 on the threads of TVM's pool, its products split among
    them (one step's at batch 1, the copied blocks at T*N rows): as many as TVM_NUM_THREADS
    says, or, unset, as this process has cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update({"RNNCC_CACHE_DIR": str(tmp_path)}, **({"TVM_NUM_THREADS": given} if given else {}))
    done = subprocess.run([sys.executable, "-c", _RUN, cell, str(hidden), str(batch)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["threads"] == (int(given) if given else found["cores"])
    assert found["error"] < 1e-5
