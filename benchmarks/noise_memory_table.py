"""The README's noise-memory table (issue #27 item 5): noise state per mechanism family for GPT-2
small, full fine-tuning and LoRA r = 8, computed by :func:`corrnoise.noise_memory.noise_state_bytes`.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/noise_memory_table.py  (prints a markdown table)
"""

from __future__ import annotations

from corrnoise.noise_memory import format_size, noise_state_bytes, noise_state_vectors
from corrnoise.strategies import BLT, DPCGD, BandedInverseSqrt, BandedSqrt, Identity, OnlineTree

#: GPT-2 small (HF ``gpt2``): 124,439,808 parameters, all trainable in full fine-tuning
GPT2_SMALL = 124_439_808
#: the run the tree:ls row is for (its state grows with log2 n); the other rows do not depend on n
STEPS = 2000


def lora_trainable(layers: int = 12, d_in: int = 768, d_out: int = 2304, rank: int = 8) -> int:
    """Trainable parameters of LoRA rank ``rank`` on one linear map per layer: A (rank x d_in) and
    B (d_out x rank), no bias. GPT-2 small's attention ``c_attn`` (768 -> 3 x 768) in its 12
    blocks is the only target; the base model is frozen."""
    return layers * rank * (d_in + d_out)


def mechanisms(n: int = STEPS):
    """(row label, strategy, noise method): one row per family. A BLT's state depends on its
    number of buffers d only, so any d = 4 parameters stand for the planner's blt:4."""
    blt4 = BLT([0.4, 0.2, 0.1, 0.05], [0.99, 0.9, 0.7, 0.3], n)
    return [
        ("DP-SGD (identity)", Identity(n), "auto"),
        ("bsr:64 (banded, buffered)", BandedSqrt(n, 64), "auto"),
        ("bsr:64, regenerated", BandedSqrt(n, 64), "regenerate"),
        ("BLT d=4, buffered", blt4, "auto"),
        ("BLT d=4, regenerated", blt4, "regenerate"),
        ("DP-CGD (dpcgd:0.9)", DPCGD(0.9, n), "auto"),
        ("BISR (bisr:64)", BandedInverseSqrt(n, 64), "auto"),
        ("tree (plain)", OnlineTree(n), "auto"),
        (f"tree:ls (n = {n})", OnlineTree(n, "ls"), "auto"),
    ]


def table() -> str:
    lora = lora_trainable()
    lines = [f"| mechanism | noise vectors kept | GPT-2 small, full ({GPT2_SMALL:,} float32) | "
             f"GPT-2 small, LoRA r=8 on c_attn ({lora:,} float32) |", "|---|---:|---:|---:|"]
    for label, strategy, method in mechanisms():
        vectors = noise_state_vectors(strategy, method)
        full = noise_state_bytes(strategy, GPT2_SMALL, "float32", method)
        small = noise_state_bytes(strategy, lora, "float32", method)
        lines.append(f"| {label} | {vectors} | {format_size(full)} | {format_size(small)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
