"""The PyTorch entry point: per-example clipping, the privatizer, the optimizer wrapper,
make_private's agreement checks, and the Opacus adapter (skipped without opacus)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from corrnoise.accounting import account
from corrnoise.errors import CorrnoiseError
from corrnoise.noise import make_generator, seed_noise
from corrnoise.sampling import BlockCyclicPoissonSampler, CyclicSampler, PoissonSampler
from corrnoise.strategies import BLT, Identity, parse_strategy
from corrnoise.torch import (
    Privatizer,
    check_agreement,
    clip_and_sum,
    clipped_gradient_sum,
    make_private,
    per_example_gradients,
)

F = torch.nn.functional


def _mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).to(dtype)


def _batch(b=7, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g, dtype=dtype) * 3, torch.randint(0, 3, (b,), generator=g)


def _loop_grads(model, x, y):
    """Per-example gradients by a loop of single-example backward passes (the reference)."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad()
    return out


# --- per-example gradients and clipping --------------------------------------------------------
def test_per_example_gradients_equal_single_example_backward():
    model = _mlp()
    x, y = _batch()
    grads, losses = per_example_gradients(model, F.cross_entropy, x, y)
    ref = _loop_grads(model, x, y)
    for j, g in enumerate(grads.values()):
        for i in range(x.shape[0]):
            torch.testing.assert_close(g[i], ref[i][j], rtol=1e-12, atol=1e-12)
    want = torch.stack([F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]) for i in range(x.shape[0])]).detach()
    torch.testing.assert_close(losses, want)


@pytest.mark.parametrize("clip_norm", [0.05, 0.5, 100.0])
def test_clipped_sum_equals_loop_of_clipped_gradients(clip_norm):
    model = _mlp()
    x, y = _batch()
    ref = _loop_grads(model, x, y)
    want = [torch.zeros_like(p) for p in model.parameters()]
    for gi in ref:
        norm = math.sqrt(sum(float((g**2).sum()) for g in gi))
        scale = min(1.0, clip_norm / norm)
        for w, g in zip(want, gi):
            w += scale * g
    sums, stats = clipped_gradient_sum(model, F.cross_entropy, x, y, clip_norm)
    for s, w in zip(sums, want):
        torch.testing.assert_close(s, w, rtol=1e-12, atol=1e-12)
    assert stats["count"] == 7
    # the clipped sum of n examples never exceeds n * clip_norm (sensitivity one clip norm each)
    total = math.sqrt(sum(float((s**2).sum()) for s in sums))
    assert total <= 7 * clip_norm * (1 + 1e-12)
    norms = [math.sqrt(sum(float((g**2).sum()) for g in gi)) for gi in ref]
    assert stats["clipped_fraction"] == pytest.approx(np.mean([v > clip_norm for v in norms]))


def test_padding_weights_equal_dropping_the_examples():
    model = _mlp()
    x, y = _batch(6)
    w = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    keep = w > 0
    a, _ = clipped_gradient_sum(model, F.cross_entropy, x, y, 0.3, weights=w)
    b, _ = clipped_gradient_sum(model, F.cross_entropy, x[keep], y[keep], 0.3)
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t)
    with pytest.raises(CorrnoiseError, match="^weights"):
        clip_and_sum([torch.ones(2, 3)], 1.0, weights=torch.tensor([1.0, 2.0]))


def test_empty_batch_sums_to_zero():
    model = _mlp()
    sums, stats = clipped_gradient_sum(model, F.cross_entropy, torch.zeros(0, 5, dtype=torch.float64),
                                       torch.zeros(0, dtype=torch.long), 1.0)
    assert stats["count"] == 0 and all(float(s.abs().sum()) == 0.0 for s in sums)


