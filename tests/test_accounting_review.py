"""Regression tests from a privacy review of the accounting layer (each failed before its fix)."""

from __future__ import annotations

import pytest

from corrnoise.accounting import NoBatching, account, parse_batching
from corrnoise.errors import CorrnoiseError
from corrnoise.losses import mechanism_sensitivity
from corrnoise.participation import Cyclic
from corrnoise.strategies import parse_strategy


def test_parse_batching_never_drops_a_participation_given_with_a_nobatching_value():
    """parse_batching(NoBatching(), 'cyclic:5:2') used to return NoBatching(Single()) silently:
    accounting it would use the single-participation sensitivity (2.5x smaller mu here) and
    understate epsilon.  The participation must either be honoured or refused."""
    strategy = parse_strategy("bsr:2", 10)
    asked = Cyclic(5, 2)
    try:
        batching = parse_batching(NoBatching(), "cyclic:5:2")
    except CorrnoiseError as exc:
        assert exc.param == "participation"
        return
    assert batching.participation == asked
    expected = mechanism_sensitivity(strategy, asked).value  # sens(C, Pi) with Pi = cyclic:5:2
    result = account(strategy, batching, delta=1e-5, noise_std=1.0)
    assert result.extras["sensitivity"] == pytest.approx(expected)


def test_parse_batching_accepts_a_matching_participation_with_a_nobatching_value():
    batching = parse_batching(NoBatching(Cyclic(5, 2)), "cyclic:5:2")
    assert batching.participation == Cyclic(5, 2)
