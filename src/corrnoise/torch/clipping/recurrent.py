"""The rule for nn.LSTM, nn.GRU and nn.RNN: exact per-example gradients from one batched backward.

The fused kernels of these layers give no per-example gradients and torch.func has no batching
rule for them, so the generic fallback pulls back one example at a time (30-100x a plain
step). This rule re-runs the recurrence unrolled with plain batched operations (F.linear,
sigmoid, tanh / relu) on the captured input and initial state, pulls the captured grad outputs
(``output``, ``h_n`` and, for an LSTM, ``c_n``; zero for an output the loss did not use) back
through it with one ``torch.autograd.grad`` call over the whole batch, and reads off the
gradient of every layer's input-side gate pre-activations

    A_t = W_ih x_t + b_ih                         (B, T, G), G = gates * hidden_size

Each example's loss depends on its own rows only, so the batched gradient with respect to A is
the per-example one. With the hidden-side pre-activations C_t = W_hh h_{t-1} + b_hh, the
per-example parameter gradients of example i are

    weight_ih: sum_t dA_t x_t^T         (a factor (dA, x): never materialized under ghost norm)
    weight_hh: sum_t dC_t h_{t-1}^T     (a factor (dC, h_prev))
    bias_ih:   sum_t dA_t               bias_hh: sum_t dC_t

where x_t is the layer's input (the previous layer's outputs, both directions concatenated,
above layer 0) and h_{t-1} the state the step started from (h_{t+1} in the reverse
direction; the initial state at the first step processed). The LSTM and the Elman RNN add A_t
and C_t before any nonlinearity, so dC_t = dA_t; the GRU multiplies the hidden part of its
n-gate by r_t, so dC_t = dA_t except on the n-gate, where it is r_t * dA_t (see
:func:`gru_step`). The equations are those of the PyTorch nn.LSTM / nn.GRU / nn.RNN
documentation, gate order (i, f, g, o), (r, z, n) and the single gate of nn.RNN as in the
parameters ``weight_ih_l{k}``.

Exactly supported: ``batch_first=True``, 3-D input, any ``num_layers``, ``bidirectional``,
``bias=False``, a given or default ``hx`` (batch on dim 1), ``nonlinearity`` tanh or relu, eval
mode, and training mode without inter-layer dropout (``dropout=0`` or a single layer, where
torch applies none). Every other call (``proj_size > 0``, unbatched 2-D input, a
PackedSequence, ``batch_first=False``, inter-layer dropout in training) goes to
:func:`.layers.fallback_handler`, which computes it exactly one example at a time or refuses it
with a one-line error, as before this rule existed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import layers

__all__ = ["recurrent_handler", "lstm_step", "gru_step", "rnn_step", "rule_applies"]

#: gates per hidden unit of each ``nn.RNNBase.mode``
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def lstm_step(a_t: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_hh: torch.Tensor, b_hh):
    """One LSTM step (PyTorch nn.LSTM documentation equations), A_t = W_ih x_t + b_ih given:

        i = sigmoid(A_i + W_hi h + b_hi)    f = sigmoid(A_f + W_hf h + b_hf)
        g = tanh(A_g + W_hg h + b_hg)       o = sigmoid(A_o + W_ho h + b_ho)
        c' = f * c + i * g                   h' = o * tanh(c')

    Returns (h', c'). A and C = W_hh h + b_hh are added first, so dC = dA.
    """
    gates = a_t + F.linear(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_step(a_t: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh):
    """One GRU step (PyTorch nn.GRU documentation equations), A_t = W_ih x_t + b_ih given:

        r = sigmoid(A_r + W_hr h + b_hr)    z = sigmoid(A_z + W_hz h + b_hz)
        n = tanh(A_n + r * (W_hn h + b_hn))
        h' = (1 - z) * n + z * h

    Returns (h', r). dC = dA on the r and z gates; on the n gate dC_n = r * dA_n (so b_hn's
    gradient is r * dA_n, not b_in's dA_n).
    """
    c_r, c_z, c_n = F.linear(h, w_hh, b_hh).chunk(3, dim=1)
    a_r, a_z, a_n = a_t.chunk(3, dim=1)
    r = torch.sigmoid(a_r + c_r)
    z = torch.sigmoid(a_z + c_z)
    n = torch.tanh(a_n + r * c_n)
    return n + z * (h - n), r


def rnn_step(a_t: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor, b_hh, relu: bool):
    """One Elman RNN step (PyTorch nn.RNN documentation equation), A_t = W_ih x_t + b_ih given:

        h' = tanh(A + W_hh h + b_hh)   (relu instead of tanh for nonlinearity='relu')

    dC = dA.
    """
    pre = a_t + F.linear(h, w_hh, b_hh)
    return torch.relu(pre) if relu else torch.tanh(pre)


def _call_parts(args, kwargs):
    """(input, hx, anything else given): the arguments of ``forward(input, hx=None)``."""
    rest = dict(kwargs)
    x = args[0] if args else rest.pop("input", None)
    hx = args[1] if len(args) > 1 else rest.pop("hx", None)
    extra = len(args) > 2 or bool(rest)
    return x, hx, extra


def _parameter_names(module: nn.Module) -> list[str]:
    """The parameters the rule reads: weight_ih/hh_l{k}[_reverse] and, with bias, bias_ih/hh_l{k}[_reverse]."""
    kinds = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if module.bias else ())
    return [f"{kind}_l{layer}{sfx}" for layer in range(module.num_layers)
            for sfx in ("", "_reverse")[:2 if module.bidirectional else 1] for kind in kinds]


def rule_applies(module: nn.Module, args, kwargs, grad_outs) -> bool:
    """Whether :func:`recurrent_handler` computes this call itself (exactly) rather than the fallback.

    Needs a plain batch-first 3-D input (no PackedSequence), no projection, no inter-layer
    dropout in training (its masks cannot be replayed), plain parameters (not parametrized),
    hx absent or of the batched shape ((layers * directions, B, hidden), a pair for an LSTM) and
    one grad output per tensor output.
    """
    mode = getattr(module, "mode", None)
    if type(module) not in (nn.LSTM, nn.GRU, nn.RNN) or mode not in _GATES:
        return False
    x, hx, extra = _call_parts(args, kwargs)
    if extra or not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        return False
    if not module.batch_first or getattr(module, "proj_size", 0) > 0:
        return False
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return False
    own = dict(module.named_parameters(recurse=False))
    if not all(n in own for n in _parameter_names(module)):  # a parametrized weight (weight_norm, ...)
        return False
    lstm = mode == "LSTM"
    states = hx if lstm and isinstance(hx, (tuple, list)) else (hx,)
    if hx is not None and (len(states) != (2 if lstm else 1)
                           or not all(isinstance(s, torch.Tensor) and s.dim() == 3 for s in states)):
        return False
    return len(grad_outs) == (3 if lstm else 2)


def _initial_states(module: nn.Module, hx, b: int, dtype, device):
    """Per (layer, direction) index k = layer * directions + direction: (h0_k, c0_k or None), (B, H)."""
    n = module.num_layers * (2 if module.bidirectional else 1)
    zeros = torch.zeros(n, b, module.hidden_size, dtype=dtype, device=device)
    lstm = module.mode == "LSTM"
    if hx is None:
        h0, c0 = zeros, (zeros if lstm else None)
    elif lstm:
        h0, c0 = (s.to(dtype) for s in hx)
    else:
        h0, c0 = hx.to(dtype), None
    return [(h0[k], None if c0 is None else c0[k]) for k in range(n)]


def _run_direction(module: nn.Module, a: torch.Tensor, h0, c0, w_hh, b_hh, reverse: bool):
    """The recurrence of one (layer, direction) on its gate pre-activations a = A (B, T, G).

    Returns the hidden states in time order (B, T, H), the final (h, c) (c None but for an
    LSTM) and, for a GRU, its reset gates r in time order (B, T, H) (else None).
    """
    t_len = a.shape[1]
    a_steps = a.unbind(1)
    hs: list = [None] * t_len
    rs: list = [None] * t_len
    h, c = h0, c0
    for t in (range(t_len - 1, -1, -1) if reverse else range(t_len)):
        if module.mode == "LSTM":
            h, c = lstm_step(a_steps[t], h, c, w_hh, b_hh)
        elif module.mode == "GRU":
            h, rs[t] = gru_step(a_steps[t], h, w_hh, b_hh)
        else:
            h = rnn_step(a_steps[t], h, w_hh, b_hh, relu=module.mode == "RNN_RELU")
        hs[t] = h
    return torch.stack(hs, dim=1), h, c, (torch.stack(rs, dim=1) if module.mode == "GRU" else None)


def _previous_states(seq: torch.Tensor, h0: torch.Tensor, reverse: bool) -> torch.Tensor:
    """h_{t-1} for every t in time order (h_{t+1} in the reverse direction; h0 where the run starts)."""
    if reverse:
        return torch.cat([seq[:, 1:], h0.unsqueeze(1)], dim=1)
    return torch.cat([h0.unsqueeze(1), seq[:, :-1]], dim=1)


def _hidden_side(module: nn.Module, da: torch.Tensor, r) -> torch.Tensor:
    """dC from dA (module docstring): equal, but for a GRU's n gate, where dC_n = r * dA_n."""
    if module.mode != "GRU":
        return da
    h = module.hidden_size
    return torch.cat([da[..., :2 * h], r * da[..., 2 * h:]], dim=-1)


def recurrent_handler(module, args, kwargs, grad_outs, dtype):
    """nn.LSTM / nn.GRU / nn.RNN: per-example gradients from one batched backward (module docstring).

    Cases the rule cannot compute exactly go to :func:`.layers.fallback_handler` unchanged
    (:func:`rule_applies`).
    """
    if not rule_applies(module, args, kwargs, grad_outs):
        return layers.fallback_handler(module, args, kwargs, grad_outs, dtype)
    x, hx, _ = _call_parts(args, kwargs)
    b, dirs, hid = x.shape[0], (2 if module.bidirectional else 1), module.hidden_size
    states = _initial_states(module, hx, b, dtype, x.device)
    runs = []  # per (layer, direction): suffix, layer input, A, h0, run results
    outputs, cotangents = [], []
    with torch.enable_grad():
        inp = x.detach().to(dtype)
        for layer in range(module.num_layers):
            seqs = []
            for d in range(dirs):
                sfx = f"l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = (module.get_parameter(f"weight_{s}_{sfx}").detach().to(dtype) for s in ("ih", "hh"))
                b_ih, b_hh = ((module.get_parameter(f"bias_{s}_{sfx}").detach().to(dtype) if module.bias else None)
                              for s in ("ih", "hh"))
                a = F.linear(inp, w_ih, b_ih)
                if not a.requires_grad:  # layer 0: A is a leaf of the re-run
                    a.requires_grad_()
                h0, c0 = states[layer * dirs + d]
                seq, h_n, c_n, r = _run_direction(module, a, h0, c0, w_hh, b_hh, reverse=d == 1)
                k = layer * dirs + d
                for final, g in ((h_n, grad_outs[1]), (c_n, grad_outs[2] if c_n is not None else None)):
                    if g is not None:
                        outputs.append(final)
                        cotangents.append(g[k].to(dtype))
                runs.append((sfx, inp.detach(), a, h0, seq, r, d == 1))
                seqs.append(seq)
            if grad_outs[0] is not None and layer == module.num_layers - 1:
                for d, seq in enumerate(seqs):
                    outputs.append(seq)
                    cotangents.append(grad_outs[0][..., d * hid:(d + 1) * hid].to(dtype))
            inp = torch.cat(seqs, dim=-1) if dirs > 1 else seqs[0]
        das = torch.autograd.grad(outputs, [run[2] for run in runs], cotangents, allow_unused=True)
    out: dict[str, list] = {}
    for (sfx, inp, a, h0, seq, r, reverse), da in zip(runs, das):
        da = torch.zeros_like(a) if da is None else da  # a (layer, direction) no used output depends on
        dc = _hidden_side(module, da, None if r is None else r.detach())
        prev = _previous_states(seq.detach(), h0.detach(), reverse)
        out[f"weight_ih_{sfx}"] = [(da.unsqueeze(1), inp.unsqueeze(1))]
        out[f"weight_hh_{sfx}"] = [(dc.unsqueeze(1), prev.unsqueeze(1))]
        if module.bias:
            out[f"bias_ih_{sfx}"] = [da.sum(dim=1)]
            out[f"bias_hh_{sfx}"] = [dc.sum(dim=1)]
    return out


for _cls in (nn.LSTM, nn.GRU, nn.RNN):
    layers.register_layer(_cls, recurrent_handler)
