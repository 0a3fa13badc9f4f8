"""Seconds per step of Hugging Face models: a plain step vs make_private's, full fine-tuning and LoRA.

    PYTHONPATH=src python benchmarks/bench_hf_step.py [--reps 20] [--models gpt2,bert,llama,opt] [--batch 32] [--seq 64]
        [--width 128] [--layers 2] [--bert-ffn 2] [--vocab 500] [--device cpu] [--methods ...,opacus_ghost]

GPT-2 small on a GPU against Opacus's ghost clipping (issue #27; 124M parameters with an untied head, see
below; benchmarks/gpu_run.sh runs this and a batch 8 x 512 tokens):

    PYTHONPATH=src python benchmarks/bench_hf_step.py --device cuda --models gpt2 --width 768 --layers 12 \
        --vocab 50257 --batch 16 --seq 128 --reps 10 --rounds 2 \
        --methods plain,private,opacus_ghost,lora_plain,lora_private,lora_opacus_ghost

GPT2LMHeadModel and BertForSequenceClassification built from configs (2 layers, width 128, 2 heads,
BERT's intermediate size 2x the width unless ``--bert-ffn``,
vocabulary 500, dropout 0, random init: nothing is downloaded), float32, torch.set_num_threads(2)
(``--threads``). Batches as a tokenizer makes them (input_ids, attention_mask, labels; BERT also
token_type_ids), fed as ``model(**batch)``. Loss: GPT-2, each sequence's next-token cross entropy
averaged over its own tokens, then over the batch (the per-example loss make_private needs; HF's
built-in LM loss averages over the batch's tokens, see tests/test_transformers_models.py); BERT,
its built-in classification loss (a mean of per-example losses). The same loss in the plain step.
``opt`` (not in the default ``--models``): OPTForCausalLM of the same width and depth, its
feed-forward 4x the width, whose decoder layers call their MLP on the batch flattened to (B*T, d)
(the engine clips those rows once the attribution check verified them); LoRA on q/k/v, fc1 and fc2.
``llama`` (not in the default ``--models``): LlamaForCausalLM of the same width and depth, the
family most fine-tuning uses today (Llama, Qwen2, Mistral): RMSNorm (transformers' own class, taken
by the engine's torch.func fallback), rotary positions, grouped-query attention (half as many
key/value heads), a gated MLP 3x the width, an untied head; GPT-2's loss.
``mixtral`` (not in the default ``--models``): MixtralForCausalLM of the same width and depth, 4
experts of 2x the width each, top 2 (transformers' default grouped expert product), the routers and
experts trained (the attribution check verifies their flattened rows first); LoRA on the four
attention projections; GPT-2's loss.

Methods: ``plain`` (forward, backward, SGD step), ``private`` (make_private, mechanism bsr:4,
cyclic batching, noise_multiplier 1: hooks, clipped sum by ghost norm + book-keeping, the
mechanism's correlated noise, SGD step), and the same two on a LoRA model (peft, r = 8 on the
attention projections: GPT-2's c_attn, BERT's query/key/value; BERT's classifier head trains too,
peft's SEQ_CLS default; Llama's every projection, attention's and the MLP's). Medians of ``reps`` steps after warmup, the methods interleaved in rounds
(``bench_step.time_interleaved``) so that load from other processes hits all of them alike; the
``uptime`` load before and after. ``last loss``: each method's training loss at its last step; every
step trains on the same batch, and every method takes the same number of steps, so the losses show
that each method trains (the private ones with their noise, sigma = 1). Before timing, each private
method runs ``DPOptimizer.check_attribution`` on the batch once (what PrivateTrainer does on its
first batch); a second table gives its time against the plain step and its worst difference.

``opacus_ghost`` (GPT-2 only): Opacus's ghost clipping (``grad_sample_mode="ghost"``, same noise
multiplier and clip norm, fixed batches) on the same model, the same per-sequence loss;
``lora_opacus_ghost`` the same on the LoRA model (its ratio is to ``lora_plain``). Opacus 1.6.0
refuses GPT2LMHeadModel as it is: tied input and output embeddings ("Parameter tying is not
supported with Ghost Clipping"), and transformers' (1, L) position ids (its embedding rule stacks
per-example tensors of batch size 1 and B; an expanded (B, L) view fails in its norm rule). With
an Opacus method among the methods every GPT-2 model of the run is therefore built with an untied head
and fed contiguous (B, L) ``position_ids``, so that all methods train the same model.

``--device cuda``: everything on the GPU; each timed step ends with a synchronize, and the table gains,
per method, the memory its model, optimizer and private state keep (``resident``) and the peak its
step adds on top (``step peak``), from ``torch.cuda.memory_allocated`` / ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import time_interleaved  # noqa: E402

warnings.filterwarnings("ignore")
SIGMA, CLIP, VOCAB = 1.0, 1.0, 500
METHODS = ["plain", "private", "lora_plain", "lora_private"]
#: Opacus's ghost clipping on the full model and on the LoRA model (GPT-2 only; see above)
OPACUS = ["opacus_ghost", "lora_opacus_ghost"]


#: model size (``--width``, ``--layers``, ``--bert-ffn``: BERT's intermediate size as a multiple of
#: the width; 2 in the tables of RESULTS.md, 4 in BERT's published configs; GPT-2's is 4): the
#: defaults are the configs of the tables in RESULTS.md
SIZE = {"width": 128, "layers": 2, "bert_ffn": 2}
#: the Llama-style model's gated MLP width as a multiple of its width (Llama's own is ~2.7x)
LLAMA_FFN = 3
#: the run's settings beyond the model size: vocabulary, device, and whether GPT-2 is built for Opacus
#: (untied head, explicit position ids: see the module docstring)
RUN = {"vocab": VOCAB, "device": "cpu", "opacus": False, "seq": 0}
#: (model, method) -> (seconds, worst difference / tolerance) of the private methods' one attribution check
CHECKS: dict[tuple[str, str], tuple[float, float]] = {}


def make_model(name: str, lora: bool):
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        w, n = SIZE["width"], SIZE["layers"]
        cfg = transformers.GPT2Config(n_layer=n, n_embd=w, n_head=max(2, w // 64), vocab_size=RUN["vocab"],
                                      n_positions=max(128, RUN["seq"]), resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=not RUN["opacus"])
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bert":
        w, n = SIZE["width"], SIZE["layers"]
        cfg = transformers.BertConfig(num_hidden_layers=n, hidden_size=w, num_attention_heads=max(2, w // 64),
                                      intermediate_size=SIZE["bert_ffn"] * w,
                                      vocab_size=RUN["vocab"], max_position_embeddings=max(128, RUN["seq"]),
                                      hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=3)
        model = transformers.BertForSequenceClassification(cfg)
    elif name == "opt":
        w, n = SIZE["width"], SIZE["layers"]
        cfg = transformers.OPTConfig(num_hidden_layers=n, hidden_size=w, ffn_dim=4 * w,
                                     num_attention_heads=max(2, w // 64), vocab_size=RUN["vocab"],
                                     max_position_embeddings=max(128, RUN["seq"]), word_embed_proj_dim=w,
                                     dropout=0.0, attention_dropout=0.0, pad_token_id=0)
        model = transformers.OPTForCausalLM(cfg)
    elif name == "mixtral":
        w, n = SIZE["width"], SIZE["layers"]
        heads = max(2, w // 64)
        cfg = transformers.MixtralConfig(num_hidden_layers=n, hidden_size=w, num_attention_heads=heads,
                                         num_key_value_heads=max(1, heads // 2), intermediate_size=2 * w,
                                         num_local_experts=4, num_experts_per_tok=2, vocab_size=RUN["vocab"],
                                         max_position_embeddings=max(128, RUN["seq"]), bos_token_id=0,
                                         eos_token_id=0, pad_token_id=0)
        model = transformers.MixtralForCausalLM(cfg)
    elif name == "llama":
        w, n = SIZE["width"], SIZE["layers"]
        heads = max(2, w // 64)
        cfg = transformers.LlamaConfig(num_hidden_layers=n, hidden_size=w, num_attention_heads=heads,
                                       num_key_value_heads=max(1, heads // 2), intermediate_size=LLAMA_FFN * w,
                                       vocab_size=RUN["vocab"], max_position_embeddings=max(128, RUN["seq"]),
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model {name} (gpt2, bert, llama, opt or mixtral)")
    if lora:
        import peft
        if name == "gpt2":
            config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["c_attn"], fan_in_fan_out=True)
        elif name == "llama":
            config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
        elif name == "opt":
            config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["q_proj", "k_proj", "v_proj", "fc1", "fc2"])
        elif name == "mixtral":
            config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        else:
            config = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=8, lora_alpha=16, lora_dropout=0.0,
                                     target_modules=["query", "key", "value"])
        model = peft.get_peft_model(model, config)
    return model.to(RUN["device"])


def make_batch(name: str, b: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, RUN["vocab"], (b, seq), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name in ("gpt2", "llama", "opt", "mixtral"):
        batch["labels"] = ids.clone()
        if RUN["opacus"] and name == "gpt2":
            batch["position_ids"] = torch.arange(seq).repeat(b, 1)
    else:
        batch["token_type_ids"] = torch.zeros_like(ids)
        batch["labels"] = torch.randint(0, 3, (b,), generator=g)
    return {k: v.to(RUN["device"]) for k, v in batch.items()}


def per_example_loss_fn(name: str):
    """One loss per example, (B,): each sequence's mean next-token loss (GPT-2, Llama, OPT) or
    the classification cross entropy (BERT)."""
    if name in ("gpt2", "llama", "opt", "mixtral"):
        def lm(model, batch):
            logits, labels = model(**batch).logits, batch["labels"]
            tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
            return tokens.sum(1) / (labels[:, 1:] != -100).sum(1)
        return lm
    return lambda model, batch: F.cross_entropy(model(**batch).logits, batch["labels"], reduction="none")


def loss_fn(name: str):
    if name in ("gpt2", "llama", "opt", "mixtral"):
        per = per_example_loss_fn(name)
        return lambda model, batch: per(model, batch).mean()
    return lambda model, batch: model(**batch).loss


class _Logits(torch.nn.Module):
    """GPT-2 called positionally, logits out: what Opacus's make_private wraps."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


