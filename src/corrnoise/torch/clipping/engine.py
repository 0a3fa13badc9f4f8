"""Per-example clipping without per-example gradients: ghost norm + book-keeping, one backward.

    engine = ClippingEngine(model, loss_reduction="mean", max_grad_norm=1.0)   # attaches hooks
    loss = criterion(model(x), y); loss.backward()                            # unchanged user code
    sums, norms = engine.clipped_sum(batch_size)   # aligned with engine.parameters; norms (B,)
    engine.clear()                                  # drop captured activations
    engine.detach()                                 # remove hooks

How. A forward hook on every module that directly owns trainable parameters (or, for peft's
LoRA Embedding, uses its ParameterDicts' parameters in its own forward:
:func:`.layers.owned_parameters`) stores its
(detached) inputs and puts a tensor hook on its outputs that stores the grad outputs during the
user's ``loss.backward()``. ``clipped_sum`` then turns each call into per-parameter
contributions (:mod:`.layers`), computes each example's squared norm per parameter by ghost
norm or, where cheaper, by materializing that parameter alone (:func:`.formulas.use_ghost`:
for dense factors ghost iff T^2 (P + Q) <= GHOST_RATIO P Q, the Gram matrices' multiply-adds
against a materialized gradient's memory passes; materialized gradients are held for the
clipped sum within a memory budget, :func:`_materialize_budget`, in one CPU buffer kept
between steps, :meth:`ClippingEngine._workspace_for`), adds them over all
parameters, clips with c_i = min(1, C / ||g_i||) (0 for a NaN/inf gradient) and forms
sum_i c_i g_i by book-keeping from the same captured tensors.

Book-keeping, not a second backward. A second backward on the reweighted loss sum_i c_i L_i
needs either ``retain_graph=True`` in the user's backward or a second forward, and per-example
losses the engine never sees; the book-keeping product costs one extra weight-gradient matmul
per layer instead of a whole backward. Measured (benchmarks/bench_step.py,
``BOOKKEEPING_VS_BACKWARD``; CPU, 2 threads, MLP 784-512-512-10, batch 256): ``clipped_sum``
(norms and book-keeping together) 2.6 ms vs 4.6 ms for the forward+backward a reweighted second
pass would add (quiet machine; 31.8 vs 33.7 ms at load average 6), so book-keeping it is.

Parameters sharing an input. Narrow matrix parameters (at most :data:`GROUP_MAX_ROWS` rows)
whose one use reads the same captured input as others (peft's LoRA A factors on one attention
input, a model's query / key / value projections of rank r) are materialized as one product,
one norm and one weighted sum (:func:`_shared_input_groups`): K narrow batched products cost
more than one K times as tall (BERT LoRA r = 8, width 128: ``clipped_sum`` 3.37 -> 2.88 ms on
1 thread, unchanged on 2). Wide ones stay apart: grouping BERT's 128 x 128 query / key / value
made the clipped sum 1.3-1.4 ms slower (its 6 MB product no longer stays in cache for the norm).

Shared parameters (tied embeddings, a layer called twice): every use of a parameter is a
contribution to the *same* per-example gradient, so the norm is that of the summed gradient,
cross terms included. Factored uses are stacked along T into one ghost norm (token equality /
gather for the one-hot side), so a tied Embedding + Linear head is exact without forming
V x d per example; a parameter with a dense use as well (or blocks that do not line up) is
materialized for that parameter alone. A table whose uses are all lookups (an Embedding, one
or called twice) gets its norm from each example's rows summed by token
(:func:`.formulas.one_hot_norm_sq`), without T x T Gram matrices.

Safety checks. A parameter that receives a gradient in backward but was captured in no hooked
call (it was used outside its owner's forward) is refused; on the first ``clipped_sum`` (and
whenever ``verify=True``) the unclipped sum of the captured per-example gradients is compared
with the gradient autograd accumulated, which catches a parameter also used outside its
owner's forward (e.g. ``F.linear(x, emb.weight)`` in a parent module) or a non-deterministic
fallback layer. Layers that mix examples (BatchNorm, SyncBatchNorm, Embedding or EmbeddingBag with
``scale_grad_by_freq``, MultiheadAttention with ``batch_first=False``) are refused at attach, and so
are those that rewrite their own state from the raw batch (Embedding / EmbeddingBag with
``max_norm``: rows renormalized in place; InstanceNorm with ``track_running_stats``). Any other
buffer or frozen parameter that a forward with gradients on changes is refused (in the state_dict)
or warned of (a non-persistent buffer) when that forward returns
(:meth:`ClippingEngine._check_state_unchanged`).

Indices shared by the batch. transformers calls its position embeddings (GPT-2's ``wpe``,
BERT's ``position_embeddings``) with ids of shape (1, L), added to every example. An Embedding
called with indices (1, *S) (or (L,), L != B) while the batch has B examples is called instead
with the indices expanded to (B, *S) (:func:`.layers.expand_shared_indices`, which states the
rule): same output values, expanded to the batch, and the per-example grad outputs that the
broadcast's backward would otherwise have summed over the batch. B is the batch dimension of the
first hooked layer called in this forward of the engine's module, or, before any, dim 0 of that
forward's first tensor argument (``input_ids`` for ``model(**batch)``); a wrong guess (a model whose only
hooked layer sees the shared indices and whose first argument is not batch-first) ends in the
batch-dimension or ``batch_size`` refusal below, never in a silent mix. The expanded output
must be used by broadcasting against the batch (``x + pos``), as transformers does; code that
reduces or indexes its batch dimension (``pos[0]``) would attribute gradients to the wrong
examples, and the first step's sum check cannot see it (the rows still add up). So each such
layer's use is probed once, by autograd, when the first forward that expanded its indices returns
(:meth:`ClippingEngine._probe_shared_indices`), and refused in one line if it mixes examples;
:func:`.attribution.check_attribution` verifies it as well (PrivateTrainer runs it first).

Gradient checkpointing (transformers' ``model.activation_checkpointing_enable()``, formerly
``gradient_checkpointing_enable()``; torch.utils.checkpoint)
runs a block's forward again during backward, so its hooks fire twice. Both forwards are
captured like any call; a call contributes only through the grad outputs that reach its own
output tensors, and the loss's gradient reaches exactly one of the two: the first forward's
outputs without reentrancy (the recomputation only refills the tensors backward saved; its
outputs are never back-propagated, their calls get no grad output and contribute nothing), the
recomputed outputs with ``use_reentrant=True`` (the first forward ran under no_grad and was
not captured). No activation is counted twice either way, and none is held twice: the calls of
a recomputation that no grad output reached are dropped when the backward pass ends. A forward
call while autograd runs a backward pass is taken for such a recomputation (:func:`_in_backward`).

torch.compile of the model works and is exact (``tests/test_hf_exact.py``): dynamo traces the
hooks or breaks the graph at them, and recompiles as the engine's state changes. It brings no
speed-up: measured on CPU (tiny GPT-2, 1 thread, loaded machine) a compiled step with the engine
took ~18 ms against ~12 ms eager.

One engine per layer. A new engine on a model (or on layers) that an earlier engine hooks
detaches the earlier one, with a warning; that one then refuses any use in one line
(:meth:`ClippingEngine._take_over`). Engines on separate layers of one model coexist. The
private optimizer detaches its engine after the run's last planned step
(``DPOptimizer.release_model``): the model is a plain one again.

Rows of the batch flattened. A layer called with m*B rows in a batch of B examples (OPT's decoder
layers reshape (B, T, d) to (B*T, d) before their MLP) is read as (B, m, ...), example-major, by
the rules that take any leading dimensions (:data:`_FLATTENABLE`) and by the fallback for the
layers whose every output row is a function of its own input row (:func:`.layers.rows_independent`:
transformers' mixture-of-experts top-k routers and experts, which see the batch's tokens as one
pool; each example's re-run gets its own rows), but only once
:func:`.attribution.check_attribution` has verified that layer on a batch of at least 2 (rows in
another order, or a table of 2B rows called without the batch, fail it), or when the batch has
one example (every row is its own). Otherwise it is refused in one line naming the check. A
router whose logits reach the loss (a load-balancing loss over the batch's routing) is refused.

Outputs shared by the batch. A fallback layer that returns (1, ...) in a forward of B > 1
examples (BART's decoder position embedding: (1, L, d), added to every example) has the batch's
summed gradient. Once :func:`.attribution.check_attribution` verified that the model broadcasts
it (indexing ``pos[0]`` would fail the check), its output is expanded to (B, ...) in the forward,
so each example's share of the grad output reaches the hook and the fallback's per-example vjp
gives each example its own gradient (:meth:`ClippingEngine._shared_output`); before, it is
refused in one line naming the check.

Limits. Every hooked layer must see the batch on dim 0 (a different size is refused; a
transposed input or a table of equal size called without the batch is not detectable here:
:func:`.attribution.check_attribution` finds it on a real batch, and ``PrivateTrainer`` runs it on
its first). A second batch (a forward after a backward,
outside it) before ``clear()`` is refused. Fallback layers must be
deterministic (no dropout inside them). A hook on an output that is a view would be lost if the
view were later modified in place (``ReLU(inplace=True)`` after a Linear on (B, T, d)): a Linear's
or Conv1D's view output is the reshape of its own (B*T, d) result, hooked there instead; other
layers' view outputs are copied once.

Weight gradients. The user's backward accumulates ``p.grad`` on the first step only (for the
check above) and with ``verify=True``; afterwards a hooked call whose input carries a gradient
runs with its parameters out of autograd, so backward computes no weight gradient (an
Embedding's, whose input is indices, still is). ``p.grad`` is then what the private optimizer
writes.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import CorrnoiseError, check_int, check_real, user_stacklevel
from .formulas import (OneHot, as_dtype, bookkeeping_sum, clip_weights, ghost_norm_sq, materialize, one_hot_side,
                       shared_input_products, use_ghost)
from .layers import (call_batch_size, conv1d_like_handler, embedding_handler, expand_shared_indices,
                     fallback_handler, handler_for, is_peft_lora_embedding, is_top_k_router, layernorm_handler,
                     linear_handler, moe_experts_handler, owned_parameters, peft_lora_embedding_handler,
                     rmsnorm_handler, router_loss_refusal, rows_independent, takes_indices)

__all__ = ["ClippingEngine", "OPAQUE_TYPES"]

#: rules of layers whose output, when it is a view, is their own (B*T, d) result reshaped (torch's
#: Linear, transformers' Conv1D): a hook on that base sees the output's gradient (ClippingEngine._forward_hook)
_RESHAPED_OUTPUT_HANDLERS = (linear_handler, conv1d_like_handler)

#: rules that take any leading dimensions, so a call that sees the batch flattened to (B*m, ...) can be
#: read as (B, m, ...) (ClippingEngine._flattened); the fallback reads so only the layers that
#: :func:`.layers.rows_independent` names (mixture-of-experts routers and experts)
_FLATTENABLE = (linear_handler, conv1d_like_handler, embedding_handler, peft_lora_embedding_handler, layernorm_handler,
                rmsnorm_handler, moe_experts_handler)


def _reads_flat(m: nn.Module, handler) -> bool:
    """Whether ``m``'s rule can read a call on the batch flattened as (B, m, ...)."""
    return handler in _FLATTENABLE or (handler is fallback_handler and rows_independent(m))


