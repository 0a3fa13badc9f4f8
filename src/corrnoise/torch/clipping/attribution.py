"""A self-test of per-example attribution: does the engine give each example its own gradient?

The guarantee's sensitivity bound assumes that what the engine clips as example j's gradient is
the gradient of example j's loss alone. The engine reads examples off dim 0 of each hooked
call, and checks what it can see: a call of another batch size is refused, and on the first step
the per-example gradients must add up to autograd's. Two things pass both checks and still break
the assumption:

* a layer called *without* the batch on a tensor whose first dimension happens to equal the
  batch size (a position table of length L with B == L; T5's relative position bias, refused at
  attach by its structure, is the known case): the rows are positions, not examples, and the
  sum over rows is still the batch's gradient;
* a loss or model that mixes examples (each example's loss normalized by a batch statistic, a
  layer that pools over the batch): example j's gradient then depends on the others.

:func:`check_attribution` runs the definition on a real batch: one forward and backward of the
whole batch through the engine, then each chosen example alone through the plain model
(:meth:`ClippingEngine.paused`), and compares the engine's gradient of example j with autograd's,
parameter by parameter. It spends no privacy (no noise, no step) and leaves the model, its
gradients and the engine as they were.

What it cannot see: a parameter whose gradient is zero on the checked examples (peft's LoRA A
factors while B is still zero) agrees trivially; behaviour only in training mode (it runs in eval
mode, so that both computations are one function: dropout is covered by the engine's own
exactness tests instead); and a model that treats other batches differently from the checked one.

``PrivateTrainer`` runs it on its first batch; ``DPOptimizer.check_attribution`` offers it to a
``make_private`` loop. It also verifies two batch layouts the engine accepts only after it (rows
of the batch flattened; an output shared by the batch: :mod:`.engine`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ...errors import CorrnoiseError, check_int
from .engine import shared_by_batch_advice

__all__ = ["ATTRIBUTION_RTOL", "AttributionReport", "TOKEN_ALIGNED", "attribution_tolerance", "check_attribution",
           "example_of", "left_padding", "right_aligned"]

#: relative tolerance on one parameter's per-example gradient, by the dtype computed in. The engine
#: and the reference compute the same gradient in a different order (a batched product against one
#: example's, another BLAS blocking), so they differ by rounding. Measured (2-layer GPT-2, BERT,
#: Llama-style and their LoRA, widths 64 and 256, padded batches; benchmarks/RESULTS.md, "Per-example
#: attribution check"; tests/test_attribution.py keeps to a tenth of each tolerance): at
#: most 1.4e-15 in float64, 1.1e-6 in float32 and 9.3e-3 under bf16 autocast: 2-20 units of the
#: dtype's roundoff. Float64 parameters get float32's tolerance: parts of a model may compute in
#: float32 whatever its parameters (transformers' RMSNorm: ~1e-7 in a float64 Llama-style model).
#: The tolerances leave 10x (bf16) to ~1000x (float32) of margin for deeper models and other data;
#: a misattributed parameter is off by O(1) of its own gradient (measured 2.3 for a position table
#: called without the batch).
ATTRIBUTION_RTOL = {torch.float64: 1e-3, torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}

#: a parameter's own gradient below this fraction of the example's whole gradient is compared
#: against it instead (a parameter example j barely touches: an Embedding row, a rounding-sized
#: gradient)
ABSOLUTE_FLOOR = 1e-3


@dataclass(frozen=True)
class AttributionReport:
    """What :func:`check_attribution` compared: ``examples`` (indices in the batch), ``batch_size``,
    ``worst`` (the largest difference relative to its tolerance, < 1 when it passed),
    ``parameter`` (where it was), ``flattened`` (layers that saw the batch flattened, B*m rows:
    :meth:`ClippingEngine._flattened`) and ``shared`` (layers whose (1, ...) output is broadcast to
    the batch: :meth:`ClippingEngine._shared_output`); both kinds are let through from now on;
    ``unexercised`` (parameters whose gradient was zero for every checked example, so they agreed
    trivially: peft's LoRA A factors while B is zero)."""

    examples: list[int]
    batch_size: int
    worst: float
    parameter: str | None
    flattened: list[str]
    shared: list[str]
    unexercised: list[str]


def attribution_tolerance(dtype: torch.dtype) -> float:
    """:data:`ATTRIBUTION_RTOL` of ``dtype`` (the loosest for a dtype not listed)."""
    return ATTRIBUTION_RTOL.get(dtype, max(ATTRIBUTION_RTOL.values()))


#: a tokenized batch's tensors that run along its tokens, one entry per position of its
#: ``attention_mask`` (transformers' names): :func:`right_aligned` moves them with the tokens
TOKEN_ALIGNED = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "inputs_embeds",
                 "special_tokens_mask", "completion_mask", "assistant_masks")


