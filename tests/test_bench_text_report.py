"""benchmarks/bench_text.py's report: the default table (SGD at the default learning rates) stays
what it was when rows with other optimizers or rates are appended; those get their own tables.
Synthetic rows only (no training, no data)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_text.py"


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_text", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(variant, eps, seed, acc, lr, optimizer=None, pipeline="full", floor=None, floor_z=None):
    r = {"variant": variant, "pipeline": pipeline, "epsilon_target": eps, "seed": seed, "lr": lr,
         "test_accuracy": acc, "ms_step_median": 100.0, "ms_per_example_median": 1.0}
    if optimizer is not None:
        r["optimizer"] = optimizer
    if floor is not None:
        r["optimizer_settings"] = {"variance_floor": floor, **({} if floor_z is None else {"floor_z": floor_z})}
    return r


def test_default_rows_are_sgd_at_the_default_rates(bt):
    assert bt.is_default(row("nonprivate", None, 0, 0.5, 0.05))          # old row: no optimizer field = sgd
    assert bt.is_default(row("auto", 3.0, 0, 0.4, 0.5, "sgd"))
    assert bt.is_default(row("auto", 3.0, 0, 0.4, 1.0, pipeline="lora"))
    assert not bt.is_default(row("auto", 3.0, 0, 0.4, 2.0, pipeline="lora"))
    assert not bt.is_default(row("auto", 3.0, 0, 0.4, 0.5, "adamw"))
    assert not bt.is_default(row("nonprivate", None, 0, 0.5, 1e-3, "adamw"))


def test_new_rows_leave_the_default_table_alone_and_pair_by_seed(bt):
    old = [row("nonprivate", None, 0, 0.5, 0.05), row("auto", 3.0, 0, 0.40, 0.5), row("auto", 3.0, 1, 0.30, 0.5)]
    new = [row("auto", 3.0, 0, 0.42, 3e-3, "adamw"), row("auto", 3.0, 1, 0.38, 3e-3, "adamw"),
           row("auto", 3.0, 0, 0.45, 3e-3, "noise-aware-adamw", floor=1e-10),
           row("auto", 3.0, 2, 0.10, 3e-3, "noise-aware-adamw"),
           row("auto", 3.0, 1, 0.30, 3e-3, "noise-aware-adamw", floor=1e-6),
           row("auto", 3.0, 1, 0.41, 3e-3, "noise-aware-adamw", floor=1e-10, floor_z=2.0)]
    text = bt.report(old + new)
    assert text.startswith(bt.table(old) + "\n\n" + bt.step_table(old))
    assert "| full | adamw | 0.003 | auto | 3 | 40.0% | 38.0-42.0 | 0,1 |" in text
    # rows without floor_z ran before the relative floor: the fixed floor alone
    assert "| full | noise-aware-adamw (floor 1e-10 fixed) | 0.003 | auto | 3 | 27.5% | 10.0-45.0 | 0,2 |" in text
    assert "| full | noise-aware-adamw (floor 1e-06 fixed) | 0.003 | auto | 3 | 30.0% | 30.0-30.0 | 1 |" in text
    assert "| full | noise-aware-adamw (floor 2 sd) | 0.003 | auto | 3 | 41.0% | 41.0-41.0 | 1 |" in text
    # paired per floor: the fixed default only on seed 0 (+3 points), the raised one and 2 sd on seed 1
    assert "| full | auto | 3 | 0.003 | 1e-10 fixed | 0 | 42.0% | 45.0% | +3.0 | +3.0 to +3.0 |" in text
    assert "| full | auto | 3 | 0.003 | 1e-06 fixed | 1 | 38.0% | 30.0% | -8.0 | -8.0 to -8.0 |" in text
    assert "| full | auto | 3 | 0.003 | 2 sd | 1 | 38.0% | 41.0% | +3.0 | +3.0 to +3.0 |" in text
    assert bt.report(old) == bt.table(old) + "\n\n" + bt.step_table(old)


def val_row(variant, eps, seed, acc, lr, optimizer="adamw", pipeline="lora"):
    r = row(variant, eps, seed, None, lr, optimizer, pipeline)
    del r["test_accuracy"]
    r.update(split="validation", validation_accuracy=acc)
    return r


def test_rates_are_chosen_on_validation_and_scored_on_test(bt):
    """The validation rows pick a rate per (pipeline, optimizer, variant, epsilon) by their mean
    accuracy; the table shows the test runs at that rate only, and validation rows enter no other
    table (their accuracy is not a test accuracy)."""
    test = [row("dpsgd-poisson", 1.0, s, a, 1e-2, "adamw", "lora") for s, a in [(0, 0.40), (1, 0.42)]]
    test += [row("dpsgd-poisson", 1.0, 0, 0.99, 3e-3, "adamw", "lora")]   # not the chosen rate: ignored
    test += [row("auto", 1.0, 0, 0.45, 3e-2, "adamw", "lora")]
    val = [val_row("dpsgd-poisson", 1.0, 0, 0.30, 3e-3), val_row("dpsgd-poisson", 1.0, 1, 0.36, 3e-3),
           val_row("dpsgd-poisson", 1.0, 0, 0.35, 1e-2), val_row("dpsgd-poisson", 1.0, 1, 0.35, 1e-2),
           val_row("auto", 1.0, 0, 0.50, 1e-1), val_row("auto", 1.0, 0, 0.20, 3e-2)]
    text = bt.report(test + val)
    assert text.startswith(bt.report(test) + "\n\nRates chosen on the validation split, scored on test:")
    # 1e-2 wins on the mean (35.0 against 33.0) though 3e-3 has the best single seed
    assert ("| lora | adamw | dpsgd-poisson | 1 | 0.003: 33.0, 0.01: 35.0 | 0.01 | 41.0% | 40.0-42.0 | 0,1 |"
            in text)
    # the planner's chosen rate has no test run yet
    assert "| lora | adamw | auto | 1 | 0.03: 20.0, 0.1: 50.0 | 0.1 | - | - | - |" in text
    # ties go to the smaller rate
    tie = [val_row("auto", 3.0, 0, 0.4, 1e-1), val_row("auto", 3.0, 0, 0.4, 1e-2)]
    assert "| 0.01: 40.0, 0.1: 40.0 | 0.01 |" in bt.selection_table(tie)


def test_a_rerun_seed_replaces_its_earlier_test_run(bt):
    """A seed scored again at the chosen rate counts once, by its latest record; the other seeds
    keep theirs."""
    val = [val_row("auto", 8.0, 0, 0.45, 3e-2, pipeline="full")]
    old = [row("auto", 8.0, s, a, 3e-2, "adamw", "full") for s, a in [(0, 0.10), (1, 0.20)]]
    new = [row("auto", 8.0, 0, 0.40, 3e-2, "adamw", "full")]
    text = bt.selection_table(val + old + new)
    assert "| full | adamw | auto | 8 | 0.03: 45.0 | 0.03 | 30.0% | 20.0-40.0 | 0,1 |" in text
