"""``corrnoise audit``: a measured lower bound on the epsilon of a training setup (issue #28)."""

from __future__ import annotations

import click

from ..errors import CorrnoiseError, check_int, check_real
from ..pipelines import BATCHINGS
from .report import emit

FIRST = ("kind", "epsilon_lower", "epsilon_guarantee", "delta", "confidence", "method", "canaries", "runs", "auc")


@click.command("audit")
@click.option("--dataset", type=click.Choice(["digits", "mnist1d"]), default="digits", show_default=True)
@click.option("--mechanism", default="identity", show_default=True, help="identity, bsr:B, dpcgd:BETA, blt:A:L, ...")
@click.option("--batching", type=click.Choice(list(BATCHINGS[1:])), default=None,
              help="Many-run: how the small runs batch (default cyclic). One-run: the real run's pipeline "
                   "(poisson, cyclic, balls-in-bins; default poisson).")
@click.option("--epsilon", type=float, default=None, help="The run is calibrated to (epsilon, delta); or give --plan.")
@click.option("--delta", type=float, default=None, help="The run's delta (default 1e-5, or the plan's).")
@click.option("--plan", "plan_file", default=None,
              help="Audit the run a `corrnoise plan --plan-out FILE` planned (its mechanism, batching, noise, size) "
                   "instead of --mechanism/--batching/--epsilon; one-run only.")
@click.option("--audit-delta", "audit_delta", type=float, default=None,
              help="Compare bound and guarantee at this delta (default: --delta).")
@click.option("--canaries", type=int, default=1, show_default=True,
              help="1: many-run audit of small runs (--per-run canaries a run, default 64); K > 1: one-run audit of "
                   "the dataset's real training run (default model and hyperparameters) with K fair-coin canaries.")
@click.option("--runs", type=int, default=None, help="Training runs of the many-run audit (default 400).")
@click.option("--per-run", "per_run", type=int, default=64, show_default=True,
              help="Many-run: canaries in each small run, each its own trial (dead coordinates, independent "
                   "noise; all at a worst-case position); 1 = one canary a run.")
@click.option("--white-box", "white_box", is_flag=True,
              help="Gradient canaries scored from the released updates (the default).")
@click.option("--black-box", "black_box", is_flag=True,
              help="Input canaries (random inputs, random labels) scored by their loss under the final model "
                   "(one-run only).")
@click.option("--score", type=click.Choice(["whitened", "sum", "lda", "loss", "margin"]), default=None,
              help="White-box: whitened (default), sum, lda (many-run); black-box: loss (default) or margin.")
@click.option("--examples", type=int, default=None,
              help="Real training examples used (many-run default 4 x batch - per-run; one-run default: the whole "
                   "training set).")
@click.option("--batch-size", "batch_size", type=int, default=None,
              help="Default max(16, per-run) (many-run) or the dataset's.")
