"""Opacus's names on corrnoise's engine: :class:`PrivacyEngine` with ``make_private``,
``make_private_with_epsilon`` and ``get_epsilon``.

    privacy_engine = PrivacyEngine()
    model, optimizer, data_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=data_loader, target_epsilon=8.0,
        target_delta=1e-5, epochs=10, max_grad_norm=1.0, mechanism="bsr:4")
    for epoch in range(10):
        for x, y in data_loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    print(privacy_engine.get_epsilon(1e-5))

A code base written for Opacus changes its import; ``make_private`` stays DP-SGD unless
``mechanism=`` names another, while ``make_private_with_epsilon`` plans by default
(``mechanism="auto"``: the planner's mechanism and batching for the target, which may be a
correlated mechanism with balls-in-bins batches; ``mechanism="identity"`` keeps Opacus's DP-SGD
with Poisson sampling). ``loss_reduction="sum"`` releases the noisy sum, as Opacus does
(``"mean"``: divided by the expected batch size). Opacus's ``accountant`` ``"rdp"`` / ``"prv"`` map
to corrnoise's ``rdp`` / ``pld``; ``grad_sample_mode`` and ``wrap_model`` are taken (the engine's
clipping is the same); ``secure_mode``, ``criterion``, ``rand_on_empty`` and any other unknown
argument are refused in one line. Everything behind the names is corrnoise's front door
(:func:`corrnoise.torch.front.make_private`): the sampler the accounting analyses, the clipping
engine (:mod:`corrnoise.torch.clipping`), the noise max_grad_norm * nu * (C^-1 Z)[t] and the
one plan (:func:`corrnoise.runplan.plan_run`) -- Opacus need not be installed, and no
privacy check lives here. Differences from Opacus, all refused with one-line errors where an
Opacus argument would change them: the run's length (``epochs`` or ``steps``) is part of the
plan (the mechanism and its noise are built for it, and steps past it are refused); the
sampler is corrnoise's (``poisson_sampling=False`` means cyclic batches, accounted without
amplification); clipping is flat; the noise comes from corrnoise's generator (secret OS seed,
``noise_seed`` for reproducible experiments only); virtual steps are
``max_physical_batch_size`` (Opacus's BatchMemoryManager is refused).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import CorrnoiseError, check_real
from .front import DPDataLoader, DPOptimizer, make_private

__all__ = ["PrivacyEngine"]

#: the delta ``optimizer.privacy_spent()`` uses after :meth:`PrivacyEngine.make_private` when no
#: ``delta`` is given (Opacus's make_private takes none; ``get_epsilon(delta)`` takes any)
DEFAULT_DELTA = 1e-5


#: Opacus's accountant names -> the corrnoise accounting method of that analysis (PRV and PLD both
#: compose privacy loss distributions; corrnoise's PLD bound is a guarantee)
_ACCOUNTANTS = {"rdp": "rdp", "prv": "pld"}
#: Opacus arguments that choose how per-example gradients are computed: corrnoise's engine clips the
#: same way whatever they say (flat clipping of each example's whole gradient), so they are taken
_SAME_HERE = ("grad_sample_mode", "wrap_model")
#: Opacus arguments with no counterpart: refused in one line, saying why
_REFUSED = {
    "criterion": "not needed: compute the loss as usual, the engine clips through hooks (and make_private returns "
                 "(module, optimizer, data_loader), never a criterion)",
    "rand_on_empty": "empty Poisson batches are steps of the accounted run here: they add their noise row",
    "total_steps": "give steps= (or epochs=): the run's length is part of the plan",
}


def _front_door_names() -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(make_private).parameters) - {"module", "optimizer", "data_loader"}


_FRONT_DOOR = _front_door_names()


class PrivacyEngine:
    """Opacus's ``PrivacyEngine`` surface over the corrnoise front door.

    ``accounting_method`` / ``accounting_options``: corrnoise's accounting (``auto`` picks the
    method that analyses the run's mechanism and batching; Opacus's ``accountant`` names have no
    meaning for correlated noise). The engine remembers the optimizer of its last
    ``make_private*`` call; :meth:`get_epsilon` accounts the steps it has taken.
    """

    def __init__(self, accountant: str | None = None, secure_mode: bool = False, *, accounting_method: str = "auto",
                 accounting_options: dict[str, Any] | None = None):
        if accountant is not None:  # Opacus's accountants by the corrnoise method of the same analysis
            if accountant not in _ACCOUNTANTS:
                raise CorrnoiseError("accountant", f"Opacus's {accountant!r} has no corrnoise counterpart here; pass "
                                     f"one of {', '.join(sorted(_ACCOUNTANTS))}, or accounting_method=")
            if accounting_method != "auto":
                raise CorrnoiseError("accountant", "give accountant or accounting_method, not both")
            accounting_method = _ACCOUNTANTS[accountant]
        if secure_mode:
            raise CorrnoiseError("secure_mode", "the noise comes from corrnoise's counter-based generator with a secret "
                                 "OS seed; Opacus's secure_mode (a cryptographic RNG) is not offered")
        self.accounting_method = accounting_method
        self.accounting_options = dict(accounting_options or {})
        self.optimizer: DPOptimizer | None = None

    def _front_door(self, module, optimizer, data_loader, *, batch_first: bool, poisson_sampling: bool,
                    clipping: str, noise_generator, kwargs: dict[str, Any]):
        if batch_first is not True:
            raise CorrnoiseError("batch_first", "must be True: the clipping engine takes dimension 0 as the batch")
        if clipping != "flat":
            raise CorrnoiseError("clipping", f"only flat clipping (one max_grad_norm) is supported, got {clipping!r}")
        if noise_generator is not None:
            raise CorrnoiseError("noise_generator", "the noise comes from corrnoise's generator (a secret OS seed); "
                                 "pass noise_seed only for reproducible experiments")
        for name, value in list(kwargs.items()):
            if name in _SAME_HERE:
                kwargs.pop(name)  # Opacus's implementation choices: the engine's clipping is the same flat clip
            elif name in _REFUSED:
                raise CorrnoiseError(name, _REFUSED[name])
            elif name not in _FRONT_DOOR:
                raise CorrnoiseError(name, "is neither an argument of Opacus's make_private that corrnoise honours nor "
                                     "one of corrnoise.torch.make_private")
        batching = kwargs.pop("batching", "auto" if poisson_sampling else "cyclic")
        if not poisson_sampling and batching != "cyclic":
            raise CorrnoiseError("poisson_sampling", f"is False but batching is {batching!r}; give one of them")
        kwargs.setdefault("accounting_method", self.accounting_method)
        kwargs.setdefault("accounting_options", self.accounting_options or None)
        module, private, loader = make_private(module, optimizer, data_loader, batching=batching, **kwargs)
        private.released_sum = kwargs.get("loss_reduction") == "sum"  # Opacus releases the noisy sum then
        self.optimizer = private
        return module, private, loader

    def make_private(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: torch.utils.data.DataLoader,
        noise_multiplier: float,
        max_grad_norm: float,
        mechanism: Any = "identity",
        epochs: float | None = None,
        steps: int | None = None,
        delta: float = DEFAULT_DELTA,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        **kwargs: Any,
    ) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
        """``(module, optimizer, data_loader)`` with noise sigma = ``noise_multiplier`` (nu / ||C||_col).

        ``mechanism``: DP-SGD (``identity``) unless given, as in Opacus (a noise multiplier fixes
        the noise, so there is no target for the planner to choose a mechanism for).

        ``epochs`` or ``steps``: the run's length (required: the mechanism is built for it).
        ``delta``: the delta of ``optimizer.privacy_spent()``. Further keywords (``batching``,
        ``seed``, ``noise_seed``, ``max_physical_batch_size``, ``store_noise_seed``,
        ``noise_method``, ...) go to :func:`corrnoise.torch.make_private`.
        """
        return self._front_door(module, optimizer, data_loader, batch_first=batch_first,
                                poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
                                kwargs=dict(kwargs, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                            mechanism=mechanism, epochs=epochs, steps=steps, delta=delta,
                                            loss_reduction=loss_reduction))

    def make_private_with_epsilon(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: torch.utils.data.DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: float | None = None,
        max_grad_norm: float,
        mechanism: Any = "auto",
        steps: int | None = None,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        **kwargs: Any,
    ) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
        """``(module, optimizer, data_loader)`` with the noise calibrated so that the planned run
        (``epochs``, or ``steps``) is (``target_epsilon``, ``target_delta``)-DP by a formal guarantee."""
        return self._front_door(module, optimizer, data_loader, batch_first=batch_first,
                                poisson_sampling=poisson_sampling, clipping=clipping, noise_generator=noise_generator,
                                kwargs=dict(kwargs, epsilon=target_epsilon, delta=target_delta, epochs=epochs,
                                            steps=steps, max_grad_norm=max_grad_norm, mechanism=mechanism,
                                            loss_reduction=loss_reduction))

    def make_private_with_plan(
        self,
        *,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: torch.utils.data.DataLoader,
        plan: Any,
        max_grad_norm: float,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        clipping: str = "flat",
        noise_generator=None,
        **kwargs: Any,
    ) -> tuple[torch.nn.Module, DPOptimizer, DPDataLoader]:
        """``(module, optimizer, data_loader)`` for a run planned beforehand (not in Opacus): ``plan``
        a :class:`corrnoise.runplan.RunPlan` or the path of its file (``corrnoise plan --plan-out``,
        re-checked on load). The plan decides mechanism, batching, noise and guarantee; the loader
        must be the plan's data and batch size."""
        from ..runplan import RunPlan

        if isinstance(plan, (str, os.PathLike)):
            plan = RunPlan.from_json(plan)
        kwargs = dict(kwargs, plan=plan, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
        kwargs.setdefault("batching", "auto")
        kwargs.setdefault("accounting_method", "auto")
        return self._front_door(module, optimizer, data_loader, batch_first=batch_first, poisson_sampling=True,
                                clipping=clipping, noise_generator=noise_generator, kwargs=kwargs)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` of what the last private optimizer released so far, instantly: the
        guarantee of its whole planned run, which bounds every prefix
        (:meth:`~corrnoise.torch.DPOptimizer.privacy_spent`; accounted once per delta). The tighter
        value of the steps taken alone: ``optimizer.privacy_spent(steps=optimizer.steps_taken)``."""
        opt = self.optimizer
        if opt is None:
            raise CorrnoiseError("optimizer", "no private optimizer yet: call make_private first")
        delta = check_real("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
        return float(opt.privacy_spent(delta=delta).epsilon)

    @property
    def steps_taken(self) -> int:
        return 0 if self.optimizer is None else self.optimizer.steps_taken
