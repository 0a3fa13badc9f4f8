"""The run as one value (:mod:`corrnoise.runplan`): :func:`plan_run` decides mechanism, batching,
sampler and noise once; a :class:`RunPlan` round-trips through its file and is re-checked by
content on load (a tampered plan is refused in one line naming the field); ``make_private(plan=)``
trains exactly it and refuses a loader or length other than the plan's; ``corrnoise plan
--plan-out`` then ``corrnoise train --plan`` trains the planned run without planning again. Also
the torch-free agreement of sampler, mechanism and accounting (moved from test_torch.py) and the
one vocabulary of batchings and pipelines."""

from __future__ import annotations

import ast
import json
import pathlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.cli import cli
from corrnoise.errors import CorrnoiseError
from corrnoise.runplan import RunPlan, balls_in_bins_accounted_steps, check_agreement, plan_run
from corrnoise.sampling import BlockCyclicPoissonSampler, CyclicSampler, PoissonSampler
from corrnoise.strategies import Dense, Identity, OnlineTree, parse_strategy
from corrnoise.torch import make_private

N, B = 100, 10


def _one_line(exc_info, param):
    msg = str(exc_info.value)
    assert exc_info.value.param == param and "\n" not in msg and msg.startswith(param + ":"), msg


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _dense(steps=20):
    rng = np.random.default_rng(0)
    return Dense(np.tril(rng.uniform(0.0, 0.3, size=(steps, steps))) + np.eye(steps))


def _front(plan=None, n=N, batch=B, **kwargs):
    model = torch.nn.Linear(4, 2)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(n), batch_size=batch),
                        plan=plan, max_grad_norm=1.0, noise_seed=0, **kwargs)


#: (mechanism, batching, noise): a guarantee by PLD/BandMF, by the exact Gaussian, none (noise given), and a
#: mechanism whose arrays live in the .npz beside the mechanism file
CASES = {
    "bandmf": ("bsr:2", "auto", {"epsilon": 4.0}),
    "gaussian": ("dpcgd:0.5", "cyclic", {"epsilon": 2.0}),
    "given-noise": ("identity", "poisson", {"noise_multiplier": 1.0}),
    "balls-in-bins": ("dpcgd:0.5", "balls-in-bins", {"noise_std": 2.0}),
    "dense-arrays": (None, "cyclic", {"epsilon": 3.0}),
}


def _plan(case, **kwargs):
    mechanism, batching, noise = CASES[case]
    return plan_run(dataset_size=N, batch_size=B, mechanism=mechanism if mechanism else _dense(), batching=batching,
                    delta=1e-5, epochs=2, **noise, **kwargs)


# --- the value and its file ------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_plan_round_trips_through_its_file(tmp_path, case):
    plan = _plan(case)
    assert plan.noise_std > 0 and plan.steps == 20 and plan.sampler.steps == 20
    assert (plan.guarantee is None) == ("epsilon" not in CASES[case][2])
    loaded = RunPlan.from_json(plan.to_json(tmp_path / "plan.json"))
    assert loaded.fingerprint == plan.fingerprint
    assert loaded.noise_std == plan.noise_std and loaded.noise_multiplier == plan.noise_multiplier
    assert (loaded.guarantee is None) == (plan.guarantee is None)
    if plan.guarantee is not None:
        assert loaded.guarantee.to_dict() == plan.guarantee.to_dict()
        assert loaded.guarantee.noise_std == loaded.noise_std
    assert loaded.batching == plan.batching and loaded.steps == plan.steps and loaded.sampler == plan.sampler
    assert (loaded.dataset_size, loaded.batch_size, loaded.epochs, loaded.steps_per_epoch, loaded.delta) == \
        (plan.dataset_size, plan.batch_size, plan.epochs, plan.steps_per_epoch, plan.delta)
    assert (loaded.method, loaded.label, loaded.pipeline) == (plan.method, plan.label, plan.pipeline)
    assert "seed" not in json.loads((tmp_path / "plan.json").read_text())["sampler"]["description"]


