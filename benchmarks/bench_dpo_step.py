"""Seconds per DPO step: trl's DPOTrainer against PrivateDPOTrainer, in one process.

    PYTHONPATH=src python benchmarks/bench_dpo_step.py [--pairs 16] [--prompt 32] [--completion 32]
        [--reps 20] [--threads 1] [--lora]

GPT-2 from bench_hf_step's config (2 layers, width 128, vocabulary 500, dropout 0, random init), its
copy as the reference model (``--lora``: LoRA r = 8 on c_attn, the reference the same model with the
adapter off, as trl does). A batch of ``--pairs`` preference pairs, each a prompt of ``--prompt``
tokens and two completions of ``--completion`` tokens (2 x pairs rows of prompt + completion tokens,
the shape bench_hf_step's default batch has at 16 pairs), random tokens, as trl's collator makes
them. Gradient checkpointing off for both (DPOConfig turns it on by default).

Methods: ``trl`` (trl's own loss on its [chosen; rejected] rows: the policy's and the reference's
log-probabilities through its fused LM head, the sigmoid DPO loss, backward, SGD step) and
``private`` (PrivateDPOTrainer's: the reference's log-probabilities as trl computes them, the
policy's from its logits on the rows pair-major, each pair's loss clipped as one gradient, bsr:4
noise with noise multiplier 1, SGD step). Medians of ``reps`` steps, interleaved in rounds
(``bench_step.time_interleaved``), after the private method's one-time attribution check. The loss
column is each method's last-step loss on the same batch (both start from the same policy).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf_step  # noqa: E402
from bench_step import time_interleaved  # noqa: E402

warnings.filterwarnings("ignore")


def _parts(pairs: int, prompt: int, completion: int, lora: bool, out: str):
    import datasets
    import tokenizers
    import transformers
    import trl

    vocab = bench_hf_step.RUN["vocab"]
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)},
                                                                          unk_token="t1")),
        pad_token="t0", eos_token="t0")
    tokenizer.backend_tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    g = torch.Generator().manual_seed(0)

    def words(n):  # n - 1 for a completion: trl appends the EOS token
        return " ".join(f"t{int(i)}" for i in torch.randint(2, vocab, (n,), generator=g))

    data = datasets.Dataset.from_dict({"prompt": [words(prompt) + " " for _ in range(4 * pairs)],
                                       "chosen": [words(completion - 1) for _ in range(4 * pairs)],
                                       "rejected": [words(completion - 1) for _ in range(4 * pairs)]})
    config = trl.DPOConfig(output_dir=out, per_device_train_batch_size=pairs, max_steps=1000, learning_rate=0.01,
                           optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                           disable_tqdm=True, max_length=None, **{_checkpointing_switch(): False})
    policy = bench_hf_step.make_model("gpt2", lora)
    reference = None if lora else copy.deepcopy(policy)
    return data, tokenizer, config, policy, reference


def _checkpointing_switch() -> str:
    """DPOConfig's checkpointing switch (transformers 5.x: activation_checkpointing)."""
    import inspect

    import transformers

    params = inspect.signature(transformers.TrainingArguments).parameters
    return "activation_checkpointing" if "activation_checkpointing" in params else "gradient_checkpointing"


def make_steps(pairs: int, prompt: int, completion: int, lora: bool, out: str) -> dict:
    import trl

    from corrnoise.integrations import PrivateDPOTrainer
    from corrnoise.integrations.trl import _PairRows

    data, tokenizer, config, policy, reference = _parts(pairs, prompt, completion, lora, out)
    plain = trl.DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=data,
                           processing_class=tokenizer)
    rows = next(iter(plain.get_train_dataloader()))
    opt = torch.optim.SGD([p for p in plain.model.parameters() if p.requires_grad], lr=0.01)

    def trl_step():
        opt.zero_grad(set_to_none=True)
        trl_step.loss = plain.compute_loss(plain.model, rows)
        trl_step.loss.backward()
        opt.step()

    data, tokenizer, config, policy, reference = _parts(pairs, prompt, completion, lora, out)
    private = PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=data,
                                processing_class=tokenizer,
                                privacy=dict(mechanism="bsr:4", batching="cyclic", noise_multiplier=1.0, delta=1e-5,
                                             max_grad_norm=1.0, noise_seed=0))
    private.create_optimizer()
    dp = private.private_optimizer
    pair_batch = _PairRows(lambda _: {k: v.clone() for k, v in rows.items()})([None] * pairs)
    model = private.model
    dp.check_attribution(lambda b: private._example_losses(model, b)[0], pair_batch)

    def private_step():
        dp.context.current_step, dp.context.size = dp.steps_taken, pairs
        private_step.loss = private._example_losses(model, pair_batch)[0].mean()
        private_step.loss.backward()
        dp.step()
        dp.zero_grad(set_to_none=True)

    return {"trl": trl_step, "private": private_step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args()
    for name in ("pairs", "prompt", "completion", "reps", "threads"):
        if getattr(args, name) < 1 or (name == "completion" and args.completion < 2):
            raise SystemExit(f"--{name} is too small: {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    bench_hf_step.RUN["seq"] = args.prompt + args.completion
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}", flush=True)
    with tempfile.TemporaryDirectory() as out:
        steps = make_steps(args.pairs, args.prompt, args.completion, args.lora, out)
        times = time_interleaved(steps, args.reps)
    print("uptime:", os.popen("uptime").read().strip())
    what = "LoRA r=8" if args.lora else "full"
    print(f"\n| GPT-2 w128, {what}, {args.pairs} pairs x ({args.prompt} + {args.completion}) | ms/step (median) | "
          "x trl's step | min ms | last loss |")
    print("|---|---:|---:|---:|---:|")
    for m, (t, tmin) in times.items():
        print(f"| {m} | {t * 1e3:.1f} | {t / times['trl'][0]:.2f} | {tmin * 1e3:.1f} | "
              f"{float(steps[m].loss.detach()):.4f} |")


if __name__ == "__main__":
    main()
