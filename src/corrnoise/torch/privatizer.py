"""The correlated-noise privatizer: tutorial Alg. 3.1, lines 6-8.

At step t, given the summed clipped per-example gradient S_t = sum_i clip_zeta(g_i),

    g_hat_t = (S_t + zeta * nu * (C^{-1} Z)[t]) / B                           (Alg. 3.1, l. 7-8)

with zeta the clip norm, nu the noise standard deviation (``noise_std``, in units of the clip
norm: docs/design.md), Z the seed noise and B the *expected* batch size -- a fixed constant, never
the realized batch size, which would depend on the data (Alg. 3.1 footnote 4; seed 000 App. I:
"our normalization in the average is always 1/B"). The noise rows come from a streaming
generator (:mod:`corrnoise.noise`), which already returns nu * (C^{-1} Z)[t].
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import CorrnoiseError, check_real
from ..noise import make_generator
from ..noise.base import split_flat

__all__ = ["Privatizer", "noise_dtype", "privatize_sum"]


def privatize_sum(sums: Sequence[torch.Tensor], noise: Sequence[torch.Tensor], clip_norm: float,
                  expected_batch_size: float, *, overwrite_noise: bool = False,
                  row: torch.Tensor | None = None) -> list[torch.Tensor]:
    """(S + zeta * noise) / B for each parameter (Alg. 3.1, lines 7-8); ``noise`` = nu (C^{-1}Z)[t].

    ``overwrite_noise``: the result is written into ``noise`` (as (zeta / B) noise + S / B), which
    must then be the caller's own tensors: no new memory, two passes. The privatizer's rows are
    (a generator hands out a row nobody else holds). In a BERT-base step (108M parameters, 2 CPU
    cores) the privatization took 616 ms into new tensors (a fresh 430 MB each step, paid page by
    page) and 53 ms in place (benchmarks/RESULTS.md). Otherwise new tensors, S + zeta noise then
    divided in place.

    ``row`` (with ``overwrite_noise``): the flat tensor ``noise`` was split from (a generator's row);
    where the parts are still its consecutive views (none converted to a sum's dtype), its scaling by
    zeta / B is one operation on the row instead of one per parameter (BERT at width 128, 41
    parameters: the noise's share of the step 2.45 -> 2.13 ms).
    """
    if len(sums) != len(noise):
        raise CorrnoiseError("grads", f"{len(sums)} gradient tensors for {len(noise)} noise tensors")
    sums, noise = list(sums), list(noise)
    for i, (s, z) in enumerate(zip(sums, noise)):
        if s.shape != z.shape:
            raise CorrnoiseError("grads", f"gradient of shape {tuple(s.shape)} does not match noise {tuple(z.shape)}")
        if z.dtype != s.dtype or z.device != s.device:
            noise[i] = z.to(dtype=s.dtype, device=s.device)
    if not sums:
        return []
    # multi-tensor calls rather than calls per parameter (a GPU step waits on the host's calls:
    # benchmarks/RESULTS.md)
    if overwrite_noise:
        if row is not None and _consecutive_parts(row, noise):
            row.mul_(clip_norm / expected_batch_size)
        else:
            torch._foreach_mul_(noise, clip_norm / expected_batch_size)
        torch._foreach_add_(noise, sums, alpha=1.0 / expected_batch_size)
        return noise
    out = torch._foreach_add(sums, noise, alpha=clip_norm)
    torch._foreach_div_(out, expected_batch_size)
    return list(out)


def _consecutive_parts(row: torch.Tensor, parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` are contiguous views of ``row`` that cover it from its start, one after the
    other, in its dtype (what :func:`.split_flat` makes of a generator's row): scaling ``row`` then
    scales each part once and nothing else."""
    if not row.is_contiguous():
        return False
    at, size = row.data_ptr(), row.element_size()
    for z in parts:
        if z.dtype != row.dtype or z.device != row.device or not z.is_contiguous() or z.data_ptr() != at:
            return False
        at += z.numel() * size
    return at <= row.data_ptr() + row.numel() * size


def noise_dtype(parameters: Sequence[torch.Tensor]) -> torch.dtype:
    """The noise's float width: the widest of the parameters' (found in review: the first
    parameter's, so a float32 parameter behind a bfloat16 one got bfloat16-rounded noise)."""
    dtype = parameters[0].dtype
    for p in parameters[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


class Privatizer:
    """Adds zeta * nu * (C^{-1} Z)[t] to summed clipped gradients and divides by B.

    ``generator`` is any object with ``next()`` returning one tensor per parameter (a
    :class:`corrnoise.noise.NoiseGenerator` built with ``dim = [shapes]``, or a
    :class:`corrnoise.torch.distributed.ShardedNoise`); its ``noise_std`` is nu.
    """

    def __init__(self, generator, clip_norm: float, expected_batch_size: float):
        self.generator = generator
        self.clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_open=True)
        self.expected_batch_size = check_real("expected_batch_size", expected_batch_size, low=0.0, low_open=True)
        self._row: torch.Tensor | None = None  # the flat row the last noise() split (privatize's)

    @classmethod
    def for_parameters(
        cls,
        strategy,
        parameters: Sequence[torch.Tensor],
        *,
        noise_std: float,
        clip_norm: float,
        expected_batch_size: float,
        seed: int | None = None,
        method: str = "auto",
    ) -> "Privatizer":
        """A privatizer whose noise has one tensor per parameter (same shape, dtype, device)."""
        parameters = list(parameters)
        if not parameters:
            raise CorrnoiseError("parameters", "no parameters to privatize")
        gen = make_generator(strategy, [p.shape for p in parameters], noise_std=noise_std, seed=seed,
                             device=parameters[0].device, dtype=noise_dtype(parameters), method=method)
        return cls(gen, clip_norm, expected_batch_size)

    @property
    def noise_std(self) -> float:
        return float(self.generator.noise_std)

    def adopt_noise_std(self, noise_std: float) -> None:
        """Use ``noise_std`` from now on (resuming a run whose checkpoint was calibrated to it)."""
        nu = check_real("noise_std", noise_std, low=0.0, low_open=True)
        self._own_generator().noise_std = nu

    def _own_generator(self):
        """The generator that draws this process's rows: a ShardedNoise holds its shard's."""
        return getattr(self.generator, "local", self.generator)

    def drop_kept_rows(self) -> None:
        """The generator lets go of the rows it keeps for reuse on CPU
        (:meth:`corrnoise.noise.NoiseGenerator.drop_kept_rows`), where it keeps any."""
        drop = getattr(self._own_generator(), "drop_kept_rows", None)
        if drop is not None:
            drop()

    @property
    def step(self) -> int:
        """The index t of the next noise row."""
        return int(self.generator.t)

    @property
    def steps(self) -> int:
        """The mechanism's number of steps n (noise rows available)."""
        return int(self.generator.n)

    def noise(self) -> list[torch.Tensor]:
        """nu * (C^{-1} Z)[t] as one tensor per parameter, then advance t: views of the generator's
        flat row (kept for :meth:`privatize`) where it has one, else what its ``next()`` returns."""
        gen = self.generator
        shapes = getattr(gen, "shapes", False)
        if shapes is not False and hasattr(gen, "next_flat"):
            self._row = gen.next_flat()
            return [self._row] if shapes is None else split_flat(self._row, shapes)
        self._row = None
        noise = gen.next()
        return [noise] if isinstance(noise, torch.Tensor) else list(noise)

    def privatize(self, sums: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The privatized average gradient g_hat_t (Alg. 3.1, line 8) for this step's sums, written
        into this step's noise row (the generator's, held by nobody else)."""
        noise = self.noise()
        row, self._row = self._row, None
        return privatize_sum(list(sums), noise, self.clip_norm, self.expected_batch_size, overwrite_noise=True, row=row)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state_dict(), "clip_norm": self.clip_norm,
                "expected_batch_size": self.expected_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("clip_norm", "expected_batch_size"):
            if float(state.get(key, float("nan"))) != getattr(self, key):
                raise CorrnoiseError("state", f"{key} = {state.get(key)!r} does not match {getattr(self, key)!r}")
        self.generator.load_state_dict(state["generator"])
