"""Tutorial Tables 2.2 (max loss) and 2.3 (RMS loss), prefix workload, single participation."""

import csv
from pathlib import Path

import pytest

from corrnoise.losses import loss_report
from corrnoise.strategies import parse_strategy

DATA = Path(__file__).parent / "data"
TOL = 0.0015


def _table(name):
    with open(DATA / name) as fh:
        return [{k: float(v) if v not in ("", "NaN") else None for k, v in row.items()} for row in csv.DictReader(fh)]


MAX_TABLE = _table("tutorial_table_2_2_max_loss.csv")
RMS_TABLE = _table("tutorial_table_2_3_rms_loss.csv")

MAX_CASES = [(int(r["n"]), col, r[col]) for r in MAX_TABLE for col in ("identity", "workload", "toeplitz", "colnorm_toeplitz")
             if r[col] is not None and not (col == "colnorm_toeplitz" and r["n"] > 2048)]
RMS_CASES = [(int(r["n"]), col, r[col]) for r in RMS_TABLE for col in ("identity", "workload", "full_h2", "streaming_h2")
             if r[col] is not None and not (col == "full_h2" and r["n"] > 2048)]
NAMES = {"identity": "identity", "workload": "prefix", "toeplitz": "toeplitz-sqrt",
         "colnorm_toeplitz": "toeplitz-sqrt+colnorm", "full_h2": "tree:full",
         "streaming_h2": "tree:ls"}


@pytest.mark.parametrize("n,column,expected", MAX_CASES)
def test_table_2_2_max_loss(n, column, expected):
    assert loss_report(parse_strategy(NAMES[column], n)).max_loss == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("n,column,expected", RMS_CASES)
def test_table_2_3_rms_loss(n, column, expected):
    assert loss_report(parse_strategy(NAMES[column], n)).rms_loss == pytest.approx(expected, abs=TOL)


def test_every_required_cell_is_checked():
    assert len(MAX_CASES) == 11 * 3 + 9 and len(RMS_CASES) == 11 * 3 + 9


def test_rms_never_exceeds_max_loss():  # tutorial Lemma 2.24
    for name in ("identity", "prefix", "toeplitz-sqrt", "bsr:4", "tree", "tree:ls", "tree:full", "dpcgd:0.5",
                 "toeplitz-sqrt+colnorm"):
        r = loss_report(parse_strategy(name, 64))
        assert r.rms_loss <= r.max_loss + 1e-12
