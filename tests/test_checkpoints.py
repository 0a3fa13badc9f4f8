"""Optimizer checkpoints round-trip: in the same process and across processes, with and without
the noise seed stored; a resumed run continues the same noise rows and sampler and ends with the
same guarantee as an uninterrupted one (issue "The first hour", item 4)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from corrnoise.errors import CorrnoiseError
from corrnoise.torch import make_private

STEPS = 6


def _build(noise_seed=None, store_noise_seed=False, mechanism="bsr:2", batching="cyclic", seed=2):
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.randint(0, 3, (40,)))
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                        DataLoader(data, batch_size=10), noise_multiplier=1.0, delta=1e-5, steps=STEPS,
                        max_grad_norm=0.5, mechanism=mechanism, batching=batching, noise_seed=noise_seed,
                        store_noise_seed=store_noise_seed, seed=seed)


def _steps(model, opt, loader, k):
    done = 0
    while done < k:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == k:
                return


def _weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_state_dict_loads_back_into_the_same_optimizer():
    """The same process: the seed is not stored, but this run's own seed is the checkpoint's."""
    model, opt, loader = _build()
    _steps(model, opt, loader, 2)
    state = opt.state_dict()
    assert "seed" not in state["noise"]["generator"]
    opt.load_state_dict(state)
    assert opt.steps_taken == 2


def test_going_back_to_an_earlier_checkpoint_of_the_same_run_is_refused():
    """Found in review: loading step 3's state after step 6 was accepted, and step 3 was released
    again with its noise row, so the difference of the two releases left the clipped sum in the
    clear. Refused in one line before anything changes; the latest state still loads."""
    model, opt, loader = _build()
    _steps(model, opt, loader, 3)
    early = opt.state_dict()
    _steps(model, opt, loader, 3)
    with pytest.raises(CorrnoiseError, match="noise rows 3..5 a second time") as err:
        opt.load_state_dict(early)
    assert err.value.param == "state" and "\n" not in str(err.value)
    assert opt.steps_taken == opt.privatizer.step == 6
    opt.load_state_dict(opt.state_dict())
    assert opt.steps_taken == 6


def _uninterrupted(noise_seed):
    model, opt, loader = _build(noise_seed=noise_seed)
    _steps(model, opt, loader, STEPS)
    return _weights(model), opt.privacy_spent()


def _resume(state, weights, **build):
    model, opt, loader = _build(**build)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(weights, model.parameters())
    opt.load_state_dict(state)
    _steps(model, opt, loader, STEPS - opt.steps_taken)
    return _weights(model), opt


def test_a_stored_seed_resumes_in_a_new_run_without_passing_it():
    model, opt, loader = _build(store_noise_seed=True)
    _steps(model, opt, loader, 3)
    state, weights, seed = opt.state_dict(), _weights(model), opt.noise_seed
    assert state["noise"]["generator"]["seed"] == seed
    resumed, ropt = _resume(state, weights)  # a fresh secret OS seed gives way to the stored one
    assert ropt.noise_seed == seed
    want, spent = _uninterrupted(seed)
    torch.testing.assert_close(resumed, want, rtol=0, atol=0)  # same machine, same process: bit-exact
    assert ropt.privacy_spent().epsilon == spent.epsilon


def test_an_unstored_seed_resumes_when_passed_again():
    model, opt, loader = _build()
    _steps(model, opt, loader, 3)
    state, weights, seed = opt.state_dict(), _weights(model), opt.noise_seed
    resumed, _ = _resume(state, weights, noise_seed=seed)
    torch.testing.assert_close(resumed, _uninterrupted(seed)[0], rtol=0, atol=0)


def test_an_unstored_seed_not_passed_says_what_to_pass():
    model, opt, loader = _build()
    _steps(model, opt, loader, 1)
    with pytest.raises(CorrnoiseError) as err:
        _resume(opt.state_dict(), _weights(model))
    assert err.value.param == "noise_seed" and "\n" not in str(err.value)
    assert "optimizer.noise_seed" in str(err.value) and "noise_seed=" in str(err.value)


def test_a_wrong_seed_is_refused_whether_stored_or_not():
    model, opt, loader = _build()
    _steps(model, opt, loader, 1)
    with pytest.raises(CorrnoiseError, match="not the seed of the checkpoint") as err:
        _resume(opt.state_dict(), _weights(model), noise_seed=opt.noise_seed + 1)
    assert err.value.param == "noise_seed"
    model, opt, loader = _build(store_noise_seed=True)
    _steps(model, opt, loader, 1)
    with pytest.raises(CorrnoiseError, match="differs from the one stored") as err:
        _resume(opt.state_dict(), _weights(model), noise_seed=opt.noise_seed + 1)
    assert err.value.param == "noise_seed"


def test_a_checkpoint_without_mechanism_fingerprint_is_refused():
    model, opt, loader = _build(noise_seed=4)
    state = {k: v for k, v in opt.state_dict().items() if k != "mechanism"}
    with pytest.raises(CorrnoiseError) as err:
        opt.load_state_dict(state)
    assert err.value.param == "state" and "identify its mechanism" in str(err.value)


def test_a_checkpoint_of_another_batching_is_refused():
    model, opt, loader = _build(noise_seed=4, mechanism="identity", batching="cyclic")
    state = opt.state_dict()
    assert state["batching"] == "none"
    with pytest.raises(CorrnoiseError) as err:
        opt.load_state_dict({**state, "batching": "poisson:0.25"})
    assert err.value.param == "batching"


def test_round_trip_across_processes_through_torch_save(tmp_path):
    """torch.save in this process, torch.load (weights_only, torch's default) in a new one."""
    model, opt, loader = _build(store_noise_seed=True)
    _steps(model, opt, loader, 3)
    path = tmp_path / "ckpt.pt"
    torch.save({"optimizer": opt.state_dict(), "weights": _weights(model)}, path)
    want = _uninterrupted(opt.noise_seed)[0]
    torch.save(want, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_checkpoints import _resume
        ckpt = torch.load({str(path)!r})
        got, opt = _resume(ckpt["optimizer"], ckpt["weights"])
        assert opt.steps_taken == {STEPS}
        torch.testing.assert_close(got, torch.load({str(tmp_path / 'want.pt')!r}), rtol=0, atol=0)
        print("resumed")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed" in out.stdout


def test_a_planned_run_resumed_with_another_pick_says_to_resume_from_its_saved_plan():
    """A planned family can come out another design when planned again (a user probe's mechanism="blt"
    picked d = 1, 2 or 4 with the cache off): the refusal says to plan once and pass plan=. A named
    mechanism's refusal does not (its mechanism is the caller's)."""
    named_model, named, _ = _build(noise_seed=4, mechanism="bsr:3")
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.randint(0, 3, (40,)))
    model, planned, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.2), DataLoader(data, batch_size=10),
                                     epsilon=4.0, delta=1e-5, epochs=2, max_grad_norm=0.5, mechanism="dpcgd",
                                     batching="cyclic", noise_seed=4)
    with pytest.raises(CorrnoiseError) as err:
        planned.load_state_dict(named.state_dict())
    assert err.value.param == "mechanism" and "\n" not in str(err.value)
    assert "was the planner's pick" in str(err.value) and "pass plan=" in str(err.value)
    _, other, _ = _build(noise_seed=4, mechanism="bsr:2")
    with pytest.raises(CorrnoiseError) as err:
        other.load_state_dict(named.state_dict())
    assert err.value.param == "mechanism" and "planner" not in str(err.value)


def test_a_resume_with_another_epsilon_names_the_calibrated_target():
    """An analytically calibrated run resumed from a checkpoint of another epsilon: the refusal says
    the noise was calibrated to this run's target (it said "given, not calibrated", a user probe)."""
    def run(epsilon):
        torch.manual_seed(0)
        model = nn.Linear(5, 3).double()
        data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.randint(0, 3, (40,)))
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.2), DataLoader(data, batch_size=10),
                            epsilon=epsilon, delta=1e-5, steps=STEPS, max_grad_norm=0.5, mechanism="bsr:2",
                            batching="cyclic", noise_seed=4)[1]

    with pytest.raises(CorrnoiseError) as err:
        run(8.0).load_state_dict(run(4.0).state_dict())
    assert err.value.param == "state" and "\n" not in str(err.value)
    assert "calibrated (gaussian) to (8, 1e-05)" in str(err.value) and "given" not in str(err.value)
