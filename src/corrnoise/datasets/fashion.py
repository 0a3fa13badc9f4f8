"""Fashion-MNIST from local IDX files (never downloaded at run time).

Search order (the first directory holding any of the split's two files is used; ``NAME`` or
``NAME.gz`` are both accepted, gzip is detected from the content):

1. ``$CORRNOISE_DATA/fashion-mnist``
2. ``/usr/share/datasets/fashion-mnist`` (Debian package ``dataset-fashion-mnist`` installed)
3. ``$CORRNOISE_DATA/FashionMNIST/raw`` (the layout torchvision writes)
4. ``./.data/usr/share/datasets/fashion-mnist`` (``make data`` run in the current directory)
5. ``<repository root>/.data/usr/share/datasets/fashion-mnist`` (``make data`` in a source
   checkout; the root is the directory holding ``pyproject.toml`` three levels above this file,
   i.e. only for an editable / in-place install)

A directory that holds one file of a split but not the other is an error (it names the missing
file) rather than silently falling through to a later directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import CorrnoiseError
from .idx import read_idx

__all__ = ["FILES", "HOW_TO_GET", "fashion_mnist", "find_fashion_mnist", "search_dirs"]

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
LOCAL_SUBDIR = Path(".data/usr/share/datasets/fashion-mnist")
HOW_TO_GET = ("get it with `make data` (Debian package dataset-fashion-mnist) or put the four "
              "(.gz) IDX files in $CORRNOISE_DATA/fashion-mnist")
NUM_CLASSES = 10


def _repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else None


def search_dirs() -> list[Path]:
    """The directories searched for the IDX files, in order (see the module docstring)."""
    env = os.environ.get("CORRNOISE_DATA")
    dirs: list[Path] = []
    if env:
        dirs.append(Path(env) / "fashion-mnist")
    dirs.append(SYSTEM_DIR)
    if env:
        dirs.append(Path(env) / "FashionMNIST" / "raw")
    dirs.append(Path.cwd() / LOCAL_SUBDIR)
    root = _repo_root()
    if root is not None:
        dirs.append(root / LOCAL_SUBDIR)
    out: list[Path] = []
    for d in dirs:  # the same directory reached twice (cwd = repo root) is listed once
        if all(d.resolve() != o.resolve() for o in out):
            out.append(d)
    return out


def _file_in(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        p = directory / name
        if p.is_file():
            return p
    return None


def _check_split(split: str) -> str:
    if split not in FILES:
        raise CorrnoiseError("split", f"must be 'train' or 'test', got {split!r}")
    return split


def find_fashion_mnist(split: str = "train") -> tuple[Path, Path]:
    """Paths of the (images, labels) IDX files of ``split`` by the search order above."""
    stems = FILES[_check_split(split)]
    for d in search_dirs():
        found = [_file_in(d, s) for s in stems]
        if all(f is None for f in found):
            continue
        for s, f in zip(stems, found):
            if f is None:
                raise CorrnoiseError(str(d / s), f"missing (its partner file is in {d}); {HOW_TO_GET}")
        return found[0], found[1]
    searched = ", ".join(str(d) for d in search_dirs())
    raise CorrnoiseError("fashion-mnist", f"{stems[0]}(.gz) not found in {searched}; {HOW_TO_GET}")


def _read(path: Path) -> np.ndarray:
    try:
        return read_idx(path)
    except CorrnoiseError as exc:
        raise CorrnoiseError(exc.param, f"{exc.message}; {HOW_TO_GET}") from None


def fashion_mnist(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """(images float32 in [0, 1] of shape (N, 28, 28), labels int64 in 0..9) of ``split``.

    Raw pixels / 255, no standardization (:func:`corrnoise.datasets.load` standardizes with
    statistics of the training split).
    """
    img_path, lab_path = find_fashion_mnist(split)
    images, labels = _read(img_path), _read(lab_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise CorrnoiseError(str(img_path), f"expected uint8 images of shape (N, 28, 28), got {images.dtype} "
                                            f"{images.shape}; {HOW_TO_GET}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise CorrnoiseError(str(lab_path), f"expected 1-d uint8 labels, got {labels.dtype} {labels.shape}; "
                                            f"{HOW_TO_GET}")
    if labels.shape[0] != images.shape[0]:
        raise CorrnoiseError(str(lab_path), f"{labels.shape[0]} labels but {img_path.name} holds "
                                            f"{images.shape[0]} images; the two files do not belong together")
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise CorrnoiseError(str(lab_path), f"label {int(labels.max())} outside 0..9; {HOW_TO_GET}")
    x = images.astype(np.float32)
    x /= np.float32(255.0)
    return x, labels.astype(np.int64)
