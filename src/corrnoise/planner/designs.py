"""The planner's candidate designs: how each family's C is built, what it costs, how it is batched."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CorrnoiseError
from .constants import (_PIPELINE_BATCHINGS, BANDS, BETAS, BUFFERS, MAX_DENSE_N, MAX_TOEPLITZ_N,
                        TOEPLITZ_MAX_ITERATIONS, TREE_DECODINGS)
from .families import design_family, families, family_designs, regenerable_families
from .setup import PlanSetup
from .store import cached_strategy

#: What a failed design raises (a refused input, a numerical failure -- numpy's LinAlgError is a
#: ValueError -- an overflow): the planner drops that candidate with the reason and goes on.
#: Programming errors (TypeError, AttributeError, ...) still propagate.
DESIGN_FAILURES = (CorrnoiseError, ValueError, ArithmeticError)


def _errors(strategy) -> tuple[float, float]:
    from ..losses import error_summary

    mean, mx = error_summary(strategy)
    return float(mean), float(mx)


def _regenerate_cost(noising) -> float:
    """2 * mean nnz per row of C^-1 - 1: nnz draws and nnz - 1 multiply-adds per step."""
    import numpy as np

    nnz = np.count_nonzero(np.abs(noising) > 1e-12, axis=1)
    return float(2.0 * nnz.mean() - 1.0)


def _toeplitz_regenerate_cost(inverse_coefficients, n: int) -> float:
    import numpy as np

    nz = (np.abs(np.asarray(inverse_coefficients)[:n]) > 1e-12).astype(float)
    return float(2.0 * np.cumsum(nz).mean() - 1.0)


def _tree_cost(n: int, buffered: bool) -> float:
    """Per-step cost of the online tree (noise_cost units, planner docstring), averaged over the
    n steps: step t draws k + 1 node rows (k = trailing zeros of t + 1, mean about 1). Plain
    (regenerated): k + 1 draws and k multiply-adds, 2k + 1. Least squares (buffered): k + 1
    draws and k fused multiply-adds, then 2k from the stored estimates and one copy, 4k + 2."""
    mean_k = sum(n >> l for l in range(1, n.bit_length())) / n  # sum_{s=1}^{n} v2(s) = sum_l floor(n / 2^l)
    return float(4.0 * mean_k + 2.0) if buffered else float(2.0 * mean_k + 1.0)


@dataclass
class _Design:
    """One strategy and the batchings to calibrate it under."""

    family: str
    mechanism: str
    strategy: Any
    memory: int
    cost: float
    batchings: list[str]
    seconds: float


@dataclass
class _Context:
    """What a family's designs depend on: n steps, b steps an epoch, the participation schema,
    the batchings the pipeline allows, and whether (and which) balls-in-bins applies."""

    n: int
    b: int
    part: str
    allowed: tuple
    bins_ok: bool
    bins: str


Tasks = list[tuple[str, Callable[[], "_Design | None"]]]
def _timed(fn):
    def run():
        t0 = time.perf_counter()
        design = fn()
        design.seconds = time.perf_counter() - t0
        return design
    return run


def _designs(setup: PlanSetup) -> Tasks:
    """(label, build) for every strategy the setup allows; build() optimizes it."""
    n, b = setup.n, setup.steps_per_epoch
    allowed = _PIPELINE_BATCHINGS[setup.pipeline]
    ctx = _Context(n, b, setup.participation, tuple(allowed), "balls-in-bins" in allowed and n % b == 0 and b >= 1,
                   f"balls-in-bins:{b}")
    wanted = setup.only or families()
    return [(label, _timed(build)) for family in families() if family in wanted
            for label, build in family_designs(family)(ctx)]


@design_family("dpsgd")
def _dpsgd_designs(ctx: _Context) -> Tasks:
    def dpsgd():
        from ..strategies import Identity

        # balls-in-bins too (the accounting gate checks its precondition, as for every family);
        # without it a balls-in-bins pipeline got only unamplified DP-SGD
        bats = ["none"] + (["poisson"] if "poisson" in ctx.allowed else []) + ([ctx.bins] if ctx.bins_ok else [])
        return _Design("dpsgd", "dpsgd", Identity(ctx.n), 0, 1.0, bats, 0.0)
    return [("dpsgd", dpsgd)]


@design_family("bandmf", regenerable=True)
def _bandmf_designs(ctx: _Context) -> Tasks:
    n, part, tasks = ctx.n, ctx.part, []
    for bands in BANDS:
        if bands > ctx.b or bands > n:
            continue

        def bandmf(bands=bands):
            from ..optimize import optimize_banded_toeplitz

            strat = cached_strategy("optimize_banded_toeplitz", {"n": n, "bands": bands, "participation": part},
                                    lambda: optimize_banded_toeplitz(n, bands, participation=part))
            bats = ["none"]
            if "block-cyclic" in ctx.allowed:
                bats.append(f"block-cyclic:{bands}")
            if ctx.bins_ok and strat.is_nonnegative():
                bats.append(ctx.bins)
            return _Design("bandmf", f"bandmf:{bands}", strat, bands - 1, float(bands), bats, 0.0)
        tasks.append((f"bandmf:{bands}", bandmf))
    return tasks


@design_family("blt", regenerable=True)
def _blt_designs(ctx: _Context) -> Tasks:
    n, part = ctx.n, ctx.part
    if n < 2:
        return []
    path: dict[int, Any] = {}

    def blt_path():
        """optimize_blt(n, buffers=d) for every d in BUFFERS from one run of the d = 1, 2, ...
        path (optimize_blt_each: the same BLTs, each d computed once instead of per design)."""
        from ..optimize import optimize_blt_each

        if not path:
            path.update(optimize_blt_each(n, BUFFERS, participation=part))
        return path

    def blt_or_error(d: int):
        found = blt_path().get(d)
        if found is None:
            raise CorrnoiseError("buffers", "BLT optimization did not produce valid parameters; try another "
                                 "number of buffers")
        return found

    tasks = []
    for d in BUFFERS:
        def blt(d=d):
            strat = cached_strategy("optimize_blt", {"n": n, "buffers": d, "participation": part},
                                    lambda: blt_or_error(d))
            d_eff = len(strat.alpha)
            bats = ["none"] + ([ctx.bins] if ctx.bins_ok and strat.is_nonnegative() else [])
            return _Design("blt", f"blt:{d_eff}", strat, d_eff, 1.0 + 2.0 * d_eff, bats, 0.0)
        tasks.append((f"blt:{d}", blt))
    return tasks


@design_family("dpcgd")
def _dpcgd_designs(ctx: _Context) -> Tasks:
    # beta and column normalization chosen per target and batching by the calibrated
    # rms_error (seed 003 Sec. 5.1: the best beta moves with epsilon and amplification)
    tasks = []
    for beta in BETAS:
        for colnorm in (False, True):
            def dpcgd(beta=beta, colnorm=colnorm):
                from ..strategies import DPCGD, ColumnNormalized

                strat = ColumnNormalized(DPCGD(beta, ctx.n)) if colnorm else DPCGD(beta, ctx.n)
                bats = ["none"] + ([ctx.bins] if ctx.bins_ok else [])
                name = f"dpcgd:{beta:g}" + ("+colnorm" if colnorm else "")
                return _Design("dpcgd", name, strat, 0, 4.0 if colnorm else 3.0, bats, 0.0)
            tasks.append((f"dpcgd:{beta:g}" + ("+colnorm" if colnorm else ""), dpcgd))
    return tasks


@design_family("toeplitz", regenerable=True)
def _toeplitz_designs(ctx: _Context) -> Tasks:
    n, part = ctx.n, ctx.part
    if not 2 <= n <= MAX_TOEPLITZ_N:
        return []

    def toeplitz():
        from ..optimize import optimize_banded_toeplitz

        strat = cached_strategy("optimize_banded_toeplitz", {"n": n, "bands": n, "participation": part,
                                                             "max_iterations": TOEPLITZ_MAX_ITERATIONS},
                                lambda: optimize_banded_toeplitz(n, n, participation=part,
                                                                 max_iterations=TOEPLITZ_MAX_ITERATIONS))
        # what make_generator's "auto" keeps and costs: the banded recurrence of C's nonzero
        # coefficients (as bandmf: b - 1 buffered rows, b per step); a budget it exceeds switches it
        # to regeneration (budget._regenerate). Found by a user probe: it reported 0 buffers and the
        # regenerated cost while training buffered, and a budget excluded it for the buffers it
        # said it did not keep.
        kept = int(strat.noise_stream().buffer_rows())
        return _Design("toeplitz", "toeplitz", strat, kept, float(kept + 1), ["none"], 0.0)
    return [("toeplitz", toeplitz)]


@design_family("dense")
def _dense_designs(ctx: _Context) -> Tasks:
    n, part = ctx.n, ctx.part
    if not 2 <= n <= MAX_DENSE_N:
        return []

    def dense():
        from ..optimize import optimize_dense

        strat = cached_strategy("optimize_dense", {"n": n, "participation": part},
                                lambda: optimize_dense(n, participation=part))
        return _Design("dense", "dense", strat, 0, _regenerate_cost(strat.noising_matrix()), ["none"], 0.0)
    return [("dense", dense)]


@design_family("tree")
def _tree_designs(ctx: _Context) -> Tasks:
    n = ctx.n
    if n < 2:
        return []
    tasks = []
    for decoding in TREE_DECODINGS:
        def tree(decoding=decoding):
            from ..strategies import OnlineTree

            strat = OnlineTree(n, decoding)
            stream = strat.noise_stream()
            return _Design("tree", strat.label, strat, stream.buffer_rows(), _tree_cost(n, stream.buffer_rows() > 0),
                           ["none"], 0.0)
        tasks.append(("tree" if decoding == "plain" else f"tree:{decoding}", tree))
    return tasks


#: the planner's families, in the order they are designed (registered above with design_family)
FAMILIES = families()
#: families whose buffered noise may be regenerated instead (dpsgd, dpcgd, toeplitz, dense and the
#: plain tree keep no buffers already; tree:ls is not switched: its memoryless form would
#: materialize C^{-1}, n x (2n - 1) numbers, and the plain tree is its buffer-free sibling)
REGENERABLE_FAMILIES = regenerable_families()


def _batching_spec(spec: str, setup: PlanSetup) -> str:
    """The SPEC with its probability: poisson:P, block-cyclic:BLOCKS:P (P = B BLOCKS / N)."""
    if spec == "poisson":
        return f"poisson:{setup.sampling_probability!r}"
    if spec.startswith("block-cyclic:"):
        blocks = int(spec.split(":")[1])
        p = min(1.0, setup.sampling_probability * blocks)
        return f"block-cyclic:{blocks}:{p!r}"
    return spec


