"""Accounting interface, exact Gaussian/GDP, DP-SGD (PLD/RDP), block-cyclic BandMF, calibration, CLI.

Also: batching specs given with a participation, delta(epsilon) in the library and the command
line, and BandMF with blocks of unequal lengths (regressions from a privacy review and issues
#8/#9; each failed before its fix). Independent references: numerical integration of the hockey-stick divergence, dp_accounting
(installed from the registry) with events built by hand, the unamplified multi-participation
sensitivity path of :mod:`corrnoise.losses`, and the published noise multipliers of seed 000 Fig. 28.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

import dp_accounting
from dp_accounting import pld, rdp

from corrnoise.accounting import (
    BallsInBins,
    BlockCyclic,
    NoBatching,
    Poisson,
    PrivacyResult,
    account,
    calibrate,
    calibrate_noise,
    choose_method,
    column_norm,
    dpsgd_epsilon,
    gaussian_delta,
    gaussian_epsilon,
    gaussian_mu,
    parse_batching,
    register_method,
)
from corrnoise.accounting import base as acc_base
from corrnoise.errors import CorrnoiseError
from corrnoise.losses import mechanism_sensitivity
from corrnoise.participation import Cyclic
from corrnoise.strategies import Banded, BandedSqrt, Dense, Identity, Toeplitz, parse_strategy


def _pld_epsilon(event, delta, discretization=1e-4):
    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                            value_discretization_interval=discretization)
    acc.compose(event)
    return acc.get_epsilon(delta)


# ---------------------------------------------------------------------------------------------
# Exact Gaussian mechanism / mu-GDP
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps,mu", [(0.0, 0.5), (0.3, 0.2), (1.0, 1.0), (2.5, 1.7), (6.0, 2.0)])
def test_gaussian_delta_matches_hockey_stick_integral(eps, mu):
    """delta(eps) = int max(0, p_P - e^eps p_Q) for P = N(mu, 1), Q = N(0, 1): the integrand is
    positive for x > eps/mu + mu/2; integrate numerically."""
    x0 = eps / mu + mu / 2
    integrand = lambda x: stats.norm.pdf(x, loc=mu) - math.exp(eps) * stats.norm.pdf(x)  # noqa: E731
    ref, _ = integrate.quad(integrand, x0, np.inf, epsabs=1e-14, epsrel=1e-12)
    assert gaussian_delta(eps, mu) == pytest.approx(ref, rel=1e-8, abs=1e-15)


@pytest.mark.parametrize("mu,delta", [(0.1, 1e-5), (0.5, 1e-6), (1.0, 1e-5), (2.0, 1e-3), (4.0, 1e-8)])
def test_gaussian_epsilon_matches_dp_accounting(mu, delta):
    eps = gaussian_epsilon(delta, mu)
    # dp_accounting's closed-form Gaussian inversion and its PLD of one Gaussian event.
    assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta), rel=1e-6, abs=1e-9)
    assert eps == pytest.approx(_pld_epsilon(dp_accounting.GaussianDpEvent(1.0 / mu), delta, 1e-3),
                                rel=1e-2, abs=2e-3)
    assert gaussian_delta(eps, mu) <= delta * (1 + 1e-9)
    assert gaussian_delta(eps * (1 - 1e-6) - 1e-12, mu) > delta or eps == 0.0


def test_gaussian_epsilon_zero_when_delta_large_and_mu_inverse():
    assert gaussian_epsilon(0.5, 0.1) == 0.0  # delta(0) = 2 Phi(0.05) - 1 ~ 0.04 < 0.5
    for eps, delta in [(0.5, 1e-5), (1.0, 1e-6), (8.0, 1e-5), (20.0, 1e-10)]:
        mu = gaussian_mu(eps, delta)
        assert gaussian_delta(eps, mu) <= delta
        assert gaussian_delta(eps, mu * (1 + 1e-6)) > delta
        assert gaussian_epsilon(delta, mu) == pytest.approx(eps, rel=1e-9)


def test_unamplified_account_reports_gdp_mu_and_sensitivity():
    strategy = parse_strategy("bsr:4", 64)
    nb = NoBatching(Cyclic(4, 16))
    r = account(strategy, nb, noise_std=3.0, delta=1e-5)
    # bsr:4 with 4 <= 16 bands: sens^2 = sum of the k = 4 column norms^2 of a pattern (Lemma 3.16b)
    norms2 = strategy.column_norms_squared()
    sens = math.sqrt(max(norms2[l::16].sum() for l in range(16)))
    assert r.method == "gaussian"
    assert r.extras["gdp_mu"] == pytest.approx(sens / 3.0, rel=1e-12)
    assert r.extras["sensitivity_exact"] is True
    assert r.epsilon == pytest.approx(gaussian_epsilon(1e-5, sens / 3.0), rel=1e-12)
    assert r.noise_multiplier == pytest.approx(3.0 / math.sqrt(norms2.max()), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# DP-SGD (C = I) with Poisson sampling
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma,p,steps,delta", [(1.1, 0.01, 1000, 1e-5), (1.5, 0.05, 200, 1e-6),
                                                 (2.0, 0.2, 40, 1e-5)])
def test_dpsgd_matches_hand_built_dp_accounting_events(sigma, p, steps, delta):
    """Our PLD epsilon vs dp_accounting given a hand-built event (a ComposedDpEvent of two
    self-composed halves, composed incrementally); RDP is an upper bound within ~25%."""
    r = account(Identity(steps), Poisson(p), noise_multiplier=sigma, delta=delta)
    assert r.method == "pld" and r.extras["dpsgd_steps"] == steps
    one = dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma))
    half = steps // 2
    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(one, half)]))
    acc.compose(one, steps - half)
    ref = acc.get_epsilon(delta)
    assert r.epsilon == pytest.approx(ref, rel=1e-2)
    r_rdp = account(Identity(steps), Poisson(p), noise_multiplier=sigma, delta=delta, method="rdp")
    racc = rdp.RdpAccountant()
    racc.compose(one, steps)
    assert r_rdp.epsilon == pytest.approx(racc.get_epsilon(delta), rel=1e-2)
    assert r.epsilon <= r_rdp.epsilon * (1 + 1e-3)
    assert r_rdp.epsilon <= 1.35 * r.epsilon


def test_dpsgd_full_batch_is_exact_gdp_composition():
    """p = 1: k Gaussian steps with noise multiplier sigma are sqrt(k)/sigma-GDP (tutorial
    Lemma 3.19); dp_accounting's PLD of the same k Gaussian events agrees to 1%."""
    eps = dpsgd_epsilon(2.0, 1.0, 25, 1e-5)
    assert eps == pytest.approx(gaussian_epsilon(1e-5, 5 / 2.0), rel=1e-12)
    ref = _pld_epsilon(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 25), 1e-5)
    assert eps == pytest.approx(ref, rel=1e-2)