class _SequenceLoss(torch.nn.Module):
    """Each sequence's mean next-token loss, then the batch mean (``reduction`` "none": per sequence),
    as :func:`loss_fn`'s for GPT-2; Opacus's ghost clipping sets ``reduction`` to get per-example losses."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, logits, labels):
        tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
        per = tokens.sum(1) / (labels[:, 1:] != -100).sum(1)
        return per.mean() if self.reduction == "mean" else per


def make_opacus_step(model, batch, b: int):
    try:
        from opacus import PrivacyEngine
    except ImportError:
        raise SystemExit("--methods opacus_ghost needs opacus (pip install 'corrnoise[opacus]')") from None

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = batch["input_ids"].repeat(4, 1)  # the loader only sizes Opacus's sampling rate
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=b)
    m, o, crit, _ = PrivacyEngine().make_private(module=_Logits(model), optimizer=opt, data_loader=loader,
                                                 criterion=_SequenceLoss(), noise_multiplier=SIGMA, max_grad_norm=CLIP,
                                                 poisson_sampling=False, grad_sample_mode="ghost")

    def step():
        o.zero_grad(set_to_none=True)
        step.loss = crit(m(batch["input_ids"], batch["attention_mask"], batch["position_ids"]), batch["labels"])
        step.loss.backward()
        o.step()
    return step


def make_step(name: str, method: str, b: int, seq: int):
    model = make_model(name, lora=method.startswith("lora"))
    batch, loss = make_batch(name, b, seq), loss_fn(name)
    if method.endswith("opacus_ghost"):
        return make_opacus_step(model, batch, b)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if not method.endswith("private"):
        def step():
            opt.zero_grad(set_to_none=True)
            step.loss = loss(model, batch)
            step.loss.backward()
            opt.step()
        return step

    from corrnoise.torch import make_private

    data = [{k: v[i % b] for k, v in batch.items()} for i in range(4 * b)]  # sizes the sampler only
    loader = torch.utils.data.DataLoader(data, batch_size=b)
    model, dp_opt, _ = make_private(model, opt, loader, mechanism="bsr:4", noise_multiplier=SIGMA, delta=1e-5,
                                    steps=1000, max_grad_norm=CLIP, batching="cyclic", noise_seed=0)
    # the first batch's attribution check, as PrivateTrainer runs it (OPT's flattened MLP rows need it)
    per = per_example_loss_fn(name)
    start = time.perf_counter()
    report = dp_opt.check_attribution(lambda bb: per(model, bb), batch)
    CHECKS[(name, method)] = (time.perf_counter() - start, report.worst)

    def step():
        # the batch the private loader would yield for this step (fetching excluded, as for plain)
        dp_opt.context.current_step, dp_opt.context.size = dp_opt.steps_taken, b
        step.loss = loss(model, batch)
        step.loss.backward()
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
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    args = ap.parse_args()
    if args.bert_ffn < 1:
        raise SystemExit(f"--bert-ffn must be >= 1, got {args.bert_ffn}")
    if args.vocab < 2:
        raise SystemExit(f"--vocab must be >= 2, got {args.vocab}")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS + OPACUS]
    if unknown:
        raise SystemExit(f"--methods: unknown {','.join(unknown)} (known: {','.join(METHODS + OPACUS)})")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no GPU here")
    if not cuda and args.device != "cpu":
        raise SystemExit(f"--device must be cpu or cuda, got {args.device}")
    SIZE.update(width=args.width, layers=args.layers, bert_ffn=args.bert_ffn)
    RUN.update(vocab=args.vocab, device=args.device, opacus=any(m in OPACUS for m in methods), seq=args.seq)
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if cuda else f"torch threads: {args.threads}"
    print("uptime:", os.popen("uptime").read().strip(), f"| {where}", flush=True)
    rows = []
    gib = 2 ** 30
    for name in args.models.split(","):
        ms = [m for m in methods if m not in OPACUS or name == "gpt2"]  # Opacus is wired for GPT-2 only
        steps, mem, raw = {}, {}, {}
        for m in ms:
            before = torch.cuda.memory_allocated() if cuda else 0
            fn = raw[m] = make_step(name, m, args.batch, args.seq)
            if cuda:
                fn = _synchronized(fn)
                fn()  # the private state a method allocates at its first step counts as resident
                mem[m] = {"resident": (torch.cuda.memory_allocated() - before) / gib}
            steps[m] = fn
        times = time_interleaved(steps, args.reps, rounds=args.rounds)
        for m in ms:
            if cuda:  # the peak one step adds on top of what is allocated before it
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                steps[m]()
                mem[m]["peak"] = (torch.cuda.max_memory_allocated() - base) / gib
            t, tmin = times[m]
            last = float(raw[m].loss.detach())  # the training loss of its last step (the same batch each step)
            rows.append({"model": name, "method": m, "s": t, "min": tmin, "loss": last, **mem.get(m, {})})
            print(f"  {name:5s} {m:13s} {t * 1e3:8.1f} ms (min {tmin * 1e3:.1f}) loss {last:.3f}", flush=True)
        del steps
    print("uptime:", os.popen("uptime").read().strip())
    print()
    extra = " resident GiB | step peak GiB |" if cuda else ""
    print(f"| model (batch {args.batch}, seq {args.seq}) | method | ms/step (median) | x its plain step | min ms | "
          f"min x plain | last loss |{extra}")
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cuda else ""))
    for r in rows:
        base = next(q for q in rows if q["model"] == r["model"]
                    and q["method"] == ("lora_plain" if r["method"].startswith("lora") else "plain"))
        tail = f" {r['resident']:.2f} | {r['peak']:.2f} |" if cuda else ""
        print(f"| {r['model']} | {r['method']} | {r['s'] * 1e3:.1f} | {r['s'] / base['s']:.2f} | "
              f"{r['min'] * 1e3:.1f} | {r['min'] / base['min']:.2f} | {r['loss']:.3f} |{tail}")
    if CHECKS:
        print()
        print("| model | method | attribution check, once (ms) | x its plain step | worst / tolerance |")
        print("|---|---|---:|---:|---:|")
        for (name, m), (sec, worst) in CHECKS.items():
            base = next((q for q in rows if q["model"] == name
                         and q["method"] == ("lora_plain" if m.startswith("lora") else "plain")), None)
            ratio = f"{sec / base['s']:.1f}" if base else "-"
            print(f"| {name} | {m} | {sec * 1e3:.1f} | {ratio} | {worst:.1e} |")


def _synchronized(fn):
    """A GPU step that returns when its kernels have run (timings see the work, not the launch)."""
    def step():
        fn()
        torch.cuda.synchronize()
    return step


if __name__ == "__main__":
    main()
