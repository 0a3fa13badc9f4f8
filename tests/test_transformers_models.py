"""Hugging Face models as they are: GPT-2 and BERT full fine-tuning (and LoRA via peft) with the
clipping engine and make_private, against a one-example-at-a-time autograd reference.

The loss: the engine clips the gradient of example b's own loss L_b, where the batch loss is
mean_b L_b (``loss_reduction="mean"``) or sum_b L_b ("sum"). BERT's built-in classification loss
is a mean over the batch of one cross entropy per example: exactly that. GPT-2's built-in LM loss
(``labels=``) is the mean over *all* non-padding tokens of the batch, (1 / N) sum_b S_b with S_b
example b's token sum and N the batch's token count, so "mean" clips (B / N) grad S_b, a quantity
that depends on the other examples' lengths (test_gpt2_builtin_lm_loss_scales_by_the_batch_token_count);
with padding the clip then bounds the wrong quantity, and an added example rescales everyone else's
contribution. Use a per-example loss instead: per_example_lm_loss below (the token mean of each
sequence, averaged over the batch), or keep HF's loss with ``num_items_in_batch=B`` (then L_b = S_b).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from corrnoise.errors import CorrnoiseError  # noqa: E402
from corrnoise.torch import make_private  # noqa: E402
from corrnoise.torch.clipping import ClippingEngine  # noqa: E402

#: float64 against the one-example loop: each gradient entry is a few thousand float64 operations deep
#: (2 layers, width 128, L = 12), rounding ~1e-16 each, so the two orders of computation agree to
#: ~1e-13 of the largest entry of the gradient (measured ~2e-15); 1e-9 leaves margin and still catches
#: any wrong term. The scale is the whole gradient's largest entry: some parameters' true gradient is 0.
RTOL = 1e-9
#: HF's built-in LM loss casts the logits to float32 (``logits.float()``): float32 rounding 6e-8 through
#: a softmax and a few hundred-term sums, ~1e-6; 1e-4 is a clear margin.
RTOL_F32_LOSS = 1e-4
#: transformers' LlamaRMSNorm normalizes in float32 whatever the model's dtype, and its mean over the
#: last dimension rounds differently on a batch of one (another reduction order): float32's 6e-8
#: through two layers, measured 1e-7 of the largest entry; 1e-6 still catches any wrong term (O(1))
RTOL_F32_NORM = 1e-6

V, L, B = 500, 12, 6
LENGTHS = [12, 9, 5, 12, 3, 7]  # padding on the right of all but two examples


def _gpt2(dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def _bert(dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256,
                                  vocab_size=V, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).to(dtype)


def _padded(lengths, seq=L, seed=1):
    """A tokenizer-style batch: input_ids padded with 0 on the right, attention_mask 1/0."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    ids = torch.randint(1, V, (len(lengths), seq), generator=g).masked_fill(mask == 0, 0)
    return ids, mask


def _lm_batch(lengths=LENGTHS):
    ids, mask = _padded(lengths)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _cls_batch(token_types: bool):
    ids, mask = _padded(LENGTHS, seed=2)
    batch = {"input_ids": ids, "attention_mask": mask}
    if token_types:  # a sentence pair: segment 1 from position 4 on
        batch["token_type_ids"] = ((torch.arange(L)[None] >= 4) & (mask == 1)).long()
    batch["labels"] = torch.tensor([0, 2, 1, 1, 0, 2])
    return batch


def per_example_lm_loss(logits, labels):
    """Next-token cross entropy averaged over each sequence's own labelled tokens: (B,)."""
    tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
    return tokens.sum(1) / (labels[:, 1:] != -100).sum(1)


def _per_example_grads(model, batch, loss_of):
    """Each example's gradient of its own loss, by autograd on that example alone (a batch of one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        out.append(torch.autograd.grad(loss_of(model, one), params))
    return out


def _norms(grads):
    return torch.tensor([math.sqrt(sum(float((t * t).sum()) for t in g)) for g in grads], dtype=torch.float64)


def _clipped_sum(grads, clip):
    norms = _norms(grads)
    return [sum(g[k] * min(1.0, clip / float(n)) for g, n in zip(grads, norms)) for k in range(len(grads[0]))]


def _close(a, b, rtol, scale=None):
    """max |a - b| <= rtol * scale, scale defaulting to max |b| (for a parameter whose true gradient is 0,
    e.g. the attention key bias, under which softmax is invariant, pass the whole gradient's scale)."""
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()), 1e-300) if scale is None else scale
    assert float((a - b).abs().max()) <= rtol * scale, (float((a - b).abs().max()), scale)


