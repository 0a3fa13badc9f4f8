"""Private supervised fine-tuning with trl: :class:`PrivateSFTTrainer`.

A thin variant of :class:`~corrnoise.integrations.transformers.PrivateTrainer` for trl's
``SFTTrainer``: trl prepares the data (tokenizing, chat templates, completion-only labels: the
prompt's tokens get label -100) and collates it; PrivateTrainer samples the batches, computes
one loss per example (each sequence's mean token loss over its labelled tokens), clips and
noises. trl's own loss (a token mean over the whole batch, optionally through its fused LM head
that runs the head on tiles of positions) is not used in training; it is in evaluation.

Refused besides what PrivateTrainer refuses: ``packing`` and ``padding_free`` (several examples
share one row, so a per-row clip would not bound any one example's contribution) and
``activation_offloading`` (it moves the tensors the clipping engine reads). ``SFTConfig``'s
default gradient checkpointing works: the run is the same as without it (tested).
``pip install trl``.
"""

from __future__ import annotations

import trl

from ..errors import CorrnoiseError
from .transformers import PrivateTrainer

__all__ = ["PrivateSFTTrainer"]


class PrivateSFTTrainer(PrivateTrainer, trl.SFTTrainer):
    """``trl.SFTTrainer`` trained privately: its arguments plus ``privacy=`` / ``plan=`` as for
    :class:`~corrnoise.integrations.transformers.PrivateTrainer`."""

    def __init__(self, *args, privacy=None, plan=None, **kwargs):
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if config is not None:
            _refuse_sft_settings(config)  # before trl packs or tokenizes anything
        super().__init__(*args, privacy=privacy, plan=plan, **kwargs)
        _refuse_sft_settings(self.args, padding_free=getattr(self, "padding_free", False))


def _refuse_sft_settings(args, padding_free: bool = False) -> None:
    """One line naming the first SFT setting that mixes examples in a row or moves what the
    clipping engine reads."""
    refusals = [
        ("packing", getattr(args, "packing", False),
         "puts several examples in one row: the per-example clip would bound rows, not examples"),
        ("padding_free", getattr(args, "padding_free", False) or padding_free,
         "concatenates the batch into one row: the per-example clip would not see the examples"),
        ("activation_offloading", getattr(args, "activation_offloading", False),
         "moves the activations the clipping engine reads"),
    ]
    for name, bad, why in refusals:
        if bad:
            raise CorrnoiseError(name, why)
