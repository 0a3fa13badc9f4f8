"""Streaming correlated-noise generators in torch: nu * (C^{-1} Z)[t], one step at a time.

A generator is built from a :class:`corrnoise.strategies.Strategy`, the model size m (an int,
a shape, or a list of parameter shapes / tensors), a seed, and the noise standard deviation
nu (``noise_std``, docs/design.md). ``gen.next()`` returns the noise of the current step and
advances; the seed noise Z is :func:`corrnoise.noise.seeds.seed_noise`, so

    gen.next() at step t == noise_std * (C^{-1} Z)[t],   Z[tau] = seed_noise(seed, tau, m).

Kinds (one class each; the strategy names its kind and parameters in
:meth:`corrnoise.strategies.Strategy.noise_stream`, and :func:`make_generator` maps the kind to
its class; all in the model's device and dtype):

* ``iid`` -- C = I (DP-SGD): nu Z[t]; no state.
* ``banded`` -- b-banded C, Toeplitz or not: forward substitution with the last b - 1
  outputs (tutorial Alg. 2.1 and its non-Toeplitz form): O(b m) memory and time.
* ``blt`` -- C = BLT(alpha, lam): d buffers updated with the parameters of C itself
  (tutorial Alg. 2.2, no inverse parameters): O(d m).
* ``dpcgd`` -- C^{-1} = I - beta S (seed 003 Eq. 8-9): nu (Z[t] - beta Z[t-1]) with Z[t-1]
  regenerated block by block from the key (seed 003 Sec. 4) and added in the same pass:
  one block of scratch per filling thread.
* ``regenerate`` -- any C (general Toeplitz, dense, tree, ...): sum_tau C^{-1}[t, tau] Z[tau]
  with every needed row of Z regenerated from the key, block by block
  (tutorial Sec. 4.4.5, Approach 2): O(m) memory, O(t m) time at step t (only the
  non-zero coefficients cost anything, so C^{-1} = I - S costs two rows).
* ``tree`` -- the online binary tree (tutorial Sec. 2.7), Z indexed by tree node: step t is
  :func:`corrnoise.linalg.tree.online_tree_step` (k + 1 <= ceil(log2 n) + 1 node rows,
  k = trailing zeros of t + 1). Plain decoding regenerates the k replaced nodes as well (no
  buffers, on average 2 rows a step); least-squares decoding keeps one node estimate per level.

Every update is in place, with no temporary of size m beyond the mechanism's buffers: the
seed-noise terms of a step (nu Z[t], -beta nu Z[t-1], regenerated rows) are combined block by
block while they are drawn (:func:`corrnoise.noise.seeds.fill_noise_combination`); banded and
BLT updates are whole-row ``addmv_`` / ``addcmul(out=buffers)`` on the same device. (Running the
banded/BLT updates per block inside the seed-noise threads with numpy was measured 5-9 ms slower
at m = 1e7 on 2 cores than these two multi-threaded torch kernels, so it was dropped.)

Column-normalized strategies (tutorial Def. 2.10) wrap any kind: C_norm^{-1} = D C^{-1}, so
the row is multiplied by the column norm of step t (Remark 2.19) at no extra memory.

Callers may modify and keep the tensor a generator returns: a CPU generator keeps up to two rows it
returned, but writes one again only once nothing else holds its memory
(:meth:`~corrnoise.noise.base.NoiseGenerator._row_buffer`).
``state_dict()`` / ``load_state_dict()`` checkpoint the step counter and buffers;
``seek(t)`` fast-forwards a fresh generator (buffered kinds replay the steps, the others jump).
A state dict holds the seed, from which all past noise can be rebuilt: keep checkpoints as
private as the training data (publish model weights, never the generator state).
A ``shard=(start, stop)`` generator produces only those coordinates of every row (tutorial
Sec. 4.4.5, Eq. 4.13); the shards of all ranks concatenate to the unsharded noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import CorrnoiseError
from ..linalg.streaming import NOISE_KINDS
from ..linalg.tree import online_tree_step
from ..strategies import Strategy
from .base import NoiseGenerator, resolve_dim  # noqa: F401  (re-exported)
from .seeds import DEFAULT_CHUNK

__all__ = [
    "NoiseGenerator",
    "IidGenerator",
    "BandedGenerator",
    "BLTGenerator",
    "DPCGDGenerator",
    "RegenerateGenerator",
    "TreeGenerator",
    "GENERATORS",
    "make_generator",
    "resolve_dim",
]

class IidGenerator(NoiseGenerator):
    """C = I: DP-SGD's independent noise nu Z[t] (tutorial Alg. 1.3 with C^{-1} = I)."""

    kind = "iid"

    def _raw_step(self, t):
        return self._z(t)


