"""Participation schemas and multi-participation sensitivity (tutorial Sec. 3.3).

Every fast path is checked against an independent computation on small n: the brute-force
oracle (enumerate patterns, max ||C[:, pi] 1||^2, valid when C^T C >= 0 on the patterns), a
subset filter over all of 2^[n], and -- where C^T C has negative entries -- a lower bound from
explicit unit vectors (sens^2 >= ||sum_{t in pi} C[:, t] u_t^T||_F^2 for any unit u_t).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from corrnoise.errors import CorrnoiseError
from corrnoise.participation import Cyclic, MinSep, Participation, Single, parse_participation
from corrnoise.sensitivity import (
    Sensitivity,
    argmax_reward_min_sep,
    brute_force_sensitivity,
    dp_relaxation_bound,
    max_reward_min_sep,
    sensitivity_banded,
    sensitivity_dense,
    sensitivity_from_gram,
    sensitivity_single,
    sensitivity_toeplitz_monotone,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_N = 12


# ------------------------------------------------------------------------ strategies


@st.composite
def feasible(draw, kinds=("single", "cyclic", "minsep"), max_n=MAX_N):
    """A feasible (n, schema) pair: cyclic k = ceil(n/b), b <= n; minsep (k-1) b < n."""
    n = draw(st.integers(1, max_n))
    kind = draw(st.sampled_from(kinds))
    if kind == "single":
        return n, Single()
    if kind == "cyclic":
        b = draw(st.integers(1, n))
        return n, Cyclic(math.ceil(n / b), b)
    b = draw(st.integers(1, n + 2))
    k = draw(st.integers(1, math.ceil(n / b)))
    return n, MinSep(k, b)


def seeds():
    return st.integers(0, 2**32 - 1)


def toeplitz(coeffs, n):
    c = np.zeros(n)
    c[: len(coeffs)] = coeffs
    C = np.zeros((n, n))
    for i in range(n):
        C[i, : i + 1] = c[i::-1]
    return C


def banded(rng, n, bands):
    i, j = np.indices((n, n))
    return np.where((i >= j) & (i - j < bands), rng.standard_normal((n, n)), 0.0)


def all_minsep_subsets(n, k, b):
    """Independent reference for Eq. 3.17: filter every subset of [n]."""
    out = set()
    for size in range(1, min(k, n) + 1):
        for sub in itertools.combinations(range(n), size):
            if all(y - x >= b for x, y in zip(sub, sub[1:])):
                out.add(sub)
    return out


def unit_vector_lower_bound(C, schema, n, rng, m=3, restarts=6, sweeps=25):
    """max over patterns and unit u_t in R^m of ||sum_{t in pi} C[:, t] u_t^T||_F^2.

    Random starts followed by coordinate ascent (u_t <- normalized sum_{tau != t} M[t,tau] u_tau,
    which never decreases the objective).  Any u gives a valid lower bound on sens^2.
    """
    M = C.T @ C
    best = 0.0
    for pattern in schema.patterns(n):
        p = list(pattern)
        for _ in range(restarts):
            U = rng.standard_normal((len(p), m))
            U /= np.linalg.norm(U, axis=1, keepdims=True)
            for _ in range(sweeps):
                for i in range(len(p)):
                    g = sum(M[p[i], p[j]] * U[j] for j in range(len(p)) if j != i)
                    norm = np.linalg.norm(g)
                    if norm > 1e-14:
                        U[i] = g / norm
            val = np.linalg.norm(C[:, p] @ U, "fro") ** 2
            best = max(best, float(val))
    return best


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# ------------------------------------------------------------------------ schemas


@SETTINGS
@given(feasible())
def test_count_matches_enumeration_and_patterns_are_valid(case):
    n, schema = case
    pats = list(schema.patterns(n))
    assert schema.count(n) == len(pats) == len(set(pats))
    kmax = schema.max_participations(n)
    assert max(len(p) for p in pats) == kmax
    for p in pats:
        assert len(p) >= 1 and list(p) == sorted(p)
        assert all(0 <= t < n for t in p)
    if isinstance(schema, Single):
        assert kmax == 1 and set(pats) == {(t,) for t in range(n)}
    elif isinstance(schema, Cyclic):
        k, b = schema.k, schema.b
        assert kmax == k
        expected = {tuple(t for t in range(l, n, b))[:k] for l in range(b)}
        assert set(pats) == expected
        # every step is covered exactly once: the patterns partition [n]
        assert sorted(t for p in pats for t in p) == list(range(n))
    else:
        assert kmax == schema.k
        assert set(pats) == all_minsep_subsets(n, schema.k, schema.b)
        # the early-and-often pattern of Eq. 3.18 is allowed
        assert tuple(j * schema.b for j in range(schema.k)) in set(pats)


def test_minsep_count_large_without_enumeration():
    # |Pi| = sum_{j=1..k} C(n - (j-1)(b-1), j) (choose j separated steps)
    n, k, b = 1000, 4, 7
    expected = sum(math.comb(n - (j - 1) * (b - 1), j) for j in range(1, k + 1))
    assert MinSep(k, b).count(n) == expected
    assert Cyclic(4, 250).count(1000) == 250 and Single().count(1000) == 1000


@SETTINGS
@given(feasible())
def test_spec_round_trip(case):
    _, schema = case
    assert parse_participation(schema.spec) == schema
    assert parse_participation(schema) is schema
    assert str(schema) == schema.spec
    assert isinstance(schema, Participation)


def test_parse_examples():
    assert parse_participation("single") == Single()
    assert parse_participation(" Cyclic:3:4 ") == Cyclic(3, 4)
    assert parse_participation("minsep:2:10") == MinSep(2, 10)


@pytest.mark.parametrize(
    "spec",
    ["", "singel", "single:1", "cyclic", "cyclic:3", "cyclic:3:4:5", "minsep:a:2", "minsep:2:-1",
     "minsep:0:3", "cyclic:2:0", "cyclic:2.5:3", "poisson:0.1", "minsep::2", "cyclic:²:2"],
)
def test_bad_spec_strings_raise(spec):
    with pytest.raises(CorrnoiseError) as err:
        parse_participation(spec)
    assert err.value.param == "participation"
    assert "\n" not in str(err.value) and str(err.value).startswith("participation: ")


def test_non_string_spec_raises():
    with pytest.raises(CorrnoiseError) as err:
        parse_participation(3)
    assert err.value.param == "participation"


@pytest.mark.parametrize("cls", [Cyclic, MinSep])
@pytest.mark.parametrize("k, b", [(0, 2), (2, 0), (-1, 3), (2.5, 2), ("2", 2), (True, 2)])
def test_bad_k_b_raise(cls, k, b):
    with pytest.raises(CorrnoiseError) as err:
        cls(k, b)
    assert err.value.param == "participation"


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 35), st.integers(1, 12))
def test_feasibility_rules(n, b, k):
    cyc_ok = b <= n and k == math.ceil(n / b)
    if cyc_ok:
        Cyclic(k, b).validate(n)
    else:
        with pytest.raises(CorrnoiseError) as err:
            Cyclic(k, b).validate(n)
        assert err.value.param == "participation"
        if b <= n:  # the message names the k that fits
            assert f"cyclic:{math.ceil(n / b)}:{b}" in str(err.value)
    if (k - 1) * b < n:
        MinSep(k, b).validate(n)
    else:
        for call in (MinSep(k, b).validate, MinSep(k, b).count, MinSep(k, b).patterns):
            with pytest.raises(CorrnoiseError) as err:
                call(n)
            assert err.value.param == "participation"


def test_bad_n_raises():
    for schema in (Single(), Cyclic(1, 1), MinSep(1, 1)):
        with pytest.raises(CorrnoiseError) as err:
            schema.validate(0)
        assert err.value.param == "n"


def test_schemas_are_frozen_and_hashable():
    s = MinSep(2, 3)
    with pytest.raises(Exception):
        s.k = 5  # type: ignore[misc]
    assert len({Single(), Single(), Cyclic(2, 3), Cyclic(2, 3), MinSep(2, 3)}) == 3


# ------------------------------------------------------------------------ Algorithm 3.2


@SETTINGS
@given(feasible(kinds=("minsep",)), seeds(), st.booleans())
def test_dp_matches_enumeration(case, seed, sparse):
    n, schema = case
    rng = np.random.default_rng(seed)
    r = rng.exponential(size=n)
    if sparse:
        r *= rng.random(n) < 0.4
    brute = max(sum(r[list(p)]) for p in all_minsep_subsets(n, schema.k, schema.b))
    assert close(max_reward_min_sep(r, schema.b, schema.k), brute)
    value, pattern = argmax_reward_min_sep(r, schema.b, schema.k)
    assert close(value, brute)
    assert pattern in all_minsep_subsets(n, schema.k, schema.b)
    assert close(float(sum(r[list(pattern)])), value)


def test_dp_rejects_bad_input():
    with pytest.raises(CorrnoiseError) as err:
        max_reward_min_sep([1.0, -2.0], 1, 1)
    assert err.value.param == "r"
    with pytest.raises(CorrnoiseError) as err:
        max_reward_min_sep([1.0], 0, 1)
    assert err.value.param == "b"
    with pytest.raises(CorrnoiseError) as err:
        argmax_reward_min_sep([1.0], 1, 0)
    assert err.value.param == "k"


def test_dp_example_fig_3_11():
    # k = 4 blocks of width b = 3 over n = 16 steps, constant reward: 4 picks
    assert max_reward_min_sep(np.ones(16), 3, 4) == 4.0
    assert argmax_reward_min_sep(np.ones(16), 3, 4)[1] == (0, 3, 6, 9)
    # only 2 steps are 3 apart in [5]: k is capped
    assert max_reward_min_sep(np.ones(5), 3, 4) == 2.0


# ------------------------------------------------------------------------ sensitivities


@SETTINGS
@given(feasible(), seeds(), st.data())
def test_banded_matches_brute_force(case, seed, data):
    n, schema = case
    b = getattr(schema, "b", n)
    bands = data.draw(st.integers(1, max(1, min(b, n))))
    rng = np.random.default_rng(seed)
    C = banded(rng, n, bands)  # entries of both signs
    brute = brute_force_sensitivity(C, schema, n)  # valid: cross terms on patterns vanish
    fast = sensitivity_banded(np.sum(C * C, axis=0), schema, n, bands)
    assert fast.exact and close(fast.value, brute)
    dense = sensitivity_dense(C, schema)
    assert dense.exact and close(dense.value, brute)
    assert close(sensitivity_from_gram(C.T @ C, schema, n).value, brute)


@SETTINGS
@given(feasible(kinds=("cyclic", "minsep")), seeds())
def test_banded_rejects_too_many_bands(case, seed):
    n, schema = case
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_banded(np.ones(n), schema, n, schema.b + 1)
    assert err.value.param == "bands"


@SETTINGS
@given(feasible(), seeds(), st.data())
def test_toeplitz_eq_3_25_matches_brute_force(case, seed, data):
    n, schema = case
    length = data.draw(st.integers(1, n))
    rng = np.random.default_rng(seed)
    coeffs = np.sort(rng.exponential(size=length))[::-1]
    if data.draw(st.booleans()):  # plateaus and exact zeros are allowed
        coeffs = np.round(coeffs, 1)
    C = toeplitz(coeffs, n)
    brute = brute_force_sensitivity(C, schema, n)  # valid: C >= 0, so C^T C >= 0
    fast = sensitivity_toeplitz_monotone(coeffs, schema, n)
    assert fast.exact and close(fast.value, brute)
    assert close(sensitivity_dense(C, schema).value, brute)


def test_toeplitz_rejects_non_monotone_or_negative():
    for coeffs in ([1.0, 0.5, 0.7], [1.0, -0.1], [0.0, 1.0]):
        with pytest.raises(CorrnoiseError) as err:
            sensitivity_toeplitz_monotone(coeffs, MinSep(2, 2), 5)
        assert err.value.param == "strategy"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_toeplitz_monotone(np.ones(6), Cyclic(3, 2), 5)
    assert err.value.param == "strategy"
    # single participation holds for any Toeplitz coefficients: column 0 is the largest
    s = sensitivity_toeplitz_monotone([1.0, -2.0, 2.0], Single(), 3)
    assert s.exact and close(s.value, 3.0)


@SETTINGS
@given(feasible(), seeds(), st.booleans(), st.booleans())
def test_nonnegative_dense_from_gram_matches_brute_force(case, seed, tall, sparse):
    n, schema = case
    rng = np.random.default_rng(seed)
    rows = 2 * n - 1 if tall else n  # e.g. the binary-tree strategy has 2n - 1 rows
    C = rng.random((rows, n))
    if sparse:
        C *= rng.random((rows, n)) < 0.5
    if not tall:
        C = np.tril(C)
    brute = brute_force_sensitivity(C, schema, n)
    g = sensitivity_from_gram(C.T @ C, schema, n)
    assert g.exact and close(g.value, brute)
    d = sensitivity_dense(C, schema)
    assert d.exact and close(d.value, brute)


@SETTINGS
@given(feasible(kinds=("cyclic", "minsep"), max_n=7), seeds())
def test_negative_gram_flagged_and_above_unit_vector_lower_bound(case, seed):
    n, schema = case
    rng = np.random.default_rng(seed)
    C = np.tril(rng.standard_normal((n, n)))
    G = C.T @ C
    negative_on_pattern = any(
        G[np.ix_(p, p)].min() < -1e-6 for p in map(list, schema.patterns(n))
    )
    assume(negative_on_pattern)
    for result in (sensitivity_from_gram(G, schema, n), sensitivity_dense(C, schema)):
        assert not result.exact
        assert result.method == "enumeration-abs-upper-bound"
        lower = unit_vector_lower_bound(C, schema, n, rng)
        assert result.squared >= lower * (1 - 1e-9)
        # the all-equal-u choice (brute force) is a lower bound too
        assert result.value >= brute_force_sensitivity(C, schema, n) * (1 - 1e-12)


def test_negative_gram_example():
    # columns (1, -1) and (0, 1): M = [[2, -1], [-1, 1]]; u_0 = -u_1 attains the abs bound 5
    C = np.array([[1.0, 0.0], [-1.0, 1.0]])
    res = sensitivity_dense(C, MinSep(2, 1))
    assert not res.exact and close(res.squared, 5.0)
    assert close(brute_force_sensitivity(C, MinSep(2, 1), 2) ** 2, 2.0)  # only a lower bound here


@SETTINGS
@given(feasible(kinds=("cyclic", "minsep")), seeds(), st.booleans())
def test_dp_relaxation_bounds_enumeration(case, seed, signed):
    n, schema = case
    rng = np.random.default_rng(seed)
    C = rng.standard_normal((n, n)) if signed else rng.random((n, n))
    G = C.T @ C
    enum = sensitivity_from_gram(G, schema, n)
    relax = dp_relaxation_bound(G, schema, n)
    assert relax.method.startswith("dp-relaxation-")
    if relax.exact:
        assert close(relax.value, enum.value)
    assert relax.squared >= enum.squared * (1 - 1e-12)
    # crude bound: k * max_t sum of the k largest |G[t, :]| entries
    A = np.sort(np.abs(G), axis=1)[:, ::-1]
    k = schema.k
    assert relax.squared <= k * A[:, :k].sum(axis=1).max() * (1 + 1e-12)
    if isinstance(schema, MinSep):
        forced = sensitivity_from_gram(G, schema, n, max_patterns=0)
        t, tau = np.indices(G.shape)
        if np.any(G[np.abs(t - tau) >= schema.b]):
            assert forced.method.startswith("dp-relaxation-") and close(forced.value, relax.value)
            assert forced.exact == (forced.method == "dp-relaxation-tight")
            if forced.exact:  # certified by an allowed pattern attaining the bound
                assert close(forced.value, enum.value)
        else:  # no pair of steps b apart (b >= n): the banded DP is exact
            assert forced.method == "banded-dp" and forced.exact
            assert close(forced.value, enum.value)


@SETTINGS
@given(feasible(kinds=("cyclic", "minsep")), seeds())
def test_dp_relaxation_equals_its_definition(case, seed):
    # w_t = max over b-separated pi' (|pi'| <= k) containing t of sum_{tau in pi'} |G[t, tau]|;
    # bound^2 = max over b-separated pi (|pi| <= k) of sum_{t in pi} w_t -- both by enumeration
    n, schema = case
    k, b = schema.k, schema.b
    G = np.random.default_rng(seed).standard_normal((n, n))
    G = G + G.T
    np.fill_diagonal(G, np.abs(np.diagonal(G)))
    A = np.abs(G)
    subsets = all_minsep_subsets(n, k, b)
    w = [max(A[t, list(p)].sum() for p in subsets if t in p) for t in range(n)]
    expected = max(sum(w[t] for t in p) for p in subsets)
    assert close(dp_relaxation_bound(G, schema, n).squared, expected)


@SETTINGS
@given(feasible(kinds=("minsep",)), seeds(), st.data())
def test_dp_relaxation_exact_for_banded(case, seed, data):
    n, schema = case
    bands = data.draw(st.integers(1, max(1, min(schema.b, n))))
    C = banded(np.random.default_rng(seed), n, bands)
    G = C.T @ C
    relax = dp_relaxation_bound(G, schema, n)
    assert relax.exact and close(relax.value, brute_force_sensitivity(C, schema, n))


def test_dp_relaxation_used_for_large_minsep():
    n = 60
    rng = np.random.default_rng(0)
    C = np.tril(rng.random((n, n)))
    schema = MinSep(4, 3)
    assert schema.count(n) > 200_000
    res = sensitivity_dense(C, schema)
    assert res.method == "dp-relaxation-upper-bound" and not res.exact
    # Lemma 3.16(a): the early-and-often pattern is a lower bound for C^T C >= 0
    v = C[:, [0, 3, 6, 9]].sum(axis=1)
    assert res.squared >= v @ v
    # Toeplitz with monotone coefficients: a valid (not tight) bound above Eq. 3.25
    coeffs = 1.0 / np.sqrt(np.arange(1, n + 1))
    loose = sensitivity_dense(toeplitz(coeffs, n), schema)
    assert loose.value >= sensitivity_toeplitz_monotone(coeffs, schema, n).value
    # rank one, non-negative: M = g g^T, w_t = g_t * S*, bound = S*^2 attained by the DP pattern
    g, h = rng.random(n), rng.random(5)
    tight = sensitivity_dense(np.outer(h, g), schema)
    assert tight.method == "dp-relaxation-tight" and tight.exact
    assert close(tight.squared, (h @ h) * max_reward_min_sep(g, schema.b, schema.k) ** 2)


@pytest.mark.parametrize("n", [1, 5, 12])
def test_identity_gives_max_participations(n):
    C = np.eye(n)
    schemas = [Single()]
    for b in range(1, n + 1):
        schemas.append(Cyclic(math.ceil(n / b), b))
        schemas += [MinSep(k, b) for k in range(1, math.ceil(n / b) + 1)]
    for schema in schemas:
        k = schema.max_participations(n)
        assert k == (1 if isinstance(schema, Single) else schema.k)
        results = [
            sensitivity_dense(C, schema),
            sensitivity_from_gram(C, schema, n),
            sensitivity_banded(np.ones(n), schema, n, 1),
            sensitivity_toeplitz_monotone([1.0], schema, n),
        ]
        for res in results:
            assert res.exact and close(res.squared, k), (schema, res)
        assert close(brute_force_sensitivity(C, schema, n) ** 2, k)


def test_single_and_result_type():
    s = sensitivity_single([1.0, 4.0, 2.0])
    assert s == Sensitivity(2.0, True, "max-column-norm") and s.squared == 4.0
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_single([1.0, -1.0])
    assert err.value.param == "col_norms_sq"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_single([])
    assert err.value.param == "col_norms_sq"


def test_bad_arrays_raise():
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_from_gram(np.ones((3, 4)), MinSep(2, 1), 3)
    assert err.value.param == "gram"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_from_gram(np.array([[1.0, 2.0], [0.0, 1.0]]), MinSep(2, 1), 2)
    assert err.value.param == "gram"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_dense(np.array([[np.nan]]), Single())
    assert err.value.param == "strategy"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_banded(np.ones(4), MinSep(2, 2), 5, 1)
    assert err.value.param == "col_norms_sq"
    with pytest.raises(CorrnoiseError) as err:
        sensitivity_dense(np.eye(5), "cyclic:2:2")  # k must be 3
    assert err.value.param == "participation"
    with pytest.raises(CorrnoiseError) as err:
        brute_force_sensitivity(np.eye(4), Single(), 5)
    assert err.value.param == "strategy"


def test_spec_strings_accepted_by_sensitivity_functions():
    C = np.tril(np.ones((6, 6)))
    assert close(sensitivity_dense(C, "minsep:2:3").value, sensitivity_dense(C, MinSep(2, 3)).value)


def test_prefix_sum_strategy_known_values():
    # C = A_pre (all-ones lower triangle): columns nested, ||sum_{j<k} C[:, j b]||^2 closed form
    n, b, k = 8, 3, 3
    C = np.tril(np.ones((n, n)))
    v = np.zeros(n)
    for j in range(k):
        v[j * b:] += 1.0
    expected = float(v @ v)  # 3*1 + 3*4 + 2*9 = 33
    assert expected == 33.0
    for schema in (Cyclic(k, b), MinSep(k, b)):
        assert close(sensitivity_dense(C, schema).squared, expected)
        assert close(sensitivity_toeplitz_monotone(np.ones(n), schema, n).squared, expected)
