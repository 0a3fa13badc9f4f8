"""Issue #27, items 2 and 3: the clipping engine on Hugging Face models as people fine-tune them --
peft LoRA with lora_dropout > 0 on nn.Linear, nn.Embedding and transformers' Conv1D targets,
gradient checkpointing, bf16 autocast, torch.compile -- against per-example autograd.

Two references, both independent of the engine:

* one example at a time (a batch of one, :func:`_one_at_a_time`), for deterministic models;
* the same forward pass (:func:`_same_forward`): with dropout in train mode a batch of one draws
  other masks than the batch did, so the reference runs the batched forward once, with the
  per-example losses L_b kept, and takes each example's gradient of its own L_b by autograd on
  that one graph (``retain_graph``). Examples do not interact in these models, so that is example
  b's gradient under the mask it was given. The engine sees a second forward under the same torch
  seed: the same masks, checked by requiring bitwise-equal losses.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from torch.utils.data import DataLoader  # noqa: E402

from corrnoise.torch import make_private  # noqa: E402
from corrnoise.torch.clipping import ClippingEngine  # noqa: E402

#: float64 against autograd: each entry is a few thousand float64 operations deep (2 layers, width 64),
#: rounding ~1e-16 each, so the two orders of computation agree to ~1e-13 of the largest entry; 1e-9
#: leaves margin and still catches any wrong term (a missed dropout mask changes entries by O(1)).
RTOL = 1e-9

V, L, B = 300, 10, 5
LENGTHS = [10, 7, 4, 10, 6]


def _gpt2(dtype=torch.float64, dropout=0.0, layers=2):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=V, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def _bert(dtype=torch.float64, dropout=0.0):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).to(dtype)


def _padded(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    mask = (torch.arange(L)[None] < lens[:, None]).long()
    ids = torch.randint(1, V, (len(lengths), L), generator=g).masked_fill(mask == 0, 0)
    return ids, mask


def _lm_batch():
    ids, mask = _padded()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _cls_batch():
    ids, mask = _padded(seed=2)
    ids[[0, 3], 2] = 0  # the padding_idx inside real text: its row of the table gets no gradient
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2, 1, 1, 0])}


def _lm_losses(model, batch):
    """(B,): next-token cross entropy averaged over each sequence's own labelled tokens."""
    logits, labels = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    tokens = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
    return tokens.sum(1) / (labels[:, 1:] != -100).sum(1)


def _cls_losses(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits.double(), batch["labels"], reduction="none")


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _one_at_a_time(model, batch, losses_of):
    """Each example's gradient of its own loss, by autograd on that example alone."""
    out = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        out.append(torch.autograd.grad(losses_of(model, one).sum(), _params(model)))
    return out


def _same_forward(model, batch, losses_of, seed):
    """(per-example gradients, losses): each example's gradient of its own loss on one batched forward
    (dropout masks drawn once, under ``seed``)."""
    torch.manual_seed(seed)
    losses = losses_of(model, batch)
    grads = [torch.autograd.grad(losses[i], _params(model), retain_graph=True) for i in range(losses.shape[0])]
    return grads, losses.detach()


def _norms(grads):
    return torch.tensor([math.sqrt(sum(float((t.double() ** 2).sum()) for t in g)) for g in grads],
                        dtype=torch.float64)


def _clipped_sum(grads, clip):
    norms = _norms(grads)
    return [sum(g[k].double() * min(1.0, clip / float(n)) for g, n in zip(grads, norms)) for k in range(len(grads[0]))]


