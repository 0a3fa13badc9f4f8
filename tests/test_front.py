"""The PyTorch front door: make_private(module, optimizer, data_loader) on the user's own loop."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.accounting import account
from corrnoise.errors import CorrnoiseError
from corrnoise.torch.front import DPOptimizer, make_private


def _data(n=64, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def _mlp(d=8, classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, classes))


def _one_step(model, opt, loader):
    """One private step on the loader's first batch."""
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# a fixed sampler seed keeps this small learning check deterministic (random batches fail it ~1 in 6);
# make_private warns that a real run must leave it secret
@pytest.mark.filterwarnings("ignore:a given seed fixes the block-cyclic sampler:UserWarning")
def test_tutorial_loop_needs_one_added_statement_and_trains():
    train_set = _data(256)
    model = _mlp()
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    # the one added statement:
    model, optimizer, loader = make_private(model, optimizer, loader, epsilon=50.0, delta=1e-5, epochs=4,
                                            max_grad_norm=1.0, mechanism="bsr:4", noise_seed=1, seed=1)
    losses = []
    for _ in range(4):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.steps_taken == optimizer.steps
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    spent = optimizer.privacy_spent()
    assert spent.epsilon <= 50.0


def test_step_lr_scheduler_drives_the_wrapped_optimizer():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt, loader = make_private(model, opt, DataLoader(_data(64), batch_size=8), noise_multiplier=1.0,
                                      delta=1e-5, steps=4, max_grad_norm=1.0, mechanism="identity",
                                      batching="cyclic", noise_seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.original.param_groups[0]["lr"] == pytest.approx(1.0 / 16)


def test_stepping_the_optimizer_given_to_make_private_is_refused_while_the_run_lasts():
    """The optimizer given to make_private stepped directly would apply the first batch's raw
    gradients (backward leaves them in .grad): refused in one line, the weights unchanged. A
    scheduler made on it before make_private still works (it wraps its step, which the private
    optimizer calls); a second make_private with the same optimizer takes it over; after the run the
    optimizer is a plain one again."""
    model = _mlp()
    raw = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
    model, opt, loader = make_private(model, raw, DataLoader(_data(32), batch_size=8), noise_multiplier=1.0,
                                      delta=1e-5, steps=4, max_grad_norm=1.0, mechanism="identity",
                                      batching="cyclic")
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CorrnoiseError, match="^optimizer: the optimizer given to make_private was stepped directly.*"
                       "step the optimizer make_private returned") as e:
        raw.step()
    assert "\n" not in str(e.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()  # the private step goes through it
    opt.zero_grad()
    sched.step()
    assert raw.param_groups[0]["lr"] == 0.5 and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.warns(RuntimeWarning, match="already had a clipping engine"):
        model, opt, loader = make_private(model, raw, DataLoader(_data(32), batch_size=8), noise_multiplier=1.0,
                                          delta=1e-5, steps=4, max_grad_norm=1.0, mechanism="identity",
                                          batching="cyclic")
    for x, y in loader:  # the first optimizer's refusal does not stand in the second's way
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert opt.steps_taken == 4
    nn.functional.cross_entropy(model(x), y).backward()
    raw.step()  # the run is over: a plain optimizer


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, batch):
        return self.a(batch["x"]) + self.b(batch["z"])


class _DictSet(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(3)
        self.x, self.z = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "z": self.z[i], "label": self.y[i]}


