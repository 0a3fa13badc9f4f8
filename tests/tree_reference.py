"""Materialized references for the binary tree, built independently of corrnoise.linalg.tree's
recurrence and node numbering: the padded tree's postorder from tutorial Sec. 2.7's recursion,
B_tree from the maximal dyadic partitions, and the streaming least-squares decoder by pinv."""

from __future__ import annotations

import numpy as np

from corrnoise.linalg.tree import tree_matrix


def padded_nodes(n: int):
    """(C, intervals): C = rows of the 2^K-leaf tree touching the first n leaves, restricted to
    them (tutorial footnote 12); intervals = each row's full (unclipped) [first, last] leaf."""
    k = max(n - 1, 0).bit_length()
    p = tree_matrix(2**k)
    keep = p[:, :n].any(axis=1)
    p = p[keep]
    intervals = [(int(np.flatnonzero(r)[0]), int(np.flatnonzero(r)[-1])) for r in p]
    return p[:, :n], intervals


def prefix_decoder(n: int, decoding: str) -> tuple[np.ndarray, np.ndarray]:
    """(C, B) with B C = A (prefix sums): ``plain`` B = B_tree (sum of the maximal dyadic
    partition of [0, t]); ``ls`` row t = A[t] pinv(C restricted to the nodes complete by t)."""
    c, intervals = padded_nodes(n)
    b = np.zeros((n, c.shape[0]))
    if decoding == "plain":
        index = {iv: i for i, iv in enumerate(intervals)}
        for t in range(n):
            start, count = 0, t + 1
            for level in reversed(range(count.bit_length())):
                if count >> level & 1:
                    b[t, index[(start, start + 2**level - 1)]] = 1.0
                    start += 2**level
    else:
        for t in range(n):
            done = [i for i, (_, last) in enumerate(intervals) if last <= t]
            b[t, done] = np.ones(t + 1) @ np.linalg.pinv(c[np.ix_(done, range(t + 1))])
    return c, b


def noising_reference(n: int, decoding: str) -> np.ndarray:
    """C^{-1} := A^{-1} B (tutorial Sec. 2.7: noise_t = (B Z)[t] - (B Z)[t - 1])."""
    _, b = prefix_decoder(n, decoding)
    out = b.copy()
    out[1:] -= b[:-1]
    return out
