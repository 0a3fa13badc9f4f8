"""Issue #9 (first part): result kinds with one gate, options never dropped silently, delta(epsilon),
and CLI options for Monte Carlo estimates and verification sample counts."""

from __future__ import annotations

import json

import pytest

from corrnoise.accounting import account, calibrate
from corrnoise.accounting.gaussian import gaussian_delta
from corrnoise.cli import main
from corrnoise.errors import CorrnoiseError
from corrnoise.strategies import parse_strategy


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(exc_info, param):
    msg = str(exc_info.value)
    assert exc_info.value.param == param and "\n" not in msg and msg.startswith(param + ":"), msg


def test_mmcc_lower_bound_is_kind_lower_bound_and_cannot_size_noise():
    strategy = parse_strategy("toeplitz-sqrt", 6)
    low = account(strategy, "poisson:0.5", noise_std=2.0, delta=1e-5, method="mmcc", lower_bound=True)
    assert low.kind == "lower_bound" and low.to_dict()["kind"] == "lower_bound"
    assert account(strategy, "poisson:0.5", noise_std=2.0, delta=1e-5, method="mmcc").kind == "guarantee"
    with pytest.raises(CorrnoiseError) as e:
        calibrate(strategy, "poisson:0.5", epsilon=4.0, delta=1e-5, method="mmcc", lower_bound=True)
    _one_line(e, "lower_bound")


@pytest.mark.parametrize("option", [{"verify": True}, {"discretisation": 0.5}, {"samples": 1000}])
def test_an_option_the_method_does_not_take_is_refused(option):
    """account(..., verify=True, discretisation=0.5) under pld dropped both silently."""
    name = next(iter(option))
    with pytest.raises(CorrnoiseError) as e:
        account(parse_strategy("identity", 20), "poisson:0.1", noise_multiplier=1.0, delta=1e-5, method="pld",
                **option)
    _one_line(e, name)
    with pytest.raises(CorrnoiseError) as e:
        calibrate(parse_strategy("identity", 20), "poisson:0.1", epsilon=2.0, delta=1e-5, method="pld", **option)
    _one_line(e, name)


def test_delta_of_epsilon_in_the_library():
    strategy = parse_strategy("identity", 20)
    exact = account(strategy, "none", noise_std=0.8, epsilon=1.0)
    assert exact.delta == pytest.approx(gaussian_delta(1.0, 1 / 0.8), rel=1e-12) and exact.epsilon == 1.0
    coarse = {"discretization": 1e-2}  # fast; still a pessimistic (valid) PLD
    pld = account(strategy, "poisson:0.1", noise_multiplier=1.0, epsilon=2.0, **coarse)
    assert account(strategy, "poisson:0.1", noise_multiplier=1.0, delta=pld.delta, **coarse).epsilon <= 2.0
    assert account(strategy, "poisson:0.1", noise_multiplier=1.0, delta=pld.delta * 0.99, **coarse).epsilon > 2.0
    mc = account(parse_strategy("bsr:2", 6), "balls-in-bins:3", noise_std=1.5, epsilon=2.0, samples=4000)
    assert mc.kind == "guarantee" and mc.extras["verified"] is True
    assert max(mc.extras["delta_add"], mc.extras["delta_remove"]) <= mc.delta / 1.25
    with pytest.raises(CorrnoiseError) as e:
        account(strategy, "none", noise_std=0.8, epsilon=1.0, delta=1e-5)
    _one_line(e, "delta")


def test_cli_reports_delta_of_epsilon_without_delta(capsys):
    code, out, err = run(capsys, "account", "identity", "--n", "20", "--batching", "none", "--noise-std", "0.8",
                         "--epsilon", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["delta"] == pytest.approx(gaussian_delta(1.0, 1 / 0.8), rel=1e-12) and data["kind"] == "guarantee"
    code, out, err = run(capsys, "account", "identity", "--n", "20", "--batching", "none", "--noise-std", "0.8",
                         "--epsilon", "1", "--delta", "1e-5")
    assert code == 2 and out == "" and err.startswith("error: noise:")


def test_cli_estimate_and_verify_samples(capsys):
    base = ["account", "bsr:2", "--n", "6", "--batching", "balls-in-bins:3", "--noise-std", "1.5", "--delta", "1e-2",
            "--samples", "4000", "--json"]
    code, out, err = run(capsys, *base, "--estimate")
    assert code == 0, err
    assert json.loads(out)["kind"] == "estimate" and json.loads(out)["verified"] is None
    code, out, err = run(capsys, *base, "--verify-samples", "500")  # failure probability > delta: refused
    assert code == 2 and out == "" and err.startswith("error: verify:") and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, "account", "bsr:2", "--n", "6", "--batching", "balls-in-bins:3", "--epsilon", "2",
                         "--delta", "1e-2", "--samples", "4000", "--estimate")
    assert code == 2 and out == "" and err.startswith("error: estimate:")
    code, out, err = run(capsys, "account", "identity", "--n", "20", "--batching", "poisson:0.1", "--sigma", "1",
                         "--delta", "1e-5", "--estimate")
    assert code == 2 and err.startswith("error: estimate:")
