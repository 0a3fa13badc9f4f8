"""How a run's batches are formed: the batching for ``auto`` and for a pipeline, and the sampler
of a plan without its secret seed (:class:`SamplerSpec`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import CorrnoiseError, check_real
from ..pipelines import AUTO, pipeline_of
from ..sampling import BallsInBinsSampler, BatchSampler, make_sampler
from ..strategies import Strategy
from .mechanism import parse_mechanism

__all__ = ["SamplerSpec", "choose_batching", "estimated_steps", "pipeline_batching", "sampling_for",
           "steps_per_epoch"]


def estimated_steps(num_examples: int, batch_size: int, epochs, steps=None) -> int:
    """The run's steps before its sampler exists (a mechanism name needs n to be built, and its
    bands decide the sampler): ``steps``, else round(epochs * N / B), at least 1."""
    if steps is not None:
        return steps
    e = check_real("epochs", epochs if epochs is not None else math.nan, low=0.0, low_open=True)
    return max(1, int(round(e * num_examples / batch_size)))


def choose_batching(strategy: Strategy, num_examples: int, batch_size: int) -> str:
    """``batching="auto"``: the amplified batching whose analysis suits C (issue #10 item 3).

    DP-SGD (one band): Poisson sampling (PLD). A banded C whose bands fit as blocks
    (bands * batch_size <= N): block-cyclic Poisson (tutorial Thm 3.21). Any other
    non-negative C (BLT, DP-CGD, Toeplitz, dense): balls-in-bins with the verified Monte
    Carlo guarantee (seed 000). Otherwise fixed batches in cyclic order, unamplified.
    """
    bands = min(int(strategy.bands), strategy.n)
    if bands <= 1:
        return "poisson"
    if bands * batch_size <= num_examples and bands < strategy.n:
        return "block-cyclic"
    if strategy.rows == strategy.n and strategy.is_nonnegative():
        return "balls-in-bins"
    return "cyclic"


def sampling_for(batching: str, mechanism, num_examples: int, batch_size: int, epochs, steps) -> str:
    """The sampler name (:func:`corrnoise.sampling.make_sampler`) for ``batching``: itself, or
    for ``auto`` the one that suits the mechanism (:func:`choose_batching`)."""
    if batching != AUTO:
        return batching
    probe = mechanism if isinstance(mechanism, Strategy) else parse_mechanism(
        mechanism, estimated_steps(num_examples, batch_size, epochs, steps))
    return choose_batching(probe, num_examples, batch_size)


def pipeline_batching(strategy: Strategy, pipeline: str, num_examples: int, batch_size: int) -> str:
    """The batching a named mechanism trains with on a data ``pipeline`` (``corrnoise train
    --batching``): ``auto`` lets the mechanism choose (:func:`choose_batching`); Poisson
    sampling is every step for DP-SGD, within blocks for a banded C that fits, and plain
    Poisson for any other C (accounted by what suits it, MMCC); other pipelines as named."""
    if pipeline != "poisson":
        return pipeline
    chosen = choose_batching(strategy, num_examples, batch_size)
    return chosen if pipeline_of(chosen) == pipeline else "poisson"


def steps_per_epoch(sampler: BatchSampler, epochs, num_examples: int, batch_size: int) -> int:
    """Logical batches per pass over the private loader: the run's steps / epochs when epochs
    were given, else a natural epoch (balls-in-bins: its bins; otherwise N / B)."""
    if epochs is not None:
        return max(1, math.ceil(sampler.steps / float(epochs) - 1e-9))
    if isinstance(sampler, BallsInBinsSampler):
        return sampler.bins
    return max(1, round(num_examples / batch_size))


@dataclass(frozen=True)
class SamplerSpec:
    """A plan's sampler without its seed: the batching ``name`` it was built for (None: a ready
    sampler the user gave, which the plan describes but cannot rebuild), the dataset size, the
    (expected) batch size, the steps, the blocks of block-cyclic sampling, and
    ``description`` (:meth:`~corrnoise.sampling.BatchSampler.describe`: what the accounting
    knows of it). The seed is never part of a plan: an amplified guarantee assumes it secret,
    so it is drawn from the OS when the run starts (:meth:`build`)."""

    name: str | None
    num_examples: int
    batch_size: int
    steps: int
    blocks: int
    description: dict[str, Any]

    @classmethod
    def of(cls, name: str | None, sampler: BatchSampler, batch_size: int) -> "SamplerSpec":
        return cls(name, int(sampler.num_examples), int(batch_size), int(sampler.steps),
                   int(getattr(sampler, "blocks", 1)), dict(sampler.describe()))

    def build(self, seed: int | None = None) -> BatchSampler:
        """The sampler with ``seed`` (None: a secret one from the OS); it must be the one described."""
        if self.name is None:
            raise CorrnoiseError("batching", "the plan was made with a ready sampler: pass that sampler as batching=")
        sampler = make_sampler(self.name, self.blocks, self.num_examples, self.batch_size, steps=self.steps,
                               seed=seed)
        if sampler.describe() != self.description:
            raise CorrnoiseError("sampler", f"the {self.name} sampler for {self.num_examples} examples, batch "
                                 f"{self.batch_size} and {self.steps} steps is not the one the plan describes")
        return sampler

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_examples": self.num_examples, "batch_size": self.batch_size,
                "steps": self.steps, "blocks": self.blocks, "description": dict(self.description)}

    @classmethod
    def from_dict(cls, data: Any) -> "SamplerSpec":
        try:
            return cls(data["name"], int(data["num_examples"]), int(data["batch_size"]), int(data["steps"]),
                       int(data["blocks"]), dict(data["description"]))
        except (KeyError, TypeError, ValueError):
            raise CorrnoiseError("sampler", "the plan's sampler needs name, num_examples, batch_size, steps, blocks "
                                 "and description") from None
