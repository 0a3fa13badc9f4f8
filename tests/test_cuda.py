"""On a GPU (every test skips without CUDA): the clipping engine, PrivateTrainer and the training
CLI on CUDA. CI has no GPU; these run in a lent GPU session (benchmarks/gpu_run.sh).

Independent references: the engine's clipped sum and norms on the CPU for the same model and
batch (float32 on both, TF32 off: the products differ only by summation order, ~1e-6 relative);
the Trainer's uninterrupted run on the same device for its resumed one.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def no_tf32():
    """Full float32 products on the GPU, so that the CPU is a reference to float32 rounding."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def _gpt2(device):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(device)


def _model(kind, device):
    torch.manual_seed(0)
    if kind == "gpt2":
        return _gpt2(device)
    if kind == "bert":  # three lookup tables (word, position, token type): their norms by token segments
        return transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=97,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).to(device)
    # a mixture of experts: routers re-run per example, experts by their own rule, both on flattened rows
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=97, max_position_embeddings=32, pad_token_id=0,
        bos_token_id=0, eos_token_id=0)).to(device)


def _clipped_sum(device, kind="gpt2"):
    """The engine's (sums, norms) for a model (GPT-2: tied head, shared (1, L) position ids, the
    probe runs) on a batch of 6 sequences of 24 tokens, each sequence's mean token loss, clip 0.5."""
    from corrnoise.torch.clipping.attribution import check_attribution
    from corrnoise.torch.clipping.engine import ClippingEngine

    model = _model(kind, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (6, 24), generator=g).to(device)

    def losses(batch):
        logits = model(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none").mean(1)

    engine = ClippingEngine(model, loss_reduction="mean", max_grad_norm=0.5)
    if kind == "mixtral":  # rows of the batch flattened: verified first
        assert check_attribution(engine, losses, ids).worst < 0.1
    for _ in range(2):  # the first step (checked against autograd) and one with weight grads out of autograd
        model.zero_grad(set_to_none=True)
        losses(ids).mean().backward()
        sums, norms = engine.clipped_sum(6)
        engine.clear()
    engine.detach()
    return [s.cpu() for s in sums], norms.cpu()


@pytest.mark.parametrize("kind", ["gpt2", "bert", "mixtral"])
def test_engine_clipped_sum_on_cuda_equals_the_cpu_one(kind):
    sums, norms = _clipped_sum("cuda", kind)
    ref_sums, ref_norms = _clipped_sum("cpu", kind)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=1e-6)
    assert (ref_norms > 0.5).any()  # clipping is active
    for got, want in zip(sums, ref_sums, strict=True):
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-4 * scale + 1e-7, (float((got - want).abs().max()), scale)


@pytest.mark.filterwarnings("ignore:a given seed fixes")
def test_private_trainer_on_cuda_resumes_to_the_same_run(tmp_path):
    """PrivateTrainer places the model on the GPU (use_cpu False); 4 steps straight against 2, a
    checkpoint, and a resumed trainer: the same parameters (float32 rounding of the same ops on the
    same device) and the same guarantee."""
    from test_hf_trainer import PRIVACY, TOL, _params, _trainer

    privacy = dict(PRIVACY, batching="auto", seed=5)
    straight = _trainer(tmp_path / "straight", privacy=privacy, max_steps=4, use_cpu=False)
    straight.train()
    assert all(p.device.type == "cuda" for p in straight.model.parameters())
    first = _trainer(tmp_path / "run", privacy=privacy, max_steps=4, use_cpu=False, save_strategy="steps",
                     save_steps=2)
    first.train()
    resumed = _trainer(tmp_path / "run", privacy={k: v for k, v in privacy.items() if k != "seed"}, max_steps=4,
                       use_cpu=False)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-2"))
    assert resumed.private_optimizer.steps_taken == 4
    for name, p in _params(resumed.model).items():
        torch.testing.assert_close(p, _params(straight.model)[name], **TOL, msg=name)
    eps = resumed.privacy_spent().epsilon
    assert eps == straight.privacy_spent().epsilon and math.isfinite(eps)


def test_the_training_cli_runs_on_cuda():
    from click.testing import CliRunner

    from corrnoise.cli import cli

    result = CliRunner().invoke(cli, ["train", "--dataset", "digits", "--mechanism", "bsr:4", "--epsilon", "4",
                                       "--delta", "1e-5", "--epochs", "1", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "cuda" in result.output and "test_accuracy" in result.output
