"""Noise-memory budget (issue #27 item 5): the byte formula against the generators' real state,
size parsing, the planner's budget (GPT-2 small acceptance), make_private and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_strategies
from hypothesis import given
from hypothesis import strategies as st

from corrnoise.errors import CorrnoiseError
from corrnoise.noise import make_generator
from corrnoise.noise_memory import (NoiseBudget, dtype_itemsize, noise_budget, noise_state_bytes, noise_state_vectors,
                                    parse_size, vectors_within)
from corrnoise.strategies import BLT, DPCGD, BandedInverseSqrt, BandedSqrt, Identity, OnlineTree

GPT2_SMALL = 124_439_808
FAST = dict(screen_samples=1 << 11, seed=1, progress=False)
SHAPES = [(37, 11), (5,), (3, 4, 6)]  # a small model: 484 coordinates in three tensors
M = 37 * 11 + 5 + 3 * 4 * 6


def _state_bytes(gen) -> int:
    """Bytes of the model-size tensors the generator object holds (its attributes, counted
    directly: any tensor whose last dimension is the model's coordinates)."""
    total = 0
    for value in vars(gen).values():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[-1] == gen.size:
            total += value.numel() * value.element_size()
    return total


def _regenerable(strategy) -> bool:
    try:
        strategy.regeneration_stream()
    except CorrnoiseError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("method", ["auto", "regenerate"])
def test_formula_matches_the_generators_state(dtype, method):
    """Every strategy kind (and its column-normalized forms): the formula equals the bytes of the
    state tensors of the generator make_generator builds, before and after some steps."""
    n = 12
    kinds = set()
    for strategy in random_strategies(n):
        if method == "regenerate" and not _regenerable(strategy):
            continue
        gen = make_generator(strategy, SHAPES, seed=3, dtype=dtype, method=method)
        kinds.add(gen.kind)
        expected = noise_state_bytes(strategy, M, str(dtype), method)
        assert _state_bytes(gen) == expected, strategy.label
        for _ in range(5):
            gen.next()
        assert _state_bytes(gen) == expected, strategy.label  # no state grows with the steps
        kept = sum(v.numel() * v.element_size() for v in gen.state_dict()["buffers"].values())
        assert kept == expected, strategy.label
    if method == "auto":  # every generator class was built
        assert kinds == {"iid", "banded", "blt", "dpcgd", "regenerate", "tree"}


@pytest.mark.parametrize("strategy, vectors", [
    (Identity(64), 0), (BandedSqrt(64, 8), 7), (BLT([0.3, 0.2, 0.1, 0.05], [0.9, 0.7, 0.5, 0.2], 64), 4),
    (DPCGD(0.9, 64), 0), (BandedInverseSqrt(64, 8), 0), (OnlineTree(64), 0), (OnlineTree(64, "ls"), 6),
])
def test_vectors_per_kind(strategy, vectors):
    """The docstring's table: banded b - 1, BLT d, tree:ls the bit length of n - 1, the rest 0."""
    assert noise_state_vectors(strategy) == vectors
    assert noise_state_vectors(strategy, "regenerate") == 0
    assert noise_state_bytes(strategy, GPT2_SMALL, "float32") == vectors * GPT2_SMALL * 4


@given(st.integers(1, 10 ** 12), st.sampled_from(["float64", "float32", "float16", "bfloat16"]),
       st.integers(1, 9))
def test_bytes_are_linear_in_params_and_itemsize(params, dtype, d):
    blt = BLT([0.1] * d, [0.5] * d, 16)
    assert noise_state_bytes(blt, params, dtype) == d * params * dtype_itemsize(dtype)[1]
    assert vectors_within(noise_state_bytes(blt, params, dtype), params, dtype) == d


@pytest.mark.parametrize("text, size", [
    ("2GB", 2 * 10 ** 9), ("512MiB", 512 * 2 ** 20), ("2e9", 2 * 10 ** 9), ("1.5 GiB", 3 * 2 ** 29),
    ("100", 100), ("64kb", 64_000), ("3 TB", 3 * 10 ** 12), (2_000_000_000, 2 * 10 ** 9), (2e9, 2 * 10 ** 9),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "2 GBs", "two GB", "-1GB", "GB", True, None, [2], -5, float("inf"),
                                 float("nan"), "1e3e3"])
def test_parse_size_refuses_with_one_line(bad):
    with pytest.raises(CorrnoiseError) as err:
        parse_size(bad)
    assert err.value.param == "max_noise_memory" and "\n" not in str(err.value)


@given(st.integers(0, 10 ** 18), st.sampled_from(["", "B", "kB", "MiB", "GiB", "gb"]))
def test_parse_size_of_integers(k, unit):
    scale = {"": 1, "b": 1, "kb": 10 ** 3, "mib": 2 ** 20, "gib": 2 ** 30, "gb": 10 ** 9}[unit.lower()]
    assert parse_size(f"{k}{unit}") == k * scale


def test_budget_method_for_names_what_fits():
    budget = noise_budget("2GB", GPT2_SMALL, torch.float32)
    assert budget == NoiseBudget(2 * 10 ** 9, GPT2_SMALL, "float32")
    assert budget.method_for(BLT([0.1] * 4, [0.5] * 4, 64)) == "auto"  # 4 x 498 MB = 1.99 GB
    assert budget.method_for(BandedSqrt(1000, 64), "regenerate") == "regenerate"
    with pytest.raises(CorrnoiseError) as err:
        budget.method_for(BandedSqrt(1000, 64))
    msg = str(err.value)
    assert err.value.param == "max_noise_memory" and "\n" not in msg
    assert "63 noise vectors" in msg and "at most 4 vectors" in msg and "regenerate" in msg


# ----------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------
#: a quick cyclic setup: 16 steps per epoch, so bandmf:2..16, blt:1..4, tree and tree:ls (5 slots)
QUICK = dict(steps=32, epochs=2, epsilon=4.0, delta=1e-5, pipeline="cyclic", only="dpsgd,bandmf,blt,dpcgd,tree")


def test_gpt2_small_plan_within_2gb():
    """Acceptance: GPT-2 small (124,439,808 float32 parameters) with max_noise_memory 2GB -- no
    recommended or feasible candidate over 2 GB, and the plan says what it excluded."""
    from corrnoise.planner import plan

    result = plan(**QUICK, trainable_params=GPT2_SMALL, dtype="float32", max_noise_memory="2GB", **FAST)
    budget = 2 * 10 ** 9
    rec = result.recommended
    assert rec.noise_memory_bytes <= budget
    assert rec.noise_memory_bytes == noise_state_bytes(rec.strategy, GPT2_SMALL, "float32", rec.noise_method)
    for c in result.candidates:
        assert c.noise_memory_bytes == noise_state_bytes(c.strategy, GPT2_SMALL, "float32", c.noise_method)
        assert c.noise_memory_bytes == c.memory_vectors * GPT2_SMALL * 4  # agrees with the planner's own count
        if c.feasible or c.calibrated:
            assert c.noise_memory_bytes <= budget, c.mechanism
    # tree:ls keeps 5 node estimates (2.49 GB) and has no regenerated variant: excluded, said why
    assert [e["candidate"] for e in result.excluded] == ["tree:ls"]
    ls = next(c for c in result.candidates if c.mechanism == "tree:ls")
    assert not ls.feasible and not ls.calibrated and "max_noise_memory" in ls.note
    # bandmf:8 and :16 buffer 7 and 15 vectors: regenerated (same C, no buffers), not excluded
    regen = {e["candidate"] for e in result.regenerated}
    assert regen == {"bandmf:8", "bandmf:16"}
    for c in result.candidates:
        assert (c.noise_method == "regenerate") == (c.mechanism in regen)
        if c.mechanism in regen:
            assert c.feasible and c.memory_vectors == 0 and c.noise_memory_bytes == 0 and "regenerated" in c.note
    data = json.loads(json.dumps(result.to_dict()))
    assert all("noise_memory_bytes" in c for c in data["candidates"])
    assert data["excluded"][0]["candidate"] == "tree:ls" and data["setup"]["max_noise_memory"] == budget


def test_plan_without_budget_is_unchanged_but_reports_bytes():
    from corrnoise.planner import plan

    plain = plan(**QUICK, **FAST)
    sized = plan(**QUICK, trainable_params=1000, dtype="bfloat16", **FAST)
    assert "noise_memory_bytes" not in plain.to_dict()["candidates"][0]
    assert "excluded" not in plain.to_dict() and "trainable_params" not in plain.to_dict()["setup"]
    assert [(c.mechanism, c.batching, c.noise_std) for c in plain.candidates] == \
           [(c.mechanism, c.batching, c.noise_std) for c in sized.candidates]
    assert plain.recommended.mechanism == sized.recommended.mechanism
    for c in sized.candidates:
        assert c.noise_method == "auto" and c.noise_memory_bytes == c.memory_vectors * 1000 * 2


def test_the_optimized_toeplitz_reports_the_buffers_it_keeps_and_regenerates_over_a_budget():
    """The toeplitz design's memory_vectors and noise_cost are those of the method that trains it
    (make_generator's "auto": a banded recurrence over its nonzero coefficients), and a budget its
    buffers exceed switches it to regeneration. Found by a user probe: it reported 0 buffers while
    training with 99, and a budget excluded it for 49 GB of buffers it said it did not keep."""
    from corrnoise.planner import plan

    setup = {**QUICK, "only": "toeplitz,dense"}
    sized = plan(**setup, trainable_params=1000, **FAST)
    toeplitz = next(c for c in sized.candidates if c.family == "toeplitz")
    kept = noise_state_vectors(toeplitz.strategy, "auto")
    assert kept > 0 and toeplitz.noise_method == "auto"
    for c in sized.candidates:
        assert c.memory_vectors == noise_state_vectors(c.strategy, c.noise_method), c.mechanism
        assert c.noise_memory_bytes == c.memory_vectors * 1000 * 4
    assert toeplitz.noise_cost == kept + 1  # one draw and one multiply-add per buffered row
    tight = plan(**setup, trainable_params=1000, max_noise_memory=4000 * (kept - 1), **FAST)
    toeplitz = next(c for c in tight.candidates if c.family == "toeplitz")
    assert toeplitz.noise_method == "regenerate" and toeplitz.feasible and toeplitz.memory_vectors == 0
    assert not tight.excluded and [e["candidate"] for e in tight.regenerated] == ["toeplitz"]


def test_plan_excludes_past_the_regeneration_limit(monkeypatch):
    """Where regenerated noise is not offered (n above the limit) the buffered family is excluded."""
    from corrnoise.planner import budget, plan

    monkeypatch.setattr(budget, "MAX_REGENERATE_N", 16)
    result = plan(**{**QUICK, "only": "dpsgd,blt"}, trainable_params=10 ** 6, max_noise_memory="7MB", **FAST)
    assert {e["candidate"] for e in result.excluded} == {"blt:4", "blt:2"}  # 16 MB and 8 MB; blt:1 4 MB fits
    assert all("n <= 16" in e["reason"] for e in result.excluded)
    assert result.recommended.noise_memory_bytes <= 7 * 10 ** 6


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_noise_memory="2GB"), "max_noise_memory"),
    (dict(trainable_params=10, max_noise_memory="2 gigabytes"), "max_noise_memory"),
    (dict(trainable_params=10, dtype="int8"), "dtype"),
    (dict(trainable_params=0), "trainable_params"),
])
def test_plan_refuses_bad_budget(kwargs, param):
    from corrnoise.planner import PlanSetup

    with pytest.raises(CorrnoiseError) as err:
        PlanSetup(epsilon=1.0, delta=1e-5, steps=10, epochs=1, **kwargs)
    assert err.value.param == param and "\n" not in str(err.value)