def test_model_taking_a_dict_batch_trains():
    model = _DictModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = make_private(model, opt, DataLoader(_DictSet(), batch_size=8), noise_multiplier=0.5,
                                      delta=1e-5, epochs=1, max_grad_norm=1.0, mechanism="dpcgd:0.5",
                                      batching="cyclic", noise_seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    for batch in loader:
        nn.functional.cross_entropy(model(batch), batch["label"]).backward()
        opt.step()
        opt.zero_grad()
    assert opt.steps_taken == 5
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_add_param_group_is_refused():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt, _ = make_private(model, opt, DataLoader(_data(32), batch_size=8), noise_multiplier=1.0, delta=1e-5,
                             steps=2, max_grad_norm=1.0, mechanism="identity", batching="cyclic")
    with pytest.raises(CorrnoiseError, match="param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


# ----------------------------------------------------------------------------------------------
# Noise audit: with zero gradients the released updates are exactly the accounted noise
# ----------------------------------------------------------------------------------------------
class _ZeroGradient(nn.Module):
    """A Linear layer fed zeros: every per-example gradient is exactly 0."""

    def __init__(self, d_in=50, d_out=400):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        return self.lin(torch.zeros_like(x))


@pytest.mark.parametrize("mechanism", ["bsr:4", "dpcgd:0.8"])
def test_noise_audit_covariance_is_the_accounted_noise(mechanism):
    from corrnoise.strategies import parse_strategy

    n_ex, batch, steps, clip = 40, 4, 10, 0.5
    model = _ZeroGradient().double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.randn(n_ex, 50, dtype=torch.float64), torch.zeros(n_ex))
    model, opt, loader = make_private(model, opt, DataLoader(data, batch_size=batch), noise_multiplier=1.3,
                                      delta=1e-5, steps=steps, max_grad_norm=clip, mechanism=mechanism,
                                      batching="cyclic")
    w = [model.lin.weight.detach().clone().reshape(-1)]
    for x, _ in loader:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        w.append(model.lin.weight.detach().clone().reshape(-1))
    released = -(torch.stack(w[1:]) - torch.stack(w[:-1])).numpy()  # (steps, m): g_hat_t = noise
    strategy = parse_strategy(mechanism, steps)
    scale = opt.noise_std * clip / opt.expected_batch_size
    whitened = strategy.matrix()[:steps, :steps] @ released / scale  # C (s C^-1 Z) / s = Z
    m = whitened.shape[1]
    # every row ~ N(0, 1) i.i.d.: variance 1 within 6 standard errors, rows uncorrelated
    var = (whitened ** 2).mean(axis=1)
    assert np.all(np.abs(var - 1.0) < 6 * np.sqrt(2.0 / m))
    corr = np.corrcoef(whitened)
    off = corr[~np.eye(steps, dtype=bool)]
    assert np.max(np.abs(off)) < 6 / np.sqrt(m)
    # privacy_spent is the accounting of exactly this noise
    spent = opt.privacy_spent()
    direct = account(strategy, opt.batching, delta=1e-5, noise_std=opt.noise_std)
    assert spent.epsilon == pytest.approx(direct.epsilon, rel=1e-12)


def test_noise_audit_detects_a_wrong_scale():
    """The audit's statistics are sharp enough to see a 10% error in the noise scale."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((10, 20000)) * 1.1
    var = (z ** 2).mean(axis=1)
    assert not np.all(np.abs(var - 1.0) < 6 * np.sqrt(2.0 / z.shape[1]))


# ----------------------------------------------------------------------------------------------
# Clipping bounds every example's influence
# ----------------------------------------------------------------------------------------------
def _released(first_x, first_y=None, *, noise_seed=5):
    """The released sum of clipped gradients + noise of one step on 8 examples (example 0 given)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, dtype=torch.float64, generator=gen)
    y = torch.randn(8, 2, dtype=torch.float64, generator=gen)
    x[0] = first_x
    y[0] = model.bias.detach() if first_y is None else first_y  # x = 0, y = bias: gradient exactly 0
    model, opt, loader = make_private(model, opt, DataLoader(TensorDataset(x, y), batch_size=8),
                                      noise_multiplier=1.0, delta=1e-5, steps=1, max_grad_norm=1.0,
                                      mechanism="identity", batching="cyclic", noise_seed=noise_seed, seed=0)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    for xb, yb in loader:
        nn.functional.mse_loss(model(xb), yb, reduction="sum").backward()
        opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (before - after) * opt.expected_batch_size  # the released sum (noise included)


