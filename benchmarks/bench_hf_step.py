"""Seconds per step of Hugging Face models: a plain step vs make_private's, full fine-tuning and LoRA.

    PYTHONPATH=src python benchmarks/bench_hf_step.py [--reps 20] [--models gpt2,bert] [--batch 32] [--seq 64]
        [--width 128] [--layers 2] [--bert-ffn 2]

GPT2LMHeadModel and BertForSequenceClassification built from configs (2 layers, width 128, 2 heads,
BERT's intermediate size 2x the width unless ``--bert-ffn``,
vocabulary 500, dropout 0, random init: nothing is downloaded), float32, torch.set_num_threads(2)
(``--threads``). Batches as a tokenizer makes them (input_ids, attention_mask, labels; BERT also
token_type_ids), fed as ``model(**batch)``. Loss: GPT-2, each sequence's next-token cross entropy
averaged over its own tokens, then over the batch (the per-example loss make_private needs; HF's
built-in LM loss averages over the batch's tokens, see tests/test_transformers_models.py); BERT,
its built-in classification loss (a mean of per-example losses). The same loss in the plain step.

Methods: ``plain`` (forward, backward, SGD step), ``private`` (make_private, mechanism bsr:4,
cyclic batching, noise_multiplier 1: hooks, clipped sum by ghost norm + book-keeping, the
mechanism's correlated noise, SGD step), and the same two on a LoRA model (peft, r = 8 on the
attention projections: GPT-2's c_attn, BERT's query/key/value; BERT's classifier head trains too,
peft's SEQ_CLS default). Medians of ``reps`` steps after warmup, the methods interleaved in rounds
(``bench_step.time_interleaved``) so that load from other processes hits all of them alike; the
``uptime`` load before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import time_interleaved  # noqa: E402

warnings.filterwarnings("ignore")
SIGMA, CLIP, VOCAB = 1.0, 1.0, 500
METHODS = ["plain", "private", "lora_plain", "lora_private"]


#: model size (``--width``, ``--layers``, ``--bert-ffn``: BERT's intermediate size as a multiple of
#: the width; 2 in the tables of RESULTS.md, 4 in BERT's published configs; GPT-2's is 4): the
#: defaults are the configs of the tables in RESULTS.md
SIZE = {"width": 128, "layers": 2, "bert_ffn": 2}


def make_model(name: str, lora: bool):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        w, n = SIZE["width"], SIZE["layers"]
        cfg = transformers.GPT2Config(n_layer=n, n_embd=w, n_head=max(2, w // 64), vocab_size=VOCAB, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bert":
        w, n = SIZE["width"], SIZE["layers"]
        cfg = transformers.BertConfig(num_hidden_layers=n, hidden_size=w, num_attention_heads=max(2, w // 64),
                                      intermediate_size=SIZE["bert_ffn"] * w,
                                      vocab_size=VOCAB, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=3)
        model = transformers.BertForSequenceClassification(cfg)
    else:
        raise SystemExit(f"unknown model {name}")
    if lora:
        import peft
        if name == "gpt2":
            config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["c_attn"], fan_in_fan_out=True)
        else:
            config = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["query", "key", "value"])
        model = peft.get_peft_model(model, config)
    return model


def make_batch(name: str, b: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (b, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "gpt2":
        batch["labels"] = ids.clone()
    else:
        batch["token_type_ids"] = torch.zeros_like(ids)
        batch["labels"] = torch.randint(0, 3, (b,), generator=g)
    return batch


def loss_fn(name: str):
    if name == "gpt2":
        def lm(model, batch):
            logits, labels = model(**batch).logits, batch["labels"]
            tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
            return (tokens.sum(1) / (labels[:, 1:] != -100).sum(1)).mean()
        return lm
    return lambda model, batch: model(**batch).loss


def make_step(name: str, method: str, b: int, seq: int):
    model = make_model(name, lora=method.startswith("lora"))
    batch, loss = make_batch(name, b, seq), loss_fn(name)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if not method.endswith("private"):
        def step():
            opt.zero_grad(set_to_none=True)
            loss(model, batch).backward()
            opt.step()
        return step

    from corrnoise.torch import make_private

    data = [{k: v[i % b] for k, v in batch.items()} for i in range(4 * b)]  # sizes the sampler only
    loader = torch.utils.data.DataLoader(data, batch_size=b)
    model, dp_opt, _ = make_private(model, opt, loader, mechanism="bsr:4", noise_multiplier=SIGMA, delta=1e-5,
                                    steps=1000, max_grad_norm=CLIP, batching="cyclic", noise_seed=0)

    def step():
        # the batch the private loader would yield for this step (fetching excluded, as for plain)
        dp_opt.context.current_step, dp_opt.context.size = dp_opt.steps_taken, b
        loss(model, batch).backward()
        dp_opt.step()
        dp_opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=SIZE["width"], help="hidden size (heads: width // 64, at least 2)")
    ap.add_argument("--layers", type=int, default=SIZE["layers"])
    ap.add_argument("--bert-ffn", type=int, default=SIZE["bert_ffn"],
                    help="BERT's intermediate size / width (4 in BERT's own configs)")
    args = ap.parse_args()
    if args.bert_ffn < 1:
        raise SystemExit(f"--bert-ffn must be >= 1, got {args.bert_ffn}")
    SIZE.update(width=args.width, layers=args.layers, bert_ffn=args.bert_ffn)
    torch.set_num_threads(args.threads)
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}", flush=True)
    rows = []
    for name in args.models.split(","):
        methods = args.methods.split(",")
        steps = {m: make_step(name, m, args.batch, args.seq) for m in methods}
        times = time_interleaved(steps, args.reps, rounds=args.rounds)
        for m in methods:
            t, tmin = times[m]
            rows.append({"model": name, "method": m, "s": t, "min": tmin})
            print(f"  {name:5s} {m:13s} {t * 1e3:8.1f} ms (min {tmin * 1e3:.1f})", flush=True)
        del steps
    print("uptime:", os.popen("uptime").read().strip())
    print()
    print(f"| model (batch {args.batch}, seq {args.seq}) | method | ms/step (median) | x its plain step | min ms | min x plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        base = next(q for q in rows if q["model"] == r["model"]
                    and q["method"] == ("lora_plain" if r["method"].startswith("lora") else "plain"))
        print(f"| {r['model']} | {r['method']} | {r['s'] * 1e3:.1f} | {r['s'] / base['s']:.2f} | "
              f"{r['min'] * 1e3:.1f} | {r['min'] / base['min']:.2f} |")


if __name__ == "__main__":
    main()
