"""Integrations with other training frameworks; each imports its framework only when used.

* :mod:`corrnoise.integrations.transformers`: :class:`PrivateTrainer`, a Hugging Face
  ``transformers.Trainer`` that trains with :func:`corrnoise.torch.make_private` (``pip install
  corrnoise[transformers]``), and :class:`PrivateSeq2SeqTrainer`, the same for
  ``transformers.Seq2SeqTrainer``.
* :mod:`corrnoise.integrations.trl`: :class:`PrivateSFTTrainer` and :class:`PrivateDPOTrainer`,
  the same for trl's ``SFTTrainer`` and ``DPOTrainer`` (``pip install trl``).

``from corrnoise.integrations import PrivateTrainer`` imports transformers at that moment (and
``PrivateSFTTrainer`` / ``PrivateDPOTrainer`` trl), not when this package is imported.
"""

from __future__ import annotations

__all__ = ["PrivateTrainer", "PrivateSeq2SeqTrainer", "PrivacyArguments", "PrivateSFTTrainer", "PrivateDPOTrainer"]


def __getattr__(name: str):
    """Lazy access to the transformers integration (transformers is an optional dependency)."""
    if name in ("PrivateSFTTrainer", "PrivateDPOTrainer"):
        from . import trl as _trl

        return getattr(_trl, name)
    if name in __all__:
        from . import transformers as _transformers

        return getattr(_transformers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
