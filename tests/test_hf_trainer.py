"""PrivateTrainer (corrnoise.integrations.transformers): the Hugging Face Trainer with the private
optimizer -- one noise row per logical batch whatever the gradient accumulation, per-example
losses, no raw clipping or raw grad norm in the logs, epsilon logged, checkpoints that resume the
same noise stream and sampler; two gloo processes (as torchrun starts them) making the updates of
one; GPT-2, BERT and LoRA. Tiny random-init models built from configs."""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from corrnoise.errors import CorrnoiseError  # noqa: E402
from corrnoise.integrations import PrivacyArguments, PrivateTrainer  # noqa: E402
from corrnoise.integrations.transformers import PLAN_FILE  # noqa: E402

V, L, N = 64, 8, 32
PRIVACY = dict(mechanism="bsr:2", batching="cyclic", noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0,
               noise_seed=0)
#: float32 runs that differ only in how a logical batch is cut into micro-batches (or in a resume):
#: the per-example gradients are the same up to float32 rounding of differently shaped matmuls
#: (~1e-7 relative), summed over a few steps
TOL = dict(rtol=1e-5, atol=1e-6)
seeded = pytest.mark.filterwarnings("ignore:a given seed fixes")
#: TrainingArguments' checkpointing switch: transformers 5.x renamed gradient_checkpointing to
#: activation_checkpointing (the old name warns there; v6 drops it)
CKPT = ("activation_checkpointing" if "activation_checkpointing" in inspect.signature(transformers.TrainingArguments)
        .parameters else "gradient_checkpointing")


def _checkpointing_on(model) -> bool:
    flag = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")
    return bool(getattr(model, flag))


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=V, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


class _Texts(torch.utils.data.Dataset):
    """Tokenizer-style examples of random lengths, padded with 0 on the right: LM labels are the
    ids with -100 on padding; classification labels one of 3 classes."""

    def __init__(self, task="lm", n=N):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, V, (n, L), generator=g)
        self.lengths = torch.randint(2, L + 1, (n,), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)
        self.task = task

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(L) < self.lengths[i]).long()
        ids = self.ids[i].masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100) if self.task == "lm" else self.classes[i]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _args(tmp_path, **kw):
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                   max_steps=2, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                   logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    options.update(kw)
    return transformers.TrainingArguments(**options)


def _trainer(tmp_path, model=None, task="lm", privacy=PRIVACY, **kw):
    return PrivateTrainer(model=model or _gpt2(), args=_args(tmp_path, **kw), train_dataset=_Texts(task),
                          privacy=privacy)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _one_line(err, param):
    assert err.value.param == param and "\n" not in str(err.value), str(err.value)


@seeded
@pytest.mark.parametrize("per_device, accumulation", [(2, 2), (1, 4)])
def test_gradient_accumulation_gives_the_update_of_the_whole_logical_batch(tmp_path, per_device, accumulation):
    """Poisson batches of expected size 4 as one micro-batch, or cut into 2 or 4 micro-batches
    (some empty when the batch drew fewer than 4): the same noise row per step, the same update."""
    privacy = dict(PRIVACY, mechanism="identity", batching="poisson", seed=3)
    whole = _trainer(tmp_path / "whole", privacy=privacy, per_device_train_batch_size=4, max_steps=3)
    whole.train()
    cut = _trainer(tmp_path / "cut", privacy=privacy, per_device_train_batch_size=per_device,
                   gradient_accumulation_steps=accumulation, max_steps=3)
    cut.train()
    sizes = [len(cut.private_optimizer.sampler.batch(t)) for t in range(3)]
    if accumulation == 4:
        assert min(sizes) < 4  # some micro-batch was empty
    assert whole.private_optimizer.expected_batch_size == cut.private_optimizer.expected_batch_size == 4
    assert whole.private_optimizer.steps_taken == cut.private_optimizer.steps_taken == cut.state.global_step == 3
    for name, p in _params(cut.model).items():
        torch.testing.assert_close(p, _params(whole.model)[name], **TOL, msg=name)
    # the logged loss is each step's mean over its examples, however the step is cut (an empty
    # micro-batch halved it before)
    logged = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (whole, cut)]
    assert len(logged[0]) == 3 and logged[1] == pytest.approx(logged[0], rel=1e-3)


@seeded
def test_a_trainer_that_divides_the_loss_by_the_accumulation_steps_trains_the_same_run(tmp_path):
    """transformers < 5.19 divide the loss compute_loss returns by the accumulation steps before
    backward for a model that takes no loss keywords (newer ones, told the loss is not scaled, the
    same division; both forced below). With a clip of 20 (per-example norms here are about 4) a
    divided loss would shrink the update 2x; the unit gradient at the micro-batch's mean keeps it
    the whole batch's update."""
    privacy = dict(PRIVACY, mechanism="identity", batching="poisson", seed=3, max_grad_norm=20.0,
                   noise_multiplier=0.5)
    whole = _trainer(tmp_path / "whole", privacy=privacy, per_device_train_batch_size=4, max_steps=2)
    whole.train()
    cut = _trainer(tmp_path / "cut", privacy=privacy, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                   max_steps=2)
    cut.loss_is_scaled_for_ga = False  # transformers >= 5.19: then it divides
    cut.model_accepts_loss_kwargs = False  # older ones divide for a model without loss kwargs (BERT's, say)
    divided = []
    backward = cut.accelerator.backward
    cut.accelerator.backward = lambda loss, **kw: (divided.append(loss.grad_fn.name()), backward(loss, **kw))[1]
    cut.train()
    assert divided and all("Div" in name for name in divided)  # the Trainer did divide what reached backward
    for name, p in _params(cut.model).items():
        torch.testing.assert_close(p, _params(whole.model)[name], **TOL, msg=name)


@seeded
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_gives_the_update_without_it(tmp_path, reentrant):
    """The Trainer's gradient_checkpointing recomputes each block's forward during backward; the
    clipping engine counts each layer once (its recomputed call), so the run is the same run."""
    privacy = dict(PRIVACY, seed=3)
    plain = _trainer(tmp_path / "plain", privacy=privacy, max_steps=2)
    plain.train()
    ckpt = _trainer(tmp_path / "ckpt", privacy=privacy, max_steps=2,
                    **{CKPT: True, f"{CKPT}_kwargs": {"use_reentrant": reentrant}})
    ckpt.train()
    assert _checkpointing_on(ckpt.model)
    for name, p in _params(ckpt.model).items():
        torch.testing.assert_close(p, _params(plain.model)[name], **TOL, msg=name)


def test_logged_grad_norm_is_the_released_update_and_epsilon_is_logged(tmp_path):
    """SGD at a constant learning rate moves the parameters by lr x the released (clipped,
    noised) gradient: the logged grad_norm is its norm, not the raw gradient's (which is not
    private). TrainingArguments.max_grad_norm clips nothing. epsilon is the run's guarantee."""
    model = _gpt2()
    before = _params(model)
    trainer = _trainer(tmp_path, model=model, privacy=dict(PRIVACY, mechanism="identity"), max_steps=1,
                       gradient_accumulation_steps=2,
                       per_device_train_batch_size=2, max_grad_norm=1e-3)
    trainer.train()
    step = trainer.state.log_history[0]
    moved = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p - before[n])
                                                  for n, p in _params(model).items()]))
    assert step["grad_norm"] == pytest.approx(float(moved) / 0.05, rel=1e-4)

    raw_model = _gpt2()
    batch = torch.utils.data.default_collate([_Texts()[i] for i in trainer.private_optimizer.sampler.batch(0)])
    raw_model(**batch).loss.backward()
    raw = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in raw_model.parameters()])))
    assert abs(step["grad_norm"] - raw) > 0.5 * raw
    assert step["epsilon"] == trainer.privacy_spent().epsilon == trainer.private_optimizer.run_guarantee().epsilon
    assert trainer.state.log_history[-1]["epsilon"] == step["epsilon"]  # the final train metrics too


def test_causal_lm_loss_is_a_mean_of_per_example_token_means(tmp_path):
    """Each example's loss is its own mean token loss (shifted by one), not scaled by the other
    examples' lengths: the batch loss is the mean of the examples' losses taken alone."""
    trainer = _trainer(tmp_path)
    model = trainer.model.train()
    batch = torch.utils.data.default_collate([_Texts()[i] for i in range(4)])
    with torch.no_grad():
        together = trainer.compute_loss(model, dict(batch))
        alone = [trainer.compute_loss(model, {k: v[i:i + 1] for k, v in batch.items()}) for i in range(4)]
        first = model(**{k: v[:1] for k, v in batch.items()}).loss  # HF's loss of one example alone
    assert float(together) == pytest.approx(sum(float(a) for a in alone) / 4, rel=1e-5)
    assert float(alone[0]) == pytest.approx(float(first), rel=1e-5)


