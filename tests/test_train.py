"""``corrnoise train`` on digits: a short run, the JSON contract, the budget, bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from corrnoise.accounting import account
from corrnoise.cli import cli, main
from corrnoise.train import load_digits_split, train_digits

KEYS = {"test_accuracy", "epsilon", "delta", "noise_std", "noise_multiplier", "steps", "mechanism", "seconds"}


def test_digits_split_is_fixed_and_scaled():
    xtr, ytr, xte, yte = load_digits_split()
    assert xtr.shape == (1437, 64) and xte.shape == (360, 64)
    assert float(xtr.min()) >= 0.0 and float(xtr.max()) <= 1.0
    assert set(ytr.tolist()) == set(range(10))


def test_short_train_run_json_and_budget():
    runner = CliRunner()
    res = runner.invoke(cli, ["train", "--dataset", "digits", "--mechanism", "dpcgd", "--epsilon", "2",
                              "--delta", "1e-5", "--epochs", "1", "--batch-size", "128", "--seed", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert KEYS <= set(out)
    assert out["mechanism"] == "dpcgd" and out["steps"] == 1437 // 128
    assert 0.0 < out["epsilon"] <= 2.0 and out["delta"] == 1e-5
    assert out["noise_multiplier"] < out["noise_std"]  # ||C||_col > 1 for beta > 0
    assert out["test_accuracy"] > 0.3  # 11 steps at epsilon 2 already learn something


def test_reported_epsilon_is_the_accounting_of_what_ran():
    out = train_digits("dpsgd", epsilon=3.0, delta=1e-5, epochs=0.5, batch_size=128, seed=1)
    from corrnoise.accounting import Poisson
    from corrnoise.strategies import Identity

    assert out["batching"].startswith("poisson:")
    again = account(Identity(out["steps"]), Poisson(128 / 1437), delta=1e-5, noise_std=out["noise_std"])
    assert out["epsilon"] == pytest.approx(again.epsilon, rel=1e-9)
    assert out["epsilon"] <= 3.0 and out["steps"] == round(0.5 * 1437 / 128)


def test_bad_input_is_one_line(capsys):
    assert main(["train", "--mechanism", "nope", "--epsilon", "8", "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: mechanism:") and "\n" not in err
    assert main(["train", "--mechanism", "dpsgd", "--epsilon", "-1", "--delta", "1e-5"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: epsilon:")
    assert main(["train", "--mechanism", "dpsgd", "--epsilon", "8", "--delta", "1e-5", "--batch-size", "5000"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: batch_size:")