def test_plan_with_nothing_within_budget_says_so(monkeypatch):
    from corrnoise.planner import budget, plan

    monkeypatch.setattr(budget, "MAX_REGENERATE_N", 16)
    with pytest.raises(CorrnoiseError) as err:
        plan(**{**QUICK, "only": "blt"}, trainable_params=GPT2_SMALL, max_noise_memory="1MB", **FAST)
    assert err.value.param == "max_noise_memory" and "dpsgd" in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------
# make_private and the CLI
# ----------------------------------------------------------------------------------------------
def _private(mechanism, max_noise_memory, **kw):
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.torch.front import make_private

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))  # 195 float32 parameters
    model[0].bias.requires_grad_(False)  # frozen: not counted (179 trainable)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = TensorDataset(torch.randn(80, 8), torch.randint(0, 3, (80,)))
    _, private, _ = make_private(model, opt, DataLoader(data, batch_size=8), mechanism=mechanism, batching="cyclic",
                                 epsilon=8.0, delta=1e-5, epochs=2, max_grad_norm=1.0,
                                 max_noise_memory=max_noise_memory, noise_seed=0, **kw)
    return private


def test_make_private_auto_plans_within_the_budget():
    """A family planned under a budget of 0 bytes: every bandmf design buffers, so the planner's
    pick is regenerated, and the generator make_private builds keeps no state."""
    private = _private("bandmf", 0)
    gen = private.privatizer.generator
    assert private.plan.planner_result.recommended.noise_method == "regenerate"
    assert gen.kind == "regenerate" and _state_bytes(gen) == 0
    fits = _private("auto", 179 * 4)  # one float32 vector of the trainable parameters
    assert _state_bytes(fits.privatizer.generator) <= 179 * 4