def test_bert_classifier_trains_with_per_example_cross_entropy(tmp_path):
    """Training loss = the built-in (mean of per-example cross entropies); evaluation during
    training uses the Trainer's own loss and leaves the private step alone."""
    trainer = PrivateTrainer(model=_bert(), args=_args(tmp_path, eval_strategy="steps", eval_steps=1),
                             train_dataset=_Texts("cls"), eval_dataset=_Texts("cls", n=8),
                             privacy=PrivacyArguments(**PRIVACY))
    model = trainer.model.train()
    batch = torch.utils.data.default_collate([_Texts("cls")[i] for i in range(4)])
    with torch.no_grad():
        assert float(trainer.compute_loss(model, dict(batch))) == pytest.approx(float(model(**batch).loss), rel=1e-5)
    before = _params(model)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2
    assert sum("eval_loss" in entry for entry in trainer.state.log_history) == 2
    assert any(not torch.equal(p, before[n]) for n, p in _params(model).items())
    with pytest.raises(CorrnoiseError, match=r"trained already \(2 of its plan's 2 steps\)") as err:
        trainer.train()
    _one_line(err, "train")


def test_lora_via_peft_updates_only_the_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                         lora_dropout=0.0, task_type="CAUSAL_LM"))
    before = _params(model)
    trainer = _trainer(tmp_path, model=model)
    trainer.train()
    changed = {n for n, p in _params(model).items() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {id(p) for p in trainer.private_optimizer.params} == {id(p) for p in model.parameters() if p.requires_grad}


@seeded
def test_resumed_checkpoint_continues_the_noise_stream_and_the_sampler(tmp_path):
    """4 steps straight vs 2 steps, a checkpoint, and a new trainer resuming it: the same final
    parameters and guarantee. bsr:2 keeps recent noise rows; block-cyclic Poisson batches (the
    plan's batching for it) come from a sampler seed the checkpoint carries (the resumed run
    does not pass it); the checkpoint's plan is adopted."""
    privacy = dict(PRIVACY, batching="auto", seed=5)
    straight = _trainer(tmp_path / "straight", privacy=privacy, max_steps=4)
    straight.train()

    first = _trainer(tmp_path / "run", privacy=privacy, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    checkpoint = os.path.join(tmp_path, "run", "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, PLAN_FILE))
    with pytest.raises(CorrnoiseError) as err:  # another noise seed would restart C^-1 Z mid-run
        _trainer(tmp_path / "run", privacy=dict(privacy, noise_seed=1), max_steps=4).train(checkpoint)
    _one_line(err, "noise_seed")
    with pytest.raises(CorrnoiseError) as err:  # the checkpoint's plan continues the run
        _trainer(tmp_path / "run", privacy=dict(privacy, mechanism="bsr:3"), max_steps=4).train(checkpoint)
    _one_line(err, "mechanism")
    resumed = _trainer(tmp_path / "run", privacy={k: v for k, v in privacy.items() if k != "seed"}, max_steps=4)
    resumed.train(resume_from_checkpoint=checkpoint)

    assert resumed.private_optimizer.steps_taken == 4 and resumed.state.global_step == 4
    assert resumed.private_optimizer.sampler.seed == 5
    for name, p in _params(resumed.model).items():
        torch.testing.assert_close(p, _params(straight.model)[name], **TOL, msg=name)
    assert resumed.privacy_spent().epsilon == straight.privacy_spent().epsilon
    assert math.isfinite(resumed.privacy_spent().epsilon)


@seeded
def test_a_resumed_run_with_dropout_draws_the_masks_of_the_uninterrupted_run(tmp_path):
    """GPT-2 with dropout: 4 steps straight vs a checkpoint at step 2 resumed by a new trainer end
    at the same parameters. The Trainer restores the checkpoint's generator state before the
    resumed pass starts, and the pass drew from it (DataLoader's worker seed): the resumed run
    ended 1.5e-3 away."""
    def dropout_gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=16,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)

    privacy = dict(PRIVACY, seed=5)
    straight = _trainer(tmp_path / "straight", model=dropout_gpt2(), privacy=privacy, max_steps=4)
    straight.train()
    _trainer(tmp_path / "run", model=dropout_gpt2(), privacy=privacy, max_steps=4, save_strategy="steps",
             save_steps=2).train()
    resumed = _trainer(tmp_path / "run", model=dropout_gpt2(), privacy=privacy, max_steps=4)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-2"))
    assert resumed.private_optimizer.steps_taken == 4
    for name, p in _params(resumed.model).items():
        torch.testing.assert_close(p, _params(straight.model)[name], **TOL, msg=name)


class _StopAt(transformers.TrainerCallback):
    """Interrupts training after ``step`` steps (as a killed job would, after its checkpoint)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@seeded
def test_a_save_only_model_checkpoint_is_refused_by_a_private_resume(tmp_path):
    """save_only_model=True saves models (allowed) but no optimizer.pt: resuming from such a
    checkpoint would start the private optimizer again at step 0 while the Trainer's global step
    goes on (found by a user probe: 4 private steps from step 0 after global step 4, the sampler's
    first batches and the same noise rows again). Refused in one line, before any training."""
    first = PrivateTrainer(model=_gpt2(), args=_args(tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=4,
                                                     save_only_model=True),
                           train_dataset=_Texts(), privacy=PRIVACY, callbacks=[_StopAt(4)])
    first.train()
    checkpoint = os.path.join(tmp_path, "run", "checkpoint-4")
    assert os.path.isfile(os.path.join(checkpoint, "model.safetensors"))
    assert not os.path.exists(os.path.join(checkpoint, "optimizer.pt"))
    resumed = _trainer(tmp_path / "run", max_steps=8, save_only_model=True)
    before = _params(resumed.model)
    with pytest.raises(CorrnoiseError) as err:
        resumed.train(resume_from_checkpoint=checkpoint)
    _one_line(err, "resume_from_checkpoint")
    assert "save_only_model=True" in str(err.value) and "step 0" in str(err.value)
    assert resumed.private_optimizer is None  # refused before the private optimizer was made
    for name, p in _params(resumed.model).items():
        assert torch.equal(p, before[name]), name
    with pytest.raises(CorrnoiseError) as err:  # also as the latest checkpoint of output_dir
        _trainer(tmp_path / "run", max_steps=8).train(resume_from_checkpoint=True)
    _one_line(err, "resume_from_checkpoint")


class _MovesTheStep(transformers.TrainerCallback):
    """A callback that moves the Trainer's step counter (off the private optimizer's count)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            state.global_step += 1


@seeded
def test_the_trainers_global_step_is_the_private_optimizers_steps_taken(tmp_path):
    """At a resume and at every step, state.global_step must be the number of noise rows the
    private optimizer released: a checkpoint whose trainer state says step 1 while its optimizer
    state is at step 2 (files from other steps), or a callback that moves the step, is refused
    in one line before the next step trains."""
    _trainer(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2).train()
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "run" / "checkpoint-2", mixed)
    state = json.loads((mixed / "trainer_state.json").read_text())
    state["global_step"] = 1
    (mixed / "trainer_state.json").write_text(json.dumps(state))
    resumed = _trainer(tmp_path / "run", max_steps=4)
    with pytest.raises(CorrnoiseError) as err:
        resumed.train(resume_from_checkpoint=str(mixed))
    _one_line(err, "resume_from_checkpoint")
    assert "global step is 1" in str(err.value) and "released 2 noise row(s)" in str(err.value)
    assert resumed.private_optimizer.steps_taken == 2  # nothing trained after the checkpoint's state

    moved = PrivateTrainer(model=_gpt2(), args=_args(tmp_path / "moved", max_steps=4), train_dataset=_Texts(),
                           privacy=PRIVACY, callbacks=[_MovesTheStep()])
    with pytest.raises(CorrnoiseError) as err:
        moved.train()
    _one_line(err, "global_step")
    assert "global step is 2" in str(err.value) and "released 1 noise row(s)" in str(err.value)
    assert moved.private_optimizer.steps_taken == 1

