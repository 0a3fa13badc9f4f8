"""The nn.LSTM / nn.GRU / nn.RNN rule of the clipping engine (clipping/recurrent.py).

Every case is checked against per-example gradients computed one example at a time by plain
autograd through torch's own (fused) layer, clipped and summed: no torch.func, no shared code
with the rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from corrnoise.errors import CorrnoiseError
from corrnoise.torch.clipping import ClippingEngine, recurrent_handler
from corrnoise.torch.clipping import layers as layers_mod
from corrnoise.torch.clipping.layers import LAYER_HANDLERS, handler_for
from corrnoise.torch.clipping.recurrent import rule_applies

TIGHT = 1e-9  # float64: the unrolled recurrence and torch's kernels agree to rounding


# float64 for every case, and each case under the engine's own ghost/materialize choice and with
# every parameter forced to one (the fixtures of the engine tests)
from test_engine import _float64, rule  # noqa: E402,F401  (pytest fixtures)


class _Net(nn.Module):
    """A batch-first recurrent layer and a Linear head on the outputs named in ``use``.

    ``use``: some of "output" (first and mean step of the output sequence), "h_n", "c_n" (every
    layer's and direction's final state); ``given_hx``: the initial state is computed from the
    input (so each example has its own), else torch's zeros.
    """

    def __init__(self, cls, inp=3, hidden=4, use=("output", "h_n"), given_hx=False, **kw):
        super().__init__()
        self.rnn = cls(inp, hidden, batch_first=True, **kw)
        self.use, self.given_hx = tuple(use), given_hx
        n_states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        self.register_buffer("scale", torch.linspace(-1.5, 1.5, n_states * hidden).reshape(n_states, 1, hidden))
        width = {"output": hidden * (2 if self.rnn.bidirectional else 1), "h_n": n_states * hidden,
                 "c_n": n_states * hidden}
        self.head = nn.Linear(sum(width[u] for u in self.use), 3)

    def forward(self, x):
        hx = None
        if self.given_hx:
            h0 = torch.tanh(x[:, 0, :1].unsqueeze(0) * self.scale)  # (layers * dirs, B, hidden)
            hx = (h0, torch.sin(2 * h0)) if isinstance(self.rnn, nn.LSTM) else h0
        out, state = self.rnn(x, hx)
        h_n, c_n = state if isinstance(state, tuple) else (state, None)
        feats = {"output": lambda: out[:, 0] + out.mean(1),
                 "h_n": lambda: h_n.transpose(0, 1).reshape(x.shape[0], -1),
                 "c_n": lambda: c_n.transpose(0, 1).reshape(x.shape[0], -1)}
        return self.head(torch.cat([feats[u]() for u in self.use], dim=1))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _loop_reference(model, x, y, clip):
    """Clipped sum and norms by brute force: one example at a time through autograd."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(_loss(model(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        norms.append(norm)
        for t, g in zip(total, grads):
            t += g * min(1.0, clip / float(norm))
    return total, torch.stack(norms)


def _close(a, b, rtol):
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= rtol * scale, (float((a - b).abs().max()), scale)


def check_against_loop(model, x, rtol=TIGHT):
    """Engine clipped sums and norms equal the loop's (clip at the median norm, so some clip)."""
    y = torch.randint(0, 3, (x.shape[0],))
    _, norms = _loop_reference(model, x, y, 1.0)
    clip = float(norms.median())
    ref, ref_norms = _loop_reference(model, x, y, clip)
    eng = ClippingEngine(model, loss_reduction="sum", max_grad_norm=clip)
    _loss(model(x), y).backward()
    sums, norms = eng.clipped_sum(x.shape[0])
    eng.detach()
    model.zero_grad()
    _close(norms, ref_norms, rtol)
    assert len(sums) == len(ref)
    for s, r in zip(sums, ref):
        _close(s, r, rtol)


CELLS = [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {"nonlinearity": "tanh"}), (nn.RNN, {"nonlinearity": "relu"})]
CELL_IDS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


@pytest.mark.parametrize("cls, kw", CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, False), (1, True), (2, True)])
def test_rule_matches_the_loop(rule, cls, kw, layers, bidirectional):
    model = _Net(cls, num_layers=layers, bidirectional=bidirectional, **kw)
    check_against_loop(model, torch.randn(5, 6, 3))


@pytest.mark.parametrize("cls, kw", CELLS, ids=CELL_IDS)
def test_rule_without_bias_and_with_a_given_initial_state(rule, cls, kw):
    check_against_loop(_Net(cls, num_layers=2, bidirectional=True, bias=False, **kw), torch.randn(4, 5, 3))
    check_against_loop(_Net(cls, num_layers=2, bidirectional=True, given_hx=True, **kw), torch.randn(4, 5, 3))


