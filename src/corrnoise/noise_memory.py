"""How much memory a mechanism's noise generator keeps between steps, and a budget for it
(issue #27 item 5; tutorial Sec. 4.4.5).

The one formula (:func:`noise_state_bytes`)::

    noise state = memory vectors x trainable parameters x bytes per element

*memory vectors* are the model-size tensors the streaming generator of
:func:`corrnoise.noise.make_generator` keeps from one step to the next for the noise method it
uses (:meth:`corrnoise.linalg.streaming.NoiseStream.buffer_rows` of the stream it is built from):
banded C b - 1 past outputs, a BLT d buffers, ``tree:ls`` one node estimate per level (the bit
length of n - 1); DP-SGD, DP-CGD, BISR / banded-inverse, regenerated Toeplitz or dense C and the
plain tree 0. ``method="regenerate"`` (memoryless regeneration, tutorial Sec. 4.4.5 Approach 2)
keeps 0 for every strategy: it redraws the rows of Z it needs from the key, at more seed-noise
draws per step.

Not counted, because none is state of the mechanism (each is the same for every mechanism, or does
not grow with the model): the step's output row (one model-size vector handed to the caller each
step -- every mechanism, DP-SGD included, adds one; on CPU the generator keeps its memory for a
later step's row once the caller has let it go, :meth:`corrnoise.noise.NoiseGenerator._row_buffer`,
as CUDA's caching allocator keeps a freed block), a float32 copy of that row made during the step
on CPU for 16-bit dtypes, the CPU seed-noise scratch (at most one chunk of 2^18 coordinates per
filling thread, a few MB whatever the model size), and the coefficient arrays (float64, O(n)
numbers: O(n^2) for a regenerated dense C).
:meth:`corrnoise.noise.NoiseGenerator.extra_memory_bytes` counts the scratch, the coefficient
arrays and a second kept row (while the caller holds the last) for a built generator.

Torch-free (the planner imports it); a torch dtype is accepted by its name.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from dataclasses import dataclass
from typing import Any

from .errors import CorrnoiseError, check_int

__all__ = ["NoiseBudget", "budgeted_noise_method", "dtype_itemsize", "format_size", "model_noise_budget", "noise_budget",
           "noise_state_bytes", "noise_state_vectors", "parse_size", "vectors_within"]

#: bytes per element of the floating-point dtypes a generator runs in
_ITEMSIZE = {"float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_CANONICAL = {"double": "float64", "float": "float32", "half": "float16"}
#: size suffixes: decimal (kB = 10^3) and binary (KiB = 2^10), case-insensitive
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: Any, param: str = "max_noise_memory") -> int:
    """A size in bytes from an int, a float or text: ``"2GB"`` (10^9), ``"512MiB"`` (2^20),
    ``"2e9"``, ``"1.5 GiB"``; exact (decimal arithmetic), rounded down to whole bytes. Anything
    else is one line naming ``param``."""
    bad = CorrnoiseError(param, f"must be a size like 2GB, 512MiB or 2e9 (bytes), got {value!r}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise bad
        number, unit = Fraction(value), ""
    else:
        match = _SIZE.match(str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise bad
        number, unit = Fraction(match.group(1)), match.group(2).lower()
    if number < 0:
        raise bad
    return math.floor(number * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """``nbytes`` for people, in decimal units (1 GB = 10^9 bytes) with three significant digits."""
    for unit, scale in (("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def dtype_itemsize(dtype: Any, param: str = "dtype") -> tuple[str, int]:
    """(canonical name, bytes per element) of a floating-point dtype given by name
    (``"float32"``, ``"bfloat16"``, ...) or as a torch / numpy dtype."""
    name = str(dtype).strip().lower()
    name = name.removeprefix("torch.")
    name = _CANONICAL.get(name, name)
    if name not in _ITEMSIZE:
        raise CorrnoiseError(param, f"must be a floating-point dtype (float64, float32, float16, bfloat16), got {dtype!r}")
    return name, _ITEMSIZE[name]


def noise_state_vectors(strategy, method: str = "auto") -> int:
    """Model-size vectors the generator of ``strategy`` keeps between steps with ``method``
    (:func:`corrnoise.noise.make_generator`'s): ``auto`` the buffer rows of the strategy's own
    recurrence (:meth:`~corrnoise.strategies.Strategy.noise_stream`); ``regenerate`` 0 (every
    regeneration stream is a ``regenerate`` kind or the plain tree, both without buffers; not
    built here, as tree:ls would materialize C^{-1} for it)."""
    if method == "regenerate":
        return 0
    if method != "auto":
        raise CorrnoiseError("noise_method", f"must be auto or regenerate, got {method!r}")
    return int(strategy.noise_stream().buffer_rows())


def noise_state_bytes(strategy, trainable_params: int, dtype: Any = "float32", method: str = "auto") -> int:
    """Bytes of noise state the generator keeps between steps for a model of
    ``trainable_params`` elements of ``dtype``: :func:`noise_state_vectors` x trainable_params x
    bytes per element (what is and is not counted: module docstring). The single place of the
    formula: the planner, ``make_private(max_noise_memory=...)`` and the CLI use it."""
    params = check_int("trainable_params", trainable_params, minimum=1)
    _, itemsize = dtype_itemsize(dtype)
    return noise_state_vectors(strategy, method) * params * itemsize


def vectors_within(max_bytes: int, trainable_params: int, dtype: Any = "float32") -> int:
    """How many model-size noise vectors fit in ``max_bytes`` (the inverse of the formula)."""
    _, itemsize = dtype_itemsize(dtype)
    return int(max_bytes // (check_int("trainable_params", trainable_params, minimum=1) * itemsize))


@dataclass(frozen=True)
class NoiseBudget:
    """A noise-memory budget for one model: ``max_bytes`` of noise state for
    ``trainable_params`` elements of ``dtype`` (``make_private(max_noise_memory=...)``)."""

    max_bytes: int
    trainable_params: int
    dtype: str = "float32"

    def planner_settings(self) -> dict[str, Any]:
        """The planner's setup fields for this budget (:class:`corrnoise.planner.PlanSetup`)."""
        return {"max_noise_memory": self.max_bytes, "trainable_params": self.trainable_params, "dtype": self.dtype}

    def method_for(self, strategy, method: str = "auto") -> str:
        """``method`` when the generator's state for ``strategy`` fits, else one line naming
        max_noise_memory that says what would fit."""
        need = noise_state_bytes(strategy, self.trainable_params, self.dtype, method)
        if need <= self.max_bytes:
            return method
        vectors = noise_state_vectors(strategy, method)
        fits = vectors_within(self.max_bytes, self.trainable_params, self.dtype)
        buffered = f"at most {fits} vectors (bsr:{fits + 1}, a BLT with {fits} buffers), " if fits else ""
        raise CorrnoiseError(
            "max_noise_memory",
            f"{strategy.label} keeps {vectors} noise vectors of {self.trainable_params:,} {self.dtype} = "
            f"{format_size(need)} > {format_size(self.max_bytes)}; what fits: {buffered}noise_method='regenerate' "
            "(no buffers, more draws per step), dpsgd, dpcgd or bisr (no buffers), or mechanism='auto' (the "
            "planner chooses within the budget)")


def noise_budget(max_noise_memory: Any, trainable_params: int, dtype: Any) -> NoiseBudget | None:
    """The :class:`NoiseBudget` of a ``max_noise_memory`` setting (None when it is None)."""
    if max_noise_memory is None:
        return None
    name, _ = dtype_itemsize(dtype)
    return NoiseBudget(parse_size(max_noise_memory), check_int("trainable_params", trainable_params, minimum=1), name)


def model_noise_budget(max_noise_memory: Any, parameters, noise_dtype: Any) -> NoiseBudget | None:
    """The budget for the noise of ``parameters`` (the trainable tensors, deduplicated): their
    element count, in ``noise_dtype`` (the generator's: :func:`corrnoise.torch.privatizer.noise_dtype`,
    the widest of the parameters'; found in review: the first parameter's, bfloat16 before float32
    layers, budgeted half the buffers' bytes)."""
    if max_noise_memory is None:
        return None
    unique = list({id(p): p for p in parameters}.values())
    if not unique:
        raise CorrnoiseError("max_noise_memory", "the model has no trainable parameters to budget noise for")
    return noise_budget(max_noise_memory, sum(int(p.numel()) for p in unique), noise_dtype)


def budgeted_noise_method(budget: NoiseBudget | None, strategy, noise_method: str = "auto", planned=None) -> str:
    """make_generator's method within ``budget``: for a planner recommendation (``planned``, a
    :class:`~corrnoise.planner.PlanResult`) with ``noise_method="auto"`` the planner's choice
    (regenerated where the buffers did not fit), then ``noise_method`` if the state fits, else
    one line naming max_noise_memory (:meth:`NoiseBudget.method_for`)."""
    if budget is None:
        return noise_method
    if noise_method == "auto" and planned is not None:
        noise_method = planned.recommended.noise_method
    return budget.method_for(strategy, noise_method)