@seeded
def test_a_lora_checkpoint_resumes_to_the_same_run(tmp_path):
    """With peft the Trainer's checkpoint holds the adapters only; resumed from it, the run ends
    with the adapters and guarantee of the uninterrupted run (the noise state covers only them)."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(_gpt2(), peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=4,
                                                             target_modules=["c_attn"], fan_in_fan_out=True))

    privacy = dict(PRIVACY, batching="auto", seed=5)
    straight = _trainer(tmp_path / "straight", model=lora(), privacy=privacy, max_steps=4)
    straight.train()
    _trainer(tmp_path / "run", model=lora(), privacy=privacy, max_steps=4, save_strategy="steps", save_steps=2).train()
    resumed = _trainer(tmp_path / "run", model=lora(), privacy={k: v for k, v in privacy.items() if k != "seed"},
                       max_steps=4)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "run", "checkpoint-2"))
    want = _params(straight.model)
    adapters = [n for n, p in resumed.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    for name in adapters:
        torch.testing.assert_close(_params(resumed.model)[name], want[name], **TOL, msg=name)
    assert resumed.privacy_spent().epsilon == straight.privacy_spent().epsilon


#: the 2-process run: bsr:2 keeps recent noise rows (sharded across the ranks), block-cyclic
#: Poisson batches (the plan's batching for it) with a given sampler seed, float64 parameters
DDP_PRIVACY = dict(PRIVACY, batching="auto", seed=5)
#: float64 runs that differ in where sums are taken: each rank sums its examples' clipped
#: gradients and the sums are all-reduced (another order of additions), per-example gradients
#: come from other micro-batch shapes (another blocking of the matmuls), and the noise row is
#: generated in shards (another length of the mechanism's kernels) -- each a few ulps (2^-52
#: ~ 2.2e-16) relative to gradients of size <= the clip norm 1, over 4 SGD steps of lr 0.05 on
#: parameters of size <= ~1 that move by ~0.05: observed differences ~1e-17 absolute; the bound
#: 1e-12 leaves room for those ulps propagating through the nonlinear steps, and is ~1e10 times
#: smaller than what one missing all-reduce or a second noise row would change (~1e-2)
DDP_TOL = dict(rtol=1e-12, atol=1e-12)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One torchrun-like rank: accelerate initializes the gloo process group from the
    environment and wraps the model in DDP. Trains 4 steps (checkpoint at 2), resumes the
    checkpoint in a new trainer, and records what mechanism="auto" says."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out = Path(out_dir)
    # 1 x 4 accumulation x 2 ranks: a rank's share of 3 (steps 2, 3) leaves it an empty micro-batch
    # while the other rank trains on its own, so no collective may hide in forward or backward
    ddp = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=4)
    record: dict = {}
    try:
        try:
            _trainer(out / "auto", privacy=dict(PRIVACY, mechanism="auto"), **ddp).train()
        except CorrnoiseError as exc:
            record["auto"] = (exc.param, str(exc))
        straight = _trainer(out / "run", model=_gpt2().double(), privacy=DDP_PRIVACY, save_strategy="steps",
                            save_steps=2, **ddp)
        straight.train()
        record["wrapped"] = type(straight.model_wrapped).__name__
        record["straight"] = _params(straight.model)
        record["straight_epsilon"] = straight.privacy_spent().epsilon
        resumed = _trainer(out / "run", model=_gpt2().double(), privacy={k: v for k, v in DDP_PRIVACY.items()
                                                                          if k != "seed"}, **ddp)
        resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
        record["resumed"] = _params(resumed.model)
        record["resumed_steps"] = (resumed.private_optimizer.steps_taken, resumed.state.global_step)
        record["resumed_epsilon"] = resumed.privacy_spent().epsilon
        torch.save(record, out / f"rank{rank}.pt")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@seeded
def test_two_processes_make_the_updates_of_one_and_resume_a_checkpoint(tmp_path):
    """2 gloo processes (as torchrun starts them) x 1 per device x 4 accumulation = the logical
    batch of 1 process x 4 x 2: the same sampler batches, noise rows and final parameters, up to
    float64 rounding; a 2-process checkpoint resumes to the same parameters and guarantee; and
    mechanism="auto" is refused in one line asking for a plan."""
    from conftest import free_port, spawn_ranks

    spawn_ranks(_ddp_worker, (2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    single = _trainer(tmp_path / "single", model=_gpt2().double(), privacy=DDP_PRIVACY,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4)
    single.train()
    want = _params(single.model)
    for r, got in enumerate(ranks):
        param, message = got["auto"]
        assert param == "mechanism" and "plan=" in message and "\n" not in message, message
        assert got["wrapped"] == "DistributedDataParallel"
        assert got["resumed_steps"] == (4, 4)
        assert got["straight_epsilon"] == got["resumed_epsilon"] == single.privacy_spent().epsilon
        for run in ("straight", "resumed"):
            for name, p in got[run].items():
                torch.testing.assert_close(p, want[name], **DDP_TOL, msg=f"rank {r} {run} {name}")
                assert torch.equal(p, ranks[0][run][name])  # every rank made the identical update
    with pytest.raises(CorrnoiseError) as err:  # one process holds none of rank 1's noise shard
        _trainer(tmp_path / "run", model=_gpt2().double(), privacy=DDP_PRIVACY, per_device_train_batch_size=4,
                 gradient_accumulation_steps=2, max_steps=4).train(str(tmp_path / "run" / "checkpoint-2"))
    _one_line(err, "resume_from_checkpoint")


def _mixtral(**kw):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                                     num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=V,
                                     max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0, **kw)
    return transformers.MixtralForCausalLM(cfg)


@seeded
def test_a_collator_that_returns_a_batch_encoding_trains_through_empty_micro_batches(tmp_path):
    """transformers' collators return a BatchEncoding; with Poisson batches cut into 4 micro-batches
    a step has several empty ones, which were one shared object (the training stopped at the
    second, "not a batch of the private train loader"). Now every step is taken."""
    def collate(items):
        return transformers.BatchEncoding(transformers.default_data_collator(items))

    privacy = dict(PRIVACY, mechanism="identity", batching="poisson", seed=3)
    trainer = PrivateTrainer(model=_gpt2(), args=_args(tmp_path, per_device_train_batch_size=1,
                                                       gradient_accumulation_steps=4, max_steps=6),
                             train_dataset=_Texts(), data_collator=collate, privacy=privacy)
    trainer.train()
    sizes = [len(trainer.private_optimizer.sampler.batch(t)) for t in range(6)]
    assert min(sizes) <= 2  # a step with two or more empty micro-batches
    assert trainer.private_optimizer.steps_taken == trainer.state.global_step == 6


def _left_padded(rows, width):
    """A causal LM batch as a tokenizer with padding_side="left" makes it (pad id 0, labels -100 there)."""
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_a_left_padded_batch_gives_each_example_the_loss_and_gradient_it_has_alone(tmp_path):
    """Found in review: with left padding (many chat tokenizers' default) an example's tokens sit at
    positions set by the longest example of its batch, so its loss and the gradient clipped as its
    own depended on the others (4.0957 next to a 2-token example, 4.2198 next to a 12-token one),
    and the attribution check, cutting rows out of the padded batch, did not see it. The trainer
    now moves each row's padding to its end: example A's loss and gradient are those of A alone,
    whoever shares its batch (float64)."""
    trainer = _trainer(tmp_path, model=_gpt2().double())
    model = trainer.model
    a, short, long_ = [5, 6, 7], [8, 9], list(range(10, 18))
    params = [p for p in model.parameters()]

    def loss_and_grad(rows, width):
        losses, _ = trainer._example_losses(model, _left_padded(rows, width))
        return losses[0], torch.autograd.grad(losses[0], params)

    alone = loss_and_grad([a], len(a))
    for rows in ([a, short], [a, long_]):
        loss, grads = loss_and_grad(rows, max(map(len, rows)))
        torch.testing.assert_close(loss, alone[0], rtol=1e-12, atol=0)
        for g, ref in zip(grads, alone[1]):
            torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)
    # the rows as the model saw them: A's tokens first, its padding after, the labels with them
    moved = _right_aligned_batch(_left_padded([a, long_], 8))
    assert moved["input_ids"][0].tolist() == a + [0] * 5 and moved["labels"][0].tolist() == a + [-100] * 5
    assert moved["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and moved["input_ids"][1].tolist() == long_


def _right_aligned_batch(batch, config=None):
    from corrnoise.integrations.transformers import _right_aligned

    return _right_aligned(batch, config)


def test_left_padding_that_cannot_be_moved_is_refused_in_one_line(tmp_path):
    """An encoder-decoder model's left-padded encoder input (its labels run along the decoder's
    positions), and a left-padded batch with another tensor of the tokens' shape (which may or may
    not run along them): one line naming the collator, suggesting right padding."""
    batch = _left_padded([[5, 6, 7], [8, 9, 10, 11]], 4)
    with pytest.raises(CorrnoiseError, match="padding_side = 'right'") as err:
        _right_aligned_batch(batch, transformers.T5Config())
    _one_line(err, "data_collator")
    with pytest.raises(CorrnoiseError, match="pixel_mask has the tokens' shape") as err:
        _right_aligned_batch(dict(batch, pixel_mask=torch.ones(2, 4)))
    _one_line(err, "data_collator")
    right = {k: v.flip(1) for k, v in batch.items()}  # padded on the right: returned as it is
    assert _right_aligned_batch(right, transformers.T5Config()) is right


def test_a_mixture_of_experts_fine_tunes_its_experts_and_refuses_the_router_loss(tmp_path):
    """Mixtral's routers and experts train under PrivateTrainer (its first batch's check verifies the
    flattened rows); a model configured to add the routers' load-balancing loss, which the
    per-example loss would silently leave out, is refused in one line -- also under LoRA."""
    peft = pytest.importorskip("peft")
    model = _mixtral()
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    before = experts.detach().clone()
    trainer = _trainer(tmp_path, model=model)
    trainer.train()
    assert float((experts.detach() - before).abs().max()) > 0
    assert trainer.private_optimizer.attribution_checked and trainer.private_optimizer.steps_taken == 2
    for aux in (_mixtral(output_router_logits=True),
                peft.get_peft_model(_mixtral(output_router_logits=True), peft.LoraConfig(r=2, target_modules=["q_proj"]))):
        with pytest.raises(CorrnoiseError) as err:
            _trainer(tmp_path, model=aux)
        _one_line(err, "output_router_logits")


def test_gpt_oss_trains_its_attention_sinks_and_experts(tmp_path):
    """GPT-OSS: its attention owns its sinks and its experts have biases and transposed weights, so
    both are re-run per example (the experts on their flattened rows, once checked)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=V,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    sinks = model.model.layers[0].self_attn.sinks
    before = sinks.detach().clone()
    trainer = _trainer(tmp_path, model=model)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2 and float((sinks.detach() - before).abs().max()) > 0


