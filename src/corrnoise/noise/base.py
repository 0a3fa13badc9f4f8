"""The streaming noise generator's base class: step counter, seed noise, scaling, splitting,
checkpoints (see :mod:`corrnoise.noise.generators` for the mechanisms' recurrences)."""

from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Any

import numpy as np
import torch

from ..errors import CorrnoiseError, check_int, check_real
from .seeds import DEFAULT_CHUNK, check_seed, fill_noise_combination, new_secret_seed, scratch_bytes

__all__ = ["NoiseGenerator", "resolve_dim", "split_flat"]

_STATE_VERSION = 2  # 2: counter-based Philox Z (issue #8); a version-1 seed gives another Z

#: rows a CPU generator keeps for reuse (:meth:`NoiseGenerator._row_buffer`): one for a loop whose
#: ``zero_grad`` drops the gradients, two where it keeps them (the last row is still ``p.grad``)
KEPT_ROWS = 2


def _storage_holders(t: torch.Tensor) -> tuple[int, int, int] | None:
    """Who holds the memory of ``t``, as three counts: the references to its storage (tensors and
    views on it: ``torch._C._storage_Use_Count``, which inductor's CUDA graph trees ask for the
    same question), to its Python storage object, and the weak references to that object
    (``untyped_storage()`` returns one object per storage, kept with it, so a caller holding only
    that object -- or a typed ``storage()`` on it, or a ``weakref`` to it -- adds to the second or
    third count, not the first: found in two reviews). None where this torch does not count as
    :func:`_holders_counted` checks."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    storage = t.untyped_storage()
    return int(count(storage._cdata)), sys.getrefcount(storage), weakref.getweakrefcount(storage)


@functools.lru_cache(maxsize=None)
def _holders_counted() -> bool:
    """Whether :func:`_storage_holders` sees a view, a held storage object and a weak reference to
    it come and go on this torch (checked once on a small tensor; where not, generators take a
    fresh row each step)."""
    t = torch.empty(4)
    alone = _storage_holders(t)
    if alone is None:
        return False
    view = t.view(4)
    with_view = _storage_holders(t)
    del view
    storage = t.untyped_storage()
    with_storage = _storage_holders(t)
    weak = weakref.ref(storage)
    del storage
    with_weak = _storage_holders(t)
    del weak
    return len({alone, with_view, with_storage, with_weak}) == 4 and _storage_holders(t) == alone


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


@functools.lru_cache(maxsize=64)
def _shape_probes(shapes: tuple[torch.Size, ...]) -> list[torch.Tensor]:
    """Storage-free (meta) tensors of the given shapes: what torch's C++ unflattening reads the
    shapes from."""
    return [torch.empty(s, device="meta") for s in shapes]


#: torch's C++ loop that cuts a flat tensor into views of given shapes (what data-parallel gradient
#: buckets use), or None where this torch lacks it
_UNFLATTEN = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)


def split_flat(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of the flat row ``flat`` with the given ``shapes`` (from :func:`resolve_dim`),
    from its first coordinate on. One C++ call where torch has it (BERT's 41 parameters: 95 -> 39
    us), else one split and a view each (a slice per parameter would be one more host call each)."""
    if _UNFLATTEN is not None:
        return list(_UNFLATTEN(flat, _shape_probes(tuple(shapes))))
    sizes = [int(math.prod(s)) for s in shapes]
    if sum(sizes) < flat.numel():
        flat = flat[: sum(sizes)]
    return [part.view(s) for part, s in zip(flat.split(sizes), shapes)]