@pytest.mark.parametrize("cls, kw", CELLS, ids=CELL_IDS)
@pytest.mark.parametrize("use", [("h_n",), ("output",)])
def test_rule_with_an_unused_output(cls, kw, use):
    check_against_loop(_Net(cls, num_layers=2, bidirectional=True, use=use, given_hx=True, **kw), torch.randn(4, 5, 3))


@pytest.mark.parametrize("use", [("c_n",), ("h_n", "c_n"), ("output", "h_n", "c_n")])
def test_lstm_cell_state_output(use):
    check_against_loop(_Net(nn.LSTM, num_layers=2, bidirectional=True, use=use, given_hx=True), torch.randn(4, 5, 3))


def test_rule_in_eval_mode_with_dropout_and_with_single_layer_dropout():
    """Eval mode applies no dropout; one layer has no inter-layer dropout even in training."""
    check_against_loop(_Net(nn.LSTM, num_layers=2, dropout=0.5).eval(), torch.randn(4, 5, 3))
    with pytest.warns(UserWarning, match="dropout"):
        model = _Net(nn.GRU, num_layers=1, dropout=0.5)
    check_against_loop(model, torch.randn(4, 5, 3))
    assert model.training


def test_rule_when_only_some_parameters_are_trained():
    model = _Net(nn.GRU, num_layers=2, bidirectional=True)
    model.rnn.weight_hh_l0.requires_grad_(False)
    model.rnn.bias_ih_l1_reverse.requires_grad_(False)
    check_against_loop(model, torch.randn(4, 5, 3))


