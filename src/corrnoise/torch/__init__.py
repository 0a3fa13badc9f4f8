"""PyTorch training with correlated noise (layer 6): one engine, the front door
:func:`make_private` (:mod:`.front`), on the user's own loop.

    from corrnoise.torch import make_private
    model, optimizer, data_loader = make_private(model, optimizer, data_loader, mechanism="bsr:4",
                                                 epsilon=8.0, delta=1e-5, epochs=10, max_grad_norm=1.0)
    for epoch in range(10):
        for x, y in data_loader:
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    print(optimizer.privacy_spent().epsilon)

The run itself -- mechanism, batching, sampler, noise, guarantee -- is decided once, torch-free,
by :func:`corrnoise.runplan.plan_run` (a :class:`~corrnoise.runplan.RunPlan`; ``make_private(...,
plan=plan)`` trains a given one). Layers over the same engine (same plan and gate, sampler,
clipping engine and noise):
:class:`~corrnoise.torch.opacus_adapter.PrivacyEngine` (Opacus's names; Opacus itself is not
needed) and :func:`~corrnoise.torch.run.make_private_run` (an ``(x, y)`` step).

Migrating from the old ``make_private(model, optimizer, loss_fn, dataset, ...)`` returning a
``PrivateOptimizer`` with ``step(x, y, weights=None)``:

* either rename the call to ``make_private_run`` (same arguments but ``chunk_size``, dropped:
  use ``max_physical_batch_size``); ``run.data_loader`` / ``run.step(x, y)`` /
  ``run.privacy_spent()`` work as before, and padded balls-in-bins batches need no
  ``weights=`` any more (the loader masks the padding);
* or call the front door: ``make_private(model, optimizer, DataLoader(dataset,
  batch_size=B), max_grad_norm=clip_norm, batching=sampler, ...)`` and write the loop body
  (forward, loss, ``backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``); one pass
  over its loader is one epoch. ``PrivateOptimizer.apply_sums`` and the torch.func
  per-example gradients are gone from training (:mod:`.per_example` is kept as the test
  reference implementation only).

The distributed helpers (:mod:`corrnoise.torch.distributed`) are imported on demand.
"""

from ..accounting.event import leading_strategy
from ..runplan import Agreement, PrivatePlan, RunPlan, check_agreement, choose_batching, plan_private, plan_run, privacy_spent
from ..sampling import make_sampler
from .front import DPDataLoader, DPOptimizer, make_private
from .noise_aware import NoiseAwareAdamW, released_noise_variance
from .opacus_adapter import PrivacyEngine
from .privatizer import Privatizer, privatize_sum
from .run import PrivateRun, make_private_run

__all__ = [
    "Agreement", "DPDataLoader", "DPOptimizer", "NoiseAwareAdamW", "PrivacyEngine", "PrivatePlan", "PrivateRun",
    "Privatizer", "RunPlan",
    "check_agreement", "choose_batching", "leading_strategy", "make_private", "make_private_run", "make_sampler",
    "plan_private", "plan_run", "privacy_spent", "privatize_sum", "released_noise_variance",
]