def _engine_step(model, batch, loss_of, clip):
    """The clipped sum and norms the engine gives for ``loss_of(model, batch)`` (no noise), model(**batch) unmodified."""
    eng = ClippingEngine(model, loss_reduction="mean", max_grad_norm=clip)
    try:
        loss_of(model, batch).backward()
        return eng.clipped_sum(batch["input_ids"].shape[0])
    finally:
        eng.detach()


def _check_exact(model, batch, loss_of, rtol=RTOL):
    grads = _per_example_grads(model, batch, loss_of)
    ref_norms = _norms(grads)
    clip = float(ref_norms.median())
    assert bool((ref_norms > 1.01 * clip).any()) and bool((ref_norms < 0.99 * clip).any())  # clipped and not
    sums, norms = _engine_step(model, batch, loss_of, clip)
    _close(norms, ref_norms, rtol)
    ref = _clipped_sum(grads, clip)
    assert len(sums) == len(ref)
    scale = max(float(r.abs().max()) for r in ref)
    for s, r in zip(sums, ref):
        _close(s, r, rtol, scale)


def _lm_loss(model, batch):
    return per_example_lm_loss(model(**batch).logits, batch["labels"]).mean()


def _lm_token_sum(model, batch):
    """sum_b S_b, S_b = example b's next-token cross entropy summed over its labelled tokens."""
    logits, labels = model(**batch).logits, batch["labels"]
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="sum")


def _builtin_loss(model, batch):
    return model(**batch).loss


def test_gpt2_full_fine_tuning_clips_each_example_exactly():
    _check_exact(_gpt2(), _lm_batch(), _lm_loss)


def test_gpt2_builtin_loss_with_num_items_in_batch_is_per_example():
    """HF's loss divided by the number of examples instead of tokens: L_b = S_b, the token sum."""
    def loss(model, batch):
        return model(**batch, num_items_in_batch=batch["input_ids"].shape[0]).loss

    _check_exact(_gpt2(), _lm_batch(), loss, RTOL_F32_LOSS)


def test_gpt2_builtin_lm_loss_would_scale_by_the_batch_token_count_and_is_refused():
    """The finding behind the module docstring: HF's own LM loss gives example b the gradient
    (1 / N) grad S_b, N the whole batch's labelled-token count, so what "mean" would clip, B / N
    grad S_b, is not a per-example quantity (the same example in a batch of longer sequences is
    another gradient). The engine refuses the batch at its clipped sum when backward went through
    that loss, in one line; labels passed but the loss taken from the logits (``_lm_loss``) are fine."""
    model, batch = _gpt2(), _lm_batch()
    n_tokens = int((batch["labels"][:, 1:] != -100).sum())
    # example 0's share of the batch loss's gradient is (1 / N) grad S_0, N over the whole batch
    loss = _builtin_loss(model, batch)
    share = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True,
                                grad_outputs=None, allow_unused=True)
    token_sums = _per_example_grads(model, batch, _lm_token_sum)
    total = [sum(g[k] for g in token_sums) / n_tokens for k in range(len(token_sums[0]))]
    for a, b in zip(share, total):
        if a is not None:
            _close(a, b, RTOL_F32_LOSS, max(float(t.abs().max()) for t in total))
    longer = _lm_batch([LENGTHS[0]] + [L] * (B - 1))  # the same example 0 among longer sequences
    assert torch.equal(longer["input_ids"][0], batch["input_ids"][0])
    assert int((longer["labels"][:, 1:] != -100).sum()) != n_tokens  # so its weight 1 / N would differ
    eng = ClippingEngine(model, loss_reduction="mean", max_grad_norm=1.0)
    try:
        _builtin_loss(model, batch).backward()
        with pytest.raises(CorrnoiseError, match=r"^loss: the model's built-in loss \(labels=\) averages over the "
                                                 r"batch's labelled tokens.*num_items_in_batch=<batch size>"):
            eng.clipped_sum(B)
        eng.clear()
        # the Trainer's num_items_in_batch (the batch's token count) is the same loss
        model(**batch, num_items_in_batch=n_tokens).loss.backward()
        with pytest.raises(CorrnoiseError, match="^loss: "):
            eng.clipped_sum(B)
        eng.clear()
        model(**batch, return_dict=False)[0].backward()  # the same loss as a tuple's first entry
        with pytest.raises(CorrnoiseError, match="^loss: "):
            eng.clipped_sum(B)
        eng.clear()
        _lm_loss(model, batch).backward()  # labels in the call, loss from the logits: accepted
        assert eng.clipped_sum(B)[1].shape == (B,)
        eng.clear()
        model(**batch, num_items_in_batch=B).loss.backward()  # a sum of per-example token sums: accepted
        assert eng.clipped_sum(B)[1].shape == (B,)
    finally:
        eng.detach()


