"""Binary-tree aggregation (tutorial Sec. 2.7): one strategy matrix, three decoders.

Both classes have the same C = C_tree (:func:`corrnoise.linalg.tree.tree_matrix`: one row per
dyadic node touching the first n leaves, postorder; every leaf lies in K + 1 = ceil(log2 n) + 1
nodes, so the sensitivity is the same), and Z has one row per node (node id = row of C). They
differ in the left inverse L (L C = I) that turns the noisy nodes into the gradient noise
L Z = A^{-1} B Z (docs/design.md: the noise added at step t is (C^{-1} Z)[t], here C^{-1} := L):

* :class:`OnlineTree` ``tree`` (plain): each prefix sum is the sum of the nodes of the maximal
  dyadic partition of [0, t] (B = B_tree of Sec. 2.7). Streams with no buffers: step t
  regenerates at most K + 1 rows of Z (on average 2).
* :class:`OnlineTree` ``tree:ls`` (streaming least squares, Honaker 2015 restricted to the
  nodes complete by step t; the "Streaming H2" column of tutorial Table 2.3): each partition
  node is replaced by its least-squares estimate from its whole subtree. Streams with one
  node estimate per level kept (the bit length of n - 1 buffers).
* :class:`Tree` ``tree:full`` (the "Full H2" column): B = A pinv(C), least squares over every
  node including those that end after step t. pinv(C)[t] has a non-zero weight on every node
  of the tree (the root's noise reaches step 0), so its noise cannot be produced with
  O(log n) rows a step: it is materialized (n <= 8192) and regenerated from C^+.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
from scipy import linalg as sla

from ..errors import CorrnoiseError, check_int
from ..linalg.streaming import NoiseStream
from ..linalg.tree import (DECODINGS, level_weights, node_ids, online_tree_errors_squared, run_tree_stream,
                           stack_slots, tree_depth, tree_matrix, tree_rows)
from .base import Strategy

#: Largest n for which C_tree or C^{-1} is materialized (the tree has 2n - 1 rows).
MAX_MATERIALIZED_TREE_N = 8192


def _check_materializable(n: int, what: str,
                          hint: str = "the losses, sensitivity and noise stream need no matrix") -> None:
    if n > MAX_MATERIALIZED_TREE_N:
        raise CorrnoiseError("n", f"the tree's {what} is materialized only for n <= {MAX_MATERIALIZED_TREE_N}, "
                             f"got {n}; {hint}")


class _TreeC(Strategy):
    """C = C_tree, shared by the decoders: structure, products with C, sensitivity."""

    @property
    def rows(self):
        return tree_rows(self.n)

    def matrix(self):
        _check_materializable(self.n, "matrix C")
        return tree_matrix(self.n)

    def is_nonnegative(self):
        return True

    def column_norms_squared(self):
        """Every leaf lies in K + 1 kept nodes (tutorial Thm 2.20's column count)."""
        return np.full(self.n, float(tree_depth(self.n) + 1))

    def closed_form_sensitivity_squared(self):
        return float(tree_depth(self.n) + 1), "tree-depth"

    def multiply(self, x):
        """C x: node sums from the prefix sums of x, O(rows) without C."""
        x = self._check_rows("x", x, self.n)
        csum = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, axis=0)])
        _, start, end = node_ids(self.n)
        return csum[end + 1] - csum[start]

    def multiply_stream(self):
        raise CorrnoiseError("strategy", "the tree's C has one row per node, not per step: it has no row-by-row "
                             "streaming form; use multiply()")

    def inverse_stream(self):
        raise CorrnoiseError("strategy", "the tree's noise takes one row of Z per node, not per step: use "
                             "inverse_multiply() or noise_stream()")