def _engine(model, batch, losses_of, clip, seed=None, after_backward=None, **kw):
    """The engine's clipped sum and norms for the batch loss mean_b L_b (the user's one backward);
    ``after_backward(engine)`` looks at the engine between backward and clipped_sum.

    Two steps on the same batch: the first (checked against autograd's gradient) and the second
    (weight gradients out of autograd, ClippingEngine._skip_weight_grads) must agree; the second
    is returned."""
    eng = ClippingEngine(model, loss_reduction="mean", max_grad_norm=clip, **kw)
    try:
        results = []
        for _ in range(2):
            if seed is not None:
                torch.manual_seed(seed)
            model.zero_grad(set_to_none=True)
            losses = losses_of(model, batch)
            losses.mean().backward()
            if after_backward is not None:
                after_backward(eng)
            sums, norms = eng.clipped_sum(batch["input_ids"].shape[0])
            eng.clear()
            results.append((sums, norms, losses.detach()))
        (s1, n1, _), (s2, n2, _) = results
        torch.testing.assert_close(n2, n1, rtol=1e-12 if n1.dtype == torch.float64 else 1e-5, atol=0)
        for a, b in zip(s2, s1):
            torch.testing.assert_close(a, b, rtol=1e-10 if a.dtype == torch.float64 else 1e-4,
                                       atol=1e-12 * max(1.0, float(b.abs().max())))
        return results[1]
    finally:
        eng.detach()


def _assert_close(a, b, rtol, scale):
    err = float((a.double() - b.double()).abs().max())
    assert err <= rtol * scale, (err, rtol * scale)


def _compare(grads, engine_result, clip, rtol):
    sums, norms, _ = engine_result
    ref_norms = _norms(grads)
    _assert_close(norms, ref_norms, rtol, float(ref_norms.max()))
    ref = _clipped_sum(grads, clip)
    assert len(sums) == len(ref)
    scale = max(float(r.abs().max()) for r in ref)  # some parameters' true gradient is 0 (attention key bias)
    for s, r in zip(sums, ref):
        _assert_close(s, r, rtol, scale)


def _clip_between(norms):
    """A clip norm halfway between the second and third smallest norms: clips some examples, not others."""
    low = torch.sort(norms).values
    assert float(low[2] - low[1]) > 1e-3 * float(low[2])
    return float(low[1] + low[2]) / 2