@pytest.mark.parametrize("token_types", [True, False], ids=["token_type_ids", "buffer_token_types"])
def test_bert_classification_builtin_loss_clips_each_example_exactly(token_types):
    _check_exact(_bert(), _cls_batch(token_types), _builtin_loss)


def test_gpt2_lora_clips_each_example_exactly():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0,
                             init_lora_weights=False)  # random B too: a zero B would leave A without gradient
    model = peft.get_peft_model(_gpt2(), config)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    _check_exact(model, _lm_batch(), _lm_loss)


# ----------------------------------------------------------------------------------------------
# Llama-style decoders (the Llama / Qwen2 / Mistral family): RMSNorm (transformers' own class, no rule
# of ours: the torch.func fallback, per layer), rotary positions, grouped-query attention, a gated MLP
# ----------------------------------------------------------------------------------------------
def _llama(tie: bool, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                                   tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_full_fine_tuning_clips_each_example_exactly(tie):
    from corrnoise.torch.clipping.layers import fallback_handler, handler_for

    model = _llama(tie)
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5 and all(handler_for(m) is fallback_handler for m in norms)
    _check_exact(model, _lm_batch(), _lm_loss, RTOL_F32_NORM)


def test_llama_lora_on_every_projection_clips_each_example_exactly():
    # q/k/v's A factors share one input and gate/up's another (the engine's shared-input products)
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(_llama(False), config)
    assert sum("lora_A" in n for n, p in model.named_parameters() if p.requires_grad) == 14
    _check_exact(model, _lm_batch(), _lm_loss, RTOL_F32_NORM)


def _mlm_batch():
    """Masked LM labels: the token at a few positions of each example, -100 elsewhere (padding too)."""
    ids, mask = _padded(LENGTHS, seed=3)
    chosen = (torch.arange(L)[None] % 3 == torch.arange(B)[:, None] % 3) & (mask == 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~chosen, -100)}


def _mlm_loss(model, batch):
    """Each example's mean cross entropy over its own labelled positions, averaged over the batch."""
    logits, labels = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return (tokens.sum(1) / (labels != -100).sum(1)).mean()


def test_bert_masked_lm_clips_each_example_exactly():
    # BertLMPredictionHead registers its decoder's bias a second time as its own: owned once, by the
    # decoder Linear whose forward adds it (counted twice before: the first step's check refused it)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=V, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg).to(torch.float64)
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias
    _check_exact(model, _mlm_batch(), _mlm_loss)


def _t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).to(torch.float64)


def _seq2seq_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], decoder_input_ids=batch["labels"]).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1).mean()


@pytest.mark.parametrize("batch_size", [4, L])
def test_a_trainable_t5_position_bias_is_refused(batch_size):
    # its call has no batch dimension: with B == L the query positions would pass for examples
    model = _t5()
    with pytest.raises(CorrnoiseError, match=r"^module: 'encoder\.block\.0\.layer\.0\.SelfAttention\."
                                             r"relative_attention_bias' is a position bias shared by the whole batch"):
        ClippingEngine(model)
    for n, p in model.named_parameters():
        if "relative_attention_bias" in n:
            p.requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    batch = {"input_ids": torch.randint(1, V, (batch_size, L), generator=g),
             "labels": torch.randint(1, V, (batch_size, L), generator=g)}
    _check_exact(model, batch, _seq2seq_loss, RTOL_F32_NORM)  # T5LayerNorm's variance is float32 too