def test_diagonal_c_uses_max_column_norm():
    """A diagonal C with entries <= 2 behaves as DP-SGD with sigma = nu / max |C[t, t]|."""
    d = np.array([1.0, 2.0, 0.5, 1.5] * 8)
    strategy = Banded(d[:, None])
    r = account(strategy, Poisson(0.1), noise_std=4.0, delta=1e-5)
    assert r.method == "pld" and r.noise_multiplier == pytest.approx(2.0)
    assert r.epsilon == pytest.approx(dpsgd_epsilon(2.0, 0.1, 32, 1e-5), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Amplified BandMF: block-cyclic Poisson sampling (tutorial Def. 3.20, Thm 3.21)
# ---------------------------------------------------------------------------------------------
FIG28_SIGMA = [1.018, 0.778, 0.606, 0.481, 0.388]  # seed 000 Fig. 28, row "BandMF + Poisson"
FIG28_BANDS = [2, 4, 8, 16, 32]                     # seed 000 Fig. 29, row "BandMF + Poisson"
FIG28_EPS = [0.5, 1.0, 2.0, 4.0, 8.0]


@pytest.mark.parametrize("sigma_fig,bands,eps", list(zip(FIG28_SIGMA, FIG28_BANDS, FIG28_EPS)))
def test_bandmf_reproduces_seed000_fig28_bandmf_poisson_row(sigma_fig, bands, eps):
    """Seed 000 Sec. 5.2 / App. H: CIFAR-10, N = 50000 examples, batch size B = 500, 20 epochs of
    100 steps (n = 2000), delta = 1e-5, target eps in {0.5, 1, 2, 4, 8}.  The row
    "BandMF + Poisson" of Fig. 28 lists the noise multiplier used with b-banded C and block-cyclic
    Poisson sampling with b blocks (b from Fig. 29), so p = B b / N (tutorial Def. 3.20).

    Mapping of the figure's sigma: it is the noise relative to the *unamplified* multi-epoch
    sensitivity, sens(C, cyclic over 20 epochs) = sqrt(20) ||C||_col for b-banded C (tutorial
    Sec. 3.3.6), i.e. the paper scales C so that this sensitivity is 1.  Our noise multiplier is
    relative to one participation, nu / ||C||_col = sigma_fig * sqrt(20); equivalently
    sigma_fig = noise_std / sqrt(20) for a column-normalized C.  With that noise, Thm 3.21 gives
    DP-SGD with ceil(2000 / b) steps at rate p, which must reach the figure's epsilon within 1%.
    """
    n, N, B = 2000, 50000, 500
    strategy = parse_strategy(f"bsr:{bands}+colnorm", n)
    r = account(strategy, BlockCyclic(bands, B * bands / N), noise_std=sigma_fig * math.sqrt(20), delta=1e-5)
    assert r.method == "bandmf"
    assert r.extras["dpsgd_steps"] == math.ceil(n / bands)
    assert r.noise_multiplier == pytest.approx(sigma_fig * math.sqrt(20), rel=1e-12)
    assert r.epsilon == pytest.approx(eps, rel=1e-2)


def test_bandmf_full_sampling_equals_unamplified_cyclic():
    """p = 1 makes block-cyclic sampling cyclic participation (k = n / blocks epochs), and for a
    banded Toeplitz C with bands <= blocks the Thm 3.21 reduction must give exactly the
    unamplified GDP bound computed from sens(C, cyclic) by the sensitivity layer."""
    n, blocks = 48, 8
    strategy = BandedSqrt(n, 6)
    amp = account(strategy, BlockCyclic(blocks, 1.0), noise_std=2.5, delta=1e-6)
    un = account(strategy, NoBatching(Cyclic(n // blocks, blocks)), noise_std=2.5, delta=1e-6)
    assert amp.epsilon == pytest.approx(un.epsilon, rel=1e-9)


def test_bandmf_is_scale_invariant_in_sigma_and_blocks_one_is_dpsgd():
    c = BandedSqrt(64, 4)
    scaled = Toeplitz(3.0 * c.toeplitz_coefficients[:4], 64)
    r1 = account(c, BlockCyclic(4, 0.1), noise_multiplier=1.3, delta=1e-5, discretization=1e-3)
    r2 = account(scaled, BlockCyclic(4, 0.1), noise_multiplier=1.3, delta=1e-5, discretization=1e-3)
    assert r1.epsilon == pytest.approx(r2.epsilon, rel=1e-9)
    assert r2.noise_std == pytest.approx(3.0 * r1.noise_std, rel=1e-12)
    a = account(Identity(64), BlockCyclic(1, 0.1), noise_multiplier=1.3, delta=1e-5, discretization=1e-3)
    b = account(Identity(64), Poisson(0.1), noise_multiplier=1.3, delta=1e-5, discretization=1e-3)
    assert a.method == "bandmf" and b.method == "pld" and a.epsilon == b.epsilon


def test_bandmf_does_not_need_nonnegative_c_but_refuses_more_bands_than_blocks():
    band = np.array([[1.0, -0.4, 0.2]] * 30)
    strategy = Banded(band)
    r = account(strategy, BlockCyclic(3, 0.2), noise_multiplier=1.0, delta=1e-5)
    assert r.extras["dpsgd_steps"] == 10 and math.isfinite(r.epsilon)
    with pytest.raises(CorrnoiseError) as err:
        account(strategy, BlockCyclic(2, 0.2), noise_multiplier=1.0, delta=1e-5, method="bandmf")
    assert err.value.param == "batching" and "bands" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------
@settings(max_examples=10)
@given(bands=st.integers(1, 4), extra_blocks=st.integers(0, 3), k=st.integers(1, 6),
       p=st.floats(0.01, 1.0), sigma=st.floats(0.6, 4.0))
def test_amplified_never_above_unamplified(bands, extra_blocks, k, p, sigma):
    """Block-cyclic amplification of a banded C is never worse than the same noise without
    amplification under the cyclic participation that block-cyclic sampling implies (an example
    of block l can only be in steps l, l + blocks, ...)."""
    blocks = bands + extra_blocks
    n = k * blocks
    strategy = BandedSqrt(n, bands)
    amp = account(strategy, BlockCyclic(blocks, p), noise_multiplier=sigma, delta=1e-5, discretization=1e-3)
    un = account(strategy, NoBatching(Cyclic(k, blocks)), noise_multiplier=sigma, delta=1e-5)
    assert amp.epsilon <= un.epsilon * (1 + 2e-3) + 1e-3  # PLD discretization is pessimistic


@settings(max_examples=12)
@given(which=st.sampled_from(["gaussian", "pld", "bandmf", "rdp"]), nu=st.floats(0.6, 5.0),
       factor=st.floats(1.02, 3.0), p=st.floats(0.005, 0.3))
def test_epsilon_decreases_as_noise_grows(which, nu, factor, p):
    n = 40
    if which == "gaussian":
        strategy, batching = parse_strategy("toeplitz-sqrt", n), NoBatching(Cyclic(4, 10))
    elif which == "bandmf":
        strategy, batching = BandedSqrt(n, 5), BlockCyclic(5, p)
    else:
        strategy, batching = Identity(n), Poisson(p)
    method = "auto" if which != "rdp" else "rdp"
    # only the PLD-based methods take a discretization (an option a method lacks is refused, issue #9)
    opts = {"discretization": 1e-3} if which in ("pld", "bandmf") else {}
    lo = account(strategy, batching, noise_std=nu, delta=1e-5, method=method, **opts).epsilon
    hi = account(strategy, batching, noise_std=nu * factor, delta=1e-5, method=method, **opts).epsilon
    assert hi <= lo
    if lo > 1e-3:
        assert hi < lo


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,batching,eps,disc", [
    (Identity(200), Poisson(0.05), 1.0, None),
    (BandedSqrt(120, 4), BlockCyclic(4, 0.1), 2.0, 1e-3),
    (parse_strategy("toeplitz-sqrt", 64), NoBatching(Cyclic(4, 16)), 0.7, None),
    (Identity(50), Poisson(0.2), 5.0, 1e-3),
])
def test_calibration_round_trips(strategy, batching, eps, disc):
    r = calibrate(strategy, batching, epsilon=eps, delta=1e-5, discretization=disc)
    assert r.epsilon <= eps
    back = account(strategy, batching, noise_std=r.noise_std, delta=1e-5, discretization=disc)
    assert back.epsilon <= eps
    assert back.epsilon >= eps * (1 - 2e-3)
    # a noticeably smaller noise misses the target: the noise is (nearly) the smallest
    assert account(strategy, batching, noise_std=r.noise_std * 0.99, delta=1e-5, discretization=disc).epsilon > eps


def test_calibrate_noise_on_a_known_curve_and_unreachable_targets():
    x, e, evals = calibrate_noise(lambda x: 3.0 / x ** 1.5, target=0.5, start=1.0, rtol=1e-6)
    assert e <= 0.5 and x == pytest.approx(6.0 ** (2 / 3), rel=1e-5) and evals < 40
    with pytest.raises(CorrnoiseError) as err:
        calibrate_noise(lambda x: 1.0 + 1.0 / x, target=0.5, start=1.0)
    assert err.value.param == "epsilon"
    with pytest.raises(CorrnoiseError):
        calibrate(Identity(10), Poisson(0.1), epsilon=0.0, delta=1e-5)


# ---------------------------------------------------------------------------------------------
# Interface: batching specs, dispatch, registry, invalid input
# ---------------------------------------------------------------------------------------------
def test_parse_batching_specs():
    assert parse_batching("none") == NoBatching()
    assert parse_batching("none", "cyclic:4:16").participation == Cyclic(4, 16)
    assert parse_batching("poisson:0.25") == Poisson(0.25)
    assert parse_batching("block-cyclic:8:0.5") == BlockCyclic(8, 0.5)
    assert parse_batching("balls-in-bins:128") == BallsInBins(128)
    for spec in ["poisson:0.25", "block-cyclic:8:0.5", "balls-in-bins:128", "none"]:
        assert parse_batching(spec).spec == spec
    assert BlockCyclic(32, 0.3).steps_per_block(2000) == 63


@pytest.mark.parametrize("spec,param", [
    ("poisson:0", "p"), ("poisson:1.5", "p"), ("poisson:-0.1", "p"), ("poisson:nan", "p"),
    ("block-cyclic:0:0.1", "blocks"), ("block-cyclic:4:2", "p"), ("balls-in-bins:0", "bins"),
    ("shuffle", "batching"), ("poisson", "batching"), ("block-cyclic:x:0.1", "batching"),
])
def test_invalid_batching(spec, param):
    with pytest.raises(CorrnoiseError) as err:
        parse_batching(spec)
    assert err.value.param == param and "\n" not in str(err.value)


def test_participation_only_with_none():
    with pytest.raises(CorrnoiseError) as err:
        parse_batching("poisson:0.1", "cyclic:2:5")
    assert err.value.param == "participation"


@pytest.mark.parametrize("kwargs,param", [
    (dict(noise_std=0.0, delta=1e-5), "noise_std"),
    (dict(noise_std=-1.0, delta=1e-5), "noise_std"),
    (dict(noise_std=float("nan"), delta=1e-5), "noise_std"),
    (dict(noise_multiplier=0.0, delta=1e-5), "sigma"),
    (dict(noise_std=1.0, delta=0.0), "delta"),
    (dict(noise_std=1.0, delta=1.0), "delta"),
    (dict(noise_std=1.0, delta=float("nan")), "delta"),
    (dict(noise_std=1.0, noise_multiplier=1.0, delta=1e-5), "noise"),
    (dict(delta=1e-5), "noise"),
    (dict(noise_std=1.0, delta=1e-5, method="nope"), "method"),
])
def test_invalid_account_inputs(kwargs, param):
    with pytest.raises(CorrnoiseError) as err:
        account(Identity(20), Poisson(0.1), **kwargs)
    assert err.value.param == param and "\n" not in str(err.value)


def test_method_batching_mismatch_and_tree_refused():
    with pytest.raises(CorrnoiseError) as err:
        account(Identity(20), Poisson(0.1), noise_std=1.0, delta=1e-5, method="gaussian")
    assert err.value.param == "method"
    with pytest.raises(CorrnoiseError) as err:
        account(parse_strategy("tree", 8), BlockCyclic(8, 0.1), noise_std=1.0, delta=1e-5)
    assert err.value.param == "mechanism"
    with pytest.raises(CorrnoiseError) as err:  # pld on a banded C under Poisson
        account(BandedSqrt(20, 3), Poisson(0.1), noise_std=1.0, delta=1e-5, method="pld")
    assert err.value.param == "method"


def test_auto_dispatch():
    assert choose_method(Identity(10), NoBatching()) == "gaussian"
    assert choose_method(Identity(10), Poisson(0.1)) == "pld"
    assert choose_method(BandedSqrt(10, 3), BlockCyclic(3, 0.1)) == "bandmf"


def test_missing_modules_give_one_line_errors(monkeypatch):
    """If the MMCC / Monte Carlo modules are absent, auto-dispatch and --method fail cleanly."""
    monkeypatch.setitem(acc_base.KNOWN_METHODS, "mmcc", "no_such_mmcc_module")
    monkeypatch.setitem(acc_base.KNOWN_METHODS, "mc", "no_such_mc_module")
    monkeypatch.delitem(acc_base._REGISTRY, "mmcc", raising=False)
    monkeypatch.delitem(acc_base._REGISTRY, "mc", raising=False)
    cases = [
        (BandedSqrt(20, 3), Poisson(0.1), "auto"),
        (BandedSqrt(20, 3), BlockCyclic(2, 0.1), "auto"),
        (Identity(20), BallsInBins(4), "auto"),
        (Identity(20), Poisson(0.1), "mmcc"),
    ]
    for strategy, batching, method in cases:
        with pytest.raises(CorrnoiseError) as err:
            account(strategy, batching, noise_std=1.0, delta=1e-5, method=method)
        assert "\n" not in str(err.value) and err.value.param in ("method", "batching")


def test_registry_plugs_in_methods_checks_nonnegativity_and_filters_options(monkeypatch):
    seen = {}

    def fake(strategy, batching, noise_std, delta, samples=None, seed=None):
        seen.update(samples=samples, seed=seed)
        return PrivacyResult(1.0 / noise_std, delta, noise_std, noise_std / column_norm(strategy), "fake-nonneg")

    monkeypatch.delitem(acc_base._REGISTRY, "fake-nonneg", raising=False)
    register_method("fake-nonneg", batchings=(Poisson,), requires_nonnegative=True)(fake)
    try:
        r = account(BandedSqrt(20, 3), Poisson(0.1), noise_std=2.0, delta=1e-5, method="fake-nonneg",
                    samples=100, seed=7, progress=False)
        assert r.epsilon == 0.5 and seen == {"samples": 100, "seed": 7}
        # an option the method does not take is refused, never dropped (issue #9)
        with pytest.raises(CorrnoiseError) as err:
            account(BandedSqrt(20, 3), Poisson(0.1), noise_std=2.0, delta=1e-5, method="fake-nonneg", accountant="pld")
        assert err.value.param == "accountant" and "\n" not in str(err.value)
        assert r.extras["batching"] == "poisson:0.1"
        negative = Banded(np.array([[1.0, -0.5]] * 20))
        with pytest.raises(CorrnoiseError) as err:
            account(negative, Poisson(0.1), noise_std=2.0, delta=1e-5, method="fake-nonneg")
        assert err.value.param == "mechanism" and "negative" in str(err.value)
        # generic calibration works for any registered method: 1/nu <= 0.25 -> nu ~ 4
        c = calibrate(BandedSqrt(20, 3), Poisson(0.1), epsilon=0.25, delta=1e-5, method="fake-nonneg")
        assert c.epsilon <= 0.25 and c.noise_std == pytest.approx(4.0, rel=1e-3)
    finally:
        acc_base._REGISTRY.pop("fake-nonneg", None)


def test_dense_negative_entries_are_fine_unamplified():
    rng = np.random.default_rng(1)
    c = np.tril(rng.normal(size=(6, 6))) + 3 * np.eye(6)
    r = account(Dense(c), NoBatching(), noise_std=2.0, delta=1e-5)
    assert r.extras["sensitivity"] == pytest.approx(np.linalg.norm(c, axis=0).max())


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _run(capsys, *args):
    from corrnoise.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_account_json(capsys):
    code, out, err = _run(capsys, "account", "bsr:4", "--n", "2000", "--batching", "block-cyclic:4:0.04",
                          "--sigma", str(0.778 * math.sqrt(20)), "--delta", "1e-5", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert {"epsilon", "delta", "noise_std", "noise_multiplier", "method"} <= set(data)
    assert data["method"] == "bandmf" and data["epsilon"] == pytest.approx(1.0, rel=1e-2)
    assert "gdp_mu" not in data
    code, out, _ = _run(capsys, "account", "identity", "--n", "100", "--batching", "none",
                        "--participation", "single", "--noise-std", "2", "--delta", "1e-5", "--json")
    data = json.loads(out)
    assert code == 0 and data["gdp_mu"] == pytest.approx(0.5) and data["method"] == "gaussian"
    code, out, _ = _run(capsys, "account", "identity", "--n", "100", "--batching", "poisson:0.1",
                        "--epsilon", "2", "--delta", "1e-5", "--json")
    data = json.loads(out)
    assert code == 0 and data["epsilon"] <= 2 and data["target_epsilon"] == 2


@pytest.mark.parametrize("args,param", [
    (["--batching", "poisson:1.5", "--sigma", "1"], "p"),
    (["--batching", "poisson:0.1", "--sigma", "1", "--noise-std", "1"], "noise"),
    (["--batching", "poisson:0.1"], "noise"),
    (["--batching", "poisson:0.1", "--sigma", "-1"], "sigma"),
    (["--batching", "poisson:0.1", "--sigma", "nan"], "sigma"),
    (["--batching", "block-cyclic:2:0.1", "--sigma", "1", "--method", "bandmf"], "batching"),
    (["--batching", "none", "--participation", "cyclic:3:3", "--sigma", "1"], "participation"),
])
def test_cli_bad_input_one_line(capsys, args, param):
    base = ["account", "bsr:4", "--n", "20", "--delta", "1e-5"]
    code, out, err = _run(capsys, *base, *args)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {param}:")
    code, _, err = _run(capsys, "account", "identity", "--n", "20", "--batching", "poisson:0.1", "--sigma", "1",
                        "--delta", "0")
    assert code != 0 and err.startswith("error: delta:") and err.count("\n") == 1


@settings(max_examples=60, deadline=None)
@given(mu=st.floats(0.05, 200.0), log_delta=st.floats(-30.0, -0.1))
def test_gaussian_tail_bound_is_a_valid_epsilon(mu, log_delta):
    """The fallback past MU_MAX: mu^2/2 + mu sqrt(2 log(1/delta)) is never below the exact epsilon."""
    from corrnoise.accounting.gaussian import epsilon_tail_bound, gaussian_epsilon

    delta = math.exp(log_delta)
    assert epsilon_tail_bound(mu, delta) >= gaussian_epsilon(delta, mu)


def test_gaussian_extremes_give_bounds_not_nan():
    from corrnoise.accounting.gaussian import MU_MAX, epsilon_tail_bound, gaussian_epsilon, gaussian_mu

    assert gaussian_mu(1e308, 1e-5) == MU_MAX
    assert gaussian_epsilon(1e-5, 1e300) == math.inf
    assert gaussian_epsilon(1e-5, 2e6) == epsilon_tail_bound(2e6, 1e-5)


def test_calibration_stops_at_the_least_noise_searched_when_any_noise_meets_the_target(monkeypatch):
    """delta 0.9 is met with no noise at all for Poisson DP-SGD: calibration returns the floor
    (noise multiplier 1/8: more noise than needed, a valid guarantee) instead of searching the
    PLD grids at vanishing noise for hours. Checked by the noise levels it accounts (never below
    the floor, four accountings: three coarse, one fine), not by a wall-clock limit."""
    import importlib

    from corrnoise.accounting.calibrate import MIN_NOISE_MULTIPLIER

    calibrate_module = importlib.import_module("corrnoise.accounting.calibrate")  # the package exports the function

    tried = []
    search = calibrate_module.calibrate_noise

    def recording_search(epsilon_of, target, start, **kwargs):
        return search(lambda x: tried.append(x) or epsilon_of(x), target, start, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate_noise", recording_search)
    res = calibrate(parse_strategy("dpsgd", 16), "poisson:0.125", epsilon=2.0, delta=0.9)
    assert res.kind == "guarantee" and res.epsilon <= 2.0
    assert res.noise_multiplier == pytest.approx(MIN_NOISE_MULTIPLIER)
    floor = MIN_NOISE_MULTIPLIER * 1.0  # C = I: column norm 1
    assert min(tried) == pytest.approx(floor) and all(x >= floor * (1 - 1e-12) for x in tried)
    assert len(tried) == res.extras["calibration_evaluations"] == 4


@pytest.mark.parametrize("epsilon", [1e-12, 1e-9, 1e-3])
def test_gaussian_calibration_at_tiny_epsilon_is_quick_and_valid(epsilon):
    """The step-up after the root finder once crept by 1e-15 relative: ~1e13 tries at eps 1e-12."""
    from corrnoise.accounting.gaussian import gaussian_delta, gaussian_epsilon, gaussian_mu

    mu = gaussian_mu(epsilon, 1e-5)
    assert gaussian_delta(epsilon, mu) <= 1e-5
    assert gaussian_epsilon(1e-5, mu) <= epsilon * (1.0 + 1e-6)
    assert gaussian_delta(epsilon, mu * 1.001) > 1e-5  # and it is the largest such mu (within 0.1%)


# ---------------------------------------------------------------------------------------------
# Batching specs given with a participation (a privacy review: each failed before its fix)
# ---------------------------------------------------------------------------------------------
def test_parse_batching_never_drops_a_participation_given_with_a_nobatching_value():
    """parse_batching(NoBatching(), 'cyclic:5:2') used to return NoBatching(Single()) silently:
    accounting it would use the single-participation sensitivity (2.5x smaller mu here) and
    understate epsilon.  The participation must either be honoured or refused."""
    strategy = parse_strategy("bsr:2", 10)
    asked = Cyclic(5, 2)
    try:
        batching = parse_batching(NoBatching(), "cyclic:5:2")
    except CorrnoiseError as exc:
        assert exc.param == "participation"
        return
    assert batching.participation == asked
    expected = mechanism_sensitivity(strategy, asked).value  # sens(C, Pi) with Pi = cyclic:5:2
    result = account(strategy, batching, delta=1e-5, noise_std=1.0)
    assert result.extras["sensitivity"] == pytest.approx(expected)


def test_parse_batching_accepts_a_matching_participation_with_a_nobatching_value():
    batching = parse_batching(NoBatching(Cyclic(5, 2)), "cyclic:5:2")
    assert batching.participation == Cyclic(5, 2)


# ---------------------------------------------------------------------------------------------
# delta(epsilon), in the library and on the command line
# ---------------------------------------------------------------------------------------------
def _one_line(exc_info, param):
    msg = str(exc_info.value)
    assert exc_info.value.param == param and "\n" not in msg and msg.startswith(param + ":"), msg


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
    code, out, err = _run(capsys, "account", "identity", "--n", "20", "--batching", "none", "--noise-std", "0.8",
                         "--epsilon", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["delta"] == pytest.approx(gaussian_delta(1.0, 1 / 0.8), rel=1e-12) and data["kind"] == "guarantee"
    code, out, err = _run(capsys, "account", "identity", "--n", "20", "--batching", "none", "--noise-std", "0.8",
                         "--epsilon", "1", "--delta", "1e-5")
    assert code == 2 and out == "" and err.startswith("error: noise:")


def test_cli_estimate_and_verify_samples(capsys):
    base = ["account", "bsr:2", "--n", "6", "--batching", "balls-in-bins:3", "--noise-std", "1.5", "--delta", "1e-2",
            "--samples", "4000", "--json"]
    code, out, err = _run(capsys, *base, "--estimate")
    assert code == 0, err
    assert json.loads(out)["kind"] == "estimate" and json.loads(out)["verified"] is None
    code, out, err = _run(capsys, *base, "--verify-samples", "500")  # failure probability > delta: refused
    assert code == 2 and out == "" and err.startswith("error: verify:") and len(err.strip().splitlines()) == 1
    code, out, err = _run(capsys, "account", "bsr:2", "--n", "6", "--batching", "balls-in-bins:3", "--epsilon", "2",
                         "--delta", "1e-2", "--samples", "4000", "--estimate")
    assert code == 2 and out == "" and err.startswith("error: estimate:")
    code, out, err = _run(capsys, "account", "identity", "--n", "20", "--batching", "poisson:0.1", "--sigma", "1",
                         "--delta", "1e-5", "--estimate")
    assert code == 2 and err.startswith("error: estimate:")


# ---------------------------------------------------------------------------------------------
# BandMF with blocks of unequal lengths (tutorial Thm 3.21: the actual visits of each block)
# ---------------------------------------------------------------------------------------------
def _independent_block_cyclic_epsilon(C: np.ndarray, blocks: int, p: float, noise_std: float, delta: float) -> float:
    """Every visit composed on its own in dp_accounting (no grouping): block k's examples are in
    the steps t = k mod blocks, each a Poisson-subsampled Gaussian with sensitivity ||C[:, t]||."""
    import dp_accounting
    from dp_accounting import pld

    norms = np.linalg.norm(C, axis=0)
    worst = 0.0
    for k in range(blocks):
        acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3)
        for t in range(k, C.shape[0], blocks):
            acc.compose(dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(noise_std / norms[t])))
        worst = max(worst, acc.get_epsilon(delta))
    return worst


def test_bandmf_accounts_the_actual_visits_of_unequal_blocks():
    """bsr:4, n = 66, 5 blocks (block 0 visited 14 times, its last visit a one-entry column):
    1.2619 before (14 full-sensitivity visits), 1.2436 by exact composition."""
    strategy = parse_strategy("bsr:4", 66)
    r = account(strategy, "block-cyclic:5:0.1", noise_std=2.0, delta=1e-5)
    assert r.method == "bandmf" and r.epsilon == pytest.approx(1.2436, abs=1e-4)
    assert r.extras["worst_block"] == 0 and r.extras["exact_visit_norms"] is True
    # the same at a coarser PLD grid (fast) against every visit composed on its own
    coarse = account(strategy, "block-cyclic:5:0.1", noise_std=2.0, delta=1e-5, discretization=1e-3)
    want = _independent_block_cyclic_epsilon(strategy.matrix(), 5, 0.1, 2.0, 1e-5)
    assert coarse.epsilon == pytest.approx(want, rel=1e-6)


def test_calibrate_from_the_coarse_result_skips_the_coarse_search_and_agrees():
    """calibrate(start=...) with the coarse (discretization 1e-3) calibration gives the same
    guarantee with fewer evaluations: the planner's screening is that coarse search."""
    from corrnoise.accounting import calibrate
    from corrnoise.strategies import parse_strategy

    C, bat = parse_strategy("bsr:4", 200), "block-cyclic:4:0.1"
    coarse = calibrate(C, bat, epsilon=2.0, delta=1e-5, discretization=1e-3)
    full = calibrate(C, bat, epsilon=2.0, delta=1e-5)
    hinted = calibrate(C, bat, epsilon=2.0, delta=1e-5, start=coarse.noise_std)
    assert hinted.noise_std == full.noise_std and hinted.epsilon == full.epsilon <= 2.0
    assert hinted.extras["calibration_evaluations"] < full.extras["calibration_evaluations"]
