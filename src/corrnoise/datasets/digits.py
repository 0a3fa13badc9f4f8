"""scikit-learn's bundled digits (1797 8x8 images, 10 classes; shipped with scikit-learn).

The split is the one ``corrnoise train`` has always used (``train.load_digits_split``): a
stratified 80/20 split with ``random_state=0``; pixels are scaled by the constant 1/16, so no
statistic of the training data is computed outside the private algorithm.
"""

from __future__ import annotations

import numpy as np

from ..errors import check_real

__all__ = ["digits"]


def digits(test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): float32 (N, 64) pixels / 16 and int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    test_fraction = check_real("test_fraction", test_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=0, stratify=y)
    return xtr, ytr, xte, yte