class BandedGenerator(NoiseGenerator):
    """b-banded C (tutorial Alg. 2.1; non-Toeplitz rows by the same forward substitution):

        out_t = (nu z_t - sum_{j=1}^{min(t, b-1)} C[t, t-j] out_{t-j}) / C[t, t].

    ``coefficients`` is either the first column (c_0..c_{b-1}) of a banded Toeplitz C or an
    (n, b) array band[t, j] = C[t, t - j]. The last b - 1 outputs live in a ring buffer of
    shape (b - 1, shard size).
    """

    kind = "banded"

    def __init__(self, n, dim, coefficients, **kw):
        super().__init__(n, dim, **kw)
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim == 1:
            c = c[: min(c.size, self.n)]
            nz = np.flatnonzero(c)
            c = c[: int(nz[-1]) + 1] if nz.size else c[:1]
        if c.ndim not in (1, 2) or c.shape[-1] < 1 or (c.ndim == 2 and c.shape[0] < self.n):
            raise CorrnoiseError("strategy", f"banded coefficients of shape {c.shape} do not cover n = {self.n} steps")
        diag = c[..., 0] if c.ndim == 2 else c[:1]
        if np.any(diag[: self.n] == 0.0):
            raise CorrnoiseError("strategy", "C has a zero on its diagonal (it is singular)")
        self.coef = c
        self.b = int(c.shape[-1])
        self._hist = torch.zeros((max(self.b - 1, 0), self.size), dtype=self.dtype, device=self.device)

    @property
    def stateless(self):
        return self.b == 1

    def _row(self, t: int) -> np.ndarray:
        return self.coef if self.coef.ndim == 1 else self.coef[t]

    def _raw_step(self, t):
        row = self._row(t)
        w = self.b - 1
        out = self._z(t)
        if w > 0 and t > 0:
            weights = np.zeros(w)
            for j in range(1, min(t, w) + 1):
                weights[(t - j) % w] = row[j]
            if np.any(weights):
                wt = torch.as_tensor(weights, dtype=self.dtype, device=self.device)
                out.addmv_(self._hist.t(), wt, alpha=-1.0)
        if row[0] != 1.0:
            out.div_(float(row[0]))
        if w > 0:
            self._hist[t % w].copy_(out)
        return out

    def _reset_buffers(self):
        self._hist.zero_()

    def _buffers(self):
        return {"history": self._hist} if self._hist.numel() else {}

    def _arrays(self):
        return super()._arrays() + [self.coef]


class BLTGenerator(NoiseGenerator):
    """C = BLT(alpha, lam) by tutorial Alg. 2.2 (Lemma 2.17), with the parameters of C:

        out_t = nu z_t - M_t alpha,   M_{t+1} = M_t diag(lam) + out_t 1^T,

    d buffers of the shard size (stored as a (d, size) tensor).
    """

    kind = "blt"

    def __init__(self, n, dim, alpha, lam, **kw):
        super().__init__(n, dim, **kw)
        self.alpha = np.asarray(alpha, dtype=np.float64).reshape(-1)
        self.lam = np.asarray(lam, dtype=np.float64).reshape(-1)
        if self.alpha.size != self.lam.size or self.alpha.size < 1:
            raise CorrnoiseError("strategy", "BLT alpha and lambda must be non-empty and of equal length")
        self._alpha_t = torch.as_tensor(self.alpha, dtype=self.dtype, device=self.device)
        self._lam_t = torch.as_tensor(self.lam, dtype=self.dtype, device=self.device).reshape(-1, 1)
        self._buf = torch.zeros((self.alpha.size, self.size), dtype=self.dtype, device=self.device)

    @property
    def stateless(self):
        return False

    def _raw_step(self, t):
        out = self._z(t)
        if t > 0:
            out.addmv_(self._buf.t(), self._alpha_t, alpha=-1.0)
        # M <- M diag(lam) + out 1^T in one fused pass over the d buffers
        torch.addcmul(out.expand_as(self._buf), self._buf, self._lam_t, out=self._buf)
        return out

    def _reset_buffers(self):
        self._buf.zero_()

    def _buffers(self):
        return {"buffers": self._buf}

    def _arrays(self):
        return super()._arrays() + [self.alpha, self.lam]