def test_a_huge_gradient_moves_the_released_sum_by_at_most_the_clip_norm():
    """Zero-out adjacency: the same run with example 0's gradient replaced by 0."""
    huge = _released(torch.tensor([1e6, -1e6, 1e6], dtype=torch.float64), torch.tensor([3.0, -2.0]))
    zeroed = _released(torch.zeros(3, dtype=torch.float64))
    diff = float(torch.linalg.norm(huge - zeroed))
    assert diff <= 1.0 + 1e-9
    assert diff >= 1.0 - 1e-6  # the huge gradient is clipped to exactly the clip norm


# ----------------------------------------------------------------------------------------------
# Gradient accumulation and checkpoints
# ----------------------------------------------------------------------------------------------
def _run(max_physical=None, steps=3, mech="bsr:2"):
    torch.manual_seed(0)
    model = _mlp().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    data = TensorDataset(torch.randn(48, 8, dtype=torch.float64), torch.randint(0, 3, (48,)))
    model, opt, loader = make_private(model, opt, DataLoader(data, batch_size=16), noise_multiplier=1.0,
                                      delta=1e-5, steps=steps, max_grad_norm=0.7, mechanism=mech,
                                      batching="cyclic", noise_seed=11, seed=2,
                                      max_physical_batch_size=max_physical)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_micro_batches_give_the_same_update_as_one_logical_batch():
    whole, opt_whole = _run(None)
    micro, opt_micro = _run(5)
    assert opt_micro.steps_taken == opt_whole.steps_taken == 3
    for a, b in zip(whole.parameters(), micro.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_checkpoint_resumes_the_same_noise_stream_only_with_the_seed():
    full, _ = _run(None, steps=3)
    # run 1 step, checkpoint (seed not stored), resume in a fresh run with the seed passed again
    torch.manual_seed(0)
    model = _mlp().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    data = TensorDataset(torch.randn(48, 8, dtype=torch.float64), torch.randint(0, 3, (48,)))

    def build(m, o, noise_seed):
        return make_private(m, o, DataLoader(data, batch_size=16), noise_multiplier=1.0, delta=1e-5, steps=3,
                            max_grad_norm=0.7, mechanism="bsr:2", batching="cyclic", noise_seed=noise_seed, seed=2)

    model, opt, loader = build(model, opt, 11)
    _one_step(model, opt, loader)
    state = opt.state_dict()
    assert "seed" not in state["noise"]["generator"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    m2 = _mlp().double()
    m2.load_state_dict(weights)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.3, momentum=0.9)
    m2, o2, l2 = build(m2, o2, 999)
    with pytest.raises(CorrnoiseError, match="noise_seed"):
        o2.load_state_dict({**state, "noise": {**state["noise"], "generator": {**state["noise"]["generator"],
                                                                               "seed": 1}}})
    m3 = _mlp().double()
    m3.load_state_dict(weights)
    o3 = torch.optim.SGD(m3.parameters(), lr=0.3, momentum=0.9)
    m3, o3, l3 = build(m3, o3, 11)
    o3.load_state_dict(state)
    for x, y in l3:
        nn.functional.cross_entropy(m3(x), y).backward()
        o3.step()
        o3.zero_grad()
    assert o3.steps_taken == 3
    for a, b in zip(full.parameters(), m3.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_private_optimizer_is_a_torch_optimizer():
    assert issubclass(DPOptimizer, torch.optim.Optimizer)


@pytest.mark.parametrize("mechanism", ["dpcgd:0.7", "blt:0.3,0.1:0.9,0.5"])
def test_blt_and_dpcgd_train_with_balls_in_bins_and_a_verified_guarantee(mechanism):
    from corrnoise.datasets import load

    data = load("digits")
    xtr, ytr, _, _ = data.tensors()
    xtr, ytr = xtr[:400], ytr[:400]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    model, opt, loader = make_private(model, opt, DataLoader(TensorDataset(xtr, ytr), batch_size=40),
                                      epsilon=8.0, delta=1e-3, epochs=2, max_grad_norm=1.0, mechanism=mechanism)
    assert opt.batching.spec == "balls-in-bins:10"
    for _ in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert opt.steps_taken == 20
    spent = opt.privacy_spent()
    assert spent.kind == "guarantee" and spent.method == "mc"
    assert spent.epsilon <= 8.0


# ----------------------------------------------------------------------------------------------
# Model shapes: output objects, several inputs, layers that mix examples
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class _TwoInputModel(nn.Module):
    """forward(x, z, *, scale=1.0, mask=None) returning an object with ``.logits``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(2, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, z, *, scale=1.0, mask=None):
        h = torch.tanh(self.a(x) + self.b(z) * scale)
        if mask is not None:
            h = h * mask
        return _Output(logits=self.head(h), hidden=h)


def _two_input_data(n=24):
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 4, generator=g, dtype=torch.float64),
                         torch.randn(n, 2, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


@pytest.mark.parametrize("as_dict", [False, True])
def test_output_object_and_positional_keyword_inputs_give_the_clipped_sum(as_dict):
    """The engine never calls the model: outputs that are objects (a dataclass, a dict with
    logits) and several positional + keyword inputs train, and each step's update is the clipped
    per-example sum (+ ~0 noise) of a loop of single-example backward passes."""
    torch.manual_seed(0)
    model = _TwoInputModel().double()
    ref = _TwoInputModel().double()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, loader = make_private(model, opt, DataLoader(_two_input_data(), batch_size=6), noise_std=1e-300,
                                      delta=1e-5, steps=4, max_grad_norm=0.3, mechanism="identity",
                                      batching="cyclic", seed=0)

    def logits(m, x, z, mask):
        out = m(x, z, scale=0.5, mask=mask)
        return {"logits": out.logits} if as_dict else out

    for x, z, y in loader:
        mask = torch.ones(len(x), 6, dtype=torch.float64)
        out = logits(model, x, z, mask)
        nn.functional.cross_entropy(out["logits"] if as_dict else out.logits, y).backward()
        want = [torch.zeros_like(p) for p in ref.parameters()]
        for i in range(len(x)):
            ref.zero_grad()
            o = logits(ref, x[i:i + 1], z[i:i + 1], mask[i:i + 1])
            nn.functional.cross_entropy(o["logits"] if as_dict else o.logits, y[i:i + 1]).backward()
            gi = [p.grad.detach().clone() for p in ref.parameters()]
            c = min(1.0, 0.3 / float(torch.sqrt(sum((g ** 2).sum() for g in gi))))
            for w, g in zip(want, gi):
                w += c * g
        opt.step()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, w / 6.0, rtol=1e-10, atol=1e-12)
        opt.zero_grad()
        with torch.no_grad():
            for rp, p in zip(ref.parameters(), model.parameters()):
                rp.copy_(p)
    assert opt.steps_taken == 4


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.SyncBatchNorm])
def test_batch_norm_is_refused_at_make_private_naming_the_module(norm):
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(norm(16)), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CorrnoiseError) as e:
        make_private(model, opt, DataLoader(_data(32), batch_size=8), noise_multiplier=1.0, delta=1e-5, steps=2,
                     max_grad_norm=1.0, mechanism="identity", batching="cyclic")
    msg = str(e.value)
    assert e.value.param == "module" and "\n" not in msg and msg.startswith("module:")
    assert "'1.0'" in msg and norm.__name__ in msg  # the module's path and type
    assert not model[0]._forward_hooks  # nothing left attached


def test_mechanism_auto_is_the_planners_choice_for_the_pipeline():
    """make_private(mechanism="auto") asks the planner (one set of rules) for the user's pipeline
    and trains with the guarantee it calibrated; a family restricts the choice."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = make_private(model, opt, DataLoader(_data(80), batch_size=8), mechanism="auto",
                                      batching="cyclic", epsilon=8.0, delta=1e-5, epochs=2, max_grad_norm=1.0)
    assert opt.batching.spec == "none" and opt.steps == 20
    for _ in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    spent = opt.privacy_spent()
    assert spent.kind == "guarantee" and spent.epsilon <= 8.0 and spent is not None
    other = _mlp()
    with pytest.raises(CorrnoiseError, match="^mechanism: 'auto' is chosen by the planner"):
        make_private(other, torch.optim.SGD(other.parameters(), lr=0.1), DataLoader(_data(80), batch_size=8),
                     mechanism="auto", noise_multiplier=1.0, delta=1e-5, epochs=2, max_grad_norm=1.0)
    _, opt2, _ = make_private(other, torch.optim.SGD(other.parameters(), lr=0.1),
                              DataLoader(_data(80), batch_size=8), mechanism="dpsgd", batching="poisson",
                              epsilon=8.0, delta=1e-5, epochs=2, max_grad_norm=1.0)
    assert opt2.strategy.label == "identity" and opt2.batching.spec.startswith("poisson:")


def test_step_without_a_captured_backward_is_refused():
    """zero_grad() between backward() and step() would release pure noise for a real batch: refused."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = make_private(model, opt, DataLoader(_data(32), batch_size=8), noise_multiplier=1.0,
                                      delta=1e-5, steps=2, max_grad_norm=1.0, mechanism="identity",
                                      batching="cyclic")
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.zero_grad()
    with pytest.raises(CorrnoiseError, match="^optimizer: step\\(\\) found no backward pass"):
        opt.step()


# ----------------------------------------------------------------------------------------------
# Resuming a Monte Carlo calibration; what is trainable; argument checks; the Opacus default
# ----------------------------------------------------------------------------------------------
def _bib_run(epsilon=6.0, delta=1e-3, seed=1):
    """A balls-in-bins run calibrated by Monte Carlo. The calibration and verification seeds are
    fixed so that whether the verification passes does not depend on the OS's entropy (with fresh
    seeds it failed now and then, by design: a failed verification releases nothing)."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    return make_private(model, opt, DataLoader(_data(40), batch_size=8), mechanism="dpcgd:0.7",
                        batching="balls-in-bins", epsilon=epsilon, delta=delta, epochs=2, max_grad_norm=1.0,
                        accounting_options={"seed": seed, "verify_seed": 1000 + seed},
                        noise_seed=7)  # the sampler seed: secret, from the OS; a resumed run adopts the checkpoint's


