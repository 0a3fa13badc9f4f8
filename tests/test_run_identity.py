"""Identity by content: a guarantee, a checkpoint or a plan is of a run only if the mechanism's
fingerprint, n, batching and participation match -- never by label (issue "Trust on any machine").

Labels are not unique: every 1-buffer BLT is ``blt(d=1)``, every dense C ``dense``, every two-tap
banded inverse ``bandinv:2``. A guarantee calibrated for one of them and passed with another
reported the first one's epsilon for what ran (a privacy reporting breach)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from conftest import random_strategies
from corrnoise.accounting import MechanismEvent, account, calibrate, run_identity, run_mismatch
from corrnoise.errors import CorrnoiseError
from corrnoise.strategies import (
    BLT, DPCGD, Banded, BandedInverse, BandedSqrt, ColumnNormalized, Dense, Identity, Strategy, Toeplitz,
    mechanism_fingerprint,
)
from corrnoise.torch import make_private

N_STEPS = 10


def _run(mechanism, guarantee, batching="cyclic", examples=100, batch=10, steps=N_STEPS):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(examples, 4), torch.randint(0, 2, (examples,)))
    model = torch.nn.Linear(4, 2)
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=batch),
                        mechanism=mechanism, guarantee=guarantee, steps=steps, batching=batching, delta=1e-5,
                        max_grad_norm=1.0, noise_seed=1)


def _refused_as_guarantee(mechanism, guarantee, **kw):
    with pytest.raises(CorrnoiseError) as err:
        _run(mechanism, guarantee, **kw)
    assert err.value.param == "guarantee"
    assert "\n" not in str(err.value)
    return str(err.value)


# --- the reproductions of the issue ----------------------------------------------------------------
def test_blt_guarantee_is_not_accepted_for_another_blt_with_the_same_label():
    ran, calibrated = BLT([0.3], [0.9], N_STEPS), BLT([0.1], [0.5], N_STEPS)
    assert ran.label == calibrated.label == "blt(d=1)"
    guarantee = calibrate(calibrated, "none", epsilon=1.0, delta=1e-5)
    # what the breach reported vs the truth: the same noise gives a larger epsilon for the other C
    true = account(MechanismEvent(ran, "none", noise_std=guarantee.noise_std), delta=1e-5).epsilon
    assert true > 1.1
    message = _refused_as_guarantee(ran, guarantee)
    assert "another mechanism" in message and "same label" in message


def test_identity_guarantee_is_not_accepted_for_a_dense_lower_triangular_c():
    rng = np.random.default_rng(0)
    c = np.tril(rng.uniform(0.1, 0.5, size=(N_STEPS, N_STEPS))) + np.eye(N_STEPS)
    guarantee = calibrate(Dense(np.eye(N_STEPS)), "none", epsilon=2.0, delta=1e-5)
    assert Dense(c).label == Dense(np.eye(N_STEPS)).label == "dense"
    _refused_as_guarantee(Dense(c), guarantee)
    _refused_as_guarantee(Dense(c), guarantee, batching="balls-in-bins")


def test_bandinv_guarantee_is_not_accepted_for_another_bandinv_with_the_same_label():
    ran, calibrated = BandedInverse(N_STEPS, [1.0, -0.9]), BandedInverse(N_STEPS, [1.0, -0.2])
    assert ran.label == calibrated.label == "bandinv:2"
    _refused_as_guarantee(ran, calibrate(calibrated, "none", epsilon=2.0, delta=1e-5))


def test_the_matching_guarantee_is_accepted_and_reported():
    mechanism = BLT([0.3], [0.9], N_STEPS)
    guarantee = calibrate(mechanism, "none", epsilon=1.0, delta=1e-5)
    _, opt, _ = _run(BLT([0.3], [0.9], N_STEPS), guarantee)  # an equal C built anew: same fingerprint
    assert opt.noise_std == guarantee.noise_std


def test_a_single_participation_guarantee_is_not_accepted_for_a_multi_epoch_cyclic_run():
    """``none`` batching is the same spec for every participation schema: one pass and ten epochs
    must not be told apart by the batching string alone."""
    mechanism = BLT([0.3], [0.9], 20)
    single = calibrate(mechanism, "none", epsilon=2.0, delta=1e-5)
    assert single.extras["participation"] == "single"
    message = _refused_as_guarantee(mechanism, single, examples=20, batch=10, steps=20)  # 10 epochs of 2 steps
    assert "participation" in message


def test_a_guarantee_without_fingerprint_is_refused():
    mechanism = BLT([0.3], [0.9], N_STEPS)
    good = calibrate(mechanism, "none", epsilon=1.0, delta=1e-5)
    stripped = type(good)(good.epsilon, good.delta, good.noise_std, good.noise_multiplier, good.method,
                          {k: v for k, v in good.extras.items() if k != "fingerprint"}, good.kind)
    assert "unidentified mechanism" in _refused_as_guarantee(mechanism, stripped)


def test_a_given_guarantee_is_proved_again_unless_this_process_computed_it(monkeypatch):
    """Review: make_private(guarantee=) trusted the guarantee's epsilon at its noise: with noise_std
    and noise_multiplier edited to a third it trained at 0.74 and reported epsilon 2 (truly 7.08),
    and an epsilon edited to 0.05 was reported as spent; a plan rebuilt with another noise
    (with_noise, dataclasses.replace) kept its guarantee. A guarantee is now taken only if this
    process's accounting computed it, content for content, else it is accounted again: an edited
    one is refused in one line, a weaker claim (a larger epsilon) and a copy are accepted."""
    import dataclasses

    import corrnoise.runplan.agreement as agreement
    from corrnoise.accounting import PrivacyResult
    from corrnoise.accounting.base import was_proven
    from corrnoise.runplan import plan_run

    mechanism = BandedSqrt(N_STEPS, 2)
    g = calibrate(mechanism, "none", epsilon=2.0, delta=1e-5)
    fields = g.to_dict()
    third = PrivacyResult.from_dict({**fields, "noise_std": g.noise_std / 3, "noise_multiplier": g.noise_multiplier / 3})
    assert account(MechanismEvent(mechanism, "none", noise_std=third.noise_std), delta=1e-5).epsilon > 6.0
    for edited, said in ((third, "epsilon 2 but its noise_std gives 7.0"),
                         (PrivacyResult.from_dict({**fields, "epsilon": 0.05}), "epsilon 0.05 but its noise_std gives 2")):
        assert not was_proven(edited)
        assert said in _refused_as_guarantee(mechanism, edited, examples=10, batch=1)
    accounted = []
    monkeypatch.setattr(agreement, "account", lambda *a, **k: accounted.append(1) or account(*a, **k))
    _, opt, _ = _run(mechanism, g, examples=10, batch=1)  # computed here: taken as it is
    assert not accounted and opt.plan.guarantee.epsilon == g.epsilon
    _run(mechanism, PrivacyResult.from_dict(fields), examples=10, batch=1)  # the same content
    assert not accounted
    weaker = PrivacyResult.from_dict({**fields, "epsilon": 2.5})
    _, opt, _ = _run(mechanism, weaker, examples=10, batch=1)
    assert accounted and opt.plan.guarantee.epsilon == 2.5
    plan = plan_run(dataset_size=10, batch_size=1, steps=N_STEPS, mechanism=mechanism, batching="cyclic", delta=1e-5,
                    epsilon=2.0)
    for rebuilt in (plan.with_noise(plan.noise_std / 3, plan.guarantee),
                    dataclasses.replace(plan, guarantee=PrivacyResult.from_dict({**plan.guarantee.to_dict(),
                                                                                  "epsilon": 0.05}))):
        model = torch.nn.Linear(4, 2)
        with pytest.raises(CorrnoiseError, match="^(noise_std|guarantee): "):
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(TensorDataset(torch.randn(10, 4), torch.randint(0, 2, (10,))), batch_size=1),
                         plan=rebuilt, max_grad_norm=1.0)


# --- two different C with one label are told apart, per strategy kind with parameters ------------
def _pairs():
    rng = np.random.default_rng(1)
    d1 = np.tril(rng.uniform(0.1, 0.5, size=(N_STEPS, N_STEPS))) + np.eye(N_STEPS)
    d2 = d1.copy()
    d2[5, 2] += 1e-9  # one entry, barely
    b1 = np.column_stack([np.ones(N_STEPS), rng.uniform(0.1, 0.5, size=(N_STEPS, 2))])
    b2 = b1.copy()
    b2[3, 1] *= 1.5
    return {
        "blt": (BLT([0.3], [0.9], N_STEPS), BLT([0.3], [0.9 + 1e-12], N_STEPS)),
        "dpcgd": (DPCGD(0.9, N_STEPS), DPCGD(0.9000001, N_STEPS)),
        "banded": (Banded(b1), Banded(b2)),
        "banded-toeplitz": (Toeplitz([1.0, 0.5, 0.2], N_STEPS), Toeplitz([1.0, 0.5, 0.3], N_STEPS)),
        "toeplitz": (Toeplitz(np.linspace(1.0, 0.1, N_STEPS), N_STEPS), Toeplitz(np.linspace(1.0, 0.2, N_STEPS), N_STEPS)),
        "dense": (Dense(d1), Dense(d2)),
        "bandinv": (BandedInverse(N_STEPS, [1.0, -0.9]), BandedInverse(N_STEPS, [1.0, -0.2])),
        "colnorm": (ColumnNormalized(Banded(b1)), ColumnNormalized(Banded(b2))),
    }


@pytest.mark.parametrize("kind", sorted(_pairs()))
def test_two_c_with_one_label_are_told_apart(kind):
    a, b = _pairs()[kind]
    assert a.label == b.label
    assert not np.array_equal(a.matrix(), b.matrix())
    assert mechanism_fingerprint(a) != mechanism_fingerprint(b)
    ida = run_identity(MechanismEvent(a, "none"))
    result_b = calibrate(b, "none", epsilon=4.0, delta=1e-5)
    assert run_mismatch(result_b, {"mechanism": a.label, **ida}) is not None
    assert run_mismatch(calibrate(a, "none", epsilon=4.0, delta=1e-5), {"mechanism": a.label, **ida}) is None


def test_a_guarantee_for_another_step_count_is_said_to_be_one():
    """Review: a guarantee of the same mechanism for another n was reported as "another mechanism
    ... (same label, other C)" (its C, n x n, has another fingerprint too); the step count is named."""
    ida = run_identity(MechanismEvent(DPCGD(0.9, N_STEPS), "none"))
    other = calibrate(DPCGD(0.9, N_STEPS + 1), "none", epsilon=4.0, delta=1e-5)
    said = run_mismatch(other, {"mechanism": "dpcgd", **ida})
    assert said == f"n = {N_STEPS + 1}, this run has {N_STEPS}"
    same_n = calibrate(DPCGD(0.9000001, N_STEPS), "none", epsilon=4.0, delta=1e-5)
    assert "same label, other C" in run_mismatch(same_n, {"mechanism": same_n.extras["mechanism"], **ida})


