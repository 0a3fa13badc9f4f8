"""The online binary tree (issue #13): the streamed noise, losses and sensitivity equal the
materialized tree (tests/tree_reference.py), at any n without a matrix, in training."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tree_reference import noising_reference, padded_nodes, prefix_decoder
from corrnoise.errors import CorrnoiseError
from corrnoise.linalg.tree import (node_id, node_ids, online_tree_step, run_tree_stream, stack_slots, tree_depth,
                                   tree_matrix, tree_rows)
from corrnoise.losses import decoder_matrix, error_summary, loss_report, mechanism_sensitivity, sensitivity_tree
from corrnoise.noise import TreeGenerator, make_generator, seed_noise
from corrnoise.participation import parse_participation
from corrnoise.sensitivity import brute_force_sensitivity
from corrnoise.strategies import OnlineTree, Tree, parse_strategy

DECODINGS = ("plain", "ls")
M, SEED, NU, CHUNK = 23, 4321, 1.3, 8


def test_node_ids_follow_the_tutorials_postorder():
    """Tutorial Sec. 2.7's 8-leaf listing: g0, g1, s01, g2, g3, s23, s03, g4, g5, s45, g6, g7, s67, s47, s07."""
    listing = [(0, 0), (1, 1), (0, 1), (2, 2), (3, 3), (2, 3), (0, 3), (4, 4), (5, 5), (4, 5), (6, 6), (7, 7),
               (6, 7), (4, 7), (0, 7)]
    for row, (first, last) in enumerate(listing):
        level = (last - first + 1).bit_length() - 1
        assert node_id(level, last) == row


@given(st.integers(1, 300))
def test_rows_and_node_ids_match_the_materialized_tree(n):
    c = tree_matrix(n)
    assert c.shape[0] == tree_rows(n)
    level, first, last = node_ids(n)
    for row in range(c.shape[0]):
        nz = np.flatnonzero(c[row])
        assert (nz[0], nz[-1]) == (first[row], last[row])
        if last[row] - first[row] + 1 == 2 ** level[row]:  # complete nodes: the closed form
            assert node_id(int(level[row]), int(last[row])) == row
    assert np.all(c.sum(axis=0) == tree_depth(n) + 1)


