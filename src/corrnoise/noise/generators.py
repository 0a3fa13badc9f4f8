"""Streaming correlated-noise generators in torch: nu * (C^{-1} Z)[t], one step at a time.

A generator is built from a :class:`corrnoise.strategies.Strategy`, the model size m (an int,
a shape, or a list of parameter shapes / tensors), a seed, and the noise standard deviation
nu (``noise_std``, DESIGN.md). ``gen.next()`` returns the noise of the current step and
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

Every update is in place, with no temporary of size m beyond the mechanism's buffers: the
seed-noise terms of a step (nu Z[t], -beta nu Z[t-1], regenerated rows) are combined block by
block while they are drawn (:func:`corrnoise.noise.seeds.fill_noise_combination`); banded and
BLT updates are whole-row ``addmv_`` / ``addcmul(out=buffers)`` on the same device. (Running the
banded/BLT updates per block inside the seed-noise threads with numpy was measured 5-9 ms slower
at m = 1e7 on 2 cores than these two multi-threaded torch kernels, so it was dropped.)

Column-normalized strategies (tutorial Def. 2.10) wrap any kind: C_norm^{-1} = D C^{-1}, so
the row is multiplied by the column norm of step t (Remark 2.19) at no extra memory.

The generator never keeps a reference to the tensor it returns (callers may modify it).
``state_dict()`` / ``load_state_dict()`` checkpoint the step counter and buffers;
``seek(t)`` fast-forwards a fresh generator (buffered kinds replay the steps, the others jump).
A state dict holds the seed, from which all past noise can be rebuilt: keep checkpoints as
private as the training data (publish model weights, never the generator state).
A ``shard=(start, stop)`` generator produces only those coordinates of every row (tutorial
Sec. 4.4.5, Eq. 4.13); the shards of all ranks concatenate to the unsharded noise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import CorrnoiseError, check_int, check_real
from ..linalg.streaming import NOISE_KINDS
from ..strategies import Strategy
from .seeds import DEFAULT_CHUNK, check_seed, fill_noise_combination, new_secret_seed, scratch_bytes

__all__ = [
    "NoiseGenerator",
    "IidGenerator",
    "BandedGenerator",
    "BLTGenerator",
    "DPCGDGenerator",
    "RegenerateGenerator",
    "GENERATORS",
    "make_generator",
    "resolve_dim",
]

_STATE_VERSION = 2  # 2: counter-based Philox Z (issue #8); a version-1 seed gives another Z


def resolve_dim(dim: Any) -> tuple[int, list[torch.Size] | None]:
    """(m, shapes): ``dim`` is an int m, a shape (torch.Size / tuple of ints), or a list of
    parameter shapes or tensors. ``shapes`` is None for an int (flat output)."""
    if isinstance(dim, bool):
        raise CorrnoiseError("dim", f"must be an integer or a list of shapes, got {dim!r}")
    if isinstance(dim, (int, np.integer)):
        return check_int("dim", dim, minimum=1), None
    if isinstance(dim, torch.Tensor):
        dim = [dim]
    if isinstance(dim, torch.Size) or (
        isinstance(dim, tuple) and all(isinstance(d, (int, np.integer)) for d in dim)
    ):
        dim = [dim]
    try:
        shapes = [torch.Size(p.shape) if isinstance(p, torch.Tensor) else torch.Size(p) for p in dim]
    except TypeError:
        raise CorrnoiseError("dim", "must be an integer, a shape, or a list of shapes/tensors") from None
    m = sum(int(math.prod(s)) for s in shapes)
    if m < 1:
        raise CorrnoiseError("dim", "the model has no coordinates")
    return m, shapes


def split_flat(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of the flat row ``flat`` with the given ``shapes`` (from :func:`resolve_dim`)."""
    out, pos = [], 0
    for s in shapes:
        k = int(math.prod(s))
        out.append(flat[pos : pos + k].view(s))
        pos += k
    return out


