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
for a multiple-choice model. The loss per pair is trl's ``loss_type`` list weighted by
``loss_weights`` (:func:`dpo_pair_losses`), each type a function of that pair alone
(:data:`PAIR_LOSSES`: DPO's sigmoid, hinge, IPO, sigmoid_norm, EXO, NCA, robust DPO, BCO, hard SPPO,
APO-zero / -down, DiscoPOP), with trl's f-divergence scores (:func:`f_divergence_scores`); each
pair's mean of them equals trl's loss on the same batch (tested for every type). The reference
log-probabilities are trl's (its reference model, peft's adapters switched off, or the
precomputed column), computed without gradients. A LoRA policy without a ``ref_model``: trl 1.16
keeps a frozen copy of the adapter as it starts (adapter "ref") and computes the reference with it,
so the reference is the starting policy -- the base model when the adapter starts at zero, as a
new LoRA adapter does -- and stays there while the policy trains; the copy gets no noise
(tests/test_hf_trainer.py; an earlier note here said the reference moved with the policy, from a
comparison made at the start, where the two are equal). Refused: the loss types that are no function of
one pair ("aot" and "aot_unpaired" sort the batch, "sft" averages its tokens), ``ld_alpha``,
``use_weighting``, ``padding_free``, ``activation_offloading`` and a mixture-of-experts router
loss (one line each). Evaluation is trl's.

``pip install trl``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import trl
from trl.trainer import dpo_trainer as _trl_dpo

from ..errors import CorrnoiseError
from .transformers import PrivateTrainer, _output

__all__ = ["PrivateSFTTrainer", "PrivateDPOTrainer", "PairTerms", "PAIR_LOSSES", "dpo_pair_losses", "f_divergence_scores",
           "completion_logps"]


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
        _refuse_custom_collator(self.data_collator)

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
        lengths = completion.sum(dim=1).view(-1, 2)
        return dpo_pair_losses(logps, reference, lengths, self.args), outputs

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


@dataclass(frozen=True)
class PairTerms:
    """What one preference pair's DPO-family loss reads, each (B,) or (B, 2) (column 0 the chosen,
    1 the rejected completion): log-ratios r = log pi - log pi_ref, their f-divergence scores,
    the completions' token counts (at least 1), and trl's loss settings."""

    ratios: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    @property
    def delta(self) -> torch.Tensor:
        """The chosen score less the rejected score, (B,)."""
        return self.scores[:, 0] - self.scores[:, 1]


def _reverse_kl(r: torch.Tensor, alpha: float) -> torch.Tensor:
    return r


def _forward_kl(r: torch.Tensor, alpha: float) -> torch.Tensor:
    return 1 - torch.exp(-r)


def _js_divergence(r: torch.Tensor, alpha: float) -> torch.Tensor:
    return math.log(2) + F.logsigmoid(r)


def _alpha_divergence(r: torch.Tensor, alpha: float) -> torch.Tensor:
    if abs(alpha - 1.0) < 1e-6:
        return r
    return (torch.exp(torch.clamp((alpha - 1.0) * r, max=80.0)) - 1.0) / (alpha - 1.0)


#: trl's f-divergences (f_divergence_type) and their scores
_F_SCORES = {"reverse_kl": _reverse_kl, "forward_kl": _forward_kl, "js_divergence": _js_divergence,
             "alpha_divergence": _alpha_divergence}
F_DIVERGENCES = tuple(_F_SCORES)


def _divergence(name: str):
    """The score function of an f-divergence name; one line naming the setting for any other."""
    fn = _F_SCORES.get(name)
    if fn is None:
        raise CorrnoiseError("f_divergence_type", f"is {name!r}: not one of {', '.join(F_DIVERGENCES)}")
    return fn


def f_divergence_scores(ratios: torch.Tensor, divergence: str, alpha: float = 0.5) -> torch.Tensor:
    """f-DPO's scores f'(pi / pi_ref) of log-ratios r (Wang et al. 2023, "Beyond Reverse KL", Thm. 1):
    reverse KL r; forward KL 1 - e^-r; Jensen-Shannon log 2 + log sigmoid(r); alpha-divergence
    (e^((alpha - 1) r) - 1) / (alpha - 1), r itself as alpha -> 1 (its exponent capped at 80 as trl does)."""
    return _divergence(divergence)(ratios, alpha)


def _sigmoid(p: PairTerms) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, Eq. 7): -log sigmoid(beta delta)."""
    return -F.logsigmoid(p.beta * p.delta)


def _hinge(p: PairTerms) -> torch.Tensor:
    """SLiC's hinge loss on the DPO margin (Zhao et al. 2023): max(0, 1 - beta delta)."""
    return torch.relu(1 - p.beta * p.delta)