def test_balls_in_bins_run_resumes_with_the_checkpoints_verified_noise():
    model, opt, loader = _bib_run()
    _one_step(model, opt, loader)
    state = opt.state_dict()
    m2, o2, _ = _bib_run(seed=2)  # another Monte Carlo calibration: another verified noise_std
    assert o2.noise_std != opt.noise_std
    o2.load_state_dict(state)
    assert o2.noise_std == opt.noise_std and o2.steps_taken == 1
    assert o2.calibration == opt.calibration and o2.privacy_spent(steps=10).kind == "guarantee"
    _, o3, _ = _bib_run(epsilon=5.0)  # a smaller target than the checkpoint's guarantee: refused
    with pytest.raises(CorrnoiseError, match="exceeds this run's") as e:
        o3.load_state_dict(state)
    assert o3.steps_taken == 0 and o3.noise_std != opt.noise_std  # nothing adopted


def test_freezing_or_unfreezing_after_make_private_is_refused_at_step():
    for change in ("freeze", "unfreeze"):
        model = _mlp()
        if change == "unfreeze":
            model[0].requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        model, opt, loader = make_private(model, opt, DataLoader(_data(), batch_size=16), mechanism="identity",
                                          noise_multiplier=1.0, delta=1e-5, epochs=1, max_grad_norm=1.0)
        model[0].requires_grad_(change == "unfreeze")
        x, y = next(iter(loader))
        nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(CorrnoiseError, match="frozen after" if change == "freeze" else "unfrozen after"):
            opt.step()


