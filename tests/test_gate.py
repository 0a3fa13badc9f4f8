"""One privacy event, one gate (issue #9 item 1).

Every entry point -- account, calibrate, torch make_private, the PrivacyEngine and make_private_run
layers over it (``corrnoise train`` and the planner reach the gate through make_private and
calibrate) -- must refuse an event whose accounting method's preconditions fail with
the SAME one-line error (same parameter, same text): there is one gate
(:func:`corrnoise.accounting.prepare`) and no copies of its checks. Also the result kinds the
gate lets through: only a formal guarantee sizes noise (a lower bound or an estimate never does),
and an option a method does not take is refused, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from corrnoise.accounting import (
    BlockCyclic,
    MechanismEvent,
    NoBatching,
    Poisson,
    account,
    calibrate,
    choose_method,
    get_method,
    method_available,
    prepare,
)
from corrnoise.accounting import preconditions as pre
from corrnoise.errors import CorrnoiseError
from corrnoise.sampling import BallsInBinsSampler, BlockCyclicPoissonSampler, PoissonSampler
from corrnoise.strategies import Banded, Identity, parse_strategy

N_STEPS, N_EX = 20, 40


def _dataset():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N_EX, 3, generator=g), torch.randint(0, 2, (N_EX,), generator=g))


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _make_private(strategy, sampler, method):
    from torch.utils.data import DataLoader

    from corrnoise.torch import make_private

    model = _model()
    make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_dataset(), batch_size=4),
                 mechanism=strategy, batching=sampler, epsilon=2.0, delta=1e-5, max_grad_norm=1.0,
                 accounting_method=method)


def _privacy_engine(strategy, sampler, method):
    from torch.utils.data import DataLoader

    from corrnoise.torch.opacus_adapter import PrivacyEngine

    model = _model()
    PrivacyEngine(accounting_method=method).make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_size=4), target_epsilon=2.0, target_delta=1e-5, max_grad_norm=1.0,
        mechanism=strategy, batching=sampler)


def _make_private_run(strategy, sampler, method):
    from corrnoise.torch import make_private_run

    model = _model()
    make_private_run(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy,
                     _dataset(), mechanism=strategy, sampler=sampler, epsilon=2.0, delta=1e-5,
                     accounting_method=method)


ENTRY_POINTS = {
    "account": lambda c, s, m: account(c, s.batching(), noise_std=3.0, delta=1e-5, method=m),
    "account_event": lambda c, s, m: account(MechanismEvent(c, s.batching(), 3.0), delta=1e-5, method=m),
    "delta_of_epsilon": lambda c, s, m: account(c, s.batching(), noise_std=3.0, epsilon=1.0, method=m),
    "calibrate": lambda c, s, m: calibrate(c, s.batching(), epsilon=2.0, delta=1e-5, method=m),
    "calibrate_event": lambda c, s, m: calibrate(MechanismEvent(c, s.batching()), epsilon=2.0, delta=1e-5, method=m),
    "prepare": lambda c, s, m: prepare(MechanismEvent(c, s.batching()), m),
    "make_private": _make_private,
    "privacy_engine": _privacy_engine,
    "make_private_run": _make_private_run,
}


def _bands_beyond_blocks():
    """(a) bsr:8 under block-cyclic sampling with 4 blocks, method bandmf (tutorial Thm 3.21)."""
    return parse_strategy("bsr:8", N_STEPS), BlockCyclicPoissonSampler(N_EX, 4, 0.4, N_STEPS, seed=0), "bandmf"


def _negative_poisson():
    """(b) a C with negative entries under Poisson sampling, auto -> MMCC refuses (seed 001)."""
    if not method_available("mmcc"):
        pytest.skip("MMCC not in this build")
    return Banded(np.array([[1.0, -0.5]] * N_STEPS)), PoissonSampler(N_EX, 0.1, N_STEPS, seed=0), "auto"


def _negative_balls_in_bins():
    """(c) a C with negative entries under balls-in-bins batching -> Monte Carlo refuses (seed 000)."""
    if not method_available("mc"):
        pytest.skip("Monte Carlo accounting not in this build")
    return Banded(np.array([[1.0, -0.5]] * N_STEPS)), BallsInBinsSampler(N_EX, 4, N_STEPS, seed=0), "auto"


CASES = {
    "bands_beyond_blocks": (_bands_beyond_blocks, "batching", ["8 bands > 4 blocks", "Thm 3.21", "method bandmf"]),
    "negative_poisson": (_negative_poisson, "mechanism", ["negative entries", "method mmcc"]),
    "negative_balls_in_bins": (_negative_balls_in_bins, "mechanism", ["negative entries", "method mc"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_entry_point_gives_the_same_one_line_error(case):
    build, param, phrases = CASES[case]
    strategy, sampler, method = build()
    messages = {}
    for name, entry in ENTRY_POINTS.items():
        with pytest.raises(CorrnoiseError) as err:
            entry(strategy, sampler, method)
        messages[name] = (err.value.param, str(err.value))
    reference = messages["account"]
    assert reference[0] == param and "\n" not in reference[1], reference
    assert all(p in reference[1] for p in phrases), reference
    assert {name: m for name, m in messages.items() if m != reference} == {}


def test_auto_choices_are_unchanged_by_the_gate():
    c8 = parse_strategy("bsr:8", N_STEPS)
    assert choose_method(Identity(10), NoBatching()) == "gaussian"
    assert choose_method(Identity(10), Poisson(0.1)) == "pld"
    assert choose_method(parse_strategy("bsr:4", N_STEPS), BlockCyclic(4, 0.1)) == "bandmf"
    if method_available("mmcc"):  # more bands than blocks, or a banded C under Poisson: MMCC
        assert choose_method(c8, BlockCyclic(4, 0.1)) == "mmcc"
        assert choose_method(c8, Poisson(0.1)) == "mmcc"
    assert choose_method(MechanismEvent(c8, BlockCyclic(8, 0.1))) == "bandmf"


def test_methods_declare_their_preconditions_once():
    assert get_method("bandmf").preconditions == (pre.require_square, pre.require_diagonal_for_poisson,
                                                  pre.require_bands_within_blocks)
    assert get_method("pld").preconditions == get_method("bandmf").preconditions
    assert get_method("gaussian").preconditions == (pre.require_participation_fits, pre.require_mechanism_cut_to_steps)
    if method_available("mmcc"):
        assert get_method("mmcc").preconditions == (pre.require_square, pre.require_nonnegative)
        assert get_method("mmcc").requires_nonnegative


@pytest.mark.parametrize("check,event,param", [
    (pre.require_square, MechanismEvent(parse_strategy("tree", 8), BlockCyclic(8, 0.1)), "mechanism"),
    (pre.require_nonnegative, MechanismEvent(Banded(np.array([[1.0, -0.5]] * 6)), Poisson(0.1)), "mechanism"),
    (pre.require_diagonal_for_poisson, MechanismEvent(parse_strategy("bsr:2", 6), Poisson(0.1)), "method"),
    (pre.require_bands_within_blocks, MechanismEvent(parse_strategy("bsr:4", 6), BlockCyclic(2, 0.1)), "batching"),
    (pre.require_participation_fits, MechanismEvent(Identity(6), NoBatching("cyclic:3:4")), "participation"),
    (pre.require_mechanism_cut_to_steps, MechanismEvent(parse_strategy("toeplitz-sqrt+colnorm", 20),
                                                        NoBatching("cyclic:2:4"), steps=8), "mechanism"),
    (pre.require_whole_epochs, MechanismEvent(parse_strategy("dpcgd:0.9", 5), "balls-in-bins:3"), "steps"),
])
def test_each_precondition_names_its_parameter(check, event, param):
    found = check(event)
    assert found is not None and found.param == param and "\n" not in found.message
    # the same hypotheses hold where they should
    assert check(MechanismEvent(Identity(6), NoBatching())) is None


def test_unamplified_events_need_no_amplification_preconditions():
    negative = Banded(np.array([[1.0, -0.5]] * 6))
    assert pre.require_nonnegative(MechanismEvent(negative, "none")) is None
    assert pre.require_square(MechanismEvent(parse_strategy("tree", 8), "none")) is None


@pytest.mark.parametrize("kwargs,param", [
    (dict(noise_std=0.0), "noise_std"),
    (dict(noise_std=-1.0), "noise_std"),
    (dict(noise_std=float("nan")), "noise_std"),
    (dict(noise_std=float("inf")), "noise_std"),
    (dict(steps=0), "steps"),
    (dict(steps=21), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(batching="shuffle"), "batching"),
    (dict(batching="poisson:1.5"), "p"),
    (dict(strategy="bsr:4"), "mechanism"),
])
def test_event_refuses_bad_fields(kwargs, param):
    fields = dict(strategy=Identity(N_STEPS), batching="poisson:0.1", noise_std=1.0)
    fields.update(kwargs)
    with pytest.raises(CorrnoiseError) as err:
        MechanismEvent(**fields)
    assert err.value.param == param and "\n" not in str(err.value)


def test_event_is_frozen_and_hashable():
    c = Identity(N_STEPS)
    a = MechanismEvent(c, "poisson:0.1", 2, 10)
    b = MechanismEvent(c, Poisson(0.1), 2.0, 10)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.batching == Poisson(0.1) and a.noise_std == 2.0 and MechanismEvent(c, "none").steps == N_STEPS
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.noise_std = 1.0  # type: ignore[misc]
    assert a.without_noise().noise_std is None and a.without_noise().with_noise(2.0) == a


def test_event_and_old_call_forms_give_the_same_numbers():
    c = parse_strategy("bsr:4", N_STEPS)
    event = MechanismEvent(c, BlockCyclic(4, 0.2), noise_std=3.0)
    old = account(c, BlockCyclic(4, 0.2), noise_std=3.0, delta=1e-5, discretization=1e-3)
    new = account(event, delta=1e-5, discretization=1e-3)
    assert new.epsilon == old.epsilon and new.to_dict() == old.to_dict()
    assert account(event, epsilon=new.epsilon, discretization=1e-3).delta == pytest.approx(1e-5, rel=2e-2)
    cal = calibrate(event.without_noise(), epsilon=2.0, delta=1e-5, discretization=1e-3)
    assert cal.noise_std == calibrate(c, BlockCyclic(4, 0.2), epsilon=2.0, delta=1e-5, discretization=1e-3).noise_std
    with pytest.raises(CorrnoiseError) as err:  # calibrating finds the noise: a noisy event is refused
        calibrate(event, epsilon=2.0, delta=1e-5)
    assert err.value.param == "noise_std"
    with pytest.raises(CorrnoiseError) as err:  # one noise only
        account(event, delta=1e-5, noise_std=1.0)
    assert err.value.param == "noise"


def test_event_steps_account_the_leading_block():
    c = Identity(N_STEPS)
    short = account(MechanismEvent(c, Poisson(0.1), 2.0, steps=5), delta=1e-5)
    assert short.epsilon == account(Identity(5), Poisson(0.1), noise_std=2.0, delta=1e-5).epsilon
    assert short.extras["n"] == 5 and math.isfinite(short.epsilon)


def test_balls_in_bins_runs_of_steps_that_are_not_whole_epochs_are_refused_by_the_gate():
    """Review: 5 steps of 3 bins, planned with a given noise, trained and then had no guarantee
    (the analysis is of n = bins * epochs). The gate refuses it for every entry point: a plan with a
    given noise or an epsilon, and a ready sampler."""
    from corrnoise.runplan import plan_run

    message = r"^steps: balls-in-bins batching runs whole epochs of 3 batches .* got 5 steps: use 3 or 6, or another"
    for noise in (dict(noise_std=5.0), dict(epsilon=8.0)):
        with pytest.raises(CorrnoiseError, match=message + ".*accounting method mc"):
            plan_run(dataset_size=7, batch_size=2, delta=1e-5, mechanism="dpcgd:0.9", batching="balls-in-bins",
                     steps=5, **noise)
    with pytest.raises(CorrnoiseError, match=message):
        plan_run(dataset_size=7, batch_size=2, delta=1e-5, mechanism="dpcgd:0.9", batching=BallsInBinsSampler(7, 3, 5),
                 noise_std=5.0)
    assert pre.require_whole_epochs(MechanismEvent(parse_strategy("dpcgd:0.9", 6), "balls-in-bins:3")) is None


def test_a_mechanism_accounted_whole_is_refused_for_fewer_steps_of_repeated_participation():
    """Review: a column-normalized or tree:full mechanism is accounted whole (not cut to the steps
    run), so cyclic:2:4 over an 8-step run of a 20-step mechanism was planned with a given noise,
    trained, and then had no guarantee; with epsilon the schema was refused with advice for 20
    steps. Both are now refused up front, naming the mechanism; built for the run's steps, or with
    single participation (the whole mechanism's column norms bound the run's), it is accounted."""
    from corrnoise.runplan import plan_run

    for mechanism in (parse_strategy("toeplitz-sqrt+colnorm", 20), parse_strategy("tree:full", 20)):
        for noise in (dict(epsilon=2.0), dict(noise_std=3.0)):
            with pytest.raises(CorrnoiseError, match=r"^mechanism: .* is built for n = 20 steps and is accounted "
                                                     r"whole \(not cut to the run's 8\), which cyclic:2:4 does not "
                                                     r"describe: build the mechanism for 8 steps") as err:
                plan_run(dataset_size=12, batch_size=3, delta=1e-5, mechanism=mechanism, batching="cyclic", steps=8,
                         **noise)
            assert "\n" not in str(err.value)
        assert plan_run(dataset_size=12, batch_size=3, delta=1e-5, mechanism=mechanism.with_n(8), batching="cyclic",
                        steps=8, epsilon=2.0).guarantee is not None
        single = MechanismEvent(mechanism, NoBatching("single"), 3.0, steps=8)
        assert pre.require_mechanism_cut_to_steps(single) is None and math.isfinite(account(single, delta=1e-5).epsilon)


# --- result kinds and options through the gate ---------------------------------------------------
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
