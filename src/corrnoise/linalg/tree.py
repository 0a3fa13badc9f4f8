"""Binary-tree aggregation (tutorial Sec. 2.7): the tree matrix, node numbering, and the online
recurrence of its noise.

Nodes are the dyadic intervals [j 2^l, (j + 1) 2^l - 1] (level l) of the tree over the
n' = 2^K leaves, K = ceil(log2 n), that touch one of the first n leaves (footnote 12: pad with
zeros), numbered in postorder (tutorial Sec. 2.7), which sorts nodes by (last leaf, level).
A *complete* node (its last leaf E < n) has postorder number ``2 E - popcount(E) + l``
(:func:`node_id`): the 2E - popcount(E) dyadic intervals inside [0, E - 1] come first, then the
l lower nodes that also end at E. Partial nodes (last leaf >= n) come after every complete node
that precedes them in the padded tree and are never used by the online decoders below.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import CorrnoiseError, check_int


def tree_matrix(n: int) -> np.ndarray:
    """The binary-tree strategy C_tree for n leaves, rows in postorder (tutorial Sec. 2.7).

    Built by the recursion P_0 = (1), P_{i+1} = [[P_i, 0], [0, P_i], [1, 1]] for
    k = ceil(log2 n); when n is not a power of two we keep the first n leaves (zero padding,
    footnote 12) and drop the rows that no longer touch any kept leaf. Shape (rows, n) with
    rows = 2n - 1 when n is a power of two.
    """
    n = check_int("n", n, minimum=1)
    k = tree_depth(n)
    p = np.ones((1, 1))
    for _ in range(k):
        size = p.shape[1]
        top = np.hstack([p, np.zeros_like(p)])
        mid = np.hstack([np.zeros_like(p), p])
        p = np.vstack([top, mid, np.ones((1, 2 * size))])
    c = p[:, :n]
    return c[np.any(c != 0.0, axis=1)]


def tree_depth(n: int) -> int:
    """K = ceil(log2 n): the levels are 0..K and every leaf lies in K + 1 nodes."""
    return (int(n) - 1).bit_length()


def tree_rows(n: int) -> int:
    """Rows of :func:`tree_matrix`: sum_{l=0}^{K} ceil(n / 2^l) nodes touch the first n leaves."""
    return sum(-(-int(n) >> l) for l in range(tree_depth(n) + 1))


def node_id(level: int, end: int) -> int:
    """Postorder number of the complete node of ``level`` whose last leaf is ``end``:
    2 end - popcount(end) + level (module docstring; tutorial Sec. 2.7's postorder)."""
    return 2 * end - bin(end).count("1") + level


def node_ids(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(level, first leaf, last leaf clipped to n - 1) of every row of :func:`tree_matrix`, in
    postorder, without materializing C: O(rows log rows)."""
    levels, starts, ends = [], [], []
    for l in range(tree_depth(n) + 1):
        s = np.arange(0, n, 1 << l, dtype=np.int64)
        levels.append(np.full(s.size, l, dtype=np.int64))
        starts.append(s)
        ends.append(s + (1 << l) - 1)
    level, start, end = (np.concatenate(a) for a in (levels, starts, ends))
    order = np.lexsort((level, end))  # postorder of the padded tree: by last leaf, then level
    return level[order], start[order], np.minimum(end[order], n - 1)


# --- the online decoders -------------------------------------------------------------------
DECODINGS = ("plain", "ls")


@lru_cache(maxsize=64)
def level_weights(decoding: str, levels: int) -> np.ndarray:
    """a_l, l = 0..levels - 1, of the node estimate u_v = a_l y_v + (1 - a_l)(u_left + u_right).

    ``plain`` (tutorial Sec. 2.7, B_tree): a_l = 1, the node's own noisy value.
    ``ls`` (Honaker 2015, the bottom-up pass, as in the "Streaming H2" column of tutorial
    Table 2.3): the least-squares estimate of a complete node from its whole subtree, with
    v_0 = 1, a_l = v_l = 2 v_{l-1} / (1 + 2 v_{l-1}) (inverse-variance weighting of the node's
    own unit-variance noise against its children's estimates, variance 2 v_{l-1}).
    """
    a = np.ones(levels)
    if decoding == "ls":
        for l in range(1, levels):
            a[l] = 2.0 * a[l - 1] / (1.0 + 2.0 * a[l - 1])
    a.flags.writeable = False
    return a


def level_variances(decoding: str, levels: int) -> np.ndarray:
    """v_l = Var(u_v) per unit noise for a complete node of level l (u_v's noise is a fixed
    combination of its subtree's noise): 1 for ``plain``; a_l for ``ls`` (:func:`level_weights`)."""
    return level_weights(decoding, levels).copy()


@dataclass(frozen=True)
class TreeStep:
    """What step t does (:func:`online_tree_step`).

    ``new_ids``: the nodes whose last leaf is t (levels 0..k, k = trailing zeros of t + 1),
    consecutive in postorder; ``old_ids``: the complete nodes of levels 0..k-1 of the dyadic
    decomposition of [0, t - 1] that the new level-k node replaces; the new node's estimate is
    u_k = sum_l alpha_l Z[new_ids[l]] + sum_l beta_l u[old_ids[l]], and the noise of step t is
    u_k - sum_l u[old_ids[l]].
    """

    t: int
    k: int
    new_ids: tuple[int, ...]
    alpha: np.ndarray
    old_ids: tuple[int, ...]
    beta: np.ndarray


def online_tree_step(t: int, weights: np.ndarray) -> TreeStep:
    """The online tree's noise at step t (tutorial Sec. 2.7, "Complexity of Noise Generation"):

        prefix noise P_t = sum of u_v over the maximal dyadic partition of [0, t]
        (the bits of t + 1), and the noise added at step t is P_t - P_{t-1} (C^{-1} = A^{-1} B).

    With k = trailing zeros of t + 1, P_t replaces the partition's nodes of levels 0..k-1
    (ending at t - 2^l) by the new level-k node ending at t, so
    noise_t = u(k, t) - sum_{l<k} u(l, t - 2^l), and unrolling
    u(l, t) = a_l Z(l, t) + (1 - a_l)(u(l - 1, t - 2^{l-1}) + u(l - 1, t)) down to the leaf
    u(0, t) = Z(0, t) gives alpha_l = a_l prod_{j=l+1}^{k} (1 - a_j) (a_0 = 1) and
    beta_l = prod_{j=l+1}^{k} (1 - a_j). With every a_l = 1 (``plain``) u_v = Z[v]:
    noise_t = Z(k, t) - sum_{l<k} Z(l, t - 2^l), at most K + 1 rows of Z.
    """
    k = ((t + 1) & -(t + 1)).bit_length() - 1
    a = np.array(weights[: k + 1], dtype=np.float64)
    a[0] = 1.0
    tail = np.ones(k + 1)  # tail[l] = prod_{j=l+1}^{k} (1 - a_j)
    for l in range(k - 1, -1, -1):
        tail[l] = tail[l + 1] * (1.0 - a[l + 1])
    first = node_id(0, t)
    return TreeStep(
        t=t, k=k, new_ids=tuple(range(first, first + k + 1)), alpha=a * tail,
        old_ids=tuple(node_id(l, t - (1 << l)) for l in range(k)), beta=tail[:k].copy(),
    )


def stack_slots(n: int) -> int:
    """Node estimates kept between steps: one per level below the top that a later step
    reads, i.e. the bit length of n - 1 (the partition of [0, t] has one node per bit of t + 1)."""
    return max(int(n) - 1, 0).bit_length()


class TreeNoiseOperator:
    """The numpy twin of the torch tree generator: z (one row per node, postorder) -> the
    online tree's noise, one step at a time. ``step(state, zt)`` takes the rows of z of the
    nodes that end at step t (``z[node_slice(t)]``) and keeps the node estimates u of the
    current partition (at most :func:`stack_slots` rows)."""

    def __init__(self, n: int, weights: np.ndarray):
        self.n = check_int("n", n, minimum=1)
        self.weights = np.asarray(weights, dtype=np.float64)

    @staticmethod
    def node_slice(t: int) -> slice:
        k = ((t + 1) & -(t + 1)).bit_length() - 1
        first = node_id(0, t)
        return slice(first, first + k + 1)

    def init(self, shape):
        return (0, {})

    def step(self, state, zt):
        t, stack = state
        if t >= self.n:
            raise CorrnoiseError("steps", f"the mechanism has n = {self.n} steps; step {t} is past its end")
        plan = online_tree_step(t, self.weights)
        zt = np.asarray(zt, dtype=np.float64)
        u = np.tensordot(plan.alpha, zt, axes=1)
        out = np.array(u, copy=True)
        for l in range(plan.k):
            u = u + plan.beta[l] * stack[l]
            out = out + (plan.beta[l] - 1.0) * stack.pop(l)
        stack[plan.k] = u
        return out, (t + 1, stack)


def run_tree_stream(op: TreeNoiseOperator, z: np.ndarray) -> np.ndarray:
    """Apply ``op`` to z of shape (rows, ...) (rows of :func:`tree_matrix`): shape (n, ...)."""
    z = np.asarray(z, dtype=np.float64)
    state = op.init(z.shape[1:])
    out = np.empty((op.n,) + z.shape[1:])
    for t in range(op.n):
        out[t], state = op.step(state, z[op.node_slice(t)])
    return out


def online_tree_errors_squared(n: int, decoding: str) -> tuple[float, float]:
    """(||B||_F^2 / n, max_t ||B[t]||^2) for B = A C^{-1} of the online tree, prefix workload.

    B[t] Z = P_t = sum of u_v over the partition of [0, t] (the set bits l of s = t + 1); the
    u_v of disjoint subtrees are independent, so ||B[t]||^2 = sum_{bits l of s} v_l
    (:func:`level_variances`). The mean counts, per level, the s in [1, n] with bit l set; the
    maximum is over s = n and, for every set bit i > 0 of n, n with bit i cleared and all lower
    bits set (any s < n first differs from n at such a bit, and v_l > 0). O(log^2 n).
    """
    n = check_int("n", n, minimum=1)
    v = level_variances(decoding, n.bit_length())
    total = 0.0
    for l in range(n.bit_length()):
        period, half = 1 << (l + 1), 1 << l
        count = ((n + 1) // period) * half + max(0, (n + 1) % period - half)
        total += count * v[l]

    def err(s: int) -> float:
        return float(sum(v[l] for l in range(s.bit_length()) if s >> l & 1))

    candidates = [n] + [((n >> i) - 1 << i) | ((1 << i) - 1) for i in range(1, n.bit_length()) if n >> i & 1]
    return total / n, max(err(s) for s in candidates)


# --- the sensitivity of C_tree (corrnoise.losses.sensitivity_tree) --------------------------
def tree_gram(n: int) -> np.ndarray:
    """C_tree^T C_tree without C: leaves i and j share the K + 1 - bitlen(i XOR j) nodes of levels
    bitlen(i XOR j)..K (every ancestor of a kept leaf is kept; tutorial Sec. 2.7)."""
    n = check_int("n", n, minimum=1)
    idx = np.arange(n)
    _, bitlen = np.frexp(np.bitwise_xor.outer(idx, idx).astype(np.float64))  # frexp(0) = (0, 0)
    return (tree_depth(n) + 1 - bitlen).astype(np.float64)


def tree_cyclic_squared(n: int, k: int, b: int) -> float:
    """max over the b cyclic patterns (l, l + b, ..., < n) of ||C_tree[:, pi] 1||^2 =
    sum_v |pi cap v|^2 (C_tree has 0/1 rows).

    Per level l the pattern's steps p (sorted) lie in node p >> l; a run of c equal node
    indices contributes c^2 = sum_{i<c} (2 i + 1), so each step adds 2 (its place in its run)
    + 1. O(b k (K + 1)) = O(n log n) time, O(n) memory."""
    pos = np.arange(b, dtype=np.int64)[:, None] + b * np.arange(k, dtype=np.int64)[None, :]
    valid = pos < n  # a pattern is truncated to steps < n (only its last step can be missing)
    col = np.arange(k, dtype=np.int64)[None, :]
    total = np.zeros(b)
    for l in range(tree_depth(n) + 1):
        node = np.where(valid, pos >> l, -1)
        starts = np.ones(node.shape, dtype=bool)
        starts[:, 1:] = node[:, 1:] != node[:, :-1]
        run_start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
        total += np.sum((2 * (col - run_start) + 1) * valid, axis=1)
    return float(total.max())


def tree_minsep_bound_squared(n: int, k: int, b: int) -> float:
    """Upper bound on max_pi sum_v |pi cap v|^2 over b-separated patterns of at most k steps: a
    level-l node spans min(2^l, n) leaves, so it holds c_v <= cap = ceil(min(2^l, n) / b) steps,
    and with sum_v c_v <= k the sum of squares is at most floor(k / cap) cap^2 + (k mod cap)^2."""
    k = min(k, -(-n // b))
    total = 0
    for l in range(tree_depth(n) + 1):
        cap = min(k, -(-min(1 << l, n) // b))
        total += (k // cap) * cap * cap + (k % cap) ** 2
    return float(total)