@given(st.integers(1, 70), st.sampled_from(DECODINGS))
def test_streamed_noise_equals_the_materialized_decoder(n, decoding):
    """The numpy operator of the strategy's NoiseStream reproduces A^{-1} B Z (reference: the
    dyadic partitions / least squares on the complete nodes) to 1e-10, non-powers of two included."""
    s = OnlineTree(n, decoding)
    c, _ = padded_nodes(n)
    ref = noising_reference(n, decoding)
    z = np.random.default_rng(n).normal(size=(s.rows, 3))
    got = run_tree_stream(s.noise_stream().operator(n), z)
    np.testing.assert_allclose(got, ref @ z, rtol=0, atol=1e-10)
    np.testing.assert_allclose(s.noising_matrix(), ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(s.noising_matrix() @ c, np.eye(n), rtol=0, atol=1e-10)  # a left inverse of C
    np.testing.assert_allclose(s.multiply(z[:n]), c @ z[:n], rtol=0, atol=1e-12)


@given(st.integers(1, 40), st.sampled_from(DECODINGS), st.sampled_from(["auto", "regenerate"]))
def test_torch_generator_equals_the_materialized_noise(n, decoding, method):
    s = OnlineTree(n, decoding)
    gen = make_generator(s, M, noise_std=NU, seed=SEED, dtype=torch.float64, chunk_size=CHUNK, method=method)
    if method == "auto":
        assert isinstance(gen, TreeGenerator)
    z = np.stack([seed_noise(SEED, tau, M, chunk_size=CHUNK).numpy() for tau in range(s.rows)])
    want = NU * noising_reference(n, decoding) @ z
    got = np.stack([gen.next_flat().numpy() for _ in range(n)])
    assert np.max(np.abs(got - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))
    with pytest.raises(CorrnoiseError) as err:
        gen.next()
    assert err.value.param == "steps"


def test_generator_memory_is_log_n_rows_and_checkpoints_resume():
    n = 37
    plain, ls = OnlineTree(n).noise_stream(), OnlineTree(n, "ls").noise_stream()
    assert plain.buffer_rows() == 0 and ls.buffer_rows() == stack_slots(n) == 6
    assert OnlineTree(10**6, "ls").noise_stream().buffer_rows() == 20
    for decoding in DECODINGS:
        s = OnlineTree(n, decoding)
        full = make_generator(s, M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
        rows = [full.next_flat() for _ in range(n)]
        half = make_generator(s, M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
        for _ in range(13):
            half.next_flat()
        resumed = make_generator(s, M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
        resumed.load_state_dict(half.state_dict())
        seeked = make_generator(s, M, seed=SEED, dtype=torch.float64, chunk_size=CHUNK)
        seeked.seek(13)
        for t in range(13, n):
            torch.testing.assert_close(resumed.next_flat(), rows[t], rtol=0, atol=0)
            torch.testing.assert_close(seeked.next_flat(), rows[t], rtol=0, atol=0)
        assert len(full._buffers()) == (decoding == "ls")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100, 1000, 2500])
@pytest.mark.parametrize("decoding", DECODINGS)
def test_closed_form_losses_equal_the_materialized_ones(n, decoding):
    """corrnoise.losses (closed forms, no matrix) vs B = A C^{-1} and C materialized."""
    s = OnlineTree(n, decoding)
    b = decoder_matrix(s)  # A @ the stream's C^{-1} on the identity
    if n <= 100:
        np.testing.assert_allclose(b, prefix_decoder(n, decoding)[1], rtol=0, atol=1e-10)
    row_sq = np.sum(b**2, axis=1)
    mean_error, max_error = error_summary(s)
    assert mean_error == pytest.approx(math.sqrt(row_sq.mean()), rel=1e-12)
    assert max_error == pytest.approx(math.sqrt(row_sq.max()), rel=1e-12)
    sens = math.sqrt(np.max(np.sum(tree_matrix(n) ** 2, axis=0)))
    report = loss_report(s)
    assert report.sensitivity == pytest.approx(sens, rel=1e-14) and report.sensitivity_exact
    assert report.rms_loss == pytest.approx(sens * math.sqrt(row_sq.mean()), rel=1e-12)
    assert report.max_loss == pytest.approx(sens * math.sqrt(row_sq.max()), rel=1e-12)


def test_least_squares_decoding_never_loses_to_plain_and_full_never_loses_to_either():
    for n in (8, 100, 1024):
        plain, ls, full = (loss_report(parse_strategy(name, n)) for name in ("tree", "tree:ls", "tree:full"))
        assert full.rms_loss <= ls.rms_loss <= plain.rms_loss
        assert ls.max_loss <= plain.max_loss


@given(st.integers(1, 13))
def test_tree_sensitivity_equals_brute_force(n):
    """Cyclic (node run lengths) and Min-Sep (Gram closed form) vs every pattern on C_tree."""
    c = tree_matrix(n)
    for b in range(1, n + 1):
        k = -(-n // b)
        for spec in (f"cyclic:{k}:{b}", f"minsep:{k}:{b}", f"minsep:{max(1, k - 1)}:{b}"):
            schema = parse_participation(spec)
            got = sensitivity_tree(n, schema)
            want = brute_force_sensitivity(c, schema, n)
            if got.exact:
                assert got.value == pytest.approx(want, rel=1e-12), spec
            else:
                assert spec.startswith("minsep") and got.value >= want * (1 - 1e-12), spec
            for strategy in (OnlineTree(n), OnlineTree(n, "ls"), Tree(n)):
                assert mechanism_sensitivity(strategy, schema) == got


def test_min_sep_level_bound_is_an_upper_bound_and_close():
    from corrnoise.linalg.tree import tree_minsep_bound_squared as _tree_level_bound_squared

    for n, b in ((13, 2), (13, 3), (64, 5), (100, 7)):
        k = -(-n // b)
        exact = sensitivity_tree(n, f"cyclic:{k}:{b}").squared  # cyclic patterns are Min-Sep patterns
        assert exact <= _tree_level_bound_squared(n, k, b) <= 1.25 * exact
        if n <= 13:
            brute = brute_force_sensitivity(tree_matrix(n), f"minsep:{k}:{b}", n) ** 2
            assert brute <= _tree_level_bound_squared(n, k, b) + 1e-9
    big = sensitivity_tree(10**6, "minsep:1000:1000")
    assert not big.exact and big.method == "tree-level-upper-bound"
    assert big.value >= sensitivity_tree(10**6, "cyclic:1000:1000").value


def test_the_first_steps_of_a_tree_are_the_smaller_tree():
    """with_n / accounting's leading_strategy: OnlineTree(n)'s first m steps read only the nodes
    of OnlineTree(m), with the same ids."""
    for decoding in DECODINGS:
        big = OnlineTree(45, decoding).noising_matrix()
        for m in (1, 7, 16, 30):
            small = OnlineTree(m, decoding).noising_matrix()
            np.testing.assert_allclose(big[:m, : small.shape[1]], small, rtol=0, atol=1e-12)
            assert not np.any(big[:m, small.shape[1]:])


def test_a_million_steps_without_a_matrix():
    """Losses, sensitivity and noise of a 10^6-step online tree from the closed forms and the
    recurrence: O(n) memory (43 bytes a step measured by tracemalloc, which counts numpy's
    buffers the same on every machine; one n x n matrix would be 8 TB), not a wall-clock limit."""
    n = 10**6
    for decoding in DECODINGS:
        s = OnlineTree(n, decoding)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            single = loss_report(s)
            cyclic = loss_report(s, "cyclic:10:100000")
            gen = make_generator(s, 16, seed=SEED)
            gen.seek(0)
            row = gen.next_flat()
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert peak <= 64 * n, f"{s.label}: {peak / n:.0f} bytes a step"
        assert single.sensitivity == pytest.approx(math.sqrt(21.0)) and cyclic.sensitivity_exact
        assert (single.sensitivity_method, cyclic.sensitivity_method) == ("tree-depth", "tree-runs")
        assert row.shape == (16,)
    with pytest.raises(CorrnoiseError) as err:
        OnlineTree(10**6).matrix()
    assert err.value.param == "n"


def test_planner_cost_counts_the_recurrences_rows():
    from corrnoise.planner.designs import _tree_cost

    for n in (2, 5, 8, 37, 1000):
        ks = [online_tree_step(t, np.ones(n.bit_length())).k for t in range(n)]
        assert _tree_cost(n, False) == pytest.approx(np.mean([2 * k + 1 for k in ks]))
        assert _tree_cost(n, True) == pytest.approx(np.mean([4 * k + 2 for k in ks]))


def test_unamplified_accounting_of_the_tree():
    from corrnoise.accounting import account
    from corrnoise.accounting.batching import NoBatching
    from corrnoise.accounting.gaussian import gaussian_epsilon

    n, nu = 12, 3.0
    for spec in ("single", "cyclic:3:4", "minsep:3:4"):
        want = gaussian_epsilon(1e-5, brute_force_sensitivity(tree_matrix(n), spec, n) / nu)
        for name in ("tree", "tree:ls"):
            res = account(parse_strategy(name, n), NoBatching(spec), noise_std=nu, delta=1e-5)
            assert res.epsilon == pytest.approx(want, rel=1e-9)
    res = account(parse_strategy("tree", 10**6), NoBatching("cyclic:10:100000"), noise_std=20.0, delta=1e-6)
    assert res.epsilon == pytest.approx(gaussian_epsilon(1e-6, sensitivity_tree(10**6, "cyclic:10:100000").value / 20.0))


def test_names_and_files(tmp_path):
    from corrnoise.strategies import load_mechanism, save_mechanism

    assert parse_strategy("tree", 9).label == "tree" and parse_strategy("tree:ls", 9).label == "tree:ls"
    assert isinstance(parse_strategy("tree:full", 9), Tree)
    for name in ("tree", "tree:ls", "tree:full"):
        s = parse_strategy(name, 9)
        back = load_mechanism(save_mechanism(s, tmp_path / f"{name.replace(':', '_')}.json"))
        assert back.label == s.label
        np.testing.assert_array_equal(back.noising_matrix(), s.noising_matrix())
    with pytest.raises(CorrnoiseError) as err:
        OnlineTree(9, "nope")
    assert err.value.param == "decoding"


class _ZeroGradient(torch.nn.Module):
    """Every per-example gradient is exactly 0, so the released update is the noise alone."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 8, bias=False)

    def forward(self, x):
        return self.lin(torch.zeros_like(x))


def _released_noise(mechanism, **kw):
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.torch.front import make_private

    torch.manual_seed(0)
    model = _ZeroGradient().double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.randn(24, 5, dtype=torch.float64), torch.zeros(24))
    model, opt, loader = make_private(model, opt, DataLoader(data, batch_size=4), mechanism=mechanism,
                                      batching="cyclic", delta=1e-5, max_grad_norm=0.5, noise_seed=99, **kw)
    w = [model.lin.weight.detach().clone().reshape(-1)]
    for _ in range(2):
        for x, _ in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            w.append(model.lin.weight.detach().clone().reshape(-1))
    released = -(torch.stack(w[1:]) - torch.stack(w[:-1])).numpy()  # lr = 1: the noised mean gradient
    return opt, released / (opt.noise_std * 0.5 / opt.expected_batch_size)  # -> (C^{-1} Z)[t]


@pytest.mark.parametrize("mechanism,kw", [
    ("tree", dict(epsilon=4.0, epochs=2)),  # the planner's tree family (plain or ls, its choice)
    ("tree:plain", dict(noise_multiplier=1.0, steps=12)),
])
def test_make_private_trains_with_the_tree_and_releases_its_materialized_noise(mechanism, kw):
    opt, noise = _released_noise(mechanism, **kw)
    n = 12  # 24 examples, batches of 4, 2 epochs
    s = opt.strategy
    assert isinstance(s, OnlineTree) and s.n == n and noise.shape == (n, 40)
    z = np.stack([seed_noise(99, tau, 40).numpy() for tau in range(s.rows)])
    want = noising_reference(n, s.decoding) @ z
    np.testing.assert_allclose(noise, want, rtol=0, atol=1e-9 * np.max(np.abs(want)))
    spent = opt.privacy_spent()
    assert spent.kind == "guarantee"
    mu = sensitivity_tree(n, "cyclic:2:6").value / opt.noise_std  # unamplified, cyclic participation
    from corrnoise.accounting.gaussian import gaussian_epsilon

    assert spent.epsilon == pytest.approx(gaussian_epsilon(1e-5, mu), rel=1e-9)
    if "epsilon" in kw:
        assert spent.epsilon <= kw["epsilon"]


@pytest.mark.parametrize("n", [5, 8, 12, 33])
def test_full_least_squares_noise_reads_every_node_every_step(n):
    """Why tree:full does not stream (strategies/tree.py): every row of pinv(C) is dense, so
    step t needs all 2n - 1 node rows of Z, against at most ceil(log2 n) + 1 for the online tree."""
    dense = np.count_nonzero(np.abs(Tree(n).noising_matrix()) > 1e-12, axis=1)
    assert np.all(dense == tree_rows(n))
    for decoding in DECODINGS:
        sparse = np.count_nonzero(OnlineTree(n, decoding).noising_matrix(), axis=1)
        if decoding == "plain":
            assert sparse.max() <= tree_depth(n) + 1