def test_clipping_covers_only_the_optimizers_parameters():
    model = _mlp()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.3)  # fine-tune the head; the body stays trainable
    # the body gets raw gradients, no noise: said once (a second optimizer on it would train it on them)
    with pytest.warns(UserWarning, match=r"^2 trainable parameter\(s\) of the module are not in the optimizer given "
                      r"to make_private \('0\.weight', '0\.bias'\): they get no clipping and no noise.*"
                      r"freeze them \(requires_grad_\(False\)\) or add them to the optimizer$") as rec:
        model, opt, loader = make_private(model, opt, DataLoader(_data(), batch_size=16), mechanism="identity",
                                          noise_multiplier=1.0, delta=1e-5, epochs=1, max_grad_norm=1.0)
    assert [w.filename for w in rec if "trainable parameter" in str(w.message)] == [__file__]  # the caller's line
    assert opt.engine.names == ["2.weight", "2.bias"]
    body = model[0].weight.detach().clone()
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, body)


@pytest.mark.parametrize("kwargs, param", [
    ({"epochs": 1, "steps": 4}, "steps"),
    ({"epochs": "3"}, "epochs"),
    ({"steps": 0, "epochs": None}, "steps"),
    ({"mechanism": "bogus"}, "mechanism"),
    ({"mechanism": "blt:2"}, "mechanism"),
    ({"noise_method": "fast"}, "noise_method"),  # review: both were named "method"
    ({"accounting_method": "magic"}, "accounting_method"),
    ({"accounting_method": ["pld"]}, "accounting_method"),
])
def test_make_private_errors_name_the_argument_given(kwargs, param):
    model = _mlp()
    args = dict(mechanism="identity", noise_multiplier=1.0, delta=1e-5, epochs=1, max_grad_norm=1.0)
    args.update(kwargs)
    with pytest.raises(CorrnoiseError) as e:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), batch_size=16), **args)
    assert e.value.param == param and "\n" not in str(e.value)