#: modules whose forward uses their children's parameters directly (not through the children's
#: forward): treated as one fallback layer owning the whole subtree.
OPAQUE_TYPES: tuple[type, ...] = (nn.MultiheadAttention,)


class _Call:
    __slots__ = ("args", "kwargs", "versions", "grads", "n_out", "saved")

    def __init__(self, args, kwargs, versions, n_out):
        self.args, self.kwargs, self.versions = args, kwargs, versions
        self.grads: list[torch.Tensor | None] = [None] * n_out
        self.n_out = n_out
        self.saved = None  # what its handler's saved_from_output read from the output (a LayerNorm's statistics)


def _detach_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach_tree(o) for o in obj) if not hasattr(obj, "_fields") else type(obj)(*(_detach_tree(o) for o in obj))
    if isinstance(obj, dict):
        return {k: _detach_tree(v) for k, v in obj.items()}
    return obj


def _refusal(path: str, m: nn.Module, trainable: dict[int, int]) -> str | None:
    """Why ``m`` (at ``path``) cannot be clipped per example, if it cannot (``trainable``: ids of the
    parameters the engine clips)."""
    name = path or "<root>"
    table = _position_bias_table(m)
    if table is not None and id(table.weight) in trainable:
        return (f"'{path}.relative_attention_bias' is a position bias shared by the whole batch (T5-style relative "
                f"attention): {shared_by_batch_advice('it')}")
    prompt = _repeated_prompt(m)
    if prompt is not None and any(id(p) in trainable for p in prompt[0].parameters()):
        return (f"'{name}' is a peft prompt-learning model ({prompt[1]}) whose virtual prompt is computed once and "
                "repeated for every example (prompt_encoder(tokens[:1]).repeat(B, 1, 1)): "
                f"{shared_by_batch_advice('the prompt encoder')}, or use peft's prefix tuning (each example's "
                "prefix is computed for it)")
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return f"'{name}' ({type(m).__name__}) mixes examples (batch statistics); replace it with GroupNorm or LayerNorm"
    if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
        return (f"'{name}' ({type(m).__name__} with track_running_stats=True) updates running_mean / running_var from "
                "the raw batches, outside the private mechanism, and they are published in the state_dict; set "
                "track_running_stats=False")
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq and id(m.weight) in trainable:
        # each row's gradient is divided by its token's count in the whole batch (found by a probe:
        # an EmbeddingBag with it passed the attach and was refused at its first step as a layer
        # whose gradients do not add up); a frozen table has no gradient to scale
        return (f"'{name}' ({type(m).__name__} with scale_grad_by_freq=True) mixes examples (each row's gradient is "
                "divided by its count in the whole batch); set scale_grad_by_freq=False")
    if (is_peft_lora_embedding(m) and m.base_layer.scale_grad_by_freq
            and any(id(p) in trainable for p in m.parameters())):
        # peft looks up its LoRA A table with the base layer's scale_grad_by_freq: the adapter's
        # gradient is scaled by the batch's counts even where the base table is frozen
        return (f"'{name}' (peft LoRA Embedding over an Embedding with scale_grad_by_freq=True) mixes examples "
                "(each row's gradient is divided by its count in the whole batch); set scale_grad_by_freq=False on "
                "its base layer")
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
        # F.embedding(max_norm=...) renormalizes the looked-up rows of the table in place, under
        # no_grad, from the raw batch: the published table shows which rows the data touched (frozen
        # or not: the rows are rewritten either way)
        return (f"'{name}' ({type(m).__name__} with max_norm={m.max_norm}) rescales the rows the batch looks up in "
                "place, from the raw data, outside the private mechanism (the table would reveal which tokens "
                "occur); set max_norm=None")
    if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and not m.batch_first:
        return f"'{name}' ({type(m).__name__}) needs batch_first=True (per-example gradients map over dim 0)"
    return None


def shared_by_batch_advice(what: str) -> str:
    """The end of every refusal of a parameter the whole batch shares (a position-bias table): why,
    and what to do with ``what`` (its name(s))."""
    return (f"its gradient is the batch's sum, not one per example; freeze {what} (requires_grad_(False)) or train "
            "adapters (LoRA) instead")


def _outer_registrations(module: nn.Module) -> set[tuple[str, int]]:
    """(module path, parameter id) of each parameter registered directly on a module and again on
    one of its descendants: transformers' BertLMPredictionHead holds ``bias`` and its ``decoder``
    Linear holds the same Parameter as its own bias, which only the Linear's forward adds. The
    innermost registration owns it; the outer one would capture the same use a second time (the
    first step's sum check against autograd refused that: 'do not add up'). An outer module that
    also used it directly would leave that use uncaptured, which the same check refuses."""
    paths: dict[int, list[str]] = {}
    for path, m in module.named_modules(remove_duplicate=True):
        for _, p in m.named_parameters(recurse=False):
            paths.setdefault(id(p), []).append(path)
    return {(path, pid) for pid, ps in paths.items() for path in ps
            if any(other != path and (path == "" or other.startswith(path + ".")) for other in ps)}


def _repeated_prompt(m: nn.Module) -> tuple[nn.Module, str] | None:
    """peft's prompt learning other than prefix tuning (prompt tuning, P-tuning, multitask prompt
    tuning): ``get_prompt`` runs the active prompt encoder on one row of virtual tokens and
    repeats the result for the batch (peft >= 0.13), so every example's copy comes from one call
    and the hooks see the batch's summed gradient; with the engine's expansion of such indices the
    repeat would multiply the batch (a shape error inside peft). Prefix tuning calls the encoder
    with the tokens expanded to the batch: each example's own call. Recognized by peft's declared
    config on the model (``active_peft_config``: ``is_prompt_learning`` and ``peft_type``). Returns
    (the active prompt encoder, the config's type), or None."""
    config = getattr(m, "active_peft_config", None)
    encoders = getattr(m, "prompt_encoder", None)
    if config is None or not getattr(config, "is_prompt_learning", False) or not isinstance(encoders, nn.ModuleDict):
        return None
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    encoder = encoders[m.active_adapter] if m.active_adapter in encoders else None
    return None if kind == "PREFIX_TUNING" or encoder is None else (encoder, kind)


def _position_bias_table(m: nn.Module) -> nn.Embedding | None:
    """T5-style relative attention (transformers' T5, mT5, LongT5, UMT5, ...): an Embedding
    ``relative_attention_bias`` that the layer's ``compute_bias`` calls with (query, key) position
    buckets of shape (L_q, L_k), without the batch, and adds to every example's attention scores.
    Its gradient is the batch's sum, so no per-example gradient can be read from its call; with
    B != L_q the call is refused as another batch size, with B == L_q the query positions would be
    taken for examples (measured: per-example norms off by 3e-4 in float64). Recognized by that
    structure (the child and the method), not by the class's name."""
    table = getattr(m, "relative_attention_bias", None)
    if isinstance(table, nn.Embedding) and callable(getattr(m, "compute_bias", None)):
        return table
    return None


