"""Binary-tree aggregation matrices (tutorial Sec. 2.7)."""

from __future__ import annotations

import numpy as np

from ..errors import check_int


def tree_matrix(n: int) -> np.ndarray:
    """The binary-tree strategy C_tree for n leaves, rows in postorder (tutorial Sec. 2.7).

    Built by the recursion P_0 = (1), P_{i+1} = [[P_i, 0], [0, P_i], [1, 1]] for
    k = ceil(log2 n); when n is not a power of two we keep the first n leaves (zero padding,
    footnote 12) and drop the rows that no longer touch any kept leaf. Shape (rows, n) with
    rows = 2n - 1 when n is a power of two.
    """
    n = check_int("n", n, minimum=1)
    k = int(np.ceil(np.log2(n))) if n > 1 else 0
    p = np.ones((1, 1))
    for _ in range(k):
        size = p.shape[1]
        top = np.hstack([p, np.zeros_like(p)])
        mid = np.hstack([np.zeros_like(p), p])
        p = np.vstack([top, mid, np.ones((1, 2 * size))])
    c = p[:, :n]
    return c[np.any(c != 0.0, axis=1)]