def test_opacus_make_private_with_a_noise_multiplier_is_dp_sgd():
    from corrnoise.torch.opacus_adapter import PrivacyEngine

    model = _mlp()
    _, opt, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(_data(), batch_size=16), noise_multiplier=1.1,
                                             max_grad_norm=1.0, epochs=1)
    assert opt.strategy.label == "identity" and opt.batching.spec.startswith("poisson")
    assert math.isclose(opt.noise_multiplier, 1.1)


def test_opacus_make_private_with_a_plan_file_trains_the_planned_run(tmp_path):
    from corrnoise.runplan import plan_run
    from corrnoise.strategies import mechanism_fingerprint
    from corrnoise.torch.opacus_adapter import PrivacyEngine

    plan = plan_run(dataset_size=64, batch_size=16, mechanism="bsr:2", batching="cyclic", epsilon=4.0, delta=1e-5,
                    epochs=2)
    path = plan.to_json(tmp_path / "plan.json")
    model = _mlp()
    engine = PrivacyEngine()
    _, opt, _ = engine.make_private_with_plan(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              data_loader=DataLoader(_data(), batch_size=16), plan=str(path),
                                              max_grad_norm=1.0)
    assert mechanism_fingerprint(opt.strategy) == plan.fingerprint and opt.noise_std == plan.noise_std
    assert engine.get_epsilon(1e-5) == 0.0  # nothing released yet
    assert opt.run_guarantee(1e-5).epsilon == plan.guarantee.epsilon
    with pytest.raises(CorrnoiseError) as e:  # the plan decides the noise
        engine.make_private_with_plan(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      data_loader=DataLoader(_data(), batch_size=16), plan=plan, max_grad_norm=1.0,
                                      noise_multiplier=1.0)
    assert e.value.param == "noise_multiplier"


