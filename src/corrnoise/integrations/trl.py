"""Private fine-tuning with trl: :class:`PrivateSFTTrainer` and :class:`PrivateDPOTrainer`.

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

:class:`PrivateDPOTrainer` is trl's ``DPOTrainer``, where one example is one preference pair
(prompt, chosen, rejected): the sampler draws pairs, and each pair's DPO loss is clipped as one
gradient, so a pair's presence is what the guarantee protects. trl collates a batch of B pairs as
2B rows, the B chosen then the B rejected; the private loader hands them over as (B, 2, L)
instead, and the model runs on the rows pair-major (chosen 0, rejected 0, chosen 1, ...): the
clipping engine reads such rows once the first batch's attribution check has verified them, as
for a multiple-choice model. The loss per pair is DPO's sigmoid loss (:func:`dpo_sigmoid_losses`);
the reference log-probabilities are trl's (its reference model, peft's adapters switched off, or
the precomputed column), computed without gradients. Refused: the other loss types and
divergences, ``loss_weights``, ``ld_alpha``, ``use_weighting``, ``padding_free``,
``activation_offloading`` and a mixture-of-experts router loss (one line each). Evaluation is trl's.

``pip install trl``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import trl

from ..errors import CorrnoiseError
from .transformers import PrivateTrainer, _output

__all__ = ["PrivateSFTTrainer", "PrivateDPOTrainer", "dpo_sigmoid_losses", "completion_logps"]


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
        *_row_refusals(args, padding_free),
    ]
    _refuse_first(refusals)


def _row_refusals(args, padding_free: bool = False) -> list[tuple[str, bool, str]]:
    """The settings both trainers refuse: rows concatenated, activations moved."""
    return [("padding_free", getattr(args, "padding_free", False) or padding_free,
             "concatenates the batch into one row: the per-example clip would not see the examples"),
            ("activation_offloading", getattr(args, "activation_offloading", False),
             "moves the activations the clipping engine reads")]


def _refuse_first(refusals: list[tuple[str, bool, str]]) -> None:
    """One line naming the first (setting, refused, why) that is refused."""
    for name, bad, why in refusals:
        if bad:
            raise CorrnoiseError(name, why)


class PrivateDPOTrainer(PrivateTrainer, trl.DPOTrainer):
    """``trl.DPOTrainer`` trained privately, one preference pair per example: its arguments plus
    ``privacy=`` / ``plan=`` as for :class:`~corrnoise.integrations.transformers.PrivateTrainer`
    (see the module docstring)."""

    def __init__(self, *args, privacy=None, plan=None, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None:
            _refuse_dpo_settings(config)  # before trl tokenizes anything
        super().__init__(*args, privacy=privacy, plan=plan, **kwargs)
        _refuse_dpo_settings(self.args, router_loss=self.aux_loss_enabled)

    def _training_data(self):
        dataset, collator = super()._training_data()
        return dataset, _PairRows(collator)

    def _example_losses(self, model, inputs):
        """Each pair's DPO loss (B,) from a batch of :class:`_PairRows`, and the model's outputs
        on its 2B rows, pair-major."""
        ids, mask, completion = (inputs[k].flatten(0, 1) for k in ("input_ids", "attention_mask", "completion_mask"))
        reference = self._reference_logps(inputs)
        outputs = model(input_ids=ids, attention_mask=mask, use_cache=False)
        logps = completion_logps(_output(outputs, "logits", 0), ids, completion).view(-1, 2)
        return dpo_sigmoid_losses(logps, reference, self.beta), outputs

    def _reference_logps(self, inputs) -> torch.Tensor:
        """(B, 2): each pair's reference log-probabilities of its chosen and rejected completion,
        trl's (precomputed, or its reference model's without gradients, in trl's row order)."""
        if "ref_chosen_logps" in inputs:
            return torch.stack([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]], dim=1)
        if self.precompute_ref_logps:  # no reference model is kept: never take the policy for it
            raise CorrnoiseError("train_dataset", "batches lack the precomputed ref_chosen_logps / ref_rejected_logps "
                                 "(precompute_ref_log_probs=True): keep those columns")
        rows = {k: inputs[k].transpose(0, 1).flatten(0, 1) for k in ("input_ids", "attention_mask", "completion_mask")}
        chosen, rejected = self.compute_ref_log_probs(self.ref_model or self.model, rows)
        return torch.stack([chosen, rejected], dim=1).detach()


class _PairRows:
    """A trl preference collator whose (2B, L) rows (the B chosen, then the B rejected) come out
    as (B, 2, L): one entry per pair, so that the private loader's batch, its micro-batches and the
    attribution check's one-example batches cut pairs, not rows."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        b = len(examples)
        for key in ("input_ids", "attention_mask", "completion_mask"):
            t = batch.get(key) if isinstance(batch, dict) else None
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != 2 * b:
                got = "missing" if t is None else tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CorrnoiseError("data_collator", f"must return trl's preference batch: '{key}' with 2 x {b} rows "
                                     f"(the chosen, then the rejected), got {got}")
            batch[key] = t.view(2, b, *t.shape[1:]).transpose(0, 1).contiguous()
        return batch


def completion_logps(logits: torch.Tensor, ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its completion, (rows,): sum_t m_(t+1) log p(x_(t+1) | x_(<=t)),
    m the completion mask (what trl's DPO sums, ``ld_alpha`` None), in float32 or wider."""
    logp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1).to(logits.device)).squeeze(-1)
    return (picked * completion[:, 1:].to(picked.dtype)).sum(dim=1)


def dpo_sigmoid_losses(logps: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's loss per pair (Rafailov et al. 2023, Eq. 7), (B,): -log sigmoid(beta ((log pi(y_w) -
    log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)))), from (B, 2) log-probabilities of the
    chosen (column 0) and rejected (column 1) completions, the policy's and the reference's."""
    ratios = logps - reference.to(logps.dtype)
    return -F.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1]))


def _refuse_dpo_settings(args, router_loss: bool = False) -> None:
    """One line naming the first DPO setting that has no per-pair loss here, or that mixes or moves
    what the clipping engine reads."""
    loss_type = getattr(args, "loss_type", ["sigmoid"])
    loss_type = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    refusals = [
        ("loss_type", loss_type != ["sigmoid"], f"is {loss_type}: only ['sigmoid'] (DPO) has a per-pair loss here"),
        ("loss_weights", getattr(args, "loss_weights", None) not in (None, [1.0]), "weighs several losses: only "
         "DPO's sigmoid loss alone has a per-pair loss here"),
        ("f_divergence_type", getattr(args, "f_divergence_type", "reverse_kl") not in ("reverse_kl", None),
         "only 'reverse_kl' (DPO) has a per-pair loss here"),
        ("ld_alpha", getattr(args, "ld_alpha", None) is not None, "only None has a per-pair loss here"),
        ("use_weighting", getattr(args, "use_weighting", False), "only False has a per-pair loss here"),
        *_row_refusals(args),
        ("router_aux_loss_coef", router_loss, "a mixture-of-experts router's loss mixes the batch's tokens: "
         "set it to 0"),
    ]
    _refuse_first(refusals)
