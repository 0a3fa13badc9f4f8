"""Per-layer rules: what a layer's per-example gradient is, from its captured input and grad output.

A handler ``fn(module, args, kwargs, grad_outs, dtype) -> {param_name: [contribution, ...]}``
turns one call of ``module`` (its detached positional/keyword inputs and the gradients of the
loss with respect to its tensor outputs) into contributions to its own parameters' per-example
gradients, each either

* a factor ``(u, v)`` (see :mod:`.formulas`): the weight gradient of example i is
  sum_t u_{i,t} v_{i,t}^T, reshaped to the parameter's shape; never materialized when the
  ghost rule says so;
* a dense tensor of shape (B, *param.shape): the per-example gradients themselves (biases,
  the elementwise affine parameters of norm layers, the torch.func fallback).

Lookup (:func:`handler_for`): the exact type in :data:`LAYER_HANDLERS` (extend it with
:func:`register_layer`; subclasses are not matched since they may override ``forward``), then the
duck-typed transformers ``Conv1D`` rule (class named ``Conv1D`` with a 2-D ``weight`` of shape
(d_in, d_out) and y = x @ weight + bias), else the torch.func fallback for that layer alone.
nn.LSTM / nn.GRU / nn.RNN have their own rule in :mod:`.recurrent` (registered when the package
is imported), which hands the calls it cannot compute exactly back to :func:`fallback_handler`.

peft's LoRA. ``lora.Linear`` (targets nn.Linear and transformers' Conv1D) keeps its adapters in
``lora_A`` / ``lora_B`` nn.Linear children called through their own forward, on the input after
``lora_dropout``: the Linear rule applies as is, and the captured input of ``lora_A`` is the
dropped-out one the forward used. ``lora.Embedding`` keeps its adapters as bare parameters
(``lora_embedding_A`` / ``lora_embedding_B`` ParameterDicts) that its own forward uses:
:func:`peft_lora_embedding_handler` is its rule, and :func:`owned_parameters` gives those
parameters to it (duck-typed, peft is not imported).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import CorrnoiseError, first_line
from .formulas import OneHot, as_dtype

__all__ = ["LAYER_HANDLERS", "register_layer", "handler_for", "is_conv1d_like", "fallback_handler", "rows_independent",
           "router_loss_refusal", "is_top_k_router",
           "unfold_conv", "is_moe_experts", "moe_experts_handler", "MOE_FACTOR_BYTES",
           "call_batch_size", "embedding_handler", "expand_shared_indices", "is_peft_lora_embedding",
           "owned_parameters", "peft_lora_embedding_handler", "takes_indices"]

Handler = Callable[..., dict]
LAYER_HANDLERS: dict[type, Handler] = {}


def register_layer(cls: type, handler: Handler) -> None:
    """Register ``handler`` for modules of exactly type ``cls`` (see the module docstring)."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CorrnoiseError("cls", f"must be a torch.nn.Module subclass, got {cls!r}")
    if not callable(handler):
        raise CorrnoiseError("handler", "must be callable")
    LAYER_HANDLERS[cls] = handler


def is_conv1d_like(module: nn.Module) -> bool:
    """The transformers ``Conv1D`` rule: class name ``Conv1D`` and a 2-D ``weight`` (d_in, d_out)."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


def is_peft_lora_embedding(module: nn.Module) -> bool:
    """peft's LoRA Embedding: a ``base_layer`` nn.Embedding and ParameterDicts ``lora_embedding_A``
    (r, V) and ``lora_embedding_B`` (d, r) that its forward uses directly."""
    return (isinstance(getattr(module, "base_layer", None), nn.Embedding)
            and isinstance(getattr(module, "lora_embedding_A", None), nn.ParameterDict)
            and isinstance(getattr(module, "lora_embedding_B", None), nn.ParameterDict))


def handler_for(module: nn.Module) -> Handler:
    h = LAYER_HANDLERS.get(type(module))
    if h is not None:
        return h
    if is_conv1d_like(module):
        return conv1d_like_handler
    if is_moe_experts(module):
        return moe_experts_handler
    if is_peft_lora_embedding(module):
        return peft_lora_embedding_handler
    return fallback_handler


def owned_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``module``'s own forward uses (names relative to it): its direct ones and
    those of its ParameterDict / ParameterList children, containers without a forward that only
    their parent's forward can read (peft keeps adapters in them: LoRA Embedding's
    ``lora_embedding_A`` / ``_B``, IA3's ``ia3_l``, VeRA's ``vera_lambda_b`` / ``_d``, AdaLoRA's
    ``lora_A`` / ``lora_E`` / ``lora_B``)."""
    own = list(module.named_parameters(recurse=False))
    for key, child in module.named_children():
        if isinstance(child, (nn.ParameterDict, nn.ParameterList)):
            own += [(f"{key}.{n}", p) for n, p in child.named_parameters()]
        elif key == "lora_magnitude_vector" and is_peft_lora_embedding(module):
            # DoRA's magnitudes: its layer is called by the LoRA Embedding's forward with the
            # LoRA tables as arguments, and its output has no batch dimension; the LoRA
            # Embedding's rule forms their gradients (:func:`peft_lora_embedding_handler`)
            own += [(f"{key}.{n}", p) for n, p in child.named_parameters()]
    return own


