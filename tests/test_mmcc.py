"""MMCC (seed 001): tail bounds, PMoG PLDs, composition and the end-to-end guarantees.

Every formula is checked against an independent computation: brute-force enumeration,
numerical integration, dp_accounting (PLD accountant, mixture-of-Gaussians PLD), the exact
Gaussian mechanism and the block-cyclic DP-SGD reduction (tutorial Thm 3.21).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import integrate
from scipy.stats import binom, norm

from corrnoise.accounting import mmcc as M
from corrnoise.accounting import account, choose_method, parse_batching
from corrnoise.accounting.gaussian import gaussian_epsilon
from corrnoise.errors import CorrnoiseError
from corrnoise.losses import mechanism_sensitivity
from corrnoise.participation import Cyclic
from corrnoise.strategies import Banded, ColumnNormalized, Dense, parse_strategy


def dpsgd_reference(sigma: float, p: float, steps: int, delta: float) -> float:
    """DP-SGD epsilon straight from dp_accounting (PLD accountant, add/remove, Poisson)."""
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    event = dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(acc.get_epsilon(delta))


def random_lower(n: int, seed: int, density: float = 0.7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = np.tril(rng.uniform(0.0, 1.0, (n, n)) * (rng.uniform(size=(n, n)) < density))
    np.fill_diagonal(c, 1.0)
    return c


# ----------------------------------------------------------------------------------------------
# Probability Tail Bounds
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.01, 0.2, 0.5])
def test_binomial_tail_count_is_the_smallest_valid_t(p):
    trials = np.arange(0, 60)
    for dp in (1e-3, 1e-9):
        t = M.binomial_tail_count(trials, p, dp)
        assert np.all(binom.sf(t, trials, p) <= dp)
        smaller = t > 0
        assert np.all(binom.sf(t[smaller] - 1, trials[smaller], p) > dp)


def paper_tail_bounds(c: np.ndarray, p: float, nu: float, delta1: float) -> np.ndarray:
    """Seed 001 Fig. 5 with App. F.3's binomial bound, by loops over (i, j): the p~ that MMCC
    used before issue #12 (one union-bound event per pair and part)."""
    n = c.shape[0]
    events = int(np.count_nonzero(c)) - n
    dp = delta1 / (2 * events)
    z = norm.isf(dp)
    q = np.where(c > 0, p, 0.0)
    for i in range(n):
        for j in range(i):
            if c[i, j] == 0:
                continue
            v = c[:i, j]
            inner = sorted((float(c[:i, jp] @ v) for jp in range(i)), reverse=True)
            t = next(t for t in range(i + 1) if binom.sf(t, i, p) <= dp)
            eps = z * np.linalg.norm(v) / nu + (2 * sum(inner[:t]) - v @ v) / (2 * nu**2)
            q[i, j] = p * math.exp(eps) / (p * math.exp(eps) + 1 - p)
    return q


@pytest.mark.parametrize("nu", [2.0, 8.0])
def test_tail_bounds_sharper_than_the_paper_on_toeplitz_sqrt(nu):
    """Issue #12: Levy peeling + the joint tail give p~ <= the paper's p~ for every pair here and
    clearly smaller on average (validity against exact quantiles and simulation:
    tests/test_mmcc_tails.py)."""
    c = parse_strategy("toeplitz-sqrt", 40).matrix()
    sens, q, events = M.probability_tail_bounds(c, 0.05, nu, 1e-6)
    old = paper_tail_bounds(c, 0.05, nu, 1e-6)
    mask = (c > 0) & ~np.eye(40, dtype=bool)
    assert events < 40 * 39 // 2
    assert np.all(q[mask] <= old[mask] * (1 + 1e-12))
    assert np.mean(q[mask] / old[mask]) < 0.9
    assert np.all(q[np.eye(40, dtype=bool)] == 0.05)
    np.testing.assert_array_equal(sens, c)


def test_tail_bounds_shrink_with_noise_and_identity_has_no_events():
    c = parse_strategy("toeplitz-sqrt", 16).matrix()
    _, q_lo, _ = M.probability_tail_bounds(c, 0.1, 2.0, 1e-6)
    _, q_hi, _ = M.probability_tail_bounds(c, 0.1, 20.0, 1e-6)
    mask = c > 0
    assert np.all(q_hi[mask] <= q_lo[mask]) and np.all(q_hi[mask] >= 0.1 - 1e-15)
    sens, q, events = M.probability_tail_bounds(np.eye(5), 0.3, 1.0, 1e-6)
    assert events == 0 and np.allclose(q, 0.3 * np.eye(5))


