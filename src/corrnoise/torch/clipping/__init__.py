"""Per-example clipping without per-example gradients (ghost norm + book-keeping).

:class:`ClippingEngine` (engine.py) hooks a model, and after the user's one ``loss.backward()``
returns the clipped per-example gradient sum and per-example norms. Per-layer rules are in
layers.py (extend with :func:`register_layer`), the rule for nn.LSTM / nn.GRU / nn.RNN in
recurrent.py, the formulas in formulas.py.
"""

from .attribution import check_attribution
from .engine import OPAQUE_TYPES, ClippingEngine
from .layers import LAYER_HANDLERS, is_conv1d_like, register_layer
from .recurrent import recurrent_handler  # registers the nn.LSTM / nn.GRU / nn.RNN rule

__all__ = ["ClippingEngine", "check_attribution", "LAYER_HANDLERS", "OPAQUE_TYPES", "is_conv1d_like",
           "recurrent_handler", "register_layer"]
