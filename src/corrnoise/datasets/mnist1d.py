"""MNIST-1D (Greydanus & Kobak, 2020), generated locally by the ``mnist1d`` package.

Only ``mnist1d.data.make_dataset`` is called: it builds the signals from the ten built-in
templates with numpy/scipy. ``mnist1d.data.get_dataset`` is never used -- it downloads a
pickle from GitHub and writes ``./mnist1d_data.pkl``.

The data are a deterministic function of ``(n_train + n_test, seed)``: the generator draws
``ceil((n_train + n_test) / 10)`` signals per class with the package's default transforms
(length 40), shuffles them, and centres/scales the whole (synthetic) set to mean 0, std 1;
the first ``n_train`` rows are the training split and the next ``n_test`` the test split.
``make_dataset`` seeds numpy's and Python's *global* generators; their states are restored
afterwards so that loading data never changes anyone else's random stream.
"""

from __future__ import annotations

import random

import numpy as np

from ..errors import CorrnoiseError, check_int

__all__ = ["DEFAULT_SEED", "SEQUENCE_LENGTH", "mnist1d"]

#: The package's own default seed (``get_dataset_args().seed``); a data seed, not a noise seed.
DEFAULT_SEED = 42
SEQUENCE_LENGTH = 40


def mnist1d(n_train: int = 20_000, n_test: int = 5_000, seed: int = DEFAULT_SEED
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): float32 (N, 40) signals and int64 labels 0..9."""
    n_train = check_int("n_train", n_train, minimum=1, maximum=10_000_000)
    n_test = check_int("n_test", n_test, minimum=1, maximum=10_000_000)
    seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1)
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise CorrnoiseError("dataset", "mnist1d needs the mnist1d package: pip install mnist1d") from None

    args = get_dataset_args()
    total = n_train + n_test
    args.num_samples = -(-total // 10) * 10
    args.train_split = 1.0  # everything lands in 'x'; the split is made below
    args.seed = seed
    args.url = None  # make_dataset never reads it; make sure nothing could fetch it
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x = np.asarray(data["x"], dtype=np.float32)
    y = np.asarray(data["y"], dtype=np.int64)
    return x[:n_train], y[:n_train], x[n_train:total], y[n_train:total]