# --- privatizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bsr:3", "blt", "toeplitz-sqrt", "identity"])
def test_privatizer_noise_is_generator_noise_scaled(name):
    n, seed, nu, clip, B = 6, 99, 1.7, 0.25, 12.5
    strategy = BLT([0.4, 0.2], [0.9, 0.5], n) if name == "blt" else parse_strategy(name, n)
    shapes = [(3, 2), (4,)]
    params = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    priv = Privatizer.for_parameters(strategy, params, noise_std=nu, clip_norm=clip, expected_batch_size=B, seed=seed)
    # independent reference: materialized C^{-1} times the seed noise rows Z[t] (m = 10)
    z = np.stack([seed_noise(seed, t, 10).numpy() for t in range(n)])
    noise = strategy.noising_matrix()[:n, :n] @ z
    sums = [torch.full(s, 2.0, dtype=torch.float64) for s in shapes]
    for t in range(n):
        out = priv.privatize(sums)
        flat = torch.cat([o.reshape(-1) for o in out]).numpy()
        np.testing.assert_allclose(flat, (2.0 + clip * nu * noise[t]) / B, rtol=1e-10, atol=1e-12)
    with pytest.raises(CorrnoiseError, match="^steps"):
        priv.privatize(sums)  # the mechanism has n rows


def test_privatizer_state_dict_resumes_the_same_noise():
    strategy = parse_strategy("bsr:3", 8)
    params = [torch.zeros(5)]
    a = Privatizer.for_parameters(strategy, params, noise_std=1.0, clip_norm=1.0, expected_batch_size=1, seed=5)
    for _ in range(3):
        a.privatize([torch.zeros(5)])
    state = a.state_dict()
    b = Privatizer.for_parameters(strategy, params, noise_std=1.0, clip_norm=1.0, expected_batch_size=1, seed=5)
    b.load_state_dict(state)
    torch.testing.assert_close(a.privatize([torch.zeros(5)]), b.privatize([torch.zeros(5)]))


# --- the optimizer wrapper ----------------------------------------------------------------------
def _dataset(n=40, dtype=torch.float64):
    x, y = _batch(n, seed=3, dtype=dtype)
    return torch.utils.data.TensorDataset(x, y)


def test_sgd_step_is_theta_minus_lr_times_privatized_gradient():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    ds = _dataset()
    sampler = CyclicSampler(40, 8, steps=5, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = make_private(model, opt, F.cross_entropy, ds, mechanism="bsr:2", noise_std=0.7, delta=1e-5,
                           sampler=sampler, clip_norm=0.5, seed=11, noise_seed=11)
    x, y = next(iter(private.data_loader))
    private.step(x, y)
    # reference: loop of clipped single-example gradients + the generator's first noise row
    ref = _loop_grads(_mlp(), x, y)
    sums = [torch.zeros_like(p) for p in before]
    for gi in ref:
        scale = min(1.0, 0.5 / math.sqrt(sum(float((g**2).sum()) for g in gi)))
        for s, g in zip(sums, gi):
            s += scale * g
    noise = make_generator(parse_strategy("bsr:2", 5), [p.shape for p in before], noise_std=0.7, seed=11,
                           dtype=torch.float64).next()
    for p, b, s, z in zip(model.parameters(), before, sums, noise):
        torch.testing.assert_close(p.detach(), b - 0.1 * (s + 0.5 * z) / 8.0)
    assert private.steps_taken == 1


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
])
def test_make_private_three_lines_and_spent_epsilon(make_opt):
    model = _mlp()
    private = make_private(model, make_opt(model.parameters()), F.cross_entropy, _dataset(), mechanism="identity",
                           epsilon=4.0, delta=1e-5, batch_size=10, steps=6, seed=0,
                           accounting_options={"discretization": 1e-3})
    for x, y in private.data_loader:
        private.step(x, y)
    spent = private.privacy_spent()
    assert private.steps_taken == 6 and isinstance(private.sampler, PoissonSampler)
    assert spent.epsilon <= 4.0 and spent.epsilon > 3.9  # calibrated for exactly these steps
    half = private.privacy_spent(steps=3)
    assert 0.0 < half.epsilon < spent.epsilon
    assert private.privacy_spent(steps=0).epsilon == 0.0
    with pytest.raises(CorrnoiseError, match="^steps"):
        private.step(*next(iter(private.data_loader)))


