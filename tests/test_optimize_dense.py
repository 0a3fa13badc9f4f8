"""Dense and general banded optimizers, the band sweep and ``corrnoise optimize``.

Independent references: tutorial Tables 2.2 / 2.3 (published numbers), scipy.optimize on the
explicit entries of C (brute force), streamed / materialized losses from corrnoise.losses, and
finite differences for gradients.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import optimize as sopt

from corrnoise.cli import main
from corrnoise.errors import CorrnoiseError
from corrnoise.losses import loss_report, per_query_squared_error
from corrnoise.optimize.banded import BandedObjective, optimize_banded, sweep_bands
from corrnoise.optimize.common import reverse_cholesky, series_sqrt
from corrnoise.optimize.dense import optimize_dense, warm_start
from corrnoise.participation import Cyclic
from corrnoise.strategies import Banded, ColumnNormalized, Dense, ToeplitzSqrt, load_mechanism
from corrnoise.workloads import momentum, prefix

DATA = Path(__file__).parent / "data"


def _table(name: str) -> dict[int, float]:
    rows = np.genfromtxt(DATA / name, delimiter=",", names=True)
    return {int(r["n"]): float(r["dense"]) for r in rows if np.isfinite(r["dense"])}


def _assert_valid(strategy) -> np.ndarray:
    c = strategy.matrix()
    assert np.all(np.isfinite(c))
    assert np.all(np.triu(c, 1) == 0.0)
    assert np.all(np.diagonal(c) > 0.0)
    return c


# ----------------------------------------------------------------------------- dense


@pytest.mark.parametrize("n", [8, 16, 32, 64, 128, 256])
def test_dense_matches_tutorial_table_2_3(n):
    """RMS loss of the dense optimum, tutorial Table 2.3 'Dense' column, to within +0.002."""
    info: dict = {}
    strategy = optimize_dense(n, info=info)
    _assert_valid(strategy)
    report = loss_report(strategy)
    published = _table("tutorial_table_2_3_rms_loss.csv")[n]
    assert published - 0.0006 <= report.rms_loss <= published + 0.002
    # certified: the dual lower bound is within 5e-5 (relative, squared loss) of the value
    assert info["gap"] <= 5e-5
    assert info["lower_bound"] <= n * report.rms_loss**2 * (1 + 1e-9)


@pytest.mark.parametrize("n", [8, 16, 32])
def test_dense_max_objective_matches_tutorial_table_2_2(n):
    report = loss_report(optimize_dense(n, objective="max"))
    published = _table("tutorial_table_2_2_max_loss.csv")[n]
    assert published - 0.0006 <= report.max_loss <= published + 0.002
    # the max-optimal strategy beats the RMS-optimal one on max loss
    assert report.max_loss < loss_report(optimize_dense(n)).max_loss


def _brute_force_single(n: int, workload) -> float:
    """min over lower-triangular C (explicit entries, columns normalized so sens = 1) of
    ||A C^-1||_F / sqrt(n), by scipy BFGS with numerical gradients."""
    a = workload.matrix(n)
    il = np.tril_indices(n)

    def loss(v):
        c = np.zeros((n, n))
        c[il] = v
        c = c / np.linalg.norm(c, axis=0)
        return np.linalg.norm(a @ np.linalg.inv(c)) ** 2 / n

    x0 = np.eye(n)[il] + 0.05
    best = sopt.minimize(loss, x0, method="BFGS", options={"gtol": 1e-10, "maxiter": 5000})
    return float(np.sqrt(best.fun))


@pytest.mark.parametrize("workload", [prefix(), momentum(0.9)], ids=["prefix", "momentum"])
def test_dense_agrees_with_brute_force_on_c_entries(workload):
    n = 5
    ours = loss_report(optimize_dense(n, workload=workload, tol=1e-9), workload=workload).rms_loss
    assert ours == pytest.approx(_brute_force_single(n, workload), rel=1e-5)


def test_dense_cyclic_agrees_with_generic_constrained_solver():
    """Problem 4.6 solved by SLSQP on the free entries of M with an explicit inverse."""
    n, schema = 6, Cyclic(2, 3)
    a = prefix().matrix(n)
    w = a.T @ a
    iu = [(i, j) for i in range(n) for j in range(i + 1, n) if (j - i) % 3 != 0]

    def gram(v):
        m = np.diag(v[:n])
        for k, (i, j) in enumerate(iu):
            m[i, j] = m[j, i] = v[n + k]
        return m

    def f(v):
        m = gram(v)
        if np.min(np.linalg.eigvalsh(m)) <= 1e-9:
            return 1e6
        return float(np.trace(w @ np.linalg.inv(m)))

    cons = [{"type": "eq", "fun": lambda v, r=r: v[r] + v[r + 3] - 1.0} for r in range(3)]
    v0 = np.concatenate([np.full(n, 0.5), np.zeros(len(iu))])
    res = sopt.minimize(f, v0, method="SLSQP", constraints=cons, options={"ftol": 1e-14, "maxiter": 1000})
    strategy = optimize_dense(n, schema)
    report = loss_report(strategy, schema)
    assert report.sensitivity == pytest.approx(1.0, abs=1e-9) and report.sensitivity_exact
    assert report.rms_loss == pytest.approx(np.sqrt(res.fun / n), rel=1e-5)
    gram_c = strategy.matrix().T @ strategy.matrix()
    assert abs(gram_c[0, 3]) < 1e-9 and abs(gram_c[2, 5]) < 1e-9  # same-pattern noise uncorrelated


@pytest.mark.parametrize(
    "n,participation",
    [(32, "single"), (64, "single"), (48, "cyclic:4:12"), (64, "minsep:3:16"), (40, "minsep:1:8")],
)
def test_dense_beats_warm_start_and_toeplitz_sqrt(n, participation):
    strategy = optimize_dense(n, participation)
    ours = loss_report(strategy, participation).rms_loss
    start = loss_report(Dense(reverse_cholesky(warm_start(n, strategy_schema(participation), prefix()))),
                        participation).rms_loss
    assert ours <= start * (1 + 1e-12)
    assert ours <= loss_report(ToeplitzSqrt(n), participation).rms_loss
    assert ours <= loss_report(ColumnNormalized(ToeplitzSqrt(n)), participation).rms_loss


def strategy_schema(spec):
    from corrnoise.participation import parse_participation

    return parse_participation(spec)


def test_dense_min_sep_is_banded_and_matches_banded_optimizer():
    n, b = 48, 6
    dense = optimize_dense(n, f"minsep:2:{b}")
    assert isinstance(dense, Banded) and dense.bands == b
    _assert_valid(dense)
    banded = optimize_banded(n, b, f"minsep:2:{b}")
    assert loss_report(banded).mean_error == pytest.approx(loss_report(dense).mean_error, rel=1e-4)


def test_dense_momentum_matches_full_band_banded():
    wl = momentum(0.9, 0.01)
    d = loss_report(optimize_dense(24, workload=wl), workload=wl).rms_loss
    b = loss_report(optimize_banded(24, 24, workload=wl), workload=wl).rms_loss
    assert b == pytest.approx(d, rel=1e-4)


def test_reverse_cholesky_is_lower_triangular():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 7))
    m = x @ x.T + 7 * np.eye(7)
    c = reverse_cholesky(m)
    assert np.allclose(np.triu(c, 1), 0.0) and np.all(np.diagonal(c) > 0)
    assert np.allclose(c.T @ c, m)
    with pytest.raises(CorrnoiseError):
        reverse_cholesky(-m)


def test_series_sqrt_squares_back():
    a = momentum(0.8, 0.05).coefficients(12)
    s = series_sqrt(a, 12)
    assert np.allclose(np.convolve(s, s)[:12], a)


# ----------------------------------------------------------------------------- banded


@pytest.mark.parametrize("workload", [prefix(), momentum(0.9, 0.01)], ids=["prefix", "momentum"])
@pytest.mark.parametrize("n,b", [(1, 1), (7, 3), (40, 5), (50, 17), (33, 33), (100, 2)])
def test_banded_objective_matches_streamed_losses(workload, n, b):
    rng = np.random.default_rng(n * 100 + b)
    p = rng.uniform(0.2, 1.0, size=(n, b))
    obj = BandedObjective(n, b, workload)
    ours = obj.per_query(torch.tensor(p)).numpy()
    strategy = Banded(obj.band(p))
    ref = per_query_squared_error(strategy, workload)
    np.testing.assert_allclose(ours, ref, rtol=1e-10)
    dense_ref = np.sum((workload.matrix(n) @ np.linalg.inv(strategy.matrix())) ** 2, axis=1)
    np.testing.assert_allclose(ours, dense_ref, rtol=1e-9)
    assert np.allclose(strategy.column_norms_squared(), 1.0)


def test_banded_gradient_matches_finite_differences():
    n, b = 70, 6
    obj = BandedObjective(n, b, momentum(0.5))
    rng = np.random.default_rng(3)
    p0 = rng.uniform(0.3, 1.0, size=(n, b))
    d = rng.normal(size=(n, b))

    def f(p):
        return float(obj.per_query(torch.tensor(p)).sum())

    p = torch.tensor(p0, requires_grad=True)
    obj.per_query(p).sum().backward()
    h = 1e-6
    fd = (f(p0 + h * d) - f(p0 - h * d)) / (2 * h)
    assert float((p.grad.numpy() * d).sum()) == pytest.approx(fd, rel=1e-6)


def _brute_force_banded(n: int, b: int) -> float:
    il = [(t, j) for j in range(n) for t in range(j, min(n, j + b))]
    a = prefix().matrix(n)

    def loss(v):
        c = np.zeros((n, n))
        for (t, j), val in zip(il, v):
            c[t, j] = val
        c = c / np.linalg.norm(c, axis=0)
        return np.linalg.norm(a @ np.linalg.inv(c)) ** 2 / n

    x0 = np.array([1.0 if t == j else 0.3 for t, j in il])
    res = sopt.minimize(loss, x0, method="BFGS", options={"gtol": 1e-10, "maxiter": 5000})
    return float(np.sqrt(res.fun))


def test_banded_agrees_with_brute_force():
    n, b = 7, 3
    s = optimize_banded(n, b, initial=None)
    assert isinstance(s, Banded) and s.bands == b
    assert loss_report(s).rms_loss == pytest.approx(_brute_force_banded(n, b), rel=1e-5)


def test_banded_full_band_equals_dense():
    n = 16
    assert loss_report(optimize_banded(n, n)).rms_loss == pytest.approx(loss_report(optimize_dense(n)).rms_loss, rel=1e-4)


def test_banded_beats_banded_sqrt_and_is_valid():
    from corrnoise.strategies import parse_strategy

    n, b = 300, 8
    s = optimize_banded(n, b, "cyclic:8:38")
    _assert_valid(s)
    r = loss_report(s, "cyclic:8:38")
    assert r.sensitivity == pytest.approx(np.sqrt(8)) and r.sensitivity_exact
    assert r.rms_loss < loss_report(parse_strategy(f"bsr:{b}+colnorm", n), "cyclic:8:38").rms_loss


def test_banded_max_objective_close_to_dense_max():
    n = 16
    banded = loss_report(optimize_banded(n, n, objective="max")).max_loss
    dense = loss_report(optimize_dense(n, objective="max")).max_loss
    assert dense * (1 - 1e-4) <= banded <= dense * (1 + 2e-3)


def test_sweep_bands_returns_losses_per_b():
    out = sweep_bands(64, [1, 2, 8, 64])
    assert sorted(out) == [1, 2, 8, 64]
    losses = [out[b].rms_loss for b in sorted(out)]
    assert all(x >= y - 1e-9 for x, y in zip(losses, losses[1:]))
    # one band, column-normalized: C = I, so the RMS loss is ||A||_F / sqrt(n) = sqrt((n + 1) / 2)
    assert out[1].rms_loss == pytest.approx(np.sqrt(65 / 2), rel=1e-12)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda: optimize_dense(0), "n"),
        (lambda: optimize_dense(8, objective="mean"), "objective"),
        (lambda: optimize_dense(8, participation="cyclic:3:4"), "participation"),
        (lambda: optimize_banded(8, 9), "bands"),
        (lambda: optimize_banded(8, 0), "bands"),
        (lambda: optimize_banded(-1, 1), "n"),
        (lambda: optimize_banded(64, 20, "minsep:2:16"), "bands"),
        (lambda: optimize_banded(8, 2, workload="sgd"), "workload"),
        (lambda: sweep_bands(8, [2, 9]), "bands"),
    ],
)
def test_bad_input_names_the_parameter(call, param):
    with pytest.raises(CorrnoiseError) as err:
        call()
    assert err.value.param == param and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "args,param",
    [
        (["optimize", "nope", "--n", "8"], "kind"),
        (["optimize", "dense", "--n", "0"], "n"),
        (["optimize", "banded", "--n", "8", "--bands", "9"], "bands"),
        (["optimize", "banded", "--n", "8", "--bands", "0"], "bands"),
        (["optimize", "banded", "--n", "8"], "bands"),
        (["optimize", "banded", "--n", "64", "--bands", "20", "--participation", "minsep:2:16"], "bands"),
        (["optimize", "dense", "--n", "8", "--objective", "mean"], "objective"),
        (["optimize", "dense", "--n", "8", "--buffers", "2"], "buffers"),
    ],
)
def test_cli_bad_input_one_line(args, param, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {param}:")


@pytest.mark.parametrize("kind,extra", [("dense", []), ("banded", ["--bands", "4"])])
def test_cli_writes_mechanism_file(tmp_path, capsys, kind, extra):
    out = tmp_path / f"{kind}.json"
    assert main(["optimize", kind, "--n", "24", *extra, "--participation", "minsep:2:4",
                 "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no progress output with --json
    data = json.loads(captured.out)
    for key in ("rms_loss", "max_loss", "sensitivity", "mean_error", "max_error", "seconds", "file"):
        assert key in data
    assert data["file"] == str(out)
    loaded = load_mechanism(out)
    report = loss_report(loaded, "minsep:2:4")
    assert report.rms_loss == pytest.approx(data["rms_loss"], rel=1e-12)
    doc = json.loads(out.read_text())
    assert doc["designed_for"] == {"participation": "minsep:2:4", "objective": "rms", "workload": "prefix"}
    assert doc["losses"]["rms_loss"] == pytest.approx(data["rms_loss"])