def _ipo(p: PairTerms) -> torch.Tensor:
    """IPO (Azar et al. 2023, Eq. 17) on per-token mean scores, as trl normalizes it:
    (s_w / n_w - s_l / n_l - 1 / (2 beta))^2."""
    mean = p.scores / p.lengths
    return (mean[:, 0] - mean[:, 1] - 1 / (2 * p.beta)) ** 2


def _sigmoid_norm(p: PairTerms) -> torch.Tensor:
    """DPO on per-token mean scores: -log sigmoid(beta (s_w / n_w - s_l / n_l))."""
    mean = p.scores / p.lengths
    return -F.logsigmoid(p.beta * (mean[:, 0] - mean[:, 1]))


def _exo_pair(p: PairTerms) -> torch.Tensor:
    """EXO (Ji et al. 2024, Eq. 16) for two completions: KL(softmax(beta s) || (1 - eps, eps)),
    eps = label_smoothing > 0."""
    h, eps = p.beta * p.delta, p.label_smoothing
    return (torch.sigmoid(h) * (F.logsigmoid(h) - math.log1p(-eps))
            + torch.sigmoid(-h) * (F.logsigmoid(-h) - math.log(eps)))


def _nca_pair(p: PairTerms) -> torch.Tensor:
    """NCA (Chen et al. 2024, pairwise): -log sigmoid(beta r_w) - (log sigmoid(-beta r_w) +
    log sigmoid(-beta r_l)) / 2."""
    w, l = p.beta * p.ratios[:, 0], p.beta * p.ratios[:, 1]
    return -F.logsigmoid(w) - 0.5 * F.logsigmoid(-w) - 0.5 * F.logsigmoid(-l)


def _robust(p: PairTerms) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024, Eq. 8) for preferences flipped with probability
    eps = label_smoothing < 1/2: ((1 - eps) l(h) - eps l(-h)) / (1 - 2 eps), l = -log sigmoid."""
    h, eps = p.beta * p.delta, p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)


def _bco_pair(p: PairTerms) -> torch.Tensor:
    """BCO on a pair (Jung et al. 2024): -log sigmoid(beta r_w) - log sigmoid(-beta r_l)."""
    return -F.logsigmoid(p.beta * p.ratios[:, 0]) - F.logsigmoid(-p.beta * p.ratios[:, 1])


def _sppo_hard(p: PairTerms) -> torch.Tensor:
    """SPPO with hard win probabilities (Wu et al. 2024, Eq. 4.7, P = 1 / 0):
    (r_w - 1 / (2 beta))^2 + (r_l + 1 / (2 beta))^2."""
    return (p.ratios[:, 0] - 0.5 / p.beta) ** 2 + (p.ratios[:, 1] + 0.5 / p.beta) ** 2


def _apo_zero(p: PairTerms) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, Eq. 7): 1 - sigmoid(beta r_w) + sigmoid(beta r_l)."""
    return 1 - torch.sigmoid(p.beta * p.ratios[:, 0]) + torch.sigmoid(p.beta * p.ratios[:, 1])


