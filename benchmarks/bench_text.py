"""Real text, offline: public pretraining on GCIDE, private fine-tuning on fortunes (issue #27 item 7).

    make data && make bench-text
    PYTHONPATH=src python benchmarks/bench_text.py [--seeds 3] [--epsilons 1,3,8] [--pipelines full,lora]
    PYTHONPATH=src python benchmarks/bench_text.py --report     # table + plot from the JSONL only
    PYTHONPATH=src python benchmarks/bench_text.py --pipelines full --runs nonprivate,auto:1,dpsgd-cyclic:8
    PYTHONPATH=src python benchmarks/bench_text.py --pipelines full --optimizer noise-aware-adamw --lr 3e-3 \
        --runs dpsgd-poisson:3,auto:3

1. Public side (not private): a byte-level BPE tokenizer (``tokenizers``) trained here on GCIDE's
   text (Debian ``dict-gcide``: Webster's 1913 dictionary; every ``--gcide-stride``-th entry up to
   ``--pretrain-chars`` characters), then a GPT-2-style LM (``GPT2Config``, random init, nothing
   downloaded) trained on it non-privately with AdamW for ``--pretrain-seconds``. Both are cached in
   ``--cache`` (keyed by their settings), so a second run skips them.
2. Private side: fortunes (Debian ``fortunes``), the ``--classes`` largest categories, a stratified
   80/20 split (seed 0), each quotation truncated to the context. ``GPT2ForSequenceClassification``
   with the pretrained transformer, fine-tuned fully or with LoRA (peft, r = 8 on ``c_attn``; the
   classification head trains too, peft's SEQ_CLS default). Loss: per-example cross entropy
   averaged over the batch (``loss_reduction="mean"``). SGD, momentum 0.9, the same learning rate
   for every private variant of a pipeline (``--lr-full`` / ``--lr-lora``; the non-private run
   ``--nonprivate-lr-scale`` times it), clip norm ``--clip``. Not tuned per variant or epsilon.
   ``--optimizer adamw`` / ``noise-aware-adamw`` (torch's AdamW / corrnoise's NoiseAwareAdamW,
   the released noise's variance taken out of the second moment; betas (0.9, 0.999), weight decay
   ``--weight-decay``, NoiseAwareAdamW's floor ``--floor-z`` / ``--variance-floor``) replaces SGD, and ``--lr``
   replaces the pipeline's learning rate; every JSONL row records ``optimizer`` (rows without it
   ran SGD) and ``lr``. The default table (``--report``) keeps SGD at the default rates; the other
   rows get their own tables (per optimizer and rate, and AdamW vs NoiseAwareAdamW paired by seed).
3. Variants, each at epsilon in ``--epsilons`` (delta ``--delta``), ``--epochs`` epochs, expected
   batch ``--batch``: ``nonprivate`` (a shuffled DataLoader, no noise, the batch gradient's
   norm clipped to ``--clip``: SGD at these rates diverged without it), ``dpsgd-poisson``
   (``make_private(mechanism="dpsgd", batching="poisson")``), ``dpsgd-cyclic`` (shuffled fixed
   batches, no amplification: ``batching="cyclic"``), ``auto`` (``mechanism="auto"``: the planner's
   pick of mechanism and batching).

Rate selection (``--split validation``): the run trains on a stratified 80% of the training split
(seed 1) and records ``validation_accuracy`` on the other 20%; the test quotations are not seen.
``--report`` then lists, per pipeline, optimizer, variant and epsilon, the rate with the best
validation accuracy and the test accuracy of the ordinary runs at that rate. (As in most published
DP benchmarks, the selection itself is not charged to the privacy budget.)

Step time: the wall time of forward + backward + optimizer step of every training step; the JSONL
keeps the median and the median per example (Poisson batches vary in size), and ``x plain`` is the
ratio to the non-private run of the same pipeline in the same process (same model, same data).
One JSON line per run is appended to ``--out``; ``--report`` writes the markdown table to stdout
and the plot to ``--plot`` from the JSONL.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("nonprivate", "dpsgd-poisson", "dpsgd-cyclic", "auto")
PRIVATE = {"dpsgd-poisson": ("dpsgd", "poisson"), "dpsgd-cyclic": ("dpsgd", "cyclic"), "auto": ("auto", "auto")}
SPECIALS = ["<|endoftext|>", "<pad>"]
OPTIMIZERS = ("sgd", "adamw", "noise-aware-adamw")
#: the learning rates of the default table (SGD): private, and non-private (a tenth)
DEFAULT_LR = {"full": 0.5, "lora": 1.0}
DEFAULT_NONPRIVATE_SCALE = 0.1
#: test accuracy of always answering the largest category (people: 250 of the 1,710 test quotations)
MAJORITY = 250 / 1710


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (each: sampler, noise, head init)")
    p.add_argument("--seed-start", type=int, default=0, help="run seeds seed-start..seeds-1 (add seeds to a file)")
    p.add_argument("--epsilons", default="1,3,8")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--pipelines", default="full,lora")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--runs", default=None,
                   help="instead of variants x epsilons: a list VARIANT[:EPSILON],... (nonprivate first, for x plain)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr-full", type=float, default=0.5)
    p.add_argument("--lr-lora", type=float, default=1.0)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd (momentum 0.9), adamw (torch.optim.AdamW) or noise-aware-adamw (corrnoise's NoiseAwareAdamW)")
    p.add_argument("--lr", type=float, default=None,
                   help="the learning rate of every pipeline (instead of --lr-full / --lr-lora; non-private: times "
                        "--nonprivate-lr-scale)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW / NoiseAwareAdamW weight decay")
    p.add_argument("--variance-floor", type=float, default=1e-10, help="NoiseAwareAdamW's variance_floor")
    p.add_argument("--floor-z", type=float, default=2.0,
                   help="NoiseAwareAdamW's floor_z (0: the fixed floor alone, as before the relative floor)")
    p.add_argument("--nonprivate-lr-scale", type=float, default=0.1,
                   help="the non-private run's learning rate is the pipeline's times this (at 1x it diverged)")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--pretrain-chars", type=int, default=4_000_000)
    p.add_argument("--gcide-stride", type=int, default=8)
    p.add_argument("--pretrain-seconds", type=float, default=150.0)
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 ran 2.3x faster than 2 on the loaded 2-core machine")
    p.add_argument("--cache", default=str(HERE.parent / "out" / "text_cache"))
    p.add_argument("--out", default=str(HERE / "text_runs.jsonl"))
    p.add_argument("--plot", default=str(HERE / "text.png"))
    p.add_argument("--report", action="store_true", help="only write the table and plot from --out")
    p.add_argument("--split", choices=("test", "validation"), default="test",
                   help="validation: train on 80%% of the training split, score on the other 20%% (rate selection)")
    return p.parse_args(argv)


# --- public side: tokenizer and pretraining ---------------------------------------------------

def cache_key(args, *names: str) -> str:
    """A short hash of the settings that determine a cached artifact."""
    blob = json.dumps({n: getattr(args, n) for n in names}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def train_tokenizer(text: str, vocab: int, cache: Path):
    """A byte-level BPE tokenizer trained on the public text (cached as vocab.json + merges.txt)."""
    from tokenizers import ByteLevelBPETokenizer

    cache.mkdir(parents=True, exist_ok=True)
    if (cache / "vocab.json").is_file():
        return ByteLevelBPETokenizer(str(cache / "vocab.json"), str(cache / "merges.txt"))
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(text.split("\n\n"), vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS)
    tok.save_model(str(cache))
    return tok


def gpt2_config(args, vocab_size: int, pad_id: int, num_labels: int | None = None):
    """The GPT-2-style config of both models (dropout 0: the clipping engine sees the same graph)."""
    import transformers

    extra = {} if num_labels is None else {"num_labels": num_labels}
    return transformers.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, n_positions=args.ctx,
                                   vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=pad_id, **extra)


def lm_chunks(tok, text: str, ctx: int):
    """The public text as one token stream (entries joined by <|endoftext|>) cut into rows of ctx."""
    import torch

    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(text.split("\n\n")):
        ids.extend(enc.ids + [eot])
    n = len(ids) // ctx
    return torch.tensor(ids[:n * ctx]).view(n, ctx)


def pretrain(args, tok, text: str, cache: Path) -> tuple[dict, dict]:
    """(transformer state dict, info): the LM trained non-privately on the public text for
    ``--pretrain-seconds`` (cached)."""
    import torch
    import transformers

    path = cache / "lm.pt"
    if path.is_file():
        saved = torch.load(path)
        return saved["state"], {**saved["info"], "cached": True}
    torch.manual_seed(0)
    cfg = gpt2_config(args, tok.get_vocab_size(), tok.token_to_id("<pad>"))
    model = transformers.GPT2LMHeadModel(cfg)
    chunks = lm_chunks(tok, text, args.ctx)
    n_val = max(64, len(chunks) // 50)
    val, train = chunks[:n_val], chunks[n_val:]
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    t0, steps, first = time.perf_counter(), 0, None
    model.train()
    while time.perf_counter() - t0 < args.pretrain_seconds:
        batch = train[torch.randint(len(train), (32,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        first = float(loss) if first is None else first
        steps += 1
    with torch.no_grad():
        model.eval()
        val_loss = statistics.mean(float(model(input_ids=val[i:i + 64], labels=val[i:i + 64]).loss)
                                   for i in range(0, len(val), 64))
    info = {"pretrain_steps": steps, "pretrain_seconds": round(time.perf_counter() - t0, 1),
            "pretrain_tokens_seen": steps * 32 * args.ctx, "pretrain_tokens": int(chunks.numel()),
            "pretrain_first_loss": round(first, 3), "pretrain_val_loss": round(val_loss, 3),
            "params_lm": sum(p.numel() for p in model.parameters())}
    state = model.transformer.state_dict()
    torch.save({"state": state, "info": info}, path)
    return state, {**info, "cached": False}


# --- private side: fortunes classification ------------------------------------------------------

class Fortunes:
    """A map-style dataset of (token ids, label) pairs: fortunes encoded and truncated to ctx."""

    def __init__(self, ids: list[list[int]], labels):
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], int(self.labels[i])


class PadCollate:
    """Right-pads a list of (ids, label) to the batch's longest sequence, tokenizer-style dict."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items):
        import torch

        longest = max((len(ids) for ids, _ in items), default=1)
        input_ids = torch.full((len(items), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), longest), dtype=torch.long)
        for row, (ids, _) in enumerate(items):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            mask[row, :len(ids)] = 1
        labels = torch.tensor([y for _, y in items], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def fortune_splits(tok, args):
    """(train Fortunes, test Fortunes, category names): stratified 80/20, seed 0."""
    from corrnoise.datasets.text import fortunes, split_indices

    texts, labels, names = fortunes(top=args.classes)
    eot = tok.token_to_id("<|endoftext|>")
    ids = [enc.ids[:args.ctx - 1] + [eot] for enc in tok.encode_batch(texts)]
    tr, te = split_indices(labels, 0.2, seed=0)
    return (Fortunes([ids[i] for i in tr], labels[tr]), Fortunes([ids[i] for i in te], labels[te]), names)


def validation_split(train: "Fortunes") -> tuple["Fortunes", "Fortunes"]:
    """(fit, validation): the training split's own stratified 80/20 split (seed 1), so that rates
    are chosen without the test split. The test quotations are never seen by a validation run."""
    from corrnoise.datasets.text import split_indices

    fit, val = split_indices(train.labels, 0.2, seed=1)
    return (Fortunes([train.ids[i] for i in fit], train.labels[fit]),
            Fortunes([train.ids[i] for i in val], train.labels[val]))


def classifier(args, tok, state: dict, num_labels: int, lora: bool, seed: int):
    """GPT2ForSequenceClassification with the pretrained transformer (head: random init from
    ``seed``), wrapped by peft LoRA (r = 8 on c_attn) when ``lora``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2ForSequenceClassification(
        gpt2_config(args, tok.get_vocab_size(), tok.token_to_id("<pad>"), num_labels))
    model.transformer.load_state_dict(state)
    if lora:
        import peft

        config = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=8, lora_alpha=16, lora_dropout=0.0,
                                 target_modules=["c_attn"], fan_in_fan_out=True)
        model = peft.get_peft_model(model, config)
    return model


def accuracy(model, data: Fortunes, collate) -> float:
    """Test accuracy (batches of 256, no gradient)."""
    import torch

    model.eval()
    loader = torch.utils.data.DataLoader(data, batch_size=256, collate_fn=collate)
    right = 0
    with torch.no_grad():
        for b in loader:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            right += int((logits.argmax(-1) == b["labels"]).sum())
    model.train()
    return right / len(data)


def privatize(variant: str, model, opt, loader, eps: float, args, seed: int):
    """make_private for the variant (``seed`` fixes sampler and noise: an experiment, not a release)."""
    from corrnoise.torch import make_private

    mechanism, batching = PRIVATE[variant]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assumes the sampler seed is secret", category=UserWarning)
        return make_private(model, opt, loader, mechanism=mechanism, batching=batching, epsilon=eps,
                            delta=args.delta, max_grad_norm=args.clip, epochs=args.epochs, seed=seed,
                            noise_seed=seed)


def train_steps(model, opt, loader, epochs: int, clip: float | None = None):
    """Run the loop; returns (seconds of each step, batch size of each step, mean training loss of
    the last epoch). ``clip``: clip the batch gradient's norm (the non-private run only)."""
    import torch
    import torch.nn.functional as F

    times, sizes, last = [], [], []
    for epoch in range(epochs):
        last = []
        for b in loader:
            t0 = time.perf_counter()
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss = F.cross_entropy(logits, b["labels"])
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            sizes.append(len(b["labels"]))
            last.append(float(loss.detach()))
    return times, sizes, statistics.mean(last) if last else float("nan")


def plan_fields(opt) -> dict:
    """What the run's plan chose (mechanism, batching, noise) and the privacy it spent."""
    plan = opt.plan
    spent = opt.privacy_spent()
    return {"mechanism": plan.label or getattr(plan.strategy, "name", str(plan.strategy)),
            "strategy": getattr(plan.strategy, "name", None), "batching": str(plan.sampler.description),
            "noise_std": plan.noise_std, "noise_multiplier": plan.noise_multiplier,
            "epsilon_spent": spent.epsilon, "accounting": spent.method}


def make_optimizer(name: str, params, lr: float, args):
    """(optimizer, settings recorded in the JSONL) for ``--optimizer``."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9), {"momentum": 0.9}
    settings = {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": args.weight_decay}
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay), settings
    if name == "noise-aware-adamw":
        from corrnoise.torch import NoiseAwareAdamW

        settings["variance_floor"] = args.variance_floor
        settings["floor_z"] = args.floor_z
        return NoiseAwareAdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay,
                               variance_floor=args.variance_floor, floor_z=args.floor_z), settings
    raise SystemExit(f"bench_text: unknown optimizer {name!r} ({', '.join(OPTIMIZERS)})")


def adam_fields(opt, steps: int) -> dict:
    """For an Adam run after training: the median over coordinates of Adam's bias-corrected second
    moment v_hat, the variance of the released noise at the last step (private runs), and for
    NoiseAwareAdamW its averaged noise variance phi_hat and the fraction of coordinates whose
    subtraction leaves nothing (``floored_fraction``: v_hat <= phi_hat, all noise as far as it can
    tell; under ``floor_z`` > 0 a few more sit at the floor)."""
    import torch

    inner = getattr(opt, "original", opt)
    if not isinstance(inner, torch.optim.AdamW) and not hasattr(inner, "observe_noise_variance"):
        return {}
    v_hat, floored, phi_hat = [], [], None
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p)
            if not state:
                continue
            k = float(state["step"])
            bc2 = 1.0 - group["betas"][1] ** k
            v = (state["exp_avg_sq"] / bc2).flatten()
            v_hat.append(v)
            if "noise_avg_sq" in state:
                phi_hat = state["noise_avg_sq"] / bc2
                floored.append(v <= phi_hat)
    if not v_hat:
        return {}
    out = {"v_hat_median": float(torch.cat(v_hat).median())}
    if hasattr(opt, "noise_variance") and steps > 0:
        out["noise_variance_last"] = opt.noise_variance(steps - 1)
    if phi_hat is not None:
        out["phi_hat"] = phi_hat
        out["floored_fraction"] = float(torch.cat(floored).float().mean())
    return out


def run_one(variant: str, pipeline: str, eps: float | None, seed: int, ctx: dict, args) -> dict:
    """One fine-tuning run; the JSONL record."""
    import torch

    train_set, test_set, names, state, tok, collate = (ctx[k] for k in
                                                        ("train", "test", "names", "state", "tok", "collate"))
    model = classifier(args, tok, state, len(names), pipeline == "lora", seed)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr if args.lr is not None else (args.lr_lora if pipeline == "lora" else args.lr_full)
    lr *= args.nonprivate_lr_scale if variant == "nonprivate" else 1.0
    opt, settings = make_optimizer(args.optimizer, params, lr, args)
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch, shuffle=True, collate_fn=collate,
                                         generator=g)
    rec = {"variant": variant, "pipeline": pipeline, "epsilon_target": eps, "seed": seed, "lr": lr,
           "optimizer": args.optimizer, "optimizer_settings": settings, "split": args.split}
    t0 = time.perf_counter()
    if variant != "nonprivate":
        model, opt, loader = privatize(variant, model, opt, loader, eps, args, seed)
    rec["seconds_planning"] = round(time.perf_counter() - t0, 2)
    epochs = int(round(args.epochs))
    times, sizes, train_loss = train_steps(model, opt, loader, epochs,
                                           clip=args.clip if variant == "nonprivate" else None)
    rec.update(steps=len(times), mean_batch=statistics.mean(sizes), train_loss_last_epoch=round(train_loss, 4),
               ms_step_median=1e3 * statistics.median(times),
               ms_per_example_median=1e3 * statistics.median(t / max(s, 1) for t, s in zip(times, sizes)),
               seconds_training=round(sum(times), 2), **{accuracy_key(args.split): accuracy(model, test_set, collate)},
               trainable_params=sum(p.numel() for p in params))
    if variant != "nonprivate":
        rec.update(plan_fields(opt))
    rec.update(adam_fields(opt, len(times)))
    return rec


def accuracy_key(split: str) -> str:
    """The record's accuracy field: ``test_accuracy``, or ``validation_accuracy`` for a run that
    trained on the fit part of the training split and was scored on its validation part."""
    return "validation_accuracy" if split == "validation" else "test_accuracy"


def add_step_ratios(records: list[dict]) -> None:
    """x plain: each run's median step (and per-example) time over the non-private run of its
    pipeline and seed in the same process."""
    plain = {(r["pipeline"], r["seed"]): r for r in records if r["variant"] == "nonprivate"}
    for r in records:
        base = plain.get((r["pipeline"], r["seed"]))
        if base:
            r["x_plain_step"] = r["ms_step_median"] / base["ms_step_median"]
            r["x_plain_per_example"] = r["ms_per_example_median"] / base["ms_per_example_median"]


# --- report ----------------------------------------------------------------------------------------

def load_records(path: str) -> list[dict]:
    """The run records of the JSONL (the header line, kind "setup", excluded)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("kind") != "setup"]


