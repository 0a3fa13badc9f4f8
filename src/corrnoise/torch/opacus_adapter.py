"""Opacus adapter (extra ``opacus``): Opacus's per-sample gradients and optimizer flow, with
correlated noise instead of Opacus's independent noise.

Opacus computes per-sample gradients with hooks (``GradSampleModule``), clips and sums them in
``DPOptimizer.clip_and_accumulate``, adds N(0, (sigma * max_grad_norm)^2) noise in ``add_noise``
and divides by the expected batch size in ``scale_grad``. :class:`CorrelatedNoiseDPOptimizer`
replaces only ``add_noise``: the noise of step t is ``max_grad_norm * nu * (C^{-1} Z)[t]`` from a
:mod:`corrnoise.noise` generator (tutorial Alg. 3.1, line 7), everything else is Opacus's.

Privacy is accounted by corrnoise (:func:`corrnoise.torch.optimizer.privacy_spent`), not by
Opacus's accountants, which know only independent noise: do not attach a PrivacyEngine
accountant to this optimizer.

    run = make_private_opacus(model, optimizer, train_set, mechanism="bsr:4", epsilon=8.0,
                              delta=1e-5, batch_size=64, epochs=10, max_grad_norm=1.0)
    for x, y in run.data_loader:
        run.optimizer.zero_grad()
        loss_fn(run.module(x), y).backward()
        run.optimizer.step()
    print(run.privacy_spent())

opacus is imported lazily; without it every entry point raises one CorrnoiseError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorrnoiseError, check_real
from ..noise import make_generator
from ..sampling import BallsInBinsSampler
from .optimizer import _SafeCollate, plan_private, privacy_spent

__all__ = ["require_opacus", "CorrelatedNoiseDPOptimizer", "correlated_dp_optimizer", "OpacusRun",
           "make_private_opacus"]


def require_opacus():
    """The opacus module, or a one-line CorrnoiseError naming how to install it."""
    try:
        import opacus
    except ImportError:
        raise CorrnoiseError("opacus", "is not installed; install the extra: pip install 'corrnoise[opacus]'") from None
    return opacus


_VIRTUAL_STEPS = ("virtual steps (BatchMemoryManager, skipped steps, gradient accumulation) put several sampled "
                  "batches into one noise row, which the accounted sampling rate does not cover; use one sampled "
                  "batch per optimizer step (a smaller batch_size, or make_private with chunk_size)")


@functools.lru_cache(maxsize=1)
def _optimizer_class():
    opacus = require_opacus()
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class _CorrelatedNoiseDPOptimizer(opacus.optimizers.DPOptimizer):
        """An Opacus ``DPOptimizer`` whose ``add_noise`` adds max_grad_norm * nu * (C^{-1} Z)[t]."""

        def __init__(self, optimizer, *, noise_source, max_grad_norm, expected_batch_size, max_steps=None, **kwargs):
            super().__init__(optimizer, noise_multiplier=float(noise_source.noise_std), max_grad_norm=max_grad_norm,
                             expected_batch_size=expected_batch_size, **kwargs)
            self.noise_source = noise_source
            self.max_steps = int(noise_source.n if max_steps is None else min(max_steps, noise_source.n))

        def signal_skip_step(self, do_skip=True):
            if do_skip:
                raise CorrnoiseError("signal_skip_step", _VIRTUAL_STEPS)
            super().signal_skip_step(do_skip)

        def pre_step(self, closure=None):
            if self.noise_source.t >= self.max_steps:
                raise CorrnoiseError("steps", f"all {self.max_steps} planned steps are done; the privacy guarantee "
                                     "covers no more (plan more steps)")
            if self._check_skip_next_step(pop_next=False):
                raise CorrnoiseError("signal_skip_step", _VIRTUAL_STEPS)
            accumulated = [len(p.grad_sample) for p in self.params if isinstance(getattr(p, "grad_sample", None), list)]
            if accumulated and max(accumulated) > 1:
                raise CorrnoiseError("step", f"{max(accumulated)} backward passes are accumulated into one step "
                                     f"(call zero_grad() before each batch's backward); {_VIRTUAL_STEPS}")
            if self.params and all(getattr(p, "grad_sample", None) is None for p in self.params):
                # an empty (Poisson) batch, no backward: the clipped sum is 0, the noise row is still used
                for p in self.params:
                    if p.summed_grad is None:
                        p.summed_grad = torch.zeros_like(p)
                self.add_noise()
                if self.loss_reduction == "mean":
                    for p in self.params:
                        p.grad /= self.expected_batch_size
                if self.step_hook:
                    self.step_hook(self)
                self._is_last_step_skipped = False
                return True
            return super().pre_step(closure)

        def clip_and_accumulate(self):
            self._zero_out_non_finite()
            super().clip_and_accumulate()

        def _zero_out_non_finite(self):
            """Replace every example's per-sample gradient by 0 (its zero-out neighbour, tutorial
            Def. 3.5) when any entry of it is NaN/inf: Opacus's clipping would carry the NaN/inf
            into the summed gradient and the release would reveal that the example was in the
            batch (as :func:`corrnoise.torch.per_example.clip_and_sum` does for our own path)."""
            if not self.params or any(getattr(p, "grad_sample", None) is None for p in self.params):
                return  # Opacus's own checks report a missing per-sample gradient
            for p in self.params:
                _check_processed_flag(p.grad_sample)
            grads = [self._get_flat_grad_sample(p) for p in self.params]
            b = len(grads[0])
            if b == 0:
                return
            finite = torch.ones(b, dtype=torch.bool, device=grads[0].device)
            for g in grads:
                finite &= torch.isfinite(g.reshape(b, -1)).all(dim=1).to(finite.device)
            if bool(finite.all()):
                return
            for p, g in zip(self.params, grads):
                keep = finite.to(g.device).reshape(b, *([1] * (g.dim() - 1)))
                p.grad_sample = torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))

        def add_noise(self):
            noise = self.noise_source.next()
            noise = [noise] if isinstance(noise, torch.Tensor) else list(noise)
            if len(noise) != len(self.params):
                raise CorrnoiseError("optimizer", f"{len(self.params)} parameters but noise for {len(noise)}")
            for p, z in zip(self.params, noise):
                _check_processed_flag(p.summed_grad)
                p.grad = (p.summed_grad + self.max_grad_norm * z.to(p.summed_grad)).view_as(p)
                _mark_as_processed(p.summed_grad)

    return _CorrelatedNoiseDPOptimizer


def __getattr__(name):  # CorrelatedNoiseDPOptimizer is built on first use (opacus is optional)
    if name == "CorrelatedNoiseDPOptimizer":
        return _optimizer_class()
    raise AttributeError(name)


def correlated_dp_optimizer(optimizer: torch.optim.Optimizer, strategy, *, noise_std: float, max_grad_norm: float,
                            expected_batch_size: float, seed: int | None = None, method: str = "auto",
                            max_steps: int | None = None, **kwargs: Any):
    """Wrap ``optimizer`` (whose params belong to a ``GradSampleModule``) in an Opacus
    ``DPOptimizer`` with correlated noise: one noise row per (non-skipped) step, and no step
    after ``max_steps`` (default: the mechanism's n) -- the number of steps the accounting covers."""
    cls = _optimizer_class()
    max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params:
        raise CorrnoiseError("optimizer", "has no trainable parameters")
    source = make_generator(strategy, [p.shape for p in params], noise_std=noise_std, seed=seed,
                            device=params[0].device, dtype=params[0].dtype, method=method)
    return cls(optimizer, noise_source=source, max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
               max_steps=max_steps, **kwargs)


@dataclass
class OpacusRun:
    """What :func:`make_private_opacus` returns: Opacus's module and optimizer, the data loader
    yielding the corrnoise sampler's batches, and the plan to account with."""

    module: Any
    optimizer: Any
    data_loader: Any
    strategy: Any
    sampler: Any
    batching: Any
    noise_std: float
    delta: float
    accounting_method: str = "auto"
    accounting_options: dict | None = None

    @property
    def steps_taken(self) -> int:
        return int(self.optimizer.noise_source.t)

    def privacy_spent(self, **options: Any):
        """(epsilon, delta) for the steps taken so far (one per noise row used)."""
        return privacy_spent(self.strategy, self.batching, noise_std=self.noise_std, delta=self.delta,
                             steps=self.steps_taken, planned_steps=self.sampler.steps, method=self.accounting_method,
                             **{**(self.accounting_options or {}), **options})


def make_private_opacus(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
    *,
    mechanism="identity",
    delta: float,
    epsilon: float | None = None,
    noise_std: float | None = None,
    noise_multiplier: float | None = None,
    batch_size: int | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    sampler="auto",
    max_grad_norm: float = 1.0,
    seed: int | None = None,
    noise_seed: int | None = None,
    accounting_method: str = "auto",
    noise_method: str = "auto",
    grad_sample_mode: str = "hooks",
    accounting_options: dict | None = None,
) -> OpacusRun:
    """Like :func:`corrnoise.torch.make_private`, but per-sample gradients, clipping and the
    optimizer flow are Opacus's (``GradSampleModule`` + ``DPOptimizer``); the noise is ours.
    ``seed`` drives the sampler, ``noise_seed`` the noise (None: a secret OS seed; see make_private)."""
    opacus = require_opacus()
    strategy, sampler, agreement, nu, _ = plan_private(
        dataset, mechanism=mechanism, delta=delta, epsilon=epsilon, noise_std=noise_std,
        noise_multiplier=noise_multiplier, batch_size=batch_size, epochs=epochs, steps=steps, sampler=sampler,
        seed=seed, accounting_method=accounting_method, accounting_options=accounting_options)
    if isinstance(sampler, BallsInBinsSampler) and sampler.batch_size is not None:
        raise CorrnoiseError("sampler", "fixed-size balls-in-bins batches pad with weight-0 entries, which the Opacus "
                             "adapter cannot weight; use make_private, or BallsInBinsSampler without batch_size")
    gsm = module if isinstance(module, opacus.GradSampleModule) else opacus.GradSampleModule(
        module, batch_first=True, loss_reduction="mean", strict=True, force_functorch=grad_sample_mode == "functorch")
    dp_opt = correlated_dp_optimizer(optimizer, strategy, noise_std=nu, max_grad_norm=max_grad_norm,
                                     expected_batch_size=sampler.expected_batch_size, seed=noise_seed,
                                     method=noise_method, max_steps=agreement.steps)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_SafeCollate(dataset))
    return OpacusRun(gsm, dp_opt, loader, strategy, sampler, agreement.batching, nu, delta, accounting_method,
                     accounting_options)