class ClippingEngine:
    """Hooks on ``module`` that give clipped per-example gradient sums after one backward.

    ``loss_reduction``: "mean" (the loss averaged over the batch, Opacus's convention: captured
    grad outputs are multiplied back by ``batch_size``) or "sum". ``max_grad_norm``: the clip
    norm C > 0. ``engine.parameters`` / ``engine.names``: the trainable parameters (deduplicated,
    in ``named_parameters`` order) that ``clipped_sum`` returns sums for. Frozen parameters
    (``requires_grad=False`` at attach) are ignored, and so are those outside ``parameters``
    when it is given (the per-example norm covers only what is optimized, as in Opacus).
    """

    def __init__(self, module: nn.Module, loss_reduction: str = "mean", max_grad_norm: float = 1.0, *,
                 verify: bool = False, parameters=None):
        if not isinstance(module, nn.Module):
            raise CorrnoiseError("module", f"must be a torch.nn.Module, got {type(module).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise CorrnoiseError("loss_reduction", f"must be 'mean' or 'sum', got {loss_reduction!r}")
        self.module = module
        self.loss_reduction = loss_reduction
        self.max_grad_norm = check_real("max_grad_norm", max_grad_norm, low=0.0, low_open=True)
        self.verify = bool(verify)
        self._verified = False
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if parameters is not None:  # only these (the optimizer's): the others are neither clipped nor noised
            chosen = {id(p) for p in parameters}
            named = [(n, p) for n, p in named if id(p) in chosen]
        if not named:
            raise CorrnoiseError("module", "has no trainable parameters" if parameters is None else
                                 "has no trainable parameter among the optimizer's")
        self.names = [n for n, _ in named]
        self.parameters = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self.parameters)}
        # owners: module -> (handler, [(param_name_in_module, global index)])
        self._owners: dict[nn.Module, tuple[Any, list[tuple[str, int]]]] = {}
        self._paths: dict[nn.Module, str] = {}
        opaque_prefixes: list[str] = []
        claimed: set[int] = set()  # parameters owned by a module above (peft's LoRA Embedding's dicts)
        outer = _outer_registrations(module)
        for path, m in module.named_modules(remove_duplicate=True):
            msg = _refusal(path, m, self._index)
            if msg is not None:
                raise CorrnoiseError("module", msg)
            if any(path.startswith(pre + ".") for pre in opaque_prefixes):
                continue
            if isinstance(m, OPAQUE_TYPES):
                opaque_prefixes.append(path)
                own = [(n, p) for n, p in m.named_parameters() if id(p) in self._index]
                names = [n for n, _ in own]
                handler = lambda mod, a, k, g, dt, _n=names: fallback_handler(mod, a, k, g, dt, names=_n)  # noqa: E731
            else:
                own = [(n, p) for n, p in owned_parameters(m)
                       if id(p) in self._index and id(p) not in claimed and (path, id(p)) not in outer]
                handler = handler_for(m)
            claimed.update(id(p) for n, p in own if "." in n)  # a shared parameter's direct owners all keep it
            if own:
                self._owners[m] = (handler, [(n, self._index[id(p)]) for n, p in own])
                self._paths[m] = path or "<root>"
        # after the first verified clipped sum, a hooked call whose input carries a gradient runs with
        # its parameters out of autograd: backward computes no weight gradient the engine would
        # recompute per example (:meth:`_skip_weight_grads`)
        self._skippable = {m: [i for _, i in owned] for m, (handler, owned) in self._owners.items()
                           if handler is not fallback_handler and not isinstance(m, OPAQUE_TYPES)}
        # a parameter that only skippable calls own: once the sum check is done, autograd reaches it
        # only through a use outside its module's forward, whose per-example share nothing captures
        # (found in review: a use of 0.005 x the weight passed the first step's 1e-2 check, and one
        # that began at step 1 was never checked); such a gradient is refused on every step
        # (:meth:`_param_hook`)
        shared = {i for m, (_, owned) in self._owners.items() if m not in self._skippable for _, i in owned}
        self._watched = {i for idx in self._skippable.values() for i in idx} - shared
        self._outside: set[int] = set()
        self._depth = [0] * len(self.parameters)
        self._skipping: list[tuple[nn.Module, list[int], bool]] = []
        self._sourced: nn.Module | None = None  # the call just returned had no input gradient (:meth:`_as_source`)
        self._calls: dict[nn.Module, list[_Call]] = {m: [] for m in self._owners}
        self._reached: set[int] = set()
        self._autograd: dict[int, torch.Tensor] = {}
        self._backward_seen = False
        self._computing = False
        self._first_batch: int | None = None  # batch dimension of the first hooked call to start in this batch
        self._recomputed: list[tuple[nn.Module, _Call]] = []  # calls captured during the running backward
        self._prune_task: int | None = None  # the backward pass whose end drops unused recomputed calls
        self._root_batch: int | None = None  # dim 0 of the module's first tensor argument in this batch
        self._workspace: torch.Tensor | None = None  # materialized gradients' storage (:meth:`_workspace_for`)
        self._detached, self._detached_by = False, "user"
        # layers whose batch layout check_attribution verified: "flattened" (m*B rows, :meth:`_flattened`) or
        # "shared" (an output (1, ...) broadcast to the batch, :meth:`_shared_output`); while it runs, such
        # calls are let through (the probe) and noted
        self._layout_verified: dict[nn.Module, str] = {}
        self._layout_probe, self._layout_seen = False, {}
        self._unexpanded: set[nn.Module] = set()  # unverified layers whose (1, ...) output this batch shares
        # this forward's layers called with shared indices, expanded, not verified yet: (layer, its output),
        # probed when the forward returns (:meth:`_probe_shared_indices`)
        self._expanded: list[tuple[nn.Module, torch.Tensor]] = []
        self._pending_probe: set[nn.Module] = set()  # layers whose running call expanded unverified indices
        # layers whose expanded shared indices the probe or check_attribution verified (a layer may also be
        # "flattened": a multiple-choice model's position embedding), and those the running check saw
        self._indices_verified: set[nn.Module] = set()
        self._indices_seen: set[nn.Module] = set()
        self._state_before: dict[str, tuple[int, int, bool]] | None = None  # buffers' versions at this forward's start
        self._state_warned: set[str] = set()  # non-persistent buffers warned of (:meth:`_check_state_unchanged`)
        self._holders: list | None = None  # :meth:`_state_holders`
        self._take_over(module)
        self._handles = [module.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True),
                         module.register_forward_hook(self._root_hook, with_kwargs=True)]
        for m, (handler, _) in self._owners.items():
            if takes_indices(handler):
                self._handles.append(m.register_forward_pre_hook(self._shared_indices_hook, with_kwargs=True))
            # first among the layer's forward hooks (``prepend``): a hook registered before the engine
            # (transformers' output capturing, installed on a model's first forward) then records the
            # engine's copy of an output, whose gradient the engine sees, not the original
            self._handles.append(m.register_forward_hook(self._forward_hook, with_kwargs=True, prepend=True))
            if m in self._skippable:
                self._handles.append(m.register_forward_pre_hook(self._skip_weight_grads, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._restore_weight_grads, always_call=True,
                                                             prepend=True))
            else:
                self._handles.append(m.register_forward_pre_hook(self._note_first_batch, with_kwargs=True))
        for i, p in enumerate(self.parameters):
            self._handles.append(p.register_hook(lambda g, i=i: self._param_hook(i, g)))
        self._token_loss_used = False
        self._router_loss_used: str | None = None
        for sub in module.modules():
            if _batch_token_loss(sub):
                self._handles.append(sub.register_forward_hook(self._token_loss_hook, with_kwargs=True))
            if _is_pretrained_model(sub):
                self._handles.append(sub.register_forward_hook(self._router_loss_hook))
            if is_top_k_router(sub) and sub not in self._owners:  # a frozen router: its logits are still watched
                self._handles.append(sub.register_forward_hook(self._router_logits_hook, prepend=True))

    def _take_over(self, module: nn.Module) -> None:
        """One live engine per layer: an earlier engine hooked on ``module`` or any of the layers this
        one hooks (an earlier make_private on the same model: a notebook cell run again, a second
        PrivateTrainer, a second phase of training) is detached first, with a warning, and refuses
        any later use in one line. Two engines' hooks would otherwise both capture every batch, and
        the earlier one, never stepped again, refuses the second forward."""
        earlier = {id(e): e for m in [module, *self._owners] if (e := _LIVE.get(m)) is not None and not e._detached}
        for old in earlier.values():
            old.detach(by="later engine")
        if earlier:
            warnings.warn("this model already had a clipping engine from an earlier make_private (or ClippingEngine); "
                          "it is detached, and the private optimizer that used it can no longer step. If that run "
                          "took steps on the same data, the two runs' privacy adds up: the new optimizer's epsilon "
                          "is of its own steps only", RuntimeWarning, stacklevel=user_stacklevel())
        for m in [module, *self._owners]:
            _LIVE[m] = self

    def check_attached(self) -> None:
        """One line if this engine was detached (by :meth:`detach`, or by a later engine on the same
        model: :meth:`_take_over`)."""
        if self._detached:
            raise CorrnoiseError("engine", "was detached" + _DETACHED_WHY[self._detached_by])

    # ------------------------------------------------------------------ hooks
    def _param_hook(self, i: int, g: torch.Tensor):
        if self._computing:
            return None
        self._reached.add(i)
        if self.verify or not self._verified:
            prev = self._autograd.get(i)
            self._autograd[i] = g.detach().clone() if prev is None else prev + g.detach()
        elif i in self._watched:
            self._outside.add(i)
        return None

    def _skip_weight_grads(self, m: nn.Module, args, kwargs):
        """Before a hooked call: take its parameters out of autograd when its input carries a gradient.

        The engine forms each example's gradient from the captured input and grad output; the
        weight gradient the user's backward would also accumulate into ``p.grad`` (one matmul per
        Linear, a vocabulary-sized table per Embedding) is never read after the first step, whose
        check against it (:meth:`clipped_sum`) needs it, as does ``verify=True``: both keep
        autograd's. Gradients still flow to the input. A call whose input carries none (an
        Embedding's indices, the first layer) runs without them too, and its outputs are made the
        start of the graph (:meth:`_as_source`), so that they still carry the loss's gradient back
        to the engine's hook. A checkpointed block's recomputation does the same as its forward:
        non-reentrant checkpointing matches the tensors each saved by position (found in review:
        a recomputation that kept the parameters saved the Linear's input besides, and the block's
        backward failed, or read the wrong tensors where shapes agreed). Uses nested or shared
        between hooked calls are counted so that the outermost restores.
        """
        self._note_first_batch(m, args, kwargs)
        idx = self._skippable[m]
        source = False
        if self.verify or not self._verified or self._computing or not torch.is_grad_enabled() or _in_transform():
            idx = []
        elif not any(isinstance(t, torch.Tensor) and t.requires_grad for t in _leaves(args, kwargs)):
            source = bool(idx)
        for i in idx:
            if self._depth[i] == 0:
                self.parameters[i].requires_grad_(False)
            self._depth[i] += 1
        self._skipping.append((m, idx, source))
        return None

    def _note_first_batch(self, m: nn.Module, args, kwargs):
        """The batch dimension of this batch's first hooked call, noted when the call starts, not
        when it returns: a layer that calls hooked layers inside its forward on something other than
        the batch (peft's DoRA layer forms its weight as ``lora_B(lora_A(eye(d_in)))``) would
        otherwise give d_in rows as the batch, and in a batch of one the layer's own (1, ...)
        output was taken for one shared by d_in examples and refused."""
        if self._first_batch is None and not self._computing and torch.is_grad_enabled():
            self._first_batch = _first_dim(args, kwargs)
        return None

    def _restore_weight_grads(self, m: nn.Module, args, output):
        """After a hooked call (also when it raised): its parameters back in autograd."""
        self._sourced = None
        if self._skipping and self._skipping[-1][0] is m:
            _, idx, source = self._skipping.pop()
            self._sourced = m if source else None
            for i in idx:
                self._depth[i] -= 1
                if self._depth[i] == 0:
                    self.parameters[i].requires_grad_(True)
        return None

    def _root_pre_hook(self, m: nn.Module, args, kwargs):
        """Each forward of the model (not a checkpointed block's recomputation during backward)
        guesses the batch of shared indices afresh: a forward of another batch before it (an
        evaluation with gradients on, between steps) does not decide its expansion. The model's
        buffers and frozen parameters are noted, for :meth:`_check_state_unchanged`."""
        if not self._computing and torch.is_grad_enabled() and not _in_backward():
            self._root_batch = _first_dim(args, kwargs)
            self._first_batch = None
            self._state_before = self._state_versions()
        else:
            self._state_before = None
        return None

    def _state_holders(self) -> list[tuple[str, nn.Module, str, bool]]:
        """(label, module, name, is a buffer) of every buffer and frozen parameter slot of the model,
        found at the first forward (a walk over GPT-2 small's modules took 0.5 ms, twice a forward);
        the slots are read afresh each time, so a buffer replaced by another tensor is seen. Not
        seen: a buffer name first registered after that forward."""
        if self._holders is None:
            found = []
            for path, sub in self.module.named_modules(remove_duplicate=False):
                pre = f"{path}." if path else ""
                public = getattr(sub, "corrnoise_public_buffers", ())
                found += [(f"buffer '{pre}{n}'", sub, n, True) for n in sub._buffers if n not in public]
                found += [(f"parameter '{pre}{n}'", sub, n, False) for n in sub._parameters]
            self._holders = found
        return self._holders

    def _state_versions(self) -> dict[str, tuple[int, int, bool]]:
        """(identity, version counter, published) of each buffer and frozen parameter of the model, by
        name; published: in the state_dict (a parameter, a persistent buffer)."""
        state = {}
        for label, sub, n, is_buffer in self._state_holders():
            t = (sub._buffers if is_buffer else sub._parameters).get(n)
            if t is None or (not is_buffer and id(t) in self._index):
                continue
            state[label] = (id(t), t._version, not is_buffer or n not in sub._non_persistent_buffers_set)
        return state

    def _check_state_unchanged(self) -> None:
        """A buffer or frozen parameter that a forward with gradients on changed in place or replaced
        (a running mean updated from the input, as BatchNorm's) is computed from the raw batch,
        without clipping or noise. Where the state_dict publishes it (a parameter, a persistent
        buffer) it is refused in one line; a non-persistent buffer is not saved, but the model's
        later outputs depend on it: one warning per buffer. transformers' rotary embeddings with
        dynamic or long-context scaling (``rope_type`` "dynamic", "longrope") rewrite their
        non-persistent ``inv_freq`` from the batch's largest position (its padded length, or its
        longest sequence where positions follow the attention mask): warned, not refused (measured,
        tiny Llama with longrope). A module declares buffers that its forward updates without reading
        the data (a step counter) by listing their names in its attribute ``corrnoise_public_buffers``;
        they are not checked (the refusal says so). Checked on every such forward; the clipped
        parameters are left out (the engine only toggles their requires_grad)."""
        before, self._state_before = self._state_before, None
        if before is None:
            return
        after = self._state_versions()
        changed = [n for n, v in after.items() if before.get(n, (None, None, v[2])) != v]
        published = [n for n in changed if after[n][2]]
        if published:
            self.clear()
            more = f" (and {len(published) - 1} more)" if len(published) > 1 else ""
            raise CorrnoiseError(
                "model", f"{published[0]}{more} was changed during a forward with gradients on: it is computed from "
                "the raw batch outside the private mechanism (no clipping, no noise) and would be published in the "
                "model's state_dict; compute it in forward without storing it, or make it a trainable parameter (if it "
                "does not depend on the data, a step counter, list its name in its module's corrnoise_public_buffers)")
        fresh = [n for n in changed if n not in self._state_warned]
        if fresh:
            self._state_warned.update(fresh)
            warnings.warn(
                f"{', '.join(fresh[:3])}{f' (and {len(fresh) - 3} more)' if len(fresh) > 3 else ''} (not in the "
                "state_dict) was changed during a forward with gradients on, from the raw batch outside the private "
                "mechanism: the trained model's outputs depend on it until it is recomputed (transformers' dynamic "
                "rotary scaling rewrites inv_freq from the batch's sequence length; pad every batch to one length "
                "to make it data-independent)", RuntimeWarning, stacklevel=user_stacklevel())

    def _root_hook(self, m: nn.Module, args, kwargs, output):
        """After each forward of the model: its buffers and frozen parameters are checked unchanged
        (:meth:`_check_state_unchanged`); the shared indices it expanded and nobody verified yet
        are probed against its output (:meth:`_probe_shared_indices`)."""
        self._check_state_unchanged()
        expanded, self._expanded = self._expanded, []
        self._pending_probe.clear()
        if expanded and not self._computing and torch.is_grad_enabled() and not _in_backward():
            self._probe_shared_indices(expanded, output)
        return None

    def _probe_shared_indices(self, expanded: list[tuple[nn.Module, torch.Tensor]], output) -> None:
        """Whether the model uses each expanded shared-index output (:meth:`_shared_indices_hook`)
        by broadcasting, checked once per layer on its first batch, by autograd.

        Example b's gradient of the table is read from row b of the expanded output's grad output
        (:func:`.layers.expand_shared_indices`). That is example b's own only if example k's
        outputs depend on no row of it other than row k. For k = 0 and k = B - 1 the vector-Jacobian
        product of the model's per-example outputs (every floating tensor of it with the batch as
        dim 0) with a random vector on row k alone must then be exactly zero off row k: batched
        operations propagate exact zeros, and a use that indexes or reduces the batch dimension
        (``pos[0]``, ``pos.mean(0)``) puts row k's vector on another row. A layer that passes is
        verified from then on; a failure is refused in one line, before any gradient is captured.
        Where the model returns no output with the batch as dim 0, the layer is left to
        :meth:`_shared_output`'s route: refused in :meth:`clipped_sum` until
        :func:`.attribution.check_attribution` has verified it. Non-finite entries are not read
        (a zero vector times an infinite activation)."""
        b = expanded[0][1].shape[0]
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()
                and t.requires_grad and t.dim() >= 1 and t.shape[0] == b]
        if not outs:
            self._unexpanded.update(m for m, _ in expanded)
            return
        gen = torch.Generator().manual_seed(0)
        before = self._computing
        self._computing = True  # no capture: checkpointed blocks run again, hooks fire
        try:
            for k in sorted({0, b - 1}):
                vectors = []
                for t in outs:
                    v = torch.zeros_like(t)
                    v[k] = torch.randn(t.shape[1:], generator=gen).to(t.dtype)
                    vectors.append(v)
                grads = self._rows_vjp(outs, vectors, [e for _, e in expanded])
                for (m, _), g in zip(expanded, grads):
                    if g is None:
                        continue
                    off = torch.cat([g[:k], g[k + 1:]])
                    if bool((torch.isfinite(off) & (off != 0)).any()):
                        self.clear()
                        raise CorrnoiseError(
                            "model", f"'{self._paths[m]}' ({type(m).__name__}) is called with indices shared by the "
                            f"batch, which the engine expands to the batch so that each example gets its own gradient, "
                            f"but example {k}'s outputs depend on other examples' rows of its output (the model "
                            "indexes or reduces its batch dimension, pos[0] or pos.mean(0), instead of broadcasting "
                            "x + pos): the gradients would go to the wrong examples; pass indices of shape (B, L), "
                            f"or {shared_by_batch_advice(', '.join(map(repr, self._owned_names([m]))))}")
        finally:
            self._computing = before
        self._indices_verified.update(m for m, _ in expanded)

    def _rows_vjp(self, outs: list[torch.Tensor], vectors: list[torch.Tensor], inputs: list[torch.Tensor]) -> list:
        """The vector-Jacobian products of ``outs`` with ``vectors`` for ``inputs`` (None where one is
        not used), keeping the graph for the user's backward. Reentrant checkpointing
        (``use_reentrant=True``) cannot run ``torch.autograd.grad``; there a full backward runs
        instead, with hooks on ``inputs`` reading their gradients and the model's parameter
        gradients put back as they were (a gradient accumulation's running sum stays)."""
        try:
            return list(torch.autograd.grad(outs, inputs, vectors, retain_graph=True, allow_unused=True))
        except RuntimeError as exc:
            if "reentrant" not in str(exc):
                raise
        got: list[torch.Tensor | None] = [None] * len(inputs)
        handles = [e.register_hook(lambda g, i=i: got.__setitem__(i, g)) for i, e in enumerate(inputs)]
        params = list(self.module.parameters())
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            torch.autograd.backward(outs, vectors, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
            for p, g in zip(params, saved):
                p.grad = g
        return got

    def _shared_indices_hook(self, m: nn.Module, args, kwargs):
        """An Embedding's indices shared by the batch, replaced by their expansion to it (see the
        module docstring)."""
        if self._computing or not torch.is_grad_enabled():
            return None
        b = self._first_batch if self._first_batch is not None else self._root_batch
        if b is None:
            return None
        idx = expand_shared_indices(args[0] if args else kwargs.get("input"), b)
        if idx is None:
            return None
        if self._layout_probe:
            self._indices_seen.add(m)
        elif m not in self._indices_verified:
            self._pending_probe.add(m)  # its output is noted by _forward_hook, probed by _root_hook
        return ((idx, *args[1:]), kwargs) if args else (args, {**kwargs, "input": idx})

    def _forward_hook(self, m: nn.Module, args, kwargs, output):
        if self._computing or not torch.is_grad_enabled():
            return None
        replaced = None
        reshaped_base = None
        shared = self._shared_output(m, output)
        if shared is not None:
            output = replaced = shared  # a view: copied below, so that a hook on it stays
        if isinstance(output, torch.Tensor) and output.requires_grad and output._is_view():
            # a hook on a view is lost if the view is later modified in place (ReLU(inplace=True)
            # after a Linear on (B, T, d)); a hook on its base is not. The base stands for the
            # output where it is only the layer's own (B*T, d) result reshaped: torch's Linear and
            # transformers' Conv1D. Elsewhere the output is copied (a copy is not a view).
            base = output._base
            if (self._owners[m][0] in _RESHAPED_OUTPUT_HANDLERS and base is not None and base.requires_grad
                    and base.numel() == output.numel() and output.is_contiguous() and base.is_contiguous()
                    and output.storage_offset() == base.storage_offset()):
                reshaped_base = base
            else:
                output = replaced = output.clone()
        if isinstance(output, torch.Tensor):  # the common case, without pytree's cost
            flat, spec = [output], None
        else:
            flat, spec = tree_flatten(output)
        outs = [o for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if self._sourced is m:
            # each floating output without a gradient: one that requires one anyway is computed from
            # a trainable parameter the engine does not clip, and keeps its graph (found in review: a
            # layer's second output did, and its first, from a clipped weight, was left unhooked)
            self._sourced = None
            if not all(o.requires_grad for o in outs):
                flat = [_as_source(o) if isinstance(o, torch.Tensor) and o.is_floating_point() and not o.requires_grad
                        else o for o in flat]
                output = replaced = flat[0] if spec is None else tree_unflatten(flat, spec)
                outs = [o for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if not any(o.requires_grad for o in outs):
            return None
        if len(outs) > 1:
            # one output may be computed from another inside the layer (an LSTM cell's h from its
            # c): a hook on the returned tensor would see that internal use too, and the vjp would
            # count it twice. Hooks on copies see only the uses outside the layer.
            flat = [o.clone() if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad else o
                    for o in flat]
            output = replaced = tree_unflatten(flat, spec)
            outs = [o for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        in_backward = _in_backward()
        if self._backward_seen and not in_backward:
            raise CorrnoiseError(
                "engine", "a forward pass with gradients on after backward and before the optimizer's step (one batch "
                "per step; engine: per clipped_sum()/clear()): split a batch with make_private's "
                "max_physical_batch_size, and evaluate under torch.no_grad() or after step()")
        leaves = [t for t in _leaves(args, kwargs) if isinstance(t, torch.Tensor)]
        call = _Call(_detach_tree(tuple(args)), _detach_tree(dict(kwargs)), [(t, t._version) for t in leaves], len(outs))
        saved_from_output = getattr(self._owners[m][0], "saved_from_output", None)
        if saved_from_output is not None and replaced is None:
            call.saved = saved_from_output(output)
        self._calls[m].append(call)
        if in_backward:
            self._note_recomputed(m, call)
        if m in self._pending_probe:
            self._pending_probe.discard(m)
            self._expanded.append((m, outs[0]))
        if reshaped_base is not None:
            shape = outs[0].shape
            reshaped_base.register_hook(lambda g, call=call, shape=shape: self._grad_hook(call, 0, g.view(shape)))
            return None
        for k, o in enumerate(outs):
            if o.requires_grad:
                o.register_hook(lambda g, call=call, k=k: self._grad_hook(call, k, g))
        return replaced

    def _token_loss_hook(self, m: nn.Module, args, kwargs, output):
        """A transformers model's built-in token-averaged loss (:func:`_batch_token_loss`) in its
        output: if the user's backward goes through it, :meth:`clipped_sum` refuses the batch. Only
        ``num_items_in_batch`` equal to the batch size makes it a sum of per-example losses."""
        if self._computing or not torch.is_grad_enabled():
            return None
        loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
        if isinstance(output, tuple) and kwargs.get("labels") is not None and len(output) > 1:  # return_dict=False
            loss, logits = output[0], output[1]
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return None
        items = kwargs.get("num_items_in_batch")
        if items is not None and isinstance(logits, torch.Tensor) and int(items) == logits.shape[0]:
            return None
        loss.register_hook(self._note_token_loss)
        return None

    def _note_token_loss(self, g):
        self._token_loss_used = True
        return None

    def _router_loss_hook(self, m: nn.Module, args, output):
        """A transformers model's router losses in its output (fields named ``*aux_loss``,
        ``*z_loss``, :func:`.layers.router_loss_refusal`): if the user's backward goes through one,
        :meth:`clipped_sum` refuses the batch, whether or not the routers train."""
        if self._computing or not torch.is_grad_enabled() or not isinstance(output, Mapping):
            return None
        for key, value in output.items():
            if (isinstance(key, str) and key.endswith(("aux_loss", "z_loss")) and isinstance(value, torch.Tensor)
                    and value.requires_grad):
                value.register_hook(lambda g, what=f"the model output's {key}": self._note_router_loss(what))
        return None

    def _router_logits_hook(self, m: nn.Module, args, output):
        """A top-k router the engine does not clip (frozen): its logits are returned as a copy whose
        gradient marks the batch for refusal, as :func:`.layers.fallback_handler` refuses a clipped
        router's (within the block only the top-k weights reach the output; a gradient on the
        logits is the loss reading them)."""
        if (self._computing or not torch.is_grad_enabled() or not isinstance(output, tuple) or not output
                or not isinstance(output[0], torch.Tensor) or not output[0].requires_grad):
            return None
        logits = output[0].clone()
        logits.register_hook(lambda g, what=f"{type(m).__name__}'s logits": self._note_router_loss(what))
        return (logits, *output[1:])

    def _note_router_loss(self, what: str) -> None:
        if self._router_loss_used is None:
            self._router_loss_used = what
        return None

    def _flattened(self, m: nn.Module, handler, nb: int, n: int) -> bool:
        """Whether a call of ``m`` with ``nb`` rows in a batch of ``n`` examples is read as the batch
        flattened, example-major ((n, nb / n, ...): OPT's decoder layers reshape (B, T, d) to
        (B*T, d) before their MLP). Only for rules that take any leading dimensions
        (:data:`_FLATTENABLE`), and only where nothing can be misattributed (one example: every row
        is its own) or :func:`.attribution.check_attribution` verified this layer on a batch of at
        least 2 (a table of that many rows called without the batch fails it). A layer whose
        gradient is zero on the checked examples (peft's LoRA A while B is zero) passes trivially;
        its rows are those of the layers around it in the same flattened block, which do not."""
        if not _reads_flat(m, handler) or n < 1 or nb <= n or nb % n:
            return False
        if self._layout_probe:
            self._layout_seen[m] = "flattened"
            return True
        return n == 1 or self._layout_verified.get(m) == "flattened"

    def _shared_output(self, m: nn.Module, output):
        """A fallback layer's output of shape (1, ...) in a forward of B > 1 examples (BART's learned
        position embedding returns (1, L, d), added to every example): its gradient would be the
        batch's sum. Expanded to (B, ...), each example's share of the grad output reaches the hook,
        and the fallback's per-example vjp gives each example its own gradient -- right when the
        model uses the output by broadcasting against the batch (``x + pos``), wrong when it
        indexes it (``pos[0]``). So it is expanded only for layers that
        :func:`.attribution.check_attribution` verified (or while it runs); otherwise the call is
        marked and :meth:`clipped_sum` refuses it in one line naming the check. Returns the output
        to use, or None to keep it."""
        b = self._first_batch if self._first_batch is not None else self._root_batch
        if (not isinstance(output, torch.Tensor) or output.dim() < 2 or output.shape[0] != 1 or b is None or b < 2
                or self._owners[m][0] is not fallback_handler or isinstance(m, OPAQUE_TYPES)):
            return None
        if self._layout_probe:
            self._layout_seen[m] = "shared"
        elif self._layout_verified.get(m) != "shared":
            self._unexpanded.add(m)
            return None
        return output.expand(b, *output.shape[1:])

    def _note_recomputed(self, m: nn.Module, call: _Call) -> None:
        """A call captured during backward (a checkpointed block's recomputation): dropped when that
        backward ends if no grad output reached it (non-reentrant checkpointing), so the engine does
        not hold a second copy of the block's activations."""
        self._recomputed.append((m, call))
        task = torch._C._current_graph_task_id()
        if self._prune_task != task:  # once per backward pass
            self._prune_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._drop_unused_recomputed)

    def _drop_unused_recomputed(self) -> None:
        for m, call in self._recomputed:
            if all(g is None for g in call.grads):
                self._calls[m] = [c for c in self._calls[m] if c is not call]
        self._recomputed.clear()

    def _grad_hook(self, call: _Call, k: int, g: torch.Tensor):
        if self._computing:  # the engine's own backward (:meth:`_probe_shared_indices`)
            return None
        self._backward_seen = True
        prev = call.grads[k]
        call.grads[k] = g.detach() if prev is None else prev + g.detach()
        return None

    # ------------------------------------------------------------------ API
    @contextlib.contextmanager
    def paused(self):
        """Within it the hooks capture nothing and change nothing: the model runs as a plain one
        (every weight gradient, shared indices broadcast as transformers does), for a reference
        computation beside the engine's (:func:`.attribution.check_attribution`). What was
        captured before stays."""
        self.check_attached()
        before = self._computing
        self._computing = True
        try:
            yield self
        finally:
            self._computing = before

    @contextlib.contextmanager
    def _attribution_probe(self):
        """The engine's side of :func:`.attribution.check_attribution`. Within it the two batch
        layouts the check verifies are let through and noted (:meth:`_flattened`,
        :meth:`_shared_output`; the dict yielded: layer -> "flattened" / "shared") and clipping is
        off (a sum with a one-hot weight is that example's gradient). Afterwards nothing is
        captured, and the first step's sum check against autograd is still to come (in training
        mode, where a train-only use of a parameter would show). :meth:`_verify_layouts` after a
        passed check lets the noted layers through from then on."""
        self.check_attached()
        if self._backward_seen or any(self._calls.values()):
            raise CorrnoiseError("batch", "the attribution check needs an engine with nothing captured: run it before "
                                 "the step's forward (or after step() / zero_grad())")
        clip, verified = self.max_grad_norm, self._verified
        self._layout_probe, self._layout_seen, self.max_grad_norm = True, {}, math.inf
        self._indices_seen = set()
        try:
            yield self._layout_seen
        finally:
            self.max_grad_norm, self._verified, self._layout_probe = clip, verified, False
            self.clear()

    def _verify_layouts(self, seen: dict[nn.Module, str]) -> None:
        """After a passed check: its layouts, and the shared indices it saw expanded, are let through."""
        self._layout_verified.update(seen)
        self._indices_verified |= self._indices_seen

    def _layout_paths(self, seen: dict[nn.Module, str], kind: str) -> list[str]:
        """Paths of the layers in ``seen`` with that layout."""
        return sorted(self._paths[m] for m, k in seen.items() if k == kind)

    def _owned_names(self, layers) -> list[str]:
        """Names of the clipped parameters ``layers`` own."""
        return [self.names[i] for m in layers for _, i in self._owners[m][1]]

    def captured(self) -> bool:
        """Whether a forward with gradients (or its backward) was captured since :meth:`clear`: a
        batch in hand that the optimizer has not taken (a forward under ``torch.no_grad()``, an
        evaluation pass, captures nothing)."""
        return self._backward_seen or any(self._calls.values())

    def clear(self) -> None:
        """Drop captured activations and grad outputs (call after each clipped sum)."""
        for calls in self._calls.values():
            calls.clear()
        self._reached.clear()
        self._autograd.clear()
        self._outside.clear()
        self._recomputed.clear()
        self._backward_seen = False
        self._token_loss_used = False
        self._router_loss_used = None
        self._unexpanded.clear()
        self._expanded.clear()
        self._pending_probe.clear()
        self._first_batch = self._root_batch = None

    def detach(self, by: str = "user") -> None:
        """Remove every hook and captured tensor; the engine cannot be used afterwards (``by``: who
        detached it, for the one-line refusal of a later use: "user", "later engine", "optimizer";
        a second call changes nothing)."""
        if by not in _DETACHED_WHY:
            raise CorrnoiseError("by", f"must be one of {', '.join(map(repr, _DETACHED_WHY))}, got {by!r}")
        if self._detached:
            return
        self._detached_by = by
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()
        self._workspace = None
        self._detached = True
        for m in [self.module, *self._owners]:
            if _LIVE.get(m) is self:
                del _LIVE[m]

    def _workspace_for(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """``numel`` numbers for this clipped sum's materialized gradients, from one buffer kept
        between steps (grown on demand, at most the memory budget: :func:`_materialize_budget`).

        A fresh allocation of that size each step is not free on CPU: the allocator hands large
        blocks back to the system and takes them again page by page (measured: a 128 x 128
        Linear's (32, 128, 128) gradients, 2 MB, 0.6 ms in a reused buffer, 1.4 ms freshly
        allocated; BERT width 128, same process: 1.59-1.63x a plain step with the kept buffer,
        1.91-1.94x with a fresh one each step).
        On CUDA the caching allocator already reuses blocks, so none is kept there.
        """
        if numel == 0 or device.type != "cpu":
            return None
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != dtype or ws.device != device:
            self._workspace = ws = None  # drop the old one before taking the new
            self._workspace = ws = torch.empty(numel, dtype=dtype, device=device)
        return ws

    def _contributions(self, n: int, dtype_floor=torch.float32):
        """Per parameter: (factors, dense tensors), the batch size and accumulation dtype (``n``:
        the examples in the batch, for calls that see it flattened, :meth:`_flattened`)."""
        factors: list[list] = [[] for _ in self.parameters]
        dense: list[list] = [[] for _ in self.parameters]
        seen = {g.dtype for calls in self._calls.values() for call in calls for g in call.grads if g is not None}
        acc = dtype_floor
        for dt in seen:  # once per dtype, not per grad output (each is a host call)
            acc = torch.promote_types(acc, dt)
        used = []  # (module, call, its batch dimension, its rows if it sees the batch flattened else 0)
        for m, calls in self._calls.items():
            handler = self._owners[m][0]
            for call in calls:
                if all(g is None for g in call.grads):
                    continue  # output not used by the loss: contributes zero
                for t, v in call.versions:
                    if t._version != v:
                        raise CorrnoiseError(
                            "module", f"input of '{self._paths[m]}' was modified in place after its forward")
                try:
                    nb = call_batch_size(m, call.args, call.kwargs)
                except CorrnoiseError:
                    raise CorrnoiseError(
                        "module", f"'{self._paths[m]}' ({type(m).__name__}) was called without a batched tensor input: "
                        "its parameters are shared by the whole batch (a position-bias table?), so "
                        f"{shared_by_batch_advice('them')}") from None
                flat = nb != n and self._flattened(m, handler, nb, n)
                used.append((m, call, n if flat else nb, nb if flat else 0))
        self._unexpanded.update(m for m, _ in self._expanded)  # expanded in a recomputation: never probed
        m = next((u[0] for u in used if u[0] in self._unexpanded), None)
        if m is not None:
            what = ("is called with indices shared by the batch, whose use the engine could not probe (the model "
                    "returns no output with the batch as dim 0, or the layer ran only in a reentrant checkpoint's "
                    "recomputation)" if takes_indices(self._owners[m][0]) else
                    f"returns an output of batch dimension 1 in a batch of {n}, shared by its examples")
            raise CorrnoiseError(
                "module", f"'{self._paths[m]}' ({type(m).__name__}) {what} (a position embedding?): the engine gives "
                "each example its share once optimizer.check_attribution on a first batch of at least 2 examples has verified that the "
                "model uses it by broadcasting (PrivateTrainer runs it)")
        sizes = [nb for _, _, nb, _ in used]
        b = sizes[0] if sizes else None
        if len(set(sizes)) > 1:  # one call's batch is not the others' (all of them other than n: batch_size's error)
            ref = n if n in sizes else b
            m, _, nb, _ = next(u for u in used if u[2] != ref)
            hint = ""
            if _reads_flat(m, self._owners[m][0]) and ref > 1 and nb > ref and nb % ref == 0:
                hint = (f"; if its rows are the batch flattened ({nb // ref} per example, as OPT's decoder layers call "
                        "their MLP and transformers' mixture-of-experts blocks their router and experts), "
                        "optimizer.check_attribution on a first batch of at least 2 examples verifies that and lets it "
                        "through (PrivateTrainer runs it)")
            elif not _reads_flat(m, self._owners[m][0]) and ref > 1:  # every such layer's, so one freeze is enough
                names = ", ".join(dict.fromkeys(self.names[i] for u, _, size, _ in used if size != ref
                                                and not _reads_flat(u, self._owners[u][0])
                                                for _, i in self._owners[u][1]))
                rules = ", ".join(h.__name__.removesuffix("_handler") for h in _FLATTENABLE)
                hint = (f"; the engine reads rows other than the batch's only through its rules for {rules} layers "
                        "and transformers' top-k routers and experts without an expert capacity, "
                        f"not for {type(m).__name__} (it may mix the tokens of all examples): freeze {names} "
                        "(requires_grad_(False)) or train adapters (LoRA) on the layers around it")
            raise CorrnoiseError("module", f"'{self._paths[m]}' has batch dimension {nb}, others {ref} (inputs must be "
                                 f"batch-first){hint}")
        self._computing = True
        try:
            for m, call, _, rows in used:
                handler, owned = self._owners[m]
                args, kwargs, grads = _unflatten(call, rows, n) if rows else (call.args, call.kwargs, call.grads)
                try:
                    if rows and handler is fallback_handler:  # each example's re-run gets its own rows
                        out = fallback_handler(m, args, kwargs, grads, acc, flat=True)
                    elif call.saved is not None and not rows:
                        out = handler(m, args, kwargs, grads, acc, saved=call.saved)
                    else:
                        out = handler(m, args, kwargs, grads, acc)
                except CorrnoiseError as exc:
                    raise CorrnoiseError(exc.param, f"'{self._paths[m]}': {exc.message}") from None
                for name, i in owned:
                    for c in out.get(name, []):
                        (factors if isinstance(c, tuple) else dense)[i].append(c)
        finally:
            self._computing = False
        return factors, dense, b, acc

    @torch.no_grad()  # torch.func's vjp in the fallback still differentiates inside
    def clipped_sum(self, batch_size: int, weights: torch.Tensor | None = None):
        """(sums, norms): sum_i w_i c_i g_i per parameter (aligned with ``self.parameters``) and ||g_i||.

        ``batch_size``: the number of examples in the batch (the captured batch dimension; the
        divisor of a "mean" loss). g_i is example i's gradient of its own loss; c_i = min(1,
        C / ||g_i||), 0 for a non-finite gradient; ``weights`` (B,) in [0, 1] (0 = padding).
        Sums and norms are in float32 or wider. Parameters backward did not reach get zeros.
        """
        self.check_attached()
        if self._token_loss_used:
            raise CorrnoiseError(
                "loss", "the model's built-in loss (labels=) averages over the batch's labelled tokens, so each "
                "example's gradient would depend on the other examples' lengths: compute one loss per example from "
                "out.logits (each sequence's mean token loss), or pass num_items_in_batch=<batch size> to the model")
        if self._router_loss_used is not None:
            raise router_loss_refusal(self._router_loss_used)
        n = check_int("batch_size", batch_size, minimum=0)
        factors, dense, b, acc = self._contributions(n)
        for i in range(len(self.parameters)):
            if i in self._reached and not factors[i] and not dense[i]:
                raise CorrnoiseError(
                    "module", f"parameter '{self.names[i]}' got a gradient outside any hooked forward call")
        if self._outside:
            names = ", ".join(self.names[i] for i in sorted(self._outside))
            raise CorrnoiseError("module", f"parameter(s) {names} got a gradient from outside their module's forward "
                                 "(used directly, as F.linear(x, layer.weight) or a tied copy): no example's share of "
                                 "it is captured; use the parameter only through its module")
        if b is None:
            dev = self.parameters[0].device
            return [torch.zeros(p.shape, dtype=torch.promote_types(acc, p.dtype), device=dev) for p in self.parameters], \
                torch.zeros(n, dtype=acc, device=dev)
        if b != n:
            raise CorrnoiseError("batch_size", f"is {n} but the captured batch dimension is {b}")
        dev = next(t for fs in factors + dense for c in fs for t in ([c[1]] if isinstance(c, tuple) else [c])).device
        scale = float(n) if self.loss_reduction == "mean" else 1.0
        # each parameter's per-example norm (rows it holds) or squared norm (ghost), summed at once below:
        # two stacks and one sum instead of a square and an add per parameter (host calls)
        row_norms: list[torch.Tensor] = []
        squares: list[torch.Tensor] = []
        ghost: list[bool] = []
        mats: list[torch.Tensor | None] = []
        budget, held = _materialize_budget(factors, dense), 0
        itemsize = torch.empty((), dtype=acc).element_size()
        offsets: dict[int, int] = {}  # parameter -> start of its materialized gradients in the workspace
        for i, p in enumerate(self.parameters):
            fs, ds = factors[i], dense[i]
            g_ok = bool(fs) and not ds and len({c[1].shape[1] for c in fs}) == 1
            if g_ok:
                u0, v0 = fs[0]
                t_total = sum(c[1].shape[2] for c in fs)
                g_ok = use_ghost(t_total, u0.shape[-1], v0.shape[-1], one_hot_side(fs) is not None)
                if not g_ok:  # materialized gradients are held until the clipped sum: within the budget
                    g_ok = held + b * p.numel() * itemsize > budget
                    if not g_ok:
                        offsets[i] = held // itemsize
                        held += b * p.numel() * itemsize
            ghost.append(g_ok)
        groups = _shared_input_groups(self.parameters, factors, offsets, acc)
        offsets = _group_offsets(self.parameters, offsets, groups, b)
        space = self._workspace_for(held // itemsize, acc, dev)
        # small dense-only gradients (biases, norm layers' affine) side by side in one (B, N) block:
        # one norm and one weighted sum for all of them instead of a few small ops each
        small = [i for i, p in enumerate(self.parameters) if not factors[i] and len(dense[i]) == 1
                 and p.numel() <= SMALL_DENSE and dense[i][0].dtype == acc]
        block = torch.cat([dense[i][0].reshape(b, -1) for i in small], dim=1) if small else None
        if block is not None:
            row_norms.append(torch.linalg.vector_norm(block, dim=1))
        in_block = set(small)
        grouped: dict[int, torch.Tensor] = {}  # first member of a shared-input group -> its (B, sum U, V) product
        for members in groups:
            start = offsets[members[0]]
            out = None if space is None else space[start:start + b * sum(self.parameters[j].numel() for j in members)]
            full = shared_input_products([factors[j][0][0] for j in members], factors[members[0]][0][1], out)
            row_norms.append(torch.linalg.vector_norm(full.view(b, -1), dim=1))
            grouped[members[0]] = full
        in_group = {j for members in groups for j in members}
        for i, p in enumerate(self.parameters):
            fs, ds = factors[i], dense[i]
            if ghost[i]:
                squares.append(ghost_norm_sq(fs))
                mats.append(None)
            elif i in in_block or i in in_group:
                mats.append(None)
            elif fs or ds:
                out = space[offsets[i]:offsets[i] + b * p.numel()] if space is not None and i in offsets else None
                full = materialize(fs, p.shape, out) if fs else None
                for d in ds:
                    full = d if full is None else full.add_(d) if fs else full + d
                row_norms.append(torch.linalg.vector_norm(_storage_rows(full)[0], dim=1))  # fused, no (B, P) temporary
                mats.append(full)
            else:
                mats.append(None)
        stacked = ([torch.stack(row_norms).square_()] if row_norms else []) + ([torch.stack(squares)] if squares else [])
        sq = torch.cat(stacked).sum(0) if stacked else torch.zeros(b, dtype=acc, device=dev)
        norms = sq.sqrt() * scale
        w = clip_weights(norms, self.max_grad_norm)
        if weights is not None:
            weights = torch.as_tensor(weights, dtype=w.dtype, device=w.device).reshape(-1)
            if weights.numel() != b:
                raise CorrnoiseError("weights", f"{weights.numel()} weights for {b} examples")
            if bool(((weights < 0) | (weights > 1)).any()):
                raise CorrnoiseError("weights", "must lie in [0, 1] (a weight above 1 would raise the sensitivity)")
            w = w * weights
        finite = torch.isfinite(sq)
        all_finite = bool(finite.all())
        w_raw = w * scale
        sums = []
        check = self.verify or not self._verified
        check_fail = []
        block_sums: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        # the materialized gradients' weighted sums in the reverse of the order they were written:
        # the last written are still in the cache (L3) when read, before the older ones evict them
        # (in the order written, each read evicted rows read next; BERT at width 128 holds 33 MB of
        # them: its weighted sums took 1.37 ms a step in that order, 1.19 ms in this one)
        for i in reversed(range(len(self.parameters))):
            if ghost[i] or mats[i] is None:
                continue
            full = mats[i] if all_finite else _zero_rows(mats[i], finite)
            rows, transposed = _storage_rows(full)
            s = torch.mv(rows.t(), as_dtype(w_raw, full.dtype))
            s = s.reshape(full.shape[1:]) if not transposed else s.reshape(full.transpose(1, 2).shape[1:]).t()
            block_sums[i] = (s, full.sum(dim=0) if check and all_finite else None)
        for members in reversed(groups):  # one weighted sum per shared-input group, cut into its members' rows
            full = grouped[members[0]]
            rows = full.view(b, -1) if all_finite else _zero_rows(full, finite).view(b, -1)
            s_all = torch.mv(rows.t(), as_dtype(w_raw, rows.dtype)).view(full.shape[1:])
            u_all = full.sum(dim=0) if check and all_finite else None
            start = 0
            for j in members:
                n_j = self.parameters[j].shape[0]
                block_sums[j] = (s_all[start:start + n_j], None if u_all is None else u_all[start:start + n_j])
                start += n_j
        if block is not None:
            rows = block if all_finite else _zero_rows(block, finite)
            s_all = torch.mv(rows.t(), as_dtype(w_raw, rows.dtype))
            u_all = rows.sum(dim=0) if check and all_finite else None
            sizes = [self.parameters[i].numel() for i in small]  # one split, not a slice per parameter
            s_parts = s_all.split(sizes)
            u_parts = [None] * len(small) if u_all is None else u_all.split(sizes)
            for i, s_i, u_i in zip(small, s_parts, u_parts):
                shape = self.parameters[i].shape
                block_sums[i] = (s_i.view(shape), None if u_i is None else u_i.view(shape))
        out_dtypes = {d: torch.promote_types(acc, d) for d in {p.dtype for p in self.parameters}}
        for i, p in enumerate(self.parameters):
            fs = factors[i]
            out_dtype = out_dtypes[p.dtype]
            if ghost[i]:
                if not all_finite:
                    fs = [(_zero_rows(u, finite), _zero_rows(v, finite)) for u, v in fs]
                s = bookkeeping_sum(fs, w_raw, p.shape)
                unclipped = bookkeeping_sum(fs, torch.ones_like(w_raw), p.shape) if check and all_finite else None
            elif i in block_sums:
                s, unclipped = block_sums[i]
            else:
                s, unclipped = torch.zeros(p.shape, dtype=out_dtype, device=dev), None
            sums.append(as_dtype(s, out_dtype))
            if unclipped is not None and i in self._autograd:
                ref = self._autograd[i].to(unclipped.dtype)
                if float((unclipped - ref).norm()) > 1e-2 * float(ref.norm()) + 1e-6 * max(1.0, float(unclipped.norm())):
                    check_fail.append(self.names[i])
        if check and all_finite:
            # verified only by a sum that adds up: a refused batch leaves the check on, so every
            # later batch is checked (and refused) again (found in review: once refused, the next
            # step was accepted unchecked)
            self._verified = not check_fail
            self._autograd.clear()
            if check_fail:
                raise CorrnoiseError(
                    "module", f"parameter(s) {', '.join(check_fail)}: captured per-example gradients do not add up to "
                    "autograd's gradient (a parameter used outside its module's forward, or a non-deterministic layer)")
        return sums, norms


def _in_transform() -> bool:
    """Whether a torch.func transform (grad, vjp, vmap) is running: parameters cannot leave autograd
    inside one (``requires_grad_`` is refused there), so such a call keeps them."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


class _GraphStart(torch.autograd.Function):
    """The identity on a tensor that carries no gradient, as a node of the graph whose only input is
    a 0-d anchor that requires one (:func:`_as_source`); its backward sends the anchor nothing."""

    @staticmethod
    def forward(ctx, anchor, value):
        # the same memory under a new tensor that is not a view: the model may modify it in place
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, None


#: device -> the 0-d anchor of :class:`_GraphStart` there (never given a gradient)
_ANCHORS: dict[torch.device, torch.Tensor] = {}


def _as_source(t: torch.Tensor) -> torch.Tensor:
    """The output of a hooked call that ran with its parameters out of autograd and no input
    gradient (:meth:`ClippingEngine._skip_weight_grads`), as a start of the graph: the same values
    in a tensor that requires a gradient and is no leaf. The loss's gradient then reaches its hook,
    as it reached the output when the parameters were in autograd, without the weight gradient
    autograd would have formed (an Embedding's whole table). No leaf: the model may modify the
    output in place (``x += pos``), which torch refuses on a leaf. No copy either (a leaf's copy
    was: one copy of the output in the forward and one into the leaf's ``.grad`` in the backward,
    for each such output, three in BERT)."""
    anchor = _ANCHORS.get(t.device)
    if anchor is None:
        anchor = _ANCHORS[t.device] = torch.zeros((), device=t.device, requires_grad=True)
    return _GraphStart.apply(anchor, t)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now: a forward call then is the recomputation of
    a checkpointed block (torch.utils.checkpoint), not a new batch. (False where torch cannot say:
    such a forward is then refused as a second batch.)"""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


#: the live engine of each hooked layer (and engine root module): :meth:`ClippingEngine._take_over`
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: the end of :meth:`ClippingEngine.check_attached`'s refusal, by who detached the engine
_DETACHED_WHY = {
    "user": "; attach a new one",
    "later engine": ": a later make_private (or ClippingEngine) took over this model; step the optimizer it returned",
    "optimizer": ": its private optimizer released the model (the planned run ended, or release_model())",
}

#: dense-only per-example gradients of at most this many numbers per example (biases, norm layers'
#: affine parameters) are clipped together in one (B, N) block (:meth:`ClippingEngine.clipped_sum`)
SMALL_DENSE = 8192

#: parameters sharing a captured input are grouped (:func:`_shared_input_groups`) where that input
#: is at least this wide (the product's rows: narrower ones run slower in the batched matmul,
#: :func:`.formulas.per_example_products`) ...
GROUP_MIN_WIDTH = 16
#: ... and each has at most this many rows (LoRA ranks; measured on CPU, three 128-wide products
#: of B = 32, T = 64: 8 rows 0.30 -> 0.13 ms grouped, 32 rows 0.60 -> 0.49, 64 rows 1.12 -> 1.11)
GROUP_MAX_ROWS = 32

#: the floor of the memory budget for materialized per-example gradients (bytes)
MATERIALIZE_FLOOR_BYTES = 64 * 2 ** 20


def _materialize_budget(factors, dense) -> int:
    """Bytes of per-example gradients ``clipped_sum`` may hold at once where materializing is cheaper
    than the ghost norm (:func:`.formulas.use_ghost`): as much as the captured inputs and grad
    outputs it already holds (so clipping at most doubles the engine's memory), at least
    :data:`MATERIALIZE_FLOOR_BYTES`. Past it, parameters take the ghost norm (a memory bound)."""
    seen, total = set(), 0
    for fs, ds in zip(factors, dense):
        for t in [side for c in fs for side in c] + list(ds):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return max(total, MATERIALIZE_FLOOR_BYTES)


#: transformers' built-in losses (``LOSS_MAPPING`` keys) that average over the batch's labelled tokens
_TOKEN_LOSSES = ("ForCausalLM", "ForMaskedLM", "ForTokenClassification", "ForConditionalGeneration")


def _is_pretrained_model(m: nn.Module) -> bool:
    """A transformers model (a ``PreTrainedModel`` subclass, found by class name: the integration is
    optional), whose output may carry router losses (:meth:`ClippingEngine._router_loss_hook`)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def _batch_token_loss(m: nn.Module) -> bool:
    """Whether ``m`` is a transformers model whose built-in loss (``labels=``) is a mean over the
    whole batch's labelled tokens: its ``loss_function`` is one of :data:`_TOKEN_LOSSES`'s (compared
    as functions, not by the model's name). Such a loss weighs example i's token sum by 1 / N, N
    counted over the batch, so what would be clipped as example i's gradient depends on the other
    examples (tests/test_transformers_models.py). transformers is not imported here: only a module
    whose class has a ``loss_function`` (its PreTrainedModel) is looked at."""
    if not isinstance(getattr(type(m), "loss_function", None), property):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING

        return any(m.loss_function is LOSS_MAPPING.get(k) for k in _TOKEN_LOSSES)
    except ImportError:  # another transformers layout: nothing to refuse by
        return False


def _shared_input_groups(parameters, factors, offsets, acc) -> list[list[int]]:
    """Materialized matrix parameters (``offsets``: those held in the workspace) whose one use has
    the same column side v, the same captured tensor: a Linear's input read by several Linears
    (peft's LoRA A factors on one input). Each group's per-example
    gradients are one product (:func:`.formulas.shared_input_products`), norm and weighted sum.

    The same storage (address, shape, strides, device) is the same values: captured tensors are
    held, so their memory is not reused, and an in-place change after a forward is refused
    (:meth:`ClippingEngine._contributions`). Only v at least :data:`GROUP_MIN_WIDTH` wide and
    parameters of at most :data:`GROUP_MAX_ROWS` rows (see the module docstring). Groups of one
    are left out."""
    by_input: dict[tuple, list[int]] = {}
    for i in offsets:
        fs = factors[i]
        if len(fs) != 1:
            continue
        u, v = fs[0]
        if (isinstance(u, OneHot) or isinstance(v, OneHot) or u.shape[1] != 1 or u.dtype != acc or v.dtype != acc
                or v.shape[-1] < GROUP_MIN_WIDTH or u.shape[-1] > GROUP_MAX_ROWS or tuple(parameters[i].shape) != (u.shape[-1], v.shape[-1])):
            continue
        by_input.setdefault((v.data_ptr(), tuple(v.shape), v.stride(), v.device), []).append(i)
    return [members for members in by_input.values() if len(members) > 1]


def _group_offsets(parameters, offsets: dict[int, int], groups: list[list[int]], b: int) -> dict[int, int]:
    """Workspace offsets (in numbers) laid out again so that each group's members are consecutive:
    the group's (B, sum U, V) product fills their regions, from its first member's offset."""
    if not groups:
        return offsets
    first = {members[0]: members for members in groups}
    later = {j for members in groups for j in members[1:]}
    new, pos = {}, 0
    for i in offsets:  # parameter order
        if i in later:
            continue
        for j in first.get(i, [i]):
            new[j] = pos
            pos += b * parameters[j].numel()
    return new


def _unflatten(call: _Call, nb: int, n: int):
    """A call's tensors with ``nb`` rows (inputs and grad outputs) as (n, nb / n, ...)."""
    def view(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == nb:
            return t.reshape(n, nb // n, *t.shape[1:])
        return t

    args, spec = tree_flatten((call.args, call.kwargs))
    args, kwargs = tree_unflatten([view(t) for t in args], spec)
    return args, kwargs, [view(g) for g in call.grads]


def _leaves(args, kwargs) -> list:
    """A call's arguments flattened (pytree order); positional tensors alone skip pytree's cost."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args)
    return tree_flatten((args, kwargs))[0]


def _first_dim(args, kwargs) -> int | None:
    """dim 0 of the first tensor with a dimension among a call's arguments (None if there is none)."""
    for v in _leaves(args, kwargs):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return None


def _storage_rows(full: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A materialized (B, *S) gradient as (B, N) rows in its storage order, without a copy, and
    whether that order is (B, Q, P) for a (B, P, Q) gradient (computed transposed,
    :func:`.formulas.per_example_products`): norms do not depend on the order; a weighted sum
    in that order is transposed back."""
    if full.dim() == 3 and not full.is_contiguous() and full.transpose(1, 2).is_contiguous():
        return full.transpose(1, 2).reshape(full.shape[0], -1), True
    return full.reshape(full.shape[0], -1), False


def _zero_rows(x, finite: torch.Tensor):
    """Rows of non-finite examples set to 0 (NaN-free), so a dropped example cannot leak a NaN."""
    if isinstance(x, OneHot):
        return x
    mask = finite.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
