"""The on-disk cache of calibrated guarantees (corrnoise.accounting.cache).

A hit must return the guarantee that was computed, for exactly the same event; anything doubtful
(a corrupted or edited file, another mechanism, batching, participation, target, method or
option) must be recomputed; estimates and seeded experiments are never stored."""

from __future__ import annotations

import json

import numpy as np
import pytest

from corrnoise.accounting import calibrate, cache as cc, parse_batching
from corrnoise.strategies import Toeplitz, parse_strategy


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRNOISE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def counted(monkeypatch):
    """Count the calibrations cached_calibrate really runs."""
    calls = []
    real = cc.calibrate

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(cc, "calibrate", spy)
    return calls


C = parse_strategy("bsr:4", 40)
BC = "block-cyclic:4:0.2"


def _entries(directory):
    return sorted((directory / "guarantees").glob("*.json"))


def test_a_hit_returns_the_same_guarantee_without_recomputing(cache_dir, counted):
    first = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    assert len(counted) == 1 and len(_entries(cache_dir)) == 1
    second = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    assert len(counted) == 1  # no second calibration
    assert second.extras.get("cached") is True and "cached" not in first.extras
    assert (second.noise_std, second.epsilon, second.delta, second.method, second.kind) == \
        (first.noise_std, first.epsilon, first.delta, first.method, first.kind)
    # the same as an uncached calibration by the code itself (deterministic PLD)
    assert second.noise_std == calibrate(C, BC, epsilon=2.0, delta=1e-5).noise_std
    assert not list((cache_dir / "guarantees").glob(".tmp-*"))  # written atomically, nothing left over


@pytest.mark.parametrize("change", ["mechanism", "batching", "participation", "epsilon", "delta", "option", "method"])
def test_any_other_event_target_or_option_misses(cache_dir, counted, change):
    coeffs = np.asarray(C.coefficients, dtype=float)
    T = Toeplitz(coeffs, 40)
    base = dict(strategy=T, batching=parse_batching("none", "cyclic:4:10"), epsilon=2.0, delta=1e-5, opts={})
    cc.cached_calibrate(base["strategy"], base["batching"], epsilon=2.0, delta=1e-5)
    other = dict(base)
    if change == "mechanism":  # same kind and n, other coefficients: the fingerprint differs
        tweaked = coeffs.copy()
        tweaked[1] *= 1.0001
        other["strategy"] = Toeplitz(tweaked, 40)
    elif change == "batching":
        other["batching"] = parse_batching("block-cyclic:4:0.2")
    elif change == "participation":
        other["batching"] = parse_batching("none", "cyclic:2:20")
    elif change == "epsilon":
        other["epsilon"] = 2.0 + 1e-12
    elif change == "delta":
        other["delta"] = 1.1e-5
    elif change == "option":
        other["batching"] = parse_batching("block-cyclic:4:0.2")
        cc.cached_calibrate(T, other["batching"], epsilon=2.0, delta=1e-5)
        other["opts"] = {"discretization": 1e-3}
    elif change == "method":
        other["batching"] = parse_batching("poisson:0.1")
        other["strategy"] = parse_strategy("identity", 40)
        cc.cached_calibrate(other["strategy"], other["batching"], epsilon=2.0, delta=1e-5)
        other["opts"] = {"method": "rdp"}
    before = len(counted)
    res = cc.cached_calibrate(other["strategy"], other["batching"], epsilon=other["epsilon"], delta=other["delta"],
                              **other["opts"])
    assert len(counted) == before + 1 and "cached" not in res.extras


def _tamper(path, edit):
    entry = json.loads(path.read_text())
    edit(entry)
    path.write_text(json.dumps(entry))


@pytest.mark.parametrize("how", ["garbage", "truncated", "noise_edited", "noise_edited_and_rehashed",
                                 "key_swapped", "estimate", "format"])
def test_a_corrupted_or_edited_entry_is_ignored_and_recomputed(cache_dir, counted, how):
    first = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    (path,) = _entries(cache_dir)
    if how == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif how == "truncated":
        path.write_text(path.read_text()[:50])
    elif how == "noise_edited":  # the digest no longer matches
        _tamper(path, lambda e: e["result"].update(noise_std=first.noise_std / 2))
    elif how == "noise_edited_and_rehashed":  # digest recomputed, but the numbers disagree with C
        def edit(e):
            e["result"]["noise_std"] = first.noise_std / 2
            e["digest"] = cc._digest(e["key"], e["result"])
        _tamper(path, edit)
    elif how == "key_swapped":  # an entry for another epsilon under this file name
        def edit(e):
            e["key"]["epsilon"] = float(8.0).hex()
            e["digest"] = cc._digest(e["key"], e["result"])
        _tamper(path, edit)
    elif how == "estimate":  # a rehashed entry claiming a non-guarantee kind
        def edit(e):
            e["result"]["kind"] = "estimate"
            e["digest"] = cc._digest(e["key"], e["result"])
        _tamper(path, edit)
    elif how == "format":
        _tamper(path, lambda e: e.update(format="something-else"))
    again = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    assert len(counted) == 2 and "cached" not in again.extras
    assert again.noise_std == first.noise_std
    # the recomputed guarantee replaced the bad entry
    assert cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5).extras.get("cached") is True


