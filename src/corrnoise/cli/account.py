"""``corrnoise account`` (docs/cli.md "Command-line contract").

    corrnoise account MECHANISM --n N --batching SPEC  two of (--sigma S | --noise-std NU), --epsilon E,
        --delta D  [--participation ...] [--method auto|gaussian|pld|rdp|bandmf|mmcc|mc]
        [--samples S] [--verify-samples S] [--seed S] [--estimate] [--lower-bound] [--json]

prints ``epsilon, delta, noise_std, noise_multiplier, method`` and the method's extras
(``gdp_mu`` when unamplified; ``delta_add, delta_remove, std_error_*, samples, verified`` for
Monte Carlo) and the result's ``kind`` (guarantee, estimate, lower_bound).  Noise and ``--delta``:
epsilon(delta); ``--epsilon`` and ``--delta``: the noise is calibrated (smallest noise_std reaching
it); noise and ``--epsilon``: delta(epsilon).  Monte Carlo results are verified guarantees unless
``--estimate`` asks for an informal estimate.
"""

from __future__ import annotations

import math

import click

from ..errors import CorrnoiseError
from .progress import command_progress
from .report import emit

METHOD_CHOICES = ["auto", "gaussian", "pld", "rdp", "bandmf", "mmcc", "mc"]


def _jsonable(data: dict) -> dict:
    out = {}
    for key, value in data.items():
        if hasattr(value, "item"):  # numpy scalars
            value = value.item()
        out[key] = value
    return out


@click.command("account")
@click.argument("mechanism")
@click.option("--n", "n", type=int, required=True, help="Number of steps (iterations).")
@click.option("--batching", required=True,
              help="none | poisson:P | block-cyclic:BLOCKS:P | balls-in-bins:BINS")
@click.option("--participation", default=None,
              help="With --batching none: single | cyclic:K:B | minsep:K:B (default single).")
@click.option("--sigma", "sigma", type=float, default=None,
              help="Noise multiplier sigma = noise_std / ||C||_col.")
@click.option("--noise-std", "noise_std", type=float, default=None,
              help="Standard deviation nu of each entry of Z, in clip-norm units.")
@click.option("--epsilon", "epsilon", type=float, default=None,
              help="Target epsilon: calibrate the smallest noise reaching it.")
@click.option("--delta", "delta", type=float, default=None,
              help="Target delta, in (0, 1). Leave out with a noise and --epsilon to report delta(epsilon).")
@click.option("--method", type=click.Choice(METHOD_CHOICES), default="auto", show_default=True,
              help="Accounting method (auto picks by batching and mechanism).")
@click.option("--samples", type=int, default=None, help="Monte Carlo estimation samples (method mc).")
@click.option("--verify-samples", "verify_samples", type=int, default=None,
              help="Monte Carlo verification samples (default: enough for failure probability 1e-3 * delta).")
@click.option("--seed", type=int, default=None,
              help="Monte Carlo seed, for reproducible experiments only (retrying with one seed re-uses its "
                   "verification sample and voids the failure probability). Default: fresh OS entropy, recorded "
                   "in the output.")
@click.option("--verify", is_flag=True, default=False,
              help="Monte Carlo: formally verify with fresh samples (Estimate-Verify-Release; the default).")
@click.option("--estimate", is_flag=True, default=False,
              help="Monte Carlo: report an informal, unverified estimate (kind 'estimate'; cannot size noise).")
@click.option("--lower-bound", "lower_bound", is_flag=True, default=False,
              help="MMCC: report the lower bound (p_tilde = p) that shows how tight MMCC is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def account_command(mechanism: str, n: int, batching: str, participation: str | None, sigma: float | None,
                    noise_std: float | None, epsilon: float | None, delta: float, method: str,
                    samples: int | None, verify_samples: int | None, seed: int | None, verify: bool,
                    estimate: bool, lower_bound: bool, as_json: bool) -> None:
    """(epsilon, delta) of MECHANISM for a noise level, or the noise for a target epsilon."""
    from ..strategies import parse_strategy
    from ..accounting import account, calibrate, parse_batching
    from ..accounting import choose_method

    if n < 1:
        raise CorrnoiseError("n", f"must be >= 1, got {n}")
    noises = [name for name, value in (("--sigma", sigma), ("--noise-std", noise_std)) if value is not None]
    if len(noises) > 1:
        raise CorrnoiseError("noise", f"give at most one of --sigma and --noise-std (got {' and '.join(noises)})")
    given = noises + [name for name, value in (("--epsilon", epsilon), ("--delta", delta)) if value is not None]
    if len(given) != 2:
        raise CorrnoiseError("noise", "give two of a noise (--sigma or --noise-std), --epsilon and --delta"
                             + (f" (got {' and '.join(given)})" if given else ""))
    for name, value in (("samples", samples), ("verify_samples", verify_samples)):
        if value is not None and value < 1:
            raise CorrnoiseError(name, f"must be >= 1, got {value}")
    spec = parse_batching(batching, participation)
    strategy = parse_strategy(mechanism, n)
    options = {"samples": samples, "seed": seed,
               "verify": True if verify else None, "lower_bound": True if lower_bound else None,
               "estimate": True if estimate else None, "verify_samples": verify_samples}
    chosen = choose_method(strategy, spec) if method == "auto" else method
    for flag, name, methods in (("--verify", "verify", ("mc",)), ("--lower-bound", "lower_bound", ("mmcc",)),
                                ("--estimate", "estimate", ("mc",)), ("--verify-samples", "verify_samples", ("mc",))):
        if options[name] and chosen not in methods:  # never drop a requested guarantee silently
            raise CorrnoiseError(name, f"{flag} applies to --method {'/'.join(methods)} only "
                                       f"(this mechanism and batching use {chosen})")
    if lower_bound and epsilon is not None:  # a lower bound on epsilon cannot size the noise
        raise CorrnoiseError("lower_bound", "--lower-bound reports how tight MMCC is for a given noise; "
                                            "calibrating noise to it would give no guarantee (use --sigma/--noise-std)")
    # progress on stderr also where it is not a terminal (a user probe met 108 s of silence in a piped
    # Monte Carlo calibration); --json keeps stderr quiet, as plan's
    with command_progress(as_json) as bar:
        options["progress"] = bar
        if noises and epsilon is not None:  # delta(epsilon) at this noise
            result = account(strategy, spec, epsilon=epsilon, noise_std=noise_std, noise_multiplier=sigma,
                             method=method, **options)
        elif epsilon is not None:
            result = calibrate(strategy, spec, epsilon=epsilon, delta=delta, method=method, **options)
        else:
            result = account(strategy, spec, delta=delta, noise_std=noise_std, noise_multiplier=sigma,
                             method=method, **options)
    if not math.isfinite(result.epsilon):
        raise CorrnoiseError("noise", f"epsilon is infinite at delta={result.delta:g} for noise_std="
                             f"{result.noise_std:g}; increase the noise or delta")
    if verify and result.extras.get("verified") is not True:
        # Estimate-Verify-Release (seed 000 Thm 2.1): nothing is released when verification fails.
        raise CorrnoiseError("verify", f"the Monte Carlo estimate (epsilon={result.epsilon:g}, delta={result.delta:g}) "
                                       "failed verification on fresh samples; increase the noise or --samples")
    data = _jsonable(result.to_dict())
    emit(data, as_json, f"corrnoise account {mechanism}")


