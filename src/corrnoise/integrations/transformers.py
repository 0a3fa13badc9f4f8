"""Private fine-tuning with the Hugging Face Trainer: :class:`PrivateTrainer`.

An existing ``transformers.Trainer`` script becomes private by changing the class and adding
``privacy=`` (the keywords of :func:`corrnoise.torch.make_private`) or ``plan=`` (a
:class:`~corrnoise.runplan.RunPlan`)::

    trainer = PrivateTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                             privacy=dict(epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()

What changes against the plain Trainer, and why:

* **Batches.** The training batches are the planned sampler's (Poisson, block-cyclic,
  balls-in-bins, cyclic), collated with the Trainer's ``data_collator``: one logical batch of
  expected size ``per_device_train_batch_size x gradient_accumulation_steps x world size`` is one
  optimizer step and one noise row. The Trainer accumulates a fixed number of backward passes
  per step, so each logical batch is cut into exactly ``gradient_accumulation_steps``
  near-equal micro-batches (:class:`~corrnoise.torch.loader.DPDataLoader` ``micro_batches``); a
  Poisson batch larger than expected gives larger micro-batches. The length of the run is the
  plan's (``max_steps``, or ``num_train_epochs`` of the private loader's epochs).
* **Loss.** The Trainer computes one loss per example and their mean over the micro-batch
  (``loss_reduction="mean"``), never a token mean over the whole batch (which would scale each
  example's gradient by the other examples' lengths, breaking the per-example sensitivity):
  token-level labels (causal LM, shifted by one; token classification) give each example's mean
  token loss, sequence classification its cross entropy (squared error for regression, binary
  cross entropy averaged over labels for multi-label), multiple choice the cross entropy over its
  choices, extractive question answering (the Trainer's ``label_names``: ``start_positions``,
  ``end_positions``) the mean of the start's and end's cross entropy. Override
  :meth:`PrivateTrainer.per_example_losses` for anything else. The model is called without its
  labels; an encoder-decoder model gets the
  ``decoder_input_ids`` it would have made from them (its own rule, else the labels shifted right
  after ``decoder_start_token_id``: Whisper). Evaluation uses the model's own loss, unchanged.
* **Attribution check.** Before its forward (also in a resumed run), the first micro-batch of at
  least 2 examples (steps on smaller ones before it are taken: no gradient can go to the wrong
  example there) is run once more in eval mode, and up to 3 of its examples alone: the clipping
  engine's gradient of each must be autograd's gradient of that example's loss computed alone
  (:meth:`~corrnoise.torch.DPOptimizer.check_attribution`). A model with a layer that sees a
  table of the batch's length instead of the batch, or a ``per_example_losses`` that mixes
  examples, is refused in one line before that batch's step; the check itself spends no privacy.
  Layers that see the batch flattened to (B*T, d) (OPT's decoder MLPs) or return an output shared
  by the batch (BART's decoder position embedding) are verified by it and then clipped.
  ``check_attribution=False`` skips it; ``trainer.attribution_report`` says what was compared.
* **Clipping.** ``TrainingArguments.max_grad_norm`` never clips the raw gradients (the
  per-example clip of the mechanism is the privacy one); it is the default of
  ``privacy["max_grad_norm"]``. The logged ``grad_norm`` is the norm of the released (clipped,
  noised, averaged) update, which is public; the raw gradient norm would not be.
* **Logs.** ``epsilon`` (the planned run's guarantee, ``optimizer.privacy_spent()``, which
  bounds every prefix of it) is logged beside the loss. The logged training loss and any
  evaluation metric are computed from the data without noise: they are not private.
* **Checkpoints.** ``optimizer.pt`` holds the private optimizer's state (noise stream position,
  the sampler seed and recent noise rows of stateful mechanisms: keep checkpoints as private as
  the data); ``privacy_plan.json`` beside it records the plan. ``resume_from_checkpoint``
  continues the same noise stream and sampler from the checkpoint's step with the checkpoint's
  plan and ends with the same guarantee. As with make_private, a checkpoint saved without
  ``store_noise_seed=True`` resumes only with the original ``noise_seed`` passed again.
  The trainer works on a copy of ``args`` with ``ignore_data_skip`` on (the private loader itself
  starts at the checkpoint's step) and ``max_grad_norm`` 0; the caller's object is unchanged.
  ``save_only_model=True`` is allowed (its checkpoints hold the model, for use as a model), but
  such a checkpoint has no ``optimizer.pt`` and is refused by ``resume_from_checkpoint``, in one
  line: resuming it would start the private optimizer again at step 0 (the sampler's first
  batches and, with the same ``noise_seed``, the same noise rows again; without it, a second
  run beyond the guarantee logged). At every resume and every step the Trainer's
  ``state.global_step`` must be the private optimizer's ``steps_taken`` (the noise rows
  released); a mismatch is refused in one line.
* **Processes.** Under ``torchrun --nproc_per_node N`` (accelerate initializes the process group
  and wraps the model in DDP) the run is make_private's data parallel one: every rank draws the
  same logical batch from a sampler seed shared by rank 0 and trains on its share, the clipped
  sums are all-reduced and the one noise row is generated in shards and gathered, so every rank
  makes the update one process would make with the same logical batch and seeds. DDP's own
  all-reduce of the unclipped gradients is switched off for the run. ``mechanism="auto"`` (or a
  planner family) is refused: plan once and pass ``plan=``, or name a mechanism. Each rank saves
  its noise state beside ``optimizer.pt`` (:func:`rank_state_file`) and loads it on resume, with
  the same number of processes.

Refused, one line naming the argument, because they would look at the data outside the
mechanism or break per-example clipping: ``group_by_length`` / a ``train_sampling_strategy``
other than ``random``, ``neftune_noise_alpha``, ``label_smoothing_factor``,
``compute_loss_func``, ``model_init``, ``auto_find_batch_size``, ``torch_compile``,
``fp16`` (a loss scaler), DeepSpeed / FSDP, torch DataParallel over several GPUs in one process
(``n_gpu``; use one process per GPU), a mixture-of-experts model configured to add its routers'
load-balancing loss (``output_router_logits``: a function of the whole batch's routing, which the
per-example loss would leave out), an iterable ``train_dataset``, and a subclass that
overrides the train sampler. Activation (gradient) checkpointing and ``bf16`` are not refused:
the clipping engine is exact under both (tests/test_hf_trainer.py, tests/test_hf_exact.py).
A left-padded training batch is right-aligned before the forward (:func:`_right_aligned`), so
that each example's tokens sit at the positions they have alone; an encoder-decoder model's
left-padded input is refused.
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch.utils.data import DataLoader

from ..errors import CorrnoiseError
from ..runplan import RunPlan, is_planned, parse_mechanism
from ..strategies import Strategy, mechanism_fingerprint
from ..torch import make_private
from ..torch.clipping.attribution import TOKEN_ALIGNED, left_padding, right_aligned
from ..torch.dp_optimizer import DPOptimizer
from ..torch.loader import DPDataLoader

__all__ = ["PrivateTrainer", "PrivateSeq2SeqTrainer", "PrivacyArguments", "PLAN_FILE", "rank_state_file"]

#: the plan's file in every checkpoint folder (beside ``optimizer.pt``, which holds the noise state)
PLAN_FILE = "privacy_plan.json"
#: the oldest transformers PrivateTrainer is tested with (tests/test_hf_trainer.py passes on 5.3.0, 5.12.0,
#: 5.17.0 and 5.24.0; 5.0-5.2 call set_initial_training_values with another signature); pyproject's
#: ``transformers`` extra says the same (tests/test_hf_trainer.py checks it)
MIN_TRANSFORMERS = "5.3"
#: the key under which each training batch carries its place in the logical batch
_MICRO_KEY = "_corrnoise_micro_batch"
#: make_private keywords that the Trainer decides (from TrainingArguments or by construction)
_TRAINER_DECIDES = {
    "epochs": "TrainingArguments.num_train_epochs", "steps": "TrainingArguments.max_steps",
    "max_physical_batch_size": "per_device_train_batch_size x gradient_accumulation_steps",
    "loss_reduction": "the Trainer's per-example loss (mean)", "distributed": "the Trainer's process setup",
}
#: make_private keywords that plan the run (a checkpoint's plan replaces them on resume)
_PLANNING = ("mechanism", "batching", "epsilon", "noise_multiplier", "noise_std", "guarantee", "delta",
             "accounting_method", "accounting_options")


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy keywords of :func:`corrnoise.torch.make_private` for :class:`PrivateTrainer`
    (a plain dict works the same). ``max_grad_norm`` None: ``TrainingArguments.max_grad_norm``.
    ``extra``: further make_private keywords passed through as given (e.g. ones newer than this
    class)."""

    mechanism: Any = "auto"
    epsilon: float | None = None
    delta: float | None = None
    max_grad_norm: float | None = None
    batching: Any = "auto"
    noise_multiplier: float | None = None
    noise_std: float | None = None
    guarantee: Any = None
    noise_seed: int | None = None
    store_noise_seed: bool = False
    nan_policy: str = "warn"
    seed: int | None = None
    accounting_method: str = "auto"
    accounting_options: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_kwargs(self) -> dict[str, Any]:
        """The make_private keywords (``extra`` merged in)."""
        kwargs = asdict(self)
        return {**{k: v for k, v in kwargs.items() if k != "extra"}, **self.extra}


