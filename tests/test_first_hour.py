"""What a new user meets first is never silent (issue "The first hour of a real user", item 5 and
6): a NaN loss, a loop longer than the plan, text for a number, a batch larger than the dataset,
a run without a length; and privacy_spent / get_epsilon answer instantly during a run."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import corrnoise.runplan.agreement as torch_optimizer  # where privacy_spent calls the accounting
from corrnoise.errors import CorrnoiseError
from corrnoise.progress import resolve_progress
from corrnoise.torch import make_private
from corrnoise.torch.opacus_adapter import PrivacyEngine


def _data(n=60):
    torch.manual_seed(0)
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def _private(batch=10, n=60, **kw):
    model = nn.Linear(4, 2)
    options = dict(mechanism="bsr:2", batching="cyclic", delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0,
                   epochs=1, noise_seed=0, seed=0)
    options.update(kw)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(n), batch_size=batch),
                        **options)


def _one_line(err, param):
    assert err.value.param == param and "\n" not in str(err.value), str(err.value)


def _nan_step(model, opt, loader):
    x, y = next(iter(loader))
    loss = nn.functional.cross_entropy(model(x), y) * float("nan")
    loss.backward()
    opt.step()


def test_a_nan_loss_warns_that_the_update_is_noise_only():
    model, opt, loader = _private()
    with pytest.warns(RuntimeWarning, match=r"step 0: 10 of 10 examples had a non-finite gradient.*noise only"):
        _nan_step(model, opt, loader)
    assert opt.steps_taken == 1


def test_nan_policy_raise_refuses_the_step_before_any_noise():
    model, opt, loader = _private(nan_policy="raise")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CorrnoiseError) as err:
        _nan_step(model, opt, loader)
    _one_line(err, "loss")
    assert "nan_policy='raise'" in str(err.value)
    assert opt.steps_taken == 0 and opt.privatizer.step == 0  # no noise row used
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b.detach())


def test_nan_policy_is_checked():
    with pytest.raises(CorrnoiseError) as err:
        _private(nan_policy="ignore")
    _one_line(err, "nan_policy")


def test_a_second_epoch_over_a_loader_planned_for_one_says_so():
    model, opt, loader = _private(epochs=1)
    with pytest.raises(CorrnoiseError) as err:
        for _epoch in range(2):
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    _one_line(err, "epochs")
    assert opt.steps_taken == opt.steps == 6


@pytest.mark.parametrize("param", ["epsilon", "max_grad_norm", "delta", "noise_multiplier"])
def test_text_for_a_number_is_refused(param):
    kw = {"epsilon": "4", "noise_multiplier": None} if param == "epsilon" else {param: "1"}
    with pytest.raises(CorrnoiseError) as err:
        _private(**kw)
    _one_line(err, param)


def test_a_batch_larger_than_the_dataset_names_batch_size():
    with pytest.raises(CorrnoiseError) as err:
        _private(batch=200, n=100, mechanism="bsr:4")
    _one_line(err, "batch_size")
    assert "larger than the dataset (100 examples)" in str(err.value)
    with pytest.raises(CorrnoiseError) as err:  # it said "use a batch of at most 0"
        _private(batch=10, n=0)
    _one_line(err, "data_loader")
    assert "the dataset is empty" in str(err.value)


def test_the_opacus_adapter_without_epochs_asks_for_the_run_length():
    model = nn.Linear(4, 2)
    with pytest.raises(CorrnoiseError) as err:
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(_data(), batch_size=10), noise_multiplier=1.0,
                                     max_grad_norm=1.0)
    _one_line(err, "epochs")
    assert "epochs or steps" in str(err.value)


def test_the_strategy_says_what_it_is():
    _, opt, _ = _private()
    text = repr(opt.strategy)
    assert text == "BandedSqrt('bsr:2', n=6)"


def _count_accounting(monkeypatch):
    """The steps of every event the torch layer accounts (its one call into the accounting)."""
    calls = []
    real = torch_optimizer.account

    def counted(event, *a, **k):
        calls.append(event.steps)
        return real(event, *a, **k)

    monkeypatch.setattr(torch_optimizer, "account", counted)
    return calls


def test_privacy_spent_during_the_run_is_the_run_guarantee_accounted_once(monkeypatch):
    model, opt, loader = _private(mechanism="bsr:2", batching="poisson", epochs=2, noise_multiplier=1.5, seed=None)
    calls = _count_accounting(monkeypatch)
    seen = []
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen.append(opt.privacy_spent())
        if len(seen) == 4:
            break
    assert calls == [opt.steps]  # the whole run once, then kept
    run = seen[-1]
    assert run.kind == "guarantee" and run.extras["scope"] == "run" and run.extras["steps"] == 4
    assert all(r.epsilon == run.epsilon for r in seen)
    prefix = opt.privacy_spent(steps=4)  # on request: the tighter value of the steps taken alone
    assert prefix.extras["scope"] == "prefix" and prefix.kind == "guarantee"
    assert 0 < prefix.epsilon < run.epsilon
    assert opt.privacy_spent(steps=opt.steps).epsilon == pytest.approx(run.epsilon, rel=1e-12)


def test_get_epsilon_is_instant_after_the_first_call(monkeypatch):
    model = nn.Linear(4, 2)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(_data(), batch_size=10), noise_multiplier=1.0,
                                             max_grad_norm=1.0, epochs=2, mechanism="bsr:2", noise_seed=0)
    calls = _count_accounting(monkeypatch)
    for epoch in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        eps = [engine.get_epsilon(1e-5), engine.get_epsilon(1e-6)]
        assert eps[1] > eps[0] > 0
    assert len(calls) == 2  # one per delta for the whole run


def test_plan_json_writes_no_file_unasked_and_takes_epochs_as_a_number(tmp_path, monkeypatch):
    import json as _json

    from click.testing import CliRunner

    from corrnoise.cli import cli

    monkeypatch.chdir(tmp_path)
    args = ["plan", "--steps", "20", "--epochs", "2.0", "--epsilon", "4", "--delta", "1e-5", "--only", "dpsgd",
            "--pipeline", "cyclic", "--json"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    data = _json.loads(out.stdout)
    assert list(tmp_path.iterdir()) == []
    assert data["candidates"][0]["noise_cost_unit"].startswith("model-size Gaussian draws")
    bad = CliRunner().invoke(cli, args[:4] + ["2.5"] + args[5:])
    assert isinstance(bad.exception, CorrnoiseError) and bad.exception.param == "epochs"  # one line: main() exits 2


def test_accounting_a_given_noise_reports_progress(monkeypatch, capsys):
    # the run's guarantee of a given noise is accounted on the first privacy_spent() (a balls-in-bins
    # Monte Carlo verification: about a minute, silent before): its progress reaches stderr
    model, opt, loader = _private(mechanism="bsr:2", batching="poisson", epochs=2, noise_multiplier=1.5, seed=None)
    real = torch_optimizer.account

    def slow(event, *a, progress=None, **k):
        report = resolve_progress(progress)
        report("verifying", 0, 2)
        time.sleep(1.1)  # past LineProgress's quiet first second
        report("verifying", 1, 2)
        return real(event, *a, **k)

    monkeypatch.setattr(torch_optimizer, "account", slow)
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.privacy_spent().kind == "guarantee"
    assert "verifying 1/2" in capsys.readouterr().err
    opt.privacy_spent(steps=1)
    assert "verifying 1/2" in capsys.readouterr().err