class NoiseGenerator:
    """Base class: the step counter, seed noise, scaling, splitting, checkpoints.

    Subclasses implement ``_raw_step(t)`` returning a fresh flat tensor equal to
    nu * (C^{-1} Z)[t] over the shard for the (un-normalized) base strategy.
    """

    kind = "abstract"

    def __init__(
        self,
        n: int,
        dim: Any,
        *,
        noise_std: float = 1.0,
        seed: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        shard: tuple[int, int] | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        row_scale: np.ndarray | None = None,
        label: str = "",
    ):
        self.n = check_int("n", n, minimum=1)
        self.m, self.shapes = resolve_dim(dim)
        self.noise_std = check_real("noise_std", noise_std, low=0.0)
        self.seed = new_secret_seed() if seed is None else check_seed(seed)
        self.device = torch.device(device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CorrnoiseError("dtype", f"must be a floating-point torch dtype, got {dtype!r}")
        self.dtype = dtype
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        if shard is None:
            shard = (0, self.m)
        try:
            start, stop = (int(shard[0]), int(shard[1]))
        except (TypeError, ValueError, IndexError):
            raise CorrnoiseError("shard", f"must be a pair (start, stop), got {shard!r}") from None
        if not 0 <= start < stop <= self.m:
            raise CorrnoiseError("shard", f"must satisfy 0 <= start < stop <= {self.m}, got {shard!r}")
        if (start, stop) != (0, self.m) and self.shapes is not None:
            raise CorrnoiseError("shard", "a sharded generator returns flat tensors: pass dim as an int")
        self.start, self.stop = start, stop
        self.size = stop - start
        self.row_scale = None if row_scale is None else np.asarray(row_scale, dtype=np.float64)
        if self.row_scale is not None and self.row_scale.size < self.n:
            raise CorrnoiseError("strategy", "column scales shorter than the number of steps")
        self.label = label or self.kind
        self.t = 0

    # --- seed noise ------------------------------------------------------------------------
    def _combination(self, terms, out: torch.Tensor | None = None) -> torch.Tensor:
        """nu * sum_i coef_i Z[tau_i] over the shard for ``terms`` = [(tau_i, coef_i)], fused
        block by block (:func:`corrnoise.noise.seeds.fill_noise_combination`)."""
        if out is None:
            out = torch.empty(self.size, dtype=self.dtype, device=self.device)
        nu = self.noise_std
        return fill_noise_combination(out, self.seed, [(tau, nu * c) for tau, c in terms], self.m,
                                      self.start, self.chunk_size)

    def _z(self, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """nu * Z[t] over the shard (a fresh tensor unless ``out`` is given)."""
        return self._combination([(t, 1.0)], out)

    # --- stepping --------------------------------------------------------------------------
    def _raw_step(self, t: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def next_flat(self) -> torch.Tensor:
        """The noise of the current step as a flat tensor (the shard's coordinates), then advance."""
        t = self.t
        if t >= self.n:
            raise CorrnoiseError(
                "steps",
                f"the mechanism {self.label} has n = {self.n} steps; step {t} is past its end "
                "(build a mechanism for more steps)",
            )
        out = self._raw_step(t)
        if self.row_scale is not None:
            out.mul_(float(self.row_scale[t]))
        self.t = t + 1
        return out

    def next(self) -> torch.Tensor | list[torch.Tensor]:
        """The current step's noise: a flat tensor for an int ``dim``, else one tensor per shape."""
        flat = self.next_flat()
        return flat if self.shapes is None else self.unflatten(flat)

    __next__ = next

    def __iter__(self):
        return self

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` with the parameter shapes."""
        if self.shapes is None:
            return [flat]
        return split_flat(flat, self.shapes)

    @property
    def stateless(self) -> bool:
        """True when the state is only (seed, t): seek() jumps instead of replaying."""
        return True

    def seek(self, t: int) -> None:
        """Position the generator so that the next call returns step t's noise."""
        t = check_int("t", t, minimum=0, maximum=self.n)
        if self.stateless:
            self.t = t
            return
        if t < self.t:
            self.reset()
        while self.t < t:
            self._raw_step(self.t)
            self.t += 1

    def reset(self) -> None:
        """Back to step 0 with the same seed."""
        self.t = 0
        self._reset_buffers()

    def _reset_buffers(self) -> None:
        pass

    # --- memory and checkpoints --------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        return {}

    def _arrays(self) -> list[np.ndarray]:
        return [] if self.row_scale is None else [self.row_scale]

    def extra_memory_bytes(self) -> int:
        """Bytes held beyond one m-vector: buffers, coefficient arrays, and on CPU the seed-noise
        scratch (one block and its Box-Muller temporaries per filling thread)."""
        total = sum(b.numel() * b.element_size() for b in self._buffers().values())
        total += sum(a.nbytes for a in self._arrays())
        if self.device.type == "cpu":
            total += scratch_bytes(min(self.chunk_size, self.size), self.dtype)
        return int(total)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this generator is (plus buffers)."""
        return {
            "version": _STATE_VERSION,
            "kind": self.kind,
            "label": self.label,
            "seed": self.seed,
            "t": self.t,
            "n": self.n,
            "m": self.m,
            "shard": [self.start, self.stop],
            "chunk_size": self.chunk_size,
            "noise_std": self.noise_std,
            "dtype": str(self.dtype),
            "buffers": {k: v.detach().clone() for k, v in self._buffers().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` taken from a generator of the same mechanism and size."""
        try:
            if state["version"] != _STATE_VERSION:
                raise CorrnoiseError("state", f"unsupported generator state version {state['version']!r}")
            for key, mine in (("kind", self.kind), ("n", self.n), ("m", self.m),
                              ("shard", [self.start, self.stop]), ("chunk_size", self.chunk_size)):
                if state[key] != mine:
                    raise CorrnoiseError("state", f"{key} = {state[key]!r} does not match this generator's {mine!r}")
            if not math.isclose(float(state["noise_std"]), self.noise_std, rel_tol=1e-12, abs_tol=0.0):
                raise CorrnoiseError("state", f"noise_std = {state['noise_std']} does not match {self.noise_std}")
            t = check_int("t", state["t"], minimum=0, maximum=self.n)
            seed = check_seed(state["seed"])
            buffers = state["buffers"]
            mine = self._buffers()
            if set(buffers) != set(mine):
                raise CorrnoiseError("state", f"buffers {sorted(buffers)} do not match {sorted(mine)}")
            for k, v in buffers.items():
                if tuple(v.shape) != tuple(mine[k].shape):
                    raise CorrnoiseError("state", f"buffer {k} has shape {tuple(v.shape)}, expected {tuple(mine[k].shape)}")
        except KeyError as exc:
            raise CorrnoiseError("state", f"missing entry {exc.args[0]!r} in the generator state") from None
        self.seed, self.t = seed, t
        for k, v in buffers.items():
            mine[k].copy_(v.to(device=self.device, dtype=self.dtype))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.label}, n={self.n}, m={self.m}, t={self.t}, "
                f"noise_std={self.noise_std:g}, dtype={self.dtype}, device={self.device})")


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


_METHODS = ("auto", "regenerate")

# One generator class per noise-stream kind (Strategy.noise_stream() says which kind).
GENERATORS: dict[str, type[NoiseGenerator]] = {
    "iid": IidGenerator,
    "banded": BandedGenerator,
    "blt": BLTGenerator,
    "dpcgd": DPCGDGenerator,
    "regenerate": RegenerateGenerator,
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
    than n bands, ``regenerate`` otherwise); ``method="regenerate"`` forces O(m)-memory
    regeneration, :meth:`Strategy.regeneration_stream`, for any strategy. A column-normalized
    strategy's stream is its base's with rows scaled by the column norms.
    """
    if not isinstance(strategy, Strategy):
        raise CorrnoiseError("strategy", f"must be a corrnoise Strategy, got {type(strategy).__name__}")
    if method not in _METHODS:
        raise CorrnoiseError("method", f"must be one of {', '.join(_METHODS)}, got {method!r}")
    stream = strategy.regeneration_stream() if method == "regenerate" else strategy.noise_stream()
    return GENERATORS[stream.kind](
        strategy.n, dim, **stream.params, noise_std=noise_std, seed=seed, device=device, dtype=dtype,
        shard=shard, chunk_size=chunk_size, row_scale=stream.row_scale, label=strategy.label)