class NoiseGenerator:
    """Base class: the step counter, seed noise, scaling, splitting, checkpoints.

    Subclasses implement ``_raw_step(t)`` returning a flat tensor held by nobody else (from
    :meth:`_combination` / :meth:`_z` without ``out``) equal to nu * (C^{-1} Z)[t] over the shard
    for the (un-normalized) base strategy.
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
        self._rows: list[tuple[torch.Tensor, tuple[int, int, int]]] = []  # kept rows, their holders when alone

    # --- seed noise ------------------------------------------------------------------------
    def _combination(self, terms, out: torch.Tensor | None = None) -> torch.Tensor:
        """nu * sum_i coef_i Z[tau_i] over the shard for ``terms`` = [(tau_i, coef_i)], fused
        block by block (:func:`corrnoise.noise.seeds.fill_noise_combination`)."""
        if out is None:
            out = self._row_buffer()
        nu = self.noise_std
        return fill_noise_combination(out, self.seed, [(tau, nu * c) for tau, c in terms], self.m,
                                      self.start, self.chunk_size)

    def _row_buffer(self) -> torch.Tensor:
        """A tensor of the shard's size for a step's row, held by nobody else.

        On CPU a fresh one each step is not free: a model-sized block goes back to the system when
        the loop drops its gradients and is taken again page by page at the next step (BERT-base,
        109M parameters, 2 cores, bsr:4: the row took 834 ms of a 2.5 s private step, 1.71x a plain
        one; 1.30x with kept rows; benchmarks/RESULTS.md). So a CPU generator keeps the last
        :data:`KEPT_ROWS` rows it returned, and hands one out again only when nothing else holds
        its memory any more (no ``p.grad``, no view, no storage object or weak reference to one,
        nor the tensor handed out: :func:`_storage_holders` counts as many holders as when the
        generator alone held it), so no tensor anyone can still see changes. What it hands out is
        always a view of the kept tensor, never the kept tensor itself. A row moved to shared
        memory (``share_memory_()``, or sent to another process by ``torch.multiprocessing``) is
        let go: another process may map it, and its holders there are not counted here. Where all
        kept rows are still held (a caller keeping early rows), the oldest is forgotten for the new
        one. On CUDA the caching allocator already reuses blocks: a fresh tensor each step."""
        if self.device.type != "cpu" or KEPT_ROWS < 1 or not _holders_counted():
            return torch.empty(self.size, dtype=self.dtype, device=self.device)
        self._rows = [(kept, alone) for kept, alone in self._rows if not kept.is_shared()]
        for kept, alone in self._rows:
            if _storage_holders(kept) == alone:
                return kept.view(kept.shape)
        buf = torch.empty(self.size, dtype=self.dtype, device=self.device)
        self._rows = (self._rows + [(buf, _storage_holders(buf))])[-KEPT_ROWS:]
        # another tensor object on the same memory: a caller's reference to the one it gets is then a
        # holder of the storage (a second reference to ``buf`` itself would not be)
        return buf.view(buf.shape)

    def drop_kept_rows(self) -> None:
        """Let go of the rows kept for reuse (:meth:`_row_buffer`, up to two model-size tensors on
        CPU); the private optimizer does when its run is over (``release_model``). A later step
        keeps its row again."""
        self._rows = []

    def _z(self, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """nu * Z[t] over the shard (in ``out``, else in a row nobody else holds: :meth:`_row_buffer`)."""
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
        scratch (one block and its Box-Muller temporaries per filling thread) and the rows kept for
        reuse beyond the first (:meth:`_row_buffer`: a second one while the caller holds the last)."""
        total = sum(b.numel() * b.element_size() for b in self._buffers().values())
        total += sum(b.numel() * b.element_size() for b, _ in self._rows[1:])
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
            "device_type": torch.device(self.device).type,
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
            if self.reads_past_seed_rows and t > 0:
                self._check_same_seed_stream(state)
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

    @property
    def reads_past_seed_rows(self) -> bool:
        """Whether a step draws seed rows Z[tau] of earlier steps again (regenerated noise), rather
        than only Z[t] and buffers of what was released."""
        return False

    def _check_same_seed_stream(self, state: dict[str, Any]) -> None:
        """A regenerating generator resumed past step 0 must draw the checkpoint's Z: the seed noise
        depends on the device type and float width (:mod:`corrnoise.noise.seeds`), and rows
        rebuilt from another stream would not be the ones already released (found in review: a
        float32 run resumed in float64 continued with a fresh float64 run's rows)."""
        mine = {"dtype": str(self.dtype), "device_type": torch.device(self.device).type}
        saved = {"dtype": state.get("dtype"), "device_type": state.get("device_type", mine["device_type"])}
        for key, value in mine.items():  # (states saved before the device type was recorded name none)
            if saved[key] != value:
                raise CorrnoiseError("state", f"was saved with noise {key} {saved[key]}, this generator's is {value}: "
                                     f"{self.label}'s noise regenerates earlier seed rows, which depend on it; resume "
                                     f"on the checkpoint's {key}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.label}, n={self.n}, m={self.m}, t={self.t}, "
                f"noise_std={self.noise_std:g}, dtype={self.dtype}, device={self.device})")
