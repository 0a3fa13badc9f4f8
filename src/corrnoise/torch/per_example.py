"""Per-example gradients with torch.func, clipping and summing (tutorial Alg. 3.1, line 5):
the REFERENCE implementation the tests compare the clipping engine with. Training never calls
it (it materializes B x #params); the training path is :mod:`corrnoise.torch.clipping`.

For a batch of examples x_1..x_B the private gradient needs every example's own gradient
g_i = grad_theta loss(theta; x_i), clipped to norm zeta (the clip norm),

    clip_zeta(v) = v * min(1, zeta / ||v||_2)                         (tutorial Eq. 1.3)

and summed: sum_i w_i clip_zeta(g_i). The norm is taken over *all* trainable parameters
together (the whole model is one vector in R^m). Under zero-out adjacency (tutorial Def. 3.5)
removing an example replaces its term by 0, so the sum has L2 sensitivity zeta: that is what
the noise is calibrated to. Weights w_i in [0, 1] are 1 for real examples and 0 for padding
entries of fixed-size balls-in-bins batches (seed 000 App. I); a weight never increases the
contribution of an example, so the sensitivity stays zeta.

The gradients come from ``torch.func``: the model runs as a pure function of its parameters
(``functional_call``) on one example at a time, ``grad`` differentiates it, ``vmap`` maps over
the batch. Models whose forward mixes examples (BatchNorm in training mode) have no
per-example gradient and are refused by torch.func; use GroupNorm/LayerNorm instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.func import functional_call, grad, vmap

from ..errors import CorrnoiseError, check_real

__all__ = [
    "trainable_parameters",
    "per_example_gradients",
    "clip_factors",
    "clip_and_sum",
    "clipped_gradient_sum",
]


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters with ``requires_grad`` (name -> parameter), in module order."""
    if not isinstance(model, torch.nn.Module):
        raise CorrnoiseError("model", f"must be a torch.nn.Module, got {type(model).__name__}")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise CorrnoiseError("model", "has no trainable parameters")
    return params


def per_example_gradients(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(per-example gradients, per-example losses) of ``loss_fn(model(x_i[None]), y_i[None])``.

    Returns ``{name: tensor of shape (B, *param.shape)}`` for the trainable parameters and the
    B losses (detached). ``chunk_size`` bounds how many examples are vectorized at once.
    """
    params = trainable_parameters(model)
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    if inputs.shape[0] != targets.shape[0]:
        raise CorrnoiseError("targets", f"{targets.shape[0]} targets for {inputs.shape[0]} inputs")
    detached = {name: p.detach() for name, p in params.items()}

    def one_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
        out = functional_call(model, ({**p, **frozen}, buffers), (x.unsqueeze(0),))
        loss = loss_fn(out, y.unsqueeze(0))
        if loss.dim() != 0:
            loss = loss.sum()
        return loss, loss.detach()

    # randomness="different": dropout draws its own mask per example, as in a batched forward
    fn = vmap(grad(one_loss, has_aux=True), in_dims=(None, 0, 0), chunk_size=chunk_size, randomness="different")
    grads, losses = fn(detached, inputs, targets)
    return grads, losses


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """min(1, zeta / ||g_i||) per example (tutorial Eq. 1.3); 1 for a zero gradient."""
    return torch.clamp(clip_norm / norms, max=1.0)  # zeta / 0 = inf -> 1


def clip_and_sum(
    grads: dict[str, torch.Tensor] | list[torch.Tensor],
    clip_norm: float,
    weights: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """sum_i w_i clip_zeta(g_i) per parameter, and the unclipped per-example norms ||g_i||.

    ``grads``: per-example gradients, each of shape (B, *shape); the norm of example i is
    over all of them together. ``weights``: optional (B,) in [0, 1] (0 = padding).
    Norms, clipping and sums are computed in at least float32 (one tensor upcast at a time):
    bfloat16 norms overshoot the clip norm by ~0.5% and float16 squares overflow, and the
    sensitivity is the clip norm only if every clipped term really has norm <= zeta. The sums
    come back in that precision; rounding them to the model's dtype after the noise is added
    is post-processing. An example whose gradient is not finite contributes zero (its zero-out
    neighbour), so a NaN/inf never reaches the released sum.
    """
    clip_norm = check_real("clip_norm", clip_norm, low=0.0, low_open=True)
    tensors = list(grads.values()) if isinstance(grads, dict) else list(grads)
    if not tensors:
        raise CorrnoiseError("grads", "no per-example gradients")
    b = tensors[0].shape[0]
    acc = torch.float32
    for g in tensors:
        acc = torch.promote_types(acc, g.dtype)
    sq = torch.zeros(b, dtype=acc, device=tensors[0].device)
    for g in tensors:
        sq = sq + g.reshape(b, -1).to(acc).pow(2).sum(dim=1)
    norms = sq.sqrt()
    factors = clip_factors(norms, clip_norm)
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=factors.dtype, device=factors.device).reshape(-1)
        if weights.numel() != b:
            raise CorrnoiseError("weights", f"{weights.numel()} weights for {b} examples")
        if bool(((weights < 0) | (weights > 1)).any()):
            raise CorrnoiseError("weights", "must lie in [0, 1] (a weight above 1 would raise the sensitivity)")
        factors = factors * weights
    finite = torch.isfinite(sq)
    if not bool(finite.all()):
        # a NaN/inf gradient cannot be clipped; zero it out (the zero-out neighbour) rather than
        # release a NaN/inf sum that reveals the example's presence
        factors = torch.where(finite, factors, torch.zeros_like(factors))
        sums = [torch.einsum("b,b...->...", factors, g.to(acc).nan_to_num(0.0, 0.0, 0.0)) for g in tensors]
    else:
        sums = [torch.einsum("b,b...->...", factors, g.to(acc)) for g in tensors]
    return sums, norms


def clipped_gradient_sum(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    clip_norm: float,
    *,
    weights: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The summed clipped per-example gradient, one tensor per trainable parameter.

    Returns ``(sums, stats)`` with stats ``loss`` (mean over real examples, not private),
    ``count`` (number of real examples) and ``clipped_fraction``. An empty batch gives zeros.
    """
    params = trainable_parameters(model)
    if inputs.shape[0] == 0:
        return [torch.zeros_like(p) for p in params.values()], {"loss": math.nan, "count": 0, "clipped_fraction": 0.0}
    grads, losses = per_example_gradients(model, loss_fn, inputs, targets, chunk_size=chunk_size)
    sums, norms = clip_and_sum(grads, clip_norm, weights)
    if weights is None:
        real = torch.ones_like(losses, dtype=torch.bool)
    else:
        real = torch.as_tensor(weights, device=losses.device).reshape(-1) > 0
    count = int(real.sum())
    loss = float(losses[real].mean()) if count else math.nan
    clipped = float((norms[real] > clip_norm).float().mean()) if count else 0.0
    return sums, {"loss": loss, "count": count, "clipped_fraction": clipped}