def _batched(x: torch.Tensor, module: nn.Module) -> None:
    if x.dim() < 2:
        raise CorrnoiseError("module", f"{type(module).__name__} input of shape {tuple(x.shape)} has no batch dimension")


def _input(args, kwargs, module: nn.Module) -> torch.Tensor:
    """The layer's input: the first positional argument, or the keyword ``input`` (torch's layers)
    / ``x`` (transformers' ``Conv1D``)."""
    if args:
        return args[0]
    for key in ("input", "x"):
        if key in kwargs:
            return kwargs[key]
    raise CorrnoiseError("module", f"{type(module).__name__} was called without its input tensor")


def call_batch_size(module: nn.Module, args, kwargs) -> int:
    """The batch size of one call: dim 0 of its first tensor input (inputs are batch-first)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:  # the first leaf, without pytree's cost
        return int(args[0].shape[0])
    for v in tree_flatten((args, kwargs))[0]:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise CorrnoiseError("module", f"{type(module).__name__} was called without a batched tensor input")


def _rows(x: torch.Tensor, dtype) -> torch.Tensor:
    """(B, *, d) -> (B, 1, T, d) with T = prod(*), upcast to the accumulation dtype."""
    return as_dtype(x.reshape(x.shape[0], 1, -1, x.shape[-1]), dtype)


def linear_handler(module, args, kwargs, grad_outs, dtype):
    """nn.Linear on (B, *, d_in): weight (d_out, d_in) gets sum_t g_t a_t^T; bias sum_t g_t."""
    x, g = _input(args, kwargs, module), grad_outs[0]
    _batched(x, module)
    a, gg = _rows(x, dtype), _rows(g, dtype)
    out = {"weight": [(gg, a)]}
    if module.bias is not None:
        out["bias"] = [gg.sum(dim=2)[:, 0]]
    return out


def conv1d_like_handler(module, args, kwargs, grad_outs, dtype):
    """transformers Conv1D, y = x @ W + b with W (d_in, d_out): W gets sum_t a_t g_t^T."""
    x, g = _input(args, kwargs, module), grad_outs[0]
    _batched(x, module)
    a, gg = _rows(x, dtype), _rows(g, dtype)
    out = {"weight": [(a, gg)]}
    if getattr(module, "bias", None) is not None:
        out["bias"] = [gg.sum(dim=2)[:, 0]]
    return out


def unfold_conv(x: torch.Tensor, module: nn.modules.conv._ConvNd) -> torch.Tensor:
    """Patches of an N-d convolution's input: (B, groups, T, C_in/groups * prod(kernel)).

    Pads as the layer does (``padding_mode``, 'same' included), then takes strided, dilated
    windows along each spatial dim; the patch order (channel, then kernel offsets) matches the
    weight's flattening, so conv = patches @ W_g^T per group.
    """
    n = len(module.kernel_size)
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    for d in range(n):
        k, s, dil = module.kernel_size[d], module.stride[d], module.dilation[d]
        x = x.unfold(2 + d, dil * (k - 1) + 1, s)
        if dil > 1:
            x = x[..., ::dil]
    b, c = x.shape[:2]
    spatial = x.shape[2:2 + n]
    t = 1
    for o in spatial:
        t *= o
    # (B, C, O_1..O_n, k_1..k_n) -> (B, O_1..O_n, C, k_1..k_n) -> (B, T, groups, C/groups * K)
    perm = [0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)]
    x = x.permute(perm).reshape(b, t, module.groups, -1)
    return x.transpose(1, 2)


def conv_handler(module, args, kwargs, grad_outs, dtype):
    """Conv1d/2d/3d as a Linear on unfolded patches, one block per group."""
    x, g = _input(args, kwargs, module), grad_outs[0]
    n = len(module.kernel_size)
    if x.dim() != n + 2:
        raise CorrnoiseError("module", f"{type(module).__name__} input of shape {tuple(x.shape)} has no batch dimension")
    a = unfold_conv(x.to(dtype), module)
    b, out_c = g.shape[:2]
    gg = g.to(dtype).reshape(b, module.groups, out_c // module.groups, -1).transpose(2, 3)
    out = {"weight": [(gg, a)]}
    if module.bias is not None:
        out["bias"] = [g.to(dtype).reshape(b, out_c, -1).sum(dim=2)]
    return out


def embedding_handler(module, args, kwargs, grad_outs, dtype):
    """nn.Embedding: the table (V, d) gets sum_t onehot(x_t) g_t^T (row padding_idx: nothing).

    Indices shared by the batch ((1, L) or (L,)) arrive here already expanded to the batch by the
    engine (:func:`expand_shared_indices`)."""
    x, g = _input(args, kwargs, module), grad_outs[0]
    if x.dim() < 2:
        raise CorrnoiseError("module", f"Embedding indices of shape {tuple(x.shape)} are as long as the batch: "
                             "pass indices shared by the batch as (1, L) and one index per example as (B, 1)")
    b = x.shape[0]
    idx = x.reshape(b, 1, -1).long()
    gg = as_dtype(g.reshape(b, 1, idx.shape[2], -1), dtype)
    if module.padding_idx is not None:
        gg = gg * (idx != module.padding_idx).unsqueeze(-1).to(dtype)
    return {"weight": [(OneHot(idx, module.num_embeddings), gg)]}


def peft_lora_embedding_handler(module, args, kwargs, grad_outs, dtype):
    """peft's LoRA Embedding: y = E[x] + s * A^T[x] B^T per active adapter (s = scaling, times the
    base layer's ``embed_scale`` if any), A (r, V), B (d, r). With dY the grad output and
    h_t = A^T[x_t] (the rank-r rows looked up):

        grad B = s * sum_t dY_t h_t^T         factor (s dY, h)
        grad A = sum_t (s B^T dY_t) onehot(x_t)^T   factor (s dY B, onehot(x)): a one-hot column side

    (no gradient to the column padding_idx, as F.embedding does). peft applies no dropout on
    this path. DoRA (peft's variant, the only adapter active on the layer): y = c * (E[x] +
    s A^T[x] B^T) with c = m / n per output coordinate, m the magnitudes and n the column norms
    ||W^T + s' B A|| over the vocabulary (s' the scaling alone), treated as a constant as peft
    does (DoRA Sec. 4.3: it is detached); so A and B get the rules above with dY * c, and

        grad m = sum_t dY_t * (E[x_t] + s A^T[x_t] B^T) / n     (dense, per example)

    Refused: another LoRA variant, DoRA beside another active adapter (each rescales what the
    ones before it added), per-call ``adapter_names``, tensor-parallel input/output functions,
    ``max_norm`` (renormalizes the table in place during forward)."""
    if module.merged or module.disable_adapters:
        return {}  # the forward used the base layer alone
    if "adapter_names" in kwargs:
        raise CorrnoiseError("module", "peft LoRA Embedding called with adapter_names (a mixed batch) is not "
                             "supported; call it without adapter_names")
    base = module.base_layer
    if base.max_norm is not None:
        raise CorrnoiseError("module", "peft LoRA Embedding over an Embedding with max_norm (renormalizes the "
                             "table in place in forward) is not supported; set max_norm=None")
    x = _input(args, kwargs, module)
    if x.dim() < 2:
        raise CorrnoiseError("module", f"Embedding indices of shape {tuple(x.shape)} are as long as the batch: "
                             "pass indices shared by the batch as (1, L) and one index per example as (B, 1)")
    b = x.shape[0]
    idx = x.reshape(b, 1, -1).long()
    g = as_dtype(grad_outs[0].reshape(b, 1, idx.shape[2], -1), dtype)
    embed_scale = module._get_embed_scale() if hasattr(module, "_get_embed_scale") else None
    active = [name for name in module.active_adapters if name in module.lora_embedding_A]
    variants = getattr(module, "lora_variant", {})
    out = {}
    for name in active:
        if name in getattr(module, "input_fns", {}) or name in getattr(module, "output_fns", {}):
            raise CorrnoiseError("module", f"peft LoRA Embedding adapter '{name}' is tensor-parallel; only vanilla "
                                 "LoRA and DoRA are supported")
        dora = name in variants
        if dora and type(variants[name]).__name__ != "DoraEmbeddingVariant":
            raise CorrnoiseError("module", f"peft LoRA Embedding adapter '{name}' is a LoRA variant "
                                 f"({type(variants[name]).__name__}); only vanilla LoRA and DoRA are supported")
        if dora and len(active) > 1:
            raise CorrnoiseError("module", f"peft LoRA Embedding adapter '{name}' is DoRA beside other active adapters "
                                 f"({', '.join(active)}): DoRA rescales what the others added; activate one")
        a = module.lora_embedding_A[name].detach().to(dtype)
        bm = module.lora_embedding_B[name].detach().to(dtype)
        s = float(module.scaling[name]) * (1.0 if embed_scale is None else float(embed_scale))
        h = F.embedding(idx, a.t())  # (b, 1, T, r)
        gg = g
        if dora:
            n = torch.linalg.norm(base.weight.detach().to(dtype).t() + float(module.scaling[name]) * (bm @ a), dim=1)
            mag = f"lora_magnitude_vector.{name}.weight"
            looked_up = as_dtype(base(x), dtype).reshape(g.shape)  # E[x_t], the base layer's scaling included
            out[mag] = [(g * (looked_up + s * torch.matmul(h, bm.t()))).sum(dim=2)[:, 0] / n]
            gg = g * (module.lora_magnitude_vector[name].weight.detach().to(dtype) / n)
        ga = s * torch.matmul(gg, bm)  # (b, 1, T, r)
        if base.padding_idx is not None:
            ga = ga * (idx != base.padding_idx).unsqueeze(-1).to(dtype)
        out[f"lora_embedding_A.{name}"] = [(ga, OneHot(idx, a.shape[1]))]
        out[f"lora_embedding_B.{name}"] = [(s * gg, h)]
    return out


def takes_indices(handler: Handler) -> bool:
    """Whether the rule's layer is called with embedding indices (its indices shared by the batch are
    expanded to it before the call: :func:`expand_shared_indices`)."""
    return handler in (embedding_handler, peft_lora_embedding_handler)


def expand_shared_indices(idx, batch_size: int) -> torch.Tensor | None:
    """Embedding indices shared by the batch, expanded to it (a view), or None if they are not shared.

    Shared: shape (1, *S) (what transformers passes as position ids: (1, L)) when the batch has
    B != 1 examples, or a 1-D (L,) with L != B (a 1-D tensor as long as the batch is ambiguous
    -- one index per example, or positions -- and is left to the rule's refusal). The layer's
    output E[idx] is then added to every example, and example b's gradient of the table is

        G_b = sum_l onehot(idx_l) dY_{b,l}^T,   dY_{b,l} = d loss_b / d (example b's copy of E[idx_l])

    which is exactly the Embedding rule for the indices expanded to (B, *S): the ghost norm
    ||G_b||^2 = sum_{l,l'} [idx_l = idx_l'] (dY_{b,l} . dY_{b,l'}) and the book-keeping sum
    sum_b c_b G_b (the rows c_b dY_{b,l} added into row idx_l) follow from :mod:`.formulas`. The
    dY_b exist only if the layer is *called* with the expanded indices: on the (1, *S) output,
    autograd has already summed the grad outputs over the batch (the broadcast's backward) before
    any hook sees them. Hence the engine calls the layer with these indices (its output is
    E[idx] expanded to the batch, the same values; used by broadcasting, x + E[idx], as every
    transformers model does, the model's outputs and gradients are unchanged).
    """
    if not isinstance(idx, torch.Tensor) or idx.dim() == 0:
        return None
    if idx.dim() == 1:
        if idx.shape[0] == batch_size and batch_size != 1:
            return None
        return idx.expand(batch_size, idx.shape[0])
    if idx.shape[0] == 1 and batch_size != 1:
        return idx.expand(batch_size, *idx.shape[1:])
    return None


def _affine_grads(module, g, x_hat, channel_dims: tuple[int, ...]):
    """Per-example grads of an elementwise affine y = x_hat * w + b: sum over non-parameter dims.

    ``x_hat`` is a fresh tensor of the caller's, overwritten here by g * x_hat: a temporary of the
    activations' size less, and on CPU a fresh one costs its page faults (measured on BERT's
    (32, 64, 128) LayerNorm inputs: 0.82 ms per layer with the product in a new tensor, 0.31 ms
    in place)."""
    keep = set(channel_dims) | {0}
    red = tuple(d for d in range(g.dim()) if d not in keep)
    out = {}
    if getattr(module, "weight", None) is not None:
        prod = x_hat.mul_(g)
        out["weight"] = [prod.sum(dim=red) if red else prod]
    if getattr(module, "bias", None) is not None:
        out["bias"] = [g.sum(dim=red) if red else g]
    return out


def layernorm_handler(module, args, kwargs, grad_outs, dtype, saved=None):
    """nn.LayerNorm: x_hat = (x - mean) / sqrt(var + eps) over normalized_shape (biased var).

    ``saved``: the (mean, rstd) the forward's own kernel computed for this call
    (:func:`layer_norm_stats`, this handler's ``saved_from_output``), when the engine found them:
    x_hat is then (x - mean) * rstd, without the statistics' pass (BERT's (32, 64, 128) inputs in
    its step: 126 -> 54 us a layer)."""
    x, g = as_dtype(_input(args, kwargs, module), dtype), as_dtype(grad_outs[0], dtype)
    _batched(x, module)
    k = len(module.normalized_shape)
    dims = tuple(range(x.dim() - k, x.dim()))
    stat_shape = x.shape[:x.dim() - k] + (1,) * k
    if saved is not None and all(t.shape == stat_shape for t in saved):
        x_hat = (x - saved[0].to(dtype)).mul_(saved[1].to(dtype))
    else:
        # the fused kernel without affine is x_hat itself (one pass; mean/var/sub/mul separately cost
        # ~4x more on CPU, aten::var alone ~2 ms on (32, 64, 128)); same statistics, in ``dtype``
        x_hat = F.layer_norm(x, x.shape[x.dim() - k:], None, None, module.eps)
    return _affine_grads(module, g, x_hat, dims)


def layer_norm_stats(output) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mean, rstd) that torch's LayerNorm kernel saved for backward with ``output``, or None where
    the output did not come straight from that kernel (another layer's forward, no graph, a
    torch version whose names differ) or where saved tensors go through hooks: reading one then
    runs the unpack hook, which under non-reentrant checkpointing recomputes the whole block
    (found by the checkpointing test: each layer's hooks fired again in the forward).
    :func:`layernorm_handler` then computes them again."""
    fn = getattr(output, "grad_fn", None) if isinstance(output, torch.Tensor) else None
    if fn is None or type(fn).__name__ != "NativeLayerNormBackward0":
        return None
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_hooks is None or top_hooks(False) is not None:
        return None
    try:
        mean, rstd = fn._saved_result1, fn._saved_result2
    except (AttributeError, RuntimeError):  # renamed, or already freed
        return None
    if not isinstance(mean, torch.Tensor) or not isinstance(rstd, torch.Tensor):
        return None
    return mean.detach(), rstd.detach()


#: what a handler reads from its call's output in the forward, kept with the call and passed back
#: to it as ``saved=`` (the engine looks this attribute up; a handler without one gets nothing)
layernorm_handler.saved_from_output = layer_norm_stats


def rmsnorm_handler(module, args, kwargs, grad_outs, dtype):
    """nn.RMSNorm: x_hat = x / sqrt(mean(x^2) + eps), eps defaulting to the finfo eps of the type
    torch computes in: float32 for bfloat16 / float16 inputs (found in review: the input dtype's,
    7.8e-3 in bfloat16, gave norms 52% too small on inputs of RMS 0.05)."""
    x_in = _input(args, kwargs, module)
    _batched(x_in, module)
    x, g = as_dtype(x_in, dtype), as_dtype(grad_outs[0], dtype)
    eps = module.eps if module.eps is not None else torch.finfo(torch.promote_types(x_in.dtype, torch.float32)).eps
    k = len(module.normalized_shape)
    dims = tuple(range(x.dim() - k, x.dim()))
    x_hat = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return _affine_grads(module, g, x_hat, dims)


def groupnorm_handler(module, args, kwargs, grad_outs, dtype):
    """nn.GroupNorm on (B, C, *): x_hat normalized per (example, group); affine per channel."""
    x, g = as_dtype(_input(args, kwargs, module), dtype), as_dtype(grad_outs[0], dtype)
    _batched(x, module)
    x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)  # fused, as in layernorm_handler
    return _affine_grads(module, g, x_hat, (1,))


@contextlib.contextmanager
def _plain_rnn_kernels(module: nn.Module):
    """The re-run of an RNN layer without the oneDNN / cuDNN fused kernels, whose backward
    needs a workspace that torch.func's vjp does not keep (same mathematics, torch's own kernels)."""
    if not isinstance(module, nn.RNNBase):
        yield
        return
    with torch.backends.mkldnn.flags(enabled=False), torch.backends.cudnn.flags(enabled=False):
        yield


_RANDOM_MESSAGE = ("draws random numbers in its forward (dropout inside it?), which per-example clipping cannot "
                   "replay; set that dropout to 0 (dropout outside the layer is fine)")


def _input_dims(module: nn.Module, args, kwargs, leaves) -> list[int]:
    """Per input leaf, the dimension that carries the batch: 0, except an RNN's initial state hx
    ((layers, B, hidden) even with batch_first=True) on 1; -1 for inputs shared by every example
    (MultiheadAttention's 2-D attn_mask (L, S), whatever L is)."""
    special: dict[int, int] = {}
    if isinstance(module, nn.RNNBase):
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        special = {id(t): 1 for t in tree_flatten(hx)[0] if isinstance(t, torch.Tensor)}
    elif isinstance(module, nn.MultiheadAttention):
        mask = args[5] if len(args) > 5 else kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            special = {id(mask): -1}
    return [special.get(id(v), 0) for v in leaves]


@contextlib.contextmanager
def _rng_untouched(module: nn.Module):
    """The re-runs leave torch's random state as they found it, and a layer that draws random numbers
    (its draws would differ from the forward's: dropout) is refused instead of giving wrong gradients."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
        drew = not torch.equal(torch.get_rng_state(), cpu) or (
            cuda is not None and any(not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda)))
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
    if drew:
        raise CorrnoiseError("module", f"{type(module).__name__} {_RANDOM_MESSAGE}")


#: the most bytes :func:`moe_experts_handler`'s per-expert factors may take (each token's rows for
#: every expert, zero where it was not routed there: B T E (3 F + d) numbers); past it, the
#: fallback's re-run per example, which holds one example's gradients at a time
MOE_FACTOR_BYTES = 1 << 30


def is_moe_experts(module: nn.Module) -> bool:
    """transformers' unified experts in their common layout (``use_experts_implementation`` with its
    defaults: [gate; up] concatenated, not transposed, no biases, no norm after the experts, the
    default gate): ``gate_up_proj`` (E, 2F, d), ``down_proj`` (E, d, F), ``act_fn``. Other layouts
    (GPT-OSS's transposed, biased, interleaved experts) take the fallback."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3):
        return False
    e, f2, d = gu.shape
    layout = (getattr(module, "has_gate", None) is True and getattr(module, "is_concatenated", None) is True
              and getattr(module, "is_transposed", None) is False and getattr(module, "has_bias", None) is False
              and getattr(module, "has_post_expert_norm", False) is False)
    gate = getattr(type(module), "_apply_gate", None)
    return (layout and hasattr(module, "act_fn") and gate is not None and gate.__name__ == "_default_apply_gate"
            and f2 % 2 == 0 and tuple(dn.shape) == (e, d, f2 // 2))


def _experts_args(args, kwargs):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    got = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
    if any(not isinstance(t, torch.Tensor) for t in got):
        raise CorrnoiseError("module", "experts called without (hidden_states, top_k_index, top_k_weights)")
    return got


def moe_experts_handler(module, args, kwargs, grad_outs, dtype):
    """transformers' unified mixture-of-experts experts (:func:`is_moe_experts`) on the batch
    flattened, read as (B, m, ...): token t's output is y_t = sum_j w_{t,j} W_d[e_{t,j}] h_{t,j},
    h = act(gate) * up, [gate; up] = W_gu[e] x_t. Per example and expert e (the factors' blocks),
    with the rows of tokens not routed to e zero:

        grad W_d[e]  = sum_t (w_{t,e} dY_t) h_{t,e}^T
        grad W_gu[e] = sum_t dZ_{t,e} x_t^T,   dZ = the pullback of W_d[e]^T w dY through the gate

    The expert products are recomputed per expert on its routed tokens (one ``mm`` each); the
    factors take B T E (3 F + d) numbers, and past :data:`MOE_FACTOR_BYTES` the fallback's
    per-example re-run is used instead.
    """
    x, idx, wts = _experts_args(args, kwargs)
    g = grad_outs[0]
    gate_up, down = module.gate_up_proj, module.down_proj
    n_exp, f2, d = gate_up.shape
    flat = x.dim() == 3
    if not flat:  # one row per example
        x, idx, wts, g = x.unsqueeze(1), idx.unsqueeze(1), wts.unsqueeze(1), None if g is None else g.unsqueeze(1)
    b, m, k = idx.shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    if b * m * n_exp * (3 * f2 // 2 + d) * itemsize > MOE_FACTOR_BYTES:
        return fallback_handler(module, args, kwargs, grad_outs, dtype, flat=flat)
    if g is None:
        return {}
    rows_x, rows_g = as_dtype(x, dtype).reshape(b * m, d), as_dtype(g, dtype).reshape(b * m, d)
    flat_idx, flat_w = idx.reshape(b * m, k), as_dtype(wts, dtype).reshape(b * m, k)
    w_gu, w_d = as_dtype(gate_up.detach(), dtype), as_dtype(down.detach(), dtype)
    # the factors' layout (B, E, m, .): example, expert block, the example's token
    u_gu = rows_x.new_zeros(b, n_exp, m, f2)
    u_d = rows_x.new_zeros(b, n_exp, m, d)
    v_d = rows_x.new_zeros(b, n_exp, m, f2 // 2)
    for e in flat_idx.unique().tolist():
        if not 0 <= e < n_exp:  # transformers' index for "no expert" (masked tokens): nothing computed
            continue
        tok, slot = (flat_idx == e).nonzero(as_tuple=True)
        with torch.enable_grad():
            z = (rows_x[tok] @ w_gu[e].t()).requires_grad_(True)
            h = module._apply_gate(z)
            dy = flat_w[tok, slot].unsqueeze(1) * rows_g[tok]
            (dz,) = torch.autograd.grad(h, z, dy @ w_d[e])
        ex, pos = tok // m, tok % m
        u_gu[ex, e, pos], u_d[ex, e, pos], v_d[ex, e, pos] = dz, dy, h.detach()
    v_gu = rows_x.view(b, 1, m, d).expand(b, n_exp, m, d)
    return {"gate_up_proj": [(u_gu, v_gu)], "down_proj": [(u_d, v_d)]}


def rows_independent(module: nn.Module) -> bool:
    """Whether a fallback layer may be read on the batch flattened (B*m rows, example-major), once
    :func:`.attribution.check_attribution` has verified it: the mixture-of-experts layers of
    transformers' unified implementation, each of whose output rows is a function of its own
    input row alone (every token routed and computed by itself):

    * the experts (classes under ``transformers.integrations.moe.use_experts_implementation``,
      which carry ``has_gate`` and ``is_concatenated``): hidden (N, d) and the router's top-k
      indices and weights (N, k) in, (N, d) out;
    * a top-k router (class name ending in "TopKRouter", an int ``top_k``): (N, d) in, per-token
      logits, weights and indices out.

    A layer with an expert capacity (an attribute named so: Switch Transformers, NLLB-MoE drop
    the tokens past it by the load of the whole batch, mixing examples) is not.
    """
    experts = hasattr(module, "has_gate") and hasattr(module, "is_concatenated")
    return (experts or is_top_k_router(module)) and not any("capacity" in k.lower() for k in vars(module))


def _is_kv_cache(v) -> bool:
    """A transformers key/value cache (``transformers.cache_utils.Cache``, found by class name: the
    integration is optional)."""
    return any(c.__name__ == "Cache" and "cache" in c.__module__ for c in type(v).__mro__)


def is_top_k_router(module: nn.Module) -> bool:
    """A mixture-of-experts top-k router (class name ending in "TopKRouter", an int ``top_k``): it
    returns (logits, top-k weights, indices), and within its block only the weights reach the output."""
    return type(module).__name__.lower().endswith("topkrouter") and isinstance(getattr(module, "top_k", None), int)


def router_loss_refusal(what: str) -> CorrnoiseError:
    """The one-line refusal of a loss that reads a mixture-of-experts router's logits or a router loss
    (``what``: the router's class, or the model output's field): transformers' load-balancing and
    z-losses (``output_router_logits=True`` with ``router_aux_loss_coef``) are functions of the
    whole batch's routing, so every example's share of the gradient would depend on the others."""
    return CorrnoiseError("module", f"the loss reads {what} (a router loss such as transformers' load-balancing "
                          "aux_loss, output_router_logits=True, is a function of the whole batch's routing): leave it "
                          "out of the loss (output_router_logits=False, or compute the loss from out.logits)")


def _refuse_router_logits_in_loss(module: nn.Module, grad_outs) -> None:
    """A top-k router returns (logits, top-k weights, indices); within its block only the weights
    reach the output. A gradient on the logits means the loss reads them directly
    (:func:`router_loss_refusal`)."""
    if is_top_k_router(module) and len(grad_outs) > 1 and grad_outs[0] is not None:
        raise router_loss_refusal(f"{type(module).__name__}'s logits")


def fallback_handler(module, args, kwargs, grad_outs, dtype, names=None, flat=False):
    """Any other layer: per-example vjp of the layer alone with torch.func.

    Re-runs the layer's forward on each example's captured input (with a batch dimension of 1)
    as a function of its own parameters and pulls back that example's grad output; only this
    layer's per-example gradients are materialized. Tensor arguments with the batch size on their
    batch dimension (:func:`_input_dims`) are mapped over, others are shared; an output may carry
    the batch on any one dimension (found against one example's output). ``grad_outs[k]`` is None
    for an output the loss did not use (zero cotangent). Buffers are copied for every re-run, so
    a layer that updates them in forward keeps its own state.
    vmap maps over the examples; an operation vmap has no rule for (the fused RNN cells, for
    one) falls back to a loop over the examples (same gradients, B vjps). The layer must be
    deterministic: one that draws random numbers (dropout inside it) is refused, since the
    re-run would draw another mask than the forward did. A failure of torch.func is reported
    as a one-line error naming the layer.

    ``flat``: the layer was called on the batch flattened, B*m rows example-major, and the
    engine passes its tensors viewed as (B, m, ...) (:func:`rows_independent` layers, once
    verified): each example's re-run gets its own m rows as the layer saw rows, (m, ...), and its
    outputs are (m, ...) rows of the (B, m, ...) grad outputs. A :func:`rows_independent` layer
    called batch-first that flattens the batch inside (DeepSeek-V3's router: (B, m, d) viewed as
    (B*m, d)) returns B*m rows: they are read as each example's m rows in turn, the order the view
    gives (the experts of the same block see those rows flattened, so the check that their layout
    needs verifies the router's with them).
    """
    if flat or rows_independent(module):
        _refuse_router_logits_in_loss(module, grad_outs)
    if any(_is_kv_cache(v) for v in tree_flatten((args, kwargs))[0]):
        raise CorrnoiseError("module", f"{type(module).__name__} was called with a key/value cache (use_cache=True): "
                             "the per-example re-runs of its forward would read and write it; train with "
                             "use_cache=False")
    try:
        with _plain_rnn_kernels(module), _rng_untouched(module):
            return _fallback(module, args, kwargs, grad_outs, dtype, names, flat)
    except RuntimeError as exc:
        if "randomness" in str(exc):
            raise CorrnoiseError("module", f"{type(module).__name__} {_RANDOM_MESSAGE}") from None
        first = first_line(str(exc)) or type(exc).__name__
        raise CorrnoiseError("module", f"{type(module).__name__}: per-example gradients by torch.func failed ({first}); "
                             "register a rule for it with register_layer") from None


#: per fallback layer, the input leaves (argument structure, position) seen without the batch on
#: their batch dimension in some call: shared by the batch (:func:`_batched_leaves`)
_SHARED_LEAVES: "weakref.WeakKeyDictionary[nn.Module, set[tuple[str, int]]]" = weakref.WeakKeyDictionary()


def _batched_leaves(module: nn.Module, spec, leaves, in_dims, b: int) -> list[bool]:
    """Which input leaves of this call carry the batch: a tensor whose batch dimension (``in_dims``)
    has the call's batch size ``b``, unless the same argument had another size there in an earlier
    call of this layer (found in review: a position index (L,) shared by the batch was split over
    the examples of a batch of B = L, after a check and a first step at B != L had passed). A shared
    argument of size B in every call this layer ever saw is still read as batched; the first
    step's check that the per-example gradients add up to autograd's refuses such a layer."""
    shape = str(spec)
    shared = _SHARED_LEAVES.setdefault(module, set())
    mapped = []
    for i, (v, d) in enumerate(zip(leaves, in_dims)):
        tensor = isinstance(v, torch.Tensor) and d >= 0 and v.dim() > d
        if tensor and v.shape[d] != b:
            shared.add((shape, i))
        mapped.append(tensor and v.shape[d] == b and (shape, i) not in shared)
    return mapped


def _shared_index_retry(module: nn.Module, spec, leaves, mapped, b: int) -> set[tuple[str, int]] | None:
    """Where a call's outputs have no batch dimension to be found, the integer 1-D inputs of length
    B read as batched, marked shared for a retry (the marks, or None if there are none): a position
    index (L,) when the batch has B = L examples (BART's learned positions get ``position_ids`` of
    shape (L,); found in review: its first batch of B = L was refused). The retry's outputs must
    then carry the batch on one dimension, and the first step's sum check verifies the values."""
    shape = str(spec)
    ambiguous = {(shape, i) for i, (v, m) in enumerate(zip(leaves, mapped))
                 if m and isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == b
                 and not v.is_floating_point() and not v.is_complex()}
    if not ambiguous:
        return None
    _SHARED_LEAVES.setdefault(module, set()).update(ambiguous)
    return ambiguous


def _fallback(module, args, kwargs, grad_outs, dtype, names, flat=False):
    if names is None:
        names = [n for n, p in owned_parameters(module) if p.requires_grad]
    params = {n: module.get_parameter(n).detach().to(dtype) for n in names}
    buffers = dict(module.named_buffers())
    b = call_batch_size(module, args, kwargs)
    used = [g is not None for g in grad_outs]
    leaves, spec = tree_flatten((args, kwargs))
    if any(isinstance(v, nn.utils.rnn.PackedSequence) for v in leaves) or any(
            isinstance(v, nn.utils.rnn.PackedSequence) for v in (list(args) + list(kwargs.values()))):
        raise CorrnoiseError("module", f"{type(module).__name__} got a PackedSequence, which per-example clipping "
                             "cannot split by example; pass the padded batch (batch_first=True) instead")
    in_dims = _input_dims(module, args, kwargs, leaves)
    mapped = _batched_leaves(module, spec, leaves, in_dims, b)
    batched = [v.to(dtype) if m and v.is_floating_point() else v for v, m in zip(leaves, mapped)]
    bleaves = [v for v, m in zip(batched, mapped) if m]
    bdims = [d for d, m in zip(in_dims, mapped) if m]

    def outputs(p, bl):
        it, it_d = iter(bl), iter(bdims)
        full = [(next(it) if flat else next(it).unsqueeze(next(it_d))) if m else v for v, m in zip(batched, mapped)]
        a, kw = tree_unflatten(full, spec)
        state = {**p, **{n: t.clone() for n, t in buffers.items()}}
        out = functional_call(module, state, tuple(a), dict(kw), strict=False)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if len(outs) != len(used):
            raise CorrnoiseError("module", f"{type(module).__name__} returned {len(outs)} tensors on one example but "
                                 f"{len(used)} on the batch")
        return tuple(o.to(dtype) for o in outs)

    # where each used output carries the batch: compare with one example's output (h_n of an
    # RNN is (layers, B, hidden) even with batch_first=True)
    with torch.no_grad():
        probe = outputs(params, [v.select(d, 0) for v, d in zip(bleaves, bdims)])
    # a rows-independent layer called batch-first that flattens the batch inside (DeepSeek-V3's
    # router views (B, m, d) as (B*m, d)): its (B*m, ...) outputs are each example's m rows in turn
    rows_out = not flat and rows_independent(module) and all(
        g is None or (g.dim() == o.dim() and g.shape[0] == b * o.shape[0] and g.shape[1:] == o.shape[1:])
        for g, o in zip(grad_outs, probe))
    if rows_out:
        grad_outs = [None if g is None else g.reshape(b, -1, *g.shape[1:]) for g in grad_outs]
    dims = []
    for g, o in zip(grad_outs, probe):
        if g is None:
            continue
        if flat or rows_out:  # (B, m, ...) grad outputs, (m, ...) rows per example
            if tuple(g.shape[1:]) != tuple(o.shape):
                raise CorrnoiseError("module", f"{type(module).__name__} returns rows of shape {tuple(o.shape)} on one "
                                     f"example's rows but {tuple(g.shape)} on the batch's")
            dims.append(0)
            continue
        cand = [d for d in range(g.dim()) if g.dim() == o.dim() and g.shape[d] == b and o.shape[d] == 1
                and all(g.shape[e] == o.shape[e] for e in range(g.dim()) if e != d)]
        if b > 1 and len(cand) != 1:
            retry = _shared_index_retry(module, spec, leaves, mapped, b)
            if retry is not None:  # the same call with those indices shared by the batch
                try:
                    return _fallback(module, args, kwargs, grad_outs, dtype, names, flat)
                except CorrnoiseError:
                    _SHARED_LEAVES[module].difference_update(retry)
                    raise
            raise CorrnoiseError("module", f"{type(module).__name__} returns an output of shape {tuple(g.shape)} "
                                 "whose batch dimension cannot be found; register a rule with register_layer")
        dims.append(cand[0] if cand else 0)
    cot = [g.to(dtype) for g in grad_outs if g is not None]

    def one(p, bl, gs):
        outs, pull = vjp(lambda pp: outputs(pp, bl), p)
        it_g, it_d = iter(gs), iter(dims)
        cots = tuple((next(it_g) if flat or rows_out else next(it_g).unsqueeze(next(it_d))) if u else torch.zeros_like(o)
                     for o, u in zip(outs, used))
        return pull(cots)[0]

    try:
        grads = vmap(one, in_dims=(None, list(bdims), list(dims)), randomness="error")(params, bleaves, cot)
    except RuntimeError as exc:
        if "randomness" in str(exc):
            raise
        # no batching rule for some operation (the fused RNN kernels): one example at a time
        per = [one(params, [v.select(d, i) for v, d in zip(bleaves, bdims)], [g.select(d, i) for g, d in zip(cot, dims)])
               for i in range(b)]
        grads = {n: torch.stack([r[n] for r in per]) for n in names}
    return {n: [grads[n]] for n in names}


for _cls in (nn.Linear,):
    register_layer(_cls, linear_handler)
for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_layer(_cls, conv_handler)
register_layer(nn.Embedding, embedding_handler)
register_layer(nn.LayerNorm, layernorm_handler)
register_layer(nn.GroupNorm, groupnorm_handler)
if hasattr(nn, "RMSNorm"):
    register_layer(nn.RMSNorm, rmsnorm_handler)