def optimizer_of(r: dict) -> str:
    """The row's optimizer (rows written before ``--optimizer`` ran SGD)."""
    return r.get("optimizer", "sgd")


def floor_of(r: dict) -> str:
    """NoiseAwareAdamW's floor as run: ``floor_z`` standard deviations of the noise-only EMA (rows
    without it ran before that floor existed: the fixed ``variance_floor`` alone)."""
    settings = r.get("optimizer_settings", {})
    fixed, z = settings.get("variance_floor", 1e-10), settings.get("floor_z", 0.0)
    return f"{z:g} sd" if z > 0 and fixed == 1e-10 else (f"{fixed:g} fixed" if z == 0 else f"{z:g} sd, {fixed:g}")


def optimizer_label(r: dict) -> str:
    """The optimizer and, for NoiseAwareAdamW, its floor."""
    name = optimizer_of(r)
    return f"{name} (floor {floor_of(r)})" if name == "noise-aware-adamw" else name


def is_default(r: dict) -> bool:
    """A row of the default table: SGD at the pipeline's default learning rate (private), a tenth
    of it (non-private)."""
    base = DEFAULT_LR.get(r["pipeline"])
    if optimizer_of(r) != "sgd" or base is None:
        return False
    want = base * (DEFAULT_NONPRIVATE_SCALE if r["variant"] == "nonprivate" else 1.0)
    return abs(r["lr"] - want) <= 1e-9 * want


