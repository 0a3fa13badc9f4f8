"""The README's Python snippets run as written (a snippet that crashes is a bug of the first
rank). The first one uses names the reader brings (``train_set``, ``model``, ``criterion``): the
prelude gives them the README's own setup (2,048 examples x 20 features, an MLP, cross-entropy)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

PRELUDE = """
import torch
from torch.utils.data import TensorDataset
torch.manual_seed(0)
train_set = TensorDataset(torch.randn(2048, 20), torch.randint(0, 2, (2048,)))
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
criterion = torch.nn.CrossEntropyLoss()
"""


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _complete(block: str) -> bool:
    """A block meant to run (not an excerpt with ``...`` standing for the reader's arguments)."""
    return not any("..." in line.split("#", 1)[0] for line in block.splitlines())


def test_the_readme_has_runnable_python_snippets():
    blocks = _python_blocks()
    assert len([b for b in blocks if _complete(b)]) >= 2


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_a_readme_python_snippet_runs_as_written(index, tmp_path):
    block = _python_blocks()[index]
    if not _complete(block):
        pytest.skip("an excerpt (its arguments are the reader's: '...')")
    script = tmp_path / "snippet.py"
    script.write_text(PRELUDE + block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "CORRNOISE_CACHE": "off"})  # files it writes: tmp
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