def test_a_plan_file_keeps_how_its_noise_runs(tmp_path):
    """A plan made under a budget that did not fit the buffers says "regenerate"; its file keeps
    that, and make_private(plan=the loaded file) builds the regenerated generator (no budget given)."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from corrnoise.runplan import RunPlan
    from corrnoise.torch.front import make_private

    planned = _private("bandmf", 0).plan
    assert planned.noise_method == "regenerate"
    loaded = RunPlan.from_json(planned.to_json(tmp_path / "plan.json"))
    assert loaded.noise_method == "regenerate"
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(80, 8), torch.randint(0, 3, (80,)))
    _, private, _ = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                                 plan=loaded, max_grad_norm=1.0, noise_seed=0)
    assert private.privatizer.generator.kind == "regenerate"


def test_make_private_named_mechanism_over_budget_says_what_fits():
    with pytest.raises(CorrnoiseError) as err:
        _private("bsr:4", "1kB")  # 3 vectors x 179 x 4 B = 2148 B
    msg = str(err.value)
    assert err.value.param == "max_noise_memory" and "\n" not in msg
    assert "3 noise vectors" in msg and "at most 1 vectors" in msg and "regenerate" in msg
    private = _private("bsr:4", "1kB", noise_method="regenerate")
    assert _state_bytes(private.privatizer.generator) == 0
    assert _state_bytes(_private("bsr:4", "2148").privatizer.generator) == 2148  # exactly at the budget


def test_cli_plan_reports_noise_memory(capsys):
    from corrnoise.cli import main

    args = ["plan", "--steps", "32", "--epochs", "2", "--epsilon", "4", "--delta", "1e-5", "--pipeline", "cyclic",
            "--only", "dpsgd,bandmf,tree", "--trainable-params", str(GPT2_SMALL), "--dtype", "float32",
            "--max-noise-memory", "2GB", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(c["noise_memory_bytes"] <= 2 * 10 ** 9 for c in data["candidates"] if c["feasible"])
    assert data["recommended"]["noise_memory_bytes"] <= 2 * 10 ** 9
    assert [e["candidate"] for e in data["excluded"]] == ["tree:ls"]
    assert main(args[:-3] + ["--max-noise-memory", "lots", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "max_noise_memory" in err


def test_readme_table_is_the_scripts_output():
    """The README's GPT-2 small table is what benchmarks/noise_memory_table.py prints (the formula's numbers)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("noise_memory_table", root / "benchmarks" / "noise_memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.lora_trainable() == 294_912  # 12 x 8 x (768 + 2304)
    assert module.table() in (root / "README.md").read_text()


def test_the_model_budget_counts_the_noise_in_its_widest_dtype():
    """Review: the budget took the first parameter's dtype (bfloat16 before float32 layers) while
    the generator draws in the widest: the buffers took twice what was budgeted."""
    from corrnoise.noise_memory import model_noise_budget
    from corrnoise.torch.privatizer import noise_dtype

    params = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(30)]
    assert noise_dtype(params) == torch.float32
    assert model_noise_budget("1MB", params, noise_dtype(params)) == NoiseBudget(10 ** 6, 40, "float32")