def summarize(records: list[dict]) -> dict:
    """{(pipeline, variant, epsilon): (mean accuracy, min, max, n, mean x plain, mechanism set)}."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["pipeline"], r["variant"], r["epsilon_target"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        accs = [r["test_accuracy"] for r in rs]
        ratios = [r["x_plain_step"] for r in rs if "x_plain_step" in r]
        mechs = sorted({f"{r.get('mechanism', '-')} / {short_batching(r.get('batching'))}" if "mechanism" in r else "-"
                        for r in rs})
        out[key] = (statistics.mean(accs), min(accs), max(accs), len(rs),
                    statistics.mean(ratios) if ratios else float("nan"), mechs)
    return out


def short_batching(description: str) -> str:
    """``accounting spec`` of a sampler description (``poisson:0.0187``, ``none``, ...), rates rounded."""
    import re

    m = re.search(r"'accounting': '([^']*)'", description or "")
    if not m:
        return description or "-"
    return re.sub(r"\d\.\d{4,}", lambda x: f"{float(x.group()):.3g}", m.group(1))


def table(records: list[dict]) -> str:
    """The markdown table: accuracy (mean, range over seeds) and step-time ratio per run kind."""
    lines = ["| pipeline | variant | epsilon | test acc. (mean) | range | runs | x plain step | mechanism / accounting |",
             "|---|---|---:|---:|---|---:|---:|---|"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    for key in sorted(summarize(records), key=lambda k: (k[0], k[2] or 0, order.get(k[1], 9))):
        mean, lo, hi, n, ratio, mechs = summarize(records)[key]
        eps = "-" if key[2] is None else f"{key[2]:g}"
        lines.append(f"| {key[0]} | {key[1]} | {eps} | {100 * mean:.1f}% | {100 * lo:.1f}-{100 * hi:.1f} | {n} | "
                     f"{ratio:.2f} | {'; '.join(mechs)} |")
    return "\n".join(lines)


def step_table(records: list[dict]) -> str:
    """Step time per pipeline and variant (all epsilons and seeds): median ms per step, and the
    mean over runs of the ratios to the plain step of the same process (per step, per example)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["pipeline"], r["variant"]), []).append(r)
    lines = ["| pipeline | variant | runs | ms/step (median of runs) | x plain per step | x plain per example |",
             "|---|---|---:|---:|---:|---:|"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    for (pipe, variant), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9))):
        ms = statistics.median(r["ms_step_median"] for r in rs)
        xs = [r["x_plain_step"] for r in rs if "x_plain_step" in r]
        xe = [r["x_plain_per_example"] for r in rs if "x_plain_per_example" in r]
        fmt = (lambda v: f"{statistics.mean(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
        lines.append(f"| {pipe} | {variant} | {len(rs)} | {ms:.0f} | {fmt(xs)} | {fmt(xe)} |")
    return "\n".join(lines)


OPT_ORDER = {o: i for i, o in enumerate(OPTIMIZERS)}


def tuning_table(records: list[dict]) -> str:
    """The rows outside the default table: accuracy per pipeline, optimizer, learning rate, variant
    and epsilon (mean and range over seeds, the seeds)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["pipeline"], optimizer_label(r), r["lr"], r["variant"], r["epsilon_target"]), []).append(r)
    order = {v: i for i, v in enumerate(VARIANTS)}
    lines = ["| pipeline | optimizer | lr | variant | epsilon | test acc. (mean) | range | seeds | mechanism |",
             "|---|---|---:|---|---:|---:|---|---|---|"]
    for key in sorted(groups, key=lambda k: (k[0], OPT_ORDER.get(k[1].split()[0], 9), k[1], order.get(k[3], 9),
                                             k[4] or 0, k[2])):
        rs = groups[key]
        accs = [r["test_accuracy"] for r in rs]
        seeds = ",".join(str(s) for s in sorted(r["seed"] for r in rs))
        mechs = "; ".join(sorted({r.get("mechanism", "-") for r in rs}))
        eps = "-" if key[4] is None else f"{key[4]:g}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {key[3]} | {eps} | {100 * statistics.mean(accs):.1f}% | "
                     f"{100 * min(accs):.1f}-{100 * max(accs):.1f} | {seeds} | {mechs} |")
    return "\n".join(lines)


def paired_table(records: list[dict]) -> str:
    """NoiseAwareAdamW minus AdamW per (pipeline, variant, epsilon, lr, NoiseAwareAdamW's floor),
    over the seeds both ran: mean accuracies and the mean and range of the per-seed differences
    (points)."""
    adam: dict = {}
    aware: dict = {}
    for r in records:
        key = (r["pipeline"], r["variant"], r["epsilon_target"], r["lr"])
        if optimizer_of(r) == "adamw":
            adam.setdefault(key, {})[r["seed"]] = r["test_accuracy"]
        elif optimizer_of(r) == "noise-aware-adamw":
            aware.setdefault(key + (floor_of(r),), {})[r["seed"]] = r["test_accuracy"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    lines = ["| pipeline | variant | epsilon | lr | floor | seeds | AdamW | NoiseAwareAdamW | difference (points) | range |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for key in sorted(aware, key=lambda k: (k[0], order.get(k[1], 9), k[2] or 0, k[3], k[4])):
        base = adam.get(key[:4], {})
        seeds = sorted(set(base) & set(aware[key]))
        if not seeds:
            continue
        xa = [base[s] for s in seeds]
        xb = [aware[key][s] for s in seeds]
        diff = [100 * (y - x) for x, y in zip(xa, xb)]
        eps = "-" if key[2] is None else f"{key[2]:g}"
        lines.append(f"| {key[0]} | {key[1]} | {eps} | {key[3]:g} | {key[4]} | {','.join(map(str, seeds))} | "
                     f"{100 * statistics.mean(xa):.1f}% | {100 * statistics.mean(xb):.1f}% | "
                     f"{statistics.mean(diff):+.1f} | {min(diff):+.1f} to {max(diff):+.1f} |")
    return "\n".join(lines)


def is_validation(r: dict) -> bool:
    """A rate-selection row (``--split validation``); rows without ``split`` were scored on test."""
    return r.get("split", "test") == "validation"


def selection_table(records: list[dict]) -> str:
    """Rates chosen on the validation split, then scored on test: per pipeline, optimizer, variant
    and epsilon, the validation accuracy of each rate tried (mean over its validation seeds), the
    rate with the best one, and the test accuracy of the test-split runs at that rate (mean,
    range, seeds; "-" until they have run). A seed run again at the same rate counts once, by its
    latest record (records are in the order they were run), so that repeating a seed does not
    weigh it twice."""
    val: dict = {}
    latest: dict = {}
    for r in records:
        key = (r["pipeline"], optimizer_label(r), r["variant"], r["epsilon_target"])
        if is_validation(r):
            val.setdefault(key, {}).setdefault(r["lr"], []).append(r["validation_accuracy"])
        else:
            latest[key + (r["lr"], r["seed"])] = r
    test: dict = {}
    for k, r in latest.items():
        test.setdefault(k[:-1], []).append(r)
    order = {v: i for i, v in enumerate(VARIANTS)}
    lines = ["| pipeline | optimizer | variant | epsilon | validation acc. per lr | chosen lr | test acc. (mean) | "
             "range | seeds |", "|---|---|---|---:|---|---:|---:|---|---|"]
    for key in sorted(val, key=lambda k: (k[0], OPT_ORDER.get(k[1].split()[0], 9), k[1], k[3] or 0,
                                          order.get(k[2], 9))):
        means = {lr: statistics.mean(accs) for lr, accs in val[key].items()}
        chosen = max(sorted(means), key=lambda lr: means[lr])  # ties: the smaller rate
        tried = ", ".join(f"{lr:g}: {100 * means[lr]:.1f}" for lr in sorted(means))
        rs = test.get(key + (chosen,), [])
        eps = "-" if key[3] is None else f"{key[3]:g}"
        if rs:
            accs = [r["test_accuracy"] for r in rs]
            scored = (f"{100 * statistics.mean(accs):.1f}% | {100 * min(accs):.1f}-{100 * max(accs):.1f} | "
                      + ",".join(str(s) for s in sorted(r["seed"] for r in rs)))
        else:
            scored = "- | - | -"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {eps} | {tried} | {chosen:g} | {scored} |")
    return "\n".join(lines)


def report(records: list[dict]) -> str:
    """The default tables (SGD at the default rates: accuracy, step time) and, when there are
    other rows, their table and the AdamW vs NoiseAwareAdamW pairs; with validation rows, the
    rates they chose and those rates' test accuracy."""
    validation = [r for r in records if is_validation(r)]
    records = [r for r in records if not is_validation(r)]
    default = [r for r in records if is_default(r)]
    other = [r for r in records if not is_default(r)]
    text = table(default) + "\n\n" + step_table(default)
    if other:
        text += "\n\nOther optimizers and learning rates:\n\n" + tuning_table(other)
        pairs = paired_table(other)
        if pairs.count("\n") > 1:
            text += "\n\nNoiseAwareAdamW vs AdamW, same seeds:\n\n" + pairs
    if validation:
        text += "\n\nRates chosen on the validation split, scored on test:\n\n" + selection_table(validation + records)
    return text


def plot(records: list[dict], path: str) -> None:
    """Accuracy vs epsilon per variant, one panel per pipeline; non-private as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(records)
    pipelines = sorted({k[0] for k in summary})
    fig, axes = plt.subplots(1, len(pipelines), figsize=(5 * len(pipelines), 3.8), squeeze=False, sharey=True)
    for ax, pipe in zip(axes[0], pipelines):
        for variant in VARIANTS[1:]:
            pts = sorted((k[2], v) for k, v in summary.items() if k[0] == pipe and k[1] == variant)
            if pts:
                xs = [e for e, _ in pts]
                ax.errorbar(xs, [100 * v[0] for _, v in pts], marker="o", capsize=3, label=variant,
                            yerr=[[100 * (v[0] - v[1]) for _, v in pts], [100 * (v[2] - v[0]) for _, v in pts]])
        base = [v for k, v in summary.items() if k[0] == pipe and k[1] == "nonprivate"]
        if base:
            ax.axhline(100 * base[0][0], ls="--", color="k", label="non-private")
        ax.axhline(100 * MAJORITY, ls=":", color="grey", label="majority class")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([1, 3, 8], ["1", "3", "8"])
        ax.set_title(f"fortunes, 10 classes: {pipe} fine-tuning")
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- main ------------------------------------------------------------------------------------------

def prepare(args) -> dict:
    """Tokenizer, pretrained LM (both cached) and the fortune splits."""
    from corrnoise.datasets.text import gcide_text

    cache = Path(args.cache) / cache_key(args, "vocab", "layers", "embd", "heads", "ctx", "pretrain_chars",
                                         "gcide_stride", "pretrain_seconds", "pretrain_lr")
    t0 = time.perf_counter()
    text = gcide_text(args.pretrain_chars, stride=args.gcide_stride)
    tok = train_tokenizer(text, args.vocab, cache)
    t_tok = time.perf_counter() - t0
    state, info = pretrain(args, tok, text, cache)
    train, test, names = fortune_splits(tok, args)
    if args.split == "validation":
        train, test = validation_split(train)
    info.update(tokenizer_seconds=round(t_tok, 1), vocab=tok.get_vocab_size(), public_chars=len(text),
                n_train=len(train), n_test=len(test), split=args.split, categories=names)
    return {"train": train, "test": test, "names": names, "state": state, "tok": tok,
            "collate": PadCollate(tok.token_to_id("<pad>")), "info": info}


def run_list(args) -> list[tuple[str, float | None]]:
    """(variant, epsilon) of each run per pipeline and seed: ``--runs``, else variants x epsilons."""
    if args.runs:
        pairs = [item.split(":") for item in args.runs.split(",")]
        todo = [(p[0], float(p[1]) if len(p) > 1 else None) for p in pairs]
    else:
        epsilons = [float(e) for e in args.epsilons.split(",")]
        todo = [(v, eps) for v in args.variants.split(",") for eps in ([None] if v == "nonprivate" else epsilons)]
    for variant, eps in todo:
        if variant not in VARIANTS or (variant != "nonprivate") == (eps is None):
            raise SystemExit(f"bench_text: bad run {variant}:{eps} (variants {', '.join(VARIANTS)}; private ones "
                             "need an epsilon)")
    return todo


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        records = load_records(args.out)
        print(report(records))
        plot([r for r in records if is_default(r) and not is_validation(r)], args.plot)
        return
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    ctx = prepare(args)
    setup = {"kind": "setup", "args": vars(args), "load_before": os.getloadavg(), **ctx["info"],
             "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps(setup), flush=True)
    todo = run_list(args)
    records: list[dict] = []
    with open(args.out, "a") as out:
        out.write(json.dumps(setup) + "\n")
        for seed in range(args.seed_start, args.seeds):
            for pipeline in args.pipelines.split(","):
                for variant, eps in todo:
                    rec = run_one(variant, pipeline, eps, seed, ctx, args)
                    rec["load"] = os.getloadavg()[0]
                    records.append(rec)
                    add_step_ratios(records)  # the non-private run of the pipeline comes first
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    print(json.dumps(rec), flush=True)
    records = load_records(args.out)
    print(report(records))
    plot([r for r in records if is_default(r) and not is_validation(r)], args.plot)


if __name__ == "__main__":
    main()