# ----------------------------------------------------------------------------------------------
# make_private end to end: a DataLoader over a list of dict examples, a collate that pads
# ----------------------------------------------------------------------------------------------
def _examples(n, labels: bool, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, L + 1, (), generator=g))
        ex = {"input_ids": torch.randint(1, V, (length,), generator=g)}
        if labels:
            ex["label"] = int(torch.randint(0, 3, (), generator=g))
        out.append(ex)
    return out


def _pad_collate(items):
    """What a tokenizer's padding does: right-pad to the longest sequence, mask, labels."""
    seq = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), seq, dtype=torch.long)
    mask = torch.zeros(len(items), seq, dtype=torch.long)
    for i, it in enumerate(items):
        ids[i, :len(it["input_ids"])] = it["input_ids"]
        mask[i, :len(it["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "label" in items[0]:
        batch["labels"] = torch.tensor([it["label"] for it in items])
    else:
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def _train(model, loader, loss_of, steps, **kwargs):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    model, opt, loader = make_private(model, opt, loader, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0,
                                      steps=steps, noise_seed=0, **kwargs)
    losses = []
    for batch in loader:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert opt.steps_taken == steps
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


def test_make_private_trains_llama_with_dpcgd():
    loader = DataLoader(_examples(32, labels=False), batch_size=8, collate_fn=_pad_collate)
    _train(_llama(True, torch.float32), loader, _lm_loss, steps=4, mechanism="dpcgd:0.9", batching="cyclic")


def test_make_private_trains_gpt2_with_bsr():
    loader = DataLoader(_examples(32, labels=False), batch_size=8, collate_fn=_pad_collate)
    _train(_gpt2(torch.float32), loader, _lm_loss, steps=4, mechanism="bsr:4", batching="cyclic")


@pytest.mark.filterwarnings("ignore:a given seed fixes the Poisson sampler:UserWarning")
def test_make_private_trains_bert_with_dpsgd():
    loader = DataLoader(_examples(32, labels=True), batch_size=8, collate_fn=_pad_collate)
    _train(_bert(torch.float32), loader, _builtin_loss, steps=4, mechanism="identity", batching="poisson", seed=5)


def _run_with_evaluations(evaluate: bool):
    """Four private steps of GPT-2; with ``evaluate``, a forward of another batch size with gradients
    on (an evaluation without torch.no_grad()) after each step."""
    model = _gpt2(torch.float32)
    loader = DataLoader(_examples(32, labels=False), batch_size=8, collate_fn=_pad_collate)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = make_private(model, opt, loader, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0,
                                      steps=4, noise_seed=0, seed=1, mechanism="bsr:4", batching="cyclic")
    held_out = _lm_batch()  # 6 examples
    for batch in loader:
        _lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        if evaluate:
            _lm_loss(model, held_out)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:a given seed fixes")
def test_an_evaluation_with_gradients_on_between_steps_changes_nothing():
    # its captured calls get no gradient and contribute nothing; the next forward expands GPT-2's
    # shared position ids to its own batch, not to the evaluation's
    for a, b in zip(_run_with_evaluations(True), _run_with_evaluations(False)):
        assert torch.equal(a, b)


def test_a_forward_between_backward_and_step_is_one_line():
    model = _gpt2(torch.float32)
    loader = DataLoader(_examples(16, labels=False), batch_size=8, collate_fn=_pad_collate)
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.05), loader, delta=1e-5,
                                      max_grad_norm=1.0, noise_multiplier=1.0, steps=2, noise_seed=0,
                                      mechanism="identity", batching="cyclic")
    batch = next(iter(loader))
    _lm_loss(model, batch).backward()
    with pytest.raises(CorrnoiseError, match="^engine: .*max_physical_batch_size, and evaluate under torch.no_grad"):
        _lm_loss(model, _lm_batch())
