"""The private optimizer: a :class:`torch.optim.Optimizer` that privatizes the wrapped one's steps."""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch

from ..accounting import RUN_IDENTITY_KEYS, PrivacyResult, run_mismatch
from ..errors import CorrnoiseError, check_int, check_real, user_stacklevel
from ..noise.seeds import seed_commitment
from ..runplan import accounted_steps, privacy_spent
from ..sampling import SEED_MAX, BatchSampler
from ..strategies import Strategy, mechanism_fingerprint
from .loader import StepContext
from .noise_aware import noise_row_norms_squared, released_noise_variance
from .privatizer import Privatizer

__all__ = ["DPOptimizer"]


#: ``nan_policy=``: what a step does with examples whose gradient is not finite
NAN_POLICIES = ("warn", "raise")


def _refuse_direct_step(ref):
    """The step pre-hook put on the optimizer given to make_private (``ref``: a weak reference to its
    DPOptimizer): stepping it directly would apply the batch's raw, unclipped gradients without
    noise (backward leaves them in ``.grad`` on the first step) and leave the private loader
    waiting; refused in one line while that DPOptimizer's engine is attached (until the planned
    run ends, ``release_model()``, or a later make_private takes the model over)."""
    def hook(optimizer, args, kwargs):
        dp = ref()
        if dp is None or dp._stepping_original or dp.engine._detached:
            return None
        raise CorrnoiseError("optimizer", "the optimizer given to make_private was stepped directly: it would apply "
                             "the batch's raw gradients, without clipping or noise; step the optimizer make_private "
                             "returned (its step() clips, adds the noise and then steps this one)")
    return hook


