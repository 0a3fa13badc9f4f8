"""Amplification-aware optimization for balls-in-bins (issue #12; seed 000 Sec. 4.2, App. D):
each differentiable piece against an independent computation, the implicit-function gradient
against finite differences of the re-calibrated objective, and the end-to-end result."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corrnoise.accounting import montecarlo as mc
from corrnoise.cli import main
from corrnoise.errors import CorrnoiseError
from corrnoise.losses import error_summary
from corrnoise.planner import amplified as am
from corrnoise.strategies import Toeplitz


def _column(seed, n):
    rng = np.random.default_rng(seed)
    return np.concatenate([[1.0], rng.uniform(0.0, 0.8, n - 1) * 0.9 ** np.arange(n - 1)])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([8, 24, 40]))
def test_prefix_error_equals_the_loss_module(seed, n):
    c = _column(seed, n)
    got = float(am.prefix_error(torch.tensor(c)))
    assert got == pytest.approx(error_summary(Toeplitz(c, n))[0], rel=1e-10)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(8, 2), (24, 6), (40, 8), (40, 40)]))
def test_modes_gram_equals_lemma_3_2_modes(seed, shape):
    n, bins = shape
    c = _column(seed, n)
    M = mc.balls_in_bins_modes(Toeplitz(c, n).matrix(), bins)
    np.testing.assert_allclose(am.modes_gram(torch.tensor(c), bins).numpy(), M.T @ M, rtol=1e-12, atol=1e-12)


def test_delta_hat_equals_the_accounting_losses_on_the_same_sample():
    n, bins, nu, eps = 32, 8, 0.9, 0.5
    c = _column(3, n)
    red = mc.reduce_balls_in_bins(Toeplitz(c, n).matrix(), bins)
    g = torch.randn(4096, bins, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = torch.tensor(red.gram)
    add, rem = am.delta_hat(1.0 / nu, G, g, eps)
    u = g.numpy() @ np.linalg.cholesky(red.gram).T
    ya, yr = mc._Losses(red, nu).both(u)
    assert float(add) == pytest.approx(mc._hockey(ya, eps).mean(), rel=1e-10)
    assert float(rem) == pytest.approx(mc._hockey(yr, eps).mean(), rel=1e-10)
    assert float(add) > 0.0 and float(rem) > 0.0


def test_fixed_sample_calibration_brackets_the_target():
    n, bins, eps, delta = 32, 8, 1.0, 1e-3
    G = am.modes_gram(torch.tensor(_column(5, n)), bins)
    g = torch.randn(8192, bins, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    t = am._calibrate_t(G, g, eps, delta, None, rtol=1e-9)
    below = max(float(x) for x in am.delta_hat(t, G, g, eps))
    above = max(float(x) for x in am.delta_hat(t * (1 + 1e-7), G, g, eps))
    assert below <= delta < above


@pytest.mark.parametrize("kind,p", [("blt", 2), ("banded-toeplitz", 4)])
def test_implicit_gradient_equals_finite_differences(kind, p):
    """(IFT) of seed 000 App. D against central differences of the re-calibrated rms (tight bisection)."""
    n, bins, eps, delta = 64, 8, 2.0, 1e-3
    _, theta, column, _ = am._start(kind, n, bins, p, p)
    theta = theta + 0.1  # off the unamplified optimum
    g = torch.randn(4096, bins, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rms, grad, t = am.amplified_rms_and_grad(theta, column, bins, g, eps, delta, rtol=1e-12)
    h = 1e-4
    for i in range(theta.size):
        e = np.zeros_like(theta)
        e[i] = h
        rp = am.amplified_rms_and_grad(theta + e, column, bins, g, eps, delta, t, rtol=1e-12)[0]
        rm = am.amplified_rms_and_grad(theta - e, column, bins, g, eps, delta, t, rtol=1e-12)[0]
        assert grad[i] == pytest.approx((rp - rm) / (2 * h), rel=2e-3, abs=1e-6 * rms)
    assert np.linalg.norm(grad) > 1e-3 * rms


def test_optimize_amplified_improves_on_its_start_and_releases_a_verified_guarantee():
    res = am.optimize_amplified("banded-toeplitz", 64, 8, 2.0, 1e-3, bands=8, steps=30, samples=4096,
                                final_samples=1 << 16)
    assert res.result_kind == "guarantee" and res.privacy.extras.get("verified") is True
    assert res.strategy.is_nonnegative() and len(res.history) == 30
    # the amplified objective improves on the best unamplified start (estimates on common samples)
    assert res.improved and res.optimized_estimate < 0.98 * res.start_estimate
    assert res.rms_error == pytest.approx(res.noise_std * error_summary(res.strategy)[0], rel=1e-12)


@pytest.mark.parametrize("kwargs,param", [
    ({"kind": "dense"}, "kind"),
    ({"n": 8192}, "n"),
    ({"bins": 7}, "bins"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"delta": 1.0}, "delta"),
])
def test_optimize_amplified_rejects_bad_input(kwargs, param):
    args = {"kind": "blt", "n": 64, "bins": 8, "epsilon": 2.0, "delta": 1e-5, **kwargs}
    with pytest.raises(CorrnoiseError) as exc:
        am.optimize_amplified(args.pop("kind"), args.pop("n"), args.pop("bins"), args.pop("epsilon"),
                              args.pop("delta"), steps=0)
    assert exc.value.param == param


def test_cli_optimize_amplified_json(capsys, tmp_path):
    out = tmp_path / "c.json"
    code = main(["optimize", "banded-toeplitz", "--n", "32", "--bands", "4", "--participation", "cyclic:4:8",
                 "--amplification", "balls-in-bins", "--epsilon", "2", "--delta", "1e-3", "--out", str(out),
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("rms_error", "noise_std", "kind", "samples", "seconds"):
        assert key in data
    assert data["result_kind"] == "guarantee" and data["file"] == str(out) and out.exists()
    assert math.isfinite(data["rms_error"]) and data["optimized_rms_estimate"] > 0.0


@pytest.mark.parametrize("argv,param", [
    (["--participation", "single", "--epsilon", "2", "--delta", "1e-5"], "participation"),
    (["--participation", "cyclic:4:8", "--delta", "1e-5"], "epsilon"),
    (["--participation", "cyclic:4:8", "--epsilon", "2", "--delta", "1e-5", "--objective", "max"], "objective"),
])
def test_cli_optimize_amplified_bad_input_is_one_line(capsys, argv, param):
    code = main(["optimize", "blt", "--n", "32", "--amplification", "balls-in-bins", *argv])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and param in err


def test_cli_epsilon_without_amplification_is_one_line(capsys):
    code = main(["optimize", "blt", "--n", "32", "--epsilon", "2"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "epsilon" in err


@pytest.mark.parametrize("kind", ["blt", "toeplitz"])
def test_every_kind_runs_end_to_end_with_c_nonnegative(kind):
    res = am.optimize_amplified(kind, 32, 8, 2.0, 1e-3, buffers=2, steps=3, samples=1024, final_samples=1 << 14)
    assert res.result_kind == "guarantee" and res.strategy.is_nonnegative() and res.strategy.n == 32
    assert res.rms_error == pytest.approx(res.noise_std * error_summary(res.strategy)[0], rel=1e-12)


def test_every_phase_reports_progress():
    """optimize_amplified's report hears each phase in order: the start point, every descent step
    (k of steps), the two selection estimates, then the verified accounting's own phases; and the
    (step, rms) callback still hears each step (the command line was silent when piped)."""
    heard, steps = [], []
    am.optimize_amplified("blt", 32, 8, 2.0, 1e-3, buffers=2, steps=3, samples=1024, final_samples=1 << 14,
                          progress=lambda k, rms: steps.append(k), report=lambda *h: heard.append(h))
    phases = [label.split(":")[0] for label, _, _ in heard]
    first = {p: phases.index(p) for p in dict.fromkeys(phases)}
    order = ["amplified start (the unamplified optimum)", "amplified descent", "amplified selection (two estimates)"]
    assert [p for p in first if p in order] == order
    assert [(d, t) for label, d, t in heard if label.startswith("amplified descent")] == [(1, 3), (2, 3), (3, 3)]
    assert steps == [0, 1, 2]
    assert max(first.values()) > first[order[-1]]  # the verified accounting reports after the selection


def test_cli_amplified_reports_on_a_pipe(capsys, monkeypatch):
    """On a pipe (not a terminal), without --json: progress lines on stderr; with --json: none."""
    import corrnoise.planner.amplified as amp
    from corrnoise.progress import LineProgress

    told = []

    def stand_in(*args, report=None, **kwargs):
        told.append(report)
        raise CorrnoiseError("kind", "stopped by the test")

    monkeypatch.setattr(amp, "optimize_amplified", stand_in)
    for flags in ([], ["--json"]):
        code = main(["optimize", "blt", "--n", "32", "--participation", "cyclic:4:8", "--amplification",
                     "balls-in-bins", "--epsilon", "2", "--delta", "1e-3", *flags])
        assert code != 0 and "stopped by the test" in capsys.readouterr().err
    assert len(told) == 2 and isinstance(told[0], LineProgress) and told[1] is None
