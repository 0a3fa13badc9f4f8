"""bisr:P (Banded Inverse Square Root, Kalinin et al. 2025) against independent dense computations.

The reference C^{-1} is built here from scipy's generalized binomials (tutorial Eq. 2.11:
A_pre^{-1/2} has first column (-1)^t binom(1/2, t)), truncated to P bands, and C = inv(C^{-1}).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import linalg as sla
from scipy.special import binom

from corrnoise.accounting import NoBatching, account, choose_method
from corrnoise.accounting import preconditions as pre
from corrnoise.accounting.event import MechanismEvent
from corrnoise.accounting.gaussian import gaussian_epsilon
from corrnoise.errors import CorrnoiseError
from corrnoise.optimize.banded_inverse import optimize_banded_inverse
from corrnoise.strategies.toeplitz import BandedInverse
from corrnoise.linalg import toeplitz as tp
from corrnoise.losses import loss_report
from corrnoise.noise import make_generator, seed_noise
from corrnoise.noise.seeds import DEFAULT_CHUNK, scratch_bytes
from corrnoise.participation import Cyclic
from corrnoise.sensitivity import brute_force_sensitivity
from corrnoise.strategies import (
    BandedInverseSqrt, ColumnNormalized, DPCGD, Identity, load_mechanism, parse_strategy, save_mechanism,
)

BANDS = (1, 2, 4, 8)


def reference_inverse(n: int, bands: int) -> np.ndarray:
    """C^{-1}: lower-triangular Toeplitz of the first ``bands`` coefficients of A_pre^{-1/2}."""
    t = np.arange(min(bands, n))
    col = np.zeros(n)
    col[: t.size] = (-1.0) ** t * binom(0.5, t)
    return sla.toeplitz(col, np.zeros(n))


def reference_c(n: int, bands: int) -> np.ndarray:
    return sla.solve_triangular(reference_inverse(n, bands), np.eye(n), lower=True)


@given(st.integers(1, 40), st.sampled_from(BANDS))
def test_matrices_equal_the_dense_reference(n, bands):
    bands = min(bands, n)
    s = parse_strategy(f"bisr:{bands}", n)
    assert isinstance(s, BandedInverseSqrt) and s.label == f"bisr:{bands}" and s.kind == "bisr"
    Cinv, C = reference_inverse(n, bands), reference_c(n, bands)
    np.testing.assert_allclose(s.noising_matrix(), Cinv, atol=1e-14)
    np.testing.assert_allclose(s.matrix(), C, rtol=1e-12, atol=1e-14)
    # C^{-1}'s first column: exactly the P given coefficients, zeros after
    assert np.count_nonzero(s.inverse_coefficients) == bands and s.inverse_coefficients.size == n
    rng = np.random.default_rng(n)
    x = rng.normal(size=(n, 2))
    np.testing.assert_allclose(s.multiply(x), C @ x, atol=1e-10)
    np.testing.assert_allclose(s.inverse_multiply(x), Cinv @ x, atol=1e-12)
    np.testing.assert_allclose(s.column_norms_squared(), np.sum(C**2, axis=0), rtol=1e-12)
    assert s.bands == (1 if bands == 1 else n) and s.inverse_bands == bands
    assert s.is_nonnegative() and bool(np.all(C >= 0))


def test_full_band_is_the_toeplitz_square_root():
    for n in (1, 7, 64):
        np.testing.assert_allclose(parse_strategy(f"bisr:{n}", n).matrix(), parse_strategy("toeplitz-sqrt", n).matrix(),
                                   rtol=1e-12, atol=1e-15)
    # P = 1 is DP-SGD, P = 2 is DP-CGD with beta = 1/2 (C^{-1} = I - S / 2)
    np.testing.assert_array_equal(parse_strategy("bisr:1", 9).matrix(), Identity(9).matrix())
    np.testing.assert_allclose(parse_strategy("bisr:2", 9).matrix(), DPCGD(0.5, 9).matrix(), rtol=1e-15)


@pytest.mark.parametrize("bands", range(1, 9))
def test_c_is_nonnegative_and_monotone_at_n_1000(bands):
    s = BandedInverseSqrt(1000, bands)
    c = s.coefficients
    assert np.all(c >= 0.0) and s.is_nonnegative() and s.is_nonnegative_monotone()
    # C's coefficients sum to 1 / q(1), q the truncated series (geometric-type decay)
    assert c.sum() == pytest.approx(1.0 / tp.bisr_inverse_coefficients(bands).sum(), rel=1e-12)


def test_many_bands_take_the_fft_path_and_stay_nonnegative():
    """P > 64 uses Newton/FFT series inversion, whose round-off in the tiny tail has either sign;
    the exact coefficients are > 0 (see bisr_coefficients), so no negative may survive."""
    n, bands = 5000, 100
    c = tp.bisr_coefficients(bands, n)
    assert np.all(c >= 0.0) and BandedInverseSqrt(n, bands).is_nonnegative()
    exact = tp.series_inverse(tp.bisr_inverse_coefficients(bands), 400)  # the IIR path is exact in sign
    np.testing.assert_allclose(c[:400], exact, rtol=1e-10)
    product = tp.series_multiply(c, tp.bisr_inverse_coefficients(bands), n)
    assert np.max(np.abs(product - np.eye(1, n)[0])) < 1e-13


def test_files_resize_and_colnorm(tmp_path):
    s = parse_strategy("bisr:4", 20)
    path = save_mechanism(s, tmp_path / "bisr.json")
    loaded = load_mechanism(path)
    assert type(loaded) is BandedInverseSqrt and loaded.params() == {"bands": 4} and loaded.label == "bisr:4"
    np.testing.assert_array_equal(loaded.matrix(), s.matrix())
    big = load_mechanism(path, n=50)
    assert big.n == 50 and big.label == "bisr:4"
    np.testing.assert_allclose(big.matrix()[:20, :20], s.matrix(), rtol=1e-15)
    assert s.with_n(3).label == "bisr:3" and s.with_n(3).n == 3
    cn = parse_strategy("bisr:4+colnorm", 20)
    assert isinstance(cn, ColumnNormalized) and cn.label == "bisr:4+colnorm"
    np.testing.assert_allclose(np.linalg.norm(cn.matrix(), axis=0), 1.0)
    cn_file = load_mechanism(save_mechanism(cn, tmp_path / "cn.json"))
    assert cn_file.label == "bisr:4+colnorm"
    np.testing.assert_array_equal(cn_file.matrix(), cn.matrix())


@pytest.mark.parametrize("name", ["bisr:0", "bisr:11", "bisr:x", "bisr:2.5", "bisr:-1"])
def test_bad_names_name_the_bands(name):
    with pytest.raises(CorrnoiseError) as err:
        parse_strategy(name, 10)
    assert err.value.param == "bands" and "\n" not in str(err.value)


# --- noise --------------------------------------------------------------------------------------
M, CHUNK, SEED, NU = 37, 8, 99, 1.3


def _materialized_noise(Cinv, m=M):
    z = np.stack([seed_noise(SEED, tau, m, chunk_size=CHUNK).numpy() for tau in range(Cinv.shape[0])])
    return NU * Cinv @ z


@given(st.integers(1, 20), st.sampled_from(BANDS), st.booleans())
def test_generator_equals_materialized_noise(n, bands, colnorm):
    bands = min(bands, n)
    s = BandedInverseSqrt(n, bands)
    Cinv = reference_inverse(n, bands)
    if colnorm:
        s = ColumnNormalized(s)
        Cinv = np.linalg.norm(reference_c(n, bands), axis=0)[:, None] * Cinv
    want = _materialized_noise(Cinv)
    gen = make_generator(s, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    assert gen.kind == "regenerate"
    got = np.stack([gen.next_flat().numpy() for _ in range(n)])
    assert np.max(np.abs(got - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))
    pieces = []
    for start, stop in [(0, 5), (5, 20), (20, M)]:  # shards cut inside chunks
        g = make_generator(s, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, shard=(start, stop))
        pieces.append(np.stack([g.next_flat().numpy() for _ in range(n)]))
    assert np.max(np.abs(np.concatenate(pieces, axis=1) - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))


def test_noise_costs_p_rows_and_no_buffers():
    stream = BandedInverseSqrt(100, 8).noise_stream()
    assert stream.kind == "regenerate" and stream.buffer_rows() == 0
    assert np.count_nonzero(stream.params["inverse_toeplitz"]) == 8
    big = 1 << 20
    gen = make_generator(BandedInverseSqrt(100, 8), big, seed=0)
    for _ in range(10):
        gen.next_flat()
    dpsgd = make_generator(Identity(100), big, seed=0)
    dpsgd.next_flat()
    # DP-SGD's level: its block of scratch per thread plus n-length coefficient arrays (16 bytes
    # a step), nothing of size m (4 MiB here)
    assert dpsgd.extra_memory_bytes() == scratch_bytes(DEFAULT_CHUNK, torch.float32)
    assert gen.extra_memory_bytes() <= dpsgd.extra_memory_bytes() + 16 * 100 < dpsgd.extra_memory_bytes() + 4 * big


# --- losses and accounting ------------------------------------------------------------------------
CASES = [(n, bands, epoch) for n, bands in [(12, 1), (12, 2), (16, 4), (24, 8), (64, 8)]
         for epoch in (None, 4, 6, 16) if epoch is None or epoch <= n]


@pytest.mark.parametrize("n,bands,epoch", CASES)
def test_loss_report_equals_dense(n, bands, epoch):
    """Single participation and cyclic:K:B (B = ``epoch`` steps per epoch, K = ceil(n / B))."""
    C, Cinv = reference_c(n, bands), reference_inverse(n, bands)
    B = np.tril(np.ones((n, n))) @ Cinv
    if epoch is None:
        participation = "single"
        sens = np.sqrt(np.max(np.sum(C**2, axis=0)))
    else:
        k = -(-n // epoch)
        participation = f"cyclic:{k}:{epoch}"
        sens = brute_force_sensitivity(C, Cyclic(k, epoch), n)  # exact: C >= 0 so C^T C >= 0
    rows = np.sum(B**2, axis=1)
    r = loss_report(parse_strategy(f"bisr:{bands}", n), participation)
    assert r.sensitivity == pytest.approx(sens, rel=1e-10) and r.sensitivity_exact
    assert r.rms_loss == pytest.approx(sens * np.sqrt(rows.mean()), rel=1e-10)
    assert r.max_loss == pytest.approx(sens * np.sqrt(rows.max()), rel=1e-10)


def test_unamplified_gaussian_accounting():
    n, noise_std = 32, 3.0
    s = parse_strategy("bisr:4", n)
    r = account(s, "none", noise_std=noise_std, delta=1e-5)
    sens = math.sqrt(np.max(np.sum(reference_c(n, 4) ** 2, axis=0)))
    assert r.method == "gaussian"
    assert r.epsilon == pytest.approx(gaussian_epsilon(1e-5, sens / noise_std), rel=1e-9)


def test_amplified_accounting_passes_the_nonnegativity_gate():
    """C >= 0, so MMCC and balls-in-bins accept bisr (tutorial/seed 000-001 preconditions)."""
    s = parse_strategy("bisr:2", 16)
    for batching in ("balls-in-bins:4", "block-cyclic:2:0.2", "poisson:0.1"):
        assert pre.require_nonnegative(MechanismEvent(s, batching)) is None
    assert choose_method(s, "block-cyclic:2:0.2") == "mmcc"  # C has n bands: not Thm 3.21
    amp = account(s, "block-cyclic:2:0.2", noise_std=2.0, delta=1e-6, method="mmcc")
    plain = account(s, NoBatching(Cyclic(8, 2)), noise_std=2.0, delta=1e-6)  # the same 8 participations
    assert plain.method == "gaussian"
    assert math.isfinite(amp.epsilon) and 0.0 < amp.epsilon < plain.epsilon


# --- bandinv:P (optimized banded-Toeplitz C^{-1}) -----------------------------------------------
@pytest.mark.parametrize("n,bands", [(1, 1), (16, 2), (48, 4), (64, 8)])
def test_bandinv_losses_equal_dense_and_beat_bisr(n, bands, tmp_path):
    s = BandedInverse(n, optimize_banded_inverse(n, bands))
    assert s.label == f"bandinv:{bands}" and s.kind == "bandinv" and s.inverse_bands == bands
    q = s.inverse_coefficients[:bands]
    Cinv = sla.toeplitz(np.concatenate([q, np.zeros(n - bands)]), np.zeros(n))
    C = sla.solve_triangular(Cinv, np.eye(n), lower=True)
    np.testing.assert_allclose(s.matrix(), C, rtol=1e-10, atol=1e-12)
    B = np.tril(np.ones((n, n))) @ Cinv
    sens = np.sqrt(np.max(np.sum(C**2, axis=0)))
    r = loss_report(s)
    assert r.sensitivity == pytest.approx(sens, rel=1e-10)
    assert r.rms_loss == pytest.approx(sens * np.linalg.norm(B) / np.sqrt(n), rel=1e-10)
    assert r.rms_loss <= loss_report(parse_strategy(f"bisr:{bands}", n)).rms_loss * (1 + 1e-12)
    assert s.is_nonnegative() == bool(np.all(C >= 0))
    loaded = load_mechanism(save_mechanism(s, tmp_path / "bi.json"))
    assert type(loaded) is type(s) and loaded.params() == s.params()
    np.testing.assert_array_equal(loaded.matrix(), s.matrix())
    gen = make_generator(s, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
    assert gen.kind == "regenerate"
    got = np.stack([gen.next_flat().numpy() for _ in range(n)])
    want = _materialized_noise(Cinv)
    assert np.max(np.abs(got - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))


@pytest.mark.parametrize("bands", [0, 11])
def test_bandinv_bad_bands_name_the_bands(bands):
    with pytest.raises(CorrnoiseError) as err:
        optimize_banded_inverse(10, bands)
    assert err.value.param == "bands"


def test_bandinv_is_designed_by_optimize_and_named_by_its_file(tmp_path):
    """bandinv:P needs an optimization, so it is a design (corrnoise optimize bandinv), not a name of
    parse_strategy (the strategies layer never runs an optimizer); its mechanism file is its name."""
    from corrnoise.cli import main

    out = tmp_path / "bi.json"
    assert main(["optimize", "bandinv", "--n", "32", "--bands", "4", "--out", str(out), "--json"]) == 0
    s = parse_strategy(str(out), 32)
    assert s.kind == "bandinv" and s.inverse_bands == 4
    with pytest.raises(CorrnoiseError):
        parse_strategy("bandinv:4", 32)