# ----------------------------------------------------------------------------------------------
# item 2: peft LoRA on Linear, Embedding and Conv1D targets, lora_dropout > 0
# ----------------------------------------------------------------------------------------------
def _lora(model, targets, dropout):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                             fan_in_fan_out=isinstance(model, transformers.GPT2PreTrainedModel),
                             init_lora_weights=False)  # random B too: a zero B leaves A without gradient
    model = peft.get_peft_model(model, config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    return model


GPT2_TARGETS = ["c_attn", "c_proj", "wte", "wpe"]  # Conv1D (attention, MLP out) and Embedding (tokens, positions)
BERT_TARGETS = ["query", "value", "dense", "word_embeddings"]  # nn.Linear and nn.Embedding


def _kinds(model):
    """The types of the base layers LoRA wraps."""
    return {type(m.base_layer).__name__ for m in model.modules() if hasattr(m, "lora_A")}


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_lora_without_dropout_matches_one_example_at_a_time(arch):
    if arch == "gpt2":
        model, batch, losses_of = _lora(_gpt2(), GPT2_TARGETS, 0.0), _lm_batch(), _lm_losses
        assert _kinds(model) == {"Conv1D", "Embedding"}
    else:
        model, batch, losses_of = _lora(_bert(), BERT_TARGETS, 0.0), _cls_batch(), _cls_losses
        assert _kinds(model) == {"Linear", "Embedding"}
    grads = _one_at_a_time(model, batch, losses_of)
    clip = _clip_between(_norms(grads))
    _compare(grads, _engine(model, batch, losses_of, clip), clip, RTOL)


def test_lora_a_factors_on_one_input_share_a_product(monkeypatch):
    # materialized (forced here; the rule's choice at longer sequences), the LoRA A factors of
    # query and value read the same attention input: one product per layer and step, exact
    from corrnoise.torch.clipping import engine as engine_mod

    monkeypatch.setattr(engine_mod, "use_ghost", lambda t, p, q, one_hot=False: False)
    sizes: list[int] = []
    real = engine_mod.shared_input_products
    monkeypatch.setattr(engine_mod, "shared_input_products",
                        lambda us, v, out=None: sizes.append(len(us)) or real(us, v, out))
    model, batch = _lora(_bert(), BERT_TARGETS, 0.0), _cls_batch()
    grads = _one_at_a_time(model, batch, _cls_losses)
    clip = _clip_between(_norms(grads))
    _compare(grads, _engine(model, batch, _cls_losses, clip), clip, RTOL)
    assert sizes and set(sizes) == {2}  # query's and value's A, in each layer


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_lora_with_dropout_matches_autograd_on_the_same_masks(arch):
    if arch == "gpt2":
        model, batch, losses_of = _lora(_gpt2(dropout=0.1), GPT2_TARGETS, 0.3), _lm_batch(), _lm_losses
    else:
        model, batch, losses_of = _lora(_bert(dropout=0.1), BERT_TARGETS, 0.3), _cls_batch(), _cls_losses
    model.train()
    grads, losses = _same_forward(model, batch, losses_of, seed=7)
    model.eval()
    with torch.no_grad():
        assert not torch.allclose(losses_of(model, batch), losses)  # dropout (LoRA's included) was on
    model.train()
    clip = _clip_between(_norms(grads))
    result = _engine(model, batch, losses_of, clip, seed=7)
    assert torch.equal(result[2], losses)  # the engine's forward drew the reference's masks
    _compare(grads, result, clip, RTOL)


@pytest.mark.parametrize("embed_scale", [None, 1.7], ids=["plain", "scaled"])
def test_a_dora_embedding_matches_one_example_at_a_time(embed_scale):
    """peft's DoRA on an Embedding (magnitudes over column norms the forward detaches, as peft does):
    the LoRA Embedding's rule forms A's, B's and the magnitudes' gradients per example (the DoRA
    layer itself has no batch dimension in its output), with the padding index inside real text;
    ``embed_scale`` (a scaled embedding, as Gemma's) multiplies the adapter's output. Each example
    alone, float64."""
    config = peft.LoraConfig(r=4, target_modules=["word_embeddings"], use_dora=True, init_lora_weights=False)
    model = peft.get_peft_model(_bert(), config)
    layer = model.base_model.model.bert.embeddings.word_embeddings
    if embed_scale is not None:
        layer.base_layer.embed_scale = embed_scale  # peft scales the adapter's output by it
    with torch.no_grad():
        layer.lora_magnitude_vector["default"].weight.mul_(torch.linspace(0.5, 1.5, 64, dtype=torch.float64))
    names = [n.rsplit("word_embeddings.", 1)[-1] for n, p in model.named_parameters() if p.requires_grad]
    assert names == ["lora_embedding_A.default", "lora_embedding_B.default", "lora_magnitude_vector.default.weight"]
    batch = _cls_batch()
    grads = _one_at_a_time(model, batch, _cls_losses)
    assert all(float(g[2].abs().max()) > 0 for g in grads)  # the magnitudes do get a gradient
    clip = _clip_between(_norms(grads))
    _compare(grads, _engine(model, batch, _cls_losses, clip), clip, RTOL)


def test_a_dora_embedding_beside_another_adapter_is_refused_in_one_line():
    """Two active adapters on one Embedding, one of them DoRA: DoRA rescales what the other added."""
    from corrnoise.errors import CorrnoiseError

    dora = peft.LoraConfig(r=4, target_modules=["word_embeddings"], use_dora=True, init_lora_weights=False)
    model = peft.get_peft_model(_bert(), dora)
    model.add_adapter("plain", peft.LoraConfig(r=4, target_modules=["word_embeddings"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "plain"])
    with pytest.raises(CorrnoiseError) as err:
        _engine(model, _cls_batch(), _cls_losses, 1.0)
    assert err.value.param == "module" and "\n" not in str(err.value)
    assert "word_embeddings" in str(err.value) and "DoRA beside other active adapters" in str(err.value)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_lora_embedding_reads_a_multiple_choice_batch_flattened(dora):
    """BertForMultipleChoice looks up its (B, choices, L) ids as B * choices rows: the LoRA
    Embedding's rule (vanilla and DoRA) reads them example-major once check_attribution has
    verified it (refused before), and the norms and clipped sums of two steps are each example's
    alone (float64)."""
    from corrnoise.torch.clipping import check_attribution

    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=V, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    targets = ["word_embeddings"] if dora else ["word_embeddings", "query"]
    model = peft.get_peft_model(transformers.BertForMultipleChoice(cfg).double(),
                                peft.LoraConfig(r=4, target_modules=targets, use_dora=dora, init_lora_weights=False))
    ids = torch.randint(1, V, (B, 3, 8), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2, 1, 0])}

    def losses_of(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        return F.cross_entropy(logits, b["labels"], reduction="none")

    grads = _one_at_a_time(model, batch, losses_of)
    clip = _clip_between(_norms(grads))
    eng = ClippingEngine(model, loss_reduction="mean", max_grad_norm=clip)
    try:
        report = check_attribution(eng, lambda b: losses_of(model, b), batch, examples=B)
        assert report.worst < 1e-6 and "base_model.model.bert.embeddings.word_embeddings" in report.flattened
        results = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            losses = losses_of(model, batch)
            losses.mean().backward()
            sums, norms = eng.clipped_sum(B)
            eng.clear()
            results.append((sums, norms, losses.detach()))
    finally:
        eng.detach()
    for result in results:
        _compare(grads, result, clip, RTOL)


def test_lora_engine_and_noise_cover_trainable_parameters_only():
    """Frozen base weights get no noise and no update, and the noise generator (its state included)
    is sized by the LoRA parameters alone, even with an optimizer given every parameter."""
    model = _lora(_gpt2(torch.float32), GPT2_TARGETS, 0.1)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    n_trainable = sum(p.numel() for p in trainable.values())
    assert n_trainable < sum(p.numel() for p in frozen.values()) / 10
    examples = [_lm_batch()["input_ids"][i] for i in range(B)] * 4  # 20 examples, 5 batches of 4
    loader = DataLoader(examples, batch_size=4, collate_fn=lambda items: {"input_ids": torch.stack(items)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # frozen ones too: AdamW would decay them
    model, opt, loader = make_private(model, opt, loader, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0,
                                      steps=4, mechanism="bsr:3", batching="cyclic", noise_seed=0)
    assert opt.engine.names == list(trainable)
    gen = opt.privatizer.generator
    assert gen.m == n_trainable
    assert {k: tuple(v.shape) for k, v in gen.state_dict()["buffers"].items()} == {"history": (2, n_trainable)}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    for batch in loader:
        ids = batch["input_ids"]
        _lm_losses(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).mean().backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None and torch.equal(p.detach(), frozen[n]), n
        else:
            assert not torch.equal(p.detach(), before[n]), n


# ----------------------------------------------------------------------------------------------
# item 3: gradient checkpointing, bf16 autocast, torch.compile
# ----------------------------------------------------------------------------------------------
def _model_and_batch(arch, dtype=torch.float64, dropout=0.0):
    if arch == "gpt2":
        return _gpt2(dtype, dropout), _lm_batch(), _lm_losses
    return _bert(dtype, dropout), _cls_batch(), _cls_losses


def _count_calls(module):
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


def _a_block_linear(model):
    """A layer inside the first checkpointed block (GPT-2's c_fc, BERT's intermediate dense)."""
    return next(m for n, m in model.named_modules() if n.endswith("h.0.mlp.c_fc") or
                n.endswith("layer.0.intermediate.dense"))


def _checkpointing_enable(model, reentrant: bool) -> None:
    """transformers' gradient checkpointing on; the method is activation_checkpointing_enable in
    transformers 5.x (gradient_checkpointing_enable warns there, and goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_gradient_checkpointing_counts_each_activation_once(arch, reentrant):
    """The blocks' forward runs again in backward (their hooks fire twice), and the clipped sum is
    still exactly the one-example-at-a-time one: the recomputed call is not counted on top of the
    first (a double count would double that layer's gradient)."""
    model, batch, losses_of = _model_and_batch(arch)
    grads = _one_at_a_time(model, batch, losses_of)
    clip = _clip_between(_norms(grads))
    _checkpointing_enable(model, reentrant)
    model.train()  # checkpointing is active in train mode only; dropout is 0
    calls = _count_calls(_a_block_linear(model))
    held = {}
    result = _engine(model, batch, losses_of, clip,
                     after_backward=lambda eng: held.update({m: len(c) for m, c in eng._calls.items()}))
    # per step (two, see _engine): forward, and the recomputation in backward; on the first, twice more
    # in the engine's probe of the shared position ids (two backward passes, to rows 0 and B - 1)
    assert len(calls) == 6
    # one captured call per layer: the copy the gradient did not reach is not held (white box)
    assert set(held.values()) == {1}
    _compare(grads, result, clip, RTOL)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_with_lora_dropout(reentrant):
    """LoRA with dropout under checkpointing: the recomputation replays the forward's masks
    (preserve_rng_state), and the engine matches autograd on the same masks (the reference runs
    without checkpointing, which torch.autograd.grad does not support with reentrancy; the same
    seed draws the same masks, checked by the bitwise-equal losses)."""
    model = _lora(_gpt2(dropout=0.1), GPT2_TARGETS, 0.3)
    model.train()
    grads, losses = _same_forward(model, _lm_batch(), _lm_losses, seed=3)
    clip = _clip_between(_norms(grads))
    _checkpointing_enable(model, reentrant)
    model.train()
    calls = _count_calls(_a_block_linear(model))
    result = _engine(model, _lm_batch(), _lm_losses, clip, seed=3)
    # two steps (see _engine), each calls it twice, and the first step's probe twice more (see above)
    assert len(calls) == 6 and torch.equal(result[2], losses)
    _compare(grads, result, clip, RTOL)


#: bf16 autocast. bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Autograd's gradient of the batch
#: loss mean_b L_b and of one example's L_b round differently at every bf16 operation of the backward
#: (the grad outputs differ by the factor 1/B, not a power of 2, before each rounding), and the engine
#: forms the weight gradients in float32 from the float32 input where autograd multiplies bf16-rounded
#: operands; each differs by <= u relatively per operation, and a gradient passes through a handful of
#: them (2 layers). Measured: norms within 0.8 u, each parameter's clipped sum within 4.8 u of its own
#: largest entry. Tolerances: 4 u on the norms, 8 u per parameter of its own largest entry, or of 1e-4 of
#: the whole gradient's if larger (the attention key bias: its true gradient is 0, its entries ~1e-7 of
#: the rest are rounding noise).
BF16_U = 2.0 ** -8
RTOL_BF16_NORMS = 4 * BF16_U
RTOL_BF16_SUMS = 8 * BF16_U


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_bf16_autocast_matches_one_example_at_a_time(arch):
    model, batch, losses_of = _model_and_batch(arch, torch.float32)

    def autocast_losses(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return losses_of(model, batch).float()

    grads = _one_at_a_time(model, batch, autocast_losses)
    clip = _clip_between(_norms(grads))
    sums, norms, _ = _engine(model, batch, autocast_losses, clip)
    ref_norms = _norms(grads)
    assert float(((norms.double() - ref_norms) / ref_norms).abs().max()) <= RTOL_BF16_NORMS
    ref = _clipped_sum(grads, clip)
    scale = max(float(r.abs().max()) for r in ref)
    for s, r in zip(sums, ref):
        _assert_close(s, r, RTOL_BF16_SUMS, max(float(r.abs().max()), 1e-4 * scale))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the layers did run in bf16
        assert model(input_ids=batch["input_ids"]).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_of_the_model_is_exact(backend):
    """torch.compile works with the engine on CPU (dynamo traces the modules' hooks or breaks the graph
    at them; the grad outputs still reach the engine): the compiled GPT-2 gives the exact clipped sum,
    step after step. backend aot_eager runs dynamo and AOTAutograd, the parts that meet the hooks;
    inductor only generates the kernels of the traced graphs. One layer: compiling takes seconds per layer."""
    model, batch, losses_of = _gpt2(layers=1), _lm_batch(), _lm_losses
    grads = _one_at_a_time(model, batch, losses_of)
    clip = _clip_between(_norms(grads))
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        _compare(grads, _engine(compiled, batch, losses_of, clip), clip, RTOL)