class DPOptimizer(torch.optim.Optimizer):
    """A :class:`torch.optim.Optimizer` that privatizes the wrapped optimizer's steps.

    It shares ``param_groups`` and ``state`` with the wrapped optimizer (so LR schedulers and
    checkpoints see one optimizer). ``step()``: the engine's clipped per-example sum over every
    micro-batch since the last step, + max_grad_norm * noise_std * (C^-1 Z)[t], / expected batch
    size, into ``.grad``; then the wrapped optimizer's update. Attributes: ``original`` (the
    wrapped optimizer), ``strategy``, ``batching``, ``delta``, ``steps`` (planned),
    ``steps_taken``, ``noise_std``, ``noise_multiplier``, ``expected_batch_size``, ``noise_variance()``
    (of the noise in a step's released gradient; a :class:`~corrnoise.torch.NoiseAwareAdamW` wrapped
    is told it before each update), and ``plan``
    (the :class:`~corrnoise.runplan.RunPlan` make_private trained: ``optimizer.plan.to_json(path)``
    records the run for review or to train it again).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, engine, privatizer: Privatizer, strategy: Strategy,
                 batching: Any, delta: float, steps: int, accounting_method: str = "auto",
                 accounting_options: dict[str, Any] | None = None, sampler: BatchSampler | None = None,
                 context: StepContext | None = None, store_noise_seed: bool = False,
                 calibration: PrivacyResult | None = None, nan_policy: str = "warn"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CorrnoiseError("optimizer", f"must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise CorrnoiseError("optimizer", "is already private (make_private was called on it before)")
        # Optimizer.__init__ appends the very dicts of ``param_groups``: the groups are shared.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state
        self.original = optimizer
        self.engine = engine
        self.params = list(engine.parameters)
        self._ids = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._ids:
                    raise CorrnoiseError("optimizer", "optimizes a tensor that is not a trainable parameter of the "
                                         "module; its gradient would not be privatized")
        self.privatizer = privatizer
        self.strategy = strategy
        # an optimizer that corrects for the noise (NoiseAwareAdamW) is told each step's variance
        self._row_norms = noise_row_norms_squared(strategy) if hasattr(optimizer, "observe_noise_variance") else None
        self.batching = batching
        self.delta = delta
        self.steps = steps
        self.accounting_method = accounting_method
        self.accounting_options = dict(accounting_options or {})
        self.sampler = sampler
        self.context = context or StepContext()
        # the loader sharing it yields no batch while the last one's forward is captured and not stepped
        self.context.captured = self.engine.captured
        self.store_noise_seed = bool(store_noise_seed)
        self.calibration = calibration
        self.plan = None  # make_private sets it
        self.steps_taken = 0
        self.attribution_checked = False  # check_attribution passed (on a batch of at least 2)
        self.last_stats: dict[str, Any] = {}
        #: True: the released gradient is the noisy sum S + noise, not (S + noise) / B (the Opacus
        #: adapter's ``loss_reduction="sum"``, as Opacus releases it); post-processing of the mean
        self.released_sum = False
        if nan_policy not in NAN_POLICIES:
            raise CorrnoiseError("nan_policy", f"must be one of {', '.join(NAN_POLICIES)}, got {nan_policy!r}")
        self.nan_policy = nan_policy
        self._run_guarantees: dict[float, PrivacyResult] = {}
        self._sums: list[torch.Tensor] | None = None
        self._count = 0
        self._clipped = 0
        self._nonfinite = 0
        #: steps taken with examples left out for a non-finite gradient (about the data: keep it as
        #: private as the training logs)
        self.nonfinite_steps = 0
        # the wrapped optimizer stepped directly (its raw, unclipped gradients) is refused while the
        # run lasts: only step() below steps it (:meth:`_refuse_direct_step`)
        self._stepping_original = False
        self._direct_step_hook = optimizer.register_step_pre_hook(_refuse_direct_step(weakref.ref(self)))

    # --- torch.optim surface ------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "original", None) is None:  # Optimizer.__init__ registering the shared groups
            return super().add_param_group(param_group)
        raise CorrnoiseError("param_group", "cannot add parameters to a private optimizer: the noise and the "
                             "clipping cover the parameters given to make_private; add the group before it")

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus's BatchMemoryManager hook: refused, since several sampled batches in one noise
        row are outside the accounted sampling; cut batches with ``max_physical_batch_size``."""
        if do_skip:
            raise CorrnoiseError("signal_skip_step", "virtual steps (Opacus's BatchMemoryManager) are not supported: "
                                 "pass max_physical_batch_size to make_private (one noise row per sampled batch)")

    @property
    def noise_std(self) -> float:
        return self.privatizer.noise_std

    @property
    def max_grad_norm(self) -> float:
        return self.privatizer.clip_norm

    @property
    def expected_batch_size(self) -> float:
        return self.privatizer.expected_batch_size

    @property
    def noise_multiplier(self) -> float:
        from ..accounting import column_norm

        return self.noise_std / column_norm(self.strategy)

    @property
    def noise_seed(self) -> int:
        """The secret noise seed: whoever knows it can remove the noise. Needed to resume from a
        checkpoint saved without it."""
        return self.privatizer.generator.seed

    def noise_variance(self, step: int | None = None) -> float:
        """Variance of each coordinate of the noise in the gradient released at ``step`` (default:
        the next one), :func:`~corrnoise.torch.noise_aware.released_noise_variance`."""
        norms = self._row_norms if self._row_norms is not None else noise_row_norms_squared(self.strategy)
        t = check_int("step", self.privatizer.step if step is None else step, minimum=0, maximum=len(norms) - 1)
        divisor = 1.0 if self.released_sum else self.expected_batch_size
        return released_noise_variance(float(norms[t]), self.noise_std, self.max_grad_norm, divisor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and any captured forward/backward the next step would otherwise use."""
        self.original.zero_grad(set_to_none=set_to_none)
        self.engine.clear()

    def _check_trainable(self) -> None:
        """The parameters trainable now are the ones make_private privatizes: one frozen since would
        still be updated (with noise), one unfrozen since would be updated with its raw gradient."""
        for p, name in zip(self.params, self.engine.names):
            if not p.requires_grad:
                raise CorrnoiseError("module", f"parameter '{name}' was frozen after make_private; freeze parameters "
                                     "before make_private (clipping and noise cover the ones trainable then)")
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in self._ids:
                    raise CorrnoiseError("optimizer", "a parameter was unfrozen after make_private: its raw gradient "
                                         "would reach the update unclipped and without noise; unfreeze it before "
                                         "make_private")

    def release_model(self) -> None:
        """Remove the clipping engine's hooks from the model: it is a plain model again (its forward
        captures nothing, and backward gives every weight gradient, as without make_private). Done
        by itself after the last planned step; call it to stop a run early and go on with the model
        (plain fine-tuning, evaluation with gradients, a new make_private). This optimizer cannot
        step afterwards; ``privacy_spent`` and ``state_dict`` still answer. The noise generator lets
        go of the rows it kept for reuse (on CPU, up to two model-size tensors)."""
        self.engine.detach(by="optimizer")  # a second call (an engine already detached) changes nothing
        self._direct_step_hook.remove()  # the wrapped optimizer is a plain one again too
        self.privatizer.drop_kept_rows()

    def check_attribution(self, per_example_loss, batch, *, examples: int = 3, compute_dtype=None):
        """Check once, on a real batch of at least 2 examples, that the engine gives each example its
        own gradient (until then ``attribution_checked`` is False: with the private loader's batch
        of 0 or 1 examples in hand it returns None and stays pending, since no gradient can go to
        the wrong example there, so ``if not optimizer.attribution_checked:
        optimizer.check_attribution(...)`` in the loop checks the first batch that can be checked):
        ``per_example_loss(batch)`` returns one loss per example, shape (B,) (e.g. ``lambda b:
        F.cross_entropy(model(b[0]), b[1], reduction="none")``). For ``examples`` of them the
        engine's gradient from the whole batch is compared with autograd's gradient of that
        example alone (:func:`corrnoise.torch.clipping.attribution.check_attribution`): a layer
        that sees a table of the batch's length instead of the batch, or a loss that mixes
        examples, is refused in one line. Spends no privacy and changes nothing; call it before a
        step's forward (``PrivateTrainer`` does on its first batch); ``compute_dtype``
        (``torch.bfloat16``) where the model's forward runs under autocast. Returns what it compared."""
        from .clipping.attribution import check_attribution

        if self.context.size is not None and self.context.size < 2:
            return None
        report = check_attribution(self.engine, per_example_loss, batch, examples=examples, compute_dtype=compute_dtype)
        self.attribution_checked = True
        return report

    def _check_step(self) -> None:
        self._check_trainable()
        current = self.context.current_step
        if current is not None and current != self.steps_taken:
            raise CorrnoiseError(
                "data_loader", f"the batch in hand was sampled for step {current} but this is step "
                f"{self.steps_taken}: take one optimizer step per batch of the private data loader (a batch "
                "used at another step is outside the accounted sampling schema)")
        if self.steps_taken >= self.steps:
            raise CorrnoiseError(
                "steps", f"all {self.steps} planned steps are done; the privacy guarantee covers no more "
                "(plan more steps with make_private)")
        if self.privatizer.step != self.steps_taken:
            raise CorrnoiseError(
                "steps", f"the noise generator is at row {self.privatizer.step} but this is step {self.steps_taken}; "
                "step t must add row t (a row used twice is reused noise)")
        self.engine.check_attached()

    def _accumulate(self) -> None:
        """Add the clipped per-example sum of the micro-batch just back-propagated to the step's sum."""
        size = self.context.size
        if size is None:
            raise CorrnoiseError("data_loader", "step() without a batch from the private data loader: iterate the "
                                 "loader make_private returned (its batches are the accounted ones; a copy of it, "
                                 "as accelerate's prepare() makes, is not: prepare the model and optimizer only)")
        if size == 0:  # an empty (Poisson) batch: its clipped sum is 0, whatever backward captured
            sums = [torch.zeros(p.shape, dtype=torch.promote_types(torch.float32, p.dtype), device=p.device)
                    for p in self.params]
            norms = torch.zeros(0)
        else:
            if not self.engine._backward_seen:
                raise CorrnoiseError("optimizer", "step() found no backward pass for this batch: call loss.backward() "
                                     "before optimizer.step() (zero_grad() drops what backward captured)")
            sums, norms = self.engine.clipped_sum(size, weights=self.context.mask)
        self.engine.clear()
        if self.context.micro_batch == 0 and self._sums is not None:
            # the step's first micro-batch again: a new pass over the loader after one left mid
            # logical batch (found in review: the micro-batches taken before were added twice, an
            # example's clipped gradient counted 2 times); nothing of them was released
            self._sums, self._count, self._clipped, self._nonfinite = None, 0, 0, 0
        if self._sums is None:
            self._sums = list(sums)
        else:
            for acc, s in zip(self._sums, sums):
                acc.add_(s)
        real = self.context.mask.sum() if self.context.mask is not None else size
        self._count += int(real)
        self._clipped += int((norms > self.max_grad_norm).sum()) if norms.numel() else 0
        if norms.numel():
            real_norms = norms if self.context.mask is None else norms[self.context.mask.to(norms.device) > 0]
            self._nonfinite += int((~torch.isfinite(real_norms)).sum())
        self.context.size = None
        self.context.mask = None

    def step(self, closure=None):
        """One private step, or -- mid logical batch (``max_physical_batch_size``) -- the clipped sum
        of this micro-batch kept for the step that ends the logical batch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_step()
        self._accumulate()
        if self.context.more_micro_batches:
            return loss
        if self._nonfinite:
            self._report_nonfinite()
        if self._row_norms is not None:
            self.original.observe_noise_variance(self.noise_variance())
        with torch.no_grad():
            noisy = self.privatizer.privatize(self._sums)
            if self.released_sum:
                torch._foreach_mul_(noisy, float(self.expected_batch_size))
            for p, g in zip(self.params, noisy):
                p.grad = g if g.dtype == p.dtype else g.to(dtype=p.dtype)
            self._stepping_original = True
            try:
                self.original.step()
            finally:
                self._stepping_original = False
        count, clipped = self._count, self._clipped
        global_counts = getattr(self.privatizer, "all_reduce_counts", None)  # data parallel: the global batch
        if global_counts is not None:
            count, clipped = global_counts(count, clipped)
        self.last_stats = {"count": count, "clipped": clipped}
        self._sums, self._count, self._clipped, self._nonfinite = None, 0, 0, 0
        self.context.clear_batch()
        self.context.current_step = None
        self.steps_taken += 1
        self.context.next_step = self.steps_taken
        if self.steps_taken >= self.steps:
            self.release_model()  # the planned run is over: the model is a plain one again
        return loss

    def _report_nonfinite(self) -> None:
        """Examples whose gradient is NaN or inf (a NaN loss, an overflow) get clip factor 0, so
        they leave the update (a whole non-finite batch leaves a noise-only update): never
        silently. ``nan_policy="warn"`` (default) warns and takes the step (its noise row and
        privacy are spent); ``"raise"`` refuses the step before any noise is added. Either says
        how many examples, which is about the data: keep training logs as private as it."""
        bad, total, step = self._nonfinite, self._count, self.steps_taken
        what = (f"step {step}: {bad} of {total} examples had a non-finite gradient (NaN/inf loss or overflow) and "
                "were left out of the update")
        if self.nan_policy == "raise":
            self._sums, self._count, self._clipped, self._nonfinite = None, 0, 0, 0
            self.context.clear_batch()
            raise CorrnoiseError("loss", f"{what}; the step was not taken (nan_policy='raise'): lower the learning "
                                 "rate or check the loss")
        self.nonfinite_steps += 1
        warnings.warn(f"{what}; the step was taken{' as noise only' if bad >= total else ''} and its privacy spent. "
                      "Lower the learning rate or check the loss; nan_policy='raise' stops the run instead",
                      RuntimeWarning, stacklevel=user_stacklevel())

    # --- privacy -----------------------------------------------------------------------------
    def privacy_spent(self, steps: int | None = None, *, delta: float | None = None, **options: Any) -> PrivacyResult:
        """The (epsilon, delta) guarantee for what was released so far.

        Without arguments: the guarantee of the whole planned run (the one the noise was
        calibrated to, instantly; else accounted on the first call and kept: a balls-in-bins run's
        Monte Carlo verification takes about a minute, with progress lines on stderr), which bounds every prefix of it -- the
        first k released updates are a post-processing of all of them (noise row t of C^-1 Z
        depends only on rows <= t of Z). ``extras["scope"]`` says ``"run"``. ``delta``: at
        another delta (accounted once per delta). Zero steps taken: epsilon 0.

        ``steps=k`` or accounting options ask for the guarantee of the first k steps alone
        (accounted now: seconds to minutes for Monte Carlo), ``extras["scope"]`` ``"prefix"``:
        tighter under amplified batching (Poisson; balls-in-bins at whole epochs); unamplified
        (cyclic) accounting analyses the planned run's participation, so there it is the run's."""
        if steps is None and not options:
            if self.steps_taken == 0:
                return privacy_spent(self.strategy, self.batching, noise_std=self.noise_std,
                                     delta=self.delta if delta is None else delta, steps=0)
            return self.run_guarantee(delta).with_extras(steps=int(self.steps_taken), accounted_steps=int(self.steps),
                                                         scope="run")
        k = self.steps_taken if steps is None else check_int("steps", steps, minimum=0, maximum=self.steps)
        d = self.delta if delta is None else check_real("delta", delta, low=0.0, high=1.0, low_open=True,
                                                        high_open=True)
        if self.calibration is not None and not options and d == self.delta \
                and accounted_steps(self.batching, k) == self.steps:
            # the run the noise was calibrated for: its guarantee (a Monte Carlo one was verified on
            # a fresh sample; accounting it again would draw new samples and a slightly other epsilon)
            return self.calibration.with_extras(steps=int(k), accounted_steps=int(self.steps), scope="prefix")
        return privacy_spent(self.strategy, self.batching, noise_std=self.noise_std, delta=d, steps=k,
                             planned_steps=self.steps, method=self.accounting_method,
                             **{"progress": True, **self.accounting_options, **options}).with_extras(scope="prefix")

    def run_guarantee(self, delta: float | None = None) -> PrivacyResult:
        """The guarantee of the whole planned run (all ``steps``) at ``delta`` (default the run's):
        the calibration when the noise was calibrated at that delta, else accounted once and kept."""
        d = self.delta if delta is None else check_real("delta", delta, low=0.0, high=1.0, low_open=True,
                                                        high_open=True)
        if self.calibration is not None and d == self.delta:
            return self.calibration
        if d not in self._run_guarantees:
            # progress lines on stderr past a second (a balls-in-bins run's Monte Carlo verification
            # takes about a minute: found silent by a user probe)
            self._run_guarantees[d] = privacy_spent(
                self.strategy, self.batching, noise_std=self.noise_std, delta=d, steps=self.steps,
                planned_steps=self.steps, method=self.accounting_method,
                **{"progress": True, **self.accounting_options})
        return self._run_guarantees[d]

    # --- checkpoints -----------------------------------------------------------------------------
    def _sampler_state(self) -> dict[str, Any] | None:
        return None if self.sampler is None else {"seed": int(self.sampler.seed), **self.sampler.describe()}

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the noise stream's position and the sampler's identity.

        Keep it as private as the training data: it always holds the sampler seed (an amplified
        guarantee assumes it secret; a resumed run reuses it) and, for stateful mechanisms (bsr,
        blt, ...), the generator's buffers of recent noise rows. The noise seed is left out
        unless ``store_noise_seed`` was asked for (whoever reads it can remove all the noise).
        Only the model's own ``state_dict()`` is safe to publish."""
        noise = self.privatizer.state_dict()
        if not self.store_noise_seed:
            noise = {**noise, "generator": {k: v for k, v in noise["generator"].items() if k != "seed"}}
        return {"corrnoise": 1, "original": self.original.state_dict(), "noise": noise,
                "noise_seed_id": seed_commitment(self.privatizer.generator.seed),
                "steps_taken": self.steps_taken, "sampler": self._sampler_state(),
                "calibration": None if self.calibration is None else self.calibration.to_dict(),
                "mechanism": mechanism_fingerprint(self.strategy), "batching": self.batching.spec}

    def _resumed_calibration(self, saved: dict[str, Any] | None, saved_noise_std) -> PrivacyResult | None:
        """The checkpoint's calibration when this run must adopt it, else None.

        A Monte Carlo calibration (balls-in-bins) draws fresh samples, so the same ``epsilon=``
        gives a slightly other verified noise_std in the resumed process; the run must go on with
        the noise its first steps used. That noise is adopted only if its guarantee is one of
        *this* run: the same mechanism (by content, :func:`~corrnoise.accounting.run_mismatch`; the
        checkpoint's fingerprint of C matched already, see :meth:`load_state_dict`), kind guarantee, same steps, batching and method,
        delta and epsilon no larger than this run's calibration. Any other mismatch is refused."""
        if saved_noise_std is None or math.isclose(float(saved_noise_std), self.noise_std, rel_tol=1e-12, abs_tol=0.0):
            return None
        mine = self.calibration
        why = None
        if mine is None:
            why = "this run's noise was given (noise_std, noise_multiplier or guarantee), not calibrated"
        elif mine.method != "mc":  # analytic calibration is deterministic: another target (found said as "given")
            why = (f"this run's noise was calibrated ({mine.method}) to ({mine.epsilon:g}, {self.delta:g}), which gives "
                   "the same noise for the same run every time, so the checkpoint's run had another target (epsilon, "
                   "delta, steps or plan): resume with the checkpoint's")
        result = None
        if why is None:
            if not isinstance(saved, dict):
                why = "the checkpoint stores no calibration"
            else:
                result = PrivacyResult.from_dict(saved)
                why = _same_run(result, mine)
                if why is not None:
                    why = f"the checkpoint's calibration was computed for {why}"
                elif result.kind != "guarantee":
                    why = f"the checkpoint's calibration is of kind {result.kind!r}"
                elif not math.isclose(result.noise_std, float(saved_noise_std), rel_tol=1e-12, abs_tol=0.0):
                    why = "the checkpoint's calibration is for another noise_std than its noise stream"
                elif result.delta > self.delta or result.epsilon > mine.epsilon:
                    why = (f"the checkpoint's guarantee ({result.epsilon:g}, {result.delta:g}) exceeds this run's "
                           f"({mine.epsilon:g}, {self.delta:g})")
        if why is not None:
            raise CorrnoiseError("state", f"noise_std {float(saved_noise_std)!r} of the checkpoint differs from this "
                                 f"run's {self.noise_std!r}: {why}")
        return result

    def _resumed_noise_seed(self, saved: int | None, saved_id: str | None) -> int:
        """The noise seed that continues the checkpoint's noise stream (a fresh seed would restart
        C^-1 Z mid-run with other rows: the noise of the two halves would not be C^-1 Z's).

        Stored in the checkpoint (``store_noise_seed``): adopted when this run's seed was drawn
        from the OS (a new process), else it must equal the given ``noise_seed``. Not stored: this
        run's own seed continues it if it is the checkpoint's (its public ``noise_seed_id``: the
        same process, or the original seed passed again as ``noise_seed``); otherwise one line
        says what to pass."""
        mine, given = self.privatizer.generator.seed, getattr(self, "noise_seed_given", True)
        if saved is not None:
            if saved != mine and given:
                raise CorrnoiseError("noise_seed", "differs from the one stored in the checkpoint: leave noise_seed "
                                     "unset to resume with the checkpoint's, or pass that one")
            return saved
        if saved_id is not None and saved_id == seed_commitment(mine):
            return mine
        if saved_id is None and given:  # a checkpoint that names no seed: the given one is taken on trust
            return mine
        if given:
            raise CorrnoiseError("noise_seed", "is not the seed of the checkpoint's run: pass that run's "
                                 "optimizer.noise_seed")
        raise CorrnoiseError("noise_seed", "the checkpoint does not store the noise seed (saved without "
                             "store_noise_seed=True): pass the original run's optimizer.noise_seed to make_private "
                             "as noise_seed= to resume")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: same sampler (description and seed: a sampler seed drawn
        from the OS is replaced by the checkpoint's, a given one must match it), same noise seed
        (stored in the checkpoint, or passed again to make_private as ``noise_seed``). A run
        calibrated by Monte Carlo (balls-in-bins) resumes with the checkpoint's verified
        noise_std and guarantee (:meth:`_resumed_calibration`)."""
        if not isinstance(state, dict) or state.get("corrnoise") != 1:
            raise CorrnoiseError("state", "not a checkpoint of a corrnoise DPOptimizer")
        saved_mechanism = state.get("mechanism")
        if saved_mechanism is None:
            raise CorrnoiseError("state", "the checkpoint does not identify its mechanism (no fingerprint: saved "
                                 "before corrnoise 0.2); its noise rows cannot be checked to be this run's")
        if saved_mechanism != mechanism_fingerprint(self.strategy):
            # a planned family ('auto', 'blt') can come out another design when planned again (its
            # Monte Carlo screening, an emptied cache): a user probe's resumes were refused so
            # without saying what to do
            planned = self.plan is not None and bool(self.plan.candidates)
            hint = (f"; this run's {self.strategy.label} was the planner's pick, which can differ when it plans again: "
                    "plan once, save it (RunPlan.to_json, corrnoise plan --plan-out) and pass plan= to the first "
                    "run and to every resume") if planned else ""
            raise CorrnoiseError("mechanism", "differs from the checkpoint's (another C: its noise rows and its "
                                 f"guarantee are not this run's); resume with the checkpoint's mechanism{hint}")
        if state.get("batching", self.batching.spec) != self.batching.spec:
            raise CorrnoiseError("batching", f"the checkpoint's run used {state['batching']} batching, this run "
                                 f"{self.batching.spec}")
        mine, saved = self._sampler_state(), state.get("sampler")
        adopt_seed = None
        if mine != saved and isinstance(saved, dict) and isinstance(mine, dict) \
                and not getattr(self, "sampler_seed_given", True):
            # this run's sampler seed was drawn from the OS: continue the checkpoint's batches with
            # its (secret) seed, if the sampler is the same but for it (describe() does not depend
            # on the seed)
            seed = saved.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= SEED_MAX \
                    and {**mine, "seed": seed} == saved:
                mine, adopt_seed = saved, seed
        if mine != saved:
            diff = sorted(k for k in set(saved or {}) | set(mine or {}) if (saved or {}).get(k) != (mine or {}).get(k))
            raise CorrnoiseError("sampler", f"this run's sampler differs from the checkpoint's in {', '.join(diff)}; "
                                 "rebuild it with the checkpoint's seed (state['sampler']['seed'])")
        noise = dict(state["noise"])
        generator = dict(noise["generator"])
        generator["seed"] = self._resumed_noise_seed(generator.get("seed"), state.get("noise_seed_id"))
        noise["generator"] = generator
        steps_taken = check_int("steps_taken", state["steps_taken"], minimum=0, maximum=self.steps)
        if steps_taken < self.steps_taken:
            # found in review: rows steps_taken.. would be added a second time, and the difference of
            # two releases of one step cancels the noise, leaving the clipped sum in the clear
            raise CorrnoiseError("state", f"is at step {steps_taken}, but this optimizer has released the updates "
                                 f"of steps up to {self.steps_taken - 1}: resuming there would add noise rows "
                                 f"{steps_taken}..{self.steps_taken - 1} a second time; resume from the latest "
                                 "checkpoint")
        calibration = self._resumed_calibration(state.get("calibration"), generator.get("noise_std"))
        previous = self.privatizer.noise_std
        if calibration is not None:
            self.privatizer.adopt_noise_std(calibration.noise_std)
        try:
            self.privatizer.load_state_dict(noise)
            self.original.load_state_dict(state["original"])
        except Exception:
            self.privatizer.adopt_noise_std(previous)
            raise
        if calibration is not None:
            self.calibration = calibration
        self._run_guarantees.clear()  # the noise may have been adopted from the checkpoint
        if adopt_seed is not None:
            self.sampler.reseed(adopt_seed)  # in place: the data loader holds the same sampler
        self.steps_taken = steps_taken
        self.context.next_step = steps_taken
        self.context.current_step = None


def _same_run(result: PrivacyResult, reference: PrivacyResult) -> str | None:
    """Where two calibrations differ in run (:func:`~corrnoise.accounting.run_mismatch`, by
    content) or accounting method (None: same run)."""
    why = run_mismatch(result, {"mechanism": reference.extras.get("mechanism"),
                                **{k: reference.extras.get(k) for k in RUN_IDENTITY_KEYS}})
    if why is None and result.method != reference.method:
        why = f"accounting method = {result.method!r}, this run has {reference.method!r}"
    return why

