"""Cost of the clipping engine on layers without a generic rule: one backward + clipped_sum vs a
plain forward+backward. MultiheadAttention goes through the torch.func fallback; LSTM/GRU through
their own rule (clipping/recurrent.py) and, for comparison, through the fallback they used before
that rule existed (one vjp per example; ``--no-fallback`` skips these slow rows).

    PYTHONPATH=src python benchmarks/bench_fallback.py [--reps 10] [--threads 2] [--no-fallback]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch
from torch import nn

from corrnoise.torch.clipping import LAYER_HANDLERS, ClippingEngine

_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


class _Recurrent(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(100, 32), cls(32, 64, batch_first=True), nn.Linear(64, 2)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))
        return self.head(out[:, -1])


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.att, self.head = nn.Embedding(100, 64), nn.MultiheadAttention(64, 4, batch_first=True), nn.Linear(64, 2)

    def forward(self, x):
        h = self.emb(x)
        out, _ = self.att(h, h, h)
        return self.head(out.mean(1))


@contextlib.contextmanager
def _without_recurrent_rule(active: bool):
    """While active, engines built see no rule for LSTM/GRU/RNN (they get the torch.func fallback)."""
    saved = {c: LAYER_HANDLERS.pop(c) for c in _RECURRENT if active and c in LAYER_HANDLERS}
    try:
        yield
    finally:
        LAYER_HANDLERS.update(saved)


def _median_ms(model, x, y, private: bool, reps: int, fallback: bool = False) -> tuple[float, float]:
    """Median and minimum ms of one training step (forward, backward, clipped_sum when private)."""
    with _without_recurrent_rule(fallback):
        engine = ClippingEngine(model, max_grad_norm=1.0) if private else None
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        if engine is not None:
            engine.clipped_sum(x.shape[0])
            engine.clear()
        model.zero_grad()
        times.append(time.perf_counter() - t0)
    if engine is not None:
        engine.detach()
    times = sorted(times[2:])
    return 1e3 * times[len(times) // 2], 1e3 * times[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fallback", action="store_true", help="skip LSTM/GRU through the fallback (slow)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randint(0, 100, (64, 20)), torch.randint(0, 2, (64,))
    print("| model (batch 64 x 20 tokens) | path | plain ms median (min) | clipped ms median (min) | x plain (median / min) |")
    print("|---|---|---:|---:|---:|")
    cases = [("LSTM 32->64", lambda: _Recurrent(nn.LSTM), "rule"), ("LSTM 32->64", lambda: _Recurrent(nn.LSTM), "fallback"),
             ("GRU 32->64", lambda: _Recurrent(nn.GRU), "rule"), ("GRU 32->64", lambda: _Recurrent(nn.GRU), "fallback"),
             ("MultiheadAttention 64, 4 heads", _Attention, "fallback")]
    for name, build, path in cases:
        if args.no_fallback and path == "fallback" and "Attention" not in name:
            continue
        plain = _median_ms(build(), x, y, False, args.reps)
        clipped = _median_ms(build(), x, y, True, args.reps, fallback=path == "fallback")
        print(f"| {name} | {path} | {plain[0]:.1f} ({plain[1]:.1f}) | {clipped[0]:.1f} ({clipped[1]:.1f}) | "
              f"{clipped[0] / plain[0]:.1f} / {clipped[1] / plain[1]:.1f} |")


if __name__ == "__main__":
    main()