def test_block_cyclic_sampler_chosen_for_banded_mechanism():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    private = make_private(model, opt, F.cross_entropy, _dataset(), mechanism="bsr:2", noise_multiplier=1.0,
                           delta=1e-5, batch_size=5, steps=8, seed=0)
    assert isinstance(private.sampler, BlockCyclicPoissonSampler) and private.sampler.blocks == 2
    assert private.batching.spec.startswith("block-cyclic:2:")
    for x, y in private.data_loader:
        private.step(x, y)
    want = account(parse_strategy("bsr:2", 8), private.batching, delta=1e-5, noise_std=private.noise_std)
    assert private.privacy_spent().epsilon == pytest.approx(want.epsilon, rel=1e-12)


# --- agreement of sampler, mechanism and accounting ---------------------------------------------
def _one_line(exc_info, param):
    msg = str(exc_info.value)
    assert exc_info.value.param == param and "\n" not in msg and msg.startswith(param + ":")


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


def test_make_private_errors_name_the_parameter():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CorrnoiseError) as e:
        make_private(model, opt, F.cross_entropy, _dataset(), mechanism="identity", delta=1e-5, batch_size=10, steps=3)
    _one_line(e, "epsilon")
    with pytest.raises(CorrnoiseError) as e:
        make_private(model, opt, F.cross_entropy, _dataset(), mechanism=Identity(3), noise_std=1.0, delta=1e-5,
                     batch_size=10, steps=4)
    _one_line(e, "steps")
    other = torch.nn.Linear(2, 2)
    with pytest.raises(CorrnoiseError) as e:
        make_private(model, torch.optim.SGD(other.parameters(), lr=0.1), F.cross_entropy, _dataset(),
                     mechanism="identity", noise_std=1.0, delta=1e-5, batch_size=10, steps=3)
    _one_line(e, "optimizer")


# --- Opacus adapter ------------------------------------------------------------------------------
def test_opacus_missing_is_one_line(monkeypatch):
    from corrnoise.torch.opacus_adapter import require_opacus

    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(CorrnoiseError) as e:
        require_opacus()
    _one_line(e, "opacus")


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_opacus_per_sample_gradients_equal_ours():
    opacus = pytest.importorskip("opacus")
    model = _mlp()
    x, y = _batch()
    ours, _ = per_example_gradients(_mlp(), F.cross_entropy, x, y)  # same weights, no Opacus hooks
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    for p, g in zip(model.parameters(), ours.values()):
        torch.testing.assert_close(p.grad_sample, g, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_opacus_adapter_adds_our_correlated_noise():
    pytest.importorskip("opacus")
    from corrnoise.torch.opacus_adapter import make_private_opacus

    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    run = make_private_opacus(model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(), mechanism="bsr:2",
                              noise_std=0.9, delta=1e-5, sampler=CyclicSampler(40, 8, steps=5, seed=0),
                              max_grad_norm=0.5, seed=21, noise_seed=21)
    noise_gen = make_generator(parse_strategy("bsr:2", 5), [p.shape for p in before], noise_std=0.9, seed=21,
                               dtype=torch.float64)
    ref_model = _mlp()
    for step, (x, y) in enumerate(run.data_loader):
        if step == 2:
            break
        sums, _ = clipped_gradient_sum(ref_model, F.cross_entropy, x, y, 0.5)
        noise = noise_gen.next()
        want = [(s + 0.5 * z) / 8.0 for s, z in zip(sums, noise)]
        run.optimizer.zero_grad()
        F.cross_entropy(run.module(x), y).backward()
        run.optimizer.step()
        for p, w in zip(model.parameters(), want):
            # Opacus clips with max_grad_norm / (norm + 1e-6): a relative difference of ~1e-6
            torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            for rp, w in zip(ref_model.parameters(), want):
                rp -= 0.1 * w
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), rp.detach(), rtol=1e-5, atol=1e-7)
    assert run.steps_taken == 2
    assert run.privacy_spent().epsilon > 0