def test_a_checkpoint_of_another_mechanism_with_the_same_label_is_refused():
    """Two 2-buffer BLTs are both labelled blt(d=2); the checkpoint's fingerprint of C tells them
    apart (adopting the other's noise and guarantee would report an epsilon the run does not have)."""
    def build(mech):
        model = _mlp()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(), batch_size=16),
                            mechanism=mech, noise_multiplier=1.0, delta=1e-5, epochs=2, max_grad_norm=1.0,
                            batching="cyclic", noise_seed=3, seed=5)

    _, first, _ = build("blt:0.05,0.01:0.2,0.1")
    state = first.state_dict()
    _, other, _ = build("blt:0.5,0.1:0.9,0.5")
    assert other.strategy.label == first.strategy.label
    with pytest.raises(CorrnoiseError) as e:
        other.load_state_dict(state)
    assert e.value.param == "mechanism"
    _, same, _ = build("blt:0.05,0.01:0.2,0.1")
    same.load_state_dict(state)


# ----------------------------------------------------------------------------------------------
# The sampler seed: secret for amplified batchings, reused on resume
# ----------------------------------------------------------------------------------------------
def _seeded(batching, seed, **kwargs):
    model = _mlp()
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_data(48), batch_size=12),
                        mechanism=kwargs.pop("mechanism", "identity"), noise_multiplier=1.0, delta=1e-5, steps=4,
                        max_grad_norm=1.0, batching=batching, seed=seed, **kwargs)


@pytest.mark.parametrize("batching,mechanism", [("poisson", "identity"), ("block-cyclic", "bsr:2"),
                                                ("auto", "identity")])
def test_a_given_seed_with_an_amplified_batching_warns_that_the_guarantee_needs_it_secret(batching, mechanism):
    """Amplification by sampling assumes the adversary does not know which steps used an example:
    a published sampler seed voids it. A given seed is allowed (experiments, distributed
    broadcast) but warned about; seed=None (OS entropy) and unamplified cyclic batches are not."""
    with pytest.warns(UserWarning, match="amplified privacy guarantee assumes the sampler seed is secret") as got:
        _, opt, _ = _seeded(batching, 3, mechanism=mechanism)
    assert opt.sampler.amplified and opt.sampler.seed == 3
    assert got[0].filename == __file__  # the warning names the caller's line, not corrnoise's
    import warnings

    for args in ((batching, None), ("cyclic", 3)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, opt, _ = _seeded(*args, mechanism=mechanism)
        assert not [w for w in caught if "sampler seed" in str(w.message)], args
        assert args[1] is not None or opt.sampler.seed != 3


def test_resume_reuses_the_checkpoints_secret_sampler_seed():
    """The sampler seed lives only in the optimizer's state_dict (drawn from the OS, never given):
    a resumed run must continue the checkpoint's batches, not refuse or draw new ones. Independent
    check: the example indices the loaders actually yield (x encodes the index)."""
    data = TensorDataset(torch.arange(40, dtype=torch.float64)[:, None], torch.zeros(40, dtype=torch.long))

    def build():
        torch.manual_seed(0)
        model = nn.Linear(1, 2).double()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=10),
                            mechanism="identity", batching="poisson", noise_multiplier=1.0, delta=1e-5, steps=8,
                            max_grad_norm=1.0, noise_seed=5)

    def rest(model, opt, loader, stop=None):
        seen = []
        while opt.steps_taken < (stop or opt.steps):
            for x, y in loader:
                seen.append(sorted(int(i) for i in x[:, 0]))
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if opt.steps_taken == stop:
                    break
        return seen

    model, opt, loader = build()
    rest(model, opt, loader, stop=3)
    state = opt.state_dict()
    assert state["sampler"]["seed"] == opt.sampler.seed
    after = rest(model, opt, loader)
    m2, o2, l2 = build()
    assert o2.sampler.seed != opt.sampler.seed  # a fresh secret seed ...
    o2.load_state_dict(state)
    assert o2.sampler.seed == opt.sampler.seed and o2.steps_taken == 3  # ... gives way to the checkpoint's
    assert rest(m2, o2, l2) == after and len(after) == 5


