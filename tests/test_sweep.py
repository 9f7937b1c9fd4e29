"""The sweep benchmark's configurations (benchmarks/sweep.py), checked without a GPU: the grid
covers what the "never slower than cuDNN" issue asks of it, and the random draws off the grid
are reproducible and within their ranges."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "benchmarks" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "tf32", "float16", "bfloat16"])
def test_the_grid_spans_batch_1_to_256_in_every_precision(sweep, dtype):
    """Each precision has rows of both cells from batch 1 to 256 and from H 64 to 2048 or
    more, H 64 at batch 64 and 256 among them (the half types at batch 256, and at small H,
    were missing until 2026-11-30, where they lost to cuDNN); at least 60 configurations,
    C != H among them."""
    rows = [c for c in sweep.CONFIGS if c[4] == dtype]
    assert {c[0] for c in rows} == {"lstm", "gru"}
    assert min(c[3] for c in rows) == 1 and max(c[3] for c in rows) == 256
    assert min(c[2] for c in rows) == 64 and max(c[2] for c in rows) >= 2048
    assert {(c[2], c[3]) for c in rows} >= {(64, 64), (64, 256)}
    assert len(sweep.CONFIGS) >= 60 and any(c[1] != c[2] for c in sweep.CONFIGS)
    assert len(set(sweep.CONFIGS)) == len(sweep.CONFIGS)


def test_random_configurations_are_reproducible_and_in_range(sweep):
    """The same seed draws the same configurations, another seed others; every one within
    the documented ranges."""
    drawn = sweep.random_configs(200, 11)
    assert drawn == sweep.random_configs(200, 11) != sweep.random_configs(200, 12)
    for cell, c, h, n, dtype in drawn:
        assert cell in ("lstm", "gru", "rnn_tanh")
        assert 8 <= h <= 4096 and 16 <= c <= 4096 and 1 <= n <= 256
        assert dtype in ("float32", "tf32", "float16", "bfloat16")
