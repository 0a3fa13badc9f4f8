"""Issue #27 item 6: AdamW that knows the noise (NoiseAwareAdamW) and the variance of the released noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.errors import CorrnoiseError
from corrnoise.runplan.mechanism import parse_mechanism
from corrnoise.torch import NoiseAwareAdamW, Privatizer, make_private, released_noise_variance
from corrnoise.torch.noise_aware import ema_noise_sd
from corrnoise.torch.noise_aware import noise_row_norms_squared

N_STEPS = 6
MECHANISMS = ["identity", "bsr:3", "blt:0.3,0.1:0.9,0.5", "dpcgd:0.9"]


@pytest.mark.parametrize("name", MECHANISMS)
def test_row_norms_are_those_of_the_inverse_of_c(name):
    """||C^{-1}[t, :]||^2 (Toeplitz C: from the first column of C^{-1}) against numpy's inverse of C."""
    strategy = parse_mechanism(name, 8)
    inverse = np.linalg.inv(strategy.matrix())
    np.testing.assert_allclose(noise_row_norms_squared(strategy), np.sum(inverse ** 2, axis=1), rtol=1e-10)


@pytest.mark.parametrize("name", ["identity", "bsr:3", "blt:0.3,0.1:0.9,0.5", "tree"])
def test_released_noise_variance_is_the_empirical_variance_of_the_released_noise(name):
    """The privatizer's actual release of a zero gradient sum, over 40 noise seeds x 5000 coordinates
    (N = 200000 draws per step): the sample variance of each step's noise is within 6 standard errors
    (a sample variance has relative standard error sqrt(2 / N) = 0.32%) of the formula."""
    strategy = parse_mechanism(name, N_STEPS)
    nu, zeta, batch = 1.3, 0.7, 16.0
    m, seeds = 5000, 40
    released = np.zeros((seeds, N_STEPS, m))
    for s in range(seeds):
        priv = Privatizer.for_parameters(strategy, [torch.zeros(m, dtype=torch.float64)], noise_std=nu,
                                         clip_norm=zeta, expected_batch_size=batch, seed=1000 + s)
        for t in range(N_STEPS):
            released[s, t] = priv.privatize([torch.zeros(m, dtype=torch.float64)])[0].numpy()
    empirical = released.transpose(1, 0, 2).reshape(N_STEPS, -1).var(axis=1)
    norms = noise_row_norms_squared(strategy)
    formula = np.array([released_noise_variance(norms[t], nu, zeta, batch) for t in range(N_STEPS)])
    rtol = 6 * math.sqrt(2 / (seeds * m))
    np.testing.assert_allclose(empirical, formula, rtol=rtol)
    if name != "identity":  # the correlated mechanisms' variance changes with t by far more than the tolerance
        assert formula.max() / formula.min() > 1 + 10 * rtol
    else:
        np.testing.assert_allclose(formula, zeta ** 2 * nu ** 2 / batch ** 2, rtol=1e-15)


def _grads(steps, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) * (1 + k % 3) for k in range(steps)]