# ----------------------------------------------------------------------------------------------
# PMoG privacy loss distributions
# ----------------------------------------------------------------------------------------------
def test_sensitivity_pmf_matches_enumeration():
    c = np.array([0.3, 0.75, 1.0, 0.125, 0.6])
    q = np.array([0.2, 0.5, 0.1, 0.9, 0.33])
    step = 2.0**-4
    w, lost = M.sensitivity_pmf(c, q, step, tail=1e-300)
    k = np.ceil(c / step).astype(int)
    expected = np.zeros(k.sum() + 1)
    for bits in itertools.product((0, 1), repeat=c.size):
        b = np.array(bits)
        expected[int(k @ b)] += float(np.prod(np.where(b, q, 1 - q)))
    assert lost == pytest.approx(0.0, abs=1e-300)
    np.testing.assert_allclose(w, expected[: w.size], rtol=1e-12, atol=1e-300)


def _exact_delta(weights, shifts, nu, eps, adjacency):
    """Hockey-stick divergence of the mixture vs N(0, nu^2) by numerical integration."""
    weights, shifts = np.asarray(weights), np.asarray(shifts)

    def p(x):
        return float(np.dot(weights, norm.pdf(x, shifts, nu)))

    def q(x):
        return float(norm.pdf(x, 0.0, nu))

    first, second = (p, q) if adjacency == "remove" else (q, p)
    f = lambda x: max(first(x) - math.exp(eps) * second(x), 0.0)  # noqa: E731
    lo, hi = -12 * nu, shifts.max() + 12 * nu
    val, _ = integrate.quad(f, lo, hi, points=list(shifts), limit=400, epsabs=1e-13)
    return val


def test_pmog_pld_is_pessimistic_and_tight_against_integration():
    c, q, nu = [0.5, 1.0], [0.3, 0.1], 0.8
    remove, add = M.pmog_pld(c, q, nu)
    weights = [0.7 * 0.9, 0.3 * 0.9, 0.7 * 0.1, 0.3 * 0.1]
    shifts = [0.0, 0.5, 1.0, 1.5]
    for eps in (0.0, 0.3, 1.0, 2.0):
        for pld, adjacency in ((remove, "remove"), (add, "add")):
            exact = _exact_delta(weights, shifts, nu, eps, adjacency)
            ours = M.pld_delta(pld, eps)
            assert ours >= exact - 1e-12
            assert ours <= exact * (1 + 2e-3) + 1e-12


def test_pmog_pld_matches_dp_accounting_mixture():
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    c, q, nu = [0.5, 1.0], [0.4, 0.05], 1.1
    ours_remove, ours_add = M.pmog_pld(c, q, nu)
    support, probs = [], []
    for bits in itertools.product((0, 1), repeat=2):
        b = np.array(bits)
        support.append(float(np.dot(c, b)))
        probs.append(float(np.prod(np.where(b, q, 1 - np.asarray(q)))))
    ref = pld_lib.from_mixture_gaussian_mechanism(nu, support, probs, value_discretization_interval=1e-3)
    for eps in (0.05, 0.5, 1.5):
        theirs = ref.get_delta_for_epsilon(eps)
        ours = max(M.pld_delta(ours_remove, eps), M.pld_delta(ours_add, eps))
        assert ours == pytest.approx(theirs, rel=2e-3)