@pytest.mark.parametrize("setting, param", [
    (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
    (dict(torch_compile=True), "torch_compile"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size"),
])
def test_settings_that_look_at_the_data_outside_the_mechanism_are_refused(tmp_path, setting, param):
    with pytest.raises(CorrnoiseError) as err:
        _trainer(tmp_path, **setting)
    _one_line(err, param)


def test_a_custom_train_sampler_is_refused(tmp_path):
    class Sorted(PrivateTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    with pytest.raises(CorrnoiseError) as err:
        Sorted(model=_gpt2(), args=_args(tmp_path), train_dataset=_Texts(), privacy=PRIVACY)
    _one_line(err, "_get_train_sampler")


def test_a_given_plan_is_trained_as_planned(tmp_path):
    from corrnoise.runplan import plan_run

    plan = plan_run(dataset_size=N, batch_size=4, delta=1e-5, mechanism="bsr:2", batching="cyclic",
                    noise_multiplier=1.0, steps=2)
    trainer = PrivateTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=-1), train_dataset=_Texts(), plan=plan,
                             privacy=dict(max_grad_norm=1.0, noise_seed=0))
    trainer.train()
    assert trainer.plan is plan and trainer.state.global_step == trainer.private_optimizer.steps_taken == 2
    with pytest.raises(CorrnoiseError) as err:  # a length that is not the plan's
        PrivateTrainer(model=_gpt2(), args=_args(tmp_path, max_steps=3), train_dataset=_Texts(), plan=plan,
                       privacy=dict(max_grad_norm=1.0)).train()
    _one_line(err, "max_steps")
    with pytest.raises(CorrnoiseError) as err:  # planning keywords beside a plan
        PrivateTrainer(model=_gpt2(), args=_args(tmp_path), train_dataset=_Texts(), plan=plan,
                       privacy=dict(max_grad_norm=1.0, epsilon=3.0)).train()
    _one_line(err, "epsilon")


def test_the_clip_norm_defaults_to_training_arguments_which_stay_unchanged(tmp_path):
    args = _args(tmp_path, max_grad_norm=0.5)
    privacy = {k: v for k, v in PRIVACY.items() if k != "max_grad_norm"}
    trainer = PrivateTrainer(model=_gpt2(), args=args, train_dataset=_Texts(), privacy=privacy)
    trainer.get_train_dataloader()
    assert trainer.private_optimizer.max_grad_norm == 0.5
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.ignore_data_skip  # the trainer's copy
    assert args.max_grad_norm == 0.5 and not args.ignore_data_skip


@seeded
def test_after_training_the_model_is_plain_again_and_a_second_trainer_trains_it(tmp_path):
    # the engine's hooks leave the model when train() ends: a plain backward gives every weight
    # gradient (a hooked layer's would be missing), and a trainer built again on it (a notebook
    # cell run again, a second phase) trains without taking anything over
    import warnings

    model = _gpt2()
    _trainer(tmp_path / "a", model=model).train()
    model.zero_grad(set_to_none=True)
    batch = {k: torch.stack([_Texts()[i][k] for i in range(4)]) for k in ("input_ids", "attention_mask", "labels")}
    for _ in range(2):
        model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    second = _trainer(tmp_path / "b", model=model, max_steps=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*already had a clipping engine")
        second.train()
    assert second.state.global_step == 3


def _gpt2_with_a_position_table():
    """GPT-2 plus a trainable Linear called on a (L, d) table without the batch, its output added to
    every example's embeddings: with batches of L examples the engine takes positions for examples."""
    model = _gpt2()
    model.transformer.extra = torch.nn.Linear(64, 64)
    table = torch.randn(L, 64)
    model.transformer.drop.register_forward_hook(lambda m, args, out: out + model.transformer.extra(table))
    return model


def test_the_first_batch_checks_per_example_attribution_before_any_noise(tmp_path):
    trainer = _trainer(tmp_path, model=_gpt2_with_a_position_table(), per_device_train_batch_size=L)
    with pytest.raises(CorrnoiseError, match="transformer.extra") as err:
        trainer.train()
    _one_line(err, "model")
    assert trainer.private_optimizer.steps_taken == 0 and trainer.private_optimizer.privatizer.step == 0
    plain = _trainer(tmp_path / "plain")
    plain.train()
    assert plain.attribution_report.worst < 0.1 and plain.attribution_report.batch_size == 4
    unchecked = PrivateTrainer(model=_gpt2(), args=_args(tmp_path / "off"), train_dataset=_Texts(), privacy=PRIVACY,
                               check_attribution=False)
    unchecked.train()
    assert unchecked.attribution_report is None and unchecked.private_optimizer.steps_taken == 2


def test_opt_whose_mlp_sees_the_batch_flattened_trains_after_the_check(tmp_path):
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2, vocab_size=V, max_position_embeddings=16,
        word_embed_proj_dim=32, pad_token_id=0, dropout=0.0))
    before = _params(model)
    trainer = _trainer(tmp_path, model=model)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2
    assert "model.decoder.layers.0.fc1" in trainer.attribution_report.flattened
    assert not torch.equal(_params(model)["model.decoder.layers.0.fc1.weight"], before["model.decoder.layers.0.fc1.weight"])


class _Pairs(torch.utils.data.Dataset):
    """Sequence-to-sequence examples: a padded source and a target of 5 tokens."""

    def __init__(self):
        self.texts = _Texts()

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        row = self.texts[i]
        return {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"],
                "labels": self.texts.ids[(i + 1) % N, :5]}