def left_padding(batch: Any) -> torch.Tensor | None:
    """Each row's leading padding, shape the mask's without its last dimension, from a mapping's
    ``attention_mask`` (0 on padding; (B, T), or (B, C, T) for a multiple-choice model's choices),
    or None when no row has any (right padding, no padding, no such mask). A row that is all
    padding counts as none."""
    mask = batch.get("attention_mask") if hasattr(batch, "get") else None
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] < 2:
        return None
    lead = (mask.cumsum(-1) == 0).sum(-1)
    lead = torch.where(lead == mask.shape[-1], torch.zeros_like(lead), lead)
    return lead if bool((lead > 0).any()) else None


def right_aligned(batch: Any, lead: torch.Tensor | None = None) -> Any:
    """``batch`` with each row's leading padding moved to its end (``lead``: :func:`left_padding`):
    the tensors of :data:`TOKEN_ALIGNED` whose leading dimensions are the mask's are rolled along
    the tokens, so that each example's tokens sit at positions 0..L-1, where they are when it is
    alone. Left padding moves them by the longest example of the batch, so an example's loss
    depends on the others (through position embeddings and rotary positions). A batch without
    left padding is returned as it is; otherwise a new dict."""
    lead = left_padding(batch) if lead is None else lead
    if lead is None:
        return batch
    shape = tuple(batch["attention_mask"].shape)
    t = shape[-1]
    index = (torch.arange(t, device=lead.device) + lead.unsqueeze(-1)) % t  # each row from its first token
    out = dict(batch)
    for key in TOKEN_ALIGNED:
        v = out.get(key)
        if isinstance(v, torch.Tensor) and tuple(v.shape[:len(shape)]) == shape:
            idx = index.to(v.device).view(*shape, *([1] * (v.dim() - len(shape)))).expand(v.shape)
            out[key] = torch.gather(v, len(shape) - 1, idx)
    return out


def example_of(batch: Any, j: int, batch_size: int) -> Any:
    """Example ``j`` of ``batch`` as a batch of one, as it would be alone: every tensor whose first
    dimension is the batch size is cut to row ``j`` (keeping the dimension), other leaves are left as
    they are, and a left-padded row is right-aligned (:func:`right_aligned`), since alone the
    example has no padding before its tokens."""
    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch_size:
            return t[j:j + 1]
        return t

    return right_aligned(tree_map(cut, batch))


def check_attribution(engine, per_example_loss: Callable[[Any], torch.Tensor], batch: Any, *,
                      examples: int = 3, compute_dtype: torch.dtype | None = None) -> AttributionReport:
    """Check the engine's per-example gradients on ``batch`` against each example computed alone.

    ``per_example_loss(batch)`` runs the engine's model on a batch and returns one loss per
    example, shape (B,), each depending on its example alone (a batch of one gives shape (1,)).
    ``examples``: how many to check (the first, the last, then evenly between). The model runs in
    eval mode (no dropout: both computations must be the same function) and without any
    autocast the caller does not put inside ``per_example_loss``; ``compute_dtype``: the dtype the
    forward computes in where that is below the parameters' (bf16 autocast inside the model's
    forward, as accelerate's mixed precision puts it), which loosens the tolerance to its own.

    For each chosen example j: the engine's sum with weight 1 on j alone and no clipping (its
    gradient g_j, from the one backward of the whole batch) against autograd's gradient of
    ``per_example_loss(example j)``, per parameter: ||g_j - ref|| <= rtol (||ref|| + floor *
    ||ref_all||), rtol by the dtype computed in (:data:`ATTRIBUTION_RTOL`). Holds the batch's
    captured activations and two gradients of the model's size at a time. Raises a one-line
    :class:`CorrnoiseError` naming the parameter that differs most; returns the report otherwise.
    """
    k = check_int("examples", examples, minimum=1)
    if compute_dtype is not None and not isinstance(compute_dtype, torch.dtype):
        raise CorrnoiseError("compute_dtype", f"must be a torch.dtype (torch.bfloat16) or None, got {compute_dtype!r}")
    module, params, names = engine.module, engine.parameters, engine.names
    modes = [(m, m.training) for m in module.modules()]
    grads = [p.grad for p in params]
    worst, where, untouched = 0.0, None, set(names)  # untouched: a zero gradient for every checked example
    try:
        with engine._attribution_probe() as seen:
            module.eval()
            for p in params:
                p.grad = None
            with torch.enable_grad():
                losses = _batch_losses(engine, per_example_loss, batch, seen)
                b = losses.shape[0]
                (losses.mean() if engine.loss_reduction == "mean" else losses.sum()).backward()
            chosen = _chosen(b, k)
            for j in chosen:  # one example's two gradients held at a time
                weights = torch.zeros(b)
                weights[j] = 1.0
                ours, _ = engine.clipped_sum(b, weights=weights)  # clipping off: example j's gradient
                with engine.paused(), torch.enable_grad():  # what the engine captured stays for the next example
                    alone = _losses(per_example_loss, example_of(batch, j, b), 1)
                    ref = torch.autograd.grad(alone.sum(), params, allow_unused=True)
                untouched -= {n for n, r in zip(names, ref) if r is not None and bool(r.any())}
                ratio, name = _worst_difference(names, params, ours, ref, compute_dtype)
                del ours, ref
                if ratio > worst:
                    worst, where = ratio, (name, j)
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for m, mode in modes:
            m.training = mode
    report = AttributionReport(examples=chosen, batch_size=b, worst=worst, parameter=where and where[0],
                               flattened=engine._layout_paths(seen, "flattened"),
                               shared=engine._layout_paths(seen, "shared"),
                               unexercised=[n for n in names if n in untouched])
    if worst > 1.0:
        name, j = where
        padded = (" The batch is padded on the left, which moves each example's tokens by the longest one's: pad on "
                  "the right (tokenizer.padding_side = 'right').") if left_padding(batch) is not None else ""
        raise CorrnoiseError(
            "model", f"example {j}'s gradient of '{name}' from the batch of {b} is not its gradient computed alone "
            f"({worst:.3g}x the tolerance): the loss mixes examples (compute each example's loss from its own "
            f"outputs alone), or a layer sees the batch other than on dim 0 (a table of length {b} called without "
            f"the batch?: freeze that layer).{padded}")
    engine._verify_layouts(seen)  # flattened rows example-major, shared outputs broadcast
    return report