def test_cache_off_and_unwritable_cache_still_calibrate(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("CORRNOISE_CACHE", "off")
    assert cc.cache_dir() is None
    a = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    b = cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5)
    assert len(counted) == 2 and a.noise_std == b.noise_std and "cached" not in b.extras
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CORRNOISE_CACHE", str(blocker))
    assert cc.cached_calibrate(C, BC, epsilon=2.0, delta=1e-5).noise_std == a.noise_std


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("CORRNOISE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir() == tmp_path / "xdg" / "corrnoise"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.cache_dir() == tmp_path / "home" / ".cache" / "corrnoise"


def test_monte_carlo_only_verified_guarantees_and_no_seeded_runs_are_stored(cache_dir, counted):
    from corrnoise.accounting import get_method

    bat = parse_batching("balls-in-bins:4")
    M = parse_strategy("bsr:2", 16)
    # a seeded experiment is computed, never stored or served
    cc.cached_calibrate(M, bat, epsilon=2.0, delta=1e-2, samples=1 << 12, seed=3)
    assert not _entries(cache_dir)
    ver = cc.cached_calibrate(M, bat, epsilon=2.0, delta=1e-2, samples=1 << 12)
    assert ver.kind == "guarantee" and ver.extras["verified"] is True
    assert len(_entries(cache_dir)) == 1
    hit = cc.cached_guarantee(M, bat, epsilon=2.0, delta=1e-2, samples=1 << 12)
    assert hit is not None and hit.noise_std == ver.noise_std
    # an estimate is refused by the store itself
    est = get_method("mc").calibrate(M, bat, 2.0, 1e-2, samples=1 << 12, estimate=True)
    key = cc.cache_key(cc.as_event(M, bat), 2.0, 1e-2, "mc", 1e-3, {"samples": 1 << 10})
    assert est.kind == "estimate" and not cc.store(cache_dir, key, est, cc.as_event(M, bat))
    assert cc.cache_key(cc.as_event(M, bat), 2.0, 1e-2, "mc", 1e-3, {"estimate": True}) is None


def test_the_key_digests_the_accounting_code(monkeypatch):
    version = cc.accountant_version()
    assert version.startswith(f"{cc.ACCOUNTANT_VERSION}:") and "dp_accounting=" in version
    monkeypatch.setattr(cc, "_VERSION", None)
    monkeypatch.setattr(cc, "ACCOUNTANT_VERSION", cc.ACCOUNTANT_VERSION + 1)
    assert cc.accountant_version() != version


def test_the_planner_reuses_an_optimized_strategy_only_if_it_rebuilds_to_the_same_fingerprint(cache_dir):
    from corrnoise.optimize import optimize_blt
    from corrnoise.planner.store import cached_strategy
    from corrnoise.strategies import ColumnNormalized, mechanism_fingerprint

    runs = []

    def build():
        runs.append(1)
        return optimize_blt(24, buffers=2, participation="cyclic:3:8")

    args = {"n": 24, "buffers": 2, "participation": "cyclic:3:8"}
    first = cached_strategy("optimize_blt", args, build)
    second = cached_strategy("optimize_blt", args, build)
    assert len(runs) == 1 and mechanism_fingerprint(second) == mechanism_fingerprint(first)
    np.testing.assert_array_equal(second.matrix(), first.matrix())  # bit for bit
    cached_strategy("optimize_blt", dict(args, buffers=1), build)  # other arguments: optimized again
    assert len(runs) == 2
    (path,) = [p for p in (cache_dir / "designs").glob("*.json")
               if json.loads(p.read_text())["key"]["args"] == args]
    entry = json.loads(path.read_text())
    assert entry["body"]["params"]["alpha"]
    entry["body"]["params"]["alpha"] = [a * 1.5 for a in entry["body"]["params"]["alpha"]]
    path.write_text(json.dumps(entry))  # edited: the digest fails
    cached_strategy("optimize_blt", args, build)
    assert len(runs) == 3
    entry = json.loads(path.read_text())
    entry["body"]["fingerprint"] = "0" * 64  # rehashed but the rebuilt C has another fingerprint
    from corrnoise.planner import store

    entry["digest"] = store._digest(entry["key"], entry["body"])
    path.write_text(json.dumps(entry))
    cached_strategy("optimize_blt", args, build)
    assert len(runs) == 4
    cn = cached_strategy("colnorm", {"n": 8}, lambda: ColumnNormalized(parse_strategy("bsr:2", 8)))
    again = cached_strategy("colnorm", {"n": 8}, lambda: 1 / 0)
    assert isinstance(again, ColumnNormalized) and mechanism_fingerprint(again) == mechanism_fingerprint(cn)