def test_an_encoder_decoder_model_trains_with_decoder_inputs_made_from_its_labels(tmp_path):
    # T5 makes decoder_input_ids from labels only when it computes its own loss; the private loss
    # is computed per example outside it, so the trainer makes them (the labels shifted right)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=V, decoder_start_token_id=0,
        pad_token_id=0, dropout_rate=0.0))
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            p.requires_grad_(False)  # shared by the batch: refused when trainable
    before = _params(model)
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_Pairs(), privacy=PRIVACY)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2 and trainer.attribution_report.worst < 0.1
    changed = [n for n, p in _params(model).items() if not torch.equal(p, before[n])]
    assert any(n.startswith("decoder.") for n in changed) and any(n.startswith("encoder.") for n in changed)
    batch = {k: torch.stack([_Pairs()[i][k] for i in range(2)]) for k in ("input_ids", "attention_mask", "labels")}
    made = trainer._model_inputs(model, batch)["decoder_input_ids"]
    assert made[:, 0].tolist() == [0, 0] and torch.equal(made[:, 1:], batch["labels"][:, :-1])
    given = trainer._model_inputs(model, {**batch, "decoder_input_ids": batch["labels"]})
    assert given["decoder_input_ids"] is batch["labels"] and "labels" not in given


def _t5():
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=V, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0))
    for name, p in model.named_parameters():
        if "relative_attention_bias" in name:
            p.requires_grad_(False)
    return model


@seeded
def test_a_seq2seq_trainer_script_trains_the_same_run_and_evaluates_by_generation(tmp_path):
    """PrivateSeq2SeqTrainer: Seq2SeqTrainingArguments as a Seq2SeqTrainer script has them; its
    updates are PrivateTrainer's, and evaluation / prediction generate (predict_with_generate)."""
    from corrnoise.integrations import PrivateSeq2SeqTrainer

    assert issubclass(PrivateSeq2SeqTrainer, transformers.Seq2SeqTrainer)
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.05,
                   optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                   disable_tqdm=True, seed=0)
    models = []
    for cls, args in ((PrivateTrainer, transformers.TrainingArguments(**options)),
                      (PrivateSeq2SeqTrainer, transformers.Seq2SeqTrainingArguments(
                          **options, predict_with_generate=True))):
        model = _t5()
        trainer = cls(model=model, args=args, train_dataset=_Pairs(), privacy=dict(PRIVACY, seed=3))
        trainer.train()
        assert trainer.private_optimizer.steps_taken == 2
        models.append(_params(model))
    for name, p in models[0].items():
        torch.testing.assert_close(models[1][name], p, **TOL)
    out = trainer.predict(torch.utils.data.Subset(_Pairs(), range(3)))
    assert out.predictions.ndim == 2 and out.predictions.shape[0] == 3  # generated ids, not (n, T, V) logits
    assert out.predictions.dtype.kind == "i" and math.isfinite(out.metrics["test_loss"])


def test_bart_whose_decoder_position_embedding_is_shared_by_the_batch_trains_after_the_check(tmp_path):
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=V, max_position_embeddings=16,
        pad_token_id=0, decoder_start_token_id=0, dropout=0.0))
    before = _params(model)
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_Pairs(), privacy=PRIVACY)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2
    assert trainer.attribution_report.shared == ["model.decoder.embed_positions"]
    name = "model.decoder.embed_positions.weight"
    assert not torch.equal(_params(model)[name], before[name])


def test_decoder_inputs_without_the_models_own_rule_are_its_labels_shifted_right():
    # Whisper has no prepare_decoder_input_ids_from_labels: the start token, the labels shifted by
    # one, ignored positions (-100) as padding
    from corrnoise.integrations.transformers import _shifted_right

    config = transformers.PretrainedConfig(decoder_start_token_id=7, pad_token_id=0)
    labels = torch.tensor([[5, 6, 8, -100], [9, -100, -100, -100]])
    assert _shifted_right(labels, config, "M").tolist() == [[7, 5, 6, 8], [7, 9, 0, 0]]
    with pytest.raises(CorrnoiseError) as err:
        _shifted_right(labels, transformers.PretrainedConfig(pad_token_id=0), "M")
    _one_line(err, "model")


def test_whisper_trains_with_its_labels_shifted_right_as_decoder_inputs(tmp_path):
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, num_mel_bins=8, max_source_positions=16,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        dropout=0.0))
    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(N):
        labels = torch.full((6,), -100)
        labels[:2 + i % 4] = torch.randint(3, V, (2 + i % 4,), generator=g)
        data.append({"input_features": torch.randn(8, 32, generator=g), "labels": labels})
    before = _params(model)
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=data, privacy=PRIVACY)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2 and trainer.attribution_report.worst < 0.1
    assert not torch.equal(_params(model)["model.decoder.embed_tokens.weight"], before["model.decoder.embed_tokens.weight"])


def test_a_compute_loss_that_bypasses_the_per_example_losses_is_one_line(tmp_path):
    class TokenMean(PrivateTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss  # the batch's token mean: no per-example loss

    trainer = TokenMean(model=_gpt2(), args=_args(tmp_path), train_dataset=_Texts(), privacy=PRIVACY,
                        check_attribution=False)
    with pytest.raises(CorrnoiseError) as err:
        trainer.train()
    _one_line(err, "compute_loss")


def test_a_transformers_older_than_the_tested_ones_is_one_line(tmp_path, monkeypatch):
    from corrnoise.integrations.transformers import MIN_TRANSFORMERS

    monkeypatch.setattr(transformers, "__version__", "5.2.0")
    with pytest.raises(CorrnoiseError) as err:
        _trainer(tmp_path)
    _one_line(err, "transformers")
    assert f"older than {MIN_TRANSFORMERS}" in str(err.value)
    monkeypatch.setattr(transformers, "__version__", f"{MIN_TRANSFORMERS}.0rc1")  # a pre-release of the minimum
    _trainer(tmp_path)


def test_the_transformers_extra_asks_for_the_tested_minimum():
    import tomllib
    from pathlib import Path

    from corrnoise.integrations.transformers import MIN_TRANSFORMERS

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    for extra in ("transformers", "test"):
        assert f"transformers>={MIN_TRANSFORMERS}" in project["optional-dependencies"][extra], extra


def test_an_unknown_privacy_keyword_is_one_line(tmp_path):
    trainer = _trainer(tmp_path, privacy=dict(PRIVACY, max_noise_memry=10))
    with pytest.raises(CorrnoiseError) as err:
        trainer.get_train_dataloader()
    _one_line(err, "privacy")
    assert "max_noise_memry" in str(err.value)


@pytest.mark.parametrize("privacy, param", [(None, "privacy"), (dict(PRIVACY, steps=3), "steps"),
                                            (dict(PRIVACY, max_physical_batch_size=2), "max_physical_batch_size")])
def test_privacy_arguments_the_trainer_decides_are_refused(tmp_path, privacy, param):
    with pytest.raises(CorrnoiseError) as err:
        _trainer(tmp_path, privacy=privacy)
    _one_line(err, param)


@pytest.mark.parametrize("length, param", [(dict(max_steps=3), "TrainingArguments.max_steps"),
                                           (dict(max_steps=-1, num_train_epochs=1.5), "TrainingArguments.num_train_epochs")])
def test_a_planned_length_the_planner_cannot_take_names_the_training_argument(tmp_path, length, param):
    """The planner plans whole epochs (N // B = 32 // 4 = 8 steps here): a Trainer length of part of
    an epoch is refused before any planning, naming the TrainingArguments setting the user gave."""
    privacy = dict(mechanism="dpsgd", epsilon=8.0, delta=1e-5, max_grad_norm=1.0)
    with pytest.raises(CorrnoiseError) as err:
        _trainer(tmp_path, privacy=privacy, **length).get_train_dataloader()
    _one_line(err, param)


def test_the_readme_trainer_example_runs(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Private fine-tuning with the Hugging Face Trainer")[1].split("\n## ")[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["trainer"].private_optimizer.steps_taken == 8
    assert namespace["trainer"].privacy_spent().epsilon <= 8.0


def _sft_parts(tmp_path, **config):
    """A pre-tokenized datasets.Dataset (trl skips tokenizing it), a word-level tokenizer built by
    hand, and an SFTConfig for 2 steps."""
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    trl = pytest.importorskip("trl")
    texts = _Texts()
    rows = [texts.ids[i, : int(texts.lengths[i])].tolist() for i in range(N)]
    vocab = {f"t{i}": i for i in range(V)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1")), pad_token="t0",
        eos_token="t0")
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.05,
                   optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                   save_strategy="no", disable_tqdm=True, max_length=None, **{CKPT: False})
    options.update(config)
    return datasets.Dataset.from_dict({"input_ids": rows}), tokenizer, trl.SFTConfig(**options)


def test_trl_sft_trainer_trains_privately(tmp_path):
    train, tokenizer, config = _sft_parts(tmp_path)
    from corrnoise.integrations import PrivateSFTTrainer

    model = _gpt2()
    before = _params(model)
    trainer = PrivateSFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                                privacy=PRIVACY)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2
    assert trainer.state.log_history[0]["epsilon"] == trainer.privacy_spent().epsilon
    assert all(not torch.equal(p, before[n]) for n, p in _params(model).items() if "wte" in n)