class _Micro(NamedTuple):
    """Where a training batch sits: its logical step, its size, its padding mask, whether more
    micro-batches of the same step follow, and its position in the step (what the private
    optimizer's step context holds)."""

    step: int
    size: int
    mask: torch.Tensor | None
    more: bool
    index: int


class _TrainerLoader(DPDataLoader):
    """The private loader, tagging every batch with its :class:`_Micro`: the Trainer fetches a
    step's micro-batches before training on them, so the shared step context would otherwise
    describe the last one fetched, not the one in hand."""

    _prefetched = True

    def __iter__(self):
        for batch in super().__iter__():
            if not isinstance(batch, MutableMapping):
                raise CorrnoiseError("data_collator", f"must return a dict of model inputs, got "
                                     f"{type(batch).__name__}")
            c = self.context
            batch[_MICRO_KEY] = _Micro(c.current_step, c.size, c.mask, c.more_micro_batches, c.micro_batch)
            yield batch


class PrivateTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with a corrnoise private optimizer.

    Arguments: those of ``transformers.Trainer``, plus ``privacy`` (a dict or
    :class:`PrivacyArguments` of :func:`corrnoise.torch.make_private` keywords: ``mechanism``,
    ``epsilon``, ``delta``, ``max_grad_norm``, ``batching``, ``noise_seed``,
    ``store_noise_seed``, ``nan_policy``, ...; unknown keys go to make_private as given) and/or
    ``plan`` (a :class:`~corrnoise.runplan.RunPlan`, which then decides the run; ``privacy``
    holds only the keywords that do not plan, such as ``max_grad_norm`` and ``noise_seed``);
    ``check_attribution`` (default True: the first batch's per-example attribution check).
    See the module docstring for what changes against the Trainer and why. After (or during)
    ``train()``: ``trainer.private_optimizer`` (the :class:`~corrnoise.torch.DPOptimizer`),
    ``trainer.plan`` and ``trainer.privacy_spent()``."""

    def __init__(self, *args, privacy: PrivacyArguments | dict[str, Any] | None = None,
                 plan: RunPlan | None = None, check_attribution: bool = True, **kwargs):
        if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
            raise CorrnoiseError("transformers", f"version {transformers.__version__} is older than "
                                 f"{MIN_TRANSFORMERS}, the oldest PrivateTrainer is tested with (the Trainer's "
                                 "training-loop methods it extends differ before): pip install 'corrnoise[transformers]'")
        self._privacy = _privacy_kwargs(privacy, plan)
        self._given_plan = plan
        self.private_optimizer: DPOptimizer | None = None
        self._resume_dir: str | None = None
        self._released_norm: float | None = None
        self._check_attribution_on = bool(check_attribution)
        self.attribution_report = None
        super().__init__(*args, **kwargs)
        _refuse_trainer_settings(self)
        self.args = copy.copy(self.args)  # the settings below are this trainer's, not the caller's object's
        self._default_clip = self.args.max_grad_norm
        self.args.max_grad_norm = 0.0  # the Trainer clips nothing: the per-example clip is the privacy one
        self.args.ignore_data_skip = True  # the private loader starts at the checkpoint's step itself
        # the Trainer divides no loss by the accumulation steps (transformers >= 5.19; older ones do,
        # and compute_loss's unit gradient undoes it); the logged loss is training_step's
        self.loss_is_scaled_for_ga = True
        self._micro_loss: torch.Tensor | None = None
        self._step_loss: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (sum, examples, returned)
        self.add_callback(_ReleasedUpdateNorm(self))
        self.add_callback(_NoRawGradientSync(self))
        self.add_callback(_StepsAreNoiseRows(self))

    # --- the run --------------------------------------------------------------------------------
    @property
    def plan(self) -> RunPlan | None:
        """The plan being trained (None before ``train()``)."""
        return None if self.private_optimizer is None else self.private_optimizer.plan

    def privacy_spent(self):
        """The guarantee of the planned run (:meth:`corrnoise.torch.DPOptimizer.privacy_spent`)."""
        if self.private_optimizer is None:
            raise CorrnoiseError("privacy_spent", "nothing is trained yet: call train() first")
        return self.private_optimizer.privacy_spent()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``, once per PrivateTrainer (a plan is trained once; resume a run with
        a new PrivateTrainer and ``resume_from_checkpoint``)."""
        if self.private_optimizer is not None:
            raise CorrnoiseError("train", f"this PrivateTrainer has trained already ({self.private_optimizer.steps_taken} "
                                 f"of its plan's {self.private_optimizer.steps} steps); build a new one "
                                 "(resume_from_checkpoint continues a run from its latest checkpoint)")
        if resume_from_checkpoint is True:
            resume_from_checkpoint = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise CorrnoiseError("resume_from_checkpoint", f"no checkpoint in {self.args.output_dir!r}")
        self._resume_dir = resume_from_checkpoint or None
        if self._resume_dir is not None:
            _refuse_checkpoint_without_privacy_state(self._resume_dir)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:  # also when interrupted: the model goes on as a plain one (its last planned step releases it too)
            if self.private_optimizer is not None:
                self.private_optimizer.release_model()

    def get_train_dataloader(self) -> DataLoader:
        """The private loader (see the module docstring); makes the optimizer private on first use."""
        if self.private_optimizer is None:
            self._make_private()
        return self._train_loader

    def create_optimizer(self, *args, **kwargs):
        """The private optimizer, made with the training loader (:meth:`get_train_dataloader`)."""
        if self.private_optimizer is None:
            self._make_private()
        return self.optimizer

    def _make_private(self) -> None:
        """Build the Trainer's optimizer, plan the run and make model and optimizer private."""
        dataset, collator = self._training_data()
        ga = self.args.gradient_accumulation_steps
        expected = self._train_batch_size * ga * self.args.world_size
        raw = super().create_optimizer()
        kwargs = self._make_private_kwargs()
        workers = dict(num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)
        source = DataLoader(dataset, batch_size=expected, collate_fn=collator, **workers)
        try:
            _, private, loader = make_private(self.model, raw, source, **kwargs)
        except TypeError as exc:
            if "unexpected keyword argument" not in str(exc):
                raise
            raise CorrnoiseError("privacy", f"{str(exc).split('() ', 1)[-1]} (not a make_private keyword)") from None
        except CorrnoiseError as exc:
            if exc.param in ("steps", "epochs"):  # the run's length is the Trainer's (privacy= may not give it)
                raise CorrnoiseError(_TRAINER_DECIDES[exc.param], exc.message) from None
            raise
        self._train_loader = _TrainerLoader(dataset, private.sampler, steps_per_epoch=private.plan.steps_per_epoch,
                                            collate_fn=collator, context=private.context, rank=loader.rank,
                                            world_size=loader.world_size, micro_batches=ga, **workers)
        self.private_optimizer = self.optimizer = private

    def _training_data(self):
        """The train dataset and collator as the Trainer prepares them (unused columns removed)."""
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
            raise CorrnoiseError("train_dataset", "needs a map-style dataset with a length (the sampler draws indices)")
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        return dataset, collator

    def _make_private_kwargs(self) -> dict[str, Any]:
        """make_private's keywords: the privacy ones, the length from TrainingArguments (or the
        plan's), the clip norm's default, and on resume the checkpoint's plan."""
        kwargs = dict(self._privacy)
        if kwargs.get("max_grad_norm") is None:
            if not self._default_clip or self._default_clip <= 0:
                raise CorrnoiseError("max_grad_norm", "give the per-example clip norm in privacy= (or "
                                     "TrainingArguments.max_grad_norm > 0)")
            kwargs["max_grad_norm"] = self._default_clip
        plan = self._given_plan
        saved = self._checkpoint_plan()
        if saved is not None and plan is None:
            _check_saved_plan(saved, kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k not in _PLANNING}
            plan = saved
        if plan is not None:
            if self.args.max_steps > 0 and self.args.max_steps != plan.steps:
                raise CorrnoiseError("max_steps", f"is {self.args.max_steps} but the plan has {plan.steps} steps; "
                                     "leave max_steps unset (-1) to train the plan")
            return {**kwargs, "plan": plan}
        _refuse_planning_per_rank(kwargs, self.args.world_size)
        length = {"steps": self.args.max_steps} if self.args.max_steps > 0 else \
            {"epochs": float(self.args.num_train_epochs)}
        return {**kwargs, **length}

    def _checkpoint_plan(self) -> RunPlan | None:
        """The plan saved in the checkpoint being resumed, if any."""
        if self._resume_dir is None:
            return None
        path = os.path.join(self._resume_dir, PLAN_FILE)
        return RunPlan.from_json(path) if os.path.isfile(path) else None

    def set_initial_training_values(self, args, dataloader):
        """The Trainer's bookkeeping with the plan's length: ``max_steps`` is the plan's steps and
        an epoch is a pass of the private loader."""
        values = list(super().set_initial_training_values(args, dataloader))
        plan = self.private_optimizer.plan
        per_epoch = min(plan.steps_per_epoch, plan.steps)
        values[0] = math.ceil(plan.steps / per_epoch)  # num_train_epochs
        values[1] = per_epoch  # num_update_steps_per_epoch
        values[5] = per_epoch * args.gradient_accumulation_steps  # steps_in_epoch (micro-batches)
        values[6] = plan.steps  # max_steps
        return tuple(values)

    # --- one micro-batch ------------------------------------------------------------------------
    def training_step(self, model, inputs, *args, **kwargs):
        """Forward and backward of one micro-batch; its clipped sum joins the step's. The
        Trainer's optimizer step at the end of the logical batch adds the noise row. An empty
        micro-batch (a small Poisson batch) contributes nothing and runs no forward."""
        micro = inputs.pop(_MICRO_KEY, None)
        if micro is None:
            raise CorrnoiseError("inputs", "not a batch of the private train loader (get_train_dataloader): only "
                                 "its batches are the accounted ones")
        context = self.private_optimizer.context
        context.current_step, context.size, context.mask, context.more_micro_batches, context.micro_batch = micro
        if micro.index == 0 or self._step_loss is None:
            self._step_loss = (torch.zeros((), device=self.args.device), 0, torch.zeros((), device=self.args.device))
        if micro.size == 0:
            loss = None
        else:
            if self._check_attribution_on and not self.private_optimizer.attribution_checked:
                self._check_attribution(model, inputs)  # waits (None) while the micro-batch has fewer than 2
            self._micro_loss = None
            super().training_step(model, inputs, *args, **kwargs)
            if self._micro_loss is None:
                raise CorrnoiseError("compute_loss", "the training loss did not come from PrivateTrainer.compute_loss "
                                     "(the mean of per-example losses the clip needs): override per_example_losses "
                                     "instead, or call super().compute_loss")
            loss = self._micro_loss  # the micro-batch's mean loss, however the Trainer scaled what it returns
        if micro.more:
            self.private_optimizer.step()  # mid logical batch: keeps the clipped sum, adds no noise
        return self._logged_loss(loss, micro.size)

    def _logged_loss(self, loss: torch.Tensor | None, size: int) -> torch.Tensor:
        """What this micro-batch adds to the Trainer's logged loss (it sums a step's returns): the
        change of the step's mean per-example loss so far, so that the step's returns add up to the
        mean over its examples however its micro-batches are cut. Found by a user probe: each
        micro-batch's mean divided by the accumulation steps halved a step's loss whose Poisson batch
        left one micro-batch empty (4.629 logged beside 2.3145 for the same update)."""
        total, count, returned = self._step_loss
        if loss is not None and size:
            total, count = total + loss.detach() * size, count + size
        mean = total / count if count else total
        self._step_loss = (total, count, mean)
        return mean - returned

    def _check_attribution(self, model, inputs) -> None:
        """Before the forward of the first micro-batch of at least 2 examples (also of a resumed
        run): each example's gradient from this micro-batch is its own
        (:meth:`~corrnoise.torch.DPOptimizer.check_attribution`, with :meth:`per_example_losses`,
        in eval mode). No privacy is spent; a model that fails it is
        refused before any noise is added. ``check_attribution=False`` skips it."""
        inputs = self._prepare_inputs(dict(inputs))
        plain = self.accelerator.unwrap_model(model)
        autocast = torch.bfloat16 if self.args.bf16 else None  # accelerate's autocast wraps the model's forward
        self.attribution_report = self.private_optimizer.check_attribution(
            lambda batch: self._example_losses(plain, batch)[0], inputs, compute_dtype=autocast)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """In training, the mean over the micro-batch of :meth:`per_example_losses`; in
        evaluation, the Trainer's."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        losses, outputs = self._example_losses(model, inputs)
        loss = losses.mean()
        self._micro_loss = loss.detach()
        if loss.requires_grad:
            loss.register_hook(_unit_gradient)
        return (loss, outputs) if return_outputs else loss

    def _example_losses(self, model, inputs):
        """(one loss per example of a training batch, the model's outputs): the forward and
        :meth:`per_example_losses` (what the loss and the attribution check both compute), on
        the batch with any left padding moved to the right (:func:`_right_aligned`)."""
        inputs = _right_aligned(inputs, _config_of(self.accelerator.unwrap_model(model)))
        labels = self._labels(inputs)
        outputs = model(**self._model_inputs(model, inputs))
        return self.per_example_losses(model, outputs, labels), outputs

    def _label_names(self, inputs) -> list[str]:
        """The batch's label keys: the Trainer's ``label_names`` (from the model's forward, or
        ``TrainingArguments.label_names``; a question-answering model's are ``start_positions`` and
        ``end_positions``), else ``labels`` (a peft model without a task type hides its base
        model's)."""
        wanted = self.label_names or ["labels"]
        present = [n for n in wanted if n in inputs]
        if present == wanted:
            return present
        if not present and "labels" in inputs:
            return ["labels"]
        missing = ", ".join(n for n in wanted if n not in inputs)
        raise CorrnoiseError("train_dataset", f"batches lack the labels {missing}: the private loss is computed per "
                             "example from them (TrainingArguments.label_names names them)")

    def _labels(self, inputs):
        """The batch's labels: the tensor of its one label key, or a dict of them (question
        answering's ``start_positions`` and ``end_positions``)."""
        names = self._label_names(inputs)
        return inputs[names[0]] if len(names) == 1 else {n: inputs[n] for n in names}

    def _model_inputs(self, model, inputs) -> dict[str, Any]:
        """The model's arguments for a training batch: the batch without ``labels`` (the loss is
        computed per example from them, never by the model); an encoder-decoder model (T5, BART)
        gets the ``decoder_input_ids`` it would have made from them (its labels shifted right)."""
        names = self._label_names(inputs)
        given = {k: v for k, v in inputs.items() if k not in names}
        config = _config_of(self.accelerator.unwrap_model(model))
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in given \
                and "decoder_inputs_embeds" not in given and "labels" in inputs:
            base = self.accelerator.unwrap_model(model)
            base = base.get_base_model() if hasattr(base, "get_base_model") else base
            prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
            given["decoder_input_ids"] = prepare(labels=inputs["labels"]) if prepare is not None else \
                _shifted_right(inputs["labels"], config, type(base).__name__)
        return given

    def per_example_losses(self, model, outputs, labels) -> torch.Tensor:
        """One loss per example, shape (B,): token-level labels give each example's mean token
        cross entropy (causal LMs shifted by one, as their built-in loss); a multiple-choice
        model's, the cross entropy over each example's choices; question answering's
        (``labels`` a dict of ``start_positions`` and ``end_positions``), the mean of the start's
        and the end's cross entropy, as its built-in loss; other sequence-level labels, the
        model's classification or regression loss per example. Override for other tasks; the
        result must be one entry per example, depending on that example alone."""
        if isinstance(labels, dict):
            if set(labels) != {"start_positions", "end_positions"}:
                raise CorrnoiseError("label_names", f"{', '.join(sorted(labels))} have no per-example loss here; "
                                     "override PrivateTrainer.per_example_losses")
            return _span_losses(_output(outputs, "start_logits", 0), _output(outputs, "end_logits", 1),
                                labels["start_positions"], labels["end_positions"])
        logits = _output(outputs, "logits", 0)
        if labels.dim() >= 2 and logits.dim() == labels.dim() + 1:
            return _token_mean_losses(logits, labels, shift=self._model_is(model, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"))
        if self._model_is(model, "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"):
            return F.cross_entropy(logits, labels.to(logits.device).view(-1), reduction="none")
        return _sequence_losses(logits, labels, _config_of(self.accelerator.unwrap_model(model)))

    def _model_is(self, model, mapping: str) -> bool:
        """Whether the model (a peft model: its base model) is of the task of one of transformers'
        auto mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a causal LM, whose labels are the
        inputs, predicted one position ahead), by the Trainer's own test."""
        from transformers.models.auto import modeling_auto

        unwrapped = self.accelerator.unwrap_model(model)
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        return base._get_name() in getattr(modeling_auto, mapping).values()

    # --- clipping, logs and checkpoints -----------------------------------------------------------
    def _clip_grad_norm(self, model):
        """Never clip the raw gradients: the mechanism's per-example clip is the privacy one."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        """No raw gradient norm (it is not private); :meth:`log` reports the released update's."""
        return None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log, with ``epsilon`` (the run's guarantee) and, for training steps,
        ``grad_norm`` = the norm of the last released update."""
        if self.private_optimizer is not None and ("loss" in logs or "train_loss" in logs):
            logs = dict(logs)
            logs["epsilon"] = float(self.private_optimizer.privacy_spent().epsilon)
            if "loss" in logs and self._released_norm is not None:
                logs["grad_norm"] = self._released_norm
        super().log(logs, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's optimizer and scheduler files (the private optimizer's state includes the
        noise stream and the sampler seed), and the plan beside them. With several processes
        every rank also saves its own state (:func:`rank_state_file`: its shard of the noise
        stream), which is what a resumed rank loads."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.world_size > 1 and self.private_optimizer is not None:
            os.makedirs(output_dir, exist_ok=True)
            path = rank_state_file(output_dir, self.args.process_index, self.args.world_size)
            torch.save(self.private_optimizer.state_dict(), path)
        if self.args.should_save and self.plan is not None:
            self.plan.to_json(os.path.join(output_dir, PLAN_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's loading; with several processes each rank loads its own state
        (:func:`rank_state_file`) and the scheduler, since ``optimizer.pt`` holds rank 0's shard
        of the noise stream only."""
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        saved_by = _checkpoint_world_size(checkpoint)
        if saved_by not in (None, self.args.world_size):
            raise CorrnoiseError("resume_from_checkpoint", f"{checkpoint!r} was saved by {saved_by} processes, each "
                                 f"with its shard of the noise stream; resume it with {saved_by}, not "
                                 f"{self.args.world_size}")
        if self.args.world_size <= 1:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = rank_state_file(checkpoint, self.args.process_index, self.args.world_size)
        if not os.path.isfile(path):
            raise CorrnoiseError("resume_from_checkpoint", f"{checkpoint!r} holds no noise state for rank "
                                 f"{self.args.process_index} of {self.args.world_size} (saved by another number of "
                                 "processes?); resume with the processes that saved it")
        from transformers.trainer import SCHEDULER_NAME

        device = "cpu" if self.args.device.type == "cpu" else self.args.device  # torch restores no "cpu:0"
        self.private_optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class PrivateSeq2SeqTrainer(PrivateTrainer, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` made private as :class:`PrivateTrainer` makes the Trainer:
    the same ``privacy=`` / ``plan=``; training is PrivateTrainer's (an encoder-decoder's per-example
    losses, its decoder inputs made from the labels), evaluation and prediction the Seq2SeqTrainer's
    (``predict_with_generate``, ``generation_max_length``, ``gen_kwargs``), which spend no privacy."""


def _refuse_checkpoint_without_privacy_state(folder: str) -> None:
    """One line refusing to resume from a checkpoint folder that holds no private optimizer state
    (no ``optimizer.pt``, no per-rank state): ``save_only_model=True`` writes the model and the
    Trainer's state only, and the Trainer would resume from it with a fresh private optimizer at
    step 0 while its ``global_step`` goes on (found by a user probe: the sampler's first batches
    drawn again, with the same ``noise_seed`` the same noise rows added again, without it a
    second run composed beyond the logged epsilon). A folder that is not there is the
    Trainer's to report."""
    from transformers.trainer import OPTIMIZER_NAME

    if not os.path.isdir(folder) or os.path.isfile(os.path.join(folder, OPTIMIZER_NAME)) \
            or _checkpoint_world_size(folder) is not None:
        return
    raise CorrnoiseError("resume_from_checkpoint", f"{folder!r} holds no {OPTIMIZER_NAME}, the private optimizer's "
                         "state (noise stream position, sampler seed, recent noise rows): it was saved with "
                         "save_only_model=True, which keeps the model only, and resuming would start the noise and "
                         "the sampler again at step 0; resume from a checkpoint saved without save_only_model, or "
                         "train a new run from the start (a run of its own, accounted separately)")


def rank_state_file(folder: str, rank: int, world_size: int) -> str:
    """The file of one rank's private optimizer state in a checkpoint of a multi-process run
    (each rank's noise generator holds its own shard of the noise stream)."""
    return os.path.join(folder, f"corrnoise-rank{rank}-of-{world_size}.pt")


def _unit_gradient(grad: torch.Tensor) -> torch.Tensor:
    """The gradient that reaches a micro-batch's mean loss in training: exactly 1. Whatever the
    Trainer or accelerate divide the returned loss by before backward (transformers < 5.19 divide
    it by the accumulation steps), the per-example gradients the clip sees are those of the mean
    loss, as the engine's ``loss_reduction="mean"`` expects; the logical batch's sum is formed by
    the private optimizer, not by scaling. fp16 loss scaling and DeepSpeed, which would need the
    scale, are refused (:func:`_refuse_trainer_settings`)."""
    return torch.ones_like(grad)


def _checkpoint_world_size(folder: str) -> int | None:
    """The number of processes that saved a checkpoint's per-rank states (None: one process)."""
    sizes = {int(m.group(1)) for name in os.listdir(folder)
             if (m := re.fullmatch(r"corrnoise-rank\d+-of-(\d+)\.pt", name))}
    return max(sizes) if sizes else None


class _NoRawGradientSync(transformers.TrainerCallback):
    """At the start of training (after accelerate wrapped the model in DDP), switch DDP's
    all-reduce of the *unclipped* gradients off for good, as make_private does for a DDP module
    (:func:`corrnoise.torch.distributed.data_parallel`): the private step all-reduces the clipped
    sums itself, and a rank whose micro-batch is empty runs no forward or backward, so DDP's
    collectives would not match across ranks. DDP's buffer broadcast in forward goes with it
    (the clipping engine refuses layers whose buffers change in training)."""

    def __init__(self, trainer: PrivateTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, DistributedDataParallel):
            wrapped.require_backward_grad_sync = False  # what no_sync() does, for the whole run
            wrapped.require_forward_param_sync = False


class _StepsAreNoiseRows(transformers.TrainerCallback):
    """The Trainer's ``state.global_step`` is the private optimizer's ``steps_taken`` (the noise
    rows released) when training begins (also resumed) and at the start and end of every step:
    any path that let them part (a checkpoint whose files come from other steps, a callback that
    moves the step) would train steps the private optimizer does not count, or count them again
    (the save_only_model resume did: global step 8 after 4 private steps from step 0). Refused
    in one line before the step's batch is trained."""

    def __init__(self, trainer: PrivateTrainer):
        self.trainer = trainer

    def _check(self, state, when: str) -> None:
        private = self.trainer.private_optimizer
        if private is None or state.global_step == private.steps_taken:
            return
        resuming = when == "begin" and self.trainer._resume_dir is not None
        param = "resume_from_checkpoint" if resuming else "global_step"
        where = f"the checkpoint {self.trainer._resume_dir!r} says" if resuming else f"at the {when} of a step,"
        raise CorrnoiseError(param, f"{where} the Trainer's global step is {state.global_step} but the private "
                             f"optimizer has released {private.steps_taken} noise row(s): each optimizer step is one "
                             "noise row and one sampled batch, so the two must agree (resume from a checkpoint a "
                             "PrivateTrainer saved whole, and leave state.global_step to the Trainer)")

    def on_train_begin(self, args, state, control, **kwargs):
        self._check(state, "begin")

    def on_step_begin(self, args, state, control, **kwargs):
        self._check(state, "start")

    def on_step_end(self, args, state, control, **kwargs):
        self._check(state, "end")


class _ReleasedUpdateNorm(transformers.TrainerCallback):
    """Right after each optimizer step, the norm of the update the step released (clipped sum +
    noise, over the expected batch size; still in ``.grad`` until the Trainer zeroes it)."""

    def __init__(self, trainer: PrivateTrainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        private = self.trainer.private_optimizer
        grads = [p.grad for p in private.params if p.grad is not None] if private is not None else []
        if grads:
            self.trainer._released_norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


# --- losses --------------------------------------------------------------------------------------
def _token_mean_losses(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> torch.Tensor:
    """Each example's mean cross entropy over its labelled tokens (label -100 is ignored; an
    example without any labelled token has loss 0)."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.to(logits.device)
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(labels.shape)
    counted = (labels != -100).reshape(labels.shape[0], -1)
    return tokens.reshape(labels.shape[0], -1).sum(1) / counted.sum(1).clamp(min=1).to(tokens.dtype)


def _output(outputs, name: str, index: int) -> torch.Tensor:
    """A model output by name (a ModelOutput or dict), or by position (a tuple); half-precision
    logits (bf16 autocast) in float32 for the loss."""
    out = outputs[name] if isinstance(outputs, dict) else outputs[index]
    return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out


def _span_losses(start_logits: torch.Tensor, end_logits: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor) -> torch.Tensor:
    """Extractive question answering's loss, one value per example: the mean of the start's and
    the end's cross entropy over the sequence's positions, as transformers' built-in loss computes
    it (positions clamped to [0, L]; position L, outside the sequence, is ignored and counts 0)."""
    length = start_logits.shape[1]
    losses = []
    for logits, pos in ((start_logits, start), (end_logits, end)):
        pos = pos.to(logits.device).reshape(logits.shape[0], -1)[:, 0].clamp(0, length)
        losses.append(F.cross_entropy(logits, pos, ignore_index=length, reduction="none"))
    return (losses[0] + losses[1]) / 2


def _sequence_losses(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """The loss a sequence classifier computes (by ``config.problem_type`` and ``num_labels``,
    as transformers decides it), one value per example."""
    labels = labels.to(logits.device)
    num_labels = getattr(config, "num_labels", logits.shape[-1])
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        diff = (logits.squeeze(-1) if num_labels == 1 else logits) - labels.to(logits.dtype)
        return diff.pow(2).reshape(diff.shape[0], -1).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    if problem == "multi_label_classification":
        losses = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return losses.reshape(losses.shape[0], -1).mean(1)
    raise CorrnoiseError("problem_type", f"{problem!r} has no per-example loss here; override "
                         "PrivateTrainer.per_example_losses")


def _shifted_right(labels: torch.Tensor, config, name: str) -> torch.Tensor:
    """Decoder inputs made from labels as encoder-decoder models make them (Whisper has no
    ``prepare_decoder_input_ids_from_labels``): the decoder start token, then the labels shifted
    right by one, -100 (ignored positions) replaced by the pad token."""
    start = getattr(config, "decoder_start_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    if start is None or pad is None:
        raise CorrnoiseError("model", f"{name} is an encoder-decoder model whose config has no "
                             "decoder_start_token_id / pad_token_id: put decoder_input_ids in the batches")
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad)


def _right_aligned(inputs, config) -> Any:
    """The batch with each row's leading padding moved to its end (:func:`.right_aligned` of the
    attribution check, which compares with each example alone so): a left-padded row (a tokenizer
    with ``padding_side="left"``, as many chat models' are) puts an example's tokens at positions
    that depend on the longest example of its batch, so its loss, and the gradient clipped as its
    own, would depend on the others (found in review: up to 44% off in a clipped sum, unrefused).
    Refused in one line: an encoder-decoder model's left-padded encoder input (its labels run along
    other positions), and another (B, T, ...) tensor, which may or may not run along the tokens."""
    lead = left_padding(inputs)
    if lead is None:
        return inputs
    if getattr(config, "is_encoder_decoder", False):
        raise CorrnoiseError("data_collator", "pads the encoder's input on the left, which moves each example's "
                             "tokens by the longest example of its batch: pad on the right (tokenizer.padding_side = "
                             "'right')")
    shape = tuple(inputs["attention_mask"].shape)
    others = [k for k, v in inputs.items() if k not in TOKEN_ALIGNED and isinstance(v, torch.Tensor)
              and tuple(v.shape[:len(shape)]) == shape]
    if others:
        raise CorrnoiseError("data_collator", f"pads on the left and the batch's {', '.join(others)} has the tokens' "
                             "shape: moving each example's tokens to the start of its row (so that they sit where they "
                             "would alone) cannot tell whether it runs along them; pad on the right "
                             "(tokenizer.padding_side = 'right')")
    return right_aligned(inputs, lead)


def _config_of(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "config", None)


# --- arguments -----------------------------------------------------------------------------------
def _privacy_kwargs(privacy, plan) -> dict[str, Any]:
    """``privacy=`` as make_private keywords, refusing the ones the Trainer decides."""
    if privacy is None and plan is None:
        raise CorrnoiseError("privacy", "give privacy= (make_private's keywords, e.g. epsilon, delta, "
                             "max_grad_norm) or plan= (a corrnoise RunPlan)")
    if plan is not None and not isinstance(plan, RunPlan):
        raise CorrnoiseError("plan", f"must be a corrnoise.runplan.RunPlan, got {type(plan).__name__}")
    if isinstance(privacy, PrivacyArguments):
        kwargs = privacy.to_kwargs()
        if plan is not None:  # defaults of planning fields are not a choice beside a plan
            defaults = PrivacyArguments().to_kwargs()
            kwargs = {k: v for k, v in kwargs.items() if k not in _PLANNING or v != defaults[k]}
    elif privacy is None or isinstance(privacy, dict):
        kwargs = dict(privacy or {})
    else:
        raise CorrnoiseError("privacy", f"must be a dict or PrivacyArguments, got {type(privacy).__name__}")
    for key, where in _TRAINER_DECIDES.items():
        if key in kwargs:
            raise CorrnoiseError(key, f"is decided by the Trainer ({where}); leave it out of privacy=")
    for key in ("module", "optimizer", "data_loader", "plan"):
        if key in kwargs:
            raise CorrnoiseError(key, "is the Trainer's; leave it out of privacy= (pass a plan as plan=)")
    return kwargs


def _refuse_planning_per_rank(kwargs: dict[str, Any], world_size: int) -> None:
    """With several processes, ``auto`` or a planner family would be planned on every rank (the
    planner's Monte Carlo screening could choose differently): one line asking for a plan."""
    mechanism = kwargs.get("mechanism", "auto")
    if world_size > 1 and is_planned(mechanism, calibrated=kwargs.get("epsilon") is not None):
        raise CorrnoiseError("mechanism", f"{mechanism!r} would be planned on each of the {world_size} processes "
                             "(they could choose differently): plan once (corrnoise.runplan.plan_run, or corrnoise "
                             "plan --plan-out FILE) and pass PrivateTrainer(plan=...), or name a mechanism")


def _check_saved_plan(saved: RunPlan, kwargs: dict[str, Any]) -> None:
    """On resume, the checkpoint's plan continues the run; the privacy keywords must not name
    another mechanism (by content: its fingerprint for the plan's steps, so ``dpsgd`` resumes a
    run planned as ``identity``) or batching, nor ask for a stronger guarantee (another delta, a
    smaller epsilon). ``auto`` and planner families accept the plan's choice."""
    mechanism = kwargs.get("mechanism")
    if isinstance(mechanism, Strategy) or (isinstance(mechanism, str) and not is_planned(
            mechanism, calibrated=kwargs.get("epsilon") is not None)):
        given = mechanism if isinstance(mechanism, Strategy) else parse_mechanism(mechanism, saved.steps)
        if mechanism_fingerprint(given) != saved.fingerprint:
            named = mechanism if isinstance(mechanism, str) else given.label
            raise CorrnoiseError("mechanism", f"the checkpoint's run uses {saved.label!r}, not {named!r} (another "
                                 "mechanism by content)")
    batching = kwargs.get("batching")
    if isinstance(batching, str) and batching != "auto" and saved.sampler.name not in (None, batching):
        raise CorrnoiseError("batching", f"the checkpoint's run uses {saved.sampler.name!r} batching, not "
                             f"{batching!r}")
    delta = kwargs.get("delta")
    if delta is not None and delta != saved.delta:
        raise CorrnoiseError("delta", f"the checkpoint's plan is for delta {saved.delta:g}, not {delta:g}")
    epsilon = kwargs.get("epsilon")
    if epsilon is not None and saved.guarantee is not None and saved.guarantee.epsilon > epsilon * (1 + 1e-9):
        raise CorrnoiseError("epsilon", f"the checkpoint's plan guarantees epsilon {saved.guarantee.epsilon:g}, "
                             f"more than {epsilon:g}")


def _router_loss_on(model) -> bool:
    """Whether a mixture-of-experts model is configured to add its routers' load-balancing loss."""
    config = getattr(model, "config", None)  # a peft model's is its base model's
    return bool(getattr(config, "output_router_logits", False)) and bool(getattr(config, "router_aux_loss_coef", 0))


def _refuse_trainer_settings(trainer: PrivateTrainer) -> None:
    """One line naming the first Trainer setting that would look at the data outside the
    mechanism, break per-example clipping, or is not supported with it yet."""
    args = trainer.args
    refusals = [
        ("group_by_length", getattr(args, "group_by_length", False),
         "sorts examples by length outside the sampler the accounting analyses"),
        ("train_sampling_strategy", getattr(args, "train_sampling_strategy", "random") != "random",
         "orders examples outside the sampler the accounting analyses; leave it 'random'"),
        ("neftune_noise_alpha", getattr(trainer, "neftune_noise_alpha", None) is not None
         or getattr(args, "neftune_noise_alpha", None) is not None,
         "its embedding noise is not the mechanism's and its scale depends on the batch's lengths"),
        ("label_smoothing_factor", getattr(args, "label_smoothing_factor", 0) != 0,
         "the label smoother is a batch loss; override PrivateTrainer.per_example_losses instead"),
        ("compute_loss_func", getattr(trainer, "compute_loss_func", None) is not None,
         "a batch loss; override PrivateTrainer.per_example_losses (one loss per example) instead"),
        ("model_init", getattr(trainer, "model_init", None) is not None,
         "a private run trains one model once (hyperparameter search would spend privacy per trial)"),
        ("auto_find_batch_size", getattr(args, "auto_find_batch_size", False),
         "would change the batch size mid-run, outside the plan"),
        ("torch_compile", getattr(args, "torch_compile", False),
         "a compiled model breaks its graphs at the clipping engine's hooks (exact, but measured slower than "
         "eager); train eager"),
        ("fp16", getattr(args, "fp16", False),
         "the loss scaler scales the captured gradients; use bf16 or full precision"),
        ("deepspeed", getattr(trainer, "is_deepspeed_enabled", False), "is not supported with private training"),
        ("fsdp", getattr(trainer, "is_fsdp_enabled", False), "is not supported with private training"),
        ("output_router_logits", _router_loss_on(trainer.model),
         "adds the mixture-of-experts routers' load-balancing loss, a function of the whole batch's routing, "
         "which the per-example loss leaves out: set config.output_router_logits=False (or "
         "router_aux_loss_coef=0)"),
        ("n_gpu", getattr(args, "n_gpu", 1) > 1,
         "torch DataParallel over several GPUs in one process is not supported; launch one process per GPU "
         "(torchrun --nproc_per_node N), which PrivateTrainer trains data parallel"),
    ]
    for name, bad, why in refusals:
        if bad:
            raise CorrnoiseError(name, why)
    for method in ("_get_train_sampler", "get_train_dataloader"):
        if getattr(type(trainer), method) is not getattr(PrivateTrainer, method):
            raise CorrnoiseError(method, "is overridden: the training batches must be the planned sampler's "
                                 "(the ones the accounting analyses)")