def _batch_losses(engine, per_example_loss, batch, seen) -> torch.Tensor:
    """The whole batch's losses through the engine, at least 2 of them. A model that fails once a
    batch-shared output is expanded to the batch does not broadcast it: one line naming it."""
    try:
        losses = _losses(per_example_loss, batch, None)
    except CorrnoiseError:
        raise
    except Exception as exc:
        shared = [m for m, kind in seen.items() if kind == "shared"]
        if not shared:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        paths = ", ".join(map(repr, engine._layout_paths(seen, "shared")))
        raise CorrnoiseError(
            "model", f"{paths} returns one output for the whole batch (a position-bias table?) that the model does "
            f"not broadcast against the batch (expanded to it: {type(exc).__name__}: {first}), so "
            f"{shared_by_batch_advice(', '.join(map(repr, engine._owned_names(shared))))}") from exc
    if losses.shape[0] < 2:
        raise CorrnoiseError("batch", f"has {losses.shape[0]} example(s): with fewer than 2 no gradient can go to the "
                             "wrong example, so nothing would be checked; pass a batch of at least 2")
    return losses


def _losses(per_example_loss, batch, expected: int | None) -> torch.Tensor:
    losses = per_example_loss(batch)
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or (
            expected is not None and losses.numel() != expected):
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        want = f"({expected},)" if expected is not None else "(B,)"
        raise CorrnoiseError("per_example_loss", f"must return one loss per example, shape {want}, got {shape}")
    return losses


def _chosen(b: int, k: int) -> list[int]:
    """The first and last example, then evenly between: k distinct indices (fewer if b < k)."""
    k = min(k, b)  # review: with k > b the spacing used k, and a batch of 2 checked example 0 only
    if k == 1:
        return [0]
    return sorted({round(i * (b - 1) / (k - 1)) for i in range(k)})


def _worst_difference(names, params, ours, ref, compute_dtype) -> tuple[float, str]:
    """The largest ||ours - ref|| / tolerance over the parameters, and its parameter's name."""
    refs = [torch.zeros_like(p) if r is None else r for p, r in zip(params, ref)]
    total = math.sqrt(sum(float(r.double().square().sum()) for r in refs))
    worst, where = 0.0, names[0]
    for name, p, s, r in zip(names, params, ours, refs):
        rtol = max(attribution_tolerance(p.dtype), attribution_tolerance(compute_dtype) if compute_dtype else 0.0)
        diff = float((s.double() - r.double()).norm())
        allowed = rtol * (float(r.double().norm()) + ABSOLUTE_FLOOR * total)
        ratio = diff / allowed if allowed > 0 else (math.inf if diff > 0 else 0.0)
        if ratio > worst:
            worst, where = ratio, name
    return worst, where