@seeded
def test_trl_sft_with_gradient_checkpointing_is_the_same_run(tmp_path):
    """SFTConfig turns gradient checkpointing on by default: the private run with it equals the
    run without it (the engine counts each recomputed layer once)."""
    from corrnoise.integrations import PrivateSFTTrainer

    privacy = dict(PRIVACY, seed=3)
    runs = []
    for on in (False, True):
        train, tokenizer, config = _sft_parts(tmp_path / str(on), **{CKPT: on})
        trainer = PrivateSFTTrainer(model=_gpt2(), args=config, train_dataset=train, processing_class=tokenizer,
                                    privacy=privacy)
        trainer.train()
        assert _checkpointing_on(trainer.model) is on
        runs.append(_params(trainer.model))
    for name, p in runs[1].items():
        torch.testing.assert_close(p, runs[0][name], **TOL, msg=name)


@pytest.mark.parametrize("setting", ["packing", "padding_free"])
def test_trl_packing_is_refused(tmp_path, setting):
    train, tokenizer, config = _sft_parts(tmp_path, **{setting: True})
    from corrnoise.integrations import PrivateSFTTrainer

    with pytest.raises(CorrnoiseError) as err:
        PrivateSFTTrainer(model=_gpt2(), args=config, train_dataset=train, processing_class=tokenizer,
                          privacy=PRIVACY)
    _one_line(err, setting)


def _dpo_parts(tmp_path, pairs=12, **config):
    """A text preference dataset (prompt, chosen, rejected) of words the hand-built word-level
    tokenizer knows, and a DPOConfig for 2 steps of 4 pairs."""
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(5)

    def words(n_min, n_max):
        n = int(torch.randint(n_min, n_max + 1, (1,), generator=g))
        return " ".join(f"t{int(i)}" for i in torch.randint(2, V, (n,), generator=g))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(pairs):
        rows["prompt"].append(words(2, 4) + " ")
        rows["chosen"].append(words(1, 3))
        rows["rejected"].append(words(1, 3))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)},
                                                                          unk_token="t1")), pad_token="t0",
        eos_token="t0")
    tokenizer.backend_tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.05,
                   optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True,
                   save_strategy="no", disable_tqdm=True, max_length=None)
    options.update(config)
    return datasets.Dataset.from_dict(rows), tokenizer, trl.DPOConfig(**options)


def _policy_and_reference(dtype=torch.float32):
    """GPT-2 and its copy as the reference, the policy moved off it (at the reference every DPO
    loss is log 2, whatever the rows)."""
    reference = _gpt2().to(dtype)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=dtype))
    return policy, reference


def test_trl_dpo_trainer_trains_privately_one_pair_per_example(tmp_path):
    train, tokenizer, config = _dpo_parts(tmp_path)
    from corrnoise.integrations import PrivateDPOTrainer

    policy, reference = _policy_and_reference()
    before = _params(policy)
    trainer = PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                                processing_class=tokenizer, privacy=PRIVACY)
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2 and trainer.plan.dataset_size == 12  # pairs, not rows
    assert trainer.state.log_history[0]["epsilon"] == trainer.privacy_spent().epsilon
    # the rows are read pair-major once the first batch's check verified it (chosen and rejected
    # of one pair are one example's)
    assert trainer.attribution_report.worst < 1.0 and "transformer.wte" in trainer.attribution_report.flattened
    assert all(not torch.equal(p, before[n]) for n, p in _params(policy).items())


def test_trl_dpo_per_pair_losses_are_trls_and_each_pairs_gradient_its_own(tmp_path):
    """The pairs' losses average to trl's own DPO loss on the same batch (its fused LM head, its
    [chosen; rejected] rows), and in float64 the engine's gradient of each pair equals that pair's
    computed alone."""
    trl = pytest.importorskip("trl")
    from corrnoise.integrations import PrivateDPOTrainer
    from corrnoise.integrations.trl import _PairRows
    from corrnoise.torch.clipping import ClippingEngine, check_attribution

    train, tokenizer, config = _dpo_parts(tmp_path)
    policy, reference = _policy_and_reference(torch.float64)
    plain = trl.DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                           processing_class=tokenizer)
    rows = next(iter(plain.get_train_dataloader()))  # 4 pairs: (8, L) rows, chosen then rejected
    theirs = plain.compute_loss(plain.model, rows)
    trainer = PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                                processing_class=tokenizer, privacy=PRIVACY)
    pairs = _PairRows(lambda _: {k: v.clone() for k, v in rows.items()})([None] * 4)
    assert pairs["input_ids"].shape[:2] == (4, 2)
    torch.testing.assert_close(pairs["input_ids"][:, 1], rows["input_ids"][4:], rtol=0, atol=0)
    losses, _ = trainer._example_losses(policy, pairs)
    assert losses.shape == (4,) and float(losses.detach().std()) > 0
    # trl's fused head returns float32 log-probabilities: its loss is ours to float32's rounding
    # of sums of ~10 log-probabilities (a pair's rows swapped or mixed moves it by O(0.1))
    torch.testing.assert_close(losses.mean().float(), theirs, rtol=1e-5, atol=0)
    engine = ClippingEngine(policy, "mean", 1.0)
    report = check_attribution(engine, lambda b: trainer._example_losses(policy, b)[0], pairs, examples=4)
    assert report.worst < 1e-6
    engine.detach()


#: every per-pair loss of trl's DPOTrainer, with the settings it reads, and mixtures of them
DPO_LOSSES = [
    *[{"loss_type": [t]} for t in ("sigmoid", "hinge", "ipo", "sigmoid_norm", "nca_pair", "bco_pair", "sppo_hard",
                                   "apo_zero", "apo_down")],
    {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    {"loss_type": ["robust"], "label_smoothing": 0.2},
    {"loss_type": ["discopop"], "discopop_tau": 0.5},
    {"loss_type": ["sigmoid", "bco_pair", "ipo"], "loss_weights": [0.8, 0.2, 1.5]},
    {"loss_type": ["sigmoid", "hinge"], "f_divergence_type": "js_divergence"},
    {"loss_type": ["ipo"], "f_divergence_type": "forward_kl"},
    {"loss_type": ["robust"], "label_smoothing": 0.1, "f_divergence_type": "alpha_divergence",
     "f_alpha_divergence_coef": 0.3},
]


@pytest.mark.parametrize("setting", DPO_LOSSES, ids=lambda d: "-".join(map(str, d.values())).replace(" ", ""))
def test_trl_dpo_every_per_pair_loss_averages_to_trls(tmp_path, setting):
    """For each per-pair loss type, weighting and f-divergence trl defines, the pairs' losses
    average to trl's own loss on the same batch (float64 policy; trl's fused head gives float32
    log-probabilities, so to float32 rounding). A pair's chosen and rejected completions swapped
    move some pair's loss by far more (the check that the columns are read as chosen, rejected)."""
    trl = pytest.importorskip("trl")
    from corrnoise.integrations import PrivateDPOTrainer
    from corrnoise.integrations.trl import _PairRows

    train, tokenizer, config = _dpo_parts(tmp_path, beta=0.5, **setting)
    policy, reference = _policy_and_reference(torch.float64)
    plain = trl.DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                           processing_class=tokenizer)
    rows = next(iter(plain.get_train_dataloader()))
    theirs = plain.compute_loss(plain.model, rows)
    trainer = PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                                processing_class=tokenizer, privacy=PRIVACY)
    pairs = _PairRows(lambda _: {k: v.clone() for k, v in rows.items()})([None] * 4)
    losses, _ = trainer._example_losses(policy, pairs)
    assert losses.shape == (4,) and float(losses.detach().std()) > 1e-4
    torch.testing.assert_close(losses.mean().float(), theirs, rtol=2e-5, atol=1e-6)
    swapped = {**pairs, **{k: pairs[k].flip(1) for k in ("input_ids", "attention_mask", "completion_mask")}}
    moved = (trainer._example_losses(policy, swapped)[0] - losses).detach().abs().max()
    assert float(moved) > 1e-3, float(moved)


