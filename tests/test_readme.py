"""The README's Python examples run as written (on the CPU)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("RNNCC_CACHE_DIR", str(tmp_path / "modules"))
    monkeypatch.chdir(tmp_path)
    block = _python_blocks()[index]
    if "register(Cell(" in block:  # the cell-file example registers a cell named mgu
        block = block.replace('name="mgu"', 'name="readme_mgu"')
    exec(compile(block, f"README.md python block {index}", "exec"), {})
