"""Text datasets (corrnoise.datasets.text): the fortune parser on small files written here, the
category loader, the stratified split, GCIDE's cleaning, and the one-line error when the data is
missing. Nothing here reads .data/ or the system's files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from corrnoise.datasets import text
from corrnoise.errors import CorrnoiseError


def write(path: Path, content: str) -> Path:
    path.write_text(content, encoding="utf-8")
    return path


def test_parse_fortunes_splits_on_percent_lines_and_cleans_entries():
    raw = ("A compliment is something like a kiss through a veil.\n\t\t-- Victor Hugo\n%\n"
           "\n%\n"                                  # an empty entry is dropped
           "50% of it is\n100% percent% inside a line\n%\n"  # % inside a line is text
           "_\bb_\bo_\bl_\bd and B\bBo\bol\bld\bd\n%\n"     # overstrike underline / bold removed
           "last entry without a trailing percent\n")
    assert text.parse_fortunes(raw) == [
        "A compliment is something like a kiss through a veil.\n\t\t-- Victor Hugo",
        "50% of it is\n100% percent% inside a line",
        "bold and Bold",
        "last entry without a trailing percent",
    ]


def test_parse_fortunes_accepts_crlf_and_keeps_inner_blank_lines():
    assert text.parse_fortunes("one\r\n\r\ntwo\r\n%\r\nthree\r\n") == ["one\n\ntwo", "three"]


def test_fortunes_reads_categories_largest_first(tmp_path):
    write(tmp_path / "small", "s1\n%\n")
    write(tmp_path / "big", "b1\n%\nb2\n%\nb3\n%\n")
    write(tmp_path / "mid", "m1\n%\nm2\n%\n")
    (tmp_path / "big.dat").write_bytes(b"\x00\x00\x00\x02")   # strfile index: not a category
    (tmp_path / "big.u8").symlink_to("big")                   # alias: not a second category
    texts, labels, names = text.fortunes(top=2, directory=tmp_path)
    assert names == ["big", "mid"]
    assert texts == ["b1", "b2", "b3", "m1", "m2"]
    assert labels.tolist() == [0, 0, 0, 1, 1] and labels.dtype == np.int64
    assert text.fortunes(top=None, directory=tmp_path)[2] == ["big", "mid", "small"]


def test_fortunes_found_through_corrnoise_data(tmp_path, monkeypatch):
    (tmp_path / "fortunes").mkdir()
    write(tmp_path / "fortunes" / "cat", "x\n%\ny\n")
    monkeypatch.setenv("CORRNOISE_DATA", str(tmp_path))
    assert text.find_fortunes() == tmp_path / "fortunes"
    assert text.fortunes()[0] == ["x", "y"]


def _hide_system_data(monkeypatch, tmp_path):
    """Point every search path at empty places: CORRNOISE_DATA, the system paths, cwd, the checkout."""
    monkeypatch.setenv("CORRNOISE_DATA", str(tmp_path / "nothing"))
    monkeypatch.setattr(text, "FORTUNES_DIR", tmp_path / "sys" / "usr/share/games/fortunes")
    monkeypatch.setattr(text, "GCIDE_FILE", tmp_path / "sys" / "usr/share/dictd/gcide.dict.dz")
    monkeypatch.setattr(text, "_repo_root", lambda: None)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("loader, param", [("fortunes", "fortunes"), ("gcide_text", "gcide")])
def test_a_missing_text_dataset_is_one_line_that_says_make_data(tmp_path, monkeypatch, loader, param):
    _hide_system_data(monkeypatch, tmp_path)
    with pytest.raises(CorrnoiseError) as err:
        getattr(text, loader)()
    msg = str(err.value)
    assert "\n" not in msg and "make data" in msg and msg.startswith(f"{param}:")


def test_gcide_text_drops_header_and_source_tags(tmp_path):
    raw = ("00-database-info\n   This is the header.\n\n"
           "Arrive \\Ar*rive\"\\, v. i.\n   1. To reach a place.\n      [1913 Webster]\n\n"
           "   2. To come; said of time.\n      [1913 Webster]\n\n"
           "Arroba \\Ar*ro\"ba\\, n.\n   A Spanish weight.\n   [PJC]\n")
    path = tmp_path / "gcide.dict.dz"
    path.write_bytes(gzip.compress(raw.encode()))
    out = text.gcide_text(path=path)
    assert "00-database" not in out and "[1913 Webster]" not in out and "[PJC]" not in out
    assert out.split("\n\n") == ["Arrive \\Ar*rive\"\\, v. i.\n   1. To reach a place.\n   2. To come; said of time.",
                                 "Arroba \\Ar*ro\"ba\\, n.\n   A Spanish weight."]
    assert text.gcide_text(path=path, stride=2).startswith("Arrive")
    assert text.gcide_text(path=path, max_chars=70).count("\n\n") == 0


def test_split_indices_is_stratified_disjoint_and_seeded():
    labels = np.array([0] * 10 + [1] * 5)
    tr, te = text.split_indices(labels, 0.2, seed=3)
    assert sorted(np.concatenate([tr, te]).tolist()) == list(range(15))
    assert np.bincount(labels[te]).tolist() == [2, 1]
    assert np.array_equal(te, text.split_indices(labels, 0.2, seed=3)[1])
    with pytest.raises(CorrnoiseError, match="test_fraction"):
        text.split_indices(labels, 1.0)
