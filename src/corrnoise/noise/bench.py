"""``corrnoise bench noise``: the per-step cost of correlated-noise generation.

For each mechanism we build its streaming generator (:func:`make_generator`) for a model of
``dim`` coordinates, draw one warm-up step, then time ``steps`` steps. ``extra_memory_bytes``
is what the generator holds beyond the one m-vector it returns (buffers, coefficient arrays,
and on CPU the seed-noise scratch: one counter block per filling thread); on CUDA the measured peak allocation beyond that vector is reported too.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable

from ..errors import CorrnoiseError, check_int
from ..strategies import Strategy, parse_strategy

__all__ = ["DEFAULT_MECHANISMS", "DTYPES", "REFERENCE_BLT4", "bench_mechanism", "bench_noise", "bench_strategy"]

#: One grammar for mechanism names everywhere (docs/cli.md); a representative order-4 BLT (the
#: timing does not depend on its values).
REFERENCE_BLT4 = "blt:0.25,0.15,0.08,0.04:0.995,0.95,0.8,0.4"
DEFAULT_MECHANISMS = ("dpsgd", "bsr:4", "bsr:16", "bsr:64", REFERENCE_BLT4, "dpcgd:0.9", "bisr:8", "toeplitz-sqrt")


def bench_strategy(name: str, n: int) -> tuple[Strategy, str]:
    """(strategy, method) for a mechanism name of the one grammar (:func:`parse_strategy`); the
    generator is the one training uses (``auto``: regenerated noise for a full Toeplitz C)."""
    try:
        return parse_strategy(name, n), "auto"
    except CorrnoiseError as exc:
        raise CorrnoiseError("mechanism", exc.message) from None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _available_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def _estimate_extra(strategy: Strategy, method: str, dim: int, itemsize: int) -> int:
    stream = strategy.regeneration_stream() if method == "regenerate" else strategy.noise_stream()
    return stream.buffer_rows() * dim * itemsize


def bench_mechanism(name: str, dim: int, steps: int, *, device: str = "cpu",
                    dtype=None, seed: int = 0) -> dict[str, Any]:
    """Time ``steps`` noise steps of mechanism ``name`` for a model of ``dim`` coordinates."""
    import torch

    from .generators import make_generator

    dtype = torch.float32 if dtype is None else dtype
    dim = check_int("dim", dim, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    dev = torch.device(device)
    n = steps + 65
    strategy, method = bench_strategy(name, n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = _estimate_extra(strategy, method, dim, itemsize) + 3 * dim * itemsize
    avail = _available_bytes() if dev.type == "cpu" else None
    row: dict[str, Any] = {"mechanism": name, "strategy": strategy.label}
    if avail is not None and need > 0.8 * avail:
        row.update(seconds_per_step=None, extra_memory_bytes=_estimate_extra(strategy, method, dim, itemsize),
                   skipped=f"needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
        return row
    gen = make_generator(strategy, dim, noise_std=1.0, seed=seed, device=dev, dtype=dtype, method=method)
    # warm-up (allocations, first-touch of buffers); a banded C^-1 (bisr, bandinv) until its window
    # of P regenerated rows is full, so the timed steps are the steady state
    for _ in range(max(1, getattr(strategy, "inverse_bands", 1))):
        gen.next_flat()
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = gen.next_flat()
        _sync(dev)
        times.append(time.perf_counter() - start)
        del out
    times.sort()
    median = times[len(times) // 2] if len(times) % 2 else 0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
    # The median resists other processes' interference; the mean is the total cost per step
    # (for regeneration, whose cost grows with t, the two agree up to that growth).
    row.update(generator=gen.kind, seconds_per_step=median, seconds_per_step_mean=sum(times) / steps,
               extra_memory_bytes=gen.extra_memory_bytes())
    if dev.type == "cuda":
        row["measured_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated(dev) - base - dim * itemsize)
    del gen
    gc.collect()
    return row


def bench_noise(dim: int, steps: int, mechanisms=DEFAULT_MECHANISMS, *, device: str = "cpu",
                dtype=None, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run :func:`bench_mechanism` for every mechanism; add the ratio to DP-SGD's i.i.d. noise."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    results = []
    for name in mechanisms:
        if progress:
            progress(name)
        results.append(bench_mechanism(name, dim, steps, device=device, dtype=dtype, seed=seed))
    iid = next((r["seconds_per_step"] for r in results if r["mechanism"] == "dpsgd"), None)
    for r in results:
        if iid and r.get("seconds_per_step") is not None:
            r["relative_to_dpsgd"] = r["seconds_per_step"] / iid
    return {"dim": dim, "steps": steps, "device": str(torch.device(device)), "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "results": results}


#: the dtypes ``corrnoise bench noise --dtype`` offers
DTYPES = ("bfloat16", "float16", "float32", "float64")