@click.option("--epochs", type=float, default=None, help="Default 2 (many-run) or the dataset's.")
@click.option("--confidence", type=float, default=0.95, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The audit's seed (runs, coins, split).")
@click.option("--plot", default=None, help="Write a PNG of the in/out score distributions and the threshold.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def audit_command(dataset, mechanism, batching, epsilon, delta, plan_file, audit_delta, canaries, runs, per_run,
                  white_box, black_box, score, examples, batch_size, epochs, confidence, seed, plot, as_json):
    """Train runs of the setup with canaries and report a lower bound on its epsilon (kind
    lower_bound, valid at --confidence) beside its guarantee."""
    if white_box and black_box:
        raise CorrnoiseError("white-box", "pass --white-box (gradient canaries) or --black-box (input canaries scored "
                             "by loss), not both")
    white_box = not black_box  # the default: the many-run audit's only kind, the one-run audit's tighter one
    _check_numbers(epsilon, delta, audit_delta, runs, confidence)
    if plot is not None and not str(plot).lower().endswith(".png"):
        raise CorrnoiseError("plot", f"must be a .png file, got {plot!r}")
    if canaries < 1:
        raise CorrnoiseError("canaries", f"must be >= 1, got {canaries}")
    if canaries > 1 and runs not in (None, 1):
        raise CorrnoiseError("runs", "the one-run audit (--canaries K > 1) uses one run; give --runs 1 or leave it out")
    _check_score(score, white_box, canaries)
    if canaries == 1:
        if black_box:
            raise CorrnoiseError("black-box", "the black-box audit is one-run: give --canaries K > 1 (e.g. 1000)")
        if plan_file is not None:
            raise CorrnoiseError("plan", "a plan fixes the real run's size: audit it one-run (--canaries K > 1)")
        result, title = _many_run(dataset, mechanism, batching, epsilon, delta, audit_delta, runs, per_run, score,
                                  examples, batch_size, epochs, confidence, seed)
        data = result.to_dict()
    else:
        result, facts, title = _one_run(dataset, mechanism, batching, epsilon, delta, plan_file, audit_delta,
                                        canaries, black_box, score, examples, batch_size, epochs, confidence, seed)
        data = {**result.to_dict(), "run": facts}
    data = {**{k: data[k] for k in FIRST if k in data}, **data}
    if plot is not None:
        plot_scores(result, plot)
        data["plot"] = str(plot)
    emit(data, as_json, title)


def _check_numbers(epsilon, delta, audit_delta, runs, confidence) -> None:
    """Each number option in one line naming its flag, before the kind of audit is looked at (a user
    probe: --epsilon -2, --runs 0 or --confidence 1.5 were answered with the --white-box error)."""
    if epsilon is not None:
        check_real("epsilon", epsilon, low=0.0, low_open=True)
    for name, value in (("delta", delta), ("audit-delta", audit_delta), ("confidence", confidence)):
        if value is not None:
            check_real(name, value, low=0.0, high=1.0, low_open=True, high_open=True)
    if runs is not None:
        check_int("runs", runs, minimum=1)


def _check_score(score, white_box, canaries) -> None:
    allowed = (("whitened", "sum", "lda") if canaries == 1 else ("whitened",)) if white_box else ("loss", "margin")
    if score is not None and score not in allowed:
        raise CorrnoiseError("score", f"this audit scores by {', '.join(allowed)}, got {score!r}")


def _many_run(dataset, mechanism, batching, epsilon, delta, audit_delta, runs, per_run, score, examples, batch_size,
              epochs, confidence, seed):
    """The many-run white-box audit of small runs (:func:`corrnoise.torch.audit.audit_many_runs`):
    ``per_run`` canaries a run; by default batch max(16, per_run) and four batches an epoch."""
    from ..torch.audit import AuditSetup, audit_many_runs

    if epsilon is None:
        raise CorrnoiseError("epsilon", "give the epsilon the runs are calibrated to (or --plan with --canaries K > 1)")
    if per_run < 1:
        raise CorrnoiseError("per-run", f"must be >= 1, got {per_run}")
    batching = batching or "cyclic"
    batch_size = max(16, per_run) if batch_size is None else batch_size
    examples = 4 * batch_size - per_run if examples is None else examples
    if examples < 1:
        raise CorrnoiseError("examples", f"leaves no real example beside {per_run} canaries a run")
    make = AuditSetup.digits if dataset == "digits" else AuditSetup.mnist1d
    setup = make(examples=examples, mechanism=mechanism, batching=batching,
                 epsilon=epsilon, delta=1e-5 if delta is None else delta, canaries=per_run,
                 batch_size=batch_size, epochs=2 if epochs is None else int(epochs))
    result = audit_many_runs(setup, 400 if runs is None else runs, score=score or "whitened", delta=audit_delta,
                             confidence=confidence, seed=seed, select_fraction=0.3)  # as benchmarks/bench_audit.py
    return result, f"corrnoise audit {mechanism} ({batching})"


def _one_run(dataset, mechanism, batching, epsilon, delta, plan_file, audit_delta, canaries, black_box, score,
             examples, batch_size, epochs, confidence, seed):
    """The one-run audit of the dataset's real run (:func:`corrnoise.torch.audit.audit_training_run`),
    planned from the options or read from ``plan_file``."""
    from ..runplan import RunPlan
    from ..torch.audit import audit_training_run

    plan = None
    if plan_file is not None:
        given = [name for name, value in (("epsilon", epsilon), ("batching", batching), ("batch-size", batch_size),
                                          ("epochs", epochs)) if value is not None]
        if given or mechanism != "identity":
            raise CorrnoiseError("plan", f"the plan decides mechanism, batching, noise and size; drop "
                                 f"--{', --'.join(given or ['mechanism'])}")
        plan = RunPlan.from_json(plan_file)
        if delta is not None and delta != plan.delta:  # review: it was taken silently
            raise CorrnoiseError("delta", f"the plan is for delta {plan.delta:g}, not {delta:g}: drop --delta")
        delta = plan.delta
    elif epsilon is None:
        raise CorrnoiseError("epsilon", "give the epsilon the run is calibrated to, or --plan FILE")
    out = audit_training_run(dataset, mechanism=mechanism, batching=batching or "poisson", epsilon=epsilon,
                             delta=1e-5 if delta is None else delta, plan=plan, canaries=canaries,
                             black_box=black_box, white_box=not black_box, examples=examples,
                             epochs=epochs, batch_size=batch_size if plan is None else plan.batch_size,
                             confidence=confidence, seed=seed, black_box_score=score or "loss",
                             audit_delta=audit_delta)
    result = out["black_box" if black_box else "white_box"]
    return result, out["run"], f"corrnoise audit {out['run']['mechanism']} ({out['run']['batching']}), one run"


def plot_scores(result, path: str) -> None:
    """Histograms of the in / out scores with the chosen threshold (many-run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s_in, s_out = result.scores
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(s_out, bins=40, alpha=0.6, label="canary out")
    ax.hist(s_in, bins=40, alpha=0.6, label="canary in")
    if "threshold" in result.extras:
        ax.axvline(result.extras["threshold"], color="k", ls="--", label="threshold")
    ax.set_xlabel("score")
    ax.set_title(f"{result.method}\nlower bound {result.epsilon:.3g} (guarantee "
                 f"{result.extras.get('epsilon_guarantee', float('nan')):.3g}) at delta {result.delta:g}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
