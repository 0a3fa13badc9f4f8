"""Seconds per DP-SGD step: plain SGD, Opacus (hooks, ghost), corrnoise vmap, corrnoise ClippingEngine.

    PYTHONPATH=src python benchmarks/bench_step.py [--reps 20] [--no-rss] [--models mlp,cnn,mlp10m]
    PYTHONPATH=src benchmarks/.venv-opake/bin/python benchmarks/bench_step.py --models mlp \
        --methods plain,opacus_ghost,front_blt4,opake_blt4,...   # the opake peer (issue #10)

All timings in one process (same load), torch.set_num_threads(2) (``--threads``), float32; median of ``reps``
steps after warmup, reported with ratios to the plain step and to Opacus ghost clipping, plus
``uptime`` load. Peak RSS: a fresh subprocess per case (``--case MODEL:METHOD``) runs a few
steps and reports ru_maxrss. Noise: every private step adds i.i.d. torch.randn noise of the
sum's size (the correlated-noise generator is not part of this comparison).

Also measures book-keeping vs a second backward: the engine's ``clipped_sum`` (norms + the
book-keeping product) against one forward+backward of the model (what a reweighted second
backward would cost on top of the norms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
SIGMA, CLIP = 1.0, 1.0
METHODS = ["plain", "opacus_hooks", "opacus_ghost", "corrnoise_vmap", "engine"]
#: the real private step of the front door (make_private: engine + the mechanism's noise generator)
FRONT = {"dpsgd": "identity", "bsr4": "bsr:4", "blt4": "blt:0.25,0.15,0.08,0.04:0.995,0.95,0.8,0.4",
         "dpcgd": "dpcgd:0.9", "tree": "tree:plain", "bisr8": "bisr:8"}
METHODS += [f"front_{k}" for k in FRONT]
#: opake 0.16.x (the peer, issue #10): its functional private step, each mechanism built with its
#: public strategy factories (opake.dpftrl.noise) and i.i.d. Gaussian DP-SGD (opake.dpsgd.noise);
#: the ``_compiled`` variants wrap opake's clipped-gradient function in torch.compile (user side:
#: opake has no compile switch of its own in its public API). Only run when opake is importable.
OPAKE = ["opake_dpsgd", "opake_bsr4", "opake_blt4", "opake_cgd", "opake_dpsgd_compiled", "opake_blt4_compiled"]
METHODS += OPAKE
#: the horizon and participation of the front door's cyclic batching above (4 batches an epoch)
OPAKE_STEPS, OPAKE_MIN_SEP = 20000, 4


def opake_available() -> bool:
    try:
        import opake.dpftrl.noise  # noqa: F401
        import opake.dpsgd.noise  # noqa: F401
    except ImportError:
        return False
    return True


def make_opake_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, method: str, lr: float = 0.01):
    """opake's functional DP step on the same model, batch, sigma and clip: per-example gradients
    by torch.func (vmap of grad) in ``clipped_grad``, clipped and summed, divided by the batch
    size; its noise function adds sigma * clip / b times the mechanism's noise (a fresh
    torch.randn draw from a per-step generator, streamed through C^-1 for BLT/BSR, regenerated
    for step t and t-1 for lambda-CGD); then the SGD update in place."""
    from torch.func import functional_call

    from opake.dpftrl.clipping import clipped_grad
    from opake.dpftrl.noise import blt_strategy, bsr_strategy, lambda_cgd_strategy, mf_gaussian_noise
    from opake.dpsgd.noise import gaussian_noise
    from opake.random import key

    b = x.shape[0]
    ce = SequenceCrossEntropy() if model_name.startswith("gpt") else nn.CrossEntropyLoss()
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = list(params)

    def loss_fn(p, xi, yi):  # one example (opake vmaps over the batch arguments)
        return ce(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grad_fn, clip_state = clipped_grad(loss_fn, clipping_norm=CLIP, batch_argnums=(1, 2), normalize_by=b)
    mech = method.removeprefix("opake_").removesuffix("_compiled")
    if mech == "dpsgd":
        noise_fn, noise_state = gaussian_noise(noise_multiplier=SIGMA, key=key(0))
    else:
        strategy = {"bsr4": lambda: bsr_strategy(bandwidth=4, alpha=1.0, beta=0.0),
                    "blt4": lambda: blt_strategy(max_buffers=4),  # L-BFGS-optimized, prefix-sum workload
                    "cgd": lambda: lambda_cgd_strategy(lambda_=0.9)}[mech]()
        noise_fn, noise_state = mf_gaussian_noise(
            params, strategy, n_steps=OPAKE_STEPS, min_sep=OPAKE_MIN_SEP,
            max_participations=OPAKE_STEPS // OPAKE_MIN_SEP, noise_multiplier=SIGMA, key=key(0))
    if method.endswith("_compiled"):
        grad_fn = torch.compile(grad_fn)
    plist = [params[k] for k in names]
    state = {"clip": clip_state, "noise": noise_state}

    def step():
        clipped, state["clip"] = grad_fn(params, x, y, state=state["clip"])
        noised, state["noise"] = noise_fn(clipped, state["noise"])
        torch._foreach_add_(plist, [noised.pytree[k] for k in names], alpha=-lr)
    return step, model


class _Block(nn.Module):
    """A pre-LN transformer block built from Linear/LayerNorm (no fused attention module)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


