"""Shared fixtures. GPU tests (marked ``gpu``) run only with ``--gpu`` on a machine with a CUDA
device: ``python -m pytest tests --gpu -m gpu``; long tests (marked ``slow``: a MetaSchedule
tune through RPC, large CUDA builds) only with ``--slow``."""

import os

import numpy as np
import pytest

# A test worker a core (pytest -n): CPU modules run on one thread of TVM's pool each, unless
# TVM_NUM_THREADS says otherwise (rnncc would otherwise give every worker all the cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TVM_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run the tests marked gpu on CUDA")
    parser.addoption("--slow", action="store_true", help="run the tests marked slow too")


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not config.getoption("--gpu"):
        skips["gpu"] = pytest.mark.skip(
            reason="GPU test: run with --gpu on a machine with a CUDA GPU")
    if not config.getoption("--slow"):
        skips["slow"] = pytest.mark.skip(reason="long test: run with --slow")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible runs."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_weights(rng, gates, input_size, hidden_size, dtype="float64", params=()):
    """PyTorch-named weights, uniform in [-1/sqrt(H), 1/sqrt(H)] like torch.nn.LSTM, and a
    cell's per-unit ``params`` (``<name>_l0`` [H], uniform in [-1, 1])."""
    k = 1.0 / np.sqrt(hidden_size)
    return {
        "weight_ih_l0": rng.uniform(-k, k, (gates * hidden_size, input_size)).astype(dtype),
        "weight_hh_l0": rng.uniform(-k, k, (gates * hidden_size, hidden_size)).astype(dtype),
        "bias_ih_l0": rng.uniform(-k, k, gates * hidden_size).astype(dtype),
        "bias_hh_l0": rng.uniform(-k, k, gates * hidden_size).astype(dtype),
        **{f"{p}_l0": rng.uniform(-1, 1, hidden_size).astype(dtype) for p in params},
    }


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """Compiled modules kept in a folder of this test module (rnncc.nn's disk cache), not in
    the user's: ``pytestmark = pytest.mark.usefixtures("module_cache")``."""
    import os

    old = os.environ.get("RNNCC_CACHE_DIR")
    os.environ["RNNCC_CACHE_DIR"] = str(tmp_path_factory.mktemp("modules"))
    yield
    if old is None:
        del os.environ["RNNCC_CACHE_DIR"]
    else:
        os.environ["RNNCC_CACHE_DIR"] = old


@pytest.fixture
def empty_compile_cache(monkeypatch, tmp_path):
    """rnncc's compile cache empty for the test: a new disk folder, nothing in this process's
    memory (a module's first use compiles it)."""
    from rnncc.compiler import cache

    monkeypatch.setenv(cache.ENV, str(tmp_path))
    monkeypatch.setattr(cache, "_loaded", {})


@pytest.fixture
def no_cyclic_gc():
    """Python's cyclic garbage collector off for the test."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def has_nvcc():
    import shutil

    return shutil.which("nvcc") is not None


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every module call in the tests starts from NaN-filled outputs and workspaces."""
    from rnncc.runtime.module import Module

    monkeypatch.setattr(Module, "poison", True)