@pytest.mark.parametrize("kind", ["blt", "banded", "dense", "bandinv"])
def test_make_private_tells_them_apart(kind):
    a, b = _pairs()[kind]
    _refused_as_guarantee(a, calibrate(b, "none", epsilon=4.0, delta=1e-5))


ALL = random_strategies(7, seed=5) + random_strategies(7, seed=6)


@given(st.sampled_from(range(len(ALL))), st.sampled_from(range(len(ALL))))
def test_equal_fingerprints_iff_equal_mechanisms(i, j):
    """Over every strategy kind: the fingerprint is equal exactly when the kind, column
    normalization and C are (materialized, compared exactly)."""
    a, b = ALL[i], ALL[j]
    same = (type(a) is type(b) and a.kind == b.kind and a.label == b.label
            and np.array_equal(a.matrix(), b.matrix()))
    assert (mechanism_fingerprint(a) == mechanism_fingerprint(b)) == same


def test_a_strategy_outside_the_registry_is_fingerprinted_by_its_matrix():
    """A user's Strategy subclass with no parameters of its own: its C decides its identity."""

    class Custom(Strategy):
        kind = "custom"

        def __init__(self, c):
            self._c = c
            self.n = c.shape[0]

        def matrix(self):
            return self._c.copy()

        def multiply_stream(self):
            from corrnoise.linalg.streaming import DenseStream
            return DenseStream(self._c)

        def inverse_stream(self):
            from corrnoise.linalg.streaming import DenseStream
            return DenseStream(self._c, inverse=True)

        @classmethod
        def from_params(cls, n, params, arrays):
            raise NotImplementedError

    c = np.eye(4) + np.tril(np.full((4, 4), 0.1), -1)
    c2 = c.copy()
    c2[3, 0] = 0.2
    assert mechanism_fingerprint(Custom(c)) == mechanism_fingerprint(Custom(c.copy()))
    assert mechanism_fingerprint(Custom(c)) != mechanism_fingerprint(Custom(c2))
    # and it is not taken for the registered dense kind with the same C
    assert mechanism_fingerprint(Custom(c)) != mechanism_fingerprint(Dense(c))


def test_identity_of_a_result_is_that_of_its_event():
    event = MechanismEvent(BandedSqrt(12, 3), "none", steps=12)
    result = calibrate(event, epsilon=2.0, delta=1e-5)
    for key, value in run_identity(event).items():
        assert result.extras[key] == value
    assert result.extras["mechanism"] == "bsr:3"
    assert run_identity(MechanismEvent(Identity(5), "poisson:0.1"))["batching"] == "poisson:0.1"
    assert "participation" not in run_identity(MechanismEvent(Identity(5), "poisson:0.1"))