class GPTLike(nn.Module):
    """Token + position embeddings, 4 blocks of d = 256, sequence 128, LM head (tied or not)."""

    def __init__(self, vocab: int = 4096, d: int = 256, blocks: int = 4, heads: int = 4, seq: int = 128,
                 tied: bool = False):
        super().__init__()
        self.seq = seq
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(blocks)])
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0], 1)  # per-example position ids
        h = self.tok(x) + self.pos(positions)
        return self.head(self.lnf(self.blocks(h)))


class SequenceCrossEntropy(nn.Module):
    """Next-token cross entropy averaged over each sequence: one loss per example (what Opacus's
    ghost criterion needs with ``reduction = "none"``), reduced over the batch by ``reduction``."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, y):
        per_token = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        per_example = per_token.reshape(y.shape).mean(dim=1)
        if self.reduction == "none":
            return per_example
        return per_example.sum() if self.reduction == "sum" else per_example.mean()


def make_model(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """(model, input shape per example, batch size)."""
    if name in ("gpt", "gpt_tied"):
        return GPTLike(tied=name == "gpt_tied"), (128,), 16
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), (784,), 256
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10)), (1, 28, 28), 256
    if name == "mlp10m":
        return nn.Sequential(nn.Linear(784, 3000), nn.ReLU(), nn.Linear(3000, 2500), nn.ReLU(), nn.Linear(2500, 10)), (784,), 64
    raise SystemExit(f"unknown model {name}")


def make_step(model_name: str, method: str):
    torch.manual_seed(0)
    model, shape, b = make_model(model_name)
    if model_name.startswith("gpt"):  # token ids in, next-token targets (one per position) out
        x = torch.randint(0, 4096, (b, *shape))
        y = torch.randint(0, 4096, (b, *shape))
    else:
        x = torch.randn(b, *shape)
        y = torch.randint(0, 10, (b,))
    ce = SequenceCrossEntropy() if model_name.startswith("gpt") else nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    if method == "plain":
        def step():
            opt.zero_grad(set_to_none=True)
            step.loss = ce(model(x), y)
            step.loss.backward()
            opt.step()
        return step, model

    if method.startswith("opake_"):
        return make_opake_step(model, x, y, method)

    if method.startswith("opacus"):
        from opacus import PrivacyEngine
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(len(x))), batch_size=b)
        pe = PrivacyEngine()
        if method == "opacus_ghost":
            m, o, crit, _ = pe.make_private(module=model, optimizer=opt, data_loader=dl, criterion=ce,
                                            noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False,
                                            grad_sample_mode="ghost")
        else:
            m, o, _ = pe.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=SIGMA,
                                      max_grad_norm=CLIP, poisson_sampling=False, grad_sample_mode="hooks")
            crit = ce

        def step():
            o.zero_grad(set_to_none=True)
            step.loss = crit(m(x), y)
            step.loss.backward()
            o.step()
        return step, m

    params = [p for p in model.parameters() if p.requires_grad]

    def release(sums):
        for p, s in zip(params, sums):
            p.grad = ((s + SIGMA * CLIP * torch.randn_like(s)) / b).to(p.dtype)
        opt.step()

    if method == "corrnoise_vmap":
        from corrnoise.torch.per_example import clipped_gradient_sum

        def step():
            sums, _ = clipped_gradient_sum(model, ce, x, y, CLIP)
            release(sums)
        return step, model

    if method.startswith("front_"):
        from corrnoise.torch import make_private

        xs = x.repeat(4, *[1] * (x.dim() - 1))  # the loader only sizes the sampler; batches are x, y
        data = torch.utils.data.TensorDataset(xs, torch.zeros(xs.shape[0]))
        dl = torch.utils.data.DataLoader(data, batch_size=b)
        model, dp_opt, _ = make_private(model, opt, dl, mechanism=FRONT[method[len("front_"):]],
                                        noise_multiplier=SIGMA, delta=1e-5, steps=20000, max_grad_norm=CLIP,
                                        batching="cyclic", noise_seed=0)

        def step():
            # the batch the private loader would yield for this step (fetching excluded, as for the others)
            dp_opt.context.current_step, dp_opt.context.size = dp_opt.steps_taken, b
            step.loss = ce(model(x), y)
            step.loss.backward()
            dp_opt.step()
            dp_opt.zero_grad(set_to_none=True)
        return step, model

    if method == "engine":
        from corrnoise.torch.clipping import ClippingEngine
        engine = ClippingEngine(model, loss_reduction="mean", max_grad_norm=CLIP)

        def step():
            opt.zero_grad(set_to_none=True)
            step.loss = ce(model(x), y)
            step.loss.backward()
            sums, _ = engine.clipped_sum(b)
            engine.clear()
            release(sums)
        step.engine = engine
        step.data = (x, y, ce)
        return step, model
    raise SystemExit(f"unknown method {method}")


def time_it(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_interleaved(steps: dict, reps: int | dict, warmup: int = 1, rounds: int = 4) -> dict:
    """Median seconds per step of each method, in ``rounds`` round-robin blocks (warmup, then
    ceil(reps / rounds) timed steps per method per block): load from other processes on the
    shared machine hits every method alike, while a block's warmup keeps one method's large
    allocations (Opacus hooks, vmap) from being paid by the next method's timed steps.
    ``reps`` may be a dict (method -> reps) to time very slow methods with fewer steps."""
    reps_of = reps if isinstance(reps, dict) else dict.fromkeys(steps, reps)
    ts: dict = {m: [] for m in steps}
    for fn in steps.values():
        fn()  # first call: allocations, the engine's one-time verification
    for _ in range(rounds):
        for m, fn in steps.items():
            for _ in range(warmup):
                fn()
            for _ in range(-(-reps_of[m] // rounds)):
                t0 = time.perf_counter()
                fn()
                ts[m].append(time.perf_counter() - t0)
    return {m: (statistics.median(v), min(v)) for m, v in ts.items()}


def bookkeeping_vs_backward(reps: int) -> dict:
    """clipped_sum (norms + book-keeping) vs one extra forward+backward, MLP at batch 256."""
    step, model = make_step("mlp", "engine")
    engine, (x, y, ce) = step.engine, step.data
    fwd_bwd = lambda: ce(model(x), y).backward()  # noqa: E731
    _, plain = make_step("mlp", "plain")  # same weights (seed 0), no hooks

    def fb():
        plain.zero_grad(set_to_none=True)
        ce(plain(x), y).backward()

    def cs():
        model.zero_grad(set_to_none=True)
        engine.clear()
        fwd_bwd()
        t0 = time.perf_counter()
        engine.clipped_sum(x.shape[0])
        return time.perf_counter() - t0

    cs()
    t_fb, t_cs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fb()
        t_fb.append(time.perf_counter() - t0)
        t_cs.append(cs())
    engine.clear()
    return {"fwd_bwd_s": statistics.median(t_fb), "clipped_sum_s": statistics.median(t_cs)}


def run_case(case: str, steps: int = 3) -> None:
    model_name, method = case.split(":")
    torch.set_num_threads(2)
    step, _ = make_step(model_name, method)
    for _ in range(steps):
        step()
    # VmHWM (this process's peak resident set) rather than ru_maxrss, which Linux carries
    # across exec from the forked parent
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"maxrss_mb": hwm / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--models", default="mlp,cnn,mlp10m")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--opake-reps", type=int, default=None,
                    help="timed steps for the opake methods (default --reps; its eager step takes seconds)")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (1 avoids OpenMP stragglers when another process holds the cores)")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return run_case(args.case)
    torch.set_num_threads(args.threads)
    print("uptime:", os.popen("uptime").read().strip(), f"| torch threads: {args.threads}")
    rows = []
    for mname in args.models.split(","):
        methods = args.methods.split(",")
        if not opake_available() and any(m.startswith("opake_") for m in methods):
            print("  opake not importable here: skipping", ", ".join(m for m in methods if m.startswith("opake_")),
                  "(install it in benchmarks/.venv-opake, see RESULTS.md)")
            methods = [m for m in methods if not m.startswith("opake_")]
        steps = {m: make_step(mname, m)[0] for m in methods}
        reps = {m: args.opake_reps if m.startswith("opake_") and args.opake_reps else args.reps for m in methods}
        times = time_interleaved(steps, reps, rounds=args.rounds)
        for method in methods:
            t, tmin = times[method]
            # the training loss of its last step (fixed batch): absent where the method computes none
            # outside torch.func (corrnoise_vmap, opake)
            last = getattr(steps[method], "loss", None)
            rows.append({"model": mname, "method": method, "s_per_step": t, "s_min": tmin,
                         "loss": float("nan") if last is None else float(last.detach())})
            print(f"  {mname:7s} {method:20s} {t * 1e3:9.2f} ms (min {tmin * 1e3:.2f}, "
                  f"{-(-reps[method] // args.rounds) * args.rounds} timed steps)", flush=True)
        del steps
    if not args.no_rss:
        env = dict(os.environ)
        for r in rows:
            out = subprocess.run([sys.executable, __file__, "--case", f"{r['model']}:{r['method']}"],
                                 capture_output=True, text=True, env=env)
            try:
                r["rss_mb"] = json.loads(out.stdout.strip().splitlines()[-1])["maxrss_mb"]
            except (IndexError, ValueError):
                r["rss_mb"] = float("nan")
    print("uptime:", os.popen("uptime").read().strip())
    print()
    print("| model | method | ms/step (median) | x plain | x opacus ghost | min ms | min x plain | min x ghost "
          "| peak RSS MB | RSS x ghost | last loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = {q["method"]: q for q in rows if q["model"] == r["model"]}
        plain = base.get("plain", {}).get("s_per_step", float("nan"))
        ghost = base.get("opacus_ghost", {})
        rss = r.get("rss_mb", float("nan"))
        print(f"| {r['model']} | {r['method']} | {r['s_per_step'] * 1e3:.1f} | {r['s_per_step'] / plain:.2f} | "
              f"{r['s_per_step'] / ghost.get('s_per_step', float('nan')):.2f} | {r['s_min'] * 1e3:.1f} | "
              f"{r['s_min'] / base.get('plain', {}).get('s_min', float('nan')):.2f} | {r['s_min'] / ghost.get('s_min', float('nan')):.2f} | "
              f"{rss:.0f} | "
              f"{rss / ghost.get('rss_mb', float('nan')):.2f} | {r['loss']:.3f} |")
    if "mlp" in args.models.split(","):
        bk = bookkeeping_vs_backward(args.reps)
        print(f"\nBOOKKEEPING_VS_BACKWARD (mlp, batch 256): clipped_sum {bk['clipped_sum_s'] * 1e3:.2f} ms "
              f"(norms + book-keeping) vs forward+backward {bk['fwd_bwd_s'] * 1e3:.2f} ms "
              f"(a second backward's extra cost)")


if __name__ == "__main__":
    main()