class DPCGDGenerator(NoiseGenerator):
    """DP-CGD (seed 003 Eq. 8-9, Sec. 4): out_t = nu (z_t - beta z_{t-1}), z_{-1} = 0.

    z_{t-1} is regenerated from its seed block by block and combined with z_t in the same
    pass, so the only extra memory is one block of scratch per filling thread.
    """

    kind = "dpcgd"

    def __init__(self, n, dim, beta, **kw):
        super().__init__(n, dim, **kw)
        self.beta = float(beta)

    @property
    def reads_past_seed_rows(self) -> bool:
        """Step t regenerates z_{t-1} (found in review: resumed in float64 after a float32 run, z_{t-1}
        came from the other stream, not the released row's, and C W lost its identity covariance)."""
        return self.beta != 0.0

    def _raw_step(self, t):
        if t > 0 and self.beta != 0.0:
            return self._combination([(t, 1.0), (t - 1, -self.beta)])
        return self._z(t)


class RegenerateGenerator(NoiseGenerator):
    """Any C by memoryless regeneration (tutorial Sec. 4.4.5, Approach 2):

        out_t = nu sum_tau C^{-1}[t, tau] Z[tau],

    each Z[tau] with a non-zero coefficient regenerated from the key block by block and
    accumulated in place: one block of scratch per thread, O(nnz(row t) m) time.

    ``inverse_toeplitz`` is the first column of C^{-1} when C is Toeplitz; otherwise
    ``noising`` is C^{-1} materialized (shape (n, rows); rows > n for the tree).
    """

    kind = "regenerate"
    reads_past_seed_rows = True

    def __init__(self, n, dim, *, inverse_toeplitz=None, noising=None, **kw):
        super().__init__(n, dim, **kw)
        if (inverse_toeplitz is None) == (noising is None):
            raise CorrnoiseError("strategy", "give exactly one of inverse_toeplitz and noising")
        if inverse_toeplitz is not None:
            ic = np.asarray(inverse_toeplitz, dtype=np.float64).reshape(-1)
            if ic.size < self.n:
                ic = np.concatenate([ic, np.zeros(self.n - ic.size)])
            self.inv = ic[: self.n]
            self._nz = np.flatnonzero(self.inv)
            self.noising = None
        else:
            self.noising = np.asarray(noising, dtype=np.float64)
            if self.noising.ndim != 2 or self.noising.shape[0] < self.n:
                raise CorrnoiseError("strategy", f"noising matrix of shape {self.noising.shape} has fewer than n rows")
            self.inv = None

    def _terms(self, t: int) -> list[tuple[int, float]]:
        """(tau, C^{-1}[t, tau]) for the non-zero entries of row t."""
        if self.inv is not None:
            js = self._nz[self._nz <= t]
            return [(t - int(j), float(self.inv[j])) for j in js]
        row = self.noising[t]
        return [(int(tau), float(row[tau])) for tau in np.flatnonzero(row)]

    def _raw_step(self, t):
        return self._combination(self._terms(t))

    def _arrays(self):
        arrays = super()._arrays()
        if self.inv is not None:
            return arrays + [self.inv, self._nz]
        return arrays + [self.noising]