@pytest.mark.parametrize("observe", [False, True], ids=["never_told", "told_zero"])
def test_without_noise_it_is_adamw(observe):
    """Noise variance 0: the same parameters as torch.optim.AdamW (float64; the two compute
    sqrt(v / bc2) and sqrt(v) / sqrt(bc2), which differ by rounding only: 1e-12 relative)."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(7, 5, dtype=torch.float64))
    b = nn.Parameter(a.detach().clone())
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    ours, ref = NoiseAwareAdamW([a], **kw), torch.optim.AdamW([b], **kw)
    for g in _grads(25, a.shape, 1):
        if observe:
            ours.observe_noise_variance(0.0)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    a, b = a.detach(), b.detach()
    assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())


def test_the_noise_variance_is_taken_out_of_the_second_moment():
    """Gradients 2 + noise of variance 1 on 2000 coordinates for 400 steps (beta2 = 0.99): Adam's
    v_hat estimates E[g^2] = 4 + 1, the corrected moment 4. Its spread per coordinate is ~0.3
    (sqrt((1 - beta2) / 2 * Var(g^2)), Var(g^2) = 18), so the mean over coordinates has standard error ~0.007
    (the test allows 0.05, 7 of them), and no coordinate reaches the floor."""
    g = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.zeros(2000, dtype=torch.float64))
    opt = NoiseAwareAdamW([p], lr=0.0, betas=(0.9, 0.99), weight_decay=0.0)
    for _ in range(400):
        opt.observe_noise_variance(1.0)
        p.grad = 2.0 + torch.randn(p.shape, generator=g, dtype=torch.float64)
        opt.step()
    corrected = opt.corrected_second_moment(p)
    raw = opt.state[p]["exp_avg_sq"] / (1 - 0.99 ** 400)
    assert abs(float(corrected.mean()) - 4.0) < 0.05
    assert abs(float(raw.mean()) - 5.0) < 0.05
    assert float(corrected.min()) > 1.0


def test_a_noise_only_coordinate_is_floored():
    p = nn.Parameter(torch.zeros(1000, dtype=torch.float64))
    opt = NoiseAwareAdamW([p], lr=0.0, betas=(0.9, 0.99), weight_decay=0.0, variance_floor=1e-3, floor_z=0.0)
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        opt.observe_noise_variance(1.0)
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)  # all noise
        opt.step()
    corrected = opt.corrected_second_moment(p)
    assert float(corrected.min()) == pytest.approx(1e-3, rel=1e-12)  # v_hat - 1 < 0 somewhere: the floor
    assert bool((corrected >= 1e-3).all())


@pytest.mark.parametrize("step", [1, 10, 300])
def test_ema_noise_sd_is_the_spread_of_a_noise_only_second_moment(step):
    """ema_noise_sd against simulation: 40,000 coordinates of pure N(0, 2.5) gradients, beta2 0.99;
    the empirical standard deviation of v_hat at the step (standard error ~0.4-1.3%, allowed 5%)."""
    g = torch.Generator().manual_seed(step)
    p = nn.Parameter(torch.zeros(40_000, dtype=torch.float64))
    opt = NoiseAwareAdamW([p], lr=0.0, betas=(0.9, 0.99), weight_decay=0.0)
    for _ in range(step):
        p.grad = 2.5 ** 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64)
        opt.step()
    v_hat = opt.state[p]["exp_avg_sq"] / (1 - 0.99 ** step)
    assert float(v_hat.std()) == pytest.approx(ema_noise_sd(2.5, 0.99, step), rel=0.05)
    assert ema_noise_sd(2.5, 0.99, 1) == pytest.approx(2.5 * 2 ** 0.5, rel=1e-12)


def test_the_default_floor_keeps_noise_only_steps_within_a_few_adamw_steps():
    """All noise (variance 1), beta2 0.999, 3000 steps: the corrected moment never falls below
    floor_z = 2 standard deviations of the noise-only EMA, so a noise-only coordinate's denominator
    is at least sqrt(2 * ema_noise_sd) (about 0.25 of AdamW's sqrt(phi)), where a fixed 1e-10
    floor lets it fall to 1e-5 on a share of the coordinates."""
    g = torch.Generator().manual_seed(5)
    p = nn.Parameter(torch.zeros(2000, dtype=torch.float64))
    ours = NoiseAwareAdamW([p], lr=0.0, weight_decay=0.0)
    fixed = NoiseAwareAdamW([q := nn.Parameter(p.detach().clone())], lr=0.0, weight_decay=0.0, floor_z=0.0)
    for _ in range(3000):
        grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        for opt, par in ((ours, p), (fixed, q)):
            opt.observe_noise_variance(1.0)
            par.grad = grad.clone()
            opt.step()
    floor = 2.0 * ema_noise_sd(1.0, 0.999, 3000)
    assert 0.05 < floor < 0.1
    assert float(ours.corrected_second_moment(p).min()) == pytest.approx(floor, rel=1e-12)
    assert float(fixed.corrected_second_moment(q).min()) == pytest.approx(1e-10, rel=1e-12)


def test_bad_options_name_the_parameter():
    p = nn.Parameter(torch.zeros(2))
    for kw, name in [(dict(variance_floor=0.0), "variance_floor"), (dict(betas=(0.9, 1.0)), "betas"),
                     (dict(lr=-1.0), "lr"), (dict(floor_z=-1.0), "floor_z")]:
        with pytest.raises(CorrnoiseError) as err:
            NoiseAwareAdamW([p], **kw)
        assert err.value.param == name and "\n" not in str(err.value)
    with pytest.raises(CorrnoiseError) as err:
        NoiseAwareAdamW([p]).observe_noise_variance(-1.0)
    assert err.value.param == "variance"
    for kw, name in [(dict(step=0), "step"), (dict(beta2=1.0), "beta2"), (dict(noise_variance=-1.0), "noise_variance")]:
        with pytest.raises(CorrnoiseError) as err:
            ema_noise_sd(**{**dict(noise_variance=1.0, beta2=0.99, step=3), **kw})
        assert err.value.param == name and "\n" not in str(err.value)


def test_make_private_tells_the_optimizer_each_steps_variance():
    """The private optimizer passes Var_t of the row it adds (bsr: it changes with t) before each update."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    model = nn.Linear(4, 2)
    opt = NoiseAwareAdamW(model.parameters(), lr=0.01)
    seen = []
    observe = opt.observe_noise_variance
    opt.observe_noise_variance = lambda v: (seen.append(v), observe(v))[1]
    model, private, loader = make_private(model, opt, DataLoader(data, batch_size=8), mechanism="bsr:3",
                                          batching="cyclic", delta=1e-5, max_grad_norm=0.5, noise_multiplier=1.2,
                                          steps=5, noise_seed=0)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        private.step()
        private.zero_grad()
    strategy = private.strategy
    rows = np.sum(strategy.noising_matrix() ** 2, axis=1)
    expected = [0.5 ** 2 * private.noise_std ** 2 * rows[t] / 8.0 ** 2 for t in range(5)]
    np.testing.assert_allclose(seen, expected, rtol=1e-12)
    assert len(set(np.round(seen, 12))) > 1