def test_unamplified_run_shorter_than_the_mechanism_accounts_its_leading_block():
    model = _mlp()
    sampler = CyclicSampler(40, 8, steps=10, seed=0)  # 2 epochs of 5 batches: cyclic:2:5
    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _dataset(),
                           mechanism=parse_strategy("toeplitz-sqrt", 30), epsilon=2.0, delta=1e-5, sampler=sampler)
    for x, y in private.data_loader:
        private.step(x, y)
    from corrnoise.accounting import parse_batching

    want = account(parse_strategy("toeplitz-sqrt", 10), parse_batching("none", "cyclic:2:5"), delta=1e-5,
                   noise_std=private.noise_std)
    spent = private.privacy_spent()
    assert spent.epsilon == pytest.approx(want.epsilon, rel=1e-12) and spent.epsilon <= 2.0
    assert spent.epsilon == pytest.approx(2.0, rel=1e-6)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("backward_on_empty", [False, True])
def test_opacus_adapter_empty_poisson_batches_still_use_their_noise_row(backward_on_empty):
    pytest.importorskip("opacus")
    from corrnoise.torch.opacus_adapter import make_private_opacus

    model = _mlp()
    sampler = PoissonSampler(40, 0.02, 12, seed=1)
    empty = sum(1 for b in sampler if not b)
    assert empty > 0
    run = make_private_opacus(model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(), mechanism="identity",
                              noise_std=1.0, delta=1e-5, sampler=sampler, seed=0,
                              accounting_options={"discretization": 1e-3})
    for x, y in run.data_loader:
        run.optimizer.zero_grad()
        if len(x) or backward_on_empty:
            F.cross_entropy(run.module(x), y).backward()
        run.optimizer.step()
    assert run.steps_taken == 12
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_fixed_size_balls_in_bins_batches_pad_with_zero_weight():
    from corrnoise.sampling import BallsInBinsSampler

    model = _mlp()
    sampler = BallsInBinsSampler(40, 5, 10, batch_size=8, seed=4)  # bins of ~8: some padded, some truncated
    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), F.cross_entropy, _dataset(),
                           mechanism="identity", noise_std=1e-300, delta=1e-5, sampler=sampler, clip_norm=0.5)
    assert private.batching.spec == "balls-in-bins:5"
    x_all, y_all = _dataset().tensors
    padded_seen = 0
    for t, ((x, y), w) in enumerate(private.data_loader):
        assert x.shape[0] == 8  # always exactly B entries
        real = [i for i in sampler.batch(t) if i < 40]
        padded_seen += int((w == 0).sum())
        assert int((w > 0).sum()) == len(real)
        private.step(x, y, weights=w)
        got = [p.grad for p in model.parameters()]  # (sum over real examples + ~0 noise) / B
        want, _ = clipped_gradient_sum(_mlp(), F.cross_entropy, x_all[real], y_all[real], 0.5)
        for g, s in zip(got, want):
            torch.testing.assert_close(g, s / 8.0)
    assert padded_seen == sampler.padding_report()["padded"] > 0


def test_noise_seed_is_secret_unless_given():
    """The sampler seed must not fix the noise: whoever knows the noise seed can subtract it."""
    runs = []
    for _ in range(2):
        model = _mlp()
        runs.append(make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _dataset(),
                                 mechanism="identity", noise_std=1.0, delta=1e-5, batch_size=10, steps=3, seed=5))
    seeds = [r.privatizer.generator.seed for r in runs]
    assert seeds[0] != seeds[1] and 5 not in seeds
    model = _mlp()
    fixed = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _dataset(),
                         mechanism="identity", noise_std=1.0, delta=1e-5, batch_size=10, steps=3, seed=5, noise_seed=9)
    assert fixed.privatizer.generator.seed == 9