@pytest.mark.parametrize("setting,args", [
    ("loss_type", {"loss_type": ["sigmoid", "aot_unpaired"]}),
    ("loss_weights", {"loss_type": ["sigmoid", "hinge"], "loss_weights": [1.0]}),
    ("f_divergence_type", {"f_divergence_type": "chi2"}),
    ("f_divergence_type", {"loss_type": ["nca_pair"], "f_divergence_type": "forward_kl"}),
    ("label_smoothing", {"loss_type": ["exo_pair"], "label_smoothing": 0.0}),
    ("label_smoothing", {"loss_type": ["robust"], "label_smoothing": 0.5}),
    ("label_smoothing", {"label_smoothing": 0.1}),
])
def test_dpo_pair_losses_named_bad_settings_in_one_line(setting, args):
    """Called directly (trl's config checks nothing here), a bad setting is one line naming it."""
    import types

    pytest.importorskip("trl")
    from corrnoise.integrations.trl import dpo_pair_losses

    config = types.SimpleNamespace(beta=0.1, **args)
    logps = torch.zeros(2, 2)
    with pytest.raises(CorrnoiseError) as err:
        dpo_pair_losses(logps, logps, torch.ones(2, 2), config)
    _one_line(err, setting)


@pytest.mark.parametrize("setting,value", [("loss_type", ["aot"]), ("loss_type", ["sigmoid", "sft"]),
                                           ("use_weighting", True), ("ld_alpha", 0.5),
                                           ("label_smoothing", 0.1)])
def test_trl_dpo_settings_without_a_per_pair_loss_are_refused(tmp_path, setting, value):
    train, tokenizer, config = _dpo_parts(tmp_path, **{setting: value})
    from corrnoise.integrations import PrivateDPOTrainer

    policy, reference = _policy_and_reference()
    with pytest.raises(CorrnoiseError) as err:
        PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                          processing_class=tokenizer, privacy=PRIVACY)
    _one_line(err, setting)


@seeded
def test_trl_dpo_with_precomputed_reference_log_probabilities(tmp_path):
    """trl computes them with the initial policy and keeps no reference model: the first step's
    loss is log 2, the second's is not (a reference taken from the moving policy would stay at
    log 2 to float32 rounding, ~1e-7). The sampler is seeded: how far one step moves the loss
    depends on the batches (4.8e-4 with one OS-drawn seed)."""
    train, tokenizer, config = _dpo_parts(tmp_path, precompute_ref_log_probs=True)
    from corrnoise.integrations import PrivateDPOTrainer

    trainer = PrivateDPOTrainer(model=_gpt2(), args=config, train_dataset=train, processing_class=tokenizer,
                                privacy=dict(PRIVACY, seed=1))
    assert trainer.ref_model is None
    trainer.train()
    first, second = (entry["loss"] for entry in trainer.state.log_history[:2])
    assert first == pytest.approx(math.log(2), abs=1e-6) and abs(second - math.log(2)) > 1e-5


def test_trl_dpo_refuses_a_collator_without_trls_preference_rows():
    pytest.importorskip("trl")
    from corrnoise.integrations.trl import _PairRows

    rows = torch.zeros(6, 5, dtype=torch.long)
    for batch, what in (({"input_ids": rows, "attention_mask": rows}, "missing"),
                        ({"input_ids": rows[:5], "attention_mask": rows, "completion_mask": rows}, "(5, 5)")):
        with pytest.raises(CorrnoiseError) as err:
            _PairRows(lambda _, b=batch: dict(b))([None] * 3)
        _one_line(err, "data_collator")
        assert what in str(err.value)


def test_trl_dpo_refuses_a_collator_that_is_not_trls(tmp_path):
    """Found in review: a collator subclassing trl's that interleaves the rows (chosen 0, rejected 0,
    chosen 1, ...) has the right shapes, so pair j was read from rows j and B + j, two pairs' rows,
    each example in two clipping units, and the attribution check passed. Only trl's own
    preference collator is taken (by its exact class); trl's default one trains (the tests above)."""
    train, tokenizer, config = _dpo_parts(tmp_path)
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from corrnoise.integrations import PrivateDPOTrainer

    class Interleaved(DataCollatorForPreference):
        def torch_call(self, examples):
            out = super().torch_call(examples)
            b = len(examples)
            order = torch.stack([torch.arange(b), torch.arange(b) + b], 1).flatten()
            return {k: v[order] if k in ("input_ids", "attention_mask", "completion_mask") else v
                    for k, v in out.items()}

    policy, reference = _policy_and_reference()
    with pytest.raises(CorrnoiseError, match="Interleaved is not trl's preference collator") as err:
        PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                          processing_class=tokenizer, data_collator=Interleaved(pad_token_id=0), privacy=PRIVACY)
    _one_line(err, "data_collator")


@seeded
def test_trl_dpo_evaluates_and_resumes_to_the_same_run(tmp_path):
    """Evaluation is trl's own loss; a run resumed from its step-1 checkpoint ends with the
    uninterrupted run's parameters."""
    from corrnoise.integrations import PrivateDPOTrainer

    train, tokenizer, config = _dpo_parts(tmp_path, save_strategy="steps", save_steps=1, eval_strategy="steps",
                                          eval_steps=1, per_device_eval_batch_size=4)
    privacy = dict(PRIVACY, seed=3)
    runs = []
    for resume in (None, str(tmp_path / "checkpoint-1")):
        policy, reference = _policy_and_reference()
        if resume:  # only the checkpoint's parameters can bring it back to the first run's
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1.0)
        trainer = PrivateDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=train,
                                    eval_dataset=train.select(range(4)), processing_class=tokenizer, privacy=privacy)
        trainer.train(resume_from_checkpoint=resume)
        runs.append(_params(policy))
    assert any("eval_loss" in entry for entry in trainer.state.log_history)
    for name, p in runs[1].items():
        torch.testing.assert_close(p, runs[0][name], **TOL, msg=name)


def test_trl_dpo_with_lora_takes_its_reference_with_the_adapter_off(tmp_path):
    peft = pytest.importorskip("peft")
    train, tokenizer, config = _dpo_parts(tmp_path)
    from corrnoise.integrations import PrivateDPOTrainer

    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8,
                                                         target_modules=["c_attn"], fan_in_fan_out=True))
    trainer = PrivateDPOTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                                privacy=PRIVACY)
    assert trainer.ref_model is None
    trainer.train()
    assert trainer.private_optimizer.steps_taken == 2
    # the first step starts at the reference (LoRA's B is zero): every pair's loss is log 2
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_the_integrations_package_imports_transformers_only_when_asked():
    import subprocess
    import sys

    code = ("import sys, corrnoise, corrnoise.integrations; assert 'transformers' not in sys.modules; "
            "from corrnoise.integrations import PrivateTrainer; assert 'transformers' in sys.modules; "
            "assert 'trl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")])})


def _task_model(task):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=V, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return (transformers.BertForMultipleChoice if task == "choice" else transformers.BertForQuestionAnswering)(cfg)


def _task_data(task, n=N, length=8):
    """Multiple choice: 3 choices of `length` tokens and the right one's index; question answering:
    a span's start and end (one example's end outside the sequence: ignored, as transformers does)."""
    g = torch.Generator().manual_seed(5)
    data = []
    for i in range(n):
        shape = (3, length) if task == "choice" else (length,)
        ids = torch.randint(1, V, shape, generator=g)
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if task == "choice":
            item["labels"] = torch.tensor(i % 3)
        else:
            item["start_positions"] = torch.tensor(i % length)
            item["end_positions"] = torch.tensor(length + 4 if i == 1 else (i + 2) % length)
        data.append(item)
    return data