class OnlineTree(_TreeC):
    """The online binary-tree mechanism (tutorial Sec. 2.7), decoded ``plain`` or ``ls``.

    Noise at step t (:func:`corrnoise.linalg.tree.online_tree_step`, the one statement of the
    recurrence): with k = trailing zeros of t + 1,
    noise_t = u(k, t) - sum_{l<k} u(l, t - 2^l), u(l, E) the estimate of the level-l node
    ending at E; plain: u = Z[node] (prefix sum = sum of the dyadic nodes, B = B_tree);
    ls: Honaker's bottom-up least-squares estimate (:func:`corrnoise.linalg.tree.level_weights`).
    Only complete nodes are read, so the noise of step t is fixed once step t is reached.
    The full least-squares decoder (every node, B = A pinv(C)) is :class:`Tree`: it does not
    stream (module docstring).
    """

    kind = "online-tree"

    def __init__(self, n: int, decoding: str = "plain"):
        self.n = check_int("n", n, minimum=1)
        if decoding not in DECODINGS:
            raise CorrnoiseError("decoding", f"must be one of {', '.join(DECODINGS)}, got {decoding!r}")
        self.decoding = decoding

    @property
    def label(self):
        return "tree" if self.decoding == "plain" else f"tree:{self.decoding}"

    @cached_property
    def _weights(self) -> np.ndarray:
        return level_weights(self.decoding, self.n.bit_length())

    def noise_stream(self) -> NoiseStream:
        return NoiseStream.tree(self._weights, stack_slots(self.n))

    def regeneration_stream(self) -> NoiseStream:
        """Plain: the stream itself regenerates every row it needs. ls: the node estimates are
        combinations of whole subtrees, so memoryless regeneration uses C^{-1} materialized."""
        if self.decoding == "plain":
            return self.noise_stream()
        _check_materializable(self.n, "C^{-1} (memoryless regeneration of tree:ls)")
        return NoiseStream.regenerate(noising=self.noising_matrix())

    def inverse_multiply(self, z):
        return run_tree_stream(self.noise_stream().operator(self.n), self._check_rows("z", z, self.rows))

    def noising_matrix(self):
        _check_materializable(self.n, "C^{-1}")
        return self.inverse_multiply(np.eye(self.rows))

    def closed_form_prefix_errors_squared(self):
        return online_tree_errors_squared(self.n, self.decoding)

    def params(self):
        return {"decoding": self.decoding}

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n, str(params.get("decoding", "plain")))

    def with_n(self, n):
        """The online tree for n steps. For n < self.n it is exactly this mechanism's first n
        steps: those read only the complete nodes inside [0, n - 1], whose ids
        (:func:`corrnoise.linalg.tree.node_id`) do not depend on the number of leaves, and
        C_tree(n) holds every such node."""
        return OnlineTree(n, self.decoding)


class Tree(_TreeC):
    """The full least-squares tree (label ``tree:full``; kind ``tree`` in mechanism files): the
    decoder is B = A pinv(C) (the ``full_h2`` column of tutorial Table 2.3) and the noise that
    reaches the gradients is pinv(C) Z. Materialized, n <= 8192: pinv(C) is dense (module
    docstring), so its noise is regenerated from the materialized C^+ (O(n) rows of Z a step).
    """

    kind = "tree"

    def __init__(self, n: int):
        self.n = check_int("n", n, minimum=1)
        _check_materializable(self.n, "least-squares decoder pinv(C) (tree:full)",
                              "tree or tree:ls stream at any n")
        self._m = tree_matrix(self.n)

    @property
    def label(self):
        return "tree:full"

    def matrix(self):
        return self._m.copy()

    @cached_property
    def _pinv(self) -> np.ndarray:
        # pinv(C) = (C^T C)^{-1} C^T for C of full column rank (every leaf is its own node).
        gram = self._m.T @ self._m
        return sla.cho_solve(sla.cho_factor(gram), self._m.T)

    def noising_matrix(self):
        return self._pinv.copy()

    def inverse_multiply(self, z):
        return self._pinv @ self._check_rows("z", z, self.rows)

    @classmethod
    def from_params(cls, n, params, arrays):
        return cls(n)

    def with_n(self, n):
        return Tree(n)
