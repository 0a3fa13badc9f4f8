"""The public API: the names a user needs from ``import corrnoise``, without loading torch."""

from __future__ import annotations

import subprocess
import sys

import corrnoise


def test_every_public_name_resolves():
    for name in corrnoise.__all__:
        assert getattr(corrnoise, name) is not None, name


def test_import_corrnoise_loads_neither_torch_nor_dp_accounting():
    code = ("import sys, corrnoise; corrnoise.parse_strategy('bsr:4', 16); "
            "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules), 'dp_accounting' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_readme_quick_example_runs():
    C = corrnoise.parse_strategy("bsr:16", 256)
    assert corrnoise.loss_report(C, "minsep:8:32").rms_loss > 0
    event = corrnoise.MechanismEvent(C, "block-cyclic:16:0.5", noise_std=4.0)
    result = corrnoise.account(event, delta=1e-5)
    assert result.kind == "guarantee" and result.epsilon > 0
    assert corrnoise.parse_strategy("dpsgd", 8).label == corrnoise.parse_strategy("identity", 8).label
