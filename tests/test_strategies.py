"""Every strategy kind: fast and streaming products equal the materialized matrices."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import linalg as sla

from corrnoise.errors import CorrnoiseError
from corrnoise.linalg.streaming import run_stream
from corrnoise.strategies import (
    BLT, DPCGD, Banded, ColumnNormalized, Dense, OnlineTree, Toeplitz, Tree, load_mechanism, parse_strategy,
    save_mechanism,
)
from tree_reference import noising_reference
from conftest import random_strategies


@given(st.integers(1, 24), st.integers(0, 10_000), st.integers(1, 3))
def test_products_and_streams_equal_dense(n, seed, m):
    rng = np.random.default_rng(seed)
    for s in random_strategies(n, seed):
        C = s.matrix()
        x = rng.normal(size=(n, m))
        z = rng.normal(size=(s.rows, m))
        assert np.allclose(s.multiply(x), C @ x, atol=1e-10), s.label
        if isinstance(s, Tree) or (isinstance(s, ColumnNormalized) and isinstance(s.base, Tree)):
            expected = np.linalg.pinv(C) @ z
        elif isinstance(s, OnlineTree):  # a left inverse of C: the online decoder (tests/test_tree.py)
            expected = noising_reference(n, s.decoding) @ z
            assert np.allclose(s.noising_matrix() @ C, np.eye(n), atol=1e-10), s.label
        else:
            expected = sla.solve_triangular(C, z, lower=True)
            assert np.allclose(run_stream(s.multiply_stream(), x), C @ x, atol=1e-10), s.label
            assert np.allclose(run_stream(s.inverse_stream(), z), expected, atol=1e-10), s.label
            assert np.allclose(s.noising_matrix() @ C, np.eye(n), atol=1e-9), s.label
        assert np.allclose(s.inverse_multiply(z), expected, atol=1e-10), s.label
        assert np.allclose(s.column_norms_squared(), np.sum(C**2, axis=0), rtol=1e-12), s.label
        assert s.is_nonnegative() == bool(np.all(C >= 0)), s.label


def test_bands_are_counted():
    n = 10
    for s in random_strategies(n):
        C = s.matrix()
        if C.shape[0] != n:
            continue
        rows, cols = np.nonzero(C)
        assert s.bands >= int(np.max(rows - cols)) + 1, s.label
    assert parse_strategy("bsr:3", n).bands == 3
    assert parse_strategy("identity", n).bands == 1


def test_column_normalization_gives_unit_columns_and_scales_noise():
    s = ColumnNormalized(parse_strategy("toeplitz-sqrt", 16))
    assert np.allclose(np.linalg.norm(s.matrix(), axis=0), 1.0)
    base = s.base
    z = np.random.default_rng(1).normal(size=16)
    assert np.allclose(s.inverse_multiply(z), s.scale * base.inverse_multiply(z))


def test_dpcgd_is_one_step_noise_cancellation():
    s = DPCGD(0.7, 6)
    assert np.allclose(s.matrix()[:, 0], 0.7 ** np.arange(6))
    z = np.arange(1.0, 7.0)
    expected = z - 0.7 * np.concatenate([[0.0], z[:-1]])
    assert np.allclose(s.inverse_multiply(z), expected)
    assert np.allclose(run_stream(s.inverse_stream(), z), expected)


def test_streams_refuse_steps_past_the_end():
    for s in random_strategies(4):
        if isinstance(s, (Tree, OnlineTree)):  # rows of Z are tree nodes: tests/test_tree.py
            continue
        op = s.inverse_stream()
        state = op.init(())
        for _ in range(4):
            _, state = op.step(state, 1.0)
        with pytest.raises(CorrnoiseError) as err:
            op.step(state, 1.0)
        assert err.value.param == "steps"


@pytest.mark.parametrize("n", [1, 7, 33])
def test_mechanism_files_round_trip_every_kind_exactly(tmp_path, n):
    long_toeplitz = Toeplitz(np.concatenate([[1.0], np.random.default_rng(3).uniform(0, 1, 2000)]), 2001)
    for i, s in enumerate(random_strategies(n, seed=n) + [long_toeplitz]):
        path = save_mechanism(s, tmp_path / f"m{i}.json", designed_for={"participation": "single"})
        loaded = load_mechanism(path)
        assert type(loaded) is type(s) and loaded.label == s.label and loaded.n == s.n
        assert np.array_equal(loaded.matrix(), s.matrix()), s.label
        assert loaded.params() == s.params()


def test_n_independent_kinds_resize_and_others_truncate(tmp_path):
    path = save_mechanism(BLT([0.2, 0.1], [0.9, 0.5], 10), tmp_path / "blt.json")
    big = load_mechanism(path, n=1000)
    assert big.n == 1000 and np.allclose(big.matrix()[:10, :10], BLT([0.2, 0.1], [0.9, 0.5], 10).matrix())
    d = Dense(np.tril(np.ones((5, 5))))
    assert np.array_equal(d.with_n(3).matrix(), np.tril(np.ones((3, 3))))
    with pytest.raises(CorrnoiseError) as err:
        d.with_n(6)
    assert err.value.param == "n"
    band = Banded(np.ones((5, 2)))
    assert band.with_n(4).n == 4


@pytest.mark.parametrize(
    "name,param",
    [("dpcgd:1.0", "beta"), ("dpcgd:-0.1", "beta"), ("dpcgd:nan", "beta"), ("bsr:0", "bands"), ("bsr:99", "bands"),
     ("blt:0.1:1.0", "lambda"), ("blt:0.1:-0.2", "lambda"), ("nonsense", "strategy"), ("bsr:x", "bands")],
)
def test_bad_strategy_names_name_the_parameter(name, param):
    with pytest.raises(CorrnoiseError) as err:
        parse_strategy(name, 10)
    assert err.value.param == param


def test_matrix_files_are_validated(tmp_path):
    upper = tmp_path / "upper.npy"
    np.save(upper, np.ones((4, 4)))
    singular = tmp_path / "singular.npy"
    np.save(singular, np.diag([1.0, 0.0, 1.0, 1.0]))
    ok = tmp_path / "ok.npy"
    np.save(ok, np.tril(np.ones((4, 4))))
    for path in (upper, singular):
        with pytest.raises(CorrnoiseError) as err:
            parse_strategy(f"matrix:{path}", 4)
        assert err.value.param == "matrix"
    assert parse_strategy(f"matrix:{ok}", 4).n == 4
    with pytest.raises(CorrnoiseError):
        parse_strategy(f"matrix:{tmp_path / 'missing.npy'}", 4)


@pytest.mark.parametrize("field, value, says", [
    (("params", "bands"), 2.5, "'bands' must be an integer"),
    (("params", "bands"), "2", "'bands' must be an integer"),
    (("params", "bands"), True, "'bands' must be an integer"),
    (("column_normalized",), "false", "'column_normalized' must be true or false"),
    (("n",), 16.7, "n: must be an integer"),
    (("n",), True, "n: must be an integer"),
    (("n",), "abc", "n: must be an integer"),
    (("params",), [1], "'params' must be an object"),
    (("params",), {}, "missing entry 'bands'"),
])
def test_mechanism_file_fields_have_their_types(tmp_path, field, value, says):
    """A hand-edited file is refused naming the field, never read with another meaning."""
    import json

    path = save_mechanism(parse_strategy("bsr:2", 16), tmp_path / "m.json")
    doc = json.loads(path.read_text())
    target = doc
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(CorrnoiseError) as e:
        load_mechanism(path)
    assert e.value.param == "mechanism" and says in str(e.value), str(e.value)


def test_mechanism_file_with_arrays_goes_into_a_new_directory(tmp_path):
    from corrnoise.strategies import Dense

    path = save_mechanism(Dense(np.tril(np.ones((4, 4)))), tmp_path / "new" / "dense.json")
    assert load_mechanism(path).n == 4


@pytest.mark.parametrize("name", ["blt:3", "bandmf:4"])
def test_planner_candidate_names_are_explained_not_misparsed(name):
    with pytest.raises(CorrnoiseError) as e:
        parse_strategy(name, 16)
    assert e.value.param == "mechanism" and "planner" in str(e.value)


# --- a family registered in one place (docs/design.md, "Adding a mechanism") ---------------------
from corrnoise.strategies import Toeplitz, load_mechanism, mechanism_fingerprint, register_family, save_mechanism  # noqa: E402
from corrnoise.strategies.base import FAMILY_KINDS, FAMILY_NAMES, parse_float  # noqa: E402


class _Geometric(Toeplitz):
    """A toy family, all of it in this class: c_t = alpha^t, named ``geometric-test:ALPHA``
    (registered by the test below only while it runs: other tests enumerate the known kinds)."""

    kind = "geometric-test"

    def __init__(self, alpha: float, n: int):
        self.alpha = float(alpha)
        super().__init__(self.alpha ** np.arange(n), n)

    @property
    def label(self):
        return f"geometric-test:{self.alpha:g}"

    def params(self):
        return {"alpha": self.alpha}

    def arrays(self):
        return {}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(params["alpha"], n)

    def with_n(self, n):
        return type(self)(self.alpha, n)

    @classmethod
    def from_name(cls, args, n):
        return cls(parse_float("alpha", args), n)


@pytest.fixture
def geometric_family():
    register_family("geometric-test")(_Geometric)
    yield _Geometric
    FAMILY_KINDS.pop("geometric-test", None)
    FAMILY_NAMES.pop("geometric-test", None)


def test_a_registered_family_is_named_saved_fingerprinted_and_trained(tmp_path, geometric_family):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.torch import make_private

    C = parse_strategy("geometric-test:0.5", 20)
    assert isinstance(C, _Geometric) and np.allclose(C.matrix()[:, 0], 0.5 ** np.arange(20))
    loaded = load_mechanism(save_mechanism(C, tmp_path / "g.json"))
    assert isinstance(loaded, _Geometric) and mechanism_fingerprint(loaded) == mechanism_fingerprint(C)
    assert mechanism_fingerprint(_Geometric(0.6, 20)) != mechanism_fingerprint(C)
    with pytest.raises(CorrnoiseError) as e:
        parse_strategy("geometric-test:x", 20)
    assert e.value.param == "alpha"
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 2, (100,)))
    _, opt, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=10),
                             mechanism="geometric-test:0.5", batching="cyclic", epsilon=2.0, delta=1e-5, epochs=2,
                             max_grad_norm=1.0)
    assert opt.strategy.label == "geometric-test:0.5" and opt.run_guarantee().epsilon <= 2.0