def test_composition_matches_dp_accounting():
    """Our FFT/tree composition of different and identical PLDs vs dp_accounting's."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    a_rem, a_add = M.pmog_pld([1.0], [0.1], 1.0)
    b_rem, b_add = M.pmog_pld([0.5], [0.3], 1.0)
    ours_rem = M.compose_all([(a_rem, 40), (b_rem, 25)])
    ours_add = M.compose_all([(a_add, 40), (b_add, 25)])
    ref = pld_lib.from_gaussian_mechanism(1.0, sampling_prob=0.1).self_compose(40).compose(
        pld_lib.from_gaussian_mechanism(1.0, sensitivity=0.5, sampling_prob=0.3).self_compose(25))
    for delta in (1e-3, 1e-6):
        ours = max(M.pld_epsilon(ours_rem, delta), M.pld_epsilon(ours_add, delta))
        assert ours == pytest.approx(ref.get_epsilon_for_delta(delta), rel=2e-3)


def test_pld_epsilon_inverts_pld_delta():
    rem, _ = M.pmog_pld([1.0, 0.5], [0.2, 0.2], 0.9)
    pld = M.self_compose(rem, 20)
    for delta in (1e-2, 1e-5, 1e-8):
        eps = M.pld_epsilon(pld, delta)
        assert M.pld_delta(pld, eps) == pytest.approx(delta, rel=1e-6)
        assert M.pld_delta(pld, eps * 0.99) > delta


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,p,sigma", [(100, 0.05, 1.0), (64, 0.25, 2.0)])
def test_identity_equals_dpsgd(n, p, sigma):
    result = M.mmcc_epsilon("identity", n, p, sigma, 1e-6)
    reference = dpsgd_reference(sigma, p, n, 1e-6)
    assert result.epsilon == pytest.approx(reference, rel=0.03)
    assert result.epsilon == pytest.approx(reference, rel=2e-3)  # in fact much closer
    assert result.extras["tail_events"] == 0 and result.extras["unique_rows"] == 1


def test_unamplified_sensitivity_matches_losses_module():
    for name, blocks in (("toeplitz-sqrt", 1), ("toeplitz-sqrt", 4), ("bsr:3", 2)):
        strat = parse_strategy(name, 24)
        expected = mechanism_sensitivity(strat, Cyclic(-(-24 // blocks), blocks)).value
        assert M.unamplified_sensitivity(strat.matrix(), blocks) == pytest.approx(expected, rel=1e-12)
    c = random_lower(10, seed=5)
    expected = mechanism_sensitivity(Dense(c), Cyclic(10, 1)).value
    assert M.unamplified_sensitivity(c, 1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name,n,nu", [("toeplitz-sqrt", 24, 6.0), ("bsr:4", 24, 3.0), ("random", 10, 6.0)])
def test_mmcc_never_above_unamplified_and_lower_bound_below(name, n, nu):
    p, delta = 0.1, 1e-6
    strat = Dense(random_lower(n, seed=11)) if name == "random" else parse_strategy(name, n)
    sens = mechanism_sensitivity(strat, Cyclic(n, 1)).value
    unamplified = gaussian_epsilon(delta, sens / nu)
    upper = M.mmcc_epsilon(strat, n, p, nu, delta)
    lower = M.mmcc_epsilon(strat, n, p, nu, delta, lower_bound=True)
    assert upper.extras["epsilon_unamplified"] == pytest.approx(unamplified, rel=1e-9)
    assert upper.epsilon <= unamplified
    assert upper.extras["epsilon_mmcc"] < unamplified  # amplification actually helps here
    assert lower.epsilon <= upper.epsilon
    assert lower.extras["max_p_tilde_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert upper.extras["max_p_tilde_ratio"] > 1.0 + 1e-6


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 6), seed=st.integers(0, 10_000), p=st.sampled_from([0.05, 0.3, 0.9]),
       nu=st.sampled_from([0.7, 2.0, 6.0]), blocks=st.sampled_from([1, 2]))
def test_property_mmcc_between_lower_bound_and_unamplified(n, seed, p, nu, blocks):
    c = random_lower(n, seed)
    upper = M.mmcc_epsilon(c, None, p, nu, 1e-5, blocks=blocks, delta_split=0.1)
    lower = M.mmcc_epsilon(c, None, p, nu, 1e-5, blocks=blocks, lower_bound=True)
    sens = mechanism_sensitivity(Dense(c), Cyclic(-(-n // blocks), blocks)).value
    assert upper.epsilon <= gaussian_epsilon(1e-5, sens / nu) * (1 + 1e-12)
    assert lower.epsilon <= upper.epsilon * (1 + 1e-9)
    assert upper.epsilon >= 0.0


def test_no_amplification_at_p_one_reduces_to_the_gaussian_mechanism():
    n, nu, delta = 12, 8.0, 1e-5
    strat = parse_strategy("toeplitz-sqrt", n)
    result = M.mmcc_epsilon(strat, n, 1.0, nu, delta)
    # every p~ = 1: rows are Gaussians whose composition is exactly the unamplified mechanism
    assert result.extras["epsilon_mmcc"] == pytest.approx(result.extras["epsilon_unamplified"], rel=0.01)
    assert result.epsilon <= result.extras["epsilon_unamplified"]


def test_epsilon_decreases_with_noise():
    strat = parse_strategy("toeplitz-sqrt", 16)
    eps = [M.mmcc_epsilon(strat, 16, 0.1, nu, 1e-6, delta_split=0.1).epsilon for nu in (2.0, 4.0, 8.0)]
    assert eps[0] > eps[1] > eps[2] > 0.0


@pytest.mark.parametrize("name,blocks,p", [("bsr:4", 4, 0.2), ("bsr:3", 4, 0.3)])
def test_generalized_mmcc_on_banded_equals_block_cyclic_reduction(name, blocks, p):
    n, nu, delta = 32, 3.0, 1e-6
    strat = parse_strategy(name, n)
    result = M.mmcc_epsilon(strat, n, p, nu, delta, blocks=blocks)
    col = math.sqrt(strat.column_norms_squared().max())
    reference = dpsgd_reference(nu / col, p, -(-n // blocks), delta)  # tutorial Thm 3.21
    assert result.epsilon == pytest.approx(reference, rel=0.03)
    assert result.extras["tail_events"] == 0


def test_generalized_mmcc_non_toeplitz_banded_all_blocks():
    rng = np.random.default_rng(7)
    band = rng.uniform(0.2, 1.0, (20, 3))
    strat = ColumnNormalized(Banded(band))
    blocks, p, nu, delta = 3, 0.3, 2.0, 1e-6
    result = M.mmcc_epsilon(strat, 20, p, nu, delta, blocks=blocks)
    col = math.sqrt(strat.column_norms_squared().max())
    reference = dpsgd_reference(nu / col, p, -(-20 // blocks), delta)
    assert result.epsilon == pytest.approx(reference, rel=0.03)


def test_toeplitz_block_cyclic_worst_block_is_the_first():
    strat = parse_strategy("toeplitz-sqrt", 12)
    auto = M.mmcc_epsilon(strat, 12, 0.3, 4.0, 1e-6, blocks=3, delta_split=0.1)
    every = M.mmcc_epsilon(strat, 12, 0.3, 4.0, 1e-6, blocks=3, delta_split=0.1, offsets="all")
    assert auto.extras["offset"] == 0
    assert every.epsilon == pytest.approx(auto.epsilon, rel=1e-12)
    assert every.extras["offset"] == 0


def test_block_cyclic_with_more_bands_than_blocks_amplifies_less_than_poisson_bound():
    """Generalized MMCC on a C with more bands than blocks: valid, between lower and unamplified."""
    strat = parse_strategy("bsr:6", 24)
    res = M.mmcc_epsilon(strat, 24, 0.2, 5.0, 1e-6, blocks=2, delta_split=0.1)
    assert res.extras["tail_events"] > 0
    assert 0.0 < res.epsilon < res.extras["epsilon_unamplified"]
    lower = M.mmcc_epsilon(strat, 24, 0.2, 5.0, 1e-6, blocks=2, lower_bound=True)
    assert lower.epsilon <= res.epsilon


def test_identical_rows_are_computed_once_with_the_same_answer():
    strat = parse_strategy("bsr:3", 30)
    once = M.mmcc_epsilon(strat, 30, 0.1, 3.0, 1e-6, delta_split=0.1)
    every = M.mmcc_epsilon(strat, 30, 0.1, 3.0, 1e-6, delta_split=0.1, dedupe=False)
    assert once.extras["unique_rows"] <= 2 * 3 and every.extras["unique_rows"] == 30
    assert once.epsilon == pytest.approx(every.epsilon, rel=1e-9)


def test_delta_split_search_is_at_least_as_good_as_each_fixed_split():
    strat = parse_strategy("toeplitz-sqrt", 16)
    auto = M.mmcc_epsilon(strat, 16, 0.1, 5.0, 1e-6)
    frac = auto.extras["delta_split"]
    assert auto.extras["delta_tail"] + auto.extras["delta_pld"] == pytest.approx(1e-6)
    fixed = M.mmcc_epsilon(strat, 16, 0.1, 5.0, 1e-6, delta_split=frac)
    assert auto.epsilon == pytest.approx(fixed.epsilon, rel=1e-12)
    assert auto.epsilon <= M.mmcc_epsilon(strat, 16, 0.1, 5.0, 1e-6, delta_split=0.6).epsilon


def test_mmcc_delta_is_consistent_with_mmcc_epsilon():
    strat = parse_strategy("toeplitz-sqrt", 8)
    res = M.mmcc_epsilon(strat, 8, 0.1, 5.0, 1e-6)
    d = M.mmcc_delta(strat, 8, 0.1, 5.0, res.epsilon)
    assert 1e-7 < d.delta <= 3e-6
    assert M.mmcc_delta(strat, 8, 0.1, 5.0, res.epsilon * 1.5).delta < d.delta
    ident = M.mmcc_delta("identity", 50, 0.1, 1.0, 2.0)
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    ref = pld_lib.from_gaussian_mechanism(1.0, sampling_prob=0.1).self_compose(50).get_delta_for_epsilon(2.0)
    assert ident.delta == pytest.approx(ref, rel=0.01)


# ----------------------------------------------------------------------------------------------
# Interface and input checks
# ----------------------------------------------------------------------------------------------
def test_registry_adapter_and_auto_choice():
    strat = parse_strategy("toeplitz-sqrt", 16)
    assert choose_method(strat, parse_batching("poisson:0.1")) == "mmcc"
    assert choose_method(parse_strategy("bsr:4", 16), parse_batching("block-cyclic:2:0.2")) == "mmcc"
    res = account(strat, "poisson:0.1", noise_std=5.0, delta=1e-6, method="mmcc", delta_split=0.1)
    direct = M.mmcc_epsilon(strat, 16, 0.1, 5.0, 1e-6, delta_split=0.1)
    assert res.method == "mmcc" and res.epsilon == pytest.approx(direct.epsilon, rel=1e-12)
    assert res.noise_multiplier == pytest.approx(5.0 / math.sqrt(strat.column_norms_squared().max()))
    banded = account(parse_strategy("bsr:2", 16), "block-cyclic:2:0.2", noise_std=2.0, delta=1e-6, method="mmcc")
    bandmf = account(parse_strategy("bsr:2", 16), "block-cyclic:2:0.2", noise_std=2.0, delta=1e-6, method="bandmf")
    assert banded.epsilon == pytest.approx(bandmf.epsilon, rel=0.03)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"strategy": -np.eye(3)}, "mechanism"),
        ({"strategy": np.triu(np.ones((3, 3)))}, "mechanism"),
        ({"strategy": np.ones((3, 4))}, "mechanism"),
        ({"strategy": np.array([[1.0, 0.0], [np.nan, 1.0]])}, "mechanism"),
        ({"p": 0.0}, "p"),
        ({"p": 1.5}, "p"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"noise_std": 0.0}, "noise_std"),
        ({"noise_std": -1.0}, "noise_std"),
        ({"blocks": 0}, "blocks"),
    ],
)
def test_invalid_inputs_are_one_line_errors(kwargs, param):
    args = {"strategy": np.eye(3), "n": None, "p": 0.1, "noise_std": 1.0, "delta": 1e-6, **kwargs}
    with pytest.raises(CorrnoiseError) as err:
        M.mmcc_epsilon(**args)
    assert err.value.param == param and "\n" not in str(err.value)


def test_dispatcher_refuses_negative_strategy():
    with pytest.raises(CorrnoiseError) as err:
        account(Dense(np.array([[1.0, 0.0], [-0.5, 1.0]])), "poisson:0.1", noise_std=1.0, delta=1e-6,
                method="mmcc")
    assert "negative" in str(err.value)


def test_generic_calibration_through_mmcc():
    from corrnoise.accounting.calibrate import calibrate

    strat = parse_strategy("toeplitz-sqrt", 8)
    res = calibrate(strat, "poisson:0.2", epsilon=4.0, delta=1e-6, method="mmcc", rtol=1e-2, delta_split=0.1)
    assert res.method == "mmcc" and 4.0 * 0.97 <= res.epsilon <= 4.0
    slightly_less = M.mmcc_epsilon(strat, 8, 0.2, res.noise_std * 0.95, 1e-6, delta_split=0.1)
    assert slightly_less.epsilon > 4.0


@pytest.mark.parametrize("sigma", [1e-20, 1e-3])
def test_noise_far_below_the_sensitivity_falls_back_to_the_unamplified_guarantee(sigma):
    """At a noise whose grids would not fit in memory MMCC gives no bound (not epsilon 0, as an
    int64 overflow of the sensitivity grid once did): the unamplified analysis binds."""
    from corrnoise.accounting import account
    from corrnoise.strategies import parse_strategy

    res = account(parse_strategy("bsr:4", 16), "poisson:0.1", noise_multiplier=sigma, delta=1e-5, method="mmcc")
    assert res.kind == "guarantee"
    assert res.extras["binding"] == "unamplified"
    assert res.epsilon == res.extras["epsilon_unamplified"] > 1e4


def test_pmog_grid_too_large_is_no_bound():
    remove, add = M.pmog_pld([1.0, 1.0], [0.1, 0.1], 1e-12)
    for pld in (remove, add):
        assert pld.inf_mass == 1.0  # delta(eps) = 1 for every eps: trivially valid


def test_a_lower_bound_labels_the_unamplified_epsilon_beside_it_as_a_guarantee():
    from corrnoise.strategies import parse_strategy

    lower = M.mmcc_epsilon(parse_strategy("bsr:4", 16).matrix(), None, 0.1, 2.0, 1e-5, lower_bound=True)
    assert lower.kind == "lower_bound"
    assert "epsilon_unamplified" not in lower.extras and lower.extras["epsilon_unamplified_guarantee"] > lower.epsilon


def test_a_lower_bound_whose_grids_give_up_is_the_trivial_zero_not_the_upper_bound():
    from corrnoise.strategies import parse_strategy

    lower = M.mmcc_epsilon(parse_strategy("bsr:4", 16).matrix(), None, 0.1, 1e-3, 1e-5, lower_bound=True)
    assert lower.kind == "lower_bound" and lower.epsilon == 0.0


def test_the_p_equals_p_reference_under_block_cyclic_sampling_is_an_estimate_not_a_lower_bound():
    """With row groups (blocks > 1) the p~ = p composition can exceed the unamplified guarantee, so it
    is no lower bound there: the found case (hypothesis) is labelled an estimate."""
    c = random_lower(4, 1)
    reference = M.mmcc_epsilon(c, None, 0.9, 0.7, 1e-5, blocks=2, lower_bound=True)
    assert reference.extras["epsilon_mmcc_estimate"] > reference.extras["epsilon_unamplified_guarantee"]
    assert reference.kind == "estimate" and "lower_bound" not in reference.extras  # review: it said lower_bound true
    lower = M.mmcc_epsilon(c, None, 0.9, 0.7, 1e-5, lower_bound=True)
    assert "epsilon_mmcc_lower_bound" in lower.extras and "epsilon_mmcc" not in lower.extras
    assert M.mmcc_epsilon(c, None, 0.9, 0.7, 1e-5, lower_bound=True).kind == "lower_bound"


def test_mmcc_reports_progress_for_epsilon_and_for_delta():
    """MMCC tells a progress reporter what it composes, both ways: epsilon(delta) (its rows) and
    delta(epsilon) (each delta_1 of its search, then its rows; ends with the search's done).
    Both dropped ``progress`` (a user probe met 22-45 s of silence in ``corrnoise account
    toeplitz-sqrt --n 512 --batching poisson:0.0625 --noise-std 36 --epsilon 2``)."""
    strat = parse_strategy("toeplitz-sqrt", 8)
    heard: list[tuple[str, int, int]] = []

    def report(label: str, done: int, total: int) -> None:
        heard.append((label, done, total))

    account(strat, "poisson:0.25", noise_std=2.0, delta=1e-5, method="mmcc", progress=report)
    assert ("MMCC rows", 0, 8) in heard
    heard.clear()
    res = account(strat, "poisson:0.25", noise_std=2.0, epsilon=2.0, method="mmcc", progress=report)
    search = [h for h in heard if h[0].startswith("MMCC delta(epsilon)")]
    assert len(search) >= 2 and search[-1] == ("MMCC delta(epsilon)", 1, 1)  # the search's end
    for k, (label, done, total) in enumerate(search[:-1], start=1):  # each composition, counted
        assert label.startswith(f"MMCC delta(epsilon): composition {k}, delta_1 = ") and (done, total) == (k, 0)
    assert any(h[0] == "MMCC rows" for h in heard) and res.extras["delta_of_epsilon"] is True