def _apo_down(p: PairTerms) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, Eq. 8): sigmoid(beta r_w) + 1 - sigmoid(beta (r_w - r_l))."""
    return torch.sigmoid(p.beta * p.ratios[:, 0]) + 1 - torch.sigmoid(p.beta * (p.ratios[:, 0] - p.ratios[:, 1]))


def _discopop(p: PairTerms) -> torch.Tensor:
    """DiscoPOP (Lu et al. 2024, Eq. 5), h = beta delta: -log sigmoid(h) (1 - m) + e^-h m,
    m = sigmoid(h / tau)."""
    h = p.beta * p.delta
    m = torch.sigmoid(h / p.discopop_tau)
    return -F.logsigmoid(h) * (1 - m) + torch.exp(-h) * m


#: trl's DPO loss types that are functions of one pair alone, which is what clipping each pair needs
#: ("aot" and "aot_unpaired" sort the batch's margins, "sft" averages the batch's tokens: refused)
PAIR_LOSSES = {"sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "sigmoid_norm": _sigmoid_norm,
               "exo_pair": _exo_pair, "nca_pair": _nca_pair, "robust": _robust, "bco_pair": _bco_pair,
               "sppo_hard": _sppo_hard, "apo_zero": _apo_zero, "apo_down": _apo_down, "discopop": _discopop}
#: the loss types trl defines an f-divergence for (the others read log-ratios, not scores)
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop"}


def dpo_pair_losses(logps: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, args) -> torch.Tensor:
    """Each pair's loss, (B,): sum_k w_k loss_k over trl's ``loss_type`` list and ``loss_weights``
    (default all 1), from (B, 2) log-probabilities of the chosen and rejected completions, the
    policy's and the reference's, and their (B, 2) completion token counts. ``args`` is trl's
    DPOConfig (beta, f_divergence_type, f_alpha_divergence_coef, label_smoothing, discopop_tau)."""
    losses = _pair_losses(args)
    ratios = logps - reference.to(logps.dtype)
    scores = f_divergence_scores(ratios, _divergence_name(args), getattr(args, "f_alpha_divergence_coef", 0.5))
    terms = PairTerms(ratios, scores, lengths.to(logps.dtype).clamp(min=1.0), float(args.beta),
                      float(getattr(args, "label_smoothing", 0.0)), float(getattr(args, "discopop_tau", 0.05)))
    total = None
    for fn, weight in losses:
        loss = weight * fn(terms)
        total = loss if total is None else total + loss
    return total


def _loss_types(args) -> list[str]:
    loss_type = getattr(args, "loss_type", ["sigmoid"])
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


def _divergence_name(args) -> str:
    return getattr(args, "f_divergence_type", "reverse_kl") or "reverse_kl"


def _pair_losses(args) -> list[tuple]:
    """(per-pair loss function, weight) for each of trl's ``loss_type`` with its ``loss_weights``
    (default all 1). The one place the loss settings are checked, for the trainer and a direct
    call alike: one line naming the setting where a type is no loss of one pair alone, the
    weights do not match the types, the f-divergence is unknown or undefined for a type, or
    ``label_smoothing`` is outside what its loss reads."""
    types = _loss_types(args)
    other = [t for t in types if t not in PAIR_LOSSES]
    if other:
        raise CorrnoiseError("loss_type", f"includes {other}: not a loss of one pair alone (aot sorts the batch's "
                             f"margins, sft averages its tokens); per-pair types: {sorted(PAIR_LOSSES)}")
    weights = getattr(args, "loss_weights", None) or [1.0] * len(types)
    if len(weights) != len(types):
        raise CorrnoiseError("loss_weights", f"has {len(weights)} weights for {len(types)} loss types")
    divergence = _divergence_name(args)
    _divergence(divergence)
    eps = getattr(args, "label_smoothing", 0.0)
    _refuse_first([
        ("f_divergence_type", divergence != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES,
         f"is {divergence!r}, defined only for loss types {sorted(F_DIVERGENCE_LOSSES)}"),
        ("label_smoothing", "exo_pair" in types and not 0 < eps < 1, "must lie in (0, 1) for the exo_pair loss"),
        ("label_smoothing", "robust" in types and not 0 <= eps < 0.5, "must lie in [0, 0.5) for the robust loss"),
        ("label_smoothing", eps != 0 and not {"exo_pair", "robust"} & set(types),
         "is read only by the exo_pair and robust losses here (older trl smoothed the sigmoid loss too): set 0 "
         "or use loss_type 'robust'"),
    ])
    return [(PAIR_LOSSES[t], float(w)) for t, w in zip(types, weights)]


#: trl's preference collators: a batch of B pairs as 2B rows, the B chosen then the B rejected
#: (what :class:`_PairRows` reads)
_TRL_PREFERENCE_COLLATORS = tuple(getattr(_trl_dpo, name) for name in
                                  ("DataCollatorForPreference", "DataCollatorForVisionPreference")
                                  if hasattr(_trl_dpo, name))


def _refuse_custom_collator(collator) -> None:
    """Another collator than trl's own (:data:`_TRL_PREFERENCE_COLLATORS`, by exact class): its
    2B rows have the right shapes whatever their order, so pair j would be read from rows j and
    B + j even where they hold two pairs' rows (found in review: an interleaving collator's pairs
    mixed two examples, each in two clipping units, unrefused; the attribution check passed)."""
    if type(collator) not in _TRL_PREFERENCE_COLLATORS:
        raise CorrnoiseError("data_collator", f"{type(collator).__name__} is not trl's preference collator: "
                             "PrivateDPOTrainer reads pair j from rows j and B + j as trl's DataCollatorForPreference "
                             "lays them out (the B chosen, then the B rejected); leave data_collator unset")


def _refuse_dpo_settings(args, router_loss: bool = False) -> None:
    """One line naming the first DPO setting that has no per-pair loss here, or that mixes or moves
    what the clipping engine reads."""
    _pair_losses(args)
    refusals = [
        ("ld_alpha", getattr(args, "ld_alpha", None) is not None, "only None has a per-pair loss here"),
        ("use_weighting", getattr(args, "use_weighting", False), "only False has a per-pair loss here"),
        *_row_refusals(args),
        ("router_aux_loss_coef", router_loss, "a mixture-of-experts router's loss mixes the batch's tokens: "
         "set it to 0"),
    ]
    _refuse_first(refusals)