class _Twice(nn.Module):
    """One GRU called twice (on the sequence and on it reversed): both calls add to its gradients."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        _, h1 = self.rnn(x)
        out2, _ = self.rnn(x.flip(1), h1)
        return self.head(torch.cat([h1[-1], out2.mean(1)], dim=1))


def test_a_layer_called_twice(rule, fallback_calls):
    check_against_loop(_Twice(), torch.randn(4, 5, 3))
    assert fallback_calls == []


def test_rule_in_float32():
    torch.set_default_dtype(torch.float32)
    check_against_loop(_Net(nn.LSTM, num_layers=2, bidirectional=True, given_hx=True), torch.randn(6, 7, 3), rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(range(len(CELLS))), layers=st.integers(1, 3), bidirectional=st.booleans(),
       bias=st.booleans(), given_hx=st.booleans(), b=st.integers(1, 4), t=st.integers(1, 5), inp=st.integers(1, 4),
       hidden=st.integers(1, 4), use=st.sampled_from([("output",), ("h_n",), ("c_n",), ("output", "h_n", "c_n")]))
def test_rule_hypothesis(kind, layers, bidirectional, bias, given_hx, b, t, inp, hidden, use):
    cls, kw = CELLS[kind]
    if cls is not nn.LSTM and "c_n" in use:
        use = tuple(u for u in use if u != "c_n") or ("h_n",)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _Net(cls, inp=inp, hidden=hidden, use=use, given_hx=given_hx, num_layers=layers,
                     bidirectional=bidirectional, bias=bias, **kw)
        check_against_loop(model, torch.randn(b, t, inp))
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------------------------
# The rule, not the fallback, computes these layers; what it cannot do goes to the fallback
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def fallback_calls(monkeypatch):
    """Record every call of the torch.func fallback (and still compute it)."""
    calls = []
    real = layers_mod.fallback_handler

    def spy(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(layers_mod, "fallback_handler", spy)
    return calls


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_the_rule_is_registered_and_used_not_the_fallback(cls, fallback_calls):
    assert LAYER_HANDLERS[cls] is recurrent_handler
    assert handler_for(cls(3, 4, batch_first=True)) is recurrent_handler
    check_against_loop(_Net(cls, num_layers=2, bidirectional=True, given_hx=True), torch.randn(4, 5, 3))
    assert fallback_calls == []


def test_subclasses_keep_the_fallback():
    class MyLSTM(nn.LSTM):
        pass

    assert handler_for(MyLSTM(3, 4, batch_first=True)) is layers_mod.fallback_handler


def test_projection_goes_to_the_fallback_and_stays_exact(fallback_calls):
    model = _Net(nn.LSTM, hidden=5, proj_size=2, num_layers=2, given_hx=False)
    model.head = nn.Linear(2 + 2 * 2, 3)  # output and h_n have proj_size features
    check_against_loop(model, torch.randn(4, 5, 3))
    assert fallback_calls == ["LSTM"]


def test_unbatched_input_goes_to_the_fallback_and_is_still_refused(fallback_calls):
    model = nn.Sequential()
    model.rnn = nn.GRU(3, 4, batch_first=True)
    eng = ClippingEngine(model, loss_reduction="sum", max_grad_norm=1.0)
    out, _ = model.rnn(torch.randn(5, 3))  # (T, features): no batch dimension
    out.pow(2).sum().backward()
    with pytest.raises(CorrnoiseError):
        eng.clipped_sum(5)
    assert fallback_calls == ["GRU"]
    eng.detach()


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_inter_layer_dropout_in_training_is_refused(cls, fallback_calls):
    model = nn.Sequential()
    model.rnn = cls(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    eng = ClippingEngine(model, loss_reduction="sum", max_grad_norm=1.0)
    out, _ = model.rnn(torch.randn(3, 5, 3))
    out.sum().backward()
    state = torch.get_rng_state()
    with pytest.raises(CorrnoiseError) as e:
        eng.clipped_sum(3)
    assert "'rnn'" in str(e.value) and "dropout" in str(e.value) and "\n" not in str(e.value)
    assert torch.equal(torch.get_rng_state(), state)
    assert fallback_calls == [cls.__name__]
    eng.detach()


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_packed_sequences_are_still_refused(cls, fallback_calls):
    model = nn.Sequential()
    model.rnn = cls(3, 4, batch_first=True)
    eng = ClippingEngine(model, loss_reduction="sum", max_grad_norm=1.0)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 5, 3), torch.tensor([5, 4, 2]), batch_first=True)
    out, _ = model.rnn(packed)
    out.data.sum().backward()
    with pytest.raises(CorrnoiseError) as e:
        eng.clipped_sum(3)
    assert "PackedSequence" in str(e.value) and "\n" not in str(e.value)
    assert fallback_calls == [cls.__name__]
    eng.detach()


def test_which_calls_the_rule_takes():
    """rule_applies, call by call: what the rule computes and what it hands to the fallback."""
    x, h0 = torch.randn(2, 3, 3), torch.zeros(1, 2, 4)
    lstm, gru = nn.LSTM(3, 4, batch_first=True), nn.GRU(3, 4, batch_first=True)
    three, two = [torch.ones(2, 3, 4), None, None], [torch.ones(2, 3, 4), None]
    assert rule_applies(lstm, (x,), {}, three) and rule_applies(lstm, (x, (h0, h0)), {}, three)
    assert rule_applies(lstm, (), {"input": x, "hx": (h0, h0)}, three)
    assert rule_applies(gru, (x, h0), {}, two) and rule_applies(gru, (x,), {"hx": h0}, two)
    assert not rule_applies(lstm, (x[0],), {}, three)  # unbatched
    assert not rule_applies(lstm, (x, h0), {}, three)  # an LSTM's hx is a pair
    assert not rule_applies(gru, (x, h0[0]), {}, two)  # unbatched hx
    assert not rule_applies(gru, (x,), {}, three)  # not one grad output per output
    assert not rule_applies(nn.GRU(3, 4), (x,), {}, two)  # batch_first=False
    assert not rule_applies(nn.LSTM(3, 4, proj_size=2, batch_first=True), (x,), {}, three)
    two_layers = nn.GRU(3, 4, num_layers=2, dropout=0.3, batch_first=True)
    assert not rule_applies(two_layers, (x,), {}, two) and rule_applies(two_layers.eval(), (x,), {}, two)
    normed = nn.utils.parametrizations.weight_norm(nn.GRU(3, 4, batch_first=True), "weight_hh_l0")
    assert not rule_applies(normed, (x,), {}, two)  # a parametrized GRU is a subclass of nn.GRU
    frozen = nn.GRU(3, 4, batch_first=True)
    w = frozen.weight_hh_l0.detach().clone()
    del frozen.weight_hh_l0
    frozen.register_buffer("weight_hh_l0", w)
    assert not rule_applies(frozen, (x,), {}, two)  # weight_hh_l0 is no longer a parameter


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_batch_first_false_is_still_refused_at_attach(cls):
    with pytest.raises(CorrnoiseError, match="batch_first=True"):
        ClippingEngine(nn.Sequential(cls(3, 4)))


def test_the_rule_computes_in_the_dtype_it_is_given():
    """A float32 layer's contributions computed in float64 equal those of its float64 copy."""
    torch.set_default_dtype(torch.float32)
    gru = nn.GRU(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    x, h0 = torch.randn(2, 5, 3), torch.randn(4, 2, 4)
    grads = [torch.randn(2, 5, 8), torch.randn(4, 2, 4)]
    low = recurrent_handler(gru, (x, h0), {}, grads, torch.float64)
    high = recurrent_handler(gru.double(), (x.double(), h0.double()), {}, [g.double() for g in grads], torch.float64)
    assert low.keys() == high.keys() and len(low) == 16
    for name in low:
        for a, b in zip(low[name], high[name]):
            for ta, tb in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert ta.dtype == torch.float64
                _close(ta, tb, 1e-12)
