"""Batch samplers for private training, usable as a torch DataLoader ``batch_sampler``.

Each sampler is an iterable of index lists (one list per training step, ``len(sampler) ==
steps``), reproducible from its seed: batch t depends only on (seed, t) and on what was
fixed at construction (block split, shuffled order, bin assignment), so iterating twice or
resuming with ``start_step`` gives the same batches. Each names the privacy analysis it
supports, in the spellings of ``corrnoise account`` (docs/design.md):

=====================  ==============================  =====================================
sampler                ``accounting`` (``--batching``)  ``participation`` (unamplified)
=====================  ==============================  =====================================
PoissonSampler         ``poisson:P``                    ``minsep:n:1`` (any pattern)
BlockCyclicPoisson     ``block-cyclic:BLOCKS:P``        ``minsep:ceil(n/BLOCKS):BLOCKS``
CyclicSampler          ``none``                         ``cyclic:K:B`` (B batches per epoch)
BallsInBinsSampler     ``balls-in-bins:BINS``           ``cyclic:K:BINS``
MinSepSampler          ``none``                         ``minsep:K:B``
=====================  ==============================  =====================================

A batch may be empty for the Poisson kinds (the sum of zero gradients is zero; only the noise
is added). The fixed-size balls-in-bins variant (seed 000 App. I) always yields exactly
``batch_size`` entries; padding entries are encoded as ``N + j`` (a zero-weight copy of
example j), which a plain dataset rejects with an IndexError -- wrap the dataset with
:meth:`BallsInBinsSampler.wrap_dataset` to get ``(example, weight)`` pairs, weight 0 for padding.

Secrecy: amplification by sampling (Poisson, block-cyclic, balls-in-bins) assumes the adversary
does not know which steps used an example, so the seed of such a sampler must be secret:
``seed=None`` (the default) draws 63 bits from the OS (:mod:`secrets`); a given seed is for
reproducible experiments only. Sampling and shuffling use numpy's PCG64, which is not a
cryptographic generator; the seed itself comes from the OS.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import numpy as np

from .errors import CorrnoiseError, check_int, check_real
from .participation import Cyclic, MinSep
from .pipelines import BATCHINGS

__all__ = [
    "BatchSampler",
    "PoissonSampler",
    "BlockCyclicPoissonSampler",
    "CyclicSampler",
    "BallsInBinsSampler",
    "MinSepSampler",
    "PaddedDataset",
    "SEED_MAX",
    "make_sampler",
]

#: The largest sampler seed (63 bits, what a seed drawn from the OS has).
SEED_MAX = (1 << 63) - 1


def _rng(seed: int, *keys: int) -> np.random.Generator:
    """A PCG64 stream for (seed, *keys): one independent stream per step / purpose."""
    return np.random.default_rng(np.random.SeedSequence([seed, *keys]))


def _fmt(p: float) -> str:
    return repr(float(p))


class BatchSampler:
    """Base class: ``steps`` batches of indices into a dataset of ``num_examples`` items."""

    accounting: str = "none"
    participation: str | None = None

    def __init__(self, num_examples: int, steps: int, seed: int | None):
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        self.steps = check_int("steps", steps, minimum=1)
        if seed is None:
            seed = secrets.randbits(63)  # OS entropy: an amplified sampler's seed must be secret
        self.seed = check_int("seed", seed, minimum=0, maximum=SEED_MAX)
        self.start_step = 0

    def _draw(self) -> None:
        """Draw what the sampler fixes at construction from ``self.seed`` (block split, shuffled
        order, bin assignment); nothing for samplers whose batches depend only on (seed, t)."""

    def reseed(self, seed: int) -> None:
        """Use ``seed`` from now on, redrawing everything fixed at construction: the same
        sampler as one built with this seed (a resumed checkpoint continues its run's batches)."""
        self.seed = check_int("seed", seed, minimum=0, maximum=SEED_MAX)
        self._draw()

    def batch(self, t: int) -> list[int]:  # pragma: no cover - abstract
        """The indices of step t."""
        raise NotImplementedError

    @property
    def amplified(self) -> bool:
        """Whether the accounting amplifies by sampling (then the seed must be secret)."""
        return self.accounting != "none"

    def _check_t(self, t: int) -> int:
        return check_int("step", t, minimum=0, maximum=self.steps - 1)

    def batches(self, start: int = 0) -> Iterator[list[int]]:
        start = check_int("start_step", start, minimum=0, maximum=self.steps)
        for t in range(start, self.steps):
            yield self.batch(t)

    def __iter__(self) -> Iterator[list[int]]:
        return self.batches(self.start_step)

    def __len__(self) -> int:
        return self.steps - self.start_step

    def describe(self) -> dict[str, Any]:
        """What the accounting needs to know about this sampler."""
        return {"sampler": type(self).__name__, "num_examples": self.num_examples, "steps": self.steps,
                "accounting": self.accounting, "participation": self.participation,
                "expected_batch_size": self.expected_batch_size}

    @property
    def expected_batch_size(self) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def batching(self):
        """The accounting layer's ``Batching`` for this sampler (``parse_batching(accounting)``,
        with the participation schema when the accounting is ``none``)."""
        from .accounting.base import parse_batching

        if self.accounting == "none":
            return parse_batching("none", self.participation)
        return parse_batching(self.accounting)


def _poisson_subset(rng: np.random.Generator, pool: np.ndarray, p: float) -> list[int]:
    """Each element of ``pool`` independently with probability p (tutorial Def. 3.18).

    Drawn as count ~ Binomial(|pool|, p), then a uniform subset of that size -- the same
    distribution as |pool| Bernoulli(p) coins, in O(count) work.
    """
    k = int(rng.binomial(pool.size, p))
    if k == 0:
        return []
    chosen = rng.choice(pool.size, size=k, replace=False, shuffle=False)
    return sorted(int(i) for i in pool[chosen])


class PoissonSampler(BatchSampler):
    """Poisson sampling (tutorial Def. 3.18): every example is in step t's batch independently
    with probability p, for every step. ``accounting = "poisson:P"``."""

    def __init__(self, num_examples: int, p: float, steps: int, seed: int | None = None):
        super().__init__(num_examples, steps, seed)
        self.p = check_real("p", p, 0.0, 1.0, low_open=True)
        self._pool = np.arange(self.num_examples)
        self.accounting = f"poisson:{_fmt(self.p)}"
        self.participation = f"minsep:{self.steps}:1"

    @classmethod
    def from_batch_size(cls, num_examples: int, batch_size: float, steps: int, seed: int | None = None):
        """p = batch_size / num_examples (expected batch size ``batch_size``)."""
        num_examples = check_int("num_examples", num_examples, minimum=1)
        b = check_real("batch_size", batch_size, 0.0, float(num_examples), low_open=True)
        return cls(num_examples, b / num_examples, steps, seed)

    @property
    def expected_batch_size(self) -> float:
        return self.p * self.num_examples

    def batch(self, t):
        t = self._check_t(t)
        return _poisson_subset(_rng(self.seed, 0, t), self._pool, self.p)


class BlockCyclicPoissonSampler(BatchSampler):
    """Block-cyclic Poisson sampling (tutorial Def. 3.20).

    Every example draws its block once, uniformly and independently of the others (seeded);
    step t Poisson-samples block t mod ``blocks`` with rate p, so the expected batch size is
    p N / blocks. Independent draws, not a split of one shuffle into equal blocks: a split keeps
    zero-out adjacency (tutorial Def. 3.5), but under add/remove an added example moves others to
    other blocks (N = 4, 2 blocks: a block ends up with 3 of the others in 2 of 5 draws), so
    neighbouring datasets would differ in more than the added example's rounds, which every
    block-cyclic analysis (tutorial Thm 3.21, MMCC, the Renyi bound) assumes.
    ``accounting = "block-cyclic:BLOCKS:P"``; an
    example can only appear in steps congruent to its block, so without amplification the
    schema is ``minsep:ceil(n/BLOCKS):BLOCKS``. ``blocks = 1`` is plain Poisson sampling.
    """

    def __init__(self, num_examples: int, blocks: int, p: float, steps: int, seed: int | None = None):
        super().__init__(num_examples, steps, seed)
        self.blocks = check_int("blocks", blocks, minimum=1, maximum=self.num_examples)
        self.p = check_real("p", p, 0.0, 1.0, low_open=True)
        self._draw()
        self.accounting = f"block-cyclic:{self.blocks}:{_fmt(self.p)}"
        k = -(-self.steps // self.blocks)
        self.participation = f"minsep:{k}:{self.blocks}"

    def _draw(self) -> None:
        assign = _rng(self.seed, 1).integers(0, self.blocks, size=self.num_examples)
        self.block_indices = [np.flatnonzero(assign == k) for k in range(self.blocks)]

    @property
    def expected_batch_size(self) -> float:
        return self.p * self.num_examples / self.blocks

    def block_of(self, index: int) -> int:
        """The block holding example ``index``."""
        for i, blk in enumerate(self.block_indices):
            pos = np.searchsorted(blk, index)
            if pos < blk.size and blk[pos] == index:
                return i
        raise CorrnoiseError("index", f"{index} is not an example index in [0, {self.num_examples})")

    def batch(self, t):
        t = self._check_t(t)
        return _poisson_subset(_rng(self.seed, 0, t), self.block_indices[t % self.blocks], self.p)


class CyclicSampler(BatchSampler):
    """Cyclic fixed-order batches (tutorial Eq. 3.16): shuffle once, cut into
    b = N // batch_size batches of exactly ``batch_size`` (the N mod batch_size leftover
    examples are never used), and visit them in the same order every epoch.

    No amplification: ``accounting = "none"`` with ``participation = "cyclic:K:b"``,
    K = ceil(steps / b) epochs. ``steps`` defaults to ``epochs * b``.
    """

    accounting = "none"

    def __init__(self, num_examples: int, batch_size: int, steps: int | None = None,
                 epochs: int | None = None, seed: int | None = None):
        num_examples = check_int("num_examples", num_examples, minimum=1)
        batch_size = check_int("batch_size", batch_size, minimum=1, maximum=num_examples)
        per_epoch = num_examples // batch_size
        if steps is None:
            if epochs is None:
                raise CorrnoiseError("steps", "give steps or epochs")
            steps = check_int("epochs", epochs, minimum=1) * per_epoch
        elif epochs is not None and check_int("steps", steps, minimum=1) != check_int("epochs", epochs, minimum=1) * per_epoch:
            raise CorrnoiseError("epochs", f"{epochs} epochs of {per_epoch} batches are not {steps} steps")
        super().__init__(num_examples, steps, seed)
        self.batch_size = batch_size
        self.batches_per_epoch = per_epoch
        self._draw()
        self.unused = int(self.num_examples - per_epoch * batch_size)
        b = min(per_epoch, self.steps)
        k = -(-self.steps // b)
        self.schema = Cyclic(k, b)
        self.schema.validate(self.steps)
        self.participation = self.schema.spec

    def _draw(self) -> None:
        order = _rng(self.seed, 1).permutation(self.num_examples)
        self.order = order[: self.batches_per_epoch * self.batch_size].reshape(self.batches_per_epoch, self.batch_size)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def batch(self, t):
        t = self._check_t(t)
        return sorted(int(i) for i in self.order[t % self.batches_per_epoch])


class BallsInBinsSampler(BatchSampler):
    """Balls-in-bins batching (seed 000 Def. 3.1), optionally with fixed-size batches (App. I).

    Every example is put once, uniformly at random and independently, into one of ``bins``
    bins; step t uses bin t mod ``bins`` (round robin, the same bins every epoch).
    ``accounting = "balls-in-bins:BINS"``; unamplified, the schema is ``cyclic:K:BINS``.

    With ``batch_size=B`` (App. I) every batch has exactly B entries: a bin with more than B
    examples is truncated to a uniformly random B of them (redrawn every step -- a truncated
    example just has gradient 0 that step, which the analysis allows under zero-out adjacency,
    tutorial Def. 3.5: a zeroed example keeps its slot; under add/remove an added example that is
    kept displaces another member, so this variant is a zero-out guarantee), and a smaller bin is
    padded with ``N + j`` entries, zero-weight copies of example j (use :meth:`wrap_dataset`
    and average over B, never over the real count). ``padded_per_bin`` and
    ``overflow_per_bin`` give the counts per use of each bin; :meth:`padding_report`
    totals them over all steps.
    """

    def __init__(self, num_examples: int, bins: int, steps: int, batch_size: int | None = None,
                 seed: int | None = None):
        super().__init__(num_examples, steps, seed)
        self.bins = check_int("bins", bins, minimum=1)
        if self.bins > self.steps:
            raise CorrnoiseError("bins", f"must be <= steps = {self.steps} (every bin is used at least once), got {self.bins}")
        self.batch_size = None if batch_size is None else check_int("batch_size", batch_size, minimum=1)
        self._draw()
        self.accounting = f"balls-in-bins:{self.bins}"
        self.participation = Cyclic(-(-self.steps // self.bins), self.bins).spec

    def _draw(self) -> None:
        assign = _rng(self.seed, 1).integers(0, self.bins, size=self.num_examples)
        order = np.argsort(assign, kind="stable")
        counts = np.bincount(assign, minlength=self.bins)
        self.bin_indices = np.split(order, np.cumsum(counts)[:-1])
        self.bin_sizes = counts
        if self.batch_size is None:
            self.padded_per_bin = np.zeros(self.bins, dtype=np.int64)
            self.overflow_per_bin = np.zeros(self.bins, dtype=np.int64)
        else:
            self.padded_per_bin = np.maximum(self.batch_size - counts, 0)
            self.overflow_per_bin = np.maximum(counts - self.batch_size, 0)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size) if self.batch_size is not None else self.num_examples / self.bins

    def is_padding(self, index: int) -> bool:
        return index >= self.num_examples

    def padding_report(self) -> dict[str, int | float]:
        """Totals over all ``steps`` of padded entries and of examples left out by truncation."""
        uses = np.bincount(np.arange(self.steps) % self.bins, minlength=self.bins)
        padded = int(np.dot(uses, self.padded_per_bin))
        dropped = int(np.dot(uses, self.overflow_per_bin))
        slots = self.steps * (self.batch_size or 0)
        return {"padded": padded, "dropped": dropped, "slots": slots,
                "padded_fraction": padded / slots if slots else 0.0,
                "dropped_fraction": dropped / max(int(np.dot(uses, self.bin_sizes)), 1),
                "empty_bins": int(np.sum(self.bin_sizes == 0))}

    def batch(self, t):
        t = self._check_t(t)
        members = self.bin_indices[t % self.bins]
        if self.batch_size is None:
            return sorted(int(i) for i in members)
        B = self.batch_size
        if members.size > B:
            pick = _rng(self.seed, 2, t).choice(members.size, size=B, replace=False)
            return sorted(int(i) for i in members[pick])
        real = sorted(int(i) for i in members)
        template = real[0] if real else 0
        return real + [self.num_examples + template] * (B - len(real))

    def wrap_dataset(self, dataset) -> "PaddedDataset":
        return PaddedDataset(dataset, self.num_examples)


class PaddedDataset:
    """``dataset[i]`` as ``(item, 1.0)`` for i < N and ``(dataset[i - N], 0.0)`` for padding
    entries i >= N (seed 000 App. I: padded examples contribute zero gradient)."""

    def __init__(self, dataset, num_examples: int):
        self.dataset = dataset
        self.num_examples = check_int("num_examples", num_examples, minimum=1)
        if len(dataset) != self.num_examples:
            raise CorrnoiseError("dataset", f"has {len(dataset)} items, the sampler was built for {self.num_examples}")

    def __len__(self) -> int:
        return 2 * self.num_examples

    def __getitem__(self, index: int):
        index = int(index)
        if 0 <= index < self.num_examples:
            return self.dataset[index], 1.0
        if self.num_examples <= index < 2 * self.num_examples:
            return self.dataset[index - self.num_examples], 0.0
        raise IndexError(index)


class MinSepSampler(BatchSampler):
    """Random participation patterns in the b-min-sep schema (tutorial Def. 3.14), for
    simulations of the unamplified multi-participation setting.

    Each example draws its own pattern: the first step uniform in [0, b + jitter), then gaps
    b + U{0..jitter}, at most k participations, all < steps. Every pattern has pairwise gaps
    >= b and at most k steps, i.e. lies in ``minsep:K:B``; jitter = 0 gives cyclic patterns.
    ``accounting = "none"``, ``participation = "minsep:K:B"``.
    """

    accounting = "none"

    def __init__(self, num_examples: int, k: int, b: int, steps: int, jitter: int = 0,
                 seed: int | None = None):
        super().__init__(num_examples, steps, seed)
        self.schema = MinSep(k, b)
        self.schema.validate(self.steps)
        self.k, self.b = self.schema.k, self.schema.b
        self.jitter = check_int("jitter", jitter, minimum=0)
        self.participation = self.schema.spec
        self._draw()

    def _draw(self) -> None:
        rng = _rng(self.seed, 1)
        steps_of = [[] for _ in range(self.steps)]
        self.patterns: list[tuple[int, ...]] = []
        first = rng.integers(0, self.b + self.jitter, size=self.num_examples)
        gaps = self.b + rng.integers(0, self.jitter + 1, size=(self.num_examples, max(self.k - 1, 1)))
        for i in range(self.num_examples):
            s, pat = int(first[i]), []
            for j in range(self.k):
                if s >= self.steps:
                    break
                pat.append(s)
                steps_of[s].append(i)
                if j < self.k - 1:
                    s += int(gaps[i, j])
            self.patterns.append(tuple(pat))
        self._batches = steps_of

    @property
    def expected_batch_size(self) -> float:
        return sum(len(p) for p in self.patterns) / self.steps

    def batch(self, t):
        t = self._check_t(t)
        return list(self._batches[t])


def make_sampler(
    sampling: str,
    strategy_bands: int,
    num_examples: int,
    batch_size: int,
    *,
    epochs: float | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> BatchSampler:
    """The sampler of batching ``sampling`` (:data:`corrnoise.pipelines.BATCHINGS` but ``auto``,
    which needs the mechanism: :func:`corrnoise.runplan.choose_batching`) with expected batch
    size ``batch_size``. Steps default to ``epochs`` passes over the data (num_examples /
    batch_size steps per epoch; N // B for cyclic batches and balls-in-bins bins).
    ``strategy_bands``: the blocks of block-cyclic sampling (the mechanism's bands)."""
    if sampling not in BATCHINGS[1:]:
        raise CorrnoiseError("sampling", f"must be one of {', '.join(BATCHINGS[1:])}, got {sampling!r}")
    n_ex = check_int("num_examples", num_examples, minimum=1)
    b = check_int("batch_size", batch_size, minimum=1, maximum=n_ex)
    if (steps is None) == (epochs is None):
        raise CorrnoiseError("steps", "give exactly one of steps and epochs")
    if sampling == "cyclic":
        per_epoch = n_ex // b
        if steps is None:
            steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * per_epoch)))
        return CyclicSampler(n_ex, b, steps=steps, seed=seed)
    if sampling == "balls-in-bins":  # n = bins * epochs (seed 000 Def. 3.1): whole epochs of N // B bins
        bins = max(1, n_ex // b)
        if steps is None:
            e = check_real("epochs", epochs, low=0.0, low_open=True)
            if not e.is_integer():
                raise CorrnoiseError("epochs", f"balls-in-bins batching runs whole epochs (of {bins} batches), got {e:g}")
            steps = int(e) * bins
        return BallsInBinsSampler(n_ex, min(bins, steps), steps, batch_size=b, seed=seed)
    if steps is None:
        steps = max(1, int(round(check_real("epochs", epochs, low=0.0, low_open=True) * n_ex / b)))
    if sampling == "poisson":
        return PoissonSampler(n_ex, b / n_ex, steps, seed=seed)
    blocks = max(1, strategy_bands)  # block-cyclic
    p = b * blocks / n_ex
    if p > 1.0:
        raise CorrnoiseError("batch_size", f"block-cyclic sampling with {blocks} blocks of ~{n_ex // blocks} "
                             f"examples cannot give batches of {b}; use a smaller batch or fewer bands")
    return BlockCyclicPoissonSampler(n_ex, blocks, p, steps, seed=seed)