class TreeGenerator(NoiseGenerator):
    """The online binary tree (:func:`corrnoise.linalg.tree.online_tree_step`, where the
    recurrence is stated): with k = trailing zeros of t + 1,

        u_k = sum_{l<=k} alpha_l nu Z[new_l] + sum_{l<k} beta_l S[l],   out_t = u_k - sum_{l<k} S[l],

    S[l] the estimate of the level-l node of the current dyadic partition, stored in slot l
    (``slots`` = bit length of n - 1 buffers), and S[k] <- u_k. With every a_l = 1 (plain
    decoding) S[l] = nu Z[old_l]: the k replaced nodes are regenerated from the key with the new
    one in a single fused pass, out_t = nu (Z[new_k] - sum_{l<k} Z[old_l]), and nothing is kept.
    """

    kind = "tree"

    def __init__(self, n, dim, weights, slots, **kw):
        super().__init__(n, dim, **kw)
        self.weights = np.asarray(weights, dtype=np.float64).reshape(-1)
        if self.weights.size < self.n.bit_length():
            raise CorrnoiseError("strategy", f"tree weights for {self.weights.size} levels do not cover n = {self.n}")
        self.regenerate = bool(np.all(self.weights == 1.0))
        slots = 0 if self.regenerate else int(slots)
        self._stack = torch.zeros((slots, self.size), dtype=self.dtype, device=self.device)

    @property
    def stateless(self):
        return self.regenerate

    @property
    def reads_past_seed_rows(self) -> bool:
        return self.regenerate

    def _raw_step(self, t):
        plan = online_tree_step(t, self.weights)
        k = plan.k
        if self.regenerate:  # u_v = nu Z[v]: alpha = e_k, beta = 0
            return self._combination([(plan.new_ids[k], 1.0)] + [(tau, -1.0) for tau in plan.old_ids])
        store = k < self._stack.shape[0]  # slot k is free: bit k of t is 0
        u = self._combination([(tau, float(a)) for tau, a in zip(plan.new_ids, plan.alpha)],
                              out=self._stack[k] if store else None)
        if k == 0:
            return u.clone() if store else u
        stack = self._stack[:k].t()
        u.addmv_(stack, torch.as_tensor(plan.beta, dtype=self.dtype, device=self.device))  # u_k
        return torch.addmv(u, stack, torch.ones(k, dtype=self.dtype, device=self.device), alpha=-1.0)

    def _reset_buffers(self):
        self._stack.zero_()

    def _buffers(self):
        return {"stack": self._stack} if self._stack.numel() else {}

    def _arrays(self):
        return super()._arrays() + [self.weights]


#: ``make_generator``'s methods (the front door's ``noise_method``)
NOISE_METHODS = ("auto", "regenerate")

# One generator class per noise-stream kind (Strategy.noise_stream() says which kind).
GENERATORS: dict[str, type[NoiseGenerator]] = {
    "iid": IidGenerator,
    "banded": BandedGenerator,
    "blt": BLTGenerator,
    "dpcgd": DPCGDGenerator,
    "regenerate": RegenerateGenerator,
    "tree": TreeGenerator,
}
assert set(GENERATORS) == set(NOISE_KINDS)


def make_generator(
    strategy: Strategy,
    dim: Any,
    *,
    noise_std: float = 1.0,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    method: str = "auto",
    shard: tuple[int, int] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> NoiseGenerator:
    """The streaming generator of nu * (C^{-1} Z)[t] for ``strategy``.

    ``method="auto"`` uses the strategy's own recurrence, :meth:`Strategy.noise_stream`
    (``iid`` for the identity, ``dpcgd`` for DP-CGD, ``blt`` for BLTs, ``banded`` for fewer
    than n bands, ``tree`` for the online tree, ``regenerate`` otherwise); ``method="regenerate"`` forces O(m)-memory
    regeneration, :meth:`Strategy.regeneration_stream`, for any strategy. A column-normalized
    strategy's stream is its base's with rows scaled by the column norms.
    """
    if not isinstance(strategy, Strategy):
        raise CorrnoiseError("strategy", f"must be a corrnoise Strategy, got {type(strategy).__name__}")
    if method not in NOISE_METHODS:
        raise CorrnoiseError("method", f"must be one of {', '.join(NOISE_METHODS)}, got {method!r}")
    stream = strategy.regeneration_stream() if method == "regenerate" else strategy.noise_stream()
    return GENERATORS[stream.kind](
        strategy.n, dim, **stream.params, noise_std=noise_std, seed=seed, device=device, dtype=dtype,
        shard=shard, chunk_size=chunk_size, row_scale=stream.row_scale, label=strategy.label)