def _private(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(64), batch_size=16)
    return make_private(model, opt, loader, mechanism="identity", noise_multiplier=1.0, delta=1e-5, epochs=1,
                        batching="cyclic", max_grad_norm=1.0, **kw)


def test_make_private_again_on_the_same_model_takes_it_over():
    # a notebook cell run again, a second PrivateTrainer, a second phase: the earlier engine's hooks
    # would capture every batch too and refuse the second forward. The new run trains every step;
    # the earlier optimizer refuses in one line
    model = _mlp()
    _, first, first_loader = _private(model)
    _one_step(model, first, first_loader)
    with pytest.warns(RuntimeWarning, match="already had a clipping engine"):
        model2, second, loader = _private(model)
    for x, y in loader:
        nn.functional.cross_entropy(model2(x), y).backward()
        second.step()
        second.zero_grad()
    assert second.steps_taken == second.steps == 4
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(CorrnoiseError, match="^engine: was detached: a later make_private .* took over this model"):
        first.step()


def test_engines_on_separate_layers_of_one_model_both_stay():
    from corrnoise.torch.clipping import ClippingEngine

    model = _mlp()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = ClippingEngine(model[0]), ClippingEngine(model[2])
    model(torch.randn(5, 8)).pow(2).mean().backward()
    assert a.clipped_sum(5)[0][0].shape == (16, 8) and b.clipped_sum(5)[0][0].shape == (3, 16)
    with pytest.raises(CorrnoiseError, match="^by: must be one of 'user', 'later engine', 'optimizer', got 'me'$"):
        a.detach(by="me")
    a.detach()
    with pytest.raises(CorrnoiseError, match="^engine: was detached; attach a new one$"):
        a.clipped_sum(5)


def test_the_last_planned_step_gives_the_model_back_plain():
    # after the run, forward and backward are a plain model's (every weight gradient, no capture);
    # another step is refused as past the plan
    model = _mlp()
    model2, opt, loader = _private(model)
    for x, y in loader:
        nn.functional.cross_entropy(model2(x), y).backward()
        opt.step()
        opt.zero_grad()
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(CorrnoiseError, match="^steps: all 4 planned steps are done"):
        opt.step()
    assert opt.privacy_spent().epsilon > 0


def test_release_model_stops_a_run_early():
    model = _mlp()
    model2, opt, loader = _private(model)
    _one_step(model2, opt, loader)
    _one_step(model2, opt, loader)  # the step after the first (weight gradients out of autograd)
    assert opt.privatizer.generator._rows  # on CPU the generator keeps its last row for reuse
    opt.release_model()
    assert opt.privatizer.generator._rows == []  # ... and lets go of it with the model
    x, y = next(iter(DataLoader(_data(16), batch_size=16)))
    nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(CorrnoiseError, match="^engine: was detached: its private optimizer released the model"):
        opt.step()


def test_an_accelerate_loop_trains_with_the_private_loader():
    # accelerate's prepare() of the model and optimizer keeps the run; a prepared copy of the loader
    # loses the accounted batches and is refused in one line that says so
    accelerate = pytest.importorskip("accelerate")
    model = _mlp()
    model2, opt, loader = _private(model)
    acc = accelerate.Accelerator(cpu=True)
    model2, opt_acc = acc.prepare(model2, opt)
    for x, y in loader:
        acc.backward(nn.functional.cross_entropy(model2(x), y))
        opt_acc.step()
        opt_acc.zero_grad()
    assert opt.steps_taken == opt.steps == 4
    model3, opt3, loader3 = _private(_mlp())
    copied = acc.prepare(loader3)
    x, y = next(iter(copied))
    nn.functional.cross_entropy(model3(x), y).backward()
    with pytest.raises(CorrnoiseError, match="^data_loader: .*accelerate's prepare\\(\\) makes, is not"):
        opt3.step()
