"""Text from local Debian packages (never downloaded at run time): fortunes and GCIDE.

* **fortunes** (Debian package ``fortunes``, fortune-mod's data): ``/usr/share/games/fortunes/``
  holds one file per category (``people``, ``definitions``, ``computers`` ...), quotations
  separated by lines holding only ``%``. :func:`fortunes` reads them as (texts, labels,
  category names): the private fine-tuning data of ``benchmarks/bench_text.py``.
* **GCIDE** (Debian package ``dict-gcide``, the GNU Collaborative International Dictionary of
  English: Webster's 1913 dictionary, public domain, with later additions; GPL): one
  gzip-compatible file ``/usr/share/dictd/gcide.dict.dz``, about 40 MB of English text.
  :func:`gcide_text` reads it: the *public* pretraining text (another domain than fortunes).

Search order, the first hit wins (as :mod:`corrnoise.datasets.fashion`): ``$CORRNOISE_DATA/<name>``,
the system path of the installed package, then ``.data/<system path>`` under the current
directory and under the source checkout (``make data`` unpacks the packages there). A missing
dataset is a one-line :class:`CorrnoiseError` that says ``make data``.
"""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import numpy as np

from ..errors import CorrnoiseError

__all__ = ["FORTUNES_DIR", "GCIDE_FILE", "find_fortunes", "find_gcide", "fortune_categories", "fortunes",
           "gcide_text", "parse_fortunes", "read_fortune_file", "split_indices"]

FORTUNES_DIR = Path("/usr/share/games/fortunes")
GCIDE_FILE = Path("/usr/share/dictd/gcide.dict.dz")
#: the files of fortunes' directory that are not categories: strfile's indices, UTF-8 aliases
NOT_CATEGORY = (".dat", ".u8")
#: GCIDE's source tags on lines of their own ("[1913 Webster]", "[WordNet 1.5]", "[PJC]" ...)
_SOURCE_TAG = re.compile(r"^\s*\[[^\]\n]{1,40}\]\s*$", re.MULTILINE)
#: overstrike (a character, a backspace): old fortunes underline or embolden with it
_OVERSTRIKE = re.compile(r".\x08")


def _how_to_get(package: str, env_name: str) -> str:
    return f"run `make data` (Debian package {package}) or put it in $CORRNOISE_DATA/{env_name}"


def _repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else None


def _candidates(system: Path, env_name: str) -> list[Path]:
    """Where a dataset may be, in search order (see the module docstring), each path once."""
    found: list[Path] = []
    env = os.environ.get("CORRNOISE_DATA")
    if env:
        found.append(Path(env) / env_name)
    found.append(system)
    local = Path(".data") / system.relative_to("/")
    found.append(Path.cwd() / local)
    root = _repo_root()
    if root is not None:
        found.append(root / local)
    out: list[Path] = []
    for p in found:
        if all(p.resolve() != o.resolve() for o in out):
            out.append(p)
    return out


def find_fortunes() -> Path:
    """The first directory of the search order that holds fortune category files."""
    for d in _candidates(FORTUNES_DIR, "fortunes"):
        if d.is_dir() and fortune_categories(d):
            return d
    raise CorrnoiseError("fortunes", f"no fortune files found; {_how_to_get('fortunes', 'fortunes')}")


def find_gcide() -> Path:
    """The GCIDE file (``gcide.dict.dz``) of the search order."""
    for p in _candidates(GCIDE_FILE, "gcide.dict.dz"):
        if p.is_file():
            return p
    raise CorrnoiseError("gcide", f"gcide.dict.dz not found; {_how_to_get('dict-gcide', 'gcide.dict.dz')}")


def fortune_categories(directory: Path) -> list[str]:
    """The category names of a fortunes directory: its regular files minus indices and aliases."""
    return sorted(p.name for p in Path(directory).iterdir()
                  if p.is_file() and not p.is_symlink() and not p.name.endswith(NOT_CATEGORY)
                  and not p.name.startswith("."))


def parse_fortunes(text: str) -> list[str]:
    """The quotations of one fortune file: blocks between lines that hold only ``%``, overstrike
    removed, surrounding blank lines stripped, empty blocks dropped."""
    entries, block = [], []
    for line in text.split("\n"):
        if line.rstrip("\r") == "%":
            entries.append("\n".join(block))
            block = []
        else:
            block.append(line.rstrip("\r"))
    entries.append("\n".join(block))
    cleaned = (_OVERSTRIKE.sub("", e).strip("\n").rstrip() for e in entries)
    return [e for e in cleaned if e.strip()]


def read_fortune_file(path: Path) -> list[str]:
    """The quotations of the fortune file at ``path`` (UTF-8; undecodable bytes replaced)."""
    return parse_fortunes(Path(path).read_bytes().decode("utf-8", errors="replace"))


def fortunes(top: int | None = 10, directory: Path | None = None) -> tuple[list[str], np.ndarray, list[str]]:
    """(texts, labels int64, category names) of the ``top`` largest categories (all when None).

    Label ``k`` is ``names[k]``; categories are ordered by size, largest first (ties by name).
    ``directory``: a fortunes directory (default: the search order of the module docstring).
    """
    d = Path(directory) if directory is not None else find_fortunes()
    if not d.is_dir() or not fortune_categories(d):
        raise CorrnoiseError("fortunes", f"no fortune files in {d}; {_how_to_get('fortunes', 'fortunes')}")
    per_cat = {name: read_fortune_file(d / name) for name in fortune_categories(d)}
    names = sorted((n for n in per_cat if per_cat[n]), key=lambda n: (-len(per_cat[n]), n))
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise CorrnoiseError("top", f"must be a positive integer or None, got {top!r}")
        names = names[:top]
    texts = [t for n in names for t in per_cat[n]]
    labels = np.array([k for k, n in enumerate(names) for _ in per_cat[n]], dtype=np.int64)
    return texts, labels, names


def split_indices(labels: np.ndarray, test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices, stratified: each class's examples shuffled with ``seed`` and the
    first ``round(test_fraction * size)`` of each put in the test split."""
    if not 0.0 < test_fraction < 1.0:
        raise CorrnoiseError("test_fraction", f"must be in (0, 1), got {test_fraction!r}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def gcide_text(max_chars: int | None = None, path: Path | None = None, stride: int = 1) -> str:
    """GCIDE's dictionary text: the dictd header entries (``00-database-*``) and the source tags
    on lines of their own (``[1913 Webster]`` ...) removed.

    ``stride``: keep every ``stride``-th entry (entries are separated by blank-line-led
    headwords), so a ``max_chars`` prefix spans the alphabet instead of its first letters.
    """
    p = Path(path) if path is not None else find_gcide()
    try:
        raw = gzip.open(p).read() if p.read_bytes()[:2] == b"\x1f\x8b" else p.read_bytes()
    except OSError as exc:
        raise CorrnoiseError(str(p), f"unreadable ({exc}); {_how_to_get('dict-gcide', 'gcide.dict.dz')}") from None
    text = _SOURCE_TAG.sub("", raw.decode("utf-8", errors="replace"))
    entries = [e for e in re.split(r"\n\s*\n(?=\S)", text) if e.strip() and not e.startswith("00-database")]
    kept, size = [], 0
    for e in entries[::max(1, int(stride))]:
        e = re.sub(r"\n\s*\n", "\n", e.strip())
        if max_chars is not None and size + len(e) > max_chars:
            break
        kept.append(e)
        size += len(e) + 2
    return "\n\n".join(kept)
