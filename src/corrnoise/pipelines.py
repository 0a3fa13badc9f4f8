"""The one vocabulary of batchings and data pipelines: how a private data loader forms batches.

======================  ================================  ==========================
batching (``name``)     accounting spec (``head``)        pipeline that forms it
======================  ================================  ==========================
``poisson``             ``poisson:P``                     ``poisson``
``block-cyclic``        ``block-cyclic:BLOCKS:P``         ``poisson``
``cyclic``              ``none`` (+ ``cyclic:K:B``)       ``cyclic``
``balls-in-bins``       ``balls-in-bins:BINS``            ``balls-in-bins``
======================  ================================  ==========================

A *batching* is what ``make_private(batching=...)`` and the samplers form; a *pipeline* is what
a user's data loading can do (``corrnoise train --batching``, ``corrnoise plan --pipeline``):
Poisson sampling also forms block-cyclic Poisson batches. Every list of these names (the
front door, the samplers, the planner's batchings per pipeline, the command line) derives from
:data:`BATCHING_KINDS`; this is the only module that writes them out. Torch-free and
import-light (the command line builds its options from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CorrnoiseError

__all__ = ["AUTO", "BatchingKind", "BATCHING_KINDS", "BATCHINGS", "PIPELINES", "batching_kind", "batching_name",
           "pipeline_of", "pipeline_spec_heads", "UNAMPLIFIED"]

#: "Let corrnoise choose": the batching that suits the mechanism, or any pipeline.
AUTO = "auto"
#: The accounting spec head of unamplified batches (any pipeline can be accounted so).
UNAMPLIFIED = "none"


@dataclass(frozen=True)
class BatchingKind:
    """One way a private data loader forms batches: ``name`` (``make_private(batching=...)``,
    the sampler), ``head`` (the first word of its accounting spec,
    :mod:`corrnoise.accounting.batching`), ``pipeline`` (the data pipeline that forms it) and
    whether its accounting is ``amplified`` by sampling (then the sampler's seed is secret)."""

    name: str
    head: str
    pipeline: str
    amplified: bool


#: The one table. A new batching scheme is one row here, its accounting ``Batching`` class and
#: its sampler (docs/design.md, "Adding a batching").
BATCHING_KINDS: tuple[BatchingKind, ...] = (
    BatchingKind("poisson", "poisson", "poisson", True),
    BatchingKind("block-cyclic", "block-cyclic", "poisson", True),
    BatchingKind("cyclic", UNAMPLIFIED, "cyclic", False),
    BatchingKind("balls-in-bins", "balls-in-bins", "balls-in-bins", True),
)
#: ``make_private(batching=...)``: ``auto`` (the batching that suits the mechanism) or one of the table.
BATCHINGS: tuple[str, ...] = (AUTO,) + tuple(k.name for k in BATCHING_KINDS)
#: The data pipelines a user may have: ``auto`` (any) or one of the table's.
PIPELINES: tuple[str, ...] = (AUTO,) + tuple(dict.fromkeys(k.pipeline for k in BATCHING_KINDS))


def batching_kind(name: str, param: str = "batching") -> BatchingKind:
    """The row named ``name`` (``auto`` is none: it is resolved first); else a one-line error."""
    for kind in BATCHING_KINDS:
        if kind.name == name:
            return kind
    raise CorrnoiseError(param, f"must be one of {', '.join(BATCHINGS[1:])}, got {name!r}")


def batching_name(spec) -> str:
    """The batching name of an accounting spec or ``Batching`` (``poisson:P`` -> ``poisson``;
    ``none`` -> ``cyclic``, unamplified fixed batches in cyclic order)."""
    head = str(getattr(spec, "spec", spec)).split(":", 1)[0]
    for kind in BATCHING_KINDS:
        if kind.head == head:
            return kind.name
    return head


def pipeline_of(name: str) -> str:
    """The pipeline that forms batching ``name`` (``auto`` for ``auto``)."""
    return AUTO if name == AUTO else batching_kind(name).pipeline


def pipeline_spec_heads(pipeline: str) -> tuple[str, ...]:
    """The accounting spec heads a run on ``pipeline`` can be accounted under: ``none`` (any
    batches, unamplified) and those of the batchings the pipeline forms (all of them for ``auto``)."""
    heads = [k.head for k in BATCHING_KINDS if pipeline == AUTO or k.pipeline == pipeline]
    return (UNAMPLIFIED,) + tuple(h for h in heads if h != UNAMPLIFIED)
