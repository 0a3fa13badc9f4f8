"""``corrnoise audit``: a measured lower bound on the epsilon of a training setup (issue #28)."""

from __future__ import annotations

import click

from ..errors import CorrnoiseError
from ..pipelines import BATCHINGS
from .report import emit

FIRST = ("kind", "epsilon_lower", "epsilon_guarantee", "delta", "confidence", "method", "canaries", "runs", "auc")


@click.command("audit")
@click.option("--dataset", type=click.Choice(["digits", "mnist1d"]), default="digits", show_default=True)
@click.option("--mechanism", default="identity", show_default=True, help="identity, bsr:B, dpcgd:BETA, blt:A:L, ...")
@click.option("--batching", type=click.Choice(list(BATCHINGS[1:])),
              default="cyclic", show_default=True)
@click.option("--epsilon", type=float, required=True, help="The run is calibrated to (epsilon, delta).")
@click.option("--delta", type=float, default=1e-5, show_default=True)
@click.option("--audit-delta", "audit_delta", type=float, default=None,
              help="Compare bound and guarantee at this delta (default: --delta).")
@click.option("--canaries", type=int, default=1, show_default=True,
              help="1: many-run audit (one canary per run); K > 1: one-run audit with K fair-coin canaries.")
@click.option("--runs", type=int, default=None, help="Training runs of the many-run audit (default 400).")
@click.option("--white-box", "white_box", is_flag=True, help="Gradient canaries scored from the released updates.")
@click.option("--score", type=click.Choice(["whitened", "sum", "lda"]), default="whitened", show_default=True)
@click.option("--examples", type=int, default=63, show_default=True, help="Real training examples used.")
@click.option("--batch-size", "batch_size", type=int, default=16, show_default=True)
@click.option("--epochs", type=int, default=2, show_default=True)
@click.option("--confidence", type=float, default=0.95, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="The audit's seed (runs, coins, split).")
@click.option("--plot", default=None, help="Write a PNG of the in/out score distributions and the threshold.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def audit_command(dataset, mechanism, batching, epsilon, delta, audit_delta, canaries, runs, white_box, score,
                  examples, batch_size, epochs, confidence, seed, plot, as_json):
    """Train small runs of the setup with canaries and report a lower bound on its epsilon
    (kind lower_bound, valid at --confidence) beside its guarantee."""
    if not white_box:
        raise CorrnoiseError("white-box", "only white-box (gradient) canaries are implemented so far; pass --white-box")
    if plot is not None and not str(plot).lower().endswith(".png"):
        raise CorrnoiseError("plot", f"must be a .png file, got {plot!r}")
    if canaries < 1:
        raise CorrnoiseError("canaries", f"must be >= 1, got {canaries}")
    if canaries > 1 and runs not in (None, 1):
        raise CorrnoiseError("runs", "the one-run audit (--canaries K > 1) uses one run; give --runs 1 or leave it out")
    from ..torch.audit import AuditSetup, audit_many_runs, audit_one_run

    make = AuditSetup.digits if dataset == "digits" else AuditSetup.mnist1d
    setup = make(examples=examples, mechanism=mechanism, batching=batching, epsilon=epsilon, delta=delta,
                 canaries=canaries, batch_size=batch_size, epochs=epochs)
    if canaries == 1:
        result = audit_many_runs(setup, 400 if runs is None else runs, score=score, delta=audit_delta,
                                 confidence=confidence, seed=seed)
    else:
        result = audit_one_run(setup, score=score, delta=audit_delta, confidence=confidence, seed=seed)
    data = result.to_dict()
    data = {**{k: data[k] for k in FIRST if k in data}, **data}
    if plot is not None:
        plot_scores(result, plot)
        data["plot"] = str(plot)
    emit(data, as_json, f"corrnoise audit {mechanism} ({batching})")


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