def test_a_left_padded_multiple_choice_batch_gives_each_example_its_loss_alone(tmp_path):
    """A multiple-choice batch's (B, choices, T) rows padded on the left are right-aligned choice by
    choice: example A's loss (float64) is the same next to an example with short choices and one
    with long choices, and equals A's alone."""
    model = _task_model("choice").double()
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_task_data("choice"), privacy=PRIVACY)
    g = torch.Generator().manual_seed(2)

    def example(lengths):
        return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths], torch.tensor(1)

    def batch(examples):
        width = max(len(c) for choices, _ in examples for c in choices)
        ids = torch.zeros(len(examples), 3, width, dtype=torch.long)
        for i, (choices, _) in enumerate(examples):
            for c, toks in enumerate(choices):
                ids[i, c, width - len(toks):] = torch.tensor(toks)
        return {"input_ids": ids, "attention_mask": (ids != 0).long(),
                "labels": torch.stack([y for _, y in examples])}

    a, short, long_ = example([3, 4, 2]), example([2, 2, 2]), example([9, 7, 8])
    alone = trainer._example_losses(model, batch([a]))[0][0]
    for other in (short, long_):
        torch.testing.assert_close(trainer._example_losses(model, batch([a, other]))[0][0], alone, rtol=1e-12, atol=0)
    moved = _right_aligned_batch(batch([a, long_]))
    assert moved["input_ids"][0, 2].tolist()[:3] == [*a[0][2], 0] and moved["labels"].tolist() == [1, 1]


@pytest.mark.parametrize("task", ["choice", "span"])
def test_multiple_choice_and_question_answering_losses_are_the_models_per_example(tmp_path, task):
    """Their per-example losses, averaged, are the model's own loss (question answering's where no
    position is ignored: its built-in mean leaves ignored positions out of the count), each depends
    on its example alone (float64 against each example alone, through the multiple-choice model's
    batch of B x choices rows), and a run trains."""
    from corrnoise.torch.clipping import ClippingEngine, check_attribution

    model = _task_model(task).double()
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_task_data(task), privacy=PRIVACY)
    data = _task_data(task)
    batch = {k: torch.stack([d[k] for d in data[2:6]]) for k in data[0]}  # no ignored position
    labels = trainer._labels(batch)
    out = model(**batch)
    per = trainer.per_example_losses(model, out, labels)
    assert per.shape == (4,)
    torch.testing.assert_close(per.mean(), out.loss, rtol=1e-12, atol=0)
    engine = ClippingEngine(model, "mean", 1.0)
    report = check_attribution(engine, lambda b: trainer.per_example_losses(model, model(**b), trainer._labels(b)),
                               {k: v for k, v in batch.items()}, examples=4)
    assert report.worst < 1e-6
    assert bool(report.flattened) == (task == "choice")  # (B * choices, L) rows, example-major
    engine.detach()
    model = _task_model(task)
    before = _params(model)
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_task_data(task), privacy=PRIVACY)
    trainer.train()
    # (float32: the multiple-choice classifier's bias has a zero gradient, softmax being shift
    # invariant, so its difference is rounding against the absolute floor: ~0.13 of the tolerance)
    assert trainer.private_optimizer.steps_taken == 2 and trainer.attribution_report.worst < 1.0
    assert bool(trainer.attribution_report.flattened) == (task == "choice")
    assert not torch.equal(_params(model)["classifier.weight" if task == "choice" else "qa_outputs.weight"],
                           before["classifier.weight" if task == "choice" else "qa_outputs.weight"])


def test_an_ignored_answer_position_counts_zero_as_in_transformers():
    from corrnoise.integrations.transformers import _span_losses

    start = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    end = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s, e = torch.tensor([1, 9, 4]), torch.tensor([2, 3, -1])  # 9 -> 5 (ignored); -1 -> 0
    per = _span_losses(start, end, s, e)
    ls = -torch.log_softmax(start, 1)
    le = -torch.log_softmax(end, 1)
    want = torch.stack([(ls[0, 1] + le[0, 2]) / 2, le[1, 3] / 2, (ls[2, 4] + le[2, 0]) / 2])
    torch.testing.assert_close(per, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dropped, missing", [(("start_positions", "end_positions"), "start_positions, end_positions"),
                                              (("end_positions",), "end_positions")])
def test_batches_without_the_models_labels_are_one_line(tmp_path, dropped, missing):
    data = [{k: v for k, v in d.items() if k not in dropped} for d in _task_data("span")]
    trainer = PrivateTrainer(model=_task_model("span"), args=_args(tmp_path), train_dataset=data, privacy=PRIVACY)
    with pytest.raises(CorrnoiseError) as err:
        trainer.train()
    _one_line(err, "train_dataset")
    assert str(err.value).startswith(f"train_dataset: batches lack the labels {missing}:")


def test_a_resumed_run_names_its_mechanism_by_content():
    """The checkpoint's plan is compared with the privacy keywords by the mechanism's fingerprint
    for the plan's steps, not its label: ``dpsgd`` resumes a run planned as ``identity``, a
    Strategy object works as its name does, another mechanism is one line."""
    from corrnoise.integrations.transformers import _check_saved_plan
    from corrnoise.runplan import plan_run
    from corrnoise.strategies import parse_strategy

    saved = plan_run(dataset_size=64, batch_size=8, epochs=1, mechanism="identity", noise_multiplier=1.0, delta=1e-5)
    for same in ("dpsgd", "identity", parse_strategy("dpsgd", saved.steps)):
        _check_saved_plan(saved, {"mechanism": same, "noise_multiplier": 1.0})
    for other in ("bsr:3", "tree", parse_strategy("bsr:3", saved.steps)):
        with pytest.raises(CorrnoiseError) as err:
            _check_saved_plan(saved, {"mechanism": other, "noise_multiplier": 1.0})
        _one_line(err, "mechanism")
        assert str(err.value).startswith("mechanism: the checkpoint's run uses 'identity', not ")
    _check_saved_plan(saved, {"mechanism": "bandmf", "epsilon": 8.0})  # a family for an epsilon: the plan's choice


def test_noise_aware_adamw_is_the_trainers_optimizer_through_optimizers(tmp_path):
    """``optimizers=(NoiseAwareAdamW(...), None)``: the trainer makes it private, and at every step
    it is told the variance of that step's released noise (the last step's at the end)."""
    from corrnoise.torch import NoiseAwareAdamW

    model = _gpt2()
    opt = NoiseAwareAdamW(model.parameters(), lr=1e-3)
    trainer = PrivateTrainer(model=model, args=_args(tmp_path), train_dataset=_Texts("lm"), optimizers=(opt, None),
                             privacy=PRIVACY)
    trainer.train()
    private = trainer.private_optimizer
    assert private.original is opt and private.steps_taken == 2
    assert opt.noise_variance == private.noise_variance(step=1) > 0


def test_trl_dpo_lora_without_a_reference_model_keeps_the_initial_adapter_as_reference(tmp_path):
    """A LoRA policy without ref_model: trl (1.16) keeps a frozen copy of the starting adapter
    (adapter "ref") and computes the reference with it, so the reference is the policy as it
    started and stays there while the private run moves the policy (the README said it moved with
    the policy: a review had compared them at the start, where they are equal). The copy is frozen:
    it gets no noise."""
    peft = pytest.importorskip("peft")
    from corrnoise.integrations import PrivateDPOTrainer

    train, tokenizer, config = _dpo_parts(tmp_path)
    policy = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                          fan_in_fan_out=True, lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():  # an adapter that starts away from the base model (a pretrained one)
        g = torch.Generator().manual_seed(4)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    trainer = PrivateDPOTrainer(model=policy, args=config, train_dataset=train, processing_class=tokenizer,
                                privacy=PRIVACY)
    rows = _first_preference_rows(trainer)

    def logps():
        with torch.no_grad():
            out = policy(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], use_cache=False)
            lp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, rows["input_ids"][:, 1:, None])[..., 0]
            return (lp * rows["completion_mask"][:, 1:]).sum(1)

    start = logps()
    with policy.disable_adapter():
        base = logps()
    ref_before = torch.cat(trainer.compute_ref_log_probs(trainer.model, rows))
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if ".ref." in n}
    assert frozen and not any(p.requires_grad for n, p in policy.named_parameters() if ".ref." in n)
    trainer.train()
    ref_after = torch.cat(trainer.compute_ref_log_probs(trainer.model, rows))
    torch.testing.assert_close(ref_after, ref_before)  # the reference did not move
    # it is the starting policy (up to trl's fused LM head, 4e-3 here) ...
    torch.testing.assert_close(ref_before, start, rtol=0.0, atol=2e-2)
    assert float((ref_before - base).abs().max()) > 0.1  # ... not the base model (0.46 away)
    assert float((logps() - start).abs().max()) > 1e-3  # while the policy moved
    for n, p in policy.named_parameters():
        if ".ref." in n:
            assert torch.equal(p, frozen[n]), n


def _first_preference_rows(trainer) -> dict:
    """The first 4 pairs as trl's collator makes them (the chosen rows, then the rejected): what
    trl's compute_ref_log_probs reads."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    return {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask")}
