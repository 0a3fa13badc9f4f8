"""Shared accounting plumbing (issue #9): worker-count independence, the UI-free progress
callback, and the one matrix coercion used by MMCC (seed 001) and Monte Carlo (seed 000)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from corrnoise.accounting import mmcc as M
from corrnoise.accounting import montecarlo as mc
from corrnoise.accounting._common import as_lower_triangular, map_ordered, resolve_workers
from corrnoise.errors import CorrnoiseError
from corrnoise.progress import null_progress, resolve_progress
from corrnoise.strategies import parse_strategy

C16 = parse_strategy("toeplitz-sqrt", 16).matrix()
SAMPLES = 1 << 17  # four chunks of 32768 at 8 bins: the pool really has work to share


def test_default_workers_is_the_core_count():
    assert resolve_workers(None) == max(1, os.cpu_count() or 1)
    assert resolve_workers(3) == 3
    with pytest.raises(CorrnoiseError) as err:
        resolve_workers(0)
    assert err.value.param == "workers"


def test_monte_carlo_estimates_do_not_depend_on_workers():
    assert len(mc._chunks(8, SAMPLES)) > 1
    one = mc.estimate_delta(C16, 8, 1.0, 1.0, samples=SAMPLES, seed=11, workers=1)
    two = mc.estimate_delta(C16, 8, 1.0, 1.0, samples=SAMPLES, seed=11, workers=2)
    assert one == two
    one = mc.estimate_epsilon(C16, 8, 1.0, 1e-3, samples=SAMPLES, seed=11, workers=1)
    two = mc.estimate_epsilon(C16, 8, 1.0, 1e-3, samples=SAMPLES, seed=11, workers=2)
    assert one == two


def test_monte_carlo_calibration_does_not_depend_on_workers():
    one = mc.calibrate_noise_std(C16, 8, 2.0, 1e-3, samples=SAMPLES, seed=5, workers=1)
    two = mc.calibrate_noise_std(C16, 8, 2.0, 1e-3, samples=SAMPLES, seed=5, workers=2)
    assert one == two


def test_mmcc_does_not_depend_on_workers():
    one = M.mmcc_epsilon("toeplitz-sqrt", 6, 0.2, 1.0, 1e-6, workers=1)
    two = M.mmcc_epsilon("toeplitz-sqrt", 6, 0.2, 1.0, 1e-6, workers=2)
    assert one.epsilon == two.epsilon and one.extras["unique_rows"] > 1


def test_progress_callback_hears_label_done_total():
    calls = []
    mc.estimate_delta(C16, 8, 1.0, 1.0, samples=SAMPLES, seed=1, workers=2,
                      progress=lambda label, done, total: calls.append((label, done, total)))
    total = len(mc._chunks(8, SAMPLES))
    assert calls == [("estimating delta", k, total) for k in range(total + 1)]
    rows = []
    M.mmcc_epsilon("toeplitz-sqrt", 8, 0.2, 1.0, 1e-6, delta_split=0.1, workers=1,
                   progress=lambda label, done, total: rows.append((label, done, total)))
    assert rows[0][:2] == ("MMCC rows", 0) and rows[-1][1] == rows[-1][2]


def test_progress_resolution():
    assert resolve_progress(None) is null_progress and resolve_progress(False) is null_progress
    cb = lambda label, done, total: None  # noqa: E731
    assert resolve_progress(cb) is cb
    with pytest.raises(CorrnoiseError) as err:
        resolve_progress("yes")
    assert err.value.param == "progress"
    assert map_ordered(lambda x: x * x, [1, 2, 3], workers=2, progress=None) == [1, 4, 9]


def test_core_imports_no_terminal_library():
    code = ("import sys; import corrnoise.accounting.mmcc, corrnoise.accounting.montecarlo, corrnoise.progress; "
            "from corrnoise.accounting import account; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'click')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value, param", [
    (np.array([[1.0, 0.0], [-0.5, 1.0]]), "C"),
    (np.array([[1.0, 0.5], [0.0, 1.0]]), "C"),
    (np.ones((2, 3)), "C"),
    (np.array([[np.nan, 0.0], [0.0, 1.0]]), "C"),
])
def test_matrix_coercion_is_one_line_errors(value, param):
    with pytest.raises(CorrnoiseError) as err:
        as_lower_triangular(value, param=param, method="test")
    assert err.value.param == param and "\n" not in str(err.value)
    cmat, label = as_lower_triangular(parse_strategy("toeplitz-sqrt", 4))
    assert cmat.shape == (4, 4) and label