def _tamper(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _refused(path, param):
    with pytest.raises(CorrnoiseError) as e:
        RunPlan.from_json(path)
    _one_line(e, param)
    return str(e.value)


def test_a_changed_mechanism_array_is_refused(tmp_path):
    path = _plan("dense-arrays").to_json(tmp_path / "plan.json")
    npz = tmp_path / "plan.mechanism.npz"
    with np.load(npz) as data:
        arrays = {k: data[k].copy() for k in data.files}
    key = next(iter(arrays))
    arrays[key][5, 2] += 1e-9  # one entry, barely
    np.savez(npz, **arrays)
    assert "fingerprint" in _refused(path, "mechanism")


def test_a_changed_mechanism_parameter_is_refused(tmp_path):
    path = _plan("bandmf").to_json(tmp_path / "plan.json")
    mechanism = tmp_path / "plan.mechanism.json"
    doc = json.loads(mechanism.read_text())
    doc["n"] = doc["n"] + 1  # another C under the same label
    mechanism.write_text(json.dumps(doc))
    _refused(path, "mechanism")


@pytest.mark.parametrize("case, field, change", [
    ("bandmf", "noise_std", lambda d: d.update(noise_std=d["noise_std"] * 0.9)),  # less noise than calibrated
    ("gaussian", "noise_std", lambda d: d.update(noise_std=d["noise_std"] * 1.1)),
    ("bandmf", "batching", lambda d: d.update(batching="block-cyclic:2:0.1")),
    ("given-noise", "batching", lambda d: d.update(batching="poisson:0.05")),
    ("gaussian", "batching", lambda d: d.update(participation="single")),
    ("bandmf", "mechanism", lambda d: d.update(fingerprint="0" * 64)),
    ("bandmf", "mechanism", lambda d: d["guarantee"].update(fingerprint="0" * 64)),
    ("gaussian", "steps", lambda d: d.update(steps=10)),
    ("gaussian", "dataset_size", lambda d: d.update(dataset_size=200)),
    ("gaussian", "batch_size", lambda d: d.update(batch_size=20)),
    ("gaussian", "delta", lambda d: d.update(delta=1e-6)),
    ("gaussian", "guarantee", lambda d: d["guarantee"].update(kind="estimate")),
    ("given-noise", "estimate", lambda d: d.update(accounting_options={"estimate": True})),
    ("bandmf", "guarantee", lambda d: d["guarantee"].update(epsilon=d["guarantee"]["epsilon"] * 0.99)),  # PLD
    ("gaussian", "guarantee", lambda d: d["guarantee"].update(epsilon=d["guarantee"]["epsilon"] * 0.99)),
    # descriptive fields that contradict the content (a user probe: all were accepted and reported)
    ("bandmf", "label", lambda d: d.update(label="dpsgd")),  # trained bsr:2, reported DP-SGD
    ("bandmf", "mechanism", lambda d: d["mechanism"].update(label="identity")),
    ("balls-in-bins", "pipeline", lambda d: d.update(pipeline="cyclic")),  # cyclic does not form balls-in-bins
    ("given-noise", "pipeline", lambda d: d.update(pipeline="balls-in-bins")),
    ("gaussian", "pipeline", lambda d: d.update(pipeline="teleport")),
    ("gaussian", "epochs", lambda d: d.update(epochs=4)),  # 20 steps are not 4 epochs of 10 examples
    ("balls-in-bins", "epochs", lambda d: d.update(epochs=4, steps_per_epoch=5)),  # consistent with each other only
    ("gaussian", "steps_per_epoch", lambda d: d.update(steps_per_epoch=5)),
])
def test_a_tampered_plan_is_refused_naming_the_field(tmp_path, case, field, change):
    path = _plan(case).to_json(tmp_path / "plan.json")
    _tamper(path, change)
    _refused(path, field)


def test_a_plan_label_names_its_mechanism_by_content(tmp_path):
    """A user probe relabelled a BandMF plan ``dpsgd`` (and its mechanism ``identity``) and training
    reported DP-SGD. A plan's label is kept only where it names the mechanism by content: its own
    label, a name that builds it (same fingerprint), or the planner's name of the candidate the
    plan trains; a mechanism file's path that does not read as it gives way to its own label."""
    planned = plan_run(dataset_size=N, batch_size=B, mechanism="auto", batching="cyclic", epsilon=4.0, delta=1e-5,
                       epochs=2)
    path = planned.to_json(tmp_path / "plan.json")
    assert RunPlan.from_json(path).label == planned.label  # the planner's name of its pick
    others = [c["mechanism"] for c in planned.candidates if c["strategy"] != planned.strategy.label]
    _tamper(path, lambda d: d.update(label=others[0]))  # another candidate's name
    assert "the plan was edited" in _refused(path, "label")
    _tamper(path, lambda d: d.update(label=planned.strategy.label))
    assert RunPlan.from_json(path).label == planned.strategy.label

    def forged(d):  # a name that builds another mechanism, backed by a candidate entry edited to match
        mine = next(c for c in d["candidates"] if c["mechanism"] == planned.label)
        d["candidates"].append({**mine, "mechanism": "dpsgd"})
        d.update(label="dpsgd")

    _tamper(path, forged)
    _refused(path, "label")
    named = _plan("given-noise").to_json(tmp_path / "named.json")
    _tamper(named, lambda d: d.update(label="dpsgd"))  # a name that builds it (identity)
    assert RunPlan.from_json(named).label == "dpsgd"
    _tamper(named, lambda d: d.update(label="dpcgd:0.5"))  # a name that builds another C
    _refused(named, "label")
    _tamper(named, lambda d: d.update(label=str(tmp_path / "gone.json")))  # a file that is not there
    assert RunPlan.from_json(named).label == "identity"


def test_a_file_that_is_not_a_plan_is_refused(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    _refused(tmp_path / "x.json", "plan")
    with pytest.raises(CorrnoiseError) as e:
        _plan("gaussian").to_json(tmp_path / "plan.txt")
    _one_line(e, "plan")


# --- make_private(plan=) -----------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_make_private_with_a_plan_is_the_keywords_run(tmp_path, case):
    mechanism, batching, noise = CASES[case]
    keywords = dict(mechanism=mechanism if mechanism else _dense(), batching=batching, delta=1e-5, epochs=2, **noise)
    _, by_keywords, loader_k = _front(**keywords)
    plan = RunPlan.from_json(_plan(case).to_json(tmp_path / "plan.json"))
    _, by_plan, loader_p = _front(plan)
    assert by_plan.noise_std == by_keywords.noise_std
    assert by_plan.strategy.label == by_keywords.strategy.label and by_plan.plan.fingerprint == plan.fingerprint
    assert by_plan.batching == by_keywords.batching and by_plan.steps == by_keywords.steps
    assert by_plan.sampler.describe() == by_keywords.sampler.describe() and len(loader_p) == len(loader_k)
    assert (by_plan.calibration is None) == (by_keywords.calibration is None)
    if plan.guarantee is not None:
        assert by_plan.run_guarantee().epsilon == plan.guarantee.epsilon == by_keywords.run_guarantee().epsilon


@pytest.mark.parametrize("loader, given, param", [
    ({"n": 90}, {}, "dataset_size"),
    ({"batch": 20}, {}, "batch_size"),
    ({}, {"steps": 10}, "steps"),
    ({}, {"epochs": 3}, "epochs"),
    ({}, {"epsilon": 2.0}, "epsilon"),
    ({}, {"mechanism": "bsr:2"}, "mechanism"),
    ({}, {"batching": "poisson"}, "batching"),
    ({}, {"delta": 1e-6}, "delta"),
])
def test_a_plan_for_another_run_is_refused_naming_the_field(loader, given, param):
    plan = _plan("gaussian")
    with pytest.raises(CorrnoiseError) as e:
        _front(plan, **loader, **given)
    _one_line(e, param)
    _front(plan, steps=20, delta=1e-5)  # what agrees is fine


def test_a_plan_made_with_a_ready_sampler_trains_with_that_sampler():
    sampler = PoissonSampler(N, 0.1, 20, seed=5)
    plan = plan_run(dataset_size=N, batch_size=B, mechanism="identity", batching=sampler, noise_std=1.0, delta=1e-5)
    assert plan.sampler.name is None
    _, opt, _ = _front(plan, batching=sampler)
    assert opt.sampler is sampler
    with pytest.raises(CorrnoiseError) as e:
        _front(plan)
    _one_line(e, "batching")


# --- corrnoise plan --plan-out, corrnoise train --plan --------------------------------------------------
def _invoke(args):
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_train_from_a_planned_file_is_the_planned_run(tmp_path):
    """The planner's recommendation, as a file, trained as is: the same noise_std and guarantee."""
    path = str(tmp_path / "plan.json")
    planned = _invoke(["plan", "--dataset-size", "1437", "--batch-size", "128", "--epochs", "1", "--epsilon", "4",
                       "--delta", "1e-5", "--only", "dpsgd", "--pipeline", "poisson", "--plan-out", path,
                       "--mechanism-file", str(tmp_path / "rec.json"), "--json"])
    assert planned["plan_file"] == path
    plan = RunPlan.from_json(path)
    assert plan.noise_std == planned["recommended"]["noise_std"]
    out = _invoke(["train", "--dataset", "digits", "--plan", path, "--device", "cpu", "--json"])
    assert out["noise_std"] == plan.noise_std and out["epsilon"] == plan.guarantee.epsilon
    assert out["kind"] == "guarantee" and out["batching"] == plan.batching.spec and out["steps"] == plan.steps
    assert out["mechanism"] == plan.label == "dpsgd" and out["pipeline"] == "poisson"


def test_train_from_a_plan_of_a_named_mechanism_is_that_run(tmp_path):
    from corrnoise.training import train

    plan = plan_run(dataset_size=1437, batch_size=128, mechanism="bsr:2", pipeline="poisson", epsilon=4.0,
                    delta=1e-5, epochs=1)
    path = str(plan.to_json(tmp_path / "plan.json"))
    out = _invoke(["train", "--dataset", "digits", "--plan", path, "--device", "cpu", "--json"])
    assert out["noise_std"] == plan.noise_std and out["epsilon"] == plan.guarantee.epsilon
    assert out["batching"] == plan.batching.spec and out["batching"].startswith("block-cyclic:2:")
    direct = train("digits", "bsr:2", batching="poisson", epsilon=4.0, delta=1e-5, epochs=1, batch_size=128,
                   device="cpu")
    assert direct["noise_std"] == plan.noise_std and set(direct.to_dict()) == set(out)
    assert len(out) == 28  # with participation and nonfinite_steps


def test_train_refuses_a_plan_for_other_data(tmp_path, capsys):
    from corrnoise.cli import main

    plan = plan_run(dataset_size=1000, batch_size=128, mechanism="identity", batching="poisson", epsilon=4.0,
                    delta=1e-5, epochs=1)
    path = str(plan.to_json(tmp_path / "plan.json"))
    assert main(["train", "--dataset", "digits", "--plan", path, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: dataset_size:") and "\n" not in err
    assert main(["train", "--dataset", "digits", "--plan", path, "--batch-size", "64"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: batch_size:")
    digits = plan_run(dataset_size=1437, batch_size=128, mechanism="identity", batching="poisson", epsilon=4.0,
                      delta=1e-5, epochs=1)
    digits_path = str(digits.to_json(tmp_path / "digits.json"))
    for command in (["train", "--dataset", "digits", "--device", "cpu"], ["audit", "--dataset", "digits", "--white-box", "--canaries", "8"]):
        # review: a --delta beside a plan was taken silently (the plan's delta trained)
        assert main([*command, "--plan", digits_path, "--delta", "1e-9"]) == 2, command
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: delta: the plan is for delta 1e-05, not 1e-09") and "\n" not in err
    assert main(["train", "--dataset", "digits", "--epsilon", "2"]) == 2  # neither a budget nor a plan
    assert capsys.readouterr().err.strip().startswith("error: delta:")
    assert main(["plan", "--steps", "20", "--epochs", "2", "--epsilon", "2", "--delta", "1e-5",
                 "--plan-out", str(tmp_path / "p.json")]) == 2  # a plan file is of a data set
    assert capsys.readouterr().err.strip().startswith("error: plan_out:")


# --- one vocabulary ----------------------------------------------------------------------------------
def test_the_batching_names_are_written_out_in_one_module():
    """No module but corrnoise.pipelines writes a collection of batching / pipeline names."""
    names = {"poisson", "block-cyclic", "cyclic", "balls-in-bins"}
    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "corrnoise"
    holders = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                if len({e.value for e in items if isinstance(e, ast.Constant)} & names) >= 2:
                    holders.add(path.name)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "BatchingKind":
                holders.add(path.name)
    assert holders == {"pipelines.py"}


def test_the_old_names_stay_importable():
    from corrnoise.torch import front, optimizer
    from corrnoise import training

    for name in ("plan_private", "check_agreement", "make_sampler", "choose_batching", "privacy_spent",
                 "check_run_size", "SAMPLINGS", "Agreement", "PrivatePlan"):
        assert getattr(optimizer, name) is not None
    assert front.plan_mechanism and front.planned_batching("none") == "cyclic" and front.BATCHINGS[0] == "auto"
    assert training.candidate_choice and training.choose_mechanism and training.PIPELINES[0] == "auto"


# --- agreement of sampler, mechanism and accounting (torch-free; was in test_torch.py) --------------

def test_steps_beyond_the_mechanism_are_refused():
    with pytest.raises(CorrnoiseError) as e:
        check_agreement(Identity(5), sampler=PoissonSampler(100, 0.1, 6, seed=0))
    _one_line(e, "steps")


def test_bands_beyond_blocks_are_refused():
    from corrnoise.accounting import method_available

    sampler = BlockCyclicPoissonSampler(100, 2, 0.1, 20, seed=0)
    with pytest.raises(CorrnoiseError) as e:  # tutorial Thm 3.21 needs bands <= blocks
        check_agreement(parse_strategy("bsr:4", 20), sampler=sampler, method="bandmf")
    _one_line(e, "batching")  # the accounting gate's parameter, as from account() (tests/test_gate.py)
    if not method_available("mmcc"):
        with pytest.raises(CorrnoiseError) as e:
            check_agreement(parse_strategy("bsr:4", 20), sampler=sampler)
        _one_line(e, "batching")
    assert check_agreement(parse_strategy("bsr:2", 20), sampler=sampler).method == "bandmf"


def test_poisson_with_a_banded_mechanism_is_refused():
    from corrnoise.accounting import method_available

    sampler = PoissonSampler(100, 0.1, 20, seed=0)
    with pytest.raises(CorrnoiseError) as e:  # DP-SGD accounting needs a diagonal C
        check_agreement(parse_strategy("bsr:2", 20), sampler=sampler, method="pld")
    _one_line(e, "method")  # the accounting gate's parameter, as from account(..., method="pld")
    if not method_available("mmcc"):  # else MMCC (seed 001) accounts it
        with pytest.raises(CorrnoiseError) as e:
            check_agreement(parse_strategy("bsr:2", 20), sampler=sampler)
        _one_line(e, "method")


def test_accounting_must_match_the_sampler():
    sampler = PoissonSampler(100, 0.1, 20, seed=0)
    with pytest.raises(CorrnoiseError) as e:
        check_agreement(Identity(20), sampler=sampler, batching="poisson:0.2")
    _one_line(e, "batching")
    with pytest.raises(CorrnoiseError) as e:
        check_agreement(Identity(20), sampler=CyclicSampler(100, 10, steps=20, seed=0), batching="poisson:0.1")
    _one_line(e, "batching")
    # cyclic batches: 2 epochs of 10 batches; accounting for one participation is wrong
    with pytest.raises(CorrnoiseError) as e:
        check_agreement(Identity(20), sampler=CyclicSampler(100, 10, steps=20, seed=0), batching="none",
                        participation="single")
    _one_line(e, "participation")
    ok = check_agreement(Identity(20), sampler=CyclicSampler(100, 10, steps=20, seed=0), batching="none",
                         participation="minsep:2:10")  # a superset of the cyclic patterns is fine
    assert ok.method == "gaussian" and ok.steps == 20


def test_balls_in_bins_accounted_steps_round_up_to_whole_epochs():
    assert [balls_in_bins_accounted_steps(t, 5) for t in (1, 4, 5, 6, 10, 11)] == [5, 5, 5, 10, 10, 15]


def _mc_plan():
    return plan_run(dataset_size=N, batch_size=B, mechanism="dpcgd:0.5", batching="balls-in-bins", epsilon=2.0,
                    delta=1e-3, epochs=2)


def test_a_monte_carlo_plan_file_is_verified_again_unless_the_cache_holds_its_guarantee(tmp_path, monkeypatch):
    """A plan file's epsilon is a claim: balls-in-bins guarantees are read from the cache of verified
    guarantees or verified afresh on load; an edited epsilon fails that verification."""
    from corrnoise.accounting import montecarlo

    calls = []
    real = montecarlo.verify_privacy
    monkeypatch.setattr(montecarlo, "verify_privacy", lambda *a, **k: calls.append(a[2:4]) or real(*a, **k))
    monkeypatch.setenv("CORRNOISE_CACHE", str(tmp_path / "cache"))
    plan = _mc_plan()
    assert plan.method == "mc" and plan.guarantee.kind == "guarantee"
    path = plan.to_json(tmp_path / "plan.json")
    calls.clear()
    assert RunPlan.from_json(path).guarantee.to_dict() == plan.guarantee.to_dict()
    assert not calls  # the cache holds the guarantee make_private verified
    monkeypatch.setenv("CORRNOISE_CACHE", "off")
    assert RunPlan.from_json(path).guarantee.to_dict() == plan.guarantee.to_dict()
    assert not calls  # this process computed it (accounting.base.was_proven)
    from corrnoise.accounting import base

    monkeypatch.setattr(base, "_PROVEN", set())  # as a new process: neither the cache nor the process knows it
    assert RunPlan.from_json(path).guarantee.to_dict() == plan.guarantee.to_dict()
    assert calls == [(plan.noise_std, plan.guarantee.epsilon)]
    _tamper(path, lambda d: d["guarantee"].update(epsilon=d["guarantee"]["epsilon"] / 2))
    assert "it was edited" in _refused(path, "guarantee")  # its record says otherwise: no verification needed
    assert len(calls) == 1


def test_the_planners_monte_carlo_pick_is_not_verified_a_second_time(monkeypatch):
    """The planner restates its verified balls-in-bins pick for the selection among its finalists
    (delta_v -> delta); that restatement is proven in this process, so the run planned with it takes
    it as it is. Found on a fresh clone with the cache off: make_private verified the pick again
    (the README's quick start on 50,000 examples, 2 min 37 s more)."""
    from corrnoise.accounting.base import was_proven
    from corrnoise.runplan import agreement

    again = []
    real = agreement._screen_epsilon  # the first step of a fresh verification of a given guarantee
    monkeypatch.setattr(agreement, "_screen_epsilon", lambda *a, **k: again.append(a[2]) or real(*a, **k))
    monkeypatch.setenv("CORRNOISE_CACHE", "off")
    plan = plan_run(dataset_size=100, batch_size=10, mechanism="auto", batching="auto", epsilon=2.0, delta=1e-3,
                    epochs=1, progress=False)
    assert plan.method == "mc" and plan.guarantee.extras["selection_verifications"] > 1
    assert was_proven(plan.guarantee) and again == []


def _halve_epsilon(d):
    d["guarantee"].update(epsilon=d["guarantee"]["epsilon"] / 2, target_epsilon=d["guarantee"]["epsilon"] / 2)


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("change", [
    lambda d: d["guarantee"].update(delta=d["guarantee"]["delta"] / 100),  # the probe: 1e-5 -> 1e-7
    lambda d: d.update(delta=d["delta"] / 100) or d["guarantee"].update(delta=d["delta"]),
    lambda d: d["guarantee"].update(epsilon=d["guarantee"]["epsilon"] / 2),
    _halve_epsilon,  # consistently: the record cannot tell, a quick Monte Carlo screening can
    lambda d: d["guarantee"].update(verified=False),
    lambda d: d["guarantee"].update(samples=d["guarantee"]["samples"] // 10),
    lambda d: d["guarantee"].update(delta_add=1.0),
])
def test_a_monte_carlo_plan_whose_fields_contradict_its_verification_is_refused_at_once(tmp_path, monkeypatch,
                                                                                        planned, change):
    """A user probe: a balls-in-bins plan whose guarantee delta was edited (1e-5 -> 1e-7, its
    verification at ~1e-5 recorded beside it) started a 30-minute verification, silent under --json;
    an edited epsilon failed that verification instead of being called edited. Fields that
    contradict the recorded verification are refused at once, in one line, before any sampling
    of a verification."""
    from corrnoise.accounting import base, montecarlo

    monkeypatch.setenv("CORRNOISE_CACHE", "off")
    plan = plan_run(dataset_size=N, batch_size=B, mechanism="dpcgd" if planned else "dpcgd:0.5",
                    batching="balls-in-bins", epsilon=2.0, delta=1e-3, epochs=2)
    assert ("verified_delta" in plan.guarantee.extras) == planned
    path = plan.to_json(tmp_path / "plan.json")
    _tamper(path, change)
    monkeypatch.setattr(base, "_PROVEN", set())  # as a new process
    monkeypatch.setattr(montecarlo, "verify_privacy", lambda *a, **k: pytest.fail("verification started"))
    assert "it was edited" in _refused(path, "guarantee")


@pytest.mark.parametrize("noise", [{"noise_multiplier": 1.3}, {"noise_std": 2.0}])
@pytest.mark.parametrize("name, kind", [("dpsgd", Identity), ("tree", OnlineTree)])
def test_a_family_that_names_one_mechanism_with_a_given_noise_is_that_mechanism(name, kind, noise):
    # mechanism="dpsgd", noise_multiplier=... is DP-SGD, as in Opacus: the planner has nothing to
    # choose, and the run is the one the mechanism's own name gives (parse_strategy)
    given = plan_run(dataset_size=N, batch_size=B, epochs=2, mechanism=name, delta=1e-5, **noise)
    named = plan_run(dataset_size=N, batch_size=B, epochs=2, mechanism=parse_strategy(name, 20), delta=1e-5, **noise)
    assert isinstance(given.strategy, kind) and given.label == name
    assert given.fingerprint == named.fingerprint and given.sampler.name == named.sampler.name
    assert given.noise_std == named.noise_std and given.steps == named.steps
    assert given.sampler.name == ("poisson" if name == "dpsgd" else "cyclic")
    _, opt, _ = _front(mechanism=name, delta=1e-5, epochs=2, **noise)
    assert isinstance(opt.plan.strategy, kind)


@pytest.mark.parametrize("name", ["auto", "bandmf", "blt", "dpcgd", "toeplitz", "dense"])
def test_a_family_the_planner_designs_with_a_given_noise_is_one_line(name):
    with pytest.raises(CorrnoiseError) as err:
        plan_run(dataset_size=N, batch_size=B, epochs=2, mechanism=name, delta=1e-5, noise_multiplier=1.0)
    _one_line(err, "mechanism")
    assert "give epsilon" in str(err.value) and "bsr:B" in str(err.value)  # the names that take a given noise


def test_a_planned_run_of_part_of_an_epoch_is_refused_with_the_lengths_it_can_take():
    """The planner plans whole epochs (its balls-in-bins candidates need them): a step count that
    is not a multiple of N // B (a Trainer's max_steps) is refused before any planning, naming
    the nearest planned lengths and the named-mechanism way out, which does run those steps."""
    for steps, nearest in ((10, "(25)"), (60, "(50 or 75)")):
        with pytest.raises(CorrnoiseError) as e:
            plan_run(dataset_size=200, batch_size=8, delta=1e-5, mechanism="auto", epsilon=3.0, steps=steps)
        _one_line(e, "steps")
        assert f"got {steps}" in str(e.value) and nearest in str(e.value) and "identity" in str(e.value)
    named = plan_run(dataset_size=200, batch_size=8, delta=1e-5, mechanism="identity", epsilon=3.0, steps=10)
    assert named.steps == 10


def test_a_plan_whose_parts_are_not_of_one_run_is_refused():
    """Review: dataclasses.replace(plan, strategy=Identity(n)) trained identity noise under bsr:3's
    guarantee, and a plan rebuilt with another sampler sampled at p = 0.5 where p = 0.1 was
    accounted (epsilon 9.6 reported as 2). make_private(plan=) now checks that the mechanism, the
    sampler and the accounting are of one run."""
    import dataclasses

    from corrnoise.runplan.batching import SamplerSpec
    from corrnoise.sampling import make_sampler

    plan = plan_run(dataset_size=N, batch_size=B, delta=1e-5, mechanism="bsr:3", batching="cyclic", epsilon=2.0,
                    epochs=2)
    with pytest.raises(CorrnoiseError, match="^plan: its mechanism identity is not the one its accounting is of"):
        _front(dataclasses.replace(plan, strategy=Identity(plan.steps)))
    pp = plan_run(dataset_size=N, batch_size=B, delta=1e-5, mechanism="identity", batching="poisson", epsilon=2.0,
                  epochs=2)
    big = make_sampler("poisson", 1, N, 5 * B, steps=pp.steps, seed=0)
    with pytest.raises(CorrnoiseError, match="^plan: its sampler forms poisson:0.5 but its accounting is of "
                                             "poisson:0.1"):
        _front(dataclasses.replace(pp, sampler=SamplerSpec.of("poisson", big, 5 * B), batch_size=5 * B), batch=5 * B)
    _front(plan)  # the plan as made


def test_a_named_batching_the_planner_does_not_form_is_warned_about(recwarn):
    # DP-CGD is not banded: under a Poisson pipeline the planner accounts it unamplified, and its
    # batches are then formed in cyclic order -- not the Poisson sampling the caller named (found
    # by a user probe: silent before)
    with pytest.warns(UserWarning, match=r"batching='poisson'.*formed as 'cyclic', not by poisson sampling"):
        plan = plan_run(dataset_size=64, batch_size=16, mechanism="dpcgd", batching="poisson", epsilon=4.0,
                        delta=1e-5, epochs=2)
    assert plan.sampler.name == "cyclic"
    recwarn.clear()
    plan = plan_run(dataset_size=64, batch_size=16, mechanism="dpsgd", batching="poisson", epsilon=4.0, delta=1e-5,
                    epochs=2)  # DP-SGD keeps its Poisson sampling: nothing to say
    assert plan.sampler.name == "poisson"
    assert not [w for w in recwarn if "formed as" in str(w.message)]
